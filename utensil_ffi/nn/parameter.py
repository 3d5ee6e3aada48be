"""Parameter: a layer's trainable tensor, with the ``grad`` its backward passes accumulate into."""

import copy

from .. import _args
from .._errors import ArgumentTypeError, DeviceError, ShapeError, check_ptr
from .._lib import lib
from .._lifetime import _hold, _let_go
from ..tensor import Tensor, _track_writes, zeros

__all__ = ["Parameter"]


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
            _track_writes(new._ptr)
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
