"""Tensor basics: numpy round trips, zero-copy views and their lifetime, close(), repr, devices."""

import gc
import importlib
import weakref

import numpy as np
import pytest

import utensil_ffi as ut


def test_roundtrip_numpy(device, rng):
    for shape in [(1,), (3,), (2, 3), (2, 3, 4, 5), (1, 1, 1, 1, 1, 1, 1, 2)]:
        a = rng.standard_normal(shape).astype(np.float32)
        t = ut.from_numpy(a, device)
        assert t.shape == shape and t.ndim == len(shape) and t.size == a.size
        assert t.device == device and t.dtype == np.float32
        np.testing.assert_array_equal(t.numpy(), a)
        np.testing.assert_array_equal(np.asarray(t), a)


def test_conversions_copy_and_cast(device):
    src = np.arange(6, dtype=np.int64).reshape(2, 3)
    t = ut.tensor(src, device)
    src[0, 0] = 100  # the tensor holds a copy
    np.testing.assert_array_equal(t.numpy(), [[0, 1, 2], [3, 4, 5]])
    # non-contiguous, other dtypes, nested lists, bools and 0-d scalars are all accepted
    nc = np.arange(24, dtype=np.float64).reshape(4, 6)[:, ::2]
    np.testing.assert_array_equal(ut.tensor(nc, device).numpy(), nc)
    np.testing.assert_array_equal(ut.tensor([[1, 2], [3, 4]], device).numpy(), [[1, 2], [3, 4]])
    np.testing.assert_array_equal(ut.tensor(np.array([True, False]), device).numpy(), [1, 0])
    assert ut.tensor(2.5, device).shape == (1,)
    assert ut.tensor(np.float16(1.5), device).item() == 1.5


def test_constructors(device):
    np.testing.assert_array_equal(ut.zeros((2, 3), device).numpy(), np.zeros((2, 3)))
    np.testing.assert_array_equal(ut.ones(4, device).numpy(), np.ones(4))
    np.testing.assert_array_equal(ut.full([2, 2], -3.5, device).numpy(), np.full((2, 2), -3.5))
    ut.seed(42)
    a = ut.randn((1000,), mean=2.0, std=0.5, device=device).numpy().copy()
    ut.seed(42)
    b = ut.randn((1000,), mean=2.0, std=0.5, device=device).numpy()
    np.testing.assert_array_equal(a, b)  # the seed makes it reproducible
    assert abs(a.mean() - 2.0) < 0.1 and abs(a.std() - 0.5) < 0.1


def test_cpu_view_is_zero_copy_and_writable():
    t = ut.zeros((2, 3))
    v = t.numpy()
    assert v.flags.writeable and v.dtype == np.float32 and v.shape == (2, 3)
    v[1, 2] = 7.0  # writes through to the tensor: later ops see it
    np.testing.assert_array_equal(ut.relu(t).numpy()[1, 2], 7.0)
    assert t.numpy().__array_interface__["data"][0] == v.__array_interface__["data"][0]


def test_view_outlives_tensor_after_del_and_gc():
    """A view stays valid and correct after its tensor object is deleted and collected."""
    before = ut.live_tensors()
    t = ut.tensor(np.arange(12, dtype=np.float32).reshape(3, 4))
    v = t.numpy()
    ref = weakref.ref(t)
    del t
    gc.collect()
    assert ref() is None  # the Tensor object is gone...
    assert ut.live_tensors() == before + 1  # ...but the view's own reference keeps the C tensor
    junk = [ut.full((3, 4), -1.0) for _ in range(20)]  # would reuse freed memory if it were freed
    np.testing.assert_array_equal(v, np.arange(12).reshape(3, 4))
    del junk
    w = v[1:]  # views of views keep it alive too
    del v
    gc.collect()
    np.testing.assert_array_equal(w, np.arange(4, 12).reshape(2, 4))
    del w
    gc.collect()
    assert ut.live_tensors() == before


def test_view_outlives_close():
    t = ut.tensor([1.0, 2.0, 3.0])
    v = t.numpy()
    t.close()
    assert t.closed
    np.testing.assert_array_equal(v, [1, 2, 3])
    v[0] = 5  # still our memory to write
    assert v[0] == 5


def test_layer_weight_view_outlives_layer():
    layer = ut.Linear(3, 2)
    layer.weight = [[1, 2, 3], [4, 5, 6]]
    w = layer.weight.numpy()
    layer.close()
    del layer
    gc.collect()
    np.testing.assert_array_equal(w, [[1, 2, 3], [4, 5, 6]])


def test_close_is_idempotent_and_context_manager():
    before = ut.live_tensors()
    with ut.zeros(3) as t:
        assert ut.live_tensors() == before + 1
    assert t.closed and ut.live_tensors() == before
    t.close()
    t.close()
    assert repr(t) == "Tensor(<closed>)"


def test_a_shape_read_before_close_is_not_served_after_it():
    t = ut.zeros((2, 3))
    assert t.shape == (2, 3)  # read once: kept beside its pointer
    t.close()
    with pytest.raises(ut.ClosedError):
        t.shape
    p = ut.Parameter(np.zeros((4, 1), np.float32))
    assert p.shape == (4, 1)
    other = ut.zeros((5,))
    p._ptr, other._ptr = other._ptr, p._ptr  # a new C tensor under the same object
    assert p.shape == (5,) and other.shape == (4, 1)
    p.close()
    other.close()


def test_a_call_over_many_tensors_defers_the_free_of_one_closed_meanwhile():
    # what another thread's close() meets while sgd_step_many or fill_many holds the tensors
    T = importlib.import_module("utensil_ffi._lifetime")  # the hold/let-go protocol's owner

    before = ut.live_tensors()
    ts = [ut.ones(3) for _ in range(4)]
    g = T._hold_group(ts)
    ts[2].close()
    assert ut.live_tensors() == before + 4  # listed in the group: not freed yet
    assert len(T._DEFERRED) == 1
    with pytest.raises(ut.ClosedError):
        T._hold_group(ts)  # a closed one refuses the next call, which lists nothing
    assert T._IN_USE_GROUPS == [g]
    T._let_go_group(g)
    assert not T._DEFERRED and not T._IN_USE_GROUPS
    assert ut.live_tensors() == before + 3
    for t in ts:
        t.close()
    assert ut.live_tensors() == before


def test_a_close_landing_between_holds_two_reads_is_freed_by_the_hold_that_fails():
    # _hold lists the pointer, then re-reads it: a close() in between sees the listing and
    # defers the free, and the hold that finds the tensor closed is the last user, so it frees
    # (it once unlisted without freeing: a tensor leaked per such race)
    T = importlib.import_module("utensil_ffi._lifetime")
    before = ut.live_tensors()
    real = ut.ones(3)

    class ClosedBetweenReads:
        reads = 0

        @property
        def _ptr(self):
            self.reads += 1
            if self.reads == 1:
                return real._ptr
            real.close()  # another thread's close, after the listing
            assert T._DEFERRED and ut.live_tensors() == before + 1
            return None

    with pytest.raises(ut.ClosedError):
        T._hold(ClosedBetweenReads())
    assert not T._DEFERRED and not T._IN_USE
    assert ut.live_tensors() == before


CLOSED_CALLS = [
    ("numpy", lambda t: t.numpy()),
    ("shape", lambda t: t.shape),
    ("device", lambda t: t.device),
    ("size", lambda t: t.size),
    ("item", lambda t: t.item()),
    ("to", lambda t: t.to("cpu")),
    ("clone", lambda t: t.clone()),
    ("reshape", lambda t: t.reshape(3)),
    ("transpose", lambda t: t.transpose(0, 0)),
    ("fill_", lambda t: t.fill_(1.0)),
    ("mul_", lambda t: t.mul_(2.0)),
    ("add_", lambda t: t.add_(t)),
    ("copy_from", lambda t: t.copy_from([1, 2, 3])),
    ("array", lambda t: np.asarray(t)),
    ("relu", lambda t: ut.relu(t)),
    ("matmul", lambda t: ut.matmul(t, t)),
    ("mse", lambda t: ut.mse_loss(t, [1, 2, 3])),
    ("as other arg", lambda t: ut.relu_backward(ut.zeros(3), t)),
    ("enter", lambda t: t.__enter__()),
    ("sync", lambda t: t.sync()),
]


@pytest.mark.parametrize("name,call", CLOSED_CALLS, ids=[c[0] for c in CLOSED_CALLS])
def test_closed_tensor_raises_value_error(name, call):
    t = ut.tensor([1.0, 2.0, 3.0])
    t.close()
    with pytest.raises(ValueError, match="closed"):
        call(t)
    with pytest.raises(ut.ClosedError):
        call(t)


def test_closed_layer_and_optimizer():
    layer = ut.Linear(2, 2)
    opt = ut.SGD(layer.parameters(), lr=0.1)
    layer.close()
    layer.close()
    for call in (lambda: layer(np.zeros((1, 2))), lambda: layer.weight, lambda: layer.parameters(),
                 lambda: layer.backward(np.zeros((1, 2))), lambda: layer.to("cpu"), opt.step):
        with pytest.raises(ut.ClosedError):
            call()
    assert repr(layer) == "Linear(<closed>)"
    opt.close()
    with pytest.raises(ut.ClosedError):
        opt.zero_grad()


def test_repr(device):
    t = ut.tensor([[1, 2], [3, 4]], device)
    r = repr(t)
    assert r.startswith("Tensor([[1.") and "shape=(2, 2)" in r and "device=%r" % device in r
    big = repr(ut.zeros((100, 100), device))
    assert "..." in big and len(big) < 1000
    assert "Linear(3, 2, bias=True" in repr(ut.Linear(3, 2, device=device))
    assert "Parameter(name='weight', shape=(2, 3)" in repr(ut.Linear(3, 2, device=device).weight)
    assert "ReLU()" in repr(ut.Sequential(ut.ReLU()))
    nested = repr(ut.Sequential(ut.ReLU(), ut.Residual(ut.Sequential(ut.ReLU6()))))
    assert nested == ("Sequential(\n  (0): ReLU()\n  (1): Residual(\n    (block): Sequential(\n"
                      "      (0): ReLU6()\n    )\n  )\n)"), nested


def test_item_and_tolist(device):
    assert ut.tensor([3.25], device).item() == 3.25
    assert ut.tensor([[1, 2]], device).tolist() == [[1.0, 2.0]]
    with pytest.raises(ut.ShapeError):
        ut.tensor([1, 2], device).item()


def test_copy_from(device):
    t = ut.zeros((2, 2), device)
    t.copy_from([[1, 2], [3, 4]])
    np.testing.assert_array_equal(ut.relu(t).numpy(), [[1, 2], [3, 4]])  # the op sees the write
    t.copy_from(ut.tensor([[5, 6], [7, 8]], device))
    np.testing.assert_array_equal(t.numpy(), [[5, 6], [7, 8]])
    t.copy_from(ut.tensor([[0, 1], [2, 3]], "cpu"))  # from another device
    np.testing.assert_array_equal(t.numpy(), [[0, 1], [2, 3]])


def test_to_devices(device):
    t = ut.tensor([1.0, -2.0, 3.0])
    assert t.to("cpu") is t
    u = t.to(device)
    assert u.device == device
    np.testing.assert_array_equal(u.numpy(), [1, -2, 3])
    back = ut.relu(u).to("cpu")
    assert back.device == "cpu"
    np.testing.assert_array_equal(back.numpy(), [1, 0, 3])
    np.testing.assert_array_equal(t.numpy(), [1, -2, 3])  # the source is unchanged


def test_devices_listing():
    assert ut.devices()[0] == "cpu"
    assert ("cuda" in ut.devices()) == ut.cuda_available()
    assert ut.tensor([1.0], "CPU").device == "cpu"


@pytest.mark.skipif(ut.cuda_available(), reason="needs a machine without a GPU")
def test_cuda_without_gpu_is_a_clear_error():
    for call in (lambda: ut.tensor([1.0], "cuda"), lambda: ut.zeros(2, "cuda:0"),
                 lambda: ut.tensor([1.0]).to("cuda"), lambda: ut.Linear(2, 2, device="cuda"),
                 lambda: ut.Linear(2, 2).to("cuda")):
        with pytest.raises(ut.DeviceError, match="no CUDA GPU"):
            call()
    with pytest.raises(RuntimeError):
        ut.randn(3, device="cuda")


@pytest.mark.skipif(not ut.cuda_available(), reason="needs a GPU")
def test_cuda_view_is_readonly_snapshot():
    t = ut.tensor([1.0, -1.0], "cuda")
    v = t.numpy()
    assert not v.flags.writeable
    with pytest.raises(ValueError):
        v[0] = 3
    t.copy_from([4.0, 5.0])
    np.testing.assert_array_equal(ut.relu(t).numpy(), [4, 5])


def test_layer_to_device_and_back(device):
    layer = ut.Conv2d(2, 3, 3, padding=1)
    w = layer.weight.numpy().copy()
    layer.to(device)
    assert layer.device == device and layer.weight.device == device
    assert layer.weight.grad.device == device
    y = layer(ut.tensor(np.ones((1, 2, 4, 4)), device))
    assert y.device == device
    layer.to("cpu")
    np.testing.assert_array_equal(layer.weight.numpy(), w)


def test_threads_and_live_tensors():
    n = ut.get_num_threads()
    assert n >= 1
    ut.set_num_threads(1)
    assert ut.get_num_threads() == 1
    ut.set_num_threads(n)
    before = ut.live_tensors()
    ts = [ut.zeros(2) for _ in range(5)]
    assert ut.live_tensors() == before + 5
    for t in ts:
        t.close()
    assert ut.live_tensors() == before


def test_training_step_reduces_loss(device, rng):
    """A few SGD steps on a tiny classification problem lower the loss (end-to-end smoke test)."""
    ut.seed(0)
    x = rng.standard_normal((32, 4)).astype(np.float32)
    y = (x[:, 0] + x[:, 1] > 0).astype(np.int64)
    model = ut.Sequential(ut.Linear(4, 16, device=device), ut.ReLU(), ut.Linear(16, 2, device=device))
    opt = ut.Adam(model.parameters(), lr=0.05)
    crit = ut.CrossEntropyLoss()
    xt = ut.tensor(x, device)
    losses = []
    for _ in range(30):
        opt.zero_grad()
        out = model(xt)
        losses.append(crit(out, y).item())
        model.backward(crit.backward())
        opt.step()
    assert losses[-1] < 0.5 * losses[0]
    crit.close()
    opt.close()
    model.close()
