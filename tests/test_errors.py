"""Wrong input to every public entry point raises the documented exception, in-process.

Each case names the entry point it feeds; test_every_entry_point_is_covered checks that every
public callable of utensil_ffi appears in the table.
"""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import utensil_ffi as ut
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


# (entry point, wrong call, exception)
CASES = [
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
    # functional forms
    ("relu", lambda: ut.relu("abc"), T),
    ("relu", lambda: ut.relu(None), T),
    ("relu6", lambda: ut.relu6(np.zeros(0)), S),
    ("relu_backward", lambda: ut.relu_backward(t(2), t(3)), S),
    ("relu6_backward", lambda: ut.relu6_backward(t(2, 3), t(3, 2)), S),
    ("relu6_backward", lambda: ut.relu6_backward(t(2), [object(), 1]), T),
    ("matmul", lambda: ut.matmul(t(2, 3), t(2, 3)), S),
    ("matmul", lambda: ut.matmul(t(2, 3, 1), t(3, 1)), S),
    ("matmul", lambda: ut.matmul(t(2, 3), "x"), T),
    ("transpose", lambda: ut.transpose(t(2, 3), 0, 7), A),
    ("transpose", lambda: ut.transpose(t(2, 3), 0, 2**40), A),
    ("functional.reshape", lambda: ut.functional.reshape(t(2, 3), (4, 2)), S),
    ("functional.add_", lambda: ut.functional.add_(np.zeros(2), t(2)), T),
    ("functional.add_", lambda: ut.functional.add_(t(2), t(3)), S),
    ("functional.scale_", lambda: ut.functional.scale_([1.0], 2.0), T),
    ("functional.scale_", lambda: ut.functional.scale_(t(1), "2"), T),
    ("functional.bias_add_", lambda: ut.functional.bias_add_(t(2, 3, 4), t(4)), S),
    ("functional.bias_add_", lambda: ut.functional.bias_add_(t(3), t(3)), S),
    ("functional.bias_add_", lambda: ut.functional.bias_add_(3, t(3)), T),
    ("global_avg_pool2d", lambda: ut.global_avg_pool2d(t(2, 3, 4)), S),
    ("global_avg_pool2d_backward", lambda: ut.global_avg_pool2d_backward(t(2, 3), 0, 2), A),
    ("global_avg_pool2d_backward", lambda: ut.global_avg_pool2d_backward(t(2, 3, 1), 2, 2), S),
    ("global_avg_pool2d_backward", lambda: ut.global_avg_pool2d_backward(t(2, 3), 2**20, 2**20), S),
    ("global_avg_pool2d_backward", lambda: ut.global_avg_pool2d_backward(t(2, 3), 2, 2.0), T),
    ("mse_loss", lambda: ut.mse_loss(t(2, 3), t(3, 2)), S),
    ("mse_loss", lambda: ut.mse_loss(t(2), None), T),
    ("mse_loss_backward", lambda: ut.mse_loss_backward(t(4), t(5)), S),
    ("cross_entropy", lambda: ut.cross_entropy(t(2, 3), np.array([0.0, 1.0])), T),
    ("cross_entropy", lambda: ut.cross_entropy(t(2, 3), np.array([0, 3])), A),
    ("cross_entropy", lambda: ut.cross_entropy(t(2, 3), np.array([-1, 0])), A),
    ("cross_entropy", lambda: ut.cross_entropy(t(2, 3), np.array([0, 1, 2])), S),
    ("cross_entropy", lambda: ut.cross_entropy(t(2, 3), np.array([[0, 1]])), S),
    ("cross_entropy", lambda: ut.cross_entropy(t(6), np.array([0])), S),
    ("cross_entropy", lambda: ut.cross_entropy(t(2, 3), "01"), T),
    ("cross_entropy", lambda: ut.cross_entropy(t(2, 3), ut.tensor([0.0, 2.5])), A),  # refused by C
    ("cross_entropy", lambda: ut.cross_entropy(t(2, 3), ut.tensor([0.0, float("nan")])), A),
    ("cross_entropy", lambda: ut.cross_entropy(t(2, 3), ut.tensor([0.0, 3.0])), A),
    ("cross_entropy", lambda: ut.cross_entropy(t(2, 3), ut.tensor([0.0, 1.0, 2.0])), S),
    ("cross_entropy_backward", lambda: ut.cross_entropy_backward(t(2, 3), np.array([5, 0])), A),
    ("cross_entropy_backward", lambda: ut.cross_entropy_backward(t(2, 3), ut.tensor([-1.0, 0.0])), A),
    ("sgd_step", lambda: ut.sgd_step(t(3), t(3), None, lr=-1.0), A),
    ("sgd_step", lambda: ut.sgd_step(t(3), t(3), None, lr=float("nan")), A),
    ("sgd_step", lambda: ut.sgd_step(t(3), t(3), None, lr=float("inf")), A),
    ("sgd_step", lambda: ut.sgd_step(t(3), t(4)), S),
    ("sgd_step", lambda: ut.sgd_step(t(3), t(3), t(2), momentum=0.9), S),
    ("sgd_step", lambda: ut.sgd_step(np.zeros(3), t(3)), T),
    ("sgd_step", lambda: ut.sgd_step(t(3), t(3), np.zeros(3)), T),
    ("sgd_step", lambda: ut.sgd_step(t(3), t(3), momentum=-0.5), A),
    ("adam_step", lambda: ut.adam_step(t(3), t(3), t(3), t(3), 0), A),
    ("adam_step", lambda: ut.adam_step(t(3), t(3), t(3), t(3), 2**31), A),
    ("adam_step", lambda: ut.adam_step(t(3), t(3), t(3), t(3), 1.0), T),
    ("adam_step", lambda: ut.adam_step(t(3), t(3), t(3), t(3), 1, beta1=1.0), A),
    ("adam_step", lambda: ut.adam_step(t(3), t(3), t(3), t(3), 1, beta2=-0.1), A),
    ("adam_step", lambda: ut.adam_step(t(3), t(3), t(3), t(3), 1, eps=-1), A),
    ("adam_step", lambda: ut.adam_step(t(3), t(3), t(2), t(3), 1), S),
    ("adam_step", lambda: ut.adam_step(t(3), t(3), np.zeros(3), t(3), 1), T),
    # layers
    ("Conv2d", lambda: ut.Conv2d(0, 2, 3), A),
    ("Conv2d", lambda: ut.Conv2d(2, 2, (1, 2, 3)), A),
    ("Conv2d", lambda: ut.Conv2d(2, 2, (0, 3)), A),
    ("Conv2d", lambda: ut.Conv2d(2, 2, 3, stride=0), A),
    ("Conv2d", lambda: ut.Conv2d(2, 2, 3, padding=-1), A),
    ("Conv2d", lambda: ut.Conv2d(2**31, 2, 3), A),
    ("Conv2d", lambda: ut.Conv2d(50000, 50000, 3), S),
    ("Conv2d", lambda: ut.Conv2d("2", 2, 3), T),
    ("Conv2d", lambda: ut.Conv2d(2, 2, 3, device="tpu"), A),
    ("Conv2d.forward", lambda: ut.Conv2d(2, 2, 3)(t(2, 5, 5)), S),
    ("Conv2d.forward", lambda: ut.Conv2d(2, 2, 3)(t(1, 3, 5, 5)), S),
    ("Conv2d.forward", lambda: ut.Conv2d(2, 2, 3)(t(1, 2, 2, 5)), S),
    ("Conv2d.forward", lambda: ut.Conv2d(2, 2, 3)(np.array([["a"]])), T),
    ("Conv2d.forward", lambda: ut.Conv2d(2, 2, 3)(), TypeError),
    ("Conv2d.backward", lambda: ut.Conv2d(2, 2, 3).backward(t(1, 2, 1, 1)), A),
    ("Conv2d.backward", lambda: fwd(ut.Conv2d(2, 2, 3), t(1, 2, 3, 3)).backward(t(1, 2, 2, 2)), S),
    ("Conv2d.backward", lambda: fwd(ut.Conv2d(2, 2, 3).eval(), t(1, 2, 3, 3)).backward(t(1, 2, 1, 1)), A),
    ("Conv2d.weight", lambda: setattr(ut.Conv2d(2, 2, 3), "weight", np.zeros((2, 2, 3))), S),
    ("Conv2d.weight", lambda: setattr(ut.Conv2d(2, 2, 3), "weight", "w"), T),
    ("Conv2d.bias", lambda: setattr(ut.Conv2d(2, 2, 3, bias=False), "bias", np.zeros(2)), A),
    ("Conv2d.bias", lambda: setattr(ut.Conv2d(2, 2, 3), "bias", np.zeros(3)), S),
    ("Conv2d.to", lambda: ut.Conv2d(2, 2, 3).to("tpu"), A),
    ("DWConv2d", lambda: ut.DWConv2d(-3, 3), A),
    ("DWConv2d", lambda: ut.DWConv2d(3, (3, "3")), T),
    ("DWConv2d.forward", lambda: ut.DWConv2d(3, 3)(t(1, 2, 5, 5)), S),
    ("DWConv2d.forward", lambda: ut.DWConv2d(3, 3, padding=1)(t(1, 3, 5)), S),
    ("DWConv2d.backward", lambda: ut.DWConv2d(3, 3).backward(t(1, 3, 1, 1)), A),
    ("DWConv2d.backward", lambda: fwd(ut.DWConv2d(1, 3), t(1, 1, 3, 3)).backward(t(1, 1, 3, 3)), S),
    ("Linear", lambda: ut.Linear(3, 0), A),
    ("Linear", lambda: ut.Linear(3, 2, device=["cpu"]), T),
    ("Linear.forward", lambda: ut.Linear(3, 2)(t(2, 4)), S),
    ("Linear.forward", lambda: ut.Linear(3, 2)(t(3)), S),
    ("Linear.backward", lambda: fwd(ut.Linear(3, 2), t(4, 3)).backward(t(4, 3)), S),
    ("Linear.backward", lambda: fwd(ut.Linear(3, 2), t(4, 3)).backward("g"), T),
    ("LayerNorm", lambda: ut.LayerNorm(0), A),
    ("LayerNorm", lambda: ut.LayerNorm(4, eps=-1.0), A),
    ("LayerNorm", lambda: ut.LayerNorm((2, 4)), A),
    ("LayerNorm.forward", lambda: ut.LayerNorm(4)(t(2, 5)), S),
    ("LayerNorm.backward", lambda: ut.LayerNorm(4).backward(t(2, 4)), A),
    ("BatchNorm2d", lambda: ut.BatchNorm2d(2, momentum=2.0), A),
    ("BatchNorm2d", lambda: ut.BatchNorm2d(2, eps=float("nan")), A),
    ("BatchNorm2d.forward", lambda: ut.BatchNorm2d(2)(t(1, 2, 1, 1)), S),
    ("BatchNorm2d.forward", lambda: ut.BatchNorm2d(2)(t(4, 3, 2, 2)), S),
    ("BatchNorm2d.running_mean", lambda: setattr(ut.BatchNorm2d(2), "running_mean", np.zeros(3)), S),
    ("BatchNorm2d.running_var", lambda: setattr(ut.BatchNorm2d(2), "running_var", [[1, 1]]), S),
    ("ReLU.backward", lambda: ut.ReLU().backward(t(2)), A),
    ("ReLU.backward", lambda: fwd(ut.ReLU(), t(2)).backward(t(3)), S),
    ("ReLU6.backward", lambda: fwd(ut.ReLU6(), t(2)).backward([[1, 2]]), S),
    ("ReLU6.forward", lambda: ut.ReLU6()("x"), T),
    ("GlobalAvgPool2d.forward", lambda: ut.GlobalAvgPool2d()(t(2, 2)), S),
    ("GlobalAvgPool2d.backward", lambda: ut.GlobalAvgPool2d().backward(t(2, 2)), A),
    ("GlobalAvgPool2d.backward", lambda: fwd(ut.GlobalAvgPool2d(), t(1, 2, 3, 3)).backward(t(1, 3)), S),
    ("Sequential", lambda: ut.Sequential(ut.ReLU(), 3), T),
    ("Residual", lambda: ut.Residual(3), T),
    ("MixedPrecision", lambda: ut.MixedPrecision(3), T),
    ("MixedPrecision", lambda: ut.MixedPrecision(ut.ReLU(), dtype="float16"), T),
    ("dtype", lambda: ut.dtype("float16", 2, 2), T),
    ("Tensor.to", lambda: t(2).to("bf16", "float32"), T),
    ("Tensor.to", lambda: t(2).to("cpu", "cuda"), T),
    ("Tensor", lambda: ut.Tensor([1.0], dtype="int8"), T),
    ("Residual.forward", lambda: ut.Residual(ut.Linear(2, 3))(t(1, 2)), S),
    ("add", lambda: ut.add(t(2, 3), t(3, 2)), S),
    ("add", lambda: ut.add(t(2), "x"), T),
    ("SyncBatchNorm", lambda: ut.SyncBatchNorm(2, process_group=object()), T),
    ("SyncBatchNorm.forward", lambda: ut.SyncBatchNorm(2)(t(2, 3, 2, 2)), S),
    ("Sequential.forward", lambda: ut.Sequential(ut.Linear(2, 2))(t(1, 3)), S),
    ("Sequential.backward", lambda: ut.Sequential(ut.Linear(2, 2)).backward(t(1, 2)), A),
    ("Module.to", lambda: ut.Sequential(ut.ReLU()).to(1), T),
    ("MSELoss", lambda: ut.MSELoss()(t(2), t(3)), S),
    ("MSELoss.backward", lambda: ut.MSELoss().backward(), A),
    ("CrossEntropyLoss", lambda: ut.CrossEntropyLoss()(t(2, 3), [0.5, 1]), T),
    ("CrossEntropyLoss.backward", lambda: ut.CrossEntropyLoss().backward(), A),
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
    ("Optimizer.step", lambda: _step_with_closed_grad(), E.ClosedError),
]


def _step_with_closed_grad():
    layer = ut.Linear(2, 2)
    opt = ut.SGD(layer.parameters(), lr=0.1)
    layer.weight.grad.close()
    opt.step()


@pytest.mark.parametrize("entry,call,exc", CASES, ids=["%s-%d" % (c[0], i) for i, c in enumerate(CASES)])
def test_wrong_input_raises(entry, call, exc):
    with pytest.raises(exc) as info:
        call()
    if exc is not TypeError:
        assert isinstance(info.value, ut.UtensilError)
        assert str(info.value)  # every error says something


NO_INPUT = {"devices", "cuda_available", "get_num_threads", "live_tensors", "synchronize",
            "backends", "get_float32_matmul_precision"}  # take no arguments


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
