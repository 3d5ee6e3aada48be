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


def _check(g, seed):
    kh, kw, s, d, p, h, w = g
    n, c = 3, 2
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


def _each(check):
    failed = []
    for i, g in enumerate(GEOMS):
        try:
            check(g, i)
        except (AssertionError, ut.UtensilError) as e:
            failed.append("%s: %s" % (_name(g), "\n".join(str(e).strip().splitlines()[:8])))
    assert not failed, "%d of %d cases failed:\n%s" % (len(failed), len(GEOMS),
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
