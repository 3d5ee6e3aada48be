"""bench_inference.py compares like with like: utensil's eval forward, onnxruntime on its own
export and PyTorch's twin agree on a network with non-trivial BatchNorm statistics, and its
check refuses an engine that computes something else."""

import numpy as np
import pytest

import bench_inference as bi


def test_engines_agree_and_rates_are_measured():
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    res = bi.run("v1", size=32, batches=(2,), threads=1, rounds=1, seconds=0.05,
                 use_torch=False)
    rates = res[2]
    assert rates["utensil"] > 0 and rates["onnxruntime"] > 0
    assert 0.0 <= rates["max diff"]["onnxruntime"] <= 1e-4


def test_the_pairs_engine_is_utensil_without_its_blocks():
    """--pairs: the same network with its separable chains as folded pairs, checked against
    the blocks like any engine (float32 rounding apart)."""
    from utensil_ffi.nn import fold

    res = bi.run("mobilenet_v2", size=32, batches=(1,), threads=1, rounds=1, seconds=0.05,
                 use_torch=False, pairs=True)
    rates = res[1]
    assert rates["utensil pairs"] > 0 and rates["utensil"] > 0
    assert 0.0 <= rates["max diff"]["utensil pairs"] <= 1e-5
    assert fold.get_separable_fold()  # the engine puts the setting back


def test_the_repacked_engine_gives_the_same_bits():
    """--repack: the weights' GEMM panels packed per call (a numpy view of each weight open)
    instead of kept: the same products in the same order, so the same logits to the bit."""
    res = bi.run("mobilenet_v2", size=64, batches=(2,), threads=1, rounds=1, seconds=0.05,
                 use_torch=False, repack=True)
    rates = res[2]
    assert rates["utensil repacked"] > 0 and rates["utensil"] > 0
    assert rates["max diff"]["utensil repacked"] == 0.0


def test_the_check_catches_an_engine_that_differs(monkeypatch):
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    real = ort.InferenceSession

    class OffByALittle:
        def __init__(self, *a, **k):
            self.s = real(*a, **k)

        def run(self, names, feeds):
            return [o * np.float32(1.01) for o in self.s.run(names, feeds)]

    monkeypatch.setattr(ort, "InferenceSession", OffByALittle)
    with pytest.raises(AssertionError, match="disagree"):
        bi.run("v1", size=32, batches=(1,), threads=1, rounds=1, seconds=0.05, use_torch=False)


def test_batchnorm_statistics_are_moved_off_their_start():
    import utensil_ffi as ut

    net = bi.build("v1", "cpu")
    try:
        bi._randomise_bn(net, np.random.default_rng(0))
        bns = [m for m in net.modules() if isinstance(m, ut.BatchNorm2d)]
        assert bns and all(np.abs(m.running_var.numpy() - 1.0).max() > 0.1 for m in bns)
        assert all(np.abs(m.running_mean.numpy()).max() > 0.01 for m in bns)
    finally:
        net.close()


def test_profile_inference_splits_both_engines_by_the_same_kinds(capsys):
    """profile_inference.py: utensil's eval forward and onnxruntime's run of its export, each
    split by convolution kind (1x1, depthwise 3x3 at strides 1 and 2, the 3x3 stem); the
    kinds, their FLOP counts and both engines' times come out of the same network."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    import profile_inference as pi

    flops = pi.profile("v1", 32, 1, 1, 2, separable=False)
    # v1 at 32^2: the stem, 13 depthwise 3x3 (4 of them stride 2) and 13 pointwise convs
    assert set(flops) == {"conv 3x3 s2", "dw 3x3 s1", "dw 3x3 s2", "conv 1x1 s1"}
    # the same network with its chains as blocks (a block's pointwise conv with the next
    # block's depthwise and pointwise): each block's convolutions counted under their own
    # kinds, so the FLOPs by kind are the unblocked run's (what onnxruntime's kinds are rated by)
    blocks = pi.profile("v1", 32, 1, 1, 2)
    assert blocks == flops
    out = capsys.readouterr().out
    assert "block 1x1+dw 3x3 s2" in out and "conv 1x1 s1" in out and "rest" in out
    # the stem's FLOPs by hand: 32 outputs of 3*3*3 taps over the 16x16 plane
    assert flops["conv 3x3 s2"] == 2.0 * 32 * 16 * 16 * 27
    ort = pi.profile_onnxruntime("v1", 32, 1, 1, 2, flops, out=lambda s: None)
    for kind in flops:
        assert ort.get(kind, 0.0) > 0.0, (kind, ort)


def test_ops_onnxruntime_times_every_distinct_step_of_the_network():
    """ops_onnxruntime.py: every folded convolution step of the network, by distinct shape, timed
    by each side in processes of their own; the counts add up to the network's steps."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    import ops_onnxruntime as oo

    lines = []
    res = oo.run("v1", 32, 1, 1, rounds=1, reps=1, calls=1, round_s=0.0, out=lines.append)
    # v1: the stem, then 13 depthwise + pointwise pairs
    assert sum(v[0] for v in res.values()) == 27
    # the stem, dw 3x3 s1 / s2 and 1x1 steps, each plane and width its own line
    assert any(k.startswith("conv 3x3 s2 3->32 16x16 relu") for k in res), list(res)
    assert sum(1 for k in res if k.startswith("dw 3x3 s2")) == 4
    for name, (n, *ts) in res.items():
        assert n >= 1 and all(0.0 < t < 1.0 for t in ts), (name, n, ts)
    assert lines[-1].split()[:4] == ["all,", "weighted", "by", "count"]
