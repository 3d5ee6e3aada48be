"""Every op, forward and backward, on random inputs against its float64 numpy reference
(utensil_ffi/reference.py, which the self-check uses too).

Geometries include batch > 1, odd sizes, padding, stride 2, kh != kw and 1x1 kernels: the cases
where other libraries shipped wrong results. The reference itself is checked at the end of this
file: its backward formulas against central finite differences (float64), its forward and
backward against PyTorch in float64 (where it is installed), and that it imports only numpy.
"""

import ast
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import utensil_ffi as ut
from tolerances import assert_close
from utensil_ffi.testing import optable
from utensil_ffi import reference as R

f32 = np.float32

# (N, C_in, C_out, H, W, kh, kw, stride, pad, bias)
CONV_GEOMS = [
    (1, 1, 1, 3, 3, 2, 2, 1, 0, True),
    (2, 3, 4, 7, 5, 3, 3, 1, 1, True),
    (2, 3, 5, 9, 8, 3, 2, 2, 1, True),
    (3, 4, 6, 5, 5, 1, 1, 1, 0, True),
    (2, 2, 3, 6, 7, 1, 1, 2, 0, False),
    (1, 3, 2, 11, 6, 5, 3, 2, 2, False),
    (2, 8, 16, 13, 13, 3, 3, 2, 1, True),
    (1, 2, 2, 4, 9, 1, 4, 3, 0, True),
]


def _ids(geoms):
    return ["N%d_C%d_O%d_%dx%d_k%dx%d_s%d_p%d_%s" % (g[:9] + ("b" if g[9] else "nob",)) for g in geoms]


def _randn(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(f32)


def _check_layer_grads(op, layer, x, go, ref_bwd, device):
    """backward twice: dx each time, parameter gradients accumulated (+=) to twice the reference."""
    rdx, rdw, rdb = ref_bwd
    dx = layer.backward(ut.tensor(go, device))
    assert_close(op + " backward dx", dx.numpy(), rdx)
    assert_close(op + " backward dW", layer.weight.grad.numpy(), rdw)
    if layer.bias is not None:
        assert_close(op + " backward db", layer.bias.grad.numpy(), rdb)
    layer.backward(ut.tensor(go, device)).close()
    assert_close(op + " backward dW", layer.weight.grad.numpy(), 2 * rdw)
    layer.zero_grad()
    assert not layer.weight.grad.numpy().any()


@pytest.mark.parametrize("geom", CONV_GEOMS, ids=_ids(CONV_GEOMS))
def test_conv2d(device, rng, geom):
    n, c, o, h, w, kh, kw, s, p, bias = geom
    x = _randn(rng, n, c, h, w)
    wt = _randn(rng, o, c, kh, kw, scale=0.5)
    b = _randn(rng, o) if bias else None
    with ut.Conv2d(c, o, (kh, kw), stride=s, padding=p, bias=bias, device=device) as layer:
        layer.weight = wt
        if bias:
            layer.bias = b
        y = layer(ut.tensor(x, device))
        ref = R.conv2d(x.astype(float), wt.astype(float), None if b is None else b.astype(float), s, p)
        assert_close("conv2d forward", y.numpy(), ref)
        go = _randn(rng, *ref.shape)
        _check_layer_grads("conv2d", layer, x, go,
                           R.conv2d_backward(x.astype(float), wt.astype(float), s, p, go.astype(float)),
                           device)


@pytest.mark.parametrize("geom", CONV_GEOMS, ids=_ids(CONV_GEOMS))
def test_dwconv2d(device, rng, geom):
    n, c, _, h, w, kh, kw, s, p, bias = geom
    x = _randn(rng, n, c, h, w)
    wt = _randn(rng, c, kh, kw, scale=0.5)
    b = _randn(rng, c) if bias else None
    with ut.DWConv2d(c, (kh, kw), stride=s, padding=p, bias=bias, device=device) as layer:
        layer.weight = wt
        if bias:
            layer.bias = b
        y = layer(ut.tensor(x, device))
        ref = R.dwconv2d(x.astype(float), wt.astype(float), None if b is None else b.astype(float), s, p)
        assert_close("dwconv2d forward", y.numpy(), ref)
        go = _randn(rng, *ref.shape)
        _check_layer_grads("dwconv2d", layer, x, go,
                           R.dwconv2d_backward(x.astype(float), wt.astype(float), s, p, go.astype(float)),
                           device)


@settings(max_examples=20, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 3), c=st.integers(1, 4), o=st.integers(1, 4), h=st.integers(1, 9),
       w=st.integers(1, 9), kh=st.integers(1, 4), kw=st.integers(1, 4), s=st.integers(1, 3),
       p=st.integers(0, 2), seed=st.integers(0, 2**32 - 1))
def test_conv2d_random_geometry(device, n, c, o, h, w, kh, kw, s, p, seed):
    """Any geometry whose kernel fits the padded input matches the reference, forward and back."""
    if h + 2 * p < kh or w + 2 * p < kw:
        with pytest.raises(ut.ShapeError):
            ut.Conv2d(c, o, (kh, kw), s, p, device=device)(np.zeros((n, c, h, w)))
        return
    rng = np.random.default_rng(seed)
    x, wt, b = _randn(rng, n, c, h, w), _randn(rng, o, c, kh, kw), _randn(rng, o)
    with ut.Conv2d(c, o, (kh, kw), s, p, device=device) as layer:
        layer.weight, layer.bias = wt, b
        y = layer(ut.tensor(x, device))
        ref = R.conv2d(x.astype(float), wt.astype(float), b.astype(float), s, p)
        assert_close("conv2d forward", y.numpy(), ref)
        go = _randn(rng, *ref.shape)
        dx = layer.backward(ut.tensor(go, device))
        rdx, rdw, rdb = R.conv2d_backward(x.astype(float), wt.astype(float), s, p, go.astype(float))
        assert_close("conv2d backward dx", dx.numpy(), rdx)
        assert_close("conv2d backward dW", layer.weight.grad.numpy(), rdw)
        assert_close("conv2d backward db", layer.bias.grad.numpy(), rdb)


# the last runs the packed GEMM with a transposed B (W^T), panels with columns and steps left
# over
@pytest.mark.parametrize("n,i,o,bias", [(5, 7, 3, True), (1, 1, 1, True), (9, 33, 17, False),
                                        (40, 101, 139, True)])
def test_linear(device, rng, n, i, o, bias):
    x, wt, b = _randn(rng, n, i), _randn(rng, o, i), _randn(rng, o)
    with ut.Linear(i, o, bias=bias, device=device) as layer:
        layer.weight = wt
        if bias:
            layer.bias = b
        y = layer(ut.tensor(x, device))
        ref = R.linear(x.astype(float), wt.astype(float), b.astype(float) if bias else None)
        assert_close("linear forward", y.numpy(), ref)
        go = _randn(rng, n, o)
        _check_layer_grads("linear", layer, x, go,
                           R.linear_backward(x.astype(float), wt.astype(float), go.astype(float)),
                           device)


@pytest.mark.parametrize("shape", [(4, 16), (3, 5, 7), (1, 1), (2, 1, 3, 9)])
def test_layernorm(device, rng, shape):
    d = shape[-1]
    x = _randn(rng, *shape, scale=3.0) + 1.5
    g, b = _randn(rng, d) + 1, _randn(rng, d)
    eps = 1e-5
    with ut.LayerNorm(d, eps=eps, device=device) as layer:
        np.testing.assert_array_equal(layer.weight.numpy(), np.ones(d))
        np.testing.assert_array_equal(layer.bias.numpy(), np.zeros(d))
        layer.weight, layer.bias = g, b
        y = layer(ut.tensor(x, device))
        x64, g64 = x.astype(float), g.astype(float)
        assert_close("layernorm forward", y.numpy(), R.layernorm(x64, g64, b.astype(float), eps))
        go = _randn(rng, *shape)
        _check_layer_grads("layernorm", layer, x, go, R.layernorm_backward(x64, g64, eps, go.astype(float)),
                           device)


@pytest.mark.parametrize("shape", [(2, 3, 5, 7), (4, 1, 1, 3), (1, 6, 4, 4), (3, 5, 1, 1)])
def test_batchnorm2d(device, rng, shape):
    n, c, h, w = shape
    eps, momentum = 1e-5, 0.1
    x = _randn(rng, *shape, scale=2.0) + 0.5
    g, b = _randn(rng, c) + 1, _randn(rng, c)
    with ut.BatchNorm2d(c, eps=eps, momentum=momentum, device=device) as layer:
        rm0, rv0 = layer.running_mean.numpy().copy(), layer.running_var.numpy().copy()
        np.testing.assert_array_equal(rm0, np.zeros(c))
        np.testing.assert_array_equal(rv0, np.ones(c))
        layer.weight, layer.bias = g, b
        x64, g64, b64 = x.astype(float), g.astype(float), b.astype(float)

        y = layer(ut.tensor(x, device))  # training mode: batch statistics
        ref, mean, var = R.batchnorm2d_train(x64, g64, b64, eps)
        assert_close("batchnorm2d train forward", y.numpy(), ref)
        rm, rv = R.batchnorm2d_running_stats(rm0, rv0, mean, var, n * h * w, momentum)
        assert_close("batchnorm2d running_mean", layer.running_mean.numpy(), rm)
        assert_close("batchnorm2d running_var", layer.running_var.numpy(), rv)
        go = _randn(rng, *shape)
        _check_layer_grads("batchnorm2d", layer, x, go,
                           R.batchnorm2d_backward(x64, g64, eps, go.astype(float)), device)

        layer.eval()  # eval mode: the running statistics, left alone
        rm = layer.running_mean.numpy().astype(float)
        rv = layer.running_var.numpy().astype(float)
        y = layer(ut.tensor(x, device))
        assert_close("batchnorm2d eval forward", y.numpy(), R.batchnorm2d_eval(x64, g64, b64, rm, rv, eps))
        np.testing.assert_array_equal(layer.running_mean.numpy(), rm.astype(f32))
        _check_layer_grads("batchnorm2d eval", layer, x, go,
                           R.batchnorm2d_eval_backward(x64, g64, rm, rv, eps, go.astype(float)), device)


@pytest.mark.parametrize("shape", [(7,), (2, 3, 5), (4, 1, 3, 3)])
def test_relu_relu6(device, rng, shape):
    x = _randn(rng, *shape, scale=5.0)
    x.reshape(-1)[:3] = [0.0, 6.0, -0.0][: x.size]  # the boundaries, where the gradient is 0
    go = _randn(rng, *shape)
    xt, gt = ut.tensor(x, device), ut.tensor(go, device)
    x64, go64 = x.astype(float), go.astype(float)
    assert_close("relu forward", ut.relu(xt).numpy(), R.relu(x64), atol=0)
    assert_close("relu6 forward", ut.relu6(xt).numpy(), R.relu6(x64), atol=0)
    assert_close("relu backward", ut.relu_backward(gt, xt).numpy(), R.relu_backward(go64, x64), atol=0)
    assert_close("relu6 backward", ut.relu6_backward(gt, xt).numpy(), R.relu6_backward(go64, x64), atol=0)
    for cls, ref in ((ut.ReLU, R.relu_backward), (ut.ReLU6, R.relu6_backward)):
        layer = cls()
        layer(xt).close()
        assert_close(cls.__name__ + " layer backward", layer.backward(gt).numpy(), ref(go64, x64), atol=0)


@pytest.mark.parametrize("shape", [(2, 3, 5, 7), (1, 1, 1, 1), (3, 4, 2, 9)])
def test_global_avgpool2d(device, rng, shape):
    x = _randn(rng, *shape)
    layer = ut.GlobalAvgPool2d()
    y = layer(ut.tensor(x, device))
    assert_close("global_avgpool2d forward", y.numpy(), R.global_avg_pool2d(x.astype(float)))
    go = _randn(rng, *shape[:2])
    dx = layer.backward(ut.tensor(go, device))
    assert_close("global_avgpool2d backward", dx.numpy(), R.global_avg_pool2d_backward(go.astype(float), *shape[2:]))


@pytest.mark.parametrize("shape", [(4, 5), (1,), (3, 2, 7)])
def test_mse_loss(device, rng, shape):
    p, t = _randn(rng, *shape), _randn(rng, *shape)
    pt, tt = ut.tensor(p, device), ut.tensor(t, device)
    assert_close("mse_loss forward", ut.mse_loss(pt, tt).numpy(), R.mse_loss(p.astype(float), t.astype(float)))
    assert_close("mse_loss backward", ut.mse_loss_backward(pt, tt).numpy(),
                 R.mse_loss_backward(p.astype(float), t.astype(float)))
    crit = ut.MSELoss()
    assert crit(pt, t).item() == pytest.approx(R.mse_loss(p.astype(float), t.astype(float))[0], rel=1e-5)
    assert_close("mse_loss backward", crit.backward().numpy(), R.mse_loss_backward(p.astype(float), t.astype(float)))
    crit.close()


@pytest.mark.parametrize("n,k,scale", [(6, 5, 3.0), (1, 1, 1.0), (17, 10, 30.0), (4, 2, 0.01)])
def test_cross_entropy(device, rng, n, k, scale):
    z = _randn(rng, n, k, scale=scale)
    labels = rng.integers(0, k, n)
    zt = ut.tensor(z, device)
    z64 = z.astype(float)
    assert_close("cross_entropy forward", ut.cross_entropy(zt, labels).numpy(), R.cross_entropy(z64, labels))
    assert_close("cross_entropy backward", ut.cross_entropy_backward(zt, labels).numpy(),
                 R.cross_entropy_backward(z64, labels))
    # labels as a float tensor of indices on the same device
    lt = ut.tensor(labels.astype(f32), device)
    assert_close("cross_entropy forward", ut.cross_entropy(zt, lt).numpy(), R.cross_entropy(z64, labels))
    crit = ut.CrossEntropyLoss()
    crit(zt, labels).close()
    assert_close("cross_entropy backward", crit.backward().numpy(), R.cross_entropy_backward(z64, labels))
    crit.close()


# the last two pack A in 8-row panels (n past two micro-panels): whole 8 x 8 blocks, a k tail,
# a panel of fewer rows, and k past one 256-deep block
@pytest.mark.parametrize("m,k,n", [(5, 7, 3), (1, 1, 1), (17, 33, 9), (64, 48, 32), (13, 19, 100),
                                   (40, 300, 130)])
def test_matmul(device, rng, m, k, n):
    a, b = _randn(rng, m, k), _randn(rng, k, n)
    at, bt = ut.tensor(a, device), ut.tensor(b, device)
    ref = R.matmul(a.astype(float), b.astype(float))
    assert_close("matmul", ut.matmul(at, bt).numpy(), ref)
    assert_close("matmul", (at @ bt).numpy(), ref)


@pytest.mark.parametrize("shape,d0,d1", [((3, 4), 0, 1), ((2, 3, 4, 5), 0, 1), ((2, 3, 4, 5), 1, 3),
                                         ((2, 3, 4, 5), 0, 3), ((5, 1, 7), 2, 0), ((3, 4, 5), -1, 0)])
def test_transpose(device, rng, shape, d0, d1):
    x = _randn(rng, *shape)
    y = ut.tensor(x, device).transpose(d0, d1)
    assert_close("transpose", y.numpy(), R.transpose(x, d0, d1), atol=0, rtol=0)


def test_reshape_add_scale_bias(device, rng):
    x, y = _randn(rng, 2, 3, 4), _randn(rng, 2, 3, 4)
    xt = ut.tensor(x, device)
    assert_close("reshape", xt.reshape(6, -1).numpy(), x.reshape(6, 4), atol=0, rtol=0)
    ut.functional.add_(xt, ut.tensor(y, device))
    assert_close("add_into", xt.numpy(), x.astype(float) + y, atol=0)
    xt.mul_(-2.5)
    assert_close("scale", xt.numpy(), -2.5 * (x.astype(float) + y))
    b = _randn(rng, 3)
    xt = ut.tensor(x, device)
    ut.functional.bias_add_(xt, ut.tensor(b, device))
    assert_close("bias_add", xt.numpy(), x + b[None, :, None])


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_sgd(device, rng, momentum):
    p, lr = _randn(rng, 4, 5), 0.1
    pt = ut.tensor(p, device)
    vt = ut.zeros(p.shape, device) if momentum else None
    ref_p, ref_v = p.astype(float), np.zeros(p.shape) if momentum else None
    for _ in range(3):
        g = _randn(rng, 4, 5)
        ut.sgd_step(pt, ut.tensor(g, device), vt, lr, momentum)
        ref_p, ref_v = R.sgd_step(ref_p, g.astype(float), ref_v, lr, momentum)
    assert_close("sgd_step", pt.numpy(), ref_p)
    # the optimizer class does the same with each parameter's grad
    with ut.Linear(5, 4, bias=False, device=device) as layer:
        layer.weight = p
        opt = ut.SGD(layer.parameters(), lr=lr, momentum=momentum)
        ref_p, ref_v = p.astype(float), np.zeros(p.shape) if momentum else None
        for _ in range(3):
            g = _randn(rng, 4, 5)
            opt.zero_grad()
            layer.weight.grad.copy_from(g)
            opt.step()
            ref_p, ref_v = R.sgd_step(ref_p, g.astype(float), ref_v, lr, momentum)
        assert_close("SGD", layer.weight.numpy(), ref_p)
        opt.close()


def test_adam(device, rng):
    p, lr, b1, b2, eps = _randn(rng, 3, 7), 0.01, 0.9, 0.999, 1e-8
    pt, mt, vt = ut.tensor(p, device), ut.zeros(p.shape, device), ut.zeros(p.shape, device)
    ref = (p.astype(float), np.zeros(p.shape), np.zeros(p.shape))
    for step in range(1, 5):
        g = _randn(rng, 3, 7)
        ut.adam_step(pt, ut.tensor(g, device), mt, vt, step, lr, b1, b2, eps)
        ref = R.adam_step(ref[0], g.astype(float), ref[1], ref[2], step, lr, b1, b2, eps)
    assert_close("adam_step", pt.numpy(), ref[0])
    assert_close("adam_step m", mt.numpy(), ref[1])
    assert_close("adam_step v", vt.numpy(), ref[2])
    with ut.Linear(7, 3, device=device) as layer:
        layer.weight = p
        opt = ut.Adam(layer.parameters(), lr=lr, betas=(b1, b2), eps=eps)
        ref = (p.astype(float), np.zeros(p.shape), np.zeros(p.shape))
        for step in range(1, 5):
            g = _randn(rng, 3, 7)
            opt.zero_grad()
            layer.weight.grad.copy_from(g)
            opt.step()
            ref = R.adam_step(ref[0], g.astype(float), ref[1], ref[2], step, lr, b1, b2, eps)
        assert_close("Adam", layer.weight.numpy(), ref[0])
        opt.close()


def test_sequential_matches_composition(device, rng):
    """Sequential.forward/backward equal the layers applied by hand (forward and reverse)."""
    ut.seed(7)
    x = _randn(rng, 2, 3, 8, 8)
    model = ut.Sequential(ut.Conv2d(3, 4, 3, padding=1, device=device), ut.BatchNorm2d(4, device=device),
                          ut.ReLU6(), ut.DWConv2d(4, 3, stride=2, padding=1, device=device), ut.ReLU(),
                          ut.GlobalAvgPool2d(), ut.Linear(4, 5, device=device))
    with model:
        y = model(ut.tensor(x, device))
        assert y.shape == (2, 5)
        labels = np.array([1, 4])
        dx = model.backward(ut.cross_entropy_backward(y, labels))
        assert dx.shape == x.shape
        # by hand, from the same weights
        h = x.astype(float)
        l0, l1, l3, l6 = model[0], model[1], model[3], model[6]
        w0, b0 = l0.weight.numpy().astype(float), l0.bias.numpy().astype(float)
        h1 = R.conv2d(h, w0, b0, 1, 1)
        h2, _, _ = R.batchnorm2d_train(h1, l1.weight.numpy().astype(float), l1.bias.numpy().astype(float), 1e-5)
        h3 = R.relu6(h2)
        h4 = R.dwconv2d(h3, l3.weight.numpy().astype(float), l3.bias.numpy().astype(float), 2, 1)
        h6 = R.global_avg_pool2d(R.relu(h4))
        ref = R.linear(h6, l6.weight.numpy().astype(float), l6.bias.numpy().astype(float))
        assert_close("sequential forward", y.numpy(), ref)
        assert len(model.parameters()) == 8


# -- the references' own gradients against finite differences (float64, numpy only) ------------
def test_reference_gradients_are_right():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 2, 5, 4))
    w = rng.standard_normal((3, 2, 3, 2))
    go = rng.standard_normal(R.conv2d(x, w, None, 2, 1).shape)
    dx, dw, _ = R.conv2d_backward(x, w, 2, 1, go)
    np.testing.assert_allclose(dx, R.numeric_grad(lambda v: R.conv2d(v, w, None, 2, 1), x, go), atol=1e-6)
    np.testing.assert_allclose(dw, R.numeric_grad(lambda v: R.conv2d(x, v, None, 2, 1), w, go), atol=1e-6)

    wd = rng.standard_normal((2, 3, 2))
    go = rng.standard_normal(R.dwconv2d(x, wd, None, 2, 1).shape)
    dx, dw, _ = R.dwconv2d_backward(x, wd, 2, 1, go)
    np.testing.assert_allclose(dx, R.numeric_grad(lambda v: R.dwconv2d(v, wd, None, 2, 1), x, go), atol=1e-6)
    np.testing.assert_allclose(dw, R.numeric_grad(lambda v: R.dwconv2d(x, v, None, 2, 1), wd, go), atol=1e-6)

    # depthwise with dilation d and channel multiplier m (weight [C*m, kh, kw]), kh != kw
    for s, p, d, m, (kh, kw) in ((1, 2, 2, 2, (3, 2)), (2, 1, 3, 3, (2, 2)), (1, 0, 2, 1, (1, 2))):
        wd, bd = rng.standard_normal((2 * m, kh, kw)), rng.standard_normal(2 * m)
        go = rng.standard_normal(R.dwconv2d(x, wd, bd, s, p, d).shape)
        dx, dw, db = R.dwconv2d_backward(x, wd, s, p, go, d)
        what = "dwconv2d s%d p%d d%d m%d k%dx%d" % (s, p, d, m, kh, kw)
        for name, got, f, v in (("dx", dx, lambda v: R.dwconv2d(v, wd, bd, s, p, d), x),
                                ("dW", dw, lambda v: R.dwconv2d(x, v, bd, s, p, d), wd),
                                ("db", db, lambda v: R.dwconv2d(x, wd, v, s, p, d), bd)):
            np.testing.assert_allclose(got, R.numeric_grad(f, v, go), atol=1e-6,
                                       err_msg=what + " " + name)

    g, b = rng.standard_normal(4) + 1, rng.standard_normal(4)
    xl, go = rng.standard_normal((3, 4)), rng.standard_normal((3, 4))
    dx, dg, _ = R.layernorm_backward(xl, g, 1e-5, go)
    np.testing.assert_allclose(dx, R.numeric_grad(lambda v: R.layernorm(v, g, b, 1e-5), xl, go), atol=1e-5)
    np.testing.assert_allclose(dg, R.numeric_grad(lambda v: R.layernorm(xl, v, b, 1e-5), g, go), atol=1e-5)

    gb, bb = rng.standard_normal(2) + 1, rng.standard_normal(2)
    go = rng.standard_normal(x.shape)
    dx, dg, _ = R.batchnorm2d_backward(x, gb, 1e-5, go)
    f = lambda v: R.batchnorm2d_train(v, gb, bb, 1e-5)[0]  # noqa: E731
    np.testing.assert_allclose(dx, R.numeric_grad(f, x, go), atol=1e-5)

    z, labels = rng.standard_normal((4, 3)), np.array([0, 2, 1, 2])
    np.testing.assert_allclose(R.cross_entropy_backward(z, labels),
                               R.numeric_grad(lambda v: R.cross_entropy(v, labels), z, np.ones(1)), atol=1e-7)


def test_reference_imports_only_numpy():
    """Independent by construction: no utensil (nor torch) behind the reference."""
    tree = ast.parse(Path(R.__file__).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "." for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert imported == {"numpy"}


# -- the reference against PyTorch (float64), an implementation it shares no code with -----------
def _torch_grads(torch, f, go, *args):
    """f(*tensors) and d sum(f * go) / d each argument, by PyTorch's autograd, as numpy."""
    ts = [torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in args]
    y = f(*ts)
    (y * torch.tensor(go)).sum().backward()
    return y.detach().numpy(), [t.grad.numpy() for t in ts]


def _same(name, got, want):
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12, err_msg=name)


def test_reference_matches_pytorch(torch):
    F = torch.nn.functional
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 3, 7, 6))
    for s, p, (kh, kw) in ((2, 1, (3, 2)), (1, 2, (2, 3)), (1, 0, (1, 1))):
        w, b = rng.standard_normal((4, 3, kh, kw)), rng.standard_normal(4)
        y = R.conv2d(x, w, b, s, p)
        go = rng.standard_normal(y.shape)
        ty, tg = _torch_grads(torch, lambda x_, w_, b_: F.conv2d(x_, w_, b_, s, p), go, x, w, b)
        _same("conv2d", y, ty)
        _same("conv2d no bias", R.conv2d(x, w, None, s, p), ty - b[None, :, None, None])
        for name, r, t in zip(("dx", "dW", "db"), R.conv2d_backward(x, w, s, p, go), tg):
            _same("conv2d " + name, r, t)
        wd, bd = rng.standard_normal((3, kh, kw)), rng.standard_normal(3)
        y = R.dwconv2d(x, wd, bd, s, p)
        go = rng.standard_normal(y.shape)
        ty, tg = _torch_grads(torch, lambda x_, w_, b_: F.conv2d(x_, w_[:, None], b_, s, p, groups=3),
                              go, x, wd, bd)
        _same("dwconv2d", y, ty)
        _same("dwconv2d no bias", R.dwconv2d(x, wd, None, s, p), ty - bd[None, :, None, None])
        for name, r, t in zip(("dx", "dW", "db"), R.dwconv2d_backward(x, wd, s, p, go), tg):
            _same("dwconv2d " + name, r, t)

    # depthwise with dilation and channel multiplier: Conv2d(C, C*m, groups=C, dilation=d)
    for s, p, d, m, (kh, kw) in ((1, 2, 2, 2, (3, 2)), (2, 3, 3, 3, (3, 3)), (1, 0, 2, 1, (1, 3)),
                                 (3, 1, 1, 2, (2, 2)),
                                 (1, 0, 3, 2, (3, 2)),  # its window spans all of H
                                 (4, 0, 2, 2, (3, 3))):  # Ho = Wo = 1
        wd, bd = rng.standard_normal((3 * m, kh, kw)), rng.standard_normal(3 * m)
        y = R.dwconv2d(x, wd, bd, s, p, d)
        go = rng.standard_normal(y.shape)
        ty, tg = _torch_grads(torch,
                              lambda x_, w_, b_: F.conv2d(x_, w_[:, None], b_, s, p, d, groups=3),
                              go, x, wd, bd)
        what = "dwconv2d s%d p%d d%d m%d k%dx%d" % (s, p, d, m, kh, kw)
        assert y.shape == ty.shape, what
        _same(what, y, ty)
        _same(what + " no bias", R.dwconv2d(x, wd, None, s, p, d), ty - bd[None, :, None, None])
        for name, r, t in zip(("dx", "dW", "db"), R.dwconv2d_backward(x, wd, s, p, go, d), tg):
            _same(what + " " + name, r, t)

    xl, wl, bl = rng.standard_normal((5, 7)), rng.standard_normal((3, 7)), rng.standard_normal(3)
    go = rng.standard_normal((5, 3))
    ty, tg = _torch_grads(torch, F.linear, go, xl, wl, bl)
    _same("linear", R.linear(xl, wl, bl), ty)
    _same("linear no bias", R.linear(xl, wl, None), ty - bl)
    for name, r, t in zip(("dx", "dW", "db"), R.linear_backward(xl, wl, go), tg):
        _same("linear " + name, r, t)
    _same("matmul", R.matmul(xl, wl.T), (torch.tensor(xl) @ torch.tensor(wl.T)).numpy())
    _same("transpose", R.transpose(x, 1, -1), torch.tensor(x).transpose(1, -1).numpy())
    tx, bc = torch.tensor(x), x[1, :, 2, 3]  # a bias of x's 3 channels
    _same("add", R.add(x, 2 * x), torch.add(tx, 2 * tx).numpy())
    _same("scale", R.scale(x, -2.5), tx.mul(-2.5).numpy())
    _same("bias_add", R.bias_add(x, bc), (tx + torch.tensor(bc)[None, :, None, None]).numpy())
    _same("bias_add [N, C]", R.bias_add(xl, xl[0]), (torch.tensor(xl) + torch.tensor(xl[0])).numpy())

    xn, g, b = rng.standard_normal((2, 3, 5)) * 3 + 1, rng.standard_normal(5) + 1, rng.standard_normal(5)
    go = rng.standard_normal(xn.shape)
    ty, tg = _torch_grads(torch, lambda x_, g_, b_: F.layer_norm(x_, (5,), g_, b_, 1e-5), go, xn, g, b)
    _same("layernorm", R.layernorm(xn, g, b, 1e-5), ty)
    for name, r, t in zip(("dx", "dgamma", "dbeta"), R.layernorm_backward(xn, g, 1e-5, go), tg):
        _same("layernorm " + name, r, t)

    g, b = rng.standard_normal(3) + 1, rng.standard_normal(3)
    rm, rv = rng.standard_normal(3), rng.uniform(0.5, 2.0, 3)
    trm, trv = torch.tensor(rm), torch.tensor(rv)
    go = rng.standard_normal(x.shape)
    ty, tg = _torch_grads(torch, lambda x_, g_, b_: F.batch_norm(x_, trm, trv, g_, b_, True, 0.1, 1e-5),
                          go, x, g, b)
    y, mean, var = R.batchnorm2d_train(x, g, b, 1e-5)
    _same("batchnorm2d train", y, ty)
    for name, r, t in zip(("dx", "dgamma", "dbeta"), R.batchnorm2d_backward(x, g, 1e-5, go), tg):
        _same("batchnorm2d " + name, r, t)
    nrm, nrv = R.batchnorm2d_running_stats(rm, rv, mean, var, 2 * 7 * 6, 0.1)
    _same("batchnorm2d running_mean", nrm, trm.numpy())
    _same("batchnorm2d running_var", nrv, trv.numpy())
    ty, tg = _torch_grads(torch, lambda x_, g_, b_: F.batch_norm(x_, trm, trv, g_, b_, False, 0.1, 1e-5),
                          go, x, g, b)
    _same("batchnorm2d eval", R.batchnorm2d_eval(x, g, b, nrm, nrv, 1e-5), ty)
    for name, r, t in zip(("dx", "dgamma", "dbeta"),
                          R.batchnorm2d_eval_backward(x, g, nrm, nrv, 1e-5, go), tg):
        _same("batchnorm2d eval " + name, r, t)

    xe = rng.uniform(-3.0, 9.0, (4, 11))  # no value sits on a kink
    go = rng.standard_normal(xe.shape)
    for name, f, tf, bwd in (("relu", R.relu, F.relu, R.relu_backward),
                             ("relu6", R.relu6, F.relu6, R.relu6_backward)):
        ty, (tdx,) = _torch_grads(torch, tf, go, xe)
        _same(name, f(xe), ty)
        _same(name + " backward", bwd(go, xe), tdx)

    go = rng.standard_normal((2, 3))
    ty, (tdx,) = _torch_grads(torch, lambda x_: x_.mean(dim=(2, 3)), go, x)
    _same("global_avg_pool2d", R.global_avg_pool2d(x), ty)
    _same("global_avg_pool2d backward", R.global_avg_pool2d_backward(go, 7, 6), tdx)

    t = rng.standard_normal(xl.shape)
    ty, (tdx,) = _torch_grads(torch, lambda p_: F.mse_loss(p_, torch.tensor(t)).reshape(1), np.ones(1), xl)
    _same("mse_loss", R.mse_loss(xl, t), ty)
    _same("mse_loss backward", R.mse_loss_backward(xl, t), tdx)
    labels = np.array([0, 2, 1, 2, 0])
    ty, (tdx,) = _torch_grads(torch, lambda z_: F.cross_entropy(z_, torch.tensor(labels)).reshape(1),
                              np.ones(1), xl[:, :3] * 4)
    _same("cross_entropy", R.cross_entropy(xl[:, :3] * 4, labels), ty)
    _same("cross_entropy backward", R.cross_entropy_backward(xl[:, :3] * 4, labels), tdx)

    for opt, ref in ((lambda ps: torch.optim.SGD(ps, lr=0.1), None),
                     (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), "sgd"),
                     (lambda ps: torch.optim.Adam(ps, lr=0.01, betas=(0.9, 0.999), eps=1e-8), "adam")):
        tp = torch.tensor(wl, requires_grad=True)
        o = opt([tp])
        p, v, m = wl.copy(), np.zeros(wl.shape), np.zeros(wl.shape)
        vel = v if ref == "sgd" else None
        for step in range(1, 4):
            grad = rng.standard_normal(wl.shape)
            tp.grad = torch.tensor(grad)
            o.step()
            if ref == "adam":
                p, m, v = R.adam_step(p, grad, m, v, step, 0.01, 0.9, 0.999, 1e-8)
            else:
                p, vel = R.sgd_step(p, grad, vel, 0.1, 0.9)
        _same("%s step" % (ref or "plain sgd"), p, tp.detach().numpy())


# -- every GPU layer against the same layer on the CPU ---------------------------------------------
# (name, make(device), input shape): the op table's samples marked "cuda_vs_cpu"
# (utensil_ffi/testing/optable.py): conv2d s2 p1 3x2 and 1x1, depthwise s2 p2 5x3 and d2 m3 s2 p3 3x5,
# linear, layernorm, batchnorm2d
GPU_CASES = [(s.name, (lambda d, op=op, g=s.geom: op.make(g, d)), op.shapes(s.geom)["x"])
             for op, s in optable.samples("cuda_vs_cpu")]


@pytest.mark.skipif(not ut.cuda_available(), reason="needs a GPU")
@pytest.mark.parametrize("name,make,shape", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_cuda_matches_cpu(rng, name, make, shape):
    cpu, gpu = make("cpu"), make("cuda")
    for pc, pg in zip(cpu.parameters(), gpu.parameters()):
        pc.copy_from(_randn(rng, *pc.shape) + 0.5)
        pg.copy_from(pc.numpy())
    x = _randn(rng, *shape)
    yc, yg = cpu(x), gpu(x)
    assert yg.device == "cuda"
    assert_close(name + " cuda vs cpu forward", yg.numpy(), yc.numpy())
    go = _randn(rng, *yc.shape)
    assert_close(name + " cuda vs cpu dx", gpu.backward(go).numpy(), cpu.backward(go).numpy())
    for pc, pg in zip(cpu.parameters(), gpu.parameters()):
        assert_close(name + " cuda vs cpu d" + pc.name, pg.grad.numpy(), pc.grad.numpy())
    cpu.close()
    gpu.close()
