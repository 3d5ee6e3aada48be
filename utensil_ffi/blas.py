"""Which engine runs matrix products on the GPU, and how precisely.

GEMMs on the GPU (matmul, Linear, Conv2d) run on NVIDIA's cuBLAS when it can be loaded at run
time, else on utensil's own CUDA kernels; the library never links or ships cuBLAS. It is looked
for at the first GEMM on the GPU, in this order:

1. ``$UTENSIL_CUBLAS_LIB``: a path to ``libcublas.so.*`` (set but empty: no cuBLAS);
2. the ``nvidia-cublas`` wheel (``pip install 'utensil-ffi[cuda]'``), found here at import;
3. the system loader (``libcublas.so.13``, ``libcublas.so.12``).

Not finding it is no error: the own kernels run and :func:`backends` says why.

Precision follows PyTorch: ``set_float32_matmul_precision("highest")`` (the default) keeps GEMMs
in fp32; ``"high"`` (or ``"medium"``) lets cuBLAS use TF32 tensor cores, which round each
product's inputs to a 10-bit mantissa (relative error up to 2**-11 per input) and keep fp32
sums: a k-term dot product is off by about ``2**-11 * sqrt(k)`` of the size of its terms.
The CPU and the own kernels are fp32 at every setting.
"""

import sys
from pathlib import Path

from . import _args
from ._errors import check_status
from ._lib import ffi, lib

__all__ = [
    "backends",
    "load_cublas",
    "preferred_blas_library",
    "set_float32_matmul_precision",
    "get_float32_matmul_precision",
]

# (package folder under site-packages/nvidia, library file), newest CUDA first
_WHEEL_LIBS = (("cu13/lib", "libcublas.so.13"), ("cublas/lib", "libcublas.so.12"))


def _wheel_cublas():
    """The nvidia-cublas wheel's libcublas, or None: looked for under each sys.path entry
    (nvidia/ may be a namespace package spread over several of them), importing nothing."""
    for entry in sys.path:
        for sub, name in _WHEEL_LIBS:
            p = Path(entry or ".") / "nvidia" / sub / name
            if p.is_file():
                return str(p.resolve())
    return None


WHEEL_CUBLAS = _wheel_cublas()
if WHEEL_CUBLAS:
    check_status(lib.ut_cublas_hint(WHEEL_CUBLAS.encode()), "cublas hint")


def _text(ptr):
    return ffi.string(ptr).decode("utf-8", "replace")


def load_cublas(path=None):
    """Load cuBLAS now, from ``path`` (a libcublas.so file) or by the default search.

    GEMMs on the GPU then run on it. Raises DeviceError with the loader's reason when it cannot
    be loaded (the own kernels keep running)."""
    if path is not None:
        path = _args.to_str(path, "path")
    check_status(lib.ut_cublas_load(path.encode() if path is not None else ffi.NULL),
                 "load_cublas")


def preferred_blas_library(backend=None):
    """Set (``"cublas"`` or ``"own"``) and return the engine for GEMMs on the GPU.

    As ``torch.backends.cuda.preferred_blas_library``: with no argument it only reports.
    ``"own"`` runs utensil's CUDA kernels (the reference the tests check cuBLAS against);
    ``"cublas"`` raises DeviceError when cuBLAS cannot be loaded."""
    if backend is not None:
        choice = _args.to_str(backend, "backend", ("cublas", "own"))
        check_status(lib.ut_cublas_enable(choice == "cublas"), "preferred_blas_library")
    return "cublas" if lib.ut_cublas_active() else "own"


def set_float32_matmul_precision(precision):
    """``"highest"`` (fp32, the default), ``"high"`` or ``"medium"`` (TF32 on cuBLAS)."""
    p = _args.to_str(precision, "precision", ("highest", "high", "medium"))
    check_status(lib.ut_set_float32_matmul_precision(p.encode()), "set_float32_matmul_precision")


def get_float32_matmul_precision():
    return _text(lib.ut_get_float32_matmul_precision())


def backends():
    """What runs the ops here, as a dict::

        {"cpu": {"threads": 2},
         "cuda": {"available": True, "gemm": "cublas", "cublas": "cuBLAS 13.1.0 (/path)",
                  "float32_matmul_precision": "highest"}}

    ``cuda["cublas"]`` says which cuBLAS runs GEMMs, or why none does."""
    cuda = {"available": bool(lib.ut_cuda_available())}
    if cuda["available"]:
        cuda["gemm"] = "cublas" if lib.ut_cublas_active() else "own"
        cuda["cublas"] = _text(lib.ut_cublas_info())
        cuda["float32_matmul_precision"] = get_float32_matmul_precision()
    return {"cpu": {"threads": int(lib.ut_get_num_threads())}, "cuda": cuda}
