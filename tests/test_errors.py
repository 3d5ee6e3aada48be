"""Wrong input to every public entry point raises the documented exception, in-process.

Each case names the entry point it feeds; test_every_entry_point_is_covered checks that every
public callable of utensil_ffi appears in the table. The ops' cases (functional forms, layers,
losses, optimizer steps) are the op table's (utensil_ffi/testing/optable.py, each op's ``errors``, with a
fragment of the message); the rest of the library's are listed here.
"""

import functools
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import utensil_ffi as ut
from utensil_ffi.testing import optable
from utensil_ffi._errors import check_ptr, check_status
from utensil_ffi._lib import ffi, lib

E = ut  # exceptions: E.ShapeError, ...
T = ut.ArgumentTypeError
A = ut.ArgumentError
S = ut.ShapeError


def t(*shape):
    return ut.zeros(shape)


def fwd(layer, x):
    """A layer after a forward pass in training mode."""
    layer(x).close()
    return layer


# (entry point, wrong call, exception): the library's entry points that are not ops (tensors,
# containers, dtypes, interop, optimizer classes); each op's own wrong calls are in the op table
_LIBRARY = [
    # the GPU's matrix products
    ("set_float32_matmul_precision", lambda: ut.set_float32_matmul_precision("fast"), A),
    ("set_float32_matmul_precision", lambda: ut.set_float32_matmul_precision(None), T),
    ("preferred_blas_library", lambda: ut.preferred_blas_library("mkl"), A),
    ("load_cublas", lambda: ut.load_cublas(3), T),
    ("load_cublas", lambda: ut.load_cublas("/nonexistent/libcublas.so.13"), E.DeviceError),
    # tensors
    ("Tensor", lambda: ut.Tensor(np.array([object()])), T),
    ("Tensor", lambda: ut.Tensor(None), T),
    ("Tensor", lambda: ut.Tensor(["a", "b"]), T),
    ("Tensor", lambda: ut.Tensor(np.array([1 + 2j])), T),
    ("Tensor", lambda: ut.Tensor([[1, 2], [3]]), A),
    ("Tensor", lambda: ut.Tensor(np.zeros((2, 0))), S),
    ("Tensor", lambda: ut.Tensor(np.zeros((1,) * 9)), S),
    ("Tensor", lambda: ut.Tensor([1.0], device=0), T),
    ("Tensor", lambda: ut.Tensor([1.0], device="tpu"), A),
    ("Tensor", lambda: ut.Tensor([1.0], device="cuda:1"), E.DeviceError),
    ("tensor", lambda: ut.tensor({"a": 1}), T),
    ("from_numpy", lambda: ut.from_numpy(np.array(["x"])), T),
    ("from_numpy", lambda: ut.from_numpy(np.zeros(3), device=None), T),
    ("zeros", lambda: ut.zeros(-1), S),
    ("zeros", lambda: ut.zeros(0), S),
    ("zeros", lambda: ut.zeros(()), S),
    ("zeros", lambda: ut.zeros((2**31,)), S),
    ("zeros", lambda: ut.zeros((2**16, 2**16)), S),
    ("zeros", lambda: ut.zeros((1,) * 9), S),
    ("zeros", lambda: ut.zeros("ab"), T),
    ("zeros", lambda: ut.zeros(2.5), T),
    ("zeros", lambda: ut.zeros((True, 2)), T),
    ("ones", lambda: ut.ones(None), T),
    ("full", lambda: ut.full(3, "x"), T),
    ("full", lambda: ut.full(3, 1.0, device="gpu0"), A),
    ("randn", lambda: ut.randn(3, std=-1), A),
    ("randn", lambda: ut.randn(3, mean=float("nan")), A),
    ("randn", lambda: ut.randn(3, mean="0"), T),
    ("randn", lambda: ut.randn([3, -2]), S),
    ("seed", lambda: ut.seed(-1), A),
    ("seed", lambda: ut.seed(2**64), A),
    ("seed", lambda: ut.seed(1.5), T),
    ("seed", lambda: ut.seed("1"), T),
    ("set_num_threads", lambda: ut.set_num_threads(0), A),
    ("set_num_threads", lambda: ut.set_num_threads(2**40), A),
    ("set_num_threads", lambda: ut.set_num_threads(10**6), A),  # passes Python, refused by C
    ("set_num_threads", lambda: ut.set_num_threads("2"), T),
    ("set_retain_forward", lambda: ut.set_retain_forward("no"), T),
    ("set_retain_forward", lambda: ut.set_retain_forward(2), T),
    ("peak_live_bytes", lambda: ut.peak_live_bytes(reset="yes"), T),
    ("Tensor.reshape", lambda: t(3).reshape(4), S),  # refused by C
    ("Tensor.reshape", lambda: t(3).reshape(-1, -1), S),
    ("Tensor.reshape", lambda: t(4).reshape(3, -1), S),
    ("Tensor.reshape", lambda: t(3).reshape("3"), T),
    ("Tensor.transpose", lambda: t(2, 3).transpose(0, 2), A),
    ("Tensor.transpose", lambda: t(2, 3).transpose("a", 0), T),
    ("Tensor.fill_", lambda: t(2).fill_("x"), T),
    ("Tensor.add_", lambda: t(2).add_([1, 2]), T),
    ("Tensor.add_", lambda: t(2).add_(t(3)), S),  # refused by C
    ("Tensor.mul_", lambda: t(2).mul_(None), T),
    ("Tensor.copy_from", lambda: t(2, 2).copy_from(np.zeros(4)), S),
    ("Tensor.copy_from", lambda: t(2).copy_from(t(3)), S),
    ("Tensor.copy_from", lambda: t(2).copy_from(["a", "b"]), T),
    ("Tensor.to", lambda: t(2).to("tpu"), A),
    ("Tensor.to", lambda: t(2).to(None), T),
    ("Tensor.item", lambda: t(2).item(), S),
    ("functional.reshape", lambda: ut.functional.reshape(t(2, 3), (4, 2)), S),
    # containers, mixed precision, dtypes
    ("Sequential", lambda: ut.Sequential(ut.ReLU(), 3), T),
    ("Residual", lambda: ut.Residual(3), T),
    ("MixedPrecision", lambda: ut.MixedPrecision(3), T),
    ("MixedPrecision", lambda: ut.MixedPrecision(ut.ReLU(), dtype="float16"), T),
    ("dtype", lambda: ut.dtype("float16", 2, 2), T),
    ("Tensor.to", lambda: t(2).to("bf16", "float32"), T),
    ("Tensor.to", lambda: t(2).to("cpu", "cuda"), T),
    ("Tensor", lambda: ut.Tensor([1.0], dtype="int8"), T),
    ("Residual.forward", lambda: ut.Residual(ut.Linear(2, 3))(t(1, 2)), S),
    # batchnorm across processes
    ("SyncBatchNorm", lambda: ut.SyncBatchNorm(2, process_group=object()), T),
    ("SyncBatchNorm.forward", lambda: ut.SyncBatchNorm(2)(t(2, 3, 2, 2)), S),
    # containers again
    ("Sequential.forward", lambda: ut.Sequential(ut.Linear(2, 2))(t(1, 3)), S),
    ("Sequential.backward", lambda: ut.Sequential(ut.Linear(2, 2)).backward(t(1, 2)), A),
    ("Module.to", lambda: ut.Sequential(ut.ReLU()).to(1), T),
    # interop
    ("from_dlpack", lambda: ut.from_dlpack([1.0, 2.0]), T),
    ("from_dlpack", lambda: ut.from_dlpack(np.zeros(2, np.float32), copy="yes"), T),
    ("from_dlpack", lambda: ut.from_dlpack(np.zeros(2, np.float32), device="tpu"), A),
    # optimizers
    ("SGD", lambda: ut.SGD([], lr=0.1), A),
    ("SGD", lambda: ut.SGD([t(3)], lr=0.1), T),
    ("SGD", lambda: ut.SGD(5, lr=0.1), T),
    ("SGD", lambda: ut.SGD(ut.Linear(2, 2).parameters(), lr=-0.1), A),
    ("SGD", lambda: ut.SGD(ut.Linear(2, 2), lr=0.1, momentum="x"), T),
    ("Adam", lambda: ut.Adam(ut.Linear(2, 2).parameters(), betas=(1.0, 0.9)), A),
    ("Adam", lambda: ut.Adam(ut.Linear(2, 2).parameters(), betas=0.9), A),
    ("Adam", lambda: ut.Adam(ut.Linear(2, 2).parameters(), eps="x"), T),
    ("Adam", lambda: ut.Adam(ut.Linear(2, 2).parameters(), lr=float("inf")), A),
    # issue 30: weight decay, Nesterov (PyTorch's messages: tests/test_recipe.py)
    ("AdamW", lambda: ut.AdamW(ut.Linear(2, 2).parameters(), weight_decay=-1), A),
    ("AdamW", lambda: ut.AdamW(ut.Linear(2, 2).parameters(), betas=(0.9, 1.0)), A),
    ("Adam", lambda: ut.Adam(ut.Linear(2, 2).parameters(), weight_decay="x"), T),
    ("SGD", lambda: ut.SGD(ut.Linear(2, 2).parameters(), nesterov=True), A),
    ("SGD", lambda: ut.SGD(ut.Linear(2, 2).parameters(), weight_decay=float("nan")), A),
    ("Optimizer.step", lambda: _step_with_closed_grad(), E.ClosedError),
]

# (entry point, wrong call, exception, message fragment): the library's cases (any message), then
# every op's wrong calls from the op table (utensil_ffi/testing/optable.py): functional forms, layers,
# losses, optimizer steps, each with a fragment its message must contain
CASES = [(entry, call, exc, None) for entry, call, exc in _LIBRARY] + [
    (c.entry, functools.partial(c.call, ut), c.exception(ut), c.match)
    for op in optable.OPS for c in op.errors]


def _step_with_closed_grad():
    layer = ut.Linear(2, 2)
    opt = ut.SGD(layer.parameters(), lr=0.1)
    layer.weight.grad.close()
    opt.step()


@pytest.mark.parametrize("entry,call,exc,match", CASES,
                         ids=["%s-%d" % (c[0], i) for i, c in enumerate(CASES)])
def test_wrong_input_raises(entry, call, exc, match):
    with pytest.raises(exc) as info:
        call()
    if exc is not TypeError:
        assert isinstance(info.value, ut.UtensilError)
        assert str(info.value)  # every error says something
    if match is not None:  # and, for the ops, says what is wrong
        assert match in str(info.value), "%r not in %r" % (match, str(info.value))


NO_INPUT = {"devices", "cuda_available", "get_num_threads", "live_tensors", "synchronize",
            "backends", "get_float32_matmul_precision", "live_bytes",
            "get_retain_forward", "empty_host_cache", "host_cached_bytes"}  # take no arguments


def test_every_entry_point_is_covered():
    covered = {c[0].split(".")[0] for c in CASES} | {c[0] for c in CASES}
    public = {
        name for name in ut.__all__
        if callable(getattr(ut, name)) and not (isinstance(getattr(ut, name), type)
                                                and issubclass(getattr(ut, name), BaseException))
    }
    public -= {"Module", "Parameter", "Optimizer", "functional"} | NO_INPUT
    missing = public - covered
    assert not missing, "entry points without a wrong-input case: %s" % sorted(missing)
    layer_methods = {c[0] for c in CASES if "." in c[0]}
    for cls in ("Conv2d", "DWConv2d", "Linear", "LayerNorm", "BatchNorm2d", "ReLU", "GlobalAvgPool2d"):
        assert {cls + ".forward", cls + ".backward"} & layer_methods, cls


def test_exception_tree():
    assert issubclass(ut.ShapeError, ut.UtensilError) and issubclass(ut.ShapeError, ValueError)
    assert issubclass(ut.ArgumentError, ValueError)
    assert issubclass(ut.ArgumentTypeError, TypeError) and issubclass(ut.ArgumentTypeError, ValueError)
    assert issubclass(ut.ClosedError, ValueError)
    assert issubclass(ut.OutOfMemoryError, MemoryError)
    assert issubclass(ut.DeviceError, RuntimeError)
    for cls in (ut.ArgumentError, ut.ShapeError, ut.OutOfMemoryError, ut.DeviceError):
        assert issubclass(cls, ut.UtensilError)


def test_c_failures_map_to_the_tree():
    """Calls the C library refuses (bypassing the Python checks) raise the mapped exception."""
    a, b = ut.zeros((2, 3)), ut.zeros((2, 3))
    with pytest.raises(ut.ShapeError, match="ut_matmul|matmul"):
        check_ptr(lib.ut_matmul(a.ptr, b.ptr), "ut_matmul")
    with pytest.raises(ut.ArgumentError):
        check_ptr(lib.ut_relu(ffi.NULL), "ut_relu")
    with pytest.raises(ut.ShapeError):
        check_ptr(lib.ut_alloc(-1, ffi.new("int[]", [1]), lib.UT_CPU), "ut_alloc")
    with pytest.raises(ut.ShapeError):
        check_ptr(lib.ut_alloc(1, ffi.new("int[]", [-5]), lib.UT_CPU), "ut_alloc")
    with pytest.raises(ut.ArgumentError):
        check_status(lib.ut_fill(ffi.NULL, 1.0), "ut_fill")
    with pytest.raises(ut.ArgumentError):
        check_status(lib.ut_sgd_step(a.ptr, b.ptr, ffi.NULL, float("nan"), 0.0), "ut_sgd_step")
    lib.ut_clear_error()
    assert lib.ut_last_status() == lib.UT_OK and ffi.string(lib.ut_last_error()) == b""


def test_nan_and_inf_inputs_do_not_crash():
    x = np.array([[np.nan, np.inf], [-np.inf, 1.0]], dtype=np.float32)
    xt = ut.tensor(x)
    assert np.isnan(ut.relu(xt).numpy()[0, 0])
    assert np.isnan(ut.mse_loss(xt, np.zeros((2, 2))).item())
    assert np.isnan(ut.cross_entropy(xt, np.array([0, 1])).item())
    ln = ut.LayerNorm(2)
    assert np.isnan(ln(xt).numpy()[0]).all()
    ln.backward(np.ones((2, 2))).close()
    with ut.Conv2d(1, 1, 1) as c:
        c(xt.reshape(1, 1, 2, 2)).close()


@pytest.mark.skipif("asan" in os.environ.get("LD_PRELOAD", ""),
                    reason="AddressSanitizer cannot run under an address-space limit")
def test_out_of_memory_is_memory_error(tmp_path):
    """With the address space capped, a large allocation fails cleanly (in a child process)."""
    code = textwrap.dedent("""
        import resource, utensil_ffi as ut
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, resource.RLIM_INFINITY))
        try:
            ut.zeros((1 << 29,))  # 2 GiB of floats
        except ut.OutOfMemoryError as e:
            assert isinstance(e, MemoryError), e
            print("OOM-OK", e)
    """)
    root = os.path.dirname(os.path.dirname(ut.__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert "OOM-OK" in r.stdout, r.stdout + r.stderr


def test_mixed_devices_raise_device_error():
    """C refuses tensors on two devices (status UT_ERR_ARG); the bindings raise DeviceError with
    its message. Without a GPU the C library runs UT_CUDA tensors on the CPU, so a tensor made
    through the C API is tagged "cuda" either way."""
    shape = ffi.new("int[]", [2, 3])
    other = ut.Tensor._wrap(check_ptr(lib.ut_alloc(2, shape, lib.UT_CUDA), "ut_alloc"))
    a = t(2, 3)
    with pytest.raises(ut.DeviceError, match="is on"):
        ut.mse_loss(a, other)
    with pytest.raises(ut.DeviceError, match="is on"):
        ut.relu_backward(a, other)
    with pytest.raises(ut.DeviceError, match="is on"):
        ut.functional.add_(a, other)
    with ut.Linear(3, 2) as lin, pytest.raises(ut.DeviceError, match="is on"):
        lin(other)
    other.close()
    a.close()
