"""Layers over the C layer structs, with explicit forward and backward (no autograd tape).

Each layer is called like a function (``y = layer(x)``); ``layer.backward(grad_out)`` returns the
gradient with respect to the input of the last forward and ADDS the parameter gradients into
``p.grad`` for each ``p`` in ``layer.parameters()`` (call ``zero_grad()`` between steps);
``backward(grad_out, input_grad=False)`` adds the same parameter gradients and returns None,
skipping what only the input's gradient needs where it can (PyTorch computes no gradient for an
input that does not require one: the images a network's first layer reads). In
training mode (the default) forward keeps what backward needs; in eval mode it keeps nothing
and backward raises. ``close()`` frees the layer's C tensors now; ``with`` does it on exit.

What forward keeps is a stack per thread, scoped to one outer call: a layer used several times in
one network (``Sequential(l, ReLU(), l)``, or a Module whose forward calls ``l`` twice) keeps one
entry per use, and backward walks them in reverse; a forward under a new outer call (calling the
model or a layer again) drops what the earlier one kept, so memory stays bounded. Call a Module
(``net(x)``) rather than ``net.forward(x)`` so its layers know they are inside one call. Backward
refuses (ArgumentError) when the input its forward saw, or the layer's weight, was changed in
place since (a version counter on every C tensor, bumped by every library write, copy_from and
in-place method); writes through a numpy() or DLPack view are not tracked.

Threads: a layer (or network) may be used from several threads at once. Eval-mode forwards run in
parallel and give the results of a serial run; training-mode forwards keep a cache per thread, so
each thread's backward differentiates its own forward; backward passes (which accumulate into
``p.grad``) and BatchNorm2d's training forward (which updates the running statistics) are
serialized per layer. ``close()`` from another thread waits for the calls in flight to finish.
"""

import copy
import inspect
import weakref

import numpy as np

from .. import _args
from .. import dtypes as _dtypes
from .._errors import ArgumentError, ArgumentTypeError, ClosedError, DeviceError, ShapeError
from .._errors import check, check_ptr
from .._lib import ffi, lib
from .. import functional as _F
from ..functional import _Args, fail
from .._lifetime import _PASS, _Handle, _State, _hold, _in_pass, _let_go
from ..tensor import Tensor, zeros

_wrap = Tensor._wrap
_NULL = ffi.NULL

__all__ = [
    "Parameter",
    "Module",
    "Conv2d",
    "DWConv2d",
    "Linear",
    "LayerNorm",
    "BatchNorm2d",
    "ReLU",
    "ReLU6",
    "GlobalAvgPool2d",
    "Sequential",
    "MSELoss",
    "CrossEntropyLoss",
]


class Parameter(Tensor):
    """A layer's trainable tensor; ``grad`` is a Tensor of the same shape on the same device
    that backward passes accumulate into."""

    __slots__ = ("_grad", "name")

    def __init__(self, data, device="cpu", requires_grad=True, name=None):
        """A standalone parameter: a float32 copy of ``data`` with a zeroed ``grad`` (``grad`` is
        None when ``requires_grad`` is false)."""
        self.name = name
        self.grad = None
        super().__init__(data, device)
        if _args.to_bool(requires_grad, "requires_grad"):
            self.grad = zeros(self.shape, self.device)

    @property
    def grad(self):
        return getattr(self, "_grad", None)

    @grad.setter
    def grad(self, g):
        # Checked here, as PyTorch does, because backward, zero_grad, to() and the optimizers
        # use grad as a Tensor of this shape and device.
        if g is not None and not isinstance(g, Tensor):
            raise ArgumentTypeError("Parameter.grad: expected a Tensor or None, got %s"
                                    % type(g).__name__)
        if g is not None and not g.closed and getattr(self, "_ptr", None) is not None:
            if g.shape != self.shape:
                raise ShapeError("Parameter.grad: a grad of shape %s for a parameter of shape %s"
                                 % (g.shape, self.shape))
            if g.device != self.device:
                raise DeviceError("Parameter.grad: a grad on %s for a parameter on %s"
                                  % (g.device, self.device))
        self._grad = g

    def __repr__(self):
        if self.closed:
            return "Parameter(<closed>)"
        return "Parameter(name=%r, shape=%s, device=%r)" % (
            getattr(self, "name", None), self.shape, self.device)

    def close(self):
        super().close()
        g = getattr(self, "grad", None)
        if g is not None:
            g.close()

    # copy.copy, copy.deepcopy: a standalone Parameter with copies of the values and of grad
    # (None stays None), attached to no layer. pickle: the same, values and grad as float32.
    def __deepcopy__(self, memo):
        new = _new_parameter(getattr(self, "name", None))
        memo[id(self)] = new
        p = _hold(self)
        try:
            new._ptr = check_ptr(lib.ut_copy(p), "Parameter copy")
        finally:
            _let_go(p)
        g = getattr(self, "grad", None)
        new.grad = copy.deepcopy(g, memo) if g is not None else None
        return new

    def __copy__(self):
        return self.__deepcopy__({})

    def __reduce_ex__(self, protocol):
        from ..tensor import _host_copy

        return (_rebuild_parameter,
                (_host_copy(self), self.device, getattr(self, "name", None),
                 getattr(self, "grad", None)))


def _new_parameter(name):
    p = object.__new__(Parameter)
    p._ptr = None
    p.name = name
    p.grad = None
    return p


def _rebuild_parameter(data, device, name, grad):
    """Unpickle a Parameter (see Parameter.__reduce_ex__)."""
    from ..tensor import _unpickle_device

    _unpickle_device(device)
    t = Tensor(data, device)
    p = _new_parameter(name)
    p._ptr, t._ptr = t._ptr, None
    p.grad = grad
    return p


def _param(ptr, name):
    p = Parameter._borrow(ptr)
    p.name = name
    p.grad = None
    p.grad = zeros(p.shape, p.device)
    return p


def _kernel(value, name):
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise ArgumentError("%s must be an int or a pair (kh, kw), got %r" % (name, value))
        return _args.to_int(value[0], name, 1), _args.to_int(value[1], name, 1)
    k = _args.to_int(value, name, 1)
    return k, k


def _takes_input_grad(fn):
    """Mark a library ``backward`` as accepting ``input_grad=`` (see _backward_params_only)."""
    fn._ut_input_grad = True
    return fn


# backward functions without the mark -> whether their signature has an input_grad parameter
_INPUT_GRAD_KW = weakref.WeakKeyDictionary()


def _accepts_input_grad(module):
    """Whether ``module.backward`` takes ``input_grad=``: the library's own do (marked); one a
    user wrote is inspected once (a subclass overriding ``backward(self, grad_out)`` does not)."""
    bound = module.backward
    fn = getattr(bound, "__func__", bound)
    if getattr(fn, "_ut_input_grad", False):
        return True
    try:
        return _INPUT_GRAD_KW[fn]
    except (KeyError, TypeError):
        pass
    try:
        p = inspect.signature(bound).parameters.get("input_grad")
    except (TypeError, ValueError):
        p = None
    ok = p is not None and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    try:
        _INPUT_GRAD_KW[fn] = ok
    except TypeError:  # not weakly referenceable: asked again next time
        pass
    return ok


def _backward_params_only(module, grad_out):
    """``module.backward(grad_out)`` for the parameter gradients only; returns None.

    For where the input gradient is thrown away (a network's first layer, a training step):
    a module that takes ``input_grad=`` gets ``input_grad=False`` and may skip that work; any
    other (a user's ``backward(self, grad_out)``) runs as written and its result is closed."""
    if _accepts_input_grad(module):
        dx = module.backward(grad_out, input_grad=False)
    else:
        dx = module.backward(grad_out)
    if isinstance(dx, Tensor) and dx is not grad_out:
        dx.close()
    return None


class Module:
    """Base of every layer: call = forward, backward, parameters, zero_grad, train/eval, to."""

    training = True

    def forward(self, x):
        raise NotImplementedError

    @_takes_input_grad
    def backward(self, grad_out, *, input_grad=True):
        """The gradient with respect to the input of the last forward; ADDS each parameter's
        gradient into ``p.grad``. With ``input_grad=False`` the parameter gradients are the same
        (bit for bit) but the input's gradient is not returned (None) and, where the layer can,
        not computed: Conv2d skips its dx GEMM and col2im, a container passes it to its first
        layer. A subclass may define ``backward(self, grad_out)`` without the keyword: the
        library's containers then call it plainly and close what it returns."""
        raise NotImplementedError

    def __call__(self, *args):
        return _in_pass(self.forward, args)

    def parameters(self):
        return [p for _, p in self.named_parameters()]

    def zero_grad(self, set_to_none=False):
        """Zero each parameter's grad in place, or with ``set_to_none=True`` drop it (the next
        backward then starts from a fresh zero grad). A grad that is None stays None."""
        _zero_grads(self.parameters(), set_to_none)

    def train(self, mode=True):
        self.training = _args.to_bool(mode, "mode")
        if not mode:
            self._clear_cache()
        return self

    def eval(self):
        return self.train(False)

    def to(self, device):
        """Move the layer's tensors to ``device`` in place; returns self."""
        _layer_device(device)
        return self

    def _clear_cache(self):
        pass

    def close(self):
        self._clear_cache()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __copy__(self):
        """``copy.copy(layer)`` is ``copy.deepcopy(layer)``: copies never share C memory."""
        return copy.deepcopy(self)

    # -- names and state dicts, with PyTorch's keys ---------------------------------------------
    # A module's own tensors come first ("weight", "bias", then buffers such as "running_mean"),
    # then each child's under "<child name>." (Sequential's children are named "0", "1", ...;
    # a user module's are its public attributes that hold a Module, in the order they were set).

    def _own_parameters(self):
        """[(name, Parameter)] that belong to this module itself, not to a child."""
        return []

    def _own_buffers(self):
        """[(name, Tensor)] of non-trainable state (BatchNorm's running statistics)."""
        return []

    def named_children(self):
        """(name, module) for each direct sub-module."""
        for k, v in list(vars(self).items()):
            if not k.startswith("_") and isinstance(v, Module):
                yield k, v

    def children(self):
        return [m for _, m in self.named_children()]

    def named_modules(self, prefix=""):
        """(dotted name, module) for this module ("" or ``prefix``) and every descendant, each
        module once (a module that appears twice keeps its first name), as in PyTorch."""
        seen = set()

        def walk(m, name):
            if id(m) in seen:
                return
            seen.add(id(m))
            yield name, m
            for k, c in m.named_children():
                yield from walk(c, name + "." + k if name else k)

        yield from walk(self, prefix)

    def modules(self):
        return [m for _, m in self.named_modules()]

    def _named_tensors(self, own, prefix, recurse):
        seen = set()
        mods = self.named_modules(prefix) if recurse else [(prefix, self)]
        for name, m in mods:
            for k, t in own(m):
                if id(t) not in seen:
                    seen.add(id(t))
                    yield (name + "." + k if name else k), t

    def named_parameters(self, prefix="", recurse=True):
        """(dotted name, Parameter) in the order of ``parameters()``: ``"weight"``, ``"0.bias"``,
        ``"encoder.3.weight"``. A Parameter shared by two layers is listed once."""
        return self._named_tensors(lambda m: m._own_parameters(), prefix, recurse)

    def named_buffers(self, prefix="", recurse=True):
        """(dotted name, Tensor) of the running statistics (``"1.running_mean"``...)."""
        return self._named_tensors(lambda m: m._own_buffers(), prefix, recurse)

    def buffers(self):
        return [b for _, b in self.named_buffers()]

    def _state_items(self, prefix):
        """(key, tensor or value, shape in the state dict) for state_dict and load_state_dict."""
        for k, t in self._own_parameters() + self._own_buffers():
            yield prefix + k, t, self._state_shape(k, t.shape)
        for k, v in self._extra_state():
            yield prefix + k, v, None
        for k, c in self.named_children():
            yield from c._state_items(prefix + k + ".")

    def _state_shape(self, name, shape):
        """The shape a tensor has in the state dict (PyTorch's; see DWConv2d)."""
        return shape

    def _extra_state(self):
        """[(name, value)] of state that is not a tensor (BatchNorm's num_batches_tracked)."""
        return []

    def _set_extra_state(self, name, value):
        raise NotImplementedError

    def state_dict(self):
        """{key: numpy array} of every parameter and buffer, with the keys and shapes PyTorch's
        ``state_dict()`` gives the same network: ``"0.weight"``, ``"1.running_var"``,
        ``"1.num_batches_tracked"``... Values are float32 copies (``num_batches_tracked``: a 0-d
        int64), on the host whatever the device. DWConv2d's weight is saved as PyTorch's
        depthwise ``[C, 1, kh, kw]``. ``{k: torch.from_numpy(v)}`` loads into the PyTorch twin
        with ``load_state_dict(strict=True)``."""
        out = {}
        for key, t, shape in self._state_items(""):
            if shape is None:
                out[key] = np.array(t, dtype=np.int64)
            else:
                out[key] = np.array(t.numpy(), dtype=np.float32, copy=True).reshape(shape)
        return out

    def load_state_dict(self, state_dict, strict=True):
        """Copy the values of ``state_dict`` into the module's tensors, in place on their device.

        Values may be numpy arrays, Tensors or anything ``np.asarray`` reads (PyTorch tensors).
        A tensor's value may have its shape in the state dict or the module's own (DWConv2d:
        ``[C, 1, kh, kw]`` or ``[C, kh, kw]``). Everything is checked before anything changes:
        with ``strict`` (the default), a missing or unexpected key raises ArgumentError (a
        ValueError) naming them all; ``num_batches_tracked`` may be missing, as PyTorch allows
        for old checkpoints. A value of the wrong shape raises ShapeError, strict or not.
        Returns ``(missing_keys, unexpected_keys)``.
        """
        if not isinstance(state_dict, dict):
            raise ArgumentTypeError("load_state_dict: expected a dict, got %s"
                                    % type(state_dict).__name__)
        items = list(self._state_items(""))
        expected = {k for k, _, _ in items}
        missing = [k for k, t, shape in items if k not in state_dict]
        unexpected = [k for k in state_dict if k not in expected]
        required = [k for k, t, shape in items if k not in state_dict and shape is not None]
        if strict and (required or unexpected):
            raise ArgumentError("load_state_dict: the state does not fit %s: missing keys %s, "
                                "unexpected keys %s" % (type(self).__name__, required or "none",
                                                        unexpected or "none"))
        todo, bad = [], []
        for k, t, shape in items:
            if k not in state_dict:
                continue
            v = state_dict[k]
            if shape is None:
                a = np.asarray(v)
                if a.shape not in ((), (1,)) or a.dtype.kind not in "iu":
                    raise ArgumentError("load_state_dict: %s must be an integer, got %r" % (k, v))
                todo.append((k, None, _args.to_int(int(a.reshape(())), k, 0, 2**63 - 1)))
                continue
            a = v.numpy() if isinstance(v, Tensor) else np.asarray(v)
            if a.shape not in (tuple(shape), t.shape):
                bad.append("%s: %s in the state, %s in the module" % (k, a.shape, tuple(shape)))
                continue
            todo.append((k, t, _args.to_float_array(a.reshape(t.shape), k)))
        if bad:
            raise ShapeError("load_state_dict: %s" % "; ".join(bad))
        owners = {k: m for k, m in self._extra_state_owners("")}
        for k, t, a in todo:
            if t is None:
                owners[k]._set_extra_state(k.rsplit(".", 1)[-1], a)
            else:
                t.copy_from(a)
        return missing, unexpected

    def _extra_state_owners(self, prefix):
        for k, _ in self._extra_state():
            yield prefix + k, self
        for k, c in self.named_children():
            yield from c._extra_state_owners(prefix + k + ".")


def _layer_device(device):
    """The C device a layer's ``to(device)`` names. A dtype is refused with what to do instead:
    PyTorch's ``model.to(torch.bfloat16)`` casts the weights, which mixed-precision training
    keeps float32."""
    if _dtypes.is_dtype_like(device):
        raise ArgumentTypeError(
            "to(%r): a layer's parameters stay float32 (the master weights); to compute in "
            "bfloat16 wrap the model: utensil.MixedPrecision(model)" % (device,))
    return _args.parse_device(device)


def _zero_grads(params, set_to_none):
    set_to_none = _args.to_bool(set_to_none, "set_to_none")
    grads = [p.grad for p in params if p.grad is not None]
    if set_to_none:
        for p in params:
            p.grad = None  # not closed: the caller may still hold it, as in PyTorch
    else:
        from ..functional import fill_many

        fill_many(grads, 0.0)  # one C call for all (a few launches on the GPU)


def _grad_ptr(p):
    """``p.grad``'s C tensor; a grad that is None ("no gradient yet") becomes a zero tensor."""
    if p.grad is None:
        p.grad = zeros(p.shape, p.device)
    return p.grad.ptr


def _public_state(obj):
    """The attributes copy and pickle carry over: the public ones (hyperparameters, training
    mode, a user's own); private ones (C handles, caches) are made anew by the rebuild."""
    return {k: v for k, v in vars(obj).items() if not k.startswith("_")}


def _rebuild_module(cls, init_cls, args, state):
    """Unpickle (and deep-copy) a Module: ``init_cls.__init__(obj, *args)``, then its state."""
    obj = cls.__new__(cls)
    init_cls.__init__(obj, *args)
    obj.__dict__.update(state)
    return obj


class _Wrapper(Module):
    """A module around one child module, held in a public attribute (so the child's parameters
    are named ``<attribute>.<...>``, as PyTorch names a wrapper's ``self.module``).

    A subclass names that attribute and the ``__init__`` arguments after the child, which copies
    rebuild from and repr shows: ``class MixedPrecision(_Wrapper, child="module",
    args=("dtype",))``; it defines ``_forward`` and ``backward``. train/eval, to and close pass
    to the child: the wrapper keeps nothing of its own for backward.
    """

    def __init_subclass__(cls, child=None, args=(), **kwargs):
        super().__init_subclass__(**kwargs)
        if child is not None:
            # the declaring class, not a user's subclass of it, names the wrapper in messages and
            # repr and rebuilds copies: its __init__ signature is the one the arguments fit
            cls._child, cls._init_names, cls._declared_by = child, tuple(args), cls

    def __init__(self, child):
        if not isinstance(child, Module):
            raise ArgumentTypeError("%s: %s must be a Module, got %s" % (
                self._declared_by.__name__, self._child, type(child).__name__))
        setattr(self, self._child, child)

    @property
    def _wrapped(self):
        return getattr(self, self._child)

    def forward(self, x):
        # one outer call even when forward is called directly (see _in_pass)
        return _in_pass(self._forward, (x,))

    def train(self, mode=True):
        self.training = _args.to_bool(mode, "mode")
        self._wrapped.train(mode)
        return self

    def to(self, device):
        self._wrapped.to(device)
        return self

    def close(self):
        self._wrapped.close()

    def __reduce_ex__(self, protocol):
        # copy, deepcopy and pickle rebuild through __init__ with a copy of the child (a child
        # shared with other modules stays shared in the copy: copy's and pickle's memo)
        state = _public_state(self)
        args = tuple(state.pop(k) for k in (self._child,) + self._init_names)
        return (_rebuild_module, (type(self), self._declared_by, args, state))

    def __repr__(self):
        extra = "".join("%s=%r," % (k, getattr(self, k)) for k in self._init_names)
        inner = repr(self._wrapped).replace("\n", "\n  ")
        return "%s(%s\n  (%s): %s\n)" % (self._declared_by.__name__, extra, self._child, inner)


def _rebuild_clayer(cls, scalars, tensors, weight, bias, device, state):
    """Unpickle (and deep-copy) a _CLayer.

    The C struct is rebuilt from its scalar fields and adopts the C tensors of the given
    Parameters and Tensors (so an optimizer pickled or deep-copied together with the layer keeps
    pointing at the layer's parameters); no random initialization runs.
    """
    from ..tensor import _unpickle_device

    _unpickle_device(device)
    own = dict(tensors, weight=weight, bias=bias)
    c = ffi.new(cls._c_struct)
    for name, value in scalars.items():
        setattr(c, name, value)
    for name, t in own.items():
        if t is not None:
            if not isinstance(t, Tensor):
                raise ArgumentTypeError("%s: %s must be a Tensor" % (cls.__name__, name))
            setattr(c, name, lib.ut_retain(t.ptr))  # the struct's own reference
    obj = cls.__new__(cls)
    _CLayer.__init__(obj, device, lambda dev: c[0])
    for name, p in (("_weight", weight), ("_bias", bias)):
        fresh = getattr(obj, name)
        if fresh is not None:
            fresh.close()  # the wrapper __init__ made; the struct keeps its reference
        setattr(obj, name, p)
    for name, t in tensors.items():
        setattr(obj, "_" + name, t)
    obj.__dict__.update(state)
    return obj


_TENSOR_PTR = ffi.typeof("ut_tensor *")


class _TensorField:
    """A layer's parameter or buffer as an attribute (weight, bias, running_mean, ...): reading
    gives its Tensor, assigning copies values into it (copy_from: the same shape), so the C
    struct keeps its tensor. ClosedError once the layer is closed. The Tensor itself is kept in
    the instance under the name with a leading underscore (None: the layer has none)."""

    def __set_name__(self, owner, name):
        self.name = name
        self.attr = "_" + name

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        obj._struct  # ClosedError once closed
        return getattr(obj, self.attr)

    def __set__(self, obj, value):
        obj._struct
        t = getattr(obj, self.attr)
        if t is None:
            raise ArgumentError("%s was created with %s=False" % (type(obj).__name__, self.name))
        t.copy_from(value)


class _CLayer(Module):
    """A layer backed by a C struct and its forward cache.

    Each subclass names its C side in full, so that grepping for an entry point finds its
    binding: ``_c_struct`` and ``_c_cache`` (the struct pointer types) and the functions
    ``_c_forward``, ``_c_backward``, ``_c_cache_free``, ``_c_free``; its allocator is passed to
    __init__. The C calls validate shapes and devices; a refused call raises the C message.
    """

    _c_struct = _c_cache = _c_forward = _c_backward = _c_cache_free = _c_free = None
    # the parameter gradients without dx (int status), for backward(input_grad=False); None:
    # the layer has no such call, so dx is computed and freed
    _c_backward_params = None
    _h = None

    weight = _TensorField()
    bias = _TensorField()

    def __init__(self, device, alloc, *args):
        dev = _args.parse_device(device)
        s = ffi.new(self._c_struct)
        s[0] = alloc(*args, dev)
        if s.weight == ffi.NULL:
            check(type(self).__name__)
        self._h = _Handle(type(self), s)
        self._finalizer = weakref.finalize(self, self._h.free)
        self._finalizer.atexit = False
        self._weight = _param(s.weight, "weight")
        self._bias = _param(s.bias, "bias") if s.bias != ffi.NULL else None

    @property
    def _struct(self):
        if self._h is None or self._h.s is None:
            raise ClosedError("operation on a closed %s" % type(self).__name__)
        return self._h.s

    @property
    def closed(self):
        return self._h is None or self._h.s is None

    @property
    def device(self):
        return _args.device_name(self._struct.weight.dev)

    def parameters(self):
        self._struct
        return [p for p in (self._weight, self._bias) if p is not None]

    def _own_parameters(self):
        self._struct
        return [(k, p) for k, p in (("weight", self._weight), ("bias", self._bias))
                if p is not None]

    def _tensors(self):
        """Every C tensor the layer owns (moved by to())."""
        out = []
        for p in self.parameters():
            out += [p.ptr] if p.grad is None else [p.ptr, p.grad.ptr]
        return out

    def to(self, device):
        dev = _layer_device(device)
        self._struct
        self._clear_cache()
        for p in self._tensors():
            if p.dev != dev:
                if lib.ut_to_device(p, dev) < 0:
                    check("%s.to" % type(self).__name__)
        return self

    def __call__(self, x):
        return self.forward(x)

    def forward(self, x):
        h = self._h
        s = h.enter() if h is not None else None
        if s is None:
            raise ClosedError("operation on a closed %s" % type(self).__name__)
        try:
            if isinstance(x, Tensor):
                xp = _hold(x)  # x stays allocated even if another thread closes it meanwhile
                try:
                    return _wrap(self._run_forward(h, s, xp))
                finally:
                    _let_go(xp)
            # an array-like: a temporary tensor on the layer's device, then the same call
            with _Args(type(self).__name__, s.weight.dev) as a:
                return _wrap(self._run_forward(h, s, a.array(x, "x")))
        finally:
            h.state.leave()

    def _run_forward(self, h, s, xp):
        """One C forward with a cache of its own when it keeps one (pushed on success); raises
        the C library's error on failure."""
        if not self._keeps_cache():
            p = self._c_forward(s, xp, _NULL)
            if p == _NULL:
                fail("%s.forward" % type(self).__name__, s.weight, xp)
            return p
        c = h.new_cache()
        if self._writes_state():
            with h.state.wlock:
                p = self._c_forward(s, xp, c)
        else:
            p = self._c_forward(s, xp, c)
        if p == _NULL:
            try:
                fail("%s.forward" % type(self).__name__, s.weight, xp)
            finally:
                h._cache_free(c)  # whatever a failed forward may have stored
        h.state.push((getattr(_PASS, "id", None), c, c.input.version, s.weight.version))
        return p

    def _writes_state(self):
        """Whether forward writes the layer's own tensors (then it is serialized)."""
        return False

    def _keeps_cache(self):
        """Whether forward keeps what backward needs: in training mode."""
        return self.training

    @_takes_input_grad
    def backward(self, grad_out, *, input_grad=True):
        name = type(self).__name__
        input_grad = _args.to_bool(input_grad, "input_grad")
        self._struct  # ClosedError once closed
        h = self._h
        e = h.state.take()
        if e is None:
            raise ArgumentError(
                "%s.backward: no forward pass to differentiate; call forward() in training "
                "mode (layer.train()) first" % name
            )
        done = False
        try:
            s = h.s
            if s is None:
                raise ClosedError("operation on a closed %s" % name)
            _, c, vin, vw = e
            if c.input.version != vin or s.weight.version != vw:
                raise ArgumentError(
                    "%s.backward: the %s was modified in place after the forward pass (copy_from, "
                    "an in-place method or an optimizer step), so its gradient would be wrong; "
                    "change it only after backward, or pass a clone to forward"
                    % (name, "input" if c.input.version != vin else "weight")
                )
            with _Args(name + ".backward", s.weight.dev) as a:
                gp = a.ptr(grad_out, "grad_out")
                params_only = self._c_backward_params if not input_grad else None
                with h.state.wlock:
                    db = _grad_ptr(self._bias) if self._bias is not None else _NULL
                    if params_only is not None:
                        if params_only(s, c, gp, _grad_ptr(self._weight), db) < 0:
                            fail("%s.backward" % name, s.weight, gp)
                        p = None
                    else:
                        p = self._c_backward(s, c, gp, _grad_ptr(self._weight), db)
                        if p == _NULL:
                            fail("%s.backward" % name, s.weight, gp)
                done = True
                if input_grad:
                    return _wrap(p)
                if p is not None:  # no params-only call: the dx it made anyway, unused
                    _wrap(p).close()
                return None
        finally:
            if not done:
                h.state.untake()
            h.state.leave()

    def _clear_cache(self):
        if self._h is not None:
            self._h.clear_cache()

    def close(self):
        """Free the layer's C tensors now (idempotent); its Parameters become closed. Calls in
        flight in other threads finish first."""
        if self.closed:
            return
        self._finalizer()
        for p in (self._weight, self._bias):
            if p is not None:
                p.close()

    def __repr__(self):
        if self.closed:
            return "%s(<closed>)" % type(self).__name__
        return "%s(%s, device=%r)" % (type(self).__name__, self._describe(), self.device)

    def __reduce_ex__(self, protocol):
        """copy.deepcopy and pickle: the same layer with copies of its parameters (values and
        grads), buffers (BatchNorm's running statistics), hyperparameters and train/eval mode,
        on the same device; the last forward's cache is not copied (backward needs a new
        forward). A closed layer raises ClosedError."""
        c = self._struct
        scalars, tensors = {}, {}
        for name, field in ffi.typeof(c[0]).fields:
            if field.type is _TENSOR_PTR:
                if name not in ("weight", "bias"):
                    tensors[name] = getattr(self, "_" + name)
            else:
                scalars[name] = getattr(c, name)
        return (_rebuild_clayer, (type(self), scalars, tensors, self._weight, self._bias,
                                  self.device, _public_state(self)))


class Conv2d(_CLayer):
    """x: [N, in_channels, H, W] -> [N, out_channels, Ho, Wo], Ho = (H + 2 padding - kh) // stride + 1.

    weight: [out_channels, in_channels, kh, kw], bias: [out_channels] (or None).
    """

    _c_struct = ffi.typeof("ut_conv2d *")
    _c_cache = ffi.typeof("ut_conv2d_cache *")
    _c_forward = lib.ut_conv2d_forward
    _c_backward = lib.ut_conv2d_backward
    _c_backward_params = lib.ut_conv2d_backward_params
    _c_cache_free = lib.ut_conv2d_cache_free
    _c_free = lib.ut_conv2d_free

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, bias=True,
                 device="cpu"):
        self.in_channels = _args.to_int(in_channels, "in_channels", 1)
        self.out_channels = _args.to_int(out_channels, "out_channels", 1)
        self.kernel_size = _kernel(kernel_size, "kernel_size")
        self.stride = _args.to_int(stride, "stride", 1)
        self.padding = _args.to_int(padding, "padding", 0)
        kh, kw = self.kernel_size
        _args.to_shape((self.out_channels, self.in_channels, kh, kw), "weight shape")
        super().__init__(device, lib.ut_conv2d_alloc, self.in_channels, self.out_channels, kh, kw,
                         self.stride, self.padding, _args.to_bool(bias, "bias"))

    def _describe(self):
        return "%d, %d, kernel_size=%s, stride=%d, padding=%d, bias=%s" % (
            self.in_channels, self.out_channels, self.kernel_size, self.stride, self.padding,
            self._bias is not None)


class DWConv2d(_CLayer):
    """Depthwise: x: [N, C, H, W] -> [N, out_channels, Ho, Wo], each channel with its own
    kh x kw filters, Ho = (H + 2 padding - dilation (kh - 1) - 1) // stride + 1.

    ``out_channels`` (default C) is a multiple m of C: output channel o reads input channel
    o // m (PyTorch's ``Conv2d(C, out_channels, groups=C)``, TensorFlow's ``depth_multiplier``).
    ``dilation`` spaces the filter's taps (PyTorch's argument). weight: [out_channels, kh, kw],
    bias: [out_channels] (or None).
    """

    _c_struct = ffi.typeof("ut_dwconv2d *")
    _c_cache = ffi.typeof("ut_dwconv2d_cache *")
    _c_forward = lib.ut_dwconv2d_forward
    _c_backward = lib.ut_dwconv2d_backward
    _c_cache_free = lib.ut_dwconv2d_cache_free
    _c_free = lib.ut_dwconv2d_free

    def __init__(self, channels, kernel_size, stride=1, padding=0, bias=True, device="cpu", *,
                 dilation=1, out_channels=None):
        self.channels = _args.to_int(channels, "channels", 1)
        self.kernel_size = _kernel(kernel_size, "kernel_size")
        self.stride = _args.to_int(stride, "stride", 1)
        self.padding = _args.to_int(padding, "padding", 0)
        self.dilation = _args.to_int(dilation, "dilation", 1)
        oc = self.channels if out_channels is None else _args.to_int(out_channels, "out_channels", 1)
        if oc % self.channels:
            raise ArgumentError(
                "DWConv2d: out_channels (%d) must be a multiple of channels (%d): each input "
                "channel gets out_channels // channels filters" % (oc, self.channels))
        self.out_channels = oc
        kh, kw = self.kernel_size
        _args.to_shape((oc, kh, kw), "weight shape")
        super().__init__(device, lib.ut_dwconv2d_alloc_ex, self.channels, oc // self.channels, kh,
                         kw, self.stride, self.padding, self.dilation, _args.to_bool(bias, "bias"))

    def _describe(self):
        extra = ""
        if self.out_channels != self.channels:
            extra += ", out_channels=%d" % self.out_channels
        if self.dilation != 1:
            extra += ", dilation=%d" % self.dilation
        return "%d, kernel_size=%s, stride=%d, padding=%d%s, bias=%s" % (
            self.channels, self.kernel_size, self.stride, self.padding, extra,
            self._bias is not None)

    def _state_shape(self, name, shape):
        # PyTorch's depthwise convolution is a Conv2d with groups=C: weight [out_channels, 1, kh, kw]
        return (shape[0], 1) + tuple(shape[1:]) if name == "weight" else shape


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


class LayerNorm(_CLayer):
    """x: [..., D] -> same shape, normalized over the last dimension; weight, bias: [D]."""

    _c_struct = ffi.typeof("ut_layernorm *")
    _c_cache = ffi.typeof("ut_layernorm_cache *")
    _c_forward = lib.ut_layernorm_forward
    _c_backward = lib.ut_layernorm_backward
    _c_cache_free = lib.ut_layernorm_cache_free
    _c_free = lib.ut_layernorm_free

    def __init__(self, normalized_shape, eps=1e-5, device="cpu"):
        if isinstance(normalized_shape, (tuple, list)):
            if len(normalized_shape) != 1:
                raise ArgumentError("LayerNorm normalizes over the last dimension only")
            normalized_shape = normalized_shape[0]
        self.dim = _args.to_int(normalized_shape, "normalized_shape", 1)
        self.eps = _args.to_float(eps, "eps", lo=0.0)
        super().__init__(device, lib.ut_layernorm_alloc, self.dim, self.eps)

    def _describe(self):
        return "%d, eps=%g" % (self.dim, self.eps)


class BatchNorm2d(_CLayer):
    """x: [N, C, H, W] -> same shape; weight, bias: [C].

    Training mode normalizes with the batch statistics and updates running_mean/running_var
    (running = (1 - momentum) running + momentum batch); eval mode uses the running statistics.
    Unlike the other layers, forward keeps its (small) cache in eval mode too, so backward
    works with frozen statistics (fine-tuning with a fixed normalization).

    ``activation="relu6"`` (or ``"relu"``) applies ReLU6 to the output in the same pass over the
    data, forward and backward: the same results as BatchNorm2d followed by ReLU6, with two
    fewer trips through memory per step (backward recomputes the pre-activation from the input
    it keeps anyway). Its state_dict is BatchNorm2d's.
    """

    _c_struct = ffi.typeof("ut_batchnorm2d *")
    _c_cache = ffi.typeof("ut_batchnorm2d_cache *")
    _c_forward = lib.ut_batchnorm2d_forward
    _c_backward = lib.ut_batchnorm2d_backward
    _c_cache_free = lib.ut_batchnorm2d_cache_free
    _c_free = lib.ut_batchnorm2d_free

    running_mean = _TensorField()
    running_var = _TensorField()

    _ACTIVATIONS = {None: lib.UT_ACT_NONE, "relu": lib.UT_ACT_RELU, "relu6": lib.UT_ACT_RELU6}

    def __init__(self, num_features, eps=1e-5, momentum=0.1, device="cpu", activation=None):
        if activation is not None:
            _args.to_str(activation, "activation", ("relu", "relu6"))
        self.num_features = _args.to_int(num_features, "num_features", 1)
        self.eps = _args.to_float(eps, "eps", lo=0.0)
        self.momentum = _args.to_float(momentum, "momentum", lo=0.0, hi=1.0)
        super().__init__(device, lib.ut_batchnorm2d_alloc, self.num_features, self.eps,
                         self.momentum)
        self._running_mean = Tensor._borrow(self._struct.running_mean)
        self._running_var = Tensor._borrow(self._struct.running_var)
        self._struct.training = True
        self._struct.activation = self._ACTIVATIONS[activation]

    @property
    def activation(self):
        """None, "relu" or "relu6": what forward applies to its output in the same pass."""
        code = self._struct.activation
        return next(k for k, v in self._ACTIVATIONS.items() if v == code)

    def train(self, mode=True):
        super().train(mode)
        self._struct.training = _args.to_bool(mode, "mode")
        return self

    def _keeps_cache(self):
        return True

    def _tensors(self):
        return super()._tensors() + [self._running_mean.ptr, self._running_var.ptr]

    def _writes_state(self):
        return self.training

    def close(self):
        was_open = not self.closed
        super().close()
        if was_open:
            self._running_mean.close()
            self._running_var.close()

    def _describe(self):
        act = ", activation=%r" % self.activation if self.activation else ""
        return "%d, eps=%g, momentum=%g%s" % (self.num_features, self.eps, self.momentum, act)

    # PyTorch's BatchNorm2d counts training forwards in num_batches_tracked; only its
    # momentum=None mode reads it, which this layer does not have, but the count keeps the state
    # dict's keys PyTorch's.
    num_batches_tracked = 0

    def forward(self, x):
        y = super().forward(x)
        if self.training:
            self.num_batches_tracked += 1
        return y

    def _own_buffers(self):
        self._struct
        return [("running_mean", self._running_mean), ("running_var", self._running_var)]

    def _extra_state(self):
        return [("num_batches_tracked", self.num_batches_tracked)]

    def _set_extra_state(self, name, value):
        self.num_batches_tracked = value


def _kept(x, like):
    """A Tensor with x's values for a later backward: a new reference to x's C tensor, or for an
    array-like a copy on the device of ``like`` (the op's result)."""
    if isinstance(x, Tensor):
        p = _hold(x)  # another thread may be closing x
        try:
            return Tensor._borrow(p)
        finally:
            _let_go(p)
    return Tensor(_args.to_float_array(x), like.device)


def _drop_kept(entry):
    t = entry[1]
    if isinstance(t, Tensor):
        t.close()


class _Stateless(Module):
    """A layer without parameters; forward keeps its input (its own reference) for backward."""

    _op = _bwd_op = None

    def __init__(self):
        self._state = _State(_drop_kept)

    @property
    def device(self):
        return None

    def __call__(self, x):
        return self.forward(x)

    def forward(self, x):
        y = self._op(x)
        if self.training:
            self._state.push((getattr(_PASS, "id", None),) + self._keep(x, y))
        return y

    def _keep(self, x, y):
        """What backward needs: (input, its version now)."""
        t = _kept(x, y)
        return t, t._ptr.version

    def _take(self):
        e = self._state.take()
        if e is None:
            raise ArgumentError(
                "%s.backward: no forward pass to differentiate; call forward() in training "
                "mode first" % type(self).__name__
            )
        return e

    @_takes_input_grad
    def backward(self, grad_out, *, input_grad=True):
        input_grad = _args.to_bool(input_grad, "input_grad")
        _, kept, version = self._take()
        done = False
        try:
            # without input_grad dx is still computed (and freed): it is all these layers do,
            # and computing it keeps every check on grad_out
            dx = self._backward_from(grad_out, kept, version)
            done = True
            if input_grad:
                return dx
            if dx is not grad_out:
                dx.close()
            return None
        finally:
            if not done:  # refused: the walk over the kept forwards stays where it was
                self._state.untake()
            self._state.leave()

    def _backward_from(self, grad_out, t, version):
        """dx from grad_out and what _keep kept."""
        if t._ptr.version != version:
            raise ArgumentError(
                "%s.backward: the input was modified in place after the forward pass "
                "(copy_from or an in-place method), so its gradient would be wrong; change it "
                "only after backward, or pass a clone to forward" % type(self).__name__
            )
        return self._bwd_op(grad_out, t)

    def _clear_cache(self):
        self._state.clear()

    def __repr__(self):
        return "%s()" % type(self).__name__

    def __reduce_ex__(self, protocol):
        # the kept input is not copied: backward needs a new forward
        return (_rebuild_module, (type(self), _Stateless, (), _public_state(self)))


class ReLU(_Stateless):
    """max(x, 0), any shape."""

    _op = staticmethod(_F.relu)
    _bwd_op = staticmethod(_F.relu_backward)


class ReLU6(_Stateless):
    """min(max(x, 0), 6), any shape."""

    _op = staticmethod(_F.relu6)
    _bwd_op = staticmethod(_F.relu6_backward)


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


class Sequential(Module):
    """Layers applied in order; backward walks them in reverse.

    Intermediate activations and gradients are freed as soon as they are passed on.
    """

    def __init__(self, *layers):
        if len(layers) == 1 and isinstance(layers[0], (list, tuple)):
            layers = tuple(layers[0])
        for i, l in enumerate(layers):
            if not isinstance(l, Module):
                raise ArgumentTypeError(
                    "Sequential: item %d is a %s, not a layer" % (i, type(l).__name__)
                )
        self.layers = list(layers)

    def __len__(self):
        return len(self.layers)

    def __getitem__(self, i):
        return self.layers[i]

    def __iter__(self):
        return iter(self.layers)

    def named_children(self):
        for i, l in enumerate(self.layers):
            yield str(i), l

    def _chain(self, x, steps):
        cur = x
        for step in steps:
            nxt = step(cur)
            # a layer may hand back its input (an identity): that is the next value, kept open
            if cur is not x and cur is not nxt and isinstance(cur, Tensor):
                cur.close()
            cur = nxt
        return cur

    def forward(self, x):
        # one outer call even when forward is called directly: layers used twice keep both uses
        return _in_pass(self._chain, (x, [l.forward for l in self.layers]))

    @_takes_input_grad
    def backward(self, grad_out, *, input_grad=True):
        """Each layer's backward, last first; with ``input_grad=False`` the first layer's
        gets it too (every other layer's dx is the next one's grad_out) and None is returned."""
        steps = [l.backward for l in reversed(self.layers)]
        if not _args.to_bool(input_grad, "input_grad"):
            if steps:
                first = self.layers[0]
                steps[-1] = lambda g: _backward_params_only(first, g)
            self._chain(grad_out, steps)
            return None
        return self._chain(grad_out, steps)

    def train(self, mode=True):
        self.training = _args.to_bool(mode, "mode")
        for l in self.layers:
            l.train(mode)
        return self

    def to(self, device):
        for l in self.layers:
            l.to(device)
        return self

    def close(self):
        for l in self.layers:
            l.close()

    def __reduce_ex__(self, protocol):
        # a layer that appears twice stays one layer in the copy (copy's and pickle's memo)
        state = _public_state(self)
        return (_rebuild_module, (type(self), Sequential, (state.pop("layers"),), state))

    def __repr__(self):
        # a child printed on several lines (a Residual, a nested Sequential) is indented whole
        inner = "".join("\n  (%d): %s" % (i, repr(l).replace("\n", "\n  "))
                        for i, l in enumerate(self.layers))
        return "Sequential(%s\n)" % inner if inner else "Sequential()"


class _Loss:
    """A loss with backward: ``loss = crit(pred, target)`` then ``grad = crit.backward()``."""

    _fwd = _bwd = None

    def __init__(self):
        self._saved = None

    def __call__(self, pred, target):
        return self.forward(pred, target)

    def forward(self, pred, target):
        out = self._fwd(pred, target)
        self.close()
        keep_p = _kept(pred, out)
        keep_t = _kept(target, out) if isinstance(target, Tensor) else target  # labels stay ints
        self._saved = (keep_p, keep_t)
        return out

    def __getstate__(self):
        # copy, deepcopy and pickle: the loss without the last call's saved inputs
        state = dict(vars(self))
        state["_saved"] = None
        return state

    def backward(self):
        """The gradient of the last loss with respect to ``pred``."""
        if self._saved is None:
            raise ArgumentError("%s.backward: call the loss first" % type(self).__name__)
        return self._bwd(*self._saved)

    def close(self):
        if self._saved is not None:
            for t in self._saved:
                if isinstance(t, Tensor):
                    t.close()
            self._saved = None


class MSELoss(_Loss):
    """mean((pred - target)^2); backward: 2 (pred - target) / pred.size."""

    _fwd = staticmethod(_F.mse_loss)
    _bwd = staticmethod(_F.mse_loss_backward)


class CrossEntropyLoss(_Loss):
    """Mean of -log softmax(logits)[label]; labels are integer class indices."""

    _fwd = staticmethod(_F.cross_entropy)
    _bwd = staticmethod(_F.cross_entropy_backward)

