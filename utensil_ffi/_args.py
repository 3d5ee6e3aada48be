"""Argument checks shared by every module: devices, numbers, arrays.

Everything a Python caller passes is checked here before it reaches C, so a wrong argument
becomes a documented exception rather than an OverflowError from cffi or a crash.
"""

import math
import operator

import numpy as np

from ._errors import ArgumentError, ArgumentTypeError, DeviceError, ShapeError
from ._lib import lib

INT_MAX = 2**31 - 1
MAX_DIMS = lib.UT_MAX_DIMS

_DEV_NAMES = {lib.UT_CPU: "cpu", lib.UT_CUDA: "cuda"}


def device_name(dev):
    return _DEV_NAMES.get(int(dev), "unknown(%d)" % int(dev))


def parse_device(device):
    """"cpu", "cuda" or "cuda:0" (also a Tensor's .device) -> the C ut_dev value.

    Unlike the C library, which runs UT_CUDA tensors on the CPU when no GPU is present,
    asking for "cuda" without one raises DeviceError.
    """
    if not isinstance(device, str):
        raise ArgumentTypeError("device must be a string like 'cpu' or 'cuda', got %r" % (device,))
    name = device.strip().lower()
    if name == "cpu":
        return lib.UT_CPU
    if name in ("cuda", "cuda:0", "gpu"):
        if not lib.ut_cuda_available():
            raise DeviceError(
                "device %r requested, but no CUDA GPU is available (the library was built "
                "without CUDA, or no GPU is present); utensil_ffi.devices() lists what is" % device
            )
        return lib.UT_CUDA
    if name.startswith("cuda:"):
        raise DeviceError("device %r: only one GPU (cuda:0) is supported" % device)
    raise ArgumentError("unknown device %r; expected 'cpu' or 'cuda'" % device)


def to_int(value, name, lo=-INT_MAX - 1, hi=INT_MAX):
    """An integer argument, range-checked so it fits the C int it is passed as."""
    if isinstance(value, (bool, np.bool_)):
        raise ArgumentTypeError("%s must be an integer, got a bool" % name)
    try:
        v = operator.index(value)
    except TypeError:
        raise ArgumentTypeError(
            "%s must be an integer, got %s" % (name, type(value).__name__)
        ) from None
    if not lo <= v <= hi:
        raise ArgumentError("%s must be in [%d, %d], got %d" % (name, lo, hi, v))
    return v


def to_bool(value, name):
    """A flag: a bool, or an integer 0/1 (numpy scalars too); anything else is refused."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)) and value in (0, 1):
        return bool(value)
    raise ArgumentTypeError("%s must be True or False, got %r" % (name, value))


def to_str(value, name, choices=None):
    """A text argument (str, or os.PathLike for paths); with choices, one of them."""
    if hasattr(value, "__fspath__"):
        value = value.__fspath__()
    if not isinstance(value, str):
        raise ArgumentTypeError("%s must be a string, got %s" % (name, type(value).__name__))
    if "\0" in value:
        raise ArgumentError("%s must not contain NUL characters" % name)
    if choices is not None and value not in choices:
        raise ArgumentError("%s must be one of %s, got %r"
                            % (name, ", ".join(repr(c) for c in choices), value))
    return value


def to_float(value, name, lo=None, hi=None, finite=True):
    """A real-number argument passed to C as float; NaN (and inf when finite) is refused."""
    if isinstance(value, (complex, np.complexfloating)):
        raise ArgumentTypeError("%s must be a real number, got %r" % (name, value))
    if isinstance(value, (str, bytes)) or value is None:
        raise ArgumentTypeError("%s must be a number, got %r" % (name, value))
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ArgumentTypeError(
            "%s must be a number, got %s" % (name, type(value).__name__)
        ) from None
    if v != v or (finite and v in (float("inf"), float("-inf"))):
        raise ArgumentError("%s must be a finite number, got %r" % (name, v))
    if lo is not None and v < lo:
        raise ArgumentError("%s must be >= %g, got %g" % (name, lo, v))
    if hi is not None and v > hi:
        raise ArgumentError("%s must be <= %g, got %g" % (name, hi, v))
    return v


FLOAT32_MAX = float(np.finfo(np.float32).max)


def to_float32(value, name, lo=None, below=None, finite=True):
    """A real-number argument the C library uses as a float32, checked as that float32.

    A value that is fine as a Python float can round to something else in float32: 1e39 to
    inf, 0.99999999 to 1.0. ``below`` is an exclusive upper bound (betas < 1); the value
    returned is the Python float given, unchanged."""
    v = to_float(value, name, lo=lo, finite=finite)
    with np.errstate(over="ignore"):
        v32 = float(np.float32(v))
    if finite and v32 in (float("inf"), float("-inf")):
        raise ArgumentError("%s = %r overflows float32 (the precision the library computes in); "
                            "its magnitude must be at most %.6g" % (name, v, FLOAT32_MAX))
    if below is not None and not v32 < below:
        largest = float(np.nextafter(np.float32(below), np.float32(-np.inf)))
        raise ArgumentError("%s must be < %g, got %r%s" % (
            name, below, v, "" if v >= below else
            ", which rounds to %r in float32 (the precision the library computes in); the "
            "largest usable value is %r" % (v32, largest)))
    return v


def to_lr(value, name="lr"):
    """A learning rate: the one rule for it, wherever it comes from (an optimizer, a param
    group, utensil-train's --lr or a checkpoint's settings): a finite float32 >= 0, as PyTorch's
    optimizers take it (0 freezes the weights). The C optimizers check the same (ut__check_lr)
    for callers that do not come through here."""
    return to_float32(value, name, lo=0.0)


def to_weight_decay(value, name="weight_decay"):
    """An optimizer's weight decay: a finite float32 >= 0; a negative one gets PyTorch's message
    ("Invalid weight_decay value: -1")."""
    v = to_float32(value, name)
    if v < 0:
        raise ArgumentError("Invalid weight_decay value: %r" % (value,))
    return v


def to_shape(shape, name="shape"):
    """A shape (an int or a sequence of positive ints) -> tuple, checked against C limits."""
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, (bool, np.bool_)):
        shape = (shape,)
    try:
        dims = tuple(shape)
    except TypeError:
        raise ArgumentTypeError("%s must be a sequence of ints, got %r" % (name, shape)) from None
    if not 1 <= len(dims) <= MAX_DIMS:
        raise ShapeError("%s must have 1 to %d dimensions, got %d" % (name, MAX_DIMS, len(dims)))
    dims = tuple(to_int(d, "%s[%d]" % (name, i), -math.inf, math.inf) for i, d in enumerate(dims))
    for i, d in enumerate(dims):
        if not 1 <= d <= INT_MAX:
            raise ShapeError("%s[%d] must be in [1, %d], got %d" % (name, i, INT_MAX, d))
    n = 1
    for d in dims:
        n *= d
    if n > INT_MAX:
        raise ShapeError("%s %r has %d elements; at most %d are supported" % (name, dims, n, INT_MAX))
    return dims


def to_float_array(data, name="data"):
    """Array-like numbers -> a C-contiguous float32 ndarray with a shape the C library accepts."""
    try:
        arr = np.asarray(data)
    except Exception as e:  # ragged nested lists and the like
        raise ArgumentError("%s cannot be read as an array: %s" % (name, e)) from None
    if arr.dtype.kind not in "biuf":
        raise ArgumentTypeError(
            "%s must hold real numbers (bool, int or float), got dtype %s" % (name, arr.dtype)
        )
    if arr.ndim == 0:
        arr = arr.reshape(1)
    to_shape(arr.shape, "%s.shape" % name)
    return np.ascontiguousarray(arr, dtype=np.float32)
