"""utensil-train: train a depthwise-separable (MobileNet-style) classifier end to end.

    utensil-train                                    # the digits scikit-learn ships, no download
    utensil-train --data mnist.npz --epochs 5 --width 32
    utensil-train --resume utensil_checkpoint.npz --epochs 30
    utensil-train --nproc-per-node 2                 # data-parallel on 2 GPUs (train_dist.py)
    utensil-train --data photos/ --arch efficientnet_b0 --optimizer adamw --warmup-epochs 5 \
        --label-smoothing 0.1 --ema --init-from efficientnet_b0.pt
    python -m utensil_ffi.cli.train ...              # the same program

The default network (utensil_ffi.nn.models.mobilenet) is built only from utensil layers: a 3x3
stem convolution, blocks of [depthwise 3x3 -> BatchNorm2d -> ReLU6 -> pointwise 1x1 ->
BatchNorm2d -> ReLU6], global average pooling and a linear classifier; ``--arch`` picks
mobilenet_v1 or one of torchvision's networks (utensil_ffi.models; archs.py). It trains with
softmax cross-entropy (``--label-smoothing``) and Adam, AdamW or SGD (``--weight-decay``,
``--norm-weight-decay`` and ``--bias-weight-decay`` as torchvision's recipe: parameter groups,
``--nesterov``), the rate set per epoch (``--warmup-epochs``, then cosine or constant), and
``--ema`` keeps a moving average of the weights (train_recipe.py).

Each epoch prints the train loss, the test loss and accuracy and the training throughput, and
saves a checkpoint (.npz: the model's and the optimizer's state_dict(), epoch, history and the
run's settings), written atomically. ``--resume FILE`` continues a run from it: the
batches of epoch e are shuffled by a Generator seeded with (seed, e), so on the CPU a resumed run
ends with bitwise the same weights as an uninterrupted one.

The ``examples`` extra (``pip install 'utensil-ffi[examples]'``) brings what this program uses beyond
the library: scikit-learn for the built-in digits, tqdm for the progress bar (``--no-progress``
runs without it), matplotlib for ``--plot``.
"""

import argparse
import math
import os
import re
import sys
import time

import numpy as np

from .. import _args
from .. import data as _data
from .._errors import ArgumentError, ShapeError, UtensilError
from ..blas import get_float32_matmul_precision, set_float32_matmul_precision
from ..functional import cross_entropy, cross_entropy_backward
from ..nn import models as _models
from ..nn.amp import MixedPrecision
from ..nn.module import _backward_params_only
from ..tensor import Tensor, cuda_available, get_num_threads, seed as _seed_library
from ..tensor import set_num_threads, zeros
from . import train_data as _train_data
from . import train_dist as _dist
from . import train_recipe as _recipe
from ._warn import cli_warnings
from .archs import ARCH_VERSION, arch_names, build_network, describe_network  # noqa: F401
from .archs import REGULARISATION, regularisation
from .archs import has_width_mult, min_image_size
# CHECKPOINT_FORMAT and CHECKPOINT_VERSION too: utensil_ffi.train, the old path, is this module
from .checkpoint import (CHECKPOINT_FORMAT, CHECKPOINT_VERSION, PROG, CheckpointError,  # noqa: F401
                         CheckpointWriter, _check_meta, load_checkpoint, save_checkpoint,
                         saved_words)
from .image_limits import image_size_problem
from .metrics import topk_correct
from .paths import writable_file_problem as _writable_file_problem

__all__ = ["main", "build_parser", "save_checkpoint", "load_checkpoint", "CheckpointError", "PROG"]

DEFAULT_CHECKPOINT = "utensil_checkpoint.npz"

# The settings that define a run. On --resume they come from the checkpoint; passing a different
# value explicitly is an error (a resumed run continues the saved one).
RUN_DEFAULTS = {
    "data": None,
    "arch": "digits",
    "width": 32,
    "width_mult": 1.0,
    "image_size": None,  # an image folder's images become squares of this size (None: as read)
    "augment": True,     # an image folder's training images: random resized crops and flips
    "batch_size": 64,
    "lr": None,  # per optimizer, see LR_DEFAULTS
    "optimizer": "adam",
    "momentum": 0.9,
    "lr_schedule": "cosine",
    "seed": 0,
    "weight_decay": None,  # per optimizer, see train_recipe.WEIGHT_DECAY_DEFAULTS
    "norm_weight_decay": None,  # the norm layers' weights and biases (None: --weight-decay)
    "bias_weight_decay": None,  # the other layers' biases (None: --weight-decay)
    "nesterov": False,
    "label_smoothing": 0.0,
    "warmup_epochs": 0,
    "ema": None,         # the EMA's decay per step; None: no EMA
    "init_from": None,   # the file the weights started from (a new run reads it, not a resume)
    "dropout": None,     # the model's dropout probability (None: its builder's default)
    "stochastic_depth_prob": None,  # likewise its stochastic depth's largest rate
}
LR_DEFAULTS = {"adam": 1e-2, "adamw": 1e-2, "sgd": 0.1}
# settings added after checkpoints existed: a checkpoint without one ran with this value
SAVED_DEFAULTS = {"arch": "digits", "width_mult": 1.0, "image_size": None, "augment": True,
                  "weight_decay": 0.0, "norm_weight_decay": None, "bias_weight_decay": None,
                  "nesterov": False, "label_smoothing": 0.0,
                  "warmup_epochs": 0, "ema": None, "init_from": None, "dropout": None,
                  "stochastic_depth_prob": None}
ARCHS = arch_names()
EMA_DEFAULT_DECAY = 0.999
PRECISIONS = ("fp32", "tf32", "bf16")
DEFAULT_EPOCHS = 20


class _UsageError(Exception):
    """Bad flags or environment: reported as `utensil-train: error: ...`, exit status 2."""


# -- command line ---------------------------------------------------------------------------------
def _number(kind, what, ok):
    """An argparse type: ``kind(s)`` (int or float), finite, for which ``ok(value)`` holds."""
    def parse(s):
        try:
            v = kind(s)
        except ValueError:
            v = None
        if v is None or not math.isfinite(v) or not ok(v):
            raise argparse.ArgumentTypeError("expected %s, got %r" % (what, s))
        return v

    parse.__name__ = what  # argparse names the type by it in some messages
    return parse


def _valid(rule, v):
    try:
        rule(v)
        return True
    except ArgumentError:
        return False


_POSITIVE_INT = _number(int, "a positive integer", lambda v: v >= 1)
_NONNEG_INT = _number(int, "an integer >= 0", lambda v: v >= 0)
_POSITIVE_FLOAT = _number(float, "a positive number", lambda v: v > 0)
_SEED = _number(int, "an integer in [0, 2**63)", lambda v: 0 <= v < 2**63)


def _lr(s):
    """--lr through the library's one rule for a learning rate (_args.to_lr)."""
    try:
        return _args.to_lr(float(s), "--lr")
    except (ValueError, ArgumentError) as e:
        raise argparse.ArgumentTypeError(
            str(e) if isinstance(e, ArgumentError) else "expected a number, got %r" % s) from None


_lr.__name__ = "a learning rate"
_MOMENTUM = _number(float, "a number in [0, 1)", lambda v: 0.0 <= v < 1.0)
_WEIGHT_DECAY = _number(float, "a number >= 0", lambda v: v >= 0.0)
_SMOOTHING = _number(float, "a number in [0, 1)", lambda v: 0.0 <= v < 1.0)
_DECAY = _number(float, "a number strictly between 0 and 1", lambda v: 0.0 < v < 1.0)
_PROB = _number(float, "a number in [0, 1)", lambda v: 0.0 <= v < 1.0)


_THREAD_COUNT = _number(int, "a positive integer or auto", lambda v: v >= 1)


def _threads(s):
    return "auto" if s == "auto" else _THREAD_COUNT(s)


def _check_output_paths(parser, args):
    """--checkpoint (or the file it defaults to) and --plot: parser errors up front."""
    if args.plot is not None:
        if not args.plot.lower().endswith(".png"):
            parser.error("--plot %s: the curves are written as PNG; give a file name ending in "
                         ".png" % args.plot)
        why = _writable_file_problem(args.plot, create_dirs=False)
        if why:
            parser.error("--plot %s: cannot write there: %s" % (args.plot, why))
    if not args.no_checkpoint:
        path = args.checkpoint or args.resume or DEFAULT_CHECKPOINT
        flag = "--checkpoint" if args.checkpoint else "--resume" if args.resume else "checkpoint"
        why = _writable_file_problem(path, create_dirs=True)
        if why:
            parser.error("%s %s: cannot save the checkpoint there: %s (or pass --no-checkpoint)"
                         % (flag, path, why))


def build_parser():
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Train a depthwise-separable (MobileNet-style) CNN built from utensil "
        "layers. With no arguments: the 8x8 handwritten digits scikit-learn ships, with a fixed "
        "held-out test split.",
        epilog="Optional extras: pip install 'utensil-ffi[examples]' (scikit-learn, tqdm, matplotlib).",
    )
    g = p.add_argument_group("data and model")
    g.add_argument("--data", metavar="DIR|FILE.npz", default=None,
                   help="train on your own data: a folder of images with one sub-folder per "
                   "class (PNG/JPEG...; with train/ and val/ sub-folders, or else 10%% of each "
                   "class held out), or an .npz with x_train, y_train, x_test, y_test (images "
                   "NCHW or NHW, integer labels); data without a test image are refused; "
                   "default: scikit-learn's digits")
    g.add_argument("--image-size", type=_POSITIVE_INT, default=None, metavar="S",
                   help="an image folder's images become S x S (resized, then cropped; default: "
                   "the first training image's size); only for a folder, and refused when one "
                   "batch of them would not fit in this machine's memory")
    g.add_argument("--no-augment", dest="augment", action="store_const", const=False,
                   default=None, help="no random resized crops and flips of a folder's "
                   "training images")
    g.add_argument("--workers", type=_NONNEG_INT, default=2, metavar="N",
                   help="background processes decoding an image folder (default 2; 0: in the "
                   "training process)")
    g.add_argument("--cache-images", action="store_true",
                   help="decode an image folder once and keep the decoded images in memory (up "
                   "to 1 GiB; augmentation still runs per sample): for folders that fit, when "
                   "decoding cannot keep up with training")
    g.add_argument("--skip-bad-images", action="store_true",
                   help="leave out, with a warning each, the files of an image folder that "
                   "cannot be read (default: stop with an error naming the first one)")
    g.add_argument("--layout", choices=_data.LAYOUTS, default="auto",
                   help="how --data's 4-D images are laid out: nchw, nhwc, or auto (default): "
                   "NCHW, and an error when the last axis has 1 or 3 entries (then it could "
                   "be NHWC channels; say which with --layout)")
    g.add_argument("--arch", choices=ARCHS, default=None, metavar="NAME",
                   help="the network: digits (the small depthwise-separable CNN sized by "
                   "--width, default), mobilenet_v1 (Howard et al. 2017; images under 96 "
                   "pixels keep its stem at stride 1), or one of torchvision's, with its "
                   "layout and state_dict keys (utensil_ffi.models): %s"
                   % ", ".join(a for a in ARCHS if a not in ("digits", "mobilenet_v1")))
    g.add_argument("--width-mult", type=_POSITIVE_FLOAT, default=None, metavar="M",
                   help="channel multiplier of the MobileNets (mobilenet_v1, v2, v3_small, "
                   "v3_large; default 1.0); the other families have none")
    g.add_argument("--width", type=_POSITIVE_INT, default=None, metavar="C",
                   help="digits: channels of the stem; the blocks use 2C and 4C (default %d)"
                   % RUN_DEFAULTS["width"])
    g.add_argument("--init-from", metavar="FILE", default=None,
                   help="start from these weights: a torchvision state_dict saved with "
                   "torch.save (.pt/.pth, needs torch) or an .npz of arrays, loaded by name; a "
                   "classifier of another class count is initialised afresh (fine-tuning)")
    g = p.add_argument_group("training")
    g.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="where to train (default: cuda if a GPU is present, else cpu)")
    g.add_argument("--epochs", type=_POSITIVE_INT, default=DEFAULT_EPOCHS, metavar="N",
                   help="train until this many epochs are done in all (also when resuming; "
                   "default %d)" % DEFAULT_EPOCHS)
    g.add_argument("--batch-size", type=_POSITIVE_INT, default=None, metavar="N",
                   help="images per step (default %d)" % RUN_DEFAULTS["batch_size"])
    g.add_argument("--optimizer", choices=_recipe.OPTIMIZERS, default=None,
                   help="adam, adamw (decoupled weight decay), or sgd with momentum (default "
                   "adam)")
    g.add_argument("--lr", type=_lr, default=None,
                   help="learning rate (default %g for adam and adamw, %g for sgd)"
                   % (LR_DEFAULTS["adam"], LR_DEFAULTS["sgd"]))
    g.add_argument("--momentum", type=_MOMENTUM, default=None,
                   help="SGD momentum (default %g)" % RUN_DEFAULTS["momentum"])
    g.add_argument("--nesterov", action="store_const", const=True, default=None,
                   help="SGD with Nesterov momentum")
    g.add_argument("--weight-decay", type=_WEIGHT_DECAY, default=None, metavar="W",
                   help="weight decay, as PyTorch's optimizers apply it: added to the gradient "
                   "(sgd, adam) or decoupled (adamw); default 0, for adamw %g"
                   % _recipe.WEIGHT_DECAY_DEFAULTS["adamw"])
    g.add_argument("--norm-weight-decay", type=_WEIGHT_DECAY, default=None, metavar="W",
                   help="weight decay of the normalization layers' weights and biases "
                   "(BatchNorm2d, LayerNorm, LayerNorm2d), as torchvision's reference recipe's "
                   "flag: a parameter group of its own (default: --weight-decay's)")
    g.add_argument("--bias-weight-decay", type=_WEIGHT_DECAY, default=None, metavar="W",
                   help="weight decay of the other layers' biases, likewise (default: "
                   "--weight-decay's)")
    g.add_argument("--lr-schedule", choices=("cosine", "constant"), default=None,
                   help="cosine: the rate decays to 0 over --epochs, set per epoch; "
                   "constant: no decay (default cosine)")
    g.add_argument("--warmup-epochs", type=_NONNEG_INT, default=None, metavar="K",
                   help="first K epochs: the rate grows linearly from %g of --lr to --lr, then "
                   "the schedule runs over the remaining epochs (default 0)"
                   % _recipe.WARMUP_START_FACTOR)
    g.add_argument("--label-smoothing", type=_SMOOTHING, default=None, metavar="E",
                   help="cross-entropy against (1 - E) one-hot + E / classes, as PyTorch's "
                   "label_smoothing, in training and evaluation (default 0)")
    g.add_argument("--dropout", type=_PROB, default=None, metavar="P",
                   help="the classifier's dropout probability, torchvision's ``dropout`` "
                   "(default: the model's, e.g. 0.2; the torchvision models only)")
    g.add_argument("--stochastic-depth-prob", type=_PROB, default=None, metavar="P",
                   help="stochastic depth's rate at the last block, growing linearly from 0 at "
                   "the first, torchvision's ``stochastic_depth_prob`` (default: the model's; "
                   "efficientnet and convnext only)")
    g.add_argument("--ema", type=_DECAY, nargs="?", const=EMA_DEFAULT_DECAY, default=None,
                   metavar="DECAY",
                   help="keep an exponential moving average of the weights, updated after "
                   "every step (avg += (1 - DECAY) (w - avg); DECAY default %g): evaluated, "
                   "saved in the checkpoint, and what utensil-export and utensil-predict use"
                   % EMA_DEFAULT_DECAY)
    g.add_argument("--seed", type=_SEED, default=None,
                   help="seeds the weight initialization and the shuffling (default 0)")
    g.add_argument("--threads", type=_threads, default=None, metavar="N|auto",
                   help="CPU threads for utensil's ops (default: the library's default); auto: "
                   "1 when other processes keep every core busy, else the default. The "
                   "choice is printed; results do not depend on it, only speed does")
    g.add_argument("--nproc-per-node", type=_POSITIVE_INT, default=None, metavar="N",
                   help="train on N GPUs of this machine, one process each (data-parallel, "
                   "NCCL; the same run as on one GPU: --batch-size stays the global batch). "
                   "Under torchrun leave it out: the launcher's environment is read")
    g.add_argument("--no-sync-bn", action="store_true",
                   help="on several GPUs, normalize with each GPU's own batch statistics "
                   "instead of the global batch's (SyncBatchNorm, the default)")
    g.add_argument("--precision", choices=PRECISIONS, default="fp32",
                   help="fp32 (default); tf32: float32 with the GPU's GEMMs on TF32 tensor cores "
                        "(set_float32_matmul_precision('high')); bf16: mixed precision, "
                        "bfloat16 activations with float32 weights (utensil.MixedPrecision; "
                        "emulated, not faster, on the CPU). Not a run setting: a resumed run "
                        "may change it")
    g.add_argument("--eval-batch-size", type=_POSITIVE_INT, default=500, metavar="N",
                   help="images per evaluation step (default 500)")
    g = p.add_argument_group("checkpoints and output")
    g.add_argument("--checkpoint", metavar="PATH", default=None,
                   help="where to save the checkpoint after each epoch, a file name used as "
                   "given (missing folders are created; default: the --resume file when "
                   "resuming, else ./%s)" % DEFAULT_CHECKPOINT)
    g.add_argument("--no-checkpoint", action="store_true", help="do not save checkpoints")
    g.add_argument("--resume", metavar="PATH", default=None,
                   help="continue the run saved in this checkpoint (with its settings)")
    g.add_argument("--plot", metavar="FILE.png", default=None,
                   help="draw the loss and accuracy curves into this PNG file; the name must end "
                   "in .png and its folder must exist (needs matplotlib)")
    g.add_argument("--no-progress", action="store_true", help="no per-step progress bar")
    g.add_argument("-q", "--quiet", action="store_true",
                   help="print only the final result (implies --no-progress)")
    return p


def _resolve(args, saved=None):
    """The run's settings: explicit flags, else the checkpoint's, else the defaults."""
    run = {}
    for k, default in RUN_DEFAULTS.items():
        given = getattr(args, k)
        if saved is not None:
            if k not in saved and k in SAVED_DEFAULTS:
                saved = dict(saved, **{k: SAVED_DEFAULTS[k]})
            if k not in saved:
                raise CheckpointError("the checkpoint does not record the setting %r" % k)
            if given is not None and given != saved[k] and not (
                    k in ("data", "init_from") and saved[k] and _same_file(given, saved[k])):
                raise _UsageError(
                    "--%s %s differs from the checkpoint's %s; a resumed run keeps the saved "
                    "run's settings (leave the flag out, or start a new run without --resume)"
                    % (k.replace("_", "-"), given, saved_words(k, saved[k])))
            run[k] = _saved_setting(k, saved[k])
        else:
            run[k] = given if given is not None else default
    if run["lr"] is None:
        run["lr"] = LR_DEFAULTS[run["optimizer"]]
    if run["weight_decay"] is None:
        run["weight_decay"] = _recipe.WEIGHT_DECAY_DEFAULTS[run["optimizer"]]
    for k in ("data", "init_from"):
        if run[k] is not None:
            run[k] = os.path.abspath(run[k])
    # not a flag: which layout --arch names (archs.py); a checkpoint without it predates v2
    run["arch_version"] = ARCH_VERSION if saved is None else _saved_setting(
        "arch_version", saved.get("arch_version", 1))
    _check_run(args, run, saved is not None)
    return run


def _check_run(args, run, resumed):
    """Usage errors for settings that make no sense together (the flags' own values are
    checked by argparse, a checkpoint's by _saved_setting)."""
    arch = run["arch"]
    if args.width_mult is not None and not has_width_mult(arch):
        raise _UsageError("--width-mult: %s has no width multiplier (%s)" % (
            arch, "size it with --width" if arch == "digits" else
            "only the MobileNets have one; mnasnet's is in its name, e.g. mnasnet0_5"))
    if args.width is not None and arch != "digits":
        raise _UsageError("--width sizes the digits network; %s is sized by its own layout%s"
                          % (arch, " and --width-mult" if has_width_mult(arch) else ""))
    taken = regularisation(arch, run["arch_version"])
    for k in REGULARISATION:
        if run[k] is not None and k not in taken:
            families = sorted({re.match("[a-z]+", a).group() for a in ARCHS
                               if k in regularisation(a)})
            raise _UsageError("--%s: %s has no %s (the %s models have)" % (
                k.replace("_", "-"), arch, k.replace("_", " "), ", ".join(families)))
    if run["optimizer"] != "sgd":
        if run["nesterov"]:
            raise _UsageError("--nesterov is SGD's; --optimizer %s has no Nesterov momentum"
                              % run["optimizer"])
        if args.momentum is not None:
            raise _UsageError("--momentum is SGD's; --optimizer %s has its own betas"
                              % run["optimizer"])
    elif run["nesterov"] and run["momentum"] == 0.0:
        raise _UsageError("--nesterov needs a momentum above 0 (--momentum)")
    if run["init_from"] is not None and not resumed:
        if not os.path.isfile(run["init_from"]):
            raise _UsageError("--init-from %s: no such file" % args.init_from)
        if not run["init_from"].lower().endswith((".pt", ".pth", ".npz")):
            raise _UsageError("--init-from %s: expected a state_dict saved with torch.save "
                              "(.pt or .pth) or an .npz of arrays" % args.init_from)
    # (constant: a run may stop inside its warm-up and be resumed with more --epochs)
    if run["lr_schedule"] == "cosine" and run["warmup_epochs"] >= args.epochs > 0:
        raise _UsageError("--warmup-epochs %d leaves no epoch of the cosine schedule after the "
                          "warm-up (--epochs %d): use fewer warm-up epochs or more epochs"
                          % (run["warmup_epochs"], args.epochs))


def _saved_setting(k, v):
    """A run setting read from a checkpoint, checked as the flag's value would be."""
    num = isinstance(v, (int, float)) and not isinstance(v, bool)
    integer = isinstance(v, int) and not isinstance(v, bool)
    ok = {
        "width": integer and v >= 1,
        "arch": v in ARCHS,
        "arch_version": integer and 1 <= v <= ARCH_VERSION,
        "image_size": v is None or (integer and v >= 1),
        "augment": isinstance(v, bool),
        "width_mult": num and math.isfinite(v) and v > 0,
        "batch_size": integer and v >= 1,
        "seed": integer and 0 <= v < 2**63,
        "lr": v is None or (num and _valid(_args.to_lr, v)),
        "momentum": num and 0.0 <= v < 1.0,
        "optimizer": v in _recipe.OPTIMIZERS,
        "weight_decay": num and math.isfinite(v) and v >= 0.0,
        "norm_weight_decay": v is None or (num and math.isfinite(v) and v >= 0.0),
        "bias_weight_decay": v is None or (num and math.isfinite(v) and v >= 0.0),
        "nesterov": isinstance(v, bool),
        "label_smoothing": num and 0.0 <= v < 1.0,
        "warmup_epochs": integer and v >= 0,
        "ema": v is None or (num and 0.0 < v < 1.0),
        "dropout": v is None or (num and 0.0 <= v < 1.0),
        "stochastic_depth_prob": v is None or (num and 0.0 <= v < 1.0),
        "init_from": v is None or isinstance(v, str),
        "lr_schedule": v in ("cosine", "constant"),
        "data": v is None or isinstance(v, str),
    }.get(k, True)
    if not ok:
        raise CheckpointError("the checkpoint's setting %r is %r, which is not a valid value"
                              % (k, v))
    return v


def _same_file(a, b):
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.abspath(a) == os.path.abspath(b)


# -- progress -------------------------------------------------------------------------------------
class _Progress:
    """A per-epoch tqdm progress bar (nothing when disabled)."""

    def __init__(self, total, desc, enabled):
        self.bar = None
        self.last = 0.0
        if enabled:
            from tqdm import tqdm  # _check_progress_available ran first

            self.bar = tqdm(total=total, desc=desc, unit="img", leave=False, file=sys.stderr,
                            dynamic_ncols=True, mininterval=0.2)

    def wants_loss(self):
        """Whether a refresh is due (reading the loss syncs the device, so not every step)."""
        return self.bar is not None and time.perf_counter() - self.last >= 0.2

    def update(self, n, loss=None):
        if self.bar is not None:
            self.bar.update(n)
            if loss is not None:
                self.bar.set_postfix(loss="%.4f" % loss, refresh=False)
                self.last = time.perf_counter()

    def close(self):
        if self.bar is not None:
            self.bar.close()


def _check_progress_available():
    try:
        import tqdm  # noqa: F401
    except ImportError:
        raise _UsageError("the progress bar needs tqdm, which is not installed: run `%s` (or "
                          "pass --no-progress)" % _data.EXTRA_HINT) from None


# -- training -------------------------------------------------------------------------------------
_lr_at = _recipe.lr_at


def train_epoch(net, opt, x, y, batch_size, seed, epoch, device, progress=None, dist=None,
                label_smoothing=0.0, after_step=None):
    """One pass over (x, y) in the order batches(seed, epoch); returns (mean loss, images, s).

    ``label_smoothing``: the cross-entropy's (PyTorch's); ``after_step``: called after every
    optimizer step (the EMA's update).

    ``progress``: None, or an object with wants_loss() and update(images, mean loss or None).
    ``dist`` (a train_dist.Dist, ``net`` its wrapped model): this rank's share of every batch;
    the loss and the image count are the global batch's."""
    net.train()
    total = zeros((1,), device)
    seen = images = 0
    share = None if dist is None else dist.share
    feed = x if isinstance(x, _train_data.TrainData) else _train_data.arrays(x, y)
    t0 = time.perf_counter()
    try:
        for whole, xs, ys in feed.train_batches(batch_size, seed, epoch, share):
            xb = Tensor(xs, device)
            yb = Tensor(ys.astype(np.float32), device)
            logits = net(xb)
            loss = cross_entropy(logits, yb, label_smoothing)
            grad = cross_entropy_backward(logits, yb, label_smoothing)
            if dist is not None:
                grad.mul_(dist.grad_scale(len(ys), whole))
            opt.zero_grad()
            # nothing reads the images' gradient: the first conv skips computing it
            _backward_params_only(net, grad)
            opt.step()
            if after_step is not None:
                after_step()
            loss.mul_(float(len(ys)))
            total.add_(loss)
            seen += len(ys)
            images += whole
            for t in (xb, yb, logits, loss, grad):
                t.close()
            if progress is not None:
                progress.update(whole, total.item() / seen if progress.wants_loss() else None)
        loss_sum = total.item()  # reading it waits for the device
        if dist is not None:
            loss_sum, seen = dist.sum_floats([loss_sum, seen])
        return loss_sum / max(seen, 1), images, time.perf_counter() - t0
    finally:
        total.close()


def evaluate(net, x, y, batch_size, device, dist=None):
    """(mean cross-entropy, accuracy) over (x, y) in eval mode (BatchNorm running statistics);
    with ``dist`` each rank evaluates its share and the sums are the ranks' together."""
    r = evaluate_full(net, x, y, batch_size, device, dist)
    return r["loss"], r["top1"]


def evaluate_full(net, x, y, batch_size, device, dist=None, num_classes=None,
                  label_smoothing=0.0):
    """{"loss", "top1", "top5", "confusion"} over (x, y) in eval mode: the mean cross-entropy,
    the share whose label is strictly the first (or among the first 5) of the logits (ties and
    NaN count against it: metrics.topk_correct), and the confusion matrix of the argmax (rows:
    true class, columns: predicted; num_classes defaults to the logits' width)."""
    net.eval()
    loss_sum, top1, top5 = 0.0, 0, 0
    confusion = None
    if isinstance(x, _train_data.TrainData):
        feed, n = x, x.n_test
    else:
        feed, n = _train_data.arrays(x[:0], y[:0], x, y), len(x)
    try:
        for xs, yb in feed.test_batches(batch_size, None if dist is None else dist.share):
            xb = Tensor(xs, device)
            logits = net(xb)
            loss = cross_entropy(logits, yb, label_smoothing)
            loss_sum += loss.item() * len(yb)
            z = logits.numpy()
            k = z.shape[1]
            if confusion is None:
                confusion = np.zeros((num_classes or k, num_classes or k), np.int64)
            pred = z.argmax(axis=1)
            top1 += int(topk_correct(z, yb, 1).sum())  # ties and NaN count against the label
            top5 += int(topk_correct(z, yb, 5).sum())
            np.add.at(confusion, (yb, pred), 1)
            for t in (xb, logits, loss):
                t.close()
    finally:
        net.train()
    if confusion is None:  # no test images here (with dist, callers give num_classes)
        confusion = np.zeros((num_classes or 0,) * 2, np.int64)
    if dist is not None:
        sums = dist.sum_floats(np.concatenate([[loss_sum, top1, top5], confusion.ravel()]))
        loss_sum, top1, top5 = float(sums[0]), int(round(sums[1])), int(round(sums[2]))
        confusion = np.rint(sums[3:]).astype(np.int64).reshape(confusion.shape)
    m = max(n, 1)
    return {"loss": loss_sum / m, "top1": top1 / m, "top5": top5 / m, "confusion": confusion}


def plot_history(history, path, title="", confusion=None, class_names=None):
    """The loss and accuracy curves, and beside them the confusion matrix when given (the last
    evaluation's: rows the true class, columns the predicted one)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ep = [h["epoch"] for h in history]
    panels = 3 if confusion is not None else 2
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4))
    a, b = axes[0], axes[1]
    a.plot(ep, [h["train_loss"] for h in history], "o-", label="train")
    a.plot(ep, [h["test_loss"] for h in history], "s-", label="test")
    a.set_xlabel("epoch")
    a.set_ylabel("cross-entropy")
    a.set_yscale("log")
    a.set_title("loss")
    a.legend()
    a.grid(True, alpha=0.3)
    b.plot(ep, [100.0 * h["test_acc"] for h in history], "o-", color="C2")
    b.set_xlabel("epoch")
    b.set_ylabel("test accuracy (%)")
    b.set_title("accuracy")
    b.grid(True, alpha=0.3)
    from matplotlib.ticker import MaxNLocator

    for ax in (a, b):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if confusion is not None:
        _plot_confusion(axes[2], np.asarray(confusion), class_names)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_confusion(ax, confusion, class_names):
    k = confusion.shape[0]
    rows = confusion.sum(axis=1, keepdims=True)
    share = confusion / np.maximum(rows, 1)  # each true class's row sums to 1: small classes show
    im = ax.imshow(share, cmap="Blues", vmin=0.0, vmax=1.0)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_title("confusion (last evaluation)")
    if k <= 20:
        names = list(class_names) if class_names is not None and len(class_names) == k \
            else [str(i) for i in range(k)]
        ax.set_xticks(range(k))
        ax.set_yticks(range(k))
        ax.set_xticklabels(names, rotation=90 if max(map(len, names)) > 2 else 0, fontsize=7)
        ax.set_yticklabels(names, fontsize=7)
        for i in range(k):
            for j in range(k):
                if confusion[i, j]:
                    ax.text(j, i, str(confusion[i, j]), ha="center", va="center", fontsize=6,
                            color="white" if share[i, j] > 0.5 else "black")
    ax.figure.colorbar(im, ax=ax, fraction=0.046, pad=0.04)


def _check_plot_available():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise _UsageError("--plot needs matplotlib, which is not installed: run `%s` (or "
                          "`pip install matplotlib`)" % _data.EXTRA_HINT) from None


def _auto_threads():
    """--threads auto: one thread when other processes already keep every core busy, else the
    library's default; returns the note printed with the model line.

    The per-op work of this network is small, so with several threads each op waits at a
    barrier for its slowest thread; on a machine whose cores are all taken, a descheduled thread
    stalls every op and training gets many times slower than on one thread. Results do not
    depend on the thread count (the CPU backend reduces in a fixed order), only speed does.
    """
    try:
        load = os.getloadavg()[0]
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    except (OSError, AttributeError):
        return "--threads auto, the load is unknown: the library's default"
    if cpus and load >= cpus:
        set_num_threads(1)
        return "--threads auto, the machine is busy, load %.1f on %d CPUs" % (load, cpus)
    return "--threads auto, load %.1f on %d CPUs" % (load, cpus or 0)


def _run(args, out):
    threads = get_num_threads()
    matmul = get_float32_matmul_precision()
    if args.precision == "tf32":
        set_float32_matmul_precision("high")
    try:
        return _run_with_threads(args, out)
    finally:
        # main() leaves the library as it found it
        if get_num_threads() != threads:
            set_num_threads(threads)
        if get_float32_matmul_precision() != matmul:
            set_float32_matmul_precision(matmul)


def _run_with_threads(args, out):
    dist = None
    if _dist.launched_world_size() > 1:
        if args.device == "cpu":
            raise _UsageError("training on several processes needs GPUs (NCCL); --device cpu "
                              "runs one process")
        dist = _dist.connect(sync_bn=not args.no_sync_bn)  # before any CUDA call: binds the GPU
    ok = False
    try:
        status = _run_ranked(args, out, dist)
        ok = status == 0  # interrupted (130): the others are being stopped, no barrier
        return status
    finally:
        if dist is not None:
            dist.close(ok)


def _run_ranked(args, out, dist):
    main_rank = dist is None or dist.is_main

    def say(*a):
        if not args.quiet and main_rank:
            print(*a, file=out, flush=True)

    # device
    if dist is not None and not cuda_available():
        raise _UsageError("rank %d: no GPU is visible to this process (CUDA_VISIBLE_DEVICES=%s)"
                          % (dist.rank, os.environ.get("CUDA_VISIBLE_DEVICES")))
    device = args.device or ("cuda" if cuda_available() else "cpu")
    if device == "cuda" and not cuda_available():
        raise _UsageError("--device cuda: no CUDA GPU is available (the library was built "
                          "without CUDA or no GPU is present); use --device cpu")
    if args.plot:
        _check_plot_available()
    if not (args.no_progress or args.quiet) and main_rank:
        _check_progress_available()
    threads_note = ""
    if args.threads == "auto":
        threads_note = _auto_threads()
    elif args.threads is not None:
        set_num_threads(args.threads)

    # settings, checkpoint
    resumed = None
    if args.resume:
        resumed = load_checkpoint(args.resume, with_ema=True)
        _check_meta(args.resume, resumed[0])
        run = _resolve(args, resumed[0].get("run", {}))
    else:
        run = _resolve(args)
    epochs = args.epochs
    ckpt_path = None
    if not args.no_checkpoint and main_rank:
        ckpt_path = args.checkpoint or args.resume or DEFAULT_CHECKPOINT

    # data
    why = run["data"] and os.path.isdir(run["data"]) and image_size_problem(
        run["image_size"], run["batch_size"], args.eval_batch_size)  # others refuse the flag
    if why:
        raise _UsageError(why)
    ds = _train_data.open_data(run["data"], args.layout, run["image_size"], run["augment"],
                               args.workers, "skip" if args.skip_bad_images else "raise",
                               cache=args.cache_images)
    try:
        return _run_on_data(args, out, dist, run, resumed, ds, device, epochs, ckpt_path, say,
                            threads_note)
    finally:
        ds.close()  # an image folder's loader workers


def _run_on_data(args, out, dist, run, resumed, ds, device, epochs, ckpt_path, say,
                 threads_note):
    data_info = {"name": ds.name, "image_shape": list(ds.image_shape),
                 "num_classes": ds.num_classes, "n_train": ds.n_train, "n_test": ds.n_test,
                 # what utensil-predict needs to prepare an image as training saw it
                 "mean": None if ds.mean is None else [float(v) for v in ds.mean],
                 "std": None if ds.std is None else [float(v) for v in ds.std],
                 "class_names": None if ds.class_names is None else list(ds.class_names),
                 "eval_transform": ds.eval_spec}
    if resumed is not None:
        saved = resumed[0].get("data_info", {})
        for k in ("image_shape", "num_classes", "n_train", "n_test"):
            if saved.get(k) != data_info[k]:
                raise CheckpointError("the data differ from the checkpoint's: %s is %s now, %s "
                                      "in the checkpoint" % (k, data_info[k], saved.get(k)))
    if dist is not None:
        why = dist.check_batches(ds.n_train, run["batch_size"])
        if why:
            raise _UsageError(why)
    least = min_image_size(run["arch"])
    if min(ds.image_shape[1:]) < least:
        raise _UsageError("--arch %s needs images of at least %d x %d pixels (its strided "
                          "convolutions are unpadded); %s has %d x %d%s"
                          % (run["arch"], least, least, ds.name, *ds.image_shape[1:],
                             "; pass --image-size" if run["data"] and os.path.isdir(run["data"])
                             else ""))

    # model and optimizer
    _seed_library(run["seed"])
    net = build_network(run, ds.image_shape, ds.num_classes, device)
    init_note = ""
    if run["init_from"] is not None and resumed is None:
        try:
            kept = _recipe.load_init(net, run["init_from"])
        except _recipe.InitError as e:
            net.close()
            raise _UsageError("--init-from %s" % e) from None
        init_note = "weights from %s%s" % (run["init_from"], (
            "; the classifier (%s) is initialised afresh: its shape differs (another class "
            "count)" % ", ".join(kept)) if kept else "")
    try:
        opt = _recipe.make_optimizer(run, net)
    except ArgumentError as e:  # a value argparse passed that float32 cannot hold (1e40)
        net.close()
        raise _UsageError("the optimizer's settings: %s" % e) from None
    ema = None
    history, start = [], 0
    try:
        ema = _recipe.make_ema(run, net)
        if resumed is not None:
            meta, model_state, optim_state, ema_state = resumed
            try:
                net.load_state_dict(model_state)
            except (ArgumentError, ShapeError) as e:
                raise CheckpointError("%s: the weights do not fit the network: %s"
                                      % (args.resume, e)) from None
            # after an epoch every parameter has state (none for SGD without momentum); one
            # missing would silently restart its moments
            want = set(range(len(opt.params))) if int(resumed[0]["epoch"]) and (
                run["optimizer"] != "sgd" or run["momentum"] != 0.0) else set()
            if set(optim_state["state"]) != want:
                raise CheckpointError("%s: the optimizer state has entries for parameters %s, "
                                      "expected %s" % (args.resume, sorted(optim_state["state"]),
                                                       sorted(want)))
            try:
                opt.load_state_dict(optim_state)
            except (ArgumentError, ShapeError) as e:
                raise CheckpointError("%s: the optimizer state does not fit: %s"
                                      % (args.resume, e)) from None
            if ema is not None:
                _load_ema(args.resume, ema, ema_state, int(meta["epoch"]))
            history = list(meta.get("history", []))
            start = int(meta["epoch"])
        # bf16: the layers compute on bfloat16 activations while net (saved, and what the
        # optimizer updates) keeps float32 weights
        trained = MixedPrecision(net) if args.precision == "bf16" else net
        model = trained if dist is None else dist.wrap(trained)
        try:
            return _train_loop(args, run, ds, data_info, net, opt, device, epochs, start,
                               history, ckpt_path, say, out, threads_note, dist, model, ema,
                               init_note)
        finally:
            if model is not net:
                model.close()
    finally:
        if ema is not None:
            ema.close()
        opt.close()
        net.close()


def _load_ema(path, ema, state, epoch):
    """The checkpoint's EMA into ``ema``; a run that saved none after an epoch is refused."""
    if state is None:
        if epoch:
            raise CheckpointError("%s: the run keeps an EMA of the weights (--ema) but the "
                                  "checkpoint holds none" % path)
        return
    try:
        ema.load_state_dict(state)
    except (ArgumentError, ShapeError) as e:
        raise CheckpointError("%s: the EMA weights do not fit the network: %s"
                              % (path, e)) from None


def describe_recipe(run, precision="fp32"):
    """The run description's line of the optimizer, schedule and loss settings."""
    parts = ["%s lr %g (%s%s)" % (run["optimizer"], run["lr"], run["lr_schedule"],
                                  ", %d warm-up epoch%s" % (run["warmup_epochs"],
                                                            "s" * (run["warmup_epochs"] != 1))
                                  if run["warmup_epochs"] else ""),
             "batch %d" % run["batch_size"], "seed %d" % run["seed"]]
    if run["optimizer"] == "sgd":
        parts.append("%smomentum %g" % ("Nesterov " if run["nesterov"] else "", run["momentum"]))
    if run["weight_decay"]:
        parts.append("weight decay %g" % run["weight_decay"])
    for k, what in (("norm_weight_decay", "norm layers"), ("bias_weight_decay", "biases")):
        if run.get(k) is not None:
            parts.append("%s' weight decay %g" % (what, run[k]))
    if run["label_smoothing"]:
        parts.append("label smoothing %g" % run["label_smoothing"])
    if run["ema"] is not None:
        parts.append("EMA of the weights, decay %g" % run["ema"])
    if precision != "fp32":
        parts.append("precision %s" % precision)
    return ", ".join(parts)


def _train_loop(args, run, ds, data_info, net, opt, device, epochs, start, history, ckpt_path,
                say, out, threads_note="", dist=None, model=None, ema=None, init_note=""):
    """``model`` is what trains (``net`` or its data-parallel wrapper); ``net`` is saved, and
    ``ema`` (an AveragedModel of net, or None) is evaluated and saved beside it."""
    model = net if model is None else model
    main_rank = dist is None or dist.is_main
    say("%s" % ds.describe())
    threads = get_num_threads()
    say("model: %s, %d parameters, on %s%s"
        % (describe_network(run), _models.count_parameters(net), device,
           " (%d CPU thread%s%s)" % (threads, "s" * (threads != 1),
                                     ": " + threads_note if threads_note else "")
           if device == "cpu" else ""))
    say(describe_recipe(run, args.precision))
    if init_note:
        say(init_note)
    if dist is not None:
        say("data-parallel on %d GPUs (NCCL), global batch %d split over them, %s" % (
            dist.world, run["batch_size"], "SyncBatchNorm" if dist.sync_bn
            else "per-GPU BatchNorm statistics"))
    if start:
        say("resumed from %s after epoch %d" % (args.resume, start))
    if start >= epochs:
        say("the checkpoint has %d epochs done already; nothing to train (raise --epochs)" % start)
    t_start = time.perf_counter()
    train_images, train_seconds = 0, 0.0
    show_progress = not (args.no_progress or args.quiet) and main_rank
    epoch = start
    confusion = None  # the last evaluation's, for the plot
    writer = ckpt_path and CheckpointWriter(ckpt_path, start if args.resume and _same_file(
        ckpt_path, args.resume) else None)
    try:
        for epoch in range(start, epochs):
            lr = _lr_at(run, epoch, epochs)
            for group in opt.param_groups:  # every group: they differ in weight decay only
                group["lr"] = lr
            bar = _Progress(ds.n_train, "epoch %d/%d" % (epoch + 1, epochs), show_progress)
            try:
                loss, n, secs = train_epoch(
                    model, opt, ds, None, run["batch_size"], run["seed"], epoch, device, bar,
                    dist, run["label_smoothing"],
                    None if ema is None else lambda: ema.update_parameters(net))
            finally:
                bar.close()
            # with --ema the averaged weights are the run's result: they are what is evaluated
            ev = evaluate_full(model if ema is None else ema, ds, None, args.eval_batch_size,
                               device, dist, ds.num_classes, run["label_smoothing"])
            test_loss, acc, confusion = ev["loss"], ev["top1"], ev["confusion"]
            train_images += n
            train_seconds += secs
            rec = {"epoch": epoch + 1, "train_loss": loss, "test_loss": test_loss,
                   "test_acc": acc, "test_top5": ev["top5"], "images_per_s": n / max(secs, 1e-9), "seconds": secs,
                   "lr": opt.lr, "device": device, "gpus": dist.world if dist else 1}
            history.append(rec)
            top5 = "  top-5 %6.2f%%" % (100 * ev["top5"]) if ds.num_classes > 5 else ""
            say("epoch %3d/%d  train loss %.4f  test loss %.4f  test acc %6.2f%%%s%s  %7.0f "
                "img/s  (%.2f s)" % (epoch + 1, epochs, loss, test_loss, 100 * acc, top5,
                                     " (EMA)" if ema is not None else "",
                                     rec["images_per_s"], secs))
            if writer:
                writer.save(net, opt, {
                    "epoch": epoch + 1, "run": run, "epochs": epochs, "history": history,
                    "data_info": data_info}, ema)
    except KeyboardInterrupt:
        print("\ninterrupted during epoch %d%s" % (
            epoch + 1, "; continue with: %s --resume %s --epochs %d"
            % (PROG, ckpt_path, epochs) if ckpt_path and history else ""), file=sys.stderr)
        if args.plot and history and main_rank:
            plot_history(history, args.plot, ds.name, confusion, ds.class_names)
        return 130
    total = time.perf_counter() - t_start
    if history and main_rank:
        last = history[-1]
        rate = train_images / train_seconds if train_seconds else float("nan")
        msg = "final test accuracy %.2f%% after %d epochs" % (100 * last["test_acc"], last["epoch"])
        if train_images:
            msg += " (%.1f s, %.0f img/s training on %s)" % (total, rate, device)
        print(msg, file=out, flush=True)
    if ckpt_path and epochs > start:
        say("checkpoint: %s" % ckpt_path)
    if args.plot and history and main_rank:
        plot_history(history, args.plot, ds.name, confusion, ds.class_names)
        say("curves%s: %s" % (" and confusion matrix" if confusion is not None else "",
                               args.plot))
    return 0


def main(argv=None, out=None):
    """Run the program; returns the exit status (0: trained; 2: bad usage, data or checkpoint;
    1: a failure on the way, such as a checkpoint that could not be saved)."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)  # exits with status 2 on bad flags
    _check_output_paths(parser, args)
    out = out or sys.stdout
    if args.nproc_per_node is not None:
        if _dist.launched_world_size():
            parser.error("--nproc-per-node: this process was started by a launcher already "
                         "(WORLD_SIZE is set); leave the flag out")
        if args.nproc_per_node > 1:
            if args.device == "cpu":
                parser.error("--nproc-per-node %d: several processes train on GPUs (NCCL); "
                             "--device cpu runs one" % args.nproc_per_node)
            if not cuda_available():  # once, here, not once per rank after it started
                parser.error("--nproc-per-node %d: no CUDA GPU is available (the library was "
                             "built without CUDA or no GPU is present); leave the flag out to "
                             "train on the CPU" % args.nproc_per_node)
            from ..distributed.launch import run as launch

            return launch(args.nproc_per_node, [sys.executable, "-m", "utensil_ffi.cli.train"]
                          + _dist.strip_nproc_flag(argv))
    try:
        with cli_warnings(PROG):
            return _run(args, out)
    except CheckpointError as e:
        msg = str(e)
        if args.resume and not msg.startswith(args.resume):
            msg = "%s: %s" % (args.resume, msg)
        print("%s: error: %s" % (PROG, msg), file=sys.stderr)
        return 2
    except (_UsageError, _data.DataError) as e:
        print("%s: error: %s" % (PROG, e), file=sys.stderr)
        return 2
    except UtensilError as e:  # DistributedError too: a peer died or hung
        print("%s: error: %s" % (PROG, e), file=sys.stderr)
        return 1
    except MemoryError:  # numpy's, say: not one of utensil's allocations (those are above)
        print("%s: error: out of memory; try a smaller --batch-size, --image-size or "
              "--eval-batch-size" % PROG, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
