"""UTENSIL_EXPECT_CUDA=1 (.ci/gpu sets it) makes every step of the GPU suite fail where the CUDA
path cannot run, instead of passing on the CPU: the C tests (build.sh and the test binary), the
self-check, the network benchmark, and the pytest device helper. Checked here, on a machine that
has no GPU (or with it hidden), by running each in a subprocess (issue 29)."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import require_device

ROOT = Path(__file__).resolve().parent.parent
MESSAGE = "UTENSIL_EXPECT_CUDA=1 but"


def _env(**extra):
    # CUDA_VISIBLE_DEVICES="" hides a GPU, so these run as on a machine without one
    return dict(os.environ, UTENSIL_EXPECT_CUDA="1", CUDA_VISIBLE_DEVICES="", **extra)


def _run(cmd, env, timeout=120):
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return r.returncode, r.stdout + r.stderr


@pytest.fixture(scope="module")
def c_test_binary(tmp_path_factory):
    """native/test.c as the one-file program build.sh's `test` also makes (-O0: only main's
    first lines run here)."""
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        pytest.skip("no C compiler")
    d = tmp_path_factory.mktemp("ctest")
    (d / "app.c").write_text('#define UT_IMPLEMENTATION\n#include "%s"\n' % (ROOT / "native" / "test.c"))
    subprocess.run([cc, "-std=c11", "-O0", str(d / "app.c"), "-o", str(d / "app"), "-lm",
                    "-lpthread"], check=True, timeout=300)
    return d / "app"


def test_c_test_binary_fails_when_cuda_is_expected_and_absent(c_test_binary):
    rc, out = _run([str(c_test_binary)], _env())
    assert rc != 0, out
    assert MESSAGE + " CUDA is not available to this test binary" in out
    assert " passed, " not in out  # it stopped before running the UT_CUDA tests on the CPU


@pytest.mark.parametrize("target", ["test", "test-plain"])
def test_build_sh_test_refuses_a_build_without_cuda(tmp_path, target):
    """`./build.sh test` (the ctests step) and its half with the library, `test-plain` (the
    step's half under UT_CTESTS_ASYNC=1), fail at once, before minutes of building, when the
    library would be built without CUDA; nothing is built."""
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    for extra in ({"UT_CUDA": "0"}, {"NVCC": str(tmp_path / "no-such-nvcc")}):
        rc, out = _run(["bash", "build.sh", target],
                       _env(BUILD_DIR=str(tmp_path / "build"), **extra))
        assert rc != 0, out
        assert MESSAGE + " the library would be built without CUDA" in out, out
        assert not (tmp_path / "build").exists()


def test_selftest_fails_when_cuda_is_expected_and_absent():
    rc, out = _run([sys.executable, "-m", "utensil_ffi.testing.selftest", "--no-fd32"], _env())
    assert rc == 2, out
    assert "utensil self-check: %s utensil sees no usable GPU" % MESSAGE in out
    assert "RESULT: PASS" not in out


def test_network_benchmark_refuses_cuda_without_a_gpu():
    """The `networks` step: utensil's "cuda" tensors would run on the CPU fallback and be timed
    as the GPU's; a usage error instead, with or without UTENSIL_EXPECT_CUDA."""
    rc, out = _run([sys.executable, "bench/bench_networks.py", "--device", "cuda", "--blas", "own",
                    "--torch", "", "--no-check", "--steps", "1", "--rounds", "1"], _env())
    assert rc == 2, out
    assert "--device cuda but utensil sees no usable GPU" in out
    assert "Traceback" not in out


def test_require_device_fails_instead_of_skipping_when_cuda_is_expected():
    with pytest.raises(pytest.fail.Exception, match=MESSAGE):
        require_device("cuda", present=["cpu"], expect_cuda=True)
    with pytest.raises(pytest.skip.Exception):
        require_device("cuda", present=["cpu"], expect_cuda=False)
    assert require_device("cuda", present=["cpu", "cuda"], expect_cuda=True) == "cuda"
    assert require_device("cpu", present=["cpu"], expect_cuda=True) == "cpu"


def test_no_test_file_makes_its_own_device_list():
    """Devices come from the `device` fixture or require_device (tests/conftest.py), which
    honour UTENSIL_EXPECT_CUDA; a list of its own in a test file skips the GPU silently."""
    own = re.compile(r"parametrize\(\s*[\"']device[\"']|^DEVICES\s*=", re.M)
    offenders = [p.name for p in sorted((ROOT / "tests").glob("test_*.py"))
                 if own.search(p.read_text())]
    assert offenders == []
