"""Shared fixtures: the `device` parameter, a seeded RNG, a leak check, the error report."""

import gc
import os

import numpy as np
import pytest

import utensil_ffi as ut

# Child processes (launcher ranks, loader workers, CLI runs) import the utensil_ffi under test,
# the one this process imported, whether or not the package is installed (a checkout run with
# PYTHONPATH set to other packages' folder, as on the lent GPU machines, left them none)
_PKG_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(ut.__file__)))
os.environ["PYTHONPATH"] = os.pathsep.join(
    [_PKG_ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])

ALL_DEVICES = ["cpu", "cuda"]
PRESENT = ut.devices()
# .ci/gpu sets it: there a missing GPU must fail the run, not skip its tests (a library built
# without CUDA runs "cuda" tensors on the CPU paths and would pass them all)
EXPECT_CUDA = os.environ.get("UTENSIL_EXPECT_CUDA") == "1"


def pytest_sessionstart(session):
    if EXPECT_CUDA and "cuda" not in PRESENT:
        raise pytest.UsageError(
            "UTENSIL_EXPECT_CUDA=1 but utensil sees no usable GPU (built without CUDA, or no "
            "device): the CUDA tests would be skipped or run on the CPU")


def require_device(device, present=None, expect_cuda=None):
    """`device`, for a test that runs on it: skipped where it is not present, failed instead
    under UTENSIL_EXPECT_CUDA=1 when it is the GPU. The one place a test learns which devices
    it may run on (the `device` fixture, and tests that need a particular device)."""
    present = PRESENT if present is None else present
    expect_cuda = EXPECT_CUDA if expect_cuda is None else expect_cuda
    if device in present:
        return device
    if expect_cuda and device == "cuda":
        pytest.fail("UTENSIL_EXPECT_CUDA=1 but utensil sees no usable GPU: the %r case would "
                    "be skipped" % device, pytrace=False)
    pytest.skip("no %s device" % device)


@pytest.fixture(params=ALL_DEVICES)
def device(request):
    """Each device the library can run on; those not present are skipped, not failed (failed
    under UTENSIL_EXPECT_CUDA=1)."""
    return require_device(request.param)


@pytest.fixture
def torch():
    """PyTorch on one thread for the test (tiny ops), its thread count restored after; skips
    where PyTorch is not installed."""
    torch = pytest.importorskip("torch")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield torch
    torch.set_num_threads(n)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture(autouse=True)
def no_leaked_tensors(request):
    """Every test must give back the C tensors it made (checked after a full collection)."""
    gc.collect()
    before = ut.live_tensors()
    yield
    rep = getattr(request.node, "rep_call", None)
    if rep is None or not rep.passed:
        return
    gc.collect()
    after = ut.live_tensors()
    # only growth counts: garbage of an earlier (failed) test may be collected during this one
    assert after <= before, "test leaked %d C tensors" % (after - before)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.when == "call":
        item.rep_call = rep


def pytest_terminal_summary(terminalreporter):
    from tolerances import WORST

    if not WORST:
        return
    tr = terminalreporter
    tr.section("worst error vs the float64 reference (max |got - ref| / max |ref|)")
    for op in sorted(WORST):
        tr.write_line("  %-34s %.2e" % (op, WORST[op]))
