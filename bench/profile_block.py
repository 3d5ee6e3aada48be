#!/usr/bin/env python3
"""Where one utensil MobileNet-block training step spends its time, layer by layer.

    python bench/profile_block.py [N C H W k stride] [--reps R]

Runs the same block as test_bench_block.py (dw kxk -> BN -> ReLU6 -> pw 1x1 -> BN -> ReLU6,
MSE, backward, SGD momentum) and prints the best-of-R time of each layer's forward and backward,
the loss and the optimizer step, on the bench's thread count (UTENSIL_BENCH_THREADS, default 2).
"""

import argparse
import os
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]
import benchlib as B  # noqa: E402
import utensil_ffi as ut  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("shape", nargs="*", type=int, default=[32, 32, 112, 112, 3, 1])
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    ut.set_num_threads(B.threads())
    shape = tuple(a.shape)
    r = B.UtBlock("cpu", B.op_data("block", shape))
    names = ["dw", "bn1", "relu6a", "pw", "bn2", "relu6b"]
    best = {}

    def tick(key, t0):
        t1 = time.perf_counter()
        best[key] = min(best.get(key, 1e9), t1 - t0)
        return t1

    for _ in range(a.reps):
        t = time.perf_counter()
        r.opt.zero_grad()
        t = tick("zero_grad", t)
        acts = [r.x]
        for name, layer in zip(names, r.net.layers):
            acts.append(layer(acts[-1]))
            t = tick(name + " fwd", t)
        loss = r.crit(acts[-1], r.target)
        g = r.crit.backward()
        t = tick("mse fwd+bwd", t)
        for name, layer in zip(reversed(names), reversed(r.net.layers)):
            g2 = layer.backward(g)
            g.close()
            g = g2
            t = tick(name + " bwd", t)
        r.opt.step()
        t = tick("sgd step", t)
        g.close()
        loss.close()
        r.crit.close()
        for x in acts[1:]:
            x.close()
    total = sum(best.values())
    print("utensil block step %s, %d threads, best of %d (ms):" % (B.shape_id(shape), B.threads(), a.reps))
    for k, v in sorted(best.items(), key=lambda kv: -kv[1]):
        print("  %-12s %8.2f  %4.0f%%" % (k, v * 1e3, 100 * v / total))
    print("  %-12s %8.2f" % ("sum", total * 1e3))
    r.close()


if __name__ == "__main__":
    main()
