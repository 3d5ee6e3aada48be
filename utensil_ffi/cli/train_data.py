"""What utensil-train reads: in-memory arrays (the digits, a .npz) or an image folder decoded as
it goes, behind one interface, so the training loop does not care which.

Both give the batches of epoch e in the order ``data.batches(n, batch_size, seed, e)``, whole
batches split over the ranks of a data-parallel run by ``share``; an image folder's batches are
decoded (with augmentation drawn from ``(seed, epoch, index)``) by ``workers`` background
processes of a :class:`utensil_ffi.data.loader.Loader`, so the result does not depend on the number
of workers.

A folder's two loaders are kept for the whole run, and each loads ahead for its next use (see
loader.py): the training loader the first batches of epoch e + 1 while the trainer takes epoch
e's last ones and evaluates, the test loader (in order, evaluation transform: the same batches
every time) the next evaluation's first batches while the trainer trains. Without it every
epoch and every evaluation began by waiting for a batch to be decoded, tens of ms each: a tenth
of a short epoch on a fast GPU for the training loader; for the evaluation, time outside the
training throughput but on the run's clock. What loading ahead costs is the decoding of the
batches the run's last epoch and evaluation will not use.
"""

import os

import numpy as np

from .. import data as _data

__all__ = ["TrainData", "open_data", "arrays", "FOLDER_HINTS"]

# An image folder's files are all decoded once before training (check="decode"), train and
# held-out alike: Pillow's verify() passes a truncated JPEG, which would otherwise stop the run
# only when it is loaded (mid-epoch, or after a whole epoch when it is in val/), or slip past
# --skip-bad-images. The advice of the errors names the flags, not ImageFolder's arguments.
FOLDER_CHECK = "decode"
FOLDER_HINTS = {"skip": "pass --skip-bad-images to leave unreadable files out",
                "load": "it was decoded when the run started: was it changed since? (fix or "
                        "restore it, then --resume from the checkpoint)",
                "cache": "more than %d bytes of memory, --cache-images's limit; leave "
                         "--cache-images out to decode them as they are used"}


class TrainData:
    """name, image_shape (C, H, W), num_classes, n_train, n_test, mean/std (the per-channel
    normalization applied), class_names (or None), eval_spec (an image folder's evaluation
    transform, images.eval_spec's dict; None for arrays); ``train_batches`` and
    ``test_batches``."""

    eval_spec = None

    def __init__(self, name, image_shape, num_classes, n_train, n_test, mean, std, class_names,
                 describe):
        self.name, self.image_shape, self.num_classes = name, tuple(image_shape), num_classes
        self.n_train, self.n_test = n_train, n_test
        self.mean, self.std, self.class_names = mean, std, class_names
        self._describe = describe

    @property
    def in_channels(self):
        return self.image_shape[0]

    def describe(self):
        return self._describe

    def train_batches(self, batch_size, seed, epoch, share=None):
        """(images in the whole batch, x, y) per batch of the epoch: x float32 [b, C, H, W] and
        y int64 [b] of this rank's share. x and y may be views of a loader's shared memory,
        valid until the next batch is requested: use them (upload them) at once."""
        raise NotImplementedError

    def test_batches(self, batch_size, share=None):
        """(x, y) batches of this rank's share of the test images, valid as train_batches'."""
        raise NotImplementedError

    def close(self):
        pass


class _Arrays(TrainData):
    def __init__(self, ds):
        super().__init__(ds.name, ds.image_shape, ds.num_classes, len(ds.x_train),
                         len(ds.x_test), ds.mean, ds.std, ds.class_names, ds.describe())
        self.ds = ds

    def train_batches(self, batch_size, seed, epoch, share=None):
        x, y = self.ds.x_train, self.ds.y_train
        for idx in _data.batches(len(x), batch_size, seed, epoch):
            mine = idx if share is None else share(idx)
            yield len(idx), x[mine], y[mine]

    def test_batches(self, batch_size, share=None):
        x, y = self.ds.x_test, self.ds.y_test
        if share is not None:
            mine = share(np.arange(len(x)))
            x, y = x[mine], y[mine]
        for i in range(0, len(x), batch_size):
            yield x[i:i + batch_size], y[i:i + batch_size]


class _Folder(TrainData):
    def __init__(self, fd, workers, timeout):
        super().__init__(fd.name, fd.image_shape, fd.num_classes, len(fd.train_indices),
                         len(fd.test_indices), fd.mean, fd.std, tuple(fd.classes), fd.describe())
        self.fd, self.workers, self.timeout = fd, workers, timeout
        self.eval_spec = fd.eval_spec
        self._loaders = {}

    def _loader(self, which, batch_size, seed, share):
        from ..data.loader import Loader

        key = (which, batch_size, seed)
        # kept across epochs: the workers are started once, and load the next epoch's (the
        # next evaluation's) first batches ahead. copy=False: the trainer uploads each batch
        # into a tensor before it asks for the next, so views of the workers' shared memory
        # do, and save this process a copy of every batch
        if key not in self._loaders:
            if which == "train":  # whole batches in data.batches order, each rank its share
                loader = Loader(self.fd.train, batch_size, shuffle=True, seed=seed,
                                workers=self.workers, indices=self.fd.train_indices,
                                share=share, timeout=self.timeout, copy=False)
            else:  # each rank its share of the test set, in order
                idx = self.fd.test_indices if share is None else share(self.fd.test_indices)
                loader = None if len(idx) == 0 else Loader(
                    self.fd.test, batch_size, shuffle=False, workers=self.workers, indices=idx,
                    timeout=self.timeout, copy=False)
            self._loaders[key] = loader
        return self._loaders[key]

    def train_batches(self, batch_size, seed, epoch, share=None):
        loader = self._loader("train", batch_size, seed, share)
        sizes = [len(b) for b in loader.batch_indices(epoch)]
        # the loader's epoch first: zip then runs it to its end, where an epoch left unfinished
        # would stop the workers (and the next epoch start new ones, without the batches they
        # had loaded ahead)
        for (x, y), whole in zip(loader.epoch(epoch), sizes):
            yield whole, x, y

    def test_batches(self, batch_size, share=None):
        loader = self._loader("test", batch_size, 0, share)
        if loader is not None:
            yield from loader.epoch(0)

    def close(self):
        for loader in self._loaders.values():
            if loader is not None:
                loader.close()
        self._loaders.clear()


def arrays(x_train, y_train, x_test=None, y_test=None, name="arrays"):
    """In-memory arrays (float32 [N, C, H, W], int labels) as TrainData, used as they are."""
    x_test = x_train[:0] if x_test is None else x_test
    y_test = y_train[:0] if y_test is None else y_test
    return _Arrays(_data.Dataset(name, x_train, y_train, x_test, y_test, 0))


def open_data(path, layout="auto", image_size=None, augment=True, workers=0, on_error="raise",
              timeout=None, cache=False):
    """The data of ``--data PATH``: a folder of class folders (or train/ and val/ ones), a .npz,
    or the digits when ``path`` is None."""
    if path is None:
        if image_size is not None:
            raise _data.DataError("--image-size resizes the images of a folder; the built-in "
                                  "digits are not one (their arrays are used as they are)")
        return _Arrays(_data.load_digits())
    if os.path.isdir(path):
        from ..data.images import load_folder

        fd = load_folder(path, image_size=image_size, augment=augment, on_error=on_error,
                         cache=cache, check=FOLDER_CHECK, hints=FOLDER_HINTS)
        if len(fd.test_indices) == 0:  # as an .npz with an empty x_test: nothing to report on
            raise _data.DataError(
                "%s: no image is held out for testing (without train/ and val/ sub-folders, "
                "10%% of each class that has 2 images or more is); add images, or give train/ "
                "and val/ sub-folders" % path)
        return _Folder(fd, workers, timeout)
    if image_size is not None:
        raise _data.DataError("--image-size resizes the images of a folder; %s is a file (its "
                              "arrays are used as they are)" % path)
    return _Arrays(_data.load_npz(path, layout))
