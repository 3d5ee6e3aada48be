"""sgd_step_many and fill_many: one C call for a whole network's optimizer step and zero_grad.

They must give exactly what the one-tensor calls give (the GPU packs 40 tensors per launch, so
the tests cross that boundary), check every argument before changing anything, and name the
item that was wrong.
"""

import numpy as np
import pytest

import utensil_ffi as ut
from utensil_ffi import functional as F
from utensil_ffi._lib import ffi, lib

from conftest import require_device


def _tensors(rng, shapes, device):
    return [ut.tensor(rng.standard_normal(s).astype(np.float32), device) for s in shapes]


SHAPES = [(3,), (7, 5), (1,), (64, 33), (2, 3, 4, 5)] * 9 + [(1000,)]  # 46: two GPU launches


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_sgd_step_many_equals_one_by_one(device, momentum):
    rng = np.random.default_rng(1)
    ps = _tensors(rng, SHAPES, device)
    gs = _tensors(rng, SHAPES, device)
    vs = _tensors(rng, SHAPES, device) if momentum else None
    ref_p = [p.clone() for p in ps]
    ref_v = [v.clone() for v in vs] if vs else [None] * len(ps)
    for _ in range(2):
        F.sgd_step_many(ps, gs, vs, lr=0.05, momentum=momentum)
        for p, g, v in zip(ref_p, gs, ref_v):
            F.sgd_step(p, g, v, lr=0.05, momentum=momentum)
    for a, b in zip(ps, ref_p):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    for a, b in zip(vs or [], ref_v):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_fill_many_fills_every_tensor(device):
    rng = np.random.default_rng(2)
    ts = _tensors(rng, SHAPES, device)
    versions = [t.ptr.version for t in ts]
    F.fill_many(ts, -2.5)
    for t, v0 in zip(ts, versions):
        assert np.all(t.numpy() == -2.5)
        assert t.ptr.version != v0  # a write: saved inputs of a pending backward see it


def test_fill_many_long_tensors_at_odd_offsets(device):
    """Long tensors are filled with streaming stores on the CPU (from 64k floats): the parts
    begin at any float (odd sizes cut by the threads, a 16-byte alignment prologue): every
    element of the filled tensors is written, and nothing of the tensors left out."""
    rng = np.random.default_rng(4)
    shapes = [(70_001,), (3,), (131_075,), (65_536,), (200_003,)]
    ts = _tensors(rng, shapes, device)
    for value in (0.0, -1.25):
        F.fill_many(ts, value)
        for t in ts:
            got = t.numpy()
            assert got.shape == t.shape and np.all(got == value)
    views = [ut.tensor(rng.standard_normal(s).astype(np.float32), device) for s in shapes]
    F.fill_many(views[1:4], 7.0)  # the first and last tensors are left as they were
    assert not np.any(views[0].numpy() == 7.0) and not np.any(views[4].numpy() == 7.0)
    assert all(np.all(v.numpy() == 7.0) for v in views[1:4])


def test_a_bad_item_changes_nothing_and_is_named(device):
    rng = np.random.default_rng(3)
    ps = _tensors(rng, [(4,)] * 6, device)
    gs = _tensors(rng, [(4,)] * 5 + [(5,)], device)
    before = [p.numpy().copy() for p in ps]
    with pytest.raises(ut.ShapeError, match="item 5"):
        F.sgd_step_many(ps, gs, None, lr=0.1)
    for p, b in zip(ps, before):
        np.testing.assert_array_equal(p.numpy(), b)
    with pytest.raises(ut.ArgumentError, match="3 grads"):
        F.sgd_step_many(ps, gs[:3], None)
    with pytest.raises(ut.ArgumentTypeError, match=r"grads\[1\]"):
        F.sgd_step_many(ps[:2], [gs[0], np.zeros(4)], None)
    gs[2].close()
    with pytest.raises(ut.ClosedError):
        F.sgd_step_many(ps[:3], gs[:3], None)
    with pytest.raises(ut.ClosedError):
        F.fill_many(gs[:3], 0.0)
    with pytest.raises(ut.ArgumentError):
        F.sgd_step_many(ps[:2], gs[:2], None, lr=-1.0)


def test_c_refuses_null_and_negative_counts():
    assert lib.ut_sgd_step_many(ffi.NULL, ffi.NULL, ffi.NULL, -1, 0.1, 0.0) == lib.UT_ERR_ARG
    assert lib.ut_sgd_step_many(ffi.NULL, ffi.NULL, ffi.NULL, 2, 0.1, 0.0) == lib.UT_ERR_ARG
    assert lib.ut_sgd_step_many(ffi.NULL, ffi.NULL, ffi.NULL, 0, 0.1, 0.0) == lib.UT_OK
    assert lib.ut_fill_many(ffi.NULL, 3, 0.0) == lib.UT_ERR_ARG
    with ut.zeros((2,)) as t:
        arr = ffi.new("ut_tensor*[]", [t.ptr, ffi.NULL])
        assert lib.ut_fill_many(arr, 2, 1.0) == lib.UT_ERR_ARG
        assert b"item 1" in ffi.string(lib.ut_last_error())
        assert np.all(t.numpy() == 0)  # checked before anything was written


def test_one_call_over_both_devices():
    require_device("cuda")
    rng = np.random.default_rng(4)
    ps = _tensors(rng, [(5,)], "cpu") + _tensors(rng, [(6,)], "cuda")
    gs = _tensors(rng, [(5,)], "cpu") + _tensors(rng, [(6,)], "cuda")
    want = [p.numpy() - 0.5 * g.numpy() for p, g in zip(ps, gs)]
    F.sgd_step_many(ps, gs, None, lr=0.5)
    for p, w in zip(ps, want):
        np.testing.assert_allclose(p.numpy(), w, rtol=1e-6)


def test_optimizer_step_and_zero_grad_use_them(device):
    ut.seed(5)
    net = ut.Sequential(ut.Linear(4, 3, device=device), ut.ReLU(), ut.Linear(3, 2, device=device))
    opt = ut.SGD(net.parameters(), lr=0.1, momentum=0.9)
    x = np.ones((2, 4), np.float32)
    net.backward(ut.ones(net(x).shape, device))
    before = [p.numpy().copy() for p in net.parameters()]
    grads = [p.grad.numpy().copy() for p in net.parameters()]
    opt.step()
    for p, b, g in zip(net.parameters(), before, grads):
        np.testing.assert_allclose(p.numpy(), b - 0.1 * g, rtol=1e-6, atol=1e-7)
    opt.zero_grad()
    assert all(np.all(p.grad.numpy() == 0) for p in net.parameters())
    net.close()
