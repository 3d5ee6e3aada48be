"""Modules made of other modules: Residual (a skip connection around a block).

    block = ut.Sequential(ut.Conv2d(8, 8, 3, padding=1), ut.BatchNorm2d(8))
    res = ut.Residual(block)            # y = x + block(x)
    y = res(x)
    dx = res.backward(dy)               # dy + block.backward(dy)
    res.backward(dy, input_grad=False)  # block's parameter gradients only; returns None

The block is the public attribute ``block``, so its parameters are named ``block.<...>`` in
``named_parameters()`` and ``state_dict()`` (``block.0.weight``...), as a PyTorch module with a
``self.block`` would name them.
"""

from .. import _args
from .._errors import ShapeError
from ..functional import add
from ..tensor import Tensor
from . import fold
from .module import _Wrapper, _backward_params_only, _takes_input_grad

__all__ = ["Residual"]


class Residual(_Wrapper, child="block"):
    """``x + block(x)``: block's output must have the shape of its input (ShapeError otherwise).

    backward(g) is ``g + block.backward(g)``: the sum passes the gradient to both branches.
    backward(g, input_grad=False) runs the block's backward for its parameter gradients only
    (passing input_grad=False on when the block takes it) and returns None.
    The residual keeps nothing of its own for backward (the block keeps what it needs), so it
    behaves in train and eval mode, across threads and when used twice as its block does.
    """

    def __init__(self, block):  # the argument's public name: Residual(block=...)
        super().__init__(block)

    def _forward(self, x):
        if not self.training:  # eval: a separable chain with its residual in one call
            plan = fold.kept_separable_plan(self.block)
            if plan is not None:  # (fold's function looked up here: profilers wrap it)
                return fold.separable_forward(plan, x, residual=True)
        y = self.block(x)
        try:
            xs = x.shape if isinstance(x, Tensor) else _args.to_float_array(x).shape
            if tuple(y.shape) != tuple(xs):
                raise ShapeError("Residual: the block maps %s to %s; x + block(x) needs the "
                                 "shape unchanged" % (list(xs), list(y.shape)))
            return add(x, y)
        finally:
            if y is not x:  # the block's output is ours; the caller's input is not
                y.close()

    @_takes_input_grad
    def backward(self, grad_out, *, input_grad=True):
        if not _args.to_bool(input_grad, "input_grad"):
            return _backward_params_only(self.block, grad_out)
        g = self.block.backward(grad_out)
        try:
            return add(grad_out, g)
        finally:
            if g is not grad_out:
                g.close()
