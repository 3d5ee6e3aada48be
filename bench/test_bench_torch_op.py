"""bench_torch_op.py in quick mode: a small MobileNetV2 training step with and without
utensil_ffi.interop.torch.convert on each present device; checks the losses agree, not the speed."""

import pytest

import utensil_ffi as ut

import bench_torch_op as bto

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_mobilenet_v2_converted_trains_like_torch(device):
    if device == "cuda" and not ("cuda" in ut.devices() and torch.cuda.is_available()):
        pytest.skip("needs a GPU seen by both utensil and PyTorch")
    # 64^2, batch 4: the last BatchNorms still normalize over 16 values (over 2, float32's
    # rounding differences would be amplified past any tolerance); one thread: tiny ops
    r = bto.run(device, threads=1, size=64, batch=4, width=0.25, steps=1, rounds=1,
                num_classes=10)
    assert r["depthwise_converted"] == 17
    assert r["img_s"]["torch"] > 0 and r["img_s"]["converted"] > 0
    loss = r["losses"]["torch"]
    assert abs(r["losses"]["converted"] - loss) <= 1e-4 * abs(loss) + 1e-5, r["losses"]
