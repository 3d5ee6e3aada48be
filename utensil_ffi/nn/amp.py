"""Mixed-precision training: a network computes in bfloat16 while its parameters, gradients and
optimizer state stay float32.

    net = ut.MixedPrecision(ut.models.mobilenet_v1(), dtype=ut.bfloat16)
    opt = ut.SGD(net.parameters(), lr=0.1, momentum=0.9)
    logits = net(x)                    # x float32 in, logits float32 out
    loss = crit(logits, y); net.backward(crit.backward()); opt.step()

What runs in bfloat16: every activation between the input and the output, and the gradients of
those activations. Convolutions and linear layers multiply a bfloat16 copy of their float32
weight, made at each call (on the GPU on tensor cores, summing in float32); depthwise and
batchnorm read the float32 parameters directly. What stays float32: the parameters (the
"master weights" the optimizer updates, so small updates are not lost to bf16's 8-bit
significand), their gradients (accumulated in float32 by the layers), batchnorm's statistics,
the loss. So an optimizer needs no change, and a checkpoint holds float32 values as always.

This wrapper is the switch (PyTorch's ``torch.autocast`` region has the same effect on the
same layers): its forward converts a float32 input to bfloat16 and the network's output back
to float32, and its backward does the same to the gradients, so code around it sees float32
only. Why not loss scaling: bfloat16 has float32's exponent range, so gradients do not
underflow as float16's do.

On the GPU the bfloat16 kernels move half the bytes of float32. On the CPU bfloat16 is emulated
on float32 values rounded after each op (the same kind of numbers, no faster): use it there to
check a model, not for speed.
"""

from .. import _args
from .. import dtypes as _dtypes
from ..tensor import Tensor
from .module import _Wrapper, _backward_params_only, _takes_input_grad

__all__ = ["MixedPrecision"]


def _convert(t, dtype, module):
    """``t`` as dtype; an array-like becomes a float32 tensor first (the caller's value), on the
    device of ``module``'s parameters, as a layer puts an array-like on its own device."""
    if not isinstance(t, Tensor):
        p = next(iter(module.parameters()), None)
        t = Tensor(t, "cpu" if p is None else p.device)
    return t.to(dtype=dtype)


def _close_converted(t, caller):
    """Close ``t`` when _convert made it (it is not the caller's)."""
    if t is not caller:
        t.close()


class MixedPrecision(_Wrapper, child="module", args=("dtype",)):
    """``module`` run in ``dtype`` (utensil.bfloat16) with float32 at its edges; see the module
    docstring. Parameters, state_dict and train/eval are the wrapped module's (named
    ``module.<...>``, as a PyTorch wrapper with ``self.module`` names them)."""

    def __init__(self, module, dtype=_dtypes.bfloat16):
        super().__init__(module)
        self.dtype = _dtypes.parse_dtype(dtype)

    def _forward(self, x):
        xc = _convert(x, self.dtype, self.module)
        try:
            y = self.module(xc)
        except BaseException:
            _close_converted(xc, x)
            raise
        if y is not xc:  # a module that returns its input (an identity) returns xc itself
            _close_converted(xc, x)  # the layers that need it hold their own reference
        return self._out(y, x)

    @_takes_input_grad
    def backward(self, grad_out, *, input_grad=True):
        """The wrapped module's backward on ``grad_out`` as dtype; returns dx as float32, or with
        ``input_grad=False`` None (no dx to compute or widen)."""
        input_grad = _args.to_bool(input_grad, "input_grad")
        g = _convert(grad_out, self.dtype, self.module)
        if not input_grad:
            try:
                return _backward_params_only(self.module, g)
            finally:
                _close_converted(g, grad_out)
        try:
            dx = self.module.backward(g)
        except BaseException:
            _close_converted(g, grad_out)
            raise
        if dx is not g:  # an identity's backward returns g itself
            _close_converted(g, grad_out)
        return self._out(dx, grad_out)

    @staticmethod
    def _out(t, caller):
        """``t`` as float32, closing ``t`` when it was converted (and is not the caller's)."""
        f = t.float()
        if f is not t and t is not caller:
            t.close()
        return f
