"""Threads: cffi releases the GIL around every C call, so the library really runs concurrently.

What the library promises (native/utensil.h, THREADS) and what is checked here:
  - independent tensors and layers may be used from several threads at once: threads running
    independent training steps get results bitwise identical to the same work run serially
    (the CPU backend is deterministic for a fixed ut.set_num_threads());
  - the error status and message are thread-local: threads failing at the same time each get
    the message of their own failure;
  - the RNG is shared and locked: concurrent randn() calls each get a whole, untorn chunk of the
    one stream, so together they draw exactly what the same calls draw serially;
  - the GPU context and its workspace are shared and locked (the same tests run on "cuda").
  - references to one tensor may be taken and dropped from several threads at once (the reference
    count is updated atomically; test_shared_tensor_refcount_is_atomic runs ThreadSanitizer).
NOT promised: ops writing ONE tensor from several threads at once.
"""

import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import utensil_ffi as ut
from utensil_ffi._lib import ffi, lib

ROOT = Path(__file__).resolve().parent.parent
N_THREADS = 4


@pytest.fixture(autouse=True)
def fast_switching():
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # interleave the Python parts as much as possible too
    yield
    sys.setswitchinterval(old)


def run_threads(fn, args_list):
    results = [None] * len(args_list)
    errors = []
    barrier = threading.Barrier(len(args_list))

    def body(i, args):
        try:
            barrier.wait()
            results[i] = fn(*args)
        except BaseException as e:  # reported in the main thread
            errors.append((i, e))

    ths = [threading.Thread(target=body, args=(i, a)) for i, a in enumerate(args_list)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    if errors:
        raise errors[0][1]
    return results


def training_job(device, seed, steps=15):
    """An independent small network trained a few steps; returns every number it produced."""
    rng = np.random.default_rng(seed)
    net = ut.Sequential(
        ut.Conv2d(3, 6, (3, 2), stride=2, padding=1, device=device),
        ut.BatchNorm2d(6, device=device),
        ut.ReLU6(),
        ut.DWConv2d(6, 3, stride=1, padding=2, device=device),
        ut.GlobalAvgPool2d(),
        ut.Linear(6, 5, device=device),
    )
    ln = ut.LayerNorm(5, device=device)
    for p in net.parameters():  # layer init draws from the shared RNG: set the values ourselves
        p.copy_from(rng.standard_normal(p.shape).astype(np.float32) * 0.4)
    opt = ut.Adam(net.parameters() + ln.parameters(), lr=0.01)
    out = []
    x_np = rng.standard_normal((5, 3, 11, 9)).astype(np.float32)
    labels = rng.integers(0, 5, size=5)
    try:
        for _ in range(steps):
            with ut.tensor(x_np, device) as x:
                h = net(x)
                logits = ln(h)
                h.close()
                out.append(ut.cross_entropy(logits, labels).numpy().copy())
                opt.zero_grad()
                with ut.cross_entropy_backward(logits, labels) as g, ln.backward(g) as g2:
                    net.backward(g2).close()
                logits.close()
                opt.step()
        out += [p.numpy().copy() for p in net.parameters()]
        out += [net[1].running_mean.numpy().copy(), net[1].running_var.numpy().copy()]
    finally:
        opt.close()
        ln.close()
        net.close()
    return out


def test_concurrent_training_matches_serial(device):
    seeds = list(range(N_THREADS))
    serial = [training_job(device, s) for s in seeds]
    for rep in range(2):
        threaded = run_threads(training_job, [(device, s) for s in seeds])
        for s, a, b in zip(seeds, serial, threaded):
            assert len(a) == len(b)
            for i, (u, v) in enumerate(zip(a, b)):
                assert np.array_equal(u, v), "thread with seed %d, value %d differs from the serial run" % (s, i)
    # and the jobs really differ from one another (the comparison above is not vacuous)
    assert not np.array_equal(serial[0][-3], serial[1][-3])


def test_concurrent_ops_match_serial(device):
    """Many short ops (matmul, conv forward/backward) in many threads, bitwise equal."""
    def job(seed):
        rng = np.random.default_rng(seed)
        a, b = rng.standard_normal((33, 17)), rng.standard_normal((17, 29))
        res = []
        for _ in range(20):
            with ut.tensor(a, device) as at, ut.tensor(b, device) as bt, ut.matmul(at, bt) as c:
                res.append(c.numpy().copy())
        return res

    serial = [job(s) for s in range(8)]
    threaded = run_threads(job, [(s,) for s in range(8)])
    for a, b in zip(serial, threaded):
        assert all(np.array_equal(u, v) for u, v in zip(a, b))


def test_error_message_is_thread_local_c():
    """Straight at the C API: each thread fails with its own ndim and reads its own message."""
    iters = 5000

    def job(k):
        ndim = 20 + k
        bad = 0
        dims = ffi.new("int[]", [1] * 32)
        for i in range(iters):
            lib.ut_clear_error()
            assert lib.ut_alloc(ndim, dims, lib.UT_CPU) == ffi.NULL
            msg = ffi.string(lib.ut_last_error()).decode()
            if ("got %d" % ndim) not in msg or lib.ut_last_status() != lib.UT_ERR_SHAPE:
                bad += 1
            if i % 2:  # interleave successes: they must not clear or change the message
                t = lib.ut_alloc(1, dims, lib.UT_CPU)
                lib.ut_free(t)
                if ("got %d" % ndim) not in ffi.string(lib.ut_last_error()).decode():
                    bad += 1
        return bad

    assert run_threads(job, [(k,) for k in range(N_THREADS)]) == [0] * N_THREADS


def test_error_message_is_thread_local_python(device):
    """Through the Python API: each thread's exception names its own failure (refused in C)."""
    def job(k):
        wrong = []
        n = 3 + k
        with ut.zeros((2,), device) as dst, ut.zeros((n,), device) as src:
            for _ in range(500):
                try:
                    dst.add_(src)
                except ut.ShapeError as e:
                    if str(n) not in str(e).split(":", 1)[1]:
                        wrong.append(str(e))
                else:
                    wrong.append("no error")
        return wrong

    results = run_threads(job, [(k,) for k in range(N_THREADS)])
    assert results == [[]] * N_THREADS, results


def test_rng_is_locked(device):
    """Concurrent randn calls draw the same values as serial ones, each tensor one whole chunk."""
    calls, n = 64, 257

    def draw(count):
        return [ut.randn((n,), device=device) for _ in range(count)]

    ut.seed(42)
    serial = draw(calls)
    want = {tuple(t.numpy().tolist()) for t in serial}
    for t in serial:
        t.close()
    ut.seed(42)
    parts = run_threads(draw, [(calls // N_THREADS,)] * N_THREADS)
    got = {tuple(t.numpy().tolist()) for part in parts for t in part}
    for part in parts:
        for t in part:
            t.close()
    assert got == want


def test_set_num_threads_is_consistent():
    old = ut.get_num_threads()
    try:
        results = {}
        for nt in (1, 2, 3):
            ut.set_num_threads(nt)
            results[nt] = training_job("cpu", 7, steps=3)
            again = run_threads(training_job, [("cpu", 7, 3)] * 2)
            for r in again:  # deterministic for a given thread count, concurrently too
                assert all(np.array_equal(u, v) for u, v in zip(results[nt], r))
        for nt in (2, 3):  # and close across thread counts
            for u, v in zip(results[1], results[nt]):
                np.testing.assert_allclose(u, v, rtol=1e-4, atol=1e-5)
    finally:
        ut.set_num_threads(old)


RACE_C = r"""
#include <pthread.h>
#include <stdio.h>
#include "utensil.h"
static ut_tensor* t;
static void* work(void* arg) {
  (void)arg;
  for (int i = 0; i < 20000; i++) { ut_retain(t); ut_free(t); }
  return NULL;
}
int main(void) {
  int shape[1] = {4};
  t = ut_alloc(1, shape, UT_CPU);
  pthread_t a, b;
  pthread_create(&a, NULL, work, NULL);
  pthread_create(&b, NULL, work, NULL);
  pthread_join(a, NULL);
  pthread_join(b, NULL);
  ut_free(t);
  printf("live %lld\n", ut_live_tensors());
  return 0;
}
"""


def test_shared_tensor_refcount_is_atomic(tmp_path):
    """ThreadSanitizer on two threads that retain and free one shared tensor."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    (tmp_path / "race.c").write_text(RACE_C)
    exe = tmp_path / "race"
    b = subprocess.run([cc, "-O1", "-g", "-fsanitize=thread", "-pthread", "-DUT_NO_CUDA",
                        "-I", str(ROOT / "native"), str(tmp_path / "race.c"),
                        str(ROOT / "native" / "utensil.c"), "-o", str(exe), "-lm"],
                       capture_output=True, text=True)
    if b.returncode != 0:
        pytest.skip("cannot build with -fsanitize=thread: " + b.stderr[-300:])
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120,
                       env={"TSAN_OPTIONS": "halt_on_error=1", "PATH": "/usr/bin:/bin"})
    if "FATAL: ThreadSanitizer" in r.stderr and "data race" not in r.stderr:
        pytest.skip("ThreadSanitizer cannot run here: " + r.stderr[-300:])
    assert "data race" not in r.stderr, r.stderr[:1500]
    assert r.returncode == 0 and "live 0" in r.stdout
