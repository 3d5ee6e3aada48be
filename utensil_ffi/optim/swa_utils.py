"""Averages of a model's weights, with torch.optim.swa_utils' names (issue 30): AveragedModel
and get_ema_multi_avg_fn, the exponential moving average (EMA) that training recipes keep::

    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.999))
    for x, y in batches:
        ...; opt.step()
        ema.update_parameters(model)
    ema.eval(); logits = ema(x)              # evaluate the averaged weights
    ema.module.state_dict()                  # export them (the model's own keys)

As in PyTorch: the averaged copy is ``ema.module`` (a deep copy of the model made at
construction), ``ema.state_dict()`` holds ``n_averaged`` and ``module.<key>``; the first
update copies the model's parameters, later ones average them; with ``use_buffers=False`` (the
default) the buffers (BatchNorm's running statistics) are copied from the model at every update,
with ``use_buffers=True`` they are averaged too. The EMA step is ``avg += (1 - decay) (cur -
avg)`` (PyTorch's lerp_) in one C call over all tensors (ut_lerp_many). Without an averaging
function it is the running mean of SWA (get_swa_multi_avg_fn). An avg_fn / multi_avg_fn of
one's own gets lists of Tensors (the averages, the model's, and the count as an int).
"""

import copy

from .. import _args
from .. import functional as _F
from .._errors import ArgumentError, ArgumentTypeError, ShapeError
from ..nn.module import Module

__all__ = ["AveragedModel", "get_ema_multi_avg_fn", "get_swa_multi_avg_fn"]


def get_ema_multi_avg_fn(decay=0.999):
    """The EMA update: each average moves (1 - decay) of the way to the model's value."""
    decay = _args.to_float(decay, "decay")
    if not 0.0 <= decay <= 1.0:
        raise ArgumentError("Invalid decay value %r provided. Please provide a value in [0,1] "
                            "range." % (decay,))

    def ema_update(ema_param_list, current_param_list, _num_averaged):
        _F.lerp_many_(ema_param_list, current_param_list, 1.0 - decay)

    return ema_update


def get_swa_multi_avg_fn():
    """The running mean of every model seen (SWA): avg += (cur - avg) / (n + 1)."""

    def swa_update(averaged_param_list, current_param_list, num_averaged):
        _F.lerp_many_(averaged_param_list, current_param_list, 1.0 / (int(num_averaged) + 1))

    return swa_update


class AveragedModel(Module):
    """torch.optim.swa_utils.AveragedModel: a copy of ``model`` whose weights are an average of
    the model's over the updates (``update_parameters(model)``).

    model: the Module to average (deep-copied); device: where the copy lives (default: where
    the model is); avg_fn(avg, cur, n) -> new average Tensor, or multi_avg_fn(avgs, curs, n)
    in place (get_ema_multi_avg_fn(decay) for the EMA); neither: the running mean (SWA).
    use_buffers: average the buffers too instead of copying them.
    """

    def __init__(self, model, device=None, avg_fn=None, multi_avg_fn=None, use_buffers=False):
        if not isinstance(model, Module):
            raise ArgumentTypeError("AveragedModel: model must be a Module, got %s"
                                    % type(model).__name__)
        for name, fn in (("avg_fn", avg_fn), ("multi_avg_fn", multi_avg_fn)):
            if fn is not None and not callable(fn):
                raise ArgumentTypeError("AveragedModel: %s must be callable" % name)
        self.module = copy.deepcopy(model)
        if device is not None:
            self.module.to(device)
        self.avg_fn = avg_fn
        self.multi_avg_fn = multi_avg_fn
        self.use_buffers = _args.to_bool(use_buffers, "use_buffers")
        self.n_averaged = 0
        self.training = model.training
        self.module.train(self.training)

    # n_averaged is PyTorch's int64 buffer: in the state dict as a 0-d int64
    def _extra_state(self):
        return [("n_averaged", self.n_averaged)]

    def _set_extra_state(self, name, value):
        self.n_averaged = value

    def forward(self, *args):
        return self.module(*args)

    def backward(self, grad_out, **kw):
        raise ArgumentError("AveragedModel.backward: the averaged weights are not trained; "
                            "train the model and call update_parameters(model)")

    def train(self, mode=True):
        self.training = _args.to_bool(mode, "mode")
        self.module.train(mode)
        return self

    def to(self, device):
        self.module.to(device)
        return self

    def close(self):
        self.module.close()

    def _pairs(self, model):
        if self.use_buffers:
            mine = self.module.parameters() + self.module.buffers()
            theirs = model.parameters() + model.buffers()
        else:
            mine, theirs = self.module.parameters(), model.parameters()
        if len(mine) != len(theirs):
            raise ShapeError("AveragedModel.update_parameters: the model has %d tensors to "
                             "average, the averaged copy %d" % (len(theirs), len(mine)))
        for i, (a, b) in enumerate(zip(mine, theirs)):
            if a.shape != b.shape:
                raise ShapeError("AveragedModel.update_parameters: tensor %d has shape %s in "
                                 "the model, %s in the averaged copy" % (i, b.shape, a.shape))
        return mine, theirs

    def update_parameters(self, model):
        """Average the model's current weights in (the first call copies them)."""
        if not isinstance(model, Module):
            raise ArgumentTypeError("update_parameters: model must be a Module, got %s"
                                    % type(model).__name__)
        mine, theirs = self._pairs(model)
        moved = []  # the model's tensors on the copy's device, when they differ
        try:
            cur = []
            for a, b in zip(mine, theirs):
                if b.device != a.device:
                    b = b.to(a.device)
                    moved.append(b)
                cur.append(b)
            if self.n_averaged == 0:
                for a, b in zip(mine, cur):
                    a.copy_from(b)
            elif self.multi_avg_fn is not None or self.avg_fn is None:
                fn = self.multi_avg_fn or get_swa_multi_avg_fn()
                fn(mine, cur, self.n_averaged)
            else:
                for a, b in zip(mine, cur):
                    new = self.avg_fn(a, b, self.n_averaged)
                    if new is not a:
                        a.copy_from(new)
            if not self.use_buffers:
                # the buffers follow the model (PyTorch keeps them in sync the same way)
                for a, b in zip(self.module.buffers(), model.buffers()):
                    a.copy_from(b)
        finally:
            for t in moved:
                t.close()
        self.n_averaged += 1

    def __repr__(self):
        return "AveragedModel(n_averaged=%d,\n  (module): %s\n)" % (
            self.n_averaged, repr(self.module).replace("\n", "\n  "))
