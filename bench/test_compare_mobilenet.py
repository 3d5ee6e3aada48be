"""compare_mobilenet.py, the utensil/PyTorch comparison of utensil-train's network."""

import pytest

import compare_mobilenet as cm


def test_compare_with_torch_trains_alike():
    """Same weights and batches give (nearly) the same training loss."""
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    r = cm.compare_with_torch("cpu", width=4, batch_size=64, epochs=1, threads=1)
    assert len(r["utensil"]) == 1 and len(r["torch"]) == 1
    assert r["utensil"][0] > 0 and r["torch"][0] > 0
    assert abs(r["loss"]["utensil"] - r["loss"]["torch"]) <= 0.02 * r["loss"]["torch"] + 1e-3
