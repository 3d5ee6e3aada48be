"""Activations, any shape (forward keeps its input for backward: _Stateless): ReLU, ReLU6, and
issue 30's SiLU, Hardswish, Hardsigmoid, Sigmoid, GELU, with torch.nn's names, arguments and
reprs.

``inplace=`` is accepted where torch.nn takes it (torchvision builds its blocks with
``inplace=True``) and kept as an attribute, but the result is always a new tensor: backward
differentiates at the forward's input, which an in-place forward would overwrite; the saving
is memory only, and a caller that uses the returned value sees the same numbers.
"""

from .. import _args
from .. import functional as _F
from .._lib import lib
from .module import _Stateless

__all__ = ["ReLU", "ReLU6", "SiLU", "Hardswish", "Hardsigmoid", "Sigmoid", "GELU"]


class _Inplace(_Stateless):
    """An activation that takes torch.nn's ``inplace=False`` (see the module's doc)."""

    def __init__(self, inplace=False):
        super().__init__()
        self.inplace = _args.to_bool(inplace, "%s: inplace" % type(self).__name__)

    _repr_inplace = True  # torch.nn's Hardswish and Hardsigmoid leave it out of their repr
    inplace = False  # what a ReLU / ReLU6 pickled before the attribute existed loads with

    def __repr__(self):
        shown = self.inplace and self._repr_inplace
        return "%s(%s)" % (type(self).__name__, "inplace=True" if shown else "")


class ReLU(_Inplace):
    """max(x, 0), any shape."""

    _op = staticmethod(_F.relu)
    _bwd_op = staticmethod(_F.relu_backward)
    _fold_act = lib.UT_ACT_RELU  # the C kind a convolution + BatchNorm2d step may apply (fold.py)


class ReLU6(_Inplace):
    """min(max(x, 0), 6), any shape."""

    _op = staticmethod(_F.relu6)
    _bwd_op = staticmethod(_F.relu6_backward)
    _fold_act = lib.UT_ACT_RELU6  # the C kind a convolution + BatchNorm2d step may apply (fold.py)


class SiLU(_Inplace):
    """x * sigmoid(x) (swish), any shape: torch.nn.SiLU."""

    _op = staticmethod(_F.silu)
    _bwd_op = staticmethod(_F.silu_backward)
    _fold_act = lib.UT_ACT_SILU  # the C kind a convolution + BatchNorm2d step may apply (fold.py)


class Hardswish(_Inplace):
    """x * min(max(x + 3, 0), 6) / 6, any shape: torch.nn.Hardswish (its gradient at the kinks:
    0 at x = -3, 1 at x = 3)."""

    _repr_inplace = False
    _op = staticmethod(_F.hardswish)
    _bwd_op = staticmethod(_F.hardswish_backward)
    _fold_act = lib.UT_ACT_HARDSWISH  # the C kind a convolution + BatchNorm2d step may apply (fold.py)


class Hardsigmoid(_Inplace):
    """min(max(x + 3, 0), 6) / 6, any shape: torch.nn.Hardsigmoid (gradient 0 at x = -3, 3)."""

    _repr_inplace = False
    _op = staticmethod(_F.hardsigmoid)
    _bwd_op = staticmethod(_F.hardsigmoid_backward)
    _fold_act = lib.UT_ACT_HARDSIGMOID  # the C kind a convolution + BatchNorm2d step may apply (fold.py)


class Sigmoid(_Stateless):
    """1 / (1 + exp(-x)), any shape: torch.nn.Sigmoid."""

    _op = staticmethod(_F.sigmoid)
    _bwd_op = staticmethod(_F.sigmoid_backward)
    _fold_act = lib.UT_ACT_SIGMOID  # the C kind a convolution + BatchNorm2d step may apply (fold.py)


class GELU(_Stateless):
    """x * Phi(x), any shape: torch.nn.GELU. ``approximate="none"`` is the erf form, ``"tanh"``
    PyTorch's tanh approximation."""

    def __init__(self, approximate="none"):
        super().__init__()
        self.approximate = _args.to_str(approximate, "GELU: approximate", ("none", "tanh"))

    def _op(self, x):
        return _F.gelu(x, self.approximate)

    def _bwd_op(self, grad_out, x):
        return _F.gelu_backward(grad_out, x, self.approximate)

    @property
    def _fold_act(self):
        return lib.UT_ACT_GELU_TANH if self.approximate == "tanh" else lib.UT_ACT_GELU

    def __repr__(self):
        return "GELU(approximate=%r)" % (self.approximate,)
