"""utensil-train's checkpoints: one .npz file per run, written atomically.

    save_checkpoint(path, net, opt, meta, ema=None)  # after each epoch
    meta, model_state, optim_state = load_checkpoint(path)
    meta, model_state, optim_state, ema_state = load_checkpoint(path, with_ema=True)

The arrays ``model/<key>`` hold ``net.state_dict()``, ``optim/<i>/<name>`` the optimizer's
per-parameter state, ``ema/<key>`` (with ``--ema``) the AveragedModel's state_dict
(``n_averaged``, ``module.<key>``: the averaged weights under the model's own keys); ``meta``
is JSON: the run's settings, epoch, history, the data's shape and classes, the optimizer's
param_groups, and the format's name and version, which load_checkpoint checks. utensil-export
and utensil-predict read the same files (the EMA's weights when there are some).
"""

import json
import os

import numpy as np

from .._errors import UtensilError
from .paths import temporary_name

__all__ = ["save_checkpoint", "load_checkpoint", "CheckpointError", "CheckpointSaveError",
           "CheckpointWriter", "CHECKPOINT_FORMAT", "CHECKPOINT_VERSION", "saved_words",
           "ema_weights"]

PROG = "utensil-train"  # the program that writes them and resumes from them (cli/train.py)
CHECKPOINT_FORMAT = "utensil-train-checkpoint"
CHECKPOINT_VERSION = 2  # 2: the model's and optimizer's state_dict() in PyTorch's layout


class CheckpointError(UtensilError, ValueError):
    """A checkpoint that cannot be resumed from, with a message meant for the user."""


class CheckpointSaveError(UtensilError, OSError):
    """A checkpoint that could not be written (a full disk, a folder gone): names the path, the
    cause, and what is kept. Not a CheckpointError: the run was fine, the file system was not."""


def save_checkpoint(path, net, opt, meta, ema=None):
    """Write the checkpoint atomically (a temporary file in the same folder, then os.replace).

    The arrays: ``model/<key>`` for each entry of ``net.state_dict()``, ``optim/<i>/<name>`` for
    each array of ``opt.state_dict()["state"]``, ``ema/<key>`` for ``ema.state_dict()`` when an
    AveragedModel is given; the optimizer's param_groups go into the JSON metadata with
    ``meta``."""
    arrays = {"model/" + k: v for k, v in net.state_dict().items()}
    if ema is not None:
        arrays.update({"ema/" + k: v for k, v in ema.state_dict().items()})
    osd = opt.state_dict()
    for i, entry in osd["state"].items():
        arrays.update({"optim/%d/%s" % (i, k): v for k, v in entry.items()})
    meta = dict(meta, format=CHECKPOINT_FORMAT, version=CHECKPOINT_VERSION,
                optimizer_param_groups=osd["param_groups"])
    arrays["meta"] = np.array(json.dumps(meta))
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = temporary_name(path)
    try:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


class CheckpointWriter:
    """utensil-train's saves, one per epoch, to ``path``; ``saved_epoch``: the epoch of the
    checkpoint already there when resuming from this same file (else None).

    A save that fails (OSError: a full disk, a file-size limit, the folder removed) raises
    CheckpointSaveError naming the path and the cause and saying what is kept: the atomic write
    leaves the last good checkpoint as it was, and the user learns how to continue from it."""

    def __init__(self, path, saved_epoch=None):
        self.path, self.saved_epoch = path, saved_epoch

    def save(self, net, opt, meta, ema=None):
        try:
            save_checkpoint(self.path, net, opt, meta, ema)
        except OSError as e:
            cause = e.strerror or str(e) or type(e).__name__
            if self.saved_epoch is None:
                kept = ("no checkpoint of this run was saved (a file already at %s is left as "
                        "it was)" % self.path)
            else:
                kept = ("the last good checkpoint, after epoch %d, is kept: continue with %s "
                        "--resume %s --epochs %d (and --checkpoint elsewhere if this disk is full)"
                        % (self.saved_epoch, PROG, self.path,
                                                     meta.get("epochs", meta["epoch"])))
            raise CheckpointSaveError("could not save the checkpoint to %s: %s; %s"
                                      % (self.path, cause, kept)) from None
        self.saved_epoch = meta["epoch"]


def load_checkpoint(path, with_ema=False):
    """(meta, model state_dict, optimizer state_dict) from a checkpoint file; CheckpointError if
    unusable. ``with_ema``: a fourth item, the EMA's state_dict (None when the run kept none)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise CheckpointError("%s: no such checkpoint file" % path)
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
    except Exception as e:
        # np.load reads any .npy/.npz/pickle: what it says of a foreign file (advice to unpickle
        # it unsafely, say) is no help; say what the file is not
        raise CheckpointError("%s: not a readable checkpoint (not an .npz of arrays written by "
                              "%s; numpy: %s)" % (path, PROG, type(e).__name__)) from None
    try:
        meta = json.loads(str(arrays.pop("meta")))
        ok = meta.get("format") == CHECKPOINT_FORMAT
    except Exception:
        ok = False
    if not ok:
        raise CheckpointError("%s: not a %s checkpoint" % (path, PROG))
    if meta.get("version") != CHECKPOINT_VERSION:
        raise CheckpointError("%s: checkpoint version %r, this program reads version %d"
                              % (path, meta.get("version"), CHECKPOINT_VERSION))
    model = {k[6:]: v for k, v in arrays.items() if k.startswith("model/")}
    if not model:
        raise CheckpointError("%s: the checkpoint holds no model weights" % path)
    state = {}
    for k, v in arrays.items():
        if k.startswith("optim/"):
            i, _, name = k[6:].partition("/")
            if not (i.isdigit() and name):
                raise CheckpointError("%s: %r is not an optimizer state entry" % (path, k))
            state.setdefault(int(i), {})[name] = v
    groups = meta.get("optimizer_param_groups")
    if not isinstance(groups, list):
        raise CheckpointError("%s: the checkpoint's metadata has no optimizer_param_groups" % path)
    optim = {"state": state, "param_groups": groups}
    if not with_ema:
        return meta, model, optim
    ema = {k[4:]: v for k, v in arrays.items() if k.startswith("ema/")}
    return meta, model, optim, ema or None


def ema_weights(ema_state):
    """The averaged weights of an EMA state_dict under the model's own keys."""
    return {k[7:]: v for k, v in ema_state.items() if k.startswith("module.")}


# what a checkpoint's run setting of None means, in words (its JSON null is no answer to a user)
_NONE_WORDS = {"data": "data: it was trained on the built-in digits",
               "image_size": "image size: none, the images were used at the first one's size"}


def saved_words(key, value):
    """A checkpoint's run setting ``key`` = ``value`` as an error message shows it, after "the
    checkpoint's"."""
    if value is None:
        return _NONE_WORDS.get(key, "%s: none" % key.replace("_", " "))
    return str(value)


def _check_meta(path, meta):
    """Raise CheckpointError naming ``path`` unless the metadata has what a resume reads."""
    def bad(what):
        raise CheckpointError("%s: the checkpoint's metadata %s" % (path, what))

    if not isinstance(meta.get("epoch"), int) or isinstance(meta["epoch"], bool) \
            or meta["epoch"] < 0:
        bad("has no valid 'epoch' (epochs done: an integer >= 0), got %r" % (meta.get("epoch"),))
    for k, kind in (("run", dict), ("data_info", dict), ("history", list)):
        if not isinstance(meta.get(k, kind()), kind) or (k != "data_info" and k not in meta):
            bad("has no valid %r (expected a %s), got %r" % (k, kind.__name__, meta.get(k)))
    for i, h in enumerate(meta["history"]):
        if not isinstance(h, dict) or not all(
                isinstance(h.get(f), (int, float)) and not isinstance(h.get(f), bool)
                for f in ("epoch", "train_loss", "test_loss", "test_acc")):
            bad("has a malformed history entry %d: %r" % (i, h))
