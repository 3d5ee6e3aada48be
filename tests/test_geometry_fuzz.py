"""Overflowing geometry through the Python API, for every layer and every functional op that takes
sizes: each integer argument replaced by hostile values (near 2**31 and 2**63, negative, zero,
numpy integer types, bools, floats, strings, None), alone and in random combinations, then
forward and backward on inputs that fit, and on inputs that are large for the geometry.

The sweep runs in a child process (this file run as a script) with its address space capped, so
a crash is a signal and a huge but valid size is a MemoryError, not a swapping machine. A case
passes when the call returns a result of the shape the geometry implies (checked against the
formula in exact integers), or raises a utensil_ffi.UtensilError with a message (or
MemoryError). UTENSIL_GEOMETRY_CASES (default 800) sizes the random part.
"""

import json
import math
import os
import random
import resource
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import pytest

try:
    import utensil_ffi as ut
except ImportError:  # run as a script from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import utensil_ffi as ut

CASES = int(os.environ.get("UTENSIL_GEOMETRY_CASES", "800"))
INT_MAX = 2**31 - 1
BIG = 2**22  # outputs above this many elements are not computed (refusals still are)

HOSTILE = [0, 1, 2, 3, -1, -2, 2**15, 2**16 + 1, 2**30 - 1, 2**30, 2**31 - 2, 2**31 - 1, 2**31,
           2**32 + 1, 2**62, 2**63 - 1, 2**63, 2**64, -(2**31), -(2**63), 10**30,
           np.int64(2**31 - 1), np.int64(2**31), np.int32(3), np.int32(-(2**31)), np.uint64(2**63),
           np.uint8(255), np.int8(-1), True, False, np.bool_(True), 3.0, np.float64(2.0), 2.5,
           np.float32(1e10), float("nan"), float("inf"), "3", None, (3,), [2, 2], 1 + 0j]


def _int(v):
    """v as the exact integer a valid argument would be, or None if it is no integer."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        return None
    return int(v)


def _huge(*dims):
    """True when every dim is a valid size and their product is over BIG: a valid request whose
    allocation (and random fill) would take seconds. The CPU child refuses those through its
    address-space cap; a CUDA child has no cap (a CUDA context needs the space), so skips them."""
    n = 1
    for d in dims:
        d = _int(d)
        if d is None or d <= 0:
            return False
        n *= d
    return n > BIG


def conv_out(h, k, s, p):
    return (h + 2 * p - k) // s + 1 if h + 2 * p >= k else None


class Sweep:
    def __init__(self, seed, device):
        self.rng = random.Random(seed)
        self.dev = device
        self.cases = self.ok = self.refused = self.skipped = 0
        self.findings = []

    def record(self, what, e):
        if len(self.findings) < 30:
            self.findings.append("%s -> %s: %s\n%s" % (what, type(e).__name__, e,
                                                     traceback.format_exc()[-1200:]))

    def uncapped_huge(self, *dims):
        if self.dev == "cuda" and _huge(*dims):
            self.skipped += 1
            return True
        return False

    def call(self, what, fn, *args, **kw):
        """fn(...) -> (True, result) or (False, None) when refused cleanly; findings recorded."""
        try:
            return True, fn(*args, **kw)
        except (ut.UtensilError, MemoryError) as e:
            if not str(e).strip():
                self.record(what + " (empty message)", e)
            self.refused += 1
            return False, None
        except Exception as e:  # noqa: BLE001 - a finding
            self.record(what, e)
            return False, None

    def check_shape(self, what, t, shape):
        if t is None:
            return
        if shape is not None and tuple(t.shape) != tuple(shape):
            self.findings.append("%s: output shape %s, geometry says %s" % (what, t.shape, shape))

    # -- layers -----------------------------------------------------------------------------------
    def layer_case(self, kind, args, x_hw, batch=1):
        self.cases += 1
        what = "%s%r on x %s" % (kind, tuple(args), x_hw)
        channels, k = (args[:2], args[2]) if kind == "Conv2d" else (args[:1], args[1])
        if self.uncapped_huge(*channels, *(k if isinstance(k, (tuple, list)) else (k, k))):
            return  # the weight alone
        if kind == "Conv2d":
            cin, cout, k, s, p = args
            ok, l = self.call(what, ut.Conv2d, cin, cout, k, stride=s, padding=p, device=self.dev)
        else:
            cin, k, s, p = args
            cout = cin
            ok, l = self.call(what, ut.DWConv2d, cin, k, stride=s, padding=p, device=self.dev)
        if not ok:
            return
        try:
            kk = tuple(k) if isinstance(k, (tuple, list)) else (k, k)
            kh, kw = int(kk[0]), int(kk[1])
            s, p, cin, cout = int(s), int(p), int(cin), int(cout)
            h, w = x_hw
            if batch * cin * h * w > BIG:
                self.skipped += 1
                return
            ho, wo = conv_out(h, kh, s, p), conv_out(w, kw, s, p)
            shape = None if ho is None or wo is None else (batch, cout, ho, wo)
            n_out = None if shape is None else math.prod(shape)
            if n_out is not None and BIG < n_out <= INT_MAX:
                self.skipped += 1  # valid but large: not computed here
                return
            x = ut.ones((batch, cin, h, w), self.dev)
            try:
                ok, y = self.call(what + " forward", l, x)
                if ok and (shape is None or n_out > INT_MAX):
                    self.findings.append("%s: forward accepted an impossible geometry, output %s"
                                         % (what, y.shape))
                if not ok:
                    return
                self.ok += 1
                self.check_shape(what, y, shape)
                ok, dx = self.call(what + " backward", l.backward, ut.ones(y.shape, self.dev))
                if ok:
                    self.check_shape(what + " backward", dx, (batch, cin, h, w))
                    dx.close()
                y.close()
            finally:
                x.close()
        finally:
            l.close()

    def layers(self, n_random):
        r = self.rng
        # each argument alone through the hostile list, on a few inputs
        for v in HOSTILE:
            for hw in [(1, 1), (3, 3), (7, 5)]:
                self.layer_case("Conv2d", (v, 1, 1, 1, 0), hw)
                self.layer_case("Conv2d", (1, v, 1, 1, 0), hw)
                self.layer_case("Conv2d", (1, 1, v, 1, 0), hw)
                self.layer_case("Conv2d", (1, 1, (1, v), 1, 0), hw)
                self.layer_case("Conv2d", (1, 1, 1, v, 0), hw)
                self.layer_case("Conv2d", (1, 1, 1, 1, v), hw)
                self.layer_case("Conv2d", (1, 1, 3, v, v), hw)
                self.layer_case("DWConv2d", (v, 1, 1, 0), hw)
                self.layer_case("DWConv2d", (1, v, 1, 0), hw)
                self.layer_case("DWConv2d", (1, (v, 2), 1, 1), hw)
                self.layer_case("DWConv2d", (1, 3, v, 0), hw)
                self.layer_case("DWConv2d", (1, 3, 1, v), hw)
                self.layer_case("DWConv2d", (2, 3, v, v), hw)
            for cls, args in ((ut.Linear, (v, 2)), (ut.Linear, (2, v)), (ut.LayerNorm, (v,)),
                              (ut.BatchNorm2d, (v,))):
                self.cases += 1
                if self.uncapped_huge(*args):
                    continue
                ok, l = self.call("%s%r" % (cls.__name__, args), cls, *args, device=self.dev)
                if ok:
                    l.close()
        # random combinations of near-limit integers
        near = [1, 2, 3, 7, 2**15 - 1, 2**15, 2**16, 2**20, 2**30 - 1, 2**30, 2**31 - 2,
                2**31 - 1, 2**31, 2**32, 2**63 - 1]
        for _ in range(n_random):
            g = lambda: r.choice(near) if r.random() < 0.6 else r.randint(0, 9)  # noqa: E731
            hw = (r.choice([1, 2, 5, 64, 2**10, 2**12]), r.choice([1, 2, 5, 64, 2**12]))
            if r.random() < 0.5:
                self.layer_case("Conv2d", (r.randint(1, 3), r.randint(1, 3),
                                           (g(), g()) if r.random() < 0.5 else g(), g(), g()), hw,
                                r.randint(1, 2))
            else:
                self.layer_case("DWConv2d", (r.randint(1, 3), (g(), g()), g(), g()), hw,
                                r.randint(1, 2))

    # -- functional ops and constructors with sizes ----------------------------------------------
    def functional(self):
        d = self.dev
        with ut.ones((2, 3), d) as a, ut.ones((2, 3, 4, 5), d) as x4:
            for v in HOSTILE:
                for what, fn, args in [
                    ("zeros", ut.zeros, ((v,),)), ("zeros2", ut.zeros, ((2, v),)),
                    ("ones", ut.ones, ((v, 1, 2),)), ("full", ut.full, ((v,), 1.0)),
                    ("randn", ut.randn, ((1, v),)), ("transpose", ut.transpose, (a, v, 0)),
                    ("transpose1", ut.transpose, (x4, 0, v)),
                    ("Tensor.transpose", a.transpose, (v, 1)),
                    ("reshape", a.reshape, ((v,),)), ("reshape2", a.reshape, ((v, -1),)),
                    ("reshape3", a.reshape, (v,)),
                    ("gap_bwd_h", ut.global_avg_pool2d_backward, (a, v, 1)),
                    ("gap_bwd_w", ut.global_avg_pool2d_backward, (a, 2, v)),
                    ("gap_bwd_hw", ut.global_avg_pool2d_backward, (a, v, v)),
                    ("seed", ut.seed, (v,)), ("set_num_threads", ut.set_num_threads, (v,)),
                ]:
                    self.cases += 1
                    size = {"zeros": (v,), "zeros2": (2, v), "ones": (v, 2), "full": (v,),
                            "randn": (v,), "gap_bwd_h": (6, v), "gap_bwd_w": (6, v),
                            "gap_bwd_hw": (6, v, v)}.get(what)
                    if size and self.uncapped_huge(*size):
                        continue
                    n0 = ut.get_num_threads()
                    ok, out = self.call("%s(%r)" % (what, v), fn, *args)
                    if what == "set_num_threads":
                        ut.set_num_threads(n0)
                    if ok:
                        self.ok += 1
                        n = _int(v)
                        if what == "gap_bwd_hw" and out is not None:
                            self.check_shape(what, out, (2, 3, n, n))
                        if isinstance(out, ut.Tensor) and out is not a:
                            out.close()
                # optimizer step counts
                with ut.zeros((2,), d) as p, ut.zeros((2,), d) as g, ut.zeros((2,), d) as m, \
                        ut.zeros((2,), d) as vv:
                    self.cases += 1
                    self.call("adam_step(step=%r)" % (v,), ut.adam_step, p, g, m, vv, v)
        # the big 2-D helpers: a matmul whose product would overflow int is refused cleanly
        for m, k, n in [(2**16, 1, 2**16), (2**31 - 1, 1, 1), (1, 2**31 - 1, 1), (46341, 1, 46341)]:
            self.cases += 1
            if self.uncapped_huge(m, k) or self.uncapped_huge(k, n):
                continue
            ok, a = self.call("zeros(%d, %d)" % (m, k), ut.zeros, (m, k), d)
            ok2, b = self.call("zeros(%d, %d)" % (k, n), ut.zeros, (k, n), d)
            if ok and ok2:
                ok3, c = self.call("matmul %dx%dx%d" % (m, k, n), ut.matmul, a, b)
                if ok3:
                    self.check_shape("matmul", c, (m, n))
                    c.close()
            for t in (a, b):
                if t is not None:
                    t.close()


def main():
    device = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    n_random = int(sys.argv[2]) if len(sys.argv) > 2 else CASES
    if not ut.cuda_available() and "asan" not in os.environ.get("LD_PRELOAD", ""):
        with open("/proc/self/statm") as f:
            vm = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        cap = vm + (3 << 30)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    ut.set_num_threads(min(ut.get_num_threads(), 2))
    live0 = ut.live_tensors()
    t0 = time.perf_counter()
    s = Sweep(12345, device)
    s.functional()
    s.layers(n_random)
    import gc

    gc.collect()
    print(json.dumps({"cases": s.cases, "ok": s.ok, "refused": s.refused, "skipped": s.skipped,
                      "findings": s.findings, "seconds": time.perf_counter() - t0,
                      "leaked": ut.live_tensors() - live0}))


@pytest.mark.timeout(960)  # the child has its own limit, below
def test_hostile_geometry_sweep(device):
    env = dict(os.environ)
    root = str(Path(ut.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
    if device == "cpu":
        # without a GPU the child caps its address space, so that valid but huge geometries are
        # refused for memory instead of computed for minutes (a CUDA context needs the space)
        env["CUDA_VISIBLE_DEVICES"] = ""
    r = subprocess.run([sys.executable, "-W", "ignore", __file__, device, str(CASES)],
                       capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, "the geometry sweep died (return code %d)\n%s" % (
        r.returncode, r.stderr[-4000:])
    rep = json.loads(r.stdout.strip().splitlines()[-1])
    print("\ngeometry sweep on %s: %d cases (%d computed, %d refused cleanly, %d large valid ones "
          "skipped) in %.1f s" % (device, rep["cases"], rep["ok"], rep["refused"], rep["skipped"],
                                  rep["seconds"]))
    assert not rep["findings"], "\n\n".join(rep["findings"])
    assert rep["leaked"] == 0
    assert rep["ok"] > 100 and rep["refused"] > 1000


if __name__ == "__main__":
    main()
