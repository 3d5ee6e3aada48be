"""utensil-train's recipe: the optimizer (with its parameter groups of weight decay), the
learning rate of each epoch, the EMA of the weights, and the weights a run starts from
(``--init-from``).

The learning rate is set once per epoch (as torchvision's reference recipe steps its
schedulers): ``--warmup-epochs K`` is LinearLR from WARMUP_START_FACTOR of the rate to all of
it over K epochs, then the schedule (cosine: CosineAnnealingLR over the remaining epochs, to 0;
constant: the rate), composed by SequentialLR, the library's copies of PyTorch's schedulers.
The rates of a run are computed from its settings and ``--epochs`` alone, so a resumed run
gets the same ones as an uninterrupted run.
"""

import os

import numpy as np

from ..nn.norm import BatchNorm2d, LayerNorm
from ..optim import SGD, Adam, AdamW
from ..optim.lr_scheduler import CosineAnnealingLR, LinearLR, SequentialLR
from ..optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from .archs import classifier_keys

__all__ = ["OPTIMIZERS", "WEIGHT_DECAY_DEFAULTS", "WARMUP_START_FACTOR", "make_optimizer",
           "param_groups", "lr_at", "make_ema", "load_init", "InitError"]

OPTIMIZERS = ("adam", "adamw", "sgd")
# PyTorch's defaults: Adam and SGD have none, AdamW 1e-2
WEIGHT_DECAY_DEFAULTS = {"adam": 0.0, "adamw": 1e-2, "sgd": 0.0}
WARMUP_START_FACTOR = 0.01  # torchvision's reference recipe's --lr-warmup-decay


class InitError(ValueError):
    """--init-from's weights do not fit the network: a message meant for the user."""


def make_optimizer(run, net):
    wd = run["weight_decay"]
    params = param_groups(net, wd, run.get("norm_weight_decay"), run.get("bias_weight_decay"))
    if run["optimizer"] == "adam":
        return Adam(params, lr=run["lr"], weight_decay=wd)
    if run["optimizer"] == "adamw":
        return AdamW(params, lr=run["lr"], weight_decay=wd)
    return SGD(params, lr=run["lr"], momentum=run["momentum"], weight_decay=wd,
               nesterov=run["nesterov"])


NORM_LAYERS = (BatchNorm2d, LayerNorm)  # their subclasses too: SyncBatchNorm, LayerNorm2d


def param_groups(net, weight_decay, norm_weight_decay=None, bias_weight_decay=None):
    """``net``'s parameters for the optimizer, grouped by weight decay as torchvision's
    reference recipe does (--norm-weight-decay, --bias-weight-decay): the normalization layers'
    weights and biases (BatchNorm2d, LayerNorm and their subclasses) get ``norm_weight_decay``,
    the other layers' biases ``bias_weight_decay``, the rest ``weight_decay``; a None takes
    ``weight_decay``'s place. The groups come in torchvision's order (the rest, norm, bias),
    empty ones left out, each listing its parameters in ``net.parameters()``' order.

    Unlike torchvision's set_weight_decay, where the "bias" key also takes the normalization
    layers' biases when both flags are given, a norm layer's bias stays in the norm group: the
    flags are what their names say. Both None: ``net.parameters()`` as it is (one group, the
    run of a utensil-train that had no such flags)."""
    params = net.parameters()
    if norm_weight_decay is None and bias_weight_decay is None:
        return params
    norm, bias = set(), set()
    for _, m in net.named_modules():
        for k, p in m.named_parameters(recurse=False):
            if norm_weight_decay is not None and isinstance(m, NORM_LAYERS):
                norm.add(id(p))
            elif bias_weight_decay is not None and k == "bias":
                bias.add(id(p))
    parts = {"other": [], "norm": [], "bias": []}
    for p in params:
        parts["norm" if id(p) in norm else "bias" if id(p) in bias else "other"].append(p)
    decay = {"other": weight_decay, "norm": norm_weight_decay, "bias": bias_weight_decay}
    return [{"params": ps, "weight_decay": decay[k]} for k, ps in parts.items() if ps]


class _Rate:
    """What the schedulers read and write of an optimizer: one group's rate alone."""

    def __init__(self, lr):
        self.param_groups = [{"lr": lr}]

    def step(self):
        pass


def lr_at(run, epoch, epochs):
    """The learning rate of epoch ``epoch`` (from 0) of a run of ``epochs`` epochs."""
    opt = _Rate(run["lr"])
    k = run.get("warmup_epochs", 0)
    scheds = []
    if k:
        scheds.append(LinearLR(opt, start_factor=WARMUP_START_FACTOR, total_iters=k))
    if run["lr_schedule"] == "cosine":
        scheds.append(CosineAnnealingLR(opt, T_max=epochs - k))
    if len(scheds) == 2:
        sched = SequentialLR(opt, scheds, milestones=[k])
    elif scheds:
        sched = scheds[0]
    else:
        return run["lr"]
    for _ in range(epoch):
        sched.step()
    return opt.param_groups[0]["lr"]


def make_ema(run, net):
    """The AveragedModel of ``--ema DECAY`` (None without it): updated after every step,
    BatchNorm's running statistics averaged too (use_buffers=True, as torchvision's
    ExponentialMovingAverage)."""
    if run.get("ema") is None:
        return None
    return AveragedModel(net, multi_avg_fn=get_ema_multi_avg_fn(run["ema"]), use_buffers=True)


def read_state_file(path):
    """{key: numpy array} from a torch.save'd state_dict (.pt/.pth; the state_dict itself, or
    one under "model", "state_dict" or "model_ema" as training scripts save it) or an .npz."""
    if not os.path.isfile(path):
        raise InitError("%s: no such file" % path)
    if path.lower().endswith(".npz"):
        try:
            with np.load(path, allow_pickle=False) as f:
                return {k: f[k] for k in f.files}
        except Exception as e:
            raise InitError("%s: not a readable .npz of arrays (numpy: %s)"
                            % (path, type(e).__name__)) from None
    try:
        import torch
    except ImportError:
        raise InitError("%s: reading a PyTorch file needs torch, which is not installed (pip "
                        "install torch), or save the state_dict as an .npz of arrays: "
                        "np.savez(f, **{k: v.numpy() for k, v in sd.items()})" % path) from None
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise InitError("%s: torch.load could not read it as a state_dict (%s: %s)"
                        % (path, type(e).__name__, e)) from None
    if isinstance(obj, dict):
        for k in ("model", "state_dict"):
            if isinstance(obj.get(k), dict):
                obj = obj[k]
                break
    if not isinstance(obj, dict) or not all(torch.is_tensor(v) for v in obj.values()):
        raise InitError("%s: not a state_dict (a dict of tensors: save model.state_dict())"
                        % path)
    return {k: v.detach().cpu().numpy() for k, v in obj.items()}


def load_init(net, path):
    """Load ``path``'s weights into ``net`` by name; returns the classifier keys left as
    initialised because their shapes differ (another class count: fine-tuning). Every other
    difference (a missing or unexpected key, another shape) raises InitError naming them."""
    theirs = read_state_file(path)
    mine = net.state_dict()
    head = set(classifier_keys(mine))
    # BatchNorm's counter is not a weight: PyTorch lets it be absent, some files lack it
    counters = lambda keys: {k for k in keys if k.endswith("num_batches_tracked")}  # noqa: E731
    missing = sorted(set(mine) - set(theirs) - counters(mine))
    unexpected = sorted(set(theirs) - set(mine) - counters(theirs))
    if missing or unexpected:
        raise InitError("%s: the weights do not fit the network: missing keys %s, unexpected "
                        "keys %s (is it a state_dict of the same --arch?)"
                        % (path, _few(missing), _few(unexpected)))
    kept, bad, take = [], [], {}
    for k, v in mine.items():
        if k not in theirs:
            continue
        a = np.asarray(theirs[k])
        if a.shape == v.shape:
            take[k] = a
        elif k in head:
            kept.append(k)
        else:
            bad.append((k, a.shape, v.shape))
    if bad:
        k, a, b = bad[0]
        # a stem of another input channel count: the commonest mismatch, say it plainly
        hint = " (another channel count: weights for RGB images do not fit grey ones, or the " \
            "reverse)" if len(a) == 4 and a[0] == b[0] and a[1] != b[1] else ""
        raise InitError("%s: shapes differ from the network's: %s%s" % (path, "; ".join(
            "%s: %s in the file, %s in the network" % x for x in bad[:4])
            + ("; ..." if len(bad) > 4 else ""), hint))
    if kept and len(kept) != len(head):
        raise InitError("%s: the classifier's %s fits the network but %s does not"
                        % (path, sorted(head - set(kept)), kept))
    net.load_state_dict(take, strict=False)
    return kept


def _few(keys, n=5):
    if not keys:
        return "none"
    return ", ".join(keys[:n]) + (" and %d more" % (len(keys) - n) if len(keys) > n else "")
