"""copy.copy, copy.deepcopy and pickle of every object kind (issue 11, item 3).

The rule under test: a copy never shares C memory with its original (copy.copy of a Tensor,
Parameter or layer is a deep copy); writing one never changes the other; copies and unpickled
objects are freed like any other (live_tensors() balances); closed objects refuse with
ClosedError. Optimizers copied or pickled together with their model stay bound to the copy's
parameters.
"""

import copy
import os
import pickle
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import utensil_ffi as ut
from utensil_ffi.testing import optable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COPIES = {
    "copy": copy.copy,
    "deepcopy": copy.deepcopy,
    "pickle": lambda x: pickle.loads(pickle.dumps(x)),
    "pickle-proto2": lambda x: pickle.loads(pickle.dumps(x, protocol=2)),
}


@pytest.fixture(params=sorted(COPIES))
def dup(request):
    return COPIES[request.param]


def _np(t):
    return np.array(t.numpy(), copy=True)


# -- the crash, in a child process --------------------------------------------------------------
CHILD = textwrap.dedent("""
    import copy, gc, numpy as np, utensil_ffi as ut
    base = ut.live_tensors()
    t = ut.tensor(np.arange(6.0).reshape(2, 3))
    c = copy.copy(t)
    lin = ut.Linear(3, 2)
    w = copy.copy(lin.weight)
    del t
    gc.collect()
    other = ut.full((2, 3), 7.0)      # would reuse the freed block the copy still points at
    c.numpy()[:] = -1.0               # writing the copy must not change `other`
    assert np.all(other.numpy() == 7.0), other.numpy()
    del c, w, other
    lin.close()
    del lin
    gc.collect()
    assert ut.live_tensors() == base, (ut.live_tensors(), base)
    print("ok")
""")


def test_copy_copy_is_not_a_double_free_in_a_child():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.returncode, r.stdout, r.stderr)


# -- tensors and parameters ---------------------------------------------------------------------
def test_tensor_copies_are_independent(device, dup, rng):
    a = rng.normal(size=(3, 4)).astype(np.float32)
    t = ut.tensor(a, device)
    before = ut.live_tensors()
    c = dup(t)
    assert type(c) is ut.Tensor and c is not t
    assert ut.live_tensors() == before + 1
    assert c.shape == t.shape and c.device == device and c.dtype == np.float32
    assert np.array_equal(_np(c), a)
    c.fill_(5.0)
    assert np.array_equal(_np(t), a)
    t.fill_(-1.0)
    assert np.all(_np(c) == 5.0)
    c.close()
    assert ut.live_tensors() == before
    t.close()


def test_tensor_pickle_keeps_exact_values():
    special = np.array([np.nan, np.inf, -np.inf, -0.0, 1e-45, 3.4028235e38], np.float32)
    with ut.tensor(special) as t:
        c = pickle.loads(pickle.dumps(t))
        assert np.array_equal(_np(c).view(np.uint32), special.view(np.uint32))
        c.close()


def test_parameter_copies_carry_values_and_grad(dup):
    lin = ut.Linear(3, 2)
    try:
        w = lin.weight
        w.grad.fill_(0.25)
        c = dup(w)
        assert type(c) is ut.Parameter and c.name == "weight"
        assert np.array_equal(_np(c), _np(w)) and np.all(_np(c.grad) == 0.25)
        # independent of the layer's weight and of its grad
        c.fill_(9.0)
        c.grad.fill_(3.0)
        assert not np.any(_np(w) == 9.0) and np.all(_np(w.grad) == 0.25)
        w.grad.zero_()
        assert np.all(_np(c.grad) == 3.0)
        c.close()
        # a None grad stays None
        w.grad = None
        assert dup(w).grad is None
    finally:
        lin.close()


def test_copies_balance_live_tensors(dup):
    import gc

    gc.collect()
    before = ut.live_tensors()
    net = ut.Sequential(ut.Linear(3, 4), ut.BatchNorm2d(2) if False else ut.ReLU(), ut.Linear(4, 2))
    opt = ut.Adam(net.parameters())
    with ut.ones((2, 3)) as x:
        y = net(x)
        net.backward(ut.ones(y.shape)).close()
        y.close()
    opt.step()
    for _ in range(3):
        net2, opt2 = dup((net, opt))
        del net2, opt2
        t2 = dup(net[0].weight)
        del t2
    gc.collect()
    opt.close()
    net.close()
    del net, opt
    gc.collect()
    assert ut.live_tensors() == before


# -- layers -------------------------------------------------------------------------------------
# name -> (make(device), input shape): the op table's samples marked "copy" (utensil_ffi/testing/optable.py:
# Conv2d with and without bias, DWConv2d, Linear, LayerNorm, BatchNorm2d in both modes, ReLU,
# ReLU6, GlobalAvgPool2d), and a Sequential of several
LAYERS = {s.name: ((lambda d, op=op, g=s.geom: op.make(g, d)), op.shapes(s.geom)["x"])
          for op, s in optable.samples("copy")}
LAYERS["Sequential"] = (
    lambda d: ut.Sequential(ut.Conv2d(2, 3, 1, device=d), ut.BatchNorm2d(3, device=d), ut.ReLU6(),
                            ut.GlobalAvgPool2d(), ut.Linear(3, 2, device=d)),
    (3, 2, 3, 3))


def _state(layer):
    """Every value a copy must reproduce: parameters, grads, running statistics, mode."""
    out = {"training": layer.training, "repr": repr(layer)}
    mods = layer.layers if isinstance(layer, ut.Sequential) else [layer]
    for i, m in enumerate(mods):
        for j, p in enumerate(m.parameters()):
            out["p%d.%d" % (i, j)] = _np(p)
            out["g%d.%d" % (i, j)] = None if p.grad is None else _np(p.grad)
        if isinstance(m, ut.BatchNorm2d):
            out["rm%d" % i], out["rv%d" % i] = _np(m.running_mean), _np(m.running_var)
        out["training%d" % i] = m.training
    return out


def _same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], np.ndarray):
            assert np.array_equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_layer_copies(kind, device, dup, rng):
    make, shape = LAYERS[kind]
    layer = make(device)
    x = ut.tensor(rng.normal(size=shape), device)
    # a trained-looking state: a step's grads, moved running statistics, perturbed weights
    y = layer(x)
    layer.backward(ut.tensor(rng.normal(size=y.shape), device)).close()
    y.close()
    for p in layer.parameters():
        p.copy_from(_np(p) + rng.normal(size=p.shape))
    expected = _state(layer)
    c = dup(layer)
    try:
        assert type(c) is type(layer) and c is not layer
        _same(_state(c), expected)
        if layer.parameters():
            assert all(p.device == device for p in c.parameters())
        # the same function: forward (both modes) agrees bitwise
        for mode in (True, False):
            layer.train(mode)
            c.train(mode)
            with layer(x) as a, c(x) as b:
                assert np.array_equal(_np(a), _np(b))
        # the last forward's cache is not copied, the copy's backward works after its forward
        layer.train()
        c.train()
        with c(x) as yc:
            c.backward(ut.ones(yc.shape, device)).close()
        # independent: writing the copy changes nothing in the original, and back
        before = _state(layer)
        for p in c.parameters():
            p.fill_(7.0)
            if p.grad is not None:
                p.grad.fill_(7.0)
        _same(_state(layer), before)
        c_before = _state(c)
        for p in layer.parameters():
            p.fill_(-3.0)
        _same(_state(c), c_before)
        # closing one leaves the other usable
        layer.close()
        with c(x) as yc:
            assert np.all(np.isfinite(_np(yc)))
    finally:
        c.close()
        layer.close()
        x.close()


def test_batchnorm_eval_mode_survives_a_copy(dup):
    bn = ut.BatchNorm2d(2)
    bn.running_mean = [1.0, -2.0]
    bn.running_var = [4.0, 0.25]
    bn.eval()
    c = dup(bn)
    try:
        assert c.training is False
        x = np.arange(8.0, dtype=np.float32).reshape(1, 2, 2, 2)
        with c(x) as y:  # eval mode normalizes with the running statistics
            want = (x - np.array([1, -2]).reshape(1, 2, 1, 1)) / np.sqrt(
                np.array([4, 0.25]).reshape(1, 2, 1, 1) + 1e-5)
            np.testing.assert_allclose(_np(y), want, rtol=1e-5, atol=1e-6)
    finally:
        c.close()
        bn.close()


def test_a_shared_layer_stays_shared_in_the_copy(dup):
    lin = ut.Linear(3, 3)
    net = ut.Sequential(lin, ut.ReLU(), lin)
    c = dup(net)
    try:
        assert c[0] is c[2] and c[0] is not lin
        assert len({id(p) for p in c.parameters()}) == 2
    finally:
        c.close()
        net.close()


def test_user_attributes_and_modules_copy(dup):
    lin = ut.Linear(2, 2)
    lin.tag = {"note": [1, 2]}
    c = dup(lin)
    try:
        assert c.tag == {"note": [1, 2]}
    finally:
        c.close()
        lin.close()


@pytest.mark.parametrize("loss", [ut.MSELoss, ut.CrossEntropyLoss])
def test_losses_copy_without_their_saved_inputs(loss, dup):
    crit = loss()
    pred = ut.tensor([[0.5, -1.0, 2.0]])
    target = ut.tensor([[0.0, 1.0, 0.0]]) if loss is ut.MSELoss else np.array([2])
    crit(pred, target).close()
    c = dup(crit)
    with pytest.raises(ut.ArgumentError, match="call the loss first"):
        c.backward()
    with c(pred, target) as a, crit(pred, target) as b:
        assert a.item() == b.item()
    g1, g2 = c.backward(), crit.backward()
    assert np.array_equal(_np(g1), _np(g2))
    for t in (g1, g2, pred):
        t.close()
    c.close()
    crit.close()
    if isinstance(target, ut.Tensor):
        target.close()


# -- optimizers ---------------------------------------------------------------------------------
OPTS = {
    "sgd": lambda ps: ut.SGD(ps, lr=0.1),
    "sgd-momentum": lambda ps: ut.SGD(ps, lr=0.1, momentum=0.9),
    "adam": lambda ps: ut.Adam(ps, lr=0.01, betas=(0.8, 0.95), eps=1e-6),
}


def _train_step(net, opt, x):
    with net(x) as y:
        opt.zero_grad()
        net.backward(ut.tensor(np.ones(y.shape) * 0.5)).close()
    opt.step()


@pytest.mark.parametrize("kind", sorted(OPTS))
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_model_and_optimizer_copied_together_stay_bound(kind, how, rng):
    net = ut.Sequential(ut.Linear(3, 4), ut.ReLU(), ut.Linear(4, 2))
    opt = OPTS[kind](net.parameters())
    x = ut.tensor(rng.normal(size=(5, 3)))
    _train_step(net, opt, x)
    _train_step(net, opt, x)
    net2, opt2 = COPIES[how]((net, opt))
    try:
        assert type(opt2) is type(opt) and opt2.lr == opt.lr and opt2.t == opt.t
        assert all(a is b for a, b in zip(opt2.params, net2.parameters()))
        sd, sd2 = opt.state_dict(), opt2.state_dict()
        assert sd["param_groups"] == sd2["param_groups"] and sorted(sd["state"]) == sorted(sd2["state"])
        assert all(np.array_equal(a, sd2["state"][i][k])
                   for i, e in sd["state"].items() for k, a in e.items())
        # the copy continues exactly like the original, and does not touch it
        before = [_np(p) for p in net.parameters()]
        _train_step(net2, opt2, x)
        assert all(np.array_equal(_np(p), b) for p, b in zip(net.parameters(), before))
        _train_step(net, opt, x)
        for p, q in zip(net.parameters(), net2.parameters()):
            assert np.array_equal(_np(p), _np(q))
    finally:
        for o in (opt, opt2, net, net2, x):
            o.close()


def test_optimizer_copy_copy_shares_parameters_not_state(rng):
    net = ut.Linear(3, 2)
    opt = ut.SGD(net.parameters(), lr=0.1, momentum=0.9)
    x = ut.tensor(rng.normal(size=(4, 3)))
    _train_step(net, opt, x)
    c = copy.copy(opt)
    try:
        assert all(a is b for a, b in zip(c.params, net.parameters()))
        v_before = opt.state_dict()["state"][0]["momentum_buffer"]
        c._state[0][0].fill_(100.0)
        assert np.array_equal(opt.state_dict()["state"][0]["momentum_buffer"], v_before)
        c.close()  # closing the copy frees only its own state
        _train_step(net, opt, x)
    finally:
        c.close()
        opt.close()
        net.close()
        x.close()


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_optimizer_alone_gets_standalone_parameters(how):
    net = ut.Linear(2, 2)
    opt = ut.Adam(net.parameters(), lr=0.1)
    for p in net.parameters():
        p.grad.fill_(1.0)
    opt.step()
    c = COPIES[how](opt)
    try:
        assert not any(a is b for a, b in zip(c.params, net.parameters()))
        before = [_np(p) for p in net.parameters()]
        c.step()
        assert all(np.array_equal(_np(p), b) for p, b in zip(net.parameters(), before))
        assert not np.array_equal(_np(c.params[0]), before[0])
    finally:
        c.close()
        opt.close()
        net.close()


# -- closed objects and devices -----------------------------------------------------------------
def _closed_objects():
    t = ut.ones(2)
    t.close()
    lin = ut.Linear(2, 2)
    w = lin.weight
    lin.close()
    bn = ut.BatchNorm2d(2)
    bn.close()
    seq_layer = ut.Linear(2, 2)
    seq = ut.Sequential(seq_layer)
    seq.close()
    opt = ut.SGD(ut.Linear(2, 2).parameters(), lr=0.1)
    opt.close()
    return {"tensor": t, "parameter": w, "linear": lin, "batchnorm": bn, "sequential": seq,
            "optimizer": opt}


@pytest.mark.parametrize("name", sorted(_closed_objects()))
@pytest.mark.parametrize("how", sorted(COPIES))
def test_closed_objects_refuse_to_copy(name, how):
    obj = _closed_objects()[name]
    with pytest.raises(ut.ClosedError):
        COPIES[how](obj)


@pytest.mark.skipif(ut.cuda_available(), reason="a GPU is present")
def test_cuda_pickle_without_gpu_is_a_clear_error():
    from utensil_ffi.tensor import _rebuild_tensor

    # what a tensor pickled on a GPU machine holds: its values and "cuda"
    payload = pickle.dumps((_rebuild_tensor, (np.ones(3, np.float32), "cuda")))
    reducer, args = pickle.loads(payload)
    with pytest.raises(ut.DeviceError, match="no CUDA GPU is available.*cpu"):
        reducer(*args)


@pytest.mark.skipif(not ut.cuda_available(), reason="needs a GPU")
def test_cuda_objects_unpickle_onto_the_gpu():
    net = ut.Sequential(ut.Conv2d(2, 2, 1, device="cuda"), ut.BatchNorm2d(2, device="cuda"))
    c = pickle.loads(pickle.dumps(net))
    try:
        assert all(p.device == "cuda" for p in c.parameters())
        assert c[1].running_mean.device == "cuda"
    finally:
        c.close()
        net.close()
