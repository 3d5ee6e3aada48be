"""Zero-copy exchange through DLPack and the array protocols (numpy; torch and cupy if present)."""

import gc

import numpy as np
import pytest

import utensil_ffi as ut
from utensil_ffi import dlpack

try:
    import torch
except ImportError:  # torch is an optional test-only reference
    torch = None
try:
    import cupy
except ImportError:
    cupy = None

needs_torch = pytest.mark.skipif(torch is None, reason="PyTorch is not installed")


def _gpu(device):
    return device == "cuda"


@pytest.fixture
def live():
    gc.collect()
    start = ut.live_tensors()
    yield
    gc.collect()
    assert ut.live_tensors() == start, "C tensors leaked"
    assert not dlpack._exports and not dlpack._imports


def test_dlpack_device(device):
    with ut.randn((2, 3), device=device) as t:
        assert t.__dlpack_device__() == ((2, 0) if _gpu(device) else (1, 0))


def test_numpy_from_dlpack_shares_memory(live):
    t = ut.tensor(np.arange(6, dtype=np.float32).reshape(2, 3))
    a = np.from_dlpack(t)
    np.testing.assert_array_equal(a, np.arange(6).reshape(2, 3))
    a[1, 2] = 42.0  # numpy writes, utensil sees it
    assert t.numpy()[1, 2] == 42.0
    del t
    gc.collect()
    assert a[1, 2] == 42.0 and a[0, 1] == 1.0  # the capsule kept the memory alive
    del a


def test_from_dlpack_numpy_shares_memory(live):
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    t = ut.from_dlpack(a)
    a[2, 3] = -7.0
    assert t.numpy()[2, 3] == -7.0
    del a
    gc.collect()
    assert t.numpy()[2, 2] == 10.0  # the producer stays alive while the tensor lives
    t.close()


def test_from_dlpack_refuses_other_dtypes_and_strides(live):
    with pytest.raises(BufferError, match="float32"):
        ut.from_dlpack(np.zeros(3, dtype=np.float64))
    with pytest.raises(BufferError, match="contiguous"):
        ut.from_dlpack(np.zeros((4, 4), dtype=np.float32).T)
    with pytest.raises(TypeError):
        ut.from_dlpack([1.0, 2.0])
    t = ut.from_dlpack(np.arange(3, dtype=np.float64), copy=True)
    np.testing.assert_array_equal(t.numpy(), [0, 1, 2])
    u = ut.from_dlpack(np.arange(16, dtype=np.float32).reshape(4, 4).T, copy=True)
    np.testing.assert_array_equal(u.numpy(), np.arange(16).reshape(4, 4).T)
    t.close()
    u.close()


def test_copy_flag_makes_an_independent_capsule(live):
    t = ut.tensor([1.0, 2.0, 3.0])
    a = np.from_dlpack(t, copy=True)
    a[0] = 50.0
    assert t.numpy()[0] == 1.0  # a copy: the original is untouched
    del a
    cap = t.__dlpack__(max_version=(1, 0), copy=True)
    del cap  # unconsumed: the destructor frees the copy
    gc.collect()
    t.close()


def test_unconsumed_capsules_are_freed(live):
    t = ut.tensor([1.0, 2.0])
    for kwargs in ({}, {"max_version": (1, 0)}):
        cap = t.__dlpack__(**kwargs)
        assert len(dlpack._exports) == 1
        del cap
        gc.collect()
        assert not dlpack._exports
    t.close()


def test_array_protocol(device):
    with ut.tensor([[1.0, 2.0]], device=device) as t:
        a = np.asarray(t)
        np.testing.assert_array_equal(a, [[1.0, 2.0]])
        if device == "cpu":
            a[0, 0] = 5.0
            assert t.numpy()[0, 0] == 5.0


@needs_torch
def test_torch_round_trip_cpu(live):
    t = ut.tensor(np.arange(6, dtype=np.float32))
    x = torch.from_dlpack(t)
    x[0] = 100.0
    assert t.numpy()[0] == 100.0
    del t
    gc.collect()
    assert float(x[0]) == 100.0
    u = ut.from_dlpack(x)
    u.numpy()[1] = -1.0
    assert float(x[1]) == -1.0
    del x
    gc.collect()
    assert u.numpy()[5] == 5.0
    u.close()


@needs_torch
def test_many_exchanges_do_not_leak(live):
    t = ut.tensor(np.ones(1000, dtype=np.float32))
    for _ in range(500):
        x = torch.from_dlpack(t)
        del x
        u = ut.from_dlpack(torch.ones(10))
        u.close()
    gc.collect()
    t.close()


@pytest.mark.skipif(torch is None or not torch.cuda.is_available() or "cuda" not in ut.devices(),
                    reason="needs PyTorch with CUDA and a GPU")
def test_torch_round_trip_cuda(live):
    t = ut.randn((4, 5), device="cuda")
    ref = t.numpy().copy()
    x = torch.from_dlpack(t)
    assert x.is_cuda
    np.testing.assert_array_equal(x.cpu().numpy(), ref)
    x.mul_(2.0)  # torch writes device memory on its stream; utensil must see it
    torch.cuda.synchronize()
    np.testing.assert_allclose(t.numpy(), 2 * ref)
    y = torch.arange(12, dtype=torch.float32, device="cuda").reshape(3, 4)
    u = ut.from_dlpack(y)
    assert u.device == "cuda"
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):  # a producer on a side stream: the exchange must be ordered
        y.add_(1.0)
        u2 = ut.from_dlpack(y)
    np.testing.assert_array_equal(u2.numpy(), np.arange(12).reshape(3, 4) + 1)
    u3 = ut.relu(u2)
    np.testing.assert_array_equal(u3.numpy(), np.arange(12).reshape(3, 4) + 1)
    del x, y
    gc.collect()
    for v in {id(u): u, id(u2): u2, id(u3): u3}.values():
        v.close()
    t.close()


@pytest.mark.skipif(torch is None or not torch.cuda.is_available() or "cuda" not in ut.devices(),
                    reason="needs PyTorch with CUDA and a GPU")
def test_shared_cuda_memory_stays_coherent_after_host_reads(live):
    """Once device memory is shared, a host read must not become a stale snapshot: writes made
    through torch, or through another utensil tensor over the same memory, are seen by the next
    read, and host writes (copy_from) are seen by torch at once (found by the stateful fuzzer)."""
    t = ut.randn((3, 4), device="cuda")
    ref = t.numpy().astype(np.float64)
    x = torch.from_dlpack(t)
    np.testing.assert_array_equal(t.numpy(), ref)  # a host read after the export
    x.mul_(2.0)
    torch.cuda.synchronize()
    np.testing.assert_allclose(t.numpy(), 2 * ref, rtol=1e-6)
    alias = ut.from_dlpack(x)  # a second utensil tensor over the same memory
    np.testing.assert_allclose(alias.numpy(), 2 * ref, rtol=1e-6)
    alias.mul_(-1.0)
    np.testing.assert_allclose(t.numpy(), -2 * ref, rtol=1e-6)
    t.copy_from(np.full((3, 4), 7.0, np.float32))  # a host write: pushed at once
    ut.synchronize()
    np.testing.assert_array_equal(x.cpu().numpy(), np.full((3, 4), 7.0))
    np.testing.assert_array_equal(alias.numpy(), np.full((3, 4), 7.0))
    y = torch.zeros(5, device="cuda")
    u = ut.from_dlpack(y)
    np.testing.assert_array_equal(u.numpy(), np.zeros(5))
    y.add_(3.0)  # the producer writes after the import and after a host read
    torch.cuda.synchronize()
    np.testing.assert_array_equal(u.numpy(), np.full(5, 3.0))
    del x, y
    gc.collect()
    for v in (alias, u, t):
        v.close()


@pytest.mark.skipif(cupy is None or "cuda" not in ut.devices(), reason="needs CuPy and a GPU")
def test_cupy_round_trip(live):
    c = cupy.arange(6, dtype=cupy.float32)
    u = ut.from_dlpack(c)
    c[0] = 9.0
    assert u.numpy()[0] == 9.0
    back = cupy.from_dlpack(u)
    back[1] = -3.0
    cupy.cuda.runtime.deviceSynchronize()
    assert float(c[1]) == -3.0
    u.close()


# -- bfloat16 on the host -------------------------------------------------------------------------
def _bf16_exact(rng, shape):
    """float32 values that bfloat16 holds exactly (the low 16 bits zero)."""
    bits = rng.standard_normal(shape).astype(np.float32).view(np.uint32) & 0xFFFF0000
    return bits.view(np.float32)


def test_a_cpu_bf16_tensor_is_exported_as_a_copy(live):
    """Its host values are float32: shared, np.from_dlpack could write 1.0001 into a bfloat16
    tensor. The consumer gets a float32 copy; the tensor keeps its values."""
    x = _bf16_exact(np.random.default_rng(0), (3, 4))
    with ut.tensor(x, "cpu", ut.bfloat16) as t:
        a = np.from_dlpack(t)
        np.testing.assert_array_equal(a, x)
        if a.flags.writeable:
            a[...] = 1.0001
        np.testing.assert_array_equal(t.numpy(), x)
        with pytest.raises(BufferError, match="copy=False"):
            t.__dlpack__(copy=False)
        del a


@needs_torch
def test_torch_bf16_cpu_writes_do_not_reach_the_tensor(live):
    x = _bf16_exact(np.random.default_rng(1), (5,))
    with ut.tensor(x, "cpu", ut.bfloat16) as t:
        v = torch.from_dlpack(t)
        assert v.dtype == torch.float32
        v.add_(1e-4)
        np.testing.assert_array_equal(t.numpy(), x)
        del v


@needs_torch
def test_from_dlpack_copy_widens_host_bf16_exactly(live):
    """A CPU bfloat16 producer cannot be shared (utensil keeps host values as float32), but
    copy=True converts it, exactly, as the README says."""
    x = _bf16_exact(np.random.default_rng(2), (2, 3, 4))
    src = torch.from_numpy(x).to(torch.bfloat16)
    with ut.from_dlpack(src, copy=True) as u:
        assert u.dtype == ut.float32 and u.shape == (2, 3, 4)
        np.testing.assert_array_equal(u.numpy(), x)
    with pytest.raises(BufferError, match="bfloat16"):
        ut.from_dlpack(src)
    with ut.from_dlpack(src.transpose(0, 2), copy=True) as u:  # strided: gathered
        np.testing.assert_array_equal(u.numpy(), np.swapaxes(x, 0, 2))
