"""CPU inference: utensil's eval-mode forward against onnxruntime running utensil's own ONNX
export of the same network (what utensil-export writes) and PyTorch eager on its twin.

    python bench/bench_inference.py [--net mobilenet_v2] [--size 224] [--batch 1 8]
                                    [--threads 2] [--rounds 5] [--seconds 1.0] [--no-torch]
                                    [--pairs] [--repack]

The network has random weights and BatchNorm running statistics drawn away from (0, 1), so a
folded or fused path cannot pass by accident. Before timing, the three outputs are compared
on one batch (utensil against onnxruntime within 1e-4 of the logits' scale, the same bound as
utensil-export's check); a disagreement stops the benchmark. Rounds alternate between the
engines and each engine's best round counts (the machine's other load then hurts all alike).
Prints img/s per engine and utensil / onnxruntime, utensil / PyTorch; all float32, all on
``--threads`` threads (onnxruntime: intra-op threads, one inter-op; PyTorch:
torch.set_num_threads). ``--pairs`` adds utensil with its separable chains run as folded pairs
(fold.set_separable_fold(False)) as one more engine: what the one-call blocks gain, same run.
``--repack`` adds utensil with a numpy view of every convolution weight open during each call,
so that the CPU packs the weights' GEMM panels per call instead of keeping them: what the
kept panels gain, same run.
"""

import argparse
import os
import sys
import tempfile
import time

import numpy as np

if __name__ == "__main__" and __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import utensil_ffi as ut  # noqa: E402

from bench.bench_networks import build, torch_twin, zoo_names  # noqa: E402


def _randomise_bn(net, rng):
    """Running statistics and affine parameters away from their initial values."""
    for m in net.modules():
        if isinstance(m, ut.BatchNorm2d):
            c = m.num_features
            m.running_mean = rng.normal(0.0, 0.2, c).astype(np.float32)
            m.running_var = rng.uniform(0.5, 2.0, c).astype(np.float32)
            m.weight.copy_from(rng.uniform(0.5, 1.5, c).astype(np.float32))
            m.bias.copy_from(rng.normal(0.0, 0.1, c).astype(np.float32))


def _best_rate(fn, batch, seconds):
    """Images per second over one round of about ``seconds`` (at least 3 calls)."""
    fn()
    n, t0 = 0, time.perf_counter()
    while n < 3 or time.perf_counter() - t0 < seconds:
        fn()
        n += 1
    return n * batch / (time.perf_counter() - t0)


def _engines(net, name, batch, size, threads, tmp, use_torch, pairs=False, repack=False):
    """name -> (callable on the staged input, its output as numpy) for each engine present."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((batch, 3, size, size)).astype(np.float32)
    xt = ut.tensor(x, "cpu")

    def ours():
        y = net(xt)
        out = y.numpy().copy()
        y.close()
        return out

    engines = {"utensil": ours}
    if pairs:
        from utensil_ffi.nn import fold

        def ours_pairs():
            prev = fold.set_separable_fold(False)
            try:
                return ours()
            finally:
                fold.set_separable_fold(prev)
        engines["utensil pairs"] = ours_pairs
    if repack:
        weights = [p for _, p in net.named_parameters() if len(p.shape) == 4]

        def ours_repacked():
            views = [w.numpy() for w in weights]  # open views: nothing derived is kept
            try:
                return ours()
            finally:
                del views
        engines["utensil repacked"] = ours_repacked
    try:
        import onnxruntime as ort

        from utensil_ffi.interop.onnx_export import export_onnx
    except ImportError:
        ort = None
    if ort is not None:
        path = os.path.join(tmp, "%s.onnx" % name)
        export_onnx(net, path, (1, 3, size, size))
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
        engines["onnxruntime"] = lambda: sess.run(None, {"input": x})[0]
    if use_torch:
        try:
            import torch

            tnet = torch_twin(net, name).eval()
        except ImportError:
            tnet = None
        if tnet is not None:
            torch.set_num_threads(threads)
            tx = torch.from_numpy(x)

            def theirs():
                with torch.inference_mode():
                    return tnet(tx).numpy()
            engines["torch eager"] = theirs
    return engines, xt


def run(name="mobilenet_v2", size=224, batches=(1, 8), threads=2, rounds=5, seconds=1.0,
        use_torch=True, pairs=False, repack=False):
    """{batch: {engine: img/s}} (with "max diff": utensil against each engine, relative to the
    logits' largest magnitude); raises AssertionError when an engine computes something else."""
    ut.set_num_threads(threads)
    ut.seed(0)
    net = build(name, "cpu")
    _randomise_bn(net, np.random.default_rng(0))
    net.eval()
    results = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for b in batches:
                engines, xt = _engines(net, name, b, size, threads, tmp, use_torch, pairs,
                                       repack)
                try:
                    want = engines["utensil"]()
                    scale = float(np.abs(want).max()) or 1.0
                    diffs = {}
                    for k, fn in engines.items():
                        if k != "utensil":
                            diffs[k] = float(np.abs(fn() - want).max()) / scale
                            assert diffs[k] <= 1e-4, (
                                "bench_inference: %s and utensil disagree on %s: %.2e of the "
                                "logits' scale" % (k, name, diffs[k]))
                    rates = {k: 0.0 for k in engines}
                    for _ in range(rounds):
                        for k, fn in engines.items():
                            rates[k] = max(rates[k], _best_rate(fn, b, seconds))
                    rates["max diff"] = diffs
                    results[b] = rates
                finally:
                    xt.close()
    finally:
        net.close()
    return results


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--net", default="mobilenet_v2", choices=["v1"] + zoo_names())
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seconds", type=float, default=1.0)
    p.add_argument("--no-torch", action="store_true", help="leave PyTorch eager out")
    p.add_argument("--pairs", action="store_true",
                   help="also utensil with separable chains as folded pairs (same run)")
    p.add_argument("--repack", action="store_true",
                   help="also utensil packing its weights' GEMM panels per call (same run)")
    a = p.parse_args(argv)
    res = run(a.net, a.size, a.batch, a.threads, a.rounds, a.seconds, not a.no_torch, a.pairs,
              a.repack)
    print("%s %d^2, CPU, %d threads, float32, eval forward (img/s, best of %d rounds)"
          % (a.net, a.size, a.threads, a.rounds))
    for b, rates in res.items():
        diffs = rates.pop("max diff")
        line = "  batch %-3d" % b + "".join("  %s %8.1f" % (k, v) for k, v in rates.items())
        for k in rates:
            if k != "utensil" and rates[k] > 0:
                line += "   utensil/%s %.2fx" % (k, rates["utensil"] / rates[k])
        print(line)
        if diffs:
            print("            agreement: " + ", ".join("%s %.1e" % kv for kv in diffs.items()))
    return res


if __name__ == "__main__":
    main()
