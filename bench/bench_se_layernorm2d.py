"""LayerNorm2d, the layer scale and squeeze-and-excitation's channel scale against PyTorch
(issue 30), on ConvNeXt-T's and EfficientNet-B0's shapes; SqueezeExcitation's eval forward
(issue 32).

    python bench/bench_se_layernorm2d.py [--device cuda] [--n 32] [--reps 30] [--dtype bf16]

One training step of each op (forward, then backward: dx and the parameter or scale gradient)
on both sides, the median time per step and the ratio (> 1: utensil faster). PyTorch's side is
what its models run: LayerNorm2d as torchvision writes it (permute to NHWC, F.layer_norm,
permute back, under autograd), the scales as broadcast multiplies under autograd.
``se_forward`` is inference instead: the whole SqueezeExcitation module in eval mode (pool,
1x1 conv to C/24 channels, SiLU, 1x1 conv back, Sigmoid, the channel scale), PyTorch's under
no_grad (torchvision's SqueezeExcitation); run it with ``--n 1`` and 8 for inference's batches.
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
from utensil_ffi import functional as F  # noqa: E402

# (op, C, H): ConvNeXt-T's four stages (LayerNorm2d in its downsampling layers and stem, the
# layer scale in every block) and EfficientNet-B0's squeeze-and-excitation planes
CASES = [("layernorm2d", c, h) for c, h in ((96, 56), (192, 28), (384, 14), (768, 7))]
CASES += [("layer_scale", c, h) for c, h in ((96, 56), (768, 7))]
CASES += [("channel_scale", c, h) for c, h in ((96, 112), (144, 56), (480, 14), (1152, 7))]
CASES += [("se_forward", c, h) for c, h in ((96, 112), (144, 56), (480, 14), (1152, 7))]


def _median_ms(fn, reps, sync):
    fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def _ours(op, x, g, c, n, device, dtype):
    if op == "layernorm2d":
        ln = ut.LayerNorm2d(c, device=device)

        def step():
            ln(x).close()
            ln.backward(g).close()

        return step, ln.close
    if op == "layer_scale":
        gamma = ut.full((c, 1, 1), 1e-6, device)
        dgamma = ut.zeros((c, 1, 1), device)

        def step():
            F.layer_scale(x, gamma).close()
            F.layer_scale_backward(g, x, gamma, dgamma).close()

        return step, lambda: (gamma.close(), dgamma.close())
    if op == "se_forward":
        se = ut.SqueezeExcitation(c, max(1, c // 24), ut.SiLU, device=device).eval()

        def step():
            se(x).close()

        return step, se.close
    s = ut.tensor(np.random.rand(n, c, 1, 1).astype(np.float32), device, dtype)

    def step():
        F.channel_scale(x, s).close()
        dx, ds = F.channel_scale_backward(g, x, s)
        dx.close(), ds.close()

    return step, s.close


def _theirs(torch, op, xa, ga, c, device, dtype):
    x = torch.tensor(xa, device=device, dtype=dtype, requires_grad=True)
    g = torch.tensor(ga, device=device, dtype=dtype)
    if op == "layernorm2d":
        w = torch.ones(c, device=device, requires_grad=True)
        b = torch.zeros(c, device=device, requires_grad=True)

        def fwd():
            y = torch.nn.functional.layer_norm(x.permute(0, 2, 3, 1), (c,), w.to(dtype),
                                               b.to(dtype), 1e-6)
            return y.permute(0, 3, 1, 2)
    elif op == "layer_scale":
        gamma = torch.full((c, 1, 1), 1e-6, device=device, requires_grad=True)

        def fwd():
            return x * gamma.to(dtype)
    elif op == "se_forward":  # torchvision.ops.SqueezeExcitation's forward
        nn = torch.nn
        fc1 = nn.Conv2d(c, max(1, c // 24), 1).to(device, dtype)
        fc2 = nn.Conv2d(max(1, c // 24), c, 1).to(device, dtype)

        def step():
            with torch.no_grad():
                p = nn.functional.adaptive_avg_pool2d(x, 1)
                x * torch.sigmoid(fc2(nn.functional.silu(fc1(p))))

        return step
    else:
        s = torch.rand(x.shape[0], c, 1, 1, device=device, dtype=dtype, requires_grad=True)

        def fwd():
            return x * s

    def step():
        fwd().backward(g)

    return step


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if ut.cuda_available() else "cpu")
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--dtype", choices=("f32", "bf16"), default="f32")
    a = ap.parse_args(argv)
    dtype = ut.bfloat16 if a.dtype == "bf16" else ut.float32
    try:
        import torch
    except ImportError:
        torch = None
    tdev = a.device if torch is None or a.device != "cuda" or torch.cuda.is_available() else None
    print("%-14s %5s %4s  %9s  %9s  %6s" % ("op", "C", "H", "ours ms", "torch ms", "ratio"))
    rng = np.random.default_rng(0)
    for op, c, h in CASES:
        if op == "se_forward" and dtype != ut.float32:
            continue  # a module's forward: float32 (bfloat16 modules are MixedPrecision's)
        xa = rng.standard_normal((a.n, c, h, h)).astype(np.float32)
        ga = rng.standard_normal((a.n, c, h, h)).astype(np.float32)
        with ut.tensor(xa, a.device, dtype) as x, ut.tensor(ga, a.device, dtype) as g:
            step, done = _ours(op, x, g, c, a.n, a.device, dtype)
            try:
                ours = _median_ms(step, a.reps, ut.synchronize)
            finally:
                done()
        theirs = float("nan")
        if torch is not None and tdev is not None:
            tdt = torch.bfloat16 if a.dtype == "bf16" else torch.float32
            sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
            theirs = _median_ms(_theirs(torch, op, xa, ga, c, tdev, tdt), a.reps, sync)
        print("%-14s %5d %4d  %9.3f  %9.3f  %6.2f" % (op, c, h, ours, theirs, theirs / ours))


if __name__ == "__main__":
    main()
