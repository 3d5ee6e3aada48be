"""torchvision.models' depthwise-separable networks, by name, built from utensil layers.

    from utensil_ffi import models
    models.list_models()                        # ['convnext_tiny', 'efficientnet_b0', ...]
    net = models.get_model("mobilenet_v3_small", num_classes=10, in_channels=1)
    net.load_state_dict({k: v.numpy() for k, v in tv_model.state_dict().items()})

Each builder takes torchvision's keyword arguments (num_classes, width_mult, dropout,
stochastic_depth_prob, ...; ``weights`` only as None: nothing is downloaded) plus utensil's
``device`` and ``in_channels`` (the stem's input channels), and ``fused`` (default True: each
BatchNorm2d applies the activation after it where BatchNorm2d can; False keeps separate
activation modules). The state_dict keys and shapes are torchvision's, by name, so state dicts
load strictly both ways. Weights are initialised as torchvision's, from the library's RNG
(``ut.seed(n)`` makes a model repeat).

One family a module:

    _utils.py        channel rounding, conv_norm_act (Conv2dNormActivation), PointwiseLinear,
                     argument checks, initialisation
    _blocks.py       InvertedResidual, CNBlock
    mobilenetv2.py   mobilenet_v2
    mobilenetv3.py   mobilenet_v3_small, mobilenet_v3_large
    efficientnet.py  efficientnet_b0 .. efficientnet_b3
    mnasnet.py       mnasnet0_5, mnasnet0_75, mnasnet1_0, mnasnet1_3
    convnext.py      convnext_tiny

Every model is a Sequential with torchvision's attribute names as children (``features``,
``avgpool``, ``classifier``; MNASNet: ``layers``, ``pool``, ``classifier``): calling it maps
[N, in_channels, H, W] to logits [N, num_classes], backward walks it back.

``utensil_ffi.models`` was the old path of ``utensil_ffi.nn.models``: its builders
(``mobilenet``, ``mobilenet_v1``, ``count_parameters``, the block tables) are here too, but
``mobilenet_v2`` is torchvision's layout here; the flat one (keys paired with torchvision's by
order, for old checkpoints) is ``utensil_ffi.nn.models.mobilenet_v2``. list_models() names
torchvision's networks only.
"""

from .._errors import ArgumentError
from ..nn.models import (DEFAULT_BLOCKS, V1_BLOCKS, V2_BLOCKS, block_channels, count_parameters,
                         mobilenet, mobilenet_v1)
from ._blocks import CNBlock, InvertedResidual
from ._utils import PointwiseLinear
from .convnext import convnext_tiny
from .efficientnet import efficientnet_b0, efficientnet_b1, efficientnet_b2, efficientnet_b3
from .mnasnet import mnasnet0_5, mnasnet0_75, mnasnet1_0, mnasnet1_3
from .mobilenetv2 import mobilenet_v2
from .mobilenetv3 import mobilenet_v3_large, mobilenet_v3_small

_BUILDERS = {f.__name__: f for f in (
    mobilenet_v2, mobilenet_v3_small, mobilenet_v3_large, efficientnet_b0, efficientnet_b1,
    efficientnet_b2, efficientnet_b3, mnasnet0_5, mnasnet0_75, mnasnet1_0, mnasnet1_3,
    convnext_tiny)}

__all__ = ["list_models", "get_model", "get_model_builder", "InvertedResidual", "CNBlock",
           "PointwiseLinear"]
__all__ += sorted(_BUILDERS)
# nn.models' names, from when this was its path
__all__ += ["mobilenet", "mobilenet_v1", "count_parameters", "block_channels", "DEFAULT_BLOCKS",
            "V1_BLOCKS", "V2_BLOCKS"]


def list_models():
    """The names get_model builds, sorted (torchvision's list_models, this package's models)."""
    return sorted(_BUILDERS)


def get_model_builder(name):
    """The builder function of a model name (ArgumentError naming the known ones)."""
    key = name.lower() if isinstance(name, str) else name
    if key not in _BUILDERS:
        raise ArgumentError("unknown model %r; utensil builds: %s"
                            % (name, ", ".join(list_models())))
    return _BUILDERS[key]


def get_model(name, **config):
    """``get_model("efficientnet_b0", num_classes=10)``: the builder of that name called with
    the keyword arguments, as torchvision.models.get_model."""
    return get_model_builder(name)(**config)
