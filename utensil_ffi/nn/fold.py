"""Inference: a convolution and the BatchNorm2d after it, folded into one pass (issue 32).

In eval mode Sequential runs each Conv2d or DWConv2d that is directly followed by a
BatchNorm2d as one C call (``ut_conv2d_bn_forward``, ``ut_dwconv2d_bn_forward``): the
BatchNorm's running statistics, affine parameters and fused activation (or, when it has none,
the activation layer after it: ReLU, ReLU6, SiLU, Hardswish, Hardsigmoid, Sigmoid, GELU)
applied per output channel as the convolution writes its output, instead of one or two more
passes over memory. The fold
(scale = gamma / sqrt(var + eps), shift = beta + (bias - mean) scale) is computed in C from the
layers' values at every call, so no cache can go stale: optimizer steps, load_state_dict,
copy_from and writes through numpy views are all seen by the next forward. The result is the
two layers' own forwards within float32 rounding; training mode (either layer) runs them as
they are, and so do the GPU and bfloat16 (in C).

``set_inference_fold(False)`` turns the fold off (every layer's own forward), e.g. to compare.
"""

from .. import _args
from .._errors import ClosedError
from .._lib import ffi, lib
from .._lifetime import _hold, _let_go
from ..functional import _Args, fail
from ..tensor import Tensor

__all__ = ["set_inference_fold", "get_inference_fold", "fold_steps", "conv_bn_forward"]

_FOLD = [True]

# The layers name their part themselves (this module sits below them: nn.container imports it):
# a convolution class its C entry point in ``_c_bn_forward`` (Conv2d: ut_conv2d_bn_forward,
# DWConv2d: ut_dwconv2d_bn_forward; subclasses such as PointwiseLinear inherit it), and
# BatchNorm2d ``_folds_into_conv = True``.


def set_inference_fold(enabled):
    """Fold (True, the default) or not (False) each eval-mode BatchNorm2d into the convolution
    before it in a Sequential; returns the previous setting. Results agree within float32
    rounding either way."""
    prev = _FOLD[0]
    _FOLD[0] = _args.to_bool(enabled, "enabled")
    return prev


def get_inference_fold():
    """Whether eval-mode Sequentials fold BatchNorm2d into the convolution before it."""
    return _FOLD[0]


def _foldable(conv, bn):
    # both in eval mode: the convolution then keeps no cache and the BatchNorm's (kept in eval
    # mode for a backward through frozen statistics) has no convolution backward to feed
    return (not conv.training and not bn.training and getattr(bn, "_folds_into_conv", False)
            and getattr(conv, "_c_bn_forward", None) is not None)


def fold_steps(layers):
    """The forwards a Sequential runs for ``layers``: each eval-mode (convolution, BatchNorm2d)
    pair as one conv_bn_forward step when the fold is on, with the activation layer after it
    too when the BatchNorm applies none itself; every other layer its own forward."""
    if not _FOLD[0]:
        return [l.forward for l in layers]
    steps, i, n = [], 0, len(layers)
    while i < n:
        l = layers[i]
        if i + 1 < n and _foldable(l, layers[i + 1]):
            bn, act, used = layers[i + 1], lib.UT_ACT_NONE, 2
            nxt = layers[i + 2] if i + 2 < n else None
            code = getattr(nxt, "_fold_act", None)
            if (code is not None and not nxt.training
                    and bn._struct.activation == lib.UT_ACT_NONE):
                act, used = code, 3
            steps.append(lambda x, c=l, b=bn, a=act: conv_bn_forward(c, b, x, a))
            i += used
        else:
            steps.append(l.forward)
            i += 1
    return steps


def conv_bn_forward(conv, bn, x, act=lib.UT_ACT_NONE):
    """bn(conv(x)) in one C call (eval mode: see the module's doc), then ``act`` (a C
    ut_activation, when the BatchNorm applies none); x a Tensor or array-like."""
    fn = conv._c_bn_forward
    ch, bh = conv._h, bn._h
    cs = ch.enter() if ch is not None else None
    if cs is None:
        raise ClosedError("operation on a closed %s" % type(conv).__name__)
    try:
        bs = bh.enter() if bh is not None else None
        if bs is None:
            raise ClosedError("operation on a closed %s" % type(bn).__name__)
        try:
            what = "%s+%s.forward" % (type(conv).__name__, type(bn).__name__)
            if isinstance(x, Tensor):
                xp = _hold(x)  # x stays allocated even if another thread closes it meanwhile
                try:
                    return Tensor._wrap(_call(fn, cs, bs, xp, act, what))
                finally:
                    _let_go(xp)
            with _Args(type(conv).__name__, cs.weight.dev) as a:
                return Tensor._wrap(_call(fn, cs, bs, a.array(x, "x"), act, what))
        finally:
            bh.state.leave()
    finally:
        ch.state.leave()


def _call(fn, cs, bs, xp, act, what):
    p = fn(cs, bs, xp, act)
    if p == ffi.NULL:
        fail(what, cs.weight, xp)
    return p
