"""Layers and networks, with explicit forward and backward (no autograd tape): torch.nn's floor.

    import utensil_ffi as ut            # ut.Conv2d is utensil_ffi.nn.Conv2d
    from utensil_ffi import nn
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU6())

One layer family a module; ``module.py`` says how forward, backward, state dicts and threads
work for all of them:

    module.py          Module (call, backward, parameters, state_dict, train/eval, to, close)
    amp.py             MixedPrecision: bfloat16 activations around float32 weights
    blocks.py          Residual
    sync_batchnorm.py  SyncBatchNorm (the statistics of every rank's batch)
    models.py          network builders (mobilenet, mobilenet_v1, mobilenet_v2), as
                       torchvision.models; imported on use: ``from utensil_ffi.nn import models``
"""

from .module import (
    BatchNorm2d,
    Conv2d,
    CrossEntropyLoss,
    DWConv2d,
    GlobalAvgPool2d,
    LayerNorm,
    Linear,
    Module,
    MSELoss,
    Parameter,
    ReLU,
    ReLU6,
    Sequential,
)
from .amp import MixedPrecision
from .blocks import Residual
from .sync_batchnorm import SyncBatchNorm

__all__ = [
    "Module", "Parameter", "Conv2d", "DWConv2d", "Linear", "LayerNorm", "BatchNorm2d", "ReLU",
    "ReLU6", "GlobalAvgPool2d", "Sequential", "MSELoss", "CrossEntropyLoss", "MixedPrecision",
    "Residual", "SyncBatchNorm",
]
