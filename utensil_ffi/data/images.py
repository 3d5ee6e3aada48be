"""Image folders: torchvision's ImageFolder layout, decoded with Pillow.

    root/cat/001.png
    root/cat/nested/002.jpg      class folders are searched recursively
    root/dog/003.png

    from utensil_ffi.data import images, transforms as T
    ds = images.ImageFolder("root", transform=T.Compose([T.Resize(32), T.CenterCrop(32)]))
    x, label = ds[0]             # float32 [3, 32, 32] in [0, 1], int

Class names are the sorted sub-folder names; class i is ``classes[i]``. Files whose extension
(any case) is not in ``extensions`` are ignored, and so are hidden files and folders (names
starting with ".", such as macOS's ``._photo.jpg``). Every image is converted to ``mode`` ("RGB"
or "L"): palette images through RGBA (so transparency is honoured before the alpha is dropped),
16-bit grayscale (I;16, I) scaled to 8 bits (/257) rather than clipped, alpha channels dropped.

Bad input is a DataError naming the file or folder, raised at construction, before any training:
a root that is not a folder, no class folders, a single class, a class folder without images,
and each file Pillow cannot read. The scan costs one ``Image.open`` per file: ``check="verify"``
(the default) reads each header and runs Pillow's ``verify()`` (which checks a PNG's chunk CRCs
to its end, but not a JPEG's compressed data); ``check="decode"`` decodes every file (finds a
truncated JPEG too, at the cost of a full pass); ``check="none"`` only lists the files. A file that
still fails to decode later (a truncated JPEG under "verify", a file changed since) raises a
DataError naming it when it is loaded. ``hints`` rewords the advice these errors end with, for a
program whose users pass flags rather than arguments (utensil-train). With ``on_error="skip"`` the files that fail the scan are
left out, each with one ``warnings.warn`` naming it (``ds.skipped`` lists them); a class left with
no images is still an error, since dropping it would renumber the classes after it.

Random transforms draw from ``np.random.default_rng((seed, epoch, index))`` (see transforms.py):
``ds.load(index, rng)`` takes the generator; ``ds[index]`` uses seed 0, epoch 0. ``ds.random``
says whether the transform draws at all (when not, the loader passes ``rng=None``).

Decoding dominates the cost of small images (about 0.1-0.2 ms of CPU per 32x32 PNG, more than
the rest of the pipeline together). ``ds.cached()`` decodes every image once and keeps them in
memory (uint8, in ``mode``); transforms, random ones included, still run per sample and epoch.
Loader workers each receive a copy, so it suits data sets of small images.

``load_folder(root, image_size)`` is what utensil-train's ``--data DIR`` builds: train/val (or
train/test) sub-folders, or one class folder split by ``stratified_split``, with training and
evaluation transforms normalized by the training images' channel statistics. The evaluation
transform is built from a JSON-able description, ``eval_spec(size, mean, std)``, which
``eval_transform(spec)`` turns back into the same transform: utensil-train records it in its
checkpoints and utensil-predict replays it.
"""

import copy
import os
import warnings
from dataclasses import dataclass

import numpy as np

from .datasets import DataError
from .transforms import CenterCrop, Compose, Normalize, RandomHorizontalFlip
from .transforms import RandomResizedCrop, Resize, ToArray, is_random

__all__ = ["ImageFolder", "IMG_EXTENSIONS", "IMAGES_HINT", "open_image", "stratified_split",
           "channel_stats", "load_folder", "FolderData", "eval_spec", "eval_transform"]

IMAGES_HINT = "pip install 'utensil-ffi[images]'"
IMG_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm",
                  ".pgm", ".pbm")
MODES = ("RGB", "L")
ON_ERROR = ("raise", "skip")
CHECKS = ("verify", "decode", "none")
# Pillow modes that become L/RGB faithfully; others (F, LAB, HSV...) have no fixed 8-bit meaning.
_SIXTEEN_BIT = ("I;16", "I;16L", "I;16B", "I;16N", "I")
_CONVERTIBLE = frozenset(("1", "L", "LA", "La", "P", "PA", "RGB", "RGBA", "RGBa", "RGBX", "CMYK",
                          "YCbCr") + _SIXTEEN_BIT)
_TO_ARRAY = ToArray()
# the advice ending a scan failure ("skip"), a decode failure at load time ("load") and cached()'s
# refusal ("cache", formatted with max_bytes), worded for Python callers; ImageFolder(hints=...)
# rewords it (utensil-train names its flags)
HINTS = {"skip": "pass on_error='skip' to leave unreadable files out",
         "load": "ImageFolder(check='decode') finds every such file before training",
         "cache": "more than max_bytes=%d bytes of memory; read them from the files instead, or "
                  "raise the limit"}


def _pil():
    try:
        from PIL import Image
    except ImportError:
        raise DataError("image folders are decoded with Pillow, which is not installed: run `%s` "
                        "(or `pip install pillow`)" % IMAGES_HINT) from None
    return Image


def _reason(e):
    from PIL import UnidentifiedImageError

    if isinstance(e, UnidentifiedImageError):
        return "not an image Pillow can read"
    return "%s: %s" % (type(e).__name__, e)


def _to_mode(img, mode, Image):
    """``img`` loaded, in ``mode`` (L or RGB); ValueError for a mode with no 8-bit map."""
    m = img.mode
    if m == mode:
        img.load()
        return img
    if m not in _CONVERTIBLE:
        raise ValueError("image mode %s cannot be converted to %s" % (m, mode))
    if m in _SIXTEEN_BIT:  # Pillow's own conversion clips 16-bit values at 255
        a = np.asarray(img, dtype=np.float32)
        img = Image.fromarray(np.clip(np.rint(a / 257.0), 0, 255).astype(np.uint8), "L")
    elif m == "P" and "transparency" in img.info:
        img = img.convert("RGBA")
    return img.convert(mode)


def open_image(path, mode="RGB", hint=""):
    """The image file at ``path`` as a loaded PIL image in ``mode`` ("RGB" or "L"), converted as
    the module doc says; a file that cannot be decoded is a DataError naming it (``hint`` is
    appended to the message)."""
    if mode not in MODES:
        raise ValueError("mode must be one of %s, got %r" % (", ".join(MODES), mode))
    Image = _pil()
    try:
        with Image.open(path) as im:
            return _to_mode(im, mode, Image)
    except Exception as e:  # Pillow raises many kinds (OSError, SyntaxError, struct.error...)
        raise DataError("%s: cannot decode this image (%s)%s" % (path, _reason(e), hint)) from None


def _files(folder, extensions, seen=None):
    """The image files under ``folder``, recursively, in sorted order; hidden names skipped.
    Symbolic links to folders are followed, but a folder reached twice (a link loop, or a second
    link to a folder already walked) is a DataError naming both paths: walking it again would
    count its images twice, under another class. ``seen`` maps (device, inode) to the first path
    of each folder walked, across the classes of one ImageFolder."""
    seen = {} if seen is None else seen
    out = []
    for here, dirs, names in os.walk(folder, followlinks=True):
        st = os.stat(here)
        first = seen.setdefault((st.st_dev, st.st_ino), here)
        if first != here:
            raise DataError("%s: the same folder as %s (a symbolic link loop, or a second link to "
                            "it): its images would be counted twice; remove the link" % (here, first))
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(names):
            if not name.startswith(".") and name.lower().endswith(extensions):
                out.append(os.path.join(here, name))
    return out


class ImageFolder:
    """One sub-folder of images per class under ``root`` (see the module doc).

    ``ImageFolder(root, transform=None, on_error="raise", extensions=IMG_EXTENSIONS,
    mode="RGB", check="verify", hints=None)``: ``ds[i]`` / ``ds.load(i, rng)`` -> (float32 [C, H, W] array,
    int label); the transform gets the image in ``mode`` and a Generator, and a PIL image it
    returns is turned into an array by ToArray. Attributes as torchvision's: ``classes``,
    ``class_to_idx``, ``samples`` [(path, label)], ``targets``; and ``skipped`` [(path, why)].
    """

    def __init__(self, root, transform=None, on_error="raise", extensions=IMG_EXTENSIONS,
                 mode="RGB", check="verify", hints=None):
        if on_error not in ON_ERROR:
            raise ValueError("on_error must be one of %s, got %r" % (", ".join(ON_ERROR), on_error))
        if mode not in MODES:
            raise ValueError("mode must be one of %s, got %r" % (", ".join(MODES), mode))
        if check not in CHECKS:
            raise ValueError("check must be one of %s, got %r" % (", ".join(CHECKS), check))
        if transform is not None and not callable(transform):
            raise TypeError("transform must be callable as transform(img, rng), got %r"
                            % (transform,))
        if isinstance(extensions, str):
            extensions = (extensions,)
        self.extensions = tuple(e.lower() for e in extensions)
        self.root = os.fspath(root)
        self.transform = transform
        self.mode = mode
        self.on_error = on_error
        self.hints = dict(HINTS, **(hints or {}))
        self._cache = None  # the decoded images, when cached()
        Image = _pil()
        self.classes = self._find_classes()
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        self.samples = []
        self.skipped = []
        seen = {}  # the folders walked so far, over every class
        for c in self.classes:
            folder = os.path.join(self.root, c)
            files = _files(folder, self.extensions, seen)
            if not files:
                raise DataError("%s: the class folder has no images (looked for %s files); add "
                                "images or remove the folder" % (folder, "/".join(self.extensions)))
            kept = []
            for p in files:  # a loop, not a comprehension: the warning's stacklevel counts frames
                if self._readable(p, check, Image):
                    kept.append(p)
            if not kept:
                raise DataError("%s: every image in this class folder was unreadable and skipped; "
                                "a class without images cannot be trained" % folder)
            self.samples.extend((p, self.class_to_idx[c]) for p in kept)
        self.targets = [label for _, label in self.samples]

    def _find_classes(self):
        root = self.root
        if not os.path.exists(root):
            raise DataError("%s: no such folder" % root)
        if not os.path.isdir(root):
            raise DataError("%s: not a folder; an image data set is a folder with one sub-folder "
                            "of images per class" % root)
        try:
            entries = sorted(os.scandir(root), key=lambda e: e.name)
        except OSError as e:
            raise DataError("%s: cannot list the folder (%s)" % (root, e)) from None
        classes = [e.name for e in entries if not e.name.startswith(".") and e.is_dir()]
        if not classes:
            loose = sum(1 for e in entries if e.name.lower().endswith(self.extensions))
            raise DataError("%s: no class folders%s; put each class's images in a sub-folder named "
                            "after the class (root/cat/1.png, root/dog/2.png)"
                            % (root, " (it holds %d images directly)" % loose if loose else ""))
        if len(classes) == 1:
            raise DataError("%s: a single class folder (%s); a classifier needs at least two"
                            % (root, classes[0]))
        return classes

    def _readable(self, path, check, Image):
        """True if ``path`` passes the scan; else raise, or warn and return False (skip)."""
        if check == "none":
            return True
        try:
            with Image.open(path) as im:
                if im.mode not in _CONVERTIBLE:
                    raise ValueError("image mode %s cannot be converted to %s"
                                     % (im.mode, self.mode))
                if check == "decode":
                    _to_mode(im, self.mode, Image)
                else:
                    im.verify()
            return True
        except Exception as e:  # Pillow raises many kinds (OSError, SyntaxError, struct.error...)
            why = _reason(e)
        if self.on_error == "raise":
            raise DataError("%s: cannot read this image (%s); fix or remove it, or %s"
                            % (path, why, self.hints["skip"]))
        self.skipped.append((path, why))
        warnings.warn("skipping %s: cannot read this image (%s)" % (path, why), stacklevel=3)
        return False

    def __len__(self):
        return len(self.samples)

    def image(self, index):
        """The PIL image of sample ``index`` in ``mode``, before the transform."""
        if self._cache is not None:
            return self._cache[index].copy()  # a transform may change its image in place
        return open_image(self.samples[index][0], self.mode, "; " + self.hints["load"])

    @property
    def random(self):
        """Whether the transform draws from the rng (see transforms.is_random)."""
        return self.transform is not None and is_random(self.transform)

    def load(self, index, rng):
        """(float32 [C, H, W] array, label) of sample ``index``, transformed with ``rng``."""
        x = self.image(index)
        if self.transform is not None:
            x = self.transform(x, rng)
        if not isinstance(x, np.ndarray):
            x = _TO_ARRAY(x)
        return x, self.samples[index][1]

    def __getitem__(self, index):
        index = range(len(self.samples))[index]  # negative indices, and IndexError past the end
        return self.load(index, np.random.default_rng((0, 0, index)) if self.random else None)

    def cached(self, max_bytes=1 << 30):
        """A copy that has decoded every image, now, and serves them from memory; a DataError
        (before decoding them all) when they would take more than ``max_bytes``."""
        if self._cache is not None:
            return copy.copy(self)
        images, total = [], 0
        for i in range(len(self.samples)):
            img = self.image(i)
            total += img.size[0] * img.size[1] * len(img.getbands())
            if total > max_bytes:
                raise DataError("%s: the decoded images need %s"
                                % (self.root, self.hints["cache"] % max_bytes))
            images.append(img)
        other = copy.copy(self)
        other._cache = images
        return other

    def with_transform(self, transform):
        """A copy with another transform, sharing the scanned file list (no new scan)."""
        other = copy.copy(self)
        other.transform = transform
        return other

    def __repr__(self):
        return "ImageFolder(%r: %d images, %d classes, mode=%s%s, transform=%r)" % (
            self.root, len(self.samples), len(self.classes), self.mode,
            ", cached" if self._cache is not None else "", self.transform)


def stratified_split(targets, fraction, seed=0):
    """(train_idx, val_idx), sorted int64: per class (in sorted order), a permutation drawn from
    ``np.random.default_rng(seed)`` sends ``round(fraction * n_c)`` samples to val, clamped to
    [1, n_c - 1] so that a class with >= 2 samples is in both parts (a class with one sample
    goes to train). Deterministic in (targets, fraction, seed)."""
    y = np.asarray(targets)
    if y.ndim != 1 or (y.size and y.dtype.kind not in "biu"):
        raise ValueError("stratified_split: targets must be a 1-D sequence of integer labels")
    fraction = float(fraction)
    if not 0.0 < fraction < 1.0:
        raise ValueError("stratified_split: fraction must be in (0, 1), got %r" % fraction)
    rng = np.random.default_rng(seed)
    train, val = [np.empty(0, np.int64)], [np.empty(0, np.int64)]
    for c in np.unique(y):
        idx = np.flatnonzero(y == c)
        idx = idx[rng.permutation(len(idx))]
        n = len(idx)
        k = min(max(int(round(fraction * n)), 1), n - 1) if n >= 2 else 0
        val.append(idx[:k])
        train.append(idx[k:])
    return (np.sort(np.concatenate(train)).astype(np.int64),
            np.sort(np.concatenate(val)).astype(np.int64))


def channel_stats(dataset, indices=None, max_images=1000, seed=0):
    """(mean, std) float32 per channel over the pixels of up to ``max_images`` samples of
    ``dataset`` (drawn without replacement by ``default_rng(seed)`` when there are more), each
    loaded with its transform and ``default_rng((seed, 0, index))``. A channel with std 0 gets 1."""
    idx = np.arange(len(dataset)) if indices is None else np.asarray(indices, dtype=np.int64)
    if len(idx) == 0:
        raise DataError("channel_stats: no images to measure")
    if len(idx) > max_images:
        idx = np.sort(np.random.default_rng(seed).choice(idx, max_images, replace=False))
    total = total_sq = None
    count = 0
    for i in idx:
        x = np.asarray(dataset.load(int(i), np.random.default_rng((seed, 0, int(i))))[0],
                       dtype=np.float64)
        s, sq = x.sum(axis=(1, 2)), np.square(x).sum(axis=(1, 2))
        total, total_sq = (s, sq) if total is None else (total + s, total_sq + sq)
        count += x.shape[1] * x.shape[2]
    mean = total / count
    std = np.sqrt(np.maximum(total_sq / count - mean * mean, 0.0))
    return mean.astype(np.float32), np.where(std > 1e-6, std, 1.0).astype(np.float32)


@dataclass
class FolderData:
    """What load_folder returns: like data.Dataset, but images are decoded as they are used."""
    name: str
    train: ImageFolder           # with the training transform (augmentation when asked)
    test: ImageFolder            # with the evaluation transform; may be the same files as train
    train_indices: np.ndarray    # the samples of ``train`` to train on
    test_indices: np.ndarray     # the samples of ``test`` to evaluate on
    image_shape: tuple           # (C, H, W) of every transformed image
    mean: np.ndarray             # the per-channel normalization both transforms end with
    std: np.ndarray
    split: str                   # "folders" (train/ and val/ or test/) or "stratified"
    eval_spec: dict = None       # what ``test``'s transform is, as eval_transform reads it

    @property
    def classes(self):
        return self.train.classes

    @property
    def num_classes(self):
        return len(self.train.classes)

    @property
    def in_channels(self):
        return self.image_shape[0]

    def describe(self):
        c, h, w = self.image_shape
        how = ("held-out folder %s" % os.path.basename(self.test.root) if self.split == "folders"
               else "stratified split")
        return "%s: %d train / %d test images (%s) of %dx%dx%d, %d classes" % (
            self.name, len(self.train_indices), len(self.test_indices), how, c, h, w,
            self.num_classes)


def _split_folders(root):
    """(train, held-out) sub-folders when ``root`` holds only train/ and val/ (or test/)."""
    try:
        subdirs = {e.name for e in os.scandir(root) if not e.name.startswith(".") and e.is_dir()}
    except OSError:
        return None  # ImageFolder reports it
    if "train" in subdirs and subdirs <= {"train", "val", "test"} and len(subdirs) > 1:
        held = "val" if "val" in subdirs else "test"
        return os.path.join(root, "train"), os.path.join(root, held)
    return None


def eval_spec(size, mean, std):
    """The evaluation transform of ``size`` (an int: shorter side resized to it, then a center
    crop; (h, w): stretched to it, then the crop is the whole image) normalized by ``mean`` and
    ``std``, as a JSON-able dict for eval_transform."""
    square = isinstance(size, (int, np.integer)) and not isinstance(size, bool)
    return {"resize": int(size) if square else [int(s) for s in size],
            "crop": list(CenterCrop(size).size),
            "mean": [float(v) for v in mean], "std": [float(v) for v in std]}


def eval_transform(spec):
    """The transform ``spec`` (from eval_spec) describes: Resize, CenterCrop, ToArray,
    Normalize."""
    resize = spec["resize"]
    return Compose([Resize(resize if isinstance(resize, int) else tuple(resize)),
                    CenterCrop(tuple(spec["crop"])), ToArray(),
                    Normalize(spec["mean"], spec["std"])])


def load_folder(root, image_size=None, mode="RGB", val_fraction=0.1, split_seed=0, augment=True,
                on_error="raise", check="verify", stats_images=1000, cache=False, hints=None):
    """An image folder as train and test ImageFolders for utensil-train (``--data DIR``).

    Layout: ``root/train/<class>/...`` with ``root/val/<class>/...`` (or ``test/``), the class
    lists equal; otherwise ``root/<class>/...`` with ``val_fraction`` of each class held out by
    ``stratified_split(targets, val_fraction, split_seed)``. Images become ``image_size`` squares
    (an int; (h, w) also works; None: the first training image's size). Evaluation: Resize +
    CenterCrop; training with ``augment``: RandomResizedCrop(scale=(0.25, 1)) +
    RandomHorizontalFlip, without: as evaluation. Both end with Normalize by the per-channel
    mean and std of up to ``stats_images`` training images (channel_stats, evaluation transform).
    ``cache=True``: the images are decoded once, here, and kept in memory (ImageFolder.cached).
    ``hints``: as ImageFolder's.
    """
    root = os.fspath(root)
    pair = _split_folders(root) if os.path.isdir(root) else None
    kw = dict(on_error=on_error, mode=mode, check=check, hints=hints)
    if pair:
        train = ImageFolder(pair[0], **kw)
        test = ImageFolder(pair[1], **kw)
        if test.classes != train.classes:
            missing = sorted(set(train.classes) - set(test.classes))
            extra = sorted(set(test.classes) - set(train.classes))
            raise DataError("%s: its class folders differ from %s's (missing: %s; extra: %s); "
                            "both need the same classes" % (pair[1], pair[0],
                                                            ", ".join(missing) or "none",
                                                            ", ".join(extra) or "none"))
        train_idx = np.arange(len(train), dtype=np.int64)
        test_idx = np.arange(len(test), dtype=np.int64)
        split = "folders"
    else:
        train = test = ImageFolder(root, **kw)
        train_idx, test_idx = stratified_split(train.targets, val_fraction, split_seed)
        split = "stratified"
    if cache:
        same = test is train
        train = train.cached()
        test = train if same else test.cached()
    if image_size is None:
        w, h = train.image(int(train_idx[0])).size
        size = (h, w)
    else:
        size = image_size
    base = Compose([Resize(size), CenterCrop(size)])
    mean, std = channel_stats(train.with_transform(base), train_idx, stats_images)
    norm = [ToArray(), Normalize(mean, std)]
    spec = eval_spec(size, mean, std)
    evaluate = eval_transform(spec)
    if augment:
        training = Compose([RandomResizedCrop(size, scale=(0.25, 1.0)), RandomHorizontalFlip()]
                           + norm)
    else:
        training = evaluate
    h, w = CenterCrop(size).size
    return FolderData(os.path.basename(os.path.normpath(root)), train.with_transform(training),
                      test.with_transform(evaluate), train_idx, test_idx,
                      (1 if mode == "L" else 3, h, w), mean, std, split, spec)
