"""Squeeze-and-excitation inside the separable block's C call (ut_separable_block's se_*; issue
32): an eval-mode MBConv (EfficientNet: SiLU, Sigmoid) or MobileNetV3 block ([1x1] ->
depthwise -> SqueezeExcitation -> 1x1) runs as one call instead of three folded steps and six
Python module calls, and on the CPU the excitation scales the project's weight per image (or
the batch-merged product's regrouped columns over small planes) instead of the depthwise's
output. Checked against a float64 numpy reference and the layers' own forwards, and the plan
against changes to the SqueezeExcitation's parts."""

import numpy as np
import pytest

import utensil_ffi as ut
from tolerances import assert_close
from utensil_ffi import models
from utensil_ffi import reference as R
from utensil_ffi._lib import ffi, lib
from utensil_ffi.nn import fold

from test_separable_block import (_bn, _bn_ref, _conv_ref, _folded_and_not,
                                  _random_running_stats)

_ACTS = {"efficientnet": (ut.SiLU, ut.Sigmoid, R.silu, R.sigmoid),
         "mobilenet_v3": (ut.ReLU, ut.Hardsigmoid, R.relu, R.hardsigmoid)}


@pytest.fixture(autouse=True)
def _fold_on():
    prev = fold.set_inference_fold(True)
    yield
    fold.set_inference_fold(prev)


def _mbconv(cin, e, cout, k, stride, kind, rng, expand=True):
    """[Conv2d 1x1, BN(act)], DWConv2d k, BN(act), SqueezeExcitation, Conv2d 1x1, BN: a list."""
    act, scale_act = _ACTS[kind][:2]
    bn_act = "silu" if kind == "efficientnet" else "hardswish"
    layers = []
    if expand:
        layers += [ut.Conv2d(cin, e, 1, bias=False), _bn(e, bn_act, rng)]
    layers += [ut.DWConv2d(e, k, stride=stride, padding=k // 2, bias=False), _bn(e, bn_act, rng),
               ut.SqueezeExcitation(e, max(1, e // 4), act, scale_act),
               ut.Conv2d(e, cout, 1, bias=False), _bn(cout, None, rng)]
    for l in layers:
        convs = [l.fc1, l.fc2] if isinstance(l, ut.SqueezeExcitation) else [l]
        for c in convs:
            if isinstance(c, ut.BatchNorm2d):
                continue
            c.weight.copy_from(rng.normal(0, 0.4, c.weight.shape).astype(np.float32))
            if c._bias is not None:
                c.bias.copy_from(rng.normal(0, 0.5, c.bias.shape).astype(np.float32))
        l.eval()
    return layers


def _reference(layers, x, kind):
    """float64: the layers in turn, the SqueezeExcitation as x * s(mean of x)."""
    act, scale_act = _ACTS[kind][2:]
    y = np.asarray(x, np.float64)
    i = 0
    while i < len(layers):
        l = layers[i]
        if isinstance(l, ut.SqueezeExcitation):
            p = R.global_avg_pool2d(y)[:, :, None, None]
            s = scale_act(_conv_ref(l.fc2, act(_conv_ref(l.fc1, p))))
            y = y * s
            i += 1
        else:
            y = _bn_ref(layers[i + 1], _conv_ref(l, y))
            i += 2
    return y


def _spy(monkeypatch):
    calls = []
    real = fold.separable_forward

    def spy(plan, x, residual=False):
        calls.append(plan[3] is not None)
        return real(plan, x, residual)

    monkeypatch.setattr(fold, "separable_forward", spy)
    return calls


# (name, cin, e, cout, kernel, stride, (h, w), expand, batch): batch 3 over planes under 256
# values takes the batch-merged product (the scale on its regrouped columns); the others the
# per-image one, the scale on the weight or, where a plane has fewer values than the project
# has outputs, on a copy of the columns
GEOMS = [
    ("7x7-b1", 16, 96, 24, 3, 1, (7, 7), True, 1),
    ("4x4-b1-columns", 16, 64, 40, 3, 1, (4, 4), True, 1),
    ("7x7-b3-merged", 16, 96, 16, 5, 1, (7, 7), True, 3),
    ("s2-14x14-b3-merged", 12, 72, 20, 3, 2, (14, 14), True, 3),
    ("20x18-b3", 8, 48, 8, 5, 1, (20, 18), True, 3),
    ("no-expand-12x12-b2", 32, 32, 16, 3, 1, (12, 12), False, 2),
    ("no-expand-24x24-b1", 16, 16, 24, 3, 2, (24, 24), False, 1),
]


@pytest.mark.parametrize("kind", sorted(_ACTS))
@pytest.mark.parametrize("geom", GEOMS, ids=[g[0] for g in GEOMS])
def test_block_with_se_matches_layers_and_float64(geom, kind, device, monkeypatch):
    """Both devices: the GPU's call runs the layers (composed of the ops themselves)."""
    _, cin, e, cout, k, s, (h, w), expand, n = geom
    rng = np.random.default_rng(11)
    layers = [l.to(device) for l in _mbconv(cin, e, cout, k, s, kind, rng, expand)]
    x = rng.standard_normal((n, cin, h, w)).astype(np.float32)
    residual = s == 1 and cin == cout
    calls = _spy(monkeypatch)
    body = ut.Sequential(*layers).eval()
    net = ut.Residual(body).eval() if residual else body
    got, unfused = _folded_and_not(net, x)
    assert calls == [True]  # one call, its plan with the SE
    want = _reference(layers, x, kind) + (x if residual else 0)
    assert_close("float64", got, want, rtol=1e-4, atol=1e-5)
    assert_close("layers", got, unfused, rtol=1e-5, atol=1e-6)


def test_the_networks_se_blocks_take_one_call(monkeypatch):
    """EfficientNet-B0 and MobileNetV3-Small in eval mode: every MBConv / inverted residual
    with squeeze-and-excitation is one separable call, with or without an expand."""
    calls = _spy(monkeypatch)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 64, 64)).astype(np.float32)
    for name, net, with_se, without in [("efficientnet_b0", models.efficientnet_b0(), 16, 0),
                                        ("mobilenet_v3_small", models.mobilenet_v3_small(), 9, 2)]:
        _random_running_stats(net, rng).eval()
        calls.clear()
        got, want = _folded_and_not(net, x)
        assert (calls.count(True), calls.count(False)) == (with_se, without), name
        assert_close(name, got, want, rtol=1e-4, atol=1e-5)


def test_a_changed_se_changes_the_plan(monkeypatch):
    """The kept plan follows the SqueezeExcitation's parts: a new fc1, an activation without a
    C code (the SE then runs itself: no chain), an SE in training mode."""
    calls = _spy(monkeypatch)
    rng = np.random.default_rng(12)
    layers = _mbconv(8, 32, 8, 3, 1, "efficientnet", rng)
    se = layers[4]
    block = models._blocks.InvertedResidual(ut.Sequential(*layers), True).eval()
    x = rng.standard_normal((1, 8, 9, 9)).astype(np.float32)

    def check(chain):
        calls.clear()
        got, unfused = _folded_and_not(block, x)
        assert calls == ([True] if chain else []), calls
        assert_close("output", got, unfused, rtol=1e-5, atol=1e-6)
        return got

    first = check(True)
    fc1 = ut.Conv2d(32, 8, 1).eval()
    fc1.weight.copy_from(rng.normal(0, 1.0, (8, 32, 1, 1)).astype(np.float32))
    se.fc1 = fc1
    assert np.abs(check(True) - first).max() > 1e-3  # the new fc1 is used

    class OwnSiLU(ut.SiLU):  # no C code: the C call cannot run it
        _fold_act = None

    se.activation = OwnSiLU()
    check(False)
    se.activation = ut.SiLU()
    se.train()
    se.fc1.eval(), se.fc2.eval()
    calls.clear()
    with block(x) as y:  # the SE trains: the block runs its layers
        assert y.shape == (1, 8, 9, 9)
    assert calls == []
    se.eval()
    check(True)


def test_refusals():
    rng = np.random.default_rng(13)
    layers = _mbconv(4, 8, 4, 3, 1, "efficientnet", rng)
    plan = fold.separable_plan(ut.Sequential(*layers))
    assert plan is not None and plan[3] is not None
    x = np.zeros((1, 4, 6, 6), np.float32)
    blk = ffi.new("ut_separable_block *")
    conv = lambda l: l._h.enter()  # noqa: E731
    try:
        blk.expand, blk.bn_expand = conv(layers[0]), conv(layers[1])
        blk.dw, blk.bn_dw = conv(layers[2]), conv(layers[3])
        blk.project, blk.bn_project = conv(layers[5]), conv(layers[6])
        blk.se_reduce = conv(layers[4].fc1)
        with ut.Tensor(x) as xt:
            assert lib.ut_separable_block_forward(blk, xt._ptr) == ffi.NULL
            assert "se_reduce and se_expand" in ffi.string(lib.ut_last_error()).decode()
            blk.se_expand = conv(layers[4].fc1)  # 8 -> 2 where 2 -> 8 belongs
            assert lib.ut_separable_block_forward(blk, xt._ptr) == ffi.NULL
            assert "to r and back" in ffi.string(lib.ut_last_error()).decode()
    finally:
        for l in layers[:4] + layers[5:] + [layers[4].fc1, layers[4].fc1]:
            l._h.state.leave()
    layers[4].fc2.close()
    with pytest.raises(ut.ClosedError):
        fold.separable_forward(plan, x)
