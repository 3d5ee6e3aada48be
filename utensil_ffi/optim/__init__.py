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

from .. import _args
from .. import functional as _F
from .._errors import ArgumentError, ArgumentTypeError, ClosedError, DeviceError, ShapeError, check
from .._lib import lib
from ..nn.module import Module
from ..nn.parameter import Parameter
from ..tensor import Tensor, zeros

__all__ = ["Optimizer", "SGD", "Adam", "AdamW", "lr_scheduler", "swa_utils"]


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
        self.initial_lr = None  # PyTorch's group["initial_lr"]: set by an lr_scheduler
        self._state = [None] * len(self.params)
        self._closed = False
        self.t = 0  # steps taken

    # The names of the state tensors each parameter has, PyTorch's (SGD: momentum_buffer if
    # momentum; Adam: exp_avg, exp_avg_sq).
    _slot_names = ()
    initial_lr = None  # what an optimizer pickled before issue 30 has

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
        initial = group.get("initial_lr")
        if initial is not None:
            initial = _args.to_lr(initial, "%s: initial_lr" % name)

        def apply():
            self.lr = lr
            if initial is not None:
                self.initial_lr = initial
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
        if getattr(self, "initial_lr", None) is not None:  # an lr_scheduler's, as in PyTorch
            group["initial_lr"] = float(self.initial_lr)
        group["params"] = list(range(len(self.params)))
        return {"state": state, "param_groups": [group]}

    def load_state_dict(self, state_dict):
        """Restore a state_dict() (this class's or PyTorch's optimizer of the same kind), for
        the same parameters in the same order; the hyperparameters come from the dict.

        Everything is checked before anything changes: ArgumentError (ArgumentTypeError) for a
        malformed dict or a PyTorch feature utensil does not have (AMSGrad, maximize), ShapeError for a count or shape that does not match the parameters.
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
        from ..nn.module import _zero_grads

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
    """torch.optim.SGD: d = grad + weight_decay param; with momentum the buffer is d at the
    first step, then momentum buf + (1 - dampening) d; d = d + momentum buf (nesterov) or buf;
    param -= lr d. The arithmetic is one C call per step (ut_sgd_step_many_ex)."""

    # what an SGD pickled before issue 30 has (its __dict__ comes back without them)
    dampening, weight_decay, nesterov = 0.0, 0.0, False

    def __init__(self, params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0,
                 nesterov=False):
        super().__init__(params, lr)
        self.momentum, self.dampening, self.weight_decay, self.nesterov = _sgd_hyper(
            momentum, dampening, weight_decay, nesterov, "SGD")

    @property
    def _slot_names(self):
        return ("momentum_buffer",) if self.momentum != 0.0 else ()

    def _slots_for(self, group):
        return ("momentum_buffer",) if group.get("momentum", self.momentum) != 0.0 else ()

    def _group(self):
        return {"lr": float(self.lr), "momentum": float(self.momentum),
                "dampening": float(self.dampening), "weight_decay": float(self.weight_decay),
                "nesterov": bool(self.nesterov), "maximize": False}

    def _set_group(self, group, name):
        _unsupported(group, name, maximize=False)
        set_lr = super()._set_group(group, name)
        hyper = _sgd_hyper(group.get("momentum", self.momentum),
                           group.get("dampening", self.dampening),
                           group.get("weight_decay", self.weight_decay),
                           group.get("nesterov", self.nesterov), name)

        def apply():
            set_lr()
            self.momentum, self.dampening, self.weight_decay, self.nesterov = hyper
        return apply

    def step(self):
        todo = self._stepping()
        kw = dict(lr=self.lr, momentum=self.momentum, dampening=self.dampening,
                  weight_decay=self.weight_decay, nesterov=self.nesterov)
        if self.momentum == 0.0:
            ps = [self.params[i] for i in todo]
            _F.sgd_step_many(ps, [p.grad for p in ps], None, **kw)
        else:
            # PyTorch's first step sets the buffer to d itself (no dampening): a fresh, zeroed
            # buffer with dampening 0 gives exactly that, so the fresh ones go in a call of their own
            fresh = [i for i in todo if self._state[i] is None]
            old = [i for i in todo if self._state[i] is not None]
            for group, damp in ((old, self.dampening), (fresh, 0.0)):
                if not group:
                    continue
                ps = [self.params[i] for i in group]
                vs = [self._slot(i, 1)[0] for i in group]
                kw["dampening"] = damp
                _F.sgd_step_many(ps, [p.grad for p in ps], vs, **kw)
        self.t += 1

    def __repr__(self):
        extra = "".join(", %s=%r" % (k, getattr(self, k)) for k in
                        ("dampening", "weight_decay", "nesterov") if getattr(self, k))
        return "SGD(lr=%g, momentum=%g%s, %d params)" % (self.lr, self.momentum, extra,
                                                        len(self.params))


def _sgd_hyper(momentum, dampening, weight_decay, nesterov, name):
    """SGD's hyperparameters checked with PyTorch's rules and messages."""
    momentum = _args.to_float32(momentum, "%s: momentum" % name)
    if momentum < 0:
        raise ArgumentError("Invalid momentum value: %r" % (momentum,))
    dampening = _args.to_float32(dampening, "%s: dampening" % name)
    weight_decay = _args.to_weight_decay(weight_decay, "%s: weight_decay" % name)
    nesterov = _args.to_bool(nesterov, "%s: nesterov" % name)
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ArgumentError("Nesterov momentum requires a momentum and zero dampening")
    return momentum, dampening, weight_decay, nesterov


class Adam(Optimizer):
    """torch.optim.Adam: bias-corrected moments (Kingma & Ba), m and v starting at zero;
    weight_decay adds weight_decay param to the gradient (L2), or with
    decoupled_weight_decay=True (AdamW) multiplies param by 1 - lr weight_decay first."""

    _slot_names = ("exp_avg", "exp_avg_sq")
    _decoupled_default = False
    weight_decay, decoupled_weight_decay = 0.0, False  # an Adam pickled before issue 30

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, *,
                 decoupled_weight_decay=None):
        super().__init__(params, lr)
        if decoupled_weight_decay is None:
            decoupled_weight_decay = self._decoupled_default
        self.betas, self.eps, self.weight_decay, self.decoupled_weight_decay = _adam_hyper(
            betas, eps, weight_decay, decoupled_weight_decay, type(self).__name__)
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
            _F.adam_step(p, p.grad, m, v, steps[i] + 1, self.lr, b1, b2, self.eps,
                         self.weight_decay, self.decoupled_weight_decay)
            steps[i] += 1

    def _group(self):
        return {"lr": float(self.lr), "betas": tuple(float(b) for b in self.betas),
                "eps": float(self.eps), "weight_decay": float(self.weight_decay),
                "amsgrad": False, "maximize": False,
                "decoupled_weight_decay": bool(self.decoupled_weight_decay)}

    def _set_group(self, group, name):
        _unsupported(group, name, amsgrad=False, maximize=False)
        set_lr = super()._set_group(group, name)
        hyper = _adam_hyper(group.get("betas", self.betas), group.get("eps", self.eps),
                            group.get("weight_decay", self.weight_decay),
                            group.get("decoupled_weight_decay", self.decoupled_weight_decay), name)

        def apply():
            set_lr()
            self.betas, self.eps, self.weight_decay, self.decoupled_weight_decay = hyper
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
        wd = ", weight_decay=%g" % self.weight_decay if self.weight_decay else ""
        return "%s(lr=%g, betas=%r, eps=%g%s, %d params)" % (
            type(self).__name__, self.lr, self.betas, self.eps, wd, len(self.params))


class AdamW(Adam):
    """torch.optim.AdamW: Adam with decoupled weight decay (Loshchilov & Hutter): param *= 1 -
    lr weight_decay, then the Adam update; weight_decay defaults to 1e-2 as in PyTorch."""

    _decoupled_default = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
        super().__init__(params, lr, betas, eps, weight_decay, decoupled_weight_decay=True)


def _adam_hyper(betas, eps, weight_decay, decoupled, name):
    """Adam's hyperparameters checked as float32 (PyTorch's message for a negative decay)."""
    try:
        b1, b2 = betas
    except (TypeError, ValueError):
        raise ArgumentError("%s: betas must be a pair (beta1, beta2), got %r"
                            % (name, betas)) from None
    betas = (_args.to_float32(b1, "%s: beta1" % name, lo=0.0, below=1.0),
             _args.to_float32(b2, "%s: beta2" % name, lo=0.0, below=1.0))
    eps = _args.to_float32(eps, "%s: eps" % name, lo=0.0)
    weight_decay = _args.to_weight_decay(weight_decay, "%s: weight_decay" % name)
    decoupled = _args.to_bool(decoupled, "%s: decoupled_weight_decay" % name)
    return betas, eps, weight_decay, decoupled


def _unsupported(group, name, **defaults):
    """ArgumentError for a PyTorch feature a saved group turns on that utensil does not have."""
    for k, default in defaults.items():
        if k in group and group[k] != default:
            raise ArgumentError("%s: the group has %s=%r; utensil's optimizer has no %s (only "
                                "%r)" % (name, k, group[k], k, default))


# torch.optim's sub-modules (issue 30): ut.optim.lr_scheduler, ut.optim.swa_utils
from . import lr_scheduler, swa_utils  # noqa: E402  (they import nothing of this module)
