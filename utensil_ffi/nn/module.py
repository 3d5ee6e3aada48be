"""Module, the base of every layer: explicit forward and backward (no autograd tape).

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
model or a layer again) drops what the earlier one kept, so memory stays bounded. By default
the entries outlive backward (a backward can be repeated: the gradients add up again), so a
network's activations stay allocated between training steps; ``ut.set_retain_forward(False)``
frees each layer's entries once its backward has walked them (PyTorch's retain_graph=False):
the same gradients, the step's peak lower by the backward's temporaries, nothing held between
steps (ut.live_bytes counts it; tests/test_forward_memory.py). Call a Module
(``net(x)``) rather than ``net.forward(x)`` so its layers know they are inside one call. Backward
refuses (ArgumentError) when the input its forward saw, or the layer's weight, was changed in
place since (a version counter on every C tensor, bumped by every library write, copy_from and
in-place method); writes through a numpy() or DLPack view are not tracked.

Threads: a layer (or network) may be used from several threads at once. Eval-mode forwards run in
parallel and give the results of a serial run; training-mode forwards keep a cache per thread, so
each thread's backward differentiates its own forward; backward passes (which accumulate into
``p.grad``) and BatchNorm2d's training forward (which updates the running statistics) are
serialized per layer. ``close()`` from another thread waits for the calls in flight to finish.

Here: Module (call, backward, parameters, named_*, state_dict / load_state_dict with PyTorch's
keys, train/eval, to, close, copy), the input_grad protocol (_takes_input_grad,
_backward_params_only), _Wrapper (a module around one child: MixedPrecision, Residual) and
_Stateless (a layer without parameters: activations, pooling). The C-struct layers' base is
_clayer.py, the layers are one family a module (conv, linear, norm, activation, pooling,
container, loss); how the caches and the threads are kept apart is _lifetime.py's.
"""

import copy
import inspect
import weakref

import numpy as np

from .. import _args
from .. import dtypes as _dtypes
from .._errors import ArgumentError, ArgumentTypeError, ShapeError
from .._lifetime import _PASS, _State, _hold, _in_pass, _let_go
from ..tensor import Tensor

__all__ = ["Module"]


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
        return self._state.take_for(type(self).__name__)

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
