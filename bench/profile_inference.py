"""Where utensil's CPU inference spends its time: an eval forward of a network split by the kind of
folded convolution step (issue 32: every convolution + BatchNorm2d runs as one step, timed as
one; a separable chain, [1x1] -> depthwise -> [squeeze-and-excitation] -> 1x1, as one "block"
step), with each kind's GFLOP/s, and the rest (residual adds, pooling, the classifier,
Python).

    python bench/profile_inference.py [--net mobilenet_v2] [--size 224] [--batch 1]
                                      [--threads 2] [--calls 5] [--by-shape] [--onnxruntime]
                                      [--no-separable]

``--no-separable`` runs each chain as its folded pairs (fold.set_separable_fold(False)), so
every convolution is timed by its own kind (what the onnxruntime split is comparable with).

The network and its BatchNorm statistics are bench_inference.py's. Timings are wall-clock
around each C call, so on a busy machine compare shares, not milliseconds. ``--onnxruntime``
then splits onnxruntime's run of the same network (utensil's own export, as bench_inference.py
runs it) by the same kinds, from its session profile (each node's kernel time): where the gap
between the two engines lies.
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
from utensil_ffi.nn import fold  # noqa: E402

from bench.bench_inference import _randomise_bn  # noqa: E402
from bench.bench_networks import build, zoo_names  # noqa: E402


def _kind(conv):
    kh, kw = conv.kernel_size
    if isinstance(conv, ut.DWConv2d):
        return "dw %dx%d s%d" % (kh, kw, conv.stride)
    return "conv %dx%d s%d" % (kh, kw, conv.stride)


def _flops(conv, y):
    """2 x the multiply-adds of the convolution that wrote y [N, O, Ho, Wo]."""
    kh, kw = conv.kernel_size
    n, o, ho, wo = y.shape
    per_out = kh * kw * (1 if isinstance(conv, ut.DWConv2d) else conv.in_channels)
    return 2.0 * n * o * ho * wo * per_out


def _block_kind(plan):
    expand, dw, _, se = plan
    return "block %s%s%s" % ("1x1+" if expand is not None else "", _kind(dw[0]),
                             "+se" if se is not None else "")


def _block_conv_flops(plan, x, y):
    """[(kind, 2 x multiply-adds)] of the chain's three convolutions, x -> y [N, O, Ho, Wo]
    (its squeeze-and-excitation's, under 1%, left out)."""
    expand, dw, project, _ = plan
    n, cin, h, w = x.shape
    _, o, ho, wo = y.shape
    e = dw[0].channels
    kh, kw = dw[0].kernel_size
    out = [(_kind(expand[0]), 2.0 * n * e * h * w * cin)] if expand is not None else []
    return out + [(_kind(dw[0]), 2.0 * n * e * ho * wo * kh * kw),
                  (_kind(project[0]), 2.0 * n * o * ho * wo * e)]


def _block_flops(plan, x, y):
    return sum(f for _, f in _block_conv_flops(plan, x, y))


def profile(net_name, size, batch, threads, calls, by_shape=False, separable=True):
    ut.set_num_threads(threads)
    net = build(net_name, "cpu")
    net.eval()
    _randomise_bn(net, np.random.default_rng(0))
    x = ut.tensor(np.random.default_rng(1).standard_normal((batch, 3, size, size)), "cpu")
    secs, flops = collections.Counter(), collections.Counter()
    # FLOPs by convolution kind whatever the steps: a block's three convolutions each under its
    # own kind, so onnxruntime's kinds (it runs every convolution as a node) get their rates
    conv_flops = collections.Counter()
    real = fold.conv_bn_forward

    def timed(conv, bn, xin, act=0):
        t0 = time.perf_counter()
        y = real(conv, bn, xin, act)
        k = _kind(conv)
        if by_shape:  # each layer shape on its own line: which GEMM or plane shape is slow
            k += " %4d->%-4d %3dx%-3d" % (getattr(conv, "in_channels", y.shape[1]), y.shape[1], y.shape[2], y.shape[3])
        secs[k] += time.perf_counter() - t0
        flops[k] += _flops(conv, y)
        conv_flops[_kind(conv)] += _flops(conv, y)
        return y

    real_block = fold.separable_forward

    def timed_block(plan, xin, residual=False):
        t0 = time.perf_counter()
        y = real_block(plan, xin, residual)
        k = _block_kind(plan)
        if by_shape:
            k += " %4d->%-4d %3dx%-3d" % (xin.shape[1], y.shape[1], y.shape[2], y.shape[3])
        secs[k] += time.perf_counter() - t0
        flops[k] += _block_flops(plan, xin, y)
        for kind, f in _block_conv_flops(plan, xin, y):
            conv_flops[kind] += f
        return y

    fold.conv_bn_forward = timed  # fold_steps' steps and the blocks look them up at each call
    fold.separable_forward = timed_block
    prev_sep = fold.set_separable_fold(separable)
    try:
        for _ in range(2):
            net(x).close()
        secs.clear()
        flops.clear()
        conv_flops.clear()
        t0 = time.perf_counter()
        for _ in range(calls):
            net(x).close()
        total = (time.perf_counter() - t0) / calls
    finally:
        fold.conv_bn_forward = real
        fold.separable_forward = real_block
        fold.set_separable_fold(prev_sep)
    print("%s %d^2, batch %d, %d threads: %.2f ms per forward (%.1f img/s)"
          % (net_name, size, batch, threads, total * 1e3, batch / total))
    for k, s in sorted(secs.items(), key=lambda kv: -kv[1]):
        print("  %-12s %8.3f ms  %5.1f%%  %7.1f GFLOP/s"
              % (k, s / calls * 1e3, 100 * s / calls / total, flops[k] / s / 1e9))
    rest = total - sum(secs.values()) / calls
    print("  %-12s %8.2f ms  %5.1f%%" % ("rest", rest * 1e3, 100 * rest / total))
    return {k: f / calls for k, f in conv_flops.items()}


def _ort_kinds(model):
    """onnxruntime's node name -> the kind _kind gives the same convolution (its fused and
    blocked forms included), from the optimized model's weights and attributes."""
    dims = {i.name: list(i.dims) for i in model.graph.initializer}
    kinds = {}
    for node in model.graph.node:
        if "Conv" not in node.op_type or len(node.input) < 2:
            continue
        w = dims.get(node.input[1])
        if not w or len(w) != 4:
            continue
        att = {a.name: a for a in node.attribute}
        group = att["group"].i if "group" in att else 1
        stride = att["strides"].ints[0] if "strides" in att else 1
        kinds[node.name] = "%s %dx%d s%d" % ("dw" if group > 1 and group == w[0] else "conv",
                                            w[2], w[3], stride)
    return kinds


def profile_onnxruntime(net_name, size, batch, threads, calls, flops=None, out=print):
    """{kind: ms per run} of onnxruntime on utensil's export of the network (node kernel time;
    the kinds not convolutions by their op type); with ``flops`` ({convolution kind: FLOP per
    run}, what profile returns, a block's convolutions each by its kind) each kind's GFLOP/s
    too."""
    try:
        import onnx
        import onnxruntime as ort
    except ImportError as e:
        raise SystemExit("profile_inference: --onnxruntime needs onnx and onnxruntime (%s)" % e)
    import json
    import tempfile

    from utensil_ffi.interop.onnx_export import export_onnx

    ut.seed(0)
    net = build(net_name, "cpu")
    try:
        net.eval()
        _randomise_bn(net, np.random.default_rng(0))
        x = np.random.default_rng(1).standard_normal((batch, 3, size, size)).astype(np.float32)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "net.onnx")
            export_onnx(net, path, (1, 3, size, size))
            so = ort.SessionOptions()
            so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
            so.optimized_model_filepath = os.path.join(tmp, "optimized.onnx")
            so.enable_profiling = True
            so.log_severity_level = 3  # not the warning that the optimized file is machine's own
            so.profile_file_prefix = os.path.join(tmp, "profile")
            sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
            kinds = _ort_kinds(onnx.load(so.optimized_model_filepath))
            for _ in range(2 + calls):
                sess.run(None, {"input": x})
            with open(sess.end_profiling()) as f:
                events = json.load(f)
    finally:
        net.close()
    runs = [e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"]
    skip = len(runs) - calls  # the warm-up runs' nodes come first
    secs, seen = collections.Counter(), 0
    for e in events:
        if e.get("cat") == "Session" and e.get("name") == "model_run":
            seen += 1
        elif (e.get("cat") == "Node" and e["name"].endswith("_kernel_time")
              and seen >= skip):
            node = e["name"][:-len("_kernel_time")]
            secs[kinds.get(node, e.get("args", {}).get("op_name", "?"))] += e["dur"] / 1e3
    total = sum(secs.values()) / calls
    out("onnxruntime %s %d^2, batch %d, %d threads: %.2f ms of node time per run"
        % (net_name, size, batch, threads, total))
    for k, v in sorted(secs.items(), key=lambda kv: -kv[1]):
        rate = ("  %7.1f GFLOP/s" % (flops[k] / (v / calls) / 1e6)
                if flops and k in flops and v > 0 else "")
        out("  %-12s %8.3f ms  %5.1f%%%s" % (k, v / calls, 100 * v / calls / total, rate))
    return {k: v / calls for k, v in secs.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--net", default="mobilenet_v2", choices=["v1"] + zoo_names())
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--calls", type=int, default=5)
    p.add_argument("--by-shape", action="store_true",
                   help="a line per (kind, channels in -> out, output plane) instead of per kind")
    p.add_argument("--onnxruntime", action="store_true",
                   help="then onnxruntime's run of utensil's export, by the same kinds")
    p.add_argument("--no-separable", action="store_true",
                   help="each separable chain as its folded pairs: every convolution by kind")
    a = p.parse_args(argv)
    flops = profile(a.net, a.size, a.batch, a.threads, a.calls, a.by_shape,
                    separable=not a.no_separable)
    if a.onnxruntime:
        profile_onnxruntime(a.net, a.size, a.batch, a.threads, a.calls, flops)


if __name__ == "__main__":
    main()
