"""CPU depthwise convolution over the shapes the specialised row engines compile (issue 32):
every filter width 1..7 with several heights (square and not), strides 1..3, dilation 1 and 2,
against the float64 reference (utensil_ffi.reference, itself checked against finite
differences and PyTorch in tests/test_reference.py): forward, dx and dW.

Planes are wide enough for several vectors a row at every vector width (AVX-512's 16 lanes
included) and odd in height, so that the engines' two-rows-a-step loops meet a lone last row;
N = 3 puts more than one plane in each thread's range (the stores that spill into the next
plane). Cases loop inside each test (conftest's per-test leak check costs more than a case).
"""

import itertools

import numpy as np

import utensil_ffi as ut
from tolerances import assert_close
from utensil_ffi import reference as R

f32 = np.float32

# (kh, kw): every width 1..7, heights from 1 to 7 across them
KERNELS = ((1, 1), (3, 1), (7, 1), (1, 2), (2, 2), (3, 3), (5, 3), (4, 4), (3, 5), (5, 5),
           (1, 6), (6, 6), (1, 7), (3, 7), (7, 7))
STRIDES = (1, 2, 3)
DILATIONS = (1, 2)


def _geoms():
    """(kh, kw, stride, dilation, padding, H, W), the padding cycling 0..3 over the cases."""
    out = []
    for i, ((kh, kw), s, d) in enumerate(itertools.product(KERNELS, STRIDES, DILATIONS)):
        p = i % 4
        h = max(d * (kh - 1) + 1 - 2 * p, 1) + 8 + (i % 3)  # 9..: odd and even output heights
        w = 37 + 5 * (i % 5)  # 37..57: several vectors a row, partial last vectors
        out.append((kh, kw, s, d, p, h, w))
    return out


GEOMS = _geoms()


def _name(g):
    return "k%dx%d_s%d_d%d_p%d_%dx%d" % g


def _check(g, seed, c=2):
    kh, kw, s, d, p, h, w = g
    n = 3
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, c, h, w)).astype(f32)
    wt = (rng.standard_normal((c, kh, kw)) * 0.5).astype(f32)
    b = rng.standard_normal(c).astype(f32)
    with ut.DWConv2d(c, (kh, kw), stride=s, padding=p, dilation=d) as layer:
        layer.weight = wt
        layer.bias = b
        y = layer(ut.tensor(x))
        ref = R.dwconv2d(x.astype(np.float64), wt.astype(np.float64), b.astype(np.float64),
                         s, p, d)
        assert_close("dw shapes forward " + _name(g), y.numpy(), ref)
        go = rng.standard_normal(ref.shape).astype(f32)
        rdx, rdw, _ = R.dwconv2d_backward(x.astype(np.float64), wt.astype(np.float64), s, p,
                                          go.astype(np.float64), d)
        dx = layer.backward(ut.tensor(go))
        assert_close("dw shapes dx " + _name(g), dx.numpy(), rdx)
        assert_close("dw shapes dW " + _name(g), layer.weight.grad.numpy(), rdw)


def _each(check, geoms=GEOMS):
    failed = []
    for i, g in enumerate(geoms):
        try:
            check(g, i)
        except (AssertionError, ut.UtensilError) as e:
            failed.append("%s: %s" % (_name(g), "\n".join(str(e).strip().splitlines()[:8])))
    assert not failed, "%d of %d cases failed:\n%s" % (len(failed), len(geoms),
                                                       "\n".join(failed))


def test_matches_reference_two_threads():
    """Forward, dx, dW of every geometry, two threads (the planes split between them)."""
    old = ut.get_num_threads()
    ut.set_num_threads(2)
    try:
        _each(_check)
    finally:
        ut.set_num_threads(old)


def test_matches_reference_one_thread():
    """The same on one thread: one range of planes, every spill landing in the next plane."""
    old = ut.get_num_threads()
    ut.set_num_threads(1)
    try:
        _each(_check)
    finally:
        ut.set_num_threads(old)


def test_square_stride1_row_engines_every_padding():
    """The register-blocked row engines of square filters at stride 1 (3x3, 5x5, 7x7: two
    output rows a step sharing their input rows) with every padding 0..3, odd and even
    output heights, planes wider than the flat engine takes."""
    geoms = [(k, k, 1, 1, p, h, 41 + 6 * p) for k in (3, 5, 7) for p in range(4)
             for h in (k + 8, k + 9)]
    _each(_check, geoms)


def test_stride2_phase_planes_every_padding():
    """Stride 2 with square 3x3, 5x5 and 7x7 filters (the phase-plane engine: the plane split
    into its four row and column parities, every tap a stride-1 read, the outputs computed
    as one flat run with junk columns dropped): every padding 0..k-1, planes from one value
    to wider than two vectors, odd and even, with the filter hanging past every edge."""
    hs, ws = (1, 2, 5, 8, 17, 34), (3, 1, 16, 31, 33, 50)
    geoms = []
    for k in (3, 5, 7):
        for p in range(k):
            for i, h in enumerate(hs):
                w = ws[(i + p + k) % len(ws)]
                if h + 2 * p >= k and w + 2 * p >= k:
                    geoms.append((k, k, 2, 1, p, h, w))
    assert len(geoms) >= 60
    _each(_check, geoms)


def test_nonfinite_input_dilated():
    """An inf in x reaches only the outputs whose taps read it (dilation 2 runs the engines,
    which multiply padding zeros by the weights, never a zero tap by x)."""
    rng = np.random.default_rng(7)
    for kh, kw, s in ((3, 3, 1), (5, 3, 2), (7, 7, 3)):
        x = rng.standard_normal((2, 2, 20, 40)).astype(f32)
        x[1, 0, 9, 17] = np.inf
        x[0, 1, 3, 5] = -np.inf
        wt = (rng.standard_normal((2, kh, kw)) * 0.5 + 2.0).astype(f32)  # no zero weight
        with ut.DWConv2d(2, (kh, kw), stride=s, padding=2, dilation=2, bias=False) as layer:
            layer.weight = wt
            y = layer(ut.tensor(x)).numpy()
        ref = R.dwconv2d(x.astype(np.float64), wt.astype(np.float64), None, s, 2, 2)
        assert np.array_equal(np.isinf(y), np.isinf(ref)) and not np.isnan(ref).any()
        fin = np.isfinite(ref)
        assert_close("dw shapes forward inf", np.where(fin, y, 0), np.where(fin, ref, 0))


def _small_geoms():
    """Planes of at most 16 values under filters of 25 taps or more, of at most 4 under any, or
    strided under 9 or more (the small-plane engine: ConvNeXt's 4x4 and 2x2 planes under 7x7 at
    64^2, MobileNet v1's last stride-2 3x3 at 64^2, MobileNetV2's 3x3 over 1x1 and 2x2 planes
    at 32^2), every stride, dilation and padding that leaves an output, and planes of one row or
    column; then strided planes of up to 64 values whose outputs are at most 16 (MobileNet v1's
    8x8 -> 4x4 at 64^2, 7x7 -> 4x4), and a few just past that."""
    out = []
    for i, ((kh, kw), (h, w), s, d) in enumerate(itertools.product(
            ((5, 5), (7, 7), (5, 7), (7, 5), (6, 6), (3, 3), (3, 5)),
            ((1, 1), (2, 2), (4, 4), (3, 5), (1, 4)),
            (1, 2, 3), (1, 2))):
        p = (kh // 2, 0, 1, 3)[i % 4]
        if h + 2 * p >= d * (kh - 1) + 1 and w + 2 * p >= d * (kw - 1) + 1:
            out.append((kh, kw, s, d, p, h, w))
    for i, ((kh, kw), (h, w), s, d) in enumerate(itertools.product(
            ((3, 3), (5, 5), (7, 7), (3, 5)), ((7, 7), (8, 8), (4, 16), (9, 7), (5, 12)),
            (2, 3), (1, 2))):
        p = (kh // 2, 0, 1)[i % 3]
        if h + 2 * p >= d * (kh - 1) + 1 and w + 2 * p >= d * (kw - 1) + 1:
            out.append((kh, kw, s, d, p, h, w))
    return out


SMALL = _small_geoms()


def test_small_planes_match_reference():
    """Forward, dx and dW over small planes against the float64 reference, with 70 channels
    (a full block of 64 and a partial one), on one thread and on two."""
    assert len(SMALL) > 40
    old = ut.get_num_threads()
    try:
        for nt in (1, 2):
            ut.set_num_threads(nt)
            _each(lambda g, seed: _check(g, seed, c=70), SMALL)
    finally:
        ut.set_num_threads(old)


def test_small_planes_nonfinite_stay_where_they_are_read():
    """An inf in x and a NaN in grad_out on a 4x4 plane under 7x7 (padding 3): only the outputs,
    input gradients and taps that read them are non-finite, as in the float64 reference (whose
    padding zeros meet only finite weights); everything else matches it."""
    rng = np.random.default_rng(11)
    n, c, h, w = 2, 67, 4, 4
    x = rng.standard_normal((n, c, h, w)).astype(f32)
    x[1, 5, 2, 1] = np.inf
    wt = (rng.standard_normal((c, 7, 7)) * 0.5 + 2.0).astype(f32)  # no zero weight
    go = rng.standard_normal((n, c, h, w)).astype(f32)
    go[0, 66, 3, 3] = np.nan
    with ut.DWConv2d(c, 7, padding=3, bias=False) as layer:
        layer.weight = wt
        y = layer(ut.tensor(x)).numpy()
        dx = layer.backward(ut.tensor(go)).numpy()
        dw = layer.weight.grad.numpy()
    x64, w64, go64 = x.astype(np.float64), wt.astype(np.float64), go.astype(np.float64)
    ref = R.dwconv2d(x64, w64, None, 1, 3)
    rdx, _, _ = R.dwconv2d_backward(x64, w64, 1, 3, go64)
    # dW: the reference multiplies the NaN by padding zeros too; PyTorch (and utensil) sum real
    # input only, so the NaN reaches the taps that read input from output (3, 3): ky, kx < 4
    _, rdw, _ = R.dwconv2d_backward(x64, w64, 1, 3, np.nan_to_num(go64, nan=0.0))
    rdw[66, :4, :4] = np.nan
    for name, got, want in (("forward", y, ref), ("dx", dx, rdx), ("dW", dw, rdw)):
        assert np.array_equal(np.isnan(got), np.isnan(want)), name
        assert np.array_equal(np.isinf(got), np.isinf(want)), name
        assert np.isfinite(want).sum() > 0.9 * want.size, name  # the case keeps most finite
        fin = np.isfinite(want)
        assert_close("dw small planes %s non-finite" % name, np.where(fin, got, 0),
                     np.where(fin, want, 0))
