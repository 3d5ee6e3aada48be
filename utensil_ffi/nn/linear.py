"""Linear: y = x W^T + b."""

from .. import _args
from .._lib import ffi, lib
from ._clayer import _CLayer

__all__ = ["Linear"]


class Linear(_CLayer):
    """x: [N, in_features] -> [N, out_features], y = x W^T + b.

    weight: [out_features, in_features], bias: [out_features] (or None).
    """

    _c_struct = ffi.typeof("ut_linear *")
    _c_cache = ffi.typeof("ut_linear_cache *")
    _c_forward = lib.ut_linear_forward
    _c_backward = lib.ut_linear_backward
    _c_cache_free = lib.ut_linear_cache_free
    _c_free = lib.ut_linear_free

    def __init__(self, in_features, out_features, bias=True, device="cpu"):
        self.in_features = _args.to_int(in_features, "in_features", 1)
        self.out_features = _args.to_int(out_features, "out_features", 1)
        _args.to_shape((self.out_features, self.in_features), "weight shape")
        super().__init__(device, lib.ut_linear_alloc, self.in_features, self.out_features, _args.to_bool(bias, "bias"))

    def _describe(self):
        return "%d, %d, bias=%s" % (self.in_features, self.out_features, self._bias is not None)
