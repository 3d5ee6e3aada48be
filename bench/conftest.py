"""pytest-benchmark harness: cases, interleaving, bandwidth probes, the JSON metadata.

Each benchmark test is parametrized by ``case`` = (op, device, shape, impl), generated here in
the order device -> shape -> impl, so every utensil case is immediately followed by its PyTorch
twin (same op, shape and device; pytest-benchmark ``group`` pairs them). That interleaving is
what makes ratios meaningful on a machine whose memory bandwidth flips between two states.

Modes (see bench/RESULTS.md):
  python -m pytest bench -q --benchmark-disable          quick: each body once, N=32 -> N=2,
                                                         results checked against torch
  python -m pytest bench --benchmark-json=RUN.json ...   full shapes, timed
UTENSIL_BENCH_FULL=1/0 forces the full / quick shape set; UTENSIL_BENCH_THREADS (default 2)
sets the thread count of both libraries; UTENSIL_BENCH_DENSE_N replaces N=32 for the dense
3x3 conv; UTENSIL_BENCH_PROBE=0 turns the per-test bandwidth probe off.
"""

import os
import platform
import time

import pytest

import benchlib as B
import utensil_ffi as ut

_SESSION = {"probes": []}


def _disabled(config):
    return bool(config.getoption("benchmark_disable", False))


def pytest_configure(config):
    if os.environ.get("UTENSIL_EXPECT_CUDA") == "1" and "cuda" not in ut.devices():
        # .ci/gpu: the CUDA cases would be left out (or run on the CPU) and the run pass
        raise pytest.UsageError("UTENSIL_EXPECT_CUDA=1 but utensil sees no usable GPU")
    config.addinivalue_line(
        "markers", "bench_op(op, shapes='all'|'tiny'|'dense3x3', impls=('ours','torch')): "
        "a benchmark parametrized by bench/conftest.py")
    n = B.threads()
    ut.set_num_threads(n)
    if B.torch is not None:
        B.torch.set_num_threads(n)
        B.torch.backends.cudnn.benchmark = True
        # fp32 on both sides: no TF32 for torch's convs and matmuls
        B.torch.backends.cudnn.allow_tf32 = False
        B.torch.backends.cuda.matmul.allow_tf32 = False
    _SESSION["full"] = B.env_full(_disabled(config))
    _SESSION["timed"] = not _disabled(config)


def pytest_generate_tests(metafunc):
    m = metafunc.definition.get_closest_marker("bench_op")
    if m is None or "case" not in metafunc.fixturenames:
        return
    op = m.args[0]
    which = m.kwargs.get("shapes", "all")
    impls = m.kwargs.get("impls", ("ours", "torch"))
    full = _SESSION.get("full", True)
    if which == "tiny":
        shape_list = [B.TINY]
    elif which == "dense3x3":
        shape_list = B.dense3x3_shapes(full)
    else:
        shape_list = B.shapes(full)
    params = []
    for dev in ("cpu", "cuda"):
        for shape in shape_list:
            for impl in impls:
                marks = []
                if dev not in ut.devices():
                    marks.append(pytest.mark.skip(reason="no %s device" % dev))
                elif impl == "torch" and B.torch_device(dev) is None:
                    marks.append(pytest.mark.skip(reason="torch not installed / no torch %s" % dev))
                params.append(pytest.param(
                    (op, dev, shape, impl), id="%s-%s-%s" % (dev, B.shape_id(shape), impl),
                    marks=marks))
    metafunc.parametrize("case", params)


def _probe(device):
    if not _SESSION["timed"] or os.environ.get("UTENSIL_BENCH_PROBE", "1") == "0":
        return None
    return B.copy_bandwidth(device, mib=256, reps=2)


@pytest.fixture(scope="session")
def session_bandwidth():
    """Copy bandwidth per device measured at the start of a timed session (1 GiB, best of 5)."""
    out = {}
    if _SESSION["timed"]:
        for dev in ut.devices():
            bw = B.copy_bandwidth(dev, mib=1024, reps=5)
            if bw:
                out[dev] = bw
                _SESSION["probes"].append({"device": dev, "when": "start", "gbs": bw})
    yield out
    if _SESSION["timed"]:
        for dev in ut.devices():
            bw = B.copy_bandwidth(dev, mib=1024, reps=5)
            if bw:
                _SESSION["probes"].append({"device": dev, "when": "end", "gbs": bw})


@pytest.fixture
def run_case(benchmark, case, session_bandwidth):
    """Build the case's runner, cross-check it against torch once, then time it."""

    def run():
        op, dev, shape, impl = case
        benchmark.group = "%s %s %s" % (op, B.shape_id(shape), dev)
        benchmark.extra_info.update(op=op, device=dev, shape=list(shape), impl=impl,
                                    threads=B.threads())
        d = B.op_data(op, shape)
        side_dev = B.torch_device(dev) if impl == "torch" else dev
        live = ut.live_tensors()
        runner = B.make_runner(op, impl, side_dev, d)
        try:
            tdev = B.torch_device(dev)
            if impl != "torch" and tdev is not None:
                # correctness: the same inputs through torch; ours must match
                ref = B.make_runner(op, "torch", tdev, d)
                try:
                    ref.reset()
                    ref()
                    runner.reset()
                    runner()
                    B.assert_close(runner.outputs(), ref.outputs(), op)
                finally:
                    ref.close()
            elif _SESSION["timed"]:
                runner()  # warm-up
            probe = _probe(dev)
            if probe:
                benchmark.extra_info["probe_gbs"] = round(probe, 2)
            benchmark.extra_info["t_start"] = round(time.time(), 3)
            benchmark(runner)
        finally:
            runner.close()
            del runner
        if impl != "torch":  # runners close what they make: no collection needed (it costs 0.2 s)
            assert ut.live_tensors() == live, "leaked %d C tensors" % (ut.live_tensors() - live)

    return run


def pytest_benchmark_update_json(config, benchmarks, output_json):
    torch = B.torch
    output_json["utensil_bench"] = {
        "full_shapes": _SESSION.get("full"),
        "threads": B.threads(),
        "devices": ut.devices(),
        "library": str(ut.library_path),
        "torch": torch.__version__ if torch is not None else None,
        "torch_cuda": bool(torch is not None and torch.cuda.is_available()),
        "malloc_env": {k: os.environ[k] for k in sorted(os.environ) if k.startswith("MALLOC_")},
        "session_probes": _SESSION["probes"],
        "loadavg": os.getloadavg(),
        "host": platform.node(),
    }
