"""Impossible or overflowing convolution geometry: a clear exception from C, never a crash.

The crash cases run in a child process (a regression kills the child, not the test run); the
in-process checks pin the exception type and message. The C API's own checks are in
native/test.c (test_hostile_api)."""

import subprocess
import sys

import numpy as np
import pytest

import utensil_ffi as ut
from utensil_ffi import ArgumentError, ShapeError

CRASHED_ON_MAIN = [
    # an int product of the output size overflowed: im2col wrote past a short buffer (SIGSEGV)
    ("ut.Conv2d(1, 1, 1, padding=32768)(ut.ones((1, 1, 1, 1)))", "ShapeError"),
    # padded extent 2^31: the depthwise engines' int sizes overflowed (SIGSEGV)
    ("ut.DWConv2d(1, 3, stride=2**30, padding=2**30 - 1)(ut.ones((1, 1, 2, 2)))", "ArgumentError"),
    # forward ran, backward overflowed its scratch sizes (SIGABRT)
    ("l = ut.DWConv2d(1, 3, stride=2**31 - 1, padding=2**30)\n"
     "y = l(ut.ones((1, 1, 2, 2)))\nl.backward(ut.ones(y.shape))", "ArgumentError"),
    # a C user's layer struct edited past what alloc accepts
    ("from utensil_ffi._lib import ffi, lib\n"
     "l = ffi.new('ut_dwconv2d*', lib.ut_dwconv2d_alloc(1, 3, 3, 1, 0, False, lib.UT_CPU))\n"
     "l.stride, l.pad = 2**30, 2**30 - 1\n"
     "x = ut.ones((1, 1, 2, 2))\n"
     "assert lib.ut_dwconv2d_forward(l, x.ptr, ffi.NULL) == ffi.NULL\n"
     "print('Error', ffi.string(lib.ut_last_error()).decode())\n"
     "lib.ut_dwconv2d_free(l)", "padding"),
    ("ut.Conv2d(1, 1, 3, padding=20000)(ut.ones((1, 1, 1, 1)))", "ShapeError"),
]


@pytest.mark.parametrize("code, exc", CRASHED_ON_MAIN)
def test_hostile_geometry_in_child(code, exc):
    src = "import utensil_ffi as ut\ntry:\n%s\nexcept Exception as e:\n    print(type(e).__name__, e)\n" % (
        "\n".join("    " + line for line in code.splitlines())
    )
    r = subprocess.run([sys.executable, "-c", src], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, "child died with %d: %s" % (r.returncode, r.stderr[-2000:])
    assert exc in r.stdout, r.stdout + r.stderr


def test_conv2d_output_too_large():
    with pytest.raises(ShapeError, match="elements"):
        ut.Conv2d(1, 1, 1, padding=32768)(ut.ones((1, 1, 1, 1)))


def test_conv2d_im2col_too_large():
    # the output (1.6e9 floats) fits an int, its 3x3 im2col buffer does not
    with pytest.raises(ShapeError, match="im2col"):
        ut.Conv2d(1, 1, 3, padding=20000)(ut.ones((1, 1, 1, 1)))


@pytest.mark.parametrize("stride, padding", [(2**30, 2**30 - 1), (2**31 - 1, 2**30), (1, 2**30)])
def test_padding_that_fits_no_input_is_refused_at_construction(stride, padding):
    with pytest.raises(ArgumentError, match="padding"):
        ut.DWConv2d(1, 3, stride=stride, padding=padding)
    with pytest.raises(ArgumentError, match="padding"):
        ut.Conv2d(1, 1, 3, stride=stride, padding=padding)


def test_padded_extent_plus_stride_beyond_int_is_a_shape_error():
    l = ut.DWConv2d(1, 3, stride=2**30, padding=2**29)
    with pytest.raises(ShapeError, match="stride"):
        l(ut.ones((1, 1, 2**3, 2**3)))


def test_huge_stride_with_one_output_pixel_is_computed():
    # the stride is never applied to a single output pixel: padding 2^29 and stride 2^31-1 give
    # a [1, 1, 1, 1] output that reads only padding, and the gradients are zero
    l = ut.DWConv2d(1, 3, stride=2**31 - 1, padding=2**29)
    y = l(ut.ones((1, 1, 2, 2)))
    assert y.shape == (1, 1, 1, 1)
    np.testing.assert_array_equal(y.numpy(), 0)
    dx = l.backward(ut.ones(y.shape))
    np.testing.assert_array_equal(dx.numpy(), 0)
    np.testing.assert_array_equal(l.weight.grad.numpy(), 0)


def test_strided_1x1_conv_with_one_output_is_not_treated_as_pointwise():
    # kernel 1, padding 0, stride 10 on a 5x5 input: one output pixel, x[0, 0] * w
    l = ut.Conv2d(1, 1, 1, stride=10, bias=False)
    x = np.arange(1, 26, dtype=np.float32).reshape(1, 1, 5, 5)
    y = l(ut.tensor(x))
    w = float(l.weight.numpy().ravel()[0])
    assert y.shape == (1, 1, 1, 1)
    np.testing.assert_allclose(y.numpy().ravel(), [w * 1.0], rtol=1e-6)
    dx = l.backward(ut.ones((1, 1, 1, 1))).numpy().ravel()
    want = np.zeros(25, np.float32)
    want[0] = w
    np.testing.assert_allclose(dx, want, rtol=1e-6)


def test_global_avg_pool_backward_too_large():
    with pytest.raises(ShapeError):
        ut.functional.global_avg_pool2d_backward(ut.ones((1, 1)), 65536, 65536)
