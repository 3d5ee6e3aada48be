"""The lean forward path (reused layer caches, cheap Tensor ownership, C-checked fast paths) and
the optimizers' public state_dict() / load_state_dict()."""

import gc
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

import utensil_ffi as ut
from utensil_ffi import functional as F


def _layers(device):
    return [
        (ut.DWConv2d(2, 2, device=device), (1, 2, 3, 3)),
        (ut.Conv2d(2, 3, 2, device=device), (1, 2, 3, 3)),
        (ut.Linear(4, 3, device=device), (2, 4)),
        (ut.LayerNorm(3, device=device), (1, 2, 3, 3)),
        (ut.BatchNorm2d(2, device=device), (2, 2, 3, 3)),
        (ut.ReLU(), (1, 2, 3, 3)),
        (ut.ReLU6(), (1, 2, 3, 3)),
        (ut.GlobalAvgPool2d(), (1, 2, 3, 3)),
    ]


# -- forward path ---------------------------------------------------------------------------------
def test_repeated_forward_backward_does_not_leak(device, rng):
    for layer, shape in _layers(device):
        x = ut.Tensor(rng.standard_normal(shape), device)
        y = layer(x)
        g = ut.Tensor(np.ones(y.shape), device)
        y.close()
        base = ut.live_tensors()
        for _ in range(20):
            layer(x).close()
            layer.backward(g).close()
        assert ut.live_tensors() == base, type(layer).__name__
        layer.close()
        x.close()
        g.close()


def test_forward_matches_array_input(device, rng):
    # An array input runs where the layer's parameters live; a layer without parameters has no
    # device, so an array runs on the CPU. Bit-equality holds on one device; across devices the
    # kernels sum in different orders (GlobalAvgPool2d differed by one ulp on the H200).
    for layer, shape in _layers(device):
        a = rng.standard_normal(shape).astype(np.float32)
        y2 = layer(a)
        with ut.Tensor(a, y2.device) as x:
            y1 = layer(x).numpy().copy()
        np.testing.assert_array_equal(y1, y2.numpy())
        if y2.device != device:
            with ut.Tensor(a, device) as x:
                np.testing.assert_allclose(layer(x).numpy(), y1, rtol=1e-6, atol=1e-6)
        layer.close()


def test_failed_forward_keeps_previous_cache(device, rng):
    layer = ut.DWConv2d(2, 2, device=device)
    x = ut.Tensor(rng.standard_normal((1, 2, 4, 4)), device)
    g = ut.Tensor(rng.standard_normal((1, 2, 3, 3)), device)
    layer(x).close()
    want = layer.backward(g).numpy().copy()
    layer(x).close()
    with pytest.raises(ut.ShapeError, match="3 channels, the layer expects 2"):
        layer(ut.Tensor(np.zeros((1, 3, 4, 4)), device))
    with pytest.raises(ut.ShapeError, match=r"x must be \[N, C, H, W\]"):
        layer(ut.Tensor(np.zeros((2, 4, 4)), device))
    with pytest.raises(ut.ShapeError, match="smaller than the 2x2 kernel"):
        layer(ut.Tensor(np.zeros((1, 2, 1, 1)), device))
    np.testing.assert_array_equal(layer.backward(g).numpy(), want)
    layer.close()
    x.close()
    g.close()


def test_shape_errors_keep_python_messages(device):
    with ut.Linear(4, 3, device=device) as lin:
        with pytest.raises(ut.ShapeError, match=r"Linear\.forward: .*x must be \[N, 4\]"):
            lin(ut.zeros((2, 5), device))
    with ut.BatchNorm2d(2, device=device) as bn:
        with pytest.raises(ut.ShapeError, match="more than one value per channel"):
            bn(ut.zeros((1, 2, 1, 1), device))
    with ut.LayerNorm(3, device=device) as ln:
        with pytest.raises(ut.ShapeError, match=r"LayerNorm\.forward: .*x must be \[\.\.\., 3\]"):
            ln(ut.zeros((2, 4), device))
    with pytest.raises(ut.ShapeError, match="cannot multiply"):
        F.matmul(ut.zeros((2, 3), device), ut.zeros((2, 3), device))
    with pytest.raises(ut.ShapeError, match="grad_out has shape"):
        F.relu_backward(ut.zeros((2, 3), device), ut.zeros((3, 2), device))
    with pytest.raises(ut.ShapeError, match=r"global_avg_pool2d: .*x must be \[N, C, H, W\]"):
        F.global_avg_pool2d(ut.zeros((2, 3), device))


def test_backward_checks_grad_shape(device, rng):
    with ut.Conv2d(2, 3, 2, device=device) as conv:
        conv(ut.Tensor(rng.standard_normal((1, 2, 3, 3)), device)).close()
        with pytest.raises(ut.ShapeError, match=r"forward output had \[1, 3, 2, 2\]"):
            conv.backward(ut.zeros((1, 3, 3, 3), device))
        conv.eval()
        conv(ut.zeros((1, 2, 3, 3), device)).close()
        with pytest.raises(ut.ArgumentError, match="no forward pass"):
            conv.backward(ut.zeros((1, 3, 2, 2), device))


def test_closed_inputs_and_layers_raise(device):
    x = ut.zeros((1, 2, 3, 3), device)
    x.close()
    for layer, _ in _layers(device):
        with pytest.raises(ut.ClosedError):
            layer(x)
        layer.close()
        if isinstance(layer, ut.layers._CLayer):
            with pytest.raises(ut.ClosedError):
                layer(ut.zeros((1, 2, 3, 3), device))
    for op in (F.relu, F.relu6, F.global_avg_pool2d):
        with pytest.raises(ut.ClosedError):
            op(x)


# -- Tensor ownership -----------------------------------------------------------------------------
def test_tensor_del_and_close_free_now():
    gc.disable()
    try:
        base = ut.live_tensors()
        t = ut.zeros((3,))
        assert ut.live_tensors() == base + 1
        del t
        assert ut.live_tensors() == base
        t = ut.zeros((3,))
        t.close()
        t.close()
        assert t.closed and ut.live_tensors() == base
    finally:
        gc.enable()


def test_view_outlives_tensor():
    t = ut.Tensor([1.0, 2.0, 3.0])
    v = t.numpy()
    t.close()
    del t
    gc.collect()
    assert v.tolist() == [1.0, 2.0, 3.0]


def test_concurrent_close_frees_once():
    base = ut.live_tensors()
    for _ in range(50):
        t = ut.zeros((4,))
        ths = [threading.Thread(target=t.close) for _ in range(4)]
        for th in ths:
            th.start()
        for th in ths:
            th.join()
    assert ut.live_tensors() == base


def test_exit_with_live_objects_is_clean():
    code = (
        "import utensil_ffi as ut\n"
        "t = ut.randn((3, 3)); v = t.numpy(); l = ut.DWConv2d(2, 2); r = ut.ReLU()\n"
        "y = l(ut.randn((1, 2, 3, 3))); z = r(y)\n"
        "cycle = [t]; cycle.append(cycle)\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=dict(os.environ), timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok" and "Exception ignored" not in r.stderr, r.stderr


# -- optimizer state ------------------------------------------------------------------------------
def _model_and_data(device, rng):
    ut.seed(7)
    net = ut.Sequential(ut.Linear(4, 5, device=device), ut.ReLU(), ut.Linear(5, 3, device=device))
    xs = [ut.Tensor(rng.standard_normal((6, 4)), device) for _ in range(6)]
    return net, xs


def _train(net, opt, xs):
    crit = ut.MSELoss()
    for x in xs:
        opt.zero_grad()
        y = net(x)
        crit(y, np.zeros(y.shape, np.float32)).close()
        y.close()
        g = crit.backward()
        net.backward(g).close()
        g.close()
        opt.step()
    crit.close()


def _weights(net):
    return [p.numpy().copy() for p in net.parameters()]


OPTS = [
    pytest.param(lambda ps: ut.SGD(ps, lr=0.05), id="sgd"),
    pytest.param(lambda ps: ut.SGD(ps, lr=0.05, momentum=0.9), id="sgd-momentum"),
    pytest.param(lambda ps: ut.Adam(ps, lr=0.01), id="adam"),
]


@pytest.mark.parametrize("make", OPTS)
def test_state_dict_resume_is_bitwise(device, rng, make):
    net, xs = _model_and_data(device, rng)
    opt = make(net.parameters())
    _train(net, opt, xs[:3])
    sd = opt.state_dict()
    w = _weights(net)
    # PyTorch's layout: one group listing the parameters by index, state per parameter
    assert list(sd) == ["state", "param_groups"] and len(sd["param_groups"]) == 1
    assert sd["param_groups"][0]["params"] == list(range(len(net.parameters())))
    assert sd["param_groups"][0]["lr"] == opt.lr
    slots = opt._slot_names
    assert sorted(sd["state"]) == (list(range(len(net.parameters()))) if slots else [])
    for i, p in enumerate(net.parameters()):
        for k in slots:
            a = sd["state"][i][k]
            assert a.dtype == np.float32 and a.shape == p.shape
        if isinstance(opt, ut.Adam):
            assert sd["state"][i]["step"] == 3
    _train(net, opt, xs[3:])
    straight = _weights(net)

    net2, _ = _model_and_data(device, rng)
    for p, a in zip(net2.parameters(), w):
        p.copy_from(a)
    opt2 = make(net2.parameters())
    opt2.load_state_dict(sd)
    if isinstance(opt2, ut.Adam):
        assert opt2.t == 3
    _train(net2, opt2, xs[3:])
    for a, b in zip(straight, _weights(net2)):
        np.testing.assert_array_equal(a, b)
    _assert_same_optimizer_state(opt.state_dict(), opt2.state_dict())
    for o in (opt, opt2):
        o.close()
    for n in (net, net2):
        n.close()
    for x in xs:
        x.close()


def _assert_same_optimizer_state(sd1, sd2):
    assert sd1["param_groups"] == sd2["param_groups"]
    assert sorted(sd1["state"]) == sorted(sd2["state"])
    for i, e in sd1["state"].items():
        assert sorted(e) == sorted(sd2["state"][i])
        for k, a in e.items():
            np.testing.assert_array_equal(a, sd2["state"][i][k])


def test_state_dict_is_a_copy_and_fresh_state_is_empty(device):
    with ut.Linear(2, 2, device=device) as lin:
        opt = ut.Adam(lin.parameters())
        sd = opt.state_dict()
        assert sd["state"] == {}  # no state before the first step, as in PyTorch
        lin.weight.grad.fill_(1.0)
        opt.step()
        sd = opt.state_dict()
        assert sd["state"][0]["step"] == 1 and np.all(sd["state"][0]["exp_avg"] != 0)
        sd["state"][0]["exp_avg"][...] = 123.0
        assert not np.any(opt.state_dict()["state"][0]["exp_avg"] == 123.0)
        opt.close()
        with pytest.raises(ut.ClosedError):
            opt.state_dict()


def test_load_state_dict_validates_before_changing(device):
    with ut.Linear(3, 2, device=device) as lin:
        opt = ut.SGD(lin.parameters(), lr=0.1, momentum=0.5)
        lin.weight.grad.fill_(1.0)
        lin.bias.grad.fill_(1.0)
        opt.step()
        good = opt.state_dict()

        def with_state(state, **group):
            return {"state": state, "param_groups": [dict(good["param_groups"][0], **group)]}

        bad_shape = with_state({0: {"momentum_buffer": np.zeros((2, 3))},
                                1: {"momentum_buffer": np.zeros(3)}})
        with pytest.raises(ut.ShapeError, match=r"state\[1\]\['momentum_buffer'\] has shape \(3,\)"):
            opt.load_state_dict(bad_shape)
        with pytest.raises(ut.ShapeError, match="2 parameters"):
            opt.load_state_dict(with_state({}, params=[0]))
        with pytest.raises(ut.ArgumentError, match="'momentum_buffer'"):
            opt.load_state_dict(with_state({0: {}}))
        with pytest.raises(ut.ArgumentError, match="'param_groups'"):
            opt.load_state_dict({"state": good["state"]})
        with pytest.raises(ut.ArgumentError, match="not in the group"):
            opt.load_state_dict(with_state({5: good["state"][0]}))
        with pytest.raises(ut.ArgumentError, match="maximize"):
            opt.load_state_dict(with_state(good["state"], maximize=True))
        with pytest.raises(ut.ArgumentError, match="Nesterov momentum requires"):
            opt.load_state_dict(with_state(good["state"], nesterov=True, dampening=0.1))
        with pytest.raises(ut.ArgumentError, match="Invalid weight_decay value"):
            opt.load_state_dict(with_state(good["state"], weight_decay=-1.0))
        with pytest.raises(ut.ArgumentError):
            opt.load_state_dict(with_state(good["state"], lr=-1.0))
        with pytest.raises(ut.ArgumentError, match="one group"):
            opt.load_state_dict({"state": {}, "param_groups": good["param_groups"] * 2})
        with pytest.raises(ut.ArgumentTypeError):
            opt.load_state_dict([1, 2])
        with pytest.raises(ut.ArgumentTypeError):
            opt.load_state_dict(with_state({0: {"momentum_buffer": "x"}}))
        _assert_same_optimizer_state(good, opt.state_dict())
        assert opt.lr == np.float32(0.1)
        opt.close()


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_optimizer_state_dict_round_trips_through_pytorch(kind):
    """PyTorch's optimizer of the same kind loads the state dict and gives back the same one."""
    torch = pytest.importorskip("torch")
    with ut.Linear(3, 2) as lin:
        opt = ut.SGD(lin.parameters(), lr=0.1, momentum=0.5) if kind == "sgd" \
            else ut.Adam(lin.parameters(), lr=0.01, betas=(0.8, 0.9), eps=1e-6)
        lin.weight.grad.fill_(1.0)
        lin.bias.grad.fill_(0.5)
        opt.step()
        opt.step()
        sd = opt.state_dict()
        tl = torch.nn.Linear(3, 2)
        topt = torch.optim.SGD(tl.parameters(), lr=1.0, momentum=0.9) if kind == "sgd" \
            else torch.optim.Adam(tl.parameters(), lr=1.0)
        topt.load_state_dict({"state": {i: {k: torch.from_numpy(v) for k, v in e.items()}
                                        for i, e in sd["state"].items()},
                              "param_groups": sd["param_groups"]})
        fresh = type(opt)(ut.Linear(3, 2).parameters())
        try:
            fresh.load_state_dict(topt.state_dict())
            _assert_same_optimizer_state(sd, fresh.state_dict())
        finally:
            fresh.close()
            for p in fresh.params:
                p.close()
        opt.close()
