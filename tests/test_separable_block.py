"""Issue 32's separable block: [1x1 conv] -> depthwise -> 1x1 conv, each with its BatchNorm2d
folded, in one C call (ut_separable_block_forward; Sequential, Residual and InvertedResidual
through nn/fold.py).

The CPU runs large planes with an expand in bands of rows (tiles kept in cache, the rows two
steps share copied over, rows past the image zeroed) and everything else as the three folded
layers one after the other; both are checked against a float64 numpy reference and against the layers' own forwards
(set_inference_fold(False)), over geometries that put band and step edges everywhere: strides 1
and 2, padding 0 to beyond the filter's half, kh != kw, heights that leave a short last step,
batch 1 (an image cut in bands) and 3, one thread and two."""

import numpy as np
import pytest

import utensil_ffi as ut
from tolerances import assert_close
from utensil_ffi import models
from utensil_ffi import reference as R
from utensil_ffi._lib import ffi, lib
from utensil_ffi.nn import fold

_REF_ACT = {None: lambda z: z, "relu6": R.relu6, "hardswish": R.hardswish, "silu": R.silu,
            "relu": R.relu}


@pytest.fixture(autouse=True)
def _fold_on():
    prev = fold.set_inference_fold(True)
    yield
    fold.set_inference_fold(prev)


def _bn(c, act, rng):
    bn = ut.BatchNorm2d(c, activation=act)
    bn.running_mean = rng.normal(0.0, 0.5, c).astype(np.float32)
    bn.running_var = rng.uniform(0.3, 3.0, c).astype(np.float32)
    bn.weight.copy_from(rng.uniform(-1.5, 1.5, c).astype(np.float32))
    bn.bias.copy_from(rng.normal(0.0, 0.5, c).astype(np.float32))
    return bn.eval()


def _conv_ref(conv, x):
    w = conv.weight.numpy().astype(np.float64)
    b = None if conv._bias is None else conv.bias.numpy().astype(np.float64)
    if isinstance(conv, ut.DWConv2d):
        return R.dwconv2d(x, w, b, conv.stride, conv.padding, conv.dilation)
    return R.conv2d(x, w, b, conv.stride, conv.padding)


def _bn_ref(bn, y):
    f = lambda t: t.numpy().astype(np.float64)  # noqa: E731
    z = R.batchnorm2d_eval(y, f(bn.weight), f(bn.bias), f(bn.running_mean), f(bn.running_var),
                           bn.eps)
    return _REF_ACT[bn.activation](z)


def _reference(layers, x, residual):
    """float64: each (conv, bn) pair in turn, then x + y when residual."""
    y = np.asarray(x, np.float64)
    for conv, bn in zip(layers[::2], layers[1::2]):
        y = _bn_ref(bn, _conv_ref(conv, y))
    return y + np.asarray(x, np.float64) if residual else y


def _block(cin, e, cout, k, stride, pad, acts, rng, expand=True, bias=False):
    """[Conv2d 1x1 cin -> e, BN], DWConv2d k (stride, pad), BN, Conv2d 1x1 e -> cout, BN."""
    layers = []
    if expand:
        layers += [ut.Conv2d(cin, e, 1, bias=bias), _bn(e, acts[0], rng)]
    else:
        assert cin == e
    layers += [ut.DWConv2d(e, k, stride=stride, padding=pad, bias=bias), _bn(e, acts[1], rng),
               ut.Conv2d(e, cout, 1, bias=bias), _bn(cout, acts[2], rng)]
    for l in layers:
        if not isinstance(l, ut.BatchNorm2d):
            l.weight.copy_from(rng.normal(0, 0.4, l.weight.shape).astype(np.float32))
            if l._bias is not None:
                l.bias.copy_from(rng.normal(0, 0.5, l.bias.shape).astype(np.float32))
        l.eval()
    return layers


def _random_running_stats(net, rng):
    """net with non-trivial BatchNorm2d running statistics (the fold's scale and shift)."""
    for m in net.modules():
        if isinstance(m, ut.BatchNorm2d):
            c = m.num_features
            m.running_mean = rng.normal(0.0, 0.2, c).astype(np.float32)
            m.running_var = rng.uniform(0.5, 2.0, c).astype(np.float32)
    return net


def _folded_and_not(net, x):
    """net(x) with the fold on, then with it off (each layer's own forward)."""
    with net(x) as y:
        got = y.numpy().copy()
    prev = fold.set_inference_fold(False)
    try:
        with net(x) as y:
            unfused = y.numpy().copy()
    finally:
        fold.set_inference_fold(prev)
    return got, unfused


def _run(seq, x, residual):
    body = ut.Sequential(*seq).eval()
    return _folded_and_not(ut.Residual(body).eval() if residual else body, x)


# (name, cin, e, cout, kernel, stride, pad, (h, w), expand): large planes with an expand run in
# bands (e * (h w + ho wo) above 512 Ki floats), the rest as the folded layers in turn
GEOMS = [
    ("bands-3x3s1", 8, 64, 8, 3, 1, 1, (67, 70), True),
    ("bands-3x3s2-odd", 6, 64, 10, 3, 2, 1, (121, 97), True),
    ("bands-5x5s2p2", 5, 48, 7, 5, 2, 2, (120, 113), True),
    ("bands-3x5-p0", 4, 56, 6, (3, 5), 1, 0, (90, 71), True),
    ("bands-7x7-p4", 4, 40, 5, 7, 1, 4, (85, 90), True),  # padding past the filter's half
    ("bands-tall-narrow", 3, 96, 4, 3, 2, 1, (700, 9), True),
    # 1-row filters over narrow planes: tiles the depthwise's small-plane engine may take
    ("bands-1x3-narrow", 3, 96, 4, (1, 3), 1, 1, (900, 7), True),
    ("bands-3x1-narrow", 3, 96, 4, (3, 1), 1, 1, (900, 5), True),
    ("layers-small", 8, 48, 8, 3, 1, 1, (14, 14), True),
    ("layers-s2-7x7", 16, 96, 24, 3, 2, 1, (7, 7), True),
    ("layers-5x5s2", 6, 36, 12, 5, 2, 2, (17, 15), True),
    ("layers-no-expand-large", 32, 32, 48, 3, 1, 1, (90, 90), False),
    ("layers-no-expand-s2", 24, 24, 16, 3, 2, 1, (31, 33), False),
    ("layers-expand-3x-large", 24, 72, 24, 3, 1, 1, (100, 100), True),  # below 4x: no bands
]


def _in_bands(geom):
    """Whether the CPU runs the block in bands (ut__cpu_sep_fwd in utensil.h: an expand of 4x
    or more, planes above UT__SEP_BANDS_ABOVE floats)."""
    _, cin, e, _, k, s, p, (h, w), expand = geom
    kh, kw = (k, k) if isinstance(k, int) else k
    ho, wo = (h + 2 * p - kh) // s + 1, (w + 2 * p - kw) // s + 1
    return expand and e >= 4 * cin and e * (h * w + ho * wo) > 512 * 1024


def test_the_geometries_cover_both_ways():
    assert [_in_bands(g) for g in GEOMS] == [g[0].startswith("bands") for g in GEOMS]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("geom", GEOMS, ids=[g[0] for g in GEOMS])
def test_block_matches_layers_and_float64(geom, batch, threads):
    name, cin, e, cout, k, s, p, (h, w), expand = geom
    rng = np.random.default_rng(abs(hash((name, batch))) % 2**32)
    acts = ("relu6", "relu6", None) if batch == 1 else ("hardswish", "silu", "relu")
    layers = _block(cin, e, cout, k, s, p, acts, rng, expand=expand, bias=batch == 3)
    x = rng.standard_normal((batch, cin, h, w)).astype(np.float32)
    prev = ut.get_num_threads()
    ut.set_num_threads(threads)
    try:
        if expand:
            assert len(fold.fold_steps(layers)) == 1  # one separable step
            got, unfused = _run(layers, x, residual=False)
        else:  # Python leaves these to the pairs: the C call itself, expand NULL
            units = fold._units(layers)
            with fold.separable_forward((None, units[0], units[1]), x) as y:
                got = y.numpy().copy()
            unfused = _run(layers, x, residual=False)[1]
    finally:
        ut.set_num_threads(prev)
    ref = _reference(layers, x, residual=False)
    assert_close(name + " vs float64", got, ref, rtol=1e-4, atol=1e-5)
    assert_close(name + " vs unfused", got, unfused, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("hw", [(60, 61), (9, 8)], ids=["bands", "image"])
def test_residual_in_the_same_call(hw):
    rng = np.random.default_rng(7)
    layers = _block(12, 72, 12, 3, 1, 1, ("relu6", "relu6", None), rng)
    x = rng.standard_normal((2, 12) + hw).astype(np.float32)
    got, unfused = _run(layers, x, residual=True)
    assert_close("residual vs float64", got, _reference(layers, x, True), rtol=1e-4, atol=1e-5)
    assert_close("residual vs unfused", got, unfused, rtol=1e-5, atol=1e-5)


def test_results_do_not_depend_on_the_thread_count():
    rng = np.random.default_rng(11)
    layers = _block(8, 64, 8, 3, 2, 1, ("relu6", "relu6", None), rng)
    x = rng.standard_normal((1, 8, 120, 90)).astype(np.float32)
    prev = ut.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3):
            ut.set_num_threads(n)
            outs.append(_run(layers, x, False)[0])
    finally:
        ut.set_num_threads(prev)
    for o in outs[1:]:
        assert_close("threads", o, outs[0], rtol=1e-6, atol=1e-6)


def test_the_networks_blocks_take_the_separable_call(monkeypatch):
    """MobileNetV2 (zoo: InvertedResidual; flat: Residual and Sequential) in eval mode: every
    block with an expand one separable call (16 of 17), the output that of the unfused layers;
    MobileNet v1's flat Sequential: a block's pointwise conv with the next block's depthwise
    and pointwise (6 chains of its 13 blocks)."""
    calls = []
    real = fold.separable_forward

    def spy(plan, x, residual=False):
        calls.append(residual)
        return real(plan, x, residual)

    monkeypatch.setattr(fold, "separable_forward", spy)  # what the blocks and steps call
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 3, 64, 64)).astype(np.float32)
    import utensil_ffi.nn.models as flat
    for name, net, blocks, residuals in [
            ("zoo v2", models.mobilenet_v2(num_classes=7), 16, 10),
            ("flat v2", flat.mobilenet_v2(num_classes=7), 16, 10),
            ("v1", flat.mobilenet_v1(num_classes=7), 6, 0)]:
        _random_running_stats(net, rng).eval()
        calls.clear()
        got, want = _folded_and_not(net, x)  # (the unfused forward makes no call)
        assert len(calls) == blocks and sum(calls) == residuals, (name, calls)
        assert_close(name, got, want, rtol=1e-4, atol=1e-5)
        net.train()
        calls.clear()
        net(x).close()
        assert not calls  # training mode: every layer itself


def test_what_does_not_make_a_chain_runs_as_before():
    rng = np.random.default_rng(2)
    blk = _block(3, 4, 6, 3, 1, 1, ("relu6", "relu6", None), rng)
    assert len(fold.fold_steps(blk)) == 1
    assert len(fold.fold_steps(blk[2:])) == 2  # no expand: two folded steps
    dense = blk[:2] + [ut.Conv2d(4, 4, 3, padding=1).eval(), _bn(4, None, rng)] + blk[4:]
    assert len(fold.fold_steps(dense)) == 3  # a 3x3 dense conv is no depthwise
    strided = blk[:4] + [ut.Conv2d(4, 6, 1, stride=2).eval(), _bn(6, None, rng)]
    assert len(fold.fold_steps(strided)) == 3  # a strided 1x1 is no project
    blk[3].train()
    assert len(fold.fold_steps(blk)) == 4  # a training BatchNorm2d: no fold there
    blk[3].eval()
    prev = fold.set_separable_fold(False)
    assert len(fold.fold_steps(blk)) == 3  # the pairs
    assert fold.separable_plan(ut.Sequential(*blk)) is None
    fold.set_separable_fold(prev)
    assert fold.separable_plan(ut.Sequential(*blk)) is not None
    fold.set_inference_fold(False)
    assert len(fold.fold_steps(blk)) == 6
    assert fold.separable_plan(ut.Sequential(*blk)) is None


def test_a_non_finite_depthwise_filter_takes_the_layers_exact_path():
    """The bands zero the rows past the image and multiply them: an inf tap would make NaN
    there, where the depthwise's own forward sums real input only."""
    rng = np.random.default_rng(4)
    layers = _block(4, 40, 4, 3, 1, 1, ("relu6", None, None), rng)
    w = layers[2].weight.numpy().copy()
    w[0, 0, 0] = np.inf
    layers[2].weight.copy_from(w)
    x = rng.uniform(0.5, 1.0, (1, 4, 100, 90)).astype(np.float32)
    got, unfused = _run(layers, x, False)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(unfused))
    assert_close("inf tap", np.nan_to_num(got), np.nan_to_num(unfused), rtol=1e-5, atol=1e-5)


def test_bfloat16_and_the_gpu_run_the_layers_one_by_one():
    rng = np.random.default_rng(6)
    layers = _block(4, 24, 4, 3, 1, 1, ("relu6", "relu6", None), rng)
    x = ut.tensor(rng.standard_normal((2, 4, 10, 10)), dtype=ut.bfloat16)
    got, unfused = _run(layers, x, False)
    assert_close("bf16", got, unfused, rtol=1e-2, atol=1e-2)


def _plan(layers):
    return fold._chain_at(fold._units(layers), 0)[0][:3]


def test_refusals():
    rng = np.random.default_rng(8)
    layers = _block(4, 8, 6, 3, 1, 1, ("relu6", "relu6", None), rng)
    plan = _plan(layers)
    x = np.zeros((1, 4, 6, 6), np.float32)
    with pytest.raises(ut.ShapeError, match="residual"):
        fold.separable_forward(plan, x, residual=True)  # 4 -> 6 channels
    with pytest.raises(ut.ShapeError, match="channels"):
        fold.separable_forward(plan, np.zeros((1, 5, 6, 6), np.float32))
    layers[3].train()
    with pytest.raises(ut.UtensilError, match="training mode"):
        fold.separable_forward(plan, x)
    layers[3].eval()
    bad = (plan[0], plan[1], (ut.Conv2d(8, 6, 3, padding=1).eval(),) + plan[2][1:])
    with pytest.raises(ut.ArgumentError, match="1x1"):
        fold.separable_forward(bad, x)
    mismatch = ((ut.Conv2d(4, 5, 1).eval(), _bn(5, None, rng), lib.UT_ACT_NONE, 2),
                plan[1], plan[2])
    with pytest.raises(ut.ShapeError, match="expand has 5 output channels"):
        fold.separable_forward(mismatch, x)
    blk = ffi.new("ut_separable_block *")
    assert lib.ut_separable_block_forward(blk, ffi.NULL) == ffi.NULL
    assert "dw is NULL" in ffi.string(lib.ut_last_error()).decode()
    layers[2].close()
    with pytest.raises(ut.ClosedError):
        fold.separable_forward(plan, x)


def test_a_kept_plan_reuses_its_struct_and_still_sees_what_changes():
    # the plan a Sequential or block keeps fills its C struct once; each call still enters its
    # layers (a close is seen), follows the residual flag and reads the layers' values now
    rng = np.random.default_rng(11)
    layers = _block(4, 8, 4, 3, 1, 1, ("relu6", "relu6", None), rng)
    plan = fold.separable_plan(ut.Sequential(*layers))
    x = rng.standard_normal((2, 4, 6, 6)).astype(np.float32)
    with fold.separable_forward(plan, x) as y1:
        first = y1.numpy().copy()
    kept = plan._c
    with fold.separable_forward(plan, x) as y2:
        assert plan._c is kept
        np.testing.assert_array_equal(y2.numpy(), first)
    with fold.separable_forward(plan, x, residual=True) as y3:
        assert plan._c is not kept
        assert_close("fp32", y3.numpy(), first + x)
    layers[5].bias.copy_from(np.full(4, 2.0, np.float32))  # the project's BatchNorm's beta
    with fold.separable_forward(plan, x) as y4:
        assert not np.allclose(y4.numpy(), first)
        with ut.Sequential(*layers[:4])(x) as d:  # the chain up to the depthwise, unfused
            with layers[4](d) as p, layers[5](p) as ref:
                assert_close("fp32", y4.numpy(), ref.numpy())
    layers[4].close()
    with pytest.raises(ut.ClosedError):
        fold.separable_forward(plan, x)
