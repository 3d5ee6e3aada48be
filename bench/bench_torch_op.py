"""A PyTorch MobileNetV2 training step with and without ``utensil_ffi.interop.torch.convert``.

    python bench/bench_torch_op.py [--device all|cpu|cuda|cpu,cuda] [--threads 2] [--size 224]
                                   [--batch 16 (CPU), 64 (CUDA)] [--width 1.0] [--kernel 3]
                                   [--steps 3] [--rounds 3] [--compile]

MobileNetV2 (torchvision's architecture and parameter names, defined here: torchvision is not
needed; 1000 classes) on random images, on the CPU and (by default, where present) CUDA, SGD with
momentum 0.9 and cross-entropy, fp32 (on CUDA with TF32 off and cudnn.benchmark on). Two copies of
one network: PyTorch's own ("torch") and the same weights after ``convert`` ("converted": its 17
depthwise convolutions on utensil, the rest PyTorch's). First one step of each on the same batch,
whose losses must agree; then rounds alternate between the two so a change of machine load hits
both. Prints images/s per side (the median round; on Linux leaving out rounds in which other
processes took over 10% of the CPUs, when some rounds were quieter) and converted/torch.
``--compile`` wraps both in ``torch.compile`` (inductor). On the CPU both libraries get --threads
threads. The first-step losses differ by float32 rounding only (the depthwise sums run in
another order); the ratio is converted/torch images/s.
"""

import argparse
import copy
import os
import statistics
import sys
import time

if __name__ == "__main__" and __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import utensil_ffi as ut  # noqa: E402


# -- MobileNetV2 (Sandler et al. 2018; torchvision.models.mobilenet_v2's layout) ------------------
def _divisible(v, divisor=8):
    new = max(divisor, int(v + divisor / 2) // divisor * divisor)
    return new + divisor if new < 0.9 * v else new


def mobilenet_v2(num_classes=1000, width=1.0, dropout=0.2, kernel=3):
    """torchvision's MobileNetV2: the same modules and state_dict keys (features.N..., classifier).
    ``kernel`` sets the depthwise filters' size (3 in MobileNetV2; 5 as in MnasNet's and
    EfficientNet's larger blocks)."""
    from torch import nn

    def conv_bn_act(inp, out, k=3, stride=1, groups=1):
        return nn.Sequential(
            nn.Conv2d(inp, out, k, stride, (k - 1) // 2, groups=groups, bias=False),
            nn.BatchNorm2d(out), nn.ReLU6(inplace=True))

    class InvertedResidual(nn.Module):
        def __init__(self, inp, out, stride, expand):
            super().__init__()
            hidden = int(round(inp * expand))
            self.use_res_connect = stride == 1 and inp == out
            layers = [conv_bn_act(inp, hidden, 1)] if expand != 1 else []
            layers += [conv_bn_act(hidden, hidden, kernel, stride, groups=hidden),  # the depthwise
                       nn.Conv2d(hidden, out, 1, bias=False), nn.BatchNorm2d(out)]
            self.conv = nn.Sequential(*layers)

        def forward(self, x):
            return x + self.conv(x) if self.use_res_connect else self.conv(x)

    class MobileNetV2(nn.Module):
        def __init__(self):
            super().__init__()
            inp, last = _divisible(32 * width), _divisible(1280 * max(1.0, width))
            features = [conv_bn_act(3, inp, stride=2)]
            for t, c, n, s in [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2),
                               (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1)]:
                out = _divisible(c * width)
                for i in range(n):
                    features.append(InvertedResidual(inp, out, s if i == 0 else 1, t))
                    inp = out
            features.append(conv_bn_act(inp, last, 1))
            self.features = nn.Sequential(*features)
            self.classifier = nn.Sequential(nn.Dropout(dropout), nn.Linear(last, num_classes))
            for m in self.modules():
                if isinstance(m, nn.Conv2d):
                    nn.init.kaiming_normal_(m.weight, mode="fan_out")
                elif isinstance(m, nn.BatchNorm2d):
                    nn.init.ones_(m.weight)
                    nn.init.zeros_(m.bias)
                elif isinstance(m, nn.Linear):
                    nn.init.normal_(m.weight, 0, 0.01)
                    nn.init.zeros_(m.bias)

        def forward(self, x):
            x = nn.functional.adaptive_avg_pool2d(self.features(x), 1).flatten(1)
            return self.classifier(x)

    return MobileNetV2()


# -- the comparison -------------------------------------------------------------------------------
def _cpu_ticks():
    """(CPU time of every process, of this one) in clock ticks, or None off Linux."""
    try:
        with open("/proc/stat") as f:
            v = [int(t) for t in f.readline().split()[1:]]
        with open("/proc/self/stat") as f:
            mine = f.read().rsplit(")", 1)[1].split()
    except (OSError, ValueError, IndexError):
        return None
    busy = sum(v) - v[3] - (v[4] if len(v) > 4 else 0)  # all but idle and iowait
    return busy, int(mine[11]) + int(mine[12])  # utime + stime


def _others_share(before, after, seconds):
    """The share of all CPUs that other processes used between two _cpu_ticks() (or None)."""
    if before is None or after is None or seconds <= 0:
        return None
    ticks = os.sysconf("SC_CLK_TCK") * seconds * (os.cpu_count() or 1)
    return max(0.0, ((after[0] - before[0]) - (after[1] - before[1])) / ticks)


def _sync(device):
    import torch

    if device == "cuda":
        torch.cuda.synchronize()  # utensil's GPU work is on the default stream: this waits for it


def make_pair(device="cpu", width=1.0, num_classes=1000, seed=0, lr=0.01, dropout=0.2, kernel=3):
    """(torch model, converted model, their SGD optimizers): the same weights on ``device``."""
    import torch

    import utensil_ffi.interop.torch as utt

    torch.manual_seed(seed)
    ref = mobilenet_v2(num_classes, width, dropout, kernel).to(device)
    conv = utt.convert(copy.deepcopy(ref))
    opts = [torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9) for m in (ref, conv)]
    return ref, conv, opts[0], opts[1]


def train_step(model, opt, x, y, seed=None):
    """One SGD step; returns the loss (a 0-d tensor, not synchronized). ``seed`` reseeds
    PyTorch's RNG first, so both networks draw the same dropout masks."""
    import torch

    if seed is not None:
        torch.manual_seed(seed)
    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss


def run(device="cpu", threads=2, size=224, batch=16, width=1.0, steps=3, rounds=3,
        compile=False, num_classes=1000, kernel=3):
    """Images/s of both networks (median round) and the first step's losses. On the CPU both
    libraries run ``threads`` threads (their settings are restored after)."""
    import torch

    saved = torch.get_num_threads(), ut.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(threads)
        ut.set_num_threads(threads)
    try:
        return _run(device, size, batch, width, steps, rounds, compile, num_classes, kernel)
    finally:
        torch.set_num_threads(saved[0])
        ut.set_num_threads(saved[1])


def _run(device, size, batch, width, steps, rounds, compile, num_classes, kernel):
    import torch

    import utensil_ffi.interop.torch as utt

    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    ref, conv, opt_ref, opt_conv = make_pair(device, width, num_classes, kernel=kernel)
    n_dw = sum(isinstance(m, utt.DepthwiseConv2d) for m in conv.modules())
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 3, size, size, generator=g).to(device)
    y = torch.randint(0, num_classes, (batch,), generator=g).to(device)
    losses = {"torch": train_step(ref, opt_ref, x, y, seed=2).item(),
              "converted": train_step(conv, opt_conv, x, y, seed=2).item()}
    sides = {"torch": (ref, opt_ref), "converted": (conv, opt_conv)}
    if compile:
        sides = {k: (torch.compile(m), o) for k, (m, o) in sides.items()}
    for m, o in sides.values():  # warm-up (cudnn.benchmark's search, compilation)
        train_step(m, o, x, y)
        _sync(device)
    rates = {k: [] for k in sides}
    others = []
    for _ in range(rounds):
        t_round, ticks = time.perf_counter(), _cpu_ticks()
        for k, (m, o) in sides.items():
            t0 = time.perf_counter()
            for _ in range(steps):
                train_step(m, o, x, y)
            _sync(device)
            rates[k].append(steps * batch / (time.perf_counter() - t0))
        others.append(_others_share(ticks, _cpu_ticks(), time.perf_counter() - t_round))
    # rounds during which other processes took more than 10% of the CPUs are left out when
    # some were quieter (a shared machine); "rounds" keeps them all
    quiet = [i for i, v in enumerate(others) if v is None or v <= 0.1] or list(range(rounds))
    ips = {k: statistics.median([v[i] for i in quiet]) for k, v in rates.items()}
    return {"img_s": ips, "ratio": ips["converted"] / ips["torch"], "losses": losses,
            "rounds": rates, "others_cpu": others, "quiet_rounds": quiet,
            "depthwise_converted": n_dw}


def _devices(spec):
    """--device: "cpu", "cuda", "cpu,cuda", or "all" (the CPU, and CUDA where both PyTorch and
    utensil have a GPU)."""
    import torch

    have = "cuda" in ut.devices() and torch.cuda.is_available()
    if spec == "all":
        return ["cpu", "cuda"] if have else ["cpu"]
    out = [d for d in spec.split(",") if d]
    for d in out:
        if d not in ("cpu", "cuda"):
            raise SystemExit("bench_torch_op: unknown device %r (cpu, cuda, cpu,cuda or all)" % d)
        if d == "cuda" and not have:
            raise SystemExit("bench_torch_op: no GPU for both libraries (utensil: %s, PyTorch "
                             "sees one: %s)" % (ut.devices(), torch.cuda.is_available()))
    return out


def report(r, device, a, batch):
    where = "%d threads" % a.threads if device == "cpu" else "fp32, TF32 off"
    kernel = "" if a.kernel == 3 else " (%dx%d depthwise)" % (a.kernel, a.kernel)
    print("MobileNetV2 x%g%s %s %d^2 batch %d (%s%s), %d depthwise convs converted" % (
        a.width, kernel, device, a.size, batch, where, ", torch.compile" if a.compile else "",
        r["depthwise_converted"]))
    print("  first-step loss: torch %.6f, converted %.6f" % (r["losses"]["torch"],
                                                             r["losses"]["converted"]))
    for k in ("torch", "converted"):
        print("  %-10s %9.1f img/s   (rounds: %s)" % (
            k, r["img_s"][k], ", ".join("%.1f" % v for v in r["rounds"][k])))
    print("  converted/torch %.2fx" % r["ratio"])
    if r["others_cpu"][0] is not None:
        print("  other processes' share of the CPUs per round: %s; median of rounds %s" % (
            ", ".join("%.0f%%" % (100 * v) for v in r["others_cpu"]),
            ", ".join(str(i + 1) for i in r["quiet_rounds"])))


def main(argv=None):
    p = argparse.ArgumentParser(prog="python bench/bench_torch_op.py",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="all",
                   help="cpu, cuda, cpu,cuda, or all (default: the CPU, and CUDA where present)")
    p.add_argument("--threads", type=int, default=2, help="CPU threads of both libraries")
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--batch", type=int, default=None, help="default: 16 on the CPU, 64 on CUDA")
    p.add_argument("--width", type=float, default=1.0)
    p.add_argument("--kernel", type=int, default=3, help="depthwise kernel size (MobileNetV2: 3)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--compile", action="store_true", help="torch.compile both networks")
    a = p.parse_args(argv)
    for device in _devices(a.device):
        batch = a.batch or (16 if device == "cpu" else 64)
        r = run(device, a.threads, a.size, batch, a.width, a.steps, a.rounds, a.compile,
                kernel=a.kernel)
        report(r, device, a, batch)


if __name__ == "__main__":
    main()
