"""Where a whole network's training step spends its time, by module class: exclusive wall time.

    python bench/profile_modules.py [--net convnext_tiny] [--size 64] [--batch 8] [--threads 2]
                                    [--device cpu] [--steps 5]

Every module class of the network (and the optimizer's step and zero_grad) is timed around its
forward and backward, minus the time of the modules it calls, so the lines add up to the step:
a nested network (the model zoo's, where profile_network.py's flat walk does not reach) read as
"PointwiseLinear backward 72 ms, GELU forward 7 ms". Python's timers cost a little per call;
the line "step" is the timed step with them on, "untimed step" the same step without.
On the GPU, kernels run asynchronously: a module's time is then its launches, not its kernels
(profile_kernels.py times those).
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
from bench.bench_networks import build, stage, utensil_step, zoo_names  # noqa: E402

PHASES = ("forward", "backward", "_backward_from")


class _Timers:
    """Wraps methods in place; exclusive time per (class name, phase); undone by restore().
    A method wrapped on a class is labelled by the class of the object it runs on."""

    def __init__(self):
        self.excl = collections.Counter()
        self._stack = []
        self._undo = []
        self._wrapped = set()

    def wrap(self, owner, attr, label=None):
        if (owner, attr) in self._wrapped:
            return
        self._wrapped.add((owner, attr))
        f = getattr(owner, attr)

        def timed(*args, **kwargs):
            key = label or (type(args[0]).__name__, attr.strip("_"))
            t0 = time.perf_counter()
            self._stack.append(0.0)
            try:
                return f(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                inner = self._stack.pop()
                self.excl[key] += dt - inner
                if self._stack:
                    self._stack[-1] += dt

        self._undo.append((owner, attr, owner.__dict__[attr] if isinstance(owner, type) else None))
        setattr(owner, attr, timed)

    def restore(self):
        for owner, attr, old in reversed(self._undo):
            if old is None:
                delattr(owner, attr)  # the instance attribute; the class's method shows again
            else:
                setattr(owner, attr, old)
        self._undo.clear()
        self._wrapped.clear()


def profile(net_name="convnext_tiny", size=64, batch=8, threads=2, device="cpu", steps=5):
    """({(class, phase): seconds per step}, timed step seconds, untimed step seconds)."""
    ut.set_num_threads(threads)
    ut.seed(0)
    net = build(net_name, device)
    net.train()
    opt = ut.SGD(net.parameters(), lr=0.01, momentum=0.9)
    rng = np.random.default_rng(0)
    x, y = stage([(rng.standard_normal((batch, 3, size, size)).astype(np.float32),
                   rng.integers(0, 1000, batch))], device)[0]
    timers = _Timers()
    try:
        def timed_steps():
            t0 = time.perf_counter()
            for _ in range(steps):
                utensil_step(net, opt, x, y)
            ut.synchronize()
            return (time.perf_counter() - t0) / steps

        utensil_step(net, opt, x, y)  # warm-up
        plain = timed_steps()
        for cls in {type(m) for m in net.modules()}:
            for phase in PHASES:
                owner = next((c for c in cls.__mro__ if phase in c.__dict__), None)
                if owner is not None:
                    timers.wrap(owner, phase)
        timers.wrap(opt, "step", ("SGD", "step"))
        timers.wrap(opt, "zero_grad", ("SGD", "zero_grad"))
        utensil_step(net, opt, x, y)
        timers.excl.clear()
        timed = timed_steps()
    finally:
        timers.restore()
        opt.close()
        net.close()
    return {k: v / steps for k, v in timers.excl.items()}, timed, plain


def main(argv=None):
    p = argparse.ArgumentParser(prog="python bench/profile_modules.py",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--net", default="convnext_tiny", choices=["v1"] + zoo_names())
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--steps", type=int, default=5)
    a = p.parse_args(argv)
    per, timed, plain = profile(a.net, a.size, a.batch, a.threads, a.device, a.steps)
    print("%s %s %d^2 batch %d, %d threads: step %.1f ms with the timers, untimed step %.1f ms "
          "(%.1f img/s)" % (a.net, a.device, a.size, a.batch, a.threads, timed * 1e3, plain * 1e3,
                           a.batch / plain))
    for (cls, phase), t in sorted(per.items(), key=lambda kv: -kv[1]):
        print("  %-22s %-13s %8.2f ms  %5.1f%%" % (cls, phase, t * 1e3, 100 * t / timed))
    return per, timed, plain


if __name__ == "__main__":
    main()
