"""Pooling: GlobalAvgPool2d, [N, C, H, W] -> [N, C]."""

from .. import _args
from .. import functional as _F
from .._errors import ShapeError
from ..tensor import Tensor
from .module import _Stateless

__all__ = ["GlobalAvgPool2d"]


class GlobalAvgPool2d(_Stateless):
    """x: [N, C, H, W] -> [N, C], the mean over H and W."""

    _op = staticmethod(_F.global_avg_pool2d)

    def _keep(self, x, y):
        # only the input's shape: backward does not read its values. The op succeeded, so x is
        # 4-D (a Tensor closed by another thread since raises ClosedError here)
        n, c, h, w = x.shape if isinstance(x, Tensor) else _args.to_float_array(x).shape
        return ((n, c), h, w), None

    def _backward_from(self, grad_out, kept, _):
        out_shape, h, w = kept
        g_shape = (grad_out.shape if isinstance(grad_out, Tensor)
                   else _args.to_float_array(grad_out).shape)
        if tuple(g_shape) != out_shape:
            raise ShapeError(
                "GlobalAvgPool2d.backward: grad_out has shape %s, the forward output had %s"
                % (tuple(g_shape), out_shape)
            )
        return _F.global_avg_pool2d_backward(grad_out, h, w)
