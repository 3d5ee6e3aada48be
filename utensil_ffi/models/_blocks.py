"""The residual blocks of the model families, with explicit forward and backward:

    InvertedResidual   MobileNetV2/V3's, EfficientNet's MBConv, MNASNet's: a body (a
                       Sequential, held under torchvision's name: "conv", "block" or "layers"),
                       plus x when the shapes allow (use_res_connect), with an optional
                       StochasticDepth ("row") on the body's output before the sum
    CNBlock            ConvNeXt's: x + stochastic_depth(layer_scale * block(x)), block =
                       depthwise 7x7 -> LayerNorm2d -> 1x1 (4x) -> GELU -> 1x1; its own
                       parameter layer_scale ([C, 1, 1], as torchvision's)

Both keep nothing but what they must for backward (CNBlock: the block's output, for the
gradient of layer_scale), per thread as every layer (_lifetime._State); their children keep
theirs. backward(g) returns g + body.backward(...) with a residual, body.backward(g) without;
input_grad=False passes down to the body and returns None. copy/pickle rebuild the same block
(children copied), never the kept forward.
"""

from collections import OrderedDict

import numpy as np

from .. import _args
from .._errors import ArgumentTypeError, check
from .._lib import lib
from .._lifetime import _PASS, _State, _in_pass
from ..functional import add, layer_scale, layer_scale_backward
from ..tensor import Tensor, zeros
from .. import nn
from ..nn import fold
from ..nn.module import (_backward_params_only, _layer_device, _public_state, _rebuild_module,
                         _takes_input_grad)
from ._utils import PointwiseLinear

__all__ = ["InvertedResidual", "CNBlock"]


def _close_unless(t, *keep):
    if isinstance(t, Tensor) and all(t is not k for k in keep):
        t.close()


def _residual_backward(body, grad_out, g, input_grad):
    """grad_out + body.backward(g) (g: the gradient at the body's output, closed here unless it
    is grad_out); with input_grad False the body's parameter gradients only, None."""
    try:
        if not input_grad:
            return _backward_params_only(body, g)
        gb = body.backward(g)
    finally:
        _close_unless(g, grad_out)
    try:
        return add(grad_out, gb)
    finally:
        _close_unless(gb, grad_out)


class InvertedResidual(nn.Module):
    """``body(x)``, or ``x + stochastic_depth(body(x))`` when ``use_res_connect``.

    body: a Module (a Sequential), stored as the public attribute named ``child`` ("block" for
    MobileNetV3 and EfficientNet, "conv" for MobileNetV2, "layers" for MNASNet), so its keys are
    torchvision's ("block.0.0.weight"). stochastic_depth_prob: None (no such child: MobileNet,
    MNASNet) or p, a StochasticDepth(p, "row") child named ``stochastic_depth`` (EfficientNet;
    no parameters, used only with the residual, as torchvision's MBConv)."""

    def __init__(self, body, use_res_connect, stochastic_depth_prob=None, child="block"):
        if not isinstance(body, nn.Module):
            raise ArgumentTypeError("InvertedResidual: body must be a Module, got %s"
                                    % type(body).__name__)
        self._child = _args.to_str(child, "child")
        setattr(self, self._child, body)
        self.use_res_connect = _args.to_bool(use_res_connect, "use_res_connect")
        if stochastic_depth_prob is not None:
            self.stochastic_depth = nn.StochasticDepth(stochastic_depth_prob, "row")

    @property
    def body(self):
        return getattr(self, self._child)

    def _sd(self):
        return self.__dict__.get("stochastic_depth")

    def forward(self, x):
        return _in_pass(self._forward, (x,))

    def _forward(self, x):
        sd = self._sd()
        if not self.training and (sd is None or not sd.training):
            # eval: a separable body (and its residual) in one call
            plan = fold.kept_separable_plan(self.body)
            if plan is not None:  # (fold's function looked up here: profilers wrap it)
                return fold.separable_forward(plan, x, residual=self.use_res_connect)
        y = self.body(x)
        if not self.use_res_connect:
            return y
        try:
            sd = self._sd()
            if sd is not None:
                z = sd(y)
                _close_unless(y, z, x)
                y = z
            return add(x, y)
        finally:
            _close_unless(y, x)

    @_takes_input_grad
    def backward(self, grad_out, *, input_grad=True):
        input_grad = _args.to_bool(input_grad, "input_grad")
        if not self.use_res_connect:
            if not input_grad:
                return _backward_params_only(self.body, grad_out)
            return self.body.backward(grad_out)
        sd = self._sd()
        g = sd.backward(grad_out) if sd is not None else grad_out
        return _residual_backward(self.body, grad_out, g, input_grad)

    def _modules(self):
        return [m for _, m in self.named_children()]

    def train(self, mode=True):
        self.training = _args.to_bool(mode, "mode")
        for m in self._modules():
            m.train(mode)
        return self

    def to(self, device):
        for m in self._modules():
            m.to(device)
        return self

    def _clear_cache(self):
        for m in self._modules():
            m._clear_cache()

    def close(self):
        for m in self._modules():
            m.close()

    def __reduce_ex__(self, protocol):
        state = _public_state(self)
        body = state.pop(self._child)
        sd = state.get("stochastic_depth")
        args = (body, state.pop("use_res_connect"), sd.p if sd is not None else None, self._child)
        return (_rebuild_module, (type(self), InvertedResidual, args, state))

    def __repr__(self):
        inner = "".join("\n  (%s): %s" % (k, repr(m).replace("\n", "\n  "))
                        for k, m in self.named_children())
        return "InvertedResidual(use_res_connect=%s,%s\n)" % (self.use_res_connect, inner)


def _drop_cn_entry(entry):
    _close_unless(entry[1])


class CNBlock(nn.Module):
    """torchvision's ConvNeXt CNBlock on NCHW: ``x + stochastic_depth(layer_scale *
    block(x))``.

    block (a Sequential named as torchvision's, its Permutes absent): "0" DWConv2d(dim, 7,
    padding 3, bias), "2" LayerNorm2d(dim, eps 1e-6), "3" PointwiseLinear(dim, 4 dim), "4"
    GELU, "5" PointwiseLinear(4 dim, dim): torchvision's channels-last LayerNorm and Linears as
    the same functions over the channels of NCHW, with its state_dict shapes. layer_scale: a
    Parameter [dim, 1, 1], initially ``layer_scale`` everywhere. stochastic_depth:
    StochasticDepth(p, "row"). Forward keeps block(x) in training mode (layer_scale's gradient
    is sum over n, h, w of grad * block(x))."""

    def __init__(self, dim, layer_scale=1e-6, stochastic_depth_prob=0.0, device="cpu"):
        dim = _args.to_int(dim, "dim", 1)
        ls = _args.to_float(layer_scale, "layer_scale")
        self._state = _State(_drop_cn_entry)
        self.block = nn.Sequential(OrderedDict([
            ("0", nn.DWConv2d(dim, 7, padding=3, bias=True, device=device)),
            ("2", nn.LayerNorm2d(dim, eps=1e-6, device=device)),
            ("3", PointwiseLinear(dim, 4 * dim, device=device)),
            ("4", nn.GELU()),
            ("5", PointwiseLinear(4 * dim, dim, device=device)),
        ]))
        self.layer_scale = nn.Parameter(np.full((dim, 1, 1), ls, np.float32), device,
                                        name="layer_scale")
        self.stochastic_depth = nn.StochasticDepth(stochastic_depth_prob, "row")

    # Training forward may free the second Linear's input (GELU's output, 4 dim channels: a
    # third of what the block keeps) and have backward recompute it from GELU's kept input: one
    # more elementwise pass per step for the memory. None (the default) does so on the GPU,
    # where memory bounds the batch, and not on the CPU, where the pass cost ConvNeXt's step
    # ~4% (64^2, batch 8) and memory is plenty; True or False decides for every device (False
    # keeps it, as PyTorch does).
    recompute_gelu = None

    @property
    def device(self):
        return self.layer_scale.device

    def _own_parameters(self):
        return [("layer_scale", self.layer_scale)]

    def forward(self, x):
        return _in_pass(self._forward, (x,))

    def _forward(self, x):
        if not isinstance(x, Tensor):
            x = Tensor(_args.to_float_array(x, "CNBlock: x"), self.device)
        y = self.block(x)
        try:
            z = layer_scale(y, self.layer_scale)
        except BaseException:
            y.close()
            raise
        if self.training:
            forgot = self.recompute_gelu
            if forgot is None:
                forgot = self.device != "cpu"
            if forgot:
                # GELU keeps its input h (4 dim channels), the second Linear GELU(h): free the
                # latter now and recompute it, bitwise the same, just before it is needed
                self.block.layers[-1]._forget_input()
            self._state.push((getattr(_PASS, "id", None), y, forgot))
        else:
            y.close()
        try:
            w = self.stochastic_depth(z)
        except BaseException:
            z.close()
            raise
        _close_unless(z, w)
        try:
            return add(x, w)
        finally:
            w.close()

    @_takes_input_grad
    def backward(self, grad_out, *, input_grad=True):
        input_grad = _args.to_bool(input_grad, "input_grad")
        e = self._state.take_for("CNBlock")
        done, forgot = False, None
        try:
            forgot = self._state.local().pos if e[2] else None
            if forgot is not None:
                self._recall_gelu_output(forgot)
            g = self.stochastic_depth.backward(grad_out)
            done = True
            try:
                p = self.layer_scale
                with self._state.wlock:
                    if p.grad is None:
                        p.grad = zeros(p.shape, p.device)
                    dy = layer_scale_backward(g, e[1], p, p.grad)
            finally:
                _close_unless(g, grad_out)
            return _residual_backward(self.block, grad_out, dy, input_grad)
        finally:
            if forgot is not None:  # kept for a repeated backward: recomputed again then
                self.block.layers[-1]._forget_input(forgot)
            if not done:
                self._state.untake()
            self._state.leave()

    def _recall_gelu_output(self, index):
        """The second Linear's input for this thread's forward ``index``: GELU's output,
        recomputed from the input GELU kept (the same op on the same values: the same bits)."""
        gelu, pw2 = self.block.layers[-2], self.block.layers[-1]
        h = gelu._state.local().entries[index][1]
        a = gelu._op(h)
        try:
            pw2._recall_input(index, a)
        finally:
            a.close()  # the Linear's cache holds its own reference

    def train(self, mode=True):
        self.training = _args.to_bool(mode, "mode")
        if not mode:
            self._state.clear()
        self.block.train(mode)
        self.stochastic_depth.train(mode)
        return self

    def to(self, device):
        self._state.clear()
        self.block.to(device)
        dev = _layer_device(device)
        p = self.layer_scale
        for t in [p] + ([p.grad] if p.grad is not None else []):
            if t.ptr.dev != dev and lib.ut_to_device(t.ptr, dev) < 0:  # in place, as layers do
                check("CNBlock.to")
        return self

    def _clear_cache(self):
        self._state.clear()
        self.block._clear_cache()
        self.stochastic_depth._clear_cache()

    def close(self):
        self._state.clear()
        self.block.close()
        self.stochastic_depth.close()
        self.layer_scale.close()

    def __reduce_ex__(self, protocol):
        # layer_scale (a public attribute) and the children are copied; the kept forward is not
        return (_rebuild_cn_block, (type(self), _public_state(self)))

    def __repr__(self):
        inner = repr(self.block).replace("\n", "\n  ")
        return ("CNBlock(layer_scale=Parameter%s,\n  (block): %s\n  (stochastic_depth): %r\n)"
                % (list(self.layer_scale.shape), inner, self.stochastic_depth))


def _rebuild_cn_block(cls, state):
    obj = cls.__new__(cls)
    obj._state = _State(_drop_cn_entry)
    obj.__dict__.update(state)
    return obj
