"""Parameter groups (PyTorch's param_groups) in SGD, Adam and AdamW, the schedulers over several
groups, and utensil-train's --norm-weight-decay / --bias-weight-decay.

The updates, state dicts and rates are compared with torch.optim driven by the same gradients;
the training flags with a hand-listed grouping and with runs that must be bitwise the same."""

import copy
import pickle
import warnings

import numpy as np
import pytest

import utensil_ffi as ut
from utensil_ffi import train as tr
from utensil_ffi.cli import train_recipe as recipe

SHAPES = [(4, 3), (4,), (2, 4), (2,)]

# (utensil class, torch class, constructor keywords, group 1's overrides); group 0 is params
# 0 and 2 with the constructor's values, group 1 params 1 and 3
KINDS = {
    "sgd": ("SGD", dict(lr=0.1, weight_decay=0.05), dict(lr=0.02, weight_decay=0.0)),
    "sgd-momentum": ("SGD", dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.05),
                     dict(lr=0.03, momentum=0.5, dampening=0.0, weight_decay=0.0)),
    "sgd-nesterov": ("SGD", dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.05),
                     dict(lr=0.05, momentum=0.7, weight_decay=0.2)),
    "sgd-mixed-momentum": ("SGD", dict(lr=0.1, momentum=0.9), dict(momentum=0.0)),
    "adam": ("Adam", dict(lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
             dict(lr=0.002, betas=(0.5, 0.9), weight_decay=0.0)),
    "adamw": ("AdamW", dict(lr=0.01, weight_decay=0.1), dict(lr=0.05, eps=1e-4,
                                                             weight_decay=0.0)),
}


@pytest.fixture
def torch():
    return pytest.importorskip("torch")


def _inits(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in SHAPES]


def _groups(ps, over):
    return [{"params": [ps[0], ps[2]]}, dict(over, params=[ps[1], ps[3]])]


def _pair(torch, kind, seed=0):
    cls, kw, over = KINDS[kind]
    inits = _inits(seed)
    ps = [ut.Parameter(a) for a in inits]
    tps = [torch.nn.Parameter(torch.from_numpy(a.copy())) for a in inits]
    opt = getattr(ut, cls)(_groups(ps, over), **kw)
    topt = getattr(torch.optim, cls)(_groups(tps, over), **kw)
    return ps, opt, tps, topt


def _grads(ps, tps, rng):
    import torch

    for p, t in zip(ps, tps):
        g = rng.standard_normal(p.shape).astype(np.float32)
        p.grad.copy_from(g)
        t.grad = torch.from_numpy(g.copy())


def _same_params(ps, tps):
    for i, (p, t) in enumerate(zip(ps, tps)):
        np.testing.assert_allclose(p.numpy(), t.detach().numpy(), rtol=2e-6, atol=1e-7,
                                   err_msg="param %d" % i)


def _same_state(sd, tsd):
    """utensil's state dict against PyTorch's: the groups' keys utensil has, and the state."""
    assert len(sd["param_groups"]) == len(tsd["param_groups"])
    for g, tg in zip(sd["param_groups"], tsd["param_groups"]):
        for k, v in g.items():
            want = tuple(tg[k]) if isinstance(v, tuple) else tg[k]
            assert v == pytest.approx(want, rel=1e-7), k
    for i, tst in tsd["state"].items():
        for k, tv in tst.items():
            if tv is None:  # PyTorch's SGD keeps None where there is no momentum
                assert k not in sd["state"].get(i, {})
                continue
            np.testing.assert_allclose(sd["state"][i][k], tv.numpy(), rtol=2e-6, atol=1e-7,
                                       err_msg="state[%d][%s]" % (i, k))


def _close(*objs):
    for o in objs:
        o.close()


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_groups_step_as_pytorch(torch, kind):
    ps, opt, tps, topt = _pair(torch, kind)
    rng = np.random.default_rng(1)
    assert len(opt.param_groups) == 2 and opt.params == ps[:1] + ps[2:3] + ps[1:2] + ps[3:]
    for k in range(4):
        if k == 2:  # as PyTorch users do between steps: honoured by the next step
            for o in (opt, topt):
                o.param_groups[1]["lr"] *= 0.5
                o.param_groups[0]["weight_decay"] = 0.3
        _grads(ps, tps, rng)
        opt.step()
        topt.step()
        _same_params(ps, tps)
    _same_state(opt.state_dict(), topt.state_dict())
    _close(opt, *ps)


def test_group_keys_are_pytorchs(torch):
    for kind, (cls, kw, over) in KINDS.items():
        ps, opt, tps, topt = _pair(torch, kind)
        for g, tg in zip(opt.param_groups, topt.param_groups):
            # every key of ours is PyTorch's; theirs has its switches (foreach...) besides
            assert set(g) - set(tg) == set()
            for k in g:  # ours are float32-rounded; betas a pair (approx takes no nesting)
                if k == "params":
                    continue
                if isinstance(tg[k], bool) or tg[k] is None:
                    assert g[k] == tg[k], k
                else:
                    assert np.allclose(np.asarray(g[k], np.float64), np.asarray(tg[k], np.float64),
                                       rtol=1e-6, atol=0), k
        assert opt.param_groups[1]["lr"] == over.get("lr", kw["lr"])
        assert opt.defaults == {k: v for k, v in opt.param_groups[0].items() if k != "params"}
        _close(opt, *ps)


@pytest.mark.parametrize("kind", ["sgd-momentum", "adam"])
def test_state_dict_round_trips_with_pytorch(torch, kind):
    rng = np.random.default_rng(2)
    ps, opt, tps, topt = _pair(torch, kind)
    for _ in range(2):
        _grads(ps, tps, rng)
        opt.step()
        topt.step()
    sd, tsd = opt.state_dict(), topt.state_dict()
    assert [g["params"] for g in sd["param_groups"]] == [[0, 1], [2, 3]]  # as PyTorch numbers
    assert [g["params"] for g in tsd["param_groups"]] == [[0, 1], [2, 3]]
    # utensil -> PyTorch and PyTorch -> utensil, each into a fresh optimizer of the same groups
    ps2, opt2, tps2, topt2 = _pair(torch, kind, seed=5)
    opt2.load_state_dict(tsd)
    topt2.load_state_dict({"state": {i: {k: torch.from_numpy(v) for k, v in e.items()}
                                     for i, e in sd["state"].items()},
                           "param_groups": sd["param_groups"]})
    for a, b, c, d in zip(ps, ps2, tps, tps2):  # the same weights in all four
        b.copy_from(a.numpy())
        with torch.no_grad():
            d.copy_(c)
    _same_state(opt2.state_dict(), topt2.state_dict())
    for _ in range(2):
        g = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
        for p, t, p2, t2, a in zip(ps, tps, ps2, tps2, g):
            p.grad.copy_from(a)
            p2.grad.copy_from(a)
            t.grad, t2.grad = torch.from_numpy(a.copy()), torch.from_numpy(a.copy())
        for o in (opt, topt, opt2, topt2):
            o.step()
    _same_params(ps2, tps)
    _same_params(ps, tps2)
    for a, b in zip(ps, ps2):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=2e-6, atol=1e-7)
    _close(opt, opt2, *ps, *ps2)


def test_mismatched_groups_are_refused_and_change_nothing(torch):
    rng = np.random.default_rng(3)
    ps, opt, tps, topt = _pair(torch, "sgd-momentum")
    _grads(ps, tps, rng)
    opt.step()
    before = opt.state_dict()
    # the same four parameters split 1 + 3: another group size
    other = ut.SGD([{"params": ps[:1]}, {"params": ps[1:], "lr": 0.5}], lr=0.1, momentum=0.9)
    other.step()
    bad = other.state_dict()
    with pytest.raises(ut.ShapeError, match=r"param_groups\[0\]: the group has 1 parameters"):
        opt.load_state_dict(bad)
    with pytest.raises(ut.ArgumentError, match="has one group, the optimizer has 2 groups"):
        opt.load_state_dict({"state": {}, "param_groups": before["param_groups"][:1]})
    with pytest.raises(ut.ArgumentError, match="appears twice"):
        opt.load_state_dict({"state": {}, "param_groups": [
            dict(before["param_groups"][0], params=[0, 1]),
            dict(before["param_groups"][1], params=[1, 2])]})
    with pytest.raises(ut.ArgumentError, match=r"param_groups\[1\]: lr"):
        opt.load_state_dict({"state": before["state"], "param_groups": [
            before["param_groups"][0], dict(before["param_groups"][1], lr=-1.0)]})
    after = opt.state_dict()
    assert after["param_groups"] == before["param_groups"]
    for i, e in before["state"].items():
        np.testing.assert_array_equal(e["momentum_buffer"], after["state"][i]["momentum_buffer"])
    _close(opt, other, *ps)


@pytest.mark.parametrize("bad", [-1.0, "x", float("nan"), None, 1e40])
@pytest.mark.parametrize("kind", ["sgd-momentum", "adam"])
def test_a_bad_value_written_into_a_group_raises_and_moves_nothing(torch, kind, bad):
    ps, opt, tps, topt = _pair(torch, kind)
    rng = np.random.default_rng(4)
    _grads(ps, tps, rng)
    opt.step()
    weights, sd, t = [p.numpy().copy() for p in ps], opt.state_dict(), opt.t
    opt.param_groups[1]["lr"] = bad
    with pytest.raises(ut.ArgumentError, match=r"param_groups\[1\]"):
        opt.step()
    with pytest.raises(ut.ArgumentError):
        opt.state_dict()
    assert opt.t == t
    for p, w in zip(ps, weights):
        np.testing.assert_array_equal(p.numpy(), w)
    opt.param_groups[1]["lr"] = 0.01
    np.testing.assert_array_equal(opt.state_dict()["state"][0][list(sd["state"][0])[-1]],
                                  sd["state"][0][list(sd["state"][0])[-1]])
    with pytest.raises(ut.ArgumentError):  # the one-group attribute is checked when written
        opt.lr = bad
    assert opt.lr == sd["param_groups"][0]["lr"]
    opt.step()  # fine again
    _close(opt, *ps)


def test_group_errors_and_add_param_group():
    ps = [ut.Parameter(a) for a in _inits()]
    with pytest.raises(ut.ArgumentError, match="some parameters appear in more than one "
                                               "parameter group"):
        ut.SGD([{"params": ps[:2]}, {"params": ps[1:]}], lr=0.1)
    with pytest.raises(ut.ArgumentError, match="unknown key 'weight_decy'"):
        ut.SGD([{"params": ps, "weight_decy": 0.0}], lr=0.1)
    with pytest.raises(ut.ArgumentError, match="param group 1 has no parameters"):
        ut.Adam([{"params": ps}, {"params": []}])
    with pytest.raises(ut.ArgumentError, match="empty parameter list"):
        ut.Adam([])
    with pytest.raises(ut.ArgumentError, match="Invalid weight_decay value"):
        ut.Adam([{"params": ps, "weight_decay": -1}])
    with pytest.raises(ut.ArgumentError, match="beta2"):
        ut.Adam([{"params": ps[:2]}, {"params": ps[2:], "betas": (0.9, 0.999999999)}])
    with pytest.raises(ut.ArgumentError, match="amsgrad"):
        ut.Adam([{"params": ps, "amsgrad": True}])
    with pytest.raises(ut.ArgumentError, match="Nesterov momentum requires"):
        ut.SGD([{"params": ps[:2]}, {"params": ps[2:], "momentum": 0.0}], lr=0.1,
               momentum=0.9, nesterov=True)
    with pytest.raises(ut.ArgumentTypeError, match="sets"):
        ut.SGD([{"params": set(ps)}])
    with pytest.raises(ut.ArgumentTypeError, match="not a mix"):
        ut.SGD([ps[0], {"params": ps[1:]}])
    with pytest.raises(ut.ArgumentTypeError, match=r"param group 1: params\[0\] is a int"):
        ut.SGD([{"params": ps[:2]}, {"params": [3]}])
    opt = ut.SGD(ps[:2], lr=0.1, momentum=0.9, weight_decay=0.01)
    opt.add_param_group({"params": ps[2:], "lr": 0.5})
    g = opt.param_groups[1]
    assert g["params"] == ps[2:] and g["lr"] == 0.5 and g["momentum"] == 0.9
    assert g["weight_decay"] == 0.01 and g["maximize"] is False
    assert opt.params == ps
    with pytest.raises(ut.ArgumentError, match="more than one parameter group"):
        opt.add_param_group({"params": [ps[0]]})
    assert len(opt.param_groups) == 2 and len(opt.params) == 4
    # a group's params changed in place would pair state with the wrong parameter: refused
    g["params"].append(ps[0])
    with pytest.raises(ut.ArgumentError, match="add_param_group"):
        opt.step()
    g["params"].pop()
    for p in ps:
        p.grad.fill_(1.0)
    opt.step()
    np.testing.assert_allclose(ps[2].numpy(), _inits()[2] - 0.5 * (1 + 0.01 * _inits()[2]),
                               rtol=1e-6, atol=1e-6)
    _close(opt, *ps)


def test_the_one_group_attributes_are_group_0():
    ps = [ut.Parameter(a) for a in _inits()]
    opt = ut.Adam([{"params": ps[:2]}, {"params": ps[2:], "lr": 0.5, "betas": (0.5, 0.6)}],
                  lr=0.1)
    assert opt.lr == 0.1 and opt.betas == (0.9, 0.999) and opt.initial_lr is None
    opt.lr = 0.2
    opt.betas = (0.7, 0.8)
    assert [g["lr"] for g in opt.param_groups] == [0.2, 0.5]
    assert opt.param_groups[1]["betas"] == (0.5, 0.6) and opt.param_groups[0]["betas"] == (0.7, 0.8)
    with pytest.raises(ut.ArgumentError):
        opt.betas = (0.9, 1.0)
    assert "2 groups" in repr(opt)
    # copies: the groups' dicts are the copy's own
    c = copy.copy(opt)
    c.param_groups[1]["lr"] = 0.01
    assert opt.param_groups[1]["lr"] == 0.5 and c.param_groups[1]["params"][0] is ps[2]
    ps2, opt2 = pickle.loads(pickle.dumps((ps, opt)))
    assert opt2.param_groups[1]["params"][0] is ps2[2] and opt2.param_groups[1]["lr"] == 0.5
    assert opt2.params[3] is ps2[3]
    _close(opt, c, opt2, *ps, *ps2)


def test_an_optimizer_pickled_before_groups_loads_as_one_group():
    """The __dict__ an SGD and an Adam had before parameter groups (hyperparameters as
    attributes) becomes one group."""
    ps = [ut.Parameter(a) for a in _inits()]
    sgd = ut.SGD.__new__(ut.SGD)
    sgd.__setstate__({"params": ps, "lr": 0.1, "momentum": 0.9, "_state": [None] * 4,
                      "_closed": False, "t": 0, "initial_lr": 0.2})
    assert sgd.param_groups == [{"params": ps, "lr": 0.1, "momentum": 0.9, "dampening": 0.0,
                                 "weight_decay": 0.0, "nesterov": False, "maximize": False,
                                 "initial_lr": 0.2}]
    assert "lr" not in sgd.__dict__ and sgd.initial_lr == 0.2
    adam = ut.AdamW.__new__(ut.AdamW)
    adam.__setstate__({"params": ps, "lr": 0.01, "betas": (0.8, 0.9), "eps": 1e-6,
                       "weight_decay": 0.1, "_state": [None] * 4, "_closed": False, "t": 0,
                       "_steps": [0] * 4})
    assert adam.decoupled_weight_decay is True and adam.betas == (0.8, 0.9)
    for p in ps:
        p.grad.fill_(1.0)
    sgd.step()
    adam.step()
    assert adam.state_dict()["param_groups"][0]["params"] == [0, 1, 2, 3]
    _close(sgd, adam, *ps)


SCHEDULES = {
    "warmup_cosine": lambda L, o: L.SequentialLR(
        o, [L.LinearLR(o, start_factor=0.01, total_iters=3),
            L.CosineAnnealingLR(o, T_max=9, eta_min=1e-4)], milestones=[3]),
    "linear": lambda L, o: L.LinearLR(o, start_factor=0.2, end_factor=0.9, total_iters=4),
}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_schedulers_over_two_groups_are_pytorchs(torch, name):
    ps, opt, tps, topt = _pair(torch, "sgd-momentum")
    s = SCHEDULES[name](ut.optim.lr_scheduler, opt)
    ts = SCHEDULES[name](torch.optim.lr_scheduler, topt)
    for x, tx in zip(getattr(s, "_schedulers", [s]), getattr(ts, "_schedulers", [ts])):
        assert x.base_lrs == tx.base_lrs == [0.1, 0.03]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(14):
            assert s.get_last_lr() == ts.get_last_lr()  # the same floats
            assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in topt.param_groups]
            opt.step()
            topt.step()
            s.step()
            ts.step()
    assert [g["initial_lr"] for g in opt.state_dict()["param_groups"]] == [0.1, 0.03]
    _close(opt, *ps)


# -- utensil-train --------------------------------------------------------------------------------

def test_param_groups_by_layer_type():
    net = ut.Sequential(ut.Conv2d(1, 3, 3), ut.BatchNorm2d(3), ut.Conv2d(3, 2, 1, bias=False),
                        ut.LayerNorm2d(2), ut.Sequential(ut.Linear(2, 4), ut.LayerNorm(4)),
                        ut.Linear(4, 3))
    names = {id(p): k for k, p in net.named_parameters()}

    def keys(groups):
        return [([names[id(p)] for p in g["params"]], g["weight_decay"]) for g in groups]

    assert recipe.param_groups(net, 0.1) == net.parameters()
    assert keys(recipe.param_groups(net, 0.1, norm_weight_decay=0.0)) == [
        (["0.weight", "0.bias", "2.weight", "4.0.weight", "4.0.bias", "5.weight", "5.bias"], 0.1),
        (["1.weight", "1.bias", "3.weight", "3.bias", "4.1.weight", "4.1.bias"], 0.0)]
    assert keys(recipe.param_groups(net, 0.1, bias_weight_decay=0.0)) == [
        (["0.weight", "1.weight", "2.weight", "3.weight", "4.0.weight", "4.1.weight",
          "5.weight"], 0.1),
        (["0.bias", "1.bias", "3.bias", "4.0.bias", "4.1.bias", "5.bias"], 0.0)]
    assert keys(recipe.param_groups(net, 0.1, 0.0, 0.01)) == [
        (["0.weight", "2.weight", "4.0.weight", "5.weight"], 0.1),
        (["1.weight", "1.bias", "3.weight", "3.bias", "4.1.weight", "4.1.bias"], 0.0),
        (["0.bias", "4.0.bias", "5.bias"], 0.01)]
    net.close()


BASE = ["--width", "2", "--batch-size", "16", "--no-progress", "--device", "cpu", "-q",
        "--optimizer", "sgd", "--lr", "0.1", "--weight-decay", "0.5"]


from test_train_recipe import npz  # noqa: E402,F401  (the toy data set, a fixture)


def _train(npz, path, *flags, epochs=1, resume=False):
    argv = ["--resume", path, "--epochs", str(epochs), "--no-progress", "--device", "cpu",
            "-q"] if resume else ["--data", npz, "--checkpoint", path, "--epochs", str(epochs)] \
        + BASE + list(flags)
    assert tr.main(argv) == 0
    return tr.load_checkpoint(path)


def test_train_norm_and_bias_weight_decay(npz, tmp_path, capsys):
    meta, model, optim = _train(npz, str(tmp_path / "a.npz"), "--norm-weight-decay", "0",
                                "--bias-weight-decay", "0.01")
    assert (meta["run"]["norm_weight_decay"], meta["run"]["bias_weight_decay"]) == (0.0, 0.01)
    groups = meta["optimizer_param_groups"]
    assert [g["weight_decay"] for g in groups] == [0.5, 0.0, 0.01]
    net = tr.build_network(meta["run"], (1, 6, 6), 3, "cpu")
    keys = [k for k, _ in net.named_parameters()]
    norm = {id(p) for m in net.modules() if isinstance(m, (ut.BatchNorm2d, ut.LayerNorm))
            for p in m.parameters()}
    want_norm = [k for k, p in net.named_parameters() if id(p) in norm]
    want_bias = [k for k in keys if k.endswith(".bias") and k not in want_norm]
    assert want_norm and want_bias
    want_other = [k for k in keys if k not in want_norm and k not in want_bias]
    # the state dict numbers the parameters group after group: the groups' sizes, and the
    # shapes of their momentum buffers, are those of the hand-listed parameters
    shapes = {k: p.shape for k, p in net.named_parameters()}
    assert [g["params"] for g in groups] == [list(range(a, b)) for a, b in [
        (0, len(want_other)), (len(want_other), len(keys) - len(want_bias)),
        (len(keys) - len(want_bias), len(keys))]]
    for g, want in zip(groups, (want_other, want_norm, want_bias)):
        assert [optim["state"][i]["momentum_buffer"].shape for i in g["params"]] == \
            [shapes[k] for k in want]
    net.close()
    capsys.readouterr()
    # the run description names them; a resume keeps them and restores every group
    meta2, _, optim2 = _train(npz, str(tmp_path / "a.npz"), epochs=2, resume=True)
    assert [g["weight_decay"] for g in meta2["optimizer_param_groups"]] == [0.5, 0.0, 0.01]
    assert meta2["run"]["norm_weight_decay"] == 0.0
    straight = _train(npz, str(tmp_path / "b.npz"), "--norm-weight-decay", "0",
                      "--bias-weight-decay", "0.01", epochs=2)
    resumed = tr.load_checkpoint(str(tmp_path / "a.npz"))[1]
    for k, v in straight[1].items():
        np.testing.assert_array_equal(v, resumed[k], err_msg=k)
    assert tr.main(["--resume", str(tmp_path / "a.npz"), "--epochs", "3", "--no-progress",
                    "--norm-weight-decay", "0.1"]) == 2
    assert "--norm-weight-decay 0.1 differs from the checkpoint's" in capsys.readouterr().err


def test_train_default_flags_are_one_group_and_unchanged(npz, tmp_path, capsys):
    meta, plain, _ = _train(npz, str(tmp_path / "plain.npz"))
    assert len(meta["optimizer_param_groups"]) == 1
    assert meta["run"]["norm_weight_decay"] is None and meta["run"]["bias_weight_decay"] is None
    # three groups of the same decay: bitwise the run of one group
    meta3, same, _ = _train(npz, str(tmp_path / "same.npz"), "--norm-weight-decay", "0.5",
                            "--bias-weight-decay", "0.5")
    assert len(meta3["optimizer_param_groups"]) == 3
    for k, v in plain.items():
        np.testing.assert_array_equal(v, same[k], err_msg=k)
    _, zero, _ = _train(npz, str(tmp_path / "zero.npz"), "--norm-weight-decay", "0")
    assert any(not np.array_equal(v, zero[k]) for k, v in plain.items())


def test_a_checkpoint_without_the_flags_resumes_with_none(npz, tmp_path):
    ck = str(tmp_path / "ck.npz")
    meta, model, optim = _train(npz, ck)
    for k in ("norm_weight_decay", "bias_weight_decay"):
        del meta["run"][k]
    net = tr.build_network(meta["run"], (1, 6, 6), 3, "cpu")
    opt = ut.SGD(net.parameters(), lr=0.1, momentum=0.9)
    net.load_state_dict(model)
    opt.load_state_dict(optim)
    tr.save_checkpoint(ck, net, opt, meta)
    _close(opt, net)
    meta, _, _ = _train(npz, ck, epochs=2, resume=True)
    assert meta["run"]["norm_weight_decay"] is None and meta["epoch"] == 2
    assert len(meta["optimizer_param_groups"]) == 1


@pytest.mark.parametrize("argv,words", [
    (["--norm-weight-decay", "-1"], "a number >= 0"),
    (["--bias-weight-decay", "nan"], "a number >= 0"),
    (["--norm-weight-decay", "1e40"], "overflows float32"),
])
def test_bad_flag_values_are_usage_errors(npz, argv, words, capsys):
    try:
        status = tr.main(["--data", npz, "--no-checkpoint", "--no-progress", "--device", "cpu"]
                         + argv)
    except SystemExit as e:
        status = e.code
    assert status == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err


def test_the_description_and_help_name_the_flags(capsys):
    run = dict(tr.RUN_DEFAULTS, optimizer="sgd", lr=0.1, weight_decay=0.5,
               norm_weight_decay=0.0, bias_weight_decay=None)
    line = tr.describe_recipe(run)
    assert "weight decay 0.5" in line and "norm layers' weight decay 0" in line
    assert "biases'" not in line
    try:
        tr.main(["--help"])
    except SystemExit:
        pass
    out = capsys.readouterr().out
    assert "--norm-weight-decay W" in out and "--bias-weight-decay W" in out


def test_step_checks_a_value_equal_to_a_good_one_but_of_another_type():
    """step() remembers the values it checked; 1.0 equals True, but is no flag."""
    ps = [ut.Parameter(a) for a in _inits()]
    opt = ut.SGD([{"params": ps[:2]}, {"params": ps[2:]}], lr=0.1, momentum=0.9, nesterov=True)
    for p in ps:
        p.grad.fill_(1.0)
    opt.step()
    opt.param_groups[1]["nesterov"] = 1.0
    with pytest.raises(ut.ArgumentTypeError, match=r"param_groups\[1\]: nesterov"):
        opt.step()
    opt.param_groups[1]["nesterov"] = np.bool_(True)  # not memoized: checked every time
    opt.param_groups[1]["lr"] = np.float32(0.05)
    opt.step()
    assert opt.t == 2 and opt.state_dict()["param_groups"][1]["lr"] == pytest.approx(0.05)
    _close(opt, *ps)
