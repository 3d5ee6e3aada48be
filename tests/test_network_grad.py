"""The whole network, not just its layers: utensil_ffi.models.mobilenet against references.

- a float64 numpy re-implementation of the network's forward pass (from the ops of
  utensil_ffi.reference, numpy only and independent of the library) gives the same loss, and
  its central finite differences give the parameter and input gradients that utensil's
  backward computes (BatchNorm in training mode, kinks of ReLU6 on both sides exercised);
- when PyTorch is installed, the same architecture written as a torch.nn.Sequential, loaded with
  utensil's state_dict() by PyTorch's load_state_dict(strict=True), gives the same logits, loss,
  gradients, BatchNorm running statistics, eval-mode outputs, and the same weights after a few SGD-with-momentum and Adam steps.
"""

import numpy as np
import pytest

import utensil_ffi as ut
from utensil_ffi import models
from utensil_ffi.testing import optable
from utensil_ffi import reference as R

# -- the float64 reference, built from the op table's references (utensil_ffi.reference) ---------
def _apply(layer, params, i, h):
    """Layer ``i`` of the network on h, in float64, with the weights in ``params``: the op
    table's float64 reference of the layer's op (utensil_ffi/testing/optable.py; KeyError for a layer
    the table does not know)."""
    op = optable.for_layer(layer)
    a = {"x": h, "w": params.get("%d.weight" % i), "b": params.get("%d.bias" % i)}
    if op.name == "dwconv2d":  # the state dict holds PyTorch's depthwise layout [C, 1, kh, kw]
        a["w"] = a["w"].reshape((a["w"].shape[0],) + a["w"].shape[2:])
    geom = op.geometry_of(layer)
    if op.name == "batchnorm2d":
        geom["training"] = True  # the batch statistics, as in training
    return op.reference(a, {}, geom)


def ref_forward(net, params, x, labels, relu6_inputs=None):
    """(loss, logits) of ``net``'s architecture in float64 with the weights in ``params``."""
    h = np.asarray(x, np.float64)
    for i, layer in enumerate(net):
        if relu6_inputs is not None and isinstance(layer, ut.ReLU6):
            relu6_inputs.append(h)
        h = _apply(layer, params, i, h)
    return R.cross_entropy(h, labels)[0], h


def _tiny_net(device, rng, blocks=((2, 2),), width=2, in_channels=1, classes=3):
    """A tiny network whose BatchNorm scales/shifts are random, so ReLU6 clips at 0 and at 6."""
    ut.seed(7)
    net = models.mobilenet(in_channels, classes, width, blocks=blocks, device=device)
    for layer in net:
        if isinstance(layer, ut.BatchNorm2d):
            c = layer.num_features
            layer.weight = rng.uniform(0.5, 5.0, c)
            layer.bias = rng.uniform(-0.5, 1.0, c)
        elif isinstance(layer, ut.Linear):
            layer.bias = rng.normal(0, 0.5, layer.out_features)
    return net


def _utensil_grads(net, x, labels, device):
    net.train()
    net.zero_grad()
    xt = ut.tensor(x, device)
    logits = net(xt)
    loss = ut.cross_entropy(logits, labels)
    g = ut.cross_entropy_backward(logits, labels)
    dx = net.backward(g)
    grads = {k: np.array(p.grad.numpy(), np.float64) for k, p in net.named_parameters()}
    out = (loss.item(), np.array(logits.numpy(), np.float64), grads, np.array(dx.numpy(), np.float64))
    for t in (xt, logits, loss, g, dx):
        t.close()
    return out


def _fd(f, arr, eps=1e-6):
    """Central differences of the scalar f() with respect to each element of arr (in place)."""
    return R.numeric_grad(lambda _: f(), arr, 1.0, eps)


def _close(name, got, ref, rtol, atol):
    scale = max(float(np.max(np.abs(ref))), 1e-3)
    np.testing.assert_allclose(got, ref, rtol=rtol, atol=atol * scale, err_msg=name)


# -- float64 reference and finite differences -----------------------------------------------------


@pytest.mark.parametrize("blocks", [((2, 2),), ((1, 1), (2, 2))], ids=["1block", "2blocks"])
def test_gradients_match_finite_differences(device, rng, blocks):
    net = _tiny_net(device, rng, blocks=blocks)
    x = rng.normal(0, 1, (4, 1, 6, 6))
    labels = np.array([0, 2, 1, 2])
    try:
        loss, logits, grads, dx = _utensil_grads(net, x.astype(np.float32), labels, device)
        params = {k: v.astype(np.float64) for k, v in net.state_dict().items()}
        x32 = x.astype(np.float32).astype(np.float64)  # what utensil saw
        ref_loss, ref_logits = ref_forward(net, params, x32, labels)

        _close("logits", logits, ref_logits, 1e-4, 1e-5)
        assert abs(loss - ref_loss) <= 1e-5 * max(1.0, abs(ref_loss))

        # both kinks of ReLU6 are exercised somewhere in the network
        acts = []
        ref_forward(net, params, x32, labels, acts)
        pre = np.concatenate([a.reshape(-1) for a in acts])
        assert (pre < 0).any() and (pre > 6).any() and ((pre > 0) & (pre < 6)).any()

        checked = 0
        for key, p in net.named_parameters():
            fd = _fd(lambda: ref_forward(net, params, x32, labels)[0], params[key])
            _close("d loss / d " + key, grads[key], fd.reshape(grads[key].shape), 2e-3, 2e-4)
            assert np.any(fd != 0.0), key
            checked += fd.size
        assert checked == models.count_parameters(net)
        fdx = _fd(lambda: ref_forward(net, params, x32, labels)[0], x32)
        _close("d loss / d x", dx, fdx, 2e-3, 2e-4)
    finally:
        net.close()


def test_reference_finite_differences_are_sound(rng):
    """The checker itself: FD of the reference recovers a known analytic gradient (Linear head)."""
    ut.seed(3)
    net = models.mobilenet(1, 3, 2, blocks=((1, 1),))
    try:
        params = {k: v.astype(np.float64) for k, v in net.state_dict().items()}
        x = rng.normal(0, 1, (5, 1, 4, 4))
        labels = np.array([0, 1, 2, 1, 0])
        loss, logits = ref_forward(net, params, x, labels)
        p = np.exp(logits - logits.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        p[np.arange(5), labels] -= 1
        head = len(net) - 1
        np.testing.assert_allclose(
            _fd(lambda: ref_forward(net, params, x, labels)[0], params["%d.bias" % head]),
            p.mean(0), rtol=1e-6, atol=1e-9)
    finally:
        net.close()


# -- PyTorch --------------------------------------------------------------------------------------


def _torch_twin(torch, net):
    """The same architecture written in PyTorch, with utensil's weights loaded strictly: the
    keys and shapes of net.state_dict() must be exactly PyTorch's."""
    nn = torch.nn
    mods = []
    for layer in net:
        if isinstance(layer, ut.DWConv2d):
            m = nn.Conv2d(layer.channels, layer.channels, layer.kernel_size, layer.stride,
                          layer.padding, groups=layer.channels, bias=layer.bias is not None)
        elif isinstance(layer, ut.Conv2d):
            m = nn.Conv2d(layer.in_channels, layer.out_channels, layer.kernel_size, layer.stride,
                          layer.padding, bias=layer.bias is not None)
        elif isinstance(layer, ut.BatchNorm2d):
            m = nn.BatchNorm2d(layer.num_features, eps=layer.eps, momentum=layer.momentum)
        elif isinstance(layer, ut.ReLU6):
            m = nn.ReLU6()
        elif isinstance(layer, ut.GlobalAvgPool2d):
            m = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())
        else:
            m = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
        mods.append(m)
    tnet = nn.Sequential(*mods)
    sd = net.state_dict()
    assert list(sd) == list(tnet.state_dict())  # the same keys, in the same order
    tnet.load_state_dict({k: torch.from_numpy(v) for k, v in sd.items()}, strict=True)
    return tnet


def _torch_run(torch, tnet, x, labels):
    xt = torch.tensor(x, dtype=torch.float32, requires_grad=True)
    tnet.zero_grad()
    logits = tnet(xt)
    loss = torch.nn.functional.cross_entropy(logits, torch.tensor(labels))
    loss.backward()
    grads = {k: p.grad.detach().numpy().astype(np.float64) for k, p in tnet.named_parameters()}
    return float(loss.detach()), logits.detach().numpy().astype(np.float64), grads, xt.grad.numpy().astype(np.float64)


def test_same_as_pytorch(device, rng, torch):
    """Default architecture (small width): logits, loss, every gradient, running statistics."""
    ut.seed(11)
    net = models.mobilenet(1, 10, 4, device=device)
    try:
        tnet = _torch_twin(torch, net)
        x = rng.normal(0, 1, (8, 1, 8, 8)).astype(np.float32)
        labels = rng.integers(0, 10, 8)
        loss, logits, grads, dx = _utensil_grads(net, x, labels, device)
        tloss, tlogits, tgrads, tdx = _torch_run(torch, tnet, x, labels)
        _close("logits", logits, tlogits, 1e-4, 1e-5)
        assert abs(loss - tloss) <= 1e-5 * max(1.0, abs(tloss))
        assert set(grads) == set(tgrads)
        for k in grads:
            _close("grad " + k, grads[k], tgrads[k].reshape(grads[k].shape), 1e-4, 1e-4)
        _close("grad x", dx, tdx, 1e-4, 1e-4)

        # BatchNorm running statistics after that one training forward pass (unbiased var)
        ours = net.state_dict()
        theirs = tnet.state_dict()
        for k in ours:
            if "running" in k:
                _close(k, ours[k], theirs[k].numpy(), 1e-5, 1e-6)

        # eval mode: both use the running statistics
        net.eval()
        tnet.eval()
        xe = rng.normal(0, 1, (5, 1, 8, 8)).astype(np.float32)
        with ut.tensor(xe, device) as xt:
            with net(xt) as out:
                got = np.array(out.numpy(), np.float64)
        with torch.no_grad():
            want = tnet(torch.from_numpy(xe)).numpy()
        _close("eval logits", got, want, 1e-4, 1e-5)
    finally:
        net.close()


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_training_steps_same_as_pytorch(device, rng, optimizer, torch):
    """A few optimizer steps on the same batches end with the same weights as PyTorch."""
    ut.seed(5)
    net = models.mobilenet(1, 4, 3, blocks=((2, 1), (2, 2)), device=device)
    tnet = _torch_twin(torch, net)
    if optimizer == "sgd":
        opt = ut.SGD(net.parameters(), lr=0.05, momentum=0.9)
        topt = torch.optim.SGD(tnet.parameters(), lr=0.05, momentum=0.9)
    else:
        opt = ut.Adam(net.parameters(), lr=1e-3)
        topt = torch.optim.Adam(tnet.parameters(), lr=1e-3)
    try:
        for step in range(3):
            x = rng.normal(0, 1, (6, 1, 6, 6)).astype(np.float32)
            labels = rng.integers(0, 4, 6)
            opt.zero_grad()
            _utensil_grads(net, x, labels, device)
            opt.step()
            topt.zero_grad()
            _torch_run(torch, tnet, x, labels)
            topt.step()
        ours = net.state_dict()
        theirs = tnet.state_dict()
        for k, v in ours.items():
            _close(k, v, theirs[k].numpy().reshape(v.shape), 1e-4, 1e-4)
    finally:
        opt.close()
        net.close()


def test_state_dict_round_trips_through_pytorch(torch):
    """utensil -> PyTorch (strict) -> utensil: the same arrays; num_batches_tracked counts."""
    ut.seed(2)
    net = models.mobilenet(3, 5, 2)
    net2 = models.mobilenet(3, 5, 2)
    try:
        with ut.tensor(np.ones((2, 3, 6, 6))) as x:
            net(x).close()
            net(x).close()
        tnet = _torch_twin(torch, net)
        dw = [m for m in tnet if isinstance(m, torch.nn.Conv2d) and m.groups > 1]
        assert dw and all(m.weight.shape[1] == 1 for m in dw)
        assert int(tnet.state_dict()["1.num_batches_tracked"]) == 2
        missing, unexpected = net2.load_state_dict(tnet.state_dict())
        assert missing == [] and unexpected == []
        a, b = net.state_dict(), net2.state_dict()
        assert list(a) == list(b)
        for k in a:
            assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), k
        assert net2[1].num_batches_tracked == 2
    finally:
        net.close()
        net2.close()
