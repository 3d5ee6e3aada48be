"""export_onnx for issue 30's layers, run by onnxruntime against utensil's eval-mode forward:
LayerNorm and LayerNorm2d (ONNX's LayerNormalization from opset 17, their formula before),
SqueezeExcitation, Dropout and StochasticDepth (no node), BatchNorm2d with each fused
activation (the nodes of the activation's own layer), and Sequential's named children (the
initializers keep the state_dict's keys). Skipped without onnx and onnxruntime.
"""

from collections import OrderedDict

import numpy as np
import pytest

import utensil_ffi as ut
from utensil_ffi.interop.onnx_export import export_onnx

from onnx_check import export_and_compare, onnxruntime, randomize_bn

OPSETS = [11, 14, 17, 20]
TOL = 1e-4  # relative to the output's largest magnitude
# BatchNorm2d's fused activations and the layer each one stands for
FUSED = {"relu": ut.ReLU, "relu6": ut.ReLU6, "silu": ut.SiLU, "hardswish": ut.Hardswish,
         "hardsigmoid": ut.Hardsigmoid, "sigmoid": ut.Sigmoid, "gelu": ut.GELU,
         "gelu_tanh": lambda: ut.GELU("tanh")}


@pytest.fixture
def ort():
    return onnxruntime()


def _ops(proto):
    return [n.op_type for n in proto.graph.node]


def _randomize_affine(m, rng):
    n = m.weight.shape[0]
    m.weight = rng.uniform(0.5, 1.5, n)
    m.bias = rng.normal(0, 0.3, n)


def _initializers(proto):
    import onnx
    return {i.name: onnx.numpy_helper.to_array(i) for i in proto.graph.initializer}


def _assert_keys_are_the_state_dict(proto, net):
    inits = _initializers(proto)
    for k, v in net.state_dict().items():
        if not k.endswith("num_batches_tracked"):
            assert k in inits, "%s is not an initializer: %s" % (k, sorted(inits))
            np.testing.assert_array_equal(inits[k], v)


@pytest.mark.parametrize("opset", OPSETS)
def test_layernorm_and_layernorm2d(ort, tmp_path, rng, opset):
    ut.seed(30)
    net = ut.Sequential(
        ut.Conv2d(3, 8, 3, padding=1),
        ut.LayerNorm2d(8),                  # over the channels of NCHW
        ut.GELU(),
        ut.Conv2d(8, 6, 3, padding=1, bias=True),
        ut.LayerNorm(7, eps=1e-3),          # over the last axis of a 4-d input: W
        ut.GlobalAvgPool2d(),
        ut.LayerNorm(6),                    # over the features of [N, 6]
        ut.Linear(6, 4))
    for i in (1, 4, 6):
        _randomize_affine(net[i], rng)
    try:
        proto, err = export_and_compare(ort, net, str(tmp_path / "ln.onnx"), (1, 3, 5, 7), rng,
                                        opset)
        assert err <= TOL
        ops = _ops(proto)
        assert ops.count("LayerNormalization") == (3 if opset >= 17 else 0)
        assert ("ReduceMean" in ops) == (opset < 17)
        assert ops.count("Transpose") == 2  # LayerNorm2d's channels moved last and back
        _assert_keys_are_the_state_dict(proto, net)
    finally:
        net.close()


def test_layernorm2d_normalizes_each_pixel_over_the_channels(ort, tmp_path, rng):
    # inputs with a large per-pixel offset: normalizing over the wrong axes would not cancel it
    ut.seed(31)
    net = ut.Sequential(ut.LayerNorm2d(5))
    _randomize_affine(net[0], rng)
    net.eval()
    path = str(tmp_path / "ln2d.onnx")
    export_onnx(net, path, (2, 5, 3, 4))
    from onnx_check import session
    x = (rng.normal(0, 1, (2, 5, 3, 4)) + rng.normal(0, 10, (2, 1, 3, 4))).astype(np.float32)
    got = session(ort, path).run(None, {"input": x})[0]
    x64 = x.astype(np.float64)
    mu = x64.mean(axis=1, keepdims=True)
    var = ((x64 - mu) ** 2).mean(axis=1, keepdims=True)
    w = net[0].weight.numpy().reshape(1, 5, 1, 1)
    b = net[0].bias.numpy().reshape(1, 5, 1, 1)
    want = (x64 - mu) / np.sqrt(var + 1e-6) * w + b
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    net.close()


@pytest.mark.parametrize("opset", [11, 17])
def test_squeeze_excitation(ort, tmp_path, rng, opset):
    ut.seed(32)
    net = ut.Sequential(
        ut.Conv2d(4, 8, 3, padding=1),
        ut.BatchNorm2d(8, activation="relu6"),
        ut.SqueezeExcitation(8, 3),                                       # ReLU, Sigmoid
        ut.SqueezeExcitation(8, 2, activation=ut.SiLU, scale_activation=ut.Hardsigmoid),
        ut.Residual(ut.Sequential(ut.SqueezeExcitation(8, 4, activation=ut.ReLU),
                                  ut.Conv2d(8, 8, 1))),
        ut.GlobalAvgPool2d(),
        ut.Linear(8, 3))
    randomize_bn(net, rng)
    try:
        proto, err = export_and_compare(ort, net, str(tmp_path / "se.onnx"), (1, 4, 6, 5), rng,
                                        opset)
        assert err <= TOL
        ops = _ops(proto)
        assert ops.count("GlobalAveragePool") == 4 and ops.count("Conv") == 8
        _assert_keys_are_the_state_dict(proto, net)
        assert "2.fc1.bias" in _initializers(proto) and "4.block.0.fc2.weight" in \
            _initializers(proto)
    finally:
        net.close()


def test_dropout_and_stochastic_depth_are_the_identity(ort, tmp_path, rng):
    ut.seed(33)
    net = ut.Sequential(
        ut.Conv2d(3, 6, 3, padding=1),
        ut.Dropout(0.5),
        ut.Residual(ut.Sequential(ut.Conv2d(6, 6, 3, padding=1), ut.StochasticDepth(0.4, "row"))),
        ut.Residual(ut.Sequential(ut.Conv2d(6, 6, 1), ut.StochasticDepth(0.9, "batch"))),
        ut.GlobalAvgPool2d(),
        ut.Dropout(0.2),
        ut.Linear(6, 2))
    try:
        # exported from training mode: the graph is the eval-mode forward all the same
        proto = export_onnx(net, str(tmp_path / "d.onnx"), (1, 3, 5, 5))
        assert net.training
        assert _ops(proto) == ["Conv", "Conv", "Add", "Conv", "Add", "GlobalAveragePool",
                               "Flatten", "Gemm"]
        _, err = export_and_compare(ort, net, str(tmp_path / "d.onnx"), (1, 3, 5, 5), rng)
        assert err <= TOL
    finally:
        net.close()


def _bn(c, name):
    try:
        return ut.BatchNorm2d(c, activation=name)
    except ut.ArgumentError:
        pytest.skip("this BatchNorm2d does not fuse %r (another branch adds it)" % name)


@pytest.mark.parametrize("opset", [11, 17, 20])
@pytest.mark.parametrize("name", sorted(FUSED))
def test_batchnorm_with_each_fused_activation(ort, tmp_path, rng, name, opset):
    ut.seed(34)
    fused = ut.Sequential(ut.Conv2d(3, 6, 3, padding=1), _bn(6, name), ut.GlobalAvgPool2d(),
                          ut.Linear(6, 3))
    layer = ut.Sequential(ut.Conv2d(3, 6, 3, padding=1), ut.BatchNorm2d(6), FUSED[name](),
                          ut.GlobalAvgPool2d(), ut.Linear(6, 3))
    randomize_bn(fused, rng)
    try:
        proto, err = export_and_compare(ort, fused, str(tmp_path / "f.onnx"), (1, 3, 5, 5), rng,
                                        opset)
        assert err <= TOL
        # the fused activation's nodes are those of its layer, after the BatchNormalization
        unfused = export_onnx(layer, str(tmp_path / "u.onnx"), (1, 3, 5, 5), opset=opset)
        assert _ops(proto) == _ops(unfused)
        assert _ops(proto)[:2] == ["Conv", "BatchNormalization"]
    finally:
        fused.close()
        layer.close()


def test_an_unknown_fused_activation_is_named(ort, tmp_path):
    class OddBatchNorm(ut.BatchNorm2d):
        activation = "mish"  # what a newer BatchNorm2d might fuse that the exporter lacks

    net = ut.Sequential(ut.Conv2d(3, 4, 1), OddBatchNorm(4))
    try:
        with pytest.raises(ut.ArgumentError, match=r"BatchNorm2d at '1': its fused activation "
                                                   r"'mish' has no ONNX form; the exporter knows "
                                                   r"gelu, gelu_tanh, hardsigmoid"):
            export_onnx(net, str(tmp_path / "m.onnx"), (1, 3, 4, 4))
    finally:
        net.close()


def test_named_sequential_keeps_the_state_dict_keys(ort, tmp_path, rng):
    ut.seed(35)
    children = OrderedDict([("stem", ut.Conv2d(3, 6, 3, padding=1)), ("bn", ut.BatchNorm2d(6)),
                            ("act", ut.ReLU6()),
                            ("se", ut.SqueezeExcitation(6, 2)), ("pool", ut.GlobalAvgPool2d()),
                            ("fc", ut.Linear(6, 2))])
    try:
        net = ut.Sequential(children)
    except (ut.ArgumentError, TypeError):  # ArgumentTypeError is a TypeError
        for m in children.values():
            m.close()
        pytest.skip("this Sequential takes no OrderedDict (another branch adds it)")
    randomize_bn(net, rng)
    try:
        proto, err = export_and_compare(ort, net, str(tmp_path / "n.onnx"), (1, 3, 5, 5), rng)
        assert err <= TOL
        assert "stem.weight" in _initializers(proto) and "se.fc1.bias" in _initializers(proto)
        _assert_keys_are_the_state_dict(proto, net)
    finally:
        net.close()


def test_wrong_shapes_are_named(ort, tmp_path):
    path = str(tmp_path / "bad.onnx")
    with ut.Sequential(ut.Linear(3, 5), ut.LayerNorm(4)) as net:
        with pytest.raises(ut.ShapeError, match=r"LayerNorm at '1' normalizes a last dimension "
                                                r"of 4, but gets \[batch, 5\]"):
            export_onnx(net, path, (1, 3))
    with ut.Sequential(ut.Linear(3, 4), ut.LayerNorm2d(4)) as net:
        with pytest.raises(ut.ShapeError, match=r"LayerNorm2d at '1' takes \[N, 4, H, W\]"):
            export_onnx(net, path, (1, 3))
    with ut.Sequential(ut.SqueezeExcitation(4, 2)) as net:
        with pytest.raises(ut.ShapeError, match=r"SqueezeExcitation at '0' takes \[N, 4, H, W\]"):
            export_onnx(net, path, (1, 3, 4, 4))
