#!/usr/bin/env python3
"""Turn a pytest-benchmark run of bench/ into a markdown table and a target summary.

USAGE
  python bench/report.py RUN.json [RUN2.json ...] [--beside OTHER.json [--beside OTHER2.json]] [--bandwidth GBPS] [--stat median|min]
                         [--title TITLE] [--device cpu|cuda]

  RUN.json      written by `python -m pytest bench --benchmark-json=RUN.json ...`; several
                files are merged (e.g. a re-run of a few cases; later files win)
  --beside      a second run of the same suite (e.g. the default glibc allocator) whose times are
                shown in extra columns next to RUN's
  --bandwidth   the memory-bandwidth roofline in GB/s (read + write) for every device; default:
                the best copy probe the run measured on that device (1 GiB session probes and
                256 MiB per-test probes), and 4300 GB/s for cuda when the run has none
  --stat        which per-benchmark statistic is compared (default median)

Per op and shape: utensil's time, PyTorch's time, the ratio torch/ours (> 1: utensil faster),
the GB/s utensil achieved moving the op's minimal bytes (formulas in op_bytes below) and its
fraction of the bandwidth roofline, utensil's GFLOP/s for the convolutions, and the copy
bandwidth probed just before that benchmark ran (the machine's state at the time). Then each
target of the issue: the number, met or missed.
"""

import argparse
import json
import math
import sys
from collections import OrderedDict

F32 = 4
TINY = (1, 2, 3, 3, 2, 1)
H200_GBS = 4300.0


def out_hw(h, w, k, s, p):
    return (h + 2 * p - k) // s + 1, (w + 2 * p - k) // s + 1


def conv_geom(op, shape):
    """(k, stride, pad) the op actually used on this (N, C, H, W, k, stride) shape."""
    n, c, h, w, k, s = shape
    if op.startswith("conv1x1"):
        return 1, 1, 0
    if op.startswith("conv3x3"):
        return 3, s, 1
    return k, s, k // 2


def op_bytes(op, shape):
    """Minimal bytes: every input read once, every output written once (float32).

    dw_fwd      x + w + b + y
    dw_bwd      g + x + w  read;  dx written;  dW, db read and written (they accumulate)
    relu6_bwd   g + x read;  dx written
    convKxK_fwd x + W + b + y                       (W: C*C*k*k)
    convKxK_bwd g + x + W read;  dx written;  dW, db read and written
    bn_fwd      x read, y written;  gamma, beta, running mean/var (4C read, 2C written)
    bn_bwd      g + x read, dx written;  gamma, saved mean/rstd read;  dgamma, dbeta read+written
    overhead    as dw_fwd (tiny shape; the number is meaningless there)
    block       None (several ops; compared by time only)
    """
    n, c, h, w, k, s = shape
    kk, ss, p = conv_geom(op, shape)
    ho, wo = out_hw(h, w, kk, ss, p)
    x, y = n * c * h * w, n * c * ho * wo
    if op in ("dw_fwd", "overhead"):
        e = x + c * kk * kk + c + y
    elif op == "dw_bwd":
        e = y + x + c * kk * kk + x + 2 * (c * kk * kk + c)
    elif op == "relu6_bwd":
        e = 3 * x
    elif op.startswith("conv") and op.endswith("_fwd"):
        e = x + c * c * kk * kk + c + y
    elif op.startswith("conv") and op.endswith("_bwd"):
        e = y + x + c * c * kk * kk + x + 2 * (c * c * kk * kk + c)
    elif op == "bn_fwd":
        e = 2 * x + 6 * c
    elif op == "bn_bwd":
        e = 3 * x + 7 * c
    else:
        return None
    return e * F32


def op_flops(op, shape):
    """Multiply-adds x 2 (forward); backward = dx + dW = 2x forward. Convolutions only."""
    n, c, h, w, k, s = shape
    kk, ss, p = conv_geom(op, shape)
    ho, wo = out_hw(h, w, kk, ss, p)
    if op.startswith("dw_"):
        f = 2.0 * n * c * ho * wo * kk * kk
    elif op.startswith("conv"):
        f = 2.0 * n * c * c * ho * wo * kk * kk
    else:
        return None
    return f * (2 if op.endswith("_bwd") else 1)


OP_ORDER = ["dw_fwd", "dw_bwd", "relu6_bwd", "conv1x1_fwd", "conv1x1_bwd", "conv3x3_fwd",
            "conv3x3_bwd", "bn_fwd", "bn_bwd", "block", "overhead"]
OP_LABEL = {
    "dw_fwd": "depthwise fwd", "dw_bwd": "depthwise bwd (dx,dW,db)", "relu6_bwd": "relu6 bwd",
    "conv1x1_fwd": "conv 1x1 fwd", "conv1x1_bwd": "conv 1x1 bwd", "conv3x3_fwd": "conv 3x3 fwd",
    "conv3x3_bwd": "conv 3x3 bwd", "bn_fwd": "batchnorm2d fwd (train)",
    "bn_bwd": "batchnorm2d bwd", "block": "MobileNet block train step",
    "overhead": "tiny dw fwd: layer / cffi",
}


class Run:
    """Benchmark JSON(s): times[(op, device, shape)][impl] = seconds (later files win)."""

    def __init__(self, paths, stat):
        if isinstance(paths, str):
            paths = [paths]
        self.path = " + ".join(paths)
        self.meta = {}
        benchmarks = []
        probes = []
        for p in paths:
            with open(p) as f:
                j = json.load(f)
            m = j.get("utensil_bench", {})
            probes += m.get("session_probes", [])
            self.meta = dict(m, session_probes=probes)
            benchmarks += j["benchmarks"]
        self.times = OrderedDict()
        self.probes = {}
        self.best_probe = {}
        for b in benchmarks:
            e = b.get("extra_info", {})
            if "op" not in e:
                continue
            key = (e["op"], e["device"], tuple(e["shape"]))
            self.times.setdefault(key, {})[e["impl"]] = b["stats"][stat]
            if e.get("probe_gbs"):
                self.probes.setdefault(key, {})[e["impl"]] = e["probe_gbs"]
                d = e["device"]
                self.best_probe[d] = max(self.best_probe.get(d, 0.0), e["probe_gbs"])
        for p in self.meta.get("session_probes", []):
            d = p["device"]
            self.best_probe[d] = max(self.best_probe.get(d, 0.0), p["gbs"])

    def t(self, op, dev, shape, impl):
        return self.times.get((op, dev, shape), {}).get(impl)


def fmt_ms(t):
    if t is None:
        return "—"
    ms = t * 1e3
    if ms >= 100:
        return "%.0f" % ms
    if ms >= 10:
        return "%.1f" % ms
    if ms >= 1:
        return "%.2f" % ms
    if ms >= 0.01:
        return "%.3f" % ms
    return "%.4f" % ms


def ratio(a, b):
    return a / b if a and b else None


def fmt_ratio(r):
    return "—" if r is None else ("%.2f" % r if r < 100 else "%.0f" % r)


def geomean(xs):
    xs = [x for x in xs if x]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def shape_str(shape):
    return "%d,%d,%d,%d k%d s%d" % shape


def bandwidth_for(run, dev, override):
    if override:
        return override
    if run.best_probe.get(dev):
        return run.best_probe[dev]
    return H200_GBS if dev == "cuda" else None


def table(run, beside, bw_override, devices):
    lines = []
    head = ["op", "N,C,H,W k s", "dev", "ours ms", "torch ms", "torch/ours", "GB/s", "% BW",
            "GFLOP/s"]
    if beside:
        head += ["default: ours ms", "torch ms", "torch/ours"]
    head += ["probe GB/s"]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(head))
    keys = sorted(run.times, key=lambda k: (devices.index(k[1]) if k[1] in devices else 9,
                                            OP_ORDER.index(k[0]) if k[0] in OP_ORDER else 99))
    for key in keys:
        op, dev, shape = key
        if dev not in devices:
            continue
        impls = run.times[key]
        ours, theirs = impls.get("ours"), impls.get("torch")
        bw = bandwidth_for(run, dev, bw_override)
        nb, nf = op_bytes(op, shape), op_flops(op, shape)
        gbs = nb / ours / 1e9 if (nb and ours and shape != TINY) else None
        gfs = nf / ours / 1e9 if (nf and ours and shape != TINY) else None
        ours_s = fmt_ms(ours)
        if op == "overhead" and impls.get("cffi"):
            ours_s = "%s / %s" % (fmt_ms(ours), fmt_ms(impls["cffi"]))
        row = [OP_LABEL.get(op, op), shape_str(shape), dev, ours_s, fmt_ms(theirs),
               fmt_ratio(ratio(theirs, ours)),
               "—" if gbs is None else "%.1f" % gbs,
               "—" if (gbs is None or not bw) else "%.0f%%" % (100 * gbs / bw),
               "—" if gfs is None else "%.0f" % gfs]
        if beside:
            bo, bt = beside.t(op, dev, shape, "ours"), beside.t(op, dev, shape, "torch")
            row += [fmt_ms(bo), fmt_ms(bt), fmt_ratio(ratio(bt, bo))]
        pr = run.probes.get(key, {})
        row.append("/".join("%.0f" % pr[i] for i in ("ours", "torch") if i in pr) or "—")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def big_shapes(run, op, dev):
    return [s for (o, d, s) in run.times if o == op and d == dev and s != TINY]


def verdict(ok):
    return "—" if ok is None else ("**met**" if ok else "**missed**")


def targets(run, bw_override, dev):
    """[(target, number, verdict)] for the issue's targets on ``dev``."""
    out = []
    bw = bandwidth_for(run, dev, bw_override)
    t = run.t

    def fb(shape, impl):
        a, b = t("dw_fwd", dev, shape, impl), t("dw_bwd", dev, shape, impl)
        return a + b if a and b else None

    dws = big_shapes(run, "dw_fwd", dev)
    fwdbwd = {s: ratio(fb(s, "torch"), fb(s, "ours")) for s in dws}
    fwdbwd = {s: r for s, r in fwdbwd.items() if r}
    per_shape = ", ".join("%s: %.2f" % (shape_str(s), r) for s, r in fwdbwd.items())
    g = geomean(fwdbwd.values())
    if dev == "cpu":
        g_all = geomean(list(fwdbwd.values()) + [ratio(fb(TINY, "torch"), fb(TINY, "ours"))])
        out.append(("depthwise fwd+bwd ≥ 2× faster than torch (geomean)",
                    "%s (with the tiny shape: %s); per shape %s" % (fmt_ratio(g), fmt_ratio(g_all), per_shape),
                    verdict(None if g is None else g >= 2)))
        s55 = [s for s in big_shapes(run, "dw_bwd", dev) if s[4] == 5]
        r55 = [ratio(t("dw_bwd", dev, s, "torch"), t("dw_bwd", dev, s, "ours")) for s in s55]
        r55 = [r for r in r55 if r]
        out.append(("depthwise 5×5 backward ≥ 20× faster than torch",
                    ", ".join("%.1f×" % r for r in r55) or "—",
                    verdict(None if not r55 else min(r55) >= 20)))
        fr = []
        for s in big_shapes(run, "relu6_bwd", dev):
            o = t("relu6_bwd", dev, s, "ours")
            if o and bw:
                fr.append((s, op_bytes("relu6_bwd", s) / o / 1e9 / bw))
        out.append(("relu6 backward ≥ 50%% of the bandwidth roofline (%s GB/s)" % ("%.0f" % bw if bw else "?"),
                    ", ".join("%s: %.0f%%" % (shape_str(s), 100 * f) for s, f in fr) or "—",
                    verdict(None if not fr else min(f for _, f in fr) >= 0.5)))
        worst = []
        for op in ("conv3x3_fwd", "conv3x3_bwd"):
            for s in big_shapes(run, op, dev):
                o, th = t(op, dev, s, "ours"), t(op, dev, s, "torch")
                if o and th:
                    worst.append((o / th, op, s))
        if worst:
            w = max(worst)
            fwd = [x[0] for x in worst if x[1] == "conv3x3_fwd"]
            bwd = [x[0] for x in worst if x[1] == "conv3x3_bwd"]
            num = "ours/torch time: fwd %s, bwd %s; worst %.2f× (%s %s)" % (
                "/".join("%.2f" % x for x in fwd), "/".join("%.2f" % x for x in bwd), w[0], w[1], shape_str(w[2]))
            out.append(("dense 3×3 conv ≤ 1.5× torch's time", num, verdict(w[0] <= 1.5)))
    else:
        fr = []
        for s in dws:
            o = t("dw_fwd", dev, s, "ours")
            if o and bw:
                fr.append((s, op_bytes("dw_fwd", s) / o / 1e9 / bw))
        out.append(("depthwise fwd ≥ 60%% of copy bandwidth (%.0f GB/s)" % bw if bw else "depthwise fwd ≥ 60% BW",
                    ", ".join("%s: %.0f%%" % (shape_str(s), 100 * f) for s, f in fr) or "—",
                    verdict(None if not fr else min(f for _, f in fr) >= 0.6)))
        out.append(("depthwise fwd+bwd ≥ 3× torch (geomean), never slower",
                    "%s; per shape %s" % (fmt_ratio(g), per_shape),
                    verdict(None if g is None else (g >= 3 and min(fwdbwd.values()) >= 1))))
    o = t("overhead", dev, TINY, "ours")
    c = t("overhead", dev, TINY, "cffi")
    out.append(("Python call overhead, tiny forward ≤ 5 µs",
                "layer %s µs, bare cffi call %s µs" % ("—" if o is None else "%.1f" % (o * 1e6),
                                                        "—" if c is None else "%.1f" % (c * 1e6)),
                verdict(None if o is None else o <= 5e-6)))
    blk = {s: ratio(t("block", dev, s, "torch"), t("block", dev, s, "ours"))
           for (op, d, s) in run.times if op == "block" and d == dev}
    blk = {s: r for s, r in blk.items() if r}
    out.append(("MobileNet block train step faster than torch eager",
                "torch/ours %s (geomean %s)" % (", ".join("%s: %.2f" % (shape_str(s), r) for s, r in blk.items()),
                                                fmt_ratio(geomean(blk.values()))),
                verdict(None if not blk else min(blk.values()) > 1)))
    return out


def describe(run, bw_override, dev):
    m = run.meta
    bw = bandwidth_for(run, dev, bw_override)
    probes = [p["gbs"] for p in m.get("session_probes", []) if p["device"] == dev]
    per = [v for k, d in run.probes.items() if k[1] == dev for v in d.values()]
    s = ("`%s`: %s threads, torch %s, allocator env %s, full shapes %s; bandwidth roofline %s GB/s "
         "(%s)" % (run.path, m.get("threads"), m.get("torch"), m.get("malloc_env") or "default glibc",
                   m.get("full_shapes"), "%.1f" % bw if bw else "?",
                   "given" if bw_override else ("best copy probe of the run" if run.best_probe.get(dev) else "H200 default")))
    if probes or per:
        s += "; copy probes: session %s GB/s, per test min/median/max %s GB/s" % (
            "/".join("%.1f" % p for p in probes) or "—",
            "%.1f/%.1f/%.1f" % (min(per), sorted(per)[len(per) // 2], max(per)) if per else "—")
    if m.get("loadavg"):
        s += "; load average at the end %.1f" % m["loadavg"][0]
    return s


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("run", nargs="+")
    ap.add_argument("--beside", action="append",
                    help="a second run (e.g. default allocator) shown next to RUN (repeat to merge)")
    ap.add_argument("--bandwidth", type=float, help="roofline GB/s (read + write)")
    ap.add_argument("--stat", default="median", choices=["median", "min", "mean"])
    ap.add_argument("--title", default=None)
    ap.add_argument("--device", action="append", help="only these devices (default: all in the run)")
    a = ap.parse_args(argv)
    run = Run(a.run, a.stat)
    beside = Run(a.beside, a.stat) if a.beside else None
    devs = a.device or [d for d in ("cpu", "cuda") if any(k[1] == d for k in run.times)]
    w = sys.stdout.write
    if a.title:
        w("### %s\n\n" % a.title)
    for dev in devs:
        w("Run: %s.\n" % describe(run, a.bandwidth, dev))
        if beside:
            w("Beside: %s.\n" % describe(beside, a.bandwidth, dev))
        w("Times are the %s per call; torch/ours > 1 means utensil is faster.\n\n" % a.stat)
        w(table(run, beside, a.bandwidth, [dev]) + "\n\n")
        w("Targets on %s:\n\n| target | measured | |\n|---|---|---|\n" % dev)
        for name, num, v in targets(run, a.bandwidth, dev):
            w("| %s | %s | %s |\n" % (name, num, v))
        if beside:
            w("\nThe same targets from the beside run (%s):\n\n| target | measured | |\n|---|---|---|\n" % beside.path)
            for name, num, v in targets(beside, a.bandwidth, dev):
                w("| %s | %s | %s |\n" % (name, num, v))
        w("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
