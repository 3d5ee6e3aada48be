"""backward(grad_out, input_grad=False): the same parameter gradients, bit for bit, as
backward(grad_out), no input gradient returned (None), and for Conv2d none computed
(ut_conv2d_backward_params: no dx GEMM, no col2im). PyTorch computes no gradient for an input that
does not require one; a network's first layer reads the images, whose gradient nobody uses.

Containers (Sequential, Residual, MixedPrecision, DistributedDataParallel) pass input_grad=False
to the module whose input gradient is thrown away; a user's Module whose ``backward(self,
grad_out)`` has no such keyword still works there (called plainly, its result closed).
The C call itself is tested in native/test.c (test_conv2d_backward_params).
"""

import numpy as np
import pytest

import utensil_ffi as ut
from utensil_ffi import distributed as D
from utensil_ffi import models
from utensil_ffi.testing import optable
from utensil_ffi.layers import _backward_params_only

from thread_group import run_ranks


def _grads(module):
    return [p.grad.numpy().copy() for p in module.parameters()]


def _assert_same(a, b):
    assert len(a) == len(b) and a
    for i, (u, v) in enumerate(zip(a, b)):
        assert np.array_equal(u, v, equal_nan=True), "parameter %d: gradients differ" % i


def _both_ways(module, x, g):
    """(grads after backward(g), grads after backward(g, input_grad=False) on a new forward of
    the same x, what that second backward returned); the first backward's dx is checked open."""
    module.zero_grad()
    with module(x):
        dx = module.backward(g)
    assert isinstance(dx, ut.Tensor) and not dx.closed
    dx.close()
    full = _grads(module)
    module.zero_grad()
    with module(x):
        r = module.backward(g, input_grad=False)
    return full, _grads(module), r


class _CountCBackward:
    """Counts the calls of Conv2d's full C backward (the one that computes dx)."""

    def __init__(self, monkeypatch):
        self.calls = 0
        real = ut.Conv2d._c_backward

        def counted(*args):
            self.calls += 1
            return real(*args)

        monkeypatch.setattr(ut.Conv2d, "_c_backward", staticmethod(counted))


# conv2d's samples marked "params_only" in the op table (utensil_ffi/testing/optable.py): 3x3 s2 p1
# (im2col, col2im), 1x1 merged over the batch, 1x1 per image without bias, strided 1x1
PARAMS_ONLY = optable.OP["conv2d"].samples_for("params_only")


@pytest.mark.parametrize("geom", [s.geom for s in PARAMS_ONLY], ids=[s.name for s in PARAMS_ONLY])
def test_conv2d_params_only(device, geom, monkeypatch):
    ut.seed(1)
    op = optable.OP["conv2d"]
    conv = op.make(geom, device)
    gm = op.geometry(**geom)
    n, cout, h, w = gm["n"], gm["o"], gm["h"], gm["w"]
    kh, kw, s, p = gm["kh"], gm["kw"], gm["stride"], gm["pad"]
    shape = (n, cout, (h + 2 * p - kh) // s + 1, (w + 2 * p - kw) // s + 1)
    with ut.randn(op.shapes(geom)["x"], device=device) as x:
        with ut.randn(shape, device=device) as g:
            full, part, r = _both_ways(conv, x, g)
            # and the dx path really is skipped: the full C backward is not called
            counter = _CountCBackward(monkeypatch)
            with conv(x):
                assert conv.backward(g, input_grad=False) is None
            assert counter.calls == 0
            with conv(x):
                conv.backward(g).close()
            assert counter.calls == 1
    assert r is None
    _assert_same(full, part)
    conv.close()


def test_conv2d_params_only_non_finite_grad():
    # a NaN in grad_out with padding: the CPU sums real input only (no NaN * padding zero)
    ut.seed(2)
    conv = ut.Conv2d(2, 3, 3, padding=1)
    g = ut.randn((2, 3, 6, 5)).numpy()
    g[1, 2, 3, 4] = np.nan
    with ut.randn((2, 2, 6, 5)) as x, ut.tensor(g) as gt:
        full, part, r = _both_ways(conv, x, gt)
    assert r is None
    _assert_same(full, part)
    conv.close()


def test_params_only_accumulates_like_backward():
    # two backward passes without zero_grad: += both times, as backward does
    ut.seed(3)
    conv = ut.Conv2d(2, 3, 3, stride=2, padding=1)
    x, g = ut.randn((2, 2, 7, 7)), ut.randn((2, 3, 4, 4))
    for _ in range(2):
        conv(x).close()
        conv.backward(g).close()
    want = _grads(conv)
    conv.zero_grad()
    for _ in range(2):
        conv(x).close()
        assert conv.backward(g, input_grad=False) is None
    _assert_same(want, _grads(conv))
    for t in (x, g):
        t.close()
    conv.close()


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_mobilenet_params_only(fused, monkeypatch):
    ut.seed(4)
    net = models.mobilenet(1, 10, 32, fused=fused)
    n_conv = sum(isinstance(l, ut.Conv2d) for l in net)
    rng = np.random.default_rng(4)
    with ut.tensor(rng.standard_normal((2, 1, 16, 16)).astype(np.float32)) as x, \
            ut.tensor(rng.standard_normal((2, 10)).astype(np.float32)) as g:
        full, part, r = _both_ways(net, x, g)
        assert r is None
        _assert_same(full, part)
        # only the first layer (the stem conv) skips its dx: every other conv still needs it
        counter = _CountCBackward(monkeypatch)
        with net(x):
            live = ut.live_tensors()
            net.backward(g, input_grad=False)
            assert ut.live_tensors() == live  # every gradient passed on was freed, none returned
        assert counter.calls == n_conv - 1
    net.close()


def test_sequential_first_layer_stateless_and_batchnorm():
    # the first layer has no params-only call (ReLU, BatchNorm2d, SyncBatchNorm): its dx is
    # computed and freed; the gradients are the same
    ut.seed(5)
    for first in (ut.ReLU(), ut.BatchNorm2d(2), ut.SyncBatchNorm(2, activation="relu6")):
        net = ut.Sequential(first, ut.Conv2d(2, 3, 3, padding=1), ut.BatchNorm2d(3),
                            ut.GlobalAvgPool2d(), ut.Linear(3, 4))
        with ut.randn((3, 2, 5, 5)) as x, ut.randn((3, 4)) as g:
            full, part, r = _both_ways(net, x, g)
        assert r is None
        _assert_same(full, part)
        net.close()


def test_residual_params_only():
    ut.seed(6)
    block = ut.Sequential(ut.Conv2d(3, 3, 3, padding=1), ut.BatchNorm2d(3, activation="relu"),
                          ut.Conv2d(3, 3, 1))
    res = ut.Residual(block)
    with ut.randn((2, 3, 6, 6)) as x, ut.randn((2, 3, 6, 6)) as g:
        full, part, r = _both_ways(res, x, g)
    assert r is None
    _assert_same(full, part)
    # inside a Sequential, as the first layer
    net = ut.Sequential(res, ut.GlobalAvgPool2d(), ut.Linear(3, 2))
    with ut.randn((2, 3, 6, 6)) as x, ut.randn((2, 2)) as g:
        full, part, r = _both_ways(net, x, g)
    assert r is None
    _assert_same(full, part)
    net.close()


def test_mixed_precision_params_only():
    # bf16 on the CPU is emulated (float32 rounded after each op): the same kind of numbers
    ut.seed(7)
    net = ut.MixedPrecision(models.mobilenet(1, 10, 32, fused=True), dtype=ut.bfloat16)
    rng = np.random.default_rng(7)
    with ut.tensor(rng.standard_normal((2, 1, 16, 16)).astype(np.float32)) as x, \
            ut.tensor(rng.standard_normal((2, 10)).astype(np.float32)) as g:
        full, part, r = _both_ways(net, x, g)
        assert r is None
        _assert_same(full, part)
        with net(x):
            live = ut.live_tensors()
            net.backward(g, input_grad=False)
            assert ut.live_tensors() == live  # no bf16 dx, and no float32 copy of one
    net.close()


class _PlainUser(ut.Module):
    """A user's module whose backward has no input_grad keyword (as written before it existed):
    y = conv(x) * 2."""

    def __init__(self, cin=2, cout=2):
        self.conv = ut.Conv2d(cin, cout, 3, padding=1)
        self.calls = 0
        self.returned = []

    def forward(self, x):
        return self.conv(x).mul_(2.0)

    def backward(self, grad_out):
        self.calls += 1
        with grad_out.clone().mul_(2.0) as g2:
            dx = self.conv.backward(g2)
        self.returned.append(dx)
        return dx


class _KeywordUser(_PlainUser):
    """A user's module that takes the keyword (not marked by the library): it is passed on."""

    def backward(self, grad_out, input_grad=True):
        self.seen = input_grad
        dx = super().backward(grad_out)
        if input_grad:
            return dx
        dx.close()
        return None


@pytest.mark.parametrize("cls", [_PlainUser, _KeywordUser])
def test_user_module_in_sequential(cls):
    ut.seed(8)
    user = cls()
    net = ut.Sequential(user, ut.ReLU(), ut.GlobalAvgPool2d(), ut.Linear(2, 3))
    with ut.randn((2, 2, 5, 5)) as x, ut.randn((2, 3)) as g:
        full, part, r = _both_ways(net, x, g)
    assert r is None
    _assert_same(full, part)
    assert user.calls == 2
    assert all(d.closed for d in user.returned)  # the container closed the unused dx
    if cls is _KeywordUser:
        assert user.seen is False
    net.close()


def test_user_module_in_residual_and_mixed_precision():
    ut.seed(9)
    for wrap in (ut.Residual, lambda m: ut.MixedPrecision(m, dtype=ut.bfloat16)):
        user = _PlainUser()
        m = wrap(user)
        with ut.randn((2, 2, 4, 4)) as x, ut.randn((2, 2, 4, 4)) as g:
            full, part, r = _both_ways(m, x, g)
        assert r is None
        _assert_same(full, part)
        assert all(d.closed for d in user.returned)
        m.close()


def test_backward_params_only_helper():
    ut.seed(10)
    user = _PlainUser()
    with ut.randn((1, 2, 3, 3)) as x, ut.randn((1, 2, 3, 3)) as g:
        user(x).close()
        assert _backward_params_only(user, g) is None
        assert user.calls == 1 and user.returned[0].closed
        assert not g.closed
    user.conv.close()


def test_ddp_params_only():
    world = 2
    rng = np.random.default_rng(11)
    x = rng.standard_normal((world, 2, 1, 6, 6)).astype(np.float32)
    g = rng.standard_normal((world, 2, 10)).astype(np.float32)

    def rank_main(r, group):
        out = []
        for user in (False, True):
            ut.seed(11)
            net = models.mobilenet(1, 10, 8, blocks=((2, 2),))
            if user:  # a user's module first: called without the keyword
                net = ut.Sequential(_PlainUser(1, 2), ut.Conv2d(2, 1, 1), net)
            with D.DistributedDataParallel(net, group) as ddp:
                grads = []
                for input_grad in (True, False):
                    ddp.zero_grad()
                    with ut.tensor(x[r]) as xt, ut.tensor(g[r]) as gt, ddp(xt):
                        dx = ddp.backward(gt, input_grad=input_grad)
                    if input_grad:
                        dx.close()
                    else:
                        assert dx is None
                    grads.append(_grads(net))
                out.append(grads)
            net.close()
        return out

    for r, runs in run_ranks(world, rank_main).items():
        for full, part in runs:
            _assert_same(full, part)


def _nets():
    return (ut.Conv2d(1, 2, 3), ut.ReLU(), ut.BatchNorm2d(1),
            ut.Sequential(ut.Conv2d(1, 2, 3), ut.ReLU()),
            ut.Residual(ut.Sequential(ut.Conv2d(1, 1, 3, padding=1))),
            ut.MixedPrecision(ut.Sequential(ut.Conv2d(1, 2, 3))))


def test_backward_without_forward_still_raises():
    for net in _nets():
        with ut.randn((1, 1, 3, 3)) as g:
            with pytest.raises(ut.ArgumentError, match="no forward pass"):
                net.backward(g, input_grad=False)
        net.close()
    # eval mode keeps nothing (BatchNorm2d excepted): backward raises, with the keyword too
    for net in (ut.Conv2d(1, 2, 3), ut.Sequential(ut.Conv2d(1, 2, 3), ut.ReLU())):
        net.eval()
        with ut.randn((1, 1, 5, 5)) as x, net(x) as y, ut.randn(y.shape) as g:
            with pytest.raises(ut.ArgumentError, match="no forward pass"):
                net.backward(g, input_grad=False)
        net.close()


def test_repeated_backward_still_works():
    # a backward may be repeated after one forward (the walk over the kept forwards starts
    # over): with input_grad=False too, and the gradients accumulate as with backward(g)
    ut.seed(13)
    for net in _nets():
        with ut.randn((1, 1, 5, 5)) as x, net(x) as y, ut.randn(y.shape) as g:
            net.backward(g).close()
            net.backward(g).close()
            twice = _grads(net)
            net.zero_grad()
            assert net.backward(g, input_grad=False) is None
            assert net.backward(g, input_grad=False) is None
            if twice:  # ReLU has no parameters
                _assert_same(twice, _grads(net))
        net.close()


def test_refused_backward_keeps_the_forward():
    # a wrong grad_out is refused as before, and the forward stays for a right one
    ut.seed(14)
    conv = ut.Conv2d(1, 2, 3)
    with ut.randn((1, 1, 5, 5)) as x, conv(x) as y, ut.randn(y.shape) as g, \
            ut.randn((1, 2, 2, 2)) as bad:
        with pytest.raises(ut.ShapeError, match="ut_conv2d_backward_params"):
            conv.backward(bad, input_grad=False)
        assert conv.backward(g, input_grad=False) is None
    conv.close()


def test_input_grad_must_be_a_flag():
    ut.seed(15)
    for net in (ut.Conv2d(1, 1, 1), ut.ReLU(), ut.Sequential(ut.Conv2d(1, 1, 1)),
                ut.Residual(ut.Conv2d(1, 1, 1)), ut.MixedPrecision(ut.Conv2d(1, 1, 1))):
        with ut.randn((1, 1, 2, 2)) as x, net(x), ut.randn((1, 1, 2, 2)) as g:
            with pytest.raises(ut.ArgumentTypeError, match="input_grad"):
                net.backward(g, input_grad="no")
            with pytest.raises(TypeError):
                net.backward(g, False)  # keyword only: a stray positional is not a flag
            net.backward(g).close()  # the forward was kept through the refusals
        net.close()


def test_train_epoch_skips_the_stem_dx(monkeypatch):
    from utensil_ffi import train

    ut.seed(16)
    net = models.mobilenet(1, 3, 8, blocks=((2, 2),))
    n_conv = sum(isinstance(l, ut.Conv2d) for l in net)
    opt = ut.SGD(net.parameters(), lr=0.01)
    rng = np.random.default_rng(15)
    x = rng.standard_normal((8, 1, 8, 8)).astype(np.float32)
    y = rng.integers(0, 3, 8)
    counter = _CountCBackward(monkeypatch)
    train.train_epoch(net, opt, x, y, 4, 0, 0, "cpu")
    assert counter.calls == 2 * (n_conv - 1)  # two batches; the stem conv's dx never made
    opt.close()
    net.close()
