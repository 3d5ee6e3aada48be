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
