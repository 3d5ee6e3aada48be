"""_CLayer: the base of the layers backed by a C struct (Conv2d, DWConv2d, Linear, LayerNorm,
BatchNorm2d): the struct and its forward caches (a _lifetime._Handle), the parameters as
attributes (_TensorField), forward and backward through the C calls each subclass names, and
copy/pickle (_rebuild_clayer)."""

import weakref

from .. import _args
from .._errors import ArgumentError, ArgumentTypeError, ClosedError, check
from .._lib import ffi, lib
from .._lifetime import _PASS, _Handle, _hold, _let_go
from ..functional import _Args, fail
from ..tensor import Tensor, zeros
from .module import Module, _layer_device, _public_state, _takes_input_grad
from .parameter import _param

_wrap = Tensor._wrap
_NULL = ffi.NULL


def _grad_ptr(p):
    """``p.grad``'s C tensor; a grad that is None ("no gradient yet") becomes a zero tensor."""
    if p.grad is None:
        p.grad = zeros(p.shape, p.device)
    return p.grad.ptr


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
        e = h.state.take_for(name)
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
