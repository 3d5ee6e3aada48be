"""Squeeze-and-excitation's channel scale, ConvNeXt's layer scale and LayerNorm2d, and the
SqueezeExcitation block (issue 30), against float64 numpy and PyTorch (torchvision is not
installed: its LayerNorm2d and SqueezeExcitation are written out here with torch ops).

The op table (utensil_ffi/testing/optable.py: channel_scale, layer_scale, layernorm2d) adds the
finite-difference gradient checks, the bf16 rule, copies, GPU-vs-CPU and the wrong calls; here
the PyTorch comparisons, the shapes the table does not sample, accumulation, determinism, the
caches, and the block.
"""

import copy

import numpy as np
import pytest

import utensil_ffi as ut
from utensil_ffi import functional as F
from utensil_ffi._lib import ffi, lib
from utensil_ffi.nn import activation as _activation
from utensil_ffi.nn.module import _Stateless
from utensil_ffi.testing import reference as R

BF16_STEP = 2.0 ** -8


def _f32(rng, *shape, scale=1.0, shift=0.0):
    return (rng.standard_normal(shape) * scale + shift).astype(np.float32)


def _close(got, want, rtol=2e-5, atol=2e-6):
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=rtol, atol=atol)


def _round_bf16(a):
    """float32 values that bf16 holds exactly (nearest even)."""
    b = np.ascontiguousarray(a, np.float32).view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return b.astype(np.uint32).view(np.float32)


class _Sigmoid(_Stateless):
    """A test-only sigmoid layer (ut.Sigmoid comes from another branch), computed on the host
    in float64 and returned in the input's dtype: enough to drive SqueezeExcitation."""

    @staticmethod
    def _as(values, like):
        t = ut.Tensor(values.astype(np.float32), like.device)
        out = t.to(dtype=like.dtype)
        if out is not t:
            t.close()
        return out

    @staticmethod
    def _op(x):
        a = x.numpy().astype(np.float64)
        return _Sigmoid._as(1.0 / (1.0 + np.exp(-a)), x)

    @staticmethod
    def _bwd_op(g, x):
        s = 1.0 / (1.0 + np.exp(-x.numpy().astype(np.float64)))
        return _Sigmoid._as(g.numpy().astype(np.float64) * s * (1.0 - s), x)


# -- channel_scale ------------------------------------------------------------------------------
@pytest.mark.parametrize("shape, s_shape", [
    ((2, 3, 4, 5), (2, 3, 1, 1)),
    ((2, 3, 4, 5), (2, 3)),
    ((1, 7, 1, 1), (1, 7, 1, 1)),
    ((3, 5, 7), (3, 5)),          # [N, C, L]
    ((4, 6), (4, 6)),             # [N, C]: no positions
    ((2, 40, 13, 11), (2, 40, 1, 1)),
])
def test_channel_scale_matches_torch(device, torch, rng, shape, s_shape):
    x, s, go = _f32(rng, *shape), _f32(rng, *s_shape), _f32(rng, *shape)
    tx = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    ts = torch.tensor(s, dtype=torch.float64, requires_grad=True)
    ty = tx * ts.reshape(s_shape[:2] + (1,) * (len(shape) - 2))
    ty.backward(torch.tensor(go, dtype=torch.float64))
    with ut.tensor(x, device) as xt, ut.tensor(s, device) as st, ut.tensor(go, device) as gt:
        with F.channel_scale(xt, st) as y:
            assert y.shape == shape and y.device == device
            _close(y.numpy(), ty.detach().numpy())
            _close(y.numpy(), R.channel_scale(x.astype(np.float64), s.astype(np.float64)))
        dx, ds = F.channel_scale_backward(gt, xt, st)
        with dx, ds:
            assert ds.shape == s_shape and dx.shape == shape
            _close(dx.numpy(), tx.grad.numpy())
            _close(ds.numpy(), ts.grad.numpy(), rtol=1e-5, atol=1e-5)
        none, ds2 = F.channel_scale_backward(gt, xt, st, input_grad=False)
        with ds2:
            assert none is None
            _close(ds2.numpy(), ts.grad.numpy(), rtol=1e-5, atol=1e-5)


def test_channel_scale_c_backward_skips_what_is_not_asked(device, rng):
    """ut_channel_scale_backward with dx or ds NULL makes only the other; both NULL is a no-op;
    a refused call sets both outputs NULL."""
    with ut.tensor(_f32(rng, 2, 3, 4, 4), device) as x, ut.tensor(_f32(rng, 2, 3), device) as s:
        out = ffi.new("ut_tensor*[2]")
        assert lib.ut_channel_scale_backward(x.ptr, x.ptr, s.ptr, out, ffi.NULL) == 0
        assert out[0] != ffi.NULL
        lib.ut_free(out[0])
        assert lib.ut_channel_scale_backward(x.ptr, x.ptr, s.ptr, ffi.NULL, ffi.NULL) == 0
        out[0] = out[1] = ffi.cast("ut_tensor*", 1)  # garbage the call must overwrite
        assert lib.ut_channel_scale_backward(x.ptr, s.ptr, s.ptr, out, out + 1) < 0
        assert out[0] == ffi.NULL and out[1] == ffi.NULL
        assert b"grad_out has shape [2, 3, 4, 4] but x has shape [2, 3]" in \
            ffi.string(lib.ut_last_error())
        assert lib.ut_channel_scale_backward(x.ptr, x.ptr, s.ptr, out, out) < 0
        assert b"different pointers" in ffi.string(lib.ut_last_error())


def test_channel_scale_bf16(device, rng):
    """bf16 x and s: y, dx, ds in bf16, each the float32 op on the same values rounded once
    (exactly on the CPU; within a bf16 step on the GPU, whose sums run in another order)."""
    x, s, go = (_round_bf16(_f32(rng, *sh)) for sh in ((3, 8, 9, 7), (3, 8, 1, 1), (3, 8, 9, 7)))
    with ut.tensor(x, device, ut.bfloat16) as xb, ut.tensor(s, device, ut.bfloat16) as sb, \
            ut.tensor(go, device, ut.bfloat16) as gb:
        y = F.channel_scale(xb, sb)
        dx, ds = F.channel_scale_backward(gb, xb, sb)
        with y, dx, ds:
            assert y.dtype == dx.dtype == ds.dtype == ut.bfloat16
            want_ds = (go.astype(np.float64) * x).sum(axis=(2, 3), keepdims=True)
            for got, want in ((y, x * s), (dx, go * s), (ds, want_ds)):
                # rounded once: within half a bf16 step (2^-8 relative) of the exact value; the
                # GPU's float32 sums in another order may round the other way
                w = np.asarray(want, np.float64)
                rtol = BF16_STEP * (1.0 if device == "cpu" else 2.0)
                np.testing.assert_allclose(got.numpy(), w, rtol=rtol, atol=1e-5 * np.abs(w).max())


def test_channel_scale_is_deterministic(device, rng):
    x, s = _f32(rng, 4, 64, 33, 31), _f32(rng, 4, 64)
    with ut.tensor(x, device) as xt, ut.tensor(s, device) as st:
        a = [F.channel_scale_backward(xt, xt, st)[1] for _ in range(2)]
        try:
            np.testing.assert_array_equal(a[0].numpy(), a[1].numpy())
        finally:
            for t in a:
                t.close()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", [
    (2, 5, 8, 8),     # 64 per row: 16-byte loads (8 bf16, 4 float32), a warp per row
    (3, 5, 14, 14),   # 196: 8-byte bf16 loads; rows (15) end inside a block of 8 warps
    (3, 4, 7, 7),     # 49: one element per load
    (1, 3, 64, 64),   # few long rows: a block of 256 threads per row
    (1, 2, 67, 65),   # long odd rows: a block per row, one element per load
])
def test_row_kernels_over_every_width(device, rng, shape, dtype):
    """Global average pooling, the SE scale and the layer scale (forward and backward) on the
    row shapes that choose each launch (threads per row, elements per load on the GPU), against
    float64 on the same values: bf16 results rounded once (within a bf16 step), float32 within
    float32 sums' rounding."""
    n, c = shape[:2]
    bf = dtype == "bfloat16"
    rnd = _round_bf16 if bf else (lambda a: a)
    x, go = rnd(_f32(rng, *shape)), rnd(_f32(rng, *shape))
    s, gy = rnd(_f32(rng, n, c)), rnd(_f32(rng, n, c))
    gamma = _f32(rng, c, 1, 1)
    x64, go64, s64 = (a.astype(np.float64) for a in (x, go, s))
    hw = shape[2] * shape[3]
    want = {
        "pool": x64.mean(axis=(2, 3)),
        "pool dx": np.broadcast_to((gy.astype(np.float64) / hw)[:, :, None, None], shape),
        "scale": x64 * s64[:, :, None, None],
        "scale dx": go64 * s64[:, :, None, None],
        "scale ds": (go64 * x64).sum(axis=(2, 3)),
        "layer": x64 * gamma.astype(np.float64),
        "layer dg": (go64 * x64).sum(axis=(0, 2, 3)).reshape(c, 1, 1),
    }
    dt = ut.bfloat16 if bf else ut.float32
    with ut.tensor(x, device, dt) as xt, ut.tensor(go, device, dt) as gt, \
            ut.tensor(s, device, dt) as st, ut.tensor(gy, device, dt) as gyt, \
            ut.tensor(gamma, device) as gmt, ut.zeros((c, 1, 1), device) as dg:
        got = {"pool": ut.global_avg_pool2d(xt),
               "pool dx": ut.global_avg_pool2d_backward(gyt, shape[2], shape[3]),
               "scale": F.channel_scale(xt, st)}
        got["scale dx"], got["scale ds"] = F.channel_scale_backward(gt, xt, st)
        got["layer"] = F.layer_scale(xt, gmt)
        F.layer_scale_backward(gt, xt, gmt, dg).close()
        try:
            for k, w in want.items():
                g = (dg if k == "layer dg" else got[k]).numpy().astype(np.float64)
                assert g.shape == w.reshape(g.shape).shape, k
                w = w.reshape(g.shape)
                # a sum's rounding grows with its terms' magnitudes, not its own
                terms = {"pool": np.abs(x64).mean(axis=(2, 3)),
                         "scale ds": np.abs(go64 * x64).sum(axis=(2, 3)),
                         "layer dg": np.abs(go64 * x64).sum(axis=(0, 2, 3)).reshape(c, 1, 1)
                         }.get(k, np.abs(w))
                # bf16: rounded once, but a GPU sum in another order may round the other way
                one = BF16_STEP * (1.0 if device == "cpu" else 2.0) \
                    if bf and k != "layer dg" else 0.0  # dgamma stays float32
                np.testing.assert_allclose(g, w, rtol=one, atol=1e-5 * terms.max()
                                           + one * np.abs(w).max() * 1e-3, err_msg=k)
        finally:
            for t in got.values():
                t.close()


# -- layer_scale --------------------------------------------------------------------------------
@pytest.mark.parametrize("shape, g_shape", [
    ((2, 3, 4, 5), (3, 1, 1)), ((2, 3, 4, 5), (3,)), ((1, 9, 2, 2), (9, 1, 1)),
    ((5, 4, 7), (4, 1)), ((3, 96, 7, 7), (96, 1, 1)),
])
def test_layer_scale_matches_torch(device, torch, rng, shape, g_shape):
    x, gamma, go = _f32(rng, *shape), _f32(rng, *g_shape), _f32(rng, *shape)
    tx = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    tg = torch.tensor(gamma, dtype=torch.float64, requires_grad=True)
    (tx * tg.reshape((1, shape[1]) + (1,) * (len(shape) - 2))).backward(
        torch.tensor(go, dtype=torch.float64))
    with ut.tensor(x, device) as xt, ut.tensor(gamma, device) as gt, \
            ut.tensor(go, device) as got, ut.zeros(g_shape, device) as dgamma:
        with F.layer_scale(xt, gt) as y:
            _close(y.numpy(), R.layer_scale(x.astype(np.float64), gamma.astype(np.float64)))
        with F.layer_scale_backward(got, xt, gt, dgamma) as dx:
            _close(dx.numpy(), tx.grad.numpy())
        _close(dgamma.numpy(), tg.grad.numpy(), rtol=1e-5, atol=1e-4)
        # gradients accumulate, as a layer's do
        F.layer_scale_backward(got, xt, gt, dgamma).close()
        _close(dgamma.numpy(), 2 * tg.grad.numpy(), rtol=1e-5, atol=2e-4)
        with F.layer_scale_backward(got, xt, gt) as dx:  # no dgamma: dx only
            _close(dx.numpy(), tx.grad.numpy())


def test_layer_scale_bf16_activations_float32_gamma(device, rng):
    x, go = _round_bf16(_f32(rng, 2, 16, 9, 9)), _round_bf16(_f32(rng, 2, 16, 9, 9))
    gamma = _f32(rng, 16, 1, 1)
    want_dg = (go.astype(np.float64) * x).sum(axis=(0, 2, 3)).reshape(16, 1, 1)
    with ut.tensor(x, device, ut.bfloat16) as xb, ut.tensor(go, device, ut.bfloat16) as gb, \
            ut.tensor(gamma, device) as g, ut.zeros((16, 1, 1), device) as dg:
        with F.layer_scale(xb, g) as y, F.layer_scale_backward(gb, xb, g, dg) as dx:
            assert y.dtype == dx.dtype == ut.bfloat16 and dg.dtype == ut.float32
            for got, want in ((y, x * gamma), (dx, go * gamma)):
                w = np.asarray(want, np.float64)
                np.testing.assert_allclose(got.numpy(), w, rtol=0,
                                           atol=BF16_STEP * np.abs(w).max())
        _close(dg.numpy(), want_dg, rtol=1e-5, atol=1e-4)  # float32 sums of bf16 products


def test_a_convnext_style_layer_scale_parameter(device, torch, rng):
    """What CNBlock needs: its own Parameter ``layer_scale`` [C, 1, 1] (torchvision's key and
    shape), multiplied in forward, its gradient accumulated by backward."""

    class Block(ut.Module):
        def __init__(self, dim):
            self.layer_scale = ut.Parameter(np.full((dim, 1, 1), 1e-6, np.float32), device)

        def _own_parameters(self):
            return [("layer_scale", self.layer_scale)]

        def forward(self, x):
            self._x = x
            return F.layer_scale(x, self.layer_scale)

        def backward(self, g):
            return F.layer_scale_backward(g, self._x, self.layer_scale, self.layer_scale.grad)

    b = Block(6)
    sd = b.state_dict()
    assert list(sd) == ["layer_scale"] and sd["layer_scale"].shape == (6, 1, 1)
    gamma = _f32(rng, 6, 1, 1)
    b.load_state_dict({"layer_scale": torch.tensor(gamma)})
    x, go = _f32(rng, 2, 6, 3, 3), _f32(rng, 2, 6, 3, 3)
    with ut.tensor(x, device) as xt, ut.tensor(go, device) as gt:
        b(xt).close()
        b.backward(gt).close()
    _close(b.layer_scale.grad.numpy(), (go.astype(np.float64) * x).sum(axis=(0, 2, 3))
           .reshape(6, 1, 1), rtol=1e-5, atol=1e-5)
    b.layer_scale.close()


# -- LayerNorm2d --------------------------------------------------------------------------------
def _torch_layernorm2d(torch, x, w, b, eps):
    """torchvision.models.convnext.LayerNorm2d.forward, written out."""
    x = x.permute(0, 2, 3, 1)
    x = torch.nn.functional.layer_norm(x, (x.shape[-1],), w, b, eps)
    return x.permute(0, 3, 1, 2)


# on the GPU these take each launch shape: 32, 16 and 4 channel groups a block, fewer groups
# than 4 where C is smaller, a partial last block, the classifier's 1x1 plane
@pytest.mark.parametrize("shape", [(2, 5, 3, 4), (1, 96, 7, 7), (3, 3, 1, 1), (2, 17, 11, 13),
                                   (4, 256, 2, 3), (16, 48, 32, 32), (4, 8, 96, 96),
                                   (5, 768, 1, 1)])
def test_layernorm2d_matches_torch(device, torch, rng, shape):
    c = shape[1]
    x, go = _f32(rng, *shape, scale=2.0, shift=0.5), _f32(rng, *shape)
    w, b = _f32(rng, c, shift=1.0), _f32(rng, c)
    tx, tw, tb = (torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in (x, w, b))
    ty = _torch_layernorm2d(torch, tx, tw, tb, 1e-6)
    ty.backward(torch.tensor(go, dtype=torch.float64))
    ln = ut.LayerNorm2d(c, device=device)
    try:
        assert ln.eps == 1e-6 and list(ln.state_dict()) == ["weight", "bias"]
        ln.load_state_dict({"weight": torch.tensor(w), "bias": torch.tensor(b)})
        with ut.tensor(x, device) as xt, ut.tensor(go, device) as gt:
            with ln(xt) as y, ln.backward(gt) as dx:
                _close(y.numpy(), ty.detach().numpy(), rtol=1e-4, atol=2e-5)
                _close(y.numpy(), R.layernorm2d(*(a.astype(np.float64) for a in (x, w, b)),
                                                1e-6), rtol=1e-4, atol=2e-5)
                _close(dx.numpy(), tx.grad.numpy(), rtol=1e-4, atol=5e-5)
        _close(ln.weight.grad.numpy(), tw.grad.numpy(), rtol=1e-4, atol=1e-4)
        _close(ln.bias.grad.numpy(), tb.grad.numpy(), rtol=1e-4, atol=1e-4)
    finally:
        ln.close()


def test_layernorm2d_is_exact_with_a_large_mean(device, rng):
    """Two passes over the channels (the mean, then the spread around it): a large common
    offset does not cancel the variance away, as a sum of squares minus the squared sum
    would in float32."""
    x = _f32(rng, 2, 64, 5, 5, scale=0.01, shift=1000.0)
    ln = ut.LayerNorm2d(64, device=device)
    try:
        with ut.tensor(x, device) as xt, ln(xt) as y:
            want = R.layernorm2d(x.astype(np.float64), np.ones(64), np.zeros(64), 1e-6)
            # x itself is float32 near 1000 (steps of 6e-5 against a spread of 0.01)
            _close(y.numpy(), want, rtol=0, atol=5e-3)
    finally:
        ln.close()


def test_layernorm2d_bf16_statistics_in_float32(device, rng):
    x = _round_bf16(_f32(rng, 2, 48, 7, 7, scale=3.0, shift=2.0))
    ln = ut.LayerNorm2d(48, device=device)
    try:
        with ut.tensor(x, device, ut.bfloat16) as xb, ln(xb) as y:
            assert y.dtype == ut.bfloat16
            want = R.layernorm2d(x.astype(np.float64), np.ones(48), np.zeros(48), 1e-6)
            np.testing.assert_allclose(y.numpy(), want, rtol=0,
                                       atol=BF16_STEP * np.abs(want).max())
    finally:
        ln.close()


@pytest.mark.parametrize("shape", [(4, 24), (2, 3, 40)])
def test_layernorm_rows_in_bf16(device, rng, shape):
    """nn.LayerNorm on bf16 rows (ConvNeXt's head under MixedPrecision): y and dx in bf16, each
    the float64 result rounded once (within a bf16 step); dW and db float32 sums of the same
    bf16 values; a float32 grad_out for a bf16 forward is refused."""
    d = shape[-1]
    x = _round_bf16(_f32(rng, *shape, scale=2.0, shift=1.0))
    go = _round_bf16(_f32(rng, *shape))
    w, b = _f32(rng, d), _f32(rng, d)
    ln = ut.LayerNorm(d, device=device)
    try:
        ln.load_state_dict({"weight": w, "bias": b})
        with ut.tensor(x, device, ut.bfloat16) as xb, ut.tensor(go, device, ut.bfloat16) as gb:
            with ln(xb) as y:
                assert y.dtype == ut.bfloat16 and y.shape == shape
                want = R.layernorm(x.astype(np.float64), w, b, 1e-5)
                np.testing.assert_allclose(y.numpy(), want, rtol=0,
                                           atol=BF16_STEP * np.abs(want).max())
            ln.zero_grad()
            with ln.backward(gb) as dx:
                assert dx.dtype == ut.bfloat16
                wdx, wdw, wdb = R.layernorm_backward(x.astype(np.float64), w, 1e-5, go)
                np.testing.assert_allclose(dx.numpy(), wdx, rtol=0,
                                           atol=BF16_STEP * np.abs(wdx).max())
            _close(ln.weight.grad.numpy(), wdw, rtol=1e-4, atol=1e-5)
            _close(ln.bias.grad.numpy(), wdb, rtol=1e-4, atol=1e-5)
            ln(xb).close()
            with ut.tensor(go, device) as g32, pytest.raises(ut.ArgumentError, match="dtype|float"):
                ln.backward(g32)
    finally:
        ln.close()


def test_layernorm2d_parameter_gradients_are_deterministic(device, rng):
    x, go = _f32(rng, 8, 32, 15, 15), _f32(rng, 8, 32, 15, 15)
    ln = ut.LayerNorm2d(32, device=device)
    grads = []
    try:
        for _ in range(2):
            ln.zero_grad()
            with ut.tensor(x, device) as xt, ut.tensor(go, device) as gt:
                ln(xt).close()
                ln.backward(gt).close()
            grads.append((ln.weight.grad.numpy().copy(), ln.bias.grad.numpy().copy()))
        for a, b in zip(*grads):
            np.testing.assert_array_equal(a, b)
    finally:
        ln.close()


def test_layernorm_and_layernorm2d_refuse_each_others_cache(rng):
    """Both keep a ut_layernorm_cache, laid out differently: each backward refuses the other's
    (no silently wrong gradient when the last dimension happens to equal C)."""
    l = lib.ut_layernorm_alloc(4, 1e-5, lib.UT_CPU)
    cache = ffi.new("ut_layernorm_cache*")
    with ut.tensor(_f32(rng, 2, 4, 3, 4)) as x:
        y = lib.ut_layernorm2d_forward(ffi.new("ut_layernorm*", l), x.ptr, cache)
        assert y != ffi.NULL
        lp = ffi.new("ut_layernorm*", l)
        assert lib.ut_layernorm_backward(lp, cache, y, ffi.NULL, ffi.NULL) == ffi.NULL
        assert b"ut_layernorm2d_forward" in ffi.string(lib.ut_last_error())
        lib.ut_layernorm_cache_free(cache)
        y2 = lib.ut_layernorm_forward(lp, x.ptr, cache)
        assert y2 != ffi.NULL
        assert lib.ut_layernorm2d_backward(lp, cache, y2, ffi.NULL, ffi.NULL) == ffi.NULL
        assert b"ut_layernorm_forward" in ffi.string(lib.ut_last_error())
        lib.ut_layernorm_cache_free(cache)
        lib.ut_free(y)
        lib.ut_free(y2)
    lib.ut_layernorm_free(lp)


# -- SqueezeExcitation --------------------------------------------------------------------------
def _torch_se(torch, sd, x, scale_fn):
    """torchvision.ops.SqueezeExcitation.forward with the given weights, written out."""
    s = x.mean(dim=(2, 3), keepdim=True)  # AdaptiveAvgPool2d(1)
    s = torch.nn.functional.conv2d(s, sd["fc1.weight"], sd["fc1.bias"])
    s = torch.relu(s)
    s = torch.nn.functional.conv2d(s, sd["fc2.weight"], sd["fc2.bias"])
    return scale_fn(s) * x


@pytest.mark.parametrize("scale, torch_scale", [
    (_Sigmoid, "sigmoid"), (ut.ReLU6, "relu6")])
def test_squeeze_excitation_matches_torch(device, torch, rng, scale, torch_scale):
    fn = {"sigmoid": torch.sigmoid, "relu6": torch.nn.functional.relu6}[torch_scale]
    se = ut.SqueezeExcitation(12, 4, scale_activation=scale, device=device)
    try:
        assert [n for n, _ in se.named_children()] == [
            "avgpool", "fc1", "fc2", "activation", "scale_activation"]
        keys = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
        assert list(se.state_dict()) == keys
        sd = {k: torch.tensor(_f32(rng, *v.shape, scale=0.5, shift=0.3 if "bias" in k else 0.0),
                              dtype=torch.float64) for k, v in se.state_dict().items()}
        assert sd["fc1.weight"].shape == (4, 12, 1, 1)  # torchvision's shapes
        se.load_state_dict({k: v.float() for k, v in sd.items()})
        sd = {k: torch.tensor(v, dtype=torch.float64) for k, v in se.state_dict().items()}
        for v in sd.values():
            v.requires_grad_(True)
        x, go = _f32(rng, 3, 12, 5, 6, shift=0.5), _f32(rng, 3, 12, 5, 6)
        tx = torch.tensor(x, dtype=torch.float64, requires_grad=True)
        ty = _torch_se(torch, sd, tx, fn)
        ty.backward(torch.tensor(go, dtype=torch.float64))
        with ut.tensor(x, device) as xt, ut.tensor(go, device) as gt:
            with se(xt) as y, se.backward(gt) as dx:
                _close(y.numpy(), ty.detach().numpy(), rtol=1e-4, atol=1e-5)
                _close(dx.numpy(), tx.grad.numpy(), rtol=1e-4, atol=1e-5)
        for name, p in se.named_parameters():
            _close(p.grad.numpy(), sd[name].grad.numpy().reshape(p.grad.shape), rtol=1e-4,
                   atol=1e-5)
        # input_grad=False: the same parameter gradients, no dx
        grads = [p.grad.numpy().copy() for p in se.parameters()]
        se.zero_grad()
        with ut.tensor(x, device) as xt, ut.tensor(go, device) as gt:
            se(xt).close()
            assert se.backward(gt, input_grad=False) is None
        for p, g in zip(se.parameters(), grads):
            np.testing.assert_array_equal(p.grad.numpy(), g)
    finally:
        se.close()


def test_squeeze_excitation_backward_checks_both_paths_by_finite_differences(rng):
    """float64 central differences of sum(se(x) * go) with respect to x: a gradient that
    dropped either path (the direct x * scale, or the one through the scale) fails."""
    se = ut.SqueezeExcitation(3, 2, scale_activation=_Sigmoid)
    try:
        # hidden units alive whatever the library's RNG drew (a dead ReLU cuts the branch off)
        se.fc1.bias = np.full(2, 1.0, np.float32)
        sd = {k: v.astype(np.float64) for k, v in se.state_dict().items()}

        def f(a):
            p = a.mean(axis=(2, 3), keepdims=True)
            h = np.maximum(np.einsum("oc,nchw->nohw", sd["fc1.weight"][:, :, 0, 0], p)
                           + sd["fc1.bias"][None, :, None, None], 0)
            z = (np.einsum("oc,nchw->nohw", sd["fc2.weight"][:, :, 0, 0], h)
                 + sd["fc2.bias"][None, :, None, None])
            return a / (1 + np.exp(-z))

        x, go = _f32(rng, 2, 3, 3, 2, shift=0.3), _f32(rng, 2, 3, 3, 2)
        want = R.numeric_grad(f, x.astype(np.float64), go.astype(np.float64), 1e-6)
        with ut.tensor(x) as xt, ut.tensor(go) as gt, se(xt) as y, se.backward(gt) as dx:
            _close(y.numpy(), f(x.astype(np.float64)), rtol=1e-5, atol=1e-6)
            _close(dx.numpy(), want, rtol=1e-4, atol=1e-6)
            direct = go * (y.numpy() / np.where(x == 0, 1, x))  # the direct path alone
            assert np.abs(dx.numpy() - direct).max() > 1e-3  # the branch's share is there
    finally:
        se.close()


def test_squeeze_excitation_modes_copies_and_mixed_precision(device, rng):
    se = ut.SqueezeExcitation(8, 4, scale_activation=_Sigmoid, device=device)
    x, go = _f32(rng, 2, 8, 5, 5), _f32(rng, 2, 8, 5, 5)
    try:
        with ut.tensor(x, device) as xt, ut.tensor(go, device) as gt:
            with se(xt) as y:
                ref = y.numpy().copy()
            dup = copy.deepcopy(se)
            with dup(xt) as y2, dup.backward(gt) as dx2:
                np.testing.assert_array_equal(y2.numpy(), ref)
            dup.close()
            se.eval()
            with se(xt) as y:
                np.testing.assert_array_equal(y.numpy(), ref)
            with pytest.raises(ut.ArgumentError, match="no forward pass"):
                se.backward(gt)
            se.train()
            mp = ut.MixedPrecision(ut.Sequential(se))
            with mp(xt) as yb:
                assert yb.dtype == ut.float32
                np.testing.assert_allclose(yb.numpy(), ref, rtol=0,
                                           atol=4 * BF16_STEP * np.abs(ref).max())
            with mp.backward(gt) as dxb:
                assert dxb.dtype == ut.float32 and dxb.shape == x.shape
            for p in se.parameters():
                assert p.grad.dtype == ut.float32
    finally:
        se.close()


def test_squeeze_excitation_refuses_an_input_changed_in_place(rng):
    se = ut.SqueezeExcitation(4, 2, scale_activation=ut.ReLU6)
    try:
        with ut.tensor(_f32(rng, 2, 4, 3, 3)) as x:
            se(x).close()
            x.mul_(2.0)
            with pytest.raises(ut.ArgumentError, match="modified in place"):
                se.backward(ut.zeros((2, 4, 3, 3)))
    finally:
        se.close()


def test_squeeze_excitation_default_scale_activation(rng):
    """torchvision's default scale activation is Sigmoid: y = x * sigmoid(fc2(relu(fc1(pool))))."""
    se = ut.SqueezeExcitation(4, 2)
    try:
        assert type(se.scale_activation) is ut.Sigmoid
        sd = {k: v.astype(np.float64) for k, v in se.state_dict().items()}
        x = _f32(rng, 2, 4, 3, 3)
        p = x.astype(np.float64).mean(axis=(2, 3))
        h = np.maximum(p @ sd["fc1.weight"][:, :, 0, 0].T + sd["fc1.bias"], 0)
        z = h @ sd["fc2.weight"][:, :, 0, 0].T + sd["fc2.bias"]
        want = x * (1 / (1 + np.exp(-z)))[:, :, None, None]
        with ut.tensor(x) as xt, se(xt) as y:
            _close(y.numpy(), want, rtol=1e-5, atol=1e-6)
    finally:
        se.close()
