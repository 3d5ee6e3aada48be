"""bfloat16 layers against float32, per layer, on MobileNet's shapes.

    python bench/bench_bf16.py [--device cuda] [--reps 30] [--torch]

One training step of each layer (forward, then backward with dx and the float32 parameter
gradients) on bf16 activations, against the same layer on float32 activations, on the shapes of
the op benchmarks (bench/benchlib.SHAPES: the 112x112 and 56x56 planes of MobileNet's early
blocks, N = 32) and the pointwise convolution and batchnorm that follow them. Prints the median
time per step of each and their ratio (> 1: bf16 faster). With --torch, PyTorch's own bf16 step
of the same layer (channels_last, autocast, cudnn) is printed beside it.
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

# (name, layer maker, N, C, H): the depthwise layers of benchlib.SHAPES and their neighbours
CASES = [
    ("dw3x3 s1 112^2", lambda: ut.DWConv2d(32, 3, stride=1, padding=1), 32, 32, 112),
    ("dw3x3 s2 56^2", lambda: ut.DWConv2d(144, 3, stride=2, padding=1), 32, 144, 56),
    ("dw3x3 s1 56^2", lambda: ut.DWConv2d(128, 3, stride=1, padding=1), 32, 128, 56),
    ("bn+relu6 112^2", lambda: ut.BatchNorm2d(32, activation="relu6"), 32, 32, 112),
    ("pw 32->64 112^2", lambda: ut.Conv2d(32, 64, 1), 32, 32, 112),
    ("pw 128->128 56^2", lambda: ut.Conv2d(128, 128, 1), 32, 128, 56),
]


def _step(layer, x, g):
    y = layer(x)
    dx = layer.backward(g)
    y.close()
    dx.close()


def _median_ms(fn, reps):
    fn()
    ut.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ut.synchronize()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def _torch_ms(layer_name, n, c, h, device, reps):
    import torch

    torch.backends.cudnn.benchmark = True
    if layer_name.startswith("dw"):
        s = 2 if " s2 " in layer_name else 1
        m = torch.nn.Conv2d(c, c, 3, stride=s, padding=1, groups=c, bias=False)
    elif layer_name.startswith("bn"):
        m = torch.nn.Sequential(torch.nn.BatchNorm2d(c), torch.nn.ReLU6())
    else:
        co = int(layer_name.split("->")[1].split()[0])
        m = torch.nn.Conv2d(c, co, 1, bias=False)
    m = m.to(device).to(memory_format=torch.channels_last)
    x = torch.randn(n, c, h, h, device=device).contiguous(memory_format=torch.channels_last)
    x.requires_grad_(True)

    def step():
        with torch.autocast(device, dtype=torch.bfloat16):
            y = m(x)
        y.backward(torch.ones_like(y))
        torch.cuda.synchronize()

    return _median_ms(step, reps)


def run(device="cuda", reps=30, with_torch=False):
    rng = np.random.default_rng(0)
    rows = []
    for name, make, n, c, h in CASES:
        layer = make().to(device)
        try:
            x = rng.standard_normal((n, c, h, h)).astype(np.float32)
            with ut.tensor(x, device) as xf:
                with layer(xf) as y0:
                    gshape = y0.shape
                layer.backward(ut.zeros(gshape, device)).close()
            g = rng.standard_normal(gshape).astype(np.float32)
            times = {}
            for dt in (ut.float32, ut.bfloat16):
                with ut.tensor(x, device, dt) as xt, ut.tensor(g, device, dt) as gt:
                    times[dt.name] = _median_ms(lambda: _step(layer, xt, gt), reps)
            if with_torch and device == "cuda":
                times["torch bf16"] = _torch_ms(name, n, c, h, device, reps)
            rows.append((name, times))
        finally:
            layer.close()
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(prog="python bench/bench_bf16.py",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--torch", action="store_true", help="also time PyTorch's bf16 layer")
    a = p.parse_args(argv)
    for name, t in run(a.device, a.reps, a.torch):
        extra = ("   torch bf16 %7.3f ms (utensil bf16 %.2fx)" % (
            t["torch bf16"], t["torch bf16"] / t["bfloat16"]) if "torch bf16" in t else "")
        print("%-18s fp32 %7.3f ms  bf16 %7.3f ms  bf16 %.2fx faster%s" % (
            name, t["float32"], t["bfloat16"], t["float32"] / t["bfloat16"], extra))


if __name__ == "__main__":
    main()
