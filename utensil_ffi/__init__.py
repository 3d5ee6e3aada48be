"""utensil_ffi: Python bindings for utensil, a small neural-network library in one C header.

    import numpy as np, utensil_ffi as ut
    model = ut.Sequential(ut.Linear(4, 8), ut.ReLU(), ut.Linear(8, 3))
    opt = ut.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = ut.tensor(np.random.rand(16, 4)), np.random.randint(0, 3, 16)
    logits = model(x)
    loss = ut.cross_entropy(logits, y)
    opt.zero_grad()
    model.backward(ut.cross_entropy_backward(logits, y))
    opt.step()

Forward and backward are explicit (no autograd tape); see utensil_ffi.nn.module.

The package, one floor a folder (imports go down only; ARCHITECTURE.md draws it):

    cli/          utensil-train, utensil-export, utensil-predict
    data/         data sets, image folders, transforms, the loader
    distributed/  process groups, DistributedDataParallel, the launcher
    interop/      the PyTorch op, ONNX export
    nn/           Module, the layers, MixedPrecision, Residual, SyncBatchNorm, models
    optim/        SGD, Adam, AdamW; lr_scheduler, swa_utils (the EMA of weights)
    functional.py, tensor.py, dtypes.py, cuda.py, blas.py, dlpack.py   the core: ops and tensors
    _lifetime.py, _args.py, _errors.py, _lib.py                        the binding underneath
    testing/      the float64 reference, the self-check

The flat package's module paths (utensil_ffi.layers, python -m utensil_ffi.train, ...) still
import: see _compat.py.
"""

from . import cuda, functional
from .blas import (
    backends,
    get_float32_matmul_precision,
    load_cublas,
    preferred_blas_library,
    set_float32_matmul_precision,
)
from ._errors import (
    ArgumentError,
    ArgumentTypeError,
    ClosedError,
    DeviceError,
    OutOfMemoryError,
    ShapeError,
    UtensilError,
)
from ._lib import HEADER_VERSION as __c_version__
from ._lib import LIB_PATH as library_path
from .functional import (
    adam_step,
    add,
    cross_entropy,
    cross_entropy_backward,
    global_avg_pool2d,
    global_avg_pool2d_backward,
    matmul,
    mse_loss,
    mse_loss_backward,
    relu,
    relu6,
    relu6_backward,
    relu_backward,
    sgd_step,
    transpose,
)
from .nn import (
    BatchNorm2d,
    Conv2d,
    CrossEntropyLoss,
    DWConv2d,
    GlobalAvgPool2d,
    LayerNorm,
    Linear,
    MixedPrecision,
    Module,
    MSELoss,
    Parameter,
    ReLU,
    ReLU6,
    Residual,
    Sequential,
    SyncBatchNorm,
)
# issue 30's activations: the layers, and the functional forms with their backward
from .functional import (
    gelu,
    gelu_backward,
    hardsigmoid,
    hardsigmoid_backward,
    hardswish,
    hardswish_backward,
    sigmoid,
    sigmoid_backward,
    silu,
    silu_backward,
)
from .nn import GELU, Hardsigmoid, Hardswish, Sigmoid, SiLU
from .dtypes import bfloat16, dtype, float32
from .optim import SGD, Adam, AdamW, Optimizer
from .tensor import (
    Tensor,
    cuda_available,
    devices,
    from_dlpack,
    from_numpy,
    full,
    get_num_threads,
    live_tensors,
    live_bytes,
    peak_live_bytes,
    empty_host_cache,
    host_cached_bytes,
    ones,
    randn,
    seed,
    set_num_threads,
    synchronize,
    tensor,
    zeros,
)

# issue 30: squeeze-and-excitation's channel scale, ConvNeXt's LayerNorm2d and layer scale
from .functional import (
    channel_scale,
    channel_scale_backward,
    layer_scale,
    layer_scale_backward,
)
from .nn import LayerNorm2d, SqueezeExcitation
# issue 30, the training recipe: regularisation layers (the optimizers are imported above)
from .nn import Dropout, StochasticDepth
# what forward keeps, once backward has used it: kept (a backward can be repeated) or freed
from ._lifetime import get_retain_forward, set_retain_forward

from . import _compat

_compat.install(__name__)  # the old module paths (utensil_ffi.layers, ...): see _compat.py

__version__ = "0.1.0"

__all__ = [
    # tensors and the library
    "from_dlpack",
    "Tensor", "tensor", "from_numpy", "zeros", "ones", "full", "randn", "seed", "devices",
    "cuda_available", "synchronize", "set_num_threads", "get_num_threads", "live_tensors", "library_path",
    "live_bytes", "peak_live_bytes", "set_retain_forward", "get_retain_forward",
    "empty_host_cache", "host_cached_bytes",
    # element types, and mixed-precision training
    "dtype", "float32", "bfloat16", "MixedPrecision",
    # the GPU's matrix products, and recorded GPU work (ut.cuda.CUDAGraph, ut.cuda.graph)
    "cuda",
    "backends", "load_cublas", "preferred_blas_library", "set_float32_matmul_precision",
    "get_float32_matmul_precision",
    # layers
    "Module", "Parameter", "Conv2d", "DWConv2d", "BatchNorm2d", "LayerNorm", "Linear", "ReLU",
    "ReLU6", "GlobalAvgPool2d", "Sequential", "SyncBatchNorm", "Residual",
    # functional forms and losses
    "functional", "add", "relu", "relu6", "relu_backward", "relu6_backward", "matmul", "transpose",
    "global_avg_pool2d", "global_avg_pool2d_backward", "mse_loss", "mse_loss_backward",
    "cross_entropy", "cross_entropy_backward", "MSELoss", "CrossEntropyLoss", "sgd_step",
    "adam_step",
    # optimizers
    "Optimizer", "SGD", "Adam", "AdamW",
    # issue 30, the training recipe: regularisation (ut.optim.lr_scheduler, ut.optim.swa_utils)
    "Dropout", "StochasticDepth",
    # issue 30's activations: layers, functional forms and their backward
    "SiLU", "Hardswish", "Hardsigmoid", "Sigmoid", "GELU", "silu", "silu_backward", "hardswish",
    "hardswish_backward", "hardsigmoid", "hardsigmoid_backward", "sigmoid", "sigmoid_backward",
    "gelu", "gelu_backward",
    # errors
    "UtensilError", "ArgumentError", "ArgumentTypeError", "ClosedError", "ShapeError",
    "OutOfMemoryError", "DeviceError",
]
__all__ += [  # issue 30: squeeze-and-excitation, ConvNeXt
    "LayerNorm2d", "SqueezeExcitation", "channel_scale", "channel_scale_backward", "layer_scale",
    "layer_scale_backward",
]
