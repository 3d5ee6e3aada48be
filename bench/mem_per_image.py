"""Training-step memory per image on the CPU, utensil against torchvision, one fresh process
per (side, network, batch).

    python bench/mem_per_image.py [--nets convnext_tiny,mobilenet_v3_large] [--size 224]
        [--batches 2,4] [--threads 2] [--python PYTHON]

Each child builds the network (stochastic depth and dropout 0, as bench_networks), SGD with
momentum 0.9 and cross-entropy, and runs one training step, so that gradients and momentum
exist; then it resets the process's peak resident memory (``/proc/self/clear_refs`` "5" resets
VmHWM), notes the resident memory, runs one more step and reports the peak minus that: what
the step itself allocated at its highest (activations kept for backward plus the temporaries
alive at that moment). glibc is told to serve every block over 64 KiB by mmap and to trim at
once (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_), so a freed activation leaves the
resident set and the next step's peak is its own. utensil's layers keep their forward caches
after backward (until the next forward replaces them), so its child drops the warm-up's
(eval() then train()) before the baseline; "held" is the resident memory after the step minus
the baseline: what stays allocated between steps. The per-image figure is the slope between
the two batch sizes (the fixed part, such as the parameters' temporaries, cancels). For utensil
the child also reports the library's own count of live tensor bytes at the end of forward
(``ut.live_bytes()``, where the build has it): what the network keeps for backward. Side
"utensil-free" is utensil with ``ut.set_retain_forward(False)`` (each layer frees what its
forward kept once its backward has used it, as PyTorch does).

Linux only (/proc). The PyTorch children need torchvision (``--python`` picks the interpreter,
by default this one).
"""

import argparse
import json
import os
import subprocess
import sys

_CHILD = r"""
import json, re, sys
side, net_name, size, batch, threads = sys.argv[1:6]
size, batch, threads = int(size), int(batch), int(threads)
import numpy as np

def status(key):
    with open("/proc/self/status") as f:
        return int(re.search(key + r":\s+(\d+)", f.read()).group(1)) * 1024

rng = np.random.default_rng(0)
x_np = rng.standard_normal((batch, 3, size, size)).astype(np.float32)
y_np = rng.integers(0, 1000, batch)
out = {}
if side == "torch":
    import torch, torchvision
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    kw = {"stochastic_depth_prob": 0.0} if net_name.startswith(("convnext", "efficientnet")) else {}
    if net_name.startswith(("mobilenet", "efficientnet")):
        kw["dropout"] = 0.0
    net = getattr(torchvision.models, net_name)(weights=None, num_classes=1000, **kw).train()
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.from_numpy(x_np), torch.from_numpy(y_np)

    def step():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
else:
    sys.path.insert(0, sys.argv[6])
    import inspect
    import utensil_ffi as ut
    from utensil_ffi import models
    ut.set_num_threads(threads)
    builder = getattr(models, net_name)
    params = inspect.signature(builder).parameters
    kw = {k: 0.0 for k in ("dropout", "stochastic_depth_prob") if k in params}
    net = builder(num_classes=1000, **kw)
    net.train()
    opt = ut.SGD(net.parameters(), lr=0.01, momentum=0.9)
    x, y = ut.tensor(x_np), ut.tensor(y_np.astype(np.float32))
    live = getattr(ut, "live_bytes", None)
    if side == "utensil-free":
        ut.set_retain_forward(False)

    def step(note=False):
        base = live() if live else 0
        logits = net(x)
        if note and live:
            out["kept_forward_bytes"] = live() - base
        grad = ut.cross_entropy_backward(logits, y)
        opt.zero_grad()
        net.backward(grad, input_grad=False)
        opt.step()
        logits.close()
        grad.close()

step()
if side != "torch":
    net.eval()  # drops what the warm-up step kept: the measured step starts from none
    net.train()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = status("VmRSS")
step(True) if side != "torch" else step()
out["peak_bytes"] = status("VmHWM") - before
out["held_bytes"] = status("VmRSS") - before
print(json.dumps(out))
"""


def measure(python, side, net, size, batch, threads, root):
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0",
               OMP_NUM_THREADS=str(threads))
    r = subprocess.run([python, "-c", _CHILD, side, net, str(size), str(batch), str(threads),
                        root], capture_output=True, text=True, env=env)
    if r.returncode:
        raise RuntimeError("%s %s batch %d failed:\n%s" % (side, net, batch, r.stderr[-3000:]))
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nets", default="convnext_tiny,mobilenet_v3_large")
    p.add_argument("--sides", default="utensil,utensil-free,torch")
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--batches", default="2,4")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--python", default=sys.executable)
    a = p.parse_args(argv)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    b0, b1 = (int(b) for b in a.batches.split(","))
    mb = 1e6
    print("%-20s %-8s %10s %10s %12s %15s %15s" % (
        "network", "side", "peak@%d MB" % b0, "peak@%d MB" % b1, "peak MB/img",
        "held MB/img", "kept fwd MB/img"))
    for net in a.nets.split(","):
        for side in a.sides.split(","):
            m0 = measure(a.python, side, net, a.size, b0, a.threads, root)
            m1 = measure(a.python, side, net, a.size, b1, a.threads, root)
            def slope(key):
                if key not in m1:
                    return ""
                return "%.1f" % ((m1[key] - m0[key]) / (b1 - b0) / mb)

            print("%-20s %-8s %10.1f %10.1f %12s %15s %15s" % (
                net, side, m0["peak_bytes"] / mb, m1["peak_bytes"] / mb, slope("peak_bytes"),
                slope("held_bytes"), slope("kept_forward_bytes")), flush=True)


if __name__ == "__main__":
    main()
