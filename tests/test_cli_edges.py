"""utensil-train's and utensil-export's edges (issue 29, items 8-11): output paths checked before
the work and a failed save reported with what is kept; top-k accuracy that ties and NaN cannot
win; a folder that holds out no test image refused as an .npz without one is; --image-size
refused when one batch cannot fit, and for the built-in digits as for an .npz."""

import errno
import os

import numpy as np
import pytest

import utensil_ffi as ut
from utensil_ffi import export as ex
from utensil_ffi import train as tr
from utensil_ffi.cli import checkpoint as ckmod
from utensil_ffi.cli import image_limits, paths
from utensil_ffi.cli.metrics import topk_correct

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAST = ["--width", "2", "--batch-size", "16", "--no-progress", "--device", "cpu"]


def _toy_npz(path, classes=3, n_test=12):
    rng = np.random.default_rng(0)
    y = np.arange(36 + n_test) % classes
    x = rng.normal(0, 0.3, (len(y), 6, 6)).astype(np.float32)
    x[np.arange(len(y)), y % 6, :] += 2.0
    np.savez(path, x_train=x[:36], y_train=y[:36], x_test=x[36:], y_test=y[36:])
    return str(path)


@pytest.fixture
def npz(tmp_path):
    return _toy_npz(tmp_path / "toy.npz")


def _image_folder(root, per_class, classes=2):
    Image = pytest.importorskip("PIL.Image")
    rng = np.random.default_rng(0)
    for k in range(classes):
        os.makedirs(os.path.join(root, "c%d" % k))
        for i in range(per_class):
            px = rng.integers(0, 255, (8, 8, 3)).astype(np.uint8)
            Image.fromarray(px).save(os.path.join(root, "c%d" % k, "%d.png" % i))
    return str(root)


# -- item 8: the checkpoint's path, and a save that fails ----------------------------------------
def test_checkpoint_path_ending_in_a_separator_is_refused_up_front(npz, tmp_path, capsys):
    path = str(tmp_path / "newdir") + os.sep
    with pytest.raises(SystemExit) as e:
        tr.main(["--data", npz, "--epochs", "1", "--checkpoint", path] + FAST)
    assert e.value.code == 2
    said = capsys.readouterr()
    assert "separator" in said.err and path in said.err and "epoch" not in said.out


def test_checkpoint_name_at_the_limit_saves(npz, tmp_path, capsys):
    # 250 characters fit NAME_MAX (255); the temporary file beside it must fit too
    path = tmp_path / ("c" * 246 + ".npz")
    assert tr.main(["--data", npz, "--epochs", "1", "--checkpoint", str(path)] + FAST) == 0
    assert tr.load_checkpoint(str(path))[0]["epoch"] == 1
    assert sorted(os.listdir(tmp_path)) == sorted(["toy.npz", path.name])  # no temp file left


def test_checkpoint_name_over_the_limit_is_refused_up_front(npz, tmp_path, capsys):
    path = str(tmp_path / "missing" / ("c" * 300 + ".npz"))
    with pytest.raises(SystemExit) as e:
        tr.main(["--data", npz, "--epochs", "1", "--checkpoint", path] + FAST)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "cannot save the checkpoint there" in err and "304 bytes long" in err, err
    assert not os.path.exists(tmp_path / "missing")


def test_temporary_name_is_short_and_beside_the_file(tmp_path):
    long = str(tmp_path / ("x" * 250))
    tmp = paths.temporary_name(long)
    assert os.path.dirname(tmp) == str(tmp_path) and len(os.path.basename(tmp)) < 40
    assert paths.temporary_name(long) != paths.temporary_name(long + "y")


def _savez_failing_from(call, err):
    real, calls = np.savez, []

    def savez(f, **arrays):
        calls.append(1)
        if len(calls) >= call:
            f.write(b"partial")  # what a full disk leaves: a part of the file
            raise OSError(err, os.strerror(err))
        return real(f, **arrays)

    return savez


def test_failed_save_keeps_the_last_checkpoint_and_says_so(npz, tmp_path, monkeypatch, capsys):
    ck = str(tmp_path / "ck.npz")
    monkeypatch.setattr(ckmod.np, "savez", _savez_failing_from(2, errno.ENOSPC))
    assert tr.main(["--data", npz, "--epochs", "3", "--checkpoint", ck] + FAST) == 1
    err = capsys.readouterr().err
    assert err.startswith("utensil-train: error: could not save the checkpoint to %s: %s"
                          % (ck, os.strerror(errno.ENOSPC))), err
    assert "after epoch 1, is kept" in err and "--resume %s --epochs 3" % ck in err
    assert "Traceback" not in err
    monkeypatch.undo()
    assert tr.load_checkpoint(ck)[0]["epoch"] == 1  # the good one, untouched
    assert sorted(os.listdir(tmp_path)) == ["ck.npz", "toy.npz"]  # no temporary file left


def test_failed_first_save_says_nothing_was_saved(npz, tmp_path, monkeypatch, capsys):
    ck = tmp_path / "ck.npz"
    ck.write_bytes(b"the user's file")
    monkeypatch.setattr(ckmod.np, "savez", _savez_failing_from(1, errno.EFBIG))
    assert tr.main(["--data", npz, "--epochs", "1", "--checkpoint", str(ck)] + FAST) == 1
    err = capsys.readouterr().err
    assert "could not save the checkpoint to %s: %s" % (ck, os.strerror(errno.EFBIG)) in err
    assert "no checkpoint of this run was saved" in err
    assert ck.read_bytes() == b"the user's file"
    assert sorted(os.listdir(tmp_path)) == ["ck.npz", "toy.npz"]


def test_resumed_run_names_the_checkpoint_it_resumed_from(npz, tmp_path, monkeypatch, capsys):
    ck = str(tmp_path / "ck.npz")
    assert tr.main(["--data", npz, "--epochs", "1", "--checkpoint", ck] + FAST) == 0
    capsys.readouterr()
    monkeypatch.setattr(ckmod.np, "savez", _savez_failing_from(1, errno.ENOSPC))
    assert tr.main(["--resume", ck, "--epochs", "2", "--no-progress", "--device", "cpu"]) == 1
    assert "after epoch 1, is kept" in capsys.readouterr().err


def test_export_checks_its_output_folder_before_the_work(tmp_path, monkeypatch, capsys):
    def no_work(*a, **k):
        raise AssertionError("the output path should be checked before the checkpoint is read")

    monkeypatch.setattr(ex, "load_network", no_work)
    out = str(tmp_path / "missing" / "m.onnx")
    with pytest.raises(SystemExit) as e:
        ex.main([str(tmp_path / "ck.npz"), out])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "utensil-export: error:" in err and "does not exist" in err and out in err
    assert ".tmp" not in err


def test_onnx_writer_takes_a_name_at_the_limit(tmp_path):
    from utensil_ffi.interop.onnx_export import _write_atomically

    path = tmp_path / ("m" * 250)
    _write_atomically(str(path), b"onnx bytes")
    assert path.read_bytes() == b"onnx bytes" and os.listdir(tmp_path) == [path.name]


# -- item 9: top-k accuracy -----------------------------------------------------------------------
class _FixedLogits:
    """A stand-in network: hands out given logits in order, batch by batch."""

    def __init__(self, logits):
        self.logits, self.pos = logits, 0

    def eval(self):
        pass

    def train(self, mode=True):
        pass

    def __call__(self, xb):
        n = xb.shape[0]
        out = ut.tensor(self.logits[self.pos:self.pos + n])
        self.pos += n
        return out


def test_topk_ties_and_nan_count_against_the_label():
    nan = np.nan
    z = np.array([[5, 1, 1, 1, 1, 1, 1],       # label 0 strictly first: right in both
                  [3, 3, 3, 3, 3, 3, 3],       # all equal: no prediction, wrong in both
                  [2, 2, 1, 1, 1, 1, 1],       # tied with one: not top-1, in the top 5
                  [9, 9, 9, 9, 9, 9, 1],       # tied with 5 others: 5 >= it, not top-5
                  [nan, 1, 1, 1, 1, 1, 1],     # the label's logit NaN
                  [5, nan, 1, 1, 1, 1, 1],     # a NaN elsewhere in the row
                  [nan] * 7], np.float32)      # all NaN (--lr 1e38)
    y = np.zeros(len(z), np.int64)
    assert topk_correct(z, y, 1).tolist() == [True, False, False, False, False, False, False]
    assert topk_correct(z, y, 5).tolist() == [True, False, True, False, False, False, False]
    r = tr.evaluate_full(_FixedLogits(z), np.zeros((len(z), 1, 1, 1), np.float32), y, 3, "cpu")
    assert r["top1"] == pytest.approx(1 / 7) and r["top5"] == pytest.approx(2 / 7)


def test_topk_matches_a_plain_rank_without_ties():
    rng = np.random.default_rng(1)
    z = rng.permuted(np.tile(np.arange(10, dtype=np.float32), (50, 1)), axis=1)  # no ties
    y = rng.integers(0, 10, 50)
    rank = np.argsort(np.argsort(-z, axis=1), axis=1)[np.arange(50), y]
    for k in (1, 3, 5):
        assert np.array_equal(topk_correct(z, y, k), rank < k)


def test_diverged_run_reports_no_top5_accuracy(tmp_path, capsys):
    data = _toy_npz(tmp_path / "six.npz", classes=6)
    assert tr.main(["--data", data, "--epochs", "1", "--lr", "1e38", "--no-checkpoint"]
                   + FAST) == 0
    out = capsys.readouterr().out
    line = [s for s in out.splitlines() if s.startswith("epoch")][0]
    # the logits overflowed to NaN: nothing may count as right (it printed top-5 100.00%)
    assert "test loss nan" in line and "test acc   0.00%" in line and "top-5   0.00%" in line, line


# -- item 10: no test set -------------------------------------------------------------------------
def test_folder_that_holds_out_no_image_is_refused(tmp_path, capsys):
    data = _image_folder(tmp_path / "imgs", per_class=1)
    assert tr.main(["--data", data, "--epochs", "1", "--no-checkpoint", "--workers", "0"]
                   + FAST) == 2
    said = capsys.readouterr()
    assert "utensil-train: error:" in said.err and "no image is held out" in said.err
    assert "final test accuracy" not in said.out and "test acc" not in said.out


def test_npz_without_test_images_is_refused_alike(tmp_path, capsys):
    x = np.zeros((8, 6, 6), np.float32)
    np.savez(tmp_path / "e.npz", x_train=x, y_train=np.arange(8) % 2, x_test=x[:0],
             y_test=np.zeros(0, np.int64))
    assert tr.main(["--data", str(tmp_path / "e.npz"), "--epochs", "1", "--no-checkpoint"]
                   + FAST) == 2
    said = capsys.readouterr()
    assert "utensil-train: error:" in said.err and "x_test is empty" in said.err
    assert "final test accuracy" not in said.out


# -- item 11: --image-size ------------------------------------------------------------------------
def test_image_size_too_large_for_memory_is_refused_up_front(tmp_path, monkeypatch, capsys):
    data = _image_folder(tmp_path / "imgs", per_class=3)
    from utensil_ffi.data import images

    def no_decoding(*a, **k):
        raise AssertionError("the size should be refused before the folder is read")

    monkeypatch.setattr(images, "load_folder", no_decoding)
    assert tr.main(["--data", data, "--image-size", "100000", "--epochs", "1",
                    "--no-checkpoint", "--workers", "0"] + FAST) == 2
    err = capsys.readouterr().err
    assert err.startswith("utensil-train: error: --image-size 100000:"), err
    assert "memory" in err and "Traceback" not in err


def test_image_size_bound_is_one_batch_against_memory():
    gib = 2 ** 30
    f = image_limits.image_size_problem
    assert f(None, 64, memory=1) is None
    assert f(64, 64, 500, memory=gib) is None  # 24 MiB for the evaluation's batch
    # 16 * 3 * 8192^2 * 4 bytes = 12 GiB
    assert f(8192, 16, memory=16 * gib) is None
    why = f(8192, 16, memory=8 * gib)
    assert "12.0 GiB" in why and "8.0 GiB" in why and "(--batch-size)" in why
    # the evaluation's batch is the larger one by default (500): it is what must fit
    why = f(2048, 64, 500, memory=8 * gib)
    assert "500 images (--eval-batch-size)" in why and "23.4 GiB" in why
    assert f(2048, 64, 64, memory=8 * gib) is None
    assert image_limits.physical_memory() is None or image_limits.physical_memory() > 0


def test_stray_memory_error_is_one_line(npz, monkeypatch, capsys):
    def out_of_memory(*a, **k):
        raise MemoryError()

    monkeypatch.setattr(tr._train_data, "open_data", out_of_memory)
    assert tr.main(["--data", npz, "--epochs", "1", "--no-checkpoint"] + FAST) == 1
    err = capsys.readouterr().err
    assert err.startswith("utensil-train: error: out of memory") and "Traceback" not in err


def test_export_names_its_output_when_the_write_fails(tmp_path, monkeypatch, capsys):
    pytest.importorskip("onnx")
    from utensil_ffi.interop import onnx_export

    class Net:
        def close(self):
            pass

    meta = {"data_info": {"image_shape": [1, 4, 4], "num_classes": 2}, "run": {}}
    monkeypatch.setattr(ex, "load_network", lambda path: (Net(), meta))

    def full_disk(net, path, *a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path + ".abc123.tmp")

    monkeypatch.setattr(onnx_export, "export_onnx", full_disk)
    out = str(tmp_path / "m.onnx")
    assert ex.main([str(tmp_path / "ck.npz"), out, "--no-check"]) == 1
    err = capsys.readouterr().err
    assert err.strip() == "utensil-export: error: could not write %s: %s" % (
        out, os.strerror(errno.ENOSPC))


def test_image_size_with_the_digits_is_refused_as_for_an_npz(npz, monkeypatch, capsys):
    from utensil_ffi import data as ud

    def no_loading():
        raise AssertionError("the flag should be refused before the digits are loaded")

    monkeypatch.setattr(ud, "load_digits", no_loading)
    assert tr.main(["--image-size", "16", "--epochs", "1", "--no-checkpoint"] + FAST) == 2
    digits_err = capsys.readouterr().err
    assert tr.main(["--data", npz, "--image-size", "16", "--epochs", "1", "--no-checkpoint"]
                   + FAST) == 2
    npz_err = capsys.readouterr().err
    same = "utensil-train: error: --image-size resizes the images of a folder; "
    assert digits_err.startswith(same) and npz_err.startswith(same), (digits_err, npz_err)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="resource limits are POSIX")
def test_file_size_limit_mid_run_is_a_clear_error(npz, tmp_path):
    # a real EFBIG from the kernel, not a stand-in: the child may write files of 4 KiB at most
    import resource
    import subprocess
    import sys

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))

    ck = str(tmp_path / "ck.npz")
    r = subprocess.run([sys.executable, "-m", "utensil_ffi.cli.train", "--data", npz,
                        "--epochs", "1", "--checkpoint", ck] + FAST, preexec_fn=limit,
                       capture_output=True, text=True, timeout=120,
                       cwd=str(tmp_path), env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1",
                                                   PYTHONPATH=ROOT + os.pathsep
                                                   + os.environ.get("PYTHONPATH", "")))
    assert r.returncode == 1, r.stderr
    assert r.stderr.startswith("utensil-train: error: could not save the checkpoint to %s: %s"
                               % (ck, os.strerror(errno.EFBIG))), r.stderr
    assert "epoch   1/1" in r.stdout and "Traceback" not in r.stderr
    assert sorted(os.listdir(tmp_path)) == ["toy.npz"]  # no partial file, no temporary one
