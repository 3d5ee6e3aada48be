"""Issue 30's activations, utensil against PyTorch: forward and backward of SiLU, Hardswish,
Hardsigmoid, Sigmoid, GELU (erf, tanh) on one large tensor, float32 and bf16, per device.

    python bench/bench_activations.py [--device cpu|cuda] [--n 16777216] [--reps 20]

Prints, per op: milliseconds per call (median of --reps, after a warm-up) for utensil and for
PyTorch, their ratio, and utensil's effective bandwidth (forward reads x and writes y; backward
reads go and x and writes dx). Each pair is first checked to agree (max abs difference printed).
"""

import argparse
import os
import sys
import time

import numpy as np
import torch

if __name__ == "__main__" and __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import utensil_ffi as ut  # noqa: E402

OPS = [
    ("silu", ut.silu, ut.silu_backward, torch.nn.functional.silu),
    ("hardswish", ut.hardswish, ut.hardswish_backward, torch.nn.functional.hardswish),
    ("hardsigmoid", ut.hardsigmoid, ut.hardsigmoid_backward, torch.nn.functional.hardsigmoid),
    ("sigmoid", ut.sigmoid, ut.sigmoid_backward, torch.sigmoid),
    ("gelu", ut.gelu, ut.gelu_backward, torch.nn.functional.gelu),
    ("gelu_tanh", lambda x: ut.gelu(x, "tanh"), lambda g, x: ut.gelu_backward(g, x, "tanh"),
     lambda t: torch.nn.functional.gelu(t, approximate="tanh")),
]


def _time(fn, sync, reps):
    fn()
    sync()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if ut.cuda_available() else "cpu")
    ap.add_argument("--n", type=int, default=1 << 24)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    dev = a.device
    rng = np.random.default_rng(0)
    x = rng.uniform(-6, 6, a.n).astype(np.float32)
    go = rng.standard_normal(a.n).astype(np.float32)
    tsync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    print("device %s, n %d, torch %s" % (dev, a.n, torch.__version__))
    print("%-12s %-8s %-4s %10s %10s %7s %9s %10s" % ("op", "dtype", "dir", "ut ms", "torch ms",
                                                      "ratio", "ut GB/s", "max |diff|"))
    for dtype, tdtype, size in ((ut.float32, torch.float32, 4), (ut.bfloat16, torch.bfloat16, 2)):
        dname = str(tdtype).replace("torch.", "")
        xt, gt = ut.tensor(x, dev, dtype), ut.tensor(go, dev, dtype)
        tx = torch.tensor(x, device=dev).to(tdtype).requires_grad_(True)
        tg = torch.tensor(go, device=dev).to(tdtype)
        for name, fwd, bwd, tfn in OPS:
            with fwd(xt) as y:
                diff = float(np.max(np.abs(y.numpy().astype(np.float32)
                                           - tfn(tx).detach().float().cpu().numpy())))
            t_ut = _time(lambda: fwd(xt).close(), ut.synchronize, a.reps)
            t_th = _time(lambda: tfn(tx.detach()), tsync, a.reps)
            print("%-12s %-8s %-4s %10.3f %10.3f %7.2f %9.1f %10.2e" % (
                name, dname, "fwd", t_ut * 1e3, t_th * 1e3, t_ut / t_th,
                2 * size * a.n / t_ut / 1e9, diff))
            ty = tfn(tx)
            t_ut = _time(lambda: bwd(gt, xt).close(), ut.synchronize, a.reps)
            t_th = _time(lambda: torch.autograd.grad(ty, tx, tg, retain_graph=True), tsync,
                         a.reps)
            print("%-12s %-8s %-4s %10.3f %10.3f %7.2f %9.1f" % (
                name, dname, "bwd", t_ut * 1e3, t_th * 1e3, t_ut / t_th,
                3 * size * a.n / t_ut / 1e9))
        xt.close(), gt.close()


if __name__ == "__main__":
    main()
