"""Running an exported utensil model in onnxruntime and comparing it with utensil's own eval-mode
forward: shared by the ONNX export tests of the blocks and of the networks."""

import numpy as np
import pytest

import utensil_ffi as ut
from utensil_ffi.interop.onnx_export import export_onnx


def onnxruntime():
    """onnxruntime, or a skip where it or onnx is not installed."""
    pytest.importorskip("onnx")
    return pytest.importorskip("onnxruntime")


def session(ort, path):
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1  # the CI has 2 cores; the graphs are small
    return ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])


def randomize_bn(net, rng):
    """Random affine parameters and running statistics for every BatchNorm2d, so that eval-mode
    BatchNorm is not close to the identity and a mistake in its export shows."""
    for m in net.modules():
        if isinstance(m, ut.BatchNorm2d):
            c = m.num_features
            m.weight = rng.uniform(0.5, 1.5, c)
            m.bias = rng.normal(0, 0.3, c)
            m.running_mean = rng.normal(0, 0.5, c)
            m.running_var = rng.uniform(0.3, 3.0, c)


def export_and_compare(ort, net, path, input_shape, rng, opset=17, batches=(1, 3)):
    """Export ``net`` (put in eval mode) at ``opset``, run onnxruntime on random batches of
    several sizes, and return (the ModelProto, the largest |onnxruntime - utensil| relative to
    the largest |utensil| output)."""
    net.eval()
    proto = export_onnx(net, path, input_shape, opset=opset)
    sess = session(ort, path)
    worst = 0.0
    for n in batches:
        x = rng.normal(0, 1, (n,) + tuple(input_shape[1:])).astype(np.float32)
        got = sess.run(None, {"input": x})[0]
        with net(x) as y:
            want = y.numpy().astype(np.float64)
        assert got.shape == want.shape
        assert np.all(np.isfinite(want))
        err = float(np.abs(got - want).max()) / max(float(np.abs(want).max()), 1e-30)
        worst = max(worst, err)
    return proto, worst
