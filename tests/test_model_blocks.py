"""utensil_ffi.models' block classes (InvertedResidual, CNBlock) at tiny sizes: gradients by
central finite differences (stochastic depth masks repeated through ut.seed, so backward must
use the forward's), input_grad=False, eval mode, the input's grad through the skip connection,
copies and repr."""

import copy
import pickle

import numpy as np
import pytest

import utensil_ffi as ut
from utensil_ffi.models import CNBlock, InvertedResidual
from utensil_ffi.models import efficientnet, mobilenetv2


def _value(block, x, gout, seed):
    ut.seed(seed)  # the same stochastic depth mask at every call
    y = block(x)
    try:
        return float(np.sum(y.numpy().astype(np.float64) * gout))
    finally:
        y.close()


def _check_fd(block, x, seed, rng, picks=4, eps=1e-2, tol=2e-2):
    """block's dx and parameter gradients against central differences of sum(block(x) * G),
    at a few random entries of x and of each parameter (float32 throughout: eps 1e-2)."""
    ut.seed(seed)
    y = block(x)
    gout = rng.normal(0, 1, y.shape)
    y.close()
    block.zero_grad()
    ut.seed(seed)
    y = block(x)
    y.close()
    dx = block.backward(ut.tensor(gout.astype(np.float32)))
    got = {"x": dx.numpy().copy()}
    dx.close()
    for k, p in block.named_parameters():
        got[k] = p.grad.numpy().copy()
    targets = [("x", x, None)] + [(k, p.numpy().copy(), p) for k, p in block.named_parameters()]
    for k, arr, p in targets:
        scale = max(float(np.abs(got[k]).max()), 1e-3)
        flat = arr.reshape(-1)
        for i in rng.choice(flat.size, min(picks, flat.size), replace=False):
            vals = []
            for d in (eps, -eps):
                a = arr.copy()
                a.reshape(-1)[i] += d
                if p is None:
                    vals.append(_value(block, a, gout, seed))
                else:
                    p.copy_from(a)
                    vals.append(_value(block, x, gout, seed))
            if p is not None:
                p.copy_from(arr)
            num = (vals[0] - vals[1]) / (2 * eps)
            ana = float(got[k].reshape(-1)[i])
            assert abs(num - ana) <= tol * scale, "%s[%d]: %g vs finite differences %g" % (
                k, i, ana, num)


def _mbconv(stride, sd_prob, cin=4, cout=4):
    # EfficientNet's MBConv: SiLU and Sigmoid are smooth, so differences are clean
    return efficientnet._mbconv(cin, cout, 3, stride, 2, sd_prob, True, "cpu")


@pytest.mark.parametrize("stride, sd_prob", [(1, 0.0), (1, 0.5), (2, 0.0)],
                         ids=["residual", "residual+stochastic_depth", "no_residual"])
def test_inverted_residual_finite_differences(rng, stride, sd_prob):
    ut.seed(3)
    block = _mbconv(stride, sd_prob)
    try:
        assert block.use_res_connect == (stride == 1)
        x = rng.normal(0, 1, (3, 4, 5, 5)).astype(np.float32)
        _check_fd(block, x, 11, rng)
    finally:
        block.close()


def test_cnblock_finite_differences(rng):
    ut.seed(4)
    block = CNBlock(4, layer_scale=1.0, stochastic_depth_prob=0.5)
    try:
        block.layer_scale.copy_from(rng.uniform(0.5, 1.5, (4, 1, 1)).astype(np.float32))
        assert [k for k, _ in block.named_parameters()][0] == "layer_scale"
        x = rng.normal(0, 1, (3, 4, 4, 4)).astype(np.float32)
        _check_fd(block, x, 12, rng)
    finally:
        block.close()


def test_stochastic_depth_drops_whole_samples_of_the_branch(rng):
    ut.seed(5)
    block = CNBlock(4, layer_scale=1.0, stochastic_depth_prob=1.0)
    try:
        x = rng.normal(0, 1, (2, 4, 3, 3)).astype(np.float32)
        y = block(x)  # p = 1: the branch is dropped, x passes
        np.testing.assert_array_equal(y.numpy(), x)
        dx = block.backward(ut.ones(y.shape))
        np.testing.assert_array_equal(dx.numpy(), np.ones_like(x))
        assert not block.layer_scale.grad.numpy().any()
        y.close(), dx.close()
    finally:
        block.close()


@pytest.mark.parametrize("make", ["mbconv", "cnblock", "v2"])
def test_input_grad_false_eval_copies_and_repr(rng, make):
    ut.seed(6)
    if make == "mbconv":
        block = _mbconv(1, 0.0)
    elif make == "cnblock":
        block = CNBlock(4, layer_scale=0.5)
    else:
        block = mobilenetv2._block(4, 4, 1, 2, True, "cpu")
        assert [k for k, _ in block.named_children()] == ["conv"]
    other = copy.deepcopy(block)
    x = rng.normal(0, 1, (2, 4, 5, 5)).astype(np.float32)
    g = ut.tensor(rng.normal(0, 1, (2, 4, 5, 5)).astype(np.float32))
    try:
        # input_grad=False: the same parameter gradients, None returned
        for b, kw in ((block, {}), (other, {"input_grad": False})):
            b.zero_grad()
            b(x).close()
            out = b.backward(g, **kw)
            assert (out is None) == bool(kw)
            if out is not None:
                out.close()
        for (k, p), q in zip(block.named_parameters(), other.parameters()):
            np.testing.assert_array_equal(p.grad.numpy(), q.grad.numpy(), err_msg=k)
        block.eval()
        y1 = block(x)
        with pytest.raises(ut.ArgumentError):
            block.backward(g)
        for c in (copy.deepcopy(block), pickle.loads(pickle.dumps(block))):
            assert type(c) is type(block) and not c.training
            assert sorted(c.state_dict()) == sorted(block.state_dict())
            yc = c(x)
            np.testing.assert_array_equal(yc.numpy(), y1.numpy())
            yc.close(), c.close()
        y1.close()
        assert type(block).__name__ + "(" in repr(block)
    finally:
        g.close(), block.close(), other.close()


def test_inverted_residual_refuses_a_non_module():
    with pytest.raises(ut.ArgumentTypeError):
        InvertedResidual(3, True)
