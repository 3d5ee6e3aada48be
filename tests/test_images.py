"""Image folders (utensil_ffi.images) and transforms (utensil_ffi.transforms), on tiny folders
written with Pillow into tmp_path."""

import io
import math
import os
import sys
import warnings

import numpy as np
import pytest

from utensil_ffi import images
from utensil_ffi import transforms as T
from utensil_ffi.data import DataError

Image = pytest.importorskip("PIL.Image")


def _rgb(rng, h=12, w=10):
    return rng.integers(0, 256, (h, w, 3), dtype=np.uint8)


def _save(path, array=None, mode=None, fmt=None, rng=None):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if array is None:
        array = _rgb(rng or np.random.default_rng(len(path)))
    img = Image.fromarray(array) if mode is None else Image.fromarray(array).convert(mode)
    img.save(path, fmt)
    return path


def _folder(root, counts, size=(12, 10), seed=0):
    """root/<class>/<i>.png with random RGB pixels; counts: {class: n}."""
    rng = np.random.default_rng(seed)
    for c, n in counts.items():
        for i in range(n):
            _save(os.path.join(root, c, "%02d.png" % i), _rgb(rng, *size))
    return str(root)


def _png_bytes(rng, h=16, w=16):
    b = io.BytesIO()
    Image.fromarray(_rgb(rng, h, w)).save(b, "PNG")
    return b.getvalue()


# -- discovery ------------------------------------------------------------------------------------
def test_classes_samples_and_targets(tmp_path):
    root = _folder(tmp_path, {"dog": 2, "cat": 3, "ant": 1})
    _save(str(tmp_path / "cat" / "deeper" / "x.PNG"))          # nested, upper-case extension
    (tmp_path / "cat" / "notes.txt").write_text("not an image")  # other extensions: ignored
    (tmp_path / "cat" / "._00.png").write_bytes(b"AppleDouble")  # hidden: ignored
    os.makedirs(tmp_path / ".cache")                              # hidden folder: no class
    ds = images.ImageFolder(root)
    assert ds.classes == ["ant", "cat", "dog"]
    assert ds.class_to_idx == {"ant": 0, "cat": 1, "dog": 2}
    assert len(ds) == 7
    paths = [os.path.relpath(p, root) for p, _ in ds.samples]
    assert paths == ["ant/00.png", "cat/00.png", "cat/01.png", "cat/02.png",
                     os.path.join("cat", "deeper", "x.PNG"), "dog/00.png", "dog/01.png"]
    assert ds.targets == [0, 1, 1, 1, 1, 2, 2]
    assert [label for _, label in ds.samples] == ds.targets
    x, y = ds[3]
    assert x.dtype == np.float32 and x.shape == (3, 12, 10) and y == 1
    assert 0.0 <= x.min() and x.max() <= 1.0
    want = np.asarray(Image.open(ds.samples[3][0]).convert("RGB")).transpose(2, 0, 1) / 255.0
    np.testing.assert_allclose(x, want, rtol=0, atol=1e-6)
    assert ds[-1][1] == 2
    with pytest.raises(IndexError):
        ds[7]


def test_extensions_argument(tmp_path):
    root = _folder(tmp_path, {"a": 1, "b": 1})
    _save(str(tmp_path / "a" / "x.bmp"), fmt="BMP")
    assert len(images.ImageFolder(root)) == 3
    assert len(images.ImageFolder(root, extensions=".png")) == 2


def test_a_symlink_loop_is_named_not_walked(tmp_path):
    """a/loop -> a would walk a's images again and again (4 files became 164 samples): refused,
    naming both paths."""
    root = _folder(tmp_path, {"a": 2, "b": 2})
    os.symlink(tmp_path / "a", tmp_path / "a" / "loop")
    with pytest.raises(DataError, match="symbolic link loop") as info:
        images.ImageFolder(root)
    assert os.path.join(root, "a", "loop") in str(info.value)


def test_a_folder_linked_into_two_classes_is_refused(tmp_path):
    """b/extra -> a would give a's images a second label."""
    root = _folder(tmp_path, {"a": 2, "b": 2})
    os.symlink(tmp_path / "a", tmp_path / "b" / "extra")
    with pytest.raises(DataError, match="counted twice"):
        images.ImageFolder(root)


def test_a_linked_class_folder_is_followed(tmp_path):
    """A class folder that is a link to images elsewhere is walked once, as before."""
    _folder(tmp_path / "elsewhere", {"cats": 3})
    root = _folder(tmp_path / "root", {"dogs": 2})
    os.symlink(tmp_path / "elsewhere" / "cats", tmp_path / "root" / "cats")
    ds = images.ImageFolder(root)
    assert ds.classes == ["cats", "dogs"] and len(ds) == 5 and ds.targets == [0, 0, 0, 1, 1]


# -- modes ----------------------------------------------------------------------------------------
def _mode_folder(tmp_path):
    rng = np.random.default_rng(3)
    rgb = _rgb(rng, 6, 5)
    gray16 = (rng.integers(0, 65536, (6, 5))).astype(np.uint16)
    gray16[0, 0], gray16[0, 1] = 65535, 0
    d = tmp_path / "m"
    _save(str(d / "a" / "rgb.png"), rgb)
    _save(str(d / "a" / "l.png"), rgb[..., 0])
    rgba = np.dstack([rgb, rng.integers(0, 256, (6, 5), dtype=np.uint8)])
    _save(str(d / "a" / "rgba.png"), rgba)
    _save(str(d / "b" / "p.png"), rgb, mode="P")
    p = Image.fromarray(rgb).convert("P")
    p.info["transparency"] = 0
    p.save(str(d / "b" / "p_transparent.png"))
    _save(str(d / "b" / "i16.png"), gray16)
    _save(str(d / "b" / "bits.png"), rgb[..., 0] > 128)
    _save(str(d / "b" / "cmyk.jpg"), rgb, mode="CMYK", fmt="JPEG")
    return str(d), rgb, gray16


def test_mixed_modes_become_rgb_or_l(tmp_path):
    root, rgb, gray16 = _mode_folder(tmp_path)
    modes = {os.path.basename(p): Image.open(p).mode for p, _ in images.ImageFolder(root).samples}
    assert modes["i16.png"].startswith("I") and modes["p.png"] == "P"
    assert modes["rgba.png"] == "RGBA"
    for mode, c in (("RGB", 3), ("L", 1)):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # e.g. Pillow's palette-transparency warning
            ds = images.ImageFolder(root, mode=mode, check="decode")
            out = {os.path.basename(p): ds[i][0] for i, (p, _) in enumerate(ds.samples)}
        for name, x in out.items():
            assert x.shape == (c, 6, 5) and x.dtype == np.float32, name
            assert 0.0 <= x.min() and x.max() <= 1.0, name
    ds = images.ImageFolder(root)
    out = {os.path.basename(p): ds[i][0] for i, (p, _) in enumerate(ds.samples)}
    np.testing.assert_allclose(out["rgb.png"], rgb.transpose(2, 0, 1) / 255.0, atol=1e-6, rtol=0)
    np.testing.assert_array_equal(out["rgba.png"], out["rgb.png"])  # alpha dropped, colours kept
    # 16-bit: scaled to 8 bits (/257), not clipped at 255
    want = np.rint(gray16 / 257.0) / 255.0
    np.testing.assert_allclose(out["i16.png"][0], want, atol=1e-6, rtol=0)
    assert out["i16.png"][:, 0, 0].tolist() == [1.0] * 3 and out["i16.png"][0, 0, 1] == 0.0
    assert set(np.unique(out["bits.png"])) <= {0.0, 1.0}
    gray = images.ImageFolder(root, mode="L")[0][0]
    assert gray.shape == (1, 6, 5)


def test_mode_argument_checked(tmp_path):
    root = _folder(tmp_path, {"a": 1, "b": 1})
    for kw in (dict(mode="RGBA"), dict(on_error="ignore"), dict(check="full")):
        with pytest.raises(ValueError, match=list(kw)[0]):
            images.ImageFolder(root, **kw)


# -- bad input ------------------------------------------------------------------------------------
def _bad_files(tmp_path):
    """A good folder plus one file of each bad kind in class b; returns (root, {name: path})."""
    root = _folder(tmp_path, {"a": 2, "b": 2})
    rng = np.random.default_rng(5)
    png = _png_bytes(rng)
    bad = {
        "truncated.png": png[: len(png) // 2],
        "corrupt.png": png[:60] + bytes(b ^ 0x5A for b in png[60:120]) + png[120:],
        "text.jpg": b"this is a text file, not a JPEG\n",
        "empty.png": b"",
    }
    paths = {}
    for name, data in bad.items():
        paths[name] = str(tmp_path / "b" / name)
        with open(paths[name], "wb") as f:
            f.write(data)
    return root, paths


@pytest.mark.parametrize("name", ["truncated.png", "corrupt.png", "text.jpg", "empty.png"])
def test_unreadable_file_raises_naming_it(tmp_path, name):
    root, paths = _bad_files(tmp_path)
    for other, p in paths.items():
        if other != name:
            os.remove(p)
    with pytest.raises(DataError, match="cannot read this image") as e:
        images.ImageFolder(root)
    assert paths[name] in str(e.value) and "on_error='skip'" in str(e.value)


def test_skip_warns_once_per_file(tmp_path):
    root, paths = _bad_files(tmp_path)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        ds = images.ImageFolder(root, on_error="skip")
    assert len(ds) == 4 and ds.targets == [0, 0, 1, 1]
    texts = [str(w.message) for w in got]
    assert len(texts) == len(paths)
    for p in paths.values():
        assert sum(p in t for t in texts) == 1
    assert sorted(p for p, _ in ds.skipped) == sorted(paths.values())
    assert all(w.filename == __file__ for w in got)  # points at the caller's line


def test_skip_cannot_empty_a_class(tmp_path):
    root = _folder(tmp_path, {"a": 2})
    os.makedirs(tmp_path / "b")
    (tmp_path / "b" / "x.png").write_bytes(b"junk")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(DataError, match="every image in this class folder"):
            images.ImageFolder(root, on_error="skip")


def test_truncated_jpeg_found_by_decode_check_or_at_load(tmp_path):
    root = _folder(tmp_path, {"a": 1, "b": 1})
    b = io.BytesIO()
    Image.fromarray(_rgb(np.random.default_rng(1), 64, 64)).save(b, "JPEG")
    path = str(tmp_path / "b" / "cut.jpg")
    with open(path, "wb") as f:
        f.write(b.getvalue()[: int(len(b.getvalue()) * 0.8)])
    ds = images.ImageFolder(root)  # verify() reads a JPEG's headers only: it passes
    i = [p for p, _ in ds.samples].index(path)
    with pytest.raises(DataError, match="cannot decode") as e:
        ds[i]
    assert path in str(e.value)
    with pytest.raises(DataError, match="cannot read") as e:
        images.ImageFolder(root, check="decode")
    assert path in str(e.value)
    assert len(images.ImageFolder(root, check="none")) == 3


def test_open_image(tmp_path):
    gray = _save(str(tmp_path / "g.png"), np.arange(12, dtype=np.uint8).reshape(3, 4))
    img = images.open_image(gray)
    assert img.mode == "RGB" and img.size == (4, 3) and img.getpixel((1, 0)) == (1, 1, 1)
    assert images.open_image(gray, "L").mode == "L"
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"\x89PNG not really")
    with pytest.raises(DataError, match="bad.png: cannot decode this image .*; see") as e:
        images.open_image(str(bad), hint="; see")
    assert str(bad) in str(e.value)
    with pytest.raises(ValueError, match="mode"):
        images.open_image(gray, "RGBA")


def test_unsupported_mode_is_refused(tmp_path):
    root = _folder(tmp_path, {"a": 1, "b": 1})
    path = str(tmp_path / "b" / "float.tif")
    Image.fromarray(np.zeros((4, 4), np.float32)).save(path)
    with pytest.raises(DataError, match="mode F cannot be converted") as e:
        images.ImageFolder(root)
    assert path in str(e.value)


def test_bad_folders(tmp_path):
    with pytest.raises(DataError, match="no such folder"):
        images.ImageFolder(tmp_path / "missing")
    f = tmp_path / "file.png"
    _save(str(f))
    with pytest.raises(DataError, match="not a folder") as e:
        images.ImageFolder(f)
    assert str(f) in str(e.value)
    loose = tmp_path / "loose"
    _save(str(loose / "1.png"))
    _save(str(loose / "2.png"))
    with pytest.raises(DataError, match=r"no class folders \(it holds 2 images directly\)"):
        images.ImageFolder(loose)
    one = _folder(tmp_path / "one", {"only": 2})
    with pytest.raises(DataError, match="a single class folder \\(only\\)"):
        images.ImageFolder(one)
    empty = _folder(tmp_path / "empty", {"a": 1})
    os.makedirs(os.path.join(empty, "b"))
    (tmp_path / "empty" / "b" / "readme.txt").write_text("x")
    with pytest.raises(DataError, match="the class folder has no images") as e:
        images.ImageFolder(empty, on_error="skip")
    assert os.path.join(empty, "b") in str(e.value)


def test_without_pillow_names_the_extra(tmp_path, monkeypatch):
    root = _folder(tmp_path, {"a": 1, "b": 1})
    monkeypatch.setitem(sys.modules, "PIL", None)  # `from PIL import Image` now fails
    with pytest.raises(DataError, match=r"pip install 'utensil-ffi\[images\]'"):
        images.ImageFolder(root)


# -- transforms -----------------------------------------------------------------------------------
def _img(h, w, seed=0):
    return Image.fromarray(_rgb(np.random.default_rng(seed), h, w))


def test_resize_and_center_crop():
    img = _img(20, 30)
    assert T.Resize(10)(img).size == (15, 10)            # (w, h): shorter side 10
    assert T.Resize(10)(_img(33, 11)).size == (10, 30)   # int(10 * 33 / 11)
    assert T.Resize((7, 9))(img).size == (9, 7)
    assert T.Resize(20)(img) is img                      # already that size: untouched
    a = np.asarray(img)
    c = np.asarray(T.CenterCrop((8, 13))(img))
    top, left = int(round((20 - 8) / 2)), int(round((30 - 13) / 2))
    np.testing.assert_array_equal(c, a[top:top + 8, left:left + 13])
    padded = np.asarray(T.CenterCrop(24)(_img(20, 20)))  # larger than the image: zeros around
    assert padded.shape == (24, 24, 3)
    np.testing.assert_array_equal(padded[2:22, 2:22], np.asarray(_img(20, 20)))
    assert padded[:2].max() == 0 and padded[:, :2].max() == 0
    for bad in (0, (3,), (2, -1), 2.5, "8"):
        with pytest.raises(ValueError, match="size"):
            T.Resize(bad)


@pytest.mark.parametrize("h,w,crop,top,left", [
    # torchvision pads d // 2 before, (d + 1) // 2 after, for a crop d larger than the image
    (2, 3, (5, 6), 1, 1),     # odd on both sides: 1 row above, 1 column left
    (3, 3, (4, 4), 0, 0),     # d = 1: the zeros go after
    (4, 4, (6, 6), 1, 1),     # even: centred
    (5, 2, (3, 5), -1, 1),    # taller than the crop, narrower: crops rows, pads columns
])
def test_center_crop_larger_than_the_image_pads_as_torchvision(h, w, crop, top, left):
    """Hand-derived from torchvision's center_crop (pad, then round((H - h) / 2)): ``top`` and
    ``left`` are where the image's first row and column land in the output (negative: cropped).
    round(-1.5) = -2 put the image one pixel off for odd differences."""
    img = _img(h, w, seed=3)
    out = np.asarray(T.CenterCrop(crop)(img))
    want = np.zeros((crop[0], crop[1], 3), np.uint8)
    a = np.asarray(img)
    for r in range(crop[0]):
        for c in range(crop[1]):
            if 0 <= r - top < h and 0 <= c - left < w:
                want[r, c] = a[r - top, c - left]
    np.testing.assert_array_equal(out, want)


def test_to_array_and_normalize():
    img = _img(5, 7)
    x = T.ToArray()(img)
    assert x.shape == (3, 5, 7) and x.dtype == np.float32
    np.testing.assert_allclose(x, np.asarray(img).transpose(2, 0, 1) / 255.0, rtol=0, atol=1e-7)
    assert T.ToArray()(img.convert("L")).shape == (1, 5, 7)
    mean, std = (0.1, 0.5, 0.9), (0.2, 0.25, 0.5)
    y = T.Normalize(mean, std)(x)
    want = (x.astype(np.float64) - np.array(mean)[:, None, None]) / np.array(std)[:, None, None]
    assert y.dtype == np.float32
    np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="2 values"):
        T.Normalize((0, 0), (1, 1))(x)
    with pytest.raises(ValueError, match="std"):
        T.Normalize((0,), (0,))
    with pytest.raises(TypeError, match="after ToArray"):
        T.Normalize(mean, std)(img)
    with pytest.raises(TypeError, match="before ToArray"):
        T.Resize(3)(x)


class _Draws:
    """A stand-in Generator that returns the given draws in order (and records the calls)."""

    def __init__(self, *values):
        self.values = list(values)
        self.calls = []

    def uniform(self, lo, hi):
        self.calls.append(("uniform", lo, hi))
        return self.values.pop(0)

    def integers(self, lo, hi):
        self.calls.append(("integers", lo, hi))
        return self.values.pop(0)


def test_random_resized_crop_matches_a_hand_computed_crop():
    img = _img(30, 40)  # width 40, height 30: area 1200
    t = T.RandomResizedCrop((6, 8), scale=(0.25, 1.0), ratio=(0.5, 2.0))
    # a draw of 0.5 of the area (600) at log-ratio log(1.5): w = round(sqrt(900)) = 30,
    # h = round(sqrt(400)) = 20; then top 3 of [0, 11), left 7 of [0, 11)
    draws = _Draws(0.5, math.log(1.5), 3, 7)
    assert t.get_params(40, 30, draws) == (3, 7, 20, 30)
    assert draws.calls == [("uniform", 0.25, 1.0), ("uniform", math.log(0.5), math.log(2.0)),
                           ("integers", 0, 11), ("integers", 0, 11)]
    # the crop is resized as torchvision's resized_crop does: crop, then bilinear resize
    rng = np.random.default_rng(11)
    top, left, h, w = t.get_params(40, 30, np.random.default_rng(11))
    got = np.asarray(t(img, rng))
    want = np.asarray(img.crop((left, top, left + w, top + h)).resize((8, 6), Image.BILINEAR))
    assert got.shape == (6, 8, 3)
    np.testing.assert_array_equal(got, want)
    # ten misses (a crop larger than the image) fall back to the whole image within ratio
    misses = _Draws(*([1.0, math.log(2.0)] * 10))
    t2 = T.RandomResizedCrop(4, scale=(1.0, 1.0), ratio=(0.5, 2.0))
    assert t2.get_params(40, 30, misses) == (0, 0, 30, 40)
    t3 = T.RandomResizedCrop(4, scale=(1.0, 1.0), ratio=(2.0, 3.0))  # 40/30 < 2: clamp height
    assert t3.get_params(40, 30, _Draws(*([1.0, math.log(3.0)] * 10))) == (5, 0, 20, 40)


def test_random_transforms_are_deterministic_per_seed_epoch_index():
    img = _img(40, 48)
    t = T.Compose([T.RandomResizedCrop(16), T.RandomHorizontalFlip(), T.ToArray()])

    def run(seed, epoch, index):
        return t(img, np.random.default_rng((seed, epoch, index)))

    a = run(0, 0, 5)
    assert a.shape == (3, 16, 16) and a.dtype == np.float32 and 0 <= a.min() and a.max() <= 1
    np.testing.assert_array_equal(a, run(0, 0, 5))
    others = [run(0, e, 5) for e in (1, 2, 3)] + [run(1, 0, 5), run(0, 0, 6)]
    assert all(not np.array_equal(a, o) for o in others)
    crops = {T.RandomResizedCrop(16).get_params(48, 40, np.random.default_rng((0, e, 5)))
             for e in range(8)}
    assert len(crops) == 8  # a different crop every epoch
    with pytest.raises(TypeError, match="numpy.random.Generator"):
        T.RandomResizedCrop(8)(img, None)
    with pytest.raises(TypeError, match="numpy.random.Generator"):
        t(img)


def test_horizontal_flip():
    img = _img(4, 6)
    rng = np.random.default_rng(0)
    flipped = np.asarray(T.RandomHorizontalFlip(1.0)(img, rng))
    np.testing.assert_array_equal(flipped, np.asarray(img)[:, ::-1])
    assert T.RandomHorizontalFlip(0.0)(img, rng) is img
    draws = [np.random.default_rng(s).random() < 0.5 for s in range(20)]
    got = [T.RandomHorizontalFlip()(img, np.random.default_rng(s)) is not img for s in range(20)]
    assert got == draws and any(got) and not all(got)
    with pytest.raises(ValueError, match="p must be"):
        T.RandomHorizontalFlip(1.5)
    with pytest.raises(ValueError, match="scale"):
        T.RandomResizedCrop(8, scale=(0.5, 0.1))


def test_folder_applies_transform_with_its_rng(tmp_path):
    root = _folder(tmp_path, {"a": 2, "b": 2}, size=(20, 24))
    t = T.Compose([T.RandomResizedCrop(8), T.RandomHorizontalFlip(), T.ToArray(),
                   T.Normalize((0.5,) * 3, (0.5,) * 3)])
    ds = images.ImageFolder(root, transform=t)
    x, y = ds[1]
    assert x.shape == (3, 8, 8) and -1.0 <= x.min() and x.max() <= 1.0
    np.testing.assert_array_equal(x, ds.load(1, np.random.default_rng((0, 0, 1)))[0])
    assert not np.array_equal(x, ds.load(1, np.random.default_rng((0, 1, 1)))[0])
    plain = ds.with_transform(T.Resize((5, 6)))  # a PIL result is turned into an array
    assert plain[1][0].shape == (3, 5, 6) and plain.samples is ds.samples
    assert ds.transform is t


def test_cached_serves_the_same_images_from_memory(tmp_path):
    root = _folder(tmp_path, {"a": 3, "b": 2})
    t = T.Compose([T.RandomResizedCrop(6), T.RandomHorizontalFlip(), T.ToArray()])
    ds = images.ImageFolder(root, transform=t)
    cached = ds.cached()
    assert cached.samples is ds.samples and "cached" in repr(cached)
    with pytest.raises(DataError, match="more than max_bytes=1000 bytes"):
        ds.cached(max_bytes=1000)  # 12 x 10 x 3 bytes each: 2 fit
    os.remove(ds.samples[0][0])  # served from memory now
    assert cached[0][0].shape == (3, 6, 6)
    for i in range(len(ds)):
        for e in (0, 1):
            rng = (0, e, i)
            if i:
                np.testing.assert_array_equal(cached.load(i, np.random.default_rng(rng))[0],
                                              ds.load(i, np.random.default_rng(rng))[0])
    a = cached.image(1)
    a.paste(0, (0, 0, 10, 12))  # a transform that writes into its image cannot reach the cache
    assert np.asarray(cached.image(1)).max() > 0
    fd = images.load_folder(root, 6, val_fraction=0.4, cache=True)
    assert fd.train._cache is fd.test._cache and fd.train._cache is not None


# -- splits, statistics, load_folder -------------------------------------------------------------
def test_stratified_split_properties():
    y = np.array([0] * 10 + [1] * 3 + [2] * 2 + [3] * 1 + [4] * 50)
    rng = np.random.default_rng(0)
    y = y[rng.permutation(len(y))]
    tr, va = images.stratified_split(y, 0.2, seed=7)
    assert tr.dtype == np.int64 and va.dtype == np.int64
    assert np.array_equal(np.sort(np.concatenate([tr, va])), np.arange(len(y)))
    assert np.array_equal(tr, np.sort(tr)) and not set(tr) & set(va)
    for c, n in ((0, 10), (1, 3), (2, 2), (4, 50)):
        assert c in y[tr] and c in y[va]  # every class with >= 2 samples in both parts
    assert 3 in y[tr] and 3 not in y[va]  # a single sample stays in train
    assert (y[va] == 0).sum() == 2 and (y[va] == 4).sum() == 10 and (y[va] == 2).sum() == 1
    again = images.stratified_split(list(y), 0.2, seed=7)
    assert all(np.array_equal(a, b) for a, b in zip((tr, va), again))
    other = images.stratified_split(y, 0.2, seed=8)
    assert not np.array_equal(va, other[1])
    for bad in (0.0, 1.0, -0.1):
        with pytest.raises(ValueError, match="fraction"):
            images.stratified_split(y, bad)
    with pytest.raises(ValueError, match="integer labels"):
        images.stratified_split(y.astype(float), 0.2)


def test_channel_stats(tmp_path):
    root = _folder(tmp_path, {"a": 3, "b": 3})
    ds = images.ImageFolder(root)
    xs = np.stack([ds[i][0] for i in range(len(ds))]).astype(np.float64)
    mean, std = images.channel_stats(ds)
    np.testing.assert_allclose(mean, xs.mean(axis=(0, 2, 3)), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(std, xs.std(axis=(0, 2, 3)), rtol=1e-4, atol=1e-6)
    some, _ = images.channel_stats(ds, max_images=2, seed=1)
    assert not np.allclose(some, mean)


def test_load_folder_split_or_val_folder(tmp_path):
    one = _folder(tmp_path / "one", {"a": 10, "b": 5}, size=(20, 16))
    fd = images.load_folder(one, 8, val_fraction=0.2)
    assert fd.split == "stratified" and fd.num_classes == 2 and fd.image_shape == (3, 8, 8)
    assert len(fd.train_indices) == 12 and len(fd.test_indices) == 3
    assert fd.train.samples is fd.test.samples
    assert "12 train / 3 test" in fd.describe()
    xs = np.stack([fd.test.load(int(i), None)[0] for i in fd.train_indices])
    np.testing.assert_allclose(xs.mean(axis=(0, 2, 3)), 0, atol=1e-4)  # normalized by train stats
    np.testing.assert_allclose(xs.std(axis=(0, 2, 3)), 1, atol=1e-3)
    x0 = fd.train.load(0, np.random.default_rng((0, 0, 0)))[0]
    assert x0.shape == (3, 8, 8) and not np.array_equal(x0, fd.test.load(0, None)[0])

    two = tmp_path / "two"
    _folder(two / "train", {"a": 4, "b": 4}, size=(8, 8))
    _folder(two / "val", {"a": 2, "b": 1}, size=(8, 8))
    fd = images.load_folder(two, augment=False)  # size from the first image
    assert fd.split == "folders" and fd.image_shape == (3, 8, 8)
    assert len(fd.train_indices) == 8 and len(fd.test_indices) == 3
    assert fd.test.root.endswith("val") and fd.train.transform is fd.test.transform
    _folder(two / "val", {"c": 1})
    with pytest.raises(DataError, match="extra: c"):
        images.load_folder(two, 8)
