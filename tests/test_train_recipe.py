"""utensil-train's recipe flags end to end: --optimizer adamw, --weight-decay, --nesterov,
--label-smoothing, --warmup-epochs and --ema, each against PyTorch (its optimizers, schedulers
and cross_entropy) or a hand computation, restored by --resume, refused with a usage error when
the values make no sense. The network is the tiny digits CNN on a small .npz: seconds in all."""

import shutil

import numpy as np
import pytest

import utensil_ffi as ut
from utensil_ffi import train as tr
from utensil_ffi.cli import export as ex
from utensil_ffi.cli import train_data as tdata
from utensil_ffi.functional import cross_entropy_backward
from utensil_ffi.nn.module import _backward_params_only

BASE = ["--width", "2", "--batch-size", "16", "--no-progress", "--device", "cpu"]


@pytest.fixture
def npz(tmp_path):
    """32 training images (two batches of 16) and 12 test images, 3 classes, 1x6x6."""
    rng = np.random.default_rng(1)
    y = rng.integers(0, 3, 44)
    x = rng.normal(0, 0.3, (44, 6, 6)).astype(np.float32)
    x[np.arange(44), 1 + 2 * y, :] += 2.0
    path = tmp_path / "toy.npz"
    np.savez(path, x_train=x[:32], y_train=y[:32], x_test=x[32:], y_test=y[32:])
    return str(path)


def _status(argv):
    """main's exit status, argparse's SystemExit included."""
    try:
        return tr.main(argv)
    except SystemExit as e:
        return e.code


# -- optimizers and the loss, against PyTorch ----------------------------------------------------

RECIPES = {
    "adamw": (["--optimizer", "adamw", "--lr", "0.01", "--weight-decay", "0.1"],
              lambda torch, ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1)),
    "adamw-default-decay": (["--optimizer", "adamw", "--lr", "0.01"],
                            lambda torch, ps: torch.optim.AdamW(ps, lr=0.01)),
    "adam-l2": (["--optimizer", "adam", "--lr", "0.01", "--weight-decay", "0.1"],
                lambda torch, ps: torch.optim.Adam(ps, lr=0.01, weight_decay=0.1)),
    "sgd-nesterov": (["--optimizer", "sgd", "--lr", "0.1", "--momentum", "0.8", "--nesterov",
                      "--weight-decay", "0.05"],
                     lambda torch, ps: torch.optim.SGD(ps, lr=0.1, momentum=0.8, nesterov=True,
                                                       weight_decay=0.05)),
}


@pytest.mark.parametrize("smoothing", [0.0, 0.2])
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_one_epoch_matches_torch_optimizer_and_loss(npz, tmp_path, name, smoothing):
    torch = pytest.importorskip("torch")
    flags, make_opt = RECIPES[name]
    ck = str(tmp_path / "ck.npz")
    assert tr.main(["--data", npz, "--epochs", "1", "--lr-schedule", "constant", "-q",
                    "--checkpoint", ck, "--label-smoothing", str(smoothing)] + flags + BASE) == 0
    meta, got, _ = tr.load_checkpoint(ck)
    assert meta["run"]["label_smoothing"] == smoothing

    # the same epoch: utensil's gradients, PyTorch's optimizer and loss
    run = meta["run"]
    ds = tdata.open_data(npz)
    ut.seed(run["seed"])
    net = tr.build_network(run, ds.image_shape, ds.num_classes, "cpu")
    params = net.parameters()
    tps = [torch.tensor(p.numpy().astype(np.float64), requires_grad=True) for p in params]
    opt = make_opt(torch, tps)
    losses, seen = [], 0
    for _, xs, ys in ds.train_batches(16, run["seed"], 0):
        net.zero_grad()
        with ut.tensor(xs) as xb, ut.tensor(ys.astype(np.float32)) as yb:
            logits = net(xb)
            z = torch.tensor(logits.numpy().astype(np.float64))
            losses.append(float(torch.nn.functional.cross_entropy(
                z, torch.tensor(ys), label_smoothing=smoothing)) * len(ys))
            seen += len(ys)
            g = cross_entropy_backward(logits, yb, smoothing)
            _backward_params_only(net, g)
            for p, t in zip(params, tps):
                t.grad = torch.tensor(p.grad.numpy().astype(np.float64))
            opt.step()
            for p, t in zip(params, tps):
                p.copy_from(t.detach().numpy().astype(np.float32))
            for x in (logits, g):
                x.close()
    want = net.state_dict()
    for k, v in want.items():
        np.testing.assert_allclose(got[k], v, rtol=2e-4, atol=2e-5, err_msg=k)
    assert meta["history"][0]["train_loss"] == pytest.approx(sum(losses) / seen, rel=1e-5)
    # the test loss is the same criterion, on the trained weights in eval mode
    net.load_state_dict(got)
    net.eval()
    with ut.tensor(ds.ds.x_test) as xb:
        z = net(xb)
        test = float(torch.nn.functional.cross_entropy(
            torch.tensor(z.numpy().astype(np.float64)), torch.tensor(ds.ds.y_test),
            label_smoothing=smoothing))
        z.close()
    assert meta["history"][0]["test_loss"] == pytest.approx(test, rel=1e-5)
    net.close()
    ds.close()


def test_the_flags_reach_the_optimizer_and_the_description(npz, tmp_path, capsys):
    ck = str(tmp_path / "ck.npz")
    assert tr.main(["--data", npz, "--epochs", "1", "--checkpoint", ck, "--optimizer", "sgd",
                    "--nesterov", "--weight-decay", "0.05", "--label-smoothing", "0.1",
                    "--warmup-epochs", "0", "--ema", "0.9"] + BASE) == 0
    out = capsys.readouterr().out
    assert "Nesterov momentum 0.9" in out and "weight decay 0.05" in out
    assert "label smoothing 0.1" in out and "EMA of the weights, decay 0.9" in out
    meta, _, _ = tr.load_checkpoint(ck)
    group = meta["optimizer_param_groups"][0]
    assert group["nesterov"] is True and group["weight_decay"] == pytest.approx(0.05)


# -- the learning rate schedule, against PyTorch's -----------------------------------------------

def _torch_rates(torch, lr, schedule, warmup, epochs):
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=lr)
    scheds = []
    if warmup:
        scheds.append(torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.01,
                                                        total_iters=warmup))
    if schedule == "cosine":
        scheds.append(torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs - warmup))
    sched = torch.optim.lr_scheduler.SequentialLR(opt, scheds, [warmup]) \
        if len(scheds) == 2 else (scheds[0] if scheds else None)
    rates = []
    for _ in range(epochs):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        if sched is not None:
            sched.step()
    return rates


@pytest.mark.parametrize("schedule,warmup,epochs", [("cosine", 0, 7), ("cosine", 3, 10),
                                                    ("constant", 2, 5), ("constant", 0, 3),
                                                    ("cosine", 1, 2)])
def test_rates_are_pytorchs(schedule, warmup, epochs):
    torch = pytest.importorskip("torch")
    run = {"lr": 0.05, "lr_schedule": schedule, "warmup_epochs": warmup}
    got = [tr._lr_at(run, e, epochs) for e in range(epochs)]
    np.testing.assert_allclose(got, _torch_rates(torch, 0.05, schedule, warmup, epochs),
                               rtol=1e-12, atol=0)


def test_warmup_without_torch_by_hand():
    run = {"lr": 1.0, "lr_schedule": "cosine", "warmup_epochs": 2}
    got = [tr._lr_at(run, e, 6) for e in range(6)]
    # 0.01 -> 1 over 2 epochs, then cosine over the other 4, from 1
    want = [0.01, 0.505] + [0.5 * (1 + np.cos(np.pi * e / 4)) for e in range(4)]
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)


def test_warmup_resumes_as_an_uninterrupted_run(npz, tmp_path):
    a, b = str(tmp_path / "a.npz"), str(tmp_path / "b.npz")
    # constant: the rates do not depend on --epochs, so a run may stop inside its warm-up
    flags = ["--data", npz, "--warmup-epochs", "2", "--lr", "0.02", "-q", "--lr-schedule",
             "constant"] + BASE
    assert tr.main(flags + ["--epochs", "4", "--checkpoint", a]) == 0
    assert tr.main(flags + ["--epochs", "1", "--checkpoint", b]) == 0
    assert tr.main(["--resume", b, "--epochs", "4", "-q", "--no-progress",
                    "--device", "cpu"]) == 0
    ma, wa, _ = tr.load_checkpoint(a)
    mb, wb, _ = tr.load_checkpoint(b)
    assert [h["lr"] for h in ma["history"]] == [h["lr"] for h in mb["history"]]
    assert ma["history"][0]["lr"] == pytest.approx(0.0002)
    assert mb["run"]["warmup_epochs"] == 2
    for k in wa:  # bitwise: the resume trains on the CPU too (--device is no saved setting)
        np.testing.assert_array_equal(wa[k], wb[k], err_msg=k)


# -- EMA --------------------------------------------------------------------------------------

def test_ema_by_hand_resumed_and_exported(npz, tmp_path, capsys):
    # one batch per epoch: after epoch 1 the EMA is a copy of the weights (its first update),
    # after epoch 2 it moved (1 - decay) of the way to them; the second epoch is a resume
    ck1, ck2 = str(tmp_path / "e1.npz"), str(tmp_path / "e2.npz")
    assert tr.main(["--data", npz, "--epochs", "1", "--checkpoint", ck1, "--ema", "0.75",
                    "--batch-size", "32", "--optimizer", "sgd", "--lr", "0.5"] + BASE[:2]
                   + ["--no-progress", "--device", "cpu"]) == 0
    assert "(EMA)" in capsys.readouterr().out
    shutil.copy(ck1, ck2)
    assert tr.main(["--resume", ck2, "--epochs", "2", "-q", "--no-progress",
                    "--device", "cpu"]) == 0
    _, w1, _, e1 = tr.load_checkpoint(ck1, with_ema=True)
    meta, w2, _, e2 = tr.load_checkpoint(ck2, with_ema=True)
    assert int(e1["n_averaged"]) == 1 and int(e2["n_averaged"]) == 2
    floats = [k for k in w1 if not k.endswith("num_batches_tracked")]
    for k in floats:  # parameters and BatchNorm's running statistics (use_buffers=True)
        np.testing.assert_array_equal(e1["module." + k], w1[k], err_msg=k)
        a, b = w1[k].astype(np.float64), w2[k].astype(np.float64)
        np.testing.assert_allclose(e2["module." + k], a + 0.25 * (b - a), rtol=1e-5, atol=1e-6,
                                   err_msg=k)
    assert any(not np.array_equal(w1[k], w2[k]) for k in floats)

    # utensil-export (and utensil-predict, through load_network) take the EMA's weights, and
    # the history's test loss is theirs
    net, m = ex.load_network(ck2)
    assert m["weights"] == "ema"
    for k in floats:
        np.testing.assert_array_equal(net.state_dict()[k], e2["module." + k], err_msg=k)
    ds = tdata.open_data(npz)
    r = tr.evaluate_full(net, ds, None, 100, "cpu")
    assert r["loss"] == pytest.approx(meta["history"][-1]["test_loss"], rel=1e-6)
    net.close()
    ds.close()


def test_an_ema_run_whose_checkpoint_lost_it_is_refused(npz, tmp_path, capsys):
    ck = str(tmp_path / "ck.npz")
    assert tr.main(["--data", npz, "--epochs", "1", "--checkpoint", ck, "--ema", "-q"]
                   + BASE) == 0
    meta, model, optim = tr.load_checkpoint(ck)
    assert meta["run"]["ema"] == tr.EMA_DEFAULT_DECAY
    net = tr.build_network(meta["run"], (1, 6, 6), 3, "cpu")
    opt = ut.Adam(net.parameters())
    net.load_state_dict(model)
    opt.load_state_dict(optim)
    tr.save_checkpoint(ck, net, opt, meta)  # no ema=
    net.close()
    opt.close()
    assert tr.main(["--resume", ck, "--epochs", "2", "-q", "--no-progress",
                    "--device", "cpu"]) == 2
    assert "holds none" in capsys.readouterr().err


# -- --resume keeps the settings; old checkpoints get the old behaviour ----------------------

NEW = ["--optimizer", "adamw", "--weight-decay", "0.02", "--label-smoothing", "0.1",
       "--warmup-epochs", "1", "--ema", "0.5"]


def test_resume_restores_every_new_setting(npz, tmp_path, capsys):
    ck = str(tmp_path / "ck.npz")
    assert tr.main(["--data", npz, "--epochs", "2", "--checkpoint", ck] + NEW + BASE) == 0
    capsys.readouterr()
    assert tr.main(["--resume", ck, "--epochs", "3", "--no-progress", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "adamw" in out and "1 warm-up epoch" in out and "weight decay 0.02" in out
    assert "label smoothing 0.1" in out and "decay 0.5" in out
    meta, _, _ = tr.load_checkpoint(ck)
    want = {"optimizer": "adamw", "weight_decay": 0.02, "label_smoothing": 0.1,
            "warmup_epochs": 1, "ema": 0.5, "nesterov": False, "init_from": None}
    assert {k: meta["run"][k] for k in want} == want
    assert [h["lr"] for h in meta["history"]] == [tr._lr_at(meta["run"], e, 3) for e in range(3)]
    for flag, value in (("--label-smoothing", "0.2"), ("--weight-decay", "0.0"),
                        ("--warmup-epochs", "0"), ("--ema", "0.9")):
        assert tr.main(["--resume", ck, "--epochs", "4", "--no-progress", flag, value]) == 2
        assert "%s %s differs from the checkpoint's" % (flag, value) in capsys.readouterr().err


def test_a_checkpoint_from_before_the_recipe_flags_resumes_with_their_old_values(npz, tmp_path):
    ck = str(tmp_path / "ck.npz")
    assert tr.main(["--data", npz, "--epochs", "1", "--checkpoint", ck, "-q"] + BASE) == 0
    meta, model, optim = tr.load_checkpoint(ck)
    for k in ("weight_decay", "nesterov", "label_smoothing", "warmup_epochs", "ema",
              "init_from", "arch_version"):
        del meta["run"][k]
    net = tr.build_network(meta["run"], (1, 6, 6), 3, "cpu")
    opt = ut.Adam(net.parameters())
    net.load_state_dict(model)
    opt.load_state_dict(optim)
    tr.save_checkpoint(ck, net, opt, meta)
    net.close()
    opt.close()
    assert tr.main(["--resume", ck, "--epochs", "2", "-q", "--no-progress",
                    "--device", "cpu"]) == 0
    run = tr.load_checkpoint(ck)[0]["run"]
    assert (run["weight_decay"], run["label_smoothing"], run["warmup_epochs"], run["ema"],
            run["arch_version"]) == (0.0, 0.0, 0, None, 1)


# -- usage errors ------------------------------------------------------------------------------

@pytest.mark.parametrize("argv,words", [
    (["--weight-decay", "-1"], "a number >= 0"),
    (["--weight-decay", "inf"], "a number >= 0"),
    (["--weight-decay", "1e40"], "overflows float32"),
    (["--label-smoothing", "1"], "in [0, 1)"),
    (["--label-smoothing", "-0.1"], "in [0, 1)"),
    (["--ema", "0"], "strictly between 0 and 1"),
    (["--ema", "1"], "strictly between 0 and 1"),
    (["--ema", "x"], "strictly between 0 and 1"),
    (["--warmup-epochs", "-1"], "an integer >= 0"),
    (["--warmup-epochs", "3", "--epochs", "3"], "leaves no epoch of the cosine schedule"),
    (["--optimizer", "adamw", "--nesterov"], "--nesterov is SGD's"),
    (["--optimizer", "sgd", "--momentum", "0", "--nesterov"], "needs a momentum above 0"),
    (["--optimizer", "adam", "--momentum", "0.5"], "--momentum is SGD's"),
    (["--optimizer", "lamb"], "invalid choice"),
])
def test_bad_values_are_usage_errors(npz, argv, words, capsys):
    argv = ["--data", npz, "--no-checkpoint", "--no-progress", "--device", "cpu"] + argv
    assert _status(argv) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err


def test_help_lists_the_recipe_flags(capsys):
    assert _status(["--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--optimizer {adam,adamw,sgd}", "--weight-decay", "--nesterov",
                 "--label-smoothing", "--warmup-epochs", "--ema [DECAY]", "--init-from"):
        assert flag in out


def test_every_recipe_flag_on_each_device(npz, tmp_path, device):
    # the GPU run of the same settings: the EMA's update (lerp) and the smoothed loss on it
    ck = str(tmp_path / "ck.npz")
    assert tr.main(["--data", npz, "--epochs", "2", "--checkpoint", ck, "-q", "--width", "2",
                    "--batch-size", "16", "--no-progress", "--device", device] + NEW) == 0
    meta, model, _, ema = tr.load_checkpoint(ck, with_ema=True)
    assert int(ema["n_averaged"]) == 4  # 2 epochs of 2 batches
    assert all(np.isfinite(h["test_loss"]) for h in meta["history"])
    assert meta["history"][-1]["device"] == device
