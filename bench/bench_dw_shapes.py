"""Depthwise convolution over kernel shapes (square or not), strides and dilations, against
PyTorch, forward and one training step (forward + backward with dx and dW), and the deployed
eval forward of depthwise -> BatchNorm2d -> ReLU6.

    python bench/bench_dw_shapes.py [--device cpu] [--dtype fp32] [--threads 2]
                                    [--kernels 3x3,5x5,7x7,3x5,5x3,1x7,7x1]
                                    [--strides 1,2,3] [--dilations 1,2] [--channels 32,256]
                                    [--planes 28,56] [--batch 8] [--reps 5]
                                    [--modes fwd,step,eval]

Padding dilation * (min(kh, kw) // 2). Each case times utensil and PyTorch in alternating
rounds and keeps the best of --reps rounds each (the machine may be shared: the best is the
least disturbed); on the CPU each round follows 10 ms of its side's calls, untimed, so that
the other side's thread pool has gone quiet (WARM_MS). Prints one row per case and mode with
PyTorch's time / utensil's (> 1: utensil faster), then the geometric mean and the worst case
per mode. On --device cuda a round is 20 calls, synchronized at its end (the kernels, not the
host, are timed), PyTorch runs with cudnn.benchmark and TF32 off, and --dtype bf16 gives both
sides bf16 activations (utensil's weights stay float32, PyTorch's are bf16). Mode ``eval`` (not
in the default modes): utensil's eval-mode DWConv2d + BatchNorm2d + ReLU6 as the network runs
them, one folded call (the BatchNorm in the filters, ReLU6 in the engine's stores), against
PyTorch's three modules in eval mode under no_grad; float32 only.
"""

import argparse
import math
import os
import sys
import time

import numpy as np

if __name__ == "__main__" and __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import utensil_ffi as ut  # noqa: E402
from utensil_ffi._lib import lib  # noqa: E402
from utensil_ffi.nn import fold  # noqa: E402


# On the CPU each round first runs its side untimed for this long. Rounds of one call straight
# after the other side's measured the other side's thread pool as much as the call: PyTorch's
# OpenMP workers spin for milliseconds after a call, our pool's worker for 200 us, and on 2
# cores a spinning worker takes a core from the next side's threads. Alternating one-call
# rounds put utensil's 7x7 forward (8 x 32 x 28^2) at 0.300 ms against PyTorch's 0.224 (0.75x)
# where each side alone (against a no-op) took 0.183 and 0.179 (0.98x); with 5 ms of
# untimed calls first: 0.187 and 0.177.
WARM_MS = 10.0


def _best_pair(a, b, reps, sync=None, calls=1, warm_ms=0.0):
    """Best ms per call of a and of b over reps alternating rounds of `calls` calls each, each
    round after warm_ms of untimed calls of its own side."""
    def round_ms(fn):
        if warm_ms:
            t0 = time.perf_counter()
            while (time.perf_counter() - t0) * 1e3 < warm_ms:
                fn()
            if sync:
                sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        if sync:
            sync()
        return (time.perf_counter() - t0) * 1e3 / calls

    round_ms(a)
    round_ms(b)
    ta, tb = [], []
    for _ in range(reps):
        ta.append(round_ms(a))
        tb.append(round_ms(b))
    return min(ta), min(tb)


def run(threads=2, kernels=((3, 3),), strides=(1,), dilations=(1,), channels=(32,), planes=(28,),
        batch=8, reps=5, modes=("fwd", "step"), out=print, device="cpu", dtype="fp32"):
    import torch

    if device == "cpu":
        ut.set_num_threads(threads)
        torch.set_num_threads(threads)
        sync, calls, warm_ms = None, 1, WARM_MS
    else:
        torch.backends.cudnn.benchmark = True
        torch.backends.cudnn.allow_tf32 = False

        def sync():
            ut.synchronize()
            torch.cuda.synchronize()
        calls, warm_ms = 20, 0.0
    if dtype not in ("fp32", "bf16"):
        raise ValueError("dtype must be fp32 or bf16, not %r" % (dtype,))
    unknown = [m for m in modes if m not in ("fwd", "step", "eval")]
    if unknown:
        raise ValueError("modes are fwd, step and eval, not %r" % (unknown,))
    if "eval" in modes and dtype != "fp32":
        raise ValueError("mode eval is float32 only")

    bf16 = dtype == "bf16"
    ut_dt = ut.bfloat16 if bf16 else ut.float32
    t_dt = torch.bfloat16 if bf16 else torch.float32
    rng = np.random.default_rng(0)
    rows = []
    for kh, kw in kernels:
        for s in strides:
            for d in dilations:
                for c in channels:
                    for h in planes:
                        pad = d * (min(kh, kw) // 2)
                        if h + 2 * pad < d * (max(kh, kw) - 1) + 1:
                            continue
                        x = rng.standard_normal((batch, c, h, h)).astype(np.float32)
                        with ut.DWConv2d(c, (kh, kw), stride=s, padding=pad, bias=False,
                                         dilation=d).to(device) as layer, \
                                ut.BatchNorm2d(c).to(device) as bn:
                            xt = ut.tensor(x, device, ut_dt)
                            y = layer(xt)
                            go = rng.standard_normal(y.shape).astype(np.float32)
                            y.close()
                            gt = ut.tensor(go, device, ut_dt)
                            conv = torch.nn.Conv2d(c, c, (kh, kw), stride=s, padding=pad,
                                                   dilation=d, groups=c, bias=False)
                            conv = conv.to(device=device, dtype=t_dt)
                            tx = torch.from_numpy(x).to(device=device, dtype=t_dt)
                            tx.requires_grad_()
                            tg = torch.from_numpy(go).to(device=device, dtype=t_dt)

                            def ours_fwd():
                                layer(xt).close()

                            def ours_step():
                                o = layer(xt)
                                layer.backward(gt).close()
                                o.close()

                            def theirs_fwd():
                                with torch.no_grad():
                                    conv(tx)

                            def theirs_step():
                                conv(tx).backward(tg)
                                tx.grad = None
                                conv.weight.grad = None

                            tbn = torch.nn.BatchNorm2d(c).to(device=device, dtype=t_dt).eval()
                            relu6 = torch.nn.ReLU6()

                            def ours_eval():
                                fold.conv_bn_forward(layer, bn, xt, lib.UT_ACT_RELU6).close()

                            def theirs_eval():
                                with torch.no_grad():
                                    relu6(tbn(conv(tx)))

                            pairs = {"fwd": (ours_fwd, theirs_fwd),
                                     "step": (ours_step, theirs_step),
                                     "eval": (ours_eval, theirs_eval)}
                            for mode in modes:
                                if mode == "eval":
                                    layer.eval()
                                    bn.eval()
                                a, b = _best_pair(*pairs[mode], reps, sync, calls, warm_ms)
                                layer.train()
                                row = (mode, kh, kw, s, d, c, h, a, b, b / a)
                                rows.append(row)
                                out("| %s | %dx%d | %d | %d | %d | %d | %.3f | %.3f | %.2f |" % row)
                            xt.close()
                            gt.close()
    return rows


def summary(rows, out=print):
    for mode in sorted({r[0] for r in rows}):
        rs = [r for r in rows if r[0] == mode]
        g = math.exp(sum(math.log(r[-1]) for r in rs) / len(rs))
        worst = min(rs, key=lambda r: r[-1])
        below = sum(1 for r in rs if r[-1] < 1.0)
        out("%s: %d cases, geomean %.2fx, worst %.2fx (%dx%d s%d d%d C%d H%d), %d below 1.0x" % (
            mode, len(rs), g, worst[-1], worst[1], worst[2], worst[3], worst[4], worst[5],
            worst[6], below))


def main(argv=None):
    p = argparse.ArgumentParser(prog="python bench/bench_dw_shapes.py",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kernels", default="3x3,5x5,7x7,3x5,5x3,1x7,7x1")
    p.add_argument("--strides", default="1,2,3")
    p.add_argument("--dilations", default="1,2")
    p.add_argument("--channels", default="32,256")
    p.add_argument("--planes", default="28,56")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--modes", default="fwd,step", help="fwd, step and/or eval")
    a = p.parse_args(argv)
    ints = lambda text: tuple(int(v) for v in text.split(",") if v)  # noqa: E731
    kernels = tuple(tuple(int(v) for v in k.split("x")) for k in a.kernels.split(",") if k)
    print("| mode | k | stride | dilation | C | H | utensil ms | PyTorch ms | PyTorch/utensil |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = run(a.threads, kernels, ints(a.strides), ints(a.dilations), ints(a.channels),
               ints(a.planes), a.batch, a.reps, tuple(a.modes.split(",")),
               out=lambda s: print(s, flush=True), device=a.device, dtype=a.dtype)
    summary(rows)


if __name__ == "__main__":
    main()
