"""GPU time per kernel of one whole-network training step, utensil against PyTorch.

    python bench/profile_kernels.py [--net v1] [--size 224] [--batch 256] [--steps 4]
                                    [--sides "utensil bf16,torch bf16"] [--top 25]

Records a few steps of each side with torch.profiler, whose CUDA activity (CUPTI) sees every
kernel and copy launched in the process, utensil's as well as PyTorch's. Prints, per side, the
wall time of a step, the GPU time its kernels add up to (the difference is time the GPU waited
for the host), and the kernels grouped by name, slowest first, in microseconds per step. Where
profile_network.py synchronizes around each layer, this leaves the step as it runs, so the two
sides are read on the same clock. Sides: "utensil fp32", "utensil bf16", "torch fp32",
"torch bf16" (channels_last + bf16 autocast + cudnn.benchmark, as bench_networks.py).
"""

import argparse
import collections
import os
import sys
import time

import numpy as np

if __name__ == "__main__" and __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import utensil_ffi as ut  # noqa: E402

from bench.bench_networks import _torch_side, build, stage, utensil_steps, zoo_names  # noqa: E402


def _side(name, net, torch, x_np, y_np, net_name):
    """A function running the side's steps over its batches, already staged."""
    lib, mode = name.split()
    if lib == "utensil":
        opt = ut.SGD(net.parameters(), lr=0.01, momentum=0.9)
        model = ut.MixedPrecision(net) if mode == "bf16" else net
        batches = stage([(x_np, y_np)], "cuda")
        return lambda: utensil_steps(model, opt, batches)
    torch.backends.cudnn.benchmark = True
    steps = _torch_side(torch, net, mode, "cuda", net_name)
    batches = [(x_np, y_np.astype(np.int64))]
    return lambda: steps(batches)


def _kernels(prof):
    """{kernel name: total device microseconds} of the recorded CUDA activity."""
    out = collections.defaultdict(float)
    count = collections.Counter()
    for ev in prof.events():
        if str(ev.device_type).endswith("CUDA") and ev.device_time_total > 0:
            out[ev.name] += ev.device_time_total
            count[ev.name] += 1
    return out, count


def profile(net_name="v1", size=224, batch=256, steps=4, sides=("utensil bf16", "torch bf16"),
            top=25, roofline=False):
    import torch
    from torch.profiler import ProfilerActivity, profile as tprofile

    ut.seed(0)
    ut.preferred_blas_library("cublas")
    net = build(net_name, "cuda")
    in_c, classes = (1, 10) if net_name == "digits" else (3, 1000)
    rng = np.random.default_rng(0)
    x_np = rng.standard_normal((batch, in_c, size, size)).astype(np.float32)
    y_np = rng.integers(0, classes, batch).astype(np.float32)
    for name in sides:
        run = _side(name, net, torch, x_np, y_np, net_name)
        for _ in range(6):  # warm-up: cudnn.benchmark, cuBLAS, caches
            run()
        t0 = time.perf_counter()
        for _ in range(steps):
            run()
        wall = (time.perf_counter() - t0) / steps * 1e6
        with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                run()
        k, count = _kernels(prof)
        gpu = sum(k.values()) / steps
        print("\n== %s  %s %d² b%d: wall %.0f µs/step (%.0f img/s), kernels %.0f µs/step "
              "(%.0f%%), %d launches/step"
              % (name, net_name, size, batch, wall, batch / wall * 1e6, gpu, 100 * gpu / wall,
                 sum(count.values()) // steps))
        for kname, t in sorted(k.items(), key=lambda kv: -kv[1])[:top]:
            print("  %9.0f µs %5.1f%% %4d×  %s" % (t / steps, 100 * t / steps / gpu,
                                                   count[kname] // steps, kname[:110]))
        if roofline and name.startswith("utensil"):
            _print_roofline(k, steps, net, net_name, batch, in_c, size, name.endswith("bf16"),
                            torch)


def _print_roofline(kernel_us, steps, net, net_name, batch, in_c, size, bf16, torch):
    """The family table of bench/roofline.py for the side just profiled."""
    from bench import roofline

    cpu_net = build(net_name, "cpu")
    shapes = roofline.layer_shapes(cpu_net, (1, in_c, size, size))
    cpu_net.close()
    params = sum(p.numel() for p in net.parameters())
    bw, flops = roofline.measure_peaks(torch)
    print("\n  roofline (bench/roofline.py), %s activations:" % ("bf16" if bf16 else "fp32"))
    for row in roofline.table(kernel_us, steps, batch, shapes, 2 if bf16 else 4, params, bw,
                              flops):
        print("  " + row)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--net", default="v1", choices=("v1", "digits") + tuple(zoo_names()))
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--sides", default="utensil bf16,torch bf16")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--roofline", action="store_true",
                   help="after each utensil side, the kernel families against the bytes and "
                        "FLOPs they must move (bench/roofline.py)")
    a = p.parse_args()
    profile(a.net, a.size, a.batch, a.steps, [s.strip() for s in a.sides.split(",")], a.top,
            a.roofline)


if __name__ == "__main__":
    main()
