"""float64 numpy references for every op of the library, forward and backward.

This is the independent reference that both the self-check (``python -m utensil_ffi.selftest``)
and the test suite (``tests/``) compare utensil against. It imports numpy and nothing else: it
never calls into utensil, so a mistake in the library cannot hide in its own reference. The names
are the library's (``utensil_ffi.functional``), one function per op and per backward, with the
argument order of the op. Where an op has a bias, ``b=None`` means "no bias".

How it is itself checked (tests/test_reference.py): each backward against ``numeric_grad`` of its
forward (central differences in float64), and, where PyTorch is installed, forward and backward
against PyTorch in float64.
"""

import numpy as np

__all__ = [
    "conv2d", "conv2d_backward", "dwconv2d", "dwconv2d_backward", "linear", "linear_backward",
    "matmul", "transpose", "add", "scale", "bias_add", "layernorm", "layernorm_backward", "batchnorm2d_train",
    "batchnorm2d_eval", "batchnorm2d_backward", "batchnorm2d_eval_backward",
    "batchnorm2d_running_stats", "relu", "relu6", "relu_backward", "relu6_backward",
    "global_avg_pool2d", "global_avg_pool2d_backward", "mse_loss", "mse_loss_backward",
    "cross_entropy", "cross_entropy_backward", "sgd_step", "adam_step", "numeric_grad",
    # issue 30's activations
    "silu", "silu_backward", "hardswish", "hardswish_backward", "hardsigmoid",
    "hardsigmoid_backward", "sigmoid", "sigmoid_backward", "gelu", "gelu_backward",
]
__all__ += [  # issue 30: squeeze-and-excitation, ConvNeXt
    "channel_scale", "channel_scale_backward", "layer_scale", "layer_scale_backward",
    "layernorm2d", "layernorm2d_backward",
]


# -- convolutions: x [N, C, H, W], zero padding p on every side, stride s, dilation d --------------
def _taps(kh, kw, s, ho, wo, d=1):
    """(i, j, rows, cols) for each kernel tap: xp[..., rows, cols] are the inputs it meets (tap
    (i, j) sits d * i rows and d * j columns into the window)."""
    for i in range(kh):
        for j in range(kw):
            yield (i, j, slice(d * i, d * i + s * (ho - 1) + 1, s),
                   slice(d * j, d * j + s * (wo - 1) + 1, s))


def _out_hw(x, kh, kw, s, p, d=1):
    """The output size: (H + 2p - d (kh - 1) - 1) // s + 1 (likewise W)."""
    return ((x.shape[2] + 2 * p - d * (kh - 1) - 1) // s + 1,
            (x.shape[3] + 2 * p - d * (kw - 1) - 1) // s + 1)


def _pad(x, p):
    return np.pad(x, ((0, 0), (0, 0), (p, p), (p, p)))


def _c(v):
    """A per-channel vector [C], broadcast against [N, C, H, W]."""
    return v[None, :, None, None]


def conv2d(x, w, b, s, p):
    """x: [N, C, H, W], w: [O, C, kh, kw], b: [O] or None -> [N, O, Ho, Wo]."""
    kh, kw = w.shape[2:]
    ho, wo = _out_hw(x, kh, kw, s, p)
    xp = _pad(x, p)
    y = np.zeros((x.shape[0], w.shape[0], ho, wo))
    for i, j, si, sj in _taps(kh, kw, s, ho, wo):
        y += np.einsum("nchw,oc->nohw", xp[:, :, si, sj], w[:, :, i, j])
    return y if b is None else y + _c(b)


def conv2d_backward(x, w, s, p, go):
    """go: [N, O, Ho, Wo] -> dx [N, C, H, W], dW [O, C, kh, kw], db [O]."""
    kh, kw = w.shape[2:]
    ho, wo = go.shape[2:]
    xp = _pad(x, p)
    dxp = np.zeros_like(xp)
    dw = np.zeros_like(w)
    for i, j, si, sj in _taps(kh, kw, s, ho, wo):
        dw[:, :, i, j] = np.einsum("nohw,nchw->oc", go, xp[:, :, si, sj])
        dxp[:, :, si, sj] += np.einsum("nohw,oc->nchw", go, w[:, :, i, j])
    h, wd = x.shape[2:]
    return dxp[:, :, p : p + h, p : p + wd], dw, go.sum(axis=(0, 2, 3))


def _multiplier(x, w):
    """The channel multiplier m of a depthwise weight w [C*m, kh, kw] over x [N, C, H, W]."""
    c, o = x.shape[1], w.shape[0]
    if o < c or o % c:
        raise ValueError("depthwise weight has %d channels, not a positive multiple of %d" % (o, c))
    return o // c


def dwconv2d(x, w, b, s, p, d=1):
    """Depthwise with channel multiplier m and dilation d (PyTorch's Conv2d(C, C*m, groups=C)):
    x: [N, C, H, W], w: [C*m, kh, kw], b: [C*m] or None -> [N, C*m, Ho, Wo];
    output channel o reads input channel o // m, tap (i, j) the input d * i, d * j into the window.
    """
    kh, kw = w.shape[1:]
    ho, wo = _out_hw(x, kh, kw, s, p, d)
    # [N, C*m, Hp, Wp]: channel c*m + r is a copy of input channel c
    xp = np.repeat(_pad(x, p), _multiplier(x, w), axis=1)
    y = np.zeros((x.shape[0], w.shape[0], ho, wo))
    for i, j, si, sj in _taps(kh, kw, s, ho, wo, d):
        y += xp[:, :, si, sj] * _c(w[:, i, j])
    return y if b is None else y + _c(b)


def dwconv2d_backward(x, w, s, p, go, d=1):
    """go: [N, C*m, Ho, Wo] -> dx [N, C, H, W], dW [C*m, kh, kw], db [C*m]."""
    kh, kw = w.shape[1:]
    ho, wo = go.shape[2:]
    n, c, h, wd = x.shape
    m = _multiplier(x, w)
    xp = np.repeat(_pad(x, p), m, axis=1)
    dxp = np.zeros_like(xp)  # the gradient of each output channel's copy of its input channel
    dw = np.zeros_like(w)
    for i, j, si, sj in _taps(kh, kw, s, ho, wo, d):
        dw[:, i, j] = np.einsum("nchw,nchw->c", go, xp[:, :, si, sj])
        dxp[:, :, si, sj] += go * _c(w[:, i, j])
    dxp = dxp.reshape(n, c, m, h + 2 * p, wd + 2 * p).sum(axis=2)  # the m copies of a channel add
    return dxp[:, :, p : p + h, p : p + wd], dw, go.sum(axis=(0, 2, 3))


# -- dense ------------------------------------------------------------------------------------------
def linear(x, w, b):
    """x: [N, I], w: [O, I], b: [O] or None -> [N, O]."""
    y = x @ w.T
    return y if b is None else y + b


def linear_backward(x, w, go):
    """go: [N, O] -> dx [N, I], dW [O, I], db [O]."""
    return go @ w, go.T @ x, go.sum(axis=0)


def matmul(a, b):
    """a: [M, K], b: [K, N] -> [M, N]."""
    return a @ b


def transpose(x, d0, d1):
    """x with dimensions d0 and d1 swapped (negative dimensions count from the end)."""
    return np.swapaxes(x, d0, d1)


# -- in-place tensor arithmetic, as new arrays ------------------------------------------------------
def add(a, b):
    """a + b, both of one shape (``add``, ``add_``)."""
    return a + b


def scale(x, alpha):
    """alpha * x (``scale_``, ``Tensor.mul_``)."""
    return alpha * x


def bias_add(x, b):
    """x: [N, C, ...], b: [C] -> x + b along dimension 1 (``bias_add_``)."""
    return x + b.reshape((1, -1) + (1,) * (x.ndim - 2))


# -- normalization ----------------------------------------------------------------------------------
def _norm_backward(go, xhat, rstd, g, axes):
    """dx for y = xhat * g + b with xhat normalized over `axes` (g already broadcast)."""
    dxhat = go * g
    return rstd * (
        dxhat - dxhat.mean(axis=axes, keepdims=True)
        - xhat * (dxhat * xhat).mean(axis=axes, keepdims=True)
    )


def _xhat(x, axes, eps):
    """(x - mean) * rstd over `axes` with the biased variance, and rstd (kept dims)."""
    mean = x.mean(axis=axes, keepdims=True)
    rstd = 1.0 / np.sqrt(x.var(axis=axes, keepdims=True) + eps)
    return (x - mean) * rstd, rstd


def layernorm(x, g, b, eps):
    """x: [..., D], g, b: [D] -> [..., D], normalized over the last dimension."""
    return _xhat(x, -1, eps)[0] * g + b


def layernorm_backward(x, g, eps, go):
    """go: [..., D] -> dx [..., D], dgamma [D], dbeta [D]."""
    xhat, rstd = _xhat(x, -1, eps)
    rows = tuple(range(x.ndim - 1))
    return _norm_backward(go, xhat, rstd, g, -1), (go * xhat).sum(axis=rows), go.sum(axis=rows)


def layernorm2d(x, g, b, eps):
    """x: [N, C, H, W], g, b: [C] -> [N, C, H, W], each (n, h, w) normalized over C
    (torchvision's LayerNorm2d: permute to NHWC, LayerNorm over C, permute back)."""
    return _xhat(x, 1, eps)[0] * _c(g) + _c(b)


def layernorm2d_backward(x, g, eps, go):
    """go: [N, C, H, W] -> dx [N, C, H, W], dgamma [C], dbeta [C]."""
    xhat, rstd = _xhat(x, 1, eps)
    return (_norm_backward(go, xhat, rstd, _c(g), 1), (go * xhat).sum(axis=(0, 2, 3)),
            go.sum(axis=(0, 2, 3)))


def batchnorm2d_train(x, g, b, eps):
    """x: [N, C, H, W], g, b: [C] -> y, batch mean [C], biased batch variance [C]."""
    mean = x.mean(axis=(0, 2, 3))
    var = x.var(axis=(0, 2, 3))
    y = (x - _c(mean)) / np.sqrt(_c(var) + eps) * _c(g) + _c(b)
    return y, mean, var


def batchnorm2d_running_stats(running_mean, running_var, mean, var, count, momentum):
    """The running statistics after one training batch of `count` values per channel: the
    running variance takes the unbiased batch variance (PyTorch's convention)."""
    return ((1 - momentum) * running_mean + momentum * mean,
            (1 - momentum) * running_var + momentum * var * count / (count - 1))


def batchnorm2d_eval(x, g, b, running_mean, running_var, eps):
    """x: [N, C, H, W] normalized with the running statistics -> [N, C, H, W]."""
    return (x - _c(running_mean)) / np.sqrt(_c(running_var) + eps) * _c(g) + _c(b)


def batchnorm2d_backward(x, g, eps, go):
    """Training mode (batch statistics): go: [N, C, H, W] -> dx, dgamma [C], dbeta [C]."""
    axes = (0, 2, 3)
    xhat, rstd = _xhat(x, axes, eps)
    dx = _norm_backward(go, xhat, rstd, _c(g), axes)
    return dx, (go * xhat).sum(axis=axes), go.sum(axis=axes)


def batchnorm2d_eval_backward(x, g, running_mean, running_var, eps, go):
    """Eval mode: the statistics are constants, so dx = gamma * rstd * go -> dx, dgamma, dbeta."""
    rstd = 1.0 / np.sqrt(running_var + eps)
    xhat = (x - _c(running_mean)) * _c(rstd)
    axes = (0, 2, 3)
    return go * _c(g * rstd), (go * xhat).sum(axis=axes), go.sum(axis=axes)


# -- elementwise, pooling ---------------------------------------------------------------------------
def relu(x):
    return np.maximum(x, 0.0)


def relu6(x):
    return np.minimum(np.maximum(x, 0.0), 6.0)


def relu_backward(go, x):
    """The gradient is 0 at the kink x = 0."""
    return go * (x > 0)


def relu6_backward(go, x):
    """The gradient is 0 at the kinks x = 0 and x = 6."""
    return go * ((x > 0) & (x < 6))


# -- issue 30's activations: the mathematical functions in float64 (written from their
# definitions, not from the library's or PyTorch's expressions); the kinks take PyTorch's values
def sigmoid(x):
    x = np.asarray(x, np.float64)
    # the two branches keep exp's argument <= 0: no overflow warning at large |x|
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def sigmoid_backward(go, x):
    s = sigmoid(x)
    return go * s * (1.0 - s)


def silu(x):
    return x * sigmoid(x)


def silu_backward(go, x):
    s = sigmoid(x)
    return go * (s + x * s * (1.0 - s))


def hardsigmoid(x):
    return np.clip(x / 6.0 + 0.5, 0.0, 1.0)


def hardsigmoid_backward(go, x):
    """1/6 strictly inside (-3, 3): 0 at the kinks."""
    return go * (((x > -3) & (x < 3)) / 6.0)


def hardswish(x):
    return x * hardsigmoid(x)


def hardswish_backward(go, x):
    """x / 3 + 1/2 inside (-3, 3); at the kinks PyTorch's one-sided choice: 0 at -3, 1 at 3."""
    return go * np.where(x <= -3, 0.0, np.where(x < 3, x / 3.0 + 0.5, 1.0))


def _erf(z):
    """erf in float64 (numpy has none, and this module imports numpy alone): the series
    erf(a) = 2/sqrt(pi) exp(-a^2) sum_n (2a^2)^n a / (1 3 5 ... (2n+1)), all its terms positive
    (no cancellation), to within 3e-15 of the correctly rounded value; erf(a) = 1 from a = 6
    (erfc(6) < 3e-17)."""
    z = np.asarray(z, np.float64)
    a = np.minimum(np.abs(z), 6.0)
    a2 = a * a
    term = a.copy()
    total = a.copy()
    for n in range(1, 160):  # past n ~ 2 a^2 = 72 each term at most halves the one before
        term = term * (2.0 * a2 / (2 * n + 1))
        total = total + term
    r = np.where(np.abs(z) >= 6.0, 1.0, 2.0 / np.sqrt(np.pi) * np.exp(-a2) * total)
    return np.sign(z) * r


def gelu(x, approximate="none"):
    x = np.asarray(x, np.float64)
    if approximate == "tanh":
        return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))
    return 0.5 * x * (1.0 + _erf(x / np.sqrt(2.0)))


def gelu_backward(go, x, approximate="none"):
    x = np.asarray(x, np.float64)
    if approximate == "tanh":
        k = np.sqrt(2.0 / np.pi)
        t = np.tanh(k * (x + 0.044715 * x ** 3))
        return go * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * k * (1.0 + 3 * 0.044715 * x * x))
    return go * (0.5 * (1.0 + _erf(x / np.sqrt(2.0))) + x * np.exp(-0.5 * x * x) / np.sqrt(2 * np.pi))


# every fused activation's name (None: none) -> (forward(z), backward(go, z)), for the layers
# that take an activation= keyword
ACTIVATIONS = {
    None: (lambda z: z, lambda go, z: go),
    "relu": (relu, relu_backward),
    "relu6": (relu6, relu6_backward),
    "silu": (silu, silu_backward),
    "hardswish": (hardswish, hardswish_backward),
    "hardsigmoid": (hardsigmoid, hardsigmoid_backward),
    "sigmoid": (sigmoid, sigmoid_backward),
    "gelu": (gelu, gelu_backward),
    "gelu_tanh": (lambda z: gelu(z, "tanh"), lambda go, z: gelu_backward(go, z, "tanh")),
}


def global_avg_pool2d(x):
    """x: [N, C, H, W] -> [N, C]."""
    return x.mean(axis=(2, 3))


def global_avg_pool2d_backward(go, h, w):
    """go: [N, C] -> [N, C, h, w]."""
    return np.broadcast_to(go[:, :, None, None] / (h * w), go.shape + (h, w)).copy()


# -- losses: each forward is a [1] array, each backward d loss / d input ----------------------------
def mse_loss(pred, target):
    return np.array([np.mean((pred - target) ** 2)])


def mse_loss_backward(pred, target):
    return 2.0 * (pred - target) / pred.size


def _log_softmax(z):
    z = z - z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


def _ce_target(z, labels, label_smoothing):
    """PyTorch's smoothed target: (1 - eps) onehot + eps / K."""
    t = np.full(z.shape, label_smoothing / z.shape[1])
    t[np.arange(len(labels)), labels] += 1.0 - label_smoothing
    return t


def cross_entropy(z, labels, label_smoothing=0.0):
    """z: [N, K] logits, labels: [N] class indices -> mean softmax cross-entropy [1]; with
    label_smoothing eps the target is (1 - eps) onehot + eps / K (PyTorch's)."""
    ls = _log_softmax(z)
    if label_smoothing:
        return np.array([-(_ce_target(z, labels, label_smoothing) * ls).sum(1).mean()])
    return np.array([-ls[np.arange(len(labels)), labels].mean()])


def cross_entropy_backward(z, labels, label_smoothing=0.0):
    g = np.exp(_log_softmax(z))
    if label_smoothing:
        return (g - _ce_target(z, labels, label_smoothing)) / len(labels)
    g[np.arange(len(labels)), labels] -= 1.0
    return g / len(labels)


# -- optimizers: one step, returning the new values (the inputs are left alone) ---------------------
def sgd_step(p, g, v, lr, momentum):
    """-> new p, new v (v None: plain SGD, no velocity)."""
    if v is None:
        return p - lr * g, None
    v = momentum * v + g
    return p - lr * v, v


def adam_step(p, g, m, v, step, lr, b1, b2, eps):
    """step counts from 1 (bias correction) -> new p, new m, new v."""
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    mhat = m / (1 - b1**step)
    vhat = v / (1 - b2**step)
    return p - lr * mhat / (np.sqrt(vhat) + eps), m, v


# -- finite differences -----------------------------------------------------------------------------
def numeric_grad(f, x, go, eps=1e-6):
    """d sum(f(x) * go) / dx by central differences, as float64.

    x is perturbed in place one element at a time (and restored), so f may read it through x or
    through any other reference to the same array. The step is taken in x's dtype and the
    difference is divided by the step actually taken (in float32, x[i] +- eps rounds).
    """
    g = np.zeros(x.shape)
    step = x.dtype.type(eps)
    for i in np.ndindex(x.shape):
        old = x[i]
        x[i] = old + step
        hi = float(x[i])
        fp = float(np.sum(np.asarray(f(x), dtype=np.float64) * go))
        x[i] = old - step
        lo = float(x[i])
        fm = float(np.sum(np.asarray(f(x), dtype=np.float64) * go))
        x[i] = old
        g[i] = (fp - fm) / (hi - lo)
    return g


# -- channel scales (squeeze-and-excitation, ConvNeXt's layer scale) -------------------------------
def _per_channel(s, x, shared):
    """s ([N, C, 1...] per sample, or [C, 1...] shared) broadcast against x [N, C, ...]."""
    lead = (1, x.shape[1]) if shared else x.shape[:2]
    return s.reshape(lead + (1,) * (x.ndim - 2))


def channel_scale(x, s):
    """x: [N, C, ...], s: [N, C] or [N, C, 1, 1] -> x * s[n, c]."""
    return x * _per_channel(s, x, False)


def channel_scale_backward(x, s, go):
    """go like x -> dx = go * s, ds [s's shape] = sum over the positions of go * x."""
    axes = tuple(range(2, x.ndim))
    return go * _per_channel(s, x, False), (go * x).sum(axis=axes).reshape(s.shape)


def layer_scale(x, gamma):
    """x: [N, C, ...], gamma: [C] or [C, 1, 1] -> x * gamma[c]."""
    return x * _per_channel(gamma, x, True)


def layer_scale_backward(x, gamma, go):
    """go like x -> dx = go * gamma, dgamma [gamma's shape] = sum over n and positions."""
    axes = (0,) + tuple(range(2, x.ndim))
    return go * _per_channel(gamma, x, True), (go * x).sum(axis=axes).reshape(gamma.shape)
