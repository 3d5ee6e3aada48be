"""utensil_ffi.torch.convert on torchvision's networks, unchanged: every depthwise nn.Conv2d
(3x3, 5x5 and 7x7; with and without bias; stride 1 and 2) becomes a DepthwiseConv2d running
utensil's op, nothing else changes type, and in training mode (dropout and stochastic depth 0,
so both copies compute the same function) the logits and every parameter's gradient match the
unconverted copy's (PyTorch's own conv2d) within float32 tolerances. Small inputs (batch 2,
64x64) keep it fast; skipped without torchvision.
"""

import copy

import pytest

import utensil_ffi as ut

torch = pytest.importorskip("torch")
tvm = pytest.importorskip("torchvision.models")
utt = pytest.importorskip("utensil_ffi.torch")
nn = torch.nn

# dropout and stochastic depth 0: both copies are the same function in training mode
BUILDERS = {
    "mobilenet_v3_large": lambda: tvm.mobilenet_v3_large(num_classes=10, dropout=0.0),
    "efficientnet_b0": lambda: tvm.efficientnet_b0(num_classes=10, dropout=0.0,
                                                   stochastic_depth_prob=0.0),
    "mnasnet1_0": lambda: tvm.mnasnet1_0(num_classes=10, dropout=0.0),
    "convnext_tiny": lambda: tvm.convnext_tiny(num_classes=10, stochastic_depth_prob=0.0),
}
# what each network's depthwise convolutions are: (kernel, stride, has bias)
KINDS = {
    "mobilenet_v3_large": {(3, 1, False), (3, 2, False), (5, 1, False), (5, 2, False)},
    "efficientnet_b0": {(3, 1, False), (3, 2, False), (5, 1, False), (5, 2, False)},
    "mnasnet1_0": {(3, 1, False), (3, 2, False), (5, 1, False), (5, 2, False)},
    "convnext_tiny": {(7, 1, True)},
}


@pytest.fixture(autouse=True)
def one_thread():
    n, m = torch.get_num_threads(), ut.get_num_threads()
    torch.set_num_threads(1)
    ut.set_num_threads(1)
    yield
    torch.set_num_threads(n)
    ut.set_num_threads(m)


def _depthwise(model):
    return {name: m for name, m in model.named_modules()
            if isinstance(m, nn.Conv2d) and m.groups == m.in_channels > 1}


def _rel_err(got, want):
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def _grads(model, x, w):
    """Logits of ``model`` on x, and each parameter's gradient of sum(w * logits)."""
    model.zero_grad()
    out = model(x)
    (out * w).sum().backward()
    return out.detach(), {k: p.grad.detach().double() for k, p in model.named_parameters()}


@pytest.mark.parametrize("arch", sorted(BUILDERS))
def test_converted_torchvision_network_matches(arch, monkeypatch):
    torch.manual_seed(0)
    ref = BUILDERS[arch]()
    with torch.no_grad():  # ConvNeXt's layer scale starts at 1e-6: its blocks would not show
        for name, p in ref.named_parameters():
            if name.endswith("layer_scale"):
                p.uniform_(0.5, 1.5)
    ref64 = copy.deepcopy(ref).double()
    conv = utt.convert(copy.deepcopy(ref))

    # which modules changed: exactly the depthwise ones, into DepthwiseConv2d
    dw = _depthwise(ref)
    kinds = {(m.kernel_size[0], m.stride[0], m.bias is not None) for m in dw.values()}
    assert kinds == KINDS[arch]
    for (name, a), (name_b, b) in zip(ref.named_modules(), conv.named_modules()):
        assert name == name_b
        if name in dw:
            assert type(b) is utt.DepthwiseConv2d, name
        else:
            assert type(b) is type(a), name

    calls = []
    op = utt.depthwise_conv2d

    def counted(*args, **kwargs):
        calls.append(1)
        return op(*args, **kwargs)

    monkeypatch.setattr(utt, "depthwise_conv2d", counted)

    for m in (ref, ref64, conv):
        m.train()
    x = torch.randn(2, 3, 64, 64)
    w = torch.randn(2, 10)  # a loss whose gradient reaches every logit differently
    out64, g64 = _grads(ref64, x.double(), w.double())
    out_ref, g_ref = _grads(ref, x, w)
    assert not calls
    out_conv, g_conv = _grads(conv, x, w)
    assert len(calls) == len(dw)  # every depthwise convolution ran utensil's op

    assert _rel_err(out_conv, out_ref) <= 1e-4, "logits"
    # The gradients against float64 PyTorch: utensil's float32 copy as close as PyTorch's own
    # float32 (training-mode BatchNorm on batch 2 and 2x2 maps is ill-conditioned: some
    # gradients are sums that cancel, to zero for a BatchNorm's shift that a convolution and
    # another BatchNorm follow, and there both copies hold rounding noise alone). The error is
    # relative to the gradient's norm, floored at 1e-6 of the largest gradient.
    floor = 1e-6 * max(float(g.abs().max()) for g in g64.values())
    for name, want in g64.items():
        scale = max(float(want.norm()), floor)
        e_conv = float((g_conv[name] - want).norm()) / scale
        e_ref = float((g_ref[name] - want).norm()) / scale
        assert e_conv <= 4 * e_ref + 1e-4, (name, e_conv, e_ref)
