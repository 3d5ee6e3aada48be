"""Stateful fuzzing of op sequences (tests/stateful_child.py) in a child process with a timeout,
on each device; plus the fuzzer's findings kept as regression tests.

UTENSIL_FUZZ_SEQUENCES (default 400, 40 ops each) and UTENSIL_FUZZ_SEED (default 0) size a run;
e.g. UTENSIL_FUZZ_SEQUENCES=5000 for a long one. A failure names the seed, the sequence, its last
ops and the command that replays it alone.
"""

import copy
import json
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import utensil_ffi as ut

HERE = Path(__file__).resolve().parent
PKG_ROOT = Path(ut.__file__).resolve().parent.parent
SEQUENCES = int(os.environ.get("UTENSIL_FUZZ_SEQUENCES", "400"))
SEED = int(os.environ.get("UTENSIL_FUZZ_SEED", "0"))
TIMEOUT = 600


def run_child(sequences, seed, device, extra_env=None):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(PKG_ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    env.update(extra_env or {})
    p = subprocess.Popen([sys.executable, "-W", "ignore", str(HERE / "stateful_child.py"),
                          str(sequences), str(seed), device], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        out, err = p.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail("the stateful fuzzer hung (no report in %d s)\n%s" % (TIMEOUT, err[-3000:]))
    lines = out.strip().splitlines()
    report = None
    if lines:
        try:
            report = json.loads(lines[-1])
        except ValueError:
            pass
    return p.returncode, report, err


# Findings of bugs outside this fuzzer's reach to fix, each with a strict xfail reproduction
# below (which fails once the bug is fixed, so the entry gets removed): (kind, message part).
# None now: the raw TypeError in _keep (test_stateless_forward_with_its_input_closed_meanwhile)
# is fixed, and its reproduction passes.
KNOWN = []


def is_known(f):
    return any(f["kind"] == k and m in f["message"] for k, m in KNOWN)


def format_finding(f):
    return ("[%(kind)s] seed %(seed)d, sequence %(sequence)d on %(device)s\n%(message)s\n"
            "last ops:\n  " % f) + "\n  ".join(f["ops"]) + "\nreplay: " + f["replay"]


def test_stateful_fuzz(device):
    rc, report, err = run_child(SEQUENCES, SEED, device)
    assert rc == 0 and report is not None, "the fuzz child died (return code %s%s)\n%s" % (
        rc, ", signal %d" % -rc if rc and rc < 0 else "", err[-4000:])
    print("\nstateful fuzz on %s: %d sequences, %d ops in %.1f s, seed %d; ops: %s" % (
        device, report["sequences"], report["ops"], report["seconds"], SEED, report["op_counts"]))
    assert report["sequences"] == SEQUENCES
    known = [f for f in report["findings"] if is_known(f)]
    if known:
        print("known findings (xfail reproductions below): %d" % len(known))
    new = [f for f in report["findings"] if not is_known(f)]
    assert not new, "\n\n".join(format_finding(f) for f in new)
    # every kind of operation ran (forks and spawns are rare: not required in short runs)
    rare = {"op_fork", "op_spawn"}
    assert set(report["op_counts"]) >= {n for n, _ in __import__("stateful_child").Driver.OPS} - rare


def test_fuzz_child_reports_a_crash():
    """The harness: a sequence that kills its process is seen as a failure."""
    code = ("import os, signal, sys; sys.path.insert(0, %r); import stateful_child as sc\n"
            "sc.Driver.op_new_tensor = lambda self: os.kill(os.getpid(), signal.SIGSEGV)\n"
            "sc.main()" % str(HERE))
    r = subprocess.run([sys.executable, "-c", code, "3", "0", "cpu"], capture_output=True,
                       env=dict(os.environ, PYTHONPATH=str(PKG_ROOT)), timeout=120)
    assert r.returncode != 0


# -- what the fuzzer found, kept as regression tests ---------------------------------------------
def test_optimizer_steps_a_shared_layer_once(rng):
    """Sequential(l, ReLU(), l).parameters() lists l's weight twice: the optimizer stepped it
    twice per step() (Adam moved it by 2 lr instead of lr)."""
    l = ut.Linear(3, 3)
    net = ut.Sequential(l, ut.ReLU(), l)
    w0 = l.weight.numpy().copy()
    l.weight.grad.copy_from(rng.standard_normal((3, 3)))
    opt = ut.Adam(net.parameters(), lr=0.1)
    assert len(opt.params) == 2
    g = l.weight.grad.numpy().astype(np.float64)
    opt.step()
    # Adam's first step moves each weight by lr * sign(grad) (up to eps)
    np.testing.assert_allclose(l.weight.numpy(), w0 - 0.1 * np.sign(g), rtol=1e-5, atol=1e-6)
    opt.close()
    net.close()


@pytest.mark.parametrize("kind", ["sgd", "sgd-momentum", "adam"])
def test_a_refused_step_changes_nothing(kind):
    """A step that raises (a closed parameter after an open one) updated the parameters before the
    failing one, and Adam counted the step anyway."""
    a, b = ut.Linear(2, 2), ut.Linear(2, 2)
    params = a.parameters() + b.parameters()
    for p in params:
        p.grad.fill_(1.0)
    opt = {"sgd": lambda: ut.SGD(params, lr=0.1),
           "sgd-momentum": lambda: ut.SGD(params, lr=0.1, momentum=0.9),
           "adam": lambda: ut.Adam(params, lr=0.1)}[kind]()
    before = [p.numpy().copy() for p in a.parameters()]
    b.weight.grad.close()
    with pytest.raises(ut.ClosedError):
        opt.step()
    for p, v in zip(a.parameters(), before):
        np.testing.assert_array_equal(p.numpy(), v)
    assert opt.t == 0
    with pytest.raises(ut.ShapeError):  # a wrong grad is refused at assignment, as in PyTorch
        b.weight.grad = ut.ones((3, 2))
    with pytest.raises(ut.ArgumentTypeError):
        b.weight.grad = np.ones((2, 2), np.float32)
    with pytest.raises(ut.ClosedError):  # the closed grad is still there: still refused
        opt.step()
    for p, v in zip(a.parameters(), before):
        np.testing.assert_array_equal(p.numpy(), v)
    b.weight.grad.close() if isinstance(b.weight.grad, ut.Tensor) else None
    b.weight.grad = ut.ones((2, 2))
    opt.step()
    assert opt.t == 1 and not np.array_equal(a.weight.numpy(), before[0])
    opt.close()
    b.weight.grad.close()
    a.close()
    b.close()


@pytest.mark.parametrize("export", ["np.from_dlpack", "capsule", "torch"])
def test_dlpack_export_of_a_forward_input_keeps_backward_working(export):
    """Exporting a CPU tensor through DLPack bumped its version (a writable sync), so reading a
    layer's input with np.from_dlpack between forward and backward made backward refuse, while
    reading it with numpy() did not."""
    l = ut.ReLU()
    x = ut.tensor([[-1.0, 2.0]])
    y = l(x)
    if export == "np.from_dlpack":
        v = np.from_dlpack(x)
        np.testing.assert_array_equal(v, [[-1.0, 2.0]])
        del v
    elif export == "capsule":
        cap = x.__dlpack__(max_version=(1, 0))  # never consumed
        del cap
    else:
        torch = pytest.importorskip("torch")
        assert torch.from_dlpack(x).tolist() == [[-1.0, 2.0]]
    dx = l.backward(ut.ones((1, 2)))
    np.testing.assert_array_equal(dx.numpy(), [[0.0, 1.0]])
    for t in (x, y, dx):
        t.close()


# Parameter.grad takes any value; the wrong ones are only found at their use, as raw errors from
# inside the package (layers.py). PyTorch refuses them at assignment (TypeError, RuntimeError).
HOSTILE_GRADS = {"array": lambda p: np.zeros(p.shape, np.float32),
                 "list": lambda p: np.zeros(p.shape).tolist(),
                 "int": lambda p: 0}
USES = {"backward": lambda l: l.backward(ut.ones((1, 2))),
        "zero_grad": lambda l: l.zero_grad(),
        "close": lambda l: l.close(),
        "to": lambda l: l.to("cpu"),
        "deepcopy": lambda l: copy.deepcopy(l).close(),
        "pickle": lambda l: pickle.loads(pickle.dumps(l)).close()}


@pytest.mark.parametrize("use", sorted(USES))
@pytest.mark.parametrize("grad", sorted(HOSTILE_GRADS))
def test_a_non_tensor_grad_is_refused_clearly(grad, use):
    """A grad that is not None or a Tensor of the parameter's shape and device is refused at
    assignment (as PyTorch does), never a raw AttributeError later (found by the stateful fuzzer)."""
    l = ut.Linear(2, 2)
    w = l.weight
    try:
        l(ut.ones((1, 2))).close()
        before = w.grad
        with pytest.raises(ut.ArgumentTypeError, match="Parameter.grad: expected a Tensor"):
            w.grad = HOSTILE_GRADS[grad](w)
        assert w.grad is before
        with ut.zeros((3, 2)) as wrong, pytest.raises(ut.ShapeError, match="shape"):
            w.grad = wrong
        USES[use](l)  # the layer still works as before
        assert w.closed or isinstance(w.grad, ut.Tensor)
    finally:
        l.close()


def test_parameters_of_a_shared_layer_are_listed_once():
    """parameters() of Sequential(l, ReLU(), l) lists l's parameters once, as PyTorch's does
    (weight decay, gradient norms and parameter counts would else count them twice)."""
    l = ut.Linear(2, 2)
    net = ut.Sequential(l, ut.ReLU(), l)
    try:
        assert len(net.parameters()) == 2
    finally:
        net.close()


class _ClosingReLU(ut.ReLU):
    """ReLU whose op closes its input right after computing: what another thread's close() does
    when it lands between the op and the layer keeping the input for backward."""

    _op = staticmethod(lambda x: (ut.relu(x), x.close())[0])


class _ClosingPool(ut.GlobalAvgPool2d):
    _op = staticmethod(lambda x: (ut.global_avg_pool2d(x), x.close())[0])


@pytest.mark.parametrize("cls", [_ClosingReLU, _ClosingPool], ids=["ReLU", "GlobalAvgPool2d"])
def test_stateless_forward_with_its_input_closed_meanwhile(cls):
    """Another thread closing the input between the op and keeping it for backward gives a
    ClosedError or a result, never a raw TypeError (found by the stateful fuzzer)."""
    x = ut.ones((1, 2, 3, 3))
    l = cls()
    try:
        y = l(x)
    except ut.ClosedError:
        return  # a clean refusal is fine too
    y.close()


def test_depthwise_and_dense_conv_agree_on_padding_rows_with_a_nonfinite_weight(device):
    """Output rows wholly in the zero padding with an inf weight: the depthwise and the dense
    conv agree on every device (found by the stateful fuzzer after fill_(inf) on a weight;
    CUDA's depthwise gave the bias there and its dense conv NaN until the dense conv's exact
    pass: both sum real input only, so both give the bias)."""
    x = np.ones((1, 1, 2, 2), np.float32)
    dw = ut.DWConv2d(1, 1, padding=1, bias=False, device=device)
    conv = ut.Conv2d(1, 1, 1, padding=1, bias=False, device=device)
    try:
        dw.weight.fill_(float("inf"))
        conv.weight.fill_(float("inf"))
        with ut.tensor(x, device) as xt:
            with dw(xt) as a, conv(xt) as b:
                np.testing.assert_array_equal(a.numpy(), b.numpy())  # NaN where 0 * inf
    finally:
        dw.close()
        conv.close()


def test_a_refused_backward_leaves_the_kept_forwards_alone(rng):
    """A backward refused for a bad grad_out leaves the walk over the kept forwards where it was:
    with a layer used twice, the next correct backward still pairs each use with its own forward."""
    x = rng.standard_normal((2, 4)).astype(np.float32)
    go = rng.standard_normal((2, 4)).astype(np.float32)
    grads = []
    for bad_call_first in (False, True):
        ut.seed(7)
        l = ut.Linear(4, 4, bias=False)
        net = ut.Sequential(l, ut.ReLU6(), l)
        with ut.tensor(x) as xt, net(xt) as y:
            if bad_call_first:
                with pytest.raises(ut.ShapeError):
                    net.backward(ut.ones((2, 4, 1)))
            with ut.tensor(go) as g, net.backward(g) as dx:
                grads.append((dx.numpy().copy(), l.weight.grad.numpy().copy()))
        net.close()
    np.testing.assert_allclose(grads[1][1], grads[0][1], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grads[1][0], grads[0][0], rtol=1e-5, atol=1e-6)
