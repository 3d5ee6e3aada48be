"""Containers: Sequential, layers applied in order."""

from .. import _args
from .._errors import ArgumentTypeError
from .._lifetime import _in_pass
from ..tensor import Tensor
from .module import Module, _backward_params_only, _public_state, _rebuild_module, _takes_input_grad

__all__ = ["Sequential"]


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
