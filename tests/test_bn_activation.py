"""BatchNorm2d(activation=...): BatchNorm and the activation in one pass, for every kind of
ut_activation (relu, relu6, silu, hardswish, hardsigmoid, sigmoid, gelu, gelu_tanh).

Checked against numpy float64 (reference.py: batchnorm then the activation, and the chain rule
through both) and against the unfused layers, BatchNorm2d then the activation's layer, on the
same data: the fused layer must give their results, in training and eval mode, on the CPU and
the GPU, with many values in the clamped regions (relu, relu6) and on both sides of the kinks
(hardswish, hardsigmoid: -3 and 3). bf16 activations: tests/test_bf16_norm.py (GPU) and the
mixed-precision test below.
"""

import copy
import pickle

import numpy as np
import pytest

import utensil_ffi as ut
from bf16_reference import bf16_round
from tolerances import assert_close
from utensil_ffi import models
from utensil_ffi import reference as R
from utensil_ffi._lib import ffi, lib

# name -> (float64 forward, float64 backward(go, z), the unfused layer)
ACT = {
    "relu6": (R.relu6, R.relu6_backward, ut.ReLU6),
    "relu": (R.relu, R.relu_backward, ut.ReLU),
    "silu": (R.silu, R.silu_backward, ut.SiLU),
    "hardswish": (R.hardswish, R.hardswish_backward, ut.Hardswish),
    "hardsigmoid": (R.hardsigmoid, R.hardsigmoid_backward, ut.Hardsigmoid),
    "sigmoid": (R.sigmoid, R.sigmoid_backward, ut.Sigmoid),
    "gelu": (R.gelu, R.gelu_backward, ut.GELU),
    "gelu_tanh": (lambda z: R.gelu(z, "tanh"), lambda g, z: R.gelu_backward(g, z, "tanh"),
                  lambda: ut.GELU(approximate="tanh")),
}
NAMES = list(ACT)
# where each activation's derivative jumps: float32 and float64 may put a value within
# rounding of one on different sides
KINKS = {"relu": (0.0,), "relu6": (0.0, 6.0), "hardswish": (-3.0, 3.0),
         "hardsigmoid": (-3.0, 3.0)}


def _spread_check(act, z):
    """The data reach the activation's distinct regions, so a wrong formula cannot hide."""
    if act == "relu6":
        frac = np.mean((z <= 0) | (z >= 6))
    elif act in KINKS:
        k = KINKS[act]
        frac = np.mean((z <= k[0]) | (z >= k[-1])) if len(k) > 1 else np.mean(z <= k[0])
    else:  # the smooth kinds: both signs, the curved middle included
        frac = np.mean(z < 0)
        assert np.mean(np.abs(z) < 2) > 0.1
    assert 0.1 < frac < 0.9, (act, frac)


def _data(seed, n=4, c=6, h=5, w=7):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n, c, h, w)) * 3 + 1).astype(np.float32)
    g = rng.uniform(0.5, 5.0, c).astype(np.float32)  # wide: many outputs past 6 and below 0
    b = rng.uniform(-1.0, 4.0, c).astype(np.float32)
    go = rng.standard_normal((n, c, h, w)).astype(np.float32)
    return x, g, b, go


@pytest.mark.parametrize("act", NAMES)
@pytest.mark.parametrize("shape", [(4, 6, 5, 7), (3, 8, 4, 4), (2, 3, 1, 1)])
def test_fused_training_matches_float64(device, act, shape):
    x, g, b, go = _data(sum(shape), *shape)
    f, fb, _ = ACT[act]
    z, _, _ = R.batchnorm2d_train(x.astype(float), g.astype(float), b.astype(float), 1e-5)
    with ut.BatchNorm2d(shape[1], activation=act, device=device) as bn:
        bn.weight, bn.bias = g, b
        y = bn(ut.tensor(x, device))
        assert_close("bn+%s forward" % act, y.numpy(), f(z))
        _spread_check(act, z)
        dx = bn.backward(ut.tensor(go, device))
        rdx, rdg, rdb = R.batchnorm2d_backward(x.astype(float), g.astype(float), 1e-5,
                                               fb(go.astype(float), z))
        assert_close("bn+%s backward dx" % act, dx.numpy(), rdx)
        assert_close("bn+%s backward dgamma" % act, bn.weight.grad.numpy(), rdg)
        assert_close("bn+%s backward dbeta" % act, bn.bias.grad.numpy(), rdb)


@pytest.mark.parametrize("act", NAMES)
def test_fused_eval_matches_float64(device, act):
    # frozen statistics: z from the running mean and variance, dx = gamma rstd f'(z) go
    x, g, b, go = _data(29, 3, 5, 4, 6)
    rng = np.random.default_rng(30)
    rm = rng.normal(1.0, 0.5, 5).astype(np.float32)
    rv = rng.uniform(4.0, 12.0, 5).astype(np.float32)
    f, fb, _ = ACT[act]
    x64, g64, rm64, rv64 = (a.astype(np.float64) for a in (x, g, rm, rv))
    z = R.batchnorm2d_eval(x64, g64, b.astype(np.float64), rm64, rv64, 1e-5)
    _spread_check(act, z)
    with ut.BatchNorm2d(5, activation=act, device=device) as bn:
        bn.weight, bn.bias = g, b
        bn.running_mean, bn.running_var = rm, rv
        bn.eval()
        y = bn(ut.tensor(x, device))
        assert_close("bn+%s eval forward" % act, y.numpy(), f(z))
        dx = bn.backward(ut.tensor(go, device))
        rdx, rdg, rdb = R.batchnorm2d_eval_backward(x64, g64, rm64, rv64, 1e-5,
                                                    fb(go.astype(np.float64), z))
        assert_close("bn+%s eval backward dx" % act, dx.numpy(), rdx)
        assert_close("bn+%s eval backward dgamma" % act, bn.weight.grad.numpy(), rdg)
        assert_close("bn+%s eval backward dbeta" % act, bn.bias.grad.numpy(), rdb)
        # eval mode leaves the running statistics alone
        np.testing.assert_array_equal(bn.running_mean.numpy(), rm)


def _run(layers, x, go, device, train=True):
    seq = ut.Sequential(*layers)
    layers[0].train(train)  # eval: frozen statistics (BatchNorm keeps its cache for backward)
    y = seq(ut.tensor(x, device)).numpy()
    dx = seq.backward(ut.tensor(go, device)).numpy()
    bn = layers[0]
    return y, dx, bn.weight.grad.numpy(), bn.bias.grad.numpy(), bn.running_mean.numpy()


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("act", NAMES)
def test_fused_equals_unfused(device, train, act):
    x, g, b, go = _data(7)
    out = []
    for fused in (True, False):
        bn = ut.BatchNorm2d(6, activation=act if fused else None, device=device)
        bn.weight, bn.bias = g, b
        bn.running_mean, bn.running_var = np.full(6, 0.5, np.float32), np.full(6, 2.0, np.float32)
        layers = [bn] if fused else [bn, ACT[act][2]()]
        out.append(_run(layers, x, go, device, train))
        bn.close()
    # the same formulas on the same float32 z (ut__act_value / ut__act_grad): float32 rounding
    # at most (a GPU's two kernels may contract a multiply-add differently)
    for name, a, u in zip(("y", "dx", "dgamma", "dbeta", "running_mean"), *out):
        np.testing.assert_allclose(a, u, rtol=1e-6, atol=1e-6, err_msg="%s %s" % (act, name))


def test_fused_mobilenet_trains_as_the_unfused_one(device):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 1, 8, 8)).astype(np.float32)
    labels = ut.tensor(rng.integers(0, 10, 4).astype(np.float32), device)
    grads = []
    for fused in (True, False):
        ut.seed(11)
        net = models.mobilenet(1, 10, 8, device=device, fused=fused)
        assert sum(isinstance(l, ut.ReLU6) for l in net) == (0 if fused else 3 * 2 + 3)
        logits = net(ut.tensor(x, device))
        net.backward(ut.cross_entropy_backward(logits, labels))
        grads.append([p.grad.numpy() for p in net.parameters()] + [logits.numpy()])
        net.close()
    assert len(grads[0]) == len(grads[1])
    for a, u in zip(*grads):
        np.testing.assert_allclose(a, u, rtol=1e-5, atol=1e-6)


def test_activation_names_are_the_c_enums():
    # another layer's code reads _ACTIVATIONS to decide what to fuse: every kind, by
    # ut_activation_name's name (None for UT_ACT_NONE)
    table = ut.BatchNorm2d._ACTIVATIONS
    assert sorted(k for k in table if k) == sorted(NAMES)
    for name, code in table.items():
        assert ffi.string(lib.ut_activation_name(code)).decode() == (name or "none")
        with ut.BatchNorm2d(2, activation=name) as bn:
            assert bn.activation == name and bn._struct.activation == code


def test_activation_is_checked():
    for bad in ("tanh", "GELU", "swish", "none"):
        with pytest.raises(ut.ArgumentError, match="activation must be one of"):
            ut.BatchNorm2d(4, activation=bad)
    with pytest.raises(ut.ArgumentTypeError):
        ut.BatchNorm2d(4, activation=6)
    with ut.BatchNorm2d(4) as bn:
        assert bn.activation is None
        for code in (9, -1, 1000):  # a C caller's bad value is refused with a message
            bn._struct.activation = code
            with pytest.raises(ut.ArgumentError, match="activation must be"):
                bn(np.zeros((2, 4, 3, 3), np.float32))
            assert b"activation" in ffi.string(lib.ut_last_error())


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_cache_activation_is_checked(act):
    # backward applies the activation the forward cached: a bad one there is refused too
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 2, 2)
    with ut.BatchNorm2d(3, activation=act) as bn, ut.tensor(x) as xt, ut.tensor(x) as gt:
        cache = ffi.new("ut_batchnorm2d_cache *")
        y = lib.ut_batchnorm2d_forward(bn._struct, xt._ptr, cache)
        assert y != ffi.NULL and cache.activation == bn._struct.activation
        try:
            cache.activation = 42
            assert lib.ut_batchnorm2d_backward(bn._struct, cache, gt._ptr, ffi.NULL,
                                               ffi.NULL) == ffi.NULL
            assert b"cache->activation must be a ut_activation (0 to 8), got 42" in \
                ffi.string(lib.ut_last_error())
        finally:
            lib.ut_free(y)
            lib.ut_batchnorm2d_cache_free(cache)


def test_activation_survives_copy_and_pickle_and_repr():
    with ut.BatchNorm2d(4, activation="relu6") as bn:
        assert "activation='relu6'" in repr(bn)
        for other in (copy.deepcopy(bn), pickle.loads(pickle.dumps(bn))):
            with other:
                assert other.activation == "relu6"
                y = other(np.full((2, 4, 3, 3), 100.0, np.float32) * np.arange(2).reshape(2, 1, 1, 1))
                assert float(y.numpy().max()) <= 6.0


@pytest.mark.parametrize("act", ["hardswish", "silu", "gelu_tanh"])
def test_new_activations_survive_copy_pickle_and_keep_the_state_dict(act):
    x = np.random.default_rng(4).standard_normal((2, 4, 3, 3)).astype(np.float32) * 4
    with ut.BatchNorm2d(4, activation=act) as bn, ut.BatchNorm2d(4) as plain:
        assert repr(bn) == repr(plain).replace(", device=", ", activation=%r, device=" % act)
        assert list(bn.state_dict()) == list(plain.state_dict())
        bn.eval()
        want = bn(x).numpy()
        for other in (copy.deepcopy(bn), pickle.loads(pickle.dumps(bn))):
            with other:
                assert other.activation == act
                np.testing.assert_array_equal(other(x).numpy(), want)


# ---- bfloat16 activations ----------------------------------------------------------------------
BF16_ULP = 2.0 ** -7  # one bf16 step, relative to the value, at most


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("act", NAMES)
def test_fused_bf16_is_the_float32_result_rounded(device, act, train):
    # bf16 x and go: the same arithmetic in float32 (statistics and parameter gradients float32),
    # y and dx rounded once when stored; the CPU to the bit, the GPU within one step here (to the
    # bit on every row width: tests/test_bf16_norm.py)
    x, g, b, go = _data(11)
    x, go = bf16_round(x), bf16_round(go)
    res = {}
    for dt in (ut.float32, ut.bfloat16):
        with ut.BatchNorm2d(6, activation=act, device=device) as bn, \
                ut.tensor(x, device, dt) as xt, ut.tensor(go, device, dt) as gt:
            bn.weight, bn.bias = g, b
            bn.running_mean, bn.running_var = np.full(6, 0.5, np.float32), np.full(6, 3, np.float32)
            bn.train(train)
            with bn(xt) as y, bn.backward(gt) as dx:
                assert y.dtype == dx.dtype == dt and bn.weight.grad.dtype == ut.float32
                res[dt] = (y.numpy().astype(np.float32), dx.numpy().astype(np.float32),
                           bn.weight.grad.numpy().copy(), bn.bias.grad.numpy().copy())
    (yf, dxf, dgf, dbf), (yb, dxb, dgb, dbb) = res[ut.float32], res[ut.bfloat16]
    for name, got, want in (("y", yb, yf), ("dx", dxb, dxf)):
        if device == "cpu":
            np.testing.assert_array_equal(got, bf16_round(want), err_msg="%s %s" % (act, name))
        else:
            np.testing.assert_allclose(got, want, rtol=BF16_ULP, atol=1e-6 * np.abs(want).max(),
                                       err_msg="%s %s" % (act, name))
    np.testing.assert_allclose(dgb, dgf, rtol=1e-6, atol=1e-6, err_msg=act + " dgamma")
    np.testing.assert_allclose(dbb, dbf, rtol=1e-6, atol=1e-6, err_msg=act + " dbeta")


@pytest.mark.parametrize("act", ["hardswish", "silu", "gelu_tanh", "relu6"])
def test_fused_under_mixed_precision_trains_as_the_unfused_net(device, act):
    # MixedPrecision runs the layers on bf16 activations: the fused net rounds once after the
    # activation where the unfused one also rounds BatchNorm's output, so the two agree to bf16
    # precision, not to the bit
    rng = np.random.default_rng(8)
    x = rng.standard_normal((4, 3, 6, 6)).astype(np.float32)
    labels = rng.integers(0, 3, 4)
    results = []
    for fused in (True, False):
        ut.seed(21)
        bn = ut.BatchNorm2d(8, activation=act if fused else None)
        # no bias before BatchNorm: its gradient is zero but for rounding noise
        layers = [ut.Conv2d(3, 8, 3, padding=1, bias=False), bn] + \
            ([] if fused else [ACT[act][2]()])
        net = ut.Sequential(*layers, ut.Conv2d(8, 5, 1), ut.GlobalAvgPool2d(),
                            ut.Linear(5, 3)).to(device)
        mp = ut.MixedPrecision(net)
        crit = ut.CrossEntropyLoss()
        try:
            with ut.tensor(x, device) as xt, mp(xt) as out:
                assert out.dtype == ut.float32
                loss = crit(out, labels)
                loss.close()
                with crit.backward() as gl, mp.backward(gl) as dx:
                    results.append([out.numpy().copy(), dx.numpy().copy()] +
                                   [p.grad.numpy().copy() for p in mp.parameters()])
        finally:
            crit.close()
            net.close()
    assert len(results[0]) == len(results[1])
    for i, (a, u) in enumerate(zip(*results)):
        scale = float(np.abs(u).max()) or 1.0
        # measured: at most 0.7% of the largest value on the CPU (a few bf16 steps)
        np.testing.assert_allclose(a, u, rtol=0, atol=0.02 * scale, err_msg="%s item %d" % (act, i))


# ---- ONNX -------------------------------------------------------------------------------------
# The exported graph is BatchNormalization followed by the activation's nodes, the ones the
# separate activation layer exports (utensil_ffi/interop/onnx_export.py).
@pytest.mark.parametrize("act", NAMES)
@pytest.mark.parametrize("opset", [13, 20])
def test_onnx_export_applies_the_fused_activation(tmp_path, act, opset):
    pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from utensil_ffi.onnx_export import export_onnx

    x, g, b, _ = _data(12, 2, 6, 5, 4)
    with ut.Sequential(ut.BatchNorm2d(6, activation=act)) as net:
        bn = net[0]
        bn.weight, bn.bias = g, b
        bn.running_mean, bn.running_var = np.full(6, 0.5, np.float32), np.full(6, 3, np.float32)
        net.eval()
        path = str(tmp_path / "bn.onnx")
        export_onnx(net, path, (1, 6, 5, 4), opset=opset)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        sess = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
        got = sess.run(None, {"input": x})[0]
        want = net(x).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
