"""utensil_ffi.models: torchvision's depthwise-separable networks by name.

Without torchvision: the state_dict keys, shapes and parameter counts against the committed
fixture (tests/fixtures/torchvision_models/keys.json, written by make_keys.py beside it), the
builders' arguments, initialisation, forward shapes, a training step, train/eval, copies.
With torchvision: every model's eval logits from torchvision's weights loaded by name (and back),
and one model per family's training-mode parameter gradients against torch autograd in float64.
"""

import collections
import copy
import json
import os
import pickle

import numpy as np
import pytest

import utensil_ffi as ut
from conftest import require_device
from utensil_ffi import models
from utensil_ffi.optim import SGD

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures",
                       "torchvision_models", "keys.json")
with open(FIXTURE) as f:
    TV = json.load(f)["models"]

NAMES = models.list_models()
# one model per family, small enough for a CPU step; their no-randomness settings
FAMILY = {
    "mobilenet_v2": dict(dropout=0.0),
    "mobilenet_v3_small": dict(dropout=0.0),
    "efficientnet_b0": dict(dropout=0.0, stochastic_depth_prob=0.0),
    "mnasnet0_5": dict(dropout=0.0),
    "convnext_tiny": dict(stochastic_depth_prob=0.0),
}


def _loss(crit, y, labels):
    t = crit(y, labels)
    try:
        return float(t.numpy().reshape(()))
    finally:
        t.close()


def _x(rng, n=2, c=3, s=32):
    return rng.normal(0, 1, (n, c, s, s)).astype(np.float32)


# -- names, shapes, counts (no torchvision) --------------------------------------------------------


def test_list_models_is_the_fixture():
    assert NAMES == sorted(TV)
    assert NAMES == sorted(NAMES) and "mobilenet_v3_large" in NAMES


@pytest.mark.parametrize("name", NAMES)
def test_state_dict_keys_and_shapes_are_torchvision(name):
    net = models.get_model(name)
    try:
        sd = net.state_dict()
        want = {k: tuple(s) for k, s in TV[name]["state_dict"]}
        assert sorted(sd) == sorted(want)
        assert {k: v.shape for k, v in sd.items()} == want
        assert sum(p.size for p in net.parameters()) == TV[name]["num_params"]
        # and utensil loads what it saved, strictly (the keys and shapes are its own)
        net.load_state_dict(sd)
    finally:
        net.close()


@pytest.mark.parametrize("name", ["mobilenet_v3_small", "mnasnet0_5", "efficientnet_b0"])
def test_fused_and_unfused_have_one_state_dict_and_one_function(rng, name):
    a = models.get_model(name, num_classes=5, fused=True)
    b = models.get_model(name, num_classes=5, fused=False)
    try:
        assert sorted(a.state_dict()) == sorted(b.state_dict())
        b.load_state_dict(a.state_dict())
        a.eval(), b.eval()
        x = _x(rng)
        ya, yb = a(x), b(x)
        np.testing.assert_allclose(ya.numpy(), yb.numpy(), rtol=1e-5, atol=1e-6)
        ya.close(), yb.close()
        acts = (ut.ReLU, ut.ReLU6, ut.SiLU, ut.Hardswish)
        n_fused = sum(isinstance(m, acts) for m in a.modules())
        n_plain = sum(isinstance(m, acts) for m in b.modules())
        in_bn = sum(m.activation is not None for m in a.modules() if isinstance(m, ut.BatchNorm2d))
        assert n_plain - n_fused == in_bn  # each fused one replaced a module
        assert in_bn > 0 or name != "mnasnet0_5"  # ReLU: fused wherever BatchNorm2d is
        assert all(m.activation is None for m in b.modules() if isinstance(m, ut.BatchNorm2d))
    finally:
        a.close(), b.close()


def test_fusion_follows_batchnorm_activations(monkeypatch):
    # an activation BatchNorm2d does not apply stays a separate module
    monkeypatch.setattr(ut.BatchNorm2d, "_ACTIVATIONS",
                        {k: v for k, v in ut.BatchNorm2d._ACTIVATIONS.items() if k != "relu"})
    net = models.mnasnet0_5(num_classes=3)
    try:
        assert any(isinstance(m, ut.ReLU) for m in net.modules())
        assert all(m.activation is None for m in net.modules() if isinstance(m, ut.BatchNorm2d))
    finally:
        net.close()


def test_builder_arguments():
    with pytest.raises(ut.ArgumentError, match="does not download"):
        models.mobilenet_v2(weights="IMAGENET1K_V1")
    with pytest.raises(TypeError, match="block"):
        models.get_model("efficientnet_b0", block=None)
    with pytest.raises(ut.ArgumentError, match="unknown model"):
        models.get_model("resnet50")
    with pytest.raises(TypeError):
        models.mobilenet_v2(1000)  # keyword-only, as torchvision's
    net = models.get_model("MobileNet_V3_Small", num_classes=7, in_channels=1, width_mult=0.5)
    try:
        sd = net.state_dict()
        assert sd["features.0.0.weight"].shape == (8, 1, 3, 3)
        assert sd["classifier.3.weight"].shape[0] == 7
        y = net.eval()(np.zeros((1, 1, 32, 32), np.float32))
        assert y.shape == (1, 7)
        y.close()
    finally:
        net.close()
    assert models.get_model_builder("convnext_tiny") is models.convnext_tiny
    net = models.mnasnet0_5(num_classes=3)
    try:  # Sequential's own .layers wins over MNASNet's child of that name: net[0]
        assert [k for k, _ in net.named_children()] == ["layers", "pool", "classifier"]
        assert net.layers == [net[0], net[1], net.classifier]
    finally:
        net.close()


def test_efficientnet_variants_dropout_and_stochastic_depth():
    for name, p in (("efficientnet_b0", 0.2), ("efficientnet_b2", 0.3)):
        net = models.get_model(name, num_classes=3)
        try:
            assert net.classifier[0].p == pytest.approx(p)
            probs = [m.p for m in net.modules() if isinstance(m, ut.StochasticDepth)]
            n = len(probs)
            np.testing.assert_allclose(probs, [0.2 * i / n for i in range(n)], rtol=1e-6)
        finally:
            net.close()
    net = models.convnext_tiny(num_classes=3, stochastic_depth_prob=0.5)
    try:
        probs = [m.p for m in net.modules() if isinstance(m, ut.StochasticDepth)]
        np.testing.assert_allclose(probs, [0.5 * i / 17 for i in range(18)], rtol=1e-6)
    finally:
        net.close()


# -- initialisation ------------------------------------------------------------------------------


def test_seed_makes_a_model_repeat():
    ut.seed(5)
    a = models.mnasnet0_5(num_classes=4)
    ut.seed(5)
    b = models.mnasnet0_5(num_classes=4)
    c = models.mnasnet0_5(num_classes=4)
    try:
        sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
        for k in sa:
            np.testing.assert_array_equal(sa[k], sb[k], err_msg=k)
        assert not np.array_equal(sa["layers.0.weight"], sc["layers.0.weight"])
    finally:
        a.close(), b.close(), c.close()


def test_initialisation_is_torchvisions():
    ut.seed(0)
    net = models.efficientnet_b0(num_classes=500)
    try:
        sd = net.state_dict()
        w = sd["features.8.0.weight"]  # Conv2d 320 -> 1280, fan_out 1280
        assert np.std(w) == pytest.approx(np.sqrt(2.0 / 1280), rel=0.02)
        dw = sd["features.2.0.block.1.0.weight"]  # depthwise 3x3 on 96: fan_out 96 * 9
        assert np.std(dw) == pytest.approx(np.sqrt(2.0 / (96 * 9)), rel=0.1)
        lin = sd["classifier.1.weight"]  # U(-1/sqrt(500), 1/sqrt(500))
        bound = 1 / np.sqrt(500)
        assert np.abs(lin).max() <= bound and np.abs(lin).max() > 0.99 * bound
        assert np.std(lin) == pytest.approx(bound / np.sqrt(3), rel=0.02)
        assert not sd["classifier.1.bias"].any()
        assert (sd["features.0.1.weight"] == 1).all() and not sd["features.0.1.bias"].any()
        assert not sd["features.1.0.block.1.fc1.bias"].any()
    finally:
        net.close()
    net = models.mobilenet_v3_small(num_classes=500)
    try:
        w = net.state_dict()["classifier.0.weight"]  # N(0, 0.01)
        assert np.std(w) == pytest.approx(0.01, rel=0.02) and abs(np.mean(w)) < 1e-3
    finally:
        net.close()
    net = models.mnasnet0_5(num_classes=300)
    try:
        w = net.state_dict()["classifier.1.weight"]  # kaiming_uniform fan_out, gain 1
        assert np.abs(w).max() <= np.sqrt(3 / 300)
        assert np.std(w) == pytest.approx(np.sqrt(1 / 300), rel=0.03)
    finally:
        net.close()
    net = models.convnext_tiny(num_classes=10)
    try:
        sd = net.state_dict()
        w = sd["features.5.0.block.3.weight"]  # trunc_normal std 0.02
        assert np.std(w) == pytest.approx(0.02, rel=0.01) and np.abs(w).max() <= 2.0
        assert (sd["features.1.0.layer_scale"] == np.float32(1e-6)).all()
        assert sd["features.1.0.layer_scale"].shape == (96, 1, 1)
        assert (sd["classifier.0.weight"] == 1).all()
    finally:
        net.close()


# -- running (no torchvision) ----------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(FAMILY))
def test_forward_train_step_eval_and_copies(rng, name):
    ut.seed(1)
    net = models.get_model(name, num_classes=4, **FAMILY[name])
    crit = ut.CrossEntropyLoss()
    x = _x(rng, n=4, s=32)
    labels = np.array([0, 1, 2, 3])
    try:
        assert net.training
        y = net(x)
        assert y.shape == (4, 4)
        loss0 = _loss(crit, y, labels)
        y.close()
        g = crit.backward()
        net.zero_grad()
        assert net.backward(g, input_grad=False) is None
        g.close()
        assert all(np.isfinite(p.grad.numpy()).all() for p in net.parameters())
        assert sum(float(np.abs(p.grad.numpy()).sum()) for p in net.parameters()) > 0
        before = [p.numpy().copy() for p in net.parameters()]
        # one step (the gradients themselves are checked against torch autograd below; a
        # loss-decrease check is not robust with batch statistics over 4 x 1 x 1 values)
        SGD(net.parameters(), lr=1e-3).step()
        assert any(not np.array_equal(b, p.numpy()) for b, p in zip(before, net.parameters()))
        y = net(x)
        loss1 = _loss(crit, y, labels)
        y.close()
        assert np.isfinite(loss0) and np.isfinite(loss1) and loss1 != loss0

        net.eval()
        assert not any(m.training for m in net.modules())
        y1, y2 = net(x), net(x)
        np.testing.assert_array_equal(y1.numpy(), y2.numpy())
        for how in (copy.deepcopy, lambda m: pickle.loads(pickle.dumps(m))):
            c = how(net)
            try:
                assert not c.training
                yc = c(x)
                np.testing.assert_array_equal(yc.numpy(), y1.numpy())
                yc.close()
            finally:
                c.close()
        net.train()
        y3 = net(x)  # batch statistics again: not the eval output (ConvNeXt has none)
        assert np.allclose(y3.numpy(), y1.numpy()) == (name == "convnext_tiny")
        for t in (y1, y2, y3):
            t.close()
    finally:
        net.close()


def test_input_gradient_and_repr(rng):
    net = models.mobilenet_v3_small(num_classes=3, dropout=0.0)
    try:
        x = _x(rng, s=32)
        y = net(x)
        dx = net.backward(ut.ones(y.shape))
        assert dx.shape == x.shape and np.abs(dx.numpy()).sum() > 0
        dx.close(), y.close()
        r = repr(net)
        assert "(features): Sequential(" in r and "InvertedResidual(use_res_connect=" in r
        assert "SqueezeExcitation(" in r and "(classifier): Sequential(" in r
        assert net.features[1].block[1].fc1 is net.features[1].block[1].fc1
    finally:
        net.close()


@pytest.mark.parametrize("name", sorted(FAMILY))
def test_cuda_matches_cpu(rng, name):
    """The model built on the GPU: training-mode logits, parameter gradients and running
    statistics, then eval logits, as the CPU's (skipped without a GPU)."""
    require_device("cuda")
    ut.seed(2)
    cpu = models.get_model(name, num_classes=5, **FAMILY[name])
    gpu = models.get_model(name, num_classes=5, device="cuda", **FAMILY[name])
    try:
        gpu.load_state_dict(cpu.state_dict())
        assert all(p.device == "cuda" for p in gpu.parameters())
        x = _x(rng, n=4, s=64)
        g = rng.normal(0, 1, (4, 5)).astype(np.float32)
        ys = []
        for net, dev in ((cpu, "cpu"), (gpu, "cuda")):
            y = net(x)
            ys.append(y.numpy().copy())
            y.close()
            with ut.tensor(g, dev) as gt:
                net.backward(gt, input_grad=False)
        np.testing.assert_allclose(ys[1], ys[0], rtol=0, atol=1e-4 * np.abs(ys[0]).max())
        grads = {k: p.grad.numpy() for k, p in cpu.named_parameters()}
        floor = 1e-3 * max(np.linalg.norm(v) for v in grads.values())
        for k, p in gpu.named_parameters():
            err = np.linalg.norm(p.grad.numpy() - grads[k])
            # float32 both, through batch statistics over 16 values: ill-conditioned (float32
            # torch is 1e-4 .. 1e-2 from float64 here); a wrong gradient is off by ~1
            assert err <= 1e-2 * max(np.linalg.norm(grads[k]), floor), k
        sc, sg = cpu.state_dict(), gpu.state_dict()
        for k in sc:
            if "running" in k:
                np.testing.assert_allclose(sg[k], sc[k], rtol=1e-4, atol=1e-5, err_msg=k)
        cpu.eval(), gpu.eval()
        yc, yg = cpu(x), gpu(x)
        np.testing.assert_allclose(yg.numpy(), yc.numpy(), rtol=0,
                                   atol=1e-4 * np.abs(yc.numpy()).max())
        yc.close(), yg.close()
    finally:
        cpu.close(), gpu.close()


# -- against torchvision -------------------------------------------------------------------------


def _torchvision():
    torch = pytest.importorskip("torch")
    tv = pytest.importorskip("torchvision")
    torch.set_num_threads(1)  # on a small shared CPU, threads only contend
    return torch, tv


def _randomise(torch, m, seed):
    """Non-trivial BatchNorm statistics and affine values, and layer scales of order 1."""
    gen = torch.Generator().manual_seed(seed)

    def u(t, lo, hi):
        t.copy_(torch.rand(t.shape, generator=gen) * (hi - lo) + lo)

    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, torch.nn.BatchNorm2d):
                u(mod.running_mean, -0.5, 0.5)
                u(mod.running_var, 0.5, 2.0)
                u(mod.weight, 0.5, 1.5)
                u(mod.bias, -0.2, 0.2)
                mod.num_batches_tracked.fill_(7)
            ls = getattr(mod, "layer_scale", None)
            if isinstance(ls, torch.nn.Parameter):
                u(ls, 0.5, 1.5)


def _to_torch(torch, sd):
    out = collections.OrderedDict((k, torch.from_numpy(np.array(v))) for k, v in sd.items())
    out._metadata = {"": {"version": 2}}  # MNASNet's check (see utensil_ffi.models.mnasnet)
    return out


@pytest.mark.parametrize("name", NAMES)
def test_eval_logits_match_torchvision(rng, name):
    torch, tv = _torchvision()
    torch.manual_seed(0)
    ref = tv.models.get_model(name, num_classes=10).eval()
    _randomise(torch, ref, 1)
    net = models.get_model(name, num_classes=10).eval()
    try:
        net.load_state_dict({k: v.numpy() for k, v in ref.state_dict().items()})
        x = _x(rng, n=2, s=64)
        y = net(x)
        with torch.no_grad():
            want = ref(torch.from_numpy(x)).numpy()
        scale = np.abs(want).max()
        np.testing.assert_allclose(y.numpy(), want, rtol=0, atol=1e-4 * scale)
        y.close()
        # and back: utensil's state dict loads strictly into torchvision, unchanged
        back = tv.models.get_model(name, num_classes=10)
        back.load_state_dict(_to_torch(torch, net.state_dict()), strict=True)
        for k, v in back.state_dict().items():
            np.testing.assert_array_equal(v.numpy(), ref.state_dict()[k].numpy(), err_msg=k)
    finally:
        net.close()


@pytest.mark.parametrize("name", sorted(FAMILY))
def test_training_gradients_match_torch_autograd(rng, name):
    """One training-mode forward and backward (batch statistics, dropout and stochastic depth
    0): every parameter gradient against torch autograd in float64 (float32 torch itself is off
    by ~1e-4 where batch statistics over 2 x 2 x 2 values amplify rounding)."""
    torch, tv = _torchvision()
    torch.manual_seed(0)
    ref = tv.models.get_model(name, num_classes=10, **FAMILY[name])
    _randomise(torch, ref, 2)
    net = models.get_model(name, num_classes=10, **FAMILY[name])
    try:
        net.load_state_dict({k: v.numpy() for k, v in ref.state_dict().items()})
        ref32 = copy.deepcopy(ref).train()
        ref = ref.double().train()
        # ConvNeXt normalizes each position (no batch statistics): 32x32 is enough and quicker
        x = _x(rng, n=2, s=32 if name == "convnext_tiny" else 64)
        g = rng.normal(0, 1, (2, 10)).astype(np.float32)
        dxs = []
        for m, dt in ((ref, torch.float64), (ref32, torch.float32)):
            xt = torch.from_numpy(x).to(dt).requires_grad_(True)
            out = m(xt)
            (out * torch.from_numpy(g).to(dt)).sum().backward()
            dxs.append(xt.grad.numpy())
        out = out.detach().double()
        y = net(x)
        np.testing.assert_allclose(y.numpy(), out.numpy(), rtol=0,
                                   atol=1e-4 * float(out.abs().max()))
        y.close()
        dx = net.backward(ut.tensor(g))
        # the input's gradient through batch statistics over few values is ill-conditioned
        # (EfficientNet's: float32 torch is off by more than its norm): utensil's error may be
        # a few times float32 torch's, not more
        want, t32 = dxs
        err = np.linalg.norm(dx.numpy() - want)
        assert err <= 4 * np.linalg.norm(t32 - want) + 1e-4 * np.linalg.norm(want)
        dx.close()
        grads = {k: p.grad.numpy() for k, p in ref.named_parameters()}
        grads32 = {k: p.grad.numpy() for k, p in ref32.named_parameters()}
        # a gradient that is zero in exact arithmetic (a bias before a batch-statistics
        # BatchNorm) is float32 noise here: measured against the largest gradient's norm; and
        # as for dx, utensil may be off by a few times what float32 torch is
        floor = 1e-3 * max(np.linalg.norm(v) for v in grads.values())
        for k, p in net.named_parameters():
            got = p.grad.numpy().reshape(grads[k].shape)
            err = np.linalg.norm(got - grads[k])
            budget = (4 * np.linalg.norm(grads32[k] - grads[k])
                      + 1e-3 * max(np.linalg.norm(grads[k]), floor))
            assert err <= budget, "%s: error %.2e, allowed %.2e" % (k, err, budget)
        # the running statistics were updated as torch's (momentum per family)
        want_sd = ref.state_dict()
        for k, v in net.state_dict().items():
            if "running" in k:
                np.testing.assert_allclose(v, want_sd[k].numpy(), rtol=1e-4, atol=1e-5,
                                           err_msg=k)
    finally:
        net.close()


@pytest.mark.parametrize("name", ["mobilenet_v2", "mobilenet_v3_small", "efficientnet_b0",
                                  "mnasnet0_5"])
def test_stem_stride_one_keeps_small_images_and_the_keys(name):
    """utensil's stem_stride: the stem's output keeps a 32 px image's size (torchvision's
    stride 2 halves it) and the state_dict is the same, so either loads the other's."""
    x = np.random.default_rng(0).standard_normal((2, 3, 32, 32)).astype(np.float32)
    sizes, keys = {}, {}
    for s in (1, 2):
        ut.seed(0)
        net = models.get_model(name, num_classes=5, stem_stride=s)
        try:
            stem = net[0][0]  # features.0 (a conv + BN + act), or MNASNet's layers.0 (a conv)
            y = stem.eval()(x)
            sizes[s] = y.shape[2:]
            y.close()
            sd = net.state_dict()
            keys[s] = [(k, v.shape) for k, v in sd.items()]
            if s == 1:
                logits = net.eval()(x)
                assert logits.shape == (2, 5) and np.isfinite(logits.numpy()).all()
                logits.close()
        finally:
            net.close()
    assert sizes == {1: (32, 32), 2: (16, 16)}
    assert keys[1] == keys[2]
    for bad, err in ((3, ut.ArgumentError), (0, ut.ArgumentError), ("1", TypeError)):
        with pytest.raises(err, match="stem_stride"):
            models.get_model(name, stem_stride=bad)


@pytest.mark.parametrize("name", sorted(FAMILY))
def test_mixed_precision_runs_every_family(device, rng, name):
    """ut.MixedPrecision (bf16 activations) over each family. Eval logits follow the float32
    network's with the same weights within bf16's rounding (0.2-2% measured). A training step
    gives finite float32 gradients to every parameter; they are compared with float32's only
    for ConvNeXt: with batch statistics a freshly initialised BatchNorm network is chaotic
    (rounding only the input to bf16 moves MobileNetV2's float32 training logits by 6%), so
    there bf16 and float32 gradients differ by order 1 with nothing wrong. ConvNeXt's head
    LayerNorm runs on bf16 rows (it refused them before)."""
    # stem stride 1 (not ConvNeXt's): 32 px would else end in 1x1 planes
    kw = dict(FAMILY[name], **({} if name.startswith("convnext") else {"stem_stride": 1}))
    ut.seed(3)
    ref = models.get_model(name, num_classes=4, device=device, **kw)
    net = models.get_model(name, num_classes=4, device=device, **kw)
    mp = ut.MixedPrecision(net, dtype=ut.bfloat16)
    x = _x(rng, n=4, s=32)
    g = rng.normal(0, 1, (4, 4)).astype(np.float32)

    def rel(a, b):
        return float(np.linalg.norm(a - b) / np.linalg.norm(b))

    try:
        ref(x).close()  # running statistics off their (0, 1) start
        net.load_state_dict(ref.state_dict())
        outs = []
        for m in (ref, mp):
            m.zero_grad()
            y = m(x)
            assert y.dtype == ut.float32
            y.close()
            with ut.tensor(g, device) as gt:  # a numpy gradient would be a CPU tensor
                assert m.backward(gt, input_grad=False) is None
            m.eval()
            y = m(x)
            outs.append(y.numpy().astype(np.float64))
            y.close()
        assert rel(outs[1], outs[0]) < 0.05
        want = np.concatenate([p.grad.numpy().ravel() for p in ref.parameters()])
        got = np.concatenate([p.grad.numpy().ravel() for p in net.parameters()])
        assert all(p.dtype == p.grad.dtype == ut.float32 for p in net.parameters())
        assert np.isfinite(got).all() and np.abs(got).sum() > 0
        if name.startswith("convnext"):
            assert rel(got, want) < 0.02
    finally:
        mp.close()
        ref.close()
