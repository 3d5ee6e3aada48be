"""Optimizers: update parameters in place from their ``grad`` on the parameters' device.

State (SGD velocity, Adam moments) lives in C tensors next to each parameter, so a step does no
host round trip. If a parameter is moved to another device, its state follows at the next step.
A parameter whose ``grad`` is None ("no gradient yet", as after ``zero_grad(set_to_none=True)``)
is skipped by ``step()``, its state untouched, as in PyTorch.

Hyperparameters are checked as the float32 values the C library computes with (a beta that
rounds to 1.0 in float32 is refused when the optimizer is made, not at the first step).

Copies: ``copy.copy(opt)`` is an optimizer of the same kind over the SAME parameter objects with
its own copy of the state. ``copy.deepcopy`` and ``pickle`` copy the parameters too, through the
memo: ``copy.deepcopy((model, opt))`` or ``pickle.dumps((model, opt))`` gives an optimizer bound
to the copied model's parameters (as PyTorch does); an optimizer copied alone gets standalone
copies of its parameters. A closed optimizer raises ClosedError.
"""

import copy

import numpy as np

from . import _args
from . import functional as _F
from ._errors import ArgumentError, ArgumentTypeError, ClosedError, DeviceError, ShapeError, check
from ._lib import lib
from .layers import Module, Parameter
from .tensor import Tensor, zeros

__all__ = ["Optimizer", "SGD", "Adam"]


class Optimizer:
    def __init__(self, params, lr):
        if isinstance(params, Module):
            params = params.parameters()
        try:
            params = list(params)
        except TypeError:
            raise ArgumentTypeError(
                "params must be an iterable of Parameters (e.g. model.parameters())"
            ) from None
        if not params:
            raise ArgumentError("the optimizer got an empty parameter list")
        for i, p in enumerate(params):
            if not isinstance(p, Parameter):
                raise ArgumentTypeError(
                    "params[%d] is a %s, not a Parameter (pass model.parameters())"
                    % (i, type(p).__name__)
                )
        # One entry per parameter object: a layer used twice (Sequential(l, ReLU(), l)) lists
        # its parameters twice, and stepping them twice per step() would double the update.
        seen = set()
        self.params = [p for p in params if not (id(p) in seen or seen.add(id(p)))]
        self.lr = _args.to_float32(lr, "lr", lo=0.0)
        self._state = [None] * len(self.params)
        self._closed = False
        self.t = 0  # steps taken

    # The state tensors each parameter has (SGD: velocity if momentum; Adam: m, v).
    _slot_count = 0

    def _check_open(self):
        if self._closed:
            raise ClosedError("operation on a closed %s" % type(self).__name__)

    def _slot(self, i, n):
        """The i-th parameter's n state tensors (zeros at first), on that parameter's device."""
        p = self.params[i]
        st = self._state[i]
        if st is None:
            st = self._state[i] = [zeros(p.shape, p.device) for _ in range(n)]
        for t in st:
            if t.ptr.dev != p.ptr.dev and lib.ut_to_device(t.ptr, p.ptr.dev) < 0:
                check("%s state to %s" % (type(self).__name__, p.device))
        return st

    def state_dict(self):
        """The optimizer's state as numpy copies: ``{"step": int, "state": [[array, ...], ...]}``.

        ``state[i]`` holds parameter i's state arrays (SGD: [velocity] with momentum, else [];
        Adam: [m, v]), each of the parameter's shape; state not created yet is zeros, which is
        what the optimizer starts from. Hyperparameters (lr, ...) are not included.
        """
        self._check_open()
        n = self._slot_count
        state = []
        for i, p in enumerate(self.params):
            st = self._state[i]
            if n == 0:
                state.append([])
            elif st is None:
                state.append([np.zeros(p.shape, np.float32) for _ in range(n)])
            else:
                state.append([np.array(t.numpy(), dtype=np.float32, copy=True) for t in st])
        return {"step": int(self.t), "state": state}

    def load_state_dict(self, state_dict):
        """Restore what state_dict() returned (for the same parameters, in the same order).

        Everything is checked before anything changes: ArgumentError (ArgumentTypeError) for a
        malformed dict, ShapeError for a count or shape that does not match the parameters.
        """
        self._check_open()
        name = "%s.load_state_dict" % type(self).__name__
        if not isinstance(state_dict, dict):
            raise ArgumentTypeError("%s: expected a dict, got %s" % (name, type(state_dict).__name__))
        missing = [k for k in ("step", "state") if k not in state_dict]
        if missing:
            raise ArgumentError("%s: the dict has no %s" % (name, " or ".join(repr(k) for k in missing)))
        step = _args.to_int(state_dict["step"], "%s: step" % name, 0)
        state = state_dict["state"]
        if not isinstance(state, (list, tuple)):
            raise ArgumentTypeError("%s: 'state' must be a list (one entry per parameter), got %s"
                                    % (name, type(state).__name__))
        if len(state) != len(self.params):
            raise ShapeError("%s: 'state' has %d entries, the optimizer has %d parameters"
                             % (name, len(state), len(self.params)))
        n = self._slot_count
        arrays = []
        for i, (entry, p) in enumerate(zip(state, self.params)):
            if not isinstance(entry, (list, tuple)):
                raise ArgumentTypeError("%s: state[%d] must be a list of arrays, got %s"
                                        % (name, i, type(entry).__name__))
            if len(entry) != n:
                raise ShapeError("%s: state[%d] has %d arrays, %s keeps %d per parameter"
                                 % (name, i, len(entry), type(self).__name__, n))
            row = []
            for j, a in enumerate(entry):
                a = _args.to_float_array(a, "%s: state[%d][%d]" % (name, i, j))
                if a.shape != p.shape:
                    raise ShapeError("%s: state[%d][%d] has shape %s, the parameter %s"
                                     % (name, i, j, a.shape, p.shape))
                row.append(a)
            arrays.append(row)
        for i, row in enumerate(arrays):
            if row:
                for t, a in zip(self._slot(i, n), row):
                    t.copy_from(a)
        self.t = step

    def zero_grad(self, set_to_none=False):
        """Zero each parameter's grad, or with ``set_to_none=True`` drop it (None: "no gradient
        yet"; the next backward allocates a fresh one, and step() skips the parameter until then)."""
        self._check_open()
        from .layers import _zero_grads

        _zero_grads(self.params, set_to_none)

    def __copy__(self):
        self._check_open()
        new = type(self).__new__(type(self))
        new.__dict__.update(self.__dict__)
        new.params = list(self.params)
        new._state = [None if st is None else [t.clone() for t in st] for st in self._state]
        for k, v in self.__dict__.items():
            if isinstance(v, list) and k not in ("params", "_state"):
                new.__dict__[k] = list(v)
        return new

    def __getstate__(self):
        # deepcopy and pickle (parameters and state included, see the module doc)
        self._check_open()
        return dict(self.__dict__)

    def step(self):
        raise NotImplementedError

    def _stepping(self):
        """The indices of the parameters step() updates (grad not None), each checked first, so
        that a step that raises has changed nothing (no parameter updated, no count advanced)."""
        self._check_open()
        name = "%s.step" % type(self).__name__
        out = []
        for i, p in enumerate(self.params):
            g = p.grad
            if g is None:
                continue
            if not isinstance(g, Tensor):
                raise ArgumentTypeError("%s: params[%d].grad is a %s, not a Tensor (or None)"
                                        % (name, i, type(g).__name__))
            if p.closed or g.closed:
                raise ClosedError("%s: params[%d]%s is closed" % (name, i, "" if p.closed else ".grad"))
            if g.shape != p.shape:
                raise ShapeError("%s: params[%d].grad has shape %s, the parameter %s"
                                 % (name, i, g.shape, p.shape))
            if g.ptr.dev != p.ptr.dev:
                raise DeviceError("%s: params[%d].grad is on %s, the parameter on %s"
                                  % (name, i, g.device, p.device))
            out.append(i)
        return out

    def close(self):
        """Free the optimizer's state tensors now (idempotent)."""
        for st in self._state:
            for t in st or ():
                t.close()
        self._state = [None] * len(self.params)
        self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class SGD(Optimizer):
    """velocity = momentum velocity + grad; param -= lr velocity (momentum 0: param -= lr grad)."""

    def __init__(self, params, lr=0.01, momentum=0.0):
        super().__init__(params, lr)
        self.momentum = _args.to_float32(momentum, "momentum", lo=0.0)

    @property
    def _slot_count(self):
        return 1 if self.momentum != 0.0 else 0

    def step(self):
        for i in self._stepping():
            p = self.params[i]
            v = self._slot(i, 1)[0] if self.momentum != 0.0 else None
            _F.sgd_step(p, p.grad, v, self.lr, self.momentum)
        self.t += 1

    def __repr__(self):
        return "SGD(lr=%g, momentum=%g, %d params)" % (self.lr, self.momentum, len(self.params))


class Adam(Optimizer):
    """Adam with bias correction (Kingma & Ba); m and v start at zero."""

    _slot_count = 2

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8):
        super().__init__(params, lr)
        try:
            b1, b2 = betas
        except (TypeError, ValueError):
            raise ArgumentError("betas must be a pair (beta1, beta2), got %r" % (betas,)) from None
        self.betas = (_args.to_float32(b1, "beta1", lo=0.0, below=1.0),
                      _args.to_float32(b2, "beta2", lo=0.0, below=1.0))
        self.eps = _args.to_float32(eps, "eps", lo=0.0)
        # Per-parameter update counts for the bias correction: a parameter skipped while its
        # grad was None starts its correction at 1 when it first gets one (as in PyTorch).
        self._steps = [0] * len(self.params)

    def step(self):
        todo = self._stepping()
        if self.t >= _args.INT_MAX:
            raise ArgumentError("Adam: step count overflow")
        self.t += 1
        b1, b2 = self.betas
        steps = self._steps
        for i in todo:
            p = self.params[i]
            m, v = self._slot(i, 2)
            _F.adam_step(p, p.grad, m, v, steps[i] + 1, self.lr, b1, b2, self.eps)
            steps[i] += 1

    def state_dict(self):
        """As Optimizer.state_dict, plus ``"param_steps"``: each parameter's update count (its
        bias correction; below "step" for a parameter skipped while its grad was None)."""
        sd = super().state_dict()
        sd["param_steps"] = list(self._steps)
        return sd

    def load_state_dict(self, state_dict):
        """As Optimizer.load_state_dict; without ``"param_steps"`` every parameter's update
        count is ``"step"``."""
        steps = state_dict.get("param_steps") if isinstance(state_dict, dict) else None
        if steps is not None:
            name = "Adam.load_state_dict"
            if not isinstance(steps, (list, tuple)) or len(steps) != len(self.params):
                raise ArgumentError("%s: 'param_steps' must be a list of %d integers"
                                    % (name, len(self.params)))
            hi = _args.to_int(state_dict.get("step", 0), "%s: step" % name, 0)
            steps = [_args.to_int(n, "%s: param_steps[%d]" % (name, i), 0, hi)
                     for i, n in enumerate(steps)]
        super().load_state_dict(state_dict)
        self._steps = list(steps) if steps is not None else [self.t] * len(self.params)

    def __repr__(self):
        return "Adam(lr=%g, betas=%r, eps=%g, %d params)" % (
            self.lr, self.betas, self.eps, len(self.params))
