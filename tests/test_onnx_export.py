"""utensil_ffi.onnx_export.export_onnx against onnxruntime: the exported graph's output must be
utensil's eval-mode forward (max abs difference <= 1e-4) for MobileNet v1 (small), the digits
network utensil-train builds, a small MobileNetV2 (with random BatchNorm statistics, so that
BatchNorm matters), and a network of every supported layer with its options (bias, stride,
padding, kh != kw, dilation, channel multiplier, fused activations); at batch sizes other than
the one given (the batch dimension is dynamic). Refusals are named exceptions; a failed export
leaves no file behind and an existing one unchanged.
"""

import os
import sys

import numpy as np
import pytest

import utensil_ffi as ut
from utensil_ffi.nn import models  # the mobilenet builders (utensil_ffi.models: torchvision's)
from utensil_ffi.onnx_export import export_onnx


@pytest.fixture
def ort():
    pytest.importorskip("onnx")
    return pytest.importorskip("onnxruntime")


def _session(ort, path):
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1  # the CI has 2 cores; the graphs are tiny
    return ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])


def _randomize_bn(net, rng):
    for m in net.modules():
        if isinstance(m, ut.BatchNorm2d):
            c = m.num_features
            m.weight = rng.uniform(0.5, 1.5, c)
            m.bias = rng.normal(0, 0.3, c)
            m.running_mean = rng.normal(0, 0.5, c)
            m.running_var = rng.uniform(0.3, 3.0, c)


def _check(ort, net, path, input_shape, rng, batches=(1, 3)):
    """Export ``net`` (eval mode), run onnxruntime on random batches of several sizes and return
    the largest |onnxruntime - utensil|."""
    net.eval()
    export_onnx(net, path, input_shape)
    sess = _session(ort, path)
    (inp,), (out,) = sess.get_inputs(), sess.get_outputs()
    assert inp.name == "input" and out.name == "output"
    assert inp.shape[0] == "batch" and list(inp.shape[1:]) == list(input_shape[1:])
    worst = 0.0
    for n in batches:
        x = rng.normal(0, 1, (n,) + tuple(input_shape[1:])).astype(np.float32)
        got = sess.run(None, {"input": x})[0]
        with net(x) as y:
            want = y.numpy()
        assert got.shape == want.shape
        worst = max(worst, float(np.abs(got.astype(np.float64) - want).max()))
    return worst


def test_mobilenet_v1_small(ort, tmp_path, rng):
    ut.seed(1)
    net = models.mobilenet(1, 10, 8)
    _randomize_bn(net, rng)
    try:
        assert _check(ort, net, str(tmp_path / "v1.onnx"), (2, 1, 8, 8), rng) <= 1e-4
    finally:
        net.close()


def test_digits_network(ort, tmp_path, rng):
    # the network utensil-train builds for the digits: 8x8 grey images, 10 classes, width 32
    ut.seed(2)
    net = models.mobilenet(1, 10, 32)
    _randomize_bn(net, rng)
    try:
        assert _check(ort, net, str(tmp_path / "digits.onnx"), (1, 1, 8, 8), rng) <= 1e-4
    finally:
        net.close()


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_mobilenet_v2_small(ort, tmp_path, rng, fused):
    ut.seed(3)
    net = models.mobilenet_v2(10, 0.35, fused=fused, stem_stride=1)
    _randomize_bn(net, rng)
    try:
        assert _check(ort, net, str(tmp_path / "v2.onnx"), (2, 3, 32, 32), rng) <= 1e-4
    finally:
        net.close()


def test_every_layer_and_option(ort, tmp_path, rng):
    ut.seed(4)
    net = ut.Sequential(
        ut.Conv2d(2, 4, (3, 2), stride=2, padding=1, bias=True),          # kh != kw, bias
        ut.BatchNorm2d(4, activation="relu"),
        ut.DWConv2d(4, 3, padding=2, dilation=2, out_channels=8),         # dilation, multiplier
        ut.BatchNorm2d(8, activation="relu6"),
        ut.Residual(ut.Sequential(ut.DWConv2d(8, (1, 3), padding=1, bias=True),
                                  ut.Conv2d(8, 8, (3, 1), padding=0),
                                  ut.ReLU())),
        ut.ReLU6(),
        ut.GlobalAvgPool2d(),
        ut.Linear(8, 5, bias=False),
        ut.ReLU(),
        ut.Linear(5, 3),
    )
    _randomize_bn(net, rng)
    try:
        assert _check(ort, net, str(tmp_path / "all.onnx"), (1, 2, 9, 7), rng) <= 1e-4
    finally:
        net.close()


def test_the_graph(ort, tmp_path):
    import onnx

    net = ut.Sequential(ut.Conv2d(3, 4, 3), ut.BatchNorm2d(4, activation="relu6"),
                        ut.GlobalAvgPool2d(), ut.Linear(4, 2))
    path = str(tmp_path / "g.onnx")
    try:
        proto = export_onnx(net, path, (1, 3, 5, 5), opset=13)
        loaded = onnx.load(path)
        assert loaded == proto
        assert [n.op_type for n in proto.graph.node] == [
            "Conv", "BatchNormalization", "Clip", "GlobalAveragePool", "Flatten", "Gemm"]
        gemm = proto.graph.node[-1]
        assert {a.name: a.i for a in gemm.attribute} == {"transB": 1}
        assert proto.opset_import[0].version == 13
        # the initializers carry the state_dict's keys and values
        inits = {i.name: onnx.numpy_helper.to_array(i) for i in proto.graph.initializer}
        for k, v in net.state_dict().items():
            if not k.endswith("num_batches_tracked"):
                np.testing.assert_array_equal(inits[k], v)
        out = proto.graph.output[0].type.tensor_type.shape.dim
        assert [d.dim_param or d.dim_value for d in out] == ["batch", 2]
        assert os.listdir(tmp_path) == ["g.onnx"]  # no temporary left behind
    finally:
        net.close()


def test_export_changes_nothing_in_the_model(ort, tmp_path, rng):
    net = ut.Sequential(ut.Conv2d(1, 2, 3), ut.BatchNorm2d(2))
    _randomize_bn(net, rng)
    try:
        before = net.state_dict()
        export_onnx(net, str(tmp_path / "m.onnx"), (1, 1, 4, 4))
        assert net.training and net[1].training  # the mode is the model's; the graph is eval
        after = net.state_dict()
        for k in before:
            np.testing.assert_array_equal(before[k], after[k])
        net.eval()
        assert _check(ort, net, str(tmp_path / "m.onnx"), (1, 1, 4, 4), rng) <= 1e-4
    finally:
        net.close()


class _Custom(ut.Module):
    def forward(self, x):
        return x


def test_unknown_layer_is_named(ort, tmp_path):
    net = ut.Sequential(ut.Linear(4, 4), ut.Residual(ut.Sequential(_Custom())))
    path = tmp_path / "bad.onnx"
    path.write_bytes(b"the old file")
    try:
        with pytest.raises(ut.ArgumentError, match=r"_Custom at '1\.block\.0' has no ONNX form"):
            export_onnx(net, str(path), (1, 4))
        with pytest.raises(ValueError):  # ArgumentError is a ValueError
            export_onnx(net[1], path, (1, 4))
        assert path.read_bytes() == b"the old file"  # untouched, and no temporary left
        assert os.listdir(tmp_path) == ["bad.onnx"]
    finally:
        net.close()
    with pytest.raises(ut.ArgumentError, match="_Custom at the top of the model has no ONNX form"):
        export_onnx(_Custom(), str(tmp_path / "c.onnx"), (1, 4))


def test_bad_arguments_are_named(ort, tmp_path):
    net = ut.Sequential(ut.Conv2d(3, 4, 3), ut.GlobalAvgPool2d(), ut.Linear(4, 2))
    path = str(tmp_path / "m.onnx")
    try:
        with pytest.raises(ut.ShapeError, match=r"Conv2d at '0' takes \[N, 3, H, W\], but gets "
                                                r"\[batch, 1, 8, 8\]"):
            export_onnx(net, path, (1, 1, 8, 8))
        with pytest.raises(ut.ShapeError, match="smaller than its kernel"):
            export_onnx(net, path, (1, 3, 2, 2))
        with pytest.raises(ut.ShapeError, match="needs a batch dimension"):
            export_onnx(net, path, (3,))
        with pytest.raises(ut.ArgumentTypeError, match="input_shape must be a sequence"):
            export_onnx(net, path, 3)
        with pytest.raises(ut.ArgumentError, match=r"input_shape\[2\] must be in"):
            export_onnx(net, path, (1, 3, 0, 4))
        with pytest.raises(ut.ArgumentError, match="opset must be in"):
            export_onnx(net, path, (1, 3, 8, 8), opset=9)
        with pytest.raises(ut.ArgumentTypeError, match="model must be a utensil Module"):
            export_onnx(lambda x: x, path, (1, 3, 8, 8))
        with pytest.raises(ut.ArgumentTypeError, match="path must be a file name"):
            export_onnx(net, 3, (1, 3, 8, 8))
        with pytest.raises(ut.ShapeError, match=r"Residual at '0': its block maps"):
            export_onnx(ut.Sequential(ut.Residual(ut.Conv2d(3, 3, 3))), path, (1, 3, 8, 8))
        assert os.listdir(tmp_path) == []
    finally:
        net.close()
    closed = ut.Linear(2, 2)
    closed.close()
    with pytest.raises(ut.ClosedError):
        export_onnx(ut.Sequential(closed), path, (1, 2))


def test_without_onnx_the_error_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "onnx", None)  # import onnx now raises ImportError
    with ut.Linear(2, 2) as net:
        with pytest.raises(ImportError, match=r"pip install 'utensil-ffi\[onnx\]'"):
            export_onnx(net, str(tmp_path / "m.onnx"), (1, 2))
    assert os.listdir(tmp_path) == []
