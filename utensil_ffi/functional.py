"""Functional forms of the C ops: each takes Tensors and returns a new Tensor.

Where a Tensor is expected an array-like is accepted too: it is copied to a temporary tensor on
the device of the op's first Tensor argument (the CPU if there is none) and freed after the call.
All tensor arguments of one op must be on one device (DeviceError otherwise).
"""

import numpy as np

from . import _args
from ._errors import ArgumentError, ArgumentTypeError, DeviceError, ShapeError
from ._errors import check_ptr, check_status
from ._lib import ffi, lib
from .tensor import Tensor

__all__ = [
    "relu",
    "relu6",
    "relu_backward",
    "relu6_backward",
    "matmul",
    "transpose",
    "reshape",
    "add_",
    "scale_",
    "bias_add_",
    "global_avg_pool2d",
    "global_avg_pool2d_backward",
    "mse_loss",
    "mse_loss_backward",
    "cross_entropy",
    "cross_entropy_backward",
    "sgd_step",
    "adam_step",
]


class _Args:
    """Turns op arguments into Tensors on one device; frees the temporaries it made on exit."""

    def __init__(self, op):
        self.op = op
        self.dev = None
        self.temps = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for t in self.temps:
            t.close()

    def tensor(self, x, name):
        if isinstance(x, Tensor):
            p = x.ptr  # ClosedError if closed
            if self.dev is None:
                self.dev = p.dev
            elif p.dev != self.dev:
                raise DeviceError(
                    "%s: %s is on %s but the other tensors are on %s"
                    % (self.op, name, _args.device_name(p.dev), _args.device_name(self.dev))
                )
            return x
        if x is None:
            raise ArgumentTypeError("%s: %s must be a Tensor or an array, got None" % (self.op, name))
        arr = _args.to_float_array(x, "%s: %s" % (self.op, name))
        if self.dev is None:
            self.dev = lib.UT_CPU
        t = Tensor(arr, _args.device_name(self.dev))
        self.temps.append(t)
        return t

    def labels(self, labels, n, k):
        """Class indices for cross_entropy -> a float tensor [n] on the op's device."""
        if isinstance(labels, Tensor):
            t = self.tensor(labels, "labels")
            if t.shape != (n,):
                raise ShapeError("%s: labels has shape %s, expected (%d,)" % (self.op, t.shape, n))
            return t
        try:
            arr = np.asarray(labels)
        except Exception as e:
            raise ArgumentError("%s: labels cannot be read as an array: %s" % (self.op, e)) from None
        if arr.dtype.kind not in "iu":
            raise ArgumentTypeError(
                "%s: labels must be integer class indices, got dtype %s" % (self.op, arr.dtype)
            )
        if arr.shape != (n,):
            raise ShapeError("%s: labels has shape %s, expected (%d,)" % (self.op, arr.shape, n))
        if n and (arr.min() < 0 or arr.max() >= k):
            raise ArgumentError(
                "%s: labels must be in [0, %d), got values in [%d, %d]"
                % (self.op, k, arr.min(), arr.max())
            )
        f = arr.astype(np.float32)
        # the C API carries class indices as float32: above 2^24 not every integer is one, and a
        # rounded label would silently name a neighbouring class
        bad = np.flatnonzero(f.astype(np.int64) != arr)
        if bad.size:
            raise ArgumentError(
                "%s: labels[%d] = %d is not exactly representable as float32 (class indices above "
                "2^24 must be even, above 2^25 multiples of 4, ...)" % (self.op, bad[0], arr[bad[0]])
            )
        return self.tensor(f, "labels")


def _same_shape(op, a, b, an, bn):
    if a.shape != b.shape:
        raise ShapeError("%s: %s has shape %s but %s has shape %s" % (op, an, a.shape, bn, b.shape))


def _new(p, op):
    return _wrap(check_ptr(p, op))


_wrap = Tensor._wrap
_NULL = ffi.NULL

# Fast paths: when every tensor argument is an open Tensor, the C op is called directly (the C
# library checks shapes and devices itself). Only if it fails does the op run again through the
# checked path below, which raises the Python message (or, failing again, the C one).


# -- elementwise ----------------------------------------------------------------------------------
def _unary(name, c_op, x):
    if isinstance(x, Tensor) and x._ptr is not None:
        r = c_op(x._ptr)
        if r != _NULL:
            return _wrap(r)
    with _Args(name) as a:
        return _new(c_op(a.tensor(x, "x").ptr), name)


def _masked_backward(name, c_op, grad_out, x):
    if isinstance(grad_out, Tensor) and isinstance(x, Tensor):
        gp, xp = grad_out._ptr, x._ptr
        if gp is not None and xp is not None:
            r = c_op(gp, xp)
            if r != _NULL:
                return _wrap(r)
    with _Args(name) as a:
        g, x = a.tensor(grad_out, "grad_out"), a.tensor(x, "x")
        _same_shape(name, g, x, "grad_out", "x")
        return _new(c_op(g.ptr, x.ptr), name)


def relu(x):
    """max(x, 0), any shape."""
    return _unary("relu", lib.ut_relu, x)


def relu6(x):
    """min(max(x, 0), 6), any shape."""
    return _unary("relu6", lib.ut_relu6, x)


def relu_backward(grad_out, x):
    """grad_out where 0 < x, else 0 (x: the forward input)."""
    return _masked_backward("relu_backward", lib.ut_relu_backward, grad_out, x)


def relu6_backward(grad_out, x):
    """grad_out where 0 < x < 6, else 0 (x: the forward input)."""
    return _masked_backward("relu6_backward", lib.ut_relu6_backward, grad_out, x)


def add_(dst, src):
    """dst += src in place (same number of elements); returns dst."""
    if not isinstance(dst, Tensor):
        raise ArgumentTypeError("add_: dst must be a Tensor, got %s" % type(dst).__name__)
    with _Args("add_") as a:
        d, s = a.tensor(dst, "dst"), a.tensor(src, "src")
        if d.size != s.size:
            raise ShapeError("add_: dst has %d elements, src %d" % (d.size, s.size))
        check_status(lib.ut_add_into(d.ptr, s.ptr), "add_")
        return dst


def scale_(t, alpha):
    """t *= alpha in place; returns t."""
    if not isinstance(t, Tensor):
        raise ArgumentTypeError("scale_: t must be a Tensor, got %s" % type(t).__name__)
    return t.mul_(alpha)


def bias_add_(x, bias):
    """x[n, c, ...] += bias[c] in place (x: [N, C, ...], bias: [C]); returns x."""
    if not isinstance(x, Tensor):
        raise ArgumentTypeError("bias_add_: x must be a Tensor, got %s" % type(x).__name__)
    with _Args("bias_add_") as a:
        xt, b = a.tensor(x, "x"), a.tensor(bias, "bias")
        if xt.ndim < 2 or b.shape != (xt.shape[1],):
            raise ShapeError("bias_add_: x %s needs bias of shape (C,), got %s" % (xt.shape, b.shape))
        check_status(lib.ut_bias_add(xt.ptr, b.ptr), "bias_add_")
        return x


# -- dense ----------------------------------------------------------------------------------------
def matmul(a, b):
    """a: [M, K] @ b: [K, N] -> [M, N]."""
    if isinstance(a, Tensor) and isinstance(b, Tensor):
        ap, bp = a._ptr, b._ptr
        if ap is not None and bp is not None:
            r = lib.ut_matmul(ap, bp)
            if r != _NULL:
                return _wrap(r)
    with _Args("matmul") as args:
        at, bt = args.tensor(a, "a"), args.tensor(b, "b")
        if at.ndim != 2 or bt.ndim != 2 or at.shape[1] != bt.shape[0]:
            raise ShapeError("matmul: cannot multiply %s by %s" % (at.shape, bt.shape))
        return _new(lib.ut_matmul(at.ptr, bt.ptr), "matmul")


def transpose(x, d0, d1):
    """A copy of x with dimensions d0 and d1 swapped."""
    with _Args("transpose") as a:
        return a.tensor(x, "x").transpose(d0, d1)


def reshape(x, shape):
    """A copy of x with a new shape of the same element count."""
    with _Args("reshape") as a:
        return a.tensor(x, "x").reshape(shape)


# -- pooling --------------------------------------------------------------------------------------
def global_avg_pool2d(x):
    """x: [N, C, H, W] -> [N, C], the mean over H and W."""
    if isinstance(x, Tensor) and x._ptr is not None:
        r = lib.ut_global_avgpool2d_forward(x._ptr)
        if r != _NULL:
            return _wrap(r)
    with _Args("global_avg_pool2d") as a:
        xt = a.tensor(x, "x")
        if xt.ndim != 4:
            raise ShapeError("global_avg_pool2d: x must be [N, C, H, W], got %s" % (xt.shape,))
        return _new(lib.ut_global_avgpool2d_forward(xt.ptr), "global_avg_pool2d")


def global_avg_pool2d_backward(grad_out, h, w):
    """grad_out: [N, C] -> dx: [N, C, h, w]."""
    h = _args.to_int(h, "h", 1)
    w = _args.to_int(w, "w", 1)
    with _Args("global_avg_pool2d_backward") as a:
        g = a.tensor(grad_out, "grad_out")
        if g.ndim != 2:
            raise ShapeError("global_avg_pool2d_backward: grad_out must be [N, C], got %s" % (g.shape,))
        _args.to_shape((g.shape[0], g.shape[1], h, w), "dx shape")
        return _new(lib.ut_global_avgpool2d_backward(g.ptr, h, w), "global_avg_pool2d_backward")


# -- losses ---------------------------------------------------------------------------------------
def mse_loss(pred, target):
    """mean((pred - target)^2) as a one-element tensor on pred's device."""
    with _Args("mse_loss") as a:
        p, t = a.tensor(pred, "pred"), a.tensor(target, "target")
        _same_shape("mse_loss", p, t, "pred", "target")
        return _new(lib.ut_mse_loss(p.ptr, t.ptr), "mse_loss")


def mse_loss_backward(pred, target):
    """d mse_loss / d pred = 2 (pred - target) / pred.size."""
    with _Args("mse_loss_backward") as a:
        p, t = a.tensor(pred, "pred"), a.tensor(target, "target")
        _same_shape("mse_loss_backward", p, t, "pred", "target")
        return _new(lib.ut_mse_loss_backward(p.ptr, t.ptr), "mse_loss_backward")


def _ce_args(a, logits, labels):
    lt = a.tensor(logits, "logits")
    if lt.ndim != 2:
        raise ShapeError("%s: logits must be [N, K], got %s" % (a.op, lt.shape))
    return lt, a.labels(labels, lt.shape[0], lt.shape[1])


def cross_entropy(logits, labels):
    """Mean over the batch of -log softmax(logits)[label].

    logits: [N, K]; labels: N integer class indices in [0, K) (an int array), or a float Tensor
    of such indices on the logits' device. Returns a one-element tensor.
    """
    with _Args("cross_entropy") as a:
        lt, lb = _ce_args(a, logits, labels)
        return _new(lib.ut_cross_entropy_loss(lt.ptr, lb.ptr), "cross_entropy")


def cross_entropy_backward(logits, labels):
    """d cross_entropy / d logits = (softmax(logits) - onehot(labels)) / N, [N, K]."""
    with _Args("cross_entropy_backward") as a:
        lt, lb = _ce_args(a, logits, labels)
        return _new(lib.ut_cross_entropy_backward(lt.ptr, lb.ptr), "cross_entropy_backward")


# -- optimizer steps ------------------------------------------------------------------------------
def _state(a, x, name, like):
    t = a.tensor(x, name)
    if t.size != like.size:
        raise ShapeError("%s: %s has %d elements, param %d" % (a.op, name, t.size, like.size))
    return t


def sgd_step(param, grad, velocity=None, lr=0.01, momentum=0.0):
    """In place: velocity = momentum velocity + grad; param -= lr velocity (no velocity: lr grad)."""
    lr = _args.to_float32(lr, "lr", lo=0.0)
    momentum = _args.to_float32(momentum, "momentum", lo=0.0)
    if not isinstance(param, Tensor):
        raise ArgumentTypeError("sgd_step: param must be a Tensor, got %s" % type(param).__name__)
    with _Args("sgd_step") as a:
        p = a.tensor(param, "param")
        g = _state(a, grad, "grad", p)
        if velocity is not None and not isinstance(velocity, Tensor):
            raise ArgumentTypeError("sgd_step: velocity must be a Tensor or None")
        v = _state(a, velocity, "velocity", p).ptr if velocity is not None else ffi.NULL
        check_status(lib.ut_sgd_step(p.ptr, g.ptr, v, lr, momentum), "sgd_step")
    return param


def adam_step(param, grad, m, v, step, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8):
    """One in-place Adam update with bias correction; ``step`` is the 1-based update count."""
    step = _args.to_int(step, "step", 1)
    lr = _args.to_float32(lr, "lr", lo=0.0)
    beta1 = _args.to_float32(beta1, "adam_step: beta1", lo=0.0, below=1.0)
    beta2 = _args.to_float32(beta2, "adam_step: beta2", lo=0.0, below=1.0)
    eps = _args.to_float32(eps, "eps", lo=0.0)
    for name, x in (("param", param), ("m", m), ("v", v)):
        if not isinstance(x, Tensor):
            raise ArgumentTypeError("adam_step: %s must be a Tensor, got %s" % (name, type(x).__name__))
    with _Args("adam_step") as a:
        p = a.tensor(param, "param")
        g = _state(a, grad, "grad", p)
        mt, vt = _state(a, m, "m", p), _state(a, v, "v", p)
        check_status(
            lib.ut_adam_step(p.ptr, g.ptr, mt.ptr, vt.ptr, step, lr, beta1, beta2, eps), "adam_step"
        )
    return param
