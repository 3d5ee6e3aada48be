"""Whole-network training throughput, utensil against the same network in PyTorch.

    python bench/bench_networks.py [--net v1] [--size 64] [--batch 8] [--threads 2]
        [--device cpu] [--steps 20] [--rounds 3]
        [--precision highest] [--blas cublas] [--graph [bf16]] [--bf16]
        [--torch fp32,tf32,bf16,compile,bf16-compile,compile-ro,bf16-compile-ro]

MobileNet v1 (``models.mobilenet_v1``: 1000 classes, width 1.0) on random images, the digits
network of utensil-train (``--net digits``: width 32, 8x8 inputs), or any network of
``utensil_ffi.models`` by its torchvision name (``--net efficientnet_b0``: 1000 classes; the
PyTorch side is torchvision's model of that name, loaded with utensil's weights by state_dict
key; both sides with dropout and stochastic depth 0, so they do the same work and the loss check
compares the same function), SGD with momentum 0.9 and cross-entropy. Both sides start from
the same weights (``torch_twin``) and train on the same batches; rounds alternate between the
sides so a change of machine load hits all of them. Before the timed steps, utensil's fp32 losses over 3 steps are checked against a PyTorch fp32
copy (``check_parity``; ``--no-check`` skips it): the rates are of the same training.
Prints images/s per side (the median round) and utensil's ratio to each PyTorch mode.

utensil runs fp32 at ``--precision highest`` and TF32 GEMMs on cuBLAS at ``high``; ``--blas own``
runs its own CUDA GEMM kernels instead of cuBLAS; ``--graph`` adds a row for utensil with one
training step recorded in a ``ut.cuda.CUDAGraph`` and replayed per batch; ``--bf16`` adds rows
for ``ut.MixedPrecision`` (bf16 activations, float32 weights: compare with PyTorch's bf16 mode).
PyTorch modes
(``--torch``, on CUDA; the CPU runs fp32 only), each with cudnn.benchmark on:
  fp32     NCHW, TF32 off for convs and matmuls: the same arithmetic as utensil at "highest"
  tf32     channels_last, TF32 on: the same arithmetic as utensil at "high"
  bf16     channels_last, bf16 autocast: what a PyTorch user picks for speed (less precise)
  compile  torch.compile of the fp32 network (TF32 off)
  bf16-compile  bf16 with torch.compile: all three of PyTorch's speed settings at once
  compile-ro, bf16-compile-ro   the same with ``mode="reduce-overhead"`` (PyTorch records the
           compiled network in CUDA graphs: the counterpart of utensil's ``--graph``);
           bf16-compile-ro is "PyTorch best" in the issues' tables
"""

import argparse
import collections
import os
import statistics
import sys
import time

import numpy as np

if __name__ == "__main__" and __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import utensil_ffi as ut  # noqa: E402
from utensil_ffi.nn import models  # noqa: E402

from bench.compare_mobilenet import to_torch  # noqa: E402


def zoo_names():
    """The torchvision-named networks of utensil_ffi.models ([] before that package exists)."""
    try:
        from utensil_ffi import models as zoo
    except ImportError:
        return []
    listing = getattr(zoo, "list_models", None)  # the old flat module's alias has none
    return list(listing()) if listing else []


def _no_randomness(builder):
    """The builder's dropout / stochastic-depth keywords, set to 0 where it takes them."""
    import inspect

    params = inspect.signature(builder).parameters
    return {k: 0.0 for k in ("dropout", "stochastic_depth_prob") if k in params}


def build(name, device, fused=True):
    if name == "v1":
        return models.mobilenet_v1(device=device, fused=fused)
    if name == "digits":
        return models.mobilenet(1, 10, 32, device=device, fused=fused)
    if name in zoo_names():
        from utensil_ffi import models as zoo

        builder = getattr(zoo, name)
        return builder(num_classes=1000, device=device, fused=fused, **_no_randomness(builder))
    raise ValueError("unknown network %r" % (name,))


def torch_twin(net, name):
    """A PyTorch float32 copy of ``net`` on the CPU: the flat Sequential's twin (to_torch) for v1
    and digits, torchvision's model of the same name for the others (strict load by key)."""
    if name in ("v1", "digits"):
        return to_torch(net)
    import torch
    import torchvision

    from utensil_ffi import models as zoo

    # torchvision's builders take these through **kwargs (no named parameter to look up), so
    # utensil's builder of the same name says which to zero
    tnet = getattr(torchvision.models, name)(weights=None, num_classes=1000,
                                             **_no_randomness(getattr(zoo, name)))
    sd = collections.OrderedDict((k, torch.from_numpy(v)) for k, v in net.state_dict().items())
    sd._metadata = {"": {"version": 2}}  # MNASNet's check (see utensil_ffi.models.mnasnet)
    tnet.load_state_dict(sd, strict=True)
    return tnet


def utensil_step(net, opt, xb, yb):
    logits = net(xb)
    grad = ut.cross_entropy_backward(logits, yb)
    opt.zero_grad()
    net.backward(grad, input_grad=False)  # no gradient for the images, as PyTorch
    opt.step()
    logits.close()
    grad.close()


def utensil_steps(net, opt, batches):
    """Training steps over batches of (x, labels) Tensors already on the network's device."""
    for xb, yb in batches:
        utensil_step(net, opt, xb, yb)
    ut.synchronize()


def utensil_graph_side(net, opt, staged):
    """The same steps with one step recorded (ut.cuda.CUDAGraph, after the eager warm-up) and
    replayed per batch, each batch copied into the recorded input tensors on the device."""
    state = {}

    def steps(batches):
        batches = staged[id(batches)]
        if not state:
            x0, y0 = batches[0]
            sx, sy = ut.zeros(x0.shape, "cuda"), ut.zeros(y0.shape, "cuda")
            sx.copy_from(x0)
            sy.copy_from(y0)
            utensil_steps(net, opt, [(sx, sy)])
            g = ut.cuda.CUDAGraph()
            with ut.cuda.graph(g):
                utensil_step(net, opt, sx, sy)
            state.update(g=g, x=sx, y=sy)
        for xb, yb in batches:
            state["x"].copy_from(xb)
            state["y"].copy_from(yb)
            state["g"].replay()
        ut.synchronize()

    def close():
        for k in ("g", "x", "y"):
            if k in state:
                state[k].close()

    return steps, close


def _folded(steps):
    """``steps`` with training's BatchNorm -> depthwise fold on (nn.fold.set_training_fold);
    a recorded side records so on its first call."""
    def run(batches):
        prev = ut.nn.fold.set_training_fold(True)
        try:
            return steps(batches)
        finally:
            ut.nn.fold.set_training_fold(prev)
    return run


def stage(batches, device):
    """The numpy batches as utensil Tensors on device (made once: the steps time training, not
    the copies from host memory)."""
    return [(ut.tensor(x, device), ut.tensor(y.astype(np.float32), device)) for x, y in batches]


def torch_steps(torch, tnet, topt, batches, device, mode="fp32"):
    for xb, yb in batches:
        with torch.autocast(device, dtype=torch.bfloat16, enabled=mode.startswith("bf16")):
            loss = torch.nn.functional.cross_entropy(tnet(xb), yb)
        topt.zero_grad()
        loss.backward()
        topt.step()
    if device == "cuda":
        torch.cuda.synchronize()


def _log_softmax_nll(logits, labels):
    """Mean cross-entropy in float64 of (N, classes) logits: the loss both sides minimise."""
    z = logits.astype(np.float64)
    z = z - z.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return float(-logp[np.arange(len(labels)), labels].mean())


def check_parity(torch, net, opt, batches, device, steps=3, rtol=(1e-4, 2e-2), name="v1"):
    """The timed sides train the same network: utensil's fp32 steps and a PyTorch fp32 copy of
    the same weights (TF32 off, NCHW) take ``steps`` steps on the same batches. The first loss
    (same weights, same batch) must agree within ``rtol[0]`` relative, the later ones within
    ``rtol[1]``: from the first update on, the two float32 trajectories drift apart through the
    batch statistics of the small last planes (0.4-0.7% after two steps at 32-64 px, batch 2-8).
    Returns the largest relative difference; raises AssertionError past the tolerance, so a
    benchmark cannot time a network that computes something else."""
    tnet = torch_twin(net, name).to(device)
    topt = torch.optim.SGD(tnet.parameters(), lr=opt.lr, momentum=opt.momentum)
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    worst = 0.0
    for i, (x, y) in enumerate(batches[:steps]):
        xb, yb = ut.tensor(x, device), ut.tensor(y.astype(np.float32), device)
        logits = net(xb)
        ours = _log_softmax_nll(logits.numpy(), y)
        grad = ut.cross_entropy_backward(logits, yb)
        opt.zero_grad()
        net.backward(grad, input_grad=False)
        opt.step()
        for t in (logits, grad, xb, yb):
            t.close()
        loss = torch.nn.functional.cross_entropy(tnet(torch.from_numpy(x).to(device)),
                                                 torch.from_numpy(y).to(device))
        topt.zero_grad()
        loss.backward()
        topt.step()
        theirs = float(loss)
        diff = abs(ours - theirs) / max(abs(theirs), 1e-6)
        assert diff <= rtol[min(i, 1)], ("bench_networks: utensil and PyTorch disagree at step %d: loss %.6f "
                              "against %.6f" % (i, ours, theirs))
        worst = max(worst, diff)
    return worst


TORCH_MODES = ("fp32", "tf32", "bf16", "compile", "bf16-compile", "compile-ro", "bf16-compile-ro")
_CHANNELS_LAST = ("tf32", "bf16", "bf16-compile", "bf16-compile-ro")


def _torch_side(torch, net, mode, device, name="v1"):
    """(module, optimizer, step function) for one PyTorch mode, from utensil's weights."""
    tnet = torch_twin(net, name).to(device)
    if mode in _CHANNELS_LAST:
        tnet = tnet.to(memory_format=torch.channels_last)
    topt = torch.optim.SGD(tnet.parameters(), lr=0.01, momentum=0.9)
    if mode.endswith("compile-ro"):
        model = torch.compile(tnet, mode="reduce-overhead")
    elif mode.endswith("compile"):
        model = torch.compile(tnet)
    else:
        model = tnet

    fmt = torch.channels_last if mode in _CHANNELS_LAST else torch.contiguous_format
    staged = {}

    def steps(batches):
        key = id(batches)
        if key not in staged:
            staged[key] = [(torch.from_numpy(x).to(device).contiguous(memory_format=fmt),
                            torch.from_numpy(y).to(device)) for x, y in batches]
        batches = staged[key]
        tf32 = mode == "tf32"
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = tf32
        torch_steps(torch, model, topt, batches, device, mode)

    return steps


def run(*args, **kwargs):
    """_run's figures, with every layer freeing its activations as backward uses them, as
    PyTorch's do (else a whole network's stay allocated while the PyTorch sides run); the
    setting comes back whatever happens (the parity check raises on a disagreement)."""
    retain = ut.set_retain_forward(False)
    try:
        return _run(*args, **kwargs)
    finally:
        ut.set_retain_forward(retain)


def _run(net_name="v1", size=64, batch=8, threads=2, device="cpu", steps=20, rounds=3,
        precision="highest", blas="cublas", torch_modes=("fp32",), seed=0, fused=True,
        graph=False, bf16=False, check=True, fold_ab=False):
    import torch

    if threads:
        ut.set_num_threads(threads)
        torch.set_num_threads(threads)
    torch.backends.cudnn.benchmark = True
    if device == "cpu":
        torch_modes = ("fp32",)
    else:
        ut.preferred_blas_library(blas)
    ut.set_float32_matmul_precision(precision)
    ut.seed(seed)
    net = build(net_name, device, fused)
    digits = net_name == "digits"
    in_c = 1 if digits else 3
    classes = 10 if digits else 1000
    size = 8 if digits else size
    sides = {"torch " + m: _torch_side(torch, net, m, device, net_name) for m in torch_modes}
    opt = ut.SGD(net.parameters(), lr=0.01, momentum=0.9)
    rng = np.random.default_rng(seed)
    batches = [(rng.standard_normal((batch, in_c, size, size)).astype(np.float32),
                rng.integers(0, classes, batch)) for _ in range(steps)]
    warm = batches[:3]
    ut_staged = {id(batches): stage(batches, device), id(warm): stage(warm, device)}
    ours = {"utensil": lambda b: utensil_steps(net, opt, ut_staged[id(b)])}
    closers = []
    if graph and graph != "bf16" and device == "cuda":
        ours["utensil graph"], c = utensil_graph_side(net, opt, ut_staged)
        closers.append(c)
    if bf16:  # the same weights and optimizer, the layers on bf16 activations
        mp = ut.MixedPrecision(net)
        ours["utensil bf16"] = lambda b: utensil_steps(mp, opt, ut_staged[id(b)])
        if graph and device == "cuda":
            ours["utensil bf16 graph"], c = utensil_graph_side(mp, opt, ut_staged)
            closers.append(c)
    if fold_ab:  # each of utensil's sides again with training's BatchNorm fold on
        ours.update({k + " folded": _folded(fn) for k, fn in list(ours.items())})
    sides = dict(ours, **sides)
    parity = check_parity(torch, net, opt, batches, device,
                          rtol=(1e-4 if precision == "highest" else 2e-3, 2e-2),
                          name=net_name) if check else None
    rates = {k: [] for k in sides}

    def make_room(name):
        # each library caches the GPU memory it frees and cannot reach the other's cache: before
        # a side runs, the other library gives its cache back (outside the timed region), so a
        # batch-256 ConvNeXt's sides fit together; recorded graphs keep their own memory
        if device == "cuda":
            (ut.cuda.empty_cache if name.startswith("torch") else torch.cuda.empty_cache)()

    try:
        for name, fn in sides.items():  # warm-up (and compilation)
            make_room(name)
            fn(warm)
        for _ in range(rounds):
            for name, fn in sides.items():
                make_room(name)
                t0 = time.perf_counter()
                fn(batches)
                rates[name].append(steps * batch / (time.perf_counter() - t0))
    finally:
        for c in closers:
            c()
        ut.set_float32_matmul_precision("highest")
        for staged in ut_staged.values():
            for xb, yb in staged:
                xb.close()
                yb.close()
        opt.close()
        net.close()
    result = {k: statistics.median(v) for k, v in rates.items()}
    if parity is not None:
        result["parity"] = parity
    return result


def main(argv=None):
    p = argparse.ArgumentParser(prog="python bench/bench_networks.py", description=__doc__.split(
        "\n\n")[0])
    p.add_argument("--net", default="v1", choices=("v1", "digits") + tuple(zoo_names()))
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--precision", default="highest", choices=("highest", "high"))
    p.add_argument("--unfused", action="store_true",
                   help="BatchNorm2d and ReLU6 as separate layers (default: fused)")
    p.add_argument("--blas", default="cublas", choices=("cublas", "own"))
    p.add_argument("--graph", nargs="?", const="all", default=None, choices=("all", "bf16"),
                   help="also time utensil with its step recorded in a CUDA graph (CUDA only); "
                        "--graph bf16: the bf16 step only (two recorded batch-256 ConvNeXt "
                        "steps and PyTorch's do not fit in one H200 together)")
    p.add_argument("--bf16", action="store_true",
                   help="also time utensil in mixed precision (ut.MixedPrecision, bf16)")
    p.add_argument("--torch", default="fp32",
                   help="PyTorch modes, comma-separated: " + ",".join(TORCH_MODES))
    p.add_argument("--fold-ab", action="store_true",
                   help="also time each utensil side with training's BatchNorm -> depthwise "
                        "fold on (\"<side> folded\"), in the same rounds")
    p.add_argument("--no-check", action="store_true",
                   help="skip the fp32 loss check against PyTorch before the timed steps")
    a = p.parse_args(argv)
    if a.device == "cuda" and "cuda" not in ut.devices():
        # utensil's "cuda" tensors would run on the CPU fallback and time the CPU as the GPU
        p.error("--device cuda but utensil sees no usable GPU (built without CUDA, or no device)")
    modes = tuple(m for m in a.torch.split(",") if m)
    for m in modes:
        if m not in TORCH_MODES:
            p.error("unknown PyTorch mode %r" % m)
    r = run(a.net, a.size, a.batch, a.threads, a.device, a.steps, a.rounds, a.precision, a.blas,
            modes, fused=not a.unfused, graph=a.graph, bf16=a.bf16, check=not a.no_check,
            fold_ab=a.fold_ab)
    parity = r.pop("parity", None)
    size = 8 if a.net == "digits" else a.size
    where = "%s threads" % a.threads if a.device == "cpu" else ut.backends()["cuda"]["gemm"]
    print("%s %s %d^2 batch %d (%s, %s), utensil at %s: utensil %.1f img/s" % (
        a.net, a.device, size, a.batch, where, "unfused" if a.unfused else "fused",
        a.precision, r["utensil"]))
    if parity is not None:
        print("  losses against PyTorch fp32 over 3 steps: within %.1e relative" % parity)
    for k, v in r.items():
        if k != "utensil":
            print("  %-18s %9.1f img/s   utensil/%s %.2fx" % (k, v, k, r["utensil"] / v))
    for ours in ("utensil bf16", "utensil bf16 graph"):
        for theirs in ("torch bf16", "torch bf16-compile", "torch bf16-compile-ro"):
            if ours in r and theirs in r:
                print("  %s / %s: %.2fx" % (ours, theirs, r[ours] / r[theirs]))


if __name__ == "__main__":
    main()
