"""Layers shared between threads, closed while in use, reused in one network, or fed an input
changed in place between forward and backward: never a crash, never a silently wrong gradient.

The crash cases run in child processes (with a timeout) over many iterations: on the code before
these fixes they died (SIGABRT from BatchNorm2d's cache swap, SIGSEGV from a close during a
forward) in most runs.
"""

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

import utensil_ffi as ut

torch = pytest.importorskip("torch")

PKG_ROOT = str(Path(ut.__file__).resolve().parent.parent)


def run_child(code, timeout=240):
    # keep the caller's path (cffi may come from it, as on the lent GPU machines)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [PKG_ROOT, os.environ.get("PYTHONPATH")])))
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, timeout=timeout,
                       capture_output=True, text=True)
    assert r.returncode == 0, "child exited with %d\n%s" % (r.returncode, r.stderr[-3000:])
    return r.stdout


# -- item 4: one layer (or network) used from several threads ------------------------------------
def test_batchnorm_eval_shared_by_threads_does_not_crash():
    run_child("""
        import sys, threading
        import utensil_ffi as ut
        sys.setswitchinterval(1e-6)
        bn = ut.BatchNorm2d(4).eval()
        net = ut.Sequential(ut.Conv2d(4, 4, 3, padding=1), ut.BatchNorm2d(4), ut.ReLU()).eval()
        x = ut.randn((2, 4, 5, 5))
        def work():
            for _ in range(3000):
                bn(x).close()
                net(x).close()
        ts = [threading.Thread(target=work) for _ in range(4)]
        for t in ts: t.start()
        for t in ts: t.join()
        bn.close(); net.close(); x.close()
        assert ut.live_tensors() == 0, ut.live_tensors()
    """)


def test_training_mode_layer_shared_by_threads_does_not_crash():
    # mixed train/eval forwards and backwards from several threads: no crash, no leak
    run_child("""
        import sys, threading
        import utensil_ffi as ut
        sys.setswitchinterval(1e-6)
        net = ut.Sequential(ut.Conv2d(3, 4, 3, padding=1), ut.BatchNorm2d(4), ut.ReLU(),
                            ut.GlobalAvgPool2d(), ut.Linear(4, 2))
        x = ut.randn((2, 3, 5, 5))
        def work(i):
            for k in range(1500):
                y = net(x)
                g = net.backward(ut.ones(y.shape))
                y.close(); g.close()
                if i == 0 and k % 100 == 0:
                    net.zero_grad()
        ts = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in ts: t.start()
        for t in ts: t.join()
        net.close(); x.close()
        assert ut.live_tensors() == 0, ut.live_tensors()
    """)


def _net(seed):
    ut.seed(seed)
    net = ut.Sequential(ut.Conv2d(3, 8, 3, padding=1), ut.BatchNorm2d(8), ut.ReLU6(),
                        ut.DWConv2d(8, 3, padding=1), ut.BatchNorm2d(8), ut.ReLU(),
                        ut.GlobalAvgPool2d(), ut.Linear(8, 5))
    x = ut.randn((4, 3, 9, 9))
    net(x)  # training forwards move the running statistics away from their initial values
    net(x)
    x.close()
    return net.eval()


def test_concurrent_eval_inference_equals_serial():
    net = _net(3)
    xs = [ut.randn((2, 3, 9, 9)) for _ in range(24)]
    serial = [net(x).numpy().copy() for x in xs]
    got = [None] * len(xs)

    def work(i):
        for _ in range(5):
            for j in range(i, len(xs), 4):
                got[j] = net(xs[j]).numpy().copy()

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        ts = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    finally:
        sys.setswitchinterval(old)
    for a, b in zip(serial, got):
        np.testing.assert_array_equal(a, b)
    net.close()


def test_training_threads_each_differentiate_their_own_forward():
    # two threads train one shared layer on different inputs: the accumulated gradient is the
    # sum of both threads' gradients, as if run one after the other
    ut.seed(0)
    lin = ut.Linear(6, 4)
    xs = [ut.randn((3, 6)) for _ in range(2)]
    expected = np.zeros((4, 6), np.float32)
    for x in xs:
        expected += np.ones((3, 4), np.float32).T @ x.numpy()
    barrier = threading.Barrier(2)

    def work(i):
        y = lin(xs[i])
        barrier.wait()  # both forwards done before either backward
        lin.backward(ut.ones(y.shape))

    ts = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    np.testing.assert_allclose(lin.weight.grad.numpy(), expected, rtol=1e-5, atol=1e-5)
    lin.close()


# -- item 5: close() while another thread is inside an op on the same object ---------------------
def test_close_layer_during_its_forward_does_not_crash():
    run_child("""
        import threading, time
        import utensil_ffi as ut
        from utensil_ffi import ClosedError
        for _ in range(8):
            lin = ut.Linear(2000, 2000)
            x = ut.randn((256, 2000))
            out = []
            def fwd():
                try:
                    out.append(lin(x))
                except ClosedError:
                    out.append(None)
            t = threading.Thread(target=fwd)
            t.start()
            time.sleep(0.002)
            lin.close()
            t.join()
            assert lin.closed
            if out[0] is not None:
                assert out[0].shape == (256, 2000)
                out[0].close()
            x.close()
        assert ut.live_tensors() == 0, ut.live_tensors()
    """)


def test_close_input_tensor_during_forward_and_tensor_op_does_not_crash():
    run_child("""
        import threading, time
        import utensil_ffi as ut
        from utensil_ffi import ClosedError
        lin = ut.Linear(2000, 2000)
        for _ in range(8):
            for op in ("layer", "fill", "clone"):
                x = ut.randn((512, 2000)) if op == "layer" else ut.zeros((4000, 4000))
                out = []
                def run():
                    try:
                        if op == "layer":
                            out.append(lin(x))
                        elif op == "fill":
                            out.append(x.fill_(1.0) and None)
                        else:
                            out.append(x.clone())
                    except ClosedError:
                        out.append(None)
                t = threading.Thread(target=run)
                t.start()
                time.sleep(0.001)
                x.close()
                t.join()
                if out[0] is not None:
                    out[0].close()
        lin.close()
        assert ut.live_tensors() == 0, ut.live_tensors()
    """)


def test_closed_layer_refuses_new_calls():
    lin = ut.Linear(2, 2)
    x = ut.ones((1, 2))
    lin(x)
    lin.close()
    with pytest.raises(ut.ClosedError):
        lin(x)
    with pytest.raises(ut.ClosedError):
        lin.backward(ut.ones((1, 2)))


# -- item 7a: a layer used several times in one network -------------------------------------------
def _torch_linear(l):
    w = torch.tensor(l.weight.numpy(), dtype=torch.float64, requires_grad=True)
    b = torch.tensor(l.bias.numpy(), dtype=torch.float64, requires_grad=True)
    return w, b


def test_linear_used_twice_in_sequential_gets_the_right_gradient():
    ut.seed(1)
    l = ut.Linear(3, 3)
    net = ut.Sequential(l, ut.ReLU(), l)
    x = ut.randn((5, 3))
    g = ut.randn((5, 3))
    y = net(x)
    dx = net.backward(g)
    w, b = _torch_linear(l)
    xt = torch.tensor(x.numpy(), dtype=torch.float64, requires_grad=True)
    yt = torch.nn.functional.linear(torch.relu(torch.nn.functional.linear(xt, w, b)), w, b)
    yt.backward(torch.tensor(g.numpy(), dtype=torch.float64))
    np.testing.assert_allclose(y.numpy(), yt.detach().numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(l.weight.grad.numpy(), w.grad.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(l.bias.grad.numpy(), b.grad.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(dx.numpy(), xt.grad.numpy(), rtol=1e-4, atol=1e-5)
    # a repeated backward walks the same two uses again: the gradients double
    net.backward(g)
    np.testing.assert_allclose(l.weight.grad.numpy(), 2 * w.grad.numpy(), rtol=1e-4, atol=1e-5)
    net.close()


def test_relu_and_relu6_used_twice_get_the_right_gradient():
    ut.seed(2)
    for cls, tf in ((ut.ReLU, torch.relu), (ut.ReLU6, lambda t: torch.clamp(t, 0, 6))):
        l1, l2, act = ut.Linear(4, 6), ut.Linear(6, 3), cls()
        net = ut.Sequential(act, l1, act, l2)
        x = ut.randn((5, 4), std=4.0)
        g = ut.randn((5, 3))
        net(x)
        dx = net.backward(g)
        w1, b1 = _torch_linear(l1)
        w2, b2 = _torch_linear(l2)
        xt = torch.tensor(x.numpy(), dtype=torch.float64, requires_grad=True)
        F = torch.nn.functional
        yt = F.linear(tf(F.linear(tf(xt), w1, b1)), w2, b2)
        yt.backward(torch.tensor(g.numpy(), dtype=torch.float64))
        np.testing.assert_allclose(l1.weight.grad.numpy(), w1.grad.numpy(), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(dx.numpy(), xt.grad.numpy(), rtol=1e-4, atol=1e-4)
        net.close()


class _TwoPools(ut.Module):
    """gap(x) + gap(conv(x)): one GlobalAvgPool2d used on two inputs of different sizes."""

    def __init__(self):
        self.conv = ut.Conv2d(2, 2, 3)
        self.gap = ut.GlobalAvgPool2d()

    def forward(self, x):
        a = self.gap(x)
        b = self.gap(self.conv(x))
        return a.add_(b)

    def backward(self, g):
        dconv = self.conv.backward(self.gap.backward(g))  # the last use first
        dx = self.gap.backward(g)
        return dx.add_(dconv)

    def parameters(self):
        return self.conv.parameters()


def test_global_avg_pool_used_twice_in_a_module_gets_the_right_gradient():
    ut.seed(3)
    m = _TwoPools()
    x = ut.randn((2, 2, 6, 6))
    g = ut.randn((2, 2))
    m(x)
    dx = m.backward(g)
    w = torch.tensor(m.conv.weight.numpy(), dtype=torch.float64, requires_grad=True)
    b = torch.tensor(m.conv.bias.numpy(), dtype=torch.float64, requires_grad=True)
    xt = torch.tensor(x.numpy(), dtype=torch.float64, requires_grad=True)
    yt = xt.mean((2, 3)) + torch.nn.functional.conv2d(xt, w, b).mean((2, 3))
    yt.backward(torch.tensor(g.numpy(), dtype=torch.float64))
    np.testing.assert_allclose(m.conv.weight.grad.numpy(), w.grad.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(dx.numpy(), xt.grad.numpy(), rtol=1e-4, atol=1e-5)
    m.conv.close()


def test_forwards_without_backward_keep_bounded_memory():
    net = ut.Sequential(ut.Linear(8, 8), ut.ReLU(), ut.Linear(8, 8))
    x = ut.randn((4, 8))
    net(x).close()
    before = ut.live_tensors()
    for _ in range(50):
        net(x).close()
    assert ut.live_tensors() == before
    net.eval()  # drops what the training forwards kept
    assert ut.live_tensors() < before
    net.close()


# -- item 7b: an input changed in place between forward and backward ----------------------------
@pytest.mark.parametrize("change", ["fill_", "copy_from", "add_", "mul_"])
@pytest.mark.parametrize("layer", ["Linear", "ReLU", "BatchNorm2d"])
def test_input_changed_in_place_after_forward_is_refused(change, layer):
    if layer == "BatchNorm2d":
        l, x = ut.BatchNorm2d(2), ut.randn((2, 2, 3, 3))
    elif layer == "Linear":
        l, x = ut.Linear(3, 2), ut.randn((4, 3))
    else:
        l, x = ut.ReLU(), ut.randn((4, 3))
    y = l(x)
    {"fill_": lambda: x.fill_(0.5), "copy_from": lambda: x.copy_from(np.zeros(x.shape)),
     "add_": lambda: x.add_(ut.ones(x.shape)), "mul_": lambda: x.mul_(2.0)}[change]()
    with pytest.raises(ut.ArgumentError, match="modified in place"):
        l.backward(ut.ones(y.shape))
    y2 = l(x)  # a new forward sees the new values: backward works again
    l.backward(ut.ones(y2.shape))


def test_weight_changed_by_an_optimizer_step_before_backward_is_refused():
    l = ut.Linear(3, 2)
    opt = ut.SGD(l.parameters(), lr=0.1)
    y = l(ut.randn((4, 3)))
    l.weight.grad.fill_(1.0)
    opt.step()
    with pytest.raises(ut.ArgumentError, match="weight was modified in place"):
        l.backward(ut.ones(y.shape))


def test_reading_the_input_between_forward_and_backward_is_fine():
    l = ut.Linear(3, 2)
    x = ut.randn((4, 3))
    y = l(x)
    repr(x), x.numpy().sum(), np.asarray(x), x.tolist(), x.clone()
    l.backward(ut.ones(y.shape))
    # writes through a numpy view are not tracked (documented): the backward still runs
    y = l(x)
    x.numpy()[:] = 0
    l.backward(ut.ones(y.shape))


# -- item 8: Identity inside Sequential; Parameter built directly --------------------------------
class _Identity(ut.Module):
    def forward(self, x):
        return x

    def backward(self, g):
        return g


def test_identity_module_inside_sequential():
    ut.seed(4)
    l1, l2 = ut.Linear(3, 4), ut.Linear(4, 2)
    net = ut.Sequential(l1, _Identity(), ut.ReLU(), _Identity(), l2, _Identity())
    ref = ut.Sequential(l1, ut.ReLU(), l2)
    x = ut.randn((5, 3))
    y = net(x)
    np.testing.assert_array_equal(y.numpy(), ref(x).numpy())
    g = net.backward(ut.ones(y.shape))
    assert g.shape == (5, 3) and not g.closed
    assert not x.closed
    ut.Sequential(_Identity())(x).numpy()  # the input itself comes back, open


def test_parameter_built_directly():
    p = ut.Parameter(np.arange(6.0).reshape(2, 3))
    assert repr(p) == "Parameter(name=None, shape=(2, 3), device='cpu')"
    assert p.grad.shape == (2, 3) and not p.grad.numpy().any()
    p.grad.fill_(1.0)
    ut.SGD([p], lr=0.5).step()
    np.testing.assert_allclose(p.numpy(), np.arange(6.0).reshape(2, 3) - 0.5)
    q = ut.Parameter([1.0, 2.0], requires_grad=False, name="w")
    assert q.grad is None and repr(q) == "Parameter(name='w', shape=(2,), device='cpu')"
    p.close()
    assert p.grad.closed and repr(p) == "Parameter(<closed>)"
