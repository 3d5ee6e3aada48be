"""The residual add (ut.add, ut.Residual) and MobileNetV2 (models.mobilenet_v2), against
independent references:

- ut.add against numpy; its refusals (shape, device, closed) are named exceptions;
- a Residual around a small conv block against a float64 numpy re-implementation
  (utensil_ffi.reference) and the central finite differences of that reference (input and
  every parameter), on every device present; lifetimes (the caller's tensors stay open, nothing
  leaks), train/eval, copies and pickles;
- MobileNetV2's parameter count against torchvision's published 3,504,872, and against a
  PyTorch twin written here with torchvision's structure (features / InvertedResidual.conv /
  classifier with Dropout) at width 0.5; a small network's logits, input gradient, parameter
  gradients and running statistics against that twin in float64, with the weights paired in
  state_dict order (the keys differ, the order and shapes match one to one).
"""

import copy
import pickle

import numpy as np
import pytest

import utensil_ffi as ut
from utensil_ffi.nn import models  # the flat mobilenet_v2 (utensil_ffi.models': torchvision's)
from utensil_ffi import reference as R


def _np(t):
    return np.array(t.numpy(), dtype=np.float64)


# -- ut.add ---------------------------------------------------------------------------------------


def test_add_matches_numpy(device, rng):
    a = rng.normal(0, 1, (2, 3, 4, 5)).astype(np.float32)
    b = rng.normal(0, 1, (2, 3, 4, 5)).astype(np.float32)
    with ut.tensor(a, device) as ta, ut.tensor(b, device) as tb:
        with ut.add(ta, tb) as y:
            assert y.device == device and y.shape == (2, 3, 4, 5)
            np.testing.assert_allclose(_np(y), a.astype(np.float64) + b, rtol=1e-6, atol=1e-6)
        with ut.add(ta, b) as y:  # an array-like goes to the Tensor's device
            assert y.device == device
            np.testing.assert_allclose(_np(y), a.astype(np.float64) + b, rtol=1e-6, atol=1e-6)
        # out of place: neither input changed
        np.testing.assert_array_equal(ta.numpy(), a)
        np.testing.assert_array_equal(tb.numpy(), b)


def test_add_backward_is_two_independent_copies(rng):
    g = rng.normal(0, 1, (3, 4)).astype(np.float32)
    with ut.tensor(g) as tg:
        da, db = ut.functional.add_backward(tg)
        try:
            assert da is not tg and db is not tg and da is not db
            np.testing.assert_array_equal(da.numpy(), g)
            np.testing.assert_array_equal(db.numpy(), g)
            da.close()
            np.testing.assert_array_equal(db.numpy(), g)  # closing one leaves the other
        finally:
            da.close()
            db.close()


@pytest.mark.parametrize("shape_b", [(3, 2), (6,), (2, 3, 1)])
def test_add_refuses_another_shape(shape_b):
    # the same element count is not enough: ut_add_into alone would accept (3, 2) and (6,)
    with ut.zeros((2, 3)) as a, ut.zeros(shape_b) as b:
        with pytest.raises(ut.ShapeError, match=r"add: a has shape \[2, 3\] but b has shape"):
            ut.add(a, b)
        with pytest.raises(ValueError):  # ShapeError is a ValueError
            ut.add(a, b)


def test_add_refuses_a_closed_tensor():
    a, b = ut.zeros((2, 2)), ut.zeros((2, 2))
    b.close()
    try:
        with pytest.raises(ut.ClosedError):
            ut.add(a, b)
    finally:
        a.close()


@pytest.mark.skipif("cuda" not in ut.devices(), reason="needs a CUDA device")
def test_add_refuses_another_device():
    with ut.zeros((2, 2), "cpu") as a, ut.zeros((2, 2), "cuda") as b:
        with pytest.raises(ut.DeviceError, match="add: a is on cpu but b is on cuda"):
            ut.add(a, b)
        with pytest.raises(RuntimeError):
            ut.add(b, a)


# -- Residual against a float64 reference and its finite differences ------------------------------


def _block(device, rng):
    """conv 3x3 -> BatchNorm (training: batch statistics) -> ReLU6 -> depthwise 3x3,
    with BatchNorm's scale and shift random so that ReLU6 clips on both sides."""
    ut.seed(5)
    block = ut.Sequential(ut.Conv2d(3, 3, 3, padding=1, bias=False, device=device),
                          ut.BatchNorm2d(3, device=device), ut.ReLU6(),
                          ut.DWConv2d(3, 3, padding=1, device=device))
    block[1].weight = rng.uniform(2.0, 6.0, 3)
    block[1].bias = rng.uniform(0.5, 3.0, 3)
    return block


def _ref_residual(p, x, pre=None):
    """x + block(x) in float64, with the block's weights from the state dict ``p``."""
    h = R.conv2d(x, p["block.0.weight"], None, 1, 1)
    h = R.batchnorm2d_train(h, p["block.1.weight"], p["block.1.bias"], 1e-5)[0]
    if pre is not None:
        pre.append(h)
    h = R.relu6(h)
    w = p["block.3.weight"]
    return x + R.dwconv2d(h, w.reshape(3, 3, 3), p["block.3.bias"], 1, 1)


def test_residual_matches_reference_and_finite_differences(device, rng):
    res = ut.Residual(_block(device, rng))
    x = rng.normal(0, 1, (2, 3, 5, 4)).astype(np.float32)  # batch 2, odd and unequal sizes
    go = rng.normal(0, 1, x.shape).astype(np.float32)
    try:
        params = {k: v.astype(np.float64) for k, v in res.state_dict().items()}
        assert [k for k, _ in res.named_parameters()] == [
            "block.0.weight", "block.1.weight", "block.1.bias",
            "block.3.weight", "block.3.bias"]
        x64 = x.astype(np.float64)
        pre = []
        ref = _ref_residual(params, x64, pre)
        assert (pre[0] < 0).any() and (pre[0] > 6).any()  # both kinks of ReLU6 are used

        res.zero_grad()
        with ut.tensor(x, device) as tx, ut.tensor(go, device) as tg:
            with res(tx) as y:
                np.testing.assert_allclose(_np(y), ref, rtol=1e-4, atol=1e-4)
            with res.backward(tg) as dx:
                got_dx = _np(dx)
            assert not tx.closed and not tg.closed  # the caller's tensors stay the caller's
            np.testing.assert_array_equal(tx.numpy(), x)
        go64 = go.astype(np.float64)
        fd = R.numeric_grad(lambda v: _ref_residual(params, v), x64.copy(), go64)
        scale = np.abs(fd).max()
        np.testing.assert_allclose(got_dx, fd, rtol=1e-3, atol=1e-4 * scale, err_msg="dx")
        for key, p in res.named_parameters():
            arr = params[key]
            fd = R.numeric_grad(lambda _: _ref_residual(params, x64), arr, go64)
            fd = fd.reshape(p.shape)
            np.testing.assert_allclose(_np(p.grad), fd, rtol=1e-3,
                                       atol=1e-4 * max(np.abs(fd).max(), 1e-3), err_msg=key)
            assert np.any(fd != 0), key
    finally:
        res.close()


def test_residual_identity_block_doubles(rng):
    # an empty Sequential hands back its input: the residual must not close the caller's x
    res = ut.Residual(ut.Sequential())
    x = rng.normal(0, 1, (2, 3)).astype(np.float32)
    with ut.tensor(x) as tx:
        with res(tx) as y:
            np.testing.assert_allclose(y.numpy(), 2 * x, rtol=1e-6)
        with res.backward(tx) as g:
            np.testing.assert_allclose(g.numpy(), 2 * x, rtol=1e-6)
        assert not tx.closed


def test_residual_in_a_network_frees_what_it_makes(rng):
    ut.seed(1)
    net = ut.Sequential(ut.Linear(4, 6), ut.Residual(ut.Sequential(ut.Linear(6, 6), ut.ReLU())),
                        ut.Residual(ut.Residual(ut.Sequential(ut.Linear(6, 6)))),
                        ut.Linear(6, 2))
    x = rng.normal(0, 1, (5, 4)).astype(np.float32)
    with ut.tensor(x) as tx, ut.tensor(np.ones((5, 2))) as g:
        before = ut.live_tensors()
        for _ in range(3):  # the count stays put from step to step
            y = net(tx)
            dx = net.backward(g)
            y.close()
            dx.close()
            after = ut.live_tensors()
            assert after <= before + 16, (before, after)  # only the layers' caches remain
            before = after
        # the reference: numpy float64
        p = {k: v.astype(np.float64) for k, v in net.state_dict().items()}
        h = x @ p["0.weight"].T + p["0.bias"]
        h = h + np.maximum(h @ p["1.block.0.weight"].T + p["1.block.0.bias"], 0)
        h = 2 * h + (h @ p["2.block.block.0.weight"].T + p["2.block.block.0.bias"])
        ref = h @ p["3.weight"].T + p["3.bias"]
        with net(tx) as y:
            np.testing.assert_allclose(y.numpy(), ref, rtol=1e-5, atol=1e-5)
    net.close()


def test_residual_refuses_a_block_that_changes_the_shape():
    res = ut.Residual(ut.Linear(3, 4))
    try:
        with ut.zeros((2, 3)) as x:
            with pytest.raises(ut.ShapeError, match=r"Residual: the block maps \[2, 3\] to \[2, 4\]"):
                res(x)
            assert not x.closed
    finally:
        res.close()
    with pytest.raises(ut.ArgumentTypeError, match="Residual: block must be a Module"):
        ut.Residual(lambda x: x)


def test_residual_train_eval_close():
    res = ut.Residual(ut.Sequential(ut.Linear(3, 3), ut.ReLU()))
    assert res.training and res.block[0].training
    res.eval()
    assert not res.training and not res.block[0].training and not res.block[1].training
    with ut.ones((2, 3)) as x:
        res(x).close()
        with pytest.raises(ut.ArgumentError, match="no forward pass"):
            res.backward(x)
    res.train()
    assert res.block[1].training
    assert res.to("cpu") is res
    res.close()
    res.close()  # idempotent
    with pytest.raises(ut.ClosedError):
        res.parameters()[0].numpy()
    with ut.ones((2, 3)) as x, pytest.raises(ut.ClosedError):
        res(x)


@pytest.mark.parametrize("how", ["copy", "deepcopy", "pickle"])
def test_residual_copies_are_independent(how, rng):
    dup = {"copy": copy.copy, "deepcopy": copy.deepcopy,
           "pickle": lambda m: pickle.loads(pickle.dumps(m))}[how]
    ut.seed(2)
    res = ut.Residual(ut.Sequential(ut.Linear(3, 3), ut.ReLU6()))
    res.eval()
    res.tag = "kept"
    c = dup(res)
    x = rng.normal(0, 1, (2, 3)).astype(np.float32)
    try:
        assert type(c) is ut.Residual and c.block is not res.block and c.tag == "kept"
        assert not c.training and not c.block[0].training
        assert list(c.state_dict()) == list(res.state_dict())
        with res(x) as a, c(x) as b:
            np.testing.assert_array_equal(a.numpy(), b.numpy())
        c.block[0].weight = np.zeros((3, 3))
        assert np.any(res.block[0].weight.numpy() != 0)  # no shared memory
    finally:
        c.close()
        res.close()


# -- MobileNetV2: the PyTorch twin, with torchvision's structure ----------------------------------


def _make_divisible(v, divisor=8):
    new_v = max(divisor, int(v + divisor / 2) // divisor * divisor)
    if new_v < 0.9 * v:
        new_v += divisor
    return new_v


def _torchvision_v2(torch, num_classes=1000, width_mult=1.0, in_channels=3, stem_stride=2):
    """torchvision.models.mobilenet_v2 written out (torchvision is not a test dependency):
    the same modules, nesting and state_dict keys (features.N..., classifier.1...)."""
    nn = torch.nn

    def conv_bn_relu6(i, o, k=3, stride=1, groups=1):
        return nn.Sequential(nn.Conv2d(i, o, k, stride, (k - 1) // 2, groups=groups, bias=False),
                             nn.BatchNorm2d(o), nn.ReLU6())

    class InvertedResidual(nn.Module):
        def __init__(self, inp, oup, stride, t):
            super().__init__()
            hidden = int(round(inp * t))
            self.use_res_connect = stride == 1 and inp == oup
            layers = [conv_bn_relu6(inp, hidden, 1)] if t != 1 else []
            layers += [conv_bn_relu6(hidden, hidden, 3, stride, groups=hidden),
                       nn.Conv2d(hidden, oup, 1, 1, 0, bias=False), nn.BatchNorm2d(oup)]
            self.conv = nn.Sequential(*layers)

        def forward(self, x):
            return x + self.conv(x) if self.use_res_connect else self.conv(x)

    class MobileNetV2(nn.Module):
        def __init__(self):
            super().__init__()
            setting = [[1, 16, 1, 1], [6, 24, 2, 2], [6, 32, 3, 2], [6, 64, 4, 2],
                       [6, 96, 3, 1], [6, 160, 3, 2], [6, 320, 1, 1]]
            c = _make_divisible(32 * width_mult)
            last = _make_divisible(1280 * max(1.0, width_mult))
            features = [conv_bn_relu6(in_channels, c, stride=stem_stride)]
            for t, ch, n, s in setting:
                out = _make_divisible(ch * width_mult)
                for i in range(n):
                    features.append(InvertedResidual(c, out, s if i == 0 else 1, t))
                    c = out
            features.append(conv_bn_relu6(c, last, 1))
            self.features = nn.Sequential(*features)
            self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(last, num_classes))

        def forward(self, x):
            x = nn.functional.adaptive_avg_pool2d(self.features(x), 1)
            return self.classifier(torch.flatten(x, 1))

    return MobileNetV2()


def _pair_state(torch, net, tnet):
    """utensil's state dict -> the twin's keys, paired in order; checks that the two lists pair
    one to one (same length, shapes, and kind of tensor: weight, bias, running_mean...)."""
    sd, tsd = net.state_dict(), tnet.state_dict()
    assert len(sd) == len(tsd)
    out = {}
    for (k, v), (tk, tv) in zip(sd.items(), tsd.items()):
        assert k.rsplit(".", 1)[-1] == tk.rsplit(".", 1)[-1], (k, tk)
        assert v.shape == tuple(tv.shape), (k, v.shape, tk, tuple(tv.shape))
        out[tk] = torch.from_numpy(np.asarray(v))
    return out


def _randomize_bn(net, rng):
    """Random BatchNorm scales, shifts and running statistics (so that BN matters in eval)."""
    for m in net.modules():
        if isinstance(m, ut.BatchNorm2d):
            c = m.num_features
            m.weight = rng.uniform(0.5, 1.5, c)
            m.bias = rng.normal(0, 0.2, c)
            m.running_mean = rng.normal(0, 0.3, c)
            m.running_var = rng.uniform(0.5, 2.0, c)


def test_parameter_count_is_torchvisions():
    net = models.mobilenet_v2()
    try:
        assert models.count_parameters(net) == 3_504_872  # torchvision's mobilenet_v2
        assert len(net) == 25 and sum(isinstance(m, ut.Residual) for m in net) == 10
    finally:
        net.close()


@pytest.mark.parametrize("width", [0.5, 1.4])
def test_parameter_count_matches_the_twin(torch, width):
    tnet = _torchvision_v2(torch, 100, width)
    n_twin = sum(p.numel() for p in tnet.parameters())
    for fused in (False, True):
        net = models.mobilenet_v2(100, width, fused=fused)
        try:
            assert models.count_parameters(net) == n_twin
            _pair_state(torch, net, tnet)  # one to one, by order and shape
        finally:
            net.close()


def _small(rng, fused=False, device="cpu"):
    ut.seed(3)
    net = models.mobilenet_v2(10, 0.35, in_channels=3, device=device, fused=fused,
                              stem_stride=1)
    _randomize_bn(net, rng)
    return net


def _twin_of(torch, net):
    tnet = _torchvision_v2(torch, 10, 0.35, 3, stem_stride=1)
    tnet.load_state_dict(_pair_state(torch, net, tnet), strict=True)
    tnet.classifier[0].p = 0.0  # utensil has no Dropout: compare the deterministic network
    return tnet


def _utensil_step(net, x, go, device):
    """(logits, dx, [parameter grads], [running_var]) of one forward and backward."""
    net.zero_grad()
    with ut.tensor(x, device) as tx, ut.tensor(go, device) as tg:
        with net(tx) as y:
            logits = _np(y)
        with net.backward(tg) as dx:
            got_dx = _np(dx)
    rv = [b for k, b in net.state_dict().items() if k.endswith("running_var")]
    return logits, got_dx, [_np(p.grad) for p in net.parameters()], rv


def _torch_step(torch, tnet, x, go, dtype):
    xt = torch.tensor(x, dtype=dtype, requires_grad=True)
    y = tnet(xt)
    (y * torch.tensor(go, dtype=dtype)).sum().backward()
    rv = [b.numpy() for k, b in tnet.state_dict().items() if k.endswith("running_var")]
    return (y.detach().double().numpy(), xt.grad.double().numpy(),
            [p.grad.double().numpy() for p in tnet.parameters()], rv)


def _errors(got, ref):
    """max |got - ref| / max |ref| per compared tensor, named; a gradient that is zero in exact
    arithmetic (the bias of a BatchNorm whose every path meets another training-mode BatchNorm,
    which removes a per-channel shift) is measured against the largest parameter gradient."""
    out = {"logits": got[0] - ref[0], "dx": got[1] - ref[1]}
    gscale = max(np.abs(g).max() for g in ref[2])
    errs = {k: np.abs(d).max() / np.abs(r).max() for (k, d), r in zip(out.items(), ref[:2])}
    for i, (g, r) in enumerate(zip(got[2], ref[2])):
        errs["grad %d" % i] = (np.abs(g - r.reshape(g.shape)).max()
                               / max(np.abs(r).max(), 1e-3 * gscale))
    for i, (b, r) in enumerate(zip(got[3], ref[3])):
        errs["running_var %d" % i] = np.abs(b - r).max() / np.abs(r).max()
    return errs


def test_small_network_matches_pytorch_frozen_batchnorm(device, torch, rng):
    """BatchNorm with its running statistics (eval) and every other layer training: logits,
    input gradient and every parameter gradient within 1e-4 of the largest value, against the
    twin in float64."""
    net = _small(rng, device=device)
    tnet = _twin_of(torch, net).double().train()
    for m in list(net.modules()) + list(tnet.modules()):
        if isinstance(m, (ut.BatchNorm2d, torch.nn.BatchNorm2d)):
            m.eval()  # utensil's BatchNorm2d keeps its backward cache in eval mode
    x = rng.normal(0, 1, (2, 3, 32, 32)).astype(np.float32)
    go = rng.normal(0, 1, (2, 10)).astype(np.float32)
    try:
        errs = _errors(_utensil_step(net, x, go, device), _torch_step(torch, tnet, x, go,
                                                                        torch.float64))
        assert len(errs) == 2 + len(net.parameters()) + 52  # 52 BatchNorms
        worst = max(errs, key=errs.get)
        assert errs[worst] <= 1e-4, "%s: %.2e" % (worst, errs[worst])
    finally:
        net.close()


def test_small_network_matches_pytorch_training_mode(device, torch, rng):
    """Training mode (batch statistics of 2x2 maps at the end: an ill-conditioned backward):
    logits, input gradient, every parameter gradient and the running statistics after the step,
    against the twin in float64, no further off than PyTorch's own float32 (which is 1e-3 off
    here)."""
    net = _small(rng, device=device)
    tnet = _twin_of(torch, net).train()
    t32 = copy.deepcopy(tnet)
    t64 = tnet.double()
    x = rng.normal(0, 1, (4, 3, 32, 32)).astype(np.float32)
    go = rng.normal(0, 1, (4, 10)).astype(np.float32)
    try:
        ref = _torch_step(torch, t64, x, go, torch.float64)
        errs = _errors(_utensil_step(net, x, go, device), ref)
        errs32 = _errors(_torch_step(torch, t32, x, go, torch.float32), ref)
        assert errs["logits"] <= 1e-4
        bad = ["%s: %.2e (PyTorch float32: %.2e)" % (k, e, errs32[k]) for k, e in errs.items()
               if not e <= max(1e-4, 2 * errs32[k]) or not e <= 1e-2]
        assert not bad, bad
    finally:
        net.close()


def test_small_network_eval_matches_pytorch_and_fused(torch, rng):
    net = _small(rng)
    fused = models.mobilenet_v2(10, 0.35, fused=True, stem_stride=1)
    tnet = _torchvision_v2(torch, 10, 0.35, 3, stem_stride=1)
    try:
        state = net.state_dict()
        fused.load_state_dict(dict(zip(fused.state_dict(), state.values())))
        tnet.load_state_dict(_pair_state(torch, net, tnet), strict=True)
        tnet = tnet.double().eval()
        net.eval()
        fused.eval()
        x = rng.normal(0, 1, (3, 3, 32, 32)).astype(np.float32)
        ref = tnet(torch.tensor(x, dtype=torch.float64)).detach().numpy()
        with net(x) as a, fused(x) as b:
            scale = np.abs(ref).max()
            assert np.abs(_np(a) - ref).max() <= 1e-4 * scale
            assert np.abs(_np(b) - ref).max() <= 1e-4 * scale
    finally:
        net.close()
        fused.close()


def test_state_dict_keys():
    net = models.mobilenet_v2(10, 0.35)
    try:
        keys = list(net.state_dict())
        assert keys[:2] == ["0.weight", "1.weight"]
        assert "3.0.weight" in keys  # block 0: t = 1, 32 -> 16, no residual
        assert "4.0.weight" in keys  # block 1: stride 2
        assert "5.block.0.weight" in keys  # block 2: 24 -> 24 stride 1, a residual
        assert keys[-2:] == ["24.weight", "24.bias"]
        assert isinstance(net[5], ut.Residual) and isinstance(net[4], ut.Sequential)
    finally:
        net.close()


def test_bad_width_is_a_clear_error():
    with pytest.raises(ValueError, match="width_mult must be > 0"):
        models.mobilenet_v2(width_mult=0)
