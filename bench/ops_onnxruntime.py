"""Each distinct convolution of a network alone, utensil against onnxruntime on the same shape:
whether onnxruntime's lead on the whole network (bench_inference.py) comes from its kernels or
from what its graph does between them.

    python bench/ops_onnxruntime.py [--net mobilenet_v2] [--size 224] [--batch 1]
                                    [--threads 2] [--rounds 3] [--reps 3] [--calls 10]
                                    [--round-s 0.1]

The network's eval forward runs once with its separable chains as folded pairs, and each
convolution + BatchNorm2d step it runs (with its activation) is recorded by shape. Each distinct
shape is then timed alone by each side, each side in a process of its own (the sides in turn,
--rounds times; a step's best counts):
- utensil: the folded step (nn.fold.conv_bn_forward) on a fresh input of that shape;
- onnxruntime "nchw": a model of that one Conv (+ Clip for ReLU6, Relu for ReLU, which it fuses)
  at graph optimization level EXTENDED: its NCHW kernels;
- onnxruntime "nchwc": the same model at level ALL, where its NCHWc transformer wraps the Conv
  in ReorderInput/ReorderOutput: its blocked-layout kernels plus the two reorders a lone node
  needs (inside its optimized network they are needed once, at the ends).
Prints a line per shape (count in the network, microseconds per call of each, ratios) and the
sums weighted by each shape's count; float32. Needs onnx and onnxruntime.
"""

import argparse
import collections
import importlib.util
import os
import sys
import time

import numpy as np

if __name__ == "__main__" and __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import utensil_ffi as ut  # noqa: E402
from utensil_ffi._lib import lib  # noqa: E402
from utensil_ffi.nn import fold  # noqa: E402

from bench.bench_inference import _randomise_bn  # noqa: E402
from bench.bench_networks import build, zoo_names  # noqa: E402

# the step's activation as onnxruntime's node after the Conv (which it fuses into the Conv);
# another activation (SiLU, Hardswish...) leaves onnxruntime's side without one, marked "*"
_ONNX_ACT = {None: None, "relu": "Relu", "relu6": "Clip"}
_ACT_NAMES = {int(code): name for name, code in ut.nn.BatchNorm2d._ACTIVATIONS.items()}


def steps_of(net_name, size, batch):
    """[(key, count, conv, bn, act, x shape)] of the network's folded convolution steps, one per
    distinct key (kind, filter, stride, padding, dilation, input shape, activation), in
    first-run order."""
    net = build(net_name, "cpu")
    net.eval()
    _randomise_bn(net, np.random.default_rng(0))
    seen = collections.OrderedDict()
    real = fold.conv_bn_forward

    def record(conv, bn, xin, act=lib.UT_ACT_NONE):
        a = bn.activation if int(act) == int(lib.UT_ACT_NONE) else _ACT_NAMES[int(act)]
        depthwise = isinstance(conv, ut.DWConv2d)
        key = ("dw" if depthwise else "conv", tuple(conv.kernel_size), conv.stride, conv.padding,
               getattr(conv, "dilation", 1), tuple(xin.shape), a)
        if key in seen:
            seen[key][1] += 1
        else:
            seen[key] = [key, 1, conv, bn, act, tuple(xin.shape)]
        return real(conv, bn, xin, act)

    fold.conv_bn_forward = record
    prev = fold.set_separable_fold(False)
    try:
        x = ut.tensor(np.random.default_rng(1).standard_normal((batch, 3, size, size)), "cpu")
        net(x).close()
    finally:
        fold.conv_bn_forward = real
        fold.set_separable_fold(prev)
    return net, [tuple(v) for v in seen.values()]


def _onnx_conv(conv, shape, act, level, threads):
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    depthwise = isinstance(conv, ut.DWConv2d)
    w = np.array(conv.weight.numpy(), np.float32)
    cout = w.shape[0]
    if depthwise:
        w = w.reshape(cout, 1, *conv.kernel_size)
    p, s, d = conv.padding, conv.stride, getattr(conv, "dilation", 1)
    inits = [numpy_helper.from_array(w, "W"),
             numpy_helper.from_array(np.zeros(cout, np.float32), "B")]
    nodes = [helper.make_node("Conv", ["x", "W", "B"], ["c" if act else "y"],
                              group=cout if depthwise else 1, pads=[p, p, p, p],
                              strides=[s, s], dilations=[d, d],
                              kernel_shape=list(conv.kernel_size))]
    if act == "Clip":
        inits += [numpy_helper.from_array(np.array(0.0, np.float32), "lo"),
                  numpy_helper.from_array(np.array(6.0, np.float32), "hi")]
        nodes.append(helper.make_node("Clip", ["c", "lo", "hi"], ["y"]))
    elif act == "Relu":
        nodes.append(helper.make_node("Relu", ["c"], ["y"]))
    graph = helper.make_graph(nodes, "conv",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    opsets = [helper.make_opsetid("", 13)]
    model = helper.make_model(graph, opset_imports=opsets)
    # make_model stamps the onnx package's newest IR version, which an older onnxruntime
    # refuses (the lent GPU machines' did): the oldest that holds opset 13, as the exporter does
    model.ir_version = helper.find_min_ir_version_for(opsets)
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
    so.graph_optimization_level = level
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so,
                                providers=["CPUExecutionProvider"])


def _best(fn, reps, min_calls, round_s):
    """Best seconds per call of fn over reps rounds of at least min_calls calls and round_s
    seconds, after one untimed call."""
    t0 = time.perf_counter()
    fn()
    calls = max(min_calls, int(round_s / max(time.perf_counter() - t0, 1e-6)))
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


SIDES = ("utensil", "ort nchw", "ort nchwc")


def time_side(side, net_name, size, batch, threads, reps, calls, round_s):
    """[(key, count, conv shape name, best seconds per call)] of one side in this process."""
    ut.set_num_threads(threads)
    net, steps = steps_of(net_name, size, batch)
    rng = np.random.default_rng(2)
    out = []
    try:
        for key, n, conv, bn, act, shape in steps:
            xa = rng.standard_normal(shape).astype(np.float32)
            if side == "utensil":
                xt = ut.tensor(xa, "cpu")
                try:
                    t = _best(lambda: fold.conv_bn_forward(conv, bn, xt, act).close(), reps,
                              calls, round_s)
                finally:
                    xt.close()
            else:
                import onnxruntime as ort
                level = (ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED if side == "ort nchw"
                         else ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
                sess = _onnx_conv(conv, shape, _ONNX_ACT.get(key[6]), level, threads)
                t = _best(lambda: sess.run(None, {"x": xa}), reps, calls, round_s)
            kind, (kh, kw), s = key[0], key[1], key[2]
            y = "%d->%d" % (shape[1], conv.out_channels if kind == "conv" else shape[1])
            pad, dil = key[3], key[4]
            ho = (shape[2] + 2 * pad - dil * (kh - 1) - 1) // s + 1
            wo = (shape[3] + 2 * pad - dil * (kw - 1) - 1) // s + 1
            name = "%s %dx%d s%d%s %s %dx%d %s%s" % (
                kind, kh, kw, s, " d%d" % dil if dil > 1 else "", y, ho, wo, key[6] or "-",
                "" if key[6] in _ONNX_ACT else "*")
            out.append((repr(key), n, name, t))
    finally:
        net.close()
    return out


def run(net_name="mobilenet_v2", size=224, batch=1, threads=2, rounds=3, reps=3, calls=10,
        round_s=0.1, out=print):
    """{shape name: (count, utensil s, nchw s, nchwc s)}, printed as a table. Each side runs in
    a process of its own, the sides one after another, `rounds` times; a step's best over the
    rounds counts. In one process the other engine's workers spin a while after its last call
    (onnxruntime's by default, utensil's pool 200 us) and took the cores from the side timed
    next: utensil's steps summed 9.5 ms against 5.5 ms with onnxruntime's spinning off."""
    import json
    import subprocess

    best = {}
    for _ in range(rounds):
        for side in SIDES:
            cmd = [sys.executable, os.path.abspath(__file__), "--net", net_name, "--size",
                   str(size), "--batch", str(batch), "--threads", str(threads), "--reps",
                   str(reps), "--calls", str(calls), "--round-s", str(round_s), "--side", side]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError("ops_onnxruntime.py --side %r failed (exit %d):\n%s"
                                   % (side, done.returncode, done.stderr[-3000:]))
            got = done.stdout
            for key, n, name, t in json.loads(got.strip().splitlines()[-1]):
                row = best.setdefault(key, [name, n, {}])
                row[2][side] = min(row[2].get(side, float("inf")), t)
    out("%s %d^2, batch %d, %d threads: each distinct convolution step alone, each side in its "
        "own process (us per call, best of %d rounds)" % (net_name, size, batch, threads, rounds))
    out("  %-38s %3s %9s %9s %9s %8s %8s" % ("step (kind k s, in -> out, out plane, act)", "n",
                                          "utensil", "ort nchw", "ort nchwc", "nchw/ut",
                                          "nchwc/ut"))
    res, tot = {}, [0.0, 0.0, 0.0]
    for name, n, t in best.values():
        ts = [t[side] for side in SIDES]
        res[name] = (n, *ts)
        for i in range(3):
            tot[i] += n * ts[i]
        out("  %-38s %3d %9.1f %9.1f %9.1f %7.2fx %7.2fx"
            % (name, n, ts[0] * 1e6, ts[1] * 1e6, ts[2] * 1e6, ts[1] / ts[0], ts[2] / ts[0]))
    out("  %-38s %3d %9.1f %9.1f %9.1f %7.2fx %7.2fx"
        % ("all, weighted by count", sum(v[0] for v in res.values()), tot[0] * 1e6,
           tot[1] * 1e6, tot[2] * 1e6, tot[1] / tot[0], tot[2] / tot[0]))
    return res


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--net", default="mobilenet_v2", choices=["v1"] + zoo_names())
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3, help="processes per side, in turn")
    p.add_argument("--reps", type=int, default=3, help="timed rounds per step in a process")
    p.add_argument("--calls", type=int, default=10, help="calls per timed round, at least")
    p.add_argument("--round-s", type=float, default=0.1, help="seconds per timed round, at least")
    p.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # a child process's side
    a = p.parse_args(argv)
    if a.side:
        import json
        print(json.dumps(time_side(a.side, a.net, a.size, a.batch, a.threads, a.reps, a.calls,
                                   a.round_s)))
        return
    if importlib.util.find_spec("onnxruntime") is None or importlib.util.find_spec("onnx") is None:
        raise SystemExit("ops_onnxruntime: needs onnx and onnxruntime")
    run(a.net, a.size, a.batch, a.threads, a.rounds, a.reps, a.calls, a.round_s)


if __name__ == "__main__":
    main()
