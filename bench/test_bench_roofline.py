"""roofline.py: the traffic model against a small network counted by hand, the kernel families,
and the share arithmetic of the table."""

import utensil_ffi as ut
from utensil_ffi import nn

import roofline as rf


def _net():
    return nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.BatchNorm2d(8),
                         nn.DWConv2d(8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU6(),
                         nn.GlobalAvgPool2d(), nn.Linear(8, 4))


def test_traffic_of_a_small_network_counted_by_hand():
    with _net() as net:
        shapes = rf.layer_shapes(net, (1, 3, 8, 8))
        assert [m.cls.__name__ for m in shapes] == [
            "Conv2d", "BatchNorm2d", "DWConv2d", "BatchNorm2d", "ReLU6", "GlobalAvgPool2d",
            "Linear"]
        assert shapes[0][1:] == ((1, 3, 8, 8), (1, 8, 4, 4), (8, 3, 3, 3), (3, 3))
        t = rf.traffic(shapes, act_bytes=2, params=100, batch=3)
        # conv 3->8 3x3 s2 on 8x8: x 192, y 128, W 216 -> three passes over x and y per sample,
        # W three times per step (read by forward and dx, dW written) at 4 bytes; Linear 8->4:
        # x 8, y 4, W 32
        gemm = 3 * 3 * (192 + 128) * 2 + 12 * 216 + 3 * 3 * (8 + 4) * 2 + 12 * 32
        assert t["GEMM (1x1, stem, Linear)"] == (gemm, 3 * (6 * 128 * 27 + 6 * 4 * 8))
        assert t["depthwise"] == (3 * 3 * 256 * 2 + 12 * 72, 3 * 6 * 128 * 9)
        assert t["BatchNorm"] == (3 * 2 * 8 * 128 * 2, 0)
        assert t[rf.OTHER] == (3 * (5 * 128 * 2 + 2 * (128 + 8) * 2), 0)
        assert t["optimizer"] == (2000, 0)
        assert rf.fused_bytes(shapes, 2) == 6 * 2 * (128 + 128)
        # the forwards are the layers' own again, and nothing is kept
        assert all("forward" not in m.__dict__ for m in net.modules())
        y = net(ut.zeros((2, 3, 8, 8)))
        assert y.shape == (2, 4)
        y.close()


def test_kernel_families():
    assert rf.family_of("void ut__cuda_dwconv2d_strip_forward_kernel<3, 1, 4, false>") \
        == "depthwise"
    assert rf.family_of("ut__cuda_batchnorm2d_apply_kernel<float, false>") == "BatchNorm"
    assert rf.family_of("void ut__cuda_channel_partial_kernel<1, 8>") == "BatchNorm"
    assert rf.family_of("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") \
        == "GEMM (1x1, stem, Linear)"
    assert rf.family_of("ut__cuda_transpose_kernel<float>") == "GEMM (1x1, stem, Linear)"
    assert rf.family_of("ut__cuda_sgd_kernel") == "optimizer"
    assert rf.family_of("ut__cuda_map1_kernel") == rf.OTHER


def test_table_shares():
    dw_bytes = 4 * 3 * 256 * 2 + 12 * 72  # batch 4
    # at 1 GB/s the depthwise bytes take dw_bytes / 1e3 µs; measured twice that per step, over
    # 2 steps -> 50%
    us = dw_bytes / 1e3 * 2 * 2
    with _net() as net:
        shapes = rf.layer_shapes(net, (1, 3, 8, 8))
    # the layers' figures were taken: the table needs the net no more
    rows = rf.table({"ut__cuda_dwconv2d_x": us, "ut__cuda_batchnorm2d_dx_kernel": 1.0}, 2, 4,
                    shapes, 2, 0, 1e9, 1e15)
    dw = [r for r in rows if r.startswith("| depthwise")]
    assert len(dw) == 1 and dw[0].endswith("| 50% |"), rows
    assert not any(r.startswith("| GEMM") for r in rows)  # no time, no row
    assert rows[-1].startswith("peaks measured here: copy 1 GB/s")
