"""MNASNet B1 (Tan et al. 2018) at depth multipliers 0.5, 0.75, 1.0, 1.3, in torchvision's
layout and state_dict keys (its version 2, the one torchvision's weights are saved in).

    net = utensil_ffi.models.mnasnet1_0(num_classes=10)

Every BatchNorm2d has momentum 0.0003 (1 - 0.9997). The model is a Sequential named as
torchvision's MNASNet attributes::

    layers.0 .. 7         stem: Conv2d 3x3 stride 2, BatchNorm2d, ReLU, depthwise 3x3,
                          BatchNorm2d, ReLU, Conv2d 1x1, BatchNorm2d ("layers.0.weight" ...
                          "layers.7.running_var"; "2" and "5", the ReLUs, absent when fused)
    layers.8 .. 13        one Sequential per stack, its blocks "0", "1", ...: InvertedResidual,
                          body "layers": "0" Conv2d 1x1 expand, "1" BatchNorm2d, "2" ReLU,
                          "3" depthwise k x k, "4" BatchNorm2d, "5" ReLU, "6" Conv2d 1x1, "7"
                          BatchNorm2d; x + layers(x) when stride 1 and in == out
    layers.14 .. 16       Conv2d 1x1 to 1280, BatchNorm2d, ReLU
    pool                  GlobalAvgPool2d (torchvision's ``x.mean([2, 3])``; no keys)
    classifier            "0" Dropout(dropout), "1" Linear(1280, num_classes)

``net.layers`` is Sequential's own list of its children (which the library's code reads), so
torchvision's ``layers`` child is ``net[0]`` here (its keys are "layers.*" all the same).

torchvision's MNASNet refuses a state dict without its version metadata (a plain dict, as
utensil's state_dict is): give it ``sd = collections.OrderedDict(...)`` with
``sd._metadata = {"": {"version": 2}}``.
"""

from collections import OrderedDict

from .. import _args
from .. import nn
from ._blocks import InvertedResidual
from ._utils import (bn_act, check_kwargs, check_weights, classifier_net, init_conv_kaiming,
                     init_uniform, init_weights, stem_stride_arg)

__all__ = ["mnasnet0_5", "mnasnet0_75", "mnasnet1_0", "mnasnet1_3"]

_BN_MOMENTUM = 1 - 0.9997
_DEPTHS = (32, 16, 24, 40, 80, 96, 192, 320)
# (kernel, first stride, expansion, repeats) of each stack, from depths[i + 1] to depths[i + 2]
_STACKS = ((3, 2, 3, 3), (5, 2, 3, 3), (5, 2, 6, 3), (3, 1, 6, 2), (5, 2, 6, 4), (3, 1, 6, 1))


def _round_to_multiple_of(val, divisor, round_up_bias=0.9):
    """torchvision's rounding of MNASNet's depths: to the nearest multiple, one step up
    unless the result keeps 90% of val."""
    new_val = max(divisor, int(val + divisor / 2) // divisor * divisor)
    return new_val if new_val >= round_up_bias * val else new_val + divisor


def _seq(items, fused, device):
    """A Sequential numbered as torchvision's plain list of (conv, BatchNorm(+act)) layers:
    items are modules or (channels, activation) pairs for a BatchNorm2d and its activation."""
    out, i = [], 0
    for it in items:
        if isinstance(it, tuple):
            c, act = it
            pairs = bn_act(c, act, momentum=_BN_MOMENTUM, fused=fused, device=device, first=i)
            out += pairs
            i += 2 if act is not None else 1  # a fused activation keeps its index free
        else:
            out.append((str(i), it))
            i += 1
    return nn.Sequential(OrderedDict(out))


def _inverted_residual(cin, cout, k, stride, t, fused, device):
    mid = cin * t
    body = _seq([nn.Conv2d(cin, mid, 1, bias=False, device=device), (mid, "relu"),
                 nn.DWConv2d(mid, k, stride=stride, padding=k // 2, bias=False, device=device),
                 (mid, "relu"), nn.Conv2d(mid, cout, 1, bias=False, device=device),
                 (cout, None)], fused, device)
    return InvertedResidual(body, cin == cout and stride == 1, child="layers")


def _mnasnet(name, alpha, weights, progress, num_classes, dropout, in_channels, device, fused,
             stem_stride, kwargs):
    check_weights(name, weights, progress)
    check_kwargs(name, kwargs)
    d = [_round_to_multiple_of(x * alpha, 8) for x in _DEPTHS]
    stem = [nn.Conv2d(_args.to_int(in_channels, "in_channels", 1), d[0], 3,
                      stride=stem_stride_arg(stem_stride), padding=1,
                      bias=False, device=device), (d[0], "relu"),
            nn.DWConv2d(d[0], 3, padding=1, bias=False, device=device), (d[0], "relu"),
            nn.Conv2d(d[0], d[1], 1, bias=False, device=device), (d[1], None)]
    for j, (k, s, t, n) in enumerate(_STACKS):
        cin, cout = d[j + 1], d[j + 2]
        stem.append(nn.Sequential([_inverted_residual(cin if i == 0 else cout, cout, k,
                                                      s if i == 0 else 1, t, fused, device)
                                   for i in range(n)]))
    stem += [nn.Conv2d(d[7], 1280, 1, bias=False, device=device), (1280, "relu")]
    head = nn.Sequential(nn.Dropout(dropout), nn.Linear(1280, _args.to_int(
        num_classes, "num_classes", 1), device=device))
    net = classifier_net(("layers", _seq(stem, fused, device)), head, pool="pool")
    # the Linear: kaiming_uniform_(fan_out, sigmoid gain 1): bound sqrt(3 / num_classes)
    return init_weights(net, init_conv_kaiming,
                        lambda m: init_uniform(m, (3.0 / m.out_features) ** 0.5))


def _builder(name, alpha, count):
    def build(*, weights=None, progress=True, num_classes=1000, dropout=0.2, in_channels=3,
              device="cpu", fused=True, stem_stride=2, **kwargs):
        return _mnasnet(name, alpha, weights, progress, num_classes, dropout, in_channels,
                        device, fused, stem_stride, kwargs)

    build.__name__ = build.__qualname__ = name
    build.__doc__ = (
        "torchvision.models.%s (depth multiplier %g, %s parameters at 1000 classes), "
        "initialised as torchvision's from the library's RNG. ``in_channels``: the stem's input "
        "channels (utensil's); ``fused``: each BatchNorm2d applies its ReLU (same keys); "
        "``stem_stride`` 1 (utensil's) suits small images."
        % (name, alpha, count))
    return build


mnasnet0_5 = _builder("mnasnet0_5", 0.5, "2,218,512")
mnasnet0_75 = _builder("mnasnet0_75", 0.75, "3,170,208")
mnasnet1_0 = _builder("mnasnet1_0", 1.0, "4,383,312")
mnasnet1_3 = _builder("mnasnet1_3", 1.3, "6,282,256")
