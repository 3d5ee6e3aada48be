"""Resource exhaustion: an allocation larger than memory raises MemoryError (utensil's
OutOfMemoryError) and the library keeps working afterwards, on the CPU and on the GPU.

One tensor holds at most INT_MAX floats (8 GiB; more is a ShapeError by design), less than this
machine's memory, so host exhaustion is made real by capping the address space of a child
process (RLIMIT_AS, 1 GiB over what it uses at the start) before allocating. The child then runs:
a plain allocation, a layer whose weights do not fit, an op whose output does not fit, a conv
whose im2col buffer does not fit in the middle of forward, and after each checks that the live
tensor count is unchanged and that a training step still gives the same numbers as before.

Under AddressSanitizer RLIMIT_AS cannot be used (ASan reserves terabytes of shadow memory);
there the cap is ASan's own: ASAN_OPTIONS=allocator_may_return_null=1:max_allocation_size_mb=N.

GPU: device memory is filled with 4 GiB tensors (op outputs, whose host mirror is never
touched) until the allocation fails; after freeing them everything works again.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import utensil_ffi as ut

ROOT = Path(__file__).resolve().parent.parent

CHILD = r'''
import gc, os, resource, sys
import numpy as np
import utensil_ffi as ut

asan = "asan" in os.environ.get("LD_PRELOAD", "")
if asan:
    opts = os.environ.get("ASAN_OPTIONS", "")
    if "allocator_may_return_null=1" not in opts or "max_allocation_size_mb" not in opts:
        print("SKIP: under ASan, set ASAN_OPTIONS=allocator_may_return_null=1:max_allocation_size_mb=1024")
        sys.exit(0)
else:
    with open("/proc/self/statm") as f:
        vm = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    cap = vm + (1 << 30)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

def step():
    """One small deterministic training step: its numbers prove the library still works."""
    rng = np.random.default_rng(0)
    net = ut.Sequential(ut.Conv2d(2, 3, 3, padding=1), ut.BatchNorm2d(3), ut.ReLU6(),
                        ut.GlobalAvgPool2d(), ut.Linear(3, 2))
    for p in net.parameters():
        p.copy_from(rng.standard_normal(p.shape).astype(np.float32))
    x = ut.tensor(rng.standard_normal((2, 2, 5, 5)))
    y = net(x)
    g = ut.cross_entropy_backward(y, [0, 1])
    net.backward(g).close()
    out = [ut.cross_entropy(y, [0, 1]).item()] + [p.grad.numpy().copy() for p in net.parameters()]
    for t in (x, y, g):
        t.close()
    net.close()
    return out

def same(a, b):
    return all(np.array_equal(u, v) for u, v in zip(a, b))

ref = step()
gc.collect()
live0 = ut.live_tensors()
big = 2**30  # 4 GiB of floats
attempts = {
    "zeros": lambda: ut.zeros((big,)),
    "randn": lambda: ut.randn((2**15, 2**15)),
    "Linear weights": lambda: ut.Linear(2**15, 2**15),
    "matmul output": lambda: ut.matmul(ut.ones((2**15, 1)), ut.ones((1, 2**15))),
    "conv im2col": lambda: ut.Conv2d(1, 1, 7, padding=3)(ut.zeros((1, 1, 6000, 6000))),
    "numpy copy of a huge array": lambda: ut.tensor(np.broadcast_to(np.float32(1), (big,))),
}
for name, fn in attempts.items():
    for _ in range(3):
        try:
            r = fn()
        except MemoryError as e:
            assert isinstance(e, ut.UtensilError) or name.startswith("numpy"), (name, type(e))
            msg = str(e)
        else:
            print("FAIL: %s did not raise MemoryError (got %r)" % (name, r))
            sys.exit(1)
        gc.collect()
        if ut.live_tensors() != live0:
            print("FAIL: %s leaked %d tensors" % (name, ut.live_tensors() - live0))
            sys.exit(1)
        if not same(step(), ref):
            print("FAIL: the library computes differently after %s failed" % name)
            sys.exit(1)
    print("OK %s: %s" % (name, msg[:120]))
print("DONE")
'''

GPU_CHILD = r'''
import gc
import numpy as np
import utensil_ffi as ut
from utensil_ffi._lib import ffi, lib

def used():
    f, t = ffi.new("size_t*"), ffi.new("size_t*")
    assert lib.ut_cuda_mem_info(f, t) == 0
    return t[0] - f[0], t[0]

x = ut.zeros((2**30,), "cuda")  # 4 GiB on the GPU (and its host mirror, written once)
a = ut.randn((64, 64), device="cuda"); b = ut.randn((64, 64), device="cuda")
ref = ut.matmul(a, b).numpy().copy()
ut.synchronize(); gc.collect()
used0, total = used()
held = []
err = None
for i in range(int(total // 2**32) + 8):
    try:
        held.append(ut.relu(x))  # an op output: 4 GiB of device memory, host mirror untouched
    except MemoryError as e:
        err = e
        break
assert err is not None, "filled %d x 4 GiB without a MemoryError" % len(held)
assert isinstance(err, ut.OutOfMemoryError), type(err)
print("OK: MemoryError after %d x 4 GiB: %s" % (len(held), str(err)[:120]))
try:  # the library works while the device is full (small ops may or may not fit)
    ut.matmul(a, b).close()
except MemoryError:
    pass
for t in held:
    t.close()
held.clear()
ut.synchronize(); gc.collect()
assert np.array_equal(ut.matmul(a, b).numpy(), ref)
after, _ = used()
assert abs(after - used0) < 2**24, (used0, after)
print("DONE")
'''


def _run(code, timeout=300):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_host_memory_exhaustion():
    r = _run(CHILD)
    if r.stdout.startswith("SKIP"):
        pytest.skip(r.stdout.strip())
    assert r.returncode == 0 and r.stdout.strip().endswith("DONE"), (
        "child exited %d\n%s\n%s" % (r.returncode, r.stdout, r.stderr[-3000:]))
    print("\n" + r.stdout)


def test_over_int_max_elements_is_a_shape_error():
    for shape in [(2**31,), (2**16, 2**16), (2**20, 2**12)]:
        with pytest.raises(ut.ShapeError):
            ut.zeros(shape)


def test_gpu_memory_exhaustion():
    if "cuda" not in ut.devices():
        pytest.skip("no cuda device")
    r = _run(GPU_CHILD, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("DONE"), (
        "child exited %d\n%s\n%s" % (r.returncode, r.stdout, r.stderr[-3000:]))
    print("\n" + r.stdout)
