"""No leaks: C tensors (the library's live-tensor counter), resident memory, GPU memory.

tracemalloc cannot see malloc/cudaMalloc, so the checks are:
  - ut.live_tensors() (an atomic counter in C of tensors allocated and not freed) is constant from
    one training step to the next and back at its start after close();
  - resident memory (/proc/self/statm) grows by less than RSS_BOUND_MIB over UTENSIL_LEAK_STEPS
    (default 3000) training steps after a warm-up; the measured growth is printed;
  - on a GPU, device memory in use (cudaMemGetInfo) returns to its start after close(), and
    close() frees at once, without waiting for the garbage collector.
"""

import gc
import os

import numpy as np
import pytest

import utensil_ffi as ut
from utensil_ffi._lib import ffi, lib

STEPS = int(os.environ.get("UTENSIL_LEAK_STEPS", "3000"))
WARMUP = 300
RSS_BOUND_MIB = 8.0
PAGE = os.sysconf("SC_PAGE_SIZE")
ASAN = "asan" in os.environ.get("LD_PRELOAD", "")  # the RSS bound is not checked under ASan


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def gpu_used():
    free, total = ffi.new("size_t*"), ffi.new("size_t*")
    assert lib.ut_cuda_mem_info(free, total) == 0, ffi.string(lib.ut_last_error())
    return total[0] - free[0]


def make_net(device, seed=0):
    """conv -> bn -> relu6 -> dwconv -> layernorm-free head: pool -> linear (a MobileNet block)."""
    rng = np.random.default_rng(seed)
    net = ut.Sequential(
        ut.Conv2d(3, 8, (3, 2), stride=2, padding=1, device=device),
        ut.BatchNorm2d(8, device=device),
        ut.ReLU6(),
        ut.DWConv2d(8, 3, stride=1, padding=1, device=device),
        ut.ReLU(),
        ut.GlobalAvgPool2d(),
        ut.Linear(8, 4, device=device),
    )
    for p in net.parameters():
        p.copy_from(rng.standard_normal(p.shape).astype(np.float32) * 0.3)
    return net


def train_steps(net, opt, device, steps, rng, check_live=None):
    x_np = rng.standard_normal((4, 3, 9, 8)).astype(np.float32)
    labels = rng.integers(0, 4, size=4)
    loss = None
    for i in range(steps):
        with ut.tensor(x_np, device) as x:
            logits = net(x)
            with ut.cross_entropy(logits, labels) as l:
                if i == steps - 1:
                    loss = l.item()
            opt.zero_grad()
            with ut.cross_entropy_backward(logits, labels) as g:
                net.backward(g).close()
            logits.close()
            opt.step()
        if check_live is not None and i % 100 == 99:
            check_live(i)
    return loss


def _run_training(device, opt_cls, steps):
    gc.collect()
    live0 = ut.live_tensors()
    rng = np.random.default_rng(1)
    net = make_net(device)
    opt = opt_cls(net.parameters(), lr=0.01)
    train_steps(net, opt, device, WARMUP, rng)
    gc.collect()
    live_warm = ut.live_tensors()
    rss0 = rss_bytes()

    def check_live(i):
        assert ut.live_tensors() == live_warm, "step %d: %d live C tensors, %d after warm-up" % (
            i, ut.live_tensors(), live_warm)

    loss = train_steps(net, opt, device, steps, rng, check_live)
    gc.collect()
    growth = (rss_bytes() - rss0) / 2**20
    assert np.isfinite(loss)
    opt.close()
    net.close()
    del net, opt
    gc.collect()
    return live0, ut.live_tensors(), growth


@pytest.mark.parametrize("opt_cls", [lambda p, lr: ut.SGD(p, lr=lr, momentum=0.9),
                                     lambda p, lr: ut.Adam(p, lr=lr)], ids=["sgd", "adam"])
def test_training_does_not_leak(device, opt_cls):
    live0, live1, growth = _run_training(device, opt_cls, STEPS)
    print("\n%s: %d training steps after %d warm-up: RSS growth %.2f MiB (bound %.0f MiB), "
          "live C tensors %d -> %d" % (device, STEPS, WARMUP, growth, RSS_BOUND_MIB, live0, live1))
    assert live1 == live0, "%d C tensors leaked" % (live1 - live0)
    if not ASAN:  # ASan's quarantine keeps freed memory resident (up to 256 MiB by default)
        assert growth < RSS_BOUND_MIB, "resident memory grew %.2f MiB over %d steps" % (growth, STEPS)


def test_error_paths_do_not_leak(device):
    """Thousands of failing calls (refused in Python and in C) leave nothing behind."""
    def failing_calls(x, conv, bn):
        for call in (
            lambda: conv(ut.zeros((2, 4, 5, 5), device)),          # wrong channels
            lambda: ut.cross_entropy(x, np.array([0, 9])),         # label out of range
            lambda: x.add_(ut.zeros(5, device)),                   # refused by the C library
            lambda: ut.mse_loss(x, ut.zeros((3, 2), device)),
            lambda: bn.backward(ut.zeros((2, 3, 4, 4), device)),   # no forward kept
            lambda: ut.zeros((2**31,), device),
        ):
            try:
                r = call()
            except ut.UtensilError:
                continue
            raise AssertionError("expected a failure, got %r" % (r,))

    with ut.randn((2, 3), device=device) as x, \
            ut.Conv2d(3, 2, 3, device=device) as conv, ut.BatchNorm2d(3, device=device).eval() as bn:
        bn._clear_cache()
        for _ in range(50):
            failing_calls(x, conv, bn)
        gc.collect()
        live0, rss0 = ut.live_tensors(), rss_bytes()
        for _ in range(1000):
            failing_calls(x, conv, bn)
        gc.collect()
        assert ut.live_tensors() == live0
        assert ASAN or (rss_bytes() - rss0) / 2**20 < RSS_BOUND_MIB


def test_numpy_view_keeps_its_own_reference(device):
    gc.collect()
    live0 = ut.live_tensors()
    t = ut.randn((100, 100), device=device)
    v = t.numpy()
    t.close()
    assert ut.live_tensors() == live0 + 1  # the view's base still holds the C tensor
    assert np.isfinite(v).all()
    del v
    gc.collect()
    assert ut.live_tensors() == live0


def test_close_frees_gpu_memory_now():
    if "cuda" not in ut.devices():
        pytest.skip("no cuda device")
    ut.synchronize()
    gc.collect()
    used0 = gpu_used()
    big = ut.zeros((64, 1024, 1024), "cuda")  # 256 MiB
    assert gpu_used() - used0 >= 255 * 2**20
    gc.disable()  # close() must not need the collector
    try:
        big.close()
        ut.synchronize()
        assert gpu_used() - used0 < 2**20
    finally:
        gc.enable()


def test_gpu_memory_returns_to_start_after_training():
    if "cuda" not in ut.devices():
        pytest.skip("no cuda device")
    # warm-up: the backend keeps a workspace sized by the largest op; build it first
    _run_training("cuda", lambda p, lr: ut.SGD(p, lr=lr, momentum=0.9), 50)
    ut.synchronize()
    gc.collect()
    used0 = gpu_used()
    live0, live1, _ = _run_training("cuda", lambda p, lr: ut.Adam(p, lr=lr), 500)
    ut.synchronize()
    gc.collect()
    used1 = gpu_used()
    print("\ncuda: device memory in use %d -> %d bytes after 800 steps and close()" % (used0, used1))
    assert live1 == live0
    assert abs(used1 - used0) < 2**20, "device memory in use grew by %d bytes" % (used1 - used0)
