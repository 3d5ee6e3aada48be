"""Depthwise convolution with dilation and a channel multiplier (issue 14).

``DWConv2d(C, k, stride, padding, dilation=d, out_channels=C*m)`` is PyTorch's
``Conv2d(C, C*m, k, stride, padding, dilation=d, groups=C)``: weight [C*m, kh, kw], bias [C*m],
output channel o reads input channel o // m, output size (H + 2p - d (kh-1) - 1) // s + 1.

On every present device: forward, dx, dW and db against the float64 reference
(utensil_ffi.reference.dwconv2d, itself checked against finite differences and PyTorch in
tests/test_reference.py) over a sample of dilation 1..3 x multiplier 1..3 x kernels
1x1, 3x3, 5x5, 3x5, 7x7 x stride 1..3 x padding 0..3 that covers every pair of those values,
plus named edge cases. Finite-difference gradient checks of the same geometries are in
tests/test_gradcheck.py. Then: PyTorch parity in float32 and its state_dict both ways, bad
arguments, non-finite values (sums over the real (output, tap, input) pairs only), copies, and
a few SGD steps of a small network against its PyTorch twin.

Each test loops over its cases and reports every failing one by name (_each) rather than being
parametrized per case: the suite's per-test leak check (conftest.py) costs more than a case.
"""

import copy
import itertools
import pickle

import numpy as np
import pytest

import utensil_ffi as ut
from tolerances import assert_close
from utensil_ffi import reference as R

f32 = np.float32

DILATIONS = (1, 2, 3)
MULTIPLIERS = (1, 2, 3)
KERNELS = ((1, 1), (3, 3), (5, 5), (3, 5), (7, 7))
STRIDES = (1, 2, 3)
PADDINGS = (0, 1, 2, 3)


def _window(k, d):
    """The rows (or columns) a dilated kernel spans."""
    return d * (k - 1) + 1


def _out(size, k, s, p, d):
    """The spec's output size, written out independently of the reference."""
    return (size + 2 * p - d * (k - 1) - 1) // s + 1


def _sample():
    """One geometry per (dilation, multiplier, kernel), the (stride, padding) of each chosen
    greedily so that every pair of values of any two of the five factors occurs at least once
    (test_sample_covers_every_pair), ties going to the (stride, padding) used least so far.
    N, C, H, W small and random (fixed seed); H and W from the smallest that fits the dilated
    window to four more."""
    rng = np.random.default_rng(14)
    seen = set()
    used = dict.fromkeys(itertools.product(STRIDES, PADDINGS), 0)
    geoms = []
    for d, m, k in itertools.product(DILATIONS, MULTIPLIERS, KERNELS):
        s, p = max(used, key=lambda sp: (len(_pairs(d, m, k, *sp) - seen), -used[sp]))
        seen |= _pairs(d, m, k, s, p)
        used[s, p] += 1
        n, c = int(rng.integers(1, 3)), int(rng.integers(1, 4))
        h = max(1, _window(k[0], d) - 2 * p + int(rng.integers(0, 5)))
        w = max(1, _window(k[1], d) - 2 * p + int(rng.integers(0, 5)))
        geoms.append((n, c, m, h, w, k, s, p, d, len(geoms) % 4 != 3))
    return geoms


def _pairs(d, m, k, s, p):
    vals = (("d", d), ("m", m), ("k", k), ("s", s), ("p", p))
    return set(itertools.combinations(vals, 2))


# (N, C, multiplier, H, W, (kh, kw), stride, pad, dilation, bias)
GEOMS = _sample()
EDGE = {
    # the dilated window is the whole padded input: one output pixel
    "window-is-padded-input": (2, 2, 3, 3, 3, (3, 3), 1, 2, 3, True),
    "window-is-input": (1, 3, 2, 5, 5, (3, 3), 2, 0, 2, True),
    # one output row, several columns: kh != kw and a wide input
    "one-row": (2, 2, 2, 7, 12, (3, 3), 1, 0, 3, True),
    "kh!=kw-1x1-out": (2, 1, 3, 5, 9, (3, 5), 1, 0, 2, False),
    "kh!=kw-5x3": (1, 2, 2, 8, 6, (5, 3), 2, 1, 2, True),
    # "same" output size with dilation (p = d (k-1) / 2)
    "same-d2": (2, 3, 2, 6, 7, (3, 3), 1, 2, 2, True),
    "same-7x7-d1": (2, 2, 2, 5, 6, (7, 7), 1, 3, 1, True),
    # a stride larger than the window: inputs no tap reads
    "stride>window": (2, 2, 2, 10, 9, (1, 1), 3, 1, 3, True),
    # stride larger than the padded input minus the window: the stride is never applied
    "stride-not-applied": (1, 2, 3, 6, 6, (3, 3), 3, 0, 2, True),
    # one input channel fanned out to many, many channels each once
    "C1-m5": (2, 1, 5, 6, 6, (3, 3), 1, 1, 2, True),
    "C6-m1-d3": (1, 6, 1, 9, 8, (3, 3), 2, 3, 3, False),
    # the padding is most of the padded input
    "pad>input": (2, 2, 2, 1, 2, (3, 3), 1, 3, 3, True),
}


def _gid(g):
    n, c, m, h, w, (kh, kw), s, p, d, bias = g
    return "d%d_m%d_k%dx%d_s%d_p%d_N%d_C%d_%dx%d%s" % (d, m, kh, kw, s, p, n, c, h, w,
                                                      "" if bias else "_nob")


def _randn(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(f32)


def _layer(g, device):
    n, c, m, h, w, k, s, p, d, bias = g
    return ut.DWConv2d(c, k, stride=s, padding=p, bias=bias, device=device, dilation=d,
                       out_channels=c * m)


def _inputs(g, seed):
    n, c, m, h, w, (kh, kw), s, p, d, bias = g
    rng = np.random.default_rng(seed)
    x = _randn(rng, n, c, h, w)
    wt = _randn(rng, c * m, kh, kw, scale=0.5)
    b = _randn(rng, c * m) if bias else None
    go = _randn(rng, n, c * m, _out(h, kh, s, p, d), _out(w, kw, s, p, d))
    return x, wt, b, go


def _f64(a):
    return None if a is None else a.astype(np.float64)


def _each(cases, check):
    """check(case) for every (name, case); fails once, naming every case that failed and why."""
    failed = []
    for name, case in cases:
        try:
            check(case)
        except (AssertionError, ut.UtensilError) as e:
            lines = str(e).strip().splitlines()
            failed.append("%s: %s: %s" % (name, type(e).__name__, "\n".join(lines[:12])))
    assert not failed, "%d of %d cases failed:\n%s" % (len(failed), len(cases), "\n".join(failed))


def test_sample_covers_every_pair():
    """The sampled geometries: each (dilation, multiplier, kernel) once, every pair of values of
    two factors at least once, every geometry valid and its output at least 1x1; the edge
    cases are what their names say."""
    assert len(GEOMS) == len(DILATIONS) * len(MULTIPLIERS) * len(KERNELS)
    seen = set()
    for n, c, m, h, w, k, s, p, d, _ in GEOMS:
        seen |= _pairs(d, m, k, s, p)
        assert _out(h, k[0], s, p, d) >= 1 and _out(w, k[1], s, p, d) >= 1
    want = set()
    for d, m, k, s, p in itertools.product(DILATIONS, MULTIPLIERS, KERNELS, STRIDES, PADDINGS):
        want |= _pairs(d, m, k, s, p)
    assert want - seen == set()
    outs = {name: (_out(h, k[0], s, p, d), _out(w, k[1], s, p, d), h + 2 * p == _window(k[0], d))
            for name, (n, c, m, h, w, k, s, p, d, _) in EDGE.items()}
    assert all(ho >= 1 and wo >= 1 for ho, wo, _ in outs.values()), outs
    assert outs["window-is-padded-input"] == (1, 1, True)
    assert outs["one-row"][:2] == (1, 6) and outs["kh!=kw-1x1-out"][:2] == (1, 1)


def _check(op, layer, g, device, seed):
    """Forward, and backward twice (parameter gradients accumulate), against the reference."""
    n, c, m, h, w, (kh, kw), s, p, d, bias = g
    x, wt, b, go = _inputs(g, seed)
    assert layer.weight.shape == (c * m, kh, kw)
    assert (layer.bias is None) == (not bias)
    layer.weight = wt
    if bias:
        assert layer.bias.shape == (c * m,)
        layer.bias = b
    y = layer(ut.tensor(x, device))
    assert y.shape == go.shape  # the spec's size: (H + 2p - d (kh-1) - 1) // s + 1
    ref = R.dwconv2d(_f64(x), _f64(wt), _f64(b), s, p, d)
    assert_close(op + " forward", y.numpy(), ref)
    rdx, rdw, rdb = R.dwconv2d_backward(_f64(x), _f64(wt), s, p, _f64(go), d)
    dx = layer.backward(ut.tensor(go, device))
    assert_close(op + " backward dx", dx.numpy(), rdx)
    assert_close(op + " backward dW", layer.weight.grad.numpy(), rdw)
    if bias:
        assert_close(op + " backward db", layer.bias.grad.numpy(), rdb)
    layer.backward(ut.tensor(go, device)).close()  # += into the gradients
    assert_close(op + " backward dW", layer.weight.grad.numpy(), 2 * rdw)
    if bias:
        assert_close(op + " backward db", layer.bias.grad.numpy(), 2 * rdb)


def _check_geometry(device, seed):
    def check(g):
        with _layer(g, device) as layer:
            assert (layer.channels, layer.out_channels, layer.dilation) == (g[1], g[1] * g[2], g[8])
            assert (layer.kernel_size, layer.stride, layer.padding) == (g[5], g[6], g[7])
            _check("dwconv2d d%d m%d" % (g[8], g[2]), layer, g, device, seed(g))
    return check


def test_matches_reference(device):
    """The sample of dilation x multiplier x kernel x stride x padding: forward, dx, dW, db."""
    _each([(_gid(g), g) for g in GEOMS], _check_geometry(device, GEOMS.index))


def test_edge_cases_match_reference(device):
    names = sorted(EDGE)
    _each([(name, EDGE[name]) for name in names],
          _check_geometry(device, lambda g: 100 + list(EDGE.values()).index(g)))


def test_defaults_are_plain_depthwise(device):
    """No dilation, no multiplier: the layer of before, the same numbers as spelled out."""
    g = (2, 3, 1, 7, 6, (3, 2), 2, 1, 1, True)
    with ut.DWConv2d(3, (3, 2), stride=2, padding=1, device=device) as plain:
        assert plain.dilation == 1 and plain.out_channels == 3
        _check("dwconv2d default", plain, g, device, 7)
        with ut.DWConv2d(3, (3, 2), stride=2, padding=1, device=device, dilation=1,
                         out_channels=None) as explicit:
            assert explicit.out_channels == 3 and explicit.weight.shape == (3, 3, 2)
            explicit.weight, explicit.bias = plain.weight.numpy(), plain.bias.numpy()
            x = ut.tensor(_inputs(g, 8)[0], device)
            assert np.array_equal(plain(x).numpy(), explicit(x).numpy())


def test_every_output_channel_reads_its_own_input_channel(device):
    """Output channel o = c*m + r reads input channel c: a one-hot input lights up exactly the
    m outputs of its channel (bias 0, 1x1 kernel of ones, dilation 2 makes no difference)."""
    c, m = 3, 2
    with ut.DWConv2d(c, 1, bias=False, device=device, dilation=2, out_channels=c * m) as layer:
        layer.weight = np.arange(1, c * m + 1, dtype=f32).reshape(c * m, 1, 1)
        for ch in range(c):
            x = np.zeros((1, c, 2, 2), f32)
            x[0, ch] = 1.0
            y = layer(ut.tensor(x, device)).numpy()
            lit = [o for o in range(c * m) if y[0, o].any()]
            assert lit == [ch * m + r for r in range(m)], (ch, lit)
            for o in lit:
                np.testing.assert_array_equal(y[0, o], np.full((2, 2), o + 1.0))


# -- PyTorch: float32 forward and autograd, state_dict both ways ---------------------------------
def test_matches_pytorch(device, torch):
    """F.conv2d(x, w[:, None], b, stride, padding, dilation, groups=C) and its autograd, float32,
    on every sampled geometry and edge case."""
    def check(g):
        n, c, m, h, w, (kh, kw), s, p, d, bias = g
        x, wt, b, go = _inputs(g, 3)
        tx = torch.tensor(x, requires_grad=True)
        tw = torch.tensor(wt, requires_grad=True)
        tb = torch.tensor(b, requires_grad=True) if bias else None
        ty = torch.nn.functional.conv2d(tx, tw[:, None], tb, s, p, d, groups=c)
        ty.backward(torch.tensor(go))
        with _layer(g, device) as layer:
            layer.weight = wt
            if bias:
                layer.bias = b
            y = layer(ut.tensor(x, device))
            assert y.shape == tuple(ty.shape)
            assert_close("dwconv2d vs torch forward", y.numpy(), ty.detach().numpy())
            dx = layer.backward(ut.tensor(go, device))
            assert_close("dwconv2d vs torch dx", dx.numpy(), tx.grad.numpy())
            assert_close("dwconv2d vs torch dW", layer.weight.grad.numpy(), tw.grad.numpy())
            if bias:
                assert_close("dwconv2d vs torch db", layer.bias.grad.numpy(), tb.grad.numpy())

    _each([(_gid(g), g) for g in GEOMS] + sorted(EDGE.items()), check)


def test_state_dict_loads_into_torch_conv2d_and_back(device, torch):
    c, m, k, s, p, d = 3, 2, (3, 5), 2, 3, 2
    x = _randn(np.random.default_rng(4), 2, c, 9, 11)

    def check(bias):
        with ut.DWConv2d(c, k, stride=s, padding=p, bias=bias, device=device, dilation=d,
                         out_channels=c * m) as layer:
            if bias:
                layer.bias = np.linspace(-1, 1, c * m, dtype=f32)
            sd = layer.state_dict()
            assert sd["weight"].shape == (c * m, 1) + k
            assert list(sd) == (["weight", "bias"] if bias else ["weight"])
            tconv = torch.nn.Conv2d(c, c * m, k, s, p, dilation=d, groups=c, bias=bias)
            tconv.load_state_dict({kk: torch.from_numpy(v) for kk, v in sd.items()}, strict=True)
            with torch.no_grad():
                want = tconv(torch.from_numpy(x)).numpy()
            assert_close("dwconv2d state_dict -> torch", layer(ut.tensor(x, device)).numpy(), want)

            # and back: PyTorch's own (random) weights into ours
            torch.manual_seed(0)
            tconv = torch.nn.Conv2d(c, c * m, k, s, p, dilation=d, groups=c, bias=bias)
            layer.load_state_dict(tconv.state_dict(), strict=True)
            with torch.no_grad():
                want = tconv(torch.from_numpy(x)).numpy()
            np.testing.assert_array_equal(layer.weight.numpy(),
                                          tconv.weight.detach().numpy().reshape(c * m, *k))
            assert_close("dwconv2d state_dict <- torch", layer(ut.tensor(x, device)).numpy(), want)

    _each([("bias", True), ("no bias", False)], check)


def test_state_dict_of_another_shape_is_refused(device):
    """A state of the plain depthwise layer (m = 1) does not fit a multiplier-2 layer."""
    with ut.DWConv2d(2, 3, device=device) as plain, \
            ut.DWConv2d(2, 3, device=device, out_channels=4) as wide:
        before = wide.weight.numpy().copy()
        with pytest.raises(ut.ShapeError):
            wide.load_state_dict(plain.state_dict())
        np.testing.assert_array_equal(wide.weight.numpy(), before)


# -- bad arguments --------------------------------------------------------------------------------
BAD = {
    "out_channels-0": (dict(out_channels=0), ut.ArgumentError, "out_channels"),
    "out_channels-negative": (dict(out_channels=-4), ut.ArgumentError, "out_channels"),
    "out_channels-not-a-multiple": (dict(out_channels=5), ut.ArgumentError, "out_channels"),
    "out_channels-fewer": (dict(out_channels=1), ut.ArgumentError, "out_channels"),
    "dilation-0": (dict(dilation=0), ut.ArgumentError, "dilation"),
    "dilation-negative": (dict(dilation=-2), ut.ArgumentError, "dilation"),
}


def test_bad_arguments(device):
    """Each refused with ArgumentError (a ValueError) whose message names the argument and the
    value; nothing is left allocated."""
    def check(case):
        kwargs, exc, word = case
        before = ut.live_tensors()
        with pytest.raises(exc) as info:
            ut.DWConv2d(2, 3, device=device, **kwargs)
        assert isinstance(info.value, ValueError)
        msg = str(info.value)
        assert word in msg, msg
        assert str(next(iter(kwargs.values()))) in msg, "the value refused is not named: " + msg
        if kwargs.get("out_channels") == 5:
            assert "multiple" in msg, msg
        assert ut.live_tensors() == before

    _each(sorted(BAD.items()), check)


# (H, W, kernel, padding, dilation): the kernel fits the padded input, its dilated window not
TOO_SMALL = [(6, 6, 3, 0, 3), (7, 4, (3, 2), 0, 4), (3, 3, 3, 1, 3), (2, 2, 2, 0, 2)]


def test_window_bigger_than_input(device):
    """The dilated window (d (k-1) + 1) does not fit the padded input: ShapeError naming the
    dilation and the input's size, though the undilated kernel would fit; the layer still
    works on an input that fits. An input with the output's channel count: ShapeError."""
    def check(case):
        h, w, k, p, d = case
        kh, kw = (k, k) if isinstance(k, int) else k
        assert h + 2 * p >= kh and w + 2 * p >= kw  # fits without the dilation
        assert h + 2 * p < _window(kh, d) or w + 2 * p < _window(kw, d)
        with ut.DWConv2d(2, k, padding=p, device=device, dilation=d, out_channels=4) as layer:
            with pytest.raises(ut.ShapeError) as info:
                layer(ut.tensor(np.ones((1, 2, h, w), f32), device))
            assert isinstance(info.value, ValueError)
            msg = str(info.value)
            assert "dilation" in msg.lower(), msg
            assert "%dx%d" % (h, w) in msg or "%d, %d" % (h, w) in msg, msg
            fits = np.ones((1, 2, h + 2 * _window(kh, d), w + 2 * _window(kw, d)), f32)
            assert layer(ut.tensor(fits, device)).shape[:2] == (1, 4)
            with pytest.raises(ut.ShapeError):  # C*m channels instead of C
                layer(ut.tensor(np.ones((1, 4) + fits.shape[2:], f32), device))

    _each([("%dx%d k%s p%d d%d" % c, c) for c in TOO_SMALL], check)


# -- non-finite values: sums over the real (output, tap, input) pairs only ------------------------
def _pair_sums(x, w, b, go, s, p, d):
    """float64 y, dx, dW, db summed over the (output, tap) pairs whose input lies inside x,
    one loop per pair: nothing multiplies padding, and no input between taps is touched."""
    n, c, h, wd = x.shape
    o_ch, kh, kw = w.shape
    m = o_ch // c
    ho, wo = go.shape[2:]
    x, w, go = x.astype(np.float64), w.astype(np.float64), go.astype(np.float64)
    y = np.zeros((n, o_ch, ho, wo)) + b.astype(np.float64)[None, :, None, None]
    dx, dw = np.zeros(x.shape), np.zeros(w.shape)
    with np.errstate(invalid="ignore"):  # inf - inf is the NaN wanted
        for o, i, j, oy, ox in itertools.product(range(o_ch), range(kh), range(kw), range(ho),
                                                 range(wo)):
            iy, ix = oy * s - p + i * d, ox * s - p + j * d
            if 0 <= iy < h and 0 <= ix < wd:
                y[:, o, oy, ox] += x[:, o // m, iy, ix] * w[o, i, j]
                dx[:, o // m, iy, ix] += go[:, o, oy, ox] * w[o, i, j]
                dw[o, i, j] += np.sum(go[:, o, oy, ox] * x[:, o // m, iy, ix])
    return y, dx, dw, go.sum(axis=(0, 2, 3))


def _read_mask(shape, kh, kw, s, p, d, ho, wo):
    """Which input positions [H, W] some (output, tap) pair reads."""
    mask = np.zeros(shape, bool)
    for i, j, oy, ox in itertools.product(range(kh), range(kw), range(ho), range(wo)):
        iy, ix = oy * s - p + i * d, ox * s - p + j * d
        if 0 <= iy < shape[0] and 0 <= ix < shape[1]:
            mask[iy, ix] = True
    return mask


def _same_nonfinite(what, got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, what
    for mask in (np.isnan, np.isposinf, np.isneginf):
        np.testing.assert_array_equal(mask(got), mask(want),
                                      err_msg="%s: %s" % (what, mask.__name__))
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], rtol=1e-4, atol=1e-5, err_msg=what)


# (C, multiplier, H, W, (kh, kw), stride, pad, dilation): each leaves input positions that no
# (output, tap) pair reads (between the taps of a window, or skipped by the stride)
NONFINITE = [
    (2, 1, 9, 9, (3, 3), 2, 0, 2),
    (2, 2, 8, 8, (3, 3), 2, 1, 2),
    (1, 3, 10, 11, (3, 3), 3, 2, 3),
    (2, 2, 9, 12, (3, 5), 2, 2, 2),
    (2, 2, 9, 9, (1, 1), 3, 1, 3),
]
SITES = ("x-unread", "x-read", "w", "go")


def _nonfinite_case(device, geom, site):
    c, m, h, w, (kh, kw), s, p, d = geom
    ho, wo = _out(h, kh, s, p, d), _out(w, kw, s, p, d)
    rng = np.random.default_rng(21)
    x = _randn(rng, 2, c, h, w)
    wt = _randn(rng, c * m, kh, kw, scale=0.5)
    b = _randn(rng, c * m)
    go = _randn(rng, 2, c * m, ho, wo)
    read = _read_mask((h, w), kh, kw, s, p, d, ho, wo)
    unread = np.argwhere(~read)
    if site == "x-unread":
        assert len(unread) >= 2, "the geometry must leave unread inputs for the test to bite"
        (a, bb), (e, f) = unread[0], unread[-1]
        x[0, 0, a, bb], x[1, 0, a, bb], x[1, c - 1, e, f] = np.inf, -np.inf, np.nan
    elif site == "x-read":
        a, bb = np.argwhere(read)[int(read.sum()) // 2]
        x[0, c - 1, a, bb], x[1, 0, a, bb] = np.inf, np.nan
    elif site == "w":
        # corner taps: at the border they read padding (when there is any), inside real input
        wt[0, 0, 0] = np.inf
        wt[c * m - 1, kh - 1, kw - 1] = -np.inf
    else:
        go[0, 0, 0, 0] = np.nan
        go[1, c * m - 1, ho - 1, wo - 1] = np.inf
    want = _pair_sums(x, wt, b, go, s, p, d)
    with ut.DWConv2d(c, (kh, kw), stride=s, padding=p, device=device, dilation=d,
                     out_channels=c * m) as layer:
        layer.weight, layer.bias = wt, b
        y = layer(ut.tensor(x, device))
        dx = layer.backward(ut.tensor(go, device))
        got = (y.numpy(), dx.numpy(), layer.weight.grad.numpy(), layer.bias.grad.numpy())
    for name, gv, wv in zip(("y", "dx", "dW", "db"), got, want):
        _same_nonfinite(name, gv, wv)
    if site == "x-unread":  # nothing at all changed: the clean input gives the same numbers
        clean = R.dwconv2d(np.nan_to_num(x.astype(np.float64), nan=0, posinf=0, neginf=0),
                           wt.astype(np.float64), b.astype(np.float64), s, p, d)
        assert np.all(np.isfinite(got[0])) and np.all(np.isfinite(got[2]))
        assert_close("unread non-finite input: forward", got[0], clean)
    if site == "w" and p > 0:  # the padding met the inf weights without making NaN
        assert not np.isnan(got[0]).any()


def test_nonfinite_only_through_real_pairs(device):
    """inf/NaN in x where no (output, dilated tap) pair reads changes nothing; one where a pair
    reads reaches exactly the outputs and weight gradients of those pairs; an inf weight
    multiplies real inputs only (never padding); a NaN in grad_out reaches the dx of the inputs
    its pairs read and the dW of its taps that read real input. Compared with the float64 sums
    over the real pairs (_pair_sums)."""
    cases = [("%s C%d_m%d_%dx%d_k%dx%d_s%d_p%d_d%d" % ((site,) + g[:4] + g[4] + g[5:]), (g, site))
             for g in NONFINITE for site in SITES]
    _each(cases, lambda case: _nonfinite_case(device, *case))


# Undilated geometries that take the GPU's fast kernels (strip, tiled), which multiply weights by
# padding and sum dW over it: a channel with an inf weight is computed again by the plain rule,
# and a tap whose dW sum met NaN or inf is summed again over real input only. The first and last
# channels carry the bad values, the middle ones show the fast results kept.
FAST_NONFINITE = [
    (3, 1, 14, 16, (3, 3), 1, 1, 1),  # strip, stride 1
    (3, 1, 16, 16, (3, 3), 2, 1, 1),  # strip, stride 2
    (3, 1, 40, 40, (3, 3), 2, 1, 1),  # strip, several strips and dW parts per plane
    (3, 1, 12, 12, (5, 5), 1, 2, 1),  # strip 5x5
    (3, 1, 13, 13, (7, 7), 1, 3, 1),  # tiled
    (3, 1, 13, 13, (5, 5), 2, 2, 1),  # tiled, stride 2
    (2, 2, 12, 14, (3, 3), 1, 1, 1),  # multiplier
]


def test_nonfinite_through_the_fast_kernels(device):
    """The rules of test_nonfinite_only_through_real_pairs on the geometries of the fast GPU
    kernels (on the CPU, the same answers)."""
    cases = [("%s C%d_m%d_%dx%d_k%dx%d_s%d_p%d" % ((site,) + g[:4] + g[4] + g[5:7]), (g, site))
             for g in FAST_NONFINITE for site in ("x-read", "w", "go")]
    _each(cases, lambda case: _nonfinite_case(device, *case))


# -- copies ---------------------------------------------------------------------------------------
COPIES = {
    "copy": copy.copy,
    "deepcopy": copy.deepcopy,
    "pickle": lambda v: pickle.loads(pickle.dumps(v)),
}


def test_copies_keep_dilation_and_multiplier(device):
    rng = np.random.default_rng(5)
    x = ut.tensor(_randn(rng, 2, 2, 9, 8), device)

    def check(dup):
        layer = ut.DWConv2d(2, (3, 2), stride=2, padding=2, device=device, dilation=3,
                            out_channels=6)
        try:
            layer.bias = _randn(rng, 6)
            with layer(x) as y:
                layer.backward(ut.tensor(_randn(rng, *y.shape), device)).close()
            c = dup(layer)
            try:
                assert type(c) is ut.DWConv2d
                assert (c.dilation, c.out_channels, c.channels) == (3, 6, 2)
                assert (c.kernel_size, c.stride, c.padding) == ((3, 2), 2, 2)
                assert c.weight.shape == (6, 3, 2)
                assert c.state_dict()["weight"].shape == (6, 1, 3, 2)
                assert repr(c) == repr(layer)
                np.testing.assert_array_equal(c.weight.numpy(), layer.weight.numpy())
                np.testing.assert_array_equal(c.bias.numpy(), layer.bias.numpy())
                np.testing.assert_array_equal(c.weight.grad.numpy(), layer.weight.grad.numpy())
                with layer(x) as a, c(x) as b:
                    assert a.shape == b.shape == (2, 6, _out(9, 3, 2, 2, 3), _out(8, 2, 2, 2, 3))
                    assert np.array_equal(a.numpy(), b.numpy())
                c.weight.fill_(2.0)  # independent of the original
                assert not np.array_equal(c.weight.numpy(), layer.weight.numpy())
            finally:
                c.close()
        finally:
            layer.close()

    _each(sorted(COPIES.items()), check)


# -- training: a few SGD steps against the PyTorch twin -------------------------------------------
def test_training_steps_match_pytorch(device, torch):
    """DWConv2d(2 -> 4, dilation 2) in Sequential(dw, ReLU, pool, Linear), loaded into its PyTorch
    twin through the state_dict, five SGD (momentum) steps: the same losses and weights. The
    twin's step is torch.optim.SGD's rule written out (v = momentum v + g, p -= lr v; ut.SGD is
    checked against torch.optim.SGD itself in tests/test_network_grad.py), which spares the
    second it takes to import torch.optim."""
    nn = torch.nn
    ut.seed(3)
    rng = np.random.default_rng(9)
    net = ut.Sequential(ut.DWConv2d(2, 3, padding=2, device=device, dilation=2, out_channels=4),
                        ut.ReLU(), ut.GlobalAvgPool2d(), ut.Linear(4, 3, device=device))
    tnet = nn.Sequential(nn.Conv2d(2, 4, 3, 1, 2, dilation=2, groups=2), nn.ReLU(),
                         nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten()), nn.Linear(4, 3))
    sd = net.state_dict()
    assert list(sd) == list(tnet.state_dict())
    tnet.load_state_dict({k: torch.from_numpy(v) for k, v in sd.items()}, strict=True)
    lr, momentum = 0.2, 0.9
    opt = ut.SGD(net.parameters(), lr=lr, momentum=momentum)
    velocity = [torch.zeros_like(tp) for tp in tnet.parameters()]
    losses, tlosses = [], []
    try:
        for _ in range(5):
            x = _randn(rng, 4, 2, 7, 6)
            labels = rng.integers(0, 3, 4)
            opt.zero_grad()
            y = net(ut.tensor(x, device))
            losses.append(float(ut.cross_entropy(y, labels).numpy()[0]))
            net.backward(ut.cross_entropy_backward(y, labels)).close()
            opt.step()
            tnet.zero_grad()
            loss = nn.functional.cross_entropy(tnet(torch.from_numpy(x)), torch.from_numpy(labels))
            loss.backward()
            with torch.no_grad():
                for tp, v in zip(tnet.parameters(), velocity):
                    v.mul_(momentum).add_(tp.grad)
                    tp.sub_(lr * v)
            tlosses.append(loss.item())
        np.testing.assert_allclose(losses, tlosses, rtol=1e-5, atol=1e-6)
        assert losses[-1] != losses[0]  # it did train
        got = net.state_dict()
        for k, v in tnet.state_dict().items():
            assert_close("trained " + k, got[k], v.numpy())
    finally:
        opt.close()
        net.close()
