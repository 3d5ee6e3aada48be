"""The GPU's GEMM engine: cuBLAS loaded at run time, the own kernels, and the matmul precision.

cuBLAS results are checked against numpy float64 and against the own kernels in the same
process (``preferred_blas_library("own")``); a missing or broken cuBLAS must leave the own
kernels running with a message saying why. Set UTENSIL_EXPECT_CUBLAS=1 where cuBLAS is
installed: a cuBLAS that is not found then fails instead of testing the own kernels twice.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import utensil_ffi as ut
from tolerances import assert_close
from utensil_ffi import reference as R
from utensil_ffi._lib import ffi, lib

HAVE_CUDA = "cuda" in ut.devices()
EXPECT_CUBLAS = os.environ.get("UTENSIL_EXPECT_CUBLAS") == "1"
needs_gpu = pytest.mark.skipif(not HAVE_CUDA, reason="no cuda device")
needs_cublas = pytest.mark.skipif(
    not HAVE_CUDA or not (EXPECT_CUBLAS or ut.backends()["cuda"].get("gemm") == "cublas"),
    reason="cuBLAS is not available here")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _defaults():
    yield
    ut.set_float32_matmul_precision("highest")
    if HAVE_CUDA:
        lib.ut_cublas_enable(True)  # back to cuBLAS where there is one (an error where not)
        lib.ut_clear_error()


def _run(code, **env):
    """Runs code in a fresh interpreter with env added; returns its stdout."""
    full = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT), str(ROOT / "tests")] + [os.environ.get("PYTHONPATH", "")]))
    for k, v in env.items():
        if v is None:
            full.pop(k, None)
        else:
            full[k] = v
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


# ---- the settings, everywhere -----------------------------------------------------------------

def test_precision_takes_pytorchs_names():
    assert ut.get_float32_matmul_precision() == "highest"
    for p in ("high", "medium", "highest"):
        ut.set_float32_matmul_precision(p)
        assert ut.get_float32_matmul_precision() == p


@pytest.mark.parametrize("bad, exc", [("low", ut.ArgumentError), ("HIGH", ut.ArgumentError),
                                      ("", ut.ArgumentError), (None, ut.ArgumentTypeError),
                                      (1, ut.ArgumentTypeError), (b"high", ut.ArgumentTypeError),
                                      ("hi\0gh", ut.ArgumentError)])
def test_bad_precision_is_refused_and_changes_nothing(bad, exc):
    ut.set_float32_matmul_precision("high")
    with pytest.raises(exc):
        ut.set_float32_matmul_precision(bad)
    assert ut.get_float32_matmul_precision() == "high"


def test_c_refuses_unknown_precision_with_a_message():
    assert lib.ut_set_float32_matmul_precision(b"fast") == lib.UT_ERR_ARG
    assert b'"fast"' in ffi.string(lib.ut_last_error())
    assert lib.ut_set_float32_matmul_precision(ffi.NULL) == lib.UT_ERR_ARG
    assert ffi.string(lib.ut_get_float32_matmul_precision()) == b"highest"


def test_backends_reports_what_runs():
    b = ut.backends()
    assert b["cpu"]["threads"] == ut.get_num_threads()
    assert b["cuda"]["available"] == HAVE_CUDA
    if HAVE_CUDA:
        assert b["cuda"]["gemm"] in ("cublas", "own")
        assert b["cuda"]["float32_matmul_precision"] == "highest"
        if b["cuda"]["gemm"] == "cublas":
            assert b["cuda"]["cublas"].startswith("cuBLAS ")
        else:
            assert "own kernels" in b["cuda"]["cublas"]


def test_bad_engine_names_are_refused():
    with pytest.raises(ut.ArgumentError):
        ut.preferred_blas_library("cudnn")
    with pytest.raises(ut.ArgumentTypeError):
        ut.preferred_blas_library(3)


def test_cublas_hint_refuses_an_overlong_path():
    assert lib.ut_cublas_hint(b"x" * 5000) == lib.UT_ERR_ARG
    assert b"longer" in ffi.string(lib.ut_last_error())
    assert lib.ut_cublas_hint(ffi.NULL) == lib.UT_ERR_ARG


@pytest.mark.skipif(HAVE_CUDA, reason="a GPU is present")
def test_without_a_gpu_cublas_calls_say_so():
    with pytest.raises(ut.DeviceError, match="no CUDA device"):
        ut.load_cublas()
    with pytest.raises(ut.DeviceError, match="no CUDA device"):
        ut.preferred_blas_library("cublas")
    assert ut.preferred_blas_library("own") == "own"
    assert ut.preferred_blas_library() == "own"
    assert "no CUDA device" in ffi.string(lib.ut_cublas_info()).decode()


def test_the_nvidia_wheel_is_found_where_pip_puts_it(tmp_path):
    lib_dir = tmp_path / "nvidia" / "cu13" / "lib"
    lib_dir.mkdir(parents=True)
    (lib_dir / "libcublas.so.13").write_bytes(b"not really a library")
    out = _run("""
        import utensil_ffi.blas as b
        print(b.WHEEL_CUBLAS)
    """, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    assert out.strip() == str(lib_dir / "libcublas.so.13")


# ---- the GPU: cuBLAS against float64 and against the own kernels ------------------------------

def _conv_grads(engine, x, w, b, stride, pad, go):
    ut.preferred_blas_library(engine)
    o, c, kh, kw = w.shape
    with ut.Conv2d(c, o, (kh, kw), stride, pad, device="cuda") as layer:
        layer.weight, layer.bias = w, b
        y = layer(ut.tensor(x, "cuda")).numpy()
        dx = layer.backward(ut.tensor(go, "cuda")).numpy()
        return y, dx, layer.weight.grad.numpy(), layer.bias.grad.numpy()


# (n, c, h, w, o, k, stride, pad): pointwise convs whose weight gradient takes either plan for
# sum_batch (wide channels over few pixels: concatenate; few channels over many: reduce), a
# dense 3x3, the strided stem, and odd sizes
CONV_SHAPES = [
    (8, 64, 7, 7, 96, 1, 1, 0),
    (4, 8, 40, 40, 16, 1, 1, 0),
    (3, 5, 9, 11, 7, 1, 1, 0),
    (4, 16, 12, 12, 24, 3, 1, 1),
    (2, 3, 33, 33, 32, 3, 2, 1),
    (2, 6, 10, 10, 10, 5, 2, 2),
]


@needs_cublas
@pytest.mark.parametrize("shape", CONV_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_conv2d_on_cublas_matches_float64_and_the_own_kernels(shape):
    n, c, h, w_, o, k, s, p = shape
    rng = np.random.default_rng(sum(shape))
    x = rng.standard_normal((n, c, h, w_)).astype(np.float32)
    w = rng.standard_normal((o, c, k, k)).astype(np.float32)
    b = rng.standard_normal(o).astype(np.float32)
    ref_y = R.conv2d(x.astype(float), w.astype(float), b.astype(float), s, p)
    go = rng.standard_normal(ref_y.shape).astype(np.float32)
    cub = _conv_grads("cublas", x, w, b, s, p, go)
    own = _conv_grads("own", x, w, b, s, p, go)
    rdx, rdw, rdb = R.conv2d_backward(x.astype(float), w.astype(float), s, p, go.astype(float))
    for name, got, mine, ref in zip(("y", "dx", "dW", "db"), cub, own, (ref_y, rdx, rdw, rdb)):
        assert_close("cublas conv2d " + name, got, ref)
        assert_close("cublas vs own conv2d " + name, got, mine.astype(float))


@needs_cublas
@pytest.mark.parametrize("m, k, n", [(1, 1000, 1), (64, 1024, 1000), (37, 5, 129), (300, 3, 2)])
def test_matmul_and_linear_on_cublas(m, k, n):
    rng = np.random.default_rng(m * k + n)
    a = rng.standard_normal((m, k)).astype(np.float32)
    bm = rng.standard_normal((k, n)).astype(np.float32)
    ut.preferred_blas_library("cublas")
    with ut.tensor(a, "cuda") as ta, ut.tensor(bm, "cuda") as tb:
        assert_close("cublas matmul", ut.matmul(ta, tb).numpy(), a.astype(float) @ bm)
    with ut.Linear(k, n, device="cuda") as layer:
        w = rng.standard_normal((n, k)).astype(np.float32)
        layer.weight = w
        y = layer(ut.tensor(a, "cuda"))
        assert_close("cublas linear", y.numpy(), a.astype(float) @ w.T.astype(float)
                     + layer.bias.numpy().astype(float))
        go = rng.standard_normal((m, n)).astype(np.float32)
        dx = layer.backward(ut.tensor(go, "cuda"))
        assert_close("cublas linear dx", dx.numpy(), go.astype(float) @ w.astype(float))
        assert_close("cublas linear dW", layer.weight.grad.numpy(), go.T.astype(float) @ a)


@needs_cublas
def test_tf32_is_used_when_asked_and_stays_within_its_bound():
    rng = np.random.default_rng(5)
    k = 4096
    a = rng.standard_normal((256, k)).astype(np.float32)
    bm = rng.standard_normal((k, 256)).astype(np.float32)
    ref = a.astype(float) @ bm.astype(float)
    results = {}
    for p in ("highest", "high"):
        ut.set_float32_matmul_precision(p)
        with ut.tensor(a, "cuda") as ta, ut.tensor(bm, "cuda") as tb:
            results[p] = ut.matmul(ta, tb).numpy().astype(float)
    # terms are products of unit normals: each output is a sum of k terms of size ~1
    err = {p: np.max(np.abs(r - ref)) for p, r in results.items()}
    assert err["highest"] < 1e-5 * np.sqrt(k) * 8
    bound = 2.0**-10 * np.sqrt(k) * 6  # two inputs rounded at 2^-11 each, 6 sigma
    assert err["high"] < bound
    assert err["high"] > 10 * err["highest"], "TF32 was asked for but the result is fp32"


@needs_cublas
def test_own_kernels_stay_fp32_at_high_precision():
    rng = np.random.default_rng(6)
    a = rng.standard_normal((64, 2048)).astype(np.float32)
    bm = rng.standard_normal((2048, 64)).astype(np.float32)
    ut.set_float32_matmul_precision("high")
    ut.preferred_blas_library("own")
    with ut.tensor(a, "cuda") as ta, ut.tensor(bm, "cuda") as tb:
        got = ut.matmul(ta, tb).numpy()
    assert_close("own matmul at high precision", got, a.astype(float) @ bm.astype(float))


@needs_gpu
def test_engine_switch_reports_and_keeps_working():
    ut.preferred_blas_library("own")
    assert ut.preferred_blas_library() == "own"
    assert ut.backends()["cuda"]["gemm"] == "own"
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    with ut.tensor(a, "cuda") as t:
        np.testing.assert_array_equal(ut.matmul(t, ut.tensor(a.T.copy(), "cuda")).numpy(),
                                      a @ a.T)
    if EXPECT_CUBLAS or "cuBLAS " in ffi.string(lib.ut_cublas_info()).decode():
        assert ut.preferred_blas_library("cublas") == "cublas"
        assert "off" not in ut.backends()["cuda"]["cublas"]


@needs_gpu
def test_cublas_is_found_where_expected():
    if not EXPECT_CUBLAS:
        pytest.skip("UTENSIL_EXPECT_CUBLAS is not set")
    b = ut.backends()["cuda"]
    assert b["gemm"] == "cublas", b["cublas"]


# ---- the GPU without cuBLAS, or with a broken one ------------------------------------------------

_PROBE = """
    import numpy as np, utensil_ffi as ut
    from utensil_ffi import reference as R
    from tolerances import assert_close
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 8, 9, 9)).astype(np.float32)
    w = rng.standard_normal((12, 8, 3, 3)).astype(np.float32)
    with ut.Conv2d(8, 12, 3, 1, 1, bias=False, device="cuda") as layer:
        layer.weight = w
        y = layer(ut.tensor(x, "cuda")).numpy()
    assert_close("conv2d without cuBLAS", y, R.conv2d(x.astype(float), w.astype(float), None, 1, 1))
    b = ut.backends()["cuda"]
    print(b["gemm"])
    print(b["cublas"])
"""


@needs_gpu
def test_cublas_pointed_at_nothing_runs_the_own_kernels(tmp_path):
    missing = tmp_path / "no" / "libcublas.so.13"
    gemm, why = _run(_PROBE, UTENSIL_CUBLAS_LIB=str(missing)).splitlines()
    assert gemm == "own"
    assert str(missing) in why and "own kernels" in why


@needs_gpu
def test_cublas_disabled_by_an_empty_override():
    gemm, why = _run(_PROBE, UTENSIL_CUBLAS_LIB="").splitlines()
    assert gemm == "own" and "empty" in why


@needs_gpu
@pytest.mark.parametrize("kind", ["not_elf", "not_cublas"])
def test_a_broken_cublas_gives_a_message_not_a_crash(tmp_path, kind):
    if kind == "not_elf":
        bad = tmp_path / "libcublas.so.13"
        bad.write_bytes(b"\x7fELF but not really" * 10)
        expect = str(bad)
    else:  # a real shared library without cuBLAS's symbols
        bad = Path(ut.library_path)
        expect = "not a usable cuBLAS"
    gemm, why = _run(_PROBE, UTENSIL_CUBLAS_LIB=str(bad)).splitlines()
    assert gemm == "own" and expect in why
    # the explicit call raises, and the engine in use keeps working
    before = ut.preferred_blas_library()
    with pytest.raises(ut.DeviceError, match="ut_cublas_load"):
        ut.load_cublas(bad)
    assert ut.preferred_blas_library() == before
    a = np.eye(3, dtype=np.float32)
    with ut.tensor(a, "cuda") as t:
        np.testing.assert_array_equal(ut.matmul(t, t).numpy(), a)
