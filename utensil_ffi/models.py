"""Network builders, as torchvision.models: each returns a Module built from utensil layers.

    from utensil_ffi import models
    net = models.mobilenet(in_channels=1, num_classes=10, width=16, device="cpu")

``mobilenet`` is the depthwise-separable (MobileNet-style) classifier utensil-train trains;
``mobilenet_v1`` is Howard et al. 2017's ImageNet network (13 blocks, 4.2 M parameters at width 1).

The network is one flat ``Sequential`` (so its layers have stable integer names)::

    stem:   Conv2d 3x3 (stride stem_stride, padding 1, no bias) -> BatchNorm2d -> ReLU6
    block:  DWConv2d 3x3 (stride s, padding 1, no bias) -> BatchNorm2d -> ReLU6
            -> Conv2d 1x1 (no bias) -> BatchNorm2d -> ReLU6             (one per entry of blocks)
    head:   GlobalAvgPool2d -> Linear(channels, num_classes)

``blocks`` lists ``(channel multiplier, stride)`` pairs: a block's output channel count is
``multiplier * width``. Convolutions followed by BatchNorm carry no bias, as in MobileNet.

``net.state_dict()`` has the keys (``"0.weight"``, ``"1.running_var"``...) and shapes of the
same architecture written as a PyTorch ``nn.Sequential`` (bench/compare_mobilenet.py builds it).
"""

from .layers import (
    BatchNorm2d,
    Conv2d,
    DWConv2d,
    GlobalAvgPool2d,
    Linear,
    ReLU6,
    Sequential,
)

__all__ = ["DEFAULT_BLOCKS", "V1_BLOCKS", "mobilenet", "mobilenet_v1", "block_channels",
           "count_parameters"]

# (channel multiplier, stride) per depthwise-separable block; one stride 2: 8x8 digits end at 4x4.
DEFAULT_BLOCKS = ((2, 1), (2, 1), (4, 2), (4, 1))
# MobileNet v1 (Howard et al. 2017, table 1) over a 32-channel stem: 64 .. 1024 channels.
V1_BLOCKS = ((2, 1), (4, 2), (4, 1), (8, 2), (8, 1), (16, 2), (16, 1), (16, 1), (16, 1), (16, 1),
             (16, 1), (32, 2), (32, 1))


def block_channels(width, blocks=DEFAULT_BLOCKS):
    """[(in_channels, out_channels, stride)] for each block of a network of this width."""
    out = []
    c = width
    for mult, stride in blocks:
        o = int(mult) * width
        out.append((c, o, int(stride)))
        c = o
    return out


def mobilenet(in_channels=1, num_classes=10, width=16, blocks=DEFAULT_BLOCKS,
              device="cpu", bn_momentum=0.1, bn_eps=1e-5, stem_stride=1, fused=False):
    """The classifier as a flat Sequential; weights come from the library RNG (see ut.seed).

    fused=True folds each ReLU6 into the BatchNorm2d before it (``activation="relu6"``): the
    same function in one pass less over the data, but the layer list (and the state_dict's
    indices) differ from the unfused network's."""
    if int(width) < 1:
        raise ValueError("width must be >= 1, got %r" % (width,))
    if not blocks:
        raise ValueError("the network needs at least one block")
    width = int(width)

    def bn_relu6(c):
        if fused:
            return [BatchNorm2d(c, eps=bn_eps, momentum=bn_momentum, device=device,
                                activation="relu6")]
        return [BatchNorm2d(c, eps=bn_eps, momentum=bn_momentum, device=device), ReLU6()]

    layers = [Conv2d(in_channels, width, 3, stride=stem_stride, padding=1, bias=False,
                     device=device)] + bn_relu6(width)
    c = width
    for cin, cout, stride in block_channels(width, blocks):
        layers += [DWConv2d(cin, 3, stride=stride, padding=1, bias=False, device=device)]
        layers += bn_relu6(cin)
        layers += [Conv2d(cin, cout, 1, bias=False, device=device)] + bn_relu6(cout)
        c = cout
    layers += [GlobalAvgPool2d(), Linear(c, num_classes, device=device)]
    return Sequential(*layers)


def mobilenet_v1(num_classes=1000, width_mult=1.0, in_channels=3, device="cpu", fused=False):
    """MobileNet v1: a stride-2 3x3 stem of 32 * width_mult channels, the 13 depthwise-separable
    blocks of V1_BLOCKS, global pooling and a linear classifier (4,231,976 parameters at width
    1.0 and 1000 classes, as torchvision's count for the paper's network)."""
    width = int(round(32 * float(width_mult)))
    return mobilenet(in_channels, num_classes, width, V1_BLOCKS, device=device, stem_stride=2,
                     fused=fused)


def count_parameters(net):
    """The number of trainable values (each Parameter's size, summed)."""
    return sum(p.size for p in net.parameters())
