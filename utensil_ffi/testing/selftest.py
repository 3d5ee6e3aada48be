"""Self-check of this installation: every op on every present device, against finite differences.

    python -m utensil_ffi.selftest [--device cpu|cuda] [--seed N] [--quiet]

Run it after installing on new hardware, a new driver or a new build. For each op with a
backward and each device that is present it checks, on small random inputs (batch > 1, odd
sizes, stride 2, padding, kh != kw, depthwise dilation and channel multiplier):

  forward   the op's output against the exact float64 numpy implementation of the op in
            utensil_ffi.reference (numpy only, independent of the library);
  fd64      the analytic gradients (utensil's float32 backward) against central finite
            differences of that float64 implementation (eps 1e-6): the gradient is right;
  fd32      the same gradients against central differences of utensil's OWN float32 forward
            (eps 1e-2): forward and backward of the build agree with each other;
  vs cpu    (GPU only) output and gradients against the same op on the CPU.

A last row per device checks mixed precision: a small MobileNet block (conv, batchnorm+ReLU6,
depthwise, pointwise, pooling, linear) run under utensil.MixedPrecision (bfloat16 activations)
against the same network in float32 (checked op by op above): output, input gradient and the
parameter gradients (as one vector) within "bf16 vs f32" (a few bfloat16 steps, 2**-8 each,
through the block).

Each number is a normalized error ||got - want||_2 / ||want||_2, the worst over the op's
outputs and gradients (x, weight, bias). The bounds are in BOUNDS below. It prints one table
and exits 0 if every row passes, 1 otherwise, 2 when it cannot run (the library does not load, a
--device is not present, or UTENSIL_EXPECT_CUDA=1, as .ci/gpu sets it, and no GPU is usable).
It needs only numpy and the library itself.

The cases come from the op table (utensil_ffi/testing/optable.py: each op's samples marked "selftest",
its float64 reference and how to call it); the test suite draws its own from the same table
(tests/test_gradcheck.py through CASES and make_case).
"""

import argparse
import math
import os
import sys
import time

import numpy as np

from . import optable
from . import reference as R
from .optable import Case

__all__ = ["BOUNDS", "CASES", "Case", "make_case", "default_cases", "check_case", "nerr", "main"]

# Normalized-error bounds for each check. float32 arithmetic on these small shapes is accurate to
# ~1e-6; fd32 is limited by float32 rounding in the forward, divided by the 2*eps step.
BOUNDS = {"forward": 1e-4, "fd64": 1e-4, "fd32": 1e-3, "vs cpu": 1e-4, "bf16 vs f32": 3e-2}
FD64_EPS = 1e-6
FD32_EPS = 1e-2


def nerr(got, want):
    """||got - want||_2 / ||want||_2 (absolute error when want is all zeros)."""
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    if got.shape != want.shape:
        return math.inf
    num = float(np.linalg.norm((got - want).ravel()))
    den = float(np.linalg.norm(want.ravel()))
    if not math.isfinite(num):
        return math.inf
    return num / den if den > 0 else num


# -- cases: drawn from the op table (utensil_ffi/testing/optable.py) ------------------------------------
# Each op with a backward (optable.OPS in table order) and its builder: CASES[op](rng, **geometry)
# -> a Case with float32 inputs, the float64 reference and a runner; the geometry not given is
# the table's default for the op.
CASES = {op.name: op.case for op in optable.OPS if op.gradcheck}


def make_case(op, rng, **geometry):
    return CASES[op](rng, **geometry)


def default_cases(rng):
    """The self-check's cases: the table's "selftest" samples, one or two geometries per op
    (stride 1 and 2, padding, kh != kw; depthwise also with dilation and a channel multiplier)."""
    return [op.case(rng, **s.geom) for op, s in optable.samples("selftest")]


# -- the checks -----------------------------------------------------------------------------------
def _fd(f, inputs, names, go, eps):
    """Central differences of sum(f(inputs) * go) with respect to each input in `names`, the step
    taken in that input's dtype (reference.numeric_grad)."""
    out = {}
    for name in names:
        a = dict(inputs)
        a[name] = inputs[name].copy()  # numeric_grad perturbs it in place
        out[name] = R.numeric_grad(lambda _: f(a), a[name], go, eps)
    return out


def check_case(case, device, rng=None, fd32=True, cpu_results=None):
    """Run the checks on one case and device -> {check: normalized error} (and the results).

    Returns (errors, results) where results = (y, grads) of this device, reusable as
    ``cpu_results`` for another device's "vs cpu" check.
    """
    rng = rng if rng is not None else np.random.default_rng(0)
    inputs = case.inputs
    names = list(inputs)
    inputs64 = {k: v.astype(np.float64) for k, v in inputs.items()}
    y_ref = case.ref(inputs64)
    go = rng.standard_normal(y_ref.shape)
    go32 = go.astype(np.float32)
    go = go32.astype(np.float64)
    errs = {}
    runner = case.open(device)
    try:
        y, grads = runner.backward(inputs, go32)
        errs["forward"] = nerr(y, y_ref)
        fd = _fd(case.ref, inputs64, names, go, FD64_EPS)
        errs["fd64"] = max(nerr(grads[k], fd[k]) for k in names)
        if fd32:
            fd = _fd(runner.forward, inputs, names, go, FD32_EPS)
            errs["fd32"] = max(nerr(grads[k], fd[k]) for k in names)
        if cpu_results is not None:
            cy, cg = cpu_results
            errs["vs cpu"] = max([nerr(y, cy)] + [nerr(grads[k], cg[k]) for k in names])
    finally:
        runner.close()
    return errs, (y, grads)


def check_bf16(device, seed=0):
    """{"bf16 vs f32": the worst normalized error of the block's output, input gradient and
    parameter gradients under MixedPrecision against float32} on one device."""
    import utensil_ffi as ut

    rng = np.random.default_rng(seed)
    ut.seed(seed)
    # no bias before a batchnorm (it cancels: its gradient is float32 roundoff, not a signal);
    # the batchnorms fuse relu6 (MobileNetV2's) and hardswish (V3's: the other kinds' kernels)
    net = ut.Sequential(ut.Conv2d(3, 8, 3, stride=2, padding=1, bias=False),
                        ut.BatchNorm2d(8, activation="relu6"),
                        ut.DWConv2d(8, 3, padding=1, bias=False),
                        ut.BatchNorm2d(8, activation="hardswish"),
                        ut.Conv2d(8, 16, 1, bias=True), ut.GlobalAvgPool2d(),
                        ut.Linear(16, 5)).to(device)
    try:
        x = rng.standard_normal((4, 3, 9, 9)).astype(np.float32)
        go = rng.standard_normal((4, 5)).astype(np.float32)
        runs = []
        for model in (net, ut.MixedPrecision(net)):
            net.zero_grad()
            with ut.tensor(x, device) as xt, ut.tensor(go, device) as gt:
                with model(xt) as y, model.backward(gt) as dx:
                    # the parameter gradients as one vector: a parameter whose gradient nearly
                    # cancels (a batchnorm's gain before another batchnorm) has no relative
                    # accuracy of its own in either precision
                    flat = np.concatenate([p.grad.numpy().ravel() for p in net.parameters()])
                    runs.append([y.numpy().copy(), dx.numpy().copy(), flat])
        return {"bf16 vs f32": max(nerr(b, a) for a, b in zip(*runs))}
    finally:
        net.close()


def _passed(errs):
    return all(e <= BOUNDS[k] for k, e in errs.items())


def _fmt(e):
    return "-" if e is None else ("%.1e" % e if math.isfinite(e) else "inf")


def run(devices=None, seed=0, fd32=True, out=None):
    """Check every case on every device; print the table to `out` (stdout); return the rows."""
    import utensil_ffi as ut

    out = out if out is not None else sys.stdout

    devices = devices or ut.devices()
    rows = []
    cols = ["forward", "fd64", "fd32", "vs cpu"]
    head = "%-22s %-6s %-30s " % ("op", "device", "case") + " ".join("%-8s" % c for c in cols)
    head += " %-9s %s" % ("max err", "result")
    print("utensil self-check: library %s, backends: %s, CPU threads: %d" % (
        ut.library_path, ", ".join("%s->%s" % (d, _backend(d)) for d in devices),
        ut.get_num_threads()), file=out)
    print("bounds (normalized error ||got-want||/||want||): %s" % ", ".join(
        "%s <= %g" % kv for kv in BOUNDS.items()), file=out)
    print(head, file=out)
    print("-" * len(head), file=out)
    cases = default_cases(np.random.default_rng(seed))
    for case in cases:
        cpu_res = None
        for dev in (["cpu"] + [d for d in devices if d != "cpu"]):
            if dev not in devices and dev != "cpu":
                continue
            err_msg = None
            try:
                errs, res = check_case(case, dev, np.random.default_rng(seed + 1), fd32=fd32,
                                       cpu_results=cpu_res if dev != "cpu" else None)
                if dev == "cpu":
                    cpu_res = res
            except Exception as e:  # a failing op is a row, not the end of the check
                errs, err_msg = {}, "%s: %s" % (type(e).__name__, e)
            if dev not in devices:
                continue
            ok = err_msg is None and _passed(errs)
            worst = max(errs.values()) if errs else math.inf
            line = "%-22s %-6s %-30s " % (case.op, dev, case.desc[:30])
            line += " ".join("%-8s" % _fmt(errs.get(c)) for c in cols)
            line += " %-9s %s" % (_fmt(worst), "pass" if ok else "FAIL")
            if err_msg:
                line += "  (%s)" % err_msg[:200]
            print(line, file=out)
            rows.append({"op": case.op, "case": case.desc, "device": dev, "errors": errs,
                         "max": worst, "passed": ok, "error": err_msg})
    for dev in devices:
        err_msg = None
        try:
            errs = check_bf16(dev, seed)
        except Exception as e:
            errs, err_msg = {}, "%s: %s" % (type(e).__name__, e)
        ok = err_msg is None and _passed(errs)
        worst = max(errs.values()) if errs else math.inf
        line = "%-22s %-6s %-30s " % ("mixed precision bf16", dev, "MobileNet block vs float32")
        line += " ".join("%-8s" % "-" for _ in cols)
        line += " %-9s %s" % (_fmt(worst), "pass" if ok else "FAIL")
        if err_msg:
            line += "  (%s)" % err_msg[:200]
        print(line, file=out)
        rows.append({"op": "mixed precision bf16", "case": "MobileNet block", "device": dev,
                     "errors": errs, "max": worst, "passed": ok, "error": err_msg})
    return rows


def _backend(dev):
    from .._lib import ffi, lib

    return ffi.string(lib.ut_backend_name(lib.UT_CUDA if dev == "cuda" else lib.UT_CPU)).decode()


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m utensil_ffi.selftest", description=__doc__.split("\n")[0])
    p.add_argument("--device", action="append", choices=["cpu", "cuda"],
                   help="check only this device (repeatable; default: every present device)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    p.add_argument("--no-fd32", action="store_true", help="skip the float32 self-consistency check")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    try:
        import utensil_ffi as ut
    except ImportError as e:
        print("utensil self-check: cannot load the library: %s" % e)
        return 2
    if os.environ.get("UTENSIL_EXPECT_CUDA") == "1" and "cuda" not in ut.devices():
        # .ci/gpu: without this the check covers the CPU alone and prints PASS
        print("utensil self-check: UTENSIL_EXPECT_CUDA=1 but utensil sees no usable GPU "
              "(built without CUDA, or no device); present: %s" % ", ".join(ut.devices()))
        return 2
    devices = args.device or ut.devices()
    missing = [d for d in devices if d not in ut.devices()]
    if missing:
        print("utensil self-check: device(s) not present: %s (present: %s)" % (
            ", ".join(missing), ", ".join(ut.devices())))
        return 2
    rows = run(devices, seed=args.seed, fd32=not args.no_fd32)
    bad = [r for r in rows if not r["passed"]]
    per_dev = {d: len({r["op"] for r in rows if r["device"] == d}) for d in devices}
    print("%d rows, %d failed; ops checked per device: %s; %.1f s" % (
        len(rows), len(bad), ", ".join("%s %d" % kv for kv in per_dev.items()),
        time.perf_counter() - t0))
    print("RESULT: %s" % ("PASS" if not bad else "FAIL"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
