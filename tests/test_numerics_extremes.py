"""Non-finite values and extreme magnitudes, compared with PyTorch (skipped without it) or with
hand-computed values."""

import numpy as np
import pytest

import utensil_ffi as ut
from utensil_ffi import ArgumentError
from utensil_ffi import functional as F
from utensil_ffi.testing import optable
from bf16_reference import bf16_round

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


def _dw_case(stride, pad, xpoke, gpoke, k=3, c=2, h=6, device="cpu"):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, c, h, h)).astype(np.float32)
    for idx, v in xpoke:
        x[idx] = v
    l = ut.DWConv2d(c, k, stride=stride, padding=pad, device=device)
    w = l.weight.numpy().reshape(c, 1, k, k)
    y = l(ut.tensor(x, device=device))
    go = rng.standard_normal(y.shape).astype(np.float32)
    for idx, v in gpoke:
        go[idx] = v
    dx = l.backward(ut.tensor(go, device=device)).numpy()
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
def test_depthwise_backward_nonfinite_like_torch(device, stride, pad, pokes):
    # 3x3 depthwise at strides 1 and 2: PyTorch's CPU kernel sums only the (output, tap) pairs
    # inside the input, so a NaN in grad_out next to the padding reaches only the taps that read
    # real input (its other sizes and strides go through a path that multiplies padding zeros)
    x, w, go, y, dx, dW, db = _dw_case(stride, pad, *pokes, device=device)
    tx = torch.tensor(x, requires_grad=True)
    tw = torch.tensor(w, requires_grad=True)
    tb = torch.zeros(w.shape[0], requires_grad=True)
    ty = torch.nn.functional.conv2d(tx, tw, tb, stride=stride, padding=pad, groups=w.shape[0])
    ty.backward(torch.tensor(go))
    same_nonfinite(y, ty.detach().numpy())
    same_nonfinite(dx, tx.grad.numpy())
    same_nonfinite(dW, tw.grad.numpy())
    same_nonfinite(db, tb.grad.numpy())


def test_depthwise_dw_nonfinite_5x5_valid_pairs(device):
    # PyTorch's 5x5 CPU path multiplies padding zeros (NaN everywhere in the channel); ours keeps
    # the 3x3 rule for every size: a float64 sum over the pairs inside the input
    stride, pad, k = 1, 2, 5
    x, w, go, _, _, dW, _ = _dw_case(stride, pad, [], [((0, 0, 0, 0), NAN)], k=k, device=device)
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


# ---- every op's non-finite propagation against PyTorch's CPU ops -------------------------------
# One NaN, +inf or -inf is put into one array (x, grad_out, weight, bias, target) at its middle,
# first or last element; the output and every gradient must have PyTorch's NaN/+inf/-inf pattern
# and its finite values.

TF = torch.nn.functional


def _poke(a, pos, v):
    a = a.copy()
    if pos == "mid":
        idx = tuple(s // 2 for s in a.shape)
    elif pos == "first":
        idx = (0,) * a.ndim
    else:
        idx = tuple(s - 1 for s in a.shape)
    a[idx] = v
    return a


def _dw_dW_valid_pairs(x, go, k, stride, pad):
    """float64 depthwise dW summed over the (output, tap) pairs inside x (see the dW tests)."""
    n, c, h, w = x.shape
    ho, wo = go.shape[2:]
    x, go = x.astype(np.float64), go.astype(np.float64)
    dW = np.zeros((c, k, k))
    for ky in range(k):
        for kx in range(k):
            for oy in range(ho):
                iy = oy * stride - pad + ky
                if not 0 <= iy < h:
                    continue
                for ox in range(wo):
                    ix = ox * stride - pad + kx
                    if 0 <= ix < w:
                        dW[:, ky, kx] += (go[:, :, oy, ox] * x[:, :, iy, ix]).sum(0)
    return dW


class _LayerOp:
    """A layer of ours against a torch function of (x, weight, bias)."""

    def __init__(self, make, x_shape, w_shape, b_shape, fwd, tw_shape=None, dW_ref=None):
        self.make, self.x_shape, self.w_shape, self.b_shape = make, x_shape, w_shape, b_shape
        self.fwd, self.tw_shape, self.dW_ref = fwd, tw_shape or w_shape, dW_ref
        self.sites = ["x", "go", "w", "b"]

    def run(self, site, pos, v, device):
        rng = np.random.default_rng(11)
        arr = {"x": rng.standard_normal(self.x_shape).astype(np.float32),
               "w": (0.5 * rng.standard_normal(self.w_shape)).astype(np.float32),
               "b": rng.standard_normal(self.b_shape).astype(np.float32)}
        if site in arr:
            arr[site] = _poke(arr[site], pos, v)
        l = self.make(device)
        l.weight = arr["w"]
        l.bias = arr["b"]
        ours = {}
        y = l(ut.tensor(arr["x"], device=device))
        ours["y"] = y.numpy()
        go = rng.standard_normal(y.shape).astype(np.float32)
        if site == "go":
            go = _poke(go, pos, v)
        ours["dx"] = l.backward(ut.tensor(go, device=device)).numpy()
        ours["dW"] = l.weight.grad.numpy().reshape(self.w_shape)
        ours["db"] = l.bias.grad.numpy()
        tx = torch.tensor(arr["x"], requires_grad=True)
        tw = torch.tensor(arr["w"].reshape(self.tw_shape), requires_grad=True)
        tb = torch.tensor(arr["b"], requires_grad=True)
        ty = self.fwd(l, tx, tw, tb)
        ty.backward(torch.tensor(go))
        want = {"y": ty.detach().numpy(), "dx": tx.grad.numpy(),
                "dW": tw.grad.numpy().reshape(self.w_shape), "db": tb.grad.numpy()}
        if self.dW_ref is not None:
            want["dW"] = self.dW_ref(arr["x"], go)
        extra = getattr(self, "extra", None)
        if extra:
            extra(l, ours, want)
        l.close()
        return ours, want


def _conv(op, g):
    sh = op.shapes(g)
    s, p = g["stride"], g["pad"]
    return _LayerOp(lambda d: op.make(g, d), sh["x"], sh["w"], sh["b"],
                    lambda l, x, w, b: TF.conv2d(x, w, b, stride=s, padding=p))


def _dw(op, g):
    # PyTorch's 3x3 CPU kernel sums dW over the pairs inside the input; its other sizes multiply
    # padding zeros (test_depthwise_dw_nonfinite_5x5_valid_pairs): ours follows the 3x3 rule
    # everywhere, so the 5x5 dW is compared with that rule in float64
    sh = op.shapes(g)
    c, k, s, p = g["c"], g["kh"], g["stride"], g["pad"]
    assert g["kw"] == k and g["dilation"] == g["mult"] == 1
    ref = None if k == 3 else (lambda x, go: _dw_dW_valid_pairs(x, go, k, s, p))
    return _LayerOp(lambda d: op.make(g, d), sh["x"], sh["w"], sh["b"],
                    lambda l, x, w, b: TF.conv2d(x, w, b, stride=s, padding=p, groups=c),
                    tw_shape=(c, 1, k, k), dW_ref=ref)


def _linear(op, g):
    sh = op.shapes(g)
    return _LayerOp(lambda d: op.make(g, d), sh["x"], sh["w"], sh["b"],
                    lambda l, x, w, b: TF.linear(x, w, b))


def _layernorm(op, g):
    sh = op.shapes(g)
    return _LayerOp(lambda d: op.make(g, d), sh["x"], sh["w"], sh["b"],
                    lambda l, x, w, b: TF.layer_norm(x, sh["w"], w, b, g["eps"]))


def _bn(op, g):
    c, training, momentum, eps = g["c"], g["training"], g["momentum"], g["eps"]
    assert c == 3
    rm0 = np.array([0.1, -0.2, 0.3], np.float32)
    rv0 = np.array([0.5, 1.5, 2.0], np.float32)

    def make(d):
        l = op.make(g, d)
        l.running_mean = rm0
        l.running_var = rv0
        assert l.training == training
        return l

    state = {}

    def fwd(l, x, w, b):
        state["rm"], state["rv"] = torch.tensor(rm0), torch.tensor(rv0)
        return TF.batch_norm(x, state["rm"], state["rv"], w, b, training, momentum, eps)

    def extra(l, ours, want):
        ours["running_mean"], ours["running_var"] = l.running_mean.numpy(), l.running_var.numpy()
        want["running_mean"], want["running_var"] = state["rm"].numpy(), state["rv"].numpy()

    sh = op.shapes(g)
    twin = _LayerOp(make, sh["x"], sh["w"], sh["b"], fwd)
    twin.extra = extra
    return twin


class _FuncOp:
    """A functional op (and its backward, when it has one) against torch autograd."""

    def __init__(self, shapes, ours, theirs, sites):
        self.shapes, self.ours, self.theirs, self.sites = shapes, ours, theirs, sites

    def run(self, site, pos, v, device):
        rng = np.random.default_rng(5)
        arrs = {k: rng.standard_normal(s).astype(np.float32) for k, s in self.shapes.items()}
        go = None
        if site == "go":
            go = site
        else:
            arrs[site] = _poke(arrs[site], pos, v)
        tens = {k: ut.tensor(a, device=device) for k, a in arrs.items()}
        ts = {k: torch.tensor(a, requires_grad=True) for k, a in arrs.items()}
        ours = {k: t.numpy() for k, t in self.ours(tens, rng, pos, v, site).items()}
        want = self.theirs(ts, np.random.default_rng(5), pos, v, site)
        for t in tens.values():
            t.close()
        return ours, want


def _gap_ours(t, rng, pos, v, site):
    x = t["x"]
    y = F.global_avg_pool2d(x)
    go = rng.standard_normal(y.shape).astype(np.float32)
    if site == "go":
        go = _poke(go, pos, v)
    return {"y": y, "dx": F.global_avg_pool2d_backward(go, *x.shape[2:])}


def _gap_torch(t, rng, pos, v, site):
    x = t["x"]
    rng.standard_normal(x.shape)  # the same draws as ours
    y = x.mean((2, 3))
    go = rng.standard_normal(tuple(y.shape)).astype(np.float32)
    if site == "go":
        go = _poke(go, pos, v)
    y.backward(torch.tensor(go))
    return {"y": y.detach().numpy(), "dx": x.grad.numpy()}


def _mse_ours(t, rng, pos, v, site):
    return {"y": F.mse_loss(t["x"], t["t"]), "dx": F.mse_loss_backward(t["x"], t["t"])}


def _mse_torch(t, rng, pos, v, site):
    y = TF.mse_loss(t["x"], t["t"])
    y.backward()
    return {"y": y.detach().numpy().reshape(1), "dx": t["x"].grad.numpy()}


CE_LABELS = np.array([0, 3, 4, 2])


def _ce_ours(t, rng, pos, v, site):
    return {"y": F.cross_entropy(t["x"], CE_LABELS), "dx": F.cross_entropy_backward(t["x"], CE_LABELS)}


def _ce_torch(t, rng, pos, v, site):
    y = TF.cross_entropy(t["x"], torch.tensor(CE_LABELS))
    y.backward()
    return {"y": y.detach().numpy().reshape(1), "dx": t["x"].grad.numpy()}


def _matmul_ours(t, rng, pos, v, site):
    return {"y": F.matmul(t["x"], t["w"])}


def _matmul_torch(t, rng, pos, v, site):
    return {"y": (t["x"] @ t["w"]).detach().numpy()}


# the PyTorch twin of each op of the table (torch stays out of the table): its samples marked
# "nonfinite" (utensil_ffi/testing/optable.py) -> a _LayerOp or _FuncOp at the sample's geometry
TWINS = {
    "conv2d": _conv,
    "dwconv2d": _dw,
    "linear": _linear,
    "layernorm": _layernorm,
    "batchnorm2d": _bn,
    "global_avg_pool2d": lambda op, g: _FuncOp(
        {"x": op.shapes(g)["x"]}, _gap_ours, _gap_torch, ["x", "go"]),
    "mse_loss": lambda op, g: _FuncOp(
        {"x": tuple(g["shape"]), "t": tuple(g["shape"])}, _mse_ours, _mse_torch, ["x", "t"]),
    "softmax_cross_entropy": lambda op, g: _FuncOp(
        {"x": (g["n"], g["k"])}, _ce_ours, _ce_torch, ["x"]),
    "matmul": lambda op, g: _FuncOp(
        {"x": (g["m"], g["k"]), "w": (g["k"], g["n"])}, _matmul_ours, _matmul_torch, ["x", "w"]),
}

OPS = {s.name: TWINS[op.name](op, op.geometry(**s.geom)) for op, s in optable.samples("nonfinite")}

CASES = [pytest.param(op, site, id="%s-%s" % (op, site)) for op in OPS for site in OPS[op].sites]


# An infinite weight (batchnorm, layernorm) or grad_out (layernorm) meets an infinity of the other
# sign inside the formula (inf - inf), so which outputs become NaN instead of +-inf depends on the
# order of evaluation, not on the maths: PyTorch's CPU batchnorm folds gamma into a scale and a
# shift, y = x * (gamma rstd) + (beta - mean gamma rstd), which is NaN wherever x and the mean have
# the same sign, and NaN everywhere when the mean is 0 (running_mean = 0 in eval mode), while the
# layer's definition gamma (x - mean) rstd + beta is +-inf there; its layernorm backward mixes
# the two infinite row sums into every element. There the rule is: the same finite values, NaN
# only where PyTorch has NaN, PyTorch's +-inf kept, and +-inf allowed where PyTorch has NaN.
ORDER_DEPENDENT = {("batchnorm_train", "w"), ("batchnorm_eval", "w"), ("layernorm", "w"),
                   ("layernorm", "go")}


def same_nonfinite_up_to_order(got, want):
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    assert not (np.isnan(got) & ~np.isnan(want)).any(), "NaN where PyTorch is not NaN"
    inf = np.isinf(want)
    np.testing.assert_array_equal(got[inf], want[inf])
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("op, site", CASES)
def test_nonfinite_like_torch(device, op, site):
    # every position and value in one test: the per-test leak check's full collections would
    # otherwise cost more than the ops
    bad = []
    for pos in ("mid", "first", "last"):
        for value in (NAN, INF, -INF):
            ours, want = OPS[op].run(site, pos, value, device)
            assert ours.keys() == want.keys()
            check = same_nonfinite
            if (op, site) in ORDER_DEPENDENT and np.isinf(value):
                check = same_nonfinite_up_to_order
            for name in want:
                try:
                    check(ours[name], want[name])
                except AssertionError as e:
                    bad.append("%s at %s = %s: %s differs: %s" % (site, pos, value, name, e))
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("shift", [0.0, 1e4, 1e30, -3e38])
def test_cross_entropy_is_shift_invariant_like_torch(device, shift):
    """Softmax ignores a common shift of the logits: CE of [c, c, ..., c] is log(K) for every
    finite c (PyTorch: 1.7918 for K = 6 at c = 1e30). utensil computed log(s) + max - x[label]
    and returned 0 there (found by the stateful fuzzer)."""
    rng = np.random.default_rng(5)
    small = rng.standard_normal((4, 6)).astype(np.float32) * (shift == 0.0)
    x = (small + np.float32(shift)).astype(np.float32)
    labels = np.array([0, 2, 5, 1], np.float32)
    with ut.tensor(x, device) as xt, ut.tensor(labels, device) as lt:
        with ut.cross_entropy(xt, lt) as loss:
            got = float(loss.numpy()[0])
    z = x.astype(np.float64) - x.astype(np.float64).max(axis=1, keepdims=True)
    ref = float(np.mean(np.log(np.exp(z).sum(axis=1)) - z[np.arange(4), labels.astype(int)]))
    assert abs(got - ref) <= 1e-5 * max(1.0, abs(ref)), (got, ref)


def _conv_real_input(x, w, b, go, s, p):
    """float64 y = conv(x, w) + b and dW = go (x) x summed over the windows' real input only
    (padding adds nothing, so an inf meets no padding zero), as PyTorch's CPU convolution."""
    x, w, go = (np.asarray(a, np.float64) for a in (x, w, go))
    n, c, h, wd = x.shape
    o, _, kh, kw = w.shape
    ho, wo = (h + 2 * p - kh) // s + 1, (wd + 2 * p - kw) // s + 1
    y = np.zeros((n, o, ho, wo)) + np.asarray(b, np.float64)[None, :, None, None]
    dw = np.zeros_like(w)
    for ky in range(kh):
        for kx in range(kw):
            iy, ix = np.arange(ho) * s - p + ky, np.arange(wo) * s - p + kx
            vy, vx = (iy >= 0) & (iy < h), (ix >= 0) & (ix < wd)
            sub = x[:, :, iy[vy]][:, :, :, ix[vx]]
            sel = np.ix_(range(n), range(o), np.flatnonzero(vy), np.flatnonzero(vx))
            y[sel] += np.einsum("nchw,oc->nohw", sub, w[:, :, ky, kx])
            dw[:, :, ky, kx] = np.einsum("nohw,nchw->oc", go[sel], sub)
    return y, dw


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("site", ["w", "go"])
def test_padded_conv_nonfinite_sums_real_input_only(device, dtype, site):
    """A padded dense conv's GEMM multiplies the columns' padding zeros too; an inf weight
    (forward) or grad_out (dW) made those products NaN where the convolution over real input
    is finite or +-inf (CUDA, until the exact pass: float32 and bf16 activations both)."""
    rng = np.random.default_rng(3)
    x = bf16_round(rng.standard_normal((2, 3, 7, 7)).astype(np.float32))
    w = bf16_round((0.5 * rng.standard_normal((4, 3, 3, 3))).astype(np.float32))
    b = bf16_round(rng.standard_normal(4).astype(np.float32))
    if site == "w":
        w[1, 2, 0, 0] = np.inf  # its top-left tap reads padding at the first row and column
    conv = ut.Conv2d(3, 4, 3, stride=2, padding=1).to(device)
    conv.weight, conv.bias = w, b
    dt = ut.bfloat16 if dtype == "bfloat16" else ut.float32
    with ut.tensor(x, device, dt) as xt, conv(xt) as y:
        go = bf16_round(rng.standard_normal(y.shape).astype(np.float32))
        if site == "go":
            go[1, 3, 0, 0] = -np.inf
        with ut.tensor(go, device, dt) as gt, conv.backward(gt) as dx:
            got = {"y": y.numpy(), "dW": conv.weight.grad.numpy()}
            assert np.isfinite(dx.numpy()).sum() > 0
    ref = dict(zip(("y", "dW"), _conv_real_input(x, w, b, go, 2, 1)))
    steps = 0 if dtype == "float32" else 4
    for name in ref:
        want = ref[name]
        if name == {"w": "y", "go": "dW"}[site]:  # the output the inf reaches
            assert (~np.isfinite(want)).any() and np.isfinite(want).any(), name
        np.testing.assert_array_equal(np.isnan(got[name]), np.isnan(want), err_msg=name)
        inf = np.isinf(want)
        np.testing.assert_array_equal(got[name][inf], want[inf], err_msg=name)
        fin = np.isfinite(want)
        scale = float(np.abs(want[fin]).max())
        np.testing.assert_allclose(got[name][fin], want[fin], rtol=1e-5,
                                   atol=1e-5 * scale + steps * 2.0 ** -8 * scale, err_msg=name)
