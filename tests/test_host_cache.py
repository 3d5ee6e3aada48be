"""The host memory cache (ut_host_empty_cache in native/utensil.h): freed blocks of 128 KiB or
more are reused by the next tensor of their size class instead of fresh pages from the system,
up to a cap (UTENSIL_HOST_CACHE_MB, default 1024; 0 turns it off). What a user relies on: a
reused block holds whatever the last tensor left, so every op must still write all of its
output; the cap holds; empty_host_cache gives everything back; nothing under ASan."""

import os
import subprocess
import sys

import numpy as np
import pytest

import utensil_ffi as ut

ASAN = "asan" in os.environ.get("LD_PRELOAD", "")
pytestmark = pytest.mark.skipif(ASAN, reason="the cache is off under AddressSanitizer")

MIB = 1 << 20


def test_a_freed_large_tensor_is_cached_and_reused():
    ut.empty_host_cache()
    assert ut.host_cached_bytes() == 0
    t = ut.full([256, 1024], 7.0)  # 1 MiB
    t.close()
    cached = ut.host_cached_bytes()
    assert MIB <= cached <= MIB * 9 // 8  # its size class: at most 1/8 over
    u = ut.zeros([256, 1024])  # the same class: the same block, which held 7s
    assert ut.host_cached_bytes() == 0  # taken back out
    assert not np.any(u.numpy())  # zeros wrote every value
    u.close()
    ut.empty_host_cache()
    assert ut.host_cached_bytes() == 0


def test_small_tensors_are_not_cached():
    ut.empty_host_cache()
    ut.full([100, 100], 1.0).close()  # 40 KB
    assert ut.host_cached_bytes() == 0


def test_ops_write_all_of_a_reused_output():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 16, 32, 32)).astype(np.float32)
    conv = ut.Conv2d(16, 32, 3, padding=1, bias=True)
    with ut.tensor(x) as xt:
        want = conv(xt).numpy().copy()
        for fill in (np.nan, 1e30):  # dirty every cached block, then run again
            ut.empty_host_cache()
            for _ in range(4):
                ut.tensor(np.full((2, 32, 32, 32), fill, np.float32)).close()
                ut.tensor(np.full((2, 16 * 9, 32 * 32), fill, np.float32)).close()
            with conv(xt) as y:
                np.testing.assert_array_equal(y.numpy(), want)


CHILD = r"""
import resource, sys
import utensil_ffi as ut
big = [2560, 4096]  # 40 MiB: over glibc's largest mmap threshold, so fresh pages every time
ut.full(big, 1.0).close()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    ut.full(big, 2.0).close()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0, ut.host_cached_bytes())
"""


def _child(mb):
    env = dict(os.environ)
    if mb is None:
        env.pop("UTENSIL_HOST_CACHE_MB", None)
    else:
        env["UTENSIL_HOST_CACHE_MB"] = str(mb)
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    faults, cached = out.stdout.split()
    return int(faults), int(cached)


def test_the_cache_saves_the_page_faults_and_its_cap_holds():
    pages = 40 * MIB // 4096
    faults_on, cached_on = _child(None)
    assert faults_on < pages // 10  # the block came back from the cache each time
    assert 40 * MIB <= cached_on <= 1024 * MIB
    faults_off, cached_off = _child(0)
    assert faults_off > 5 * pages  # off: fresh pages each time
    assert cached_off == 0
    faults_cap, cached_cap = _child(16)  # a 40 MiB block does not fit a 16 MiB cap
    assert cached_cap == 0 and faults_cap > 5 * pages
