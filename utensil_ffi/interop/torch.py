"""utensil's depthwise convolution inside a PyTorch model (needs PyTorch; the rest of utensil_ffi
does not, and ``import utensil_ffi`` never imports this module).

    import utensil_ffi.interop.torch as utt
    utt.convert(model)          # every eligible nn.Conv2d(groups=in_channels) now runs on utensil
    loss = loss_fn(model(x), y); loss.backward(); opt.step()      # unchanged, torch.compile too

What is here:

- ``depthwise_conv2d(x, weight, bias=None, stride=1, padding=0, dilation=1)``, the custom op
  ``torch.ops.utensil.depthwise_conv2d`` (``torch.library.custom_op``): PyTorch's
  ``F.conv2d(x, weight, bias, stride, padding, dilation, groups=C)`` for x: [N, C, H, W] and
  weight: [m*C, 1, kh, kw] (m filters per channel), on the CPU and on CUDA. Its backward is the
  op ``torch.ops.utensil.depthwise_conv2d_backward`` (dx, dW and db in one C call). Both have fake
  kernels, so ``torch.compile`` traces them without a graph break, and autograd is registered
  (first derivatives; a double backward raises).
- ``DepthwiseConv2d``: an ``nn.Conv2d`` subclass with Conv2d's arguments (``groups`` defaults to,
  and must equal, ``in_channels``), parameters and state_dict keys, whose forward runs the op.
- ``convert(model)``: turns every eligible depthwise ``nn.Conv2d`` of ``model`` into a
  DepthwiseConv2d in place (the same module objects and Parameters: weights, hooks and an
  optimizer made earlier keep working); returns ``model``.

Policies:

- Layout: the op reads float32 C-contiguous memory. Other layouts (channels_last, slices) are
  made contiguous first, one copy; the gradients come back contiguous.
- dtype: the op refuses anything but float32 (TypeError naming the dtype). DepthwiseConv2d
  instead falls back to PyTorch's own conv2d for what utensil does not run: another dtype
  (float64, half), autocast, a device other than the CPU and utensil's GPU (cuda:0, when utensil
  was built with CUDA), or a stride or dilation that differs between height and width (the core
  has one of each). Padding is the core's when it is the same on all four sides; other padding
  (``padding=(1, 2)``, odd ``"same"``, ``padding_mode="reflect"``...) is applied with ``F.pad``
  and the op runs unpadded.
- Eligible for ``convert``: a module whose type is exactly ``nn.Conv2d`` (subclasses have their
  own forward) with ``groups == in_channels > 1`` and equal strides and dilations in both
  directions. Everything else is left alone.
- Memory: zero-copy both ways, on the tensors' device. The outputs are utensil tensors handed
  to ``torch.from_dlpack`` (PyTorch keeps them alive and frees them into utensil's memory
  cache). The inputs are lent to C for the call only (``ut_wrap`` over the PyTorch tensor's
  memory, which the call holds): what a DLPack import ends in, without a capsule per input
  (about 30 us each, five per layer and training step). dW and db are PyTorch zeros that
  utensil adds into.
- CUDA streams: utensil queues its GPU work on the legacy default stream, which is PyTorch's
  default stream too, so in the usual case nothing is synchronized. On another current stream
  the op is ordered on it: utensil's stream waits for the work queued so far on PyTorch's
  current stream, and that stream then waits for utensil's work (CUDA events, no host wait).
  Not capturable in a PyTorch CUDA graph (tagged ``cudagraph_unsafe``).
- Threads: utensil's CPU threads are its own (``utensil_ffi.set_num_threads``, default: the
  cores the process may run on); PyTorch's setting is left alone. They take turns (one op at a
  time), so set both to the same count: ``ut.set_num_threads(torch.get_num_threads())``.
"""

import inspect
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .._errors import check_ptr, check_status
from .._lib import ffi, lib
from ..tensor import Tensor

if not hasattr(torch.library, "custom_op"):  # torch.library.custom_op came with PyTorch 2.4
    raise ImportError("utensil_ffi.interop.torch needs PyTorch 2.4 or newer "
                      "(torch.library.custom_op); this is PyTorch %s" % torch.__version__)

__all__ = ["depthwise_conv2d", "depthwise_conv2d_backward", "DepthwiseConv2d", "convert",
           "eligible"]

# Read once: DepthwiseConv2d's forward must not call into C while torch.compile traces it.
_UT_CUDA = bool(lib.ut_cuda_available())
# Not capturable in PyTorch's CUDA graphs (utensil launches on the legacy default stream): say so
# where this PyTorch knows the tag (custom_op takes tags from 2.5 on)
_TAGS = {"tags": (torch.Tag.cudagraph_unsafe,)} if hasattr(torch.Tag, "cudagraph_unsafe") and (
    "tags" in inspect.signature(torch.library.custom_op).parameters) else {}
_OP = "utensil::depthwise_conv2d"


# -- shapes ---------------------------------------------------------------------------------------
def _geometry(x, weight, bias, stride, padding, dilation, who=_OP):
    """(n, c, h, w, oc, kh, kw, ho, wo) after checking what the op accepts (real and fake)."""
    if x.dim() != 4:
        raise ValueError("%s: x must be [N, C, H, W], got shape %s" % (who, tuple(x.shape)))
    if weight.dim() != 4 or weight.shape[1] != 1:
        raise ValueError("%s: weight must be [out_channels, 1, kh, kw], got shape %s"
                         % (who, tuple(weight.shape)))
    n, c, h, w = x.shape
    oc, _, kh, kw = weight.shape
    if c < 1 or oc % c != 0 or oc < c:
        raise ValueError("%s: weight's %d filters are not a multiple of x's %d channels"
                         % (who, oc, c))
    if bias is not None and tuple(bias.shape) != (oc,):
        raise ValueError("%s: bias must be [%d], got shape %s" % (who, oc, tuple(bias.shape)))
    if stride < 1 or padding < 0 or dilation < 1:
        raise ValueError("%s: need stride >= 1, padding >= 0, dilation >= 1; got %d, %d, %d"
                         % (who, stride, padding, dilation))
    for t, name in ((x, "x"), (weight, "weight"), (bias, "bias")):
        if t is None:
            continue
        if t.dtype != torch.float32:
            raise TypeError("%s: utensil computes in float32; %s is %s (convert it, or use "
                            "torch's conv2d for other dtypes)" % (who, name, t.dtype))
        if t.device != x.device:
            raise ValueError("%s: %s is on %s, x on %s" % (who, name, t.device, x.device))
    ho = (h + 2 * padding - dilation * (kh - 1) - 1) // stride + 1
    wo = (w + 2 * padding - dilation * (kw - 1) - 1) // stride + 1
    if ho < 1 or wo < 1:
        raise ValueError("%s: a %dx%d input padded by %d is smaller than the %dx%d kernel "
                         "dilated by %d" % (who, h, w, padding, kh, kw, dilation))
    return n, c, h, w, oc, kh, kw, ho, wo


# -- the exchange with utensil --------------------------------------------------------------------
_INT_MAX = 2**31 - 1


class _Call:
    """One call into utensil: the device checks, the inputs lent to C, and the ordering on
    PyTorch's current CUDA stream.

    ``call.lend(t)`` is a C tensor over ``t``'s memory (``ut_wrap``, zero-copy; a contiguous copy
    first when ``t`` is not contiguous), valid inside the ``with`` block: the call holds ``t`` (or
    its copy) and frees the C tensor on leaving. It is the wrap that importing ``t`` through
    DLPack ends in, without the capsule's per-tensor cost (about 30 us, five times per training
    step of each layer); the results go back through DLPack (``_export``).

    On a CUDA stream other than the default one, entering makes utensil's stream (the legacy
    default stream) wait for the work queued so far on PyTorch's current stream, and leaving
    makes that stream wait for what utensil queued (CUDA events, no host wait): the op behaves
    as if it ran on the current stream. Nothing is done on the CPU, nor on PyTorch's default
    stream, which is utensil's.
    """

    __slots__ = ("dev", "stream", "guard", "held", "lent")

    def __init__(self, x):
        self.dev, self.stream, self.guard, self.held, self.lent = lib.UT_CPU, 0, None, [], []
        dev = x.device
        if dev.type == "cpu":
            return
        if dev.type != "cuda":
            raise RuntimeError("%s: utensil runs on the CPU and on CUDA, not on %s" % (_OP, dev))
        if not _UT_CUDA:
            raise RuntimeError("%s: x is on %s, but this utensil library has no usable GPU "
                               "(built without CUDA, or none present; utensil_ffi.devices() "
                               "lists what it has)" % (_OP, dev))
        if (dev.index or 0) != 0:
            raise RuntimeError("%s: utensil uses one GPU, cuda:0; x is on %s" % (_OP, dev))
        self.dev = lib.UT_CUDA
        if torch.cuda.current_device() != 0:  # the current stream below is device 0's
            self.guard = torch.cuda.device(0)

    def __enter__(self):
        if self.guard is not None:
            self.guard.__enter__()
        if self.dev == lib.UT_CUDA:
            s = torch.cuda.current_stream().cuda_stream
            if s != 0:  # not the legacy default stream: utensil's stream waits for this one
                self.stream = s
                check_status(lib.ut_cuda_stream_wait(ffi.NULL, ffi.cast("void*", s)), _OP)
        return self

    def lend(self, t):
        if t is None:
            return ffi.NULL
        if not t.is_contiguous():
            # the copy is queued on PyTorch's current stream after __enter__'s wait (autograd's
            # grad of a sum is an expanded, non-contiguous tensor): wait for it too, or
            # utensil may read the copy's buffer before it is written
            t = t.contiguous()
            if self.stream:
                check_status(lib.ut_cuda_stream_wait(ffi.NULL, ffi.cast("void*", self.stream)),
                             _OP)
        if t.numel() > _INT_MAX:
            raise ValueError("%s: utensil's tensors hold at most 2^31 - 1 elements, got %s"
                             % (_OP, tuple(t.shape)))
        self.held.append(t)
        p = lib.ut_wrap(t.dim(), ffi.new("int[]", tuple(t.shape)), self.dev,
                        ffi.cast("void*", t.data_ptr()), ffi.NULL, ffi.NULL)
        self.lent.append(check_ptr(p, _OP))
        return p

    def __exit__(self, *exc):
        try:
            for p in self.lent:  # the C tensors only: the memory stays PyTorch's
                lib.ut_free(p)
            if self.stream:  # PyTorch's stream waits for utensil's work
                check_status(lib.ut_cuda_stream_wait(ffi.cast("void*", self.stream), ffi.NULL),
                             _OP)
        finally:
            if self.guard is not None:
                self.guard.__exit__(*exc)


def _export(p, who):
    """The PyTorch tensor over the C tensor ``p`` a utensil op returned (DLPack, no copy;
    PyTorch's deleter gives it back to utensil)."""
    return torch.from_dlpack(Tensor._wrap(check_ptr(p, who)))


def _layer(c, oc, kh, kw, stride, padding, dilation, weight, bias):
    """A ut_dwconv2d over the lent C tensors weight and bias (never freed through it)."""
    return ffi.new("ut_dwconv2d *", {
        "weight": weight, "bias": bias, "c": c, "kh": kh, "kw": kw, "stride": stride,
        "pad": padding, "dilation": dilation, "mult": oc // c})


# -- the ops --------------------------------------------------------------------------------------
@torch.library.custom_op(_OP, mutates_args=(), device_types=("cpu", "cuda"), **_TAGS)
def depthwise_conv2d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                     stride: int = 1, padding: int = 0, dilation: int = 1) -> torch.Tensor:
    """x: [N, C, H, W], weight: [m*C, 1, kh, kw], bias: [m*C] or None -> [N, m*C, Ho, Wo],
    Ho = (H + 2 padding - dilation (kh - 1) - 1) // stride + 1: PyTorch's
    ``F.conv2d(x, weight, bias, stride, padding, dilation, groups=C)`` on utensil's kernels
    (C: ut_dwconv2d_forward). float32 only; non-contiguous inputs are copied contiguous first."""
    n, c, h, w, oc, kh, kw, ho, wo = _geometry(x, weight, bias, stride, padding, dilation)
    if n == 0:  # utensil has no empty tensors
        return x.new_zeros((0, oc, ho, wo))
    with _Call(x) as call:
        layer = _layer(c, oc, kh, kw, stride, padding, dilation, call.lend(weight),
                       call.lend(bias))
        return _export(lib.ut_dwconv2d_forward(layer, call.lend(x), ffi.NULL), _OP)


@depthwise_conv2d.register_fake
def _depthwise_conv2d_fake(x, weight, bias=None, stride=1, padding=0, dilation=1):
    n, c, h, w, oc, kh, kw, ho, wo = _geometry(x, weight, bias, stride, padding, dilation)
    return x.new_empty((n, oc, ho, wo))


@torch.library.custom_op(_OP + "_backward", mutates_args=(), device_types=("cpu", "cuda"),
                         **_TAGS)
def depthwise_conv2d_backward(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                              has_bias: bool, stride: int, padding: int,
                              dilation: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """grad_out: [N, m*C, Ho, Wo] and the forward's x, weight -> (dx [N, C, H, W],
    dW [m*C, 1, kh, kw], db [m*C], or [0] when has_bias is False), in one C call
    (ut_dwconv2d_backward)."""
    who = _OP + "_backward"
    n, c, h, w, oc, kh, kw, ho, wo = _geometry(x, weight, None, stride, padding, dilation, who)
    if tuple(grad_out.shape) != (n, oc, ho, wo) or grad_out.dtype != torch.float32:
        raise ValueError("%s: grad_out must be float32 [%d, %d, %d, %d], got %s %s"
                         % (who, n, oc, ho, wo, grad_out.dtype, tuple(grad_out.shape)))
    dw = torch.zeros_like(weight, memory_format=torch.contiguous_format)
    db = weight.new_zeros((oc,) if has_bias else (0,))
    if n == 0:
        return x.new_zeros(x.shape), dw, db
    with _Call(x) as call:
        dbp = call.lend(db) if has_bias else ffi.NULL
        # the bias slot only tells the C backward to compute db: it reads db's shape, not values
        layer = _layer(c, oc, kh, kw, stride, padding, dilation, call.lend(weight), dbp)
        cache = ffi.new("ut_dwconv2d_cache *", {"input": call.lend(x)})
        dx = _export(lib.ut_dwconv2d_backward(layer, cache, call.lend(grad_out), call.lend(dw),
                                              dbp), who)
    return dx, dw, db


@depthwise_conv2d_backward.register_fake
def _depthwise_conv2d_backward_fake(grad_out, x, weight, has_bias, stride, padding, dilation):
    oc = weight.shape[0]
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty_like(weight, memory_format=torch.contiguous_format),
            weight.new_empty((oc,) if has_bias else (0,)))


def _setup_context(ctx, inputs, output):
    x, weight, bias, stride, padding, dilation = inputs
    ctx.save_for_backward(x, weight)
    ctx.conf = (bias is not None, stride, padding, dilation)


def _backward(ctx, grad):
    x, weight = ctx.saved_tensors
    has_bias, stride, padding, dilation = ctx.conf
    dx, dw, db = depthwise_conv2d_backward(grad, x, weight, has_bias, stride, padding, dilation)
    return (dx if ctx.needs_input_grad[0] else None, dw if ctx.needs_input_grad[1] else None,
            db if has_bias and ctx.needs_input_grad[2] else None, None, None, None)


depthwise_conv2d.register_autograd(_backward, setup_context=_setup_context)


# -- the module -----------------------------------------------------------------------------------
def _runs_on_utensil(x, weight, bias):
    """Whether utensil takes this call (else DepthwiseConv2d runs PyTorch's conv2d)."""
    if x.dtype != torch.float32 or weight.dtype != torch.float32:
        return False
    if bias is not None and bias.dtype != torch.float32:
        return False
    dev = x.device
    if dev.type == "cuda":
        if not _UT_CUDA or (dev.index or 0) != 0:
            return False
    elif dev.type != "cpu":
        return False
    return not torch.is_autocast_enabled(dev.type)


class DepthwiseConv2d(nn.Conv2d):
    """``nn.Conv2d(in_channels, out_channels, kernel_size, groups=in_channels, ...)`` whose
    forward and backward run on utensil (the ``utensil::depthwise_conv2d`` op).

    The same arguments as nn.Conv2d (``groups`` defaults to ``in_channels`` and must equal it;
    ``out_channels`` is a multiple of it), the same parameters, state_dict keys and repr fields,
    and ``isinstance(m, nn.Conv2d)`` holds. What utensil does not run falls back to PyTorch's
    conv2d (see the module's docstring): other dtypes, autocast, other devices, a stride or
    dilation that differs between height and width.
    """

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1,
                 groups=None, bias=True, padding_mode="zeros", device=None, dtype=None):
        if groups is None:
            groups = in_channels
        if groups != in_channels:
            raise ValueError("DepthwiseConv2d: groups must equal in_channels (%d), got %r; use "
                             "nn.Conv2d for grouped convolutions" % (in_channels, groups))
        super().__init__(in_channels, out_channels, kernel_size, stride=stride, padding=padding,
                         dilation=dilation, groups=groups, bias=bias, padding_mode=padding_mode,
                         device=device, dtype=dtype)

    def __prepare_scriptable__(self):
        # torch.jit.script calls this on every submodule before compiling: TorchScript cannot
        # call into utensil (a cffi library), so say what works instead of its compiler's error
        raise RuntimeError(
            "utensil_ffi.torch.DepthwiseConv2d cannot be compiled by torch.jit.script (its forward "
            "calls into utensil through cffi, which TorchScript cannot run); use torch.jit.trace "
            "or torch.compile, which keep the utensil op, or script the model before convert()")

    def _conv_forward(self, x, weight, bias):
        (sh, sw), (dh, dw) = self.stride, self.dilation
        if sh != sw or dh != dw or x.dim() not in (3, 4) or not _runs_on_utensil(x, weight, bias):
            return super()._conv_forward(x, weight, bias)
        batched = x.dim() == 4
        if not batched:
            x = x.unsqueeze(0)
        pads = self._reversed_padding_repeated_twice  # [left, right, top, bottom]
        if self.padding_mode == "zeros" and min(pads) == max(pads):
            pad = pads[0]
        else:
            mode = "constant" if self.padding_mode == "zeros" else self.padding_mode
            x = F.pad(x, list(pads), mode=mode)
            pad = 0
        y = depthwise_conv2d(x, weight, bias, sh, pad, dh)
        return y if batched else y.squeeze(0)


def eligible(module):
    """Whether ``convert`` turns ``module`` into a DepthwiseConv2d: a plain nn.Conv2d (its type
    exactly) with groups == in_channels > 1 and the same stride and dilation in both
    directions."""
    return (type(module) is nn.Conv2d and module.groups == module.in_channels > 1
            and module.stride[0] == module.stride[1]
            and module.dilation[0] == module.dilation[1])


def convert(model):
    """Turn every eligible depthwise nn.Conv2d in ``model`` (``model`` itself included) into a
    DepthwiseConv2d, in place, and return ``model``.

    The modules stay the same objects with the same Parameters (only their class changes), so
    the weights, state_dict keys, hooks and an optimizer made before the call are kept. See
    ``eligible`` for what is converted; the rest is left as it is.
    """
    if not isinstance(model, nn.Module):
        raise TypeError("convert: expected an nn.Module, got %s" % type(model).__name__)
    for m in model.modules():
        if eligible(m):
            m.__class__ = DepthwiseConv2d
    return model
