"""Training's fold of a BatchNorm2d into the DWConv2d after it (ut_batchnorm2d_dwconv2d_forward;
issue 31): the GPU's depthwise kernels normalize their input as they load it, forward and in
backward's weight gradient, and act(bn(x)) is never written.

The fold must change nothing but the memory traffic: the output, every gradient, the running
statistics and the layers' caches are compared to the bit with the two layers run one after the
other (set_training_fold(False)), on the CPU (where the C call runs the two layers as they are) and on
the GPU (the strip kernels' loads: 3x3 stride 1 and 2, 5x5 stride 1, each at plane widths that
take the wide bf16 kernels (a multiple of 8), the pair kernels (even) and the one-column kernels
(odd); the other geometries and activations run the two layers there too), in float32 and in
bfloat16 (MixedPrecision). The unfolded layers are themselves checked against float64 in
test_bn_activation.py and the depthwise tests; here the chain is also checked against a float64
reference of its own, so that a fold that broke both paths alike would still fail. Non-finite
inputs and weights take the kernels' reruns, which normalize as they load too.
"""

import numpy as np
import pytest

import utensil_ffi as ut
from tolerances import assert_close
from utensil_ffi import models
from utensil_ffi import reference as R
from utensil_ffi._lib import ffi, lib
from utensil_ffi.nn import fold

# (kernel, stride, padding, height, width): the strip kernels' shapes at widths for the wide
# (16), pair (14) and one-column (9) bf16 kernels, and shapes that take the scratch path
SHAPES = [(3, 1, 1, 16, 16), (3, 2, 1, 16, 16), (5, 1, 2, 16, 16), (3, 1, 1, 14, 14),
          (3, 2, 1, 14, 14), (5, 1, 2, 14, 14), (3, 1, 1, 9, 9), (3, 2, 1, 9, 7),
          (5, 2, 2, 12, 12), (7, 1, 3, 10, 10), (3, 1, 0, 8, 8)]
ACTS = [None, "relu", "relu6", "silu"]


def _net(device, act, k, s, pad, c=5, mult=1):
    ut.seed(3)
    net = ut.Sequential(ut.BatchNorm2d(c, activation=act, device=device),
                        ut.DWConv2d(c, k, stride=s, padding=pad, bias=True, device=device,
                                    out_channels=c * mult))
    # gamma and beta away from 1 and 0, so the fold's affine part is exercised
    net[0].weight.copy_from(np.linspace(0.5, 1.5, c, dtype=np.float32))
    net[0].bias.copy_from(np.linspace(-0.4, 0.6, c, dtype=np.float32))
    return net


def _step(device, folded, act, shape, x, bf16=False, mult=1, calls=None):
    k, s, pad, _, _ = shape
    net = _net(device, act, k, s, pad, x.shape[1], mult)
    run = ut.MixedPrecision(net) if bf16 else net
    prev = fold.set_training_fold(folded)
    try:
        y = run(x)
    finally:
        fold.set_training_fold(prev)
    go = np.random.RandomState(7).randn(*y.shape).astype(np.float32)
    dx = run.backward(ut.tensor(go, device=device))
    out = {"y": y.numpy().copy(), "dx": dx.numpy().copy(),
           "running_mean": net[0].running_mean.numpy().copy(),
           "running_var": net[0].running_var.numpy().copy()}
    for name, p in net.named_parameters():
        out[name] = p.grad.numpy().copy()
    out["batches"] = net[0].num_batches_tracked
    net.close()
    return out


def _counting(monkeypatch):
    calls = []
    real = fold.bn_dw_forward

    def counted(bn, dw, x):
        calls.append((type(bn).__name__, type(dw).__name__))
        return real(bn, dw, x)

    monkeypatch.setattr(fold, "bn_dw_forward", counted)
    return calls


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "k%ds%dp%d_%dx%d" % s)
@pytest.mark.parametrize("act", ACTS)
def test_fold_is_the_two_layers_to_the_bit(device, shape, act, monkeypatch):
    rng = np.random.RandomState(1)
    x = (rng.randn(3, 5, shape[3], shape[4]) * 2 + 0.5).astype(np.float32)
    calls = _counting(monkeypatch)
    a = _step(device, True, act, shape, ut.tensor(x, device=device))
    assert calls == [("BatchNorm2d", "DWConv2d")]  # the fold ran
    b = _step(device, False, act, shape, ut.tensor(x, device=device))
    assert len(calls) == 1  # and the comparison did not
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


@pytest.mark.parametrize("shape", SHAPES[:7], ids=lambda s: "k%ds%dp%d_%dx%d" % s)
@pytest.mark.parametrize("act", ["relu6", None])
def test_fold_bf16_is_the_two_layers_to_the_bit(device, shape, act):
    rng = np.random.RandomState(2)
    x = (rng.randn(2, 6, shape[3], shape[4]) * 3 - 0.5).astype(np.float32)
    a = _step(device, True, act, shape, x, bf16=True)
    b = _step(device, False, act, shape, x, bf16=True)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def test_fold_with_a_channel_multiplier(device):
    x = np.random.RandomState(4).randn(2, 3, 9, 10).astype(np.float32)
    a = _step(device, True, "relu", (3, 1, 1, 9, 10), ut.tensor(x, device=device), mult=2)
    b = _step(device, False, "relu", (3, 1, 1, 9, 10), ut.tensor(x, device=device), mult=2)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def test_fold_against_float64(device):
    """The folded step against float64: batchnorm with batch statistics, relu6, the depthwise
    convolution, and their gradients by the chain rule."""
    k, s, pad = 3, 2, 1
    rng = np.random.RandomState(5)
    x = rng.randn(2, 4, 12, 12).astype(np.float32)
    net = _net(device, "relu6", k, s, pad, c=4)
    y = net(ut.tensor(x, device=device))
    go = rng.randn(*y.shape).astype(np.float32)
    dx = net.backward(ut.tensor(go, device=device))
    bn, dw = net[0], net[1]
    gam = bn.weight.numpy().astype(np.float64)
    bet = bn.bias.numpy().astype(np.float64)
    w = dw.weight.numpy().astype(np.float64)
    b = dw.bias.numpy().astype(np.float64)
    xd = x.astype(np.float64)
    mean = xd.mean(axis=(0, 2, 3))
    var = xd.var(axis=(0, 2, 3))
    xhat = (xd - mean[None, :, None, None]) / np.sqrt(var[None, :, None, None] + 1e-5)
    z = xhat * gam[None, :, None, None] + bet[None, :, None, None]
    a = np.clip(z, 0, 6)
    y_ref = R.dwconv2d(a, w, b, s, pad)
    assert_close("bn+dw y", y.numpy(), y_ref, rtol=1e-5, atol=1e-5)
    da, dw_ref, db_ref = R.dwconv2d_backward(a, w, s, pad, go.astype(np.float64))
    assert_close("bn+dw dW", dw.weight.grad.numpy(), dw_ref, rtol=1e-4, atol=1e-4)
    assert_close("bn+dw db", dw.bias.grad.numpy(), db_ref, rtol=1e-4, atol=1e-4)
    dz = da * ((z > 0) & (z < 6))
    n = xd.shape[0] * xd.shape[2] * xd.shape[3]
    dbeta = dz.sum(axis=(0, 2, 3))
    dgamma = (dz * xhat).sum(axis=(0, 2, 3))
    dxhat = dz * gam[None, :, None, None]
    dx_ref = (dxhat - dxhat.mean(axis=(0, 2, 3), keepdims=True)
              - xhat * (dxhat * xhat).mean(axis=(0, 2, 3), keepdims=True)) \
        / np.sqrt(var[None, :, None, None] + 1e-5)
    assert n > 1
    assert_close("bn+dw dgamma", bn.weight.grad.numpy(), dgamma, rtol=1e-4, atol=1e-4)
    assert_close("bn+dw dbeta", bn.bias.grad.numpy(), dbeta, rtol=1e-4, atol=1e-4)
    assert_close("bn+dw dx", dx.numpy(), dx_ref, rtol=1e-4, atol=1e-4)
    net.close()


@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[1], SHAPES[6]],
                         ids=lambda s: "k%ds%dp%d_%dx%d" % s)
def test_fold_non_finite_is_the_two_layers(device, shape):
    """An inf in x and an inf weight: the kernels' reruns (a channel with a non-finite weight
    recomputed over real input, a non-finite dW tap summed again) normalize as they load too."""
    x = np.random.RandomState(6).randn(2, 5, shape[3], shape[4]).astype(np.float32)
    x[1, 2, 3, 4] = np.inf

    def run(folded):
        k, s, pad, _, _ = shape
        net = _net(device, None, k, s, pad)
        w = net[1].weight.numpy().copy()
        w[3, 0, 0] = np.inf
        net[1].weight.copy_from(w)
        prev = fold.set_training_fold(folded)
        try:
            y = net(ut.tensor(x, device=device))
        finally:
            fold.set_training_fold(prev)
        go = np.ones(y.shape, np.float32)
        dx = net.backward(ut.tensor(go, device=device))
        out = [y.numpy().copy(), dx.numpy().copy()] + [p.grad.numpy().copy()
                                                      for p in net.parameters()]
        net.close()
        return out

    for u, v in zip(run(True), run(False)):
        np.testing.assert_array_equal(u, v)


def test_fold_through_nested_sequentials_and_not_sync_or_eval(device, monkeypatch):
    """An inverted residual's expand and depthwise units are sibling Sequentials: the fold
    looks through them. Off by default; eval mode and SyncBatchNorm do not fold."""
    calls = _counting(monkeypatch)
    net = models.mobilenet_v2(num_classes=4, width_mult=0.25, device=device)
    net.train()
    x = np.random.RandomState(8).randn(2, 3, 32, 32).astype(np.float32)
    net(ut.tensor(x, device=device)).close()
    assert calls == []  # off by default
    monkeypatch.setattr(fold, "_TRAINING", [True])
    y = net(ut.tensor(x, device=device))
    n_train = len(calls)
    # the 16 blocks with an expand; the first block's depthwise follows the stem's BatchNorm
    # across the InvertedResidual (a module of its own, not looked through)
    assert n_train == 16
    net.backward(ut.tensor(np.ones(y.shape, np.float32), device=device))
    net.eval()
    net(ut.tensor(x, device=device))
    assert len(calls) == n_train
    net.close()
    bn = ut.SyncBatchNorm(4, device=device) if hasattr(ut, "SyncBatchNorm") else None
    if bn is not None:
        seq = ut.Sequential(bn, ut.DWConv2d(4, 3, padding=1, device=device))
        seq(ut.tensor(np.ones((2, 4, 5, 5), np.float32), device=device))
        assert len(calls) == n_train
        seq.close()


def test_folded_backward_checks_its_input_version(device, monkeypatch):
    """The depthwise's cache holds the BatchNorm's input: changing it in place between forward
    and backward is refused as for any layer."""
    monkeypatch.setattr(fold, "_TRAINING", [True])
    net = _net(device, "relu", 3, 1, 1)
    x = ut.tensor(np.random.RandomState(9).randn(2, 5, 8, 8).astype(np.float32), device=device)
    y = net(x)
    x.copy_from(np.zeros((2, 5, 8, 8), np.float32))
    with pytest.raises(ut.ArgumentError, match="modified in place"):
        net.backward(ut.tensor(np.ones(y.shape, np.float32), device=device))
    net.close()


def test_c_entry_refuses_missing_caches_and_mismatched_layers():
    bn = ut.BatchNorm2d(4)
    dw = ut.DWConv2d(3, 3, padding=1)
    x = ut.tensor(np.ones((2, 4, 5, 5), np.float32))
    p = lib.ut_batchnorm2d_dwconv2d_forward(bn._struct, dw._struct, x.ptr, ffi.NULL, ffi.NULL)
    assert p == ffi.NULL
    assert "both caches are required" in ffi.string(lib.ut_last_error()).decode()
    with pytest.raises(ut.ShapeError):
        fold.bn_dw_forward(bn, dw, x)  # x has 4 channels, the depthwise takes 3
    for l in (bn, dw):
        l.close()
    x.close()
