"""The CUDA backend really runs, and a training step on the GPU stays on the GPU.

Set UTENSIL_EXPECT_CUDA=1 on a GPU machine: a missing or unusable GPU then fails instead of
skipping, so a run cannot silently test the CPU fallback twice.
"""

import os

import numpy as np
import pytest

import utensil_ffi as ut
from utensil_ffi._lib import ffi, lib

EXPECT = os.environ.get("UTENSIL_EXPECT_CUDA") == "1"
HAVE = "cuda" in ut.devices()
needs_gpu = pytest.mark.skipif(not HAVE and not EXPECT, reason="no cuda device")


def transfers():
    up, down = ffi.new("long long*"), ffi.new("long long*")
    lib.ut_transfer_counts(up, down)
    return up[0], down[0]


@needs_gpu
def test_gpu_is_really_used():
    assert HAVE, "UTENSIL_EXPECT_CUDA=1 but utensil sees no usable GPU"
    assert ffi.string(lib.ut_backend_name(lib.UT_CUDA)) == b"cuda"
    with ut.randn((64, 64), device="cuda") as t:
        assert t.ptr.gpu_buf != ffi.NULL  # the data lives in device memory
        free, total = ffi.new("size_t*"), ffi.new("size_t*")
        assert lib.ut_cuda_mem_info(free, total) == 0 and 0 < free[0] <= total[0]


def test_cpu_tensors_never_transfer():
    before = transfers()
    with ut.randn((8, 8)) as a:
        ut.relu(a).numpy()
    assert transfers() == before


@needs_gpu
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_training_step_makes_no_host_round_trips(optimizer):
    ut.seed(3)
    model = ut.Sequential(
        ut.Conv2d(3, 8, 3, padding=1), ut.BatchNorm2d(8), ut.ReLU6(),
        ut.DWConv2d(8, 3, stride=2, padding=1), ut.BatchNorm2d(8), ut.ReLU6(),
        ut.Conv2d(8, 16, 1), ut.ReLU(), ut.GlobalAvgPool2d(), ut.Linear(16, 5),
    ).to("cuda")
    params = model.parameters()
    opt = ut.SGD(params, lr=0.05, momentum=0.9) if optimizer == "sgd" else ut.Adam(params, lr=1e-3)
    rng = np.random.default_rng(0)
    x = ut.tensor(rng.standard_normal((6, 3, 9, 9)), device="cuda")
    labels = ut.tensor(rng.integers(0, 5, 6).astype(np.float32), device="cuda")

    def step():
        opt.zero_grad()
        logits = model(x)
        loss = ut.cross_entropy(logits, labels)
        model.backward(ut.cross_entropy_backward(logits, labels))
        opt.step()
        return loss

    step().close()  # the first step uploads the weights, input and labels once
    ut.synchronize()
    before = transfers()
    losses = [step() for _ in range(3)]
    ut.synchronize()
    assert transfers() == before, "a GPU training step copied data between host and device"
    values = [l.item() for l in losses]  # reading the loss is the one copy the user asks for
    assert transfers()[1] == before[1] + 3
    assert all(np.isfinite(values)) and values[-1] < values[0]
    for t in losses + [x, labels]:
        t.close()
    opt.close()
    model.close()


@pytest.mark.parametrize("suite", ["tests", "bench"])
def test_expect_cuda_fails_a_run_that_sees_no_gpu(suite):
    """.ci/gpu sets UTENSIL_EXPECT_CUDA=1: a run where utensil sees no GPU (here: hidden with
    CUDA_VISIBLE_DEVICES="") must fail at once, not skip the CUDA cases or run them on the CPU
    fallback and pass."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    target = {"tests": "tests/test_tensor.py", "bench": "bench/test_bench_ops.py"}[suite]
    env = dict(os.environ, UTENSIL_EXPECT_CUDA="1", CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "--benchmark-disable", "-x", target], cwd=root, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 4, r.stdout[-2000:] + r.stderr[-2000:]
    assert "UTENSIL_EXPECT_CUDA=1 but utensil sees no usable GPU" in r.stdout + r.stderr
