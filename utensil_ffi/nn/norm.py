"""Normalization: LayerNorm (over the last dimension), LayerNorm2d (over the channels of NCHW:
ConvNeXt's) and BatchNorm2d (over N, H, W per channel, with running statistics and an optional
fused activation)."""

from .. import _args
from .._errors import ArgumentError
from .._lib import ffi, lib
from ..tensor import Tensor
from ._clayer import _CLayer, _TensorField

__all__ = ["LayerNorm", "LayerNorm2d", "BatchNorm2d"]


class LayerNorm(_CLayer):
    """x: [..., D] -> same shape, normalized over the last dimension; weight, bias: [D]."""

    _c_struct = ffi.typeof("ut_layernorm *")
    _c_cache = ffi.typeof("ut_layernorm_cache *")
    _c_forward = lib.ut_layernorm_forward
    _c_backward = lib.ut_layernorm_backward
    _c_cache_free = lib.ut_layernorm_cache_free
    _c_free = lib.ut_layernorm_free

    def __init__(self, normalized_shape, eps=1e-5, device="cpu"):
        if isinstance(normalized_shape, (tuple, list)):
            if len(normalized_shape) != 1:
                raise ArgumentError("LayerNorm normalizes over the last dimension only")
            normalized_shape = normalized_shape[0]
        self.dim = _args.to_int(normalized_shape, "normalized_shape", 1)
        self.eps = _args.to_float(eps, "eps", lo=0.0)
        super().__init__(device, lib.ut_layernorm_alloc, self.dim, self.eps)

    def _describe(self):
        return "%d, eps=%g" % (self.dim, self.eps)


class LayerNorm2d(LayerNorm):
    """x: [N, C, H, W] -> same shape, each (n, h, w) normalized over the C channels; weight,
    bias: [C] (torchvision.models.convnext.LayerNorm2d, whose eps ConvNeXt sets to 1e-6; the
    same state_dict keys, weight and bias). Activations float32 or bfloat16 (statistics in
    float32); one pass over NCHW in place of PyTorch's permute, LayerNorm, permute back."""

    _c_forward = lib.ut_layernorm2d_forward
    _c_backward = lib.ut_layernorm2d_backward

    def __init__(self, normalized_shape, eps=1e-6, device="cpu"):
        super().__init__(normalized_shape, eps, device)


class BatchNorm2d(_CLayer):
    """x: [N, C, H, W] -> same shape; weight, bias: [C].

    Training mode normalizes with the batch statistics and updates running_mean/running_var
    (running = (1 - momentum) running + momentum batch); eval mode uses the running statistics.
    Unlike the other layers, forward keeps its (small) cache in eval mode too, so backward
    works with frozen statistics (fine-tuning with a fixed normalization).

    ``activation`` applies an activation to the output in the same pass over the data, forward
    and backward: "relu", "relu6", "silu", "hardswish", "hardsigmoid", "sigmoid", "gelu" (erf)
    or "gelu_tanh" (GELU(approximate="tanh")). The results are those of BatchNorm2d followed by
    the activation's layer, with two fewer trips through memory per step (backward recomputes
    the pre-activation from the input it keeps anyway). Its state_dict is BatchNorm2d's.
    """

    _c_struct = ffi.typeof("ut_batchnorm2d *")
    _c_cache = ffi.typeof("ut_batchnorm2d_cache *")
    _c_forward = lib.ut_batchnorm2d_forward
    _c_backward = lib.ut_batchnorm2d_backward
    _c_cache_free = lib.ut_batchnorm2d_cache_free
    _c_free = lib.ut_batchnorm2d_free

    running_mean = _TensorField()
    running_var = _TensorField()
    # in eval mode a Sequential runs a convolution and this layer after it as one step, in
    # training this layer and a DWConv2d after it (fold.py; this class only, not SyncBatchNorm)
    _folds_into_conv = True
    _folds_into_dw = True

    # the names are ut_activation_name's (the C enum's); GELU's "gelu_tanh" is
    # GELU(approximate="tanh")
    _ACTIVATIONS = {None: lib.UT_ACT_NONE, "relu": lib.UT_ACT_RELU, "relu6": lib.UT_ACT_RELU6,
                    "silu": lib.UT_ACT_SILU, "hardswish": lib.UT_ACT_HARDSWISH,
                    "hardsigmoid": lib.UT_ACT_HARDSIGMOID, "sigmoid": lib.UT_ACT_SIGMOID,
                    "gelu": lib.UT_ACT_GELU, "gelu_tanh": lib.UT_ACT_GELU_TANH}

    def __init__(self, num_features, eps=1e-5, momentum=0.1, device="cpu", activation=None):
        if activation is not None:
            _args.to_str(activation, "activation", tuple(k for k in self._ACTIVATIONS if k))
        self.num_features = _args.to_int(num_features, "num_features", 1)
        self.eps = _args.to_float(eps, "eps", lo=0.0)
        self.momentum = _args.to_float(momentum, "momentum", lo=0.0, hi=1.0)
        super().__init__(device, lib.ut_batchnorm2d_alloc, self.num_features, self.eps,
                         self.momentum)
        self._running_mean = Tensor._borrow(self._struct.running_mean)
        self._running_var = Tensor._borrow(self._struct.running_var)
        self._struct.training = True
        self._struct.activation = self._ACTIVATIONS[activation]

    @property
    def activation(self):
        """None or an activation's name (see the class): what forward applies to its output in
        the same pass."""
        code = self._struct.activation
        return next(k for k, v in self._ACTIVATIONS.items() if v == code)

    def train(self, mode=True):
        super().train(mode)
        self._struct.training = _args.to_bool(mode, "mode")
        return self

    def _keeps_cache(self):
        return True

    def _tensors(self):
        return super()._tensors() + [self._running_mean.ptr, self._running_var.ptr]

    def _writes_state(self):
        return self.training

    def close(self):
        was_open = not self.closed
        super().close()
        if was_open:
            self._running_mean.close()
            self._running_var.close()

    def _describe(self):
        act = ", activation=%r" % self.activation if self.activation else ""
        return "%d, eps=%g, momentum=%g%s" % (self.num_features, self.eps, self.momentum, act)

    # PyTorch's BatchNorm2d counts training forwards in num_batches_tracked; only its
    # momentum=None mode reads it, which this layer does not have, but the count keeps the state
    # dict's keys PyTorch's.
    num_batches_tracked = 0

    def forward(self, x):
        y = super().forward(x)
        if self.training:
            self.num_batches_tracked += 1
        return y

    def _own_buffers(self):
        self._struct
        return [("running_mean", self._running_mean), ("running_var", self._running_var)]

    def _extra_state(self):
        return [("num_batches_tracked", self.num_batches_tracked)]

    def _set_extra_state(self, name, value):
        self.num_batches_tracked = value
