"""export_onnx for every network of utensil_ffi.models.list_models(), run by onnxruntime
against utensil's eval-mode forward (within 1e-4 of the output's magnitude): small width where
the builder takes one, 64x64 inputs, random BatchNorm statistics and ConvNeXt's layer scale at
0.5 (at its 1e-6 default the blocks would hardly show). The initializers carry the state_dict's
keys (torchvision's). Skipped without onnx and onnxruntime.
"""

import inspect

import numpy as np
import pytest

import utensil_ffi as ut
from utensil_ffi import models

from onnx_check import export_and_compare, onnxruntime, randomize_bn

TOL = 1e-4


@pytest.fixture
def ort():
    return onnxruntime()


def _build(name, **extra):
    builder = models.get_model_builder(name)
    params = inspect.signature(builder).parameters
    kw = dict(num_classes=10, **extra)
    if "width_mult" in params:
        kw["width_mult"] = 0.5
    if "layer_scale" in params:
        kw["layer_scale"] = 0.5
    return builder(**kw)


def _check_keys(proto, net):
    import onnx
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in proto.graph.initializer}
    for k, v in net.state_dict().items():
        if not k.endswith("num_batches_tracked"):
            assert k in inits, k
            # PointwiseLinear's [out, in] is the ONNX Conv's [out, in, 1, 1]
            np.testing.assert_array_equal(inits[k].reshape(v.shape), v, err_msg=k)


@pytest.mark.parametrize("name", models.list_models())
def test_every_model_exports_and_matches(ort, tmp_path, rng, name):
    ut.seed(40)
    net = _build(name)
    randomize_bn(net, rng)
    try:
        proto, err = export_and_compare(ort, net, str(tmp_path / "m.onnx"), (1, 3, 64, 64), rng,
                                        batches=(2,))
        assert err <= TOL
        _check_keys(proto, net)
    finally:
        net.close()


@pytest.mark.parametrize("name", ["mobilenet_v3_small", "efficientnet_b0", "mnasnet0_5"])
def test_unfused_models_match_too(ort, tmp_path, rng, name):
    # fused=False: every activation a layer of its own, at opset 11 (their formulas)
    ut.seed(41)
    net = _build(name, fused=False)
    randomize_bn(net, rng)
    try:
        proto, err = export_and_compare(ort, net, str(tmp_path / "m.onnx"), (1, 3, 64, 64), rng,
                                        opset=11, batches=(1,))
        assert err <= TOL
    finally:
        net.close()


@pytest.mark.parametrize("opset", [11, 20])
def test_convnext_at_other_opsets(ort, tmp_path, rng, opset):
    # opset 11: LayerNorm2d, LayerNorm and GELU as their formulas; 20: ONNX's Gelu
    ut.seed(42)
    net = _build("convnext_tiny")
    try:
        proto, err = export_and_compare(ort, net, str(tmp_path / "m.onnx"), (1, 3, 64, 64), rng,
                                        opset=opset, batches=(1,))
        assert err <= TOL
        ops = {n.op_type for n in proto.graph.node}
        assert ("LayerNormalization" in ops) == (opset >= 17) and ("Gelu" in ops) == (opset >= 20)
    finally:
        net.close()
