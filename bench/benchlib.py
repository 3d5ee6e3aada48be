"""Shared pieces of the benchmark suite: shapes, settings, runners for utensil and PyTorch.

A *runner* wraps one op on one side (utensil or torch) with its inputs already on the device:
``runner()`` is the timed call (device work synchronized inside it), ``runner.outputs()`` the
numpy results of the last call (for the correctness check against torch), ``runner.reset()``
zeroes accumulated gradients, ``runner.close()`` frees what it holds.
"""

import os
import time

import numpy as np

import utensil_ffi as ut

try:  # torch is optional: without it only utensil is timed and nothing is cross-checked
    import torch
    import torch.nn.functional as TF
except ImportError:  # pragma: no cover - exercised on machines without torch
    torch = None


def _no_grad(fn):
    """torch.no_grad() where torch is installed; the class bodies below must still load without
    it (their runners are never built then)."""
    return fn if torch is None else torch.no_grad()(fn)
    TF = None

# (N, C, H, W, k, stride) from the issue; padding is k // 2 everywhere.
SHAPES = [
    (32, 32, 112, 112, 3, 1),
    (32, 144, 56, 56, 3, 2),
    (32, 384, 14, 14, 3, 1),
    (32, 960, 7, 7, 3, 1),
    (32, 240, 28, 28, 5, 1),
    (1, 2, 3, 3, 2, 1),
]
TINY = (1, 2, 3, 3, 2, 1)
QUICK_N = 2  # quick mode: the same geometries (H, W, k, stride) with N = 32 -> 2 and C -> C // 8


def env_full(benchmark_disabled):
    """Full shapes unless UTENSIL_BENCH_FULL=0, or benchmarking is disabled and it isn't 1."""
    v = os.environ.get("UTENSIL_BENCH_FULL")
    if v is not None and v != "":
        return v not in ("0", "false", "no")
    return not benchmark_disabled


def shapes(full):
    if full:
        return list(SHAPES)
    return [(QUICK_N, max(1, c // 8), h, w, k, s) if n == 32 else (n, c, h, w, k, s)
            for (n, c, h, w, k, s) in SHAPES]


def dense3x3_shapes(full):
    """Shapes for the dense 3x3 conv: the listed ones; UTENSIL_BENCH_DENSE_N=n replaces N=32 by n
    (the 3x3 dense conv on the big shapes is 7-26 GFLOP per forward: heavy on 2 cores)."""
    n_dense = os.environ.get("UTENSIL_BENCH_DENSE_N")
    out = shapes(full)
    if n_dense and full:
        out = [(int(n_dense) if sh[0] == 32 else sh[0],) + tuple(sh[1:]) for sh in out]
    return out


def shape_id(shape):
    n, c, h, w, k, s = shape
    return "%dx%dx%dx%d-k%ds%d" % (n, c, h, w, k, s)


def threads():
    return int(os.environ.get("UTENSIL_BENCH_THREADS", "2"))


def torch_device(device):
    """The torch device twin of a utensil device, or None when torch can't run there."""
    if torch is None:
        return None
    if device == "cpu":
        return "cpu"
    if device == "cuda" and torch.cuda.is_available():
        return "cuda"
    return None


def sync(device, side):
    if device != "cuda":
        return
    if side == "torch":
        torch.cuda.synchronize()
    else:
        ut.synchronize()


# -- bandwidth probes -------------------------------------------------------------------------------
def copy_bandwidth(device="cpu", mib=256, reps=5):
    """Best-of-``reps`` copy bandwidth in GB/s (bytes read + bytes written), or None.

    CPU: torch's dst.copy_(src) on the bench thread count (numpy's single-threaded copyto when
    torch is missing). CUDA: a torch device-to-device copy.
    """
    n = mib * 2**20 // 4
    best = float("inf")
    if device == "cuda":
        if torch is None or not torch.cuda.is_available():
            return None
        a = torch.ones(n, device="cuda")
        b = torch.empty_like(a)
        b.copy_(a)
        torch.cuda.synchronize()
        for _ in range(reps):
            t = time.perf_counter()
            b.copy_(a)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
        del a, b
    elif torch is not None:
        a = torch.ones(n)
        b = torch.empty_like(a)
        b.copy_(a)
        for _ in range(reps):
            t = time.perf_counter()
            b.copy_(a)
            best = min(best, time.perf_counter() - t)
        del a, b
    else:
        a = np.ones(n, np.float32)
        b = np.empty_like(a)
        np.copyto(b, a)
        for _ in range(reps):
            t = time.perf_counter()
            np.copyto(b, a)
            best = min(best, time.perf_counter() - t)
        del a, b
    return 2.0 * n * 4 / best / 1e9


# -- data -------------------------------------------------------------------------------------------
def f32(a):
    return np.ascontiguousarray(a, dtype=np.float32)


def out_hw(h, w, k, s, p):
    return (h + 2 * p - k) // s + 1, (w + 2 * p - k) // s + 1


def op_data(op, shape):
    """The numpy inputs of ``op`` on ``shape`` (identical for both sides)."""
    n, c, h, w, k, s = shape
    r = np.random.default_rng(sum(map(ord, op)) * 1000003 + sum(shape))
    d = {}
    if op in ("dw_fwd", "dw_bwd", "overhead"):
        p = k // 2
        ho, wo = out_hw(h, w, k, s, p)
        d["x"] = f32(r.standard_normal((n, c, h, w)))
        d["w"] = f32(r.standard_normal((c, k, k)) / k)
        d["b"] = f32(r.standard_normal(c))
        d["g"] = f32(r.standard_normal((n, c, ho, wo)))
        d["geom"] = (k, s, p)
    elif op == "relu6_bwd":
        d["x"] = f32(r.normal(3.0, 3.0, (n, c, h, w)))
        d["g"] = f32(r.standard_normal((n, c, h, w)))
    elif op in ("conv1x1_fwd", "conv1x1_bwd", "conv3x3_fwd", "conv3x3_bwd"):
        kk = 1 if op.startswith("conv1x1") else 3
        ss = 1 if kk == 1 else s
        p = kk // 2
        ho, wo = out_hw(h, w, kk, ss, p)
        d["x"] = f32(r.standard_normal((n, c, h, w)))
        d["w"] = f32(r.standard_normal((c, c, kk, kk)) / np.sqrt(c * kk * kk))
        d["b"] = f32(r.standard_normal(c))
        d["g"] = f32(r.standard_normal((n, c, ho, wo)))
        d["geom"] = (kk, ss, p)
    elif op in ("bn_fwd", "bn_bwd"):
        d["x"] = f32(r.normal(0.5, 2.0, (n, c, h, w)))
        d["w"] = f32(r.uniform(0.5, 1.5, c))
        d["b"] = f32(r.standard_normal(c))
        d["g"] = f32(r.standard_normal((n, c, h, w)))
    elif op == "block":
        p = k // 2
        ho, wo = out_hw(h, w, k, s, p)
        d["x"] = f32(r.standard_normal((n, c, h, w)))
        d["w_dw"] = f32(r.standard_normal((c, k, k)) / k)
        d["w_pw"] = f32(r.standard_normal((c, c, 1, 1)) / np.sqrt(c))
        d["target"] = f32(r.uniform(0.0, 6.0, (n, c, ho, wo)))
        d["geom"] = (k, s, p)
    else:
        raise KeyError(op)
    return d


# -- runners ----------------------------------------------------------------------------------------
class _Runner:
    side = None

    def __init__(self, device):
        self.device = device
        self.out = None

    def __call__(self):
        new = self.step()
        old, self.out = self.out, new
        self._drop(old)
        sync(self.device, self.side)

    def reset(self):
        pass

    def outputs(self):
        raise NotImplementedError

    def _drop(self, old):
        pass

    def close(self):
        self._drop(self.out)
        self.out = None


def _np(t):
    """numpy copy of a utensil Tensor or torch tensor."""
    if torch is not None and isinstance(t, torch.Tensor):
        return t.detach().cpu().numpy().copy()
    return np.array(t.numpy(), copy=True)


class UtRunner(_Runner):
    """utensil side; ``self.temps`` are tensors/layers freed at close()."""

    side = "ours"

    def __init__(self, device):
        super().__init__(device)
        self.temps = []

    def T(self, a):
        t = ut.tensor(a, self.device)
        self.temps.append(t)
        return t

    def _drop(self, old):
        if old is None:
            return
        for t in old if isinstance(old, tuple) else (old,):
            t.close()

    def close(self):
        super().close()
        for t in reversed(self.temps):
            t.close()
        self.temps = []


class TorchRunner(_Runner):
    side = "torch"

    def T(self, a, grad=False):
        t = torch.from_numpy(np.array(a, copy=True)).to(self.device)
        if grad:
            t.requires_grad_(True)
        return t


# -- depthwise --------------------------------------------------------------------------------------
class UtDW(UtRunner):
    def __init__(self, device, d, backward):
        super().__init__(device)
        k, s, p = d["geom"]
        c = d["w"].shape[0]
        self.layer = ut.DWConv2d(c, k, stride=s, padding=p, bias=True, device=device)
        self.temps.append(self.layer)
        self.layer.weight.copy_from(d["w"])
        self.layer.bias.copy_from(d["b"])
        self.x = self.T(d["x"])
        self.backward = backward
        if backward:
            self.layer.train()
            self.layer(self.x).close()  # keeps the cache for backward
            self.g = self.T(d["g"])
        else:
            self.layer.eval()

    def step(self):
        if self.backward:
            return self.layer.backward(self.g)
        return self.layer(self.x)

    def reset(self):
        self.layer.zero_grad()

    def outputs(self):
        if self.backward:
            return {"dx": _np(self.out), "dW": _np(self.layer.weight.grad), "db": _np(self.layer.bias.grad)}
        return {"y": _np(self.out)}


class TorchDW(TorchRunner):
    def __init__(self, device, d, backward):
        super().__init__(device)
        self.k, self.s, self.p = d["geom"]
        c = d["w"].shape[0]
        self.c = c
        self.x = self.T(d["x"])
        self.w = self.T(d["w"].reshape(c, 1, self.k, self.k))
        self.b = self.T(d["b"])
        self.g = self.T(d["g"])
        self.backward = backward

    @_no_grad
    def step(self):
        s, p = self.s, self.p
        if self.backward:
            return torch.ops.aten.convolution_backward(
                self.g, self.x, self.w, [self.c], [s, s], [p, p], [1, 1], False, [0, 0], self.c,
                [True, True, True])
        return TF.conv2d(self.x, self.w, self.b, s, p, 1, self.c)

    def outputs(self):
        if self.backward:
            dx, dw, db = self.out
            return {"dx": _np(dx), "dW": _np(dw).reshape(self.c, self.k, self.k), "db": _np(db)}
        return {"y": _np(self.out)}


class UtDWRaw(UtRunner):
    """The C entry point through cffi directly (no layer wrapper): the floor of the Python cost."""

    def __init__(self, device, d):
        super().__init__(device)
        from utensil_ffi._lib import ffi, lib

        self.ffi, self.lib = ffi, lib
        k, s, p = d["geom"]
        self.layer = ut.DWConv2d(d["w"].shape[0], k, stride=s, padding=p, bias=True, device=device)
        self.temps.append(self.layer)
        self.layer.weight.copy_from(d["w"])
        self.layer.bias.copy_from(d["b"])
        self.x = self.T(d["x"])
        self.s = self.layer._struct  # the C struct (a private attribute; bench only)
        self.xp = self.x.ptr
        self.fwd = lib.ut_dwconv2d_forward
        self.free = lib.ut_free
        self.null = ffi.NULL
        self.raw = None

    def __call__(self):
        y = self.fwd(self.s, self.xp, self.null)
        old, self.raw = self.raw, y
        if old is not None:
            self.free(old)
        if self.device == "cuda":
            ut.synchronize()

    def outputs(self):
        return {"y": _np(ut.Tensor._borrow(self.raw))}

    def close(self):
        if self.raw is not None:
            self.free(self.raw)
            self.raw = None
        super().close()


# -- relu6 backward ---------------------------------------------------------------------------------
class UtRelu6Bwd(UtRunner):
    def __init__(self, device, d):
        super().__init__(device)
        self.x, self.g = self.T(d["x"]), self.T(d["g"])

    def step(self):
        return ut.relu6_backward(self.g, self.x)

    def outputs(self):
        return {"dx": _np(self.out)}


class TorchRelu6Bwd(TorchRunner):
    def __init__(self, device, d):
        super().__init__(device)
        self.x, self.g = self.T(d["x"]), self.T(d["g"])

    @_no_grad
    def step(self):
        return torch.ops.aten.hardtanh_backward(self.g, self.x, 0.0, 6.0)

    def outputs(self):
        return {"dx": _np(self.out)}


# -- dense conv -------------------------------------------------------------------------------------
class UtConv(UtRunner):
    def __init__(self, device, d, backward):
        super().__init__(device)
        k, s, p = d["geom"]
        c = d["w"].shape[0]
        self.layer = ut.Conv2d(c, c, k, stride=s, padding=p, bias=True, device=device)
        self.temps.append(self.layer)
        self.layer.weight.copy_from(d["w"])
        self.layer.bias.copy_from(d["b"])
        self.x = self.T(d["x"])
        self.backward = backward
        if backward:
            self.layer.train()
            self.layer(self.x).close()
            self.g = self.T(d["g"])
        else:
            self.layer.eval()

    step = UtDW.step
    reset = UtDW.reset

    def outputs(self):
        if self.backward:
            return {"dx": _np(self.out), "dW": _np(self.layer.weight.grad), "db": _np(self.layer.bias.grad)}
        return {"y": _np(self.out)}


class TorchConv(TorchRunner):
    def __init__(self, device, d, backward):
        super().__init__(device)
        self.k, self.s, self.p = d["geom"]
        self.c = d["w"].shape[0]
        self.x, self.w, self.b, self.g = (self.T(d[n]) for n in ("x", "w", "b", "g"))
        self.backward = backward

    @_no_grad
    def step(self):
        s, p = self.s, self.p
        if self.backward:
            return torch.ops.aten.convolution_backward(
                self.g, self.x, self.w, [self.c], [s, s], [p, p], [1, 1], False, [0, 0], 1,
                [True, True, True])
        return TF.conv2d(self.x, self.w, self.b, s, p)

    def outputs(self):
        if self.backward:
            dx, dw, db = self.out
            return {"dx": _np(dx), "dW": _np(dw), "db": _np(db)}
        return {"y": _np(self.out)}


# -- batchnorm --------------------------------------------------------------------------------------
class UtBN(UtRunner):
    def __init__(self, device, d, backward):
        super().__init__(device)
        c = d["w"].shape[0]
        self.layer = ut.BatchNorm2d(c, eps=1e-5, momentum=0.1, device=device)
        self.temps.append(self.layer)
        self.layer.weight.copy_from(d["w"])
        self.layer.bias.copy_from(d["b"])
        self.layer.train()
        self.x = self.T(d["x"])
        self.backward = backward
        if backward:
            self.layer(self.x).close()
            self.g = self.T(d["g"])

    step = UtDW.step
    reset = UtDW.reset

    def outputs(self):
        if self.backward:
            return {"dx": _np(self.out), "dgamma": _np(self.layer.weight.grad),
                    "dbeta": _np(self.layer.bias.grad)}
        return {"y": _np(self.out)}


class TorchBN(TorchRunner):
    def __init__(self, device, d, backward):
        super().__init__(device)
        c = d["w"].shape[0]
        self.x, self.w, self.b, self.g = (self.T(d[n]) for n in ("x", "w", "b", "g"))
        self.rm = torch.zeros(c, device=device)
        self.rv = torch.ones(c, device=device)
        self.backward = backward
        if backward:
            _, self.mean, self.invstd = torch.ops.aten.native_batch_norm(
                self.x, self.w, self.b, self.rm, self.rv, True, 0.1, 1e-5)

    @_no_grad
    def step(self):
        if self.backward:
            return torch.ops.aten.native_batch_norm_backward(
                self.g, self.x, self.w, self.rm, self.rv, self.mean, self.invstd, True, 1e-5,
                [True, True, True])
        return torch.ops.aten.native_batch_norm(self.x, self.w, self.b, self.rm, self.rv, True, 0.1, 1e-5)

    def outputs(self):
        if self.backward:
            dx, dw, db = self.out
            return {"dx": _np(dx), "dgamma": _np(dw), "dbeta": _np(db)}
        return {"y": _np(self.out[0])}


# -- the check --------------------------------------------------------------------------------------
# float32 tolerances per op family. Single ops: max |ours - torch| / max |torch| (results are sums
# over up to N*H*W terms: dW, db, BN statistics). The block: the relative L2 error
# ||ours - torch|| / ||torch||, because a ReLU6 mask may flip where a forward value lies within
# rounding of 0 or 6, which moves a few gradient elements by a whole value (a max-norm check
# would fail on rounding luck; those flips barely move the L2 norm).
TOL = {"default": 2e-4, "conv3x3": 1e-3, "conv1x1": 1e-3, "block": 5e-3}


def assert_close(ours, ref, op):
    tol = TOL["default"]
    for fam in ("conv3x3", "conv1x1", "block"):
        if op.startswith(fam):
            tol = TOL[fam]
    for name, r in ref.items():
        o = ours[name]
        assert o.shape == r.shape, "%s %s: shape %s vs torch %s" % (op, name, o.shape, r.shape)
        diff = o.astype(np.float64) - r
        if op == "block":
            scale = max(float(np.linalg.norm(r)), 1e-30)
            err = float(np.linalg.norm(diff)) / scale
            what = "||ours - torch|| / ||torch||"
        else:
            scale = max(float(np.max(np.abs(r))), 1e-6)
            err = float(np.max(np.abs(diff))) / scale
            what = "max |ours - torch| / max |torch|"
        assert err <= tol, "%s %s: %s = %.3g > %.3g" % (op, name, what, err, tol)


# -- one MobileNet block training step --------------------------------------------------------------
# dw kxk (stride s, pad k//2, no bias) -> BN -> ReLU6 -> pw 1x1 C->C (no bias) -> BN -> ReLU6,
# MSE against a fixed target, backward through everything (dx of the block input included on
# both sides: utensil always computes it, so torch's input requires grad), SGD momentum 0.9.
LR, MOMENTUM = 0.01, 0.9


class UtBlock(UtRunner):
    def __init__(self, device, d):
        super().__init__(device)
        k, s, p = d["geom"]
        c = d["x"].shape[1]
        self.dw = ut.DWConv2d(c, k, stride=s, padding=p, bias=False, device=device)
        self.pw = ut.Conv2d(c, c, 1, bias=False, device=device)
        self.net = ut.Sequential(self.dw, ut.BatchNorm2d(c, device=device), ut.ReLU6(),
                                 self.pw, ut.BatchNorm2d(c, device=device), ut.ReLU6())
        self.temps.append(self.net)
        self.dw.weight.copy_from(d["w_dw"])
        self.pw.weight.copy_from(d["w_pw"])
        self.x, self.target = self.T(d["x"]), self.T(d["target"])
        self.crit = ut.MSELoss()
        self.opt = ut.SGD(self.net.parameters(), lr=LR, momentum=MOMENTUM)

    def step(self):
        self.opt.zero_grad()
        y = self.net(self.x)
        loss = self.crit(y, self.target)
        g = self.crit.backward()
        dx = self.net.backward(g)
        self.opt.step()
        self.crit.close()
        y.close()
        g.close()
        return (loss, dx)

    def outputs(self):
        loss, dx = self.out
        return {"loss": _np(loss).reshape(()), "dx": _np(dx),
                "grad_dw": _np(self.dw.weight.grad), "grad_pw": _np(self.pw.weight.grad),
                "w_dw": _np(self.dw.weight), "w_pw": _np(self.pw.weight)}

    def close(self):
        super().close()
        self.opt.close()
        self.crit.close()


class TorchBlock(TorchRunner):
    def __init__(self, device, d):
        super().__init__(device)
        k, s, p = d["geom"]
        c = d["x"].shape[1]
        nn = torch.nn
        self.net = nn.Sequential(
            nn.Conv2d(c, c, k, stride=s, padding=p, groups=c, bias=False), nn.BatchNorm2d(c),
            nn.ReLU6(), nn.Conv2d(c, c, 1, bias=False), nn.BatchNorm2d(c), nn.ReLU6()).to(device)
        with torch.no_grad():
            self.net[0].weight.copy_(torch.from_numpy(d["w_dw"]).reshape(c, 1, k, k))
            self.net[3].weight.copy_(torch.from_numpy(d["w_pw"]))
        self.c, self.k = c, k
        self.x = self.T(d["x"], grad=True)
        self.target = self.T(d["target"])
        self.opt = torch.optim.SGD(self.net.parameters(), lr=LR, momentum=MOMENTUM)

    def step(self):
        self.opt.zero_grad()
        self.x.grad = None
        loss = TF.mse_loss(self.net(self.x), self.target)
        loss.backward()
        self.opt.step()
        return loss.detach()

    def outputs(self):
        c, k = self.c, self.k
        return {"loss": _np(self.out).reshape(()), "dx": _np(self.x.grad),
                "grad_dw": _np(self.net[0].weight.grad).reshape(c, k, k),
                "grad_pw": _np(self.net[3].weight.grad),
                "w_dw": _np(self.net[0].weight).reshape(c, k, k), "w_pw": _np(self.net[3].weight)}


RUNNERS = {
    # op: (utensil runner, torch runner), each called as runner(device, data)
    "dw_fwd": (lambda dev, d: UtDW(dev, d, False), lambda dev, d: TorchDW(dev, d, False)),
    "dw_bwd": (lambda dev, d: UtDW(dev, d, True), lambda dev, d: TorchDW(dev, d, True)),
    "relu6_bwd": (UtRelu6Bwd, TorchRelu6Bwd),
    "conv1x1_fwd": (lambda dev, d: UtConv(dev, d, False), lambda dev, d: TorchConv(dev, d, False)),
    "conv1x1_bwd": (lambda dev, d: UtConv(dev, d, True), lambda dev, d: TorchConv(dev, d, True)),
    "conv3x3_fwd": (lambda dev, d: UtConv(dev, d, False), lambda dev, d: TorchConv(dev, d, False)),
    "conv3x3_bwd": (lambda dev, d: UtConv(dev, d, True), lambda dev, d: TorchConv(dev, d, True)),
    "bn_fwd": (lambda dev, d: UtBN(dev, d, False), lambda dev, d: TorchBN(dev, d, False)),
    "bn_bwd": (lambda dev, d: UtBN(dev, d, True), lambda dev, d: TorchBN(dev, d, True)),
    "overhead": (lambda dev, d: UtDW(dev, d, False), lambda dev, d: TorchDW(dev, d, False)),
    "block": (UtBlock, TorchBlock),
}


def make_runner(op, impl, device, d):
    """The runner for ``op`` on one side (impl "ours", "cffi" or "torch") on ``device``."""
    if impl == "cffi":
        return UtDWRaw(device, d)
    ours, theirs = RUNNERS[op]
    return (theirs if impl == "torch" else ours)(device, d)
