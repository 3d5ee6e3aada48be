"""Per-op benchmarks: utensil against PyTorch on the issue's shapes, on every device present.

Each test times one op; the case (op, device, shape, impl) comes from conftest.py, which orders
the cases so that each utensil case is directly followed by its torch twin. Before timing, each
utensil case is run once on the same inputs as torch and must match it (the quick CI mode,
``--benchmark-disable``, is therefore also a correctness test on every geometry).

Padding is k // 2. Dense convs map C -> C channels; the 1x1 conv has stride 1 (MobileNet's
pointwise convs), the 3x3 conv the listed stride. Backward = (dx, dW, db) in one call on both
sides (torch: aten.convolution_backward / native_batch_norm_backward / hardtanh_backward).
"""

import pytest


@pytest.mark.bench_op("dw_fwd")
def test_dw_fwd(run_case):
    run_case()


@pytest.mark.bench_op("dw_bwd")
def test_dw_bwd(run_case):
    run_case()


@pytest.mark.bench_op("relu6_bwd")
def test_relu6_bwd(run_case):
    run_case()


@pytest.mark.bench_op("conv1x1_fwd")
def test_conv1x1_fwd(run_case):
    run_case()


@pytest.mark.bench_op("conv1x1_bwd")
def test_conv1x1_bwd(run_case):
    run_case()


@pytest.mark.bench_op("conv3x3_fwd", shapes="dense3x3")
def test_conv3x3_fwd(run_case):
    run_case()


@pytest.mark.bench_op("conv3x3_bwd", shapes="dense3x3")
def test_conv3x3_bwd(run_case):
    run_case()


@pytest.mark.bench_op("bn_fwd")
def test_bn_fwd(run_case):
    run_case()


@pytest.mark.bench_op("bn_bwd")
def test_bn_bwd(run_case):
    run_case()


@pytest.mark.bench_op("overhead", shapes="tiny", impls=("ours", "cffi", "torch"))
def test_call_overhead(run_case):
    """Depthwise forward on the tiny shape three ways: the layer (what users call), the C entry
    point through cffi alone (the floor), and torch's F.conv2d."""
    run_case()
