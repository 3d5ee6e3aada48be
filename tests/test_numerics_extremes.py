"""Non-finite values and extreme magnitudes, compared with PyTorch (skipped without it) or with
hand-computed values."""

import numpy as np
import pytest

import utensil_ffi as ut
from utensil_ffi import ArgumentError
from utensil_ffi import functional as F

torch = pytest.importorskip("torch")

NAN, INF = float("nan"), float("inf")


def same_nonfinite(got, want):
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    assert got.shape == want.shape
    for mask in (np.isnan, np.isposinf, np.isneginf):
        np.testing.assert_array_equal(mask(got), mask(want))
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], rtol=1e-4, atol=1e-5)


def test_relu_backward_passes_nan_like_torch(device):
    x = np.array([NAN, -1.0, 0.0, 1.0, 6.0, 7.0, -INF, INF], np.float32)
    go = np.array([1.0, NAN, INF, -INF, 2.0, 3.0, NAN, 4.0], np.float32)
    for ours, theirs in ((F.relu_backward, torch.relu), (F.relu6_backward, torch.nn.functional.relu6)):
        tx = torch.tensor(x, requires_grad=True)
        theirs(tx).backward(torch.tensor(go))
        got = ours(ut.tensor(go, device=device), ut.tensor(x, device=device)).numpy()
        same_nonfinite(got, tx.grad.numpy())


def _dw_case(stride, pad, xpoke, gpoke, k=3, c=2, h=6):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, c, h, h)).astype(np.float32)
    for idx, v in xpoke:
        x[idx] = v
    l = ut.DWConv2d(c, k, stride=stride, padding=pad)
    w = l.weight.numpy().reshape(c, 1, k, k)
    y = l(ut.tensor(x))
    go = rng.standard_normal(y.shape).astype(np.float32)
    for idx, v in gpoke:
        go[idx] = v
    dx = l.backward(ut.tensor(go)).numpy()
    return x, w, go, y.numpy(), dx, l.weight.grad.numpy().reshape(c, 1, k, k), l.bias.grad.numpy()


POKES = [
    ([((0, 0, 0, 0), NAN)], []),
    ([((1, 1, 2, 5), INF)], []),
    ([], [((0, 0, 0, 0), NAN)]),
    ([], [((1, 1, -1, -1), -INF)]),
    ([((0, 1, 3, 3), NAN)], [((1, 0, 0, 1), INF)]),
]


@pytest.mark.parametrize("stride, pad", [(1, 1), (2, 1), (1, 0), (2, 0)])
@pytest.mark.parametrize("pokes", POKES)
def test_depthwise_backward_nonfinite_like_torch(stride, pad, pokes):
    # 3x3 depthwise at strides 1 and 2: PyTorch's CPU kernel sums only the (output, tap) pairs
    # inside the input, so a NaN in grad_out next to the padding reaches only the taps that read
    # real input (its other sizes and strides go through a path that multiplies padding zeros)
    x, w, go, y, dx, dW, db = _dw_case(stride, pad, *pokes)
    tx = torch.tensor(x, requires_grad=True)
    tw = torch.tensor(w, requires_grad=True)
    tb = torch.zeros(w.shape[0], requires_grad=True)
    ty = torch.nn.functional.conv2d(tx, tw, tb, stride=stride, padding=pad, groups=w.shape[0])
    ty.backward(torch.tensor(go))
    same_nonfinite(y, ty.detach().numpy())
    same_nonfinite(dx, tx.grad.numpy())
    same_nonfinite(dW, tw.grad.numpy())
    same_nonfinite(db, tb.grad.numpy())


def test_depthwise_dw_nonfinite_5x5_valid_pairs():
    # PyTorch's 5x5 CPU path multiplies padding zeros (NaN everywhere in the channel); ours keeps
    # the 3x3 rule for every size: a float64 sum over the pairs inside the input
    stride, pad, k = 1, 2, 5
    x, w, go, _, _, dW, _ = _dw_case(stride, pad, [], [((0, 0, 0, 0), NAN)], k=k)
    n, c, h, _ = x.shape
    ho = go.shape[2]
    want = np.zeros((c, k, k))
    for ch in range(c):
        for ky in range(k):
            for kx in range(k):
                for b in range(n):
                    for oy in range(ho):
                        for ox in range(ho):
                            iy, ix = oy * stride - pad + ky, ox * stride - pad + kx
                            if 0 <= iy < h and 0 <= ix < h:
                                want[ch, ky, kx] += float(go[b, ch, oy, ox]) * float(x[b, ch, iy, ix])
    same_nonfinite(dW.reshape(c, k, k), want)
    assert np.isfinite(dW[0, 0, 0, 0]) and np.isnan(dW[0, 0, -1, -1])


@pytest.mark.parametrize("g", [1e20, -1e20, 1e19, 5e20, 3e38, -3e38, 1e-30, 1.0])
def test_adam_extreme_gradients_like_torch(device, g):
    p0 = np.array([0.5, -0.25], np.float32)
    grads = np.array([g, g / 3], np.float32)
    tp = torch.tensor(p0, requires_grad=True)
    opt = torch.optim.Adam([tp], lr=0.1)
    p = ut.tensor(p0, device=device)
    m = ut.zeros((2,), device=device)
    v = ut.zeros((2,), device=device)
    for step in range(1, 4):
        tp.grad = torch.tensor(grads)
        opt.step()
        F.adam_step(p, ut.tensor(grads, device=device), m, v, step, lr=0.1)
        same_nonfinite(p.numpy(), tp.detach().numpy())


def test_adam_1e20_keeps_its_update(device):
    # main lost it: v/bc2 = 1e37 * 1000 overflowed to inf and the step became 0
    p = ut.tensor(np.zeros(1, np.float32), device=device)
    m, v = ut.zeros((1,), device=device), ut.zeros((1,), device=device)
    F.adam_step(p, ut.tensor(np.array([1e20], np.float32), device=device), m, v, 1, lr=0.1)
    np.testing.assert_allclose(p.numpy(), [-0.1], rtol=1e-5)


def test_cross_entropy_class_index_above_2_24(device):
    k = 2**24 + 2
    logits = np.zeros((1, k), np.float32)
    logits[0, 2**24] = 5.0
    lt = ut.tensor(logits, device=device)
    # 2^24 is exact in float32; main compared it with float(k) = 2^24 and refused it
    loss = float(F.cross_entropy(lt, np.array([2**24])).numpy()[0])
    want = np.log(np.exp(5.0) + (k - 1)) - 5.0
    assert abs(loss - want) < 1e-4 * want
    g = F.cross_entropy_backward(lt, np.array([2**24])).numpy()
    assert g[0, 2**24] < 0 and g[0, 0] > 0
    # 2^24 + 1 has no float32: refused, not rounded to the neighbouring class
    with pytest.raises(ArgumentError, match="float32"):
        F.cross_entropy(lt, np.array([2**24 + 1]))
