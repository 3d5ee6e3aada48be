"""Layers and networks, with explicit forward and backward (no autograd tape): torch.nn's floor.

    import utensil_ffi as ut            # ut.Conv2d is utensil_ffi.nn.Conv2d
    from utensil_ffi import nn
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU6())

One layer family a module (as torch.nn.modules); ``module.py`` says how forward, backward,
state dicts and threads work for all of them:

    module.py          Module (call, backward, parameters, state_dict, train/eval, to, close),
                       _Wrapper (one child) and _Stateless (no parameters), their bases
    parameter.py       Parameter: a trainable tensor and its grad
    _clayer.py         _CLayer: the base of the layers over a C struct
    conv.py            Conv2d, DWConv2d
    linear.py          Linear
    norm.py            LayerNorm, LayerNorm2d, BatchNorm2d
    activation.py      ReLU, ReLU6; SiLU, Hardswish, Hardsigmoid, Sigmoid, GELU
    pooling.py         GlobalAvgPool2d
    container.py       Sequential
    loss.py            MSELoss, CrossEntropyLoss
    amp.py             MixedPrecision: bfloat16 activations around float32 weights
    blocks.py          Residual
    squeeze_excitation.py  SqueezeExcitation (torchvision.ops.SqueezeExcitation)
    sync_batchnorm.py  SyncBatchNorm (the statistics of every rank's batch)
    dropout.py         Dropout, StochasticDepth (torchvision.ops'): random masks in training
    models.py          network builders (mobilenet, mobilenet_v1, mobilenet_v2), as
                       torchvision.models; imported on use: ``from utensil_ffi.nn import models``
"""

from .activation import ReLU, ReLU6
from .activation import GELU, Hardsigmoid, Hardswish, Sigmoid, SiLU  # issue 30's activations
from .amp import MixedPrecision
from .blocks import Residual
from .container import Sequential
from .conv import Conv2d, DWConv2d
from .linear import Linear
from .loss import CrossEntropyLoss, MSELoss
from .module import Module
from .norm import BatchNorm2d, LayerNorm, LayerNorm2d
from .parameter import Parameter
from .pooling import GlobalAvgPool2d
from .squeeze_excitation import SqueezeExcitation
from .sync_batchnorm import SyncBatchNorm

# issue 30, the training recipe: regularisation
from .dropout import Dropout, StochasticDepth

__all__ = [
    "Module", "Parameter", "Conv2d", "DWConv2d", "Linear", "LayerNorm", "BatchNorm2d", "ReLU",
    "ReLU6", "GlobalAvgPool2d", "Sequential", "MSELoss", "CrossEntropyLoss", "MixedPrecision",
    "Residual", "SyncBatchNorm",
    # issue 30, the training recipe
    "Dropout", "StochasticDepth",
    # issue 30's activations
    "SiLU", "Hardswish", "Hardsigmoid", "Sigmoid", "GELU",
]
__all__ += ["LayerNorm2d", "SqueezeExcitation"]  # issue 30: squeeze-and-excitation, ConvNeXt
