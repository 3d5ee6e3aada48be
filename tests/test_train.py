"""utensil-train (utensil_ffi.train) end to end: flags, data loading, checkpoints, --resume.

Runs use a tiny network on a small synthetic .npz so the file stays fast; one run on the
built-in digits checks the default data path. The full default run (>= 97% on the digits) is
slow-ish and runs only with UTENSIL_FULL_TRAIN=1.
"""

import os
import sys

import numpy as np
import pytest

import utensil_ffi as ut
from utensil_ffi import data as ud
from utensil_ffi.nn import models
from utensil_ffi import train as tr

TINY = ["--width", "2", "--batch-size", "16", "--no-progress"]


@pytest.fixture
def npz(tmp_path):
    """A small learnable 3-class problem: 6x6 images with a bright row per class, plus noise."""
    rng = np.random.default_rng(0)

    def make(n):
        y = rng.integers(0, 3, n)
        x = rng.normal(0, 0.3, (n, 6, 6))
        x[np.arange(n), 1 + 2 * y, :] += 2.0
        return x.astype(np.float32), y

    xtr, ytr = make(72)
    xte, yte = make(30)
    path = tmp_path / "toy.npz"
    np.savez(path, x_train=xtr, y_train=ytr, x_test=xte, y_test=yte)
    return str(path)


def _run(argv, device=None):
    if device is not None:
        argv = list(argv) + ["--device", device]
    return tr.main(argv)


def _ckpt(path):
    meta, model, optim = tr.load_checkpoint(path)
    return meta, model, optim


# -- training and checkpoints ---------------------------------------------------------------------


def test_trains_and_saves_checkpoint(npz, tmp_path, device, capsys):
    ck = tmp_path / "ck.npz"
    assert _run(["--data", npz, "--epochs", "3", "--checkpoint", str(ck), "--lr", "0.01"]
                + TINY, device) == 0
    out = capsys.readouterr().out
    assert "epoch   3/3" in out and "img/s" in out and "test acc" in out
    assert "final test accuracy" in out
    meta, model, optim = _ckpt(ck)
    assert meta["epoch"] == 3 and len(meta["history"]) == 3
    assert meta["run"]["seed"] == 0 and meta["run"]["width"] == 2
    h = meta["history"]
    assert h[-1]["train_loss"] < h[0]["train_loss"]
    assert h[-1]["test_acc"] > 0.6
    assert all(np.isfinite(r["images_per_s"]) and r["images_per_s"] > 0 for r in h)
    # weights, running statistics and Adam state are all there, with PyTorch's names
    assert any(k.endswith("running_var") for k in model)
    assert int(model["1.num_batches_tracked"]) == 3 * 5
    assert set(optim["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    assert optim["param_groups"][0]["params"] == list(range(len(optim["state"])))
    # 72 images / 16 = 5 batches (the last of 8) per epoch
    assert all(int(e["step"]) == 3 * 5 for e in optim["state"].values())
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def _final_state(path):
    """The checkpoint's model state and its optimizer state flattened to {"<i>/<name>": array}."""
    _, model, optim = _ckpt(path)
    flat = {"%d/%s" % (i, k): v for i, e in optim["state"].items() for k, v in e.items()}
    return model, flat


def _assert_same_state(a, b, device):
    (m1, o1), (m2, o2) = _final_state(a), _final_state(b)
    assert set(m1) == set(m2) and set(o1) == set(o2)
    for k in list(m1) + ["optim:" + k for k in o1]:
        x, y = (o1[k[6:]], o2[k[6:]]) if k.startswith("optim:") else (m1[k], m2[k])
        if device == "cpu":
            assert np.array_equal(x, y), k  # bitwise
        else:
            np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5, err_msg=k)


def _losses(path):
    return [r["train_loss"] for r in _ckpt(path)[0]["history"]]


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_one_epoch_then_resume_equals_two_epochs(npz, tmp_path, device, optimizer):
    common = ["--data", npz, "--optimizer", optimizer, "--seed", "3"] + TINY
    straight, part = tmp_path / "straight.npz", tmp_path / "part.npz"
    assert _run(common + ["--epochs", "2", "--checkpoint", str(straight)], device) == 0
    assert _run(common + ["--epochs", "1", "--checkpoint", str(part)], device) == 0
    assert _ckpt(part)[0]["epoch"] == 1
    assert _run(["--resume", str(part), "--epochs", "2", "--no-progress"], device) == 0
    assert _ckpt(part)[0]["epoch"] == 2  # the resumed run keeps writing the same file
    _assert_same_state(straight, part, device)
    if device == "cpu":
        assert _losses(straight) == _losses(part)


def test_interrupted_run_resumes_exactly(npz, tmp_path, device, monkeypatch, capsys):
    """Ctrl-C during epoch 3 of 4: exit 130, the checkpoint of epoch 2 resumes to the same end."""
    common = ["--data", npz, "--seed", "5", "--lr-schedule", "cosine"] + TINY
    straight, ck = tmp_path / "straight.npz", tmp_path / "ck.npz"
    assert _run(common + ["--epochs", "4", "--checkpoint", str(straight)], device) == 0

    real = tr.train_epoch
    calls = []

    def interrupted(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(tr, "train_epoch", interrupted)
    assert _run(common + ["--epochs", "4", "--checkpoint", str(ck)], device) == 130
    assert "--resume" in capsys.readouterr().err
    assert _ckpt(ck)[0]["epoch"] == 2
    monkeypatch.setattr(tr, "train_epoch", real)
    assert _run(["--resume", str(ck), "--epochs", "4", "--no-progress"], device) == 0
    _assert_same_state(straight, ck, device)
    if device == "cpu":
        assert _losses(straight) == _losses(ck)


def test_same_seed_same_losses(npz, tmp_path, device):
    a, b, c = (tmp_path / n for n in ("a.npz", "b.npz", "c.npz"))
    for path, seed in ((a, "1"), (b, "1"), (c, "2")):
        assert _run(["--data", npz, "--epochs", "2", "--seed", seed, "--checkpoint", str(path)]
                    + TINY, device) == 0
    if device == "cpu":
        assert _losses(a) == _losses(b)
        _assert_same_state(a, b, device)
    else:
        np.testing.assert_allclose(_losses(a), _losses(b), rtol=1e-4)
    assert _losses(a) != _losses(c)


def test_resume_refuses_changed_settings(npz, tmp_path, capsys):
    ck = tmp_path / "ck.npz"
    assert _run(["--data", npz, "--epochs", "1", "--checkpoint", str(ck)] + TINY) == 0
    capsys.readouterr()
    assert _run(["--resume", str(ck), "--epochs", "2", "--width", "8", "--no-progress"]) == 2
    assert "--width 8 differs from the checkpoint" in capsys.readouterr().err
    # the same value, spelled out, is fine; so is a checkpoint already at --epochs
    assert _run(["--resume", str(ck), "--epochs", "1", "--width", "2", "--data", npz,
                 "--no-progress"]) == 0
    assert "nothing to train" in capsys.readouterr().out


def test_bad_checkpoints(tmp_path, capsys):
    missing = tmp_path / "nope.npz"
    assert _run(["--resume", str(missing)] + TINY) == 2
    assert "no such checkpoint" in capsys.readouterr().err
    other = tmp_path / "other.npz"
    np.savez(other, a=np.zeros(3))
    assert _run(["--resume", str(other)] + TINY) == 2
    assert "not a utensil-train checkpoint" in capsys.readouterr().err
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not a zip file")
    assert _run(["--resume", str(junk)] + TINY) == 2
    assert "not a readable checkpoint" in capsys.readouterr().err


def test_checkpoint_helpers_round_trip(tmp_path):
    ut.seed(1)
    net = models.mobilenet(1, 3, 2, blocks=((1, 1),))
    opt = ut.Adam(net.parameters(), lr=0.01)
    x = np.random.default_rng(0).normal(size=(4, 1, 5, 5))
    try:
        with ut.tensor(x) as xt:
            for _ in range(2):
                with net(xt) as logits:
                    with ut.cross_entropy_backward(logits, np.array([0, 1, 2, 0])) as g:
                        opt.zero_grad()
                        net.backward(g).close()
                        opt.step()
        path = tmp_path / "c.npz"
        tr.save_checkpoint(path, net, opt, {"epoch": 2, "run": {}, "history": []})
        meta, model, optim = tr.load_checkpoint(path)
        assert meta["epoch"] == 2 and int(optim["state"][0]["step"]) == 2
        ut.seed(9)
        net2 = models.mobilenet(1, 3, 2, blocks=((1, 1),))
        opt2 = ut.Adam(net2.parameters(), lr=0.5)
        try:
            net2.load_state_dict(model)
            opt2.load_state_dict(optim)
            assert opt2.t == 2 and opt2.lr == opt.lr
            for k, v in net.state_dict().items():
                assert np.array_equal(net2.state_dict()[k], v), k
            s1, s2 = opt.state_dict(), opt2.state_dict()
            assert s1["param_groups"] == s2["param_groups"]
            assert all(np.array_equal(s1["state"][i][k], s2["state"][i][k])
                       for i in s1["state"] for k in s1["state"][i])
        finally:
            opt2.close()
            net2.close()
    finally:
        opt.close()
        net.close()


def test_checkpoint_that_does_not_fit(npz, tmp_path, capsys):
    """A checkpoint whose weights do not fit the network is a clear error, not a traceback."""
    ck = tmp_path / "ck.npz"
    assert _run(["--data", npz, "--epochs", "1", "--checkpoint", str(ck)] + TINY) == 0
    with np.load(ck) as f:
        arrays = {k: f[k] for k in f.files}
    arrays["model/0.weight"] = arrays["model/0.weight"][:1]
    np.savez(ck, **arrays)
    capsys.readouterr()
    assert _run(["--resume", str(ck), "--epochs", "2", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "the weights do not fit the network" in err and "0.weight" in err, err


# -- data -----------------------------------------------------------------------------------------


def test_digits_default_data(tmp_path, capsys):
    pytest.importorskip("sklearn")
    ds = ud.load_digits()
    assert ds.x_train.shape == (1438, 1, 8, 8) and ds.x_test.shape == (359, 1, 8, 8)
    assert ds.x_train.dtype == np.float32 and ds.num_classes == 10
    assert abs(float(ds.x_train.mean())) < 1e-4 and abs(float(ds.x_train.std()) - 1) < 1e-3
    # the split is fixed and stratified
    again = ud.load_digits()
    assert np.array_equal(ds.y_test, again.y_test) and np.array_equal(ds.x_test, again.x_test)
    counts = np.bincount(ds.y_test, minlength=10)
    assert counts.min() >= 35 and counts.max() <= 37
    # and it trains (one short epoch of a narrow network)
    ck = tmp_path / "d.npz"
    assert _run(["--epochs", "2", "--width", "8", "--no-progress", "--checkpoint", str(ck),
                 "--device", "cpu"]) == 0
    assert _ckpt(ck)[0]["history"][-1]["test_acc"] > 0.5
    assert "digits" in capsys.readouterr().out


@pytest.mark.skipif(not os.environ.get("UTENSIL_FULL_TRAIN"),
                    reason="the full default run; set UTENSIL_FULL_TRAIN=1")
def test_default_run_reaches_97_percent(tmp_path, monkeypatch):
    pytest.importorskip("sklearn")
    monkeypatch.chdir(tmp_path)
    assert tr.main(["--no-progress", "--device", "cpu"]) == 0
    meta = _ckpt(tmp_path / tr.DEFAULT_CHECKPOINT)[0]
    assert meta["history"][-1]["test_acc"] >= 0.97


def test_npz_layouts(tmp_path):
    rng = np.random.default_rng(0)
    base = dict(y_train=rng.integers(0, 4, 10), y_test=rng.integers(0, 4, 6))
    # NHW uint8 -> NCHW float, scaled from 0..255
    p = tmp_path / "nhw.npz"
    np.savez(p, x_train=rng.integers(0, 256, (10, 5, 5), dtype=np.uint8),
             x_test=rng.integers(0, 256, (6, 5, 5), dtype=np.uint8), **base)
    ds = ud.load_npz(p)
    assert ds.x_train.shape == (10, 1, 5, 5) and ds.x_test.shape == (6, 1, 5, 5)
    assert ds.num_classes == int(max(base["y_train"].max(), base["y_test"].max())) + 1
    # NHWC (CIFAR as often saved) -> NCHW, per-channel normalization, when asked for: "auto"
    # cannot tell it from NCHW with 7x3 images (test_clear_errors.py covers that error)
    p = tmp_path / "nhwc.npz"
    np.savez(p, x_train=rng.random((10, 7, 7, 3)), x_test=rng.random((6, 7, 7, 3)), **base)
    ds = ud.load_npz(p, layout="nhwc")
    assert ds.x_train.shape == (10, 3, 7, 7)
    np.testing.assert_allclose(ds.x_train.mean(axis=(0, 2, 3)), 0, atol=1e-5)
    # NCHW as is; (N, 1) labels accepted
    p = tmp_path / "nchw.npz"
    np.savez(p, x_train=rng.random((10, 2, 4, 4)), x_test=rng.random((6, 2, 4, 4)),
             y_train=base["y_train"][:, None], y_test=base["y_test"])
    assert ud.load_npz(p).x_train.shape == (10, 2, 4, 4)


BAD_FILES = {
    "missing key": (dict(x_train=np.zeros((4, 5, 5)), y_train=np.zeros(4, int),
                         x_test=np.zeros((2, 5, 5))), "missing array(s) y_test"),
    "label count": (dict(x_train=np.zeros((4, 5, 5)), y_train=np.zeros(3, int),
                         x_test=np.zeros((2, 5, 5)), y_test=np.zeros(2, int)),
                    "3 labels but there are 4 images"),
    "image rank": (dict(x_train=np.zeros((4, 25)), y_train=np.zeros(4, int),
                        x_test=np.zeros((2, 25)), y_test=np.zeros(2, int)), "expected images"),
    "image sizes": (dict(x_train=np.zeros((4, 5, 5)), y_train=np.zeros(4, int),
                         x_test=np.zeros((2, 6, 6)), y_test=np.zeros(2, int)), "x_test images"),
    "float labels": (dict(x_train=np.zeros((4, 5, 5)), y_train=np.array([0, 1.5, 1, 0]),
                          x_test=np.zeros((2, 5, 5)), y_test=np.zeros(2, int)),
                     "integer class indices"),
    "negative labels": (dict(x_train=np.zeros((4, 5, 5)), y_train=np.array([0, -1, 1, 0]),
                             x_test=np.zeros((2, 5, 5)), y_test=np.zeros(2, int)), "negative"),
    "nan images": (dict(x_train=np.full((4, 5, 5), np.nan), y_train=np.array([0, 1, 1, 0]),
                        x_test=np.zeros((2, 5, 5)), y_test=np.zeros(2, int)), "NaN"),
    "one class": (dict(x_train=np.zeros((4, 5, 5)), y_train=np.zeros(4, int),
                       x_test=np.zeros((2, 5, 5)), y_test=np.zeros(2, int)), "single class"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_data_files_give_clear_errors(tmp_path, capsys, case):
    arrays, message = BAD_FILES[case]
    p = tmp_path / "bad.npz"
    np.savez(p, **arrays)
    assert _run(["--data", str(p), "--epochs", "1", "--no-checkpoint"] + TINY) == 2
    err = capsys.readouterr().err
    assert err.startswith("utensil-train: error:") and message in err, err
    assert "Traceback" not in err


def test_unreadable_data_files(tmp_path, capsys):
    assert _run(["--data", str(tmp_path / "none.npz"), "--no-checkpoint"] + TINY) == 2
    assert "no such file" in capsys.readouterr().err
    p = tmp_path / "text.npz"
    p.write_text("hello")
    assert _run(["--data", str(p), "--no-checkpoint"] + TINY) == 2
    assert "not a readable .npz" in capsys.readouterr().err
    p = tmp_path / "single.npy"
    np.save(p, np.zeros(3))
    assert _run(["--data", str(p), "--no-checkpoint"] + TINY) == 2
    assert "not an .npz archive" in capsys.readouterr().err
    p = tmp_path / "objects.npz"
    np.savez(p, x_train=np.array([None, 1], dtype=object), y_train=np.zeros(2, int),
             x_test=np.zeros((2, 3, 3)), y_test=np.zeros(2, int))
    assert _run(["--data", str(p), "--no-checkpoint"] + TINY) == 2
    assert "pickle" in capsys.readouterr().err


def test_batches_depend_only_on_seed_and_epoch():
    a = ud.batches(50, 16, seed=4, epoch=2)
    b = ud.batches(50, 16, seed=4, epoch=2)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not np.array_equal(np.concatenate(a), np.concatenate(ud.batches(50, 16, 4, 3)))
    assert sorted(np.concatenate(a).tolist()) == list(range(50))
    assert [len(x) for x in ud.batches(33, 16, 0, 0)] == [16, 16]  # a last batch of 1 is dropped
    assert [len(x) for x in ud.batches(34, 16, 0, 0)] == [16, 16, 2]


# -- the command line and optional packages -------------------------------------------------------


@pytest.mark.parametrize("argv", [["--epochs", "0"], ["--lr", "-1"], ["--device", "tpu"],
                                  ["--batch-size", "x"], ["--seed", "-3"], ["--bogus"],
                                  ["--momentum", "1.5"], ["--optimizer", "rmsprop"],
                                  ["--threads", "0"], ["--threads", "many"], ["--lr", "nan"],
                                  ["--seed", str(2**63)], ["--width", "1.5"]])
def test_bad_flags_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as e:
        tr.main(argv)
    assert e.value.code == 2
    assert "usage: utensil-train" in capsys.readouterr().err


def test_help_mentions_the_flags(capsys):
    with pytest.raises(SystemExit) as e:
        tr.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--device", "--epochs", "--batch-size", "--lr", "--seed", "--width", "--data",
                 "--resume", "--checkpoint", "--plot"):
        assert flag in out


@pytest.mark.skipif(ut.cuda_available(), reason="a GPU is present")
def test_cuda_without_gpu_is_a_clear_error(npz, capsys):
    assert _run(["--data", npz, "--device", "cuda", "--no-checkpoint"] + TINY) == 2
    err = capsys.readouterr().err
    assert "no CUDA GPU is available" in err and "--device cpu" in err
    assert "Traceback" not in err


def test_plot(npz, tmp_path, device):
    pytest.importorskip("matplotlib")
    png = tmp_path / "curves.png"
    assert _run(["--data", npz, "--epochs", "2", "--no-checkpoint", "--plot", str(png)] + TINY,
                device) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib(npz, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert _run(["--data", npz, "--epochs", "1", "--no-checkpoint", "--plot",
                 str(tmp_path / "c.png")] + TINY) == 2
    err = capsys.readouterr().err
    assert "--plot needs matplotlib" in err and "utensil-ffi[examples]" in err


def test_digits_without_sklearn(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "sklearn", None)
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    assert tr.main(["--epochs", "1", "--no-checkpoint", "--no-progress", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "scikit-learn" in err and "utensil-ffi[examples]" in err and "--data" in err


def test_progress_bar(npz, capsys):
    pytest.importorskip("tqdm")
    argv = ["--data", npz, "--epochs", "1", "--no-checkpoint", "--width", "2", "--batch-size", "8"]
    assert tr.main(argv + ["--device", "cpu"]) == 0
    assert "epoch   1/1" in capsys.readouterr().out


def test_progress_bar_without_tqdm(npz, monkeypatch, capsys):
    """tqdm comes with the examples extra: without it the bar is an error naming the fix."""
    monkeypatch.setitem(sys.modules, "tqdm", None)
    argv = ["--data", npz, "--epochs", "1", "--no-checkpoint", "--width", "2", "--device", "cpu"]
    assert tr.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("utensil-train: error:") and "tqdm" in err
    assert "utensil-ffi[examples]" in err and "--no-progress" in err
    assert tr.main(argv + ["--no-progress"]) == 0


def test_quiet(npz, capsys):
    assert tr.main(["--data", npz, "--epochs", "1", "--no-checkpoint", "-q", "--width", "2",
                    "--device", "cpu"]) == 0
    cap = capsys.readouterr()
    assert cap.out.startswith("final test accuracy") and cap.out.count("\n") == 1
    assert cap.err == ""


def test_python_dash_m_entry_point(npz, tmp_path):
    import subprocess

    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-m", "utensil_ffi.train", "--data", npz, "--epochs", "1",
                        "--no-checkpoint", "--device", "cpu"] + TINY,
                       capture_output=True, text=True, cwd=str(tmp_path), env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "final test accuracy" in r.stdout
    r = subprocess.run([sys.executable, "-m", "utensil_ffi.train", "--device", "cuda", "--data",
                        npz] if not ut.cuda_available() else [sys.executable, "-c", "pass"],
                       capture_output=True, text=True, cwd=str(tmp_path), env=env, timeout=120)
    if not ut.cuda_available():
        assert r.returncode == 2 and "Traceback" not in r.stderr


def test_thread_count_does_not_change_results(npz, tmp_path):
    n = ut.get_num_threads()
    a, b = tmp_path / "a.npz", tmp_path / "b.npz"
    try:
        assert tr.main(["--data", npz, "--epochs", "2", "--threads", "1", "--device", "cpu",
                        "--checkpoint", str(a)] + TINY) == 0
        assert tr.main(["--data", npz, "--epochs", "2", "--threads", "3", "--device", "cpu",
                        "--checkpoint", str(b)] + TINY) == 0
    finally:
        ut.set_num_threads(n)
    _assert_same_state(a, b, "cpu")
    assert _losses(a) == _losses(b)


def test_threads_auto_says_what_it_chose(npz, capsys, monkeypatch):
    n = ut.get_num_threads()
    argv = ["--data", npz, "--epochs", "1", "--threads", "auto", "--no-checkpoint",
            "--device", "cpu"] + TINY
    monkeypatch.setattr(os, "getloadavg", lambda: (99.0, 99.0, 99.0))
    assert tr.main(argv) == 0
    assert "(1 CPU thread: --threads auto, the machine is busy, load 99.0" in capsys.readouterr().out
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    assert tr.main(argv) == 0
    assert "(%d CPU thread" % n in capsys.readouterr().out
    assert ut.get_num_threads() == n


def test_main_leaves_the_thread_count_alone(npz):
    n = ut.get_num_threads()
    assert tr.main(["--data", npz, "--epochs", "1", "--threads", "1", "--no-checkpoint",
                    "--device", "cpu"] + TINY) == 0
    assert ut.get_num_threads() == n


@pytest.mark.parametrize("value, ok", [(0.0, True), (0.1, True), (-1e-3, False),
                                       (float("nan"), False), (float("inf"), False),
                                       (1e39, False)])
def test_one_rule_for_the_learning_rate(value, ok, capsys):
    """lr was checked five times under two rules ("positive" in the CLI, ">= 0" in the
    optimizers and C). Now one rule, finite float32 >= 0: --lr, a checkpoint's setting, the
    optimizers, a param group and the C call agree on every value."""
    import utensil_ffi as ut
    from utensil_ffi._lib import lib

    verdicts = []
    try:
        tr.build_parser().parse_args(["--lr", repr(value)])
        verdicts.append(True)
    except SystemExit:
        verdicts.append(False)
    try:
        tr._saved_setting("lr", value)
        verdicts.append(True)
    except tr.CheckpointError:
        verdicts.append(False)
    w = ut.Parameter(np.ones(3, np.float32))
    try:
        ut.SGD([w], lr=value)
        verdicts.append(True)
    except ut.ArgumentError:
        verdicts.append(False)
    opt = ut.SGD([w], lr=0.1)
    try:
        sd = opt.state_dict()
        sd["param_groups"][0]["lr"] = value
        opt.load_state_dict(sd)
        verdicts.append(True)
    except ut.ArgumentError:
        verdicts.append(False)
    with ut.zeros((3,)) as g:
        verdicts.append(lib.ut_sgd_step(w.ptr, g.ptr, ut._lib.ffi.NULL, value, 0.0) == 0)
    opt.close()
    w.close()
    capsys.readouterr()
    assert verdicts == [ok] * 5
