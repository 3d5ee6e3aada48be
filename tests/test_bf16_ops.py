"""bf16 activations on the GPU: the casts, the elementwise ops, conv2d and Linear.

Every input is a bf16 value (numpy float32 arrays rounded by ``bf16_round`` of
bf16_reference.py, a reference of round-to-nearest-even on float32 bit patterns), so the float64
reference and the float32 run of the same layer see exactly the numbers the bf16 run sees; what
differs is only where bf16 rounds.

Tolerances, from what the kernels do (float32 arithmetic, bf16 stores rounded to nearest even,
unit roundoff u = 2**-8 relative):
- moves and one-rounding ops (cast, transpose, relu/relu6 and their backward, add, scale, bias
  add, avgpool backward) are exact: the bits must equal the numpy reference's;
- reductions into a bf16 output (avgpool forward): u |ref| for the rounding plus float32
  accumulation, 1e-5 of the sum of |terms|;
- GEMM outputs in bf16 (conv2d's y and dx, Linear's y and dx): u |ref| for the final rounding plus
  u |ref|_abs for one intermediate bf16 rounding (the GEMM's output before the bias add, conv2d's
  columns of dx before col2im sums them), plus 1e-5 |ref|_abs for the float32 accumulation on
  tensor cores, where |ref|_abs is the same op on |x|, |w|, |b|, |grad_out| (it bounds every
  partial sum);
- float32 results of bf16 operands (dW, db): bf16 times bf16 is exact in float32, so only
  float32 accumulation remains: 1e-4 |ref|_abs (a bf16 rounding would be 40 times that).

CUDA only: the tests skip without a GPU, and fail instead where UTENSIL_EXPECT_CUDA=1. The GEMM
tests need cuBLAS (the own GEMM kernels are float32 only); UTENSIL_EXPECT_CUBLAS=1 makes a
missing cuBLAS fail them instead of skipping.
"""

import os

import numpy as np
import pytest

import utensil_ffi as ut
from bf16_reference import bf16_round
from utensil_ffi import functional as F
from utensil_ffi.testing import optable
from utensil_ffi import reference as R
from utensil_ffi._lib import lib

EXPECT = os.environ.get("UTENSIL_EXPECT_CUDA") == "1"
EXPECT_CUBLAS = os.environ.get("UTENSIL_EXPECT_CUBLAS") == "1"
HAVE = "cuda" in ut.devices()
needs_gpu = pytest.mark.skipif(not HAVE and not EXPECT, reason="no cuda device")
needs_cublas = pytest.mark.skipif(
    not (HAVE or EXPECT)
    or not (EXPECT_CUBLAS or (HAVE and ut.backends()["cuda"].get("gemm") == "cublas")),
    reason="bf16 GEMMs need cuBLAS, not available here")
U = 2.0 ** -8  # bf16's unit roundoff


@pytest.fixture(autouse=True)
def _defaults():
    yield
    ut.set_float32_matmul_precision("highest")
    if HAVE:
        lib.ut_cublas_enable(True)  # back to cuBLAS where there is one (an error where not)
        lib.ut_clear_error()


# ---- the reference ------------------------------------------------------------------------------

def randb(rng, shape, scale=1.0):
    """random bf16 values (float32 array)"""
    return bf16_round(rng.standard_normal(shape) * scale)


def on_gpu(a):
    """a bf16 tensor on the GPU holding a (bf16 values already: the cast is exact)"""
    with ut.tensor(np.asarray(a, np.float32), "cuda") as t:
        return t.to(ut.bfloat16)


def host(t):
    """values of a tensor (bf16 ones as float32), with its dtype checked to be bf16"""
    assert t.dtype == ut.bfloat16, t.dtype
    return np.asarray(t.numpy(), np.float32)


def assert_bits(got, want, what):
    """equal to the bit (a NaN matches any NaN; 0 and -0 differ)"""
    got = np.asarray(got, np.float32)
    want = np.asarray(want, np.float32)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan), what
    g, w = got[~nan].view(np.uint32), want[~nan].view(np.uint32)
    bad = np.flatnonzero(g != w)
    assert bad.size == 0, "%s: %d of %d differ, first at %d: got %r, want %r" % (
        what, bad.size, g.size, bad[0], got[~nan][bad[0]], want[~nan][bad[0]])


def assert_within(got, ref, tol, what):
    """|got - ref| <= tol elementwise (tol an array or a scalar)"""
    got = np.asarray(got, np.float64)
    ref = np.asarray(ref, np.float64)
    assert got.shape == ref.shape, (what, got.shape, ref.shape)
    err = np.abs(got - ref)
    tol = np.broadcast_to(np.asarray(tol, np.float64), ref.shape) + 1e-30
    bad = np.flatnonzero(err > tol)
    assert bad.size == 0, "%s: %d of %d off, worst %.3g x the tolerance at %d (got %r, ref %r)" % (
        what, bad.size, err.size, float(np.max(err / tol)), bad[0], got.flat[bad[0]],
        ref.flat[bad[0]])


def gemm_tol(ref, ref_abs):
    """a bf16 GEMM output: final and one intermediate rounding, float32 accumulation"""
    return U * np.abs(ref) + (U + 1e-5) * ref_abs + 1e-30


SIZES = [1, 7, 8, 9, 4096 + 5, (1 << 20) + 3]  # below, at and past one 8-value group; tails


# ---- casts --------------------------------------------------------------------------------------

def _cast_cases(rng):
    """random magnitudes, ties both ways, both zeros, subnormals, the overflow edge, inf, NaN"""
    hi = rng.integers(0, 1 << 16, 4096, dtype=np.uint64)
    lows = np.array([0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF], np.uint64)
    ties = ((hi[:, None] << 16) | lows[None, :]).reshape(-1) & 0xFFFFFFFF
    ties = ties.astype(np.uint32).view(np.float32)
    special = np.array([0.0, -0.0, 1e-40, -1e-40, 1e-45, 1.17e-38, 3.3895e38, 3.4028235e38,
                        -3.4028235e38, np.inf, -np.inf, np.nan, 1.0, -1.0, 255.5, 1.00390625,
                        1.01171875], np.float32)
    wide = (rng.standard_normal(5000) * 10.0 ** rng.integers(-30, 30, 5000)).astype(np.float32)
    return np.concatenate([ties, special, wide])


def test_bf16_round_reference():
    """the numpy reference itself, on hand-checked values"""
    x = np.array([1.0, 1.00390625, 1.005859375, 1.01171875, 3.4028235e38, -np.inf, 1e-45],
                 np.float32)
    # 1 + 2^-8 is a tie -> 1 (even); 1 + 1.5*2^-8 -> 1 + 2^-7; 1 + 3*2^-8 is a tie -> 1 + 2^-6
    want = np.array([1.0, 1.0, 1.0078125, 1.015625, np.inf, -np.inf, 0.0], np.float32)
    assert_bits(bf16_round(x), want, "bf16_round")
    assert np.isnan(bf16_round(np.array([np.nan], np.float32)))[0]


@needs_gpu
def test_cast_rounds_to_nearest_even(rng):
    x = _cast_cases(rng)
    want = bf16_round(x)
    with ut.tensor(x, "cuda") as t:
        b = t.to(ut.bfloat16)
        assert b.dtype == ut.bfloat16 and t.dtype == ut.float32
        assert b.device == "cuda" and b.shape == t.shape
        assert_bits(host(b), want, "cast float32 -> bf16 on the GPU")
        f = b.float()
        assert f.dtype == ut.float32
        assert_bits(f.numpy(), want, "cast bf16 -> float32 on the GPU")
        # bf16 -> bf16 (a copy) and float32 -> bf16 again: the same bits
        assert_bits(host(b.to(ut.bfloat16)), want, "cast bf16 -> bf16")
        assert_bits(host(f.bfloat16()), want, "round trip float32 -> bf16 -> float32 -> bf16")
        # the same values rounded on the host and uploaded
        with ut.tensor(x).to(ut.bfloat16) as c:
            assert_bits(host(c), want, "cast float32 -> bf16 on the CPU")
            with c.to("cuda") as g:
                assert_bits(host(g), want, "bf16 uploaded")


@needs_gpu
@pytest.mark.parametrize("n", SIZES)
def test_cast_sizes(rng, n):
    """every length: 8-value groups, the tail after them, a length below one group"""
    x = (rng.standard_normal(n) * 3).astype(np.float32)
    want = bf16_round(x)
    with ut.tensor(x, "cuda") as t, t.to(ut.bfloat16) as b, b.to(ut.float32) as f:
        assert_bits(host(b), want, "cast to bf16, n=%d" % n)
        assert_bits(f.numpy(), want, "cast to float32, n=%d" % n)


# ---- elementwise --------------------------------------------------------------------------------

def _relu_ref(x, cap):
    v = np.where(x > 0, x, np.float32(0)).astype(np.float32)
    return np.where(v > cap, np.float32(cap), v).astype(np.float32) if cap > 0 else v


def _relu_bwd_ref(go, x, cap):
    stop = (x <= 0) | ((x >= cap) if cap > 0 else False)  # NaN x: not stopped, passes go
    return np.where(stop, np.float32(0), go).astype(np.float32)


@needs_gpu
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("cap", [0.0, 6.0])
def test_relu_forward_backward(rng, n, cap):
    x = randb(rng, n, 4.0)
    x[: min(n, 4)] = np.array([0.0, -0.0, 6.0, 5.96875], np.float32)[: min(n, 4)]
    go = randb(rng, n)
    xn = x.copy()
    if n > 8:
        xn[5] = np.nan  # relu_backward passes grad_out through a NaN input
    fwd, bwd = (ut.relu6, ut.relu6_backward) if cap else (ut.relu, ut.relu_backward)
    with on_gpu(x) as xb, on_gpu(xn) as xnb, on_gpu(go) as gb:
        assert_bits(host(fwd(xb)), _relu_ref(x, cap), "relu%s forward" % ("6" if cap else ""))
        assert_bits(host(bwd(gb, xnb)), _relu_bwd_ref(go, xn, cap),
                    "relu%s backward" % ("6" if cap else ""))


@needs_gpu
@pytest.mark.parametrize("n", SIZES)
def test_add_and_scale(rng, n):
    a, b = randb(rng, n), randb(rng, n, 0.3)
    want_sum = bf16_round(a + b)  # float32 sum, then one rounding
    with on_gpu(a) as ab, on_gpu(b) as bb:
        assert_bits(host(ut.add(ab, bb)), want_sum, "add")
        ab.add_(bb)
        assert_bits(host(ab), want_sum, "add_")
        ab.mul_(0.7)
        assert_bits(host(ab), bf16_round(want_sum * np.float32(0.7)), "scale (mul_)")
        F.scale_(ab, -3.0)
        assert_bits(host(ab), bf16_round(bf16_round(want_sum * np.float32(0.7)) * np.float32(-3)),
                    "scale_")


@needs_gpu
@pytest.mark.parametrize("shape, d0, d1", [((3, 5, 7), 0, 2), ((2, 3, 4, 5), 1, 3),
                                           ((9, 17), 0, 1), ((2, 1, 8, 8), 2, 3),
                                           # rows of 16+ units, moved a warp per row: the
                                           # merged pointwise regroups at 14^2 and 7^2
                                           ((4, 6, 196), 0, 1), ((3, 5, 49), 0, 1),
                                           ((3, 4, 5, 64), 0, 2), ((2, 3, 33, 35), 0, 1)])
def test_transpose(rng, shape, d0, d1):
    x = randb(rng, shape)
    with on_gpu(x) as xb:
        assert_bits(host(ut.transpose(xb, d0, d1)), np.swapaxes(x, d0, d1), "transpose")


@needs_gpu
@pytest.mark.parametrize("shape", [(3, 5, 7, 7), (2, 4, 4, 4), (5, 11), (2, 3, 1, 1),
                                   (4, 32, 14, 14), (1, 7, 3, 3)])
def test_bias_add(rng, shape):
    """inner sizes that are and are not multiples of 8, so 8-value groups cross channels"""
    x = randb(rng, shape)
    bias = rng.standard_normal(shape[1]).astype(np.float32)  # float32, not rounded
    bshape = (1, shape[1]) + (1,) * (len(shape) - 2)
    want = bf16_round(x + bias.reshape(bshape))
    with on_gpu(x) as xb, ut.tensor(bias, "cuda") as bt:
        F.bias_add_(xb, bt)
        assert_bits(host(xb), want, "bias_add")


@needs_gpu
@pytest.mark.parametrize("shape", [(2, 3, 7, 7), (4, 16, 1, 1), (2, 5, 32, 33), (1, 1, 1, 300)])
def test_global_avgpool(rng, shape):
    n, c, h, w = shape
    x = randb(rng, shape, 2.0)
    x64 = x.astype(np.float64)
    ref = x64.mean(axis=(2, 3))
    ref_abs = np.abs(x64).mean(axis=(2, 3))
    go = randb(rng, (n, c))
    want_dx = bf16_round(np.broadcast_to((go.astype(np.float64) / (h * w)).astype(np.float32)
                                         [:, :, None, None], shape))
    with on_gpu(x) as xb, on_gpu(go) as gb:
        y = host(ut.global_avg_pool2d(xb))
        assert_within(y, ref, U * np.abs(ref) + 1e-5 * ref_abs, "global_avgpool2d forward")
        assert_bits(host(ut.global_avg_pool2d_backward(gb, h, w)), want_dx,
                    "global_avgpool2d backward")


# ---- conv2d and Linear (GEMMs: cuBLAS) ----------------------------------------------------------

def _layer_run(layer, x, go):
    """forward and backward of layer on x and go (bf16 values) in the given dtype; returns
    y, dx (as float arrays), dW, db and their dtypes"""
    for p in layer.parameters():
        if p.grad is not None:
            p.grad.zero_()
    y = layer(x)
    dx = layer.backward(go)
    out = (y.numpy(), dx.numpy(), layer.weight.grad.numpy(), layer.bias.grad.numpy())
    dtypes = (y.dtype, dx.dtype, layer.weight.grad.dtype, layer.bias.grad.dtype)
    return out, dtypes


def _check_layer(name, layer, x, go, refs, abs_refs):
    """bf16 run against float64 (refs) and against the float32 run on the same values"""
    with on_gpu(x) as xb, on_gpu(go) as gb:
        got, dtypes = _layer_run(layer, xb, gb)
    assert dtypes == (ut.bfloat16, ut.bfloat16, ut.float32, ut.float32), dtypes
    with ut.tensor(x, "cuda") as xf, ut.tensor(go, "cuda") as gf:
        f32, f32_dtypes = _layer_run(layer, xf, gf)
    assert f32_dtypes == (ut.float32,) * 4
    for what, g, f, ref, ra in zip(("y", "dx"), got[:2], f32[:2], refs[:2], abs_refs[:2]):
        tol = gemm_tol(ref, ra)
        assert_within(g, ref, tol, "%s %s vs float64" % (name, what))
        assert_within(g, f, tol + 1e-5 * ra, "%s %s vs float32" % (name, what))
    for what, g, f, ref, ra in zip(("dW", "db"), got[2:], f32[2:], refs[2:], abs_refs[2:]):
        assert_within(g, ref, 1e-4 * ra + 1e-30, "%s %s vs float64" % (name, what))
        assert_within(g, f, 2e-4 * ra + 1e-30, "%s %s vs float32" % (name, what))


# (n, c, h, w, o, (kh, kw), stride, pad): conv2d's samples marked "bf16_gemm" in the op table
# (utensil_ffi/testing/optable.py, where the cuBLAS plans each one exercises are listed): 3x3 stride 2 on
# im2col with few and 64 channels, the strided stem, kh != kw, 1x1 pointwise over planes of
# 7x7, 14x14 and 9x11 (one GEMM over the batch), odd sizes
CONV_SHAPES = [(g["n"], g["c"], g["h"], g["w"], g["o"], (g["kh"], g["kw"]), g["stride"], g["pad"])
               for g in (s.geom for s in optable.OP["conv2d"].samples_for("bf16_gemm"))]


@needs_cublas
@pytest.mark.parametrize("shape", CONV_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_conv2d_bf16(rng, shape):
    n, c, h, w_, o, (kh, kw), s, p = shape
    x = randb(rng, (n, c, h, w_))
    w = randb(rng, (o, c, kh, kw), 1.0 / np.sqrt(c * kh * kw))
    b = randb(rng, o, 0.1)
    ho, wo = (h + 2 * p - kh) // s + 1, (w_ + 2 * p - kw) // s + 1
    go = randb(rng, (n, o, ho, wo))
    x64, w64, b64, go64 = (a.astype(np.float64) for a in (x, w, b, go))
    refs = (R.conv2d(x64, w64, b64, s, p),) + tuple(R.conv2d_backward(x64, w64, s, p, go64))
    ax, aw, ab, ag = (np.abs(a) for a in (x64, w64, b64, go64))
    abs_refs = (R.conv2d(ax, aw, ab, s, p),) + tuple(R.conv2d_backward(ax, aw, s, p, ag))
    with ut.Conv2d(c, o, (kh, kw), s, p, device="cuda") as layer:
        layer.weight, layer.bias = w, b
        _check_layer("conv2d %s" % (shape,), layer, x, go, refs, abs_refs)


# (n, i, o): linear's samples marked "bf16_gemm" in the op table
LINEAR_SHAPES = [(s.geom["n"], s.geom["i"], s.geom["o"])
                 for s in optable.OP["linear"].samples_for("bf16_gemm")]


def _linear_case(rng, n, i, o):
    x, go = randb(rng, (n, i)), randb(rng, (n, o))
    w, b = randb(rng, (o, i), 1.0 / np.sqrt(i)), randb(rng, o, 0.1)
    return x, w, b, go


@needs_cublas
@pytest.mark.parametrize("n, i, o", LINEAR_SHAPES)
def test_linear_bf16(rng, n, i, o):
    x, w, b, go = _linear_case(rng, n, i, o)
    x64, w64, b64, go64 = (a.astype(np.float64) for a in (x, w, b, go))
    refs = (R.linear(x64, w64, b64),) + tuple(R.linear_backward(x64, w64, go64))
    ax, aw, ab, ag = (np.abs(a) for a in (x64, w64, b64, go64))
    abs_refs = (R.linear(ax, aw, ab),) + tuple(R.linear_backward(ax, aw, ag))
    with ut.Linear(i, o, device="cuda") as layer:
        layer.weight, layer.bias = w, b
        _check_layer("linear %dx%dx%d" % (n, i, o), layer, x, go, refs, abs_refs)


@needs_cublas
def test_float32_gradients_accumulate_in_float32(rng):
    """dW += go^T x from bf16 operands into the float32 gradient (beta = 1): two identical
    passes give exactly twice one pass, so the accumulation never went through bf16"""
    x, w, b, go = _linear_case(rng, 48, 200, 24)
    with ut.Linear(200, 24, device="cuda") as layer, on_gpu(x) as xb, on_gpu(go) as gb:
        layer.weight, layer.bias = w, b
        layer.weight.grad.zero_()
        layer(xb)
        layer.backward(gb)
        once = layer.weight.grad.numpy().copy()
        layer(xb)
        layer.backward(gb)
        twice = layer.weight.grad.numpy()
        assert layer.weight.grad.dtype == ut.float32
        scale = float(np.max(np.abs(once)))
        np.testing.assert_allclose(twice, 2 * once, rtol=0, atol=2.0 ** -22 * scale)
    n, c, o = 4, 8, 16
    xc, gc = randb(rng, (n, c, 10, 10)), randb(rng, (n, o, 5, 5))
    with ut.Conv2d(c, o, 3, 2, 1, device="cuda") as conv, on_gpu(xc) as xb, on_gpu(gc) as gb:
        conv.weight.grad.zero_()
        conv(xb)
        conv.backward(gb)
        once = conv.weight.grad.numpy().copy()
        conv(xb)
        conv.backward(gb)
        scale = float(np.max(np.abs(once)))
        np.testing.assert_allclose(conv.weight.grad.numpy(), 2 * once, rtol=0,
                                   atol=2.0 ** -22 * scale)


@needs_cublas
def test_tf32_setting_does_not_apply_to_bf16(rng):
    """bf16 operands multiply exactly in float32 at every float32_matmul_precision"""
    x, w, b, go = _linear_case(rng, 64, 512, 40)
    results = []
    for precision in ("highest", "high"):
        ut.set_float32_matmul_precision(precision)
        with ut.Linear(512, 40, device="cuda") as layer, on_gpu(x) as xb, on_gpu(go) as gb:
            layer.weight, layer.bias = w, b
            results.append(_layer_run(layer, xb, gb)[0])
    for what, a, c in zip(("y", "dx", "dW", "db"), *results):
        assert_bits(c, a, "linear %s at 'high' vs 'highest'" % what)


@needs_gpu
def test_bf16_gemm_without_cublas_says_why(rng):
    """the own GEMM kernels are float32 only: a bf16 GEMM on them is an error naming cuBLAS,
    never float kernels run on bf16 data; float32 keeps working"""
    x, w, b, go = _linear_case(rng, 4, 16, 8)
    ut.preferred_blas_library("own")
    with ut.Linear(16, 8, device="cuda") as layer, on_gpu(x) as xb:
        layer.weight, layer.bias = w, b
        with pytest.raises(ut.DeviceError, match="cuBLAS"):
            layer(xb)
        with ut.tensor(x, "cuda") as xf:
            y = layer(xf).numpy()
        np.testing.assert_allclose(y, R.linear(x.astype(float), w.astype(float), b.astype(float)),
                                   rtol=1e-5, atol=1e-5)
