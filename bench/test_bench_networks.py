"""bench_networks.py times the same training on both sides: its loss check against PyTorch
passes on MobileNet v1 (models.mobilenet_v1 against its PyTorch twin) and catches a network
that trains differently."""

import pytest

import bench_networks as bn


def test_mobilenet_v1_trains_as_pytorch():
    """64 px, batch 4: the last plane's batch statistics span 16 values (at batch 2 and 32 px
    they span 2, and the float32 trajectories of any two implementations part after a step)."""
    pytest.importorskip("torch")
    r = bn.run("v1", size=64, batch=4, threads=1, device="cpu", steps=3, rounds=1)
    assert r["utensil"] > 0 and r["torch fp32"] > 0
    assert 0.0 <= r["parity"] <= 2e-2


def test_the_check_catches_a_network_that_differs(monkeypatch):
    """A PyTorch twin with one weight changed: the check must refuse to time it."""
    torch = pytest.importorskip("torch")
    real = bn.to_torch

    def off_by_a_little(net):
        tnet = real(net)
        with torch.no_grad():
            tnet[-1].weight.mul_(1.01)  # the classifier's weights, 1% off
        return tnet

    monkeypatch.setattr(bn, "to_torch", off_by_a_little)
    with pytest.raises(AssertionError, match="disagree"):
        bn.run("v1", size=64, batch=4, threads=1, device="cpu", steps=3, rounds=1)
