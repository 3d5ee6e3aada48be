"""Activations: ReLU and ReLU6, any shape (forward keeps its input for backward: _Stateless)."""

from .. import functional as _F
from .module import _Stateless

__all__ = ["ReLU", "ReLU6"]


class ReLU(_Stateless):
    """max(x, 0), any shape."""

    _op = staticmethod(_F.relu)
    _bwd_op = staticmethod(_F.relu_backward)


class ReLU6(_Stateless):
    """min(max(x, 0), 6), any shape."""

    _op = staticmethod(_F.relu6)
    _bwd_op = staticmethod(_F.relu6_backward)
