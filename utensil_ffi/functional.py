"""Functional forms of the C ops: each takes Tensors and returns a new Tensor.

Where a Tensor is expected an array-like is accepted too: it is copied to a temporary tensor on
the device of the op's first Tensor argument (the CPU if there is none) and freed after the call.
All tensor arguments of one op must be on one device (DeviceError otherwise).

Validation is the C library's: each op calls C once, and a refused call raises the C message as
the exception its status names (_errors.check). Python checks only what C cannot see: argument
kinds, array-likes and their dtypes, integer labels before their float32 conversion, scalars that
must fit a C int or float, and closed Tensors. Each Tensor argument is held for the call
(_lifetime._hold), so a close() from another thread meanwhile cannot free it under C.
"""

import numpy as np

from . import _args
from ._errors import ArgumentError, ArgumentTypeError, ClosedError, DeviceError, ShapeError
from ._errors import check, check_ptr
from ._lib import ffi, lib
from ._lifetime import (_DEFERRED, _free_deferred, _hold, _hold_group, _let_go, _let_go_group,
                        _list, _unlist)
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
    # the activations of issue 30 (torch.nn.functional's names), each with its backward
    "silu",
    "silu_backward",
    "hardswish",
    "hardswish_backward",
    "hardsigmoid",
    "hardsigmoid_backward",
    "sigmoid",
    "sigmoid_backward",
    "gelu",
    "gelu_backward",
]


class _Args:
    """The pointers of an op's tensor arguments, each held for the call (see _lifetime._hold: a
    Tensor another thread closes meanwhile stays allocated until the call ends); array-likes
    become temporary tensors on the device of the first Tensor argument (the CPU if there is
    none). ``with _Args(op) as a: a.ptrs(...)``; on exit it lets go and frees the temporaries.

    Shapes and devices are the C library's to check: a failed call raises its message (fail()).
    """

    __slots__ = ("op", "dev", "held", "groups", "temps")

    def __init__(self, op, dev=None):
        self.op = op
        self.dev = dev  # where array-likes go; None: the first Tensor argument's device
        self.held = []
        self.groups = []
        self.temps = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        # in listing order: list.remove scans from the front, so each pointer is then found
        # first (the reverse order made a many-tensor op such as sgd_step_many quadratic:
        # ~1 ms of a small network's step)
        for p in self.held:
            _let_go(p)
        for g in self.groups:
            _let_go_group(g)
        for t in self.temps:
            t.close()

    def ptrs(self, *named):
        """(value, name) pairs -> their held C pointers, Tensors first (their device is where the
        array-likes go)."""
        out = [None] * len(named)
        for i, (x, name) in enumerate(named):
            if isinstance(x, Tensor):
                p = _hold(x)  # ClosedError if closed
                self.held.append(p)
                if self.dev is None:
                    self.dev = p.dev
                out[i] = p
        for i, (x, name) in enumerate(named):
            if out[i] is None:
                out[i] = self.array(x, name)
        return out

    def ptr(self, x, name):
        return self.ptrs((x, name))[0]

    def tensors(self, ts):
        """The held pointers of a list of Tensors (checked to be Tensors already), listed as
        one group: for the calls over a whole network's tensors."""
        if not ts:
            return []
        g = _hold_group(ts)
        self.groups.append(g)
        if self.dev is None:
            self.dev = g.ptrs[0].dev
        return g.ptrs

    def array(self, x, name):
        """Array-like ``x`` as a temporary tensor's pointer on this op's device."""
        if x is None:
            raise ArgumentTypeError("%s: %s must be a Tensor or an array, got None" % (self.op, name))
        return self._temp(_args.to_float_array(x, "%s: %s" % (self.op, name)))

    def _temp(self, arr):
        if self.dev is None:
            self.dev = lib.UT_CPU
        p = check_ptr(lib.ut_from_data(arr.ndim, ffi.new("int[]", arr.shape),
                                       ffi.from_buffer("float[]", arr), self.dev), self.op)
        self.temps.append(_wrap(p))
        return p

    def labels(self, labels):
        """Class indices for cross_entropy -> (a held pointer to a float tensor on the op's
        device, None or the error to raise if the C call succeeds).

        A Tensor is taken as it is. An integer array becomes float32 labels, the C API's form;
        the C library checks their shape and values, but cannot see a value the conversion
        changed: that error is raised only once C has accepted the rest, so that a wrong shape
        or range is reported first, as C reports it."""
        if isinstance(labels, Tensor):
            return self.ptr(labels, "labels"), None
        try:
            arr = np.asarray(labels)
        except Exception as e:
            raise ArgumentError("%s: labels cannot be read as an array: %s" % (self.op, e)) from None
        if arr.dtype.kind not in "iu":
            raise ArgumentTypeError(
                "%s: labels must be integer class indices, got dtype %s" % (self.op, arr.dtype)
            )
        if arr.ndim == 0:  # the conversion would make it [1]
            raise ShapeError("%s: labels must be [N], got a scalar" % self.op)
        f = arr.astype(np.float32)
        # above 2^24 not every integer is a float32, and a rounded label would silently name a
        # neighbouring class
        bad = np.flatnonzero(f.astype(np.int64) != arr)
        lost = None
        if bad.size:
            lost = ArgumentError(
                "%s: labels[%d] = %d is not exactly representable as float32 (class indices above "
                "2^24 must be even, above 2^25 multiples of 4, ...)"
                % (self.op, bad[0], arr.reshape(-1)[bad[0]])
            )
        return self.array(f, "labels"), lost


def fail(what, *ptrs):
    """Raise the C library's error for the failed call ``what``: the exception class its status
    names, or DeviceError when the call's tensors (``ptrs``, held) are on different devices."""
    mixed = len({p.dev for p in ptrs}) > 1
    check(what, cls=DeviceError if mixed else None)


_wrap = Tensor._wrap
_NULL = ffi.NULL


def _new(what, c_op, *named):
    """A C op that returns a new tensor, on (value, name) arguments."""
    with _Args(what) as a:
        ps = a.ptrs(*named)
        r = c_op(*ps)
        if r == _NULL:
            fail(what, *ps)
        return _wrap(r)


def _inplace(what, c_op, named, *scalars):
    """A C op that returns a ut_status, on (value, name) arguments and then ``scalars``."""
    with _Args(what) as a:
        ps = a.ptrs(*named)
        if c_op(*ps, *scalars) < 0:
            fail(what, *ps)


# The fast paths: an op whose arguments are all Tensors lists them in _lifetime._IN_USE and calls
# C directly: _hold and _let_go written out (with _lifetime's _list and _unlist), since on a small
# op their two calls per tensor cost more than the rest of the protocol (and no _Args, whose
# bookkeeping would double the cost).


def _unary(what, c_op, x):
    if isinstance(x, Tensor):
        xp = x._ptr
        if xp is None:
            raise ClosedError("operation on a closed Tensor")
        _list(xp)
        try:
            if x._ptr is not xp:  # closed meanwhile (see _hold)
                raise ClosedError("operation on a closed Tensor")
            r = c_op(xp)
            if r == _NULL:
                fail(what)
        finally:
            _unlist(xp)
            if _DEFERRED:
                _free_deferred()
        return _wrap(r)
    return _new(what, c_op, (x, "x"))


def _binary(what, c_op, a, b, an, bn):
    if isinstance(a, Tensor) and isinstance(b, Tensor):
        ap, bp = a._ptr, b._ptr
        if ap is None or bp is None:
            raise ClosedError("operation on a closed Tensor")
        _list(ap)
        _list(bp)
        try:
            if a._ptr is not ap or b._ptr is not bp:  # closed meanwhile (see _hold)
                raise ClosedError("operation on a closed Tensor")
            r = c_op(ap, bp)
            if r == _NULL:
                fail(what, ap, bp)
        finally:
            _unlist(bp)
            _unlist(ap)
            if _DEFERRED:
                _free_deferred()
        return _wrap(r)
    return _new(what, c_op, (a, an), (b, bn))


def relu(x):
    """max(x, 0), any shape."""
    return _unary("relu", lib.ut_relu, x)


def relu6(x):
    """min(max(x, 0), 6), any shape."""
    return _unary("relu6", lib.ut_relu6, x)


def relu_backward(grad_out, x):
    """grad_out where 0 < x, else 0 (x: the forward input)."""
    return _binary("relu_backward", lib.ut_relu_backward, grad_out, x, "grad_out", "x")


def relu6_backward(grad_out, x):
    """grad_out where 0 < x < 6, else 0 (x: the forward input)."""
    return _binary("relu6_backward", lib.ut_relu6_backward, grad_out, x, "grad_out", "x")


# ---- the activations of issue 30: one C pair, ut_activation_forward / _backward, the kind an
# argument (see utensil.h); PyTorch's formulas, values at the kinks and NaN handling.

def _act(what, kind, x):
    return _unary(what, lambda p: lib.ut_activation_forward(p, kind), x)


def _act_backward(what, kind, grad_out, x):
    return _binary(what, lambda g, p: lib.ut_activation_backward(g, p, kind), grad_out, x,
                   "grad_out", "x")


def silu(x):
    """x * sigmoid(x) (swish), any shape: torch.nn.functional.silu."""
    return _act("silu", lib.UT_ACT_SILU, x)


def silu_backward(grad_out, x):
    """grad_out * s (1 + x (1 - s)), s = sigmoid(x) (x: the forward input)."""
    return _act_backward("silu_backward", lib.UT_ACT_SILU, grad_out, x)


def hardswish(x):
    """x * min(max(x + 3, 0), 6) / 6, any shape: torch.nn.functional.hardswish."""
    return _act("hardswish", lib.UT_ACT_HARDSWISH, x)


def hardswish_backward(grad_out, x):
    """grad_out * (0 for x <= -3, x / 3 + 1/2 for -3 < x < 3, 1 for x >= 3), as PyTorch."""
    return _act_backward("hardswish_backward", lib.UT_ACT_HARDSWISH, grad_out, x)


def hardsigmoid(x):
    """min(max(x + 3, 0), 6) / 6, any shape: torch.nn.functional.hardsigmoid."""
    return _act("hardsigmoid", lib.UT_ACT_HARDSIGMOID, x)


def hardsigmoid_backward(grad_out, x):
    """grad_out / 6 where -3 < x < 3, else 0 (the kinks and NaN included), as PyTorch."""
    return _act_backward("hardsigmoid_backward", lib.UT_ACT_HARDSIGMOID, grad_out, x)


def sigmoid(x):
    """1 / (1 + exp(-x)), any shape: torch.sigmoid."""
    return _act("sigmoid", lib.UT_ACT_SIGMOID, x)


def sigmoid_backward(grad_out, x):
    """grad_out * (1 - y) * y, y = sigmoid(x) (x: the forward input, not the output)."""
    return _act_backward("sigmoid_backward", lib.UT_ACT_SIGMOID, grad_out, x)


def _gelu_kind(approximate, what):
    a = _args.to_str(approximate, "%s: approximate" % what, ("none", "tanh"))
    return lib.UT_ACT_GELU if a == "none" else lib.UT_ACT_GELU_TANH


def gelu(x, approximate="none"):
    """x * Phi(x), any shape: torch.nn.functional.gelu. approximate="none": the erf form,
    x (1 + erf(x / sqrt 2)) / 2; "tanh": x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) / 2."""
    return _act("gelu", _gelu_kind(approximate, "gelu"), x)


def gelu_backward(grad_out, x, approximate="none"):
    """grad_out * gelu'(x) of the same form (x: the forward input)."""
    return _act_backward("gelu_backward", _gelu_kind(approximate, "gelu_backward"), grad_out, x)


def add_(dst, src):
    """dst += src in place (same number of elements); returns dst."""
    if not isinstance(dst, Tensor):
        raise ArgumentTypeError("add_: dst must be a Tensor, got %s" % type(dst).__name__)
    _inplace("add_", lib.ut_add_into, ((dst, "dst"), (src, "src")))
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
    _inplace("bias_add_", lib.ut_bias_add, ((x, "x"), (bias, "bias")))
    return x


# -- dense ----------------------------------------------------------------------------------------
def matmul(a, b):
    """a: [M, K] @ b: [K, N] -> [M, N]."""
    return _binary("matmul", lib.ut_matmul, a, b, "a", "b")


def transpose(x, d0, d1):
    """A copy of x with dimensions d0 and d1 swapped."""
    if isinstance(x, Tensor):
        return x.transpose(d0, d1)
    with Tensor(_args.to_float_array(x, "transpose: x")) as t:
        return t.transpose(d0, d1)


def reshape(x, shape):
    """A copy of x with a new shape of the same element count."""
    if isinstance(x, Tensor):
        return x.reshape(shape)
    with Tensor(_args.to_float_array(x, "reshape: x")) as t:
        return t.reshape(shape)


# -- pooling --------------------------------------------------------------------------------------
def global_avg_pool2d(x):
    """x: [N, C, H, W] -> [N, C], the mean over H and W."""
    return _unary("global_avg_pool2d", lib.ut_global_avgpool2d_forward, x)


def global_avg_pool2d_backward(grad_out, h, w):
    """grad_out: [N, C] -> dx: [N, C, h, w]."""
    h = _args.to_int(h, "h", 1)
    w = _args.to_int(w, "w", 1)
    with _Args("global_avg_pool2d_backward") as a:
        g = a.ptr(grad_out, "grad_out")
        r = lib.ut_global_avgpool2d_backward(g, h, w)
        if r == _NULL:
            fail("global_avg_pool2d_backward")
        return _wrap(r)


# -- losses ---------------------------------------------------------------------------------------
def mse_loss(pred, target):
    """mean((pred - target)^2) as a one-element tensor on pred's device."""
    return _binary("mse_loss", lib.ut_mse_loss, pred, target, "pred", "target")


def mse_loss_backward(pred, target):
    """d mse_loss / d pred = 2 (pred - target) / pred.size."""
    return _binary("mse_loss_backward", lib.ut_mse_loss_backward, pred, target, "pred", "target")


def _ce(what, c_op, logits, labels, *scalars):
    with _Args(what) as a:
        lp = a.ptr(logits, "logits")
        yp, lost = a.labels(labels)
        r = c_op(lp, yp, *scalars)
        if r == _NULL:
            fail(what, lp, yp)
        if lost is not None:
            lib.ut_free(r)  # computed from rounded labels
            raise lost
        return _wrap(r)


def _label_smoothing(value):
    v = _args.to_float32(value, "label_smoothing")
    if not 0.0 <= v <= 1.0:
        raise ArgumentError("label_smoothing must be between 0.0 and 1.0. Got: %r" % (value,))
    return v


def cross_entropy(logits, labels, label_smoothing=0.0):
    """Mean over the batch of -log softmax(logits)[label].

    logits: [N, K]; labels: N integer class indices in [0, K) (an int array), or a float Tensor
    of such indices on the logits' device. Returns a one-element tensor.
    label_smoothing (eps, in [0, 1]) as PyTorch's: the target is (1 - eps) onehot + eps / K, so
    the loss is the mean of (1 - eps) (-log softmax[label]) + eps mean_k(-log softmax[k]).
    """
    eps = _label_smoothing(label_smoothing)
    if eps == 0.0:
        return _ce("cross_entropy", lib.ut_cross_entropy_loss, logits, labels)
    return _ce("cross_entropy", lib.ut_cross_entropy_loss_smoothed, logits, labels, eps)


def cross_entropy_backward(logits, labels, label_smoothing=0.0):
    """d cross_entropy / d logits = (softmax(logits) - target) / N, [N, K]; target the onehot
    labels, or with label_smoothing eps (1 - eps) onehot + eps / K."""
    eps = _label_smoothing(label_smoothing)
    if eps == 0.0:
        return _ce("cross_entropy_backward", lib.ut_cross_entropy_backward, logits, labels)
    return _ce("cross_entropy_backward", lib.ut_cross_entropy_backward_smoothed, logits, labels,
               eps)


# -- optimizer steps ------------------------------------------------------------------------------
def sgd_step(param, grad, velocity=None, lr=0.01, momentum=0.0):
    """In place: velocity = momentum velocity + grad; param -= lr velocity (no velocity: lr grad)."""
    lr = _args.to_float32(lr, "lr", lo=0.0)
    momentum = _args.to_float32(momentum, "momentum", lo=0.0)
    if not isinstance(param, Tensor):
        raise ArgumentTypeError("sgd_step: param must be a Tensor, got %s" % type(param).__name__)
    if velocity is not None and not isinstance(velocity, Tensor):
        raise ArgumentTypeError("sgd_step: velocity must be a Tensor or None")
    named = ((param, "param"), (grad, "grad")) + (((velocity, "velocity"),) if velocity is not None
                                                   else ())
    with _Args("sgd_step") as a:
        ps = a.ptrs(*named)
        if lib.ut_sgd_step(ps[0], ps[1], ps[2] if velocity is not None else _NULL, lr, momentum) < 0:
            fail("sgd_step", *ps)
    return param


def sgd_step_many(params, grads, velocities=None, lr=0.01, momentum=0.0, dampening=0.0,
                  weight_decay=0.0, nesterov=False):
    """sgd_step on each (params[i], grads[i], velocities[i]) in one C call (on the GPU, a few
    launches for a whole network). Every argument is checked before anything changes.

    With weight_decay, dampening or nesterov it is PyTorch's SGD update (ut_sgd_step_many_ex):
    d = grad + weight_decay param; v = momentum v + (1 - dampening) d; d = d + momentum v
    (nesterov) or v; param -= lr d."""
    lr = _args.to_float32(lr, "lr", lo=0.0)
    momentum = _args.to_float32(momentum, "momentum", lo=0.0)
    dampening = _args.to_float32(dampening, "dampening")
    weight_decay = _args.to_weight_decay(weight_decay)
    nesterov = _args.to_bool(nesterov, "nesterov")
    plain = weight_decay == 0.0 and dampening == 0.0 and not nesterov
    params, grads = list(params), list(grads)
    vels = None if velocities is None else list(velocities)
    if len(grads) != len(params) or (vels is not None and len(vels) != len(params)):
        raise ArgumentError("sgd_step_many: %d params, %d grads%s" % (
            len(params), len(grads), "" if vels is None else ", %d velocities" % len(vels)))
    for name, seq in (("params", params), ("grads", grads), ("velocities", vels or [])):
        for i, t in enumerate(seq):
            if not isinstance(t, Tensor):
                raise ArgumentTypeError("sgd_step_many: %s[%d] must be a Tensor, got %s"
                                        % (name, i, type(t).__name__))
    if not params:
        return
    with _Args("sgd_step_many") as a:
        ps = a.tensors(params)
        gs = a.tensors(grads)
        vs = a.tensors(vels) if vels is not None else None
        arr = [ffi.new("ut_tensor*[]", x) if x is not None else _NULL for x in (ps, gs, vs)]
        rc = (lib.ut_sgd_step_many(arr[0], arr[1], arr[2], len(ps), lr, momentum) if plain else
              lib.ut_sgd_step_many_ex(arr[0], arr[1], arr[2], len(ps), lr, momentum, dampening,
                                      weight_decay, nesterov))
        if rc < 0:
            fail("sgd_step_many")


def fill_many(tensors, value):
    """Every tensor filled with value, in one C call (zero_grad over a network)."""
    value = _args.to_float32(value, "value", finite=False)
    tensors = list(tensors)
    for i, t in enumerate(tensors):
        if not isinstance(t, Tensor):
            raise ArgumentTypeError("fill_many: tensors[%d] must be a Tensor, got %s"
                                    % (i, type(t).__name__))
    if not tensors:
        return
    with _Args("fill_many") as a:
        ps = a.tensors(tensors)
        if lib.ut_fill_many(ffi.new("ut_tensor*[]", ps), len(ps), value) < 0:
            fail("fill_many")


def _pack(what, c_op, flat, tensors):
    tensors = list(tensors)
    for i, t in enumerate([flat] + tensors):
        if not isinstance(t, Tensor):
            raise ArgumentTypeError("%s: %s must be a Tensor, got %s" % (
                what, "flat" if i == 0 else "tensors[%d]" % (i - 1), type(t).__name__))
    with _Args(what) as a:
        fp = a.ptr(flat, "flat")
        ps = a.tensors(tensors)
        if c_op(fp, ffi.new("ut_tensor*[]", ps) if ps else ffi.NULL, len(ps)) < 0:
            fail(what)


def pack(flat, tensors):
    """Copy the tensors into ``flat`` end to end (its size is the sum of theirs; one device)."""
    _pack("pack", lib.ut_pack, flat, tensors)


def unpack(flat, tensors):
    """Copy ``flat`` back out into the tensors, the inverse of :func:`pack`."""
    _pack("unpack", lib.ut_unpack, flat, tensors)


def adam_step(param, grad, m, v, step, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
              weight_decay=0.0, decoupled_weight_decay=False):
    """One in-place Adam update with bias correction; ``step`` is the 1-based update count.

    weight_decay: PyTorch's Adam adds weight_decay param to the gradient; with
    decoupled_weight_decay (AdamW) param *= 1 - lr weight_decay before the update instead."""
    weight_decay = _args.to_weight_decay(weight_decay)
    decoupled = _args.to_bool(decoupled_weight_decay, "decoupled_weight_decay")
    step = _args.to_int(step, "step", 1)
    lr = _args.to_float32(lr, "lr", lo=0.0)
    beta1 = _args.to_float32(beta1, "adam_step: beta1", lo=0.0, below=1.0)
    beta2 = _args.to_float32(beta2, "adam_step: beta2", lo=0.0, below=1.0)
    eps = _args.to_float32(eps, "eps", lo=0.0)
    for name, x in (("param", param), ("m", m), ("v", v)):
        if not isinstance(x, Tensor):
            raise ArgumentTypeError("adam_step: %s must be a Tensor, got %s" % (name, type(x).__name__))
    # the Python floats go to C as doubles (ut_adam_step_ex): 1 - beta2 and the bias
    # corrections are then PyTorch's, not those of float32-rounded betas
    _inplace("adam_step", lib.ut_adam_step_ex,
             ((param, "param"), (grad, "grad"), (m, "m"), (v, "v")),
             step, lr, beta1, beta2, eps, weight_decay, decoupled)
    return param


# -- residual add ---------------------------------------------------------------------------------
# Built from two existing C calls (ut_copy, then ut_add_into) rather than a new op: ut_add_into
# checks only the element count, so the shape rule of an out-of-place add is checked here.
__all__ += ["add", "add_backward"]


def add(a, b):
    """a + b as a new tensor: a and b of one shape on one device (a residual connection).

    Neither input changes. ShapeError when the shapes differ (even with the same element count:
    a silent reshape would hide a wrong block); DeviceError when the devices differ."""
    with _Args("add") as args:
        ap, bp = args.ptrs((a, "a"), (b, "b"))
        if ap.dev != bp.dev:
            raise DeviceError("add: a is on %s but b is on %s (move one with .to())"
                              % (_args.device_name(ap.dev), _args.device_name(bp.dev)))
        sa, sb = (tuple(ffi.unpack(p.shape.shape, p.shape.ndim)) for p in (ap, bp))
        if sa != sb:
            raise ShapeError("add: a has shape %s but b has shape %s (they must match)"
                             % (list(sa), list(sb)))
        r = lib.ut_copy(ap)
        if r == _NULL:
            fail("add", ap)
        if lib.ut_add_into(r, bp) < 0:
            try:
                fail("add", r, bp)
            finally:
                lib.ut_free(r)  # after fail() has read the C error
        return _wrap(r)


def add_backward(grad_out):
    """The gradients of ``add(a, b)``: (d a, d b), each a copy of grad_out (the sum is the
    identity to both inputs); two copies, so that closing one leaves the other."""
    if not isinstance(grad_out, Tensor):
        grad_out = Tensor(_args.to_float_array(grad_out, "add_backward: grad_out"))
        return grad_out, grad_out.clone()
    return grad_out.clone(), grad_out.clone()


# -- channel scales: squeeze-and-excitation and ConvNeXt's layer scale (issue 30) ----------------
__all__ += ["channel_scale", "channel_scale_backward", "layer_scale", "layer_scale_backward"]


def channel_scale(x, s):
    """x: [N, C, ...] times s: [N, C] or [N, C, 1, 1] per sample and channel
    (squeeze-and-excitation's last step); s has x's dtype."""
    return _binary("channel_scale", lib.ut_channel_scale, x, s, "x", "s")


def channel_scale_backward(grad_out, x, s, *, input_grad=True):
    """The gradients of ``channel_scale(x, s)``: ``(dx, ds)``, dx = grad_out * s (like x),
    ds[n, c] = sum of grad_out * x over the positions (like s; summed in float32). With
    ``input_grad=False`` dx is not computed: ``(None, ds)``."""
    input_grad = _args.to_bool(input_grad, "input_grad")
    with _Args("channel_scale_backward") as a:
        gp, xp, sp = a.ptrs((grad_out, "grad_out"), (x, "x"), (s, "s"))
        out = ffi.new("ut_tensor*[2]")
        if lib.ut_channel_scale_backward(gp, xp, sp, out if input_grad else _NULL, out + 1) < 0:
            fail("channel_scale_backward", gp, xp, sp)
        return (_wrap(out[0]) if input_grad else None), _wrap(out[1])


def layer_scale(x, gamma):
    """x: [N, C, ...] times the float32 parameter gamma: [C] or [C, 1, 1] (ConvNeXt's
    ``layer_scale``, torchvision's shape [C, 1, 1])."""
    return _binary("layer_scale", lib.ut_layer_scale, x, gamma, "x", "gamma")


def layer_scale_backward(grad_out, x, gamma, dgamma=None):
    """dx = grad_out * gamma; when ``dgamma`` (a float32 Tensor of C elements, e.g. the
    parameter's ``grad``) is given, ``dgamma += sum over n, h, w of grad_out * x`` in place."""
    if dgamma is not None and not isinstance(dgamma, Tensor):
        raise ArgumentTypeError("layer_scale_backward: dgamma must be a Tensor or None, got %s"
                                % type(dgamma).__name__)
    named = [(grad_out, "grad_out"), (x, "x"), (gamma, "gamma")]
    if dgamma is not None:
        named.append((dgamma, "dgamma"))
    with _Args("layer_scale_backward") as a:
        ps = a.ptrs(*named)
        r = lib.ut_layer_scale_backward(ps[0], ps[1], ps[2], ps[3] if dgamma is not None else _NULL)
        if r == _NULL:
            fail("layer_scale_backward", *ps)
        return _wrap(r)
# -- regularisation: Dropout, StochasticDepth (issue 30) ------------------------------------------
# The mask comes from an RNG that seed() seeds, so a seeded run repeats: the host's for a CPU
# tensor, a counter-based stream drawn on the GPU for a GPU tensor (ut_dropout_mask): no upload,
# and a step recorded in a CUDA graph draws a new mask at each replay.
__all__ += ["dropout_mask", "mask_scale_", "dropout", "stochastic_depth"]


def _drop_p(p, what):
    v = _args.to_float32(p, "p")
    if not 0.0 <= v <= 1.0:
        raise ArgumentError("%s probability has to be between 0 and 1, but got %r" % (what, p))
    return v


def dropout_mask(shape, p, device="cpu"):
    """A float32 [shape] mask from the library's RNG (see seed()): 0 with probability p, else
    1 / (1 - p) (p 1: all 0). The CPU and the GPU draw different masks from one seed (the GPU's
    on the device, so a recorded step draws anew at each replay), as PyTorch's devices do."""
    dims = _args.to_shape(shape)
    p = _drop_p(p, "dropout")
    dev = _args.parse_device(device)
    return _wrap(check_ptr(lib.ut_dropout_mask(len(dims), ffi.new("int[]", dims), p, dev),
                           "dropout_mask"))


def mask_scale_(x, mask):
    """In place x[r, ...] *= mask[r], x viewed as [mask.size, rest] (mask float32, x's device):
    Dropout's mask (one per element) or StochasticDepth's (one per sample). Returns x."""
    if not isinstance(x, Tensor):
        raise ArgumentTypeError("mask_scale_: x must be a Tensor, got %s" % type(x).__name__)
    _inplace("mask_scale_", lib.ut_mask_scale, ((x, "x"), (mask, "mask")))
    return x


def _as_tensor(x, what):
    return x if isinstance(x, Tensor) else Tensor(_args.to_float_array(x, "%s: input" % what))


def dropout(input, p=0.5, training=True, inplace=False):
    """torch.nn.functional.dropout: each element zeroed with probability p, the others scaled
    by 1 / (1 - p); the input itself when not training or p is 0 (forward only: nn.Dropout
    keeps the mask for backward)."""
    p = _drop_p(p, "dropout")
    if not _args.to_bool(training, "training") or p == 0.0:
        return input
    x = _as_tensor(input, "dropout")
    y = x if _args.to_bool(inplace, "inplace") and x is input else x.clone()
    with dropout_mask(y.shape, p, y.device) as m:
        mask_scale_(y, m)
    return y


def _stochastic_depth_shape(shape, mode):
    mode = _args.to_str(mode, "mode")
    if mode not in ("row", "batch"):
        raise ArgumentError("mode has to be either 'batch' or 'row', but got %s" % mode)
    return (shape[0],) if mode == "row" else (1,)


def stochastic_depth(input, p, mode, training=True):
    """torchvision.ops.stochastic_depth: mode "row" zeroes whole samples (dim 0) with
    probability p and scales the others by 1 / (1 - p); "batch" does it to the whole batch at
    once. The input itself when not training or p is 0 (forward only)."""
    p = _drop_p(p, "drop")
    x = _as_tensor(input, "stochastic_depth")
    shape = _stochastic_depth_shape(x.shape, mode)
    if not _args.to_bool(training, "training") or p == 0.0:
        return input
    y = x.clone()
    with dropout_mask(shape, p, y.device) as m:
        mask_scale_(y, m)
    return y


# -- the exponential moving average of weights (issue 30) -----------------------------------------
__all__ += ["lerp_many_"]


def lerp_many_(avg, cur, weight):
    """In place avg[i] += weight (cur[i] - avg[i]) for each pair, as PyTorch's lerp_ (weight in
    [0, 1]; float32 tensors of equal size, pairwise on one device), in one C call."""
    weight = _args.to_float32(weight, "weight")
    avg, cur = list(avg), list(cur)
    if len(avg) != len(cur):
        raise ArgumentError("lerp_many_: %d averages, %d current tensors" % (len(avg), len(cur)))
    for name, seq in (("avg", avg), ("cur", cur)):
        for i, t in enumerate(seq):
            if not isinstance(t, Tensor):
                raise ArgumentTypeError("lerp_many_: %s[%d] must be a Tensor, got %s"
                                        % (name, i, type(t).__name__))
    if not avg:
        return
    with _Args("lerp_many_") as a:
        ps, cs = a.tensors(avg), a.tensors(cur)
        if lib.ut_lerp_many(ffi.new("ut_tensor*[]", ps), ffi.new("ut_tensor*[]", cs), len(ps),
                            weight) < 0:
            fail("lerp_many_")
