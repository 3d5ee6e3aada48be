"""Containers: Sequential, layers applied in order.

Children are named "0", "1", ... or, built from an OrderedDict as torch's
``nn.Sequential(OrderedDict([("conv", c), ("bn", b)]))``, by its keys: the names prefix the
state_dict keys ("conv.weight") and read as attributes (``seq.conv``). Names may skip indices
("0", "2", "3": a torchvision layout without its parameterless modules)."""

from collections import OrderedDict

from .. import _args
from .._errors import ArgumentError, ArgumentTypeError
from .._lifetime import _in_pass
from .fold import kept_fold_steps
from ..tensor import Tensor
from .module import Module, _backward_params_only, _public_state, _rebuild_module, _takes_input_grad

__all__ = ["Sequential"]


class Sequential(Module):
    """Layers applied in order; backward walks them in reverse.

    Intermediate activations and gradients are freed as soon as they are passed on.
    ``Sequential(l0, l1)``, ``Sequential([l0, l1])`` or ``Sequential(OrderedDict(name=l))``
    (any dict: its keys name the children; indexing stays positional, as torch's).
    """

    _folds_through = True  # fold.py looks through a plain Sequential for a separable chain

    def __init__(self, *layers):
        names = None
        if len(layers) == 1 and isinstance(layers[0], dict):
            names = [_child_name(k) for k in layers[0]]
            layers = tuple(layers[0].values())
        elif len(layers) == 1 and isinstance(layers[0], (list, tuple)):
            layers = tuple(layers[0])
        for i, l in enumerate(layers):
            if not isinstance(l, Module):
                raise ArgumentTypeError(
                    "Sequential: item %s is a %s, not a layer"
                    % (names[i] if names else i, type(l).__name__)
                )
        self.layers = list(layers)
        # None: the default names "0", "1", ... (kept None so appending to layers still works)
        self._names = names if names is not None and names != _index_names(len(layers)) else None

    def __getattr__(self, name):
        # only called when ordinary lookup fails: a child named like an attribute (seq.features);
        # one named as an attribute Sequential has (layers, training) is reached by index only
        names = self.__dict__.get("_names")
        if names is not None and name in names and not name.startswith("__"):
            return self.__dict__["layers"][names.index(name)]
        raise AttributeError("%r object has no attribute %r" % (type(self).__name__, name))

    def _child_names(self):
        names = self.__dict__.get("_names")
        if names is None or len(names) != len(self.layers):
            return _index_names(len(self.layers))
        return names

    def __len__(self):
        return len(self.layers)

    def __getitem__(self, i):
        return self.layers[i]

    def __iter__(self):
        return iter(self.layers)

    def named_children(self):
        yield from zip(self._child_names(), self.layers)

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
        # one outer call even when forward is called directly: layers used twice keep both uses;
        # in eval mode a convolution and the BatchNorm2d after it run as one step (fold.py)
        return _in_pass(self._chain, (x, kept_fold_steps(self, self.layers)))

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

    def _clear_cache(self):
        # a block's _clear_cache (CNBlock's, InvertedResidual's) reaches its layers through here
        for l in self.layers:
            l._clear_cache()

    def close(self):
        for l in self.layers:
            l.close()

    def __reduce_ex__(self, protocol):
        # a layer that appears twice stays one layer in the copy (copy's and pickle's memo)
        state = _public_state(self)
        layers = state.pop("layers")
        if self.__dict__.get("_names") is not None:
            layers = OrderedDict(zip(self._child_names(), layers))
        return (_rebuild_module, (type(self), Sequential, (layers,), state))

    def __repr__(self):
        # a child printed on several lines (a Residual, a nested Sequential) is indented whole
        inner = "".join("\n  (%s): %s" % (k, repr(l).replace("\n", "\n  "))
                        for k, l in self.named_children())
        return "Sequential(%s\n)" % inner if inner else "Sequential()"


def _index_names(n):
    return [str(i) for i in range(n)]


def _child_name(key):
    if not isinstance(key, str):
        raise ArgumentTypeError("Sequential: child names must be strings, got %r" % (key,))
    if not key or "." in key:
        raise ArgumentError("Sequential: a child name must be non-empty and without '.', got %r"
                            % key)
    return key
