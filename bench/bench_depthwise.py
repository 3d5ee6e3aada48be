"""Depthwise convolution across kernel sizes, strides and plane sizes, against PyTorch.

    python bench/bench_depthwise.py [--device cpu] [--threads 2] [--kernels 3,5,7]
                                    [--strides 1,2,3] [--dilation 1] [--multiplier 1] [--reps 30]

One training step of the layer (forward, then backward with dx and dW), median of --reps runs
after a warm-up, fp32 on both sides (on CUDA with TF32 off, which depthwise does not use). The
shapes are MobileNet's: wide shallow planes early, narrow deep ones late, and the digits
network's tiny planes. Prints one row per case with utensil's time, PyTorch's and their ratio
(> 1: utensil faster). --dilation and --multiplier run the same sweep with dilated filters
(padding dilation * (k // 2), "same" at stride 1) or m filters per channel (out_channels m * C).
"""

import argparse
import os
import statistics
import sys
import time

import numpy as np

if __name__ == "__main__" and __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import utensil_ffi as ut  # noqa: E402

# (N, C, H): the planes each kernel/stride pair is run on
SHAPES = [(8, 32, 64), (8, 64, 32), (8, 128, 16), (8, 256, 8), (8, 512, 4), (64, 64, 8)]


def _median_ms(fn, reps, device, torch):
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            ut.synchronize()
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def run(device="cpu", threads=2, kernels=(3, 5, 7), strides=(1, 2, 3), reps=30, shapes=SHAPES,
        dilation=1, multiplier=1):
    import torch

    if device == "cpu":
        ut.set_num_threads(threads)
        torch.set_num_threads(threads)
    torch.backends.cudnn.allow_tf32 = False
    rows = []
    rng = np.random.default_rng(0)
    for k in kernels:
        for s in strides:
            for n, c, h in shapes:
                if h < k:
                    continue
                x = rng.standard_normal((n, c, h, h)).astype(np.float32)
                pad = dilation * (k // 2)
                oc = multiplier * c
                with ut.DWConv2d(c, k, stride=s, padding=pad, bias=False, device=device,
                                 dilation=dilation, out_channels=oc) as layer:
                    xt = ut.tensor(x, device)
                    y = layer(xt)
                    go = rng.standard_normal(y.shape).astype(np.float32)
                    gt = ut.tensor(go, device)
                    y.close()

                    def ours():
                        out = layer(xt)
                        layer.backward(gt).close()
                        out.close()

                    conv = torch.nn.Conv2d(c, oc, k, stride=s, padding=pad, dilation=dilation,
                                           groups=c, bias=False).to(device)
                    tx = torch.from_numpy(x).to(device).requires_grad_()
                    tg = torch.from_numpy(go).to(device)

                    def theirs():
                        conv(tx).backward(tg)

                    a = _median_ms(ours, reps, device, torch)
                    b = _median_ms(theirs, reps, device, torch)
                    rows.append((k, s, n, c, h, a, b))
                    xt.close()
                    gt.close()
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(prog="python bench/bench_depthwise.py",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kernels", default="3,5,7")
    p.add_argument("--strides", default="1,2,3")
    p.add_argument("--dilation", type=int, default=1)
    p.add_argument("--multiplier", type=int, default=1)
    p.add_argument("--reps", type=int, default=30)
    a = p.parse_args(argv)
    ints = lambda text: tuple(int(v) for v in text.split(",") if v)  # noqa: E731
    rows = run(a.device, a.threads, ints(a.kernels), ints(a.strides), a.reps,
               dilation=a.dilation, multiplier=a.multiplier)
    print("| k | stride | N, C, H | utensil ms | PyTorch ms | PyTorch/utensil |")
    print("|---|---|---|---|---|---|")
    for k, s, n, c, h, ours, theirs in rows:
        print("| %d | %d | %d, %d, %d | %.3f | %.3f | %.2f |" % (k, s, n, c, h, ours, theirs,
                                                                theirs / ours))


if __name__ == "__main__":
    main()
