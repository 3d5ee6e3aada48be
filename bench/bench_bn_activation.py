"""BatchNorm2d with a fused activation against BatchNorm2d followed by the activation's layer:
milliseconds per training step (forward and backward), float32 and bf16, per device.

    python bench/bench_bn_activation.py [--device cpu|cuda] [--shape 64 96 28 28] [--reps 20]

Prints, per activation and dtype: the fused layer's forward and backward, the unfused pair's, and
fused / unfused (below 1: the fusion pays). The plain BatchNorm2d (activation None) is the floor:
a fused kind should cost about as much as it on the GPU, where these kernels are memory-bound.
Each pair is first checked to agree (max abs difference of y and dx printed).
"""

import argparse
import os
import sys
import time

import numpy as np

if __name__ == "__main__" and __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import utensil_ffi as ut  # noqa: E402

LAYERS = {None: None, "relu": ut.ReLU, "relu6": ut.ReLU6, "silu": ut.SiLU,
          "hardswish": ut.Hardswish, "hardsigmoid": ut.Hardsigmoid, "sigmoid": ut.Sigmoid,
          "gelu": ut.GELU, "gelu_tanh": lambda: ut.GELU(approximate="tanh")}


def _median_ms(fn, reps):
    fn()
    ut.synchronize()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ut.synchronize()
        ts.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(ts))


def _net(c, act, fused, device):
    bn = ut.BatchNorm2d(c, activation=act if fused else None, device=device)
    layers = [bn] if fused or act is None else [bn, LAYERS[act]()]
    return ut.Sequential(*layers).to(device)


def _times(net, x, go, reps):
    def fwd():
        net.eval()  # no cache left behind
        net(x).close()

    def step():
        net.train()
        net(x).close()
        net.backward(go).close()

    t_fwd = _median_ms(fwd, reps)
    return t_fwd, _median_ms(step, reps) - t_fwd


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if ut.cuda_available() else "cpu")
    ap.add_argument("--shape", type=int, nargs=4, default=[64, 96, 28, 28])
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    xs = (rng.standard_normal(a.shape) * 2 + 0.5).astype(np.float32)
    gs = rng.standard_normal(a.shape).astype(np.float32)
    c = a.shape[1]
    print("device %s, shape %s" % (a.device, a.shape))
    print("%-12s %-8s %9s %9s %9s %9s %7s %10s" % ("activation", "dtype", "fused fwd", "bwd",
                                                  "unfused", "bwd", "ratio", "max |diff|"))
    for dtype in (ut.float32, ut.bfloat16):
        with ut.tensor(xs, a.device, dtype) as x, ut.tensor(gs, a.device, dtype) as go:
            for act in LAYERS:
                nets = [_net(c, act, fused, a.device) for fused in (True, False)]
                try:
                    outs = []
                    for net in nets:
                        net.train()
                        with net(x) as y, net.backward(go) as dx:
                            outs.append((y.numpy().astype(np.float32),
                                         dx.numpy().astype(np.float32)))
                    diff = max(float(np.max(np.abs(p - q))) for p, q in zip(*outs))
                    (ff, fb), (uf, ub) = (_times(net, x, go, a.reps) for net in nets)
                    print("%-12s %-8s %9.3f %9.3f %9.3f %9.3f %7.2f %10.2e" % (
                        act, "bf16" if dtype == ut.bfloat16 else "float32", ff, fb, uf, ub,
                        (ff + fb) / (uf + ub), diff))
                finally:
                    for net in nets:
                        net.close()


if __name__ == "__main__":
    main()
