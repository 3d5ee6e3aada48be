"""Issue 32's inference fold: an eval-mode convolution and the BatchNorm2d after it in one C call
(ut_conv2d_bn_forward, ut_dwconv2d_bn_forward; Sequential through nn/fold.py).

Each case is checked against the two layers' own forwards (set_inference_fold(False)) and a
float64 numpy reference; the fold is recomputed per call, so every way of changing a weight or a
statistic (load_state_dict, an optimizer step, copy_from, a numpy view, a training forward) must
show in the next eval forward. Training mode and its gradients must not notice the fold."""

import numpy as np
import pytest

import utensil_ffi as ut
from tolerances import assert_close
from utensil_ffi import models
from utensil_ffi import reference as R
from utensil_ffi._lib import ffi, lib
from utensil_ffi.nn import fold

ACTS = [None, "relu", "relu6", "silu", "hardswish", "hardsigmoid", "sigmoid", "gelu",
        "gelu_tanh"]

_REF_ACT = {None: lambda z: z, "relu": R.relu, "relu6": R.relu6, "silu": R.silu,
            "hardswish": R.hardswish, "hardsigmoid": R.hardsigmoid, "sigmoid": R.sigmoid,
            "gelu": R.gelu, "gelu_tanh": lambda z: R.gelu(z, approximate="tanh")}


@pytest.fixture(autouse=True)
def _fold_on():
    prev = fold.set_inference_fold(True)
    yield
    fold.set_inference_fold(prev)


def _randomise_bn(bn, rng):
    c = bn.num_features
    bn.running_mean = rng.normal(0.0, 0.5, c).astype(np.float32)
    bn.running_var = rng.uniform(0.3, 3.0, c).astype(np.float32)
    bn.weight.copy_from(rng.uniform(-1.5, 1.5, c).astype(np.float32))  # negative gammas too
    bn.bias.copy_from(rng.normal(0.0, 0.5, c).astype(np.float32))


def _unfolded(model, x):
    prev = fold.set_inference_fold(False)
    try:
        with model(x) as y:
            return y.numpy().copy()
    finally:
        fold.set_inference_fold(prev)


def _folded(model, x):
    with model(x) as y:
        return y.numpy().copy()


def _reference(conv, bn, x):
    """float64: the convolution, the BatchNorm with its running statistics, the activation."""
    x = np.asarray(x, np.float64)
    w = conv.weight.numpy().astype(np.float64)
    b = None if conv._bias is None else conv.bias.numpy().astype(np.float64)
    if isinstance(conv, ut.DWConv2d):
        y = R.dwconv2d(x, w, b, conv.stride, conv.padding, conv.dilation)
    else:
        y = R.conv2d(x, w, b, conv.stride, conv.padding)
    z = R.batchnorm2d_eval(y, bn.weight.numpy().astype(np.float64),
                           bn.bias.numpy().astype(np.float64),
                           bn.running_mean.numpy().astype(np.float64),
                           bn.running_var.numpy().astype(np.float64), bn.eps)
    return _REF_ACT[bn.activation](z)


def _check(name, model, conv, bn, x):
    got = _folded(model, x)
    assert_close(name + " vs float64", got, _reference(conv, bn, x), rtol=1e-4, atol=2e-6)
    assert_close(name + " vs unfolded", got, _unfolded(model, x), rtol=1e-5, atol=2e-6)
    return got


# (name, convolution factory, input channels, spatial size): each engine and GEMM form the fold
# runs through: im2col GEMM (padded, strided, kh != kw, with bias), the pointwise GEMM per image
# and over a merged batch (small planes), the regrouped k x k without padding, depthwise plain,
# strided (the stride-1 detour too), dilated, with a channel multiplier (PyTorch's grouped
# Conv2d(C, 2C, groups=C)) and with kh != kw.
GEOMS = [
    ("dense3x3s1p1", lambda: ut.Conv2d(5, 7, 3, padding=1), 5, (9, 11)),
    ("dense3x5s2p2+bias", lambda: ut.Conv2d(4, 6, (3, 5), stride=2, padding=2), 4, (10, 9)),
    ("dense1x1", lambda: ut.Conv2d(6, 9, 1, bias=False), 6, (17, 18)),
    ("dense1x1-small-plane", lambda: ut.Conv2d(8, 12, 1, bias=False), 8, (5, 5)),
    # 156 values a plane: merged over a batch in training, per image in inference (its
    # weight's panels kept)
    ("dense1x1-156-plane", lambda: ut.Conv2d(10, 14, 1), 10, (12, 13)),
    ("dense2x2s2p0", lambda: ut.Conv2d(4, 8, 2, stride=2, bias=False), 4, (8, 8)),
    # K = 32 * 9 = 288 > the GEMM's 256-deep blocks: the epilogue after the last one only
    ("dense3x3-K288", lambda: ut.Conv2d(32, 10, 3, padding=1, bias=False), 32, (7, 9)),
    # the GEMM's panels packed straight from x (no column matrix): output rows that cross
    # panels and column blocks (P > 1024), strides 2 and 3, 1x1 strided, padding 0 and beyond
    # the kernel's half, K > 256 over several k blocks
    ("dense3x3s2p1-stem", lambda: ut.Conv2d(3, 16, 3, stride=2, padding=1), 3, (66, 70)),
    ("dense7x7s2p3", lambda: ut.Conv2d(3, 8, 7, stride=2, padding=3, bias=False), 3, (45, 38)),
    ("dense1x1s2", lambda: ut.Conv2d(5, 7, 1, stride=2, bias=False), 5, (21, 20)),
    ("dense5x3s3p2-K300", lambda: ut.Conv2d(20, 9, (5, 3), stride=3, padding=2), 20, (40, 31)),
    ("dense3x3p0", lambda: ut.Conv2d(4, 6, 3, bias=False), 4, (30, 40)),
    ("dense3x3p2", lambda: ut.Conv2d(3, 5, 3, padding=2, bias=False), 3, (12, 50)),
    # the panels' phase rows: output rows longer than one fill (256 columns), ConvNeXt's 4x4
    # stride-4 patchify, a 1x7 row at stride 2, and a 17x17 stride 17 whose 17 phase rows do
    # not fit (the gather instead)
    ("dense3x3s2p1-long-rows", lambda: ut.Conv2d(3, 8, 3, stride=2, padding=1), 3, (7, 600)),
    ("dense4x4s4", lambda: ut.Conv2d(3, 8, 4, stride=4, bias=False), 3, (16, 20)),
    ("dense1x7s2p3", lambda: ut.Conv2d(3, 6, (1, 7), stride=2, padding=3, bias=False), 3,
     (8, 29)),
    ("dense17x17s17", lambda: ut.Conv2d(2, 4, 17, stride=17, bias=False), 2, (34, 36)),
    ("dw3x3s1p1", lambda: ut.DWConv2d(6, 3, padding=1, bias=False), 6, (13, 12)),
    ("dw3x3s2p1+bias", lambda: ut.DWConv2d(6, 3, stride=2, padding=1), 6, (14, 15)),
    ("dw5x5s2p2", lambda: ut.DWConv2d(5, 5, stride=2, padding=2, bias=False), 5, (16, 16)),
    ("dw7x7s1p3", lambda: ut.DWConv2d(4, 7, padding=3, bias=False), 4, (12, 12)),
    # wide planes: stride 2 in the planes' engine itself (the small ones above detour through
    # stride 1 and take the activation afterwards)
    ("dw3x3s2p1-wide", lambda: ut.DWConv2d(5, 3, stride=2, padding=1, bias=False), 5, (18, 40)),
    ("dw3x5-dil2", lambda: ut.DWConv2d(4, (3, 5), padding=2, dilation=2, bias=False), 4, (11, 13)),
    ("dw-grouped-x2", lambda: ut.DWConv2d(3, 3, padding=1, out_channels=6), 3, (9, 9)),
    ("dw-stride3", lambda: ut.DWConv2d(4, 3, stride=3, padding=1, bias=False), 4, (20, 19)),
    # the ReLUs in each row engine's stores: 3x3 over rows wider than the flat engine takes,
    # and a filter taller than 7 (the general row engine)
    ("dw3x3s1p1-wide", lambda: ut.DWConv2d(4, 3, padding=1, bias=False), 4, (10, 70)),
    ("dw9x1p0", lambda: ut.DWConv2d(4, (9, 1), bias=False), 4, (20, 13)),
    # pointwise over planes of 1-4 values, a depth of 32 or more (one image: the dot-product
    # engine against the weight in place, the epilogue after; three: the packed engine's
    # narrow columns), and 17 columns past a vector (AVX-512's narrow path after 16)
    ("dense1x1-1x1-plane", lambda: ut.Conv2d(40, 12, 1, bias=False), 40, (1, 1)),
    ("dense1x1-2x2-plane+bias", lambda: ut.Conv2d(64, 10, 1), 64, (2, 2)),
    ("dense1x1-17-columns", lambda: ut.Conv2d(12, 9, 1, bias=False), 12, (1, 17)),
]


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("geom", GEOMS, ids=[g[0] for g in GEOMS])
def test_fold_matches_layers_and_float64(geom, act, batch):
    name, make, cin, (h, w) = geom
    rng = np.random.default_rng(abs(hash((name, act, batch))) % 2**32)
    conv = make()
    if conv._bias is not None:
        conv.bias.copy_from(rng.normal(0, 0.5, conv.out_channels).astype(np.float32))
    bn = ut.BatchNorm2d(conv.out_channels, activation=act)
    _randomise_bn(bn, rng)
    model = ut.Sequential(conv, bn).eval()
    x = rng.standard_normal((batch, cin, h, w)).astype(np.float32) * 2
    _check("%s %s n=%d" % (name, act, batch), model, conv, bn, x)


def test_the_c_entry_points_directly():
    """conv_bn_forward (the step Sequential runs) on a Tensor and on an array-like."""
    rng = np.random.default_rng(3)
    conv, bn = ut.Conv2d(3, 4, 3, padding=1), ut.BatchNorm2d(4, activation="relu6")
    _randomise_bn(bn, rng)
    bn.eval()
    conv.eval()
    x = rng.standard_normal((2, 3, 6, 6)).astype(np.float32)
    with ut.tensor(x) as xt, fold.conv_bn_forward(conv, bn, xt) as y:
        a = y.numpy().copy()
    with fold.conv_bn_forward(conv, bn, x) as y:
        assert_close("array-like", y.numpy(), a, rtol=0, atol=0)
    assert_close("direct vs float64", a, _reference(conv, bn, x))


def test_refusals():
    conv, bn = ut.Conv2d(3, 4, 3, padding=1), ut.BatchNorm2d(4)
    x = np.zeros((1, 3, 5, 5), np.float32)
    with pytest.raises(ut.UtensilError, match="training mode"):
        fold.conv_bn_forward(conv, bn, x)  # a BatchNorm2d in training mode: no fold
    bn.eval()
    with pytest.raises(ut.ShapeError, match="channels"):
        fold.conv_bn_forward(conv, ut.BatchNorm2d(5).eval(), x)
    with pytest.raises(ut.ShapeError):
        fold.conv_bn_forward(conv, bn, np.zeros((1, 2, 5, 5), np.float32))
    dw = ut.DWConv2d(3, 3, padding=1)
    with pytest.raises(ut.ShapeError, match="channels"):
        fold.conv_bn_forward(dw, bn, x)
    bn.close()
    with pytest.raises(ut.ClosedError):
        fold.conv_bn_forward(conv, bn, x)


def test_only_eval_pairs_fold():
    conv, bn, act = ut.Conv2d(3, 4, 3, padding=1), ut.BatchNorm2d(4), ut.ReLU()
    seq = [conv, bn, act]
    assert len(fold.fold_steps(seq)) == 3  # training mode: every layer itself
    bn.eval()
    assert len(fold.fold_steps(seq)) == 3  # a training conv (frozen BatchNorm fine-tuning)
    conv.eval()
    assert len(fold.fold_steps(seq)) == 2
    assert len(fold.fold_steps([bn, conv])) == 2  # the order matters
    fold.set_inference_fold(False)
    assert len(fold.fold_steps(seq)) == 3


@pytest.mark.parametrize("layer", ["relu", "relu6", "silu", "hardswish", "hardsigmoid",
                                   "sigmoid", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("dw", [False, True])
def test_an_activation_layer_after_the_batchnorm_folds_too(layer, dw):
    """conv, BatchNorm2d (no activation), activation layer: one step, the layer's values."""
    rng = np.random.default_rng(len(layer) + 10 * dw)
    conv = ut.DWConv2d(4, 3, stride=2, padding=1) if dw else ut.Conv2d(3, 4, 3, padding=1)
    bn = ut.BatchNorm2d(4)
    _randomise_bn(bn, rng)
    act = {"relu": ut.ReLU(), "relu6": ut.ReLU6(), "silu": ut.SiLU(), "hardswish": ut.Hardswish(),
           "hardsigmoid": ut.Hardsigmoid(), "sigmoid": ut.Sigmoid(), "gelu": ut.GELU(),
           "gelu_tanh": ut.GELU(approximate="tanh")}[layer]
    model = ut.Sequential(conv, bn, act).eval()
    assert len(fold.fold_steps(model.layers)) == 1
    x = rng.standard_normal((2, 4 if dw else 3, 9, 8)).astype(np.float32) * 2
    got = _folded(model, x)
    ref = _REF_ACT[layer](_reference(conv, bn, x))
    assert_close("conv+bn+%s layer vs float64" % layer, got, ref, rtol=1e-4, atol=2e-6)
    assert_close("conv+bn+%s layer vs unfolded" % layer, got, _unfolded(model, x), rtol=1e-5,
                 atol=2e-6)
    # a BatchNorm with its own activation leaves the layer after it to itself
    bn2 = ut.BatchNorm2d(4, activation="relu").eval()
    assert len(fold.fold_steps([conv, bn2, act])) == 2
    act.train()
    assert len(fold.fold_steps([conv, bn, act])) == 2


def test_the_c_entry_refuses_two_activations():
    conv, bn = ut.Conv2d(3, 4, 1), ut.BatchNorm2d(4, activation="relu").eval()
    with pytest.raises(ut.UtensilError, match="relu already"):
        fold.conv_bn_forward(conv, bn, np.zeros((1, 3, 2, 2), np.float32), lib.UT_ACT_SILU)


def test_padded_non_finite_weight_takes_the_exact_path():
    """A padded dense conv with an inf weight: the padding contributes nothing (PyTorch's and
    the unfolded layer's rule), not NaN; the fold falls back to the layers for it."""
    rng = np.random.default_rng(5)
    conv, bn = ut.Conv2d(2, 3, 3, padding=1, bias=False), ut.BatchNorm2d(3, activation="relu")
    _randomise_bn(bn, rng)
    w = conv.weight.numpy()
    w[1, 0, 0, 0] = np.inf
    model = ut.Sequential(conv, bn).eval()
    x = rng.uniform(0.5, 1.0, (2, 2, 5, 5)).astype(np.float32)
    got, ref = _folded(model, x), _unfolded(model, x)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(ref))
    fin = np.isfinite(ref)
    assert_close("non-finite weight", got[fin], ref[fin])


# -- whole networks ------------------------------------------------------------------------------

@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("name", ["mobilenet_v2", "mobilenet_v3_small", "efficientnet_b0"])
def test_networks_fold_within_float32_rounding(name, batch):
    ut.seed(7)
    net = getattr(models, name)(num_classes=10)
    rng = np.random.default_rng(11)
    for m in net.modules():
        if isinstance(m, ut.BatchNorm2d):
            _randomise_bn(m, rng)
            m.weight.copy_from(rng.uniform(0.5, 1.5, m.num_features).astype(np.float32))
    net.eval()
    x = rng.standard_normal((batch, 3, 48, 48)).astype(np.float32)
    got, ref = _folded(net, x), _unfolded(net, x)
    scale = np.abs(ref).max()
    assert scale > 0
    assert np.abs(got - ref).max() <= 1e-4 * scale, (np.abs(got - ref).max(), scale)


# -- the fold never goes stale -------------------------------------------------------------------

def _pair(rng, act="silu", dw=False):
    conv = ut.DWConv2d(4, 3, padding=1) if dw else ut.Conv2d(3, 4, 3, padding=1)
    bn = ut.BatchNorm2d(4, activation=act)
    _randomise_bn(bn, rng)
    return conv, bn, ut.Sequential(conv, bn)


def _x(rng, cin):
    return rng.standard_normal((2, cin, 6, 7)).astype(np.float32)


def _fresh_check(name, model, conv, bn, x, before):
    got = _check(name, model, conv, bn, x)
    assert np.abs(got - before).max() > 1e-3, name + ": the output did not change"


@pytest.mark.parametrize("dw", [False, True])
def test_stale_after_load_state_dict(dw):
    rng = np.random.default_rng(21)
    conv, bn, model = _pair(rng, dw=dw)
    model.eval()
    x = _x(rng, conv.weight.shape[1] if not dw else 4)
    before = _folded(model, x)
    sd = {k: np.asarray(v).copy() for k, v in model.state_dict().items()}
    sd["0.weight"] = sd["0.weight"] * 1.5
    sd["1.running_var"] = sd["1.running_var"] * 2.0
    sd["1.running_mean"] = sd["1.running_mean"] + 0.3
    model.load_state_dict(sd)
    _fresh_check("load_state_dict", model, conv, bn, x, before)


@pytest.mark.parametrize("dw", [False, True])
def test_stale_after_an_optimizer_step(dw):
    rng = np.random.default_rng(22)
    conv, bn, model = _pair(rng, dw=dw)
    cin = 4 if dw else 3
    x = _x(rng, cin)
    model.eval()
    before = _folded(model, x)
    model.train()
    opt = ut.SGD(model.parameters(), lr=0.5)
    with model(x) as y:
        g = np.ones(y.shape, np.float32)
    opt.zero_grad()
    model.backward(g).close()
    opt.step()
    model.eval()
    _fresh_check("optimizer step", model, conv, bn, x, before)


@pytest.mark.parametrize("what", ["conv.weight", "conv.bias", "bn.weight", "bn.bias",
                                  "bn.running_mean", "bn.running_var"])
def test_stale_after_a_numpy_view_write(what):
    """A write through a numpy view is invisible to the library (no version bump): the fold,
    made per call, sees it anyway."""
    rng = np.random.default_rng(23)
    conv, bn, model = _pair(rng)
    model.eval()
    x = _x(rng, 3)
    before = _folded(model, x)
    layer, field = what.split(".")
    view = getattr(conv if layer == "conv" else bn, field).numpy()
    if field == "running_var":
        view *= 4.0
    else:
        view += 0.7
    _fresh_check("numpy view " + what, model, conv, bn, x, before)


def test_stale_after_copy_from_and_attribute_assignment():
    rng = np.random.default_rng(24)
    conv, bn, model = _pair(rng, dw=True)
    model.eval()
    x = _x(rng, 4)
    before = _folded(model, x)
    conv.weight.copy_from(conv.weight.numpy() * -1.0)
    bn.running_mean = bn.running_mean.numpy() - 0.5
    _fresh_check("copy_from", model, conv, bn, x, before)


def test_kept_weight_panels_see_every_write():
    """The CPU packs a pointwise weight's GEMM panels once and keeps them on the weight while
    its values are unchanged (ut_track_writes): a write through a numpy view, open during the
    forward or closed before it, or through a DLPack consumer must still show next time."""
    rng = np.random.default_rng(26)
    conv = ut.Conv2d(40, 24, 1)
    bn = ut.BatchNorm2d(24, activation="relu6")
    _randomise_bn(bn, rng)
    model = ut.Sequential(conv, bn).eval()
    x = rng.standard_normal((2, 40, 9, 9)).astype(np.float32)
    before = _check("first", model, conv, bn, x)
    _folded(model, x)
    assert conv.weight.ptr.derived != ffi.NULL, "the panels were not kept"
    conv.weight.numpy()[:] *= -1.5  # a view closed before the next forward
    _fresh_check("closed view", model, conv, bn, x, before)
    before = _folded(model, x)
    view = conv.weight.numpy()  # open across forwards: nothing is kept meanwhile
    _folded(model, x)
    view += 0.3
    _fresh_check("open view", model, conv, bn, x, before)
    before = _folded(model, x)
    view *= -1.0
    _fresh_check("open view again", model, conv, bn, x, before)
    del view
    torch = pytest.importorskip("torch")
    before = _folded(model, x)
    t = torch.from_dlpack(conv.weight)
    t.mul_(0.5)
    del t
    _fresh_check("dlpack", model, conv, bn, x, before)


def test_stale_after_train_then_eval():
    """A training forward moves the running statistics; the next eval forward uses them."""
    rng = np.random.default_rng(25)
    conv, bn, model = _pair(rng, act="relu")
    bn.momentum = 0.9
    model.eval()
    x = _x(rng, 3)
    before = _folded(model, x)
    model.train()
    model(_x(rng, 3) * 3 + 1).close()
    model.eval()
    _fresh_check("train then eval", model, conv, bn, x, before)


def test_kept_steps_follow_the_layers_the_modes_and_the_settings():
    """A Sequential keeps its folded steps between calls (fold.kept_fold_steps); they are
    derived again when a layer is replaced in place, appended or removed, a layer's mode
    changes or a fold setting changes; a copy derives its own. Each output is checked against
    the layers run one by one."""
    import copy

    rng = np.random.default_rng(27)
    conv, bn, model = _pair(rng, act="relu")
    model.eval()
    x = _x(rng, 3)
    _check("first", model, conv, bn, x)
    assert model(x).numpy().shape == (2, 4, 6, 7)
    steps = fold.kept_fold_steps(model, model.layers)
    assert steps is fold.kept_fold_steps(model, model.layers)  # kept
    assert len(steps) == 1  # the pair as one step
    conv2 = ut.Conv2d(3, 4, 3, padding=1)
    conv2.eval()
    before = _folded(model, x)
    model.layers[0] = conv2  # in place: same length
    _fresh_check("a layer replaced", model, conv2, bn, x, before)
    model.layers.append(ut.ReLU6())
    with model(x) as y:
        assert_close("appended ReLU6", y.numpy(), np.minimum(_reference(conv2, bn, x), 6.0),
                     rtol=1e-4, atol=2e-6)
    model.layers.pop()
    bn.train()  # one layer's mode: the pair no longer folds (a training BatchNorm)
    with model(x) as y:
        z = R.conv2d(x.astype(np.float64), conv2.weight.numpy().astype(np.float64),
                     conv2.bias.numpy().astype(np.float64), 1, 1)
        mean, var = z.mean(axis=(0, 2, 3), keepdims=True), z.var(axis=(0, 2, 3), keepdims=True)
        ref = (z - mean) / np.sqrt(var + bn.eps) * bn.weight.numpy()[None, :, None, None] \
            + bn.bias.numpy()[None, :, None, None]
        assert_close("BatchNorm in training", y.numpy(), np.maximum(ref, 0.0), rtol=1e-4,
                     atol=1e-5)
    bn.eval()
    assert len(fold.kept_fold_steps(model, model.layers)) == 1
    prev = fold.set_inference_fold(False)
    try:
        assert len(fold.kept_fold_steps(model, model.layers)) == 2
    finally:
        fold.set_inference_fold(prev)
    twin = copy.deepcopy(model)
    twin.layers[0].weight.copy_from(twin.layers[0].weight.numpy() * -2.0)
    assert_close("the copy's own layers", _folded(twin, x),
                 _reference(twin.layers[0], twin.layers[1], x), rtol=1e-4, atol=2e-6)
    assert_close("the original unchanged", _folded(model, x), _reference(conv2, bn, x),
                 rtol=1e-4, atol=2e-6)


def test_kept_steps_call_a_forward_wrapped_later():
    """The kept steps look each layer's forward up when they run: a forward wrapped after the
    first call (profilers, instrumentation) is the one called."""
    rng = np.random.default_rng(29)
    conv, bn, model = _pair(rng, act="relu")
    tail = ut.Hardswish()
    model.layers.append(tail)
    model.eval()
    x = _x(rng, 3)
    first = _folded(model, x)
    calls = []
    plain = type(tail).forward

    def counted(self, t):
        calls.append(self)
        return plain(self, t)

    type(tail).forward = counted
    try:
        again = _folded(model, x)
    finally:
        type(tail).forward = plain
    assert calls == [tail]
    np.testing.assert_array_equal(again, first)


def test_kept_separable_plan_follows_the_modes():
    """An inverted residual keeps its separable plan between eval calls; a layer of its body
    put in training mode runs the layers themselves (its BatchNorm's batch statistics)."""
    rng = np.random.default_rng(28)
    m = models.mobilenet_v2(num_classes=10, width_mult=0.25)
    m.eval()
    block = m.features[2]
    x = rng.standard_normal((2, block.body[0][0].in_channels, 8, 8)).astype(np.float32)
    plan = fold.kept_separable_plan(block.body)
    assert plan is not None and plan is fold.kept_separable_plan(block.body)
    folded = _folded(block, x)
    assert_close("block folded vs unfolded", folded, _unfolded(block, x), rtol=1e-4, atol=1e-5)
    block.body[0][1].train()
    assert fold.kept_separable_plan(block.body) is None
    block.body[0][1].eval()
    assert fold.kept_separable_plan(block.body) is not None


def test_an_eval_forward_leaves_training_unchanged():
    """Eval forwards (folded) between training steps: the gradients and running statistics are
    those of the same steps without them."""
    def run(with_eval):
        ut.seed(3)
        model = ut.Sequential(ut.Conv2d(3, 4, 3, padding=1), ut.BatchNorm2d(4, activation="silu"),
                              ut.DWConv2d(4, 3, padding=1), ut.BatchNorm2d(4, activation="relu6"))
        rng = np.random.default_rng(9)
        x = rng.standard_normal((2, 3, 6, 6)).astype(np.float32)
        grads = []
        for _ in range(2):
            if with_eval:
                model.eval()
                model(x).close()
                model.train()
            with model(x) as y:
                g = np.cos(y.numpy())
            for p in model.parameters():
                p.grad = None
            model.backward(g).close()
            grads.append([p.grad.numpy().copy() for p in model.parameters()])
        stats = [m.running_var.numpy().copy() for m in model.layers[1::2]]
        return grads, stats

    (ga, sa), (gb, sb) = run(False), run(True)
    for a, b in zip(ga, gb):
        for u, v in zip(a, b):
            np.testing.assert_array_equal(u, v)
    for u, v in zip(sa, sb):
        np.testing.assert_array_equal(u, v)


# -- where the fold does not run: bfloat16 and the GPU take the layers' own forwards ----------------

def _mixed_model(device):
    ut.seed(1)
    m = ut.Sequential(ut.Conv2d(3, 8, 3, padding=1), ut.BatchNorm2d(8), ut.ReLU6(),
                      ut.DWConv2d(8, 3, stride=2, padding=1),
                      ut.BatchNorm2d(8, activation="silu"))
    rng = np.random.default_rng(2)
    for bn in (m[1], m[4]):
        _randomise_bn(bn, rng)
    return m.to(device).eval()


def test_bfloat16_runs_the_layers_themselves():
    net = ut.MixedPrecision(_mixed_model("cpu")).eval()
    x = np.random.default_rng(0).standard_normal((2, 3, 8, 8)).astype(np.float32)
    np.testing.assert_array_equal(_folded(net, x), _unfolded(net, x))


def test_every_device_matches_the_cpu_fold(device):
    """On the GPU the C entry points run the layers one after the other (no CUDA kernel of
    their own): the same values as the CPU's fold within float32 rounding."""
    x = np.random.default_rng(0).standard_normal((2, 3, 9, 9)).astype(np.float32)
    cpu = _folded(_mixed_model("cpu"), x)
    net = _mixed_model(device)
    with ut.tensor(x, device) as xt:
        got = _folded(net, xt)
    assert_close("fold on %s vs the CPU's" % device, got, cpu, rtol=1e-4, atol=1e-5)
    with ut.tensor(x, device) as xt:
        assert_close("fold on %s vs its layers" % device, got, _unfolded(net, xt), rtol=1e-5,
                     atol=1e-6)
