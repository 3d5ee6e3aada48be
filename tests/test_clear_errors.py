"""Clear errors instead of tracebacks, and the PyTorch None-grad idiom (issue 11, item 8).

- ``p.grad = None`` / ``zero_grad(set_to_none=True)``: backward starts a fresh zero grad,
  zero_grad skips it, an optimizer's step skips the parameter (checked against torch.optim).
- Hyperparameters are validated as the float32 values C uses, when the optimizer is made.
- utensil-train: --checkpoint/--plot checked before training, corrupt checkpoints named with
  what is wrong, ambiguous 4-D --data layouts refused until --layout says which.
"""

import json
import os

import numpy as np
import pytest

import utensil_ffi as ut
from utensil_ffi import data as ud
from utensil_ffi import train as tr

TINY = ["--width", "2", "--batch-size", "16", "--no-progress", "--device", "cpu"]


def _np(t):
    return np.array(t.numpy(), copy=True)


# -- None grads ---------------------------------------------------------------------------------
def test_backward_into_a_none_grad_starts_from_zero(rng):
    x = rng.normal(size=(5, 3)).astype(np.float32)
    g = rng.normal(size=(5, 2)).astype(np.float32)
    lin = ut.Linear(3, 2)
    try:
        lin.weight.grad = None
        lin.bias.grad = None
        for k in (1, 2):  # a fresh zero grad, then accumulation into it
            with lin(x) as y:
                lin.backward(g).close()
            np.testing.assert_allclose(_np(lin.weight.grad), k * g.T @ x, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(_np(lin.bias.grad), k * g.sum(0), rtol=1e-5, atol=1e-6)
            assert lin.weight.grad.device == "cpu" and lin.weight.grad.shape == (2, 3)
    finally:
        lin.close()


def test_zero_grad_with_none_grads():
    net = ut.Sequential(ut.Linear(2, 2), ut.ReLU(), ut.BatchNorm2d(2) if False else ut.Linear(2, 1))
    opt = ut.SGD(net.parameters(), lr=0.1)
    try:
        ps = net.parameters()
        for p in ps:
            p.grad.fill_(1.0)
        kept = ps[0].grad
        net.zero_grad(set_to_none=True)
        assert all(p.grad is None for p in ps)
        assert np.all(_np(kept) == 1.0)  # the dropped grad stays usable, as in PyTorch
        kept.close()
        net.zero_grad()
        opt.zero_grad()  # None stays None, no AttributeError
        assert all(p.grad is None for p in ps)
        before = [_np(p) for p in ps]
        opt.step()  # nothing to do
        assert all(np.array_equal(_np(p), b) for p, b in zip(ps, before))
        net.to("cpu")
        ps[1].grad = ut.ones(ps[1].shape)
        opt.zero_grad(set_to_none=True)
        assert ps[1].grad is None
        with pytest.raises(ut.ArgumentTypeError):
            opt.zero_grad(set_to_none="yes")
    finally:
        opt.close()
        net.close()


@pytest.mark.parametrize("kind", ["sgd", "sgd-momentum", "adam"])
def test_step_skips_none_grads_like_torch(kind, rng):
    torch = pytest.importorskip("torch")
    w0 = [rng.normal(size=(3, 2)).astype(np.float32), rng.normal(size=(3,)).astype(np.float32)]
    # step 1: only the first parameter has a gradient; then both; then only the second
    grads = [[rng.normal(size=w.shape).astype(np.float32) if on else None for w, on in
              zip(w0, mask)] for mask in ((1, 0), (1, 1), (0, 1), (1, 1))]
    lin = ut.Linear(2, 3)
    ps = [lin.weight, lin.bias]
    for p, w in zip(ps, w0):
        p.copy_from(w)
    tp = [torch.nn.Parameter(torch.tensor(w)) for w in w0]
    if kind == "adam":
        opt, topt = ut.Adam(ps, lr=0.1, betas=(0.8, 0.9)), torch.optim.Adam(tp, lr=0.1, betas=(0.8, 0.9))
    else:
        m = 0.9 if kind == "sgd-momentum" else 0.0
        opt, topt = ut.SGD(ps, lr=0.1, momentum=m), torch.optim.SGD(tp, lr=0.1, momentum=m)
    try:
        for step in grads:
            for p, q, g in zip(ps, tp, step):
                p.grad = None if g is None else ut.tensor(g)
                q.grad = None if g is None else torch.tensor(g)
            opt.step()
            topt.step()
            for p, q in zip(ps, tp):
                np.testing.assert_allclose(_np(p), q.detach().numpy(), rtol=1e-5, atol=1e-6)
        if kind == "adam":
            steps = [int(e["step"]) for e in opt.state_dict()["state"].values()]
            assert steps == [3, 3] and opt.t == 4
            assert steps == [int(e["step"]) for e in topt.state_dict()["state"].values()]
    finally:
        opt.close()
        lin.close()


def test_adam_param_steps_round_trip():
    lin = ut.Linear(2, 2)
    opt = ut.Adam(lin.parameters())
    try:
        lin.bias.grad = None
        opt.step()
        sd = opt.state_dict()
        # each parameter's own count is its "step"; the bias has no state yet, as in PyTorch
        assert sorted(sd["state"]) == [0] and sd["state"][0]["step"] == 1
        opt2 = ut.Adam(lin.parameters())
        opt2.load_state_dict(sd)
        assert opt2._steps == [1, 0] and opt2.t == 1
        groups = sd["param_groups"]
        with pytest.raises(ut.ArgumentError, match="whole number"):
            opt2.load_state_dict({"state": {0: dict(sd["state"][0], step=np.float32(1.5))},
                                  "param_groups": groups})
        no_step = {k: v for k, v in sd["state"][0].items() if k != "step"}
        with pytest.raises(ut.ArgumentError, match="'step'"):
            opt2.load_state_dict({"state": {0: no_step}, "param_groups": groups})
        assert opt2._steps == [1, 0]
        opt2.close()
    finally:
        opt.close()
        lin.close()


# -- float32 validation -------------------------------------------------------------------------
def _params():
    return ut.Linear(2, 2).parameters()


@pytest.mark.parametrize("make, what", [
    (lambda: ut.Adam(_params(), betas=(0.99999999, 0.999)), "beta1.*rounds to 1.0 in float32"),
    (lambda: ut.Adam(_params(), betas=(0.9, 0.999999999)), "beta2.*rounds to 1.0 in float32"),
    (lambda: ut.Adam(_params(), betas=(1.0, 0.9)), "beta1 must be < 1"),
    (lambda: ut.Adam(_params(), lr=1e39), "lr.*overflows float32"),
    (lambda: ut.Adam(_params(), eps=1e39), "eps.*overflows float32"),
    (lambda: ut.Adam(_params(), lr=float("inf")), "lr must be a finite number"),
    (lambda: ut.SGD(_params(), lr=0.1, momentum=1e39), "momentum.*overflows float32"),
    (lambda: ut.SGD(_params(), lr=-1.0), "lr must be >= 0"),
    (lambda: ut.adam_step(ut.ones(2), ut.ones(2), ut.zeros(2), ut.zeros(2), 1, beta1=0.99999999),
     "beta1.*rounds to 1.0"),
    (lambda: ut.sgd_step(ut.ones(2), ut.ones(2), lr=1e39), "lr.*overflows"),
])
def test_hyperparameters_are_checked_as_float32(make, what):
    with pytest.raises(ut.ArgumentError, match=what):
        make()


def test_the_largest_float32_beta_below_one_works():
    b = float(np.nextafter(np.float32(1), np.float32(0)))  # 0.99999994
    lin = ut.Linear(2, 2)
    opt = ut.Adam(lin.parameters(), betas=(b, b), lr=3e38)
    try:
        for p in lin.parameters():
            p.grad.fill_(1.0)
        opt.step()  # accepted at construction means accepted at step()
    finally:
        opt.close()
        lin.close()


# -- utensil-train: output paths, up front ------------------------------------------------------
def _toy(folder):
    rng = np.random.default_rng(0)
    y = rng.integers(0, 3, 40)
    x = rng.normal(0, 0.3, (40, 6, 6))
    x[np.arange(40), 1 + 2 * y, :] += 2.0
    path = folder / "toy.npz"
    np.savez(path, x_train=x[:30], y_train=y[:30], x_test=x[30:], y_test=y[30:])
    return str(path)


@pytest.fixture
def npz(tmp_path):
    return _toy(tmp_path)


@pytest.fixture
def no_training(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("training started before the bad path was reported")

    monkeypatch.setattr(tr, "train_epoch", refuse)


def _usage_error(argv, capsys):
    with pytest.raises(SystemExit) as e:
        tr.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "usage: utensil-train" in err and "Traceback" not in err
    return err


def test_plot_paths_are_checked_before_training(npz, tmp_path, capsys, no_training):
    base = ["--data", npz, "--epochs", "1", "--no-checkpoint"] + TINY
    folder = tmp_path / "somedir"
    folder.mkdir()
    err = _usage_error(base + ["--plot", str(folder)], capsys)
    assert "ending in .png" in err
    assert not (tmp_path / "somedir.png").exists()
    (tmp_path / "dir.png").mkdir()
    err = _usage_error(base + ["--plot", str(tmp_path / "dir.png")], capsys)
    assert "is a directory" in err
    err = _usage_error(base + ["--plot", str(tmp_path / "missing" / "c.png")], capsys)
    assert "does not exist" in err
    err = _usage_error(base + ["--plot", str(tmp_path / "curves.pdf")], capsys)
    assert ".png" in err


def test_checkpoint_paths_are_checked_before_training(npz, tmp_path, capsys, no_training,
                                                      monkeypatch):
    base = ["--data", npz, "--epochs", "1"] + TINY
    err = _usage_error(base + ["--checkpoint", str(tmp_path)], capsys)
    assert "--checkpoint" in err and "is a directory" in err
    afile = tmp_path / "plain"
    afile.write_text("x")
    err = _usage_error(base + ["--checkpoint", str(afile / "ck.npz")], capsys)
    assert "is not a directory" in err
    # the default ./utensil_checkpoint.npz, in a folder that is a directory by that name
    monkeypatch.chdir(tmp_path)
    (tmp_path / tr.DEFAULT_CHECKPOINT).mkdir()
    err = _usage_error(base, capsys)
    assert tr.DEFAULT_CHECKPOINT in err and "--no-checkpoint" in err


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0,
                    reason="root may write anywhere")
def test_unwritable_checkpoint_folder(npz, tmp_path, capsys, no_training):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        err = _usage_error(["--data", npz, "--checkpoint", str(ro / "ck.npz")] + TINY, capsys)
        assert "not writable" in err
    finally:
        ro.chmod(0o700)


def test_missing_checkpoint_folders_are_created(npz, tmp_path):
    ck = tmp_path / "a" / "b" / "ck.npz"
    assert tr.main(["--data", npz, "--epochs", "1", "--checkpoint", str(ck)] + TINY) == 0
    assert ck.is_file()


# -- utensil-train: corrupt checkpoints ---------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """One tiny real checkpoint (and its data) that each case corrupts a copy of."""
    folder = tmp_path_factory.mktemp("ck")
    data = _toy(folder)
    ck = folder / "ck.npz"
    assert tr.main(["--data", data, "--epochs", "1", "--checkpoint", str(ck), "-q"] + TINY) == 0
    return ck


def _rewrite(path, out, meta_edit=None, drop=()):
    with np.load(path) as f:
        arrays = {k: f[k] for k in f.files if not any(k.startswith(d) for d in drop)}
    meta = json.loads(str(arrays["meta"]))
    if meta_edit:
        meta_edit(meta)
    arrays["meta"] = np.array(json.dumps(meta))
    np.savez(out, **arrays)
    return str(out)


CORRUPT = {
    "no epoch": (lambda m: m.pop("epoch"), (), "'epoch'"),
    "epoch text": (lambda m: m.update(epoch="one"), (), "'epoch'"),
    "no run": (lambda m: m.pop("run"), (), "'run'"),
    "history not a list": (lambda m: m.update(history={"a": 1}), (), "'history'"),
    "history entry": (lambda m: m["history"][0].pop("test_acc"), (), "history entry 0"),
    "run setting missing": (lambda m: m["run"].pop("width"), (), "setting 'width'"),
    "run setting type": (lambda m: m["run"].update(width="wide"), (), "setting 'width'"),
    "run optimizer": (lambda m: m["run"].update(optimizer="rmsprop"), (), "'optimizer'"),
    "data_info": (lambda m: m.update(data_info=[1]), (), "'data_info'"),
    "no weights": (None, ("model/",), "no model weights"),
    "missing weight": (None, ("model/0.",), "do not fit"),
    "no optimizer state": (None, ("optim/0",), "optimizer state"),
}


@pytest.mark.parametrize("case", sorted(CORRUPT))
def test_corrupt_checkpoints_name_the_file_and_the_problem(case, checkpoint, tmp_path, capsys,
                                                           no_training):
    edit, drop, what = CORRUPT[case]
    bad = _rewrite(checkpoint, tmp_path / "bad.npz", edit, drop)
    assert tr.main(["--resume", bad, "--epochs", "2", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("utensil-train: error: %s:" % bad), err
    assert what in err, err
    assert "Traceback" not in err and "KeyError" not in err


# -- utensil-train: data layouts ----------------------------------------------------------------
def _layout_file(tmp_path, shape):
    rng = np.random.default_rng(1)
    p = tmp_path / "imgs.npz"
    np.savez(p, x_train=rng.random((20,) + shape), y_train=rng.integers(0, 2, 20),
             x_test=rng.random((6,) + shape), y_test=rng.integers(0, 2, 6))
    return str(p)


def test_ambiguous_4d_layout_is_refused_until_named(tmp_path, capsys, no_training):
    p = _layout_file(tmp_path, (5, 8, 3))
    assert tr.main(["--data", p, "--epochs", "1", "--no-checkpoint"] + TINY) == 2
    err = capsys.readouterr().err
    assert "ambiguous" in err and "--layout nchw" in err and "(20, 5, 8, 3)" in err
    with pytest.raises(ud.DataError, match="ambiguous"):
        ud.load_npz(p)
    assert ud.load_npz(p, layout="nchw").image_shape == (5, 8, 3)
    ds = ud.load_npz(p, layout="nhwc")
    assert ds.image_shape == (3, 5, 8)
    raw = np.load(p)["x_train"]
    # nhwc: channel c of image n is raw[n, :, :, c] (normalized per channel)
    want = (raw[..., 1] - raw[..., 1].mean()) / raw[..., 1].std()
    np.testing.assert_allclose(ds.x_train[:, 1], want, rtol=1e-4, atol=1e-5)
    with pytest.raises(ud.DataError, match="layout"):
        ud.load_npz(p, layout="nwhc")


@pytest.mark.parametrize("layout, channels", [("nchw", 5), ("nhwc", 3)])
def test_layout_flag_trains_on_the_named_layout(tmp_path, layout, channels):
    p = _layout_file(tmp_path, (5, 8, 3))
    ck = tmp_path / "ck.npz"
    assert tr.main(["--data", p, "--epochs", "1", "--layout", layout, "--checkpoint", str(ck),
                    "-q"] + TINY) == 0
    meta, model, _ = tr.load_checkpoint(ck)
    assert meta["data_info"]["image_shape"][0] == channels
    assert model["0.weight"].shape[1] == channels


def test_unambiguous_layouts_need_no_flag(tmp_path):
    assert ud.load_npz(_layout_file(tmp_path, (2, 6, 6))).image_shape == (2, 6, 6)  # NCHW
    assert ud.load_npz(_layout_file(tmp_path, (6, 7))).image_shape == (1, 6, 7)  # NHW


def test_data_and_checkpoint_errors_are_utensil_errors():
    """The README says every error utensil raises is a ut.UtensilError (and still a ValueError)."""
    import utensil_ffi as ut
    from utensil_ffi.data import DataError
    from utensil_ffi.train import CheckpointError, load_checkpoint

    for cls in (DataError, CheckpointError):
        assert issubclass(cls, ut.UtensilError) and issubclass(cls, ValueError)
    with pytest.raises(ut.UtensilError, match="no such checkpoint"):
        load_checkpoint("/nonexistent/ck.npz")


def test_predict_names_a_foreign_file_as_not_a_checkpoint(tmp_path, capsys):
    """utensil-predict model.onnx answered with numpy's advice to unpickle unsafely."""
    from utensil_ffi.cli import predict

    f = tmp_path / "model.onnx"
    f.write_bytes(b"\x08\x07\x12\x04onnx not an npz")
    assert predict.main([str(f), str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert "not an .npz of arrays written by utensil-train" in err and "allow_pickle" not in err
