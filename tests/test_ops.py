"""Ports of the C tests in native/test.c, under the same names, through the Python API.

Each takes the `device` fixture (the C suite runs each test on UT_CPU and UT_CUDA). The fixtures
and their hand-derived expected values are the C suite's; see the comments there.
"""

import math

import numpy as np
import pytest

import utensil_ffi as ut
from utensil_ffi import reference as R
from utensil_ffi._lib import ffi, lib


def check(t, expected, tol=1e-5):
    """The C suite's assert_data: |got - want| <= tol * max(1, |want|) elementwise."""
    got = t.numpy() if isinstance(t, ut.Tensor) else np.asarray(t)
    want = np.asarray(expected, dtype=np.float64).reshape(-1)
    got = np.asarray(got, dtype=np.float64).reshape(-1)
    assert got.shape == want.shape
    assert np.all(np.abs(got - want) <= tol * np.maximum(1.0, np.abs(want))), (got, want)


def T(shape, data, device):
    return ut.tensor(np.asarray(data, dtype=np.float32).reshape(shape), device)


# -- library and tensors ---------------------------------------------------------------------
def test_library(device):
    assert lib.ut_version() == lib.UT_VERSION
    assert ffi.string(lib.ut_backend_name(lib.UT_CPU)) == b"cpu"
    dev = lib.UT_CUDA if device == "cuda" else lib.UT_CPU
    assert ffi.string(lib.ut_backend_name(dev)).decode() == device
    old = ut.get_num_threads()
    ut.set_num_threads(1)
    assert ut.get_num_threads() == 1
    ut.set_num_threads(old)
    assert ut.get_num_threads() == old
    assert lib.ut_type_size(b"ut_tensor") == ffi.sizeof("ut_tensor")
    assert lib.ut_field_offset(b"ut_batchnorm2d", b"training") == ffi.offsetof("ut_batchnorm2d", "training")
    fr, tot = ffi.new("size_t*"), ffi.new("size_t*")
    st = lib.ut_cuda_mem_info(fr, tot)
    if ut.cuda_available():
        assert st == 0 and tot[0] > 0 and fr[0] <= tot[0]
    else:
        assert st < 0 and ffi.string(lib.ut_last_error()) != b""
    lib.ut_clear_error()


def test_alloc(device):
    z = ut.zeros((2, 3, 4), device)
    assert z.shape == (2, 3, 4) and z.device == device and z.ptr.rc == 1
    check(z, np.zeros(24), 0)
    src = np.array([1, 2, 3], dtype=np.float32)
    t = ut.tensor(src, device)
    src[0] = 100
    check(t, [1, 2, 3], 0)
    s = lib.ut_shape_new(4, ffi.new("int[]", [2, 1, 3, 5]))
    assert s.ndim == 4 and s.nelem == 30 and s.shape[3] == 5


def test_fill(device):
    t = ut.zeros((2, 3), device)
    check(t.fill_(2.5), [2.5] * 6, 0)
    check(t.fill_(-1), [-1] * 6, 0)


def test_copy_reshape(device):
    t = T((2, 3), [1, 2, 3, 4, 5, 6], device)
    c = t.clone()
    assert c.ptr != t.ptr and c.device == device and c.shape == (2, 3)
    check(c, [1, 2, 3, 4, 5, 6], 0)
    c.copy_from([[50, 2, 3], [4, 5, 6]])
    c.mul_(2)
    check(c, [100, 4, 6, 8, 10, 12], 0)
    check(t, [1, 2, 3, 4, 5, 6], 0)
    r = t.reshape(3, 1, 2)
    assert r.shape == (3, 1, 2) and r.device == device
    check(r, [1, 2, 3, 4, 5, 6], 0)
    assert t.reshape(6).shape == (6,)
    d = ut.zeros(6, device)
    d.copy_from(t.reshape(6))
    check(d, [1, 2, 3, 4, 5, 6], 0)


def test_transpose(device):
    t = T((2, 3), [1, 2, 3, 4, 5, 6], device)
    tt = t.transpose(0, 1)
    assert tt.shape == (3, 2)
    check(tt, [1, 4, 2, 5, 3, 6], 0)
    check(t.transpose(1, 0), [1, 4, 2, 5, 3, 6], 0)
    check(tt.transpose(0, 1), [1, 2, 3, 4, 5, 6], 0)
    t3 = T((2, 2, 2), range(8), device)
    check(t3.transpose(0, 2), [0, 4, 2, 6, 1, 5, 3, 7], 0)
    check(t3.transpose(1, 2), [0, 2, 1, 3, 4, 6, 5, 7], 0)
    check(t3.transpose(0, 1), [0, 1, 4, 5, 2, 3, 6, 7], 0)
    check(t3.transpose(1, 1), range(8), 0)
    x = np.arange(120, dtype=np.float32).reshape(2, 3, 4, 5)
    x4 = ut.tensor(x, device)
    for d0, d1 in [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]:
        np.testing.assert_array_equal(x4.transpose(d0, d1).numpy(), np.swapaxes(x, d0, d1))
    # rows of 16+ units (a warp per row on the GPU), with and without a middle dimension
    for shape, d0, d1 in [((4, 6, 196), 0, 1), ((3, 4, 5, 64), 0, 2), ((2, 5, 3, 49), 1, 2)]:
        x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
        np.testing.assert_array_equal(ut.tensor(x, device).transpose(d0, d1).numpy(),
                                      np.swapaxes(x, d0, d1))
    y3 = T((3, 1, 4), range(12), device).transpose(2, 0)
    assert y3.shape == (4, 1, 3)
    check(y3, [0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11], 0)


# -- elementwise and dense -------------------------------------------------------------------
def test_relu(device):
    x = T((2, 3), [-1.5, 0, 2, -3, 7, 0.5], device)
    y = ut.relu(x)
    assert y.shape == (2, 3) and y.device == device
    check(y, [0, 0, 2, 0, 7, 0.5], 0)
    check(x, [-1.5, 0, 2, -3, 7, 0.5], 0)


def test_relu6(device):
    check(ut.relu6(T(6, [-1, 0, 3, 6, 7, 5.5], device)), [0, 0, 3, 6, 6, 5.5], 0)


def test_relu_backward(device):
    x = T(6, [-1, 0, 3, 6, 7, 5.5], device)
    go = T(6, [1, 2, 3, 4, 5, 6], device)
    check(ut.relu_backward(go, x), [0, 0, 3, 4, 5, 6], 0)
    check(ut.relu6_backward(go, x), [0, 0, 3, 0, 0, 6], 0)


def test_edge_activations(device):
    a = T(6, [-2, -1, 0, 3, 4, 8], device)
    check(ut.relu6(a), [0, 0, 0, 3, 4, 6], 1e-6)
    check(ut.relu(a), [0, 0, 0, 3, 4, 8], 1e-6)
    check(ut.relu6_backward(ut.ones(6, device), a), [0, 0, 0, 1, 1, 0], 1e-6)


def test_add_into(device):
    d = T((2, 2), [1, 2, 3, 4], device)
    s = T(4, [10, 20, 30, 40], device)
    ut.functional.add_(d, s)
    assert d.shape == (2, 2)
    check(d, [11, 22, 33, 44], 0)
    d.add_(s)
    check(d, [21, 42, 63, 84], 0)
    check(s, [10, 20, 30, 40], 0)


def test_scale(device):
    t = T(3, [1, -2, 3], device)
    check(t.mul_(-0.5), [-0.5, 1, -1.5], 0)
    check(ut.functional.scale_(t, 0), [0, 0, 0], 0)


def test_matmul(device):
    c = ut.matmul(T((2, 3), [1, 2, 3, 4, 5, 6], device), T((3, 2), [7, 8, 9, 10, 11, 12], device))
    assert c.shape == (2, 2) and c.device == device
    check(c, [58, 64, 139, 154], 1e-6)
    c = T((3, 1), [1, 2, 3], device) @ T((1, 2), [4, 5], device)
    assert c.shape == (3, 2)
    check(c, [4, 5, 8, 10, 12, 15], 1e-6)
    c = T((1, 4), [1, -1, 2, 0.5], device) @ T((4, 1), [2, 3, -1, 4], device)
    assert c.shape == (1, 1)
    check(c, [-1], 1e-6)


def test_matmul_large(device):
    ut.seed(7)
    a, b = ut.randn((37, 53), device=device), ut.randn((53, 29), device=device)
    c = ut.matmul(a, b)
    old = ut.get_num_threads()
    ut.set_num_threads(1)
    c1 = ut.matmul(a, b)
    ut.set_num_threads(old)
    a64, b64 = a.numpy().astype(float), b.numpy().astype(float)
    ref, mag = a64 @ b64, np.abs(a64) @ np.abs(b64)
    assert np.all(np.abs(c.numpy() - ref) <= 1e-5 * (mag + 1))
    assert np.all(np.abs(c1.numpy() - ref) <= 1e-5 * (mag + 1))


def test_bias_add(device):
    x = T((2, 3), [1, 2, 3, 4, 5, 6], device)
    ut.functional.bias_add_(x, T(3, [10, 20, 30], device))
    check(x, [11, 22, 33, 14, 25, 36], 0)
    x = ut.zeros((2, 2, 1, 2), device)
    ut.functional.bias_add_(x, T(2, [1, -1], device))
    check(x, [1, 1, -1, -1, 1, 1, -1, -1], 0)


# -- conv2d ------------------------------------------------------------------------------------
X33 = [1, 2, 3, 4, 5, 6, 7, 8, 9]


def test_conv2d_forward(device):
    l = ut.Conv2d(1, 1, 2, bias=False, device=device)
    assert l.bias is None and l.weight.shape == (1, 1, 2, 2)
    l.weight = [1, 0, 0, -1] and np.array([1, 0, 0, -1]).reshape(1, 1, 2, 2)
    out = l(T((1, 1, 3, 3), X33, device))
    assert out.shape == (1, 1, 2, 2) and out.device == device
    check(out, [-4] * 4)
    l.close()
    assert l.closed


def test_conv2d_backward(device):
    l = ut.Conv2d(1, 1, 2, bias=False, device=device)
    l.weight = np.array([1, 0, 0, -1]).reshape(1, 1, 2, 2)
    x = T((1, 1, 3, 3), X33, device)
    l(x).close()
    assert x.ptr.rc == 2  # the layer's cache holds a reference to the input
    go = T((1, 1, 2, 2), [1, 0, 0, 0], device)
    dx = l.backward(go)
    assert dx.shape == (1, 1, 3, 3)
    check(l.weight.grad, [1, 2, 4, 5])
    check(dx, [1, 0, 0, 0, -1, 0, 0, 0, 0])
    dx2 = l.backward(go)  # accumulates into dW, dx is fresh
    check(l.weight.grad, [2, 4, 8, 10])
    check(dx2, [1, 0, 0, 0, -1, 0, 0, 0, 0])
    l.close()
    assert x.ptr.rc == 1


def test_conv2d_stride_pad(device):
    l = ut.Conv2d(1, 1, 3, stride=2, padding=1, device=device)
    assert l.bias.shape == (1,)
    l.weight, l.bias = np.ones((1, 1, 3, 3)), [0.5]
    out = l(T((1, 1, 3, 3), X33, device))
    assert out.shape == (1, 1, 2, 2)
    check(out, [12.5, 16.5, 24.5, 28.5])
    dx = l.backward(ut.ones((1, 1, 2, 2), device))
    check(l.weight.grad, [5, 10, 5, 10, 20, 10, 5, 10, 5])
    check(l.bias.grad, [4])
    check(dx, [1, 2, 1, 2, 4, 2, 1, 2, 1])


def test_conv2d_1x1(device):
    l = ut.Conv2d(2, 2, 1, device=device)
    l.weight, l.bias = np.array([1, 0.5, -1, 2]).reshape(2, 2, 1, 1), [1, -1]
    x = T((2, 2, 2, 2), [1, 2, 3, 4, 10, 20, 30, 40, 0, 0, 0, 1, 0, 1, 0, 0], device)
    out = l(x)
    check(out, [7, 13, 19, 25, 18, 37, 56, 75, 1, 1.5, 1, 2, -1, 1, -1, -2])
    l.weight.grad.fill_(1)
    l.bias.grad.fill_(1)
    dx = l.backward(ut.ones((2, 2, 2, 2), device))
    check(l.weight.grad, [12, 102, 12, 102])
    check(l.bias.grad, [9, 9])
    check(dx, [0, 0, 0, 0, 2.5, 2.5, 2.5, 2.5, 0, 0, 0, 0, 2.5, 2.5, 2.5, 2.5])


def test_conv2d_rect_kernel(device):
    l = ut.Conv2d(1, 1, (2, 3), bias=False, device=device)
    assert l.weight.shape == (1, 1, 2, 3)
    l.weight = np.array([1, 0, 0, 0, 0, 1]).reshape(1, 1, 2, 3)
    out = l(T((1, 1, 3, 4), range(1, 13), device))
    assert out.shape == (1, 1, 2, 2)
    check(out, [8, 10, 16, 18])
    big = ut.Conv2d(1, 1, 5, padding=1, bias=False, device=device)
    big.weight.fill_(1)
    o3 = big(T((1, 1, 3, 3), X33, device))
    assert o3.shape == (1, 1, 1, 1)
    check(o3, [45])


def _conv_random_case(device, dw, n, c, o, h, w, kh, kw, s, p):
    """The C suite's conv_random_case: forward and backward against the float64 reference."""
    if dw:
        l = ut.DWConv2d(c, (kh, kw), stride=s, padding=p, device=device)
    else:
        l = ut.Conv2d(c, o, (kh, kw), stride=s, padding=p, device=device)
    with l:
        l.bias.fill_(0.25)
        x = ut.randn((n, c, h, w), device=device)
        y = l(x)
        go = ut.randn(y.shape, device=device)
        dx = l.backward(go)
        x64, w64, b64, go64 = (t.numpy().astype(float) for t in (x, l.weight, l.bias, go))
        conv, bwd = (R.dwconv2d, R.dwconv2d_backward) if dw else (R.conv2d, R.conv2d_backward)
        ry = conv(x64, w64, b64, s, p)
        rdx, rdw, rdb = bwd(x64, w64, s, p, go64)
        for got, ref in ((y, ry), (dx, rdx), (l.weight.grad, rdw), (l.bias.grad, rdb)):
            got = got.numpy()
            assert got.shape == ref.shape
            assert np.all(np.abs(got - ref) <= 1e-4 * (1 + np.abs(ref)))


def test_conv2d_random(device):
    ut.seed(11)
    _conv_random_case(device, False, 2, 3, 4, 7, 6, 3, 2, 2, 1)
    _conv_random_case(device, False, 3, 5, 2, 9, 5, 3, 3, 1, 1)
    _conv_random_case(device, False, 2, 4, 3, 6, 7, 1, 1, 1, 0)
    _conv_random_case(device, False, 1, 2, 3, 5, 5, 1, 1, 2, 0)
    _conv_random_case(device, False, 2, 1, 2, 8, 8, 4, 4, 3, 2)


def test_pointwise_conv2d_over_small_images(device):
    """Pointwise convs over images of fewer than 256 pixels run on the CPU as one GEMM over the
    whole batch (inputs regrouped channel-major); at 256 and over, one GEMM per image. Both,
    forward and backward, against the float64 reference."""
    ut.seed(13)
    for n, c, o, h, w in [(3, 17, 9, 5, 5), (4, 33, 40, 15, 17), (2, 8, 5, 16, 16),
                          (5, 64, 48, 2, 2), (1, 3, 4, 2, 2), (6, 5, 3, 1, 1)]:
        _conv_random_case(device, False, n, c, o, h, w, 1, 1, 1, 0)


def test_pointwise_conv2d_over_1x1_planes(device):
    """A pointwise conv over 1x1 planes (squeeze-and-excitation's, on pooled [N, C, 1, 1])
    runs on the CPU as a Linear over the batch, y [N, out] = x [N, in] . W^T (matrix-vector
    products at one image; depths under and over 32, where the dot-product engine takes
    them): forward and backward against the float64 reference, bias or not."""
    ut.seed(19)
    for n, c, o in [(1, 1152, 48), (1, 48, 1152), (1, 28, 672), (3, 96, 4), (8, 4, 96),
                    (2, 33, 1), (1, 40, 1)]:
        _conv_random_case(device, False, n, c, o, 1, 1, 1, 1, 1, 0)
    with ut.Conv2d(40, 9, 1, bias=False, device=device) as l:
        x = ut.randn((2, 40, 1, 1), device=device)
        y, ref = l(x), R.conv2d(x.numpy().astype(float), l.weight.numpy().astype(float),
                                np.zeros(9), 1, 0)
        np.testing.assert_allclose(y.numpy(), ref, rtol=1e-4, atol=1e-4)


def test_unpadded_conv2d_over_small_planes(device):
    """A k x k convolution without padding over small output planes (ConvNeXt's patchify stem
    and 2x2 downsampling) runs on the CPU as one GEMM over the batch (its im2col columns
    regrouped channel-major); with padding, a single image or 256 output pixels and more, one
    GEMM per image. Each case, forward and backward, against the float64 reference."""
    ut.seed(17)
    for n, c, o, h, w, k, s, p in [(3, 6, 5, 8, 8, 2, 2, 0), (4, 3, 7, 16, 12, 4, 4, 0),
                                   (2, 5, 4, 7, 9, 3, 1, 0), (3, 4, 6, 9, 9, 3, 2, 1),
                                   (1, 4, 3, 8, 8, 2, 2, 0), (2, 3, 4, 32, 32, 2, 2, 0),
                                   (5, 8, 3, 3, 3, 3, 1, 0)]:
        _conv_random_case(device, False, n, c, o, h, w, k, k, s, p)


def test_dwconv2d_random(device):
    ut.seed(12)
    _conv_random_case(device, True, 2, 3, 0, 7, 6, 3, 2, 2, 1)
    _conv_random_case(device, True, 3, 5, 0, 9, 5, 3, 3, 1, 1)
    _conv_random_case(device, True, 2, 4, 0, 6, 7, 1, 1, 1, 0)
    _conv_random_case(device, True, 2, 2, 0, 8, 8, 4, 4, 3, 2)


# -- depthwise conv2d (the seed's tests) -----------------------------------------------------------
XDW = [1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 8, 7, 6, 5, 4, 3, 2, 1]
WDW = np.array([1, 0, 0, -1, 0, 1, 1, 0]).reshape(2, 2, 2)


def test_dwconv2d_forward(device):
    l = ut.DWConv2d(2, 2, bias=True, device=device)
    l.weight, l.bias = WDW, [100, 1000]
    out = l(T((1, 2, 3, 3), XDW, device))
    assert out.shape == (1, 2, 2, 2)
    check(out, [96, 96, 96, 96, 1014, 1012, 1008, 1006], 1e-4)


def test_dwconv2d_backward(device):
    l = ut.DWConv2d(2, 2, bias=False, device=device)
    l.weight = WDW
    l(T((1, 2, 3, 3), XDW, device)).close()
    dx = l.backward(T((1, 2, 2, 2), [1, 0, 0, 0, 0, 0, 0, 0], device))
    check(l.weight.grad, [1, 2, 4, 5, 0, 0, 0, 0], 1e-4)
    check(dx, [1, 0, 0, 0, -1] + [0] * 13, 1e-4)


def test_dwconv2d_stride_pad(device):
    l = ut.DWConv2d(2, (3, 2), stride=2, padding=1, device=device)
    assert l.weight.shape == (2, 3, 2)
    l.weight = np.array([1, 1, 1, 1, 1, 1, 1, 2, 3, 4, 5, 6]).reshape(2, 3, 2)
    l.bias = [0, 0.5]
    out = l(T((1, 2, 3, 3), X33 + [2] * 9, device))
    assert out.shape == (1, 2, 2, 2)
    check(out, [5, 16, 11, 28, 20.5, 36.5, 12.5, 20.5])
    dx = l.backward(ut.ones((1, 2, 2, 2), device))
    check(l.bias.grad, [4, 4])
    check(l.weight.grad, [5, 10, 10, 20, 5, 10, 2, 4, 4, 8, 2, 4])
    check(dx, [1, 1, 1, 2, 2, 2, 1, 1, 1, 4, 3, 4, 8, 6, 8, 4, 3, 4])


# -- linear, norms, pooling ------------------------------------------------------------------------
def test_linear(device):
    l = ut.Linear(3, 2, device=device)
    assert l.weight.shape == (2, 3) and l.bias.shape == (2,)
    assert l.in_features == 3 and l.out_features == 2
    l.weight, l.bias = np.array([1, 2, 3, 0, -1, 1]).reshape(2, 3), [0.5, -0.5]
    x = T((2, 3), [1, 1, 1, 2, 0, -1], device)
    y = l(x)
    assert y.shape == (2, 2)
    check(y, [6.5, -0.5, -0.5, -1.5])
    go = T((2, 2), [1, 0, 0, 1], device)
    dx = l.backward(go)
    check(l.weight.grad, [1, 1, 1, 2, 0, -1])
    check(l.bias.grad, [1, 1])
    assert dx.shape == (2, 3)
    check(dx, [1, 2, 3, 0, -1, 1])
    nb = ut.Linear(3, 2, bias=False, device=device)
    assert nb.bias is None and len(nb.parameters()) == 1
    nb.weight = np.array([1, 2, 3, 0, -1, 1]).reshape(2, 3)
    check(nb(x), [6, 0, -1, -1])
    nb.backward(go).close()
    check(nb.weight.grad, [1, 1, 1, 2, 0, -1])


@pytest.mark.parametrize("n, i, o", [(5, 300, 7), (1, 256, 100), (97, 260, 3), (8, 1024, 33),
                                     (1, 48, 1152), (1, 33, 17), (6, 40, 1), (1, 31, 64)])
def test_linear_wide_inputs(device, n, i, o):
    """Linear with k = in_features >= 256 and a short side, or one sample or one output from
    k = 32 on (the CPU forward then runs on the dot-product engine, no packing; 31: the packed
    one): forward and backward against the float64 reference."""
    ut.seed(21)
    with ut.Linear(i, o, device=device) as l:
        x = ut.randn((n, i), device=device)
        go = ut.randn((n, o), device=device)
        y = l(x)
        dx = l.backward(go)
        x64, w64, b64, go64 = (t.numpy().astype(float) for t in (x, l.weight, l.bias, go))
        rdx, rdw, rdb = R.linear_backward(x64, w64, go64)
        for got, ref in ((y, R.linear(x64, w64, b64)), (dx, rdx), (l.weight.grad, rdw),
                         (l.bias.grad, rdb)):
            np.testing.assert_allclose(got.numpy(), ref, rtol=1e-4, atol=1e-4)


def test_layernorm(device):
    l = ut.LayerNorm(4, eps=1e-5, device=device)
    assert l.dim == 4
    check(l.weight, [1, 1, 1, 1], 0)
    check(l.bias, [0, 0, 0, 0], 0)
    x = T((2, 4), [-1, -1, 1, 1, 1, 2, 3, 4], device)
    y = l(x)
    assert y.shape == (2, 4)
    check(y, [-0.999995, -0.999995, 0.999995, 0.999995, -1.341635, -0.447212, 0.447212, 1.341635])
    dx = l.backward(T((2, 4), [1, 0, 0, 0, 1, 1, 1, 1], device))
    check(dx, [0.5, -0.5, 0, 0, 0, 0, 0, 0], 1e-4)
    check(l.weight.grad, [-2.341635, -0.447212, 0.447212, 1.341635], 1e-4)
    check(l.bias.grad, [2, 1, 1, 1])
    l.weight.fill_(2)
    l.bias = [0, 1, 0, 1]
    y3 = l(T((2, 1, 4), [-1, -1, 1, 1, 1, 2, 3, 4], device))
    assert y3.shape == (2, 1, 4)
    check(y3, [-1.99999, -0.99999, 1.99999, 2.99999, -2.683271, 0.105576, 0.894424, 3.683271], 1e-4)


def test_batchnorm2d_train(device):
    l = ut.BatchNorm2d(2, eps=1e-5, momentum=0.1, device=device)
    assert l.training and l.num_features == 2
    check(l.running_mean, [0, 0], 0)
    check(l.running_var, [1, 1], 0)
    y = l(T((2, 2, 1, 2), [1, 3, 0, 0, 5, 7, 2, 2], device))
    assert y.shape == (2, 2, 1, 2)
    check(y, [-1.341641, -0.447214, -0.999995, -0.999995, 0.447214, 1.341641, 0.999995, 0.999995], 1e-4)
    check(l.running_mean, [0.4, 0.1])
    check(l.running_var, [1.566667, 1.033333])
    dx = l.backward(T((2, 2, 1, 2), [1, 0, 1, 1, 0, 0, 1, 1], device))
    check(dx, [0.134164, -0.178885, 0, 0, -0.044721, 0.089443, 0, 0], 1e-4)
    check(l.weight.grad, [-1.341641, 0], 1e-4)
    check(l.bias.grad, [1, 4])


def test_batchnorm2d_eval(device):
    l = ut.BatchNorm2d(2, eps=1e-5, momentum=0.1, device=device).eval()
    assert not l.training
    l.running_mean, l.running_var = [1, -1], [4, 0.25]
    l.weight, l.bias = [2, 1], [0, 3]
    y = l(T((1, 2, 1, 2), [1, 5, -1, 0], device))
    check(y, [0, 4, 3, 5], 1e-3)
    check(l.running_mean, [1, -1], 0)
    check(l.running_var, [4, 0.25], 0)
    dx = l.backward(ut.ones((1, 2, 1, 2), device))
    check(dx, [1, 1, 2, 2], 1e-3)
    check(l.weight.grad, [2, 2], 1e-3)
    check(l.bias.grad, [2, 2])


def test_global_avgpool(device):
    x = T((2, 2, 1, 3), [1, 2, 3, 0, 0, 3, -3, 0, 0, 4, 4, 4], device)
    pool = ut.GlobalAvgPool2d()
    y = pool(x)
    assert y.shape == (2, 2)
    check(y, [2, 1, -1, 4], 1e-6)
    dx = pool.backward(T((2, 2), [3, 6, -3, 0], device))
    assert dx.shape == (2, 2, 1, 3)
    check(dx, [1, 1, 1, 2, 2, 2, -1, -1, -1, 0, 0, 0], 1e-6)
    check(ut.global_avg_pool2d_backward(T((2, 2), [3, 6, -3, 0], device), 1, 3),
          [1, 1, 1, 2, 2, 2, -1, -1, -1, 0, 0, 0], 1e-6)


# -- losses ----------------------------------------------------------------------------------------
def test_mse(device):
    pred, target = T((2, 2), [1, 2, 3, 4], device), T((2, 2), [1, 0, 3, 6], device)
    loss = ut.mse_loss(pred, target)
    assert loss.size == 1 and loss.device == device
    check(loss, [2], 1e-6)
    g = ut.mse_loss_backward(pred, target)
    assert g.shape == (2, 2)
    check(g, [0, 1, 0, -1], 1e-6)


def test_cross_entropy(device):
    l3 = math.log(3)
    logits = T((2, 3), [0, 0, 0, 2, 2 + l3, 2], device)
    labels = np.array([2, 0])
    loss = ut.cross_entropy(logits, labels)
    assert loss.size == 1
    check(loss, [1.3540251])
    g = ut.cross_entropy_backward(logits, labels)
    assert g.shape == (2, 3)
    check(g, [1 / 6, 1 / 6, -1 / 3, -0.4, 0.3, 0.1])
    big = T((1, 2), [1000, 0], device)
    check(ut.cross_entropy(big, np.array([0])), [0])
    check(ut.cross_entropy(big, np.array([1])), [1000])
    check(ut.cross_entropy_backward(big, np.array([1])), [1, -1])
    eq = ut.full((3, 5), 0.7, device)
    check(ut.cross_entropy(eq, ut.tensor([4, 0, 2], device)), [1.6094379])


# -- optimizers ------------------------------------------------------------------------------------
def test_sgd_momentum(device):
    p, g, v = T(2, [1, 2], device), T(2, [0.5, -1], device), ut.zeros(2, device)
    ut.sgd_step(p, g, v, 0.1, 0.9)
    check(p, [0.95, 2.1], 1e-6)
    check(v, [0.5, -1], 1e-6)
    ut.sgd_step(p, g, v, 0.1, 0.9)
    check(p, [0.855, 2.29], 1e-6)
    check(v, [0.95, -1.9], 1e-6)
    ut.sgd_step(p, g, None, 0.5, 0.9)
    check(p, [0.605, 2.79], 1e-6)


def test_adam(device):
    p, g, m, v = T(2, [1, -1], device), T(2, [1, -2], device), ut.zeros(2, device), ut.zeros(2, device)
    ut.adam_step(p, g, m, v, 1, 0.01, 0.9, 0.999, 1e-8)
    check(p, [0.99, -0.99], 1e-6)
    check(m, [0.1, -0.2], 1e-6)
    check(v, [0.001, 0.004], 1e-6)
    g.copy_from([3, 0])
    ut.adam_step(p, g, m, v, 2, 0.01, 0.9, 0.999, 1e-8)
    check(p, [0.9808222, -0.9832994], 1e-6)
    check(m, [0.39, -0.18], 1e-6)
    check(v, [0.009999, 0.003996], 1e-6)


# -- RNG, mirror, devices, reference counts ----------------------------------------------------
def test_randn(device):
    ut.seed(42)
    a = ut.randn(1000, device=device).numpy().copy()
    ut.seed(42)
    b = ut.randn(1000, device=device).numpy()
    ut.seed(43)
    c = ut.randn(1000, device=device).numpy()
    assert (a == b).all() and not (a == c).all()
    ut.seed(1234)
    r = ut.randn((400, 250), mean=2.0, std=3.0, device=device).numpy().astype(float)
    assert np.isfinite(r).all()
    assert abs(r.mean() - 2) < 0.05 and abs(r.std() - 3) < 0.05


def test_sync_mirror(device):
    t = ut.zeros(3, device)
    t.copy_from([1, 2, 3])  # a host write the next op sees
    check(ut.relu(t), [1, 2, 3], 0)
    t.mul_(2)
    check(t, [2, 4, 6], 0)
    t.copy_from([-5, 4, 6])
    check(ut.relu(t), [0, 4, 6], 0)
    t.mul_(0.5)
    check(t.sync(), [-2.5, 2, 3], 0)  # read-only sync: the device copy stays valid
    check(ut.relu(t), [0, 2, 3], 0)
    u = T(3, [1, 1, 1], device)
    u.add_(t)
    u.copy_from(u.numpy() * np.array([1, 0, 1]) + np.array([0, 10, 0]))
    u.add_(t)
    check(u, [-4, 12, 7], 0)


def test_to_device(device):
    t = T(3, [1, 2, 3], "cpu")
    u = t.to(device)
    assert u.device == device
    u.mul_(2)
    back = u.to("cpu")
    assert back.device == "cpu" and back.ptr.gpu_buf == ffi.NULL
    check(back, [2, 4, 6], 0)
    assert back.to("cpu") is back
    # a layer moves in place, parameters and gradients together
    l = ut.Linear(2, 2, device="cpu").to(device)
    assert l.device == device and l.weight.grad.device == device


def test_refcount(device):
    live0 = ut.live_tensors()
    t = ut.zeros(4, device)
    assert ut.live_tensors() == live0 + 1 and t.ptr.rc == 1
    v = t.numpy()  # a view holds its own reference
    assert t.ptr.rc == 2
    del v
    import gc

    gc.collect()
    assert t.ptr.rc == 1
    t.close()
    assert ut.live_tensors() == live0
    l = ut.Linear(2, 2, device=device)
    x = ut.zeros((1, 2), device)
    l(x).close()
    assert x.ptr.rc == 2  # the forward cache retains the input...
    l.eval()
    assert x.ptr.rc == 1  # ...until it is dropped
    l.close()
    l.close()  # again: harmless
    x.close()
    assert ut.live_tensors() == live0


def test_wrap(device):
    """ut_wrap is not part of the Python API; its C contract is checked through the bindings."""
    released = []
    release = ffi.callback("void(void*)", lambda ctx: released.append(1))
    if device == "cpu":
        buf = np.array([1, -2, 3, -4], dtype=np.float32)
        t = lib.ut_wrap(2, ffi.new("int[]", [2, 2]), lib.UT_CPU, ffi.from_buffer("float[]", buf), release, ffi.NULL)
        assert t != ffi.NULL and t.borrowed and t.rc == 1
        w = ut.Tensor._wrap(t)  # the Python object owns the one reference
        check(ut.relu(w), [1, 0, 3, 0], 0)
        w.mul_(2)
        np.testing.assert_array_equal(buf, [2, -4, 6, -8])
        buf[0] = 10
        check(w.clone(), [10, -4, 6, -8], 0)
        assert not released
        w.close()
        assert released == [1]
    elif not ut.cuda_available():
        one = ffi.new("float[2]")
        assert lib.ut_wrap(1, ffi.new("int[]", [2]), lib.UT_CUDA, one, release, ffi.NULL) == ffi.NULL
        assert lib.ut_last_status() == lib.UT_ERR_DEVICE
    one = ffi.new("float*", 1.0)
    dev = lib.UT_CUDA if device == "cuda" else lib.UT_CPU
    assert lib.ut_wrap(1, ffi.new("int[]", [1]), dev, ffi.NULL, release, ffi.NULL) == ffi.NULL
    assert lib.ut_last_status() == lib.UT_ERR_ARG
    assert lib.ut_wrap(1, ffi.new("int[]", [1]), 5, one, release, ffi.NULL) == ffi.NULL
    assert len(released) == (1 if device == "cpu" else 0)


def test_cuda_sync(device):
    t = T(2, [1, 2], device).mul_(3)
    ut.synchronize()
    assert lib.ut_cuda_stream_wait(ffi.NULL, ffi.NULL) == 0
    check(t, [3, 6], 0)


# -- larger random inputs against float64 references ------------------------------------------
def test_large_elementwise(device):
    ut.seed(21)
    n = 100003
    x, y = ut.randn(n, 0, 4, device), ut.randn(n, 1, 2, device)
    x64, y64 = x.numpy().astype(float), y.numpy().astype(float)
    np.testing.assert_array_equal(ut.relu(x).numpy(), np.maximum(x64, 0).astype(np.float32))
    np.testing.assert_array_equal(ut.relu6(x).numpy(), np.clip(x64, 0, 6).astype(np.float32))
    np.testing.assert_array_equal(ut.relu6_backward(y, x).numpy(),
                                  np.where((x64 > 0) & (x64 < 6), y64, 0).astype(np.float32))
    acc = x.clone().add_(y).mul_(0.5)
    check(acc, 0.5 * (x64 + y64), 1e-6)
    check(ut.mse_loss_backward(x, y), 2 * (x64 - y64) / n, 1e-5)
    check(ut.mse_loss(x, y), [np.mean((x64 - y64) ** 2)], 1e-5)


def test_large_matmul_transpose(device):
    ut.seed(22)
    a, b = ut.randn((130, 257), device=device), ut.randn((257, 70), device=device)
    c = ut.matmul(a, b)
    old = ut.get_num_threads()
    ut.set_num_threads(1)
    c1 = ut.matmul(a, b)
    ut.set_num_threads(old)
    ctt = ut.matmul(b.transpose(1, 0), a.transpose(0, 1)).transpose(0, 1)
    ref = a.numpy().astype(float) @ b.numpy().astype(float)
    for t in (c, c1, ctt):
        assert np.all(np.abs(t.numpy() - ref) <= 1e-4 * (1 + np.abs(ref)))
    if ffi.string(lib.ut_backend_name(c.ptr.dev)) == b"cpu":
        np.testing.assert_array_equal(c.numpy(), c1.numpy())  # independent of the thread count


def test_large_conv(device):
    ut.seed(23)
    _conv_random_case(device, False, 4, 8, 16, 17, 17, 3, 3, 2, 1)
    _conv_random_case(device, False, 2, 16, 24, 15, 13, 1, 1, 1, 0)
    _conv_random_case(device, True, 4, 32, 0, 20, 19, 3, 5, 2, 2)
    _conv_random_case(device, True, 3, 24, 0, 16, 16, 3, 3, 1, 1)


def _close(got, ref, tol):
    got = got.numpy() if isinstance(got, ut.Tensor) else got
    assert np.all(np.abs(got - ref) <= tol * (1 + np.abs(ref)))


def test_large_norms(device):
    ut.seed(24)
    l = ut.LayerNorm(257, device=device)
    l.weight.copy_(1) if False else l.weight.copy_from(ut.randn(257, 1, 0.5, device))
    l.bias.copy_from(ut.randn(257, 0, 0.5, device))
    x, go = ut.randn((150, 257), 3, 2, device), ut.randn((150, 257), 0, 1, device)
    y = l(x)
    dx = l.backward(go)
    x64, g64, b64, go64 = (t.numpy().astype(float) for t in (x, l.weight, l.bias, go))
    _close(y, R.layernorm(x64, g64, b64, 1e-5), 1e-4)
    rdx, rdw, rdb = R.layernorm_backward(x64, g64, 1e-5, go64)
    _close(dx, rdx, 1e-3)
    _close(l.weight.grad, rdw, 1e-4)
    _close(l.bias.grad, rdb, 1e-4)

    bn = ut.BatchNorm2d(7, device=device)
    bn.weight.copy_from(ut.randn(7, 1, 0.5, device))
    bn.bias.copy_from(ut.randn(7, 0, 0.5, device))
    x, go = ut.randn((10, 7, 23, 21), -2, 3, device), ut.randn((10, 7, 23, 21), 0, 1, device)
    y = bn(x)
    dx = bn.backward(go)
    x64, g64, b64, go64 = (t.numpy().astype(float) for t in (x, bn.weight, bn.bias, go))
    ry, mean, var = R.batchnorm2d_train(x64, g64, b64, 1e-5)
    _close(y, ry, 1e-4)
    rdx, rdw, rdb = R.batchnorm2d_backward(x64, g64, 1e-5, go64)
    _close(dx, rdx, 1e-3)
    _close(bn.weight.grad, rdw, 1e-3)
    _close(bn.bias.grad, rdb, 1e-3)
    cnt = 10 * 23 * 21
    _close(bn.running_mean, 0.1 * mean, 1e-4)
    _close(bn.running_var, 0.9 + 0.1 * var * cnt / (cnt - 1), 1e-4)


def test_large_pool_ce_optim(device):
    ut.seed(25)
    x, go = ut.randn((6, 40, 16, 16), 1, 1, device), ut.randn((6, 40), 0, 1, device)
    _close(ut.global_avg_pool2d(x), R.global_avg_pool2d(x.numpy().astype(float)), 1e-5)
    _close(ut.global_avg_pool2d_backward(go, 16, 16), R.global_avg_pool2d_backward(go.numpy().astype(float), 16, 16), 1e-6)
    logits = ut.randn((300, 129), 0, 10, device)
    labels = (np.arange(300) * 37) % 129
    z = logits.numpy().astype(float)
    _close(ut.cross_entropy(logits, labels), R.cross_entropy(z, labels), 1e-5)
    assert np.all(np.abs(ut.cross_entropy_backward(logits, labels).numpy() - R.cross_entropy_backward(z, labels)) <= 1e-7)
    p, g = ut.randn(50000, device=device), ut.randn(50000, device=device)
    pa, v, m, va = p.clone(), ut.zeros(50000, device), ut.zeros(50000, device), ut.zeros(50000, device)
    rp = ra = p.numpy().astype(float)
    g64 = g.numpy().astype(float)
    rv, rm, rva = None, np.zeros(50000), np.zeros(50000)
    rv = np.zeros(50000)
    for step in (1, 2):
        ut.sgd_step(p, g, v, 0.01, 0.9)
        ut.adam_step(pa, g, m, va, step, 0.001, 0.9, 0.999, 1e-8)
        rp, rv = R.sgd_step(rp, g64, rv, 0.01, 0.9)
        ra, rm, rva = R.adam_step(ra, g64, rm, rva, step, 0.001, 0.9, 0.999, 1e-8)
    _close(p, rp, 1e-5)
    _close(pa, ra, 1e-5)


# -- errors: nothing aborts; the right exception with a message -----------------------------------
def test_errors_tensors(device):
    for call, exc in [
        (lambda: ut.zeros((2, 0), device), ut.ShapeError),
        (lambda: ut.zeros((-3, 2), device), ut.ShapeError),
        (lambda: ut.zeros((), device), ut.ShapeError),
        (lambda: ut.zeros((1,) * 9, device), ut.ShapeError),
        (lambda: ut.zeros((65536, 65536), device), ut.ShapeError),
        (lambda: ut.zeros((2**31 - 1, 2, 1), device), ut.ShapeError),
        (lambda: ut.randn((65536, 65536), device=device), ut.ShapeError),
    ]:
        with pytest.raises(exc):
            call()
    a = T((2, 3), [1, 2, 3, 4, 5, 6], device)
    b, v3 = ut.zeros((2, 2), device), ut.zeros((2, 3, 1), device)
    for call, exc in [
        (lambda: ut.matmul(a, b), ut.ShapeError),
        (lambda: ut.matmul(a, v3), ut.ShapeError),
        (lambda: ut.relu_backward(a, b), ut.ShapeError),
        (lambda: ut.relu6_backward(b, a), ut.ShapeError),
        (lambda: a.add_(b), ut.ShapeError),
        (lambda: b.copy_from(a), ut.ShapeError),
        (lambda: a.reshape(4, 2), ut.ShapeError),
        (lambda: a.reshape(-2, -3), ut.ShapeError),
        (lambda: ut.functional.bias_add_(a, b), ut.ShapeError),
        (lambda: ut.mse_loss(a, b), ut.ShapeError),
        (lambda: ut.mse_loss_backward(a, b), ut.ShapeError),
        (lambda: ut.matmul(None, a), ut.ArgumentTypeError),
        (lambda: a.add_(None), ut.ArgumentTypeError),
        (lambda: a.transpose(0, 2), ut.ArgumentError),
        (lambda: ut.global_avg_pool2d(a), ut.ShapeError),
        (lambda: ut.global_avg_pool2d_backward(v3, 1, 1), ut.ShapeError),
        (lambda: ut.global_avg_pool2d_backward(a, 0, 2), ut.ArgumentError),
        (lambda: ut.set_num_threads(0), ut.ArgumentError),
    ]:
        with pytest.raises(exc) as info:
            call()
        assert str(info.value)
    assert ut.get_num_threads() >= 1
    other = [d for d in ut.devices() if d != device]
    if other:  # device mismatch (needs both devices present)
        o, o33 = T((2, 3), [1] * 6, other[0]), ut.zeros((3, 3), other[0])
        for call in (lambda: a.add_(o), lambda: ut.matmul(a, o33), lambda: ut.mse_loss(a, o),
                     lambda: ut.relu_backward(a, o)):
            with pytest.raises((ut.DeviceError, ut.ArgumentError)):
                call()
    check(a, [1, 2, 3, 4, 5, 6], 0)  # the failed calls did not touch their arguments


def test_errors_layers(device):
    live0 = ut.live_tensors()
    for call in [lambda: ut.Conv2d(0, 1, 3, device=device), lambda: ut.Conv2d(1, -2, 3, device=device),
                 lambda: ut.Conv2d(1, 1, (0, 3), device=device), lambda: ut.Conv2d(1, 1, 3, stride=0, device=device),
                 lambda: ut.Conv2d(1, 1, 3, padding=-1, device=device), lambda: ut.DWConv2d(0, 3, device=device),
                 lambda: ut.DWConv2d(2, 3, stride=0, device=device), lambda: ut.DWConv2d(2, 3, padding=-1, device=device),
                 lambda: ut.DWConv2d(2, (3, -1), device=device), lambda: ut.Linear(0, 3, device=device),
                 lambda: ut.Linear(3, 0, bias=False, device=device), lambda: ut.LayerNorm(0, device=device),
                 lambda: ut.LayerNorm(4, eps=-1, device=device), lambda: ut.BatchNorm2d(0, device=device),
                 lambda: ut.BatchNorm2d(2, eps=-1e-5, device=device),
                 lambda: ut.BatchNorm2d(2, momentum=1.5, device=device)]:
        with pytest.raises(ut.ArgumentError):
            call()
    with pytest.raises(ut.ShapeError):
        ut.Conv2d(65536, 65536, 3, device=device)
    assert ut.live_tensors() == live0

    l = ut.Conv2d(2, 3, 3, device=device)
    x3, xc, xs = ut.zeros((2, 5, 5), device), ut.zeros((1, 3, 5, 5), device), ut.zeros((1, 2, 2, 5), device)
    x = ut.zeros((1, 2, 5, 5), device)
    for bad in (x3, xc, xs):
        with pytest.raises(ut.ShapeError):
            l(bad)
    with pytest.raises(ut.ArgumentTypeError):
        l(None)
    with pytest.raises(ut.ArgumentError):
        l.backward(ut.zeros((1, 3, 3, 3), device))  # no forward yet
    l(x).close()
    with pytest.raises(ut.ShapeError):
        l.backward(ut.zeros((1, 3, 2, 3), device))
    with pytest.raises(ut.ArgumentTypeError):
        l.backward(None)
    assert not l.weight.grad.numpy().any() and not l.bias.grad.numpy().any()

    d = ut.DWConv2d(2, 3, bias=False, device=device)
    for bad in (xc, xs, x3):
        with pytest.raises(ut.ShapeError):
            d(bad)
    d(x).close()
    with pytest.raises(ut.ShapeError):
        d.backward(ut.zeros((1, 2, 2, 2), device))

    lx = ut.zeros((3, 5), device)
    with pytest.raises(ut.ShapeError):
        ut.Linear(4, 2, device=device)(lx)
    with pytest.raises(ut.ShapeError):
        ut.Linear(4, 2, device=device)(x3)
    with pytest.raises(ut.ShapeError):
        ut.LayerNorm(4, device=device)(lx)
    bn = ut.BatchNorm2d(3, device=device)
    for bad in (x, lx):
        with pytest.raises(ut.ShapeError):
            bn(bad)

    logits = ut.zeros((2, 3), device)
    for labels, exc in [(ut.tensor([0, 3], device), ut.ArgumentError),
                        (ut.tensor([0, 1.5], device), ut.ArgumentError),
                        (ut.tensor([-1, 0], device), ut.ArgumentError),
                        (np.array([0, 3]), ut.ArgumentError),
                        (ut.tensor([0, 0, 0], device), ut.ShapeError)]:
        with pytest.raises(exc):
            ut.cross_entropy(logits, labels)
        with pytest.raises(exc):
            ut.cross_entropy_backward(logits, labels)
    with pytest.raises(ut.ShapeError):
        ut.cross_entropy(ut.zeros(3, device), np.array([0, 0, 0]))
    dw, dwbad, db = ut.zeros(54, device), ut.zeros(7, device), ut.zeros(3, device)
    for call, exc in [(lambda: ut.sgd_step(dw, dwbad, None, 0.1, 0), ut.ShapeError),
                      (lambda: ut.sgd_step(db, db, dwbad, 0.1, 0.9), ut.ShapeError),
                      (lambda: ut.sgd_step(None, db, None, 0.1, 0), ut.ArgumentTypeError),
                      (lambda: ut.adam_step(db, db, db, dwbad, 1, 0.1, 0.9, 0.999, 1e-8), ut.ShapeError),
                      (lambda: ut.adam_step(db, db, db, db, 0, 0.1, 0.9, 0.999, 1e-8), ut.ArgumentError)]:
        with pytest.raises(exc):
            call()
