"""Regularisation layers (issue 30): Dropout (torch.nn.Dropout) and StochasticDepth
(torchvision.ops.StochasticDepth), with PyTorch's names, arguments and messages.

In training mode forward draws a mask from the library's RNG (``ut.seed`` makes it repeat),
multiplies the input by it and keeps it; backward multiplies grad_out by the same mask. In eval
mode (or with p = 0) both are the identity and hand back their argument itself. A GPU
tensor's mask is drawn on the device (see functional.dropout_mask), so a training step recorded
in a CUDA graph draws a new one at each replay; activations may be bfloat16 (rounded once, after the float32 product). Neither has parameters or state_dict
entries; ONNX export writes them as Identity (inference graphs).
"""

from .. import _args
from .. import functional as _F
from .._lifetime import _PASS
from ..tensor import Tensor
from .module import _Stateless

__all__ = ["Dropout", "StochasticDepth"]


class _MaskLayer(_Stateless):
    """A layer whose forward multiplies its input by a random mask and whose backward
    multiplies grad_out by the same one (kept per forward, as _Stateless keeps inputs)."""

    p = 0.0
    inplace = False

    def _mask_shape(self, shape):
        raise NotImplementedError

    def forward(self, x):
        if not self.training:
            return x
        x = x if isinstance(x, Tensor) else _F._as_tensor(x, type(self).__name__)
        if self.p == 0.0:
            mask, y = None, x
        else:
            y = x if self.inplace else x.clone()
            mask = _F.dropout_mask(self._mask_shape(y.shape), self.p, y.device)
            try:
                _F.mask_scale_(y, mask)
            except BaseException:
                mask.close()
                if y is not x:
                    y.close()
                raise
        self._state.push((getattr(_PASS, "id", None), mask, None))
        return y

    def _backward_from(self, grad_out, mask, version):
        if mask is None:  # p = 0: the identity
            return grad_out
        g = grad_out if isinstance(grad_out, Tensor) else _F._as_tensor(grad_out, "backward")
        dx = g.clone()
        try:
            return _F.mask_scale_(dx, mask)
        except BaseException:
            dx.close()
            raise


class Dropout(_MaskLayer):
    """torch.nn.Dropout: in training each element is zeroed with probability p and the others
    scaled by 1 / (1 - p); the identity in eval mode. inplace: forward writes into its input
    (as PyTorch's; the input must then not be needed elsewhere)."""

    def __init__(self, p=0.5, inplace=False):
        super().__init__()
        self.p = _F._drop_p(p, "dropout")
        self.inplace = _args.to_bool(inplace, "inplace")

    def _mask_shape(self, shape):
        return shape

    def __repr__(self):
        return "Dropout(p=%g, inplace=%s)" % (self.p, self.inplace)


class StochasticDepth(_MaskLayer):
    """torchvision.ops.StochasticDepth: in training, mode "row" zeroes each sample (dim 0)
    with probability p and scales the survivors by 1 / (1 - p); mode "batch" does it to the
    whole batch with one draw. The identity in eval mode."""

    def __init__(self, p, mode):
        super().__init__()
        self.p = _F._drop_p(p, "drop")
        _F._stochastic_depth_shape((1,), mode)  # checks mode
        self.mode = mode

    def _mask_shape(self, shape):
        return _F._stochastic_depth_shape(shape, self.mode)

    def __repr__(self):
        return "StochasticDepth(p=%g, mode=%s)" % (self.p, self.mode)
