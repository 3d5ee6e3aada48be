"""What a training forward keeps for backward, counted in bytes (ut.live_bytes: the C library's
count of live tensor values, 4 bytes each), against hand counts; and set_retain_forward(False),
which frees it as backward uses it.

ConvNeXt-T at 224², batch 256, ran out of a 139 GB GPU in fp32: every layer kept its forward
until the next forward (a whole network's activations held between steps, on top of the
backward's temporaries), and convolutions kept their im2col / regrouped columns beside their
input. These tests fail if a kept copy comes back.
"""

import numpy as np
import pytest

import utensil_ffi as ut
from utensil_ffi.models import CNBlock

F32 = 4


def _nbytes(t):
    return int(np.prod(t.shape)) * F32


@pytest.fixture
def retain_forward():
    """Restores the library's setting after the test."""
    old = ut.get_retain_forward()
    yield
    ut.set_retain_forward(old)


def test_live_bytes_counts_values_and_the_peak(device):
    base = ut.live_bytes()
    ut.peak_live_bytes(reset=True)
    a = ut.zeros((3, 5, 7), device)
    b = ut.zeros((11,), device)
    assert ut.live_bytes() - base == (105 + 11) * F32
    a.close()
    assert ut.live_bytes() - base == 11 * F32
    assert ut.peak_live_bytes() - base == (105 + 11) * F32  # the high-water mark stays
    assert ut.peak_live_bytes(reset=True) - base == (105 + 11) * F32
    assert ut.peak_live_bytes() - base == 11 * F32  # reset: from what is live now
    b.close()
    assert ut.live_bytes() == base


@pytest.mark.parametrize("kernel,stride,padding,hw", [
    (3, 1, 1, 6),    # im2col columns 9x the input
    (4, 4, 0, 8),    # ConvNeXt's stem: columns a permutation of the input
    (2, 2, 0, 6),    # ConvNeXt's downsampling
    (1, 1, 0, 5),    # pointwise: on the CPU the whole batch as one GEMM over regrouped columns
    (1, 1, 0, 16),   # pointwise, per image: the columns are the input itself
])
def test_conv2d_keeps_its_input_only(device, rng, kernel, stride, padding, hw):
    conv = ut.Conv2d(3, 4, kernel, stride=stride, padding=padding, device=device)
    x = ut.tensor(rng.standard_normal((2, 3, hw, hw)).astype(np.float32), device)
    base = ut.live_bytes()
    y = conv(x)
    assert ut.live_bytes() - base == _nbytes(y)  # the output; x kept by reference
    g = ut.tensor(rng.standard_normal(y.shape).astype(np.float32), device)
    dx = conv.backward(g)
    # the gradients from the rebuilt columns, against float64 sums over the windows
    xs = np.pad(x.numpy().astype(np.float64), ((0, 0), (0, 0), (padding,) * 2, (padding,) * 2))
    w = conv.weight.numpy().astype(np.float64)
    gn = g.numpy().astype(np.float64)
    ho = y.shape[2]
    dw = np.zeros_like(w)
    dxs = np.zeros_like(xs)
    for i in range(ho):
        for j in range(ho):
            win = xs[:, :, i * stride:i * stride + kernel, j * stride:j * stride + kernel]
            dw += np.einsum("no,nckl->ockl", gn[:, :, i, j], win)
            dxs[:, :, i * stride:i * stride + kernel, j * stride:j * stride + kernel] += \
                np.einsum("no,ockl->nckl", gn[:, :, i, j], w)
    dxs = dxs[:, :, padding:padding + hw, padding:padding + hw]
    np.testing.assert_allclose(conv.weight.grad.numpy(), dw, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(dx.numpy(), dxs, rtol=1e-4, atol=1e-4)
    for t in (x, y, g, dx):
        t.close()
    conv.close()


def test_cnblock_recomputes_gelu_by_default_on_the_gpu_only(device, rng):
    """recompute_gelu None (the default): GELU's output is freed and recomputed on the GPU,
    kept on the CPU (12 E against 8 E + the statistics, as counted below)."""
    n, c, h, w = 2, 8, 5, 6
    block = CNBlock(c, layer_scale=0.5, device=device)
    assert block.recompute_gelu is None
    x = ut.tensor(rng.standard_normal((n, c, h, w)).astype(np.float32), device)
    base = ut.live_bytes()
    y = block(x)
    kept = (12 if device == "cpu" else 8) * n * c * h * w + 2 * n * h * w
    assert ut.live_bytes() - base == kept * F32
    y.close()
    block.eval()
    x.close()
    block.close()


@pytest.mark.parametrize("recompute", [True, False])
def test_cnblock_keeps_each_activation_once(device, rng, recompute):
    """Hand count of a CNBlock's forward at [N, C, H, W] (E = N C H W values): the depthwise
    output (kept by LayerNorm2d), LayerNorm2d's output (the first Linear's input) and its mean
    and 1/std (N H W each), the first Linear's output (GELU's input, 4E), the second Linear's
    output (for layer_scale's gradient) and the block's output: 8 E + 2 N H W; GELU's output
    (the second Linear's input, 4E) too unless backward recomputes it (recompute_gelu). The
    input is kept by reference."""
    n, c, h, w = 2, 8, 5, 6
    block = CNBlock(c, layer_scale=0.5, device=device)
    block.recompute_gelu = recompute
    x = ut.tensor(rng.standard_normal((n, c, h, w)).astype(np.float32), device)
    e = n * c * h * w
    base = ut.live_bytes()
    y = block(x)
    assert ut.live_bytes() - base == ((8 if recompute else 12) * e + 2 * n * h * w) * F32
    y.close()
    block.eval()  # drops what forward kept
    assert ut.live_bytes() == base
    x.close()
    block.close()


def _net(device):
    ut.seed(3)
    return ut.models.convnext_tiny(num_classes=5, stochastic_depth_prob=0.0, device=device)


def _step(net, x, labels):
    logits = net(x)
    g = ut.cross_entropy_backward(logits, labels)
    net.backward(g, input_grad=False)
    logits.close()
    g.close()


def test_retain_forward_false_frees_the_activations_as_backward_goes(device, rng, retain_forward):
    x = ut.tensor(rng.standard_normal((2, 3, 32, 32)).astype(np.float32), device)
    labels = ut.tensor(np.array([1, 4], np.float32), device)
    grads, peaks = {}, {}
    for retain in (True, False):
        ut.set_retain_forward(retain)
        net = _net(device).train()
        _step(net, x, labels)  # makes the gradients, so the counts below are activations only
        net.zero_grad()
        net.eval().train()  # drops what that step kept (else the next forward replaces it)
        base = ut.live_bytes()
        logits = net(x)
        kept = ut.live_bytes() - base
        g = ut.cross_entropy_backward(logits, labels)
        ut.peak_live_bytes(reset=True)
        net.backward(g, input_grad=False)
        peak = peaks[retain] = ut.peak_live_bytes() - base
        logits.close()
        g.close()
        after = ut.live_bytes() - base
        grads[retain] = {k: p.grad.numpy().copy() for k, p in net.named_parameters()}
        if retain:
            # all but the logits, until the next forward (the GELU outputs backward recomputed
            # freed again: a repeated backward recomputes them again)
            assert after == kept - 10 * F32
        else:
            assert after == 0
            # freed as backward goes: the peak stays near what the forward kept, where keeping
            # it all adds the backward's temporaries on top
            assert peak <= 1.05 * kept, (peak, kept)
            assert peak < peaks[True] - 0.05 * kept, (peak, peaks[True], kept)
            with pytest.raises(ut.ArgumentError, match="no forward pass"):
                net.backward(ut.zeros((2, 5), device), input_grad=False)
        net.close()
    for k in grads[True]:  # the same arithmetic: the same bits
        np.testing.assert_array_equal(grads[False][k], grads[True][k], err_msg=k)
    x.close()
    labels.close()


def test_retain_forward_true_lets_backward_repeat(device, rng, retain_forward):
    ut.set_retain_forward(True)
    lin = ut.Linear(3, 2, device=device)
    x = ut.tensor(rng.standard_normal((4, 3)).astype(np.float32), device)
    y = lin(x)
    g = ut.tensor(np.ones((4, 2), np.float32), device)
    lin.backward(g).close()
    once = lin.weight.grad.numpy().copy()
    lin.backward(g).close()
    np.testing.assert_allclose(lin.weight.grad.numpy(), 2 * once, rtol=1e-6)
    assert ut.set_retain_forward(False) is True  # returns the previous setting
    assert ut.get_retain_forward() is False
    for t in (x, y, g):
        t.close()
    lin.close()


@pytest.mark.parametrize("retain", [True, False])
def test_cnblock_recomputed_gelu_gives_the_same_bits(device, rng, retain, retain_forward):
    """Gradients (dx and every parameter's, a second backward's in retain mode) with GELU's
    output recomputed in backward are those of the block that kept it, bit for bit; both
    against float64 central differences are test_model_blocks' (the default block)."""
    ut.set_retain_forward(retain)
    x = rng.standard_normal((2, 8, 5, 6)).astype(np.float32)
    gout = rng.standard_normal((2, 8, 5, 6)).astype(np.float32)
    got = {}
    for recompute in (False, True):
        ut.seed(5)
        block = CNBlock(8, layer_scale=0.5, stochastic_depth_prob=0.3, device=device)
        block.recompute_gelu = recompute
        ut.seed(9)  # the same stochastic depth draw
        y = block(ut.tensor(x, device))
        g = ut.tensor(gout, device)
        runs = []
        for _ in range(2 if retain else 1):
            dx = block.backward(g)
            runs.append([dx.numpy().copy()] + [p.grad.numpy().copy()
                                               for _, p in block.named_parameters()])
            dx.close()
        got[recompute] = runs
        y.close()
        g.close()
        block.close()
    for a, b in zip(got[False], got[True]):
        for u, v in zip(a, b):
            np.testing.assert_array_equal(u, v)
    if retain:  # the second backward added the same gradients again
        for u, v in zip(got[True][1][1:], got[True][0][1:]):
            np.testing.assert_array_equal(u, 2 * v)
