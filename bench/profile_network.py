"""Where one utensil training step of a whole network spends its time, layer by layer.

    python bench/profile_network.py [--net v1] [--size 224] [--batch 64] [--device cuda]
                                    [--precision highest] [--blas cublas] [--steps 5]

Times every layer's forward and backward (the device synchronized around each, so a layer's
time includes its launches) and sums them by kind: GEMM (Conv2d, Linear), depthwise (DWConv2d),
BatchNorm, elementwise (ReLU, ReLU6), pooling and the loss. The step time without those
synchronizations, against the sum of the layers, shows what launching and Python cost between
the kernels ("gaps"). Prints the kinds, the slowest layers, and the totals.
"""

import argparse
import collections
import os
import statistics
import sys
import time

import numpy as np

if __name__ == "__main__" and __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import utensil_ffi as ut  # noqa: E402

from bench.bench_networks import build, stage, utensil_steps  # noqa: E402

KINDS = {"Conv2d": "GEMM", "Linear": "GEMM", "DWConv2d": "depthwise", "BatchNorm2d": "BatchNorm",
         "ReLU": "elementwise", "ReLU6": "elementwise", "GlobalAvgPool2d": "pooling"}


def profile(net_name="v1", size=224, batch=64, device="cuda", precision="highest",
            blas="cublas", steps=5, threads=2, fused=True):
    ut.set_num_threads(threads)
    if device == "cuda":
        ut.preferred_blas_library(blas)
    ut.set_float32_matmul_precision(precision)
    ut.seed(0)
    net = build(net_name, device, fused)
    in_c, classes = (3, 1000) if net_name == "v1" else (1, 10)
    size = size if net_name == "v1" else 8
    rng = np.random.default_rng(0)
    x_np = rng.standard_normal((batch, in_c, size, size)).astype(np.float32)
    y_np = rng.integers(0, classes, batch).astype(np.float32)
    opt = ut.SGD(net.parameters(), lr=0.01, momentum=0.9)
    layer_t = collections.defaultdict(float)
    try:
        plain = []
        batches = stage([(x_np, y_np)], device) * 3
        utensil_steps(net, opt, batches)  # warm-up
        for _ in range(steps):
            t0 = time.perf_counter()
            utensil_steps(net, opt, batches)
            plain.append((time.perf_counter() - t0) / len(batches))
        batches[0][0].close()
        batches[0][1].close()
        x, y = ut.tensor(x_np, device), ut.tensor(y_np, device)
        for it in range(steps + 1):
            outs, cur = [], x
            for i, layer in enumerate(net.layers):
                ut.synchronize()
                t0 = time.perf_counter()
                cur = layer(cur)
                ut.synchronize()
                if it:
                    layer_t[(i, type(layer).__name__, "forward")] += time.perf_counter() - t0
                outs.append(cur)
            t0 = time.perf_counter()
            g = ut.cross_entropy_backward(cur, y)
            ut.synchronize()
            if it:
                layer_t[(len(net.layers), "loss", "backward")] += time.perf_counter() - t0
            for i in reversed(range(len(net.layers))):
                ut.synchronize()
                t0 = time.perf_counter()
                g2 = net.layers[i].backward(g, input_grad=i > 0)  # no image gradient, as the step
                ut.synchronize()
                if it:
                    layer_t[(i, type(net.layers[i]).__name__, "backward")] += \
                        time.perf_counter() - t0
                g.close()
                g = g2  # None after the first layer
            for o in outs:
                o.close()
            opt.zero_grad()
        x.close()
        y.close()
    finally:
        opt.close()
        net.close()
        ut.set_float32_matmul_precision("highest")
    per = {k: v / steps for k, v in layer_t.items()}
    return per, statistics.median(plain)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python bench/profile_network.py",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--net", default="v1", choices=("v1", "digits"))
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    p.add_argument("--precision", default="highest", choices=("highest", "high"))
    p.add_argument("--blas", default="cublas", choices=("cublas", "own"))
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--unfused", action="store_true")
    a = p.parse_args(argv)
    per, step = profile(a.net, a.size, a.batch, a.device, a.precision, a.blas, a.steps, a.threads,
                        not a.unfused)
    total = sum(per.values())
    kinds = collections.defaultdict(float)
    for (_, name, _), t in per.items():
        kinds[KINDS.get(name, name)] += t
    print("%s %s %d^2 batch %d, %s, precision %s: step %.2f ms unsynchronized, layers %.2f ms "
          "synchronized one by one" % (a.net, a.device, a.size if a.net == "v1" else 8, a.batch,
                                       ut.backends()["cuda"].get("gemm", "cpu"), a.precision,
                                       step * 1e3, total * 1e3))
    for k, t in sorted(kinds.items(), key=lambda kv: -kv[1]):
        print("  %-12s %8.2f ms  %5.1f%%" % (k, t * 1e3, 100 * t / total))
    print("  optimizer and gaps between launches: %.2f ms (step minus layers; negative when "
          "the synchronizations cost more than the overlap they remove)" % ((step - total) * 1e3))
    print("slowest layers:")
    for k in sorted(per, key=lambda k: -per[k])[:12]:
        print("  %3d %-12s %-8s %8.3f ms" % (k[0], k[1], k[2], per[k] * 1e3))


if __name__ == "__main__":
    main()
