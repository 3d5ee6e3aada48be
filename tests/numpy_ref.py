"""float64 numpy references for every op, forward and backward, and the error bookkeeping.

The backward references are checked against central finite differences of the forward
references in tests/test_reference.py, so they are trustworthy in their own right.
"""

import numpy as np

WORST = {}


def assert_close(op, got, ref, rtol=1e-4, atol=1e-5):
    """assert_allclose with float32 tolerances (atol scaled by ref's magnitude); records the error."""
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape, "%s: shape %s, expected %s" % (op, got.shape, ref.shape)
    scale = float(np.max(np.abs(ref))) if ref.size else 0.0
    err = float(np.max(np.abs(got - ref))) / max(scale, 1e-30) if ref.size else 0.0
    WORST[op] = max(WORST.get(op, 0.0), err)
    np.testing.assert_allclose(got, ref, rtol=rtol, atol=atol * max(scale, 1.0), err_msg=op)


# -- convolutions ---------------------------------------------------------------------------------
def _windows(xp, kh, kw, s, ho, wo):
    """(i, j, xp[..., i::s, j::s] cut to ho x wo) for each kernel tap."""
    for i in range(kh):
        for j in range(kw):
            yield i, j, (slice(i, i + s * (ho - 1) + 1, s), slice(j, j + s * (wo - 1) + 1, s))


def _geom(x, kh, kw, s, p):
    n, c, h, w = x.shape
    return (h + 2 * p - kh) // s + 1, (w + 2 * p - kw) // s + 1


def _pad(x, p):
    return np.pad(x, ((0, 0), (0, 0), (p, p), (p, p)))


def conv2d(x, w, b, s, p):
    """x: [N, C, H, W], w: [O, C, kh, kw], b: [O] or None -> [N, O, Ho, Wo]."""
    kh, kw = w.shape[2:]
    ho, wo = _geom(x, kh, kw, s, p)
    xp = _pad(x, p)
    y = np.zeros((x.shape[0], w.shape[0], ho, wo))
    for i, j, (si, sj) in _windows(xp, kh, kw, s, ho, wo):
        y += np.einsum("nchw,oc->nohw", xp[:, :, si, sj], w[:, :, i, j])
    if b is not None:
        y += b[None, :, None, None]
    return y


def conv2d_backward(x, w, s, p, go):
    """-> dx, dW, db."""
    kh, kw = w.shape[2:]
    ho, wo = go.shape[2:]
    xp = _pad(x, p)
    dxp = np.zeros_like(xp)
    dw = np.zeros_like(w)
    for i, j, (si, sj) in _windows(xp, kh, kw, s, ho, wo):
        dw[:, :, i, j] = np.einsum("nohw,nchw->oc", go, xp[:, :, si, sj])
        dxp[:, :, si, sj] += np.einsum("nohw,oc->nchw", go, w[:, :, i, j])
    h, wd = x.shape[2:]
    return dxp[:, :, p : p + h, p : p + wd], dw, go.sum(axis=(0, 2, 3))


def dwconv2d(x, w, b, s, p):
    """x: [N, C, H, W], w: [C, kh, kw], b: [C] or None -> [N, C, Ho, Wo]."""
    kh, kw = w.shape[1:]
    ho, wo = _geom(x, kh, kw, s, p)
    xp = _pad(x, p)
    y = np.zeros((x.shape[0], x.shape[1], ho, wo))
    for i, j, (si, sj) in _windows(xp, kh, kw, s, ho, wo):
        y += xp[:, :, si, sj] * w[None, :, i, j, None, None]
    if b is not None:
        y += b[None, :, None, None]
    return y


def dwconv2d_backward(x, w, s, p, go):
    kh, kw = w.shape[1:]
    ho, wo = go.shape[2:]
    xp = _pad(x, p)
    dxp = np.zeros_like(xp)
    dw = np.zeros_like(w)
    for i, j, (si, sj) in _windows(xp, kh, kw, s, ho, wo):
        dw[:, i, j] = np.einsum("nchw,nchw->c", go, xp[:, :, si, sj])
        dxp[:, :, si, sj] += go * w[None, :, i, j, None, None]
    h, wd = x.shape[2:]
    return dxp[:, :, p : p + h, p : p + wd], dw, go.sum(axis=(0, 2, 3))


# -- dense ----------------------------------------------------------------------------------------
def linear(x, w, b):
    y = x @ w.T
    return y + b if b is not None else y


def linear_backward(x, w, go):
    return go @ w, go.T @ x, go.sum(axis=0)


def _norm_backward(go, xhat, rstd, g, axes):
    """dx for y = xhat * g + b with xhat normalized over `axes` (g already broadcast)."""
    dxhat = go * g
    return rstd * (
        dxhat - dxhat.mean(axis=axes, keepdims=True)
        - xhat * (dxhat * xhat).mean(axis=axes, keepdims=True)
    )


def layernorm(x, g, b, eps):
    mean = x.mean(axis=-1, keepdims=True)
    var = x.var(axis=-1, keepdims=True)
    rstd = 1.0 / np.sqrt(var + eps)
    return (x - mean) * rstd * g + b


def layernorm_backward(x, g, eps, go):
    mean = x.mean(axis=-1, keepdims=True)
    rstd = 1.0 / np.sqrt(x.var(axis=-1, keepdims=True) + eps)
    xhat = (x - mean) * rstd
    rows = tuple(range(x.ndim - 1))
    return _norm_backward(go, xhat, rstd, g, -1), (go * xhat).sum(axis=rows), go.sum(axis=rows)


def _c(v):
    return v[None, :, None, None]


def batchnorm2d_train(x, g, b, eps):
    """-> y, batch mean, biased batch var."""
    mean = x.mean(axis=(0, 2, 3))
    var = x.var(axis=(0, 2, 3))
    y = (x - _c(mean)) / np.sqrt(_c(var) + eps) * _c(g) + _c(b)
    return y, mean, var


def batchnorm2d_eval(x, g, b, rm, rv, eps):
    return (x - _c(rm)) / np.sqrt(_c(rv) + eps) * _c(g) + _c(b)


def batchnorm2d_backward(x, g, eps, go):
    axes = (0, 2, 3)
    mean = x.mean(axis=axes, keepdims=True)
    rstd = 1.0 / np.sqrt(x.var(axis=axes, keepdims=True) + eps)
    xhat = (x - mean) * rstd
    dx = _norm_backward(go, xhat, rstd, _c(g), axes)
    return dx, (go * xhat).sum(axis=axes), go.sum(axis=axes)


# -- elementwise, pooling, losses -------------------------------------------------------------------
def relu(x):
    return np.maximum(x, 0.0)


def relu6(x):
    return np.minimum(np.maximum(x, 0.0), 6.0)


def relu_backward(go, x):
    return go * (x > 0)


def relu6_backward(go, x):
    return go * ((x > 0) & (x < 6))


def avgpool(x):
    return x.mean(axis=(2, 3))


def avgpool_backward(go, h, w):
    return np.broadcast_to(go[:, :, None, None] / (h * w), go.shape + (h, w)).copy()


def mse(p, t):
    return np.array([np.mean((p - t) ** 2)])


def mse_backward(p, t):
    return 2.0 * (p - t) / p.size


def _log_softmax(z):
    z = z - z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


def cross_entropy(z, labels):
    ls = _log_softmax(z)
    return np.array([-ls[np.arange(len(labels)), labels].mean()])


def cross_entropy_backward(z, labels):
    g = np.exp(_log_softmax(z))
    g[np.arange(len(labels)), labels] -= 1.0
    return g / len(labels)


# -- optimizers -----------------------------------------------------------------------------------
def sgd(p, g, v, lr, momentum):
    """-> new p, new v (v None: plain SGD)."""
    if v is None:
        return p - lr * g, None
    v = momentum * v + g
    return p - lr * v, v


def adam(p, g, m, v, step, lr, b1, b2, eps):
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    mhat = m / (1 - b1**step)
    vhat = v / (1 - b2**step)
    return p - lr * mhat / (np.sqrt(vhat) + eps), m, v


# -- finite differences (float64) -----------------------------------------------------------------
def numeric_grad(f, x, go, eps=1e-6):
    """d sum(f(x) * go) / dx by central differences."""
    g = np.zeros_like(x)
    it = np.nditer(x, flags=["multi_index"])
    for _ in it:
        i = it.multi_index
        old = x[i]
        x[i] = old + eps
        fp = np.sum(f(x) * go)
        x[i] = old - eps
        fm = np.sum(f(x) * go)
        x[i] = old
        g[i] = (fp - fm) / (2 * eps)
    return g
