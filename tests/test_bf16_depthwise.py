"""bf16 depthwise convolution on the GPU (native/cuda/depthwise.cu, the *_bf16 entry points).

What is compared: a DWConv2d run on bf16 activations against the same layer (same weights) run
in float32 on the same values, i.e. on the bf16-rounded input and output gradient. The bf16
kernels compute in float32 exactly as the float32 kernels do and round once when they store, so:

  forward y   |y16 - y32| <= 2^-8 |y32|          one round-to-nearest-even to bf16 (8 significant
                                                 bits: relative error at most 2^-8)
  dx (m = 1)  |dx16 - dx32| <= 2^-8 |dx32|       likewise
  dx (m > 1)  |dx16 - dx32| <= (m + 1) 2^-8 A     the core sums the m per-filter dx planes
                                                 (chan_group_sum): each partial and the sum
                                                 rounded, A = sum |go| |w| over the pairs
  dW, db      |dw16 - dw32| <= 1e-5 A + 1e-30     float32 sums of identical products; the bf16
                                                 dW kernel may group the partial sums
                                                 differently (2-8 columns per item), A = sum
                                                 |go| |x| over the pairs

Geometries: the dilation x multiplier x kernel x stride x padding sample and the edge cases of
test_dw_dilation_multiplier.py, plus shapes that pick each CUDA path (read the dispatch in
depthwise.cu): the strip kernels (3x3 stride 1 and 2, 5x5 stride 1; widths that are multiples
of 8 take the wide bf16 kernels ut__cuda_dwconv2d_stripw_*, other even widths the pair kernels
ut__cuda_dwconv2d_strip2_*, odd widths the one-column ones), the tiled kernels
(5x5 stride 2, 7x7), and the plain kernels (dilation > 1, kh != kw, stride 3, 1x1), odd sizes,
a 1x1 image and batch > 1. Then non-finite values: the same NaN/inf pattern as float32 (the
rule of "sums over real (output, tap, input) pairs only").

Skipped without a GPU (UTENSIL_EXPECT_CUDA=1 makes a missing GPU fail, as in test_cuda.py).
"""

import os

import numpy as np
import pytest

import utensil_ffi as ut
from bf16_reference import bf16_round
from test_dw_dilation_multiplier import EDGE, GEOMS, _each, _gid, _out
from utensil_ffi import reference as R

EXPECT = os.environ.get("UTENSIL_EXPECT_CUDA") == "1"
HAVE = "cuda" in ut.devices()
needs_gpu = pytest.mark.skipif(not HAVE and not EXPECT, reason="no cuda device")

f32 = np.float32
U = 2.0 ** -8  # bf16's unit roundoff (round to nearest even, 8 significant bits)

# (N, C, multiplier, H, W, (kh, kw), stride, pad, dilation, bias), as in
# test_dw_dilation_multiplier.py; named by the CUDA path they take
PATHS = {
    # strip kernels, bf16 pairs (input width even): 3x3 s1/s2 with odd and even padding, 5x5 s1
    "strip2-3x3-s1-p1": (2, 5, 1, 14, 16, (3, 3), 1, 1, 1, True),
    "strip2-3x3-s1-p0": (2, 3, 1, 9, 10, (3, 3), 1, 0, 1, True),
    "strip2-3x3-s1-p2": (1, 3, 1, 10, 10, (3, 3), 1, 2, 1, False),
    "strip2-3x3-s2-p1": (3, 4, 1, 16, 16, (3, 3), 2, 1, 1, True),
    "strip2-3x3-s2-p1-odd-out": (2, 3, 1, 9, 14, (3, 3), 2, 1, 1, True),  # wo = 7, rows odd
    "strip2-3x3-s2-p0": (1, 3, 1, 10, 10, (3, 3), 2, 0, 1, True),
    "strip2-5x5-s1-p2": (2, 4, 1, 12, 12, (5, 5), 1, 2, 1, True),
    "strip2-5x5-s1-p1": (2, 3, 1, 11, 12, (5, 5), 1, 1, 1, False),
    "strip2-mobilenet-112": (2, 8, 1, 112, 112, (3, 3), 1, 1, 1, True),
    "strip2-mobilenet-112-s2": (2, 8, 1, 112, 112, (3, 3), 2, 1, 1, True),
    "strip2-mobilenet-56": (2, 16, 1, 56, 56, (3, 3), 1, 1, 1, True),
    "strip2-mobilenet-56-s2": (2, 16, 1, 56, 56, (3, 3), 2, 1, 1, True),
    "strip2-multiplier": (2, 3, 2, 12, 14, (3, 3), 1, 1, 1, True),
    # strip kernels, wide bf16 items (input width a multiple of 8: ut__cuda_dwconv2d_stripw_*,
    # which also serve the even widths above that are multiples of 8): output widths that are
    # not a multiple of the item (stores one by one), each padding offset, odd row counts, and
    # dx at stride 2 from go rows of a width that is a multiple of 4 with an odd dx width
    "wide-3x3-s1-p0": (2, 5, 1, 16, 24, (3, 3), 1, 0, 1, True),
    "wide-3x3-s1-p2": (2, 5, 1, 16, 24, (3, 3), 1, 2, 1, False),
    "wide-3x3-s2-p0": (2, 5, 1, 16, 24, (3, 3), 2, 0, 1, True),
    "wide-3x3-s2-p1-odd-rows": (2, 3, 1, 17, 40, (3, 3), 2, 1, 1, True),
    "wide-3x3-s2-p2": (2, 3, 1, 18, 40, (3, 3), 2, 2, 1, True),
    "wide-3x3-s2-dx-odd-width": (2, 3, 1, 13, 55, (3, 3), 2, 1, 1, True),
    "wide-3x3-s1-8-wide": (2, 4, 1, 5, 8, (3, 3), 1, 1, 1, True),
    "wide-5x5-s1-p2": (3, 4, 1, 20, 32, (5, 5), 1, 2, 1, True),
    "wide-5x5-s1-p1": (2, 3, 1, 11, 32, (5, 5), 1, 1, 1, True),
    # strip kernels, one column per item (input width odd)
    "strip-3x3-s1-odd": (2, 3, 1, 7, 9, (3, 3), 1, 1, 1, True),
    "strip-3x3-s2-odd": (2, 16, 1, 57, 55, (3, 3), 2, 1, 1, True),
    "strip-5x5-s1-odd": (2, 3, 1, 13, 11, (5, 5), 1, 2, 1, True),
    "strip-3x3-s1-p3": (2, 3, 1, 10, 9, (3, 3), 1, 3, 1, True),
    "strip-1x1-image": (1, 1, 1, 1, 1, (3, 3), 1, 1, 1, True),
    "strip-1x1-image-s2": (3, 2, 1, 1, 1, (3, 3), 2, 1, 1, False),
    "strip-2x2-image-s2": (3, 5, 1, 2, 2, (3, 3), 2, 1, 1, True),
    "strip-3x3-image": (2, 4, 1, 3, 3, (3, 3), 1, 1, 1, True),
    # tiled kernels (odd and even sizes: the bf16 tile copies 8-byte chunks plus 2-byte heads
    # and tails wherever a band does not start on four elements)
    "tile-5x5-s2": (2, 3, 1, 12, 12, (5, 5), 2, 2, 1, True),
    "tile-5x5-s2-odd": (2, 8, 1, 29, 27, (5, 5), 2, 2, 1, True),
    "tile-7x7-s1": (2, 2, 1, 13, 11, (7, 7), 1, 3, 1, True),
    "tile-7x7-s1-even": (2, 8, 1, 30, 30, (7, 7), 1, 3, 1, False),
    "tile-7x7-s2": (1, 2, 1, 15, 16, (7, 7), 2, 3, 1, True),
    "tile-7x7-s2-odd": (2, 8, 1, 31, 33, (7, 7), 2, 3, 1, True),
    "tile-7x7-s2-p1": (2, 3, 1, 16, 16, (7, 7), 2, 1, 1, True),
    # plain kernels
    "direct-dilation": (2, 2, 1, 9, 9, (3, 3), 1, 2, 2, True),
    "direct-3x5": (2, 3, 1, 6, 5, (3, 5), 1, 1, 1, True),
    "direct-stride3": (2, 3, 1, 9, 8, (3, 3), 3, 1, 1, True),
    "direct-1x1": (2, 3, 1, 5, 6, (1, 1), 1, 0, 1, True),
    "direct-1x1-image": (1, 1, 1, 1, 1, (1, 1), 1, 0, 1, True),
    "direct-2x2-s2": (2, 3, 1, 5, 6, (2, 2), 2, 1, 1, True),
    "direct-5x5-d2": (1, 4, 1, 10, 12, (5, 5), 2, 4, 2, True),
}


def _inputs(g, seed):
    """x and go rounded to bf16 (as float32 arrays), float32 w and bias."""
    n, c, m, h, w, (kh, kw), s, p, d, bias = g
    rng = np.random.default_rng(seed)
    x = _bf16_values(rng.standard_normal((n, c, h, w)).astype(f32))
    wt = (rng.standard_normal((c * m, kh, kw)) * 0.5).astype(f32)
    b = rng.standard_normal(c * m).astype(f32) if bias else None
    go = _bf16_values(rng.standard_normal(
        (n, c * m, _out(h, kh, s, p, d), _out(w, kw, s, p, d))).astype(f32))
    return x, wt, b, go


_bf16_values = bf16_round  # the tests' own rounding (bf16_reference), not the library's


def _layer(g, wt, b):
    n, c, m, h, w, k, s, p, d, bias = g
    layer = ut.DWConv2d(c, k, stride=s, padding=p, bias=bias, device="cuda", dilation=d,
                        out_channels=c * m)
    layer.weight = wt
    if bias:
        layer.bias = b
    return layer


def _run(g, x, wt, b, go, dtype):
    """y, dx, dW, db (db None without bias) of a fresh layer on activations of dtype."""
    with _layer(g, wt, b) as layer, ut.tensor(x, "cuda").to(dtype) as tx, \
            ut.tensor(go, "cuda").to(dtype) as tgo:
        y = layer(tx)
        assert y.dtype == dtype, (y.dtype, dtype)
        dx = layer.backward(tgo)
        assert dx.dtype == dtype, (dx.dtype, dtype)
        assert layer.weight.grad.dtype == ut.float32
        out = (y.numpy().copy(), dx.numpy().copy(), layer.weight.grad.numpy().copy(),
               layer.bias.grad.numpy().copy() if g[-1] else None)
        y.close()
        dx.close()
        return out


def _abs_bounds(g, x, wt, go):
    """Per element: sum |w| |x| (y), sum |go| |w| (dx), sum |go| |x| (dW), sum |go| (db) over
    the (output, tap, input) pairs: the scale of each sum's rounding error."""
    n, c, m, h, w, k, s, p, d, bias = g
    ax, aw, ago = (np.abs(a).astype(np.float64) for a in (x, wt, go))
    ay = R.dwconv2d(ax, aw, None, s, p, d)
    adx, adw, adb = R.dwconv2d_backward(ax, aw, s, p, ago, d)
    return ay, adx, adw, adb


def _check(g, seed):
    n, c, m = g[:3]
    x, wt, b, go = _inputs(g, seed)
    y32, dx32, dw32, db32 = _run(g, x, wt, b, go, ut.float32)
    y16, dx16, dw16, db16 = _run(g, x, wt, b, go, ut.bfloat16)
    ay, adx, adw, adb = _abs_bounds(g, x, wt, go)
    tiny = 1e-30
    # one rounding of the float32 result
    err = np.abs(y16.astype(np.float64) - y32)
    assert np.all(err <= U * np.abs(y32) + tiny), "forward: worst %.3g of |y| (bound %.3g)" % (
        np.max(err / np.maximum(np.abs(y32), tiny)), U)
    err = np.abs(dx16.astype(np.float64) - dx32)
    bound = U * np.abs(dx32) + tiny if m == 1 else (m + 1) * U * adx + tiny
    assert np.all(err <= bound), "dx: worst excess %.3g" % np.max(err - bound)
    err = np.abs(dw16.astype(np.float64) - dw32)
    assert np.all(err <= 1e-5 * adw + tiny), "dW: worst excess %.3g" % np.max(err - 1e-5 * adw)
    if db32 is not None:
        err = np.abs(db16.astype(np.float64) - db32)
        assert np.all(err <= 1e-5 * adb + tiny), "db: worst excess %.3g" % np.max(err - 1e-5 * adb)
    # values really changed by the rounding somewhere (the test would pass on float32 output)
    if y32.size >= 16:
        assert not np.array_equal(y16, y32), "forward output is not bf16"
        assert np.array_equal(_bf16_values(y16), y16)


@needs_gpu
def test_bf16_matches_float32_on_every_path():
    """The shapes that pick the strip (pair and one-column), tiled and plain kernels."""
    _each([(name, (i, PATHS[name])) for i, name in enumerate(sorted(PATHS))],
          lambda case: _check(case[1], 1 + case[0]))


@needs_gpu
def test_bf16_matches_float32_on_dilation_multiplier_sample():
    """test_dw_dilation_multiplier.py's sample (every pair of dilation, multiplier, kernel,
    stride, padding) and its edge cases."""
    cases = [(_gid(g), g) for g in GEOMS] + sorted(EDGE.items())
    _each([(name, (i, g)) for i, (name, g) in enumerate(cases)],
          lambda case: _check(case[1], 200 + case[0]))


@needs_gpu
def test_bf16_gradients_accumulate():
    """dW and db += over two backward passes, in float32, as for float32 activations."""
    g = PATHS["strip2-3x3-s1-p1"]
    x, wt, b, go = _inputs(g, 5)
    with _layer(g, wt, b) as layer, ut.tensor(x, "cuda").to(ut.bfloat16) as tx, \
            ut.tensor(go, "cuda").to(ut.bfloat16) as tgo:
        layer(tx).close()
        layer.backward(tgo).close()
        dw1, db1 = layer.weight.grad.numpy().copy(), layer.bias.grad.numpy().copy()
        layer.backward(tgo).close()
        np.testing.assert_allclose(layer.weight.grad.numpy(), 2 * dw1, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(layer.bias.grad.numpy(), 2 * db1, rtol=1e-6, atol=1e-6)


# non-finite values: (name, geometry, where) with where in "w", "x", "go"; the geometries have
# padding, where the fast float32 kernels multiply by zeros and the exact reruns take over
NONFINITE = [
    ("strip2 inf weight", PATHS["strip2-3x3-s1-p1"], "w"),
    ("strip2 s2 inf weight", PATHS["strip2-3x3-s2-p1"], "w"),
    ("strip2 inf go", PATHS["strip2-3x3-s1-p1"], "go"),
    ("strip2 nan x", PATHS["strip2-5x5-s1-p2"], "x"),
    ("strip odd inf weight", PATHS["strip-3x3-s1-odd"], "w"),
    ("strip odd inf go", PATHS["strip-3x3-s2-odd"], "go"),
    ("tile inf weight", PATHS["tile-7x7-s1"], "w"),
    ("tile s2 inf go", PATHS["tile-5x5-s2"], "go"),
    ("tile nan x", PATHS["tile-7x7-s2"], "x"),
    ("direct inf weight", PATHS["direct-dilation"], "w"),
]


@needs_gpu
def test_bf16_nonfinite_like_float32():
    """A NaN or inf: the same non-finite pattern as float32 on the same values (sums over the
    real (output, tap, input) pairs only, so padding never makes a NaN), the finite values
    within the bounds above."""
    def check(case):
        g, where = case
        x, wt, b, go = _inputs(g, 9)
        if where == "w":
            wt.flat[wt.size // 2] = np.inf
        elif where == "x":
            x.flat[x.size // 2] = np.nan
        else:
            go.flat[go.size // 3] = np.inf
        with np.errstate(invalid="ignore"):
            r32 = _run(g, x, wt, b, go, ut.float32)
            r16 = _run(g, x, wt, b, go, ut.bfloat16)
        for what, a32, a16 in zip(("y", "dx", "dW", "db"), r32, r16):
            if a32 is None:
                continue
            assert np.array_equal(np.isnan(a16), np.isnan(a32)), what + ": NaN pattern"
            assert np.array_equal(np.isposinf(a16), np.isposinf(a32)), what + ": +inf pattern"
            assert np.array_equal(np.isneginf(a16), np.isneginf(a32)), what + ": -inf pattern"
            fin = np.isfinite(a32)
            scale = float(np.max(np.abs(a32[fin]))) if fin.any() else 1.0
            rtol = U if what in ("y", "dx") else 1e-5
            np.testing.assert_allclose(a16[fin], a32[fin], rtol=rtol, atol=1e-5 * scale,
                                       err_msg=what)

    _each([(name, (g, where)) for name, g, where in NONFINITE], check)
