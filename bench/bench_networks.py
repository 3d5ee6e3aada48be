"""Whole-network training throughput, utensil against the same network in PyTorch (fp32).

    python bench/bench_networks.py [--net v1] [--size 64] [--batch 8] [--threads 2]
                                   [--device cpu] [--steps 20] [--rounds 3]

MobileNet v1 (``models.mobilenet_v1``: 1000 classes, width 1.0) on random images, or the digits
network of utensil-train (``--net digits``: width 32, 8x8 inputs), SGD with momentum 0.9 and
cross-entropy. Both sides start from the same weights (``to_torch``) and train on
the same batches; rounds alternate between the two so a change of machine load hits both. Prints
images/s per side (the median round) and their ratio. Needs torch. On CUDA the PyTorch side runs
with TF32 off (``--tf32`` turns it on), so both compute in fp32.
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
from utensil_ffi import models  # noqa: E402

from bench.compare_mobilenet import to_torch  # noqa: E402


def build(name, device):
    if name == "v1":
        return models.mobilenet_v1(device=device)
    if name == "digits":
        return models.mobilenet(1, 10, 32, device=device)
    raise ValueError("unknown network %r" % (name,))


def utensil_steps(net, opt, batches, device):
    for x, y in batches:
        xb, yb = ut.tensor(x, device), ut.tensor(y.astype(np.float32), device)
        logits = net(xb)
        grad = ut.cross_entropy_backward(logits, yb)
        opt.zero_grad()
        net.backward(grad).close()
        opt.step()
        for t in (xb, yb, logits, grad):
            t.close()
    ut.synchronize()


def torch_steps(torch, tnet, topt, batches, device):
    for x, y in batches:
        xb, yb = torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)
        loss = torch.nn.functional.cross_entropy(tnet(xb), yb)
        topt.zero_grad()
        loss.backward()
        topt.step()
    if device == "cuda":
        torch.cuda.synchronize()


def run(net_name="v1", size=64, batch=8, threads=2, device="cpu", steps=20, rounds=3,
        tf32=False, seed=0):
    import torch

    if threads:
        ut.set_num_threads(threads)
        torch.set_num_threads(threads)
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = bool(tf32)
    ut.seed(seed)
    net = build(net_name, device)
    in_c = 3 if net_name == "v1" else 1
    classes = 1000 if net_name == "v1" else 10
    size = size if net_name == "v1" else 8
    tnet = to_torch(net).to(device)
    opt = ut.SGD(net.parameters(), lr=0.01, momentum=0.9)
    topt = torch.optim.SGD(tnet.parameters(), lr=0.01, momentum=0.9)
    rng = np.random.default_rng(seed)
    batches = [(rng.standard_normal((batch, in_c, size, size)).astype(np.float32),
                rng.integers(0, classes, batch)) for _ in range(steps)]
    rates = {"utensil": [], "torch": []}
    try:
        utensil_steps(net, opt, batches[:2], device)  # warm-up
        torch_steps(torch, tnet, topt, batches[:2], device)
        for _ in range(rounds):
            t0 = time.perf_counter()
            utensil_steps(net, opt, batches, device)
            rates["utensil"].append(steps * batch / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            torch_steps(torch, tnet, topt, batches, device)
            rates["torch"].append(steps * batch / (time.perf_counter() - t0))
    finally:
        opt.close()
        net.close()
    return {k: statistics.median(v) for k, v in rates.items()}


def main(argv=None):
    p = argparse.ArgumentParser(prog="python bench/bench_networks.py", description=__doc__.split(
        "\n\n")[0])
    p.add_argument("--net", default="v1", choices=("v1", "digits"))
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tf32", action="store_true")
    a = p.parse_args(argv)
    r = run(a.net, a.size, a.batch, a.threads, a.device, a.steps, a.rounds, a.tf32)
    size = a.size if a.net == "v1" else 8
    print("%s %s %d^2 batch %d, %s threads, fp32: utensil %.1f img/s, PyTorch %.1f img/s, "
          "utensil/PyTorch %.2fx" % (a.net, a.device, size, a.batch, a.threads, r["utensil"],
                                     r["torch"], r["utensil"] / r["torch"]))


if __name__ == "__main__":
    main()
