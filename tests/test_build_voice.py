"""build.sh says what it is doing, one "utensil build: ..." line per stage on stderr, so that
`pip install -v` shows why the first install takes minutes where nvcc is present, and how to
skip the CUDA part (UT_CUDA=0) (issue 29, item 3).

The builds here use stand-in compilers that only create their outputs (the real ones take
minutes): what is checked is build.sh's own voice, not the compilers'."""

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CUDA_FILES = sorted((ROOT / "native" / "cuda").glob("*.cu"))

# Creates the file after -o; enough for build.sh's CPU stages.
FAKE_CC = """#!/usr/bin/env bash
out=""; while [[ $# -gt 0 ]]; do [[ $1 == -o ]] && out=$2; shift; done
: >"$out"
"""
# The same, except that the shared library it links is a real one that defines the CUDA
# backend's entry point, which build.sh checks with nm.
FAKE_NVCC = """#!/usr/bin/env bash
out=""; shared=0
for a in "$@"; do [[ $a == -shared ]] && shared=1; done
while [[ $# -gt 0 ]]; do [[ $1 == -o ]] && out=$2; shift; done
if [[ $shared == 1 ]]; then
  printf 'void ut__cuda_backend(void) {}\\n' >"$out.c" && cc -shared -fPIC "$out.c" -o "$out"
else
  : >"$out"
fi
"""


def _script(path, text):
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


@pytest.fixture
def fakes(tmp_path):
    if shutil.which("bash") is None or shutil.which("cc") is None:
        pytest.skip("needs bash and cc")
    return {"CC": _script(tmp_path / "fake-cc", FAKE_CC),
            "NVCC": _script(tmp_path / "fake-nvcc", FAKE_NVCC)}


def _build(tmp_path, **env):
    full = dict(os.environ, BUILD_DIR=str(tmp_path / "build"), **env)
    full.pop("UTENSIL_EXPECT_CUDA", None)
    r = subprocess.run(["bash", "build.sh", "lib"], cwd=ROOT, env=full, capture_output=True,
                       text=True, timeout=120)
    stages = [l for l in r.stderr.splitlines() if l.startswith("utensil build: ")]
    return r, stages


def test_usage_names_ut_cuda():
    r = subprocess.run(["bash", "build.sh", "--help"], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0
    assert "UT_CUDA=0" in r.stdout and "utensil build:" in r.stdout


def test_cpu_build_says_each_stage(tmp_path, fakes):
    r, stages = _build(tmp_path, UT_CUDA="0", **fakes)
    assert r.returncode == 0, r.stderr
    assert stages[0] == "utensil build: building without CUDA (UT_CUDA=0)"
    assert "utensil build: compiling the CPU core (native/utensil.c)" in stages
    assert any(s.startswith("utensil build: linking ") for s in stages)
    assert stages[-1].startswith("utensil build: built ")
    assert r.stdout == ""  # stderr only: pip -v shows it, a caller's stdout stays clean


def test_cuda_build_says_how_many_files_how_long_and_how_to_skip(tmp_path, fakes):
    assert CUDA_FILES
    r, stages = _build(tmp_path, UT_CUDA="1", **fakes)
    assert r.returncode == 0, r.stderr
    nvcc = [s for s in stages if "CUDA files with nvcc" in s]
    assert len(nvcc) == 1, stages
    assert nvcc[0].startswith("utensil build: compiling %d CUDA files with nvcc" % len(CUDA_FILES))
    assert "minutes" in nvcc[0] and "UT_CUDA=0 skips" in nvcc[0]
    assert "utensil build: compiling the CPU core (native/utensil.c)" in stages
    assert any(s.startswith("utensil build: linking ") for s in stages)
    # a second build keeps the objects and says so instead
    r, stages = _build(tmp_path, UT_CUDA="1", **fakes)
    assert r.returncode == 0, r.stderr
    assert not any("CUDA files with nvcc" in s for s in stages)
    assert "utensil build: the %d CUDA objects are up to date" % len(CUDA_FILES) in stages
