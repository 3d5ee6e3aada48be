"""utensil-train and utensil-predict on image folders (issue 29, items 6, 7 and 12): images that
do not decode (a truncated JPEG) are found before training, in train/ and val/ alike, or skipped
with one warning line each under --skip-bad-images; predict replays training's evaluation
transform exactly; the CLI's messages name its flags and describe a checkpoint in words."""

import json
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

from utensil_ffi import predict as pr
from utensil_ffi import train as tr
from utensil_ffi.cli import _warn
from utensil_ffi.cli import train_data as td
from utensil_ffi.data import DataError

Image = pytest.importorskip("PIL.Image")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--epochs", "1", "--width", "4", "--batch-size", "4", "--workers", "0", "--no-progress",
        "--device", "cpu"]


def _image(path, h, w, k, seed):
    rng = np.random.default_rng(seed)
    img = np.full((h, w, 3), 60.0 + 60.0 * k) + rng.normal(0, 30, (h, w, 3))
    Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(path)


def make_folder(root, per_class=4, classes=2, sizes=((12, 12),), ext="png", seed=0):
    """Class k's images are tinted 60 + 60 k; the i-th has size sizes[i % len(sizes)]."""
    for k in range(classes):
        os.makedirs(os.path.join(root, "c%d" % k), exist_ok=True)
        for i in range(per_class):
            h, w = sizes[i % len(sizes)]
            _image(os.path.join(root, "c%d" % k, "%03d.%s" % (i, ext)), h, w, k, seed + 100 * k + i)
    return str(root)


def truncated_jpeg(path):
    """A JPEG Pillow opens and verifies, cut to half its bytes so that decoding it fails."""
    _image(path, 64, 64, 0, 7)  # noise: kilobytes of compressed data after the header
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[:len(data) * 2 // 3])
    with Image.open(path) as im:
        im.verify()  # passes: the header scan alone would keep this file
    return str(path)


def split_folder(root):
    make_folder(os.path.join(root, "train"))
    make_folder(os.path.join(root, "val"), per_class=2, seed=50)
    return str(root)


# item 6: a truncated JPEG ----------------------------------------------------------------------

def test_truncated_jpeg_in_train_stops_the_run_naming_file_and_flag(tmp_path, capsys):
    data = split_folder(tmp_path / "d")
    bad = truncated_jpeg(os.path.join(data, "train", "c1", "cut.jpg"))
    ck = tmp_path / "ck.npz"
    assert tr.main(["--data", data, "--checkpoint", str(ck)] + TINY) == 2
    cap = capsys.readouterr()
    assert bad in cap.err and "utensil-train: error:" in cap.err
    # the CLI's advice names its flag, not the Python argument or class
    assert "--skip-bad-images" in cap.err
    assert "on_error" not in cap.err and "ImageFolder" not in cap.err
    assert "epoch" not in cap.out and not ck.exists()


def test_truncated_jpeg_in_val_is_found_before_training(tmp_path, capsys):
    data = split_folder(tmp_path / "d")
    bad = truncated_jpeg(os.path.join(data, "val", "c0", "cut.jpg"))
    # opening the data (what runs before the first epoch) finds it, not the first evaluation
    with pytest.raises(DataError, match="cut.jpg"):
        td.open_data(data, workers=0)
    ck = tmp_path / "ck.npz"
    assert tr.main(["--data", data, "--checkpoint", str(ck)] + TINY) == 2
    cap = capsys.readouterr()
    assert bad in cap.err and "--skip-bad-images" in cap.err
    assert "epoch" not in cap.out and not ck.exists()


def test_skip_bad_images_skips_truncated_jpegs_with_one_warning_line_each(tmp_path):
    data = split_folder(tmp_path / "d")
    bad = [truncated_jpeg(os.path.join(data, "train", "c1", "cut.jpg")),
           truncated_jpeg(os.path.join(data, "val", "c0", "cut.jpg"))]
    ck = tmp_path / "ck.npz"
    # a process of its own: the user's view of stderr, without pytest's warning capture
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-m", "utensil_ffi.cli.train", "--data", data,
                        "--skip-bad-images", "--checkpoint", str(ck)] + TINY,
                       cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    for path in bad:
        mine = [ln for ln in lines if path in ln]
        assert len(mine) == 1, r.stderr
        assert mine[0].startswith("utensil-train: warning: skipping %s" % path), r.stderr
    assert "UserWarning" not in r.stderr and "images.py" not in r.stderr, r.stderr
    info = tr.load_checkpoint(str(ck))[0]["data_info"]
    assert (info["n_train"], info["n_test"]) == (8, 4)  # the good files only


def test_a_file_broken_after_the_scan_is_named_when_loaded(tmp_path):
    data = split_folder(tmp_path / "d")
    ds = td.open_data(data, workers=0)
    try:
        victim = ds.fd.test.samples[0][0]
        with open(victim, "rb") as f:
            head = f.read()[:100]
        with open(victim, "wb") as f:  # cut after the up-front decode
            f.write(head)
        with pytest.raises(DataError) as e:
            list(ds.test_batches(4))
    finally:
        ds.close()
    assert victim in str(e.value) and "changed since" in str(e.value)
    assert "ImageFolder" not in str(e.value)


def test_the_cli_hints_name_flags_not_arguments(tmp_path):
    from utensil_ffi.data.images import ImageFolder

    data = make_folder(tmp_path / "d")
    bad = os.path.join(data, "c0", "junk.png")
    with open(bad, "wb") as f:
        f.write(b"not an image")
    with pytest.raises(DataError) as e:  # the Python API keeps its argument names
        ImageFolder(data)
    assert "on_error='skip'" in str(e.value)
    with pytest.raises(DataError) as e:
        ImageFolder(data, hints=td.FOLDER_HINTS)
    assert "--skip-bad-images" in str(e.value) and "on_error" not in str(e.value)
    os.remove(bad)
    with pytest.raises(DataError) as e:  # --cache-images over its limit
        ImageFolder(data, hints=td.FOLDER_HINTS).cached(max_bytes=1000)
    assert "--cache-images" in str(e.value) and "max_bytes" not in str(e.value)


def test_cli_warnings_format_only_inside_the_block():
    before = warnings.formatwarning
    with _warn.cli_warnings("prog"):
        assert warnings.formatwarning("skipping x", UserWarning, "lib.py", 3) \
            == "prog: warning: skipping x\n"
    assert warnings.formatwarning is before
    assert "lib.py" in warnings.formatwarning("skipping x", UserWarning, "lib.py", 3)


# item 7: predict replays the evaluation transform ----------------------------------------------

@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run with no --image-size whose first image is square and others are not."""
    root = tmp_path_factory.mktemp("pred")
    data = make_folder(root / "d", per_class=6, sizes=((12, 12), (12, 20), (20, 12)))
    ck = str(root / "ck.npz")
    assert tr.main(["--data", data, "--checkpoint", ck] + TINY) == 0
    return data, ck


def test_predict_prepares_as_training_evaluated(trained, capsys):
    from utensil_ffi.cli.export import load_network
    from utensil_ffi.data.images import load_folder

    data, ck = trained
    info = tr.load_checkpoint(ck)[0]["data_info"]
    fd = load_folder(data)  # what training evaluated with (the same folder and defaults)
    assert fd.image_shape == (3, 12, 12)
    net, _ = load_network(ck, "cpu")
    try:
        for i, (path, _) in enumerate(fd.test.samples):  # every file, square or not
            want = fd.test[i][0]
            np.testing.assert_array_equal(pr.prepare(path, info), want, err_msg=path)
            probs = pr.predict(net, want[None])[0]
            capsys.readouterr()
            assert pr.main([ck, path, "--top-k", "1"]) == 0
            name = capsys.readouterr().out.split(": ")[1].split()[0]
            assert name == info["class_names"][int(np.argmax(probs))], path
    finally:
        net.close()


def test_predict_reads_checkpoints_without_the_record(trained):
    from utensil_ffi.data import transforms as T

    data, ck = trained
    info = dict(tr.load_checkpoint(ck)[0]["data_info"])
    info.pop("eval_transform", None)  # as written before it was recorded: the old rule
    path = os.path.join(data, "c0", "001.png")
    old = T.Compose([T.Resize(12), T.CenterCrop(12), T.ToArray(),
                     T.Normalize(info["mean"], info["std"])])
    np.testing.assert_array_equal(pr.prepare(path, info), old(Image.open(path).convert("RGB")))


def _rewrite_meta(src, dst, change):
    with np.load(src) as f:
        arrays = {k: f[k] for k in f.files}
    meta = json.loads(str(arrays["meta"]))
    change(meta)
    arrays["meta"] = np.array(json.dumps(meta))
    np.savez(dst, **arrays)
    return str(dst)


def test_predict_refuses_a_malformed_evaluation_record(trained, tmp_path, capsys):
    data, ck = trained
    bad = _rewrite_meta(ck, tmp_path / "bad.npz",
                        lambda m: m["data_info"]["eval_transform"].update(crop="big"))
    assert pr.main([bad, os.path.join(data, "c0", "000.png")]) == 2
    err = capsys.readouterr().err
    assert "utensil-predict: error:" in err and "evaluation transform" in err
    assert "Traceback" not in err


# item 12: what the CLI says --------------------------------------------------------------------

def test_resume_names_the_digits_in_words(trained, tmp_path, capsys):
    data, ck = trained
    digits = _rewrite_meta(ck, tmp_path / "digits.npz", lambda m: m["run"].update(data=None))
    assert tr.main(["--resume", digits, "--data", data] + TINY) == 2
    err = capsys.readouterr().err
    assert "built-in digits" in err and "None" not in err


def test_predict_help_describes_device(capsys):
    with pytest.raises(SystemExit):
        pr.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    after = out.rsplit("--device {cpu,cuda}", 1)[1].strip()  # the options list, not usage
    assert after and not after.startswith("-"), out
