"""ConvNeXt-T (Liu et al. 2022) in torchvision's layout and state_dict keys, on NCHW throughout.

    net = utensil_ffi.models.convnext_tiny(num_classes=10, stochastic_depth_prob=0.1)

torchvision permutes to channels-last around each block's LayerNorm and Linears; here those are
the same functions over the channels of NCHW (LayerNorm2d, PointwiseLinear: a 1x1 Conv2d saved
with a Linear's [out, in] shape), so no permutes. The model is a Sequential named as
torchvision's ConvNeXt attributes::

    features.0            stem: "0" Conv2d 4x4 stride 4 (bias), "1" LayerNorm2d (eps 1e-6)
    features.1, 3, 5, 7   stages of 3, 3, 9, 3 CNBlocks at 96, 192, 384, 768 channels:
                          "features.1.0.block.0.weight" (depthwise 7x7), "...block.2.*"
                          (LayerNorm2d), "...block.3.*", "...block.5.*" (the Linears),
                          "features.1.0.layer_scale" ([C, 1, 1], initially 1e-6)
    features.2, 4, 6      downsampling: "0" LayerNorm2d, "1" Conv2d 2x2 stride 2 (bias)
    avgpool               GlobalAvgPool2d ([N, 768])
    classifier            "0" LayerNorm over the channels ([N, 768]: torchvision's LayerNorm2d
                          on [N, 768, 1, 1]), "2" Linear(768, num_classes) (torchvision's "1"
                          is Flatten: absent)

Stochastic depth grows linearly over the 18 blocks, from 0 to stochastic_depth_prob (0.1 by
default, torchvision's for convnext_tiny). Convolutions and Linears: trunc_normal(std 0.02),
biases zero.
"""

from collections import OrderedDict

from .. import _args
from .. import nn
from ._blocks import CNBlock
from ._utils import check_kwargs, check_weights, init_trunc_normal, init_weights

__all__ = ["convnext_tiny"]

# (channels, blocks, channels after the stage's downsampling or None)
_TINY = ((96, 3, 192), (192, 3, 384), (384, 9, 768), (768, 3, None))


def _convnext(name, setting, weights, progress, num_classes, stochastic_depth_prob, layer_scale,
              in_channels, device, kwargs):
    check_weights(name, weights, progress)
    check_kwargs(name, kwargs)
    sd_max = _args.to_float(stochastic_depth_prob, "stochastic_depth_prob", lo=0.0, hi=1.0)
    c0 = setting[0][0]
    features = [nn.Sequential(OrderedDict([
        ("0", nn.Conv2d(_args.to_int(in_channels, "in_channels", 1), c0, 4, stride=4, bias=True,
                        device=device)),
        ("1", nn.LayerNorm2d(c0, eps=1e-6, device=device))]))]
    total = sum(n for _, n, _ in setting)
    done = 0
    for c, n, nxt in setting:
        stage = []
        for _ in range(n):
            p = sd_max * done / (total - 1.0) if total > 1 else 0.0
            stage.append(CNBlock(c, layer_scale, p, device=device))
            done += 1
        features.append(nn.Sequential(stage))
        if nxt is not None:
            features.append(nn.Sequential(
                nn.LayerNorm2d(c, eps=1e-6, device=device),
                nn.Conv2d(c, nxt, 2, stride=2, bias=True, device=device)))
    last = setting[-1][2] or setting[-1][0]
    head = nn.Sequential(OrderedDict([
        ("0", nn.LayerNorm(last, eps=1e-6, device=device)),
        ("2", nn.Linear(last, _args.to_int(num_classes, "num_classes", 1), device=device))]))
    net = nn.Sequential(OrderedDict([("features", nn.Sequential(features)),
                                     ("avgpool", nn.GlobalAvgPool2d()), ("classifier", head)]))
    return init_weights(net, lambda m: init_trunc_normal(m, 0.02),
                        lambda m: init_trunc_normal(m, 0.02))


def convnext_tiny(*, weights=None, progress=True, num_classes=1000, stochastic_depth_prob=0.1,
                  layer_scale=1e-6, in_channels=3, device="cpu", **kwargs):
    """torchvision.models.convnext_tiny (28,589,128 parameters at 1000 classes), initialised
    as torchvision's (trunc_normal std 0.02, layer_scale 1e-6) from the library's RNG.
    ``in_channels``: the stem's input channels (utensil's). No BatchNorm, so no ``fused``."""
    return _convnext("convnext_tiny", _TINY, weights, progress, num_classes,
                     stochastic_depth_prob, layer_scale, in_channels, device, kwargs)
