"""Convolutions: Conv2d (dense) and DWConv2d (depthwise, with dilation and a channel multiplier)."""

from .. import _args
from .._errors import ArgumentError
from .._lib import ffi, lib
from ._clayer import _CLayer

__all__ = ["Conv2d", "DWConv2d"]


def _kernel(value, name):
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise ArgumentError("%s must be an int or a pair (kh, kw), got %r" % (name, value))
        return _args.to_int(value[0], name, 1), _args.to_int(value[1], name, 1)
    k = _args.to_int(value, name, 1)
    return k, k


class Conv2d(_CLayer):
    """x: [N, in_channels, H, W] -> [N, out_channels, Ho, Wo], Ho = (H + 2 padding - kh) // stride + 1.

    weight: [out_channels, in_channels, kh, kw], bias: [out_channels] (or None).
    """

    _c_struct = ffi.typeof("ut_conv2d *")
    _c_cache = ffi.typeof("ut_conv2d_cache *")
    _c_forward = lib.ut_conv2d_forward
    _c_backward = lib.ut_conv2d_backward
    _c_backward_params = lib.ut_conv2d_backward_params
    _c_cache_free = lib.ut_conv2d_cache_free
    _c_free = lib.ut_conv2d_free
    _c_bn_forward = lib.ut_conv2d_bn_forward  # eval mode, with the BatchNorm2d after it (fold.py)
    _separable_role = "dense"  # a separable chain's expand or project when 1x1 (fold.py)

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, bias=True,
                 device="cpu"):
        self.in_channels = _args.to_int(in_channels, "in_channels", 1)
        self.out_channels = _args.to_int(out_channels, "out_channels", 1)
        self.kernel_size = _kernel(kernel_size, "kernel_size")
        self.stride = _args.to_int(stride, "stride", 1)
        self.padding = _args.to_int(padding, "padding", 0)
        kh, kw = self.kernel_size
        _args.to_shape((self.out_channels, self.in_channels, kh, kw), "weight shape")
        super().__init__(device, lib.ut_conv2d_alloc, self.in_channels, self.out_channels, kh, kw,
                         self.stride, self.padding, _args.to_bool(bias, "bias"))

    def _forget_input(self, index=-1):
        """Free the input (and columns) this thread's forward ``index`` kept (by default the
        last; nothing if that entry is gone): for a caller that can rebuild the same values
        before backward (CNBlock recomputes its GELU's output, the input of its second
        PointwiseLinear) and hands them back with _recall_input."""
        h = self._h
        st = h.state.local()
        with h.state.lock:
            if st is None or not -len(st.entries) <= index < len(st.entries):
                return
            c = st.entries[index][1]
            p, q = c.input, c.col
            c.input = c.col = ffi.NULL
        lib.ut_free(p)
        lib.ut_free(q)

    def _recall_input(self, index, x):
        """Give this thread's entry ``index`` (forgotten by _forget_input) the input ``x``
        again: its own reference, and x's version for backward's check."""
        h = self._h
        st = h.state.local()
        with h.state.lock:
            pid, c, _, vw = st.entries[index]
            old, q = c.input, c.col
            c.input = lib.ut_retain(x.ptr)
            c.col = ffi.NULL  # backward takes a pointwise input itself as its columns
            st.entries[index] = (pid, c, c.input.version, vw)
        lib.ut_free(old)  # a repeated backward's earlier recall
        lib.ut_free(q)

    def _describe(self):
        return "%d, %d, kernel_size=%s, stride=%d, padding=%d, bias=%s" % (
            self.in_channels, self.out_channels, self.kernel_size, self.stride, self.padding,
            self._bias is not None)


class DWConv2d(_CLayer):
    """Depthwise: x: [N, C, H, W] -> [N, out_channels, Ho, Wo], each channel with its own
    kh x kw filters, Ho = (H + 2 padding - dilation (kh - 1) - 1) // stride + 1.

    ``out_channels`` (default C) is a multiple m of C: output channel o reads input channel
    o // m (PyTorch's ``Conv2d(C, out_channels, groups=C)``, TensorFlow's ``depth_multiplier``).
    ``dilation`` spaces the filter's taps (PyTorch's argument). weight: [out_channels, kh, kw],
    bias: [out_channels] (or None).
    """

    _c_struct = ffi.typeof("ut_dwconv2d *")
    _c_cache = ffi.typeof("ut_dwconv2d_cache *")
    _c_forward = lib.ut_dwconv2d_forward
    _c_backward = lib.ut_dwconv2d_backward
    _c_cache_free = lib.ut_dwconv2d_cache_free
    _c_free = lib.ut_dwconv2d_free
    _c_bn_forward = lib.ut_dwconv2d_bn_forward  # eval mode, with the BatchNorm2d after it (fold.py)
    # training, with the BatchNorm2d before it (fold.py)
    _c_bn_train_forward = lib.ut_batchnorm2d_dwconv2d_forward
    _separable_role = "depthwise"  # a separable chain's middle (fold.py)

    def __init__(self, channels, kernel_size, stride=1, padding=0, bias=True, device="cpu", *,
                 dilation=1, out_channels=None):
        self.channels = _args.to_int(channels, "channels", 1)
        self.kernel_size = _kernel(kernel_size, "kernel_size")
        self.stride = _args.to_int(stride, "stride", 1)
        self.padding = _args.to_int(padding, "padding", 0)
        self.dilation = _args.to_int(dilation, "dilation", 1)
        oc = self.channels if out_channels is None else _args.to_int(out_channels, "out_channels", 1)
        if oc % self.channels:
            raise ArgumentError(
                "DWConv2d: out_channels (%d) must be a multiple of channels (%d): each input "
                "channel gets out_channels // channels filters" % (oc, self.channels))
        self.out_channels = oc
        kh, kw = self.kernel_size
        _args.to_shape((oc, kh, kw), "weight shape")
        super().__init__(device, lib.ut_dwconv2d_alloc_ex, self.channels, oc // self.channels, kh,
                         kw, self.stride, self.padding, self.dilation, _args.to_bool(bias, "bias"))

    def _describe(self):
        extra = ""
        if self.out_channels != self.channels:
            extra += ", out_channels=%d" % self.out_channels
        if self.dilation != 1:
            extra += ", dilation=%d" % self.dilation
        return "%d, kernel_size=%s, stride=%d, padding=%d%s, bias=%s" % (
            self.channels, self.kernel_size, self.stride, self.padding, extra,
            self._bias is not None)

    def _state_shape(self, name, shape):
        # PyTorch's depthwise convolution is a Conv2d with groups=C: weight [out_channels, 1, kh, kw]
        return (shape[0], 1) + tuple(shape[1:]) if name == "weight" else shape
