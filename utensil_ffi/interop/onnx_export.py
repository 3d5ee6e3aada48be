"""export_onnx: a utensil model as an ONNX file, for onnxruntime, TensorRT, OpenVINO, ...

    from utensil_ffi import models
    from utensil_ffi.interop.onnx_export import export_onnx
    net = models.efficientnet_b0(num_classes=10)
    export_onnx(net, "efficientnet_b0.onnx", (1, 3, 224, 224))

The graph is the model's eval-mode forward (BatchNorm2d with its running statistics), whatever
mode the model is in; the model itself is not changed and runs nothing. Supported modules:
Sequential (its children's names, an OrderedDict's keys too, name the initializers), Residual,
Conv2d, DWConv2d (dilation and channel multiplier: a grouped Conv), BatchNorm2d (with any fused
activation: its layer's nodes after the BatchNormalization), ReLU, ReLU6, SiLU, Hardswish,
Hardsigmoid, Sigmoid, GELU, GlobalAvgPool2d, Linear, LayerNorm, LayerNorm2d, SqueezeExcitation,
utensil_ffi.models' blocks (InvertedResidual, CNBlock with its layer scale, PointwiseLinear: a
1x1 Conv), and Dropout and StochasticDepth (their eval-mode identity: no node); any other raises
ArgumentError naming it. The activations are ONNX's own operators where the opset has them
(HardSwish from 14, Gelu from 20), else their formula in older ones (x * HardSigmoid(x); GELU's
erf or tanh expression); SiLU is x * Sigmoid(x) at every opset (ONNX has no Swish). LayerNorm is
LayerNormalization from opset 17 and its formula (ReduceMean, Sub, Mul, Add, Sqrt, Div) before;
LayerNorm2d is the same over the channels, moved last and back by two Transposes. Needs the
``onnx`` package (``pip install 'utensil-ffi[onnx]'``).
"""

import os
import uuid

import numpy as np

from .. import _args
from .._errors import ArgumentError, ArgumentTypeError, ShapeError
from ..nn.activation import GELU, Hardsigmoid, Hardswish, ReLU, ReLU6, Sigmoid, SiLU
from ..nn.blocks import Residual
from ..nn.container import Sequential
from ..nn.conv import Conv2d, DWConv2d
from ..nn.linear import Linear
from ..nn.module import Module
from ..nn.norm import BatchNorm2d, LayerNorm, LayerNorm2d
from ..nn.pooling import GlobalAvgPool2d
from ..nn.squeeze_excitation import SqueezeExcitation
from ..nn.dropout import Dropout, StochasticDepth  # issue 30: the identity at inference
from ..models import CNBlock, InvertedResidual
from ..models._utils import PointwiseLinear

__all__ = ["export_onnx"]

# Clip takes its bounds as inputs from opset 11 on, and Gemm's bias became optional there.
MIN_OPSET = 11
BATCH = "batch"  # the name of the dynamic first dimension of the input and the output


def _import_onnx():
    # lazily: onnx is an optional dependency, and a large import that training never needs
    try:
        import onnx
        from onnx import helper, numpy_helper
    except ImportError as e:
        raise ImportError("export_onnx needs the onnx package: pip install 'utensil-ffi[onnx]' "
                          "(or pip install onnx); importing it failed: %s" % e) from None
    return onnx, helper, numpy_helper


def export_onnx(model, path, input_shape, opset=17):
    """Write ``model`` as an ONNX model to ``path`` (atomically) and return the ModelProto.

    ``input_shape`` is the shape of one input, batch first, e.g. ``(1, 3, 224, 224)``; the
    batch dimension is exported as the symbolic ``"batch"``, the others as given (they fix the
    spatial size, as in torch.onnx.export). The graph has one input ``"input"`` and one output
    ``"output"`` (float32); initializers carry the state_dict's keys (``"0.weight"``...).
    ``opset`` is the default domain's opset version, from 11 to the newest the installed onnx
    knows. The file is written to a temporary name in the same directory and renamed over
    ``path`` only once it is complete and checked by ``onnx.checker``.
    """
    onnx, helper, numpy_helper = _import_onnx()
    if not isinstance(model, Module):
        raise ArgumentTypeError("export_onnx: model must be a utensil Module, got %s"
                                % type(model).__name__)
    if not isinstance(path, (str, bytes, os.PathLike)):
        raise ArgumentTypeError("export_onnx: path must be a file name, got %s"
                                % type(path).__name__)
    path = os.fsdecode(path)
    newest = onnx.defs.onnx_opset_version()
    opset = _args.to_int(opset, "export_onnx: opset", MIN_OPSET, newest)
    if isinstance(input_shape, (int, np.integer)) or not hasattr(input_shape, "__len__"):
        raise ArgumentTypeError("export_onnx: input_shape must be a sequence of ints, batch "
                                "first, e.g. (1, 3, 224, 224); got %r" % (input_shape,))
    dims = [_args.to_int(d, "export_onnx: input_shape[%d]" % i, 1)
            for i, d in enumerate(input_shape)]
    if len(dims) < 2:
        raise ShapeError("export_onnx: input_shape needs a batch dimension and at least one "
                         "more, got %r" % (tuple(input_shape),))

    g = _Graph(helper, numpy_helper, opset)
    shape = (BATCH,) + tuple(dims[1:])
    out, out_shape = g.emit(model, "", "input", shape)
    if g.nodes and g.nodes[-1].output[0] == out:
        g.nodes[-1].output[0] = "output"
    else:  # a model that computes nothing (an empty Sequential): the output must be a node's
        g.node("Identity", [out], "", "output")

    graph = helper.make_graph(
        g.nodes, "utensil",
        [helper.make_tensor_value_info("input", onnx.TensorProto.FLOAT, list(shape))],
        [helper.make_tensor_value_info("output", onnx.TensorProto.FLOAT, list(out_shape))],
        initializer=g.initializers)
    opsets = [helper.make_opsetid("", opset)]
    proto = helper.make_model(graph, opset_imports=opsets, producer_name="utensil")
    # the oldest IR version that carries this opset: the newest onnx's default may be newer than
    # what a deployed runtime reads
    proto.ir_version = helper.find_min_ir_version_for(opsets)
    onnx.checker.check_model(proto, full_check=True)  # also infers shapes against ours
    _write_atomically(path, proto.SerializeToString())
    return proto


def _write_atomically(path, data):
    """``data`` to ``path`` through a temporary file in the same directory and os.replace, so a
    reader never sees half a file and a failure leaves an existing file as it was."""
    # a short name: ``path``'s own may be at the file system's limit (NAME_MAX) already
    tmp = os.path.join(os.path.dirname(os.path.abspath(path)), ".%s.tmp" % uuid.uuid4().hex[:16])
    # os.open with 0o666: the umask applies, as for any new file (mkstemp would make it 0600)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _values(t):
    """A float32 numpy copy of a Tensor's values (the host copy for a GPU tensor)."""
    return np.array(t.numpy(), dtype=np.float32, copy=True)


def _fmt(shape):
    return "[%s]" % ", ".join(str(d) for d in shape)


class _Graph:
    """The nodes and initializers of the graph being built; emit() walks the model."""

    def __init__(self, helper, numpy_helper, opset=MIN_OPSET):
        self.helper = helper
        self.numpy_helper = numpy_helper
        self.opset = opset  # the default domain's: which operators the emitters may use
        self.nodes = []
        self.initializers = []
        self.names = set()
        self.tensors = {}  # id(Tensor) -> initializer name: a shared layer's weights once

    # -- names, constants, nodes ----------------------------------------------------------------
    def fresh(self, base):
        """A value name not used yet: ``base``, else ``base_1``, ``base_2``..."""
        name, i = base, 0
        while name in self.names:
            i += 1
            name = "%s_%d" % (base, i)
        self.names.add(name)
        return name

    def const(self, name, array, owner=None):
        """An initializer with these values; ``owner`` (a Tensor) is exported once however many
        times its layer appears."""
        if owner is not None and id(owner) in self.tensors:
            return self.tensors[id(owner)]
        name = self.fresh(name)
        self.initializers.append(self.numpy_helper.from_array(np.asarray(array, np.float32), name))
        if owner is not None:
            self.tensors[id(owner)] = name
        return name

    def node(self, op, inputs, path, output=None, **attrs):
        """One node named after the module's path; returns its output's name."""
        base = path or "model"
        out = output or self.fresh("%s/%s" % (base, op))
        self.nodes.append(self.helper.make_node(op, list(inputs), [out],
                                                name=self.fresh("%s:%s" % (base, op)), **attrs))
        return out

    # -- the walk -------------------------------------------------------------------------------
    def emit(self, m, path, x, shape):
        """Nodes computing module ``m`` (at dotted ``path``) on value ``x`` of ``shape`` (batch
        symbolic) -> (output value name, output shape)."""
        fn = _EMIT.get(type(m))
        if fn is None and isinstance(m, BatchNorm2d):  # SyncBatchNorm: BatchNorm2d in eval mode
            fn = _EMIT[BatchNorm2d]
        if fn is None:
            raise ArgumentError(
                "export_onnx: %s at %s has no ONNX form; the exporter knows %s"
                % (type(m).__name__, "'%s'" % path if path else "the top of the model",
                   ", ".join(sorted(t.__name__ for t in _EMIT))))
        return fn(self, m, path, x, shape)

    def sequential(self, m, path, x, shape):
        # the children's own names ("0", "1"... or an OrderedDict's keys): the state_dict's
        for name, layer in m.named_children():
            x, shape = self.emit(layer, _join(path, name), x, shape)
        return x, shape

    def residual(self, m, path, x, shape):
        y, yshape = self.emit(m.block, _join(path, "block"), x, shape)
        if yshape != shape:
            raise ShapeError("export_onnx: Residual at '%s': its block maps %s to %s; x + "
                             "block(x) needs the shape unchanged" % (path, _fmt(shape),
                                                                    _fmt(yshape)))
        return self.node("Add", [x, y], path), shape

    def _image(self, m, path, shape, channels):
        if len(shape) != 4 or shape[1] != channels:
            raise ShapeError("export_onnx: %s at '%s' takes [N, %d, H, W], but gets %s"
                             % (type(m).__name__, path, channels, _fmt(shape)))
        return shape[2], shape[3]

    def _conv(self, m, path, x, shape, cin, weight, group, dilation):
        h, w = self._image(m, path, shape, cin)
        kh, kw = m.kernel_size
        s, p = m.stride, m.padding
        ho = (h + 2 * p - dilation * (kh - 1) - 1) // s + 1
        wo = (w + 2 * p - dilation * (kw - 1) - 1) // s + 1
        if ho < 1 or wo < 1:
            raise ShapeError("export_onnx: %s at '%s': a %dx%d input is smaller than its "
                             "kernel" % (type(m).__name__, path, h, w))
        inputs = [x, self.const(_join(path, "weight"), weight, m.weight)]
        if m.bias is not None:
            inputs.append(self.const(_join(path, "bias"), _values(m.bias), m.bias))
        y = self.node("Conv", inputs, path, kernel_shape=[kh, kw], strides=[s, s],
                      pads=[p, p, p, p], dilations=[dilation, dilation], group=group)
        return y, (shape[0], weight.shape[0], ho, wo)

    def conv2d(self, m, path, x, shape):
        return self._conv(m, path, x, shape, m.in_channels, _values(m.weight), 1, 1)

    def dwconv2d(self, m, path, x, shape):
        # PyTorch's and ONNX's depthwise form: a Conv with group=C, weight [out_channels, 1,
        # kh, kw]; output channel o reads input channel o // (out_channels // C), as utensil's
        w = _values(m.weight).reshape(m.out_channels, 1, *m.kernel_size)
        return self._conv(m, path, x, shape, m.channels, w, m.channels, m.dilation)

    def batchnorm2d(self, m, path, x, shape):
        self._image(m, path, shape, m.num_features)
        inputs = [x] + [self.const(_join(path, k), _values(t), t) for k, t in (
            ("weight", m.weight), ("bias", m.bias), ("running_mean", m.running_mean),
            ("running_var", m.running_var))]
        y = self.node("BatchNormalization", inputs, path, epsilon=float(m.eps))
        if m.activation is not None:  # the fused activation: the node(s) its layer would emit
            fn = _ACTIVATIONS.get(m.activation)
            if fn is None:
                raise ArgumentError(
                    "export_onnx: BatchNorm2d at '%s': its fused activation %r has no ONNX form; "
                    "the exporter knows %s" % (path, m.activation, ", ".join(sorted(_ACTIVATIONS))))
            y = fn(self, y, path)
        return y, shape

    # -- activations: one emitter each, keyed by name in _ACTIVATIONS, shared by the activation
    # layers and BatchNorm2d's fused activation ------------------------------------------------
    def _scalar(self, name, value):
        """A float32 scalar initializer, one per graph for each name."""
        return self.const(name, np.array(value, np.float32), _SCALARS.setdefault(name, object()))

    def _relu(self, x, path):
        return self.node("Relu", [x], path)

    def _relu6(self, x, path):
        lo = self.const("relu6_min", np.array(0.0, np.float32), _RELU6_MIN)
        hi = self.const("relu6_max", np.array(6.0, np.float32), _RELU6_MAX)
        return self.node("Clip", [x, lo, hi], path)

    def _sigmoid(self, x, path):
        return self.node("Sigmoid", [x], path)

    def _hardsigmoid(self, x, path):
        # ONNX's max(0, min(1, alpha x + beta)) with PyTorch's alpha 1/6, beta 1/2
        return self.node("HardSigmoid", [x], path, alpha=1.0 / 6.0, beta=0.5)

    def _hardswish(self, x, path):
        if self.opset >= 14:
            return self.node("HardSwish", [x], path)
        return self.node("Mul", [x, self._hardsigmoid(x, path)], path)

    def _silu(self, x, path):
        return self.node("Mul", [x, self.node("Sigmoid", [x], path)], path)

    def _gelu(self, x, path, approximate="none"):
        if self.opset >= 20:
            return self.node("Gelu", [x], path, approximate=approximate)
        if approximate == "tanh":  # x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) / 2
            x3 = self.node("Mul", [self.node("Mul", [x, x], path), x], path)
            inner = self.node("Add", [x, self.node("Mul", [x3, self._scalar(
                "gelu_kappa", 0.044715)], path)], path)
            t = self.node("Tanh", [self.node("Mul", [inner, self._scalar(
                "gelu_sqrt_2_over_pi", np.sqrt(2.0 / np.pi))], path)], path)
        else:  # x (1 + erf(x / sqrt 2)) / 2
            t = self.node("Erf", [self.node("Mul", [x, self._scalar(
                "gelu_rsqrt2", np.sqrt(0.5))], path)], path)
        one_plus = self.node("Add", [t, self._scalar("gelu_one", 1.0)], path)
        half_x = self.node("Mul", [x, self._scalar("gelu_half", 0.5)], path)
        return self.node("Mul", [half_x, one_plus], path)

    def _gelu_tanh(self, x, path):
        return self._gelu(x, path, "tanh")

    def activation_layer(self, m, path, x, shape):
        """An activation layer: the emitter of its name (GELU's by its ``approximate``)."""
        name = _LAYER_ACTIVATION[type(m)]
        if name == "gelu" and m.approximate == "tanh":
            name = "gelu_tanh"
        return _ACTIVATIONS[name](self, x, path), shape

    # -- issue 30's normalizations and squeeze-and-excitation ----------------------------------
    def _norm_last_axis(self, m, path, x):
        """LayerNorm over the last axis, with m's weight, bias and eps: ONNX's
        LayerNormalization from opset 17, its formula before (LayerNormalization is new in 17)."""
        scale = self.const(_join(path, "weight"), _values(m.weight), m.weight)
        bias = self.const(_join(path, "bias"), _values(m.bias), m.bias)
        if self.opset >= 17:
            return self.node("LayerNormalization", [x, scale, bias], path, axis=-1,
                             epsilon=float(m.eps))
        # (x - mean) / sqrt(mean((x - mean)^2) + eps) * weight + bias; ReduceMean's axes are an
        # attribute up to opset 17, an input from 18
        mean = self.node("ReduceMean", [x], path, axes=[-1], keepdims=1)
        d = self.node("Sub", [x, mean], path)
        var = self.node("ReduceMean", [self.node("Mul", [d, d], path)], path, axes=[-1],
                        keepdims=1)
        eps = self.const(_join(path, "eps"), np.array(m.eps, np.float32))
        std = self.node("Sqrt", [self.node("Add", [var, eps], path)], path)
        y = self.node("Mul", [self.node("Div", [d, std], path), scale], path)
        return self.node("Add", [y, bias], path)

    def layer_norm(self, m, path, x, shape):
        if shape[-1] != m.dim:
            raise ShapeError("export_onnx: LayerNorm at '%s' normalizes a last dimension of %d, "
                             "but gets %s" % (path, m.dim, _fmt(shape)))
        return self._norm_last_axis(m, path, x), shape

    def layer_norm2d(self, m, path, x, shape):
        # the channels moved last and back: LayerNormalization normalizes the axes from its
        # ``axis`` to the end, and here that is C alone (as torchvision's permute, LayerNorm,
        # permute back)
        self._image(m, path, shape, m.dim)
        nhwc = self.node("Transpose", [x], path, perm=[0, 2, 3, 1])
        y = self._norm_last_axis(m, path, nhwc)
        return self.node("Transpose", [y], path, perm=[0, 3, 1, 2]), shape

    def squeeze_excitation(self, m, path, x, shape):
        # x * scale_activation(fc2(activation(fc1(avgpool(x))))); GlobalAveragePool's [N, C, 1, 1]
        # is what the 1x1 convolutions take, and Mul broadcasts it over H and W
        self._image(m, path, shape, m.fc1.in_channels)
        s = self.node("GlobalAveragePool", [x], _join(path, "avgpool"))
        sshape = (shape[0], shape[1], 1, 1)
        for name in ("fc1", "activation", "fc2", "scale_activation"):
            s, sshape = self.emit(getattr(m, name), _join(path, name), s, sshape)
        if sshape != (shape[0], shape[1], 1, 1):
            raise ShapeError("export_onnx: SqueezeExcitation at '%s': its scale is %s, not one "
                             "number per channel of %s" % (path, _fmt(sshape), _fmt(shape)))
        return self.node("Mul", [x, s], path), shape

    def global_avg_pool2d(self, m, path, x, shape):
        if len(shape) != 4:
            raise ShapeError("export_onnx: GlobalAvgPool2d at '%s' takes [N, C, H, W], but gets "
                             "%s" % (path, _fmt(shape)))
        y = self.node("GlobalAveragePool", [x], path)
        return self.node("Flatten", [y], path, axis=1), shape[:2]

    def linear(self, m, path, x, shape):
        if len(shape) != 2 or shape[1] != m.in_features:
            raise ShapeError("export_onnx: Linear at '%s' takes [N, %d], but gets %s"
                             % (path, m.in_features, _fmt(shape)))
        inputs = [x, self.const(_join(path, "weight"), _values(m.weight), m.weight)]
        if m.bias is not None:
            inputs.append(self.const(_join(path, "bias"), _values(m.bias), m.bias))
        return self.node("Gemm", inputs, path, transB=1), (shape[0], m.out_features)

    # -- utensil_ffi.models' blocks ------------------------------------------------------------
    def _add_residual(self, m, path, x, shape, y, yshape):
        if yshape != shape:
            raise ShapeError("export_onnx: %s at '%s': its body maps %s to %s; x + body(x) "
                             "needs the shape unchanged" % (type(m).__name__, path, _fmt(shape),
                                                           _fmt(yshape)))
        return self.node("Add", [x, y], path), shape

    def inverted_residual(self, m, path, x, shape):
        # body(x), plus x with use_res_connect; its StochasticDepth is the identity at inference
        name = next(k for k, c in m.named_children() if c is m.body)
        y, yshape = self.emit(m.body, _join(path, name), x, shape)
        if not m.use_res_connect:
            return y, yshape
        return self._add_residual(m, path, x, shape, y, yshape)

    def cn_block(self, m, path, x, shape):
        # x + layer_scale * block(x): layer_scale [C, 1, 1] broadcasts over N, H and W
        y, yshape = self.emit(m.block, _join(path, "block"), x, shape)
        scale = self.const(_join(path, "layer_scale"), _values(m.layer_scale), m.layer_scale)
        y = self.node("Mul", [y, scale], path)
        return self._add_residual(m, path, x, shape, y, yshape)

    def identity(self, m, path, x, shape):
        """Dropout, StochasticDepth: the identity in eval mode, so no node (as PyTorch's export
        drops them)."""
        return x, shape


# keys for the two Clip bounds, shared by every ReLU6 of a graph (const() dedupes by identity)
_RELU6_MIN, _RELU6_MAX = object(), object()
# keys for the activations' scalar constants by name, likewise shared within a graph
_SCALARS = {}

# the activations by name: BatchNorm2d's ``activation`` strings, and the layers' (below)
_ACTIVATIONS = {
    "relu": _Graph._relu,
    "relu6": _Graph._relu6,
    "silu": _Graph._silu,
    "hardswish": _Graph._hardswish,
    "hardsigmoid": _Graph._hardsigmoid,
    "sigmoid": _Graph._sigmoid,
    "gelu": _Graph._gelu,
    "gelu_tanh": _Graph._gelu_tanh,
}
_LAYER_ACTIVATION = {ReLU: "relu", ReLU6: "relu6", SiLU: "silu", Hardswish: "hardswish",
                     Hardsigmoid: "hardsigmoid", Sigmoid: "sigmoid", GELU: "gelu"}

_EMIT = {
    Sequential: _Graph.sequential,
    Residual: _Graph.residual,
    Conv2d: _Graph.conv2d,
    DWConv2d: _Graph.dwconv2d,
    BatchNorm2d: _Graph.batchnorm2d,
    GlobalAvgPool2d: _Graph.global_avg_pool2d,
    Linear: _Graph.linear,
    # issue 30, the training recipe
    Dropout: _Graph.identity,
    StochasticDepth: _Graph.identity,
    # issue 30's blocks
    LayerNorm: _Graph.layer_norm,
    LayerNorm2d: _Graph.layer_norm2d,
    SqueezeExcitation: _Graph.squeeze_excitation,
    # utensil_ffi.models' blocks
    InvertedResidual: _Graph.inverted_residual,
    CNBlock: _Graph.cn_block,
    PointwiseLinear: _Graph.conv2d,  # a 1x1 Conv2d whose state_dict has a Linear's shape
}
_EMIT.update((cls, _Graph.activation_layer) for cls in _LAYER_ACTIVATION)


def _join(path, name):
    return "%s.%s" % (path, name) if path else name
