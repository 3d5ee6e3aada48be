"""MobileNetV2 (Sandler et al. 2018) in torchvision's layout and state_dict keys.

    net = utensil_ffi.models.mobilenet_v2(num_classes=10, in_channels=1)

The model is a Sequential named as torchvision's MobileNetV2 attributes::

    features.0            conv_norm_act 3x3 stride 2 (ReLU6): "0.0.weight", "0.1.running_mean"
    features.1 .. 17      InvertedResidual, body "conv": [conv_norm_act 1x1 expand (ReLU6),
                          unless t == 1], conv_norm_act 3x3 depthwise (ReLU6), Conv2d 1x1
                          project, BatchNorm2d: "features.2.conv.0.0.weight" ...
                          "features.2.conv.3.running_var"; x + conv(x) when stride 1, in == out
    features.18           conv_norm_act 1x1 to 1280 (ReLU6)
    avgpool               GlobalAvgPool2d (torchvision's adaptive pool + flatten; no keys)
    classifier            "0" Dropout(dropout), "1" Linear(1280, num_classes)

(the flat ``utensil_ffi.nn.models.mobilenet_v2`` pairs with torchvision by order only and
stays for its checkpoints).
"""

from collections import OrderedDict

from .. import _args
from .. import nn
from .._errors import ArgumentError
from ._blocks import InvertedResidual
from ._utils import (bn_act, check_kwargs, check_weights, classifier_net, conv_norm_act,
                     init_conv_kaiming, init_normal, init_weights, make_divisible,
                     stem_stride_arg)

__all__ = ["mobilenet_v2"]

# (expansion t, channels c, repeats n, first stride s), the paper's table 2
_SETTING = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1),
            (6, 160, 3, 2), (6, 320, 1, 1))


def _block(cin, cout, stride, t, fused, device):
    hidden = int(round(cin * t))
    layers = []
    if t != 1:
        layers.append(conv_norm_act(cin, hidden, 1, act="relu6", fused=fused, device=device))
    layers.append(conv_norm_act(hidden, hidden, 3, stride, groups=hidden, act="relu6",
                                fused=fused, device=device))
    layers.append(nn.Conv2d(hidden, cout, 1, bias=False, device=device))
    layers += [m for _, m in bn_act(cout, None, device=device)]
    body = nn.Sequential(OrderedDict((str(i), m) for i, m in enumerate(layers)))
    return InvertedResidual(body, stride == 1 and cin == cout, child="conv")


def mobilenet_v2(*, weights=None, progress=True, num_classes=1000, width_mult=1.0,
                 round_nearest=8, dropout=0.2, in_channels=3, device="cpu", fused=True,
                 stem_stride=2, **kwargs):
    """torchvision.models.mobilenet_v2 (3,504,872 parameters at 1000 classes), initialised as
    torchvision's (kaiming-normal fan_out convolutions, Linear N(0, 0.01)) from the library's
    RNG. ``in_channels`` (utensil's) sets the stem's input channels; ``fused`` folds each
    ReLU6 into its BatchNorm2d (same keys); ``stem_stride`` 1 (utensil's) suits small images.
    ``weights`` must be None (see check_weights)."""
    check_weights("mobilenet_v2", weights, progress)
    check_kwargs("mobilenet_v2", kwargs)
    width_mult = _args.to_float(width_mult, "width_mult", lo=0.0)
    if not width_mult > 0:
        raise ArgumentError("mobilenet_v2: width_mult must be > 0, got %r" % width_mult)
    rn = _args.to_int(round_nearest, "round_nearest", 1)
    c = make_divisible(32 * width_mult, rn)
    last = make_divisible(1280 * max(1.0, width_mult), rn)
    features = [conv_norm_act(_args.to_int(in_channels, "in_channels", 1), c, 3,
                              stem_stride_arg(stem_stride),
                              act="relu6", fused=fused, device=device)]
    for t, ch, n, s in _SETTING:
        out = make_divisible(ch * width_mult, rn)
        for i in range(n):
            features.append(_block(c, out, s if i == 0 else 1, t, fused, device))
            c = out
    features.append(conv_norm_act(c, last, 1, act="relu6", fused=fused, device=device))
    head = nn.Sequential(nn.Dropout(dropout), nn.Linear(last, _args.to_int(
        num_classes, "num_classes", 1), device=device))
    net = classifier_net(("features", nn.Sequential(features)), head)
    return init_weights(net, init_conv_kaiming, lambda m: init_normal(m, 0.01))
