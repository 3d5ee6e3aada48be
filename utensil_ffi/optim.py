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
from .nn.module import Module
from .nn.parameter import Parameter
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
        self.lr = _args.to_lr(lr)
        self._state = [None] * len(self.params)
        self._closed = False
        self.t = 0  # steps taken

    # The names of the state tensors each parameter has, PyTorch's (SGD: momentum_buffer if
    # momentum; Adam: exp_avg, exp_avg_sq).
    _slot_names = ()

    @property
    def _slot_count(self):
        return len(self._slot_names)

    def _check_open(self):
        if self._closed:
            raise ClosedError("operation on a closed %s" % type(self).__name__)

    def _slot(self, i, n):
        """The i-th parameter's n state tensors (zeros at first), on that parameter's device."""
        p = self.params[i]
        st = self._state[i]
        if st is None:
            st = self._state[i] = [zeros(p.shape, p.device) for _ in range(n)]
        dev = p.ptr.dev
        for t in st:
            if t.ptr.dev != dev and lib.ut_to_device(t.ptr, dev) < 0:
                check("%s state to %s" % (type(self).__name__, p.device))
        return st

    # -- state dicts, in PyTorch's layout -------------------------------------------------------
    def _group(self):
        """The hyperparameters of the one parameter group, with PyTorch's names and defaults for
        the features utensil does not have (so PyTorch's optimizer loads the dict)."""
        return {"lr": float(self.lr)}

    def _set_group(self, group, name):
        """Check a saved group's hyperparameters; return a function that applies them."""
        lr = _args.to_lr(group.get("lr", self.lr), "%s: lr" % name)

        def apply():
            self.lr = lr
        return apply

    def _slots_for(self, group):
        """The state tensors' names under the hyperparameters of ``group`` (checked)."""
        return self._slot_names

    def _param_state(self, i):
        """Per-parameter state that is not a tensor (Adam: "step")."""
        return {}

    def _check_param_state(self, i, entry, name):
        return None

    def state_dict(self):
        """The state in PyTorch's layout, as numpy copies::

            {"state": {0: {"momentum_buffer": array}, ...},              # SGD with momentum
             "state": {0: {"step": array(3.), "exp_avg": array, "exp_avg_sq": array}, ...}, # Adam
             "param_groups": [{"lr": 0.01, ..., "params": [0, 1, ...]}]}

        ``state`` has an entry for each parameter (its index in ``params``) that has state, so
        none before the first step; each array has the parameter's shape and is float32 (Adam's
        ``step``: a 0-d float32, as PyTorch stores it). ``param_groups`` holds the one group's
        hyperparameters under PyTorch's names. ``torch.from_numpy`` on each array gives a dict
        the PyTorch optimizer of the same kind loads. The count ``t`` is not saved.
        """
        self._check_open()
        state = {}
        for i, st in enumerate(self._state):
            if st is None:
                continue
            entry = self._param_state(i)
            for k, t in zip(self._slot_names, st):
                entry[k] = np.array(t.numpy(), dtype=np.float32, copy=True)
            state[i] = entry
        group = self._group()
        group["params"] = list(range(len(self.params)))
        return {"state": state, "param_groups": [group]}

    def load_state_dict(self, state_dict):
        """Restore a state_dict() (this class's or PyTorch's optimizer of the same kind), for
        the same parameters in the same order; the hyperparameters come from the dict.

        Everything is checked before anything changes: ArgumentError (ArgumentTypeError) for a
        malformed dict or a PyTorch feature utensil does not have (weight decay, Nesterov,
        AMSGrad...), ShapeError for a count or shape that does not match the parameters.
        A parameter without an entry in ``state`` starts afresh, as in PyTorch.
        """
        self._check_open()
        name = "%s.load_state_dict" % type(self).__name__
        if not isinstance(state_dict, dict):
            raise ArgumentTypeError("%s: expected a dict, got %s" % (name, type(state_dict).__name__))
        missing = [k for k in ("state", "param_groups") if k not in state_dict]
        if missing:
            raise ArgumentError("%s: the dict has no %s (PyTorch's layout: {'state': {...}, "
                                "'param_groups': [...]})"
                                % (name, " or ".join(repr(k) for k in missing)))
        groups, state = state_dict["param_groups"], state_dict["state"]
        if not isinstance(groups, (list, tuple)) or len(groups) != 1 \
                or not isinstance(groups[0], dict):
            raise ArgumentError("%s: 'param_groups' must be a list of one group (a dict); "
                                "utensil optimizers have one parameter group" % name)
        if not isinstance(state, dict):
            raise ArgumentTypeError("%s: 'state' must be a dict {parameter id: {...}}, got %s"
                                    % (name, type(state).__name__))
        ids = groups[0].get("params")
        if not isinstance(ids, (list, tuple)):
            raise ArgumentError("%s: the group has no 'params' list" % name)
        if len(ids) != len(self.params):
            raise ShapeError("%s: the group has %d parameters, the optimizer has %d parameters"
                             % (name, len(ids), len(self.params)))
        index = {k: i for i, k in enumerate(ids)}
        apply_group = self._set_group(groups[0], name)
        slots = self._slots_for(groups[0])
        rows = [None] * len(self.params)
        extras = [None] * len(self.params)
        for k, entry in state.items():
            if k not in index:
                raise ArgumentError("%s: 'state' has an entry for %r, which is not in the "
                                    "group's params" % (name, k))
            i = index[k]
            if not isinstance(entry, dict):
                raise ArgumentTypeError("%s: state[%r] must be a dict, got %s"
                                        % (name, k, type(entry).__name__))
            p = self.params[i]
            row = []
            for slot in slots:
                if slot not in entry:
                    raise ArgumentError("%s: state[%r] has no %r" % (name, k, slot))
                if entry[slot] is None:  # PyTorch's SGD keeps None before momentum starts
                    row = None
                    break
                a = _args.to_float_array(entry[slot], "%s: state[%r][%r]" % (name, k, slot))
                if a.shape != p.shape:
                    raise ShapeError("%s: state[%r][%r] has shape %s, the parameter %s"
                                     % (name, k, slot, a.shape, p.shape))
                row.append(a)
            rows[i] = row if row else None
            extras[i] = self._check_param_state(i, entry, "%s: state[%r]" % (name, k))
        apply_group()
        for i, row in enumerate(rows):
            if row is None:
                for t in self._state[i] or ():
                    t.close()
                self._state[i] = None
            else:
                for t, a in zip(self._slot(i, len(row)), row):
                    t.copy_from(a)
        self._set_param_states(extras)

    def _set_param_states(self, extras):
        pass

    def zero_grad(self, set_to_none=False):
        """Zero each parameter's grad, or with ``set_to_none=True`` drop it (None: "no gradient
        yet"; the next backward allocates a fresh one, and step() skips the parameter until then)."""
        self._check_open()
        from .nn.module import _zero_grads

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
        for i, p in enumerate(self.params):  # on every step: kept to cheap reads
            g = p.grad
            if g is None:
                continue
            if not isinstance(g, Tensor):
                raise ArgumentTypeError("%s: params[%d].grad is a %s, not a Tensor (or None)"
                                        % (name, i, type(g).__name__))
            pp, gp = getattr(p, "_ptr", None), getattr(g, "_ptr", None)
            if pp is None or gp is None:
                raise ClosedError("%s: params[%d]%s is closed" % (name, i, "" if pp is None else ".grad"))
            if g.shape != p.shape:
                raise ShapeError("%s: params[%d].grad has shape %s, the parameter %s"
                                 % (name, i, g.shape, p.shape))
            if gp.dev != pp.dev:
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
    def _slot_names(self):
        return ("momentum_buffer",) if self.momentum != 0.0 else ()

    def _slots_for(self, group):
        return ("momentum_buffer",) if group.get("momentum", self.momentum) != 0.0 else ()

    def _group(self):
        return {"lr": float(self.lr), "momentum": float(self.momentum), "dampening": 0,
                "weight_decay": 0, "nesterov": False, "maximize": False}

    def _set_group(self, group, name):
        _unsupported(group, name, dampening=0, weight_decay=0, nesterov=False, maximize=False)
        set_lr = super()._set_group(group, name)
        momentum = _args.to_float32(group.get("momentum", self.momentum), "%s: momentum" % name,
                                    lo=0.0)

        def apply():
            set_lr()
            self.momentum = momentum
        return apply

    def step(self):
        todo = self._stepping()
        ps = [self.params[i] for i in todo]
        vs = [self._slot(i, 1)[0] for i in todo] if self.momentum != 0.0 else None
        _F.sgd_step_many(ps, [p.grad for p in ps], vs, self.lr, self.momentum)
        self.t += 1

    def __repr__(self):
        return "SGD(lr=%g, momentum=%g, %d params)" % (self.lr, self.momentum, len(self.params))


class Adam(Optimizer):
    """Adam with bias correction (Kingma & Ba); m and v start at zero."""

    _slot_names = ("exp_avg", "exp_avg_sq")

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

    def _group(self):
        return {"lr": float(self.lr), "betas": tuple(float(b) for b in self.betas),
                "eps": float(self.eps), "weight_decay": 0, "amsgrad": False, "maximize": False}

    def _set_group(self, group, name):
        _unsupported(group, name, weight_decay=0, amsgrad=False, maximize=False)
        set_lr = super()._set_group(group, name)
        betas = group.get("betas", self.betas)
        try:
            b1, b2 = betas
        except (TypeError, ValueError):
            raise ArgumentError("%s: betas must be a pair, got %r" % (name, betas)) from None
        betas = (_args.to_float32(b1, "%s: beta1" % name, lo=0.0, below=1.0),
                 _args.to_float32(b2, "%s: beta2" % name, lo=0.0, below=1.0))
        eps = _args.to_float32(group.get("eps", self.eps), "%s: eps" % name, lo=0.0)

        def apply():
            set_lr()
            self.betas, self.eps = betas, eps
        return apply

    # Each parameter's update count is its "step" (its bias correction): below the optimizer's
    # count for a parameter skipped while its grad was None.
    def _param_state(self, i):
        return {"step": np.array(self._steps[i], dtype=np.float32)}

    def _check_param_state(self, i, entry, name):
        if "step" not in entry:
            raise ArgumentError("%s has no 'step'" % name)
        a = np.asarray(entry["step"])
        if a.size != 1 or a.dtype.kind not in "iuf" or not np.isfinite(a).all() \
                or float(a.reshape(())) != int(a.reshape(())):
            raise ArgumentError("%s: 'step' must be a whole number, got %r" % (name, entry["step"]))
        return _args.to_int(int(a.reshape(())), "%s: step" % name, 0)

    def _set_param_states(self, steps):
        self._steps = [n or 0 for n in steps]
        self.t = max(self._steps)

    def __repr__(self):
        return "Adam(lr=%g, betas=%r, eps=%g, %d params)" % (
            self.lr, self.betas, self.eps, len(self.params))


def _unsupported(group, name, **defaults):
    """ArgumentError for a PyTorch feature a saved group turns on that utensil does not have."""
    for k, default in defaults.items():
        if k in group and group[k] != default:
            raise ArgumentError("%s: the group has %s=%r; utensil's optimizer has no %s (only "
                                "%r)" % (name, k, group[k], k, default))
