"""Network builders, as torchvision.models: each returns a Module built from utensil layers.

    from utensil_ffi.nn import models
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

``mobilenet_v2`` is Sandler et al. 2018's network with inverted residual blocks (torchvision's
definition); see its docstring for its layout and state_dict keys.
"""

from .activation import ReLU6
from .blocks import Residual
from .container import Sequential
from .conv import Conv2d, DWConv2d
from .linear import Linear
from .norm import BatchNorm2d
from .pooling import GlobalAvgPool2d

__all__ = ["DEFAULT_BLOCKS", "V1_BLOCKS", "V2_BLOCKS", "mobilenet", "mobilenet_v1", "mobilenet_v2",
           "block_channels", "count_parameters"]

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


# MobileNetV2 (Sandler et al. 2018, table 2): (expansion t, channels c, repeats n, first stride s)
V2_BLOCKS = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1),
             (6, 160, 3, 2), (6, 320, 1, 1))


def _make_divisible(v, divisor=8):
    """torchvision's channel rounding: the multiple of ``divisor`` nearest ``v`` (at least
    ``divisor``), one step up when rounding down would lose more than 10%."""
    new_v = max(divisor, int(v + divisor / 2) // divisor * divisor)
    if new_v < 0.9 * v:
        new_v += divisor
    return new_v


def mobilenet_v2(num_classes=1000, width_mult=1.0, in_channels=3, device="cpu", fused=False,
                 stem_stride=2):
    """MobileNetV2 as torchvision's ``mobilenet_v2`` defines it (3,504,872 parameters at width
    1.0 and 1000 classes, as torchvision's count), as one Sequential::

        stem:   Conv2d 3x3 (stride stem_stride, padding 1, no bias) -> BatchNorm2d -> ReLU6
        blocks: one entry per inverted residual block (V2_BLOCKS: 17 blocks), a Sequential
                    [Conv2d 1x1 expand to t * in -> BatchNorm2d -> ReLU6]   (not when t == 1)
                    DWConv2d 3x3 (stride s, padding 1) -> BatchNorm2d -> ReLU6
                    Conv2d 1x1 project to out -> BatchNorm2d               (linear bottleneck)
                wrapped in a Residual (x + block(x)) when stride is 1 and in == out
        head:   Conv2d 1x1 to 1280 -> BatchNorm2d -> ReLU6 -> GlobalAvgPool2d -> Linear

    Channel counts are ``_make_divisible(c * width_mult, 8)``; the head's 1280 is scaled only
    when width_mult > 1, as in torchvision. utensil has no Dropout: the classifier is the Linear
    alone (torchvision's Dropout(0.2) before it has no parameters, so the counts match).
    ``stem_stride=1`` keeps small images (32x32, CIFAR) from shrinking to 1x1 before the head.

    State dict keys: ``"0.weight"`` (stem conv), ``"1.*"`` (its BatchNorm), then block i
    (from 0) at index 3 + i: ``"3.0.weight"`` for a plain block, ``"5.block.0.weight"`` for a
    residual one; the head's conv, BatchNorm, pooling and Linear are the last entries
    (``"24.weight"`` for the Linear). In order and shape they match torchvision's keys one to
    one (``features.0.0.weight`` ... ``classifier.1.bias``), so pairing the two state dicts in
    order loads torchvision's weights. ``fused=True`` folds each ReLU6 into the BatchNorm2d
    before it (``activation="relu6"``), as ``mobilenet`` does: the same function and the same
    order of tensors, but fewer layers, so other indices (block i at 2 + i)."""
    width_mult = float(width_mult)
    if not width_mult > 0:
        raise ValueError("width_mult must be > 0, got %r" % (width_mult,))

    def bn(c, act):
        if fused and act:
            return [BatchNorm2d(c, device=device, activation="relu6")]
        return [BatchNorm2d(c, device=device)] + ([ReLU6()] if act else [])

    c = _make_divisible(32 * width_mult)
    layers = [Conv2d(in_channels, c, 3, stride=stem_stride, padding=1, bias=False,
                     device=device)] + bn(c, True)
    for t, ch, n, s in V2_BLOCKS:
        out = _make_divisible(ch * width_mult)
        for i in range(n):
            stride = s if i == 0 else 1
            hidden = int(round(c * t))
            block = []
            if t != 1:
                block += [Conv2d(c, hidden, 1, bias=False, device=device)] + bn(hidden, True)
            block += [DWConv2d(hidden, 3, stride=stride, padding=1, bias=False, device=device)]
            block += bn(hidden, True)
            block += [Conv2d(hidden, out, 1, bias=False, device=device)] + bn(out, False)
            block = Sequential(*block)
            layers.append(Residual(block) if stride == 1 and c == out else block)
            c = out
    last = _make_divisible(1280 * max(1.0, width_mult))
    layers += [Conv2d(c, last, 1, bias=False, device=device)] + bn(last, True)
    layers += [GlobalAvgPool2d(), Linear(last, num_classes, device=device)]
    return Sequential(*layers)


def count_parameters(net):
    """The number of trainable values (each Parameter's size, summed)."""
    return sum(p.size for p in net.parameters())
