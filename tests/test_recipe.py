"""The training recipe's pieces against PyTorch (issue 30): SGD (weight decay, dampening,
Nesterov), Adam (L2) and AdamW, cross-entropy label smoothing, Dropout and StochasticDepth, the
learning-rate schedulers and the EMA of the weights (AveragedModel).

Each comparison starts PyTorch and utensil from the same weights and feeds both the same
gradients, step after step; PyTorch is the reference (never hard-coded numbers)."""

import numpy as np
import pytest

import utensil_ffi as ut
from utensil_ffi import functional as F

# ---- optimizers ------------------------------------------------------------------------------

SHAPES = [(5, 3), (7,), (2, 3, 2, 2)]


def _params(rng, device):
    init = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    return init, [ut.Parameter(a, device) for a in init]


def _run(torch, ut_opt, t_opt_fn, rng, device, steps=6, grad_none_at=None):
    """Step both optimizers on the same gradients; compare weights and state after each step.
    grad_none_at: (step, param index) whose grad is None that step (skipped, as in PyTorch)."""
    init, ps = _params(rng, device)
    tps = [torch.nn.Parameter(torch.from_numpy(a.copy())) for a in init]
    opt, topt = ut_opt(ps), t_opt_fn(tps)
    try:
        for s in range(steps):
            for i, (p, tp) in enumerate(zip(ps, tps)):
                g = rng.standard_normal(p.shape).astype(np.float32)
                if grad_none_at == (s, i):
                    p.grad.close()
                    p.grad = None
                    tp.grad = None
                else:
                    if p.grad is None:
                        p.grad = ut.zeros(p.shape, device)
                    p.grad.copy_from(g)
                    tp.grad = torch.from_numpy(g.copy())
            opt.step()
            topt.step()
            for p, tp in zip(ps, tps):
                want = tp.detach().numpy()
                np.testing.assert_allclose(p.numpy(), want, rtol=2e-6, atol=2e-7 * np.abs(want).max())
        sd, tsd = opt.state_dict(), topt.state_dict()
        for k, entry in tsd["state"].items():
            for name, val in entry.items():
                if val is None:
                    continue
                np.testing.assert_allclose(sd["state"][k][name], val.numpy(), rtol=2e-6, atol=1e-7)
        for key, val in sd["param_groups"][0].items():
            want = tsd["param_groups"][0][key]
            assert (tuple(val) == tuple(want)) if key == "betas" else val == pytest.approx(want), key
    finally:
        opt.close()
        for p in ps:
            p.close()
    return sd, tsd


SGD_CASES = [
    dict(lr=0.1),
    dict(lr=0.1, weight_decay=0.05),
    dict(lr=0.05, momentum=0.9),
    dict(lr=0.05, momentum=0.9, weight_decay=1e-2),
    dict(lr=0.05, momentum=0.9, dampening=0.3, weight_decay=1e-2),
    dict(lr=0.05, momentum=0.9, nesterov=True),
    dict(lr=0.05, momentum=0.8, nesterov=True, weight_decay=4e-5),
]


@pytest.mark.parametrize("kw", SGD_CASES, ids=lambda kw: ",".join("%s=%s" % i for i in kw.items()))
def test_sgd_matches_pytorch(torch, device, rng, kw):
    _run(torch, lambda ps: ut.SGD(ps, **kw), lambda ps: torch.optim.SGD(ps, **kw), rng, device)


def test_sgd_dampening_first_step_after_a_skipped_grad(torch, device, rng):
    """A parameter without a grad at the first step gets PyTorch's first-step buffer (d itself,
    no dampening) at the step it first has one, while the others are dampened."""
    kw = dict(lr=0.05, momentum=0.9, dampening=0.5, weight_decay=0.01)
    _run(torch, lambda ps: ut.SGD(ps, **kw), lambda ps: torch.optim.SGD(ps, **kw), rng, device,
         grad_none_at=(0, 1))


ADAM_CASES = [
    ("Adam", dict(lr=1e-2)),
    ("Adam", dict(lr=1e-2, weight_decay=0.1)),
    ("Adam", dict(lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=1e-3)),
    ("AdamW", dict()),
    ("AdamW", dict(lr=1e-2, weight_decay=0.1)),
    ("AdamW", dict(lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05)),
]


@pytest.mark.parametrize("kind,kw", ADAM_CASES,
                         ids=lambda x: x if isinstance(x, str) else ",".join("%s=%s" % i for i in x.items()))
def test_adam_adamw_match_pytorch(torch, device, rng, kind, kw):
    _run(torch, lambda ps: getattr(ut, kind)(ps, **kw),
         lambda ps: getattr(torch.optim, kind)(ps, **kw), rng, device, steps=8,
         grad_none_at=(2, 0))


def test_adamw_defaults_are_pytorchs(torch):
    with ut.Linear(2, 2) as lin:
        opt = ut.AdamW(lin.parameters())
        want = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))]).defaults
        assert opt.lr == want["lr"] and opt.weight_decay == want["weight_decay"]
        assert opt.betas == want["betas"] and opt.eps == want["eps"]
        assert opt.decoupled_weight_decay
        sgd = ut.SGD(lin.parameters())
        assert sgd.lr == torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))]).defaults["lr"]
        opt.close()
        sgd.close()


def test_optimizer_state_dicts_load_into_pytorch_and_back(torch, rng):
    """SGD (Nesterov, decay) and AdamW state dicts: PyTorch loads them, steps on, and utensil
    loading PyTorch's dict continues identically."""
    for make, tmake in (
        (lambda ps: ut.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
         lambda ps: torch.optim.SGD(ps, lr=1.0)),
        (lambda ps: ut.AdamW(ps, lr=0.01, weight_decay=0.2), lambda ps: torch.optim.AdamW(ps)),
    ):
        init, ps = _params(rng, "cpu")
        tps = [torch.nn.Parameter(torch.from_numpy(a.copy())) for a in init]
        opt, topt = make(ps), tmake(tps)
        for p in ps:
            p.grad.copy_from(rng.standard_normal(p.shape).astype(np.float32))
        opt.step()
        sd = opt.state_dict()
        topt.load_state_dict({"state": {i: {k: torch.from_numpy(v) for k, v in e.items()}
                                        for i, e in sd["state"].items()},
                              "param_groups": sd["param_groups"]})
        for tp, p in zip(tps, ps):
            tp.data.copy_(torch.from_numpy(p.numpy()))
        fresh = make(ps)
        fresh.load_state_dict(topt.state_dict())
        assert fresh.state_dict()["param_groups"] == sd["param_groups"]
        for p, tp in zip(ps, tps):
            g = rng.standard_normal(p.shape).astype(np.float32)
            p.grad.copy_from(g)
            tp.grad = torch.from_numpy(g)
        fresh.step()
        topt.step()
        for p, tp in zip(ps, tps):
            np.testing.assert_allclose(p.numpy(), tp.detach().numpy(), rtol=2e-6, atol=1e-7)
        opt.close()
        fresh.close()
        for p in ps:
            p.close()


@pytest.mark.parametrize("make,match", [
    (lambda ps: ut.SGD(ps, weight_decay=-1), "Invalid weight_decay value"),
    (lambda ps: ut.AdamW(ps, weight_decay=-0.5), "Invalid weight_decay value"),
    (lambda ps: ut.Adam(ps, weight_decay=-0.5), "Invalid weight_decay value"),
    (lambda ps: ut.SGD(ps, momentum=-0.1), "Invalid momentum value"),
    (lambda ps: ut.SGD(ps, nesterov=True), "Nesterov momentum requires"),
    (lambda ps: ut.SGD(ps, momentum=0.9, dampening=0.1, nesterov=True), "Nesterov momentum requires"),
    (lambda ps: ut.SGD(ps, lr=-1), "lr"),
    (lambda ps: ut.AdamW(ps, lr=float("nan")), "lr"),
    (lambda ps: ut.SGD(ps, weight_decay=float("inf")), "weight_decay"),
])
def test_optimizer_bad_values(torch, make, match):
    with ut.Linear(2, 2) as lin:
        with pytest.raises(ut.ArgumentError, match=match):
            make(lin.parameters())


def test_c_steps_refuse_bad_weight_decay():
    """The C entry points check for callers that do not come through Python."""
    p, g, m, v = (ut.zeros(3) for _ in range(4))
    try:
        with pytest.raises(ut.ArgumentError, match="Invalid weight_decay value"):
            F.adam_step(p, g, m, v, 1, weight_decay=-1.0)
        with pytest.raises(ut.ArgumentError, match="Nesterov"):
            F.sgd_step_many([p], [g], [v], 0.1, 0.0, nesterov=True)
        from utensil_ffi._lib import ffi, lib
        arr = [ffi.new("ut_tensor*[]", [t._ptr]) for t in (p, g, v)]
        assert lib.ut_sgd_step_many_ex(arr[0], arr[1], arr[2], 1, 0.1, 0.9, 0.0, -1.0, False) < 0
        assert b"Invalid weight_decay" in ffi.string(lib.ut_last_error())
        assert lib.ut_adam_step_ex(p._ptr, g._ptr, m._ptr, v._ptr, 1, 0.1, 0.9, 0.99, 1e-8,
                                   float("nan"), True) < 0
    finally:
        for t in (p, g, m, v):
            t.close()


# ---- cross-entropy label smoothing -----------------------------------------------------------

@pytest.mark.parametrize("eps", [0.0, 0.1, 0.35, 1.0])
@pytest.mark.parametrize("n,k", [(6, 5), (3, 1000), (1, 2)])
def test_cross_entropy_label_smoothing_matches_pytorch(torch, device, rng, eps, n, k):
    x = (rng.standard_normal((n, k)) * 4).astype(np.float32)
    y = rng.integers(0, k, n)
    tx = torch.from_numpy(x.astype(np.float64)).requires_grad_()
    want = torch.nn.functional.cross_entropy(tx, torch.from_numpy(y), label_smoothing=eps)
    want.backward()
    crit = ut.CrossEntropyLoss(label_smoothing=eps)
    # the CPU sums in float64; the GPU's row kernels in float32 (K terms, expf)
    rtol = 2e-6 if device == "cpu" else 1e-5
    gtol = dict(rtol=1e-5, atol=(1e-8 if device == "cpu" else 1e-6) * np.abs(tx.grad.numpy()).max())
    with ut.tensor(x, device=device) as t:
        with crit(t, y) as loss, crit.backward() as g:
            np.testing.assert_allclose(loss.numpy()[0], want.item(), rtol=rtol, atol=1e-6)
            np.testing.assert_allclose(g.numpy(), tx.grad.numpy(), **gtol)
        with F.cross_entropy(t, y, label_smoothing=eps) as l2, \
                F.cross_entropy_backward(t, y, label_smoothing=eps) as g2:
            np.testing.assert_allclose(l2.numpy()[0], want.item(), rtol=rtol, atol=1e-6)
            np.testing.assert_allclose(g2.numpy(), tx.grad.numpy(), **gtol)
    crit.close()


def test_cross_entropy_label_smoothing_gradient_is_the_loss_derivative(device, rng):
    """Central differences of the smoothed loss in float64 against the C gradient."""
    x = rng.standard_normal((3, 4))
    y = np.array([0, 3, 1])
    eps = 0.2

    def loss64(z):
        z = z - z.max(1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(1, keepdims=True))
        target = np.full_like(z, eps / z.shape[1])
        target[np.arange(len(y)), y] += 1 - eps
        return -(target * logp).sum(1).mean()

    num = np.zeros_like(x)
    for i in np.ndindex(*x.shape):
        d = np.zeros_like(x)
        d[i] = 1e-6
        num[i] = (loss64(x + d) - loss64(x - d)) / 2e-6
    with ut.tensor(x.astype(np.float32), device=device) as t:
        with F.cross_entropy_backward(t, y, label_smoothing=eps) as g:
            np.testing.assert_allclose(g.numpy(), num, rtol=1e-4, atol=1e-6)
        with F.cross_entropy(t, y, label_smoothing=eps) as l:
            assert l.numpy()[0] == pytest.approx(loss64(x.astype(np.float32).astype(np.float64)), rel=1e-6)


def test_cross_entropy_label_smoothing_bf16_logits(device, rng, torch):
    x = (rng.standard_normal((4, 7)) * 2).astype(np.float32)
    y = rng.integers(0, 7, 4)
    with ut.tensor(x, device=device).to(ut.bfloat16) as t:
        xb = t.to(ut.float32).numpy()
        tx = torch.from_numpy(xb.astype(np.float64)).requires_grad_()
        want = torch.nn.functional.cross_entropy(tx, torch.from_numpy(y), label_smoothing=0.25)
        want.backward()
        with F.cross_entropy(t, y, label_smoothing=0.25) as l, \
                F.cross_entropy_backward(t, y, label_smoothing=0.25) as g:
            assert g.dtype == ut.bfloat16
            np.testing.assert_allclose(l.numpy()[0], want.item(), rtol=2e-6 if device == "cpu" else 1e-5)
            np.testing.assert_allclose(g.to(ut.float32).numpy(), tx.grad.numpy(), rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("eps", [-0.1, 1.5, float("nan")])
def test_cross_entropy_label_smoothing_bad_values(eps):
    with pytest.raises(ut.ArgumentError):
        ut.CrossEntropyLoss(label_smoothing=eps)
    with ut.tensor(np.zeros((2, 3), np.float32)) as t:
        with pytest.raises(ut.ArgumentError):
            F.cross_entropy(t, [0, 1], label_smoothing=eps)
    from utensil_ffi._lib import ffi, lib
    with ut.tensor(np.zeros((2, 3), np.float32)) as t, ut.tensor([0.0, 1.0]) as y:
        assert lib.ut_cross_entropy_loss_smoothed(t._ptr, y._ptr, 1.5) == ffi.NULL
        assert b"label_smoothing must be between 0.0 and 1.0" in ffi.string(lib.ut_last_error())


# ---- Dropout and StochasticDepth -------------------------------------------------------------

def _binomial_ok(count, n, p, z=6.0):
    """count ~ Binomial(n, p) within z standard deviations."""
    sd = np.sqrt(n * p * (1 - p))
    return abs(count - n * p) <= z * sd + 1


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_statistics_and_backward(device, rng, p):
    x = rng.standard_normal((64, 300)).astype(np.float32)
    go = rng.standard_normal(x.shape).astype(np.float32)
    ut.seed(11)
    d = ut.Dropout(p)
    with ut.tensor(x, device=device) as t, ut.tensor(go, device=device) as gt:
        with d(t) as y, d.backward(gt) as dx:
            a, g = y.numpy(), dx.numpy()
    kept = a != 0
    assert _binomial_ok((~kept).sum(), x.size, p)
    scale = np.float32(1) / np.float32(1 - p)
    np.testing.assert_array_equal(a[kept], x[kept] * scale)  # exactly x / (1 - p), float32
    np.testing.assert_array_equal(g, np.where(kept, go * scale, 0))  # the same mask
    d.close()


def test_dropout_is_deterministic_under_seed(device):
    x = np.ones((8, 50), np.float32)
    outs = []
    for s in (5, 5, 6):
        ut.seed(s)
        with ut.Dropout(0.5) as d, ut.tensor(x, device=device) as t, d(t) as y:
            outs.append(y.numpy())
    np.testing.assert_array_equal(outs[0], outs[1])
    assert not np.array_equal(outs[0], outs[2])


def test_dropout_identity_cases_and_inplace(device, rng):
    x = rng.standard_normal((4, 5)).astype(np.float32)
    with ut.tensor(x, device=device) as t:
        d = ut.Dropout(0.5).eval()
        assert d(t) is t
        d0 = ut.Dropout(0.0)
        assert d0(t) is t
        with ut.tensor(np.ones_like(x), device=device) as g:
            assert d0.backward(g) is g
        with ut.Dropout(1.0)(t) as y:
            np.testing.assert_array_equal(y.numpy(), 0)
        ut.seed(3)
        y = ut.Dropout(0.5, inplace=True)(t)
        assert y is t and np.all((t.numpy() == 0) | (t.numpy() == x * 2))
        with pytest.raises(ut.ArgumentError):
            d.backward(t)  # eval mode kept nothing
    for bad in (-0.1, 1.01):
        with pytest.raises(ut.ArgumentError, match="dropout probability has to be between 0 and 1"):
            ut.Dropout(bad)
        with pytest.raises(ut.ArgumentError, match="drop probability has to be between 0 and 1"):
            ut.StochasticDepth(bad, "row")
    with pytest.raises(ut.ArgumentError, match="mode has to be either 'batch' or 'row'"):
        ut.StochasticDepth(0.1, "col")
    assert repr(ut.Dropout(0.2)) == "Dropout(p=0.2, inplace=False)"
    assert ut.Dropout(0.2).state_dict() == {} and ut.Dropout().parameters() == []


def test_dropout_bf16_activations(device, rng):
    x = rng.standard_normal((16, 64)).astype(np.float32)
    ut.seed(8)
    d = ut.Dropout(0.25)
    with ut.tensor(x, device=device).to(ut.bfloat16) as t:
        xb = t.to(ut.float32).numpy()
        with d(t) as y, d.backward(t) as dx:
            assert y.dtype == ut.bfloat16 and dx.dtype == ut.bfloat16
            a = y.to(ut.float32).numpy()
            g = dx.to(ut.float32).numpy()
    kept = a != 0
    want = ut.dtypes.round_bf16(xb * (np.float32(1) / np.float32(0.75)))
    np.testing.assert_array_equal(a[kept], want[kept])
    np.testing.assert_array_equal(g, np.where(kept, want, 0))
    d.close()


@pytest.mark.parametrize("mode", ["row", "batch"])
def test_stochastic_depth(device, rng, mode):
    p, n = 0.3, 400
    x = rng.standard_normal((n, 3, 2, 2)).astype(np.float32)
    go = rng.standard_normal(x.shape).astype(np.float32)
    ut.seed(21)
    sd = ut.StochasticDepth(p, mode)
    dropped = 0
    trials = 1 if mode == "row" else 40
    for _ in range(trials):
        with ut.tensor(x, device=device) as t, ut.tensor(go, device=device) as gt:
            with sd(t) as y, sd.backward(gt) as dx:
                a, g = y.numpy(), dx.numpy()
        rows = a.reshape(n, -1)
        zero = np.all(rows == 0, axis=1)
        scale = np.float32(1) / np.float32(1 - p)
        np.testing.assert_array_equal(rows[~zero], (x.reshape(n, -1) * scale)[~zero])
        np.testing.assert_array_equal(g.reshape(n, -1), np.where(zero[:, None], 0, go.reshape(n, -1) * scale))
        if mode == "batch":
            assert zero.all() or not zero.any()  # one draw for the whole batch
            dropped += zero.all()
        else:
            dropped += zero.sum()
    assert _binomial_ok(dropped, n if mode == "row" else trials, p)
    sd.eval()
    with ut.tensor(x, device=device) as t:
        assert sd(t) is t
    assert repr(sd) == "StochasticDepth(p=0.3, mode=%s)" % mode


def test_dropout_in_a_network_trains_with_consistent_gradients(device, rng):
    """Linear -> Dropout -> Linear: the weight gradient equals the float64 one computed with
    the mask the forward drew (recovered from the hidden activations)."""
    ut.seed(4)
    l1, l2 = ut.Linear(5, 16, device=device), ut.Linear(16, 3, device=device)
    drop = ut.Dropout(0.4)
    net = ut.Sequential(l1, drop, l2)
    x = rng.standard_normal((7, 5)).astype(np.float32)
    go = rng.standard_normal((7, 3)).astype(np.float32)
    with ut.tensor(x, device=device) as t, ut.tensor(go, device=device) as g:
        net.zero_grad()
        with net(t) as y:
            out = y.numpy()
        net.backward(g, input_grad=False)
    w1, b1 = l1.weight.numpy().astype(np.float64), l1.bias.numpy().astype(np.float64)
    w2, b2 = l2.weight.numpy().astype(np.float64), l2.bias.numpy().astype(np.float64)
    h = x @ w1.T + b1
    # the mask: out = (h * m) @ w2.T + b2 -> solve per row is ill-posed; read it from a replay
    ut.seed(4)
    ut.Linear(5, 16), ut.Linear(16, 3)  # the same draws as the layers' initialization
    with F.dropout_mask(h.shape, 0.4, device) as m:
        mask = m.numpy().astype(np.float64)
    hm = h * mask
    np.testing.assert_allclose(out, hm @ w2.T + b2, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(l2.weight.grad.numpy(), go.T.astype(np.float64) @ hm, rtol=1e-5, atol=1e-5)
    dh = (go.astype(np.float64) @ w2) * mask
    np.testing.assert_allclose(l1.weight.grad.numpy(), dh.T @ x, rtol=1e-5, atol=1e-5)
    net.close()


def test_onnx_export_writes_dropout_as_identity(tmp_path, rng):
    pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from utensil_ffi.interop.onnx_export import export_onnx
    ut.seed(2)
    net = ut.Sequential(ut.Linear(6, 8), ut.Dropout(0.5), ut.ReLU(), ut.StochasticDepth(0.2, "row"),
                        ut.Linear(8, 3))
    path = str(tmp_path / "drop.onnx")
    export_onnx(net, path, (2, 6))
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    x = rng.standard_normal((3, 6)).astype(np.float32)
    net.eval()
    with net(x) as y:
        np.testing.assert_allclose(sess.run(None, {"input": x})[0], y.numpy(), rtol=1e-5, atol=1e-6)
    import onnx
    ops = {n.op_type for n in onnx.load(path).graph.node}
    assert "Dropout" not in ops
    net.close()


# ---- learning-rate schedules -----------------------------------------------------------------

def _sched_pair(torch, build, lr=0.1):
    lin = ut.Linear(2, 2)
    opt = ut.SGD(lin.parameters(), lr=lr, momentum=0.9)
    tp = torch.nn.Parameter(torch.zeros(2))
    topt = torch.optim.SGD([tp], lr=lr, momentum=0.9)
    return lin, opt, build(ut.optim.lr_scheduler, opt), topt, build(torch.optim.lr_scheduler, topt)


SCHEDULES = {
    "linear": lambda L, o: L.LinearLR(o, start_factor=0.1, end_factor=0.9, total_iters=4),
    "cosine": lambda L, o: L.CosineAnnealingLR(o, T_max=6, eta_min=1e-4),
    "warmup_cosine": lambda L, o: L.SequentialLR(
        o, [L.LinearLR(o, start_factor=0.01, total_iters=5),
            L.CosineAnnealingLR(o, T_max=20)], milestones=[5]),
    "three_phases": lambda L, o: L.SequentialLR(
        o, [L.LinearLR(o, start_factor=0.2, total_iters=2),
            L.CosineAnnealingLR(o, T_max=3, eta_min=0.01),
            L.LinearLR(o, start_factor=0.5, total_iters=2)], milestones=[2, 7]),
}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_lr_schedulers_match_pytorch_exactly(torch, name):
    import warnings
    lin, opt, s, topt, ts = _sched_pair(torch, SCHEDULES[name])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(30):
            assert s.get_last_lr() == ts.get_last_lr()  # the same floats, not only close
            assert opt.lr == topt.param_groups[0]["lr"]
            opt.step()
            topt.step()
            s.step()
            ts.step()
    sd, tsd = s.state_dict(), ts.state_dict()

    def plain(d):
        return {k: ([plain(x) for x in v] if k == "_schedulers" else v) for k, v in d.items()}
    assert plain(sd) == plain(tsd)
    assert opt.state_dict()["param_groups"][0]["initial_lr"] == topt.state_dict()["param_groups"][0]["initial_lr"]
    lin.close()
    opt.close()


def test_lr_scheduler_state_dict_resumes(torch):
    """A schedule saved mid-way and loaded into a fresh optimizer + scheduler continues as the
    uninterrupted one."""
    build = SCHEDULES["warmup_cosine"]
    lin, opt, s, _, _ = _sched_pair(torch, build)
    for _ in range(7):
        opt.step()
        s.step()
    osd, ssd = opt.state_dict(), s.state_dict()
    lin2 = ut.Linear(2, 2)
    opt2 = ut.SGD(lin2.parameters(), lr=0.1, momentum=0.9)
    s2 = build(ut.optim.lr_scheduler, opt2)
    opt2.load_state_dict(osd)
    s2.load_state_dict(ssd)
    for _ in range(10):
        opt.step(), opt2.step()
        s.step(), s2.step()
        assert s.get_last_lr() == s2.get_last_lr()
    for m in (lin, lin2, opt, opt2):
        m.close()


def test_lr_scheduler_drives_the_optimizer(torch, rng):
    """AdamW under warm-up + cosine: the weights after 12 steps equal PyTorch's."""
    import warnings
    init = rng.standard_normal((4, 3)).astype(np.float32)
    p = ut.Parameter(init)
    tp = torch.nn.Parameter(torch.from_numpy(init.copy()))
    opt, topt = ut.AdamW([p], lr=0.05, weight_decay=0.1), torch.optim.AdamW([tp], lr=0.05, weight_decay=0.1)
    s = SCHEDULES["warmup_cosine"](ut.optim.lr_scheduler, opt)
    ts = SCHEDULES["warmup_cosine"](torch.optim.lr_scheduler, topt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(12):
            g = rng.standard_normal(init.shape).astype(np.float32)
            p.grad.copy_from(g)
            tp.grad = torch.from_numpy(g)
            opt.step(), topt.step()
            s.step(), ts.step()
    np.testing.assert_allclose(p.numpy(), tp.detach().numpy(), rtol=2e-6, atol=1e-7)
    opt.close()
    p.close()


def test_lr_scheduler_closed_form_and_errors(torch):
    import warnings
    lin, opt, s, topt, ts = _sched_pair(torch, lambda L, o: L.CosineAnnealingLR(o, T_max=10))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s.step(4)
        ts.step(4)
    assert s.get_last_lr() == pytest.approx(ts.get_last_lr(), rel=1e-15)
    L = ut.optim.lr_scheduler
    with pytest.raises(ut.ArgumentError, match="Starting multiplicative factor"):
        L.LinearLR(opt, start_factor=0)
    with pytest.raises(ut.ArgumentError, match="Ending multiplicative factor"):
        L.LinearLR(opt, end_factor=1.5)
    with pytest.raises(ut.ArgumentError, match="number of milestones"):
        L.SequentialLR(opt, [L.LinearLR(opt), L.CosineAnnealingLR(opt, 3)], milestones=[])
    with pytest.raises(ut.ArgumentTypeError):
        L.CosineAnnealingLR(object(), 3)
    lin.close()
    opt.close()


# ---- EMA of the weights ----------------------------------------------------------------------

def test_ema_averaged_model_matches_pytorch(torch, device, rng):
    from utensil_ffi.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
    ut.seed(9)
    net = ut.Sequential(ut.Linear(4, 6, device=device), ut.ReLU(), ut.Linear(6, 2, device=device))
    tnet = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
    tnet.load_state_dict({k: torch.from_numpy(v) for k, v in net.state_dict().items()})
    ema = AveragedModel(net, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    tema = torch.optim.swa_utils.AveragedModel(
        tnet, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    opt, topt = ut.SGD(net.parameters(), lr=0.1), torch.optim.SGD(tnet.parameters(), lr=0.1)
    for _ in range(5):
        for p, tp in zip(net.parameters(), tnet.parameters()):
            g = rng.standard_normal(p.shape).astype(np.float32)
            p.grad.copy_from(g)
            tp.grad = torch.from_numpy(g)
        opt.step(), topt.step()
        ema.update_parameters(net)
        tema.update_parameters(tnet)
    sd, tsd = ema.state_dict(), tema.state_dict()
    assert set(sd) == set(tsd)
    assert int(sd["n_averaged"]) == int(tsd["n_averaged"]) == 5
    for k in sd:
        np.testing.assert_allclose(sd[k], tsd[k].numpy(), rtol=1e-6, atol=1e-7, err_msg=k)
    # the averaged weights evaluate and export as the model's own keys
    x = rng.standard_normal((3, 4)).astype(np.float32)
    ema.eval()
    tema.eval()
    with ema(ut.tensor(x, device=device)) as y:
        np.testing.assert_allclose(y.numpy(), tema(torch.from_numpy(x)).detach().numpy(), rtol=1e-5, atol=1e-6)
    assert set(ema.module.state_dict()) == set(net.state_dict())
    # a fresh AveragedModel loads the state dict (n_averaged included)
    ema2 = AveragedModel(net, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    ema2.load_state_dict({k: torch.as_tensor(v).numpy() for k, v in tsd.items()})
    assert ema2.n_averaged == 5
    for k, v in ema2.state_dict().items():
        np.testing.assert_allclose(v, sd[k], rtol=1e-6, atol=1e-7)
    for m in (net, ema, ema2, opt):
        m.close()


def test_swa_mean_and_buffers_follow_the_model(torch, rng):
    """Without an averaging function: the running mean (SWA); BatchNorm's running statistics
    are copied from the model at each update (use_buffers=False), averaged with use_buffers."""
    from utensil_ffi.optim.swa_utils import AveragedModel
    bn = ut.BatchNorm2d(3)
    swa = AveragedModel(bn)
    swa_b = AveragedModel(bn, use_buffers=True)
    seen_w, seen_rm = [], []
    for _ in range(4):
        w = rng.standard_normal(3).astype(np.float32)
        rm = rng.standard_normal(3).astype(np.float32)
        bn.weight.copy_from(w)
        bn.running_mean.copy_from(rm)
        seen_w.append(w)
        seen_rm.append(rm)
        swa.update_parameters(bn)
        swa_b.update_parameters(bn)
    np.testing.assert_allclose(swa.module.weight.numpy(), np.mean(seen_w, 0), rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(swa.module.running_mean.numpy(), seen_rm[-1])
    np.testing.assert_allclose(swa_b.module.running_mean.numpy(), np.mean(seen_rm, 0), rtol=1e-6, atol=1e-7)
    with pytest.raises(ut.ArgumentError, match="Invalid decay value"):
        ut.optim.swa_utils.get_ema_multi_avg_fn(1.5)
    with pytest.raises(ut.ShapeError):
        swa.update_parameters(ut.BatchNorm2d(4))
    for m in (bn, swa, swa_b):
        m.close()


@pytest.mark.parametrize("how", ["copy", "deepcopy", "pickle"])
def test_regularisation_layers_copy_and_pickle(how):
    """The settings travel (the training-mode output is random, so only the settings and the
    eval-mode identity are compared; test_copy_pickle's output check does not apply)."""
    import copy
    import pickle
    fn = {"copy": copy.copy, "deepcopy": copy.deepcopy,
          "pickle": lambda m: pickle.loads(pickle.dumps(m))}[how]
    for layer in (ut.Dropout(0.25, inplace=True), ut.StochasticDepth(0.1, "batch"),
                  ut.CrossEntropyLoss(label_smoothing=0.2)):
        again = fn(layer)
        assert type(again) is type(layer) and repr(again) == repr(layer)
