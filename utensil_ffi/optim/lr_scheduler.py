"""Learning-rate schedules with torch.optim.lr_scheduler's names and semantics (issue 30):
LinearLR, CosineAnnealingLR and SequentialLR, enough for "linear warm-up, then cosine" as
PyTorch composes it::

    opt = ut.AdamW(model.parameters(), lr=1e-3)
    warm = LinearLR(opt, start_factor=0.01, total_iters=5)
    cos = CosineAnnealingLR(opt, T_max=95)
    sched = SequentialLR(opt, [warm, cos], milestones=[5])
    for epoch in range(100):
        train_one_epoch(...)          # opt.step() inside
        sched.step()

Each parameter group is scheduled on its own, as in PyTorch: the scheduler reads and writes
each group's "lr" and keeps its "initial_lr" (which the optimizer's state_dict then carries, as
PyTorch's does); ``base_lrs`` and ``get_last_lr()`` have one entry per group. The arithmetic is
PyTorch's, step by step in Python floats (the recursive forms included), so the learning rates
equal PyTorch's exactly. ``state_dict()`` holds the same keys as PyTorch's (every attribute but
the optimizer). Not here: PyTorch's warning when ``scheduler.step()`` comes before
``optimizer.step()``.

Needs only the optimizer's ``param_groups`` (a list of dicts with "lr"; duck-typed: it imports
no optimizer). Each rate written is checked as a learning rate (ArgumentError).
"""

import math
from bisect import bisect_right

from .. import _args
from .._errors import ArgumentError, ArgumentTypeError

__all__ = ["LRScheduler", "LinearLR", "CosineAnnealingLR", "SequentialLR"]


def _set_lrs(optimizer, lrs):
    lrs = [_args.to_lr(lr, "param_groups[%d]: lr" % k) for k, lr in enumerate(lrs)]
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr


class LRScheduler:
    """torch.optim.lr_scheduler.LRScheduler: step() moves last_epoch on and sets each
    parameter group's lr to get_lr()'s."""

    _get_lr_called_within_step = False
    _is_initial = False

    def __init__(self, optimizer, last_epoch=-1):
        if not isinstance(getattr(optimizer, "param_groups", None), list) \
                or not hasattr(optimizer, "step"):
            raise ArgumentTypeError("%s is not an Optimizer" % type(optimizer).__name__)
        last_epoch = _args.to_int(last_epoch, "last_epoch", -1)
        self.optimizer = optimizer
        groups = optimizer.param_groups
        for k, group in enumerate(groups):
            if last_epoch == -1:
                if group.get("initial_lr") is None:
                    group["initial_lr"] = group["lr"]
            elif group.get("initial_lr") is None:
                raise ArgumentError("param 'initial_lr' is not specified in param_groups[%d] "
                                    "when resuming scheduler with last_epoch >= 0 (load the "
                                    "optimizer's state_dict first)" % k)
        self.base_lrs = [group["initial_lr"] for group in groups]
        self.last_epoch = last_epoch
        self._initial_step()

    def _initial_step(self):
        self._step_count = 0
        self._is_initial = True
        try:
            self.step()
        finally:
            self._is_initial = False

    def state_dict(self):
        """Every attribute but the optimizer (PyTorch's keys)."""
        return {k: v for k, v in self.__dict__.items() if k != "optimizer"}

    def load_state_dict(self, state_dict):
        if not isinstance(state_dict, dict):
            raise ArgumentTypeError("%s.load_state_dict: expected a dict, got %s"
                                    % (type(self).__name__, type(state_dict).__name__))
        self.__dict__.update(state_dict)

    def get_last_lr(self):
        """The learning rates the last step set, one per parameter group."""
        return self._last_lr

    def get_lr(self):
        raise NotImplementedError

    def step(self, epoch=None):
        """Call after optimizer.step(). ``epoch`` (deprecated in PyTorch) jumps to that epoch
        through the closed form."""
        self._step_count += 1
        self._update_lr(epoch)

    def _update_lr(self, epoch=None):
        self._get_lr_called_within_step = True
        try:
            if epoch is None:
                self.last_epoch += 1
                values = self.get_lr()
            else:
                self.last_epoch = _args.to_int(epoch, "epoch", 0)
                closed = getattr(self, "_get_closed_form_lr", None)
                values = closed() if closed is not None else self.get_lr()
        finally:
            self._get_lr_called_within_step = False
        _set_lrs(self.optimizer, values)
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    def __repr__(self):
        return "%s(last_epoch=%d, lr=%s)" % (type(self).__name__, self.last_epoch, ", ".join(
            "%g" % group["lr"] for group in self.optimizer.param_groups))


class LinearLR(LRScheduler):
    """torch.optim.lr_scheduler.LinearLR: the lr scaled by a factor that goes linearly from
    start_factor to end_factor over total_iters steps (a warm-up), then left alone."""

    def __init__(self, optimizer, start_factor=1.0 / 3, end_factor=1.0, total_iters=5,
                 last_epoch=-1):
        start_factor = _args.to_float(start_factor, "start_factor")
        end_factor = _args.to_float(end_factor, "end_factor")
        if start_factor > 1.0 or start_factor <= 0:
            raise ArgumentError("Starting multiplicative factor expected to be greater than 0 "
                                "and less or equal to 1.")
        if end_factor > 1.0 or end_factor < 0:
            raise ArgumentError("Ending multiplicative factor expected to be between 0 and 1.")
        self.start_factor = start_factor
        self.end_factor = end_factor
        self.total_iters = _args.to_int(total_iters, "total_iters", 1)
        super().__init__(optimizer, last_epoch)

    def get_lr(self):
        lrs = [group["lr"] for group in self.optimizer.param_groups]
        if self.last_epoch == 0:
            return [lr * self.start_factor for lr in lrs]
        if self._is_initial or self.last_epoch > self.total_iters:
            return lrs
        return [lr * (1.0 + (self.end_factor - self.start_factor)
                      / (self.total_iters * self.start_factor
                         + (self.last_epoch - 1) * (self.end_factor - self.start_factor)))
                for lr in lrs]

    def _get_closed_form_lr(self):
        return [base_lr * (self.start_factor + (self.end_factor - self.start_factor)
                           * min(self.total_iters, self.last_epoch) / self.total_iters)
                for base_lr in self.base_lrs]


class CosineAnnealingLR(LRScheduler):
    """torch.optim.lr_scheduler.CosineAnnealingLR: eta_min + (base_lr - eta_min)
    (1 + cos(pi epoch / T_max)) / 2, computed with PyTorch's recursive form."""

    def __init__(self, optimizer, T_max, eta_min=0.0, last_epoch=-1):
        self.T_max = _args.to_int(T_max, "T_max", 1)
        self.eta_min = _args.to_float(eta_min, "eta_min", lo=0.0)
        super().__init__(optimizer, last_epoch)

    def get_lr(self):
        return [self._lr(group["lr"], base_lr)
                for group, base_lr in zip(self.optimizer.param_groups, self.base_lrs)]

    def _lr(self, lr, base_lr):
        eta_min, t_max = self.eta_min, self.T_max
        if self._is_initial:
            return lr
        if self._step_count == 1 and self.last_epoch > 0:
            return eta_min + (base_lr - eta_min) * (1 + math.cos(self.last_epoch * math.pi
                                                                 / t_max)) / 2
        if (self.last_epoch - 1 - t_max) % (2 * t_max) == 0:
            return lr + (base_lr - eta_min) * (1 - math.cos(math.pi / t_max)) / 2
        return (1 + math.cos(math.pi * self.last_epoch / t_max)) \
            / (1 + math.cos(math.pi * (self.last_epoch - 1) / t_max)) * (lr - eta_min) + eta_min

    def _get_closed_form_lr(self):
        return [self.eta_min + (base_lr - self.eta_min)
                * (1 + math.cos(math.pi * self.last_epoch / self.T_max)) / 2
                for base_lr in self.base_lrs]


class SequentialLR(LRScheduler):
    """torch.optim.lr_scheduler.SequentialLR: schedulers[i] runs from milestones[i - 1] on
    (each restarted from epoch 0 at its milestone)."""

    def __init__(self, optimizer, schedulers, milestones, last_epoch=-1):
        schedulers, milestones = list(schedulers), list(milestones)
        name = type(self).__name__
        if len(schedulers) < 1:
            raise ArgumentError("%s expects at least one scheduler, but got no scheduler." % name)
        for i, s in enumerate(schedulers):
            if not hasattr(s, "optimizer"):
                raise ArgumentTypeError("%s at index %d should have `optimizer` as its "
                                        "attribute." % (name, i))
            if s.optimizer is not optimizer:
                raise ArgumentError("%s expects all schedulers to belong to the same optimizer, "
                                    "but got scheduler %s at index %d has a different one."
                                    % (name, type(s).__name__, i))
        if len(milestones) != len(schedulers) - 1:
            raise ArgumentError(
                "Sequential Schedulers expects number of schedulers provided to be one more than "
                "the number of milestone points, but got number of schedulers %d and the number "
                "of milestones to be equal to %d" % (len(schedulers), len(milestones)))
        self._schedulers = schedulers
        self._milestones = [_args.to_int(m, "milestones[%d]" % i, 0)
                            for i, m in enumerate(milestones)]
        self.last_epoch = _args.to_int(last_epoch, "last_epoch", -1) + 1
        self.optimizer = optimizer
        # back to the start: undo the others' steps
        _set_lrs(optimizer, [group["initial_lr"] for group in optimizer.param_groups])
        self.recursive_undo()
        idx = bisect_right(self._milestones, 0)
        self._schedulers[idx]._initial_step()
        self._last_lr = schedulers[idx].get_last_lr()

    def recursive_undo(self, sched=None):
        scheds = self if sched is None else sched
        if hasattr(scheds, "_schedulers"):
            for s in scheds._schedulers:
                self.recursive_undo(s)
        elif hasattr(scheds, "last_epoch"):
            scheds.last_epoch -= 1

    def step(self):
        self.last_epoch += 1
        idx = bisect_right(self._milestones, self.last_epoch)
        scheduler = self._schedulers[idx]
        if idx > 0 and self._milestones[idx - 1] == self.last_epoch:
            scheduler._update_lr(0)
        else:
            scheduler.step()
        self._last_lr = scheduler.get_last_lr()

    def state_dict(self):
        sd = {k: v for k, v in self.__dict__.items() if k not in ("optimizer", "_schedulers")}
        sd["_schedulers"] = [s.state_dict() for s in self._schedulers]
        return sd

    def load_state_dict(self, state_dict):
        if not isinstance(state_dict, dict):
            raise ArgumentTypeError("%s.load_state_dict: expected a dict, got %s"
                                    % (type(self).__name__, type(state_dict).__name__))
        state_dict = dict(state_dict)
        scheds = state_dict.pop("_schedulers")
        self.__dict__.update(state_dict)
        for s, sd in zip(self._schedulers, scheds):
            s.load_state_dict(sd)
