"""SqueezeExcitation (torchvision.ops.SqueezeExcitation): a block that rescales each channel of
its input by a weight computed from the input itself (issue 30; MobileNetV3, EfficientNet).

    se = ut.SqueezeExcitation(64, 16)          # avgpool, fc1, activation, fc2, scale_activation
    y = se(x)                                   # x * sigmoid(fc2(relu(fc1(mean_hw(x)))))
    dx = se.backward(dy)                        # both paths: dy * scale, and through the branch

Its own module (not blocks.py) because it is built of layers (Conv2d) that sit on blocks.py's
floor (tests/test_imports.py).
"""

from .. import _args
from .._errors import ArgumentError, ArgumentTypeError
from .._lifetime import _PASS, _State, _in_pass
from ..functional import channel_scale, channel_scale_backward
from ..tensor import Tensor
from . import activation as _activation
from .conv import Conv2d
from .module import Module, _backward_params_only, _kept, _public_state, _takes_input_grad
from .pooling import GlobalAvgPool2d

__all__ = ["SqueezeExcitation"]


def _drop_se_entry(entry):
    for t in entry[1:]:
        if isinstance(t, Tensor):
            t.close()


def _close_unless(t, *keep):
    if isinstance(t, Tensor) and all(t is not k for k in keep):
        t.close()


class SqueezeExcitation(Module):
    """torchvision.ops.SqueezeExcitation: ``x * scale_activation(fc2(activation(fc1(
    avgpool(x)))))``, the scale one number per sample and channel.

    x: [N, C, H, W] with C = input_channels -> same shape. Submodules with torchvision's names
    and state_dict keys: ``avgpool`` (GlobalAvgPool2d: [N, C], reshaped to [N, C, 1, 1] for the
    1x1 convolutions; no parameters), ``fc1`` (Conv2d(input_channels, squeeze_channels, 1),
    with bias), ``fc2`` (Conv2d(squeeze_channels, input_channels, 1)), ``activation``,
    ``scale_activation`` (``activation`` and ``scale_activation`` are Module classes, called
    with no arguments, as torchvision's ``nn.ReLU`` and ``nn.Sigmoid``; any Module with
    forward and backward fits).

    backward(g) follows both paths from x: the direct one (g * scale) and the one through the
    scale branch (d scale[n, c] = sum over h, w of g * x, back through scale_activation, fc2,
    activation, fc1 and the pooling), and returns their sum. Forward keeps x and the scale (per
    thread, as every layer keeps its cache) in training mode only.
    """

    def __init__(self, input_channels, squeeze_channels, activation=_activation.ReLU,
                 scale_activation=_activation.Sigmoid, device="cpu"):
        for name, cls in (("activation", activation), ("scale_activation", scale_activation)):
            if not callable(cls):
                raise ArgumentTypeError("SqueezeExcitation: %s must be a Module class (called "
                                        "with no arguments), got %r" % (name, cls))
        input_channels = _args.to_int(input_channels, "input_channels", 1)
        squeeze_channels = _args.to_int(squeeze_channels, "squeeze_channels", 1)
        self._state = _State(_drop_se_entry)
        # torchvision's order: avgpool, fc1, fc2, activation, scale_activation
        self.avgpool = GlobalAvgPool2d()
        self.fc1 = Conv2d(input_channels, squeeze_channels, 1, device=device)
        self.fc2 = Conv2d(squeeze_channels, input_channels, 1, device=device)
        self.activation = self._make(activation, "activation")
        self.scale_activation = self._make(scale_activation, "scale_activation")

    # fold.py: an eval-mode separable block's C call may run this block as its se_* part
    _folds_into_block = True

    def _block_parts(self):
        """(fc1, activation's C code, fc2, scale_activation's C code) when the separable
        block's C call computes what this eval-mode block computes (the pooling, two plain 1x1
        Conv2ds, two activations with C codes, all in eval mode); else None."""
        if (self.training or type(self.avgpool) is not GlobalAvgPool2d
                or any(m.training for m in self._children())):
            return None
        for fc in (self.fc1, self.fc2):
            if (type(fc) is not Conv2d or tuple(fc.kernel_size) != (1, 1) or fc.stride != 1
                    or fc.padding != 0):
                return None
        a = getattr(self.activation, "_fold_act", None)
        sa = getattr(self.scale_activation, "_fold_act", None)
        if a is None or sa is None:
            return None
        return self.fc1, a, self.fc2, sa

    @staticmethod
    def _make(cls, name):
        m = cls()
        if not isinstance(m, Module):
            raise ArgumentTypeError("SqueezeExcitation: %s() made a %s, not a Module"
                                    % (name, type(m).__name__))
        return m

    @property
    def device(self):
        return self.fc1.device

    def _children(self):
        return [self.avgpool, self.fc1, self.fc2, self.activation, self.scale_activation]

    def __call__(self, x):
        return self.forward(x)

    def forward(self, x):
        return _in_pass(self._forward, (x,))

    def _forward(self, x):
        if not isinstance(x, Tensor):
            x = Tensor(_args.to_float_array(x, "SqueezeExcitation: x"), self.device)
        s = self._scale(x)
        try:
            y = channel_scale(x, s)
        except BaseException:
            s.close()
            raise
        if self.training:
            k = _kept(x, y)
            self._state.push((getattr(_PASS, "id", None), k, k._ptr.version, s))
        else:
            s.close()
        return y

    def _scale(self, x):
        """scale_activation(fc2(activation(fc1(avgpool(x))))): [N, C, 1, 1], x's dtype."""
        p = self.avgpool(x)
        try:
            p4 = p.reshape(tuple(p.shape) + (1, 1))
        finally:
            p.close()
        cur = p4
        try:
            for m in (self.fc1, self.activation, self.fc2, self.scale_activation):
                nxt = m(cur)
                _close_unless(cur, nxt)  # the layers keep their own references
                cur = nxt
        except BaseException:
            _close_unless(cur, x)
            raise
        return cur

    @_takes_input_grad
    def backward(self, grad_out, *, input_grad=True):
        input_grad = _args.to_bool(input_grad, "input_grad")
        e = self._state.take_for("SqueezeExcitation")
        done = False
        try:
            _, x, version, s = e
            if x._ptr.version != version:
                raise ArgumentError(
                    "SqueezeExcitation.backward: the input was modified in place after the "
                    "forward pass, so its gradient would be wrong; change it only after backward, "
                    "or pass a clone to forward")
            dx, g = channel_scale_backward(grad_out, x, s, input_grad=input_grad)
            done = True
            try:
                for m in (self.scale_activation, self.fc2, self.activation):
                    nxt = m.backward(g)
                    _close_unless(g, nxt)
                    g = nxt
                if not input_grad:
                    return _backward_params_only(self.fc1, g)
                g4 = self.fc1.backward(g)
                _close_unless(g, g4)
                try:
                    g2 = g4.reshape(tuple(g4.shape)[:2])
                finally:
                    g4.close()
                try:
                    dxb = self.avgpool.backward(g2)
                finally:
                    g2.close()
                try:
                    return dx.add_(dxb)
                finally:
                    dxb.close()
            except BaseException:
                _close_unless(dx)
                raise
            finally:
                _close_unless(g)
        finally:
            if not done:
                self._state.untake()
            self._state.leave()

    def train(self, mode=True):
        self.training = _args.to_bool(mode, "mode")
        if not mode:
            self._state.clear()
        for m in self._children():
            m.train(mode)
        return self

    def to(self, device):
        self._state.clear()
        for m in self._children():
            m.to(device)
        return self

    def _clear_cache(self):
        self._state.clear()
        for m in self._children():
            m._clear_cache()

    def close(self):
        self._state.clear()
        for m in self._children():
            m.close()

    def __reduce_ex__(self, protocol):
        # the children are copied (pickle's memo keeps a shared one shared); the kept forward
        # is not: backward needs a new forward
        return (_rebuild_squeeze_excitation, (type(self), _public_state(self)))

    def __repr__(self):
        inner = "".join("\n  (%s): %s" % (k, repr(m).replace("\n", "\n  "))
                        for k, m in self.named_children())
        return "SqueezeExcitation(%s\n)" % inner


def _rebuild_squeeze_excitation(cls, state):
    obj = cls.__new__(cls)
    obj._state = _State(_drop_se_entry)
    obj.__dict__.update(state)
    return obj
