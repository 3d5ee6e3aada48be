"""A roofline for one training step: the bytes and FLOPs each kernel family must move, against
the GPU time profile_kernels.py measures for it (issue 31).

    python bench/profile_kernels.py --net v1 --size 224 --batch 256 --sides "utensil bf16" \\
        --roofline

The model counts what utensil's own decomposition of the step has to touch at the least: each
layer's forward and backward read their operands once and write their results once, at the
activation's element size (2 bytes in bf16, 4 in fp32; parameters and their gradients float32):

    Conv2d, Linear (GEMMs)  forward x, W -> y; dx: g, W -> dx; dW: x, g -> dW; 2 MACs each
                            (W read twice and dW written once: 12 bytes per weight)
    DWConv2d                the same three, depthwise
    BatchNorm2d             forward: statistics (read x), apply (x -> y): 3 touches;
                            backward: sums (x, g), dx (x, g -> dx): 5 touches (activation fused)
    activations             forward 2 touches, backward 3; Dropout, StochasticDepth likewise
    GlobalAvgPool2d, SqueezeExcitation's scale, Residual's add   their reads and writes
    the optimizer (SGD momentum)   w, g, m read, w, m written: 20 bytes per parameter

Layouts (transposes), im2col, casts, non-finite reruns and workspace passes are not in the
model: they are time the family spends above it. The fused model of the issue (each conv
output written once and read once in forward, ~4 touches in backward: ``fused_bytes``) is the
step's floor once BatchNorm lives in its neighbours.

Shares are against the device's own measured peaks (``measure_peaks``: a large copy and a large
bf16 matmul, same process), so they stay honest on an H100 or an H200.
"""

import collections
import re

import numpy as np

import utensil_ffi as ut
from utensil_ffi import nn

__all__ = ["FAMILIES", "Layer", "family_of", "layer_shapes", "traffic", "fused_bytes",
           "measure_peaks", "table"]

DEPTHWISE, BATCHNORM, GEMM, OPTIMIZER = ("depthwise", "BatchNorm", "GEMM (1x1, stem, Linear)",
                                         "optimizer")
OTHER = "other (activations, pooling, SE, loss, casts)"
# kernel name -> family, first match wins; names are utensil's kernels and cuBLAS's
FAMILIES = (
    (DEPTHWISE, re.compile(r"dwconv2d")),
    (BATCHNORM, re.compile(r"batchnorm|channel_partial|channel_sum|bn_")),
    (GEMM, re.compile(r"gemm|xmma|cutlass|nvjet|sm90_|sm80_|im2col|col2im|transpose")),
    (OPTIMIZER, re.compile(r"sgd|adam|lerp")),
)


def family_of(kernel_name):
    """The family a kernel's time is booked to (OTHER when no pattern matches)."""
    for name, pat in FAMILIES:
        if pat.search(kernel_name):
            return name
    return OTHER


# what the model needs of a layer (the net may be closed afterwards): its class, the shapes of
# its input and output, its weight's shape and kernel size where it has them
Layer = collections.namedtuple("Layer", "cls x y weight kernel")


def layer_shapes(net, input_shape, device="cpu"):
    """[Layer] of every layer that does work, in call order, from one training-mode forward of
    ``net`` (on ``device``) on zeros of ``input_shape``."""
    seen = []
    patched = []
    for m in net.modules():
        if list(m.children()) and not _own_work(m):
            continue
        orig = m.forward

        def spy(x, m=m, orig=orig):
            y = orig(x)
            w = getattr(m, "weight", None)
            seen.append(Layer(type(m), tuple(x.shape), tuple(y.shape),
                              tuple(w.shape) if w is not None else None,
                              getattr(m, "kernel_size", None)))
            return y

        m.forward = spy
        patched.append(m)
    try:
        x = ut.tensor(np.zeros(input_shape, np.float32), device)
        net.train()
        y = net(x)
        y.close()
        x.close()
    finally:
        for m in patched:
            del m.forward
        net._clear_cache()
    return seen


def _own_work(m):
    # composite modules whose own forward touches memory besides their children's
    return isinstance(m, (nn.SqueezeExcitation, nn.Residual))


def _numel(shape):
    return int(np.prod(shape, dtype=np.int64))


def traffic(shapes, act_bytes=2, params=0, batch=1):
    """{family: (bytes, flops)} of one training step over ``batch`` samples (forward + backward
    + SGD momentum over ``params`` parameters) for the layers of ``layer_shapes`` (taken at
    batch 1), activations of ``act_bytes``; weights are read and their gradients written once
    per pass whatever the batch."""
    out = {}

    def add(fam, act, weights=0, flops=0):
        b, f = out.get(fam, (0, 0))
        out[fam] = (b + batch * act * act_bytes + 4 * weights, f + batch * flops)

    for m in shapes:
        nx, ny = _numel(m.x), _numel(m.y)
        if issubclass(m.cls, nn.DWConv2d):
            kh, kw = m.kernel
            add(DEPTHWISE, 3 * (nx + ny), 3 * _numel(m.weight), 3 * 2 * ny * kh * kw)
        elif issubclass(m.cls, (nn.Conv2d, nn.Linear)):
            w = _numel(m.weight)
            macs = ny * (w // m.y[1])  # each output: one weight row (out_c rows)
            add(GEMM, 3 * (nx + ny), 3 * w, 3 * 2 * macs)
        elif issubclass(m.cls, nn.BatchNorm2d):
            add(BATCHNORM, 8 * nx)
        elif issubclass(m.cls, nn.GlobalAvgPool2d):
            add(OTHER, 2 * (nx + ny))
        elif issubclass(m.cls, nn.SqueezeExcitation):
            add(OTHER, 6 * nx)  # forward x, s -> y; backward g -> dx and g, x -> ds
        elif issubclass(m.cls, nn.Residual):
            add(OTHER, 3 * nx)  # forward: two reads, one write; backward passes g on
        else:  # activations, dropout, layer norms: elementwise
            add(OTHER, 5 * nx)
    if params:
        add(OPTIMIZER, 0, 5 * params)
    return out


def fused_bytes(shapes, act_bytes=2):
    """The issue's floor: every conv output written once and read once in forward and touched
    about four times in backward (BatchNorm folded into its neighbours)."""
    conv = (nn.Conv2d, nn.DWConv2d)
    return 6 * act_bytes * sum(_numel(m.y) for m in shapes if issubclass(m.cls, conv))


def measure_peaks(torch):
    """(copy bytes per second, read + write; bf16 matmul FLOP/s) measured on the current GPU."""
    dev = "cuda"
    src = torch.empty(1 << 29, dtype=torch.bfloat16, device=dev)  # 1 GiB
    dst = torch.empty_like(src)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)

    def best(fn, reps=10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        fn()
        times = []
        for _ in range(reps):
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return min(times)

    bw = 2 * src.numel() * 2 / best(lambda: dst.copy_(src))
    flops = 2 * 8192 ** 3 / best(lambda: torch.matmul(a, b))
    del src, dst, a, b
    return bw, flops


def table(kernel_us, steps, batch, shapes, act_bytes, params, bw, flops):
    """Markdown rows: per family its measured µs per step, modelled MB and GFLOP, achieved
    GB/s and TFLOP/s, and the share of the roofline time (max of bytes / bw, flops / peak) in
    the measured time; then the step against the fused floor. ``kernel_us``: {name: total µs}
    over ``steps`` steps; ``shapes`` for one sample (scaled by ``batch``)."""
    model = traffic(shapes, act_bytes, params, batch)
    spent = {}
    for name, us in kernel_us.items():
        fam = family_of(name)
        spent[fam] = spent.get(fam, 0.0) + us / steps
    rows = ["| family | µs/step | model MB | model GFLOP | GB/s | TFLOP/s | roofline share |",
            "|---|---|---|---|---|---|---|"]
    order = [f for f, _ in FAMILIES] + [OTHER]
    floors = 0.0  # the kernels run one after another: the step's floor is the families' sum
    for fam in order:
        us = spent.get(fam, 0.0)
        nbytes, fl = model.get(fam, (0, 0))
        floor = max(nbytes / bw, fl / flops) * 1e6
        floors += floor
        if us <= 0:
            continue
        rows.append("| %s | %.0f | %.0f | %.0f | %.0f | %.1f | %.0f%% |"
                    % (fam, us, nbytes / 1e6, fl / 1e9, nbytes / us / 1e3, fl / us / 1e6,
                       100 * floor / us))
    total = sum(spent.values())
    nbytes = sum(v[0] for v in model.values())
    fl = sum(v[1] for v in model.values())
    rows.append("| whole step (kernels) | %.0f | %.0f | %.0f | %.0f | %.1f | %.0f%% |"
                % (total, nbytes / 1e6, fl / 1e9, nbytes / total / 1e3, fl / total / 1e6,
                   100 * floors / total))
    fused = fused_bytes(shapes, act_bytes) * batch
    rows.append("")
    rows.append("peaks measured here: copy %.0f GB/s (read + write), bf16 matmul %.0f TFLOP/s. "
                "Fused floor (conv outputs touched 6 times): %.0f MB, %.0f µs, so the step's "
                "kernels run at %.0f%% of it."
                % (bw / 1e9, flops / 1e12, fused / 1e6, fused / bw * 1e6,
                   100 * fused / bw * 1e6 / total))
    return rows
