"""What the model families share: torchvision's channel rounding, the conv + norm + activation
unit (torchvision.ops.Conv2dNormActivation's keys), the builders' common arguments, and weight
initialisation drawn from the library's RNG (``ut.seed(n)`` makes a model repeat).

conv_norm_act(...) is a Sequential named as torchvision's: "0" the convolution (DWConv2d when
it is depthwise: groups == in == out), "1" the BatchNorm2d, "2" the activation. With
``fused=True`` an activation BatchNorm2d can apply itself (``BatchNorm2d._ACTIVATIONS``, looked
up by name, so activations added there are fused without a change here) is folded into it and
"2" is absent; the state_dict keys are the same either way.
"""

from collections import OrderedDict

import numpy as np

from .. import _args
from .._errors import ArgumentError, ArgumentTypeError
from .. import nn
from ..tensor import randn

__all__ = ["make_divisible", "conv_norm_act", "bn_act", "activation", "PointwiseLinear",
           "check_weights", "init_conv_kaiming", "init_normal", "init_uniform",
           "init_trunc_normal", "init_zeros", "init_bn", "init_weights", "check_kwargs",
           "classifier_net", "stem_stride_arg"]

# torchvision's activation classes by the names BatchNorm2d._ACTIVATIONS uses
_ACTIVATION_CLASSES = {
    "relu": nn.ReLU, "relu6": nn.ReLU6, "silu": nn.SiLU, "hardswish": nn.Hardswish,
    "hardsigmoid": nn.Hardsigmoid, "sigmoid": nn.Sigmoid, "gelu": nn.GELU,
}


def make_divisible(v, divisor=8, min_value=None):
    """torchvision's channel rounding: the multiple of ``divisor`` nearest ``v`` (at least
    ``min_value``, default ``divisor``), one step up when rounding down loses more than 10%."""
    if min_value is None:
        min_value = divisor
    new_v = max(min_value, int(v + divisor / 2) // divisor * divisor)
    if new_v < 0.9 * v:
        new_v += divisor
    return new_v


def activation(name):
    """A new activation module from its name ("relu", "hardswish", ...)."""
    return _ACTIVATION_CLASSES[name]()


def bn_act(channels, act, *, eps=1e-5, momentum=0.1, fused=True, device="cpu", first=1):
    """[(name, module)]: BatchNorm2d named str(first), then the activation ``act`` (a name or
    None) named str(first + 1) unless it is fused into the BatchNorm2d."""
    if fused and act is not None and act in nn.BatchNorm2d._ACTIVATIONS:
        return [(str(first), nn.BatchNorm2d(channels, eps=eps, momentum=momentum, device=device,
                                            activation=act))]
    out = [(str(first), nn.BatchNorm2d(channels, eps=eps, momentum=momentum, device=device))]
    if act is not None:
        out.append((str(first + 1), activation(act)))
    return out


def conv_norm_act(cin, cout, kernel_size=3, stride=1, groups=1, act="relu", *, dilation=1,
                  eps=1e-5, momentum=0.1, fused=True, device="cpu"):
    """torchvision's Conv2dNormActivation with BatchNorm2d: padding (k - 1) // 2 * dilation, no
    bias. groups is 1 (dense) or cin == cout (depthwise); nothing between is built."""
    pad = (kernel_size - 1) // 2 * dilation
    if groups == 1 and dilation == 1:
        conv = nn.Conv2d(cin, cout, kernel_size, stride=stride, padding=pad, bias=False,
                         device=device)
    elif groups == cin == cout:
        conv = nn.DWConv2d(cin, kernel_size, stride=stride, padding=pad, bias=False,
                           device=device, dilation=dilation)
    else:
        raise ArgumentError("conv_norm_act: groups=%d, dilation=%d for %d -> %d channels: only a "
                            "dense undilated or a depthwise convolution is built"
                            % (groups, dilation, cin, cout))
    return nn.Sequential(OrderedDict([("0", conv)] + bn_act(
        cout, act, eps=eps, momentum=momentum, fused=fused, device=device)))


class PointwiseLinear(nn.Conv2d):
    """torch's Linear over the channels of a channels-last tensor, as a 1x1 Conv2d on NCHW (no
    permutes): the same function, with a Linear's state_dict shape ([out, in]) for its weight,
    so ConvNeXt's ``block.3.weight`` loads as it is. Either shape loads."""

    def __init__(self, in_features, out_features, bias=True, device="cpu"):
        super().__init__(in_features, out_features, 1, bias=bias, device=device)

    def _state_shape(self, name, shape):
        return tuple(shape[:2]) if name == "weight" else shape

    def __repr__(self):
        if self.closed:
            return "PointwiseLinear(<closed>)"
        return "PointwiseLinear(%d, %d, bias=%s, device=%r)" % (
            self.in_channels, self.out_channels, self._bias is not None, self.device)


def check_weights(name, weights, progress=True):
    """torchvision's ``weights=`` is accepted only as None: nothing is downloaded here."""
    if weights is not None:
        raise ArgumentError(
            "%s(weights=%r): utensil does not download pretrained weights; build the model with "
            "weights=None and load a torchvision state_dict: net.load_state_dict({k: v.numpy() "
            "for k, v in torchvision.models.%s(weights=...).state_dict().items()})"
            % (name, weights, name))
    _args.to_bool(progress, "progress")


def stem_stride_arg(stem_stride):
    """utensil's ``stem_stride`` (torchvision's stem has stride 2): 1 keeps small images (32 px)
    from shrinking to 1x1 before the head. A stride is no weight, so the keys are the same."""
    return _args.to_int(stem_stride, "stem_stride", 1, 2)


def check_kwargs(name, kwargs):
    """torchvision's builders pass unknown keywords to the model class, which refuses them."""
    if kwargs:
        raise ArgumentTypeError("%s() got unexpected keyword arguments %s (utensil builds "
                                "torchvision's defaults for block, norm_layer and settings)"
                                % (name, sorted(kwargs)))


# -- initialisation, from the library's RNG -----------------------------------------------------

def _normal(shape, std):
    return randn(tuple(shape), 0.0, float(std)).numpy()


def _fan_out(layer):
    """torch's fan_out of the weight it would have: out * kh * kw (a depthwise convolution's
    [C, 1, kh, kw] weight too)."""
    kh, kw = layer.kernel_size
    return layer.out_channels * kh * kw


def init_conv_kaiming(layer):
    """kaiming_normal_(mode="fan_out", ReLU gain): std sqrt(2 / fan_out); bias zero."""
    layer.weight = _normal(layer.weight.shape, np.sqrt(2.0 / _fan_out(layer)))
    init_zeros(layer, "bias")


def init_normal(layer, std):
    layer.weight = _normal(layer.weight.shape, std)
    init_zeros(layer, "bias")


def init_uniform(layer, bound):
    """U(-bound, bound) from normals: exp(-(z1^2 + z2^2) / 2) is uniform on (0, 1)."""
    shape = layer.weight.shape
    z = _normal((2,) + tuple(shape), 1.0)
    u = np.exp(-0.5 * (z[0].astype(np.float64) ** 2 + z[1].astype(np.float64) ** 2))
    layer.weight = ((2.0 * u - 1.0) * bound).astype(np.float32)
    init_zeros(layer, "bias")


def init_trunc_normal(layer, std, a=-2.0, b=2.0):
    """trunc_normal_(std, a, b): the draws outside [a, b] (absolute bounds) drawn again."""
    w = _normal(layer.weight.shape, std)
    bad = (w < a) | (w > b)
    while bad.any():
        w[bad] = _normal((int(bad.sum()),), std)
        bad = (w < a) | (w > b)
    layer.weight = w
    init_zeros(layer, "bias")


def init_zeros(layer, name="bias"):
    t = getattr(layer, "_" + name, None)
    if t is not None:
        t.copy_from(np.zeros(t.shape, np.float32))


def init_bn(layer):
    layer.weight = np.ones(layer.weight.shape, np.float32)
    init_zeros(layer, "bias")


def init_weights(net, conv, linear):
    """torchvision's init loop: ``conv(layer)`` for each convolution (dense, depthwise,
    PointwiseLinear), ``linear(layer)`` for each Linear, ones and zeros for each BatchNorm2d
    (LayerNorm's are ones and zeros already), in module order, so a seed gives one model."""
    for _, m in net.named_modules():
        if isinstance(m, (nn.Conv2d, nn.DWConv2d)):
            conv(m)
        elif isinstance(m, nn.Linear):
            linear(m)
        elif isinstance(m, nn.BatchNorm2d):
            init_bn(m)
    return net


def classifier_net(features, head, pool="avgpool"):
    """The model: a Sequential named as torchvision's model attributes, ``features`` (or
    MNASNet's ``layers``), the global average pool ([N, C]: torchvision's avgpool + flatten, or
    MNASNet's mean), and the classifier."""
    return nn.Sequential(OrderedDict([(features[0], features[1]), (pool, nn.GlobalAvgPool2d()),
                                      ("classifier", head)]))
