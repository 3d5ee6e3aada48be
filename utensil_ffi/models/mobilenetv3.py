"""MobileNetV3 small and large (Howard et al. 2019) in torchvision's layout and state_dict keys.

    net = utensil_ffi.models.mobilenet_v3_small(num_classes=10)

Every BatchNorm2d has eps 0.001, momentum 0.01. The model is a Sequential named as
torchvision's MobileNetV3 attributes::

    features.0            conv_norm_act 3x3 stride 2 (Hardswish)
    features.1 .. n       InvertedResidual, body "block": [conv_norm_act 1x1 expand, unless
                          expanded == in], conv_norm_act k x k depthwise, [SqueezeExcitation
                          (ReLU, Hardsigmoid; keys "fc1", "fc2")], conv_norm_act 1x1 project (no
                          activation); activation ReLU or Hardswish per row of the table
    features.n+1          conv_norm_act 1x1 to 6 x the last block's channels (Hardswish)
    avgpool               GlobalAvgPool2d
    classifier            "0" Linear, "1" Hardswish, "2" Dropout, "3" Linear(., num_classes)

``reduced_tail`` halves the last stage's channels, ``dilated`` dilates its depthwise
convolutions by 2 (stride 1), as torchvision's arguments.
"""

from collections import OrderedDict

from .. import _args
from .. import nn
from .._errors import ArgumentError
from ._blocks import InvertedResidual
from ._utils import (check_kwargs, check_weights, classifier_net, conv_norm_act,
                     init_conv_kaiming, init_normal, init_weights, make_divisible,
                     stem_stride_arg)

__all__ = ["mobilenet_v3_large", "mobilenet_v3_small"]

_BN = dict(eps=0.001, momentum=0.01)

# (in, kernel, expanded, out, SE, activation, stride, last stage); channels before width_mult
_LARGE = (
    (16, 3, 16, 16, False, "relu", 1, False), (16, 3, 64, 24, False, "relu", 2, False),
    (24, 3, 72, 24, False, "relu", 1, False), (24, 5, 72, 40, True, "relu", 2, False),
    (40, 5, 120, 40, True, "relu", 1, False), (40, 5, 120, 40, True, "relu", 1, False),
    (40, 3, 240, 80, False, "hardswish", 2, False), (80, 3, 200, 80, False, "hardswish", 1, False),
    (80, 3, 184, 80, False, "hardswish", 1, False), (80, 3, 184, 80, False, "hardswish", 1, False),
    (80, 3, 480, 112, True, "hardswish", 1, False), (112, 3, 672, 112, True, "hardswish", 1, False),
    (112, 5, 672, 160, True, "hardswish", 2, True), (160, 5, 960, 160, True, "hardswish", 1, True),
    (160, 5, 960, 160, True, "hardswish", 1, True),
)
_SMALL = (
    (16, 3, 16, 16, True, "relu", 2, False), (16, 3, 72, 24, False, "relu", 2, False),
    (24, 3, 88, 24, False, "relu", 1, False), (24, 5, 96, 40, True, "hardswish", 2, False),
    (40, 5, 240, 40, True, "hardswish", 1, False), (40, 5, 240, 40, True, "hardswish", 1, False),
    (40, 5, 120, 48, True, "hardswish", 1, False), (48, 5, 144, 48, True, "hardswish", 1, False),
    (48, 5, 288, 96, True, "hardswish", 2, True), (96, 5, 576, 96, True, "hardswish", 1, True),
    (96, 5, 576, 96, True, "hardswish", 1, True),
)


def _block(cin, k, exp, cout, se, act, stride, dilation, fused, device):
    layers = []
    if exp != cin:
        layers.append(conv_norm_act(cin, exp, 1, act=act, fused=fused, device=device, **_BN))
    layers.append(conv_norm_act(exp, exp, k, 1 if dilation > 1 else stride, groups=exp,
                                act=act, dilation=dilation, fused=fused, device=device, **_BN))
    if se:
        layers.append(nn.SqueezeExcitation(exp, make_divisible(exp // 4, 8), nn.ReLU,
                                           nn.Hardsigmoid, device=device))
    layers.append(conv_norm_act(exp, cout, 1, act=None, fused=fused, device=device, **_BN))
    body = nn.Sequential(OrderedDict((str(i), m) for i, m in enumerate(layers)))
    return InvertedResidual(body, stride == 1 and cin == cout, child="block")


def _mobilenet_v3(name, table, last_channel, weights, progress, num_classes, width_mult,
                  reduced_tail, dilated, dropout, in_channels, device, fused, stem_stride, kwargs):
    check_weights(name, weights, progress)
    check_kwargs(name, kwargs)
    width_mult = _args.to_float(width_mult, "width_mult", lo=0.0)
    if not width_mult > 0:
        raise ArgumentError("%s: width_mult must be > 0, got %r" % (name, width_mult))
    div = 2 if _args.to_bool(reduced_tail, "reduced_tail") else 1
    dilation = 2 if _args.to_bool(dilated, "dilated") else 1

    def adjust(c):
        return make_divisible(c * width_mult, 8)

    rows = []
    for i, (cin, k, exp, cout, se, act, s, tail) in enumerate(table):
        if tail:  # the last stage: reduced_tail halves it, but its first block's input and
            if table[i - 1][7]:  # expansion (which the earlier stage sets) stay
                cin, exp = cin // div, exp // div
            cout = cout // div
        rows.append((adjust(cin), k, adjust(exp), adjust(cout), se, act, s,
                     dilation if tail else 1))
    features = [conv_norm_act(_args.to_int(in_channels, "in_channels", 1), rows[0][0], 3,
                              stem_stride_arg(stem_stride),
                              act="hardswish", fused=fused, device=device, **_BN)]
    for cin, k, exp, cout, se, act, s, d in rows:
        features.append(_block(cin, k, exp, cout, se, act, s, d, fused, device))
    c = rows[-1][3]
    features.append(conv_norm_act(c, 6 * c, 1, act="hardswish", fused=fused, device=device,
                                  **_BN))
    last = adjust(last_channel // div)
    head = nn.Sequential(nn.Linear(6 * c, last, device=device), nn.Hardswish(),
                         nn.Dropout(dropout),
                         nn.Linear(last, _args.to_int(num_classes, "num_classes", 1),
                                   device=device))
    net = classifier_net(("features", nn.Sequential(features)), head)
    return init_weights(net, init_conv_kaiming, lambda m: init_normal(m, 0.01))


def mobilenet_v3_large(*, weights=None, progress=True, num_classes=1000, width_mult=1.0,
                       reduced_tail=False, dilated=False, dropout=0.2, in_channels=3,
                       device="cpu", fused=True, stem_stride=2, **kwargs):
    """torchvision.models.mobilenet_v3_large (5,483,032 parameters at 1000 classes),
    initialised as torchvision's from the library's RNG. ``in_channels``: the stem's input
    channels (utensil's); ``fused``: each BatchNorm2d applies its activation (same keys);
    ``stem_stride`` 1 (utensil's) suits small images."""
    return _mobilenet_v3("mobilenet_v3_large", _LARGE, 1280, weights, progress, num_classes,
                         width_mult, reduced_tail, dilated, dropout, in_channels, device, fused,
                         stem_stride, kwargs)


def mobilenet_v3_small(*, weights=None, progress=True, num_classes=1000, width_mult=1.0,
                       reduced_tail=False, dilated=False, dropout=0.2, in_channels=3,
                       device="cpu", fused=True, stem_stride=2, **kwargs):
    """torchvision.models.mobilenet_v3_small (2,542,856 parameters at 1000 classes); as
    mobilenet_v3_large."""
    return _mobilenet_v3("mobilenet_v3_small", _SMALL, 1024, weights, progress, num_classes,
                         width_mult, reduced_tail, dilated, dropout, in_channels, device, fused,
                         stem_stride, kwargs)
