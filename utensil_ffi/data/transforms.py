"""Image transforms with torchvision's names, whose randomness comes from the caller.

    from utensil_ffi.data import transforms as T
    train = T.Compose([T.RandomResizedCrop(32), T.RandomHorizontalFlip(), T.ToArray(),
                       T.Normalize((0.5, 0.5, 0.5), (0.25, 0.25, 0.25))])
    x = train(pil_image, np.random.default_rng((seed, epoch, index)))   # float32 [C, H, W]

Every transform is called as ``t(img, rng)``. ``rng`` is a ``numpy.random.Generator``; the
random transforms draw only from it (never from a global generator), and the image folder and the
loader build it as ``np.random.default_rng((seed, epoch, index))``. So an image's augmentation
depends only on (seed, epoch, index): not on the number of loader workers, not on the order they
finish in, not on what else was drawn before. Deterministic transforms accept ``rng=None``; the
random ones refuse it with a TypeError rather than fall back to an unseeded generator, which would
make a run silently irreproducible. Each transform says which it is in ``random`` (Compose: any
of its steps); a callable without that attribute counts as random. Making the Generator costs
about 30 us, a tenth of decoding a 32x32 PNG, so the image folder skips it when nothing draws.

Geometric transforms (Resize, CenterCrop, RandomResizedCrop, RandomHorizontalFlip) take and return
PIL images and resample bilinearly, as torchvision does for PIL input; ``ToArray`` turns a PIL
image into a float32 ``[C, H, W]`` array in [0, 1] (torchvision's ``ToTensor``, for numpy);
``Normalize`` works on that array. Pillow is imported only when a transform touches an image.
"""

import math
import numbers

import numpy as np

__all__ = ["is_random", "Compose", "Lambda", "Resize", "CenterCrop", "RandomResizedCrop",
           "RandomHorizontalFlip", "ToArray", "Normalize"]


def _size_pair(size, what):
    """(h, w) from an int (square) or a pair of positive ints; ValueError naming ``what``."""
    if isinstance(size, numbers.Integral) and not isinstance(size, bool):
        pair = (int(size), int(size))
    else:
        try:
            pair = tuple(int(s) for s in size)
        except (TypeError, ValueError):
            pair = ()
        if len(pair) != 2 or any(p != s for p, s in zip(pair, size)):
            raise ValueError("%s: size must be an int or a (height, width) pair of ints, got %r"
                             % (what, size))
    if min(pair) < 1:
        raise ValueError("%s: size must be positive, got %r" % (what, size))
    return pair


def _range(v, what, low=None):
    """(lo, hi) floats with lo <= hi (and lo > low when given)."""
    try:
        lo, hi = (float(a) for a in v)
    except (TypeError, ValueError):
        raise ValueError("%s must be a (min, max) pair of numbers, got %r" % (what, v)) from None
    if not (math.isfinite(lo) and math.isfinite(hi)) or lo > hi or (low is not None and lo <= low):
        raise ValueError("%s must be a finite (min, max) pair with min <= max%s, got %r"
                         % (what, "" if low is None else " and min > %g" % low, v))
    return lo, hi


def _pil_image(img, who):
    from PIL import Image

    if not isinstance(img, Image.Image):
        raise TypeError("%s takes a PIL image (put it before ToArray), got %s"
                        % (who, type(img).__name__))
    return Image


def _need_rng(rng, who):
    if not isinstance(rng, np.random.Generator):
        raise TypeError("%s is random: call it as t(img, rng) with a numpy.random.Generator "
                        "(e.g. np.random.default_rng((seed, epoch, index))), got %r" % (who, rng))


def is_random(transform):
    """Whether ``transform`` draws from its rng (True for callables that do not say)."""
    return bool(getattr(transform, "random", True))


class Compose:
    """Apply ``transforms`` in order, passing the same ``rng`` to each."""

    def __init__(self, transforms):
        self.transforms = list(transforms)
        for t in self.transforms:
            if not callable(t):
                raise TypeError("Compose: %r is not callable" % (t,))
        self.random = any(is_random(t) for t in self.transforms)

    def __call__(self, img, rng=None):
        for t in self.transforms:
            img = t(img, rng)
        return img

    def __repr__(self):
        return "Compose([%s])" % ", ".join(repr(t) for t in self.transforms)


class Lambda:
    """A one-argument function ``fn(img)`` as a transform (it gets no rng: keep it
    deterministic)."""

    random = False

    def __init__(self, fn):
        if not callable(fn):
            raise TypeError("Lambda: %r is not callable" % (fn,))
        self.fn = fn

    def __call__(self, img, rng=None):
        return self.fn(img)

    def __repr__(self):
        return "Lambda(%r)" % (self.fn,)


class Resize:
    """``Resize(s)``: the shorter side becomes s, the aspect ratio kept (torchvision's rule:
    the longer side is ``int(s * long / short)``); ``Resize((h, w))``: exactly h x w."""

    random = False

    def __init__(self, size):
        self.square = isinstance(size, numbers.Integral) and not isinstance(size, bool)
        self.size = _size_pair(size, "Resize")

    def output_size(self, width, height):
        """(width, height) after resizing an image of ``width`` x ``height``."""
        if not self.square:
            return self.size[1], self.size[0]
        s = self.size[0]
        if width <= height:
            return s, int(s * height / width)
        return int(s * width / height), s

    def __call__(self, img, rng=None):
        Image = _pil_image(img, "Resize")
        size = self.output_size(*img.size)
        return img if size == img.size else img.resize(size, Image.BILINEAR)

    def __repr__(self):
        return "Resize(%r)" % (self.size[0] if self.square else self.size,)


def _center_offset(size, crop):
    """Where a centred crop starts along one side: ``round((size - crop) / 2)``; for a crop
    larger than the image, where torchvision's padding puts the image: ``d // 2`` zeros before
    it, ``(d + 1) // 2`` after (d the difference), where round(-1.5) = -2 put it a pixel off."""
    if crop > size:
        return -((crop - size) // 2)
    return int(round((size - crop) / 2.0))


class CenterCrop:
    """The central ``size`` (int or (h, w)) crop; an image smaller than that is padded with 0,
    placed as torchvision places it. The offset is ``round((H - h) / 2)``."""

    random = False

    def __init__(self, size):
        self.size = _size_pair(size, "CenterCrop")

    def __call__(self, img, rng=None):
        _pil_image(img, "CenterCrop")
        h, w = self.size
        width, height = img.size
        if (width, height) == (w, h):
            return img
        top = _center_offset(height, h)
        left = _center_offset(width, w)
        return img.crop((left, top, left + w, top + h))  # PIL fills outside the image with 0

    def __repr__(self):
        return "CenterCrop(%r)" % (self.size,)


class RandomResizedCrop:
    """A crop of random area (``scale`` of the image's) and aspect ratio (``ratio``, drawn
    log-uniformly), resized to ``size`` (int or (h, w)). torchvision's algorithm: ten tries,
    then a central crop clamped to ``ratio``. See ``get_params`` for the exact draws."""

    random = True

    def __init__(self, size, scale=(0.08, 1.0), ratio=(3.0 / 4.0, 4.0 / 3.0)):
        self.size = _size_pair(size, "RandomResizedCrop")
        self.scale = _range(scale, "RandomResizedCrop: scale", low=0.0)
        if self.scale[1] > 1.0:
            raise ValueError("RandomResizedCrop: scale is a fraction of the image's area; its "
                             "max must be <= 1, got %r" % (scale,))
        self.ratio = _range(ratio, "RandomResizedCrop: ratio", low=0.0)

    def get_params(self, width, height, rng):
        """(top, left, h, w) of the crop for an image of ``width`` x ``height``.

        Per try: ``area = rng.uniform(*scale) * width * height``, ``r = exp(rng.uniform(log
        ratio))``, ``w = round(sqrt(area r))``, ``h = round(sqrt(area / r))``; if the crop fits,
        ``top = rng.integers(0, height - h + 1)`` then ``left = rng.integers(0, width - w + 1)``."""
        area = width * height
        log_lo, log_hi = math.log(self.ratio[0]), math.log(self.ratio[1])
        for _ in range(10):
            target = area * rng.uniform(self.scale[0], self.scale[1])
            r = math.exp(rng.uniform(log_lo, log_hi))
            w = int(round(math.sqrt(target * r)))
            h = int(round(math.sqrt(target / r)))
            if 0 < w <= width and 0 < h <= height:
                top = int(rng.integers(0, height - h + 1))
                left = int(rng.integers(0, width - w + 1))
                return top, left, h, w
        in_ratio = width / height  # fall back to the whole image, clamped to the ratio range
        if in_ratio < self.ratio[0]:
            w, h = width, int(round(width / self.ratio[0]))
        elif in_ratio > self.ratio[1]:
            h, w = height, int(round(height * self.ratio[1]))
        else:
            w, h = width, height
        return (height - h) // 2, (width - w) // 2, h, w

    def __call__(self, img, rng):
        _need_rng(rng, "RandomResizedCrop")
        Image = _pil_image(img, "RandomResizedCrop")
        top, left, h, w = self.get_params(img.size[0], img.size[1], rng)
        crop = img.crop((left, top, left + w, top + h))  # then resize: torchvision's resized_crop
        return crop.resize((self.size[1], self.size[0]), Image.BILINEAR)

    def __repr__(self):
        return "RandomResizedCrop(%r, scale=%r, ratio=%r)" % (self.size, self.scale, self.ratio)


class RandomHorizontalFlip:
    """Mirror left-right with probability ``p`` (the draw: ``rng.random() < p``)."""

    random = True

    def __init__(self, p=0.5):
        p = float(p)
        if not 0.0 <= p <= 1.0:
            raise ValueError("RandomHorizontalFlip: p must be in [0, 1], got %r" % p)
        self.p = p

    def __call__(self, img, rng):
        _need_rng(rng, "RandomHorizontalFlip")
        Image = _pil_image(img, "RandomHorizontalFlip")
        return img.transpose(Image.FLIP_LEFT_RIGHT) if rng.random() < self.p else img

    def __repr__(self):
        return "RandomHorizontalFlip(p=%g)" % self.p


class ToArray:
    """PIL image (mode L or RGB) -> float32 ``[C, H, W]`` in [0, 1] (8-bit values / 255)."""

    random = False

    def __call__(self, img, rng=None):
        _pil_image(img, "ToArray")
        if img.mode not in ("L", "RGB"):
            raise ValueError("ToArray takes 8-bit L or RGB images, got mode %s (ImageFolder "
                             "converts every file to its mode= first)" % img.mode)
        w, h = img.size
        a = np.frombuffer(img.tobytes(), np.uint8)  # half the time of np.asarray(img)
        a = a.reshape(1, h, w) if img.mode == "L" else a.reshape(h, w, 3).transpose(2, 0, 1)
        out = np.empty(a.shape, np.float32)
        np.multiply(a, np.float32(1.0 / 255.0), out=out)
        return out

    def __repr__(self):
        return "ToArray()"


class Normalize:
    """``(x - mean[c]) / std[c]`` per channel of a float32 ``[C, H, W]`` array (after ToArray)."""

    random = False

    def __init__(self, mean, std):
        self.mean = np.asarray(mean, dtype=np.float32).reshape(-1)
        self.std = np.asarray(std, dtype=np.float32).reshape(-1)
        if self.mean.shape != self.std.shape or self.mean.size == 0:
            raise ValueError("Normalize: mean and std need one value per channel each, got %d "
                             "and %d" % (self.mean.size, self.std.size))
        if not (np.all(np.isfinite(self.mean)) and np.all(np.isfinite(self.std))
                and np.all(self.std > 0)):
            raise ValueError("Normalize: mean must be finite and std finite and > 0, got mean=%s "
                             "std=%s" % (self.mean.tolist(), self.std.tolist()))

    def __call__(self, x, rng=None):
        if not isinstance(x, np.ndarray) or x.ndim != 3:
            raise TypeError("Normalize takes a [C, H, W] array (put it after ToArray), got %s"
                            % (type(x).__name__ if not isinstance(x, np.ndarray)
                               else "an array of shape %s" % (x.shape,)))
        if x.shape[0] != self.mean.size:
            raise ValueError("Normalize: the image has %d channels but mean/std have %d values"
                             % (x.shape[0], self.mean.size))
        return ((x - self.mean[:, None, None]) / self.std[:, None, None]).astype(np.float32,
                                                                                 copy=False)

    def __repr__(self):
        return "Normalize(mean=%s, std=%s)" % (self.mean.tolist(), self.std.tolist())
