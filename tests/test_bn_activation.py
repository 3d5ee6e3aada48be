"""BatchNorm2d(activation="relu6" | "relu"): BatchNorm and the activation in one pass.

Checked against numpy float64 (reference.py: batchnorm then relu6, and the chain rule through
both) and against the unfused layers, BatchNorm2d then ReLU6, on the same data: the fused layer
must give their results, in training and eval mode, on the CPU and the GPU, with many values in
both clamped regions.
"""

import copy
import pickle

import numpy as np
import pytest

import utensil_ffi as ut
from tolerances import assert_close
from utensil_ffi import models
from utensil_ffi import reference as R
from utensil_ffi._lib import ffi, lib

ACT = {"relu6": (R.relu6, R.relu6_backward, ut.ReLU6), "relu": (R.relu, R.relu_backward, ut.ReLU)}


def _data(seed, n=4, c=6, h=5, w=7):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n, c, h, w)) * 3 + 1).astype(np.float32)
    g = rng.uniform(0.5, 5.0, c).astype(np.float32)  # wide: many outputs past 6 and below 0
    b = rng.uniform(-1.0, 4.0, c).astype(np.float32)
    go = rng.standard_normal((n, c, h, w)).astype(np.float32)
    return x, g, b, go


@pytest.mark.parametrize("act", ["relu6", "relu"])
@pytest.mark.parametrize("shape", [(4, 6, 5, 7), (3, 8, 4, 4), (2, 3, 1, 1)])
def test_fused_training_matches_float64(device, act, shape):
    x, g, b, go = _data(sum(shape), *shape)
    f, fb, _ = ACT[act]
    z, _, _ = R.batchnorm2d_train(x.astype(float), g.astype(float), b.astype(float), 1e-5)
    with ut.BatchNorm2d(shape[1], activation=act, device=device) as bn:
        bn.weight, bn.bias = g, b
        y = bn(ut.tensor(x, device))
        assert_close("bn+%s forward" % act, y.numpy(), f(z))
        clamped = np.mean((z <= 0) | ((z >= 6) if act == "relu6" else False))
        assert 0.1 < clamped < 0.9  # the masks really matter in this test
        dx = bn.backward(ut.tensor(go, device))
        rdx, rdg, rdb = R.batchnorm2d_backward(x.astype(float), g.astype(float), 1e-5,
                                               fb(go.astype(float), z))
        assert_close("bn+%s backward dx" % act, dx.numpy(), rdx)
        assert_close("bn+%s backward dgamma" % act, bn.weight.grad.numpy(), rdg)
        assert_close("bn+%s backward dbeta" % act, bn.bias.grad.numpy(), rdb)


def _run(layers, x, go, device, train=True):
    seq = ut.Sequential(*layers)
    layers[0].train(train)  # eval: frozen statistics (BatchNorm keeps its cache for backward)
    y = seq(ut.tensor(x, device)).numpy()
    dx = seq.backward(ut.tensor(go, device)).numpy()
    bn = layers[0]
    return y, dx, bn.weight.grad.numpy(), bn.bias.grad.numpy(), bn.running_mean.numpy()


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("act", ["relu6", "relu"])
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
    for name, a, u in zip(("y", "dx", "dgamma", "dbeta", "running_mean"), *out):
        np.testing.assert_allclose(a, u, rtol=1e-6, atol=1e-6, err_msg=name)


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


def test_activation_is_checked():
    with pytest.raises(ut.ArgumentError, match="activation"):
        ut.BatchNorm2d(4, activation="gelu")
    with pytest.raises(ut.ArgumentTypeError):
        ut.BatchNorm2d(4, activation=6)
    with ut.BatchNorm2d(4) as bn:
        assert bn.activation is None
        bn._struct.activation = 9  # a C caller's bad value is refused with a message
        with pytest.raises(ut.ArgumentError, match="activation must be"):
            bn(np.zeros((2, 4, 3, 3), np.float32))
        assert b"activation" in ffi.string(lib.ut_last_error())


def test_activation_survives_copy_and_pickle_and_repr():
    with ut.BatchNorm2d(4, activation="relu6") as bn:
        assert "activation='relu6'" in repr(bn)
        for other in (copy.deepcopy(bn), pickle.loads(pickle.dumps(bn))):
            with other:
                assert other.activation == "relu6"
                y = other(np.full((2, 4, 3, 3), 100.0, np.float32) * np.arange(2).reshape(2, 1, 1, 1))
                assert float(y.numpy().max()) <= 6.0
