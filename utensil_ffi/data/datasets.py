"""Data sets for utensil-train: the embedded handwritten digits, or the user's own .npz file.

Both give a ``Dataset``: float32 images ``[N, C, H, W]`` normalized per channel with the
training set's mean and standard deviation, and int64 labels in ``[0, num_classes)``.

- ``load_digits()``: the 1,797 8x8 handwritten digits scikit-learn ships (no download), with a
  fixed, stratified held-out split (20% per class to the test set, chosen by a numpy Generator
  seeded with 0, so the split does not depend on the training seed or the scikit-learn version).
- ``load_npz(path, layout="auto")``: a file with arrays ``x_train, y_train, x_test, y_test``;
  images as ``NHW`` or 4-D. 4-D arrays are ``NCHW`` with ``layout="nchw"``, ``NHWC`` (transposed)
  with ``layout="nhwc"``; ``"auto"`` reads them as ``NCHW`` but refuses, with a DataError asking
  for the layout, a shape whose last axis has 1 or 3 entries: (N, 5, 8, 3) may be 5 channels of
  8x3 pixels or 5x8 RGB pixels, and guessing wrong would train silently on scrambled images. Integer
  images (e.g. uint8 0..255) are scaled to [0, 1] before normalization. Anything else is refused
  with a ``DataError`` that says what is wrong.
- ``batches(n, batch_size, seed, epoch)``: the index batches of one epoch, shuffled by a
  Generator seeded with ``(seed, epoch)``, so any epoch's order can be reproduced on its own
  (which is what makes ``--resume`` exact).
"""

import os
from dataclasses import dataclass, field

import numpy as np

from .._errors import UtensilError

__all__ = ["DataError", "Dataset", "load_digits", "load_npz", "batches", "stratified_split",
           "EXTRA_HINT"]

EXTRA_HINT = "pip install 'utensil-ffi[examples]'"
KEYS = ("x_train", "y_train", "x_test", "y_test")
LAYOUTS = ("auto", "nchw", "nhwc")


class DataError(UtensilError, ValueError):
    """A data set that cannot be used, with a message meant for the user."""


@dataclass
class Dataset:
    name: str
    x_train: np.ndarray  # float32 [N, C, H, W], C-contiguous
    y_train: np.ndarray  # int64 [N]
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    mean: np.ndarray = field(default=None)  # per-channel normalization that was applied
    std: np.ndarray = field(default=None)
    class_names: tuple = field(default=None)  # a name per class index, when the data have them

    @property
    def image_shape(self):
        return tuple(self.x_train.shape[1:])

    @property
    def in_channels(self):
        return self.x_train.shape[1]

    def describe(self):
        c, h, w = self.image_shape
        return "%s: %d train / %d test images of %dx%dx%d, %d classes" % (
            self.name, len(self.x_train), len(self.x_test), c, h, w, self.num_classes)


def stratified_split(y, test_fraction=0.2, seed=0):
    """(train_idx, test_idx): per class, a seeded permutation sends round(fraction n_c) to test."""
    rng = np.random.default_rng(seed)
    train, test = [], []
    for c in np.unique(y):
        idx = np.flatnonzero(y == c)
        idx = idx[rng.permutation(len(idx))]
        k = int(round(test_fraction * len(idx)))
        test.append(idx[:k])
        train.append(idx[k:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


def _normalize(x_train, x_test):
    axes = (0, 2, 3)
    mean = x_train.mean(axis=axes, dtype=np.float64)
    std = x_train.std(axis=axes, dtype=np.float64)
    std = np.where(std > 0, std, 1.0)
    shape = (1, -1, 1, 1)

    def f(x):
        return np.ascontiguousarray(((x - mean.reshape(shape)) / std.reshape(shape)).astype(np.float32))

    return f(x_train), f(x_test), mean.astype(np.float32), std.astype(np.float32)


def _finish(name, x_train, y_train, x_test, y_test, num_classes):
    xtr, xte, mean, std = _normalize(x_train, x_test)
    return Dataset(name, xtr, y_train.astype(np.int64), xte, y_test.astype(np.int64),
                   int(num_classes), mean, std)


def load_digits(test_fraction=0.2, split_seed=0):
    """scikit-learn's 8x8 digits (pixels 0..16) as a Dataset with the fixed held-out split."""
    try:
        from sklearn.datasets import load_digits as _sk_digits
    except ImportError:
        raise DataError(
            "the built-in digits data set comes with scikit-learn, which is not installed: "
            "run `%s` (or `pip install scikit-learn`), or train on your own file with "
            "--data FILE.npz" % EXTRA_HINT
        ) from None
    d = _sk_digits()
    x = (np.asarray(d.images, dtype=np.float64) / 16.0)[:, None, :, :]
    y = np.asarray(d.target, dtype=np.int64)
    tr, te = stratified_split(y, test_fraction, split_seed)
    return _finish("digits (scikit-learn, 8x8)", x[tr], y[tr], x[te], y[te], 10)


def _images(name, a, path, layout="auto"):
    if a.dtype.kind not in "biuf":
        raise DataError("%s: %s has dtype %s; expected numbers" % (path, name, a.dtype))
    if a.ndim == 3:  # NHW
        a = a[:, None, :, :]
    elif a.ndim == 4:
        if layout == "auto" and a.shape[-1] in (1, 3):
            n, d1, d2, d3 = a.shape
            raise DataError(
                "%s: %s has shape %s, which is ambiguous: NCHW (%d channels of %dx%d pixels) or "
                "NHWC (%d channels of %dx%d pixels); say which with --layout nchw or --layout "
                "nhwc (layout= for load_npz)" % (path, name, a.shape, d1, d2, d3, d3, d1, d2))
        if layout == "nhwc":
            a = a.transpose(0, 3, 1, 2)
    else:
        raise DataError("%s: %s has shape %s; expected images as NCHW [N, C, H, W] or NHW "
                        "[N, H, W]" % (path, name, a.shape))
    if min(a.shape) < 1:
        raise DataError("%s: %s is empty (shape %s)" % (path, name, a.shape))
    if a.dtype.kind in "biu":
        scale = 255.0 if a.max() > 1 else 1.0
        a = a.astype(np.float64) / scale
    else:
        a = a.astype(np.float64)
        if not np.all(np.isfinite(a)):
            raise DataError("%s: %s contains NaN or infinite values" % (path, name))
    return a


def _labels(name, y, n, path):
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.ndim != 1:
        raise DataError("%s: %s has shape %s; expected one integer class label per image"
                        % (path, name, y.shape))
    if y.shape[0] != n:
        raise DataError("%s: %s has %d labels but there are %d images" % (path, name, y.shape[0], n))
    if y.dtype.kind == "f":
        if not np.all(np.isfinite(y)) or np.any(y != np.round(y)):
            raise DataError("%s: %s must hold integer class indices" % (path, name))
    elif y.dtype.kind not in "biu":
        raise DataError("%s: %s has dtype %s; expected integer class indices" % (path, name, y.dtype))
    y = y.astype(np.int64)
    if y.min() < 0:
        raise DataError("%s: %s has negative class indices" % (path, name))
    return y


def load_npz(path, layout="auto"):
    """The user's data: an .npz with x_train, y_train, x_test, y_test (see the module doc for
    ``layout``: "auto", "nchw" or "nhwc")."""
    if layout not in LAYOUTS:
        raise DataError("layout must be one of %s, got %r" % (", ".join(LAYOUTS), layout))
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise DataError("%s: no such file" % path)
    with open(path, "rb") as f:
        magic = f.read(6)
    if magic == b"\x93NUMPY":
        raise DataError("%s: a single array (.npy), not an .npz archive with %s; save them with "
                        "numpy.savez(path, x_train=..., y_train=..., x_test=..., y_test=...)"
                        % (path, ", ".join(KEYS)))
    if not magic.startswith(b"PK"):
        raise DataError("%s: not a readable .npz file (not a zip archive); save the arrays with "
                        "numpy.savez" % path)
    try:
        with np.load(path, allow_pickle=False) as f:
            missing = [k for k in KEYS if k not in f.files]
            if missing:
                raise DataError("%s: missing array(s) %s; the file must hold %s (it has: %s)"
                                % (path, ", ".join(missing), ", ".join(KEYS),
                                   ", ".join(f.files) or "nothing"))
            arrays = {k: np.asarray(f[k]) for k in KEYS}
    except DataError:
        raise
    except ValueError as e:  # object arrays need pickle, which we refuse
        raise DataError("%s: cannot read the arrays without pickle (%s); save plain numeric "
                        "arrays with numpy.savez" % (path, e)) from None
    except Exception as e:  # not a zip / npy file
        raise DataError("%s: not a readable .npz file (%s)" % (path, e)) from None
    x_train = _images("x_train", arrays["x_train"], path, layout)
    x_test = _images("x_test", arrays["x_test"], path, layout)
    if x_train.shape[1:] != x_test.shape[1:]:
        raise DataError("%s: x_train images are %s but x_test images are %s"
                        % (path, x_train.shape[1:], x_test.shape[1:]))
    y_train = _labels("y_train", arrays["y_train"], len(x_train), path)
    y_test = _labels("y_test", arrays["y_test"], len(x_test), path)
    num_classes = int(max(y_train.max(), y_test.max())) + 1
    if num_classes < 2:
        raise DataError("%s: the labels name a single class; a classifier needs at least two" % path)
    if len(x_train) < 2:
        raise DataError("%s: x_train needs at least 2 images" % path)
    return _finish(os.path.basename(path), x_train, y_train, x_test, y_test, num_classes)


def batches(n, batch_size, seed, epoch, shuffle=True):
    """Index arrays for one epoch; the order depends only on (seed, epoch).

    A last batch of one image is dropped (BatchNorm cannot train on a single value per channel).
    """
    order = np.random.default_rng([int(seed), int(epoch)]).permutation(n) if shuffle else np.arange(n)
    out = [order[i:i + batch_size] for i in range(0, n, batch_size)]
    if len(out) > 1 and len(out[-1]) < 2:
        out.pop()
    return out
