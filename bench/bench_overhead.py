"""The cost of one tiny op, from Python, against PyTorch on the same device.

    python bench/bench_overhead.py [--device cuda] [--calls 20000]

Each row is the time per call of a loop of --calls calls on a tiny tensor (the work itself is
nothing; what is measured is the binding, the C entry point, the allocation of the output and,
on the GPU, the kernel launch), the device synchronized once at the end: what a Python training
loop of small ops pays per op. Rows: an activation through `utensil_ffi.functional`, the same C
call straight through cffi (no Python wrapper), a depthwise layer's forward, and an empty
`ut_fill` launch, and (CUDA) the activation recorded 100 times in a `ut.cuda.CUDAGraph` and
replayed (time per op); PyTorch's `torch.relu` and a depthwise `Conv2d` forward on the same
tensors. Last, an op over many tensors: SGD with momentum over the parameters of MobileNet v1 at
width 0.25 (one C call on our side, PyTorch's foreach implementation on its side).
"""

import argparse
import os
import sys
import time

import numpy as np

if __name__ == "__main__" and __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import utensil_ffi as ut  # noqa: E402
import utensil_ffi.functional as F  # noqa: E402
from utensil_ffi.nn import models  # noqa: E402
from utensil_ffi._lib import lib  # noqa: E402


def _per_call_us(fn, calls, sync):
    for _ in range(min(calls, 1000)):  # warm: allocator caches, lazy module loading
        fn()
    sync()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best / calls * 1e6


def run(device="cuda", calls=20000):
    rows = []
    x = ut.tensor(np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3), device)
    xi = ut.tensor(np.ones((1, 2, 3, 3), np.float32), device)
    dw = ut.DWConv2d(2, 2, device=device)
    p = x.ptr
    sync = ut.synchronize
    rows.append(("utensil F.relu(x), x [2, 3]", _per_call_us(lambda: F.relu(x), calls, sync)))
    rows.append(("utensil lib.ut_relu + ut_free (bare cffi)",
                 _per_call_us(lambda: lib.ut_free(lib.ut_relu(p)), calls, sync)))
    rows.append(("utensil DWConv2d(2, 2) forward, x [1, 2, 3, 3]",
                 _per_call_us(lambda: dw(xi), calls, sync)))
    rows.append(("utensil lib.ut_fill (one launch, no allocation)",
                 _per_call_us(lambda: lib.ut_fill(p, 0.5), calls, sync)))
    # an op over many tensors: the optimizer's step over a small MobileNet v1's parameters
    net = models.mobilenet_v1(num_classes=10, width_mult=0.25, device=device)
    for q in net.parameters():
        q.grad.fill_(0.01)
    opt = ut.SGD(net.parameters(), lr=1e-3, momentum=0.9)
    many = max(calls // 100, 20)
    rows.append(("utensil SGD(momentum).step(), MobileNet v1 x0.25's %d parameters"
                 % len(net.parameters()), _per_call_us(opt.step, many, sync)))
    if device == "cuda":  # the same op recorded 100 times and replayed: the cost per op
        g = ut.cuda.CUDAGraph()
        with ut.cuda.graph(g):
            y = x
            for _ in range(100):
                y = F.relu(y)
        rows.append(("utensil F.relu x 100 in a CUDAGraph, per op of a replay",
                     _per_call_us(g.replay, max(calls // 100, 10), sync) / 100))
        g.close()
    try:
        import torch
    except ImportError:
        return rows
    tdev = "cuda" if device == "cuda" else "cpu"
    tx = torch.linspace(-1, 1, 6, device=tdev).reshape(2, 3)
    txi = torch.ones(1, 2, 3, 3, device=tdev)
    conv = torch.nn.Conv2d(2, 2, 2, groups=2).to(tdev)
    tsync = torch.cuda.synchronize if tdev == "cuda" else (lambda: None)
    with torch.no_grad():
        rows.append(("PyTorch torch.relu(x)", _per_call_us(lambda: torch.relu(tx), calls, tsync)))
        rows.append(("PyTorch depthwise Conv2d forward (no_grad)",
                     _per_call_us(lambda: conv(txi), calls, tsync)))
    rows.append(("PyTorch depthwise Conv2d forward (autograd)",
                 _per_call_us(lambda: conv(txi), calls, tsync)))
    tparams = [torch.nn.Parameter(torch.zeros(q.shape, device=tdev)) for q in net.parameters()]
    for q in tparams:
        q.grad = torch.full_like(q, 0.01)
    topt = torch.optim.SGD(tparams, lr=1e-3, momentum=0.9, foreach=True)
    rows.append(("PyTorch SGD(momentum, foreach=True).step(), the same %d shapes" % len(tparams),
                 _per_call_us(topt.step, many, tsync)))
    dw.close()
    net.close()
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(prog="python bench/bench_overhead.py",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if ut.cuda_available() else "cpu",
                   choices=("cpu", "cuda"))
    p.add_argument("--calls", type=int, default=20000)
    a = p.parse_args(argv)
    print("| call (%s) | us per call |" % a.device)
    print("|---|---|")
    for name, us in run(a.device, a.calls):
        print("| %s | %.2f |" % (name, us))


if __name__ == "__main__":
    main()
