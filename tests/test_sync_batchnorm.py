"""SyncBatchNorm: ranks (threads here, tests/thread_group.py) normalizing with the statistics of
their batches together must compute what one BatchNorm2d computes on the whole batch: the
output, the running statistics, dx, and dW/db summed over the ranks. On the GPU with NCCL the
same layer is checked by tests/dist_child.py (two GPUs)."""

import copy
import pickle

import numpy as np
import pytest

import utensil_ffi as ut
from utensil_ffi._errors import ArgumentTypeError
from utensil_ffi._lib import ffi, lib

from thread_group import run_ranks



def _params(c, rng):
    return (rng.uniform(0.5, 1.5, c).astype(np.float32), rng.normal(0, 0.5, c).astype(np.float32))


def _load(bn, w, b):
    bn.weight.copy_from(w)
    bn.bias.copy_from(b)


@pytest.mark.parametrize("activation", [None, "relu6", "hardswish", "silu", "gelu"])
@pytest.mark.parametrize("sizes", [(2, 2), (1, 4, 2)])  # equal batches; three unequal ranks
def test_ranks_together_compute_one_batchnorm_on_the_whole_batch(device, activation, sizes):
    rng = np.random.default_rng(len(sizes))
    c, h, w = 3, 4, 5
    # an offset mean (10) and small spread: the combination must not cancel
    x = (10 + rng.normal(0, 0.3, (sum(sizes), c, h, w))).astype(np.float32)
    go = rng.normal(0, 1, x.shape).astype(np.float32)
    wt, bs = _params(c, rng)
    cuts = np.cumsum((0,) + sizes)

    ref = ut.BatchNorm2d(c, momentum=0.3, device=device, activation=activation)
    _load(ref, wt, bs)
    y_ref = ref(ut.tensor(x, device)).numpy()
    dx_ref = ref.backward(ut.tensor(go, device)).numpy()

    def rank_main(r, group):
        bn = ut.SyncBatchNorm(c, momentum=0.3, device=device, activation=activation,
                              process_group=group)
        _load(bn, wt, bs)
        part = slice(cuts[r], cuts[r + 1])
        y = bn(ut.tensor(x[part], device)).numpy()
        dx = bn.backward(ut.tensor(go[part], device)).numpy()
        return (y, dx, bn.weight.grad.numpy().copy(), bn.bias.grad.numpy().copy(),
                bn.running_mean.numpy().copy(), bn.running_var.numpy().copy())

    got = run_ranks(len(sizes), rank_main)
    y = np.concatenate([got[r][0] for r in range(len(sizes))])
    dx = np.concatenate([got[r][1] for r in range(len(sizes))])
    np.testing.assert_allclose(y, y_ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-3, atol=1e-4)
    # each rank's dW is its share: their sum is the whole batch's (DDP averages them)
    np.testing.assert_allclose(sum(got[r][2] for r in got), ref.weight.grad.numpy(), rtol=1e-4,
                               atol=1e-4)
    np.testing.assert_allclose(sum(got[r][3] for r in got), ref.bias.grad.numpy(), rtol=1e-4,
                               atol=1e-4)
    for r in got:  # every rank moved its running statistics by the global ones
        np.testing.assert_allclose(got[r][4], ref.running_mean.numpy(), rtol=1e-5)
        np.testing.assert_allclose(got[r][5], ref.running_var.numpy(), rtol=1e-4)


def test_statistics_against_float64():
    # independent of BatchNorm2d: the normalized output of two ranks against numpy float64
    rng = np.random.default_rng(3)
    x = rng.normal(-4, 2, (5, 2, 3, 3)).astype(np.float32)
    parts = [x[:2], x[2:]]

    def rank_main(r, group):
        bn = ut.SyncBatchNorm(2, eps=1e-5, process_group=group)
        return bn(ut.tensor(parts[r])).numpy()

    got = run_ranks(2, rank_main)
    x64 = x.astype(np.float64)
    want = (x64 - x64.mean(axis=(0, 2, 3), keepdims=True)) / np.sqrt(
        x64.var(axis=(0, 2, 3), keepdims=True) + 1e-5)
    np.testing.assert_allclose(np.concatenate([got[0], got[1]]), want, rtol=1e-4, atol=1e-5)


def test_eval_mode_and_no_group_are_batchnorm2d():
    rng = np.random.default_rng(4)
    x = rng.normal(0, 1, (3, 2, 4, 4)).astype(np.float32)
    ref, bn = ut.BatchNorm2d(2), ut.SyncBatchNorm(2)
    for layer in (ref, bn):  # no group: this process alone
        layer(ut.tensor(x))
    np.testing.assert_allclose(bn.running_var.numpy(), ref.running_var.numpy(), rtol=1e-6)

    def rank_main(r, group):
        layer = ut.SyncBatchNorm(2, process_group=group)
        layer.running_mean.copy_from(np.array([1.0, -1.0], np.float32))
        layer.eval()
        return layer(ut.tensor(x)).numpy()

    got = run_ranks(2, rank_main)  # eval: no collective at all (one rank alone would hang)
    ref.running_mean.copy_from(np.array([1.0, -1.0], np.float32))
    ref.running_var.copy_from(np.ones(2, np.float32))
    ref.eval()
    np.testing.assert_allclose(got[0], ref(ut.tensor(x)).numpy(), rtol=1e-6)


def test_a_failing_group_raises_its_error_and_keeps_the_layer_usable():
    class Broken:
        def all_reduce(self, t, op="avg"):
            raise RuntimeError("peer 3 is gone")

    bn = ut.SyncBatchNorm(2, process_group=Broken())
    before = bn.running_mean.numpy().copy()
    with pytest.raises(RuntimeError, match="peer 3 is gone"):
        bn(ut.ones((2, 2, 2, 2)))
    np.testing.assert_array_equal(bn.running_mean.numpy(), before)  # not half-updated
    bn.process_group = None
    bn(ut.randn((2, 2, 2, 2)))


def test_a_bad_group_is_a_type_error():
    with pytest.raises(ArgumentTypeError, match="process_group"):
        ut.SyncBatchNorm(2, process_group=object())


def test_caches_of_the_other_kind_are_refused_in_c():
    l = ffi.new("ut_batchnorm2d *", lib.ut_batchnorm2d_alloc(2, 1e-5, 0.1, lib.UT_CPU))
    c = ffi.new("ut_batchnorm2d_cache *")
    x = ut.randn((2, 2, 3, 3))
    g = ut.ones((2, 2, 3, 3))
    ident = ffi.callback("int(void *, ut_tensor *)", lambda ctx, t: 0)
    try:
        y = lib.ut_batchnorm2d_forward(l, x.ptr, c)
        assert y != ffi.NULL
        lib.ut_free(y)
        assert lib.ut_batchnorm2d_backward_sync(l, c, g.ptr, ffi.NULL, ffi.NULL, ident,
                                                ffi.NULL) == ffi.NULL
        assert "ut_batchnorm2d_forward_sync" in ffi.string(lib.ut_last_error()).decode()
        lib.ut_batchnorm2d_cache_free(c)
        y = lib.ut_batchnorm2d_forward_sync(l, x.ptr, c, ident, ffi.NULL)
        assert y != ffi.NULL and c.synced
        lib.ut_free(y)
        assert lib.ut_batchnorm2d_backward(l, c, g.ptr, ffi.NULL, ffi.NULL) == ffi.NULL
        assert "backward_sync" in ffi.string(lib.ut_last_error()).decode()
        dx = lib.ut_batchnorm2d_backward_sync(l, c, g.ptr, ffi.NULL, ffi.NULL, ident, ffi.NULL)
        assert dx != ffi.NULL  # the matching call works (one rank: the identity)
        lib.ut_free(dx)
        # a reduce that fails without a message: the status and a message naming the call
        lib.ut_batchnorm2d_cache_free(c)
        bad = ffi.callback("int(void *, ut_tensor *)", lambda ctx, t: -1)
        assert lib.ut_batchnorm2d_forward_sync(l, x.ptr, c, bad, ffi.NULL) == ffi.NULL
        assert "reduce failed" in ffi.string(lib.ut_last_error()).decode()
    finally:
        lib.ut_batchnorm2d_cache_free(c)
        lib.ut_batchnorm2d_free(l)


def test_convert_keeps_parameters_and_state_dict():
    ut.seed(0)
    net = ut.Sequential(ut.Conv2d(1, 2, 1), ut.BatchNorm2d(2, activation="relu6"), ut.ReLU(),
                        ut.Sequential(ut.BatchNorm2d(2)))
    params = [id(p) for p in net.parameters()]
    keys = list(net.state_dict())

    class G:
        def all_reduce(self, t, op="avg"):
            return t

    assert ut.SyncBatchNorm.convert_sync_batchnorm(net, G()) is net
    assert isinstance(net[1], ut.SyncBatchNorm) and isinstance(net[3][0], ut.SyncBatchNorm)
    assert net[1].activation == "relu6" and net[1].process_group is not None
    assert [id(p) for p in net.parameters()] == params and list(net.state_dict()) == keys
    net(ut.randn((2, 1, 3, 3)))
    # a copy keeps the layer, not the group
    for twin in (copy.deepcopy(net), pickle.loads(pickle.dumps(net))):
        assert isinstance(twin[1], ut.SyncBatchNorm) and twin[1].process_group is None
        np.testing.assert_array_equal(twin[1].running_mean.numpy(), net[1].running_mean.numpy())
    with pytest.raises(ArgumentTypeError):
        ut.SyncBatchNorm.convert_sync_batchnorm([net])


def test_ddp_with_sync_batchnorm_trains_as_one_process():
    from utensil_ffi import distributed as D

    world, b, steps = 2, 3, 4
    rng = np.random.default_rng(7)
    data = [(rng.normal(0, 1, (world * b, 1, 5, 5)).astype(np.float32),
             rng.integers(0, 3, world * b)) for _ in range(steps)]

    def net():
        ut.seed(11)
        return ut.Sequential(ut.Conv2d(1, 4, 3, padding=1, bias=False),
                             ut.BatchNorm2d(4, activation="relu6"), ut.GlobalAvgPool2d(),
                             ut.Linear(4, 3))

    ref = net()
    opt = ut.SGD(ref.parameters(), lr=0.2, momentum=0.9)
    want = []
    for x, y in data:
        logits = ref(ut.tensor(x))
        want.append(float(ut.cross_entropy(logits, y).numpy()[0]))
        opt.zero_grad()
        ref.backward(ut.cross_entropy_backward(logits, y))
        opt.step()

    nets = [net() for _ in range(world)]  # here: the library's RNG is one for all threads

    def rank_main(r, group):
        model = ut.SyncBatchNorm.convert_sync_batchnorm(nets[r], group)
        losses = []
        with D.DistributedDataParallel(model, group) as ddp:
            opt = ut.SGD(ddp.parameters(), lr=0.2, momentum=0.9)
            for x, y in data:
                idx = slice(r * b, (r + 1) * b)
                logits = ddp(ut.tensor(x[idx]))
                loss = ut.tensor(np.array([float(ut.cross_entropy(logits, y[idx]).numpy()[0])],
                                          np.float32))
                group.all_reduce(loss, "avg")  # the global batch's mean loss
                losses.append(float(loss.numpy()[0]))
                opt.zero_grad()
                ddp.backward(ut.cross_entropy_backward(logits, y[idx]))
                opt.step()
            return losses, [p.numpy().copy() for p in model.parameters()]

    got = run_ranks(world, rank_main)
    for r in range(world):
        np.testing.assert_allclose(got[r][0], want, rtol=1e-4, atol=1e-5)
        for a, w in zip(got[r][1], ref.parameters()):
            np.testing.assert_allclose(a, w.numpy(), rtol=1e-4, atol=1e-5)
