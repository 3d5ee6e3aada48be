"""EfficientNet B0..B3 (Tan & Le 2019) in torchvision's layout and state_dict keys.

    net = utensil_ffi.models.efficientnet_b0(num_classes=10, stochastic_depth_prob=0.2)

The model is a Sequential named as torchvision's EfficientNet attributes (BatchNorm2d with
torch's defaults, SiLU everywhere)::

    features.0            conv_norm_act 3x3 stride 2 (SiLU)
    features.1 .. 7       one Sequential per stage, its blocks "0", "1", ...: MBConv as an
                          InvertedResidual, body "block": [conv_norm_act 1x1 expand, unless
                          the ratio is 1], conv_norm_act k x k depthwise, SqueezeExcitation (SiLU,
                          Sigmoid; squeeze channels max(1, in // 4)), conv_norm_act 1x1 project
                          (no activation); child "stochastic_depth" (p grows linearly with the
                          block's index, from 0 to stochastic_depth_prob * (n - 1) / n)
    features.8            conv_norm_act 1x1 to 4 x 320 x width (SiLU)
    avgpool               GlobalAvgPool2d
    classifier            "0" Dropout(dropout), "1" Linear(., num_classes)

Variants (width_mult, depth_mult, dropout): b0 (1.0, 1.0, 0.2), b1 (1.0, 1.1, 0.2), b2 (1.1,
1.2, 0.3), b3 (1.2, 1.4, 0.3); channels are make_divisible(c * width, 8), repeats
ceil(n * depth).
"""

import math
from collections import OrderedDict

from .. import _args
from .. import nn
from ._blocks import InvertedResidual
from ._utils import (check_kwargs, check_weights, classifier_net, conv_norm_act,
                     init_conv_kaiming, init_uniform, init_weights, make_divisible,
                     stem_stride_arg)

__all__ = ["efficientnet_b0", "efficientnet_b1", "efficientnet_b2", "efficientnet_b3"]

# (expand ratio, kernel, stride, in, out, repeats) before the multipliers
_STAGES = ((1, 3, 1, 32, 16, 1), (6, 3, 2, 16, 24, 2), (6, 5, 2, 24, 40, 2), (6, 3, 2, 40, 80, 3),
           (6, 5, 1, 80, 112, 3), (6, 5, 2, 112, 192, 4), (6, 3, 1, 192, 320, 1))

# name -> (width_mult, depth_mult, default dropout)
_VARIANTS = {"efficientnet_b0": (1.0, 1.0, 0.2), "efficientnet_b1": (1.0, 1.1, 0.2),
             "efficientnet_b2": (1.1, 1.2, 0.3), "efficientnet_b3": (1.2, 1.4, 0.3)}


def _mbconv(cin, cout, k, stride, ratio, sd_prob, fused, device):
    exp = make_divisible(cin * ratio, 8)
    layers = []
    if exp != cin:
        layers.append(conv_norm_act(cin, exp, 1, act="silu", fused=fused, device=device))
    layers.append(conv_norm_act(exp, exp, k, stride, groups=exp, act="silu", fused=fused,
                                device=device))
    layers.append(nn.SqueezeExcitation(exp, max(1, cin // 4), nn.SiLU, nn.Sigmoid,
                                       device=device))
    layers.append(conv_norm_act(exp, cout, 1, act=None, fused=fused, device=device))
    body = nn.Sequential(OrderedDict((str(i), m) for i, m in enumerate(layers)))
    return InvertedResidual(body, stride == 1 and cin == cout, sd_prob, child="block")


def _efficientnet(name, weights, progress, num_classes, dropout, stochastic_depth_prob,
                  in_channels, device, fused, stem_stride, kwargs):
    check_weights(name, weights, progress)
    check_kwargs(name, kwargs)
    width, depth, default_dropout = _VARIANTS[name]
    dropout = default_dropout if dropout is None else dropout
    sd_max = _args.to_float(stochastic_depth_prob, "stochastic_depth_prob", lo=0.0, hi=1.0)
    stages = [(r, k, s, make_divisible(cin * width, 8), make_divisible(cout * width, 8),
               int(math.ceil(n * depth))) for r, k, s, cin, cout, n in _STAGES]
    total = sum(st[5] for st in stages)
    features = [conv_norm_act(_args.to_int(in_channels, "in_channels", 1), stages[0][3], 3,
                              stem_stride_arg(stem_stride),
                              act="silu", fused=fused, device=device)]
    done = 0
    for r, k, s, cin, cout, n in stages:
        stage = []
        for i in range(n):
            stage.append(_mbconv(cin if i == 0 else cout, cout, k, s if i == 0 else 1, r,
                                 sd_max * float(done) / total, fused, device))
            done += 1
        features.append(nn.Sequential(stage))
    c = stages[-1][4]
    features.append(conv_norm_act(c, 4 * c, 1, act="silu", fused=fused, device=device))
    head = nn.Sequential(nn.Dropout(dropout), nn.Linear(4 * c, _args.to_int(
        num_classes, "num_classes", 1), device=device))
    net = classifier_net(("features", nn.Sequential(features)), head)
    return init_weights(net, init_conv_kaiming,
                        lambda m: init_uniform(m, 1.0 / math.sqrt(m.out_features)))


def _builder(name, params):
    def build(*, weights=None, progress=True, num_classes=1000, dropout=None,
              stochastic_depth_prob=0.2, in_channels=3, device="cpu", fused=True, stem_stride=2,
              **kwargs):
        return _efficientnet(name, weights, progress, num_classes, dropout,
                             stochastic_depth_prob, in_channels, device, fused, stem_stride, kwargs)

    build.__name__ = build.__qualname__ = name
    build.__doc__ = (
        "torchvision.models.%s (%s parameters at 1000 classes): width x%g, depth x%g, "
        "dropout %g by default; stochastic_depth_prob (0.2) as torchvision's. Initialised as "
        "torchvision's (kaiming-normal fan_out convolutions, Linear U(+-1/sqrt(classes))) from "
        "the library's RNG. ``in_channels``: the stem's input channels (utensil's); ``fused``: "
        "each BatchNorm2d applies its SiLU when BatchNorm2d can (same keys); ``stem_stride`` 1 "
        "(utensil's) suits small images."
        % ((name,) + params))
    return build


efficientnet_b0 = _builder("efficientnet_b0", ("5,288,548", 1.0, 1.0, 0.2))
efficientnet_b1 = _builder("efficientnet_b1", ("7,794,184", 1.0, 1.1, 0.2))
efficientnet_b2 = _builder("efficientnet_b2", ("9,109,994", 1.1, 1.2, 0.3))
efficientnet_b3 = _builder("efficientnet_b3", ("12,233,232", 1.2, 1.4, 0.3))
