"""The stateful fuzzer: random sequences of operations on live objects, run in a child process by
tests/test_stateful_fuzz.py (a crash or hang kills only the child).

    python tests/stateful_child.py SEQUENCES SEED DEVICE [--only I] [--ops N]

Where tests/fuzz_child.py calls one entry point at a time with hostile arguments, this driver
keeps a pool of live objects (tensors, their numpy and DLPack views, layers, Sequentials with a
layer used twice, optimizers, losses) and applies a random sequence of operations to it: create,
forward, backward, zero_grad (set_to_none too), optimizer step, in-place writes between forward
and backward, close (objects, their parameters and grads, inputs still cached by a layer), copy,
deepcopy and pickle round trips, train/eval switches, DLPack export and import (numpy, utensil,
PyTorch when installed), two threads sharing a layer, a thread closing what another uses, and
fork/spawn children running ops. Sequence i draws from random.Random("SEED:i") alone, so
``--only i`` replays it.

Invariants checked, each violation recorded as a finding with the seed, sequence and op log:
- no crash or hang (the parent sees a signal or a timeout; a thread or child process that does
  not finish in time is reported here, then the process exits);
- every exception is a utensil_ffi.UtensilError with a message, MemoryError, or BufferError
  (DLPack's documented builtin), never a raw AttributeError/TypeError from inside the package;
- operations the model knows are valid succeed, and those it knows are invalid raise;
- values agree with a shadow model: each tensor's expected values after in-place writes (shared
  by its aliases: numpy views, DLPack imports), forward outputs, input gradients, accumulated
  parameter gradients, running statistics and optimizer steps against utensil_ffi/reference.py;
- live_tensors() is back at its baseline after each sequence, once everything is closed.

The last line of stdout is a JSON report: sequences, ops, findings.
"""

import copy
import gc
import json
import multiprocessing
import os
import pickle
import random
import resource
import signal
import sys
import threading
import time
import traceback

import numpy as np

try:
    import utensil_ffi as ut
except ImportError:  # run directly from a checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import utensil_ffi as ut
from utensil_ffi import functional as F
from utensil_ffi import reference as R

ALLOWED = (ut.UtensilError, MemoryError, BufferError)
JOIN_TIMEOUT = 60.0
OP_STATS = {}  # op name -> (count, seconds)

_TORCH = []


def _torch():
    """PyTorch when installed (imported on first use: it makes gc.collect and spawn slow)."""
    if not _TORCH:
        try:
            import torch
        except ImportError:  # optional
            torch = None
        _TORCH.append(torch)
    return _TORCH[0]


class Finding(Exception):
    """An invariant broken (raised by the checks, caught by the driver)."""

    def __init__(self, kind, message):
        super().__init__("%s: %s" % (kind, message))
        self.kind = kind


class Refused(Exception):
    """The library raised a documented exception; ``exc`` is it."""

    def __init__(self, exc):
        super().__init__(str(exc))
        self.exc = exc


def guarded(fn, *args, **kwargs):
    """fn(...): documented exceptions become Refused (checked to carry a message), anything
    else a Finding."""
    try:
        return fn(*args, **kwargs)
    except ALLOWED as e:
        if not str(e).strip():
            raise Finding("no-message", "%s raised with an empty message" % type(e).__name__)
        raise Refused(e) from None
    except Finding:
        raise
    except RecursionError as e:
        raise Finding("raw-exception", "RecursionError: %s" % e) from None
    except Exception as e:
        tb = "".join(traceback.format_exception(type(e), e, e.__traceback__)[-4:])
        raise Finding("raw-exception", "%s: %s\n%s" % (type(e).__name__, e, tb[-1500:])) from None


def close_enough(what, got, ref, rtol=2e-3, exact=False, any_for_nan=False):
    """got (float32) against ref: exactly, or within rtol of ref's largest finite magnitude; NaN
    (or an infinity) where ref has NaN, the same infinity where ref is infinite or beyond float32's range.
    any_for_nan: any value where ref is NaN (a padded convolution met a non-finite value: the
    float64 reference multiplies the padding zeros, utensil's exact path skips them as PyTorch's
    oneDNN convolutions do, and PyTorch's own paths differ there)."""
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if got.shape != ref.shape:
        raise Finding("wrong-answer", "%s: shape %s, expected %s" % (what, got.shape, ref.shape))
    with np.errstate(over="ignore", invalid="ignore"):
        ref = ref.astype(np.float32).astype(np.float64)  # beyond float32: inf
        if exact:
            ok = np.array_equal(got, ref, equal_nan=True)
        else:
            fin = np.isfinite(ref)
            scale = max(float(np.max(np.abs(ref[fin]))) if fin.any() else 0.0, 1.0)
            # where the reference is NaN an infinity may meet one of the other sign in another
            # order (inf weights through the exact convolution): +-inf is accepted there, as
            # tests/test_numerics_extremes.py accepts it against PyTorch; NaN only where ref has it
            nan_ok = np.isnan(ref) & (np.isnan(got) | np.isinf(got) | any_for_nan)
            ok = (np.array_equal(np.isnan(got) | nan_ok, np.isnan(ref))
                  and np.array_equal(got[np.isinf(ref)], ref[np.isinf(ref)])
                  and bool(np.all(np.abs(got[fin] - ref[fin]) <= rtol * scale)))
        err = float(np.nanmax(np.abs(got - ref))) if ref.size and not ok else 0.0
    if not ok:
        raise Finding("wrong-answer", "%s differs from the reference (max |diff| %.3g)\n got %s\n ref %s"
                      % (what, err, np.array2string(got.ravel()[:12], precision=5),
                         np.array2string(ref.ravel()[:12], precision=5)))


# -- the shadow model -----------------------------------------------------------------------------
class Box:
    """The expected values of one C tensor's memory (None: unknown), shared by its aliases.
    ``gen`` counts the writes made through the library (what a layer's version check sees)."""

    def __init__(self, values):
        self.v = None if values is None else np.array(values, dtype=np.float32, copy=True)
        self.gen = 0

    def write(self, values):
        self.v = None if values is None else np.array(values, dtype=np.float32, copy=True)
        self.gen += 1


class TRec:
    def __init__(self, t, box, what):
        self.t, self.box, self.what = t, box, what


class LRec:
    """A layer or a network: ``steps`` is the flat list of (layer, kind) it applies, in order
    (a Sequential's layers; a layer used twice appears twice)."""

    def __init__(self, obj, kind, cfg, steps=None):
        self.obj, self.kind, self.cfg = obj, kind, cfg
        self.steps = steps if steps is not None else [self]
        self.touch = 0  # ops on the layer since creation (invalidate a kept forward)
        self.last = None  # what a backward after the last forward must give


def _params_of(layer_rec):
    l = layer_rec.obj
    try:
        return list(l.parameters())
    except ALLOWED:
        return []


def ref_step_forward(rec, x):
    """Reference forward of one layer on float64 ``x`` with the layer's actual parameters:
    (y, ctx for ref_step_backward)."""
    k, c, l = rec.kind, rec.cfg, rec.obj
    if k in ("relu", "relu6"):
        return (R.relu(x) if k == "relu" else R.relu6(x)), ("act", k, x)
    if k == "pool":
        return R.global_avg_pool2d(x), ("pool", x.shape)
    w = l.weight.numpy().astype(np.float64)
    b = l.bias.numpy().astype(np.float64) if l.bias is not None else None
    if k == "lin":
        return R.linear(x, w, b), ("lin", x, w)
    if k == "conv":
        return R.conv2d(x, w, b, c["stride"], c["padding"]), ("conv", x, w)
    if k == "dw":
        return R.dwconv2d(x, w, b, c["stride"], c["padding"]), ("dw", x, w)
    if k == "ln":
        return R.layernorm(x, w, b, c["eps"]), ("ln", x, w)
    if k == "bn":
        if l.training:
            y, mean, var = R.batchnorm2d_train(x, w, b, c["eps"])
            return y, ("bn", x, w, mean, var)
        rm = l.running_mean.numpy().astype(np.float64)
        rv = l.running_var.numpy().astype(np.float64)
        return R.batchnorm2d_eval(x, w, b, rm, rv, c["eps"]), ("bne", x, w, rm, rv)
    raise AssertionError(k)


def ref_step_backward(rec, ctx, go):
    """(dx, [dW, db]) of one layer."""
    k, c = ctx[0], rec.cfg
    if k == "act":
        return (R.relu_backward(go, ctx[2]) if ctx[1] == "relu" else R.relu6_backward(go, ctx[2])), []
    if k == "pool":
        return R.global_avg_pool2d_backward(go, ctx[1][2], ctx[1][3]), []
    if k == "lin":
        dx, dw, db = R.linear_backward(ctx[1], ctx[2], go)
    elif k == "conv":
        dx, dw, db = R.conv2d_backward(ctx[1], ctx[2], c["stride"], c["padding"], go)
    elif k == "dw":
        dx, dw, db = R.dwconv2d_backward(ctx[1], ctx[2], c["stride"], c["padding"], go)
    elif k == "ln":
        dx, dw, db = R.layernorm_backward(ctx[1], ctx[2], c["eps"], go)
    elif k == "bn":
        dx, dw, db = R.batchnorm2d_backward(ctx[1], ctx[2], c["eps"], go)
    else:
        dx, dw, db = R.batchnorm2d_eval_backward(ctx[1], ctx[2], ctx[3], ctx[4], c["eps"], go)
    return dx, [dw, db]


# -- worker functions for child processes ---------------------------------------------------------
def _child_ops(results=None):
    """What a fork/spawn child runs: parallel ops, a layer forward and backward, checked."""
    a = np.random.default_rng(7).standard_normal((64, 48)).astype(np.float32)
    ok = True
    with ut.tensor(a) as ta:
        with ut.matmul(ta, ut.transpose(ta, 0, 1)) as m:
            ok &= np.allclose(m.numpy(), a.astype(np.float64) @ a.T, rtol=1e-3, atol=1e-3)
    l = ut.Linear(48, 5)
    x = ut.tensor(a)
    y = l(x)
    w = l.weight.numpy().astype(np.float64)
    ok &= np.allclose(y.numpy(), R.linear(a.astype(np.float64), w, l.bias.numpy()), rtol=1e-3,
                      atol=1e-3)
    dx = l.backward(ut.ones(y.shape))
    ok &= np.allclose(dx.numpy(), np.ones((64, 5)) @ w, rtol=1e-3, atol=1e-3)
    for t in (x, y, dx):
        t.close()
    l.close()
    if results is not None:
        results.put(bool(ok))
    return bool(ok)


# -- the driver -----------------------------------------------------------------------------------
class Driver:
    def __init__(self, seed, index, device, n_ops, allow_spawn):
        self.rng = random.Random("%d:%d" % (seed, index))
        self.np = np.random.default_rng(self.rng.getrandbits(32))
        self.dev = device
        self.cuda = device == "cuda"
        self.n_ops = n_ops
        self.allow_spawn = allow_spawn
        self.tensors = []  # TRec
        self.views = []  # (kind, array-like, box or None, snapshot)
        self.layers = []  # LRec
        self.opts = []  # [optimizer, kind, shadow state or None]
        self.log = []
        self.ops = 0
        self.spawned = 0
        ut.seed(self.rng.getrandbits(63))

    # -- helpers ----------------------------------------------------------------------------------
    def note(self, s):
        self.log.append(s)

    def pick(self, seq):
        return self.rng.choice(seq) if seq else None

    def data(self, shape, scale=1.0):
        return (self.np.standard_normal(shape) * scale).astype(np.float32)

    def add_tensor(self, t, values, what):
        rec = TRec(t, Box(values), what)
        self.tensors.append(rec)
        return rec

    def new_tensor(self, shape=None):
        if shape is None:
            shape = tuple(self.rng.randint(1, 4) for _ in range(self.rng.randint(1, 4)))
        a = self.data(shape)
        t = guarded(ut.tensor, a, self.dev)
        self.note("t%d = tensor(%s)" % (len(self.tensors), shape))
        return self.add_tensor(t, a, "tensor")

    def wrote(self, t, values):
        """A library call wrote ``t`` (values now unknown unless given)."""
        for r in self.tensors:
            if t is not None and r.t is t:
                r.box.write(values)

    def open_tensors(self):
        return [r for r in self.tensors if not r.t.closed]

    def check_tensor(self, rec, what):
        if rec.t.closed or rec.box.v is None:
            return
        got = guarded(rec.t.numpy)
        close_enough(what, got, rec.box.v, exact=True)

    def expect_refused(self, fn, what, *args):
        try:
            guarded(fn, *args)
        except Refused:
            return
        raise Finding("accepted-invalid", "%s was accepted" % what)

    def param_recs(self, lrec):
        """TRecs of a layer's parameters (registered once, with the values read back)."""
        out = []
        for p in _params_of(lrec):
            rec = next((r for r in self.tensors if r.t is p), None)
            if rec is None:
                rec = self.add_tensor(p, None if p.closed else p.numpy(), "param")
            out.append(rec)
        return out

    # -- creation -------------------------------------------------------------------------------
    def make_layer(self, kind=None):
        kind = kind or self.rng.choice(["lin", "conv", "dw", "ln", "bn", "relu", "relu6", "pool",
                                        "seq_twice", "seq_conv"])
        r = self.rng
        d = self.dev
        if kind == "lin":
            cfg = dict(i=r.randint(1, 6), o=r.randint(1, 5), bias=r.random() < 0.7)
            obj = ut.Linear(cfg["i"], cfg["o"], bias=cfg["bias"], device=d)
        elif kind == "conv":
            cfg = dict(c=r.randint(1, 3), o=r.randint(1, 3), k=(r.randint(1, 3), r.randint(1, 3)),
                       stride=r.randint(1, 3), padding=r.randint(0, 2), bias=r.random() < 0.7)
            obj = ut.Conv2d(cfg["c"], cfg["o"], cfg["k"], cfg["stride"], cfg["padding"],
                            bias=cfg["bias"], device=d)
        elif kind == "dw":
            cfg = dict(c=r.randint(1, 4), k=(r.randint(1, 3), r.randint(1, 3)),
                       stride=r.randint(1, 3), padding=r.randint(0, 2), bias=r.random() < 0.7)
            obj = ut.DWConv2d(cfg["c"], cfg["k"], cfg["stride"], cfg["padding"], bias=cfg["bias"],
                              device=d)
        elif kind == "ln":
            cfg = dict(d=r.randint(1, 6), eps=r.choice([1e-5, 1e-3]))
            obj = ut.LayerNorm(cfg["d"], eps=cfg["eps"], device=d)
        elif kind == "bn":
            cfg = dict(c=r.randint(1, 4), eps=r.choice([1e-5, 1e-3]), momentum=r.choice([0.1, 0.5]))
            obj = ut.BatchNorm2d(cfg["c"], eps=cfg["eps"], momentum=cfg["momentum"], device=d)
        elif kind in ("relu", "relu6", "pool"):
            cfg = {}
            obj = {"relu": ut.ReLU, "relu6": ut.ReLU6, "pool": ut.GlobalAvgPool2d}[kind]()
        elif kind == "seq_twice":
            n = r.randint(1, 5)
            lin = self.make_layer_rec("lin", dict(i=n, o=n, bias=r.random() < 0.7))
            act = self.make_layer_rec(r.choice(["relu", "relu6"]), {})
            steps = [lin, act, lin] + ([act, lin] if r.random() < 0.3 else [])
            obj = guarded(ut.Sequential, *[s.obj for s in steps])
            rec = LRec(obj, "seq", dict(first=steps[0]), steps)
            self.layers.append(rec)
            self.note("L%d = Sequential(%s) # shares L%d" % (len(self.layers) - 1,
                      ", ".join(s.kind for s in steps), self.layers.index(lin)))
            return rec
        elif kind == "seq_conv":
            c = r.randint(1, 3)
            o = r.randint(1, 3)
            parts = [self.make_layer_rec("conv", dict(c=c, o=o, k=(3, 3), stride=r.randint(1, 2),
                                                      padding=1, bias=False)),
                     self.make_layer_rec("bn", dict(c=o, eps=1e-3, momentum=0.1)),
                     self.make_layer_rec("relu6", {}),
                     self.make_layer_rec("dw", dict(c=o, k=(3, 3), stride=1, padding=1, bias=True)),
                     self.make_layer_rec("pool", {}),
                     self.make_layer_rec("lin", dict(i=o, o=r.randint(1, 4), bias=True))]
            obj = guarded(ut.Sequential, [p.obj for p in parts])
            rec = LRec(obj, "seq", dict(first=parts[0]), parts)
            self.layers.append(rec)
            self.note("L%d = Sequential(conv, bn, relu6, dw, pool, lin)" % (len(self.layers) - 1))
            return rec
        else:
            raise AssertionError(kind)
        rec = LRec(obj, kind, cfg)
        self.layers.append(rec)
        self.note("L%d = %r" % (len(self.layers) - 1, obj))
        return rec

    def make_layer_rec(self, kind, cfg):
        d = self.dev
        if kind == "lin":
            obj = guarded(ut.Linear, cfg["i"], cfg["o"], bias=cfg["bias"], device=d)
        elif kind == "conv":
            obj = guarded(ut.Conv2d, cfg["c"], cfg["o"], cfg["k"], cfg["stride"], cfg["padding"],
                          bias=cfg["bias"], device=d)
        elif kind == "dw":
            obj = guarded(ut.DWConv2d, cfg["c"], cfg["k"], cfg["stride"], cfg["padding"],
                          bias=cfg["bias"], device=d)
        elif kind == "bn":
            obj = guarded(ut.BatchNorm2d, cfg["c"], eps=cfg["eps"], momentum=cfg["momentum"], device=d)
        else:
            obj = {"relu": ut.ReLU, "relu6": ut.ReLU6, "pool": ut.GlobalAvgPool2d}[kind]()
        rec = LRec(obj, kind, cfg)
        self.layers.append(rec)
        return rec

    def input_shape(self, lrec):
        """A valid input shape for the layer or network."""
        r = self.rng
        first = lrec.cfg["first"] if lrec.kind == "seq" else lrec
        k, c = first.kind, first.cfg
        n = r.randint(1, 3)
        if k == "lin":
            return (n, c["i"])
        if k == "ln":
            return tuple(r.randint(1, 3) for _ in range(r.randint(1, 3))) + (c["d"],)
        if k in ("relu", "relu6"):
            return tuple(r.randint(1, 3) for _ in range(r.randint(1, 4)))
        if k == "pool":
            return (n, r.randint(1, 3), r.randint(1, 4), r.randint(1, 4))
        ch = c.get("c", 1)
        kh, kw = c.get("k", (1, 1))
        p = c.get("padding", 0)
        h = max(1, kh - 2 * p) + r.randint(0, 3)
        w = max(1, kw - 2 * p) + r.randint(0, 3)
        if k == "bn" or (lrec.kind == "seq" and any(s.kind == "bn" for s in lrec.steps)):
            n = max(n, 2)  # training batch statistics need two values per channel
        return (n, ch, h, w)

    def layers_of(self, lrec):
        """The distinct C layers a record applies."""
        out = []
        for s in lrec.steps:
            if s not in out:
                out.append(s)
        return out

    def touch(self, lrec):
        for s in self.layers_of(lrec):
            s.touch += 1
        for other in self.layers:  # networks containing it lose their kept forward too
            if other.kind == "seq" and any(s in lrec.steps for s in other.steps):
                other.touch += 1
        lrec.touch += 1

    def make_optimizer(self):
        lrec = self.pick([l for l in self.layers if _params_of(l)])
        if lrec is None:
            return
        kind = self.rng.choice(["sgd", "sgdm", "adam"])
        params = _params_of(lrec)
        lr = self.rng.choice([0.1, 0.01])
        if kind == "adam":
            opt = guarded(ut.Adam, params, lr=lr)
        else:
            opt = guarded(ut.SGD, params, lr=lr, momentum=0.9 if kind == "sgdm" else 0.0)
        self.param_recs(lrec)
        shadow = [[None, None, 0] for _ in opt.params]  # per parameter: velocity/m, v, Adam steps
        self.opts.append([opt, kind, shadow])
        self.note("O%d = %r over L%d" % (len(self.opts) - 1, opt, self.layers.index(lrec)))

    # -- operations -----------------------------------------------------------------------------
    def op_new_tensor(self):
        self.new_tensor()

    def op_inplace(self):
        rec = self.pick(self.tensors)
        if rec is None:
            return
        t, box = rec.t, rec.box
        kind = self.rng.choice(["fill_", "zero_", "mul_", "add_", "copy_from", "copy_from_t",
                                "F.add_", "F.scale_"])
        i = self.tensors.index(rec)
        if t.closed:
            self.note("t%d.%s() on a closed tensor" % (i, kind))
            self.expect_refused(lambda: t.fill_(1.0) if kind == "fill_" else t.mul_(2.0),
                                "%s on a closed tensor" % kind)
            return
        shape = t.shape
        old = box.v
        if kind == "fill_":
            v = self.rng.choice([0.5, -3.0, 1e30, float("inf"), float("-inf"), 7.0])
            guarded(t.fill_, v)
            new = np.full(shape, v, np.float32)
        elif kind == "zero_":
            guarded(t.zero_)
            new = np.zeros(shape, np.float32)
        elif kind in ("mul_", "F.scale_"):
            a = self.rng.choice([2.0, -0.5, 0.0, 1e-3])
            guarded(t.mul_, a) if kind == "mul_" else guarded(F.scale_, t, a)
            new = None if old is None else old * np.float32(a)
        elif kind in ("add_", "F.add_"):
            other = self.pick([r for r in self.open_tensors() if r.t.size == t.size
                               and r.t.device == t.device])
            if other is None:
                return
            ov = other.box.v
            self.note("t%d.%s(t%d)" % (i, kind, self.tensors.index(other)))
            guarded(t.add_, other.t) if kind == "add_" else guarded(F.add_, t, other.t)
            new = None if old is None or ov is None else (
                old.reshape(-1) + ov.reshape(-1)).reshape(shape)
            box.write(new)
            self.check_tensor(rec, "t%d after %s" % (i, kind))
            return
        elif kind == "copy_from":
            a = self.data(shape)
            guarded(t.copy_from, a)
            new = a
        else:
            other = self.pick([r for r in self.open_tensors() if r.t.shape == shape])
            if other is None or other is rec:
                return
            self.note("t%d.copy_from(t%d)" % (i, self.tensors.index(other)))
            guarded(t.copy_from, other.t)
            new = other.box.v
            box.write(new)
            self.check_tensor(rec, "t%d after copy_from(tensor)" % i)
            return
        self.note("t%d.%s" % (i, kind))
        box.write(new)
        self.check_tensor(rec, "t%d after %s" % (i, kind))

    def op_functional(self):
        """A functional op on pool tensors; shapes that fit must work and match the reference,
        shapes that do not must raise."""
        recs = self.open_tensors()
        if not recs:
            return
        a = self.pick(recs)
        if a.box.v is None:
            return
        x = a.box.v.astype(np.float64)
        name = self.rng.choice(["relu", "relu6", "matmul", "transpose", "reshape", "gap",
                                "gap_bwd", "relu_bwd", "mse", "ce"])
        self.note("%s(t%d %s)" % (name, self.tensors.index(a), a.t.shape))
        out = None
        if name in ("relu", "relu6"):
            out = guarded(getattr(ut, name), a.t)
            ref = getattr(R, name)(x)
        elif name == "relu_bwd":
            b = self.pick([r for r in recs if r.t.shape == a.t.shape and r.box.v is not None])
            out = guarded(ut.relu_backward, b.t, a.t)
            ref = R.relu_backward(b.box.v.astype(np.float64), x)
        elif name == "matmul":
            b = self.pick(recs)
            if b.box.v is None:
                return
            ok = a.t.ndim == 2 and b.t.ndim == 2 and a.t.shape[1] == b.t.shape[0]
            if not ok:
                return self.expect_refused(ut.matmul, "matmul %s @ %s" % (a.t.shape, b.t.shape),
                                           a.t, b.t)
            out = guarded(ut.matmul, a.t, b.t)
            ref = R.matmul(x, b.box.v.astype(np.float64))
        elif name == "transpose":
            d0 = self.rng.randint(-a.t.ndim - 1, a.t.ndim)
            d1 = self.rng.randint(-a.t.ndim, a.t.ndim - 1)
            if not -a.t.ndim <= d0 < a.t.ndim:
                return self.expect_refused(ut.transpose, "transpose dim %d" % d0, a.t, d0, d1)
            out = guarded(ut.transpose, a.t, d0, d1)
            ref = R.transpose(x, d0, d1)
        elif name == "reshape":
            shape = (a.t.size,) if self.rng.random() < 0.7 else (a.t.size + 1,)
            if shape[0] != a.t.size:
                return self.expect_refused(a.t.reshape, "reshape to %s" % (shape,), shape)
            out = guarded(a.t.reshape, shape)
            ref = x.reshape(shape)
        elif name == "gap":
            if a.t.ndim != 4:
                return self.expect_refused(ut.global_avg_pool2d, "gap of %s" % (a.t.shape,), a.t)
            out = guarded(ut.global_avg_pool2d, a.t)
            ref = R.global_avg_pool2d(x)
        elif name == "gap_bwd":
            if a.t.ndim != 2:
                return self.expect_refused(ut.global_avg_pool2d_backward, "gap_bwd", a.t, 2, 3)
            h, w = self.rng.randint(1, 3), self.rng.randint(1, 3)
            out = guarded(ut.global_avg_pool2d_backward, a.t, h, w)
            ref = R.global_avg_pool2d_backward(x, h, w)
        elif name == "mse":
            b = self.pick([r for r in recs if r.box.v is not None])
            if b.t.shape != a.t.shape:
                return self.expect_refused(ut.mse_loss, "mse of two shapes", a.t, b.t)
            crit = ut.MSELoss()
            out = guarded(crit, a.t, b.t)
            y = b.box.v.astype(np.float64)
            close_enough("mse", out.numpy(), R.mse_loss(x, y))
            out.close()
            out = guarded(crit.backward)
            ref = R.mse_loss_backward(x, y)
            crit.close()
        else:
            if a.t.ndim != 2 or not np.isfinite(x).all():
                return
            labels = self.np.integers(0, a.t.shape[1], a.t.shape[0])
            crit = ut.CrossEntropyLoss()
            out = guarded(crit, a.t, labels)
            close_enough("cross_entropy", out.numpy(), R.cross_entropy(x, labels))
            out.close()
            if self.rng.random() < 0.5:
                crit2 = copy.deepcopy(crit)
                self.expect_refused(crit2.backward, "backward of a copied loss")
            out = guarded(crit.backward)
            ref = R.cross_entropy_backward(x, labels)
            crit.close()
        if not np.isfinite(ref).all():
            self.add_tensor(out, None, name)
            return
        rec = self.add_tensor(out, out.numpy(), name)
        close_enough(name, rec.box.v, ref)

    def op_view(self):
        rec = self.pick(self.open_tensors())
        if rec is None:
            return
        i = self.tensors.index(rec)
        how = self.rng.choice(["numpy", "array", "np.from_dlpack", "ut.from_dlpack",
                               "ut.from_dlpack(np)", "ut.from_dlpack(copy)", "torch", "capsule"])
        self.note("view %s of t%d" % (how, i))
        t = rec.t
        if how == "numpy":
            v = guarded(t.numpy)
            self.views.append(("view", v, rec.box if not self.cuda else None, v.copy()))
        elif how == "array":
            v = guarded(np.asarray, t)
            self.views.append(("view", v, rec.box if not self.cuda else None, v.copy()))
        elif how == "np.from_dlpack":
            if self.cuda:
                return
            v = guarded(np.from_dlpack, t)
            self.views.append(("view", v, rec.box, v.copy()))
        elif how == "ut.from_dlpack":
            u = guarded(ut.from_dlpack, t)
            self.tensors.append(TRec(u, rec.box, "alias"))
        elif how == "ut.from_dlpack(copy)":
            u = guarded(ut.from_dlpack, t, copy=True)
            self.add_tensor(u, rec.box.v, "dlpack copy")
        elif how == "ut.from_dlpack(np)":
            if self.cuda:
                return
            a = self.data(t.shape)
            u = guarded(ut.from_dlpack, a)
            box = Box(a)
            self.tensors.append(TRec(u, box, "from numpy"))
            self.views.append(("view", a, box, a.copy()))
        elif how == "capsule":
            cap = guarded(t.__dlpack__, max_version=self.rng.choice([None, (1, 0)]))
            del cap  # never consumed: its destructor must drop the reference
        else:
            torch = _torch() if self.rng.random() < 0.3 or _TORCH else None
            if torch is None or (self.cuda and not torch.cuda.is_available()):
                return
            tt = guarded(torch.from_dlpack, t)
            back = guarded(ut.from_dlpack, tt)
            self.tensors.append(TRec(back, rec.box, "via torch"))
            self.views.append(("torch", tt, rec.box, None))
        for r in (rec,):
            self.check_tensor(r, "t%d after a %s view" % (i, how))

    def check_views(self):
        for kind, v, box, snap in self.views:
            got = v.detach().cpu().numpy() if kind == "torch" else np.asarray(v)
            if box is not None and box.v is not None:
                close_enough("a kept %s view" % kind, got, box.v, exact=True)

    def op_close_tensor(self):
        rec = self.pick(self.tensors)
        if rec is None:
            return
        self.note("t%d.close()%s" % (self.tensors.index(rec), " (a %s)" % rec.what))
        guarded(rec.t.close)
        guarded(rec.t.close)  # idempotent
        if rec.what == "param":
            g = getattr(rec.t, "grad", None)
            assert g is None or g.closed

    def op_copy_tensor(self):
        rec = self.pick(self.tensors)
        if rec is None:
            return
        how = self.rng.choice(["copy", "deepcopy", "pickle", "clone"])
        self.note("%s(t%d)" % (how, self.tensors.index(rec)))
        fn = {"copy": copy.copy, "deepcopy": copy.deepcopy, "clone": lambda t: t.clone(),
              "pickle": lambda t: pickle.loads(pickle.dumps(t))}[how]
        if rec.t.closed:
            return self.expect_refused(fn, "%s of a closed tensor" % how, rec.t)
        c = guarded(fn, rec.t)
        if isinstance(rec.t, ut.Parameter) and how != "clone":
            g = rec.t.grad
            if (c.grad is None) != (g is None):
                raise Finding("wrong-answer", "%s of a Parameter changed whether grad is None" % how)
            if g is not None and not g.closed:
                close_enough("copied grad", c.grad.numpy(), g.numpy(), exact=True)
            if c.grad is not None:
                self.add_tensor(c.grad, c.grad.numpy(), "copied grad")
        new = self.add_tensor(c, rec.box.v, "copy")
        self.check_tensor(new, "%s of t%d" % (how, self.tensors.index(rec)))
        if c.device != rec.t.device:
            raise Finding("wrong-answer", "%s moved the tensor to %s" % (how, c.device))

    def forward_ref(self, lrec, x):
        """Reference forward of a layer or network on float64 x: (y, ctxs) or None when not
        computable (a closed parameter)."""
        ctxs = []
        cur = x
        for s in lrec.steps:
            if s.kind not in ("relu", "relu6", "pool"):
                ps = _params_of(s)
                if not ps or any(p.closed for p in ps):
                    return None
            else:
                ps = []
            if (s.kind == "dw" and self.dev == "cuda"
                    and not np.isfinite(s.obj.weight.numpy()).all()):
                # a known CUDA bug, a strict xfail there
                # (test_depthwise_forward_padding_rows_propagate_a_nonfinite_weight)
                return None
            if s.kind in ("bn", "ln") and not all(np.isfinite(p.numpy()).all() for p in ps):
                return None  # inf gamma: PyTorch's formulas give inf where float64's give NaN
            if s.kind in ("bn", "ln") and not (np.abs(cur) < 1e15).all():
                return None  # float32 statistics overflow there, as PyTorch's: not compared
            y, ctx = ref_step_forward(s, cur)
            ctxs.append(ctx)
            cur = y
        return cur, ctxs

    def op_forward(self):
        lrec = self.pick(self.layers)
        if lrec is None:
            return
        li = self.layers.index(lrec)
        use_array = self.rng.random() < 0.15
        xrec = None
        if not use_array:
            shape = self.input_shape(lrec)
            xrec = self.pick([r for r in self.open_tensors() if r.t.shape == shape
                              and r.box.v is not None and r.t.device == self.dev])
            if xrec is None or self.rng.random() < 0.5:
                xrec = self.new_tensor(shape)
            x_in = xrec.t
            xv = xrec.box.v
        else:
            xv = self.data(self.input_shape(lrec))
            x_in = xv
        self.note("y = L%d(%s)" % (li, "array" if use_array else "t%d" % self.tensors.index(xrec)))
        closed = any(getattr(s.obj, "closed", False) for s in lrec.steps)
        elsewhere = any(not getattr(s.obj, "closed", False) and getattr(s.obj, "device", None)
                        not in (None, self.dev) for s in lrec.steps)  # moved by to()
        before = {}
        for s in self.layers_of(lrec):
            if s.kind == "bn" and not s.obj.closed and s.obj.training:
                before[s] = (s.obj.running_mean.numpy().astype(np.float64),
                             s.obj.running_var.numpy().astype(np.float64))
        ref = None if closed or elsewhere else self.forward_ref(lrec, xv.astype(np.float64))
        self.touch(lrec)
        if closed:
            return self.expect_refused(lrec.obj, "forward of a closed layer", x_in)
        try:
            y = guarded(lrec.obj, x_in)
        except Refused as e:
            if ref is not None and not any(s.kind == "bn" and not s.obj.training and False
                                           for s in lrec.steps):
                # every layer open with open parameters and a valid input: must work
                raise Finding("refused-valid", "forward refused: %r" % e.exc) from None
            return
        if ref is None:
            self.add_tensor(y, None, "output")
            return
        yv = guarded(y.numpy)
        close_enough("L%d forward" % li, yv, ref[0], any_for_nan=self.padded_conv(lrec))
        for s, (rm, rv) in before.items():
            n, _, h, w = xv.shape if lrec.kind != "seq" else (None, None, None, None)
            if lrec.kind != "seq":
                mean = xv.astype(np.float64).mean(axis=(0, 2, 3))
                var = xv.astype(np.float64).var(axis=(0, 2, 3))
                em, ev = R.batchnorm2d_running_stats(rm, rv, mean, var, n * h * w, s.cfg["momentum"])
                close_enough("running_mean", s.obj.running_mean.numpy(), em)
                close_enough("running_var", s.obj.running_var.numpy(), ev)
        self.add_tensor(y, yv, "output")
        keeps = all(s.obj.training or s.kind == "bn" for s in lrec.steps)
        if keeps:
            # a stateless layer runs where its input is (an array: on the CPU), and its
            # backward takes a gradient on that device only
            lrec.last = dict(ctxs=ref[1], out_shape=yv.shape, touch=lrec.touch, dev=y.device,
                             touches=[s.touch for s in self.layers_of(lrec)],
                             xbox=(xrec.box, xrec.box.gen) if xrec is not None else None,
                             pboxes=[(r.box, r.box.gen) for s in self.layers_of(lrec)
                                     for r in self.param_recs(s)],
                             modes=[s.obj.training for s in lrec.steps])
        else:
            lrec.last = None

    @staticmethod
    def padded_conv(lrec):
        return any(s.kind in ("conv", "dw") and s.cfg["padding"] for s in lrec.steps)

    def op_backward(self):
        lrec = self.pick(self.layers)
        if lrec is None:
            return
        li = self.layers.index(lrec)
        last = lrec.last
        ok = (last is not None and last["touch"] == lrec.touch and last["dev"] == self.dev
              and last["touches"] == [s.touch for s in self.layers_of(lrec)]
              and (last["xbox"] is None or last["xbox"][0].gen == last["xbox"][1])
              and all(b.gen == g for b, g in last["pboxes"])
              and not any(getattr(s.obj, "closed", False) for s in lrec.steps)
              and all(not p.closed and (p.grad is None or not p.grad.closed)
                      for s in self.layers_of(lrec) for p in _params_of(s)))
        shape = last["out_shape"] if last is not None else self.input_shape(lrec)
        bad_shape = self.rng.random() < 0.1
        if bad_shape:
            shape = tuple(shape) + (1,)
        go = self.data(shape)
        self.note("L%d.backward(%s)%s" % (li, shape, " # predicted ok" if ok else ""))
        grads_before = {}
        for s in self.layers_of(lrec):
            for p in _params_of(s):
                if not p.closed:
                    grads_before[id(p)] = (np.zeros(p.shape) if p.grad is None or p.grad.closed
                                           else p.grad.numpy().astype(np.float64))
        gt = guarded(ut.tensor, go, self.dev)
        for s in self.layers_of(lrec):
            for p in _params_of(s):
                self.wrote(p.grad, None)
        try:
            dx = guarded(lrec.obj.backward, gt)
        except Refused as e:
            if ok and not bad_shape:
                raise Finding("refused-valid", "backward refused: %r" % e.exc) from None
            return
        finally:
            gt.close()
            # the walk over kept forwards moved: networks sharing these layers lose theirs
            self.touch(lrec)
            if ok and lrec.last is not None:
                lrec.last.update(touch=lrec.touch,
                                 touches=[s.touch for s in self.layers_of(lrec)])
        if bad_shape:
            raise Finding("accepted-invalid", "backward accepted grad_out of shape %s" % (shape,))
        if not ok:
            self.add_tensor(dx, None, "dx")
            return
        # the reference backward through the kept contexts, accumulating per layer
        g = go.astype(np.float64)
        dparams = {}
        for s, ctx in zip(reversed(lrec.steps), reversed(last["ctxs"])):
            g, dps = ref_step_backward(s, ctx, g)
            for p, dp in zip(_params_of(s), dps):
                dparams[id(p)] = dparams.get(id(p), 0) + dp
        dxv = guarded(dx.numpy)
        padded = self.padded_conv(lrec)
        close_enough("L%d backward dx" % li, dxv, g, any_for_nan=padded)
        self.add_tensor(dx, dxv, "dx")
        for s in self.layers_of(lrec):
            for p in _params_of(s):
                exp = grads_before[id(p)] + dparams.get(id(p), 0)
                close_enough("L%d grad of %s" % (li, p.name), p.grad.numpy(), exp,
                             any_for_nan=padded)

    def op_zero_grad(self):
        target = self.rng.choice(["layer", "opt"])
        none = self.rng.random() < 0.5
        if target == "opt" and self.opts:
            o = self.pick(self.opts)
            self.note("O%d.zero_grad(set_to_none=%s)" % (self.opts.index(o), none))
            params = o[0].params
            try:
                guarded(o[0].zero_grad, set_to_none=none)
            except Refused:  # a closed grad: those before it were zeroed
                for p in params:
                    self.wrote(p.grad, None)
                return
        else:
            lrec = self.pick(self.layers)
            if lrec is None:
                return
            self.note("L%d.zero_grad(set_to_none=%s)" % (self.layers.index(lrec), none))
            params = [p for s in self.layers_of(lrec) for p in _params_of(s)]
            try:
                guarded(lrec.obj.zero_grad, set_to_none=none)
            except Refused:
                for p in params:
                    self.wrote(p.grad, None)
                return
        for p in params:
            self.wrote(p.grad, None)
        for p in params:
            if p.grad is not None and not p.grad.closed and not p.closed:
                if none:
                    raise Finding("wrong-answer", "zero_grad(set_to_none=True) left a grad")
                close_enough("zeroed grad", p.grad.numpy(), np.zeros(p.shape), exact=True)

    def op_step(self):
        o = self.pick(self.opts)
        if o is None:
            return
        opt, kind, shadow = o
        oi = self.opts.index(o)
        # a parameter whose grad is None is skipped, even a closed one (as in PyTorch)
        usable = not opt._closed and all(
            p.grad is None or (isinstance(p.grad, ut.Tensor) and not p.closed and not p.grad.closed
                               and p.grad.shape == p.shape) for p in opt.params)
        kept = [(p, p.numpy().copy()) for p in opt.params if not p.closed]
        t0 = opt.t
        before = []
        for p in opt.params:
            if usable and p.grad is None:
                before.append((None, None))
            elif usable:
                before.append((p.numpy().astype(np.float64),
                               None if p.grad is None else p.grad.numpy().astype(np.float64)))
        self.note("O%d.step()%s" % (oi, " # predicted ok" if usable else ""))
        try:
            guarded(opt.step)
        except Refused as e:
            if usable:
                raise Finding("refused-valid", "step refused: %r" % e.exc) from None
            for p, v in kept:  # a refused step changes nothing
                close_enough("a parameter after a refused step (%r)" % e.exc, p.numpy(), v,
                             exact=True)
            if opt.t != t0:
                raise Finding("wrong-answer", "a refused step advanced the step count")
            return
        if not usable:
            raise Finding("accepted-invalid", "step of a closed optimizer or parameter")
        for p in opt.params:  # the step wrote the parameters (layers' version checks see it)
            rec = next((r for r in self.tensors if r.t is p), None)
            if rec is not None:
                rec.box.write(None)
        for i, (p, (pv, gv)) in enumerate(zip(opt.params, before)):
            st = shadow[i]
            if gv is None or st is None:
                continue  # skipped (no gradient yet), or state unknown
            if kind == "sgd":
                exp, _ = R.sgd_step(pv, gv, None, opt.lr, 0.0)
            elif kind == "sgdm":
                v0 = st[0] if st[0] is not None else np.zeros_like(pv)
                exp, st[0] = R.sgd_step(pv, gv, v0, opt.lr, opt.momentum)
            else:
                m0 = st[0] if st[0] is not None else np.zeros_like(pv)
                v0 = st[1] if st[1] is not None else np.zeros_like(pv)
                st[2] += 1
                exp, st[0], st[1] = R.adam_step(pv, gv, m0, v0, st[2], opt.lr, opt.betas[0],
                                                opt.betas[1], opt.eps)
            got = p.numpy()
            close_enough("O%d step of param %d (before %s, grad %s)" % (oi, i, pv.ravel()[:4], gv.ravel()[:4]), got, exp)
        for p in opt.params:
            rec = next((r for r in self.tensors if r.t is p), None)
            if rec is not None and not p.closed:
                rec.box.v = p.numpy().copy()

    def op_set_grad(self):
        """p.grad = something else: a Tensor of another shape, an array, a list, a number."""
        lrec = self.pick([l for l in self.layers if _params_of(l)])
        if lrec is None:
            return
        p = self.pick(_params_of(lrec))
        if p.closed:
            return
        kind = self.rng.choice(["tensor", "none", "wrong-shape", "array", "list", "int"])
        self.note("L%d %s.grad = <%s>" % (self.layers.index(lrec), p.name, kind))
        self.param_recs(lrec)
        if kind == "tensor":
            g = self.new_tensor(p.shape).t
        elif kind == "none":
            g = None
        elif kind == "wrong-shape":
            g = self.new_tensor(tuple(p.shape) + (2,)).t
        elif kind == "array":
            g = np.zeros(p.shape, np.float32)
        elif kind == "list":
            g = np.zeros(p.shape).tolist()
        else:
            g = 0
        if kind in ("tensor", "none"):
            guarded(setattr, p, "grad", g)
        else:  # refused at assignment, the grad left as it was
            before = p.grad
            self.expect_refused(setattr, "p.grad = <%s>" % kind, p, "grad", g)
            if p.grad is not before:
                raise Finding("wrong-answer", "a refused grad assignment changed p.grad")

    def op_train_eval(self):
        lrec = self.pick(self.layers)
        if lrec is None:
            return
        mode = self.rng.random() < 0.5
        self.note("L%d.train(%s)" % (self.layers.index(lrec), mode))
        self.touch(lrec)
        try:
            guarded(lrec.obj.train, mode)
        except Refused:
            return
        for s in self.layers_of(lrec):
            if not getattr(s.obj, "closed", False) and s.obj.training != mode:
                raise Finding("wrong-answer", "train(%s) left a layer with training=%s"
                              % (mode, s.obj.training))

    def op_close_layer(self):
        lrec = self.pick(self.layers)
        if lrec is None:
            return
        what = self.rng.choice(["layer", "layer", "param", "grad"])
        li = self.layers.index(lrec)
        self.touch(lrec)
        if what == "layer":
            self.note("L%d.close()" % li)
            guarded(lrec.obj.close)
            guarded(lrec.obj.close)
            for s in self.layers_of(lrec):
                for p in getattr(s.obj, "_weight", None), getattr(s.obj, "_bias", None):
                    if p is not None and not p.closed:
                        raise Finding("wrong-answer", "a closed layer's parameter is open")
            return
        ps = _params_of(lrec)
        if not ps:
            return
        p = self.pick(ps)
        self.note("L%d %s.%s close()" % (li, p.name, what))
        self.param_recs(lrec)
        if what == "param":
            guarded(p.close)
        elif p.grad is not None:
            guarded(p.grad.close)

    def op_copy_layer(self):
        lrec = self.pick(self.layers)
        if lrec is None:
            return
        how = self.rng.choice(["copy", "deepcopy", "pickle", "pickle_with_opt"])
        li = self.layers.index(lrec)
        self.note("%s(L%d)" % (how, li))
        closed = any(getattr(s.obj, "closed", False) for s in lrec.steps)
        opt = None
        if how == "pickle_with_opt":
            mine = [p for s in self.layers_of(lrec) for p in _params_of(s)]
            o = self.pick([o for o in self.opts if o[0].params
                           and all(any(q is p for p in mine) for q in o[0].params)])
            if o is None:
                how = "pickle"
            else:
                opt = o[0]
        fn = {"copy": copy.copy, "deepcopy": copy.deepcopy,
              "pickle": lambda l: pickle.loads(pickle.dumps(l)),
              "pickle_with_opt": lambda l: pickle.loads(pickle.dumps((l, opt)))}[how]
        closed_param = any(p.closed or (p.grad is not None and p.grad.closed)
                           for s in self.layers_of(lrec) for p in _params_of(s))
        if closed:
            return self.expect_refused(fn, "%s of a closed layer" % how, lrec.obj)
        try:
            c = guarded(fn, lrec.obj)
        except Refused as e:
            if not closed_param and (opt is None or not opt._closed):
                raise Finding("refused-valid", "%s of an open layer refused: %r" % (how, e.exc)) from None
            return
        copt = None
        if how == "pickle_with_opt":
            c, copt = c
        # the copy: same structure (a shared layer stays shared), same values, own memory
        if lrec.kind == "seq":
            uniq = {}
            steps = []
            for s, cs in zip(lrec.steps, c.layers):
                if s.obj is not lrec.steps[lrec.steps.index(s)].obj:
                    pass
                key = id(s)
                if key in uniq and uniq[key].obj is not cs:
                    raise Finding("wrong-answer", "%s split a layer used twice" % how)
                if key not in uniq:
                    uniq[key] = LRec(cs, s.kind, s.cfg)
                    self.layers.append(uniq[key])
                steps.append(uniq[key])
            new = LRec(c, "seq", dict(first=steps[0]), steps)
            pairs = [(s, uniq[id(s)]) for s in self.layers_of(lrec)]
        else:
            new = LRec(c, lrec.kind, lrec.cfg)
            pairs = [(lrec, new)]
        self.layers.append(new)
        for s, cs in pairs:
            if s.obj.training != cs.obj.training:
                raise Finding("wrong-answer", "%s changed the train/eval mode" % how)
            for p, cp in zip(_params_of(s), _params_of(cs)):
                if p is cp or cp.ptr == p.ptr:
                    raise Finding("wrong-answer", "%s shares a parameter" % how)
                close_enough("%s of a parameter" % how, cp.numpy(), p.numpy(), exact=True)
                if p.grad is not None and cp.grad is not None and not p.grad.closed:
                    close_enough("%s of a grad" % how, cp.grad.numpy(), p.grad.numpy(), exact=True)
            if s.kind == "bn":
                close_enough("%s running_var" % how, cs.obj.running_var.numpy(),
                             s.obj.running_var.numpy(), exact=True)
        if copt is not None:
            cparams = [p for _, cs in pairs for p in _params_of(cs)]
            if not all(any(q is p for p in cparams) for q in copt.params):
                raise Finding("wrong-answer", "pickled (model, opt): opt not bound to the copy")
            self.opts.append([copt, "copy", [None] * len(copt.params)])

    def op_copy_opt(self):
        o = self.pick(self.opts)
        if o is None:
            return
        how = self.rng.choice(["copy", "deepcopy", "state_dict"])
        self.note("%s(O%d)" % (how, self.opts.index(o)))
        opt = o[0]
        if opt._closed:
            fn = {"copy": copy.copy, "deepcopy": copy.deepcopy,
                  "state_dict": lambda x: x.state_dict()}[how]
            return self.expect_refused(fn, "%s of a closed optimizer" % how, opt)
        try:
            if how == "state_dict":
                sd = guarded(opt.state_dict)
                guarded(opt.load_state_dict, sd)
                return
            c = guarded(copy.copy if how == "copy" else copy.deepcopy, opt)
        except Refused as e:
            if any(p.closed or (p.grad is not None and p.grad.closed) for p in opt.params):
                return
            raise Finding("refused-valid", "%s of an open optimizer: %r" % (how, e.exc)) from None
        if how == "deepcopy":
            for p in c.params:  # standalone copies of the parameters: registered for closing
                self.add_tensor(p, p.numpy(), "opt copy param")
                if p.grad is not None:
                    self.add_tensor(p.grad, p.grad.numpy(), "opt copy grad")
        self.opts.append([c, "copy", [None] * len(c.params)])

    def op_close_opt(self):
        o = self.pick(self.opts)
        if o is None:
            return
        self.note("O%d.close()" % self.opts.index(o))
        guarded(o[0].close)
        o[2] = [None] * len(o[0].params)

    def op_to(self):
        lrec = self.pick(self.layers)
        if lrec is None:
            return
        dev = self.rng.choice(ut.devices())
        self.note("L%d.to(%r)" % (self.layers.index(lrec), dev))
        self.touch(lrec)
        try:
            guarded(lrec.obj.to, dev)
        except Refused:
            return

    # -- threads --------------------------------------------------------------------------------
    def run_threads(self, fns, what):
        errors = []

        def body(fn):
            try:
                fn()
            except Refused:
                pass
            except Finding as e:
                errors.append(e)
            except BaseException as e:  # noqa: BLE001 - reported
                errors.append(Finding("raw-exception", "in a thread: %s: %s\n%s" % (
                    type(e).__name__, e, traceback.format_exc()[-1500:])))

        ts = [threading.Thread(target=body, args=(f,), daemon=True) for f in fns]
        for t in ts:
            t.start()
        deadline = time.monotonic() + JOIN_TIMEOUT
        for t in ts:
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                raise Finding("hang", "%s: a thread did not finish in %gs" % (what, JOIN_TIMEOUT))
        if errors:
            raise errors[0]

    def op_threads_share(self):
        """Two threads run forward (and backward in training mode) on one layer at once; eval
        outputs must equal the reference, and both gradients must land in p.grad."""
        lrec = self.pick([l for l in self.layers if not any(
            getattr(s.obj, "closed", False) for s in l.steps)])
        if lrec is None:
            return
        li = self.layers.index(lrec)
        shapes = [self.input_shape(lrec) for _ in range(2)]
        xs = [self.data(s) for s in shapes]
        training = lrec.obj.training if lrec.kind != "seq" else all(s.obj.training for s in lrec.steps)
        self.note("threads share L%d (training=%s)" % (li, training))
        if any(s.kind == "bn" for s in lrec.steps):
            lrec.touch += 1  # running statistics move: the kept forward's eval stats may not hold
        refs = [self.forward_ref(lrec, x.astype(np.float64)) for x in xs] \
            if not any(s.kind == "bn" and s.obj.training for s in lrec.steps) else [None, None]
        outs = [None, None]

        def work(k):
            x = guarded(ut.tensor, xs[k], self.dev)
            try:
                y = guarded(lrec.obj, x)
                try:
                    if refs[k] is not None:
                        close_enough("threaded forward", y.numpy(), refs[k][0])
                    outs[k] = y.shape
                    if training:
                        g = guarded(ut.ones, y.shape, self.dev)
                        try:
                            guarded(lrec.obj.backward, g).close()
                        finally:
                            g.close()
                finally:
                    y.close()
            finally:
                x.close()

        for s in self.layers_of(lrec):
            for p in _params_of(s):
                self.wrote(p.grad, None)  # both backwards accumulate (not shadowed)
        self.run_threads([lambda: work(0), lambda: work(1)], "two threads sharing a layer")

    def op_thread_closes(self):
        """A thread closes a layer (or the input tensor) while the main thread runs it."""
        lrec = self.pick(self.layers)
        if lrec is None:
            return
        li = self.layers.index(lrec)
        x = self.new_tensor(self.input_shape(lrec))
        victim = self.rng.choice(["layer", "input", "param"])
        self.note("a thread closes the %s of L%d during forwards" % (victim, li))
        self.touch(lrec)
        started = threading.Event()

        def closer():
            started.wait(5)
            time.sleep(self.rng.random() * 0.002)
            if victim == "layer":
                guarded(lrec.obj.close)
            elif victim == "input":
                guarded(x.t.close)
            else:
                ps = _params_of(lrec)
                if ps:
                    self.param_recs(lrec)
                    guarded(ps[0].close)

        def user():
            for i in range(20):
                if i == 1:
                    started.set()
                try:
                    y = guarded(lrec.obj, x.t)
                    y.close()
                except Refused:
                    pass
            started.set()

        self.run_threads([closer, user], "a thread closing a layer in use")

    # -- processes ------------------------------------------------------------------------------
    def op_fork(self):
        if not hasattr(os, "fork"):
            return
        lrec = self.pick([l for l in self.layers if not any(getattr(s.obj, "closed", False)
                                                           for s in l.steps)])
        self.note("fork, child runs ops%s" % ("" if lrec is None else " and L%d"
                                               % self.layers.index(lrec)))
        here = lrec is not None and all(getattr(s.obj, "device", None) in (None, self.dev)
                                        for s in lrec.steps)  # not moved to the GPU by to()
        shape = self.input_shape(lrec) if here and not self.cuda else None
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: never returns into the driver
            code = 1
            try:
                signal.alarm(60)
                ok = _child_ops()
                if shape is not None:
                    x = ut.tensor(np.ones(shape, np.float32))
                    lrec.obj(x).close()
                code = 0 if ok else 2
            except BaseException:  # noqa: BLE001 - the exit code says it
                traceback.print_exc()
            os._exit(code)
        deadline = time.monotonic() + JOIN_TIMEOUT
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise Finding("hang", "a forked child did not finish in %gs" % JOIN_TIMEOUT)
            time.sleep(0.005)
        if os.WIFSIGNALED(status):
            raise Finding("crash", "a forked child died of signal %d" % os.WTERMSIG(status))
        if os.WEXITSTATUS(status) != 0:
            raise Finding("fork-child", "a forked child failed (exit %d)" % os.WEXITSTATUS(status))

    def op_spawn(self):
        if not self.allow_spawn or self.spawned >= 1:
            return
        self.spawned += 1
        self.note("spawn a child running ops")
        ctx = multiprocessing.get_context("spawn")
        q = ctx.Queue()
        p = ctx.Process(target=_child_ops, args=(q,), daemon=True)
        p.start()
        p.join(JOIN_TIMEOUT)
        if p.is_alive():
            p.kill()
            p.join()
            raise Finding("hang", "a spawned child did not finish in %gs" % JOIN_TIMEOUT)
        if p.exitcode != 0:
            raise Finding("crash", "a spawned child exited with %s" % p.exitcode)
        if not q.get(timeout=5):
            raise Finding("wrong-answer", "a spawned child computed wrong values")

    # -- the sequence ---------------------------------------------------------------------------
    OPS = [("op_new_tensor", 4), ("op_inplace", 8), ("op_functional", 6), ("op_view", 4),
           ("op_close_tensor", 3), ("op_copy_tensor", 3), ("make_layer", 5), ("op_forward", 14),
           ("op_backward", 12), ("op_zero_grad", 4), ("make_optimizer", 3), ("op_step", 5),
           ("op_train_eval", 3), ("op_close_layer", 2), ("op_copy_layer", 3), ("op_copy_opt", 2),
           ("op_close_opt", 1), ("op_to", 1), ("op_threads_share", 3), ("op_thread_closes", 2),
           ("op_fork", 0.4), ("op_spawn", 0.1), ("op_set_grad", 1)]

    def run(self):
        names = [n for n, _ in self.OPS]
        weights = [w for _, w in self.OPS]
        self.make_layer()
        for _ in range(self.n_ops):
            name = self.rng.choices(names, weights)[0]
            self.ops += 1
            t0 = time.perf_counter()
            try:
                getattr(self, name)()
            except Refused:
                pass  # a documented refusal the model did not predict either way
            finally:
                n, t = OP_STATS.get(name, (0, 0.0))
                OP_STATS[name] = (n + 1, t + time.perf_counter() - t0)
            if self.rng.random() < 0.2:
                self.check_views()
                for rec in self.tensors:
                    self.check_tensor(rec, "t%d (%s)" % (self.tensors.index(rec), rec.what))
        self.check_views()

    def close_all(self):
        for o in self.opts:
            o[0].close()
        for l in self.layers:
            l.obj.close()
        for rec in self.tensors:
            rec.t.close()
        self.views = []
        self.opts = self.layers = self.tensors = []


def run_sequence(seed, index, device, n_ops, allow_spawn):
    """One sequence: (ops run, finding dict or None)."""
    live0 = ut.live_tensors()
    d = Driver(seed, index, device, n_ops, allow_spawn)
    finding = None
    try:
        d.run()
    except Finding as e:
        finding = {"kind": e.kind, "message": str(e)[:3000]}
    except Refused as e:
        finding = {"kind": "refused-at-setup", "message": repr(e.exc)}
    except Exception as e:  # noqa: BLE001 - a bug of this driver, reported as one
        finding = {"kind": "driver-error", "message": traceback.format_exc()[-2000:]}
    try:
        d.close_all()
    except Exception as e:  # noqa: BLE001 - closing must never fail
        finding = finding or {"kind": "close-failed", "message": "%s: %s" % (type(e).__name__, e)}
    d_log, n_run = d.log, d.ops
    live = ut.live_tensors()
    if live != live0:  # cycles (a layer's finalizer, a traceback) may hold some: collect
        gc.collect()
        live = ut.live_tensors()
    if finding is None and live != live0:
        finding = {"kind": "leak", "message": "live_tensors() %d after closing everything, %d "
                   "before the sequence" % (live, live0)}
    if finding is not None:
        finding.update(seed=seed, sequence=index, device=device,
                       ops=d_log if os.environ.get("UTENSIL_FUZZ_FULL_LOG") else d_log[-40:],
                       replay="python tests/stateful_child.py 1 %d %s --only %d --ops %d"
                       % (seed, device, index, n_ops))
    return n_run, finding


def main():
    args = sys.argv[1:]
    only = None
    n_ops = 40
    if "--only" in args:
        i = args.index("--only")
        only = int(args[i + 1])
        del args[i:i + 2]
    if "--ops" in args:
        i = args.index("--ops")
        n_ops = int(args[i + 1])
        del args[i:i + 2]
    n_seq = int(args[0]) if args else 50
    seed = int(args[1]) if len(args) > 1 else 0
    device = args[2] if len(args) > 2 else "cpu"
    if not ut.cuda_available() and "asan" not in os.environ.get("LD_PRELOAD", ""):
        cap = (1 << 30) * 8
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    ut.set_num_threads(min(ut.get_num_threads(), 2))
    t0 = time.perf_counter()
    report = {"sequences": 0, "ops": 0, "findings": [], "seed": seed, "device": device}
    indices = [only] if only is not None else range(n_seq)
    for i in indices:
        n, finding = run_sequence(seed, i, device, n_ops, allow_spawn=(i % 25 == 0))
        report["sequences"] += 1
        report["ops"] += n
        if finding is not None:
            report["findings"].append(finding)
            if finding["kind"] == "hang":
                break  # a thread may still run: report and leave
    report["seconds"] = time.perf_counter() - t0
    report["op_counts"] = {k: v[0] for k, v in sorted(OP_STATS.items())}
    report["op_seconds"] = {k: round(v[1], 3) for k, v in sorted(OP_STATS.items())}
    print(json.dumps(report))
    sys.stdout.flush()
    os._exit(0)  # threads of a hang must not hold the exit


if __name__ == "__main__":
    main()
