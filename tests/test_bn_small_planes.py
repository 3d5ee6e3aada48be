"""BatchNorm2d over small planes (fewer than 64 values: the 7x7 and smaller planes at the end of
a network), where the CPU sums and applies a block of channels as one run of each image.

Checked against numpy float64 in training mode (output, running statistics, dx, dgamma, dbeta)
and in eval mode, with the cases the run's bookkeeping could get wrong: planes of 1 to 63 values
(and 64, the per-row path, for comparison), channel counts that leave a partial block, batches
past the 64 images summed in float before a double, an offset mean with a small spread (the
variance must not cancel), and every fused activation, the data on both sides of zero.
"""

import numpy as np
import pytest

import utensil_ffi as ut
from tolerances import assert_close
from utensil_ffi.testing import reference as R

ACT = R.ACTIVATIONS

# (n, c, h, w): a 1x1 plane with a partial block of channels (300 = 256 + 44), planes of 4, 9,
# 16, 49, 63 and 64 values, a batch past 64 images
SHAPES = [(3, 300, 1, 1), (70, 5, 2, 2), (2, 37, 3, 3), (8, 40, 4, 4), (5, 11, 7, 7),
          (3, 9, 7, 9), (2, 6, 8, 8), (130, 3, 1, 3)]


def _data(shape, seed, offset=1.0, spread=3.0):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * spread + offset).astype(np.float32)
    g = rng.uniform(0.5, 5.0, shape[1]).astype(np.float32)
    b = rng.uniform(-1.0, 4.0, shape[1]).astype(np.float32)
    go = rng.standard_normal(shape).astype(np.float32)
    return x, g, b, go


@pytest.mark.parametrize("act", list(ACT))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_training_matches_float64(device, shape, act):
    x, g, b, go = _data(shape, sum(shape))
    f, fb = ACT[act]
    x64 = x.astype(np.float64)
    z, mean, var = R.batchnorm2d_train(x64, g.astype(np.float64), b.astype(np.float64), 1e-5)
    if act:  # the data reach both sides of the kinks
        assert 0.1 < np.mean(z <= 0) < 0.9
    with ut.BatchNorm2d(shape[1], activation=act, momentum=0.25, device=device) as bn:
        bn.weight, bn.bias = g, b
        y = bn(ut.tensor(x, device))
        assert_close("forward", y.numpy(), f(z))
        count = shape[0] * shape[2] * shape[3]
        rm, rv = R.batchnorm2d_running_stats(np.zeros(shape[1]), np.ones(shape[1]), mean, var,
                                             count, 0.25)
        assert_close("running mean", bn.running_mean.numpy(), rm)
        assert_close("running var", bn.running_var.numpy(), rv)
        dx = bn.backward(ut.tensor(go, device))
        rdx, rdg, rdb = R.batchnorm2d_backward(x64, g.astype(np.float64), 1e-5,
                                               fb(go.astype(np.float64), z))
        assert_close("dx", dx.numpy(), rdx)
        assert_close("dgamma", bn.weight.grad.numpy(), rdg)
        assert_close("dbeta", bn.bias.grad.numpy(), rdb)


@pytest.mark.parametrize("shape", [(4, 300, 1, 1), (70, 5, 2, 2), (3, 9, 7, 9)], ids=str)
def test_offset_mean_small_spread(device, shape):
    # a mean of 100 and a spread of 0.05: a variance from squares about zero would cancel (x's
    # own float32 rounding, 4e-6 at 100, bounds the output's agreement)
    x, g, b, go = _data(shape, 7, offset=100.0, spread=0.05)
    z, mean, var = R.batchnorm2d_train(x.astype(np.float64), g.astype(np.float64),
                                       b.astype(np.float64), 1e-8)
    with ut.BatchNorm2d(shape[1], eps=1e-8, momentum=1.0, device=device) as bn:
        bn.weight, bn.bias = g, b
        y = bn(ut.tensor(x, device))
        assert_close("forward", y.numpy(), z, rtol=1e-3, atol=2e-3)
        count = shape[0] * shape[2] * shape[3]
        np.testing.assert_allclose(bn.running_var.numpy(), var * count / (count - 1), rtol=1e-3)


@pytest.mark.parametrize("act", list(ACT))
@pytest.mark.parametrize("shape", [(3, 300, 1, 1), (70, 5, 2, 2), (5, 11, 7, 7)], ids=str)
def test_eval_matches_float64(device, shape, act):
    x, g, b, go = _data(shape, 3 + sum(shape))
    rng = np.random.default_rng(5)
    rm = rng.normal(1.0, 0.5, shape[1]).astype(np.float32)
    rv = rng.uniform(4.0, 12.0, shape[1]).astype(np.float32)
    f, fb = ACT[act]
    x64, g64, rm64, rv64 = (a.astype(np.float64) for a in (x, g, rm, rv))
    z = R.batchnorm2d_eval(x64, g64, b.astype(np.float64), rm64, rv64, 1e-5)
    with ut.BatchNorm2d(shape[1], activation=act, device=device) as bn:
        bn.weight, bn.bias = g, b
        bn.running_mean, bn.running_var = rm, rv
        bn.eval()
        y = bn(ut.tensor(x, device))
        assert_close("eval forward", y.numpy(), f(z))
        dx = bn.backward(ut.tensor(go, device))
        rdx, rdg, rdb = R.batchnorm2d_eval_backward(x64, g64, rm64, rv64, 1e-5,
                                                    fb(go.astype(np.float64), z))
        assert_close("eval dx", dx.numpy(), rdx)
        assert_close("eval dgamma", bn.weight.grad.numpy(), rdg)
        assert_close("eval dbeta", bn.bias.grad.numpy(), rdb)
