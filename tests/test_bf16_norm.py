"""bf16 BatchNorm2d and channel_sum on the GPU (native/cuda/norm.cu, the *_bf16 kernels).

The bf16 kernels are the float32 kernels as templates over the activation type: x and go are
read into float32, everything is computed in float32 in the same order (the same per-channel
walk, workspace and merges) and y and dx are rounded to nearest even when stored; statistics,
running statistics and parameter gradients stay float32. So a bf16 layer given the bf16-rounded
input must give what the float32 layer gives on the same values widened to float32:

  y, dx            the float32 layer's y, dx rounded to nearest even bf16
  dgamma, dbeta,   the float32 layer's, unchanged (float32 both)
  running stats,
  bias gradients

Two tiers check that:
  *_close    within one bf16 unit in the last place (rtol 2**-7: bf16 keeps 8 significant bits,
             so one ulp is at most 2**-7 of the value; rounding alone is at most half of that)
             for y and dx, float32 tolerances for the float32 outputs. A failure here is a
             wrong result.
  *_bitwise  exactly the rounded float32 results. A failure here with the *_close tests passing
             means the results are right but the bf16 path no longer computes what the float32
             path computes in the same order (the design the kernels document), e.g. the core
             calls them differently.
A third check compares with numpy float64 (utensil_ffi.reference) on the widened input.

Shapes: rows H*W a multiple of 8 (112x112, 56x56, 28x28: 16-byte vectors of 8 bf16), of 4 but
not 8 (14x14 = 196, 2x2: 8-byte vectors of 4), and neither (7x7, 5x5, 1x1: one element at a
time); the reductions split the larger ones over several chunks per channel.

Set UTENSIL_EXPECT_CUDA=1 on a GPU machine so that a missing GPU fails instead of skipping.
"""

import os

import numpy as np
import pytest

import utensil_ffi as ut
from bf16_reference import bf16_round as _bf16_round
from tolerances import assert_close
from utensil_ffi import reference as R

EXPECT = os.environ.get("UTENSIL_EXPECT_CUDA") == "1"
HAVE = "cuda" in ut.devices()
pytestmark = pytest.mark.skipif(not HAVE and not EXPECT, reason="no cuda device")

ULP = 2.0 ** -7  # one bf16 ulp, relative to the value, at most
EPS = 1e-5

SHAPES = [
    pytest.param((2, 8, 112, 112), id="112x112-vec8"),
    pytest.param((4, 16, 56, 56), id="56x56-vec8"),
    pytest.param((4, 96, 28, 28), id="28x28-vec8-c96"),
    pytest.param((8, 24, 14, 14), id="14x14-vec4"),
    pytest.param((3, 5, 2, 2), id="2x2-vec4"),
    pytest.param((8, 32, 7, 7), id="7x7-scalar"),
    pytest.param((2, 3, 5, 5), id="5x5-scalar"),
    pytest.param((16, 24, 1, 1), id="1x1-scalar"),
]
def bf16_round(a):
    """float32 values rounded to the nearest bf16, ties to even (finite values only)."""
    assert np.all(np.isfinite(a))
    return _bf16_round(a)


# every fused activation: NONE, RELU and RELU6 take the kernels' cap path, the others their
# GEN instantiations (norm.cu)
ACTS = [pytest.param(None, id="plain")] + [
    pytest.param(a, id=a) for a in ("relu6", "relu", "silu", "hardswish", "hardsigmoid",
                                    "sigmoid", "gelu", "gelu_tanh")]
# float64 forward and backward(go, z) of each, and where its derivative jumps
F64 = R.ACTIVATIONS
KINKS = {"relu6": (0.0, 6.0), "relu": (0.0,), "hardswish": (-3.0, 3.0),
         "hardsigmoid": (-3.0, 3.0)}
MODES = [pytest.param(True, id="train"), pytest.param(False, id="eval")]


def _bf16(a):
    """A bf16 CUDA tensor holding a rounded, and the float32 values it holds."""
    with ut.tensor(a, "cuda") as f:
        t = f.to(ut.bfloat16)
    assert t.dtype == ut.bfloat16
    v = t.numpy()
    assert v.dtype == np.float32
    np.testing.assert_array_equal(v, bf16_round(a),
                                  err_msg="the float32 -> bf16 cast does not round to nearest even")
    return t, v


def _data(shape, seed):
    rng = np.random.default_rng(seed)
    n, c = shape[:2]
    # per-channel offsets (the statistics must not cancel) and a wide gamma: with relu6 many
    # outputs land below 0 and above 6, so the mask matters
    off = rng.uniform(-4.0, 4.0, (1, c, 1, 1))
    x = (rng.standard_normal(shape) * 3 + off).astype(np.float32)
    g = rng.uniform(0.5, 5.0, c).astype(np.float32)
    b = rng.uniform(-1.0, 4.0, c).astype(np.float32)
    rm = rng.normal(0.0, 2.0, c).astype(np.float32)
    rv = rng.uniform(4.0, 12.0, c).astype(np.float32)
    go = rng.standard_normal(shape).astype(np.float32)
    return x, g, b, rm, rv, go


def _run(x, go, g, b, rm, rv, act, training, layer=ut.BatchNorm2d, **kw):
    """forward and backward of a fresh layer on tensors x, go -> dict of numpy results."""
    c = x.shape[1]
    bn = layer(c, momentum=0.3, device="cuda", activation=act, **kw)
    try:
        bn.weight, bn.bias = g, b
        bn.running_mean, bn.running_var = rm, rv
        bn.train(training)
        y = bn(x)
        dx = bn.backward(go)
        try:
            out = {"y": y.numpy(), "dx": dx.numpy(),
                   "dgamma": bn.weight.grad.numpy().copy(), "dbeta": bn.bias.grad.numpy().copy(),
                   "running_mean": bn.running_mean.numpy().copy(),
                   "running_var": bn.running_var.numpy().copy()}
            out["dtypes"] = (y.dtype, dx.dtype, bn.weight.grad.dtype, bn.running_mean.dtype)
        finally:
            y.close()
            dx.close()
    finally:
        bn.close()
    return out


def _both(shape, act, training, seed=0, layer=ut.BatchNorm2d, **kw):
    """The bf16 layer on bf16 x, go, and the float32 layer on the same values widened."""
    x, g, b, rm, rv, go = _data(shape, seed)
    xb, xr = _bf16(x)
    gb, gr = _bf16(go)
    with xb, gb:
        half = _run(xb, gb, g, b, rm, rv, act, training, layer, **kw)
    with ut.tensor(xr, "cuda") as xf, ut.tensor(gr, "cuda") as gf:
        full = _run(xf, gf, g, b, rm, rv, act, training, layer, **kw)
    assert half["dtypes"] == (ut.bfloat16, ut.bfloat16, ut.float32, ut.float32), half["dtypes"]
    assert full["dtypes"][0] == ut.float32
    return half, full, (xr, gr, g, b, rm, rv)


def _check_close(half, full, what):
    for k in ("y", "dx"):
        scale = float(np.max(np.abs(full[k])))
        # one bf16 ulp of each value, and float32 noise near zero (not expected: see the doc)
        np.testing.assert_allclose(half[k], full[k], rtol=ULP, atol=1e-6 * max(scale, 1.0),
                                   err_msg="%s %s" % (what, k))
    for k in ("dgamma", "dbeta", "running_mean", "running_var"):
        scale = float(np.max(np.abs(full[k])))
        np.testing.assert_allclose(half[k], full[k], rtol=1e-5, atol=1e-5 * max(scale, 1.0),
                                   err_msg="%s %s" % (what, k))


def _check_bitwise(half, full, what):
    for k in ("y", "dx"):
        want = bf16_round(full[k])
        bad = np.flatnonzero(half[k] != want)
        assert bad.size == 0, "%s %s: %d of %d differ from the rounded float32 result, first at " \
            "%d: %r, want %r (float32 %r)" % (what, k, bad.size, want.size, bad[0],
                                              half[k].flat[bad[0]], want.flat[bad[0]],
                                              full[k].flat[bad[0]])
    for k in ("dgamma", "dbeta", "running_mean", "running_var"):
        np.testing.assert_array_equal(half[k], full[k], err_msg="%s %s" % (what, k))


@pytest.mark.parametrize("training", MODES)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("shape", SHAPES)
def test_batchnorm2d_bf16_close_to_float32(shape, act, training):
    half, full, _ = _both(shape, act, training)
    _check_close(half, full, "bn")
    if act == "relu6":  # the masks really matter here, and bf16 keeps 0 and 6 exact
        y = half["y"]
        assert 0.0 <= y.min() and y.max() <= 6.0
        assert 0.02 < np.mean((y == 0.0) | (y == 6.0)) < 0.98


@pytest.mark.parametrize("training", MODES)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("shape", SHAPES)
def test_batchnorm2d_bf16_is_float32_rounded_bitwise(shape, act, training):
    half, full, _ = _both(shape, act, training)
    _check_bitwise(half, full, "bn")


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[3], SHAPES[5], SHAPES[7]])
def test_batchnorm2d_bf16_training_against_float64(shape, act):
    half, _, (xr, gr, g, b, rm, rv) = _both(shape, act, True, seed=1)
    x64, g64 = xr.astype(np.float64), gr.astype(np.float64)
    z, mean, var = R.batchnorm2d_train(x64, g.astype(float), b.astype(float), EPS)
    y, gz = F64[act][0](z), F64[act][1](g64, z)
    rdx, rdg, rdb = R.batchnorm2d_backward(x64, g.astype(float), EPS, gz)
    count = shape[0] * shape[2] * shape[3]
    rrm, rrv = R.batchnorm2d_running_stats(rm.astype(float), rv.astype(float), mean, var, count,
                                           0.3)
    # bf16 outputs: one ulp of the largest value (the scaled atol), float32 for the rest; a
    # value within float32 noise of a kink (relu6's 0 and 6, hardswish's -3 and 3) may take
    # the derivative of the other side, so dx is compared where z is clear of them
    clear = np.abs(z) > 1e-3
    for k in KINKS.get(act, ()):
        clear &= np.abs(z - k) > 1e-3
    assert_close("bf16 bn forward", half["y"], y, rtol=ULP, atol=ULP)
    assert_close("bf16 bn backward dx", half["dx"][clear], rdx[clear], rtol=ULP, atol=ULP)
    assert_close("bf16 bn backward dgamma", half["dgamma"], rdg, rtol=1e-4, atol=1e-4)
    assert_close("bf16 bn backward dbeta", half["dbeta"], rdb, rtol=1e-4, atol=1e-4)
    assert_close("bf16 bn running_mean", half["running_mean"], rrm, rtol=1e-5, atol=1e-5)
    assert_close("bf16 bn running_var", half["running_var"], rrv, rtol=1e-4, atol=1e-5)


class _Alone:
    """A process group of one rank: the sums over the ranks are the rank's own."""

    def all_reduce(self, t, op="sum"):
        pass


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[3], SHAPES[5]])
def test_sync_batchnorm_bf16_backward_halves(shape, act):
    # SyncBatchNorm's backward runs bn_bwd_sums_bf16, then bn_bwd_dx_bf16 with the summed count
    half, full, _ = _both(shape, act, True, seed=2, layer=ut.SyncBatchNorm,
                          process_group=_Alone())
    _check_close(half, full, "sync bn")
    _check_bitwise(half, full, "sync bn")


# ---- channel_sum: the bias gradient of Linear, Conv2d and DWConv2d on bf16 grad_out ----------

def _bias_grad(make, x, go):
    layer = make()
    try:
        y = layer(x)
        y.close()
        layer.backward(go).close()
        return layer.bias.grad.numpy().copy(), layer.bias.grad.dtype
    finally:
        layer.close()


BIAS_CASES = [
    pytest.param(lambda: ut.Linear(12, 10, device="cuda"), (37, 12), (37, 10), id="linear"),
    pytest.param(lambda: ut.Conv2d(8, 16, 1, device="cuda"), (4, 8, 7, 7), (4, 16, 7, 7),
                 id="conv2d-1x1-7x7"),
    pytest.param(lambda: ut.Conv2d(3, 8, 3, padding=1, device="cuda"), (2, 3, 56, 56),
                 (2, 8, 56, 56), id="conv2d-3x3-56x56"),
    pytest.param(lambda: ut.DWConv2d(8, 3, padding=1, device="cuda"), (2, 8, 28, 28),
                 (2, 8, 28, 28), id="dwconv2d-28x28"),
]


@pytest.mark.parametrize("make,xshape,yshape", BIAS_CASES)
def test_bias_gradient_bf16_channel_sum(make, xshape, yshape):
    rng = np.random.default_rng(5)
    x = rng.standard_normal(xshape).astype(np.float32)
    go = (rng.standard_normal(yshape) * 2 + 0.5).astype(np.float32)
    xb, xr = _bf16(x)
    gb, gr = _bf16(go)
    with xb, gb:
        try:
            got, dt = _bias_grad(make, xb, gb)
        except ut.ArgumentError as e:  # the layer itself does not take bf16 (yet)
            pytest.skip("the layer refuses bf16: %s" % e)
    with ut.tensor(xr, "cuda") as xf, ut.tensor(gr, "cuda") as gf:
        want, _ = _bias_grad(make, xf, gf)
    assert dt == ut.float32
    axes = (0,) + tuple(range(2, len(yshape)))
    assert_close("bf16 bias grad", got, gr.astype(np.float64).sum(axis=axes), rtol=1e-5,
                 atol=1e-5)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    # the same walk over the same values: the float32 layer's sums to the bit
    np.testing.assert_array_equal(got, want)
