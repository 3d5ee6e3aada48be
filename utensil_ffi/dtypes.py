"""Element types of utensil tensors, with PyTorch's names: ``utensil.float32`` (the default) and
``utensil.bfloat16`` (for the activations of mixed-precision training, see ``utensil.amp``).

A bfloat16 tensor keeps 2 bytes per value on the GPU. Its host copy is float32 (numpy has no
bfloat16), so ``.numpy()`` of any tensor is a float32 view; a bfloat16 tensor's values are
exactly representable in bfloat16, and values written to it are rounded to nearest even.
``utensil.float32 == numpy.float32`` holds, so code written before bfloat16 keeps working.
"""

import numpy as np

from ._errors import ArgumentTypeError
from ._lib import lib

__all__ = ["dtype", "float32", "bfloat16", "parse_dtype", "is_dtype_like", "round_bf16"]


class dtype:
    """An element type (like ``torch.dtype``): ``utensil.float32`` or ``utensil.bfloat16``."""

    __slots__ = ("name", "code", "itemsize")

    def __init__(self, *args, **kwargs):
        raise ArgumentTypeError("utensil.dtype cannot be made: use utensil.float32 or "
                                "utensil.bfloat16 (or parse_dtype('bf16'))")

    def __repr__(self):
        return "utensil." + self.name

    def __eq__(self, other):
        if isinstance(other, dtype):
            return self is other
        if self.code == lib.UT_F32 and not isinstance(other, str):
            try:
                return np.dtype(other) == np.float32
            except TypeError:
                return False
        return False

    def __hash__(self):
        return hash(self.name)

    def __reduce__(self):
        return (parse_dtype, (self.name,))

    @property
    def is_floating_point(self):
        return True


def _make(name, code, itemsize):
    d = object.__new__(dtype)
    d.name, d.code, d.itemsize = name, code, itemsize
    return d


float32 = _make("float32", lib.UT_F32, 4)
bfloat16 = _make("bfloat16", lib.UT_BF16, 2)
_BY_CODE = {float32.code: float32, bfloat16.code: bfloat16}
_NAMES = {"float32": float32, "float": float32, "fp32": float32, "f32": float32,
          "bfloat16": bfloat16, "bf16": bfloat16}


def from_code(code):
    return _BY_CODE[int(code)]


def is_dtype_like(x):
    """Whether ``x`` names an element type (and so is not a device): a utensil dtype, a
    name such as "bfloat16"/"bf16"/"float32", numpy's float32, or torch's float32/bfloat16."""
    if isinstance(x, dtype):
        return True
    if isinstance(x, str):
        return x.lower() in _NAMES
    return _foreign_name(x) is not None


def _foreign_name(x):
    """"float32"/"bfloat16" for numpy, ml_dtypes and torch dtypes, else None."""
    s = str(x)
    if s.startswith("torch."):
        s = s[6:]
    elif isinstance(x, type) and issubclass(x, np.generic):
        s = np.dtype(x).name
    elif not isinstance(x, np.dtype):
        return None
    return s if s in ("float32", "bfloat16") else None


def parse_dtype(x, name="dtype"):
    """The utensil dtype that ``x`` names; ArgumentTypeError for anything else."""
    if isinstance(x, dtype):
        return x
    key = x.lower() if isinstance(x, str) else _foreign_name(x)
    if key in _NAMES:
        return _NAMES[key]
    raise ArgumentTypeError("%s must be utensil.float32 or utensil.bfloat16 (or a name such as "
                            "'bf16'), got %r" % (name, x))


def round_bf16(a):
    """float32 array ``a`` rounded to the nearest even bfloat16, as float32 (the library's own
    rounding: NaN stays NaN, overflow goes to infinity)."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    u = a.view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    nan = np.isnan(a)
    out = (r & 0xFFFFFFFF).astype(np.uint32).view(np.float32)
    if nan.any():
        out = out.copy()
        out[nan] = np.nan
    return out.reshape(a.shape)
