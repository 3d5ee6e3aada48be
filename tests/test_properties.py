"""Property-based tests (hypothesis): random valid shapes and hyper-parameters -> every op
matches the float64 numpy reference (utensil_ffi/reference.py), forward and backward; random invalid
ones -> the documented exception (ShapeError / ArgumentError / ArgumentTypeError, all
UtensilError), never a crash or a wrong-shaped result.

UTENSIL_HYPOTHESIS_EXAMPLES sets max_examples per test (default 15; e.g. 500 for a long run).
"""

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import utensil_ffi as ut
from utensil_ffi import reference as R

EXAMPLES = int(os.environ.get("UTENSIL_HYPOTHESIS_EXAMPLES", "15"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
seeds = st.integers(0, 2**32 - 1)
dims = st.integers(1, 6)


def close(op, got, ref, rtol=1e-4, atol=1e-5):
    got = np.asarray(got, dtype=np.float64)
    assert got.shape == ref.shape, "%s: shape %s, expected %s" % (op, got.shape, ref.shape)
    scale = max(float(np.max(np.abs(ref))) if ref.size else 0.0, 1.0)
    np.testing.assert_allclose(got, ref, rtol=rtol, atol=atol * scale, err_msg=op)


def arr(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def layer_grads(layer, device, go):
    with ut.tensor(go, device) as g, layer.backward(g) as dx:
        out = [dx.numpy().astype(np.float64), layer.weight.grad.numpy().astype(np.float64)]
        if layer.bias is not None:
            out.append(layer.bias.grad.numpy().astype(np.float64))
        return out


# -- valid inputs match the reference ----------------------------------------------------------
@SETTINGS
@given(n=st.integers(1, 3), c=st.integers(1, 4), h=dims, w=dims, kh=st.integers(1, 4),
       kw=st.integers(1, 4), s=st.integers(1, 3), p=st.integers(0, 2), bias=st.booleans(),
       seed=seeds)
def test_dwconv2d_matches_reference(device, n, c, h, w, kh, kw, s, p, bias, seed):
    assume(h + 2 * p >= kh and w + 2 * p >= kw)
    rng = np.random.default_rng(seed)
    x, wt, b = arr(rng, n, c, h, w), arr(rng, c, kh, kw), arr(rng, c)
    with ut.DWConv2d(c, (kh, kw), s, p, bias=bias, device=device) as layer:
        layer.weight = wt
        if bias:
            layer.bias = b
        x64, w64 = x.astype(float), wt.astype(float)
        with ut.tensor(x, device) as xt, layer(xt) as y:
            ref = R.dwconv2d(x64, w64, b.astype(float) if bias else None, s, p)
            close("dwconv2d", y.numpy(), ref)
        go = arr(rng, *ref.shape)
        got = layer_grads(layer, device, go)
        want = R.dwconv2d_backward(x64, w64, s, p, go.astype(float))
        for name, g, r in zip(("dx", "dW", "db"), got, want):
            close("dwconv2d " + name, g, r)


@SETTINGS
@given(n=st.integers(1, 3), c=st.integers(1, 4), o=st.integers(1, 5), h=dims, w=dims,
       kh=st.integers(1, 4), kw=st.integers(1, 4), s=st.integers(1, 3), p=st.integers(0, 2),
       bias=st.booleans(), seed=seeds)
def test_conv2d_matches_reference(device, n, c, o, h, w, kh, kw, s, p, bias, seed):
    assume(h + 2 * p >= kh and w + 2 * p >= kw)
    rng = np.random.default_rng(seed)
    x, wt, b = arr(rng, n, c, h, w), arr(rng, o, c, kh, kw), arr(rng, o)
    with ut.Conv2d(c, o, (kh, kw), s, p, bias=bias, device=device) as layer:
        layer.weight = wt
        if bias:
            layer.bias = b
        x64, w64 = x.astype(float), wt.astype(float)
        with ut.tensor(x, device) as xt, layer(xt) as y:
            ref = R.conv2d(x64, w64, b.astype(float) if bias else None, s, p)
            close("conv2d", y.numpy(), ref)
        go = arr(rng, *ref.shape)
        for name, g, r in zip(("dx", "dW", "db"), layer_grads(layer, device, go),
                              R.conv2d_backward(x64, w64, s, p, go.astype(float))):
            close("conv2d " + name, g, r)


@SETTINGS
@given(n=st.integers(1, 8), i=st.integers(1, 40), o=st.integers(1, 40), bias=st.booleans(),
       seed=seeds)
def test_linear_matches_reference(device, n, i, o, bias, seed):
    rng = np.random.default_rng(seed)
    x, wt, b = arr(rng, n, i), arr(rng, o, i), arr(rng, o)
    with ut.Linear(i, o, bias=bias, device=device) as layer:
        layer.weight = wt
        if bias:
            layer.bias = b
        with ut.tensor(x, device) as xt, layer(xt) as y:
            close("linear", y.numpy(), R.linear(x.astype(float), wt.astype(float),
                                                b.astype(float) if bias else None))
        go = arr(rng, n, o)
        for name, g, r in zip(("dx", "dW", "db"), layer_grads(layer, device, go),
                              R.linear_backward(x.astype(float), wt.astype(float), go.astype(float))):
            close("linear " + name, g, r)


@SETTINGS
@given(lead=st.lists(st.integers(1, 4), min_size=1, max_size=3), d=st.integers(3, 40),
       eps=st.sampled_from([1e-5, 1e-3, 0.1]), seed=seeds)
def test_layernorm_matches_reference(device, lead, d, eps, seed):
    rng = np.random.default_rng(seed)
    shape = tuple(lead) + (d,)
    x = arr(rng, *shape, scale=2.0) + 1.0
    g, b = arr(rng, d) + 1.0, arr(rng, d)
    with ut.LayerNorm(d, eps=eps, device=device) as layer:
        layer.weight, layer.bias = g, b
        x64, g64 = x.astype(float), g.astype(float)
        with ut.tensor(x, device) as xt, layer(xt) as y:
            close("layernorm", y.numpy(), R.layernorm(x64, g64, b.astype(float), eps))
        go = arr(rng, *shape)
        for name, gg, r in zip(("dx", "dW", "db"), layer_grads(layer, device, go),
                               R.layernorm_backward(x64, g64, eps, go.astype(float))):
            close("layernorm " + name, gg, r, rtol=1e-3, atol=1e-4)


@SETTINGS
@given(n=st.integers(1, 4), c=st.integers(1, 5), h=dims, w=dims,
       eps=st.sampled_from([1e-5, 1e-3]), momentum=st.floats(0.0, 1.0), seed=seeds)
def test_batchnorm2d_matches_reference(device, n, c, h, w, eps, momentum, seed):
    assume(n * h * w >= 2)
    rng = np.random.default_rng(seed)
    x = arr(rng, n, c, h, w, scale=2.0) + 0.5
    g, b = arr(rng, c) + 1.0, arr(rng, c)
    with ut.BatchNorm2d(c, eps=eps, momentum=momentum, device=device) as layer:
        layer.weight, layer.bias = g, b
        x64, g64 = x.astype(float), g.astype(float)
        with ut.tensor(x, device) as xt, layer(xt) as y:
            ref, mean, var = R.batchnorm2d_train(x64, g64, b.astype(float), eps)
            close("batchnorm2d", y.numpy(), ref)
        rm, rv = R.batchnorm2d_running_stats(np.zeros(c), np.ones(c), mean, var, n * h * w, momentum)
        close("batchnorm2d running_mean", layer.running_mean.numpy(), rm)
        close("batchnorm2d running_var", layer.running_var.numpy(), rv)
        go = arr(rng, n, c, h, w)
        for name, gg, r in zip(("dx", "dW", "db"), layer_grads(layer, device, go),
                               R.batchnorm2d_backward(x64, g64, eps, go.astype(float))):
            close("batchnorm2d " + name, gg, r, rtol=1e-3, atol=1e-4)


@SETTINGS
@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=5), scale=st.floats(0.1, 10.0),
       seed=seeds)
def test_elementwise_and_mse_match_reference(device, shape, scale, seed):
    rng = np.random.default_rng(seed)
    x, go, t = arr(rng, *shape, scale=scale), arr(rng, *shape), arr(rng, *shape)
    x64, go64, t64 = x.astype(float), go.astype(float), t.astype(float)
    with ut.tensor(x, device) as xt, ut.tensor(go, device) as gt, ut.tensor(t, device) as tt:
        for name, f, ref in (("relu", ut.relu, R.relu), ("relu6", ut.relu6, R.relu6)):
            with f(xt) as y:
                close(name, y.numpy(), ref(x64), atol=0)
        with ut.relu_backward(gt, xt) as d:
            close("relu_backward", d.numpy(), R.relu_backward(go64, x64), atol=0)
        with ut.relu6_backward(gt, xt) as d:
            close("relu6_backward", d.numpy(), R.relu6_backward(go64, x64), atol=0)
        with ut.mse_loss(xt, tt) as l:
            close("mse", l.numpy(), R.mse_loss(x64, t64))
        with ut.mse_loss_backward(xt, tt) as d:
            close("mse_backward", d.numpy(), R.mse_loss_backward(x64, t64))


@SETTINGS
@given(n=st.integers(1, 10), k=st.integers(1, 12), scale=st.floats(0.01, 30.0), seed=seeds)
def test_cross_entropy_matches_reference(device, n, k, scale, seed):
    rng = np.random.default_rng(seed)
    z = arr(rng, n, k, scale=scale)
    labels = rng.integers(0, k, size=n)
    with ut.tensor(z, device) as zt, ut.cross_entropy(zt, labels) as l, \
            ut.cross_entropy_backward(zt, labels) as d:
        close("cross_entropy", l.numpy(), R.cross_entropy(z.astype(float), labels))
        close("cross_entropy_backward", d.numpy(), R.cross_entropy_backward(z.astype(float), labels))


@SETTINGS
@given(n=st.integers(1, 4), c=st.integers(1, 5), h=dims, w=dims, m=st.integers(1, 7),
       seed=seeds)
def test_pool_and_matmul_match_reference(device, n, c, h, w, m, seed):
    rng = np.random.default_rng(seed)
    x, go = arr(rng, n, c, h, w), arr(rng, n, c)
    with ut.tensor(x, device) as xt, ut.global_avg_pool2d(xt) as y, \
            ut.tensor(go, device) as gt, ut.global_avg_pool2d_backward(gt, h, w) as dx:
        close("avgpool", y.numpy(), R.global_avg_pool2d(x.astype(float)))
        close("avgpool_backward", dx.numpy(), R.global_avg_pool2d_backward(go.astype(float), h, w))
    a, b = arr(rng, n * c, h), arr(rng, h, m)
    with ut.tensor(a, device) as at, ut.tensor(b, device) as bt, ut.matmul(at, bt) as cc:
        close("matmul", cc.numpy(), R.matmul(a.astype(float), b.astype(float)))


# -- invalid inputs raise the documented exception ---------------------------------------------
@SETTINGS
@given(n=st.integers(1, 3), c=st.integers(1, 4), h=dims, w=dims, kh=st.integers(1, 9),
       kw=st.integers(1, 9), s=st.integers(1, 3), p=st.integers(0, 2), dc=st.integers(-2, 2),
       rank=st.integers(1, 6))
def test_conv_invalid_geometry_raises(device, n, c, h, w, kh, kw, s, p, dc, rank):
    """Wrong channel count, wrong rank, or a kernel larger than the padded input: ShapeError."""
    fits = h + 2 * p >= kh and w + 2 * p >= kw
    assume(not fits or dc != 0 or rank != 4)
    shape = (n, c + dc if c + dc >= 1 else c + 1, h, w)
    shape = shape[:rank] if rank <= 4 else shape + (1,) * (rank - 4)
    for layer in (ut.Conv2d(c, 2, (kh, kw), s, p, device=device),
                  ut.DWConv2d(c, (kh, kw), s, p, device=device)):
        with layer, ut.zeros(shape, device) as x:
            with pytest.raises(ut.ShapeError):
                layer(x)


@SETTINGS
@given(kind=st.sampled_from(["conv", "dw", "lin", "ln", "bn"]),
       bad=st.sampled_from([0, -1, -(2**31), 2**31, 2**40]), where=st.integers(0, 3))
def test_layer_invalid_hyperparameters_raise(device, kind, bad, where):
    """Non-positive or out-of-range sizes, strides, paddings: ArgumentError or ShapeError."""
    args = {
        "conv": [3, 4, 3, 1],       # in, out, kernel, stride
        "dw": [3, 3, 1, 0],         # channels, kernel, stride, padding
        "lin": [3, 4],
        "ln": [5],
        "bn": [5],
    }[kind]
    where = where % len(args)
    if kind == "dw" and where == 3 and bad >= 0:
        bad = -1 if bad == 0 else bad  # padding 0 is valid
    args[where] = bad
    cls = {"conv": ut.Conv2d, "dw": ut.DWConv2d, "lin": ut.Linear, "ln": ut.LayerNorm,
           "bn": ut.BatchNorm2d}[kind]
    with pytest.raises((ut.ArgumentError, ut.ShapeError)):
        cls(*args, device=device).close()


@SETTINGS
@given(a=st.lists(st.integers(1, 5), min_size=1, max_size=4),
       b=st.lists(st.integers(1, 5), min_size=1, max_size=4))
def test_binary_shape_mismatch_raises(device, a, b):
    a, b = tuple(a), tuple(b)
    with ut.zeros(a, device) as x, ut.zeros(b, device) as y:
        if a != b:
            for f in (ut.mse_loss, ut.mse_loss_backward, ut.relu_backward, ut.relu6_backward):
                with pytest.raises(ut.ShapeError):
                    f(x, y)
        if not (len(a) == 2 and len(b) == 2 and a[1] == b[0]):
            with pytest.raises(ut.ShapeError):
                ut.matmul(x, y)
        if len(a) != 2:
            with pytest.raises(ut.ShapeError):
                ut.cross_entropy(x, np.zeros(a[0], dtype=np.int64))


@SETTINGS
@given(n=st.integers(1, 5), k=st.integers(1, 6),
       labels=st.lists(st.integers(-(2**40), 2**40), min_size=1, max_size=5))
def test_cross_entropy_invalid_labels_raise(device, n, k, labels):
    labels = np.array(labels, dtype=np.int64)
    with ut.zeros((n, k), device) as z:
        if labels.shape != (n,):
            with pytest.raises(ut.ShapeError):
                ut.cross_entropy(z, labels)
        elif labels.min() < 0 or labels.max() >= k:
            with pytest.raises(ut.ArgumentError):
                ut.cross_entropy(z, labels)
            with pytest.raises(ut.ArgumentError):
                ut.cross_entropy_backward(z, labels)
        else:
            ut.cross_entropy(z, labels).close()
        with pytest.raises(ut.ArgumentTypeError):
            ut.cross_entropy(z, np.zeros(n, dtype=np.float32))


@SETTINGS
@given(shape=st.lists(st.integers(-(2**33), 2**33), min_size=0, max_size=10))
def test_tensor_shapes_valid_or_shape_error(device, shape):
    """Any int list is either a valid shape (<= 8 dims, each >= 1, <= INT_MAX elements) or a
    ShapeError, for every constructor."""
    n = 1
    for d in shape:
        n *= d
    valid = 1 <= len(shape) <= 8 and all(d >= 1 for d in shape) and n <= 2**31 - 1
    small = valid and n <= 2**20
    if valid and not small:
        return  # valid but large: allocating it is test_exhaustion's business
    for make in (lambda: ut.zeros(shape, device), lambda: ut.randn(shape, device=device),
                 lambda: ut.full(shape, 2.0, device)):
        if valid:
            with make() as t:
                assert t.shape == tuple(shape)
        else:
            with pytest.raises(ut.ShapeError):
                make()
