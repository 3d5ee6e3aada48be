"""Optimizers: update parameters in place from their ``grad`` on the parameters' device.

State (SGD velocity, Adam moments) lives in C tensors next to each parameter, so a step does no
host round trip. If a parameter is moved to another device, its state follows at the next step.
A parameter whose ``grad`` is None ("no gradient yet", as after ``zero_grad(set_to_none=True)``)
is skipped by ``step()``, its state untouched, as in PyTorch.

Parameter groups, as PyTorch's ``param_groups``: ``params`` is either an iterable of Parameters
(one group) or of dicts ``{"params": [...], "weight_decay": 0.0, ...}``, each a group whose
missing hyperparameters take the constructor's values (``opt.defaults``)::

    decay, no_decay = ...   # e.g. BatchNorm weights and all biases in no_decay
    opt = ut.SGD([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}],
                 lr=0.1, momentum=0.9, weight_decay=1e-4)
    opt.param_groups[1]["lr"] = 0.01   # honoured by the next step(), as in PyTorch

Each group in ``opt.param_groups`` is a dict with "params" (a list of Parameters) and every
hyperparameter under PyTorch's name, the features utensil lacks at their off value (SGD: lr,
momentum, dampening, weight_decay, nesterov, maximize=False; Adam/AdamW: lr, betas, eps,
weight_decay, amsgrad=False, maximize=False, decoupled_weight_decay). ``add_param_group(dict)``
adds one. A parameter in two groups, an empty group, a key that is not a hyperparameter (PyTorch
keeps unknown keys; utensil refuses them, so a misspelt "weight_decy" cannot silently do
nothing) or a bad value raises ArgumentError. Values written into a group later are checked by
the next step() before any parameter changes: a bad one raises ArgumentError and nothing moves.

The attributes of the one-group API (``opt.lr``, ``opt.momentum``, ``opt.weight_decay``,
``opt.betas``, ``opt.eps``, ``opt.initial_lr``, ...) are group 0's values: reading one reads
``param_groups[0]``, writing one (checked at once) writes ``param_groups[0]`` only, with several
groups too (PyTorch has no ``opt.lr``: write each group's "lr" to change them all).
``opt.params`` lists every parameter, group after group, in the order the state_dict numbers
them.

Hyperparameters are checked as the float32 values the C library computes with (a beta that
rounds to 1.0 in float32 is refused when the optimizer is made, not at the first step).

Copies: ``copy.copy(opt)`` is an optimizer of the same kind over the SAME parameter objects with
its own copy of the state and of the groups' dicts. ``copy.deepcopy`` and ``pickle`` copy the
parameters too, through the memo: ``copy.deepcopy((model, opt))`` or ``pickle.dumps((model,
opt))`` gives an optimizer bound to the copied model's parameters (as PyTorch does); an optimizer
copied alone gets standalone copies of its parameters. Optimizers pickled before parameter groups
load as one group. A closed optimizer raises ClosedError.
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

# PyTorch's implementation switches, which its state_dicts carry in each group: accepted in a
# group only when off (utensil has one implementation of each optimizer)
_SWITCHES = ("foreach", "fused", "capturable", "differentiable")


class _Group0:
    """An attribute of the one-group API: ``param_groups[0][key]``, checked when written."""

    def __init__(self, key):
        self.key = key

    def __get__(self, opt, cls=None):
        if opt is None:
            return self
        return opt.param_groups[0].get(self.key)

    def __set__(self, opt, value):
        g = opt.param_groups[0]
        name = "%s.%s" % (type(opt).__name__, self.key)
        if self.key == "initial_lr":
            if value is None:
                g.pop("initial_lr", None)
            else:
                g["initial_lr"] = _args.to_lr(value, name)
            return
        g[self.key] = opt._check_group(dict(g, **{self.key: value}), name)[self.key]


def _n_groups(n):
    return "one group" if n == 1 else "%d groups" % n


class Optimizer:
    """The base of SGD, Adam and AdamW: parameter groups, state dicts, copies (see the module
    doc). A subclass names its group keys in ``_keys`` and checks them in ``_hyper``."""

    # the keys of a group but "params", in PyTorch's order; and those of PyTorch's features
    # utensil lacks, with the only value a group may give them
    _keys = ("lr",)
    _absent = {}
    # the names of a parameter's state tensors when it has all of them
    _all_slots = ()

    def __init__(self, params, defaults):
        if not isinstance(defaults, dict):  # Optimizer.__init__(params, lr), before groups
            defaults = {"lr": defaults}
        self._closed = False
        self.t = 0  # steps taken
        self.param_groups, self.params, self._state = [], [], []
        self.defaults = self._check_group(dict(self._absent, **defaults), type(self).__name__)
        groups, one = _groups_of(params)
        for g in groups:
            self.add_param_group(g, _one=one)

    lr = _Group0("lr")
    initial_lr = _Group0("initial_lr")  # PyTorch's group["initial_lr"]: set by an lr_scheduler

    def _hyper(self, values, name):
        return {"lr": _args.to_lr(values["lr"], "%s: lr" % name)}

    def _check_group(self, group, name):
        """A group's hyperparameters checked (the C library's float32 rules), as a new dict in
        PyTorch's key order; ArgumentError naming ``name`` for a missing or bad one."""
        missing = [k for k in self._keys if k not in group]
        if missing:
            raise ArgumentError("%s has no %s" % (name, " or ".join(repr(k) for k in missing)))
        _unsupported(group, name, **self._absent)
        out = self._hyper(group, name)
        out.update(self._absent)
        return {k: out[k] for k in self._keys}

    def add_param_group(self, param_group, _one=False):
        """Add a group ``{"params": Parameters, <hyperparameter>: value, ...}`` (PyTorch's
        add_param_group): missing hyperparameters take ``opt.defaults``' values. Refused, before
        anything changes: a parameter already in a group, an empty group, a key that is not a
        hyperparameter of this optimizer, a bad value."""
        self._check_open()
        k = len(self.param_groups)
        where = "params" if _one else "param group %d" % k
        if not isinstance(param_group, dict):
            raise ArgumentTypeError("param group %d must be a dict {'params': [...], ...}, got "
                                    "%s" % (k, type(param_group).__name__))
        if "params" not in param_group:
            raise ArgumentError("param group %d has no 'params'" % k)
        ps = param_group["params"]
        if isinstance(ps, Module):
            ps = ps.parameters()
        ps = [ps] if isinstance(ps, Parameter) else _ordered_list(ps)
        if not ps:
            raise ArgumentError("the optimizer got an empty parameter list" if _one
                                else "param group %d has no parameters" % k)
        for i, p in enumerate(ps):
            if not isinstance(p, Parameter):
                raise ArgumentTypeError(
                    "%s[%d] is a %s, not a Parameter (pass model.parameters())"
                    % ("params" if _one else "param group %d: params" % k, i, type(p).__name__))
        # One entry per parameter object: a layer used twice (Sequential(l, ReLU(), l)) lists
        # its parameters twice, and stepping them twice per step() would double the update.
        seen = set()
        ps = [p for p in ps if not (id(p) in seen or seen.add(id(p)))]
        if any(id(p) in seen for p in self.params):
            raise ArgumentError("some parameters appear in more than one parameter group")
        known = set(self._keys) | {"params", "initial_lr"} | set(_SWITCHES)
        unknown = sorted(str(key) for key in param_group if key not in known)
        if unknown:
            raise ArgumentError("param group %d: unknown key%s %s; %s's are %s" % (
                k, "s" * (len(unknown) > 1), ", ".join(repr(u) for u in unknown),
                type(self).__name__, ", ".join(("params",) + self._keys)))
        for s in _SWITCHES:
            if param_group.get(s):
                raise ArgumentError("param group %d: %s=%r; utensil's optimizers have no %s "
                                    "implementation" % (k, s, param_group[s], s))
        name = "%s: %s" % (type(self).__name__, where) if not _one else type(self).__name__
        group = {"params": ps}
        group.update(self._check_group(dict(self.defaults, **{
            key: v for key, v in param_group.items() if key in self._keys}), name))
        if param_group.get("initial_lr") is not None:
            group["initial_lr"] = _args.to_lr(param_group["initial_lr"], "%s: initial_lr" % name)
        self.param_groups.append(group)
        self.params.extend(ps)
        self._state.extend([None] * len(ps))
        self._grow(len(ps))

    def _grow(self, n):
        """Per-parameter bookkeeping for n parameters just added."""

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
    def _slots_for(self, group):
        """The state tensors' names under the (checked) hyperparameters of ``group``."""
        return self._all_slots

    def _param_state(self, i):
        """Per-parameter state that is not a tensor (Adam: "step")."""
        return {}

    def _check_param_state(self, i, entry, name):
        return None

    def state_dict(self):
        """The state in PyTorch's layout, as numpy copies::

            {"state": {0: {"momentum_buffer": array}, ...},              # SGD with momentum
             "state": {0: {"step": array(3.), "exp_avg": array, "exp_avg_sq": array}, ...}, # Adam
             "param_groups": [{"lr": 0.01, ..., "params": [0, 1, ...]}, ...]}

        ``state`` has an entry for each parameter (its index in ``params``: the groups'
        parameters numbered consecutively, as PyTorch does) that has state, so none before the
        first step; each array has the parameter's shape and is float32 (Adam's ``step``: a 0-d
        float32, as PyTorch stores it). ``param_groups`` holds each group's hyperparameters
        under PyTorch's names. ``torch.from_numpy`` on each array gives a dict the PyTorch
        optimizer of the same kind, made with the same groups, loads. The count ``t`` is not
        saved.
        """
        self._check_open()
        name = "%s.state_dict" % type(self).__name__
        groups, start = [], 0
        for k, g in enumerate(self._groups_checked(name)):
            packed = self._check_group(g, "%s: param_groups[%d]" % (name, k))
            if g.get("initial_lr") is not None:  # an lr_scheduler's, as in PyTorch
                packed["initial_lr"] = float(g["initial_lr"])
            packed["params"] = list(range(start, start + len(g["params"])))
            start += len(g["params"])
            groups.append(packed)
        state = {}
        for i, st in enumerate(self._state):
            if st is None:
                continue
            entry = self._param_state(i)
            for k, t in zip(self._all_slots, st):
                entry[k] = np.array(t.numpy(), dtype=np.float32, copy=True)
            state[i] = entry
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict):
        """Restore a state_dict() (this class's or PyTorch's optimizer of the same kind), for
        the same parameters in the same groups and order; the hyperparameters come from the
        dict (a key it lacks keeps the group's value).

        Everything is checked before anything changes: ArgumentError (ArgumentTypeError) for a
        malformed dict, another number of groups or a PyTorch feature utensil does not have
        (AMSGrad, maximize), ShapeError for a group size or shape that does not match the
        parameters. A parameter without an entry in ``state`` starts afresh, as in PyTorch.
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
        mine = self._groups_checked(name)
        if not isinstance(groups, (list, tuple)) or not all(isinstance(g, dict) for g in groups):
            raise ArgumentError("%s: 'param_groups' must be a list of groups (dicts)" % name)
        if len(groups) != len(mine):
            raise ArgumentError("%s: 'param_groups' has %s, the optimizer has %s (make it with "
                                "the same parameter groups)"
                                % (name, _n_groups(len(groups)), _n_groups(len(mine))))
        if not isinstance(state, dict):
            raise ArgumentTypeError("%s: 'state' must be a dict {parameter id: {...}}, got %s"
                                    % (name, type(state).__name__))
        ids, hyper, slots = [], [], []
        for k, (g, m) in enumerate(zip(groups, mine)):
            gname = "%s: param_groups[%d]" % (name, k) if len(mine) > 1 else name
            gids = g.get("params")
            if not isinstance(gids, (list, tuple)):
                raise ArgumentError("%s: the group has no 'params' list" % gname)
            if len(gids) != len(m["params"]):
                raise ShapeError("%s: the group has %d parameters, the optimizer's has %d "
                                 "parameters" % (gname, len(gids), len(m["params"])))
            checked = self._check_group(dict(m, **{key: g[key] for key in self._keys + tuple(
                self._absent) if key in g}), gname)
            initial = g.get("initial_lr")
            if initial is not None:
                initial = _args.to_lr(initial, "%s: initial_lr" % gname)
            hyper.append((checked, initial))
            ids.extend(gids)
            slots.extend([self._slots_for(checked)] * len(gids))
        try:
            index = {key: i for i, key in enumerate(ids)}
        except TypeError:
            raise ArgumentTypeError("%s: a group's 'params' holds something that is not a "
                                    "parameter id" % name) from None
        if len(index) != len(ids):
            raise ArgumentError("%s: a parameter id appears twice in the groups' 'params'" % name)
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
            for slot in slots[i]:
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
        for m, (checked, initial) in zip(mine, hyper):
            m.update(checked)
            if initial is not None:
                m["initial_lr"] = initial
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

    def _groups_checked(self, name):
        """param_groups, after checking that their "params" are still the parameters they were
        given (the state is kept by position: a group's list changed in place would pair state
        with the wrong parameters)."""
        groups, i, n = self.param_groups, 0, len(self.params)
        for k, g in enumerate(groups):
            ps = g.get("params") if isinstance(g, dict) else None
            # (a Parameter compares by identity: the list comparison is the identity check)
            if not isinstance(ps, list) or ps != self.params[i:i + len(ps)]:
                raise ArgumentError("%s: param_groups[%d]['params'] changed after the group was "
                                    "added (add parameters with add_param_group)" % (name, k))
            i += len(ps)
        if i != n:
            raise ArgumentError("%s: param_groups lost a group after it was added" % name)
        return groups

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
        new.param_groups = [dict(g, params=list(g["params"])) for g in self.param_groups]
        new.defaults = dict(self.defaults)
        new._state = [None if st is None else [t.clone() for t in st] for st in self._state]
        for k, v in self.__dict__.items():
            if isinstance(v, list) and k not in ("params", "_state", "param_groups"):
                new.__dict__[k] = list(v)
        return new

    def __getstate__(self):
        # deepcopy and pickle (parameters and state included, see the module doc)
        self._check_open()
        return dict(self.__dict__)

    def __setstate__(self, state):
        state = dict(state)
        if "param_groups" not in state:  # pickled before parameter groups: one group
            values = dict(self._old_defaults(), **self._absent)
            for k in self._keys:
                if k in state:
                    values[k] = state.pop(k)
            group = {"params": list(state["params"])}
            group.update({k: values[k] for k in self._keys})
            initial = state.pop("initial_lr", None)
            if initial is not None:
                group["initial_lr"] = initial
            state["param_groups"] = [group]
            state["defaults"] = {k: values[k] for k in self._keys}
        self.__dict__.update(state)

    def _old_defaults(self):
        """The values of hyperparameters an optimizer pickled before issue 30 may lack."""
        return {}

    def step(self):
        raise NotImplementedError

    def _stepping(self):
        """[(the group's checked hyperparameters, the indices of its parameters step() updates
        (grad not None))] for each group, everything checked first, so that a step that raises
        has changed nothing (no parameter updated, no count advanced)."""
        self._check_open()
        name = "%s.step" % type(self).__name__
        out, i = [], 0
        for k, g in enumerate(self._groups_checked(name)):  # on every step: kept to cheap reads
            hyper = self._step_hyper(g, "%s: param_groups[%d]" % (name, k))
            todo = []
            for p in g["params"]:
                g_ = p.grad
                if g_ is not None:
                    if not isinstance(g_, Tensor):
                        raise ArgumentTypeError("%s: params[%d].grad is a %s, not a Tensor (or "
                                                "None)" % (name, i, type(g_).__name__))
                    pp, gp = getattr(p, "_ptr", None), getattr(g_, "_ptr", None)
                    if pp is None or gp is None:
                        raise ClosedError("%s: params[%d]%s is closed"
                                          % (name, i, "" if pp is None else ".grad"))
                    if g_.shape != p.shape:
                        raise ShapeError("%s: params[%d].grad has shape %s, the parameter %s"
                                         % (name, i, g_.shape, p.shape))
                    if gp.dev != pp.dev:
                        raise DeviceError("%s: params[%d].grad is on %s, the parameter on %s"
                                          % (name, i, g_.device, p.device))
                    todo.append(i)
                i += 1
            out.append((hyper, todo))
        return out

    def _step_hyper(self, group, name):
        """_check_group for step(), memoized: the float32 checks cost more than a small step, and
        a group's values rarely change. Only plain Python scalars (and tuples or lists of them)
        are memoized, by type and value, so that a value equal but of another type (1 for True)
        is checked afresh, and NaN, never equal to itself, always is."""
        try:
            key = (type(self),) + tuple(_plain(group[k]) for k in self._keys)
        except (KeyError, TypeError):
            return self._check_group(group, name)
        hyper = _CHECKED.get(key)
        if hyper is None:
            hyper = self._check_group(group, name)
            if len(_CHECKED) >= 1024:  # a schedule writes a new rate each epoch
                _CHECKED.clear()
            _CHECKED[key] = hyper
        return hyper

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

    def _groups_note(self):
        n = len(self.param_groups)
        return ", %d groups" % n if n > 1 else ""


_CHECKED = {}  # _step_hyper's memo: (class, plain values) -> the checked hyperparameters
_SCALARS = (bool, int, float)


def _plain(v):
    """A hashable key for a plain value, its type part of it; TypeError for anything else."""
    if type(v) in _SCALARS:
        return type(v), v
    if type(v) in (tuple, list) and all(type(x) in _SCALARS for x in v):
        return type(v), tuple((type(x), x) for x in v)
    raise TypeError


def _ordered_list(params):
    """``params`` as a list: an ordered iterable (a set's order changes between runs, so the
    state_dict's numbering would; PyTorch's message)."""
    if isinstance(params, (set, frozenset)):
        raise ArgumentTypeError("optimizer parameters need to be organized in ordered "
                                "collections, but the ordering of tensors in sets will change "
                                "between runs. Please use a list instead.")
    try:
        return list(params)
    except TypeError:
        raise ArgumentTypeError(
            "params must be an iterable of Parameters (e.g. model.parameters())"
        ) from None


def _groups_of(params):
    """(the groups ``params`` describes, as a list of dicts; whether it was the one-group form)
    PyTorch's two forms: Parameters, one group; or dicts, a group each."""
    if isinstance(params, Module):
        params = params.parameters()
    if isinstance(params, dict):
        return [params], False
    params = _ordered_list(params)
    if not params:
        raise ArgumentError("the optimizer got an empty parameter list")
    dicts = [isinstance(p, dict) for p in params]
    if all(dicts):
        return params, False
    if any(dicts):
        raise ArgumentTypeError("params must be all Parameters (one group) or all dicts (a "
                                "group each), not a mix")
    return [{"params": params}], True


class SGD(Optimizer):
    """torch.optim.SGD: d = grad + weight_decay param; with momentum the buffer is d at the
    first step, then momentum buf + (1 - dampening) d; d = d + momentum buf (nesterov) or buf;
    param -= lr d. The arithmetic is one C call per group and step (ut_sgd_step_many_ex; two
    when some momentum buffers start at this step)."""

    _keys = ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize")
    _absent = {"maximize": False}
    _all_slots = ("momentum_buffer",)
    momentum = _Group0("momentum")
    dampening = _Group0("dampening")
    weight_decay = _Group0("weight_decay")
    nesterov = _Group0("nesterov")

    def __init__(self, params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0,
                 nesterov=False):
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening,
                                      weight_decay=weight_decay, nesterov=nesterov))

    def _hyper(self, values, name):
        out = super()._hyper(values, name)
        out["momentum"], out["dampening"], out["weight_decay"], out["nesterov"] = _sgd_hyper(
            values["momentum"], values["dampening"], values["weight_decay"], values["nesterov"],
            name)
        return out

    def _old_defaults(self):
        # what an SGD pickled before issue 30 ran with (its __dict__ comes back without them)
        return {"dampening": 0.0, "weight_decay": 0.0, "nesterov": False}

    @property
    def _slot_names(self):
        """Group 0's state tensors' names."""
        return self._slots_for(self.param_groups[0])

    def _slots_for(self, group):
        return ("momentum_buffer",) if group["momentum"] != 0.0 else ()

    def step(self):
        for hyper, todo in self._stepping():
            kw = dict(lr=hyper["lr"], momentum=hyper["momentum"], dampening=hyper["dampening"],
                      weight_decay=hyper["weight_decay"], nesterov=hyper["nesterov"])
            if hyper["momentum"] == 0.0:
                ps = [self.params[i] for i in todo]
                _F.sgd_step_many(ps, [p.grad for p in ps], None, **kw)
                continue
            # PyTorch's first step sets the buffer to d itself (no dampening): a fresh, zeroed
            # buffer with dampening 0 gives exactly that, so the fresh ones go in a call of their own
            fresh = [i for i in todo if self._state[i] is None]
            old = [i for i in todo if self._state[i] is not None]
            for part, damp in ((old, hyper["dampening"]), (fresh, 0.0)):
                if not part:
                    continue
                ps = [self.params[i] for i in part]
                vs = [self._slot(i, 1)[0] for i in part]
                kw["dampening"] = damp
                _F.sgd_step_many(ps, [p.grad for p in ps], vs, **kw)
        self.t += 1

    def __repr__(self):
        extra = "".join(", %s=%r" % (k, getattr(self, k)) for k in
                        ("dampening", "weight_decay", "nesterov") if getattr(self, k))
        return "SGD(lr=%g, momentum=%g%s, %d params%s)" % (
            self.lr, self.momentum, extra, len(self.params), self._groups_note())


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

    _keys = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize",
             "decoupled_weight_decay")
    _absent = {"amsgrad": False, "maximize": False}
    _all_slots = _slot_names = ("exp_avg", "exp_avg_sq")
    _decoupled_default = False
    betas = _Group0("betas")
    eps = _Group0("eps")
    weight_decay = _Group0("weight_decay")
    decoupled_weight_decay = _Group0("decoupled_weight_decay")

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, *,
                 decoupled_weight_decay=None):
        if decoupled_weight_decay is None:
            decoupled_weight_decay = self._decoupled_default
        # Per-parameter update counts for the bias correction: a parameter skipped while its
        # grad was None starts its correction at 1 when it first gets one (as in PyTorch).
        self._steps = []
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      decoupled_weight_decay=decoupled_weight_decay))

    def _hyper(self, values, name):
        out = super()._hyper(values, name)
        out["betas"], out["eps"], out["weight_decay"], out["decoupled_weight_decay"] = \
            _adam_hyper(values["betas"], values["eps"], values["weight_decay"],
                        values["decoupled_weight_decay"], name)
        return out

    def _old_defaults(self):
        # what an Adam pickled before issue 30 ran with
        return {"weight_decay": 0.0, "decoupled_weight_decay": self._decoupled_default}

    def _grow(self, n):
        self._steps.extend([0] * n)

    def step(self):
        work = self._stepping()
        if self.t >= _args.INT_MAX:
            raise ArgumentError("Adam: step count overflow")
        self.t += 1
        steps = self._steps
        for hyper, todo in work:
            lr, (b1, b2), eps = hyper["lr"], hyper["betas"], hyper["eps"]
            wd, decoupled = hyper["weight_decay"], hyper["decoupled_weight_decay"]
            for i in todo:
                p = self.params[i]
                m, v = self._slot(i, 2)
                _F.adam_step(p, p.grad, m, v, steps[i] + 1, lr, b1, b2, eps, wd, decoupled)
                steps[i] += 1

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
        return "%s(lr=%g, betas=%r, eps=%g%s, %d params%s)" % (
            type(self).__name__, self.lr, self.betas, self.eps, wd, len(self.params),
            self._groups_note())


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
