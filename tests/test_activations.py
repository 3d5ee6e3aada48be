"""Issue 30's activations against PyTorch and a float64 numpy reference: SiLU, Hardswish,
Hardsigmoid, Sigmoid, GELU (erf and tanh forms), forward and backward, on every device.

- random values over [-12, 12] (and sizes that cover the CPU's threads and the GPU's 16-byte
  groups and their tail) against torch.nn.functional in float32, and against
  utensil_ffi.reference in float64;
- special values, one by one: +-inf, +-1e20, +-100, the kinks -3 and 3 and their float32
  neighbours, signed zeros, NaN, with grad_out 1, NaN and inf: PyTorch's values (its scalar
  path: each value as its own size-1 tensor; for gelu(+inf) PyTorch's vectorized CPU path
  gives NaN where its scalar path and CUDA give inf, and so do we);
- bfloat16 activations: the float32 op on the same values rounded once (CPU bit-exact, GPU
  within one bf16 step), and PyTorch's bf16 op within one step;
- the C entry points (ut_activation_forward / _backward): any kind, RELU and RELU6 to the bit
  of ut_relu / ut_relu6, NONE a copy, a bad kind refused; the layers: torch.nn's reprs,
  inplace=, copy / pickle, no state_dict, a network's gradients against PyTorch's;
- ONNX export run by onnxruntime at opsets 11, 14, 17 and 20 (each activation's two forms).
"""

import copy
import pickle

import numpy as np
import pytest

import utensil_ffi as ut
from bf16_reference import bf16_round
from tolerances import assert_close
from utensil_ffi._lib import ffi, lib
from utensil_ffi.testing import reference as R

# name -> (forward(x), backward(go, x), torch function name and kwargs, float64 forward, backward)
KINDS = {
    "silu": (ut.silu, ut.silu_backward, ("silu", {}), R.silu, R.silu_backward),
    "hardswish": (ut.hardswish, ut.hardswish_backward, ("hardswish", {}), R.hardswish,
                  R.hardswish_backward),
    "hardsigmoid": (ut.hardsigmoid, ut.hardsigmoid_backward, ("hardsigmoid", {}),
                    R.hardsigmoid, R.hardsigmoid_backward),
    "sigmoid": (ut.sigmoid, ut.sigmoid_backward, ("sigmoid", {}), R.sigmoid, R.sigmoid_backward),
    "gelu": (lambda x: ut.gelu(x), lambda g, x: ut.gelu_backward(g, x), ("gelu", {}),
             R.gelu, R.gelu_backward),
    "gelu_tanh": (lambda x: ut.gelu(x, approximate="tanh"),
                  lambda g, x: ut.gelu_backward(g, x, approximate="tanh"),
                  ("gelu", {"approximate": "tanh"}),
                  lambda x: R.gelu(x, "tanh"), lambda g, x: R.gelu_backward(g, x, "tanh")),
}
NAMES = sorted(KINDS)
C_KIND = {"silu": lib.UT_ACT_SILU, "hardswish": lib.UT_ACT_HARDSWISH,
          "hardsigmoid": lib.UT_ACT_HARDSIGMOID, "sigmoid": lib.UT_ACT_SIGMOID,
          "gelu": lib.UT_ACT_GELU, "gelu_tanh": lib.UT_ACT_GELU_TANH}
LAYERS = {"silu": lambda: ut.SiLU(), "hardswish": lambda: ut.Hardswish(),
          "hardsigmoid": lambda: ut.Hardsigmoid(), "sigmoid": lambda: ut.Sigmoid(),
          "gelu": lambda: ut.GELU(), "gelu_tanh": lambda: ut.GELU(approximate="tanh")}


def _torch_fn(torch, name):
    fname, kw = KINDS[name][2]
    fn = torch.sigmoid if fname == "sigmoid" else getattr(torch.nn.functional, fname)
    return lambda t: fn(t, **kw)


def _torch_both(torch, name, x, go):
    """PyTorch's float32 forward and backward at x (numpy arrays in, numpy out)."""
    t = torch.tensor(x, requires_grad=True)
    y = _torch_fn(torch, name)(t)
    (g,) = torch.autograd.grad(y, t, torch.tensor(go))
    return y.detach().numpy(), g.numpy()


def _ours(name, x, go, device, dtype=None):
    fwd, bwd = KINDS[name][:2]
    with ut.tensor(x, device, dtype) as xt, ut.tensor(go, device, dtype) as gt:
        with fwd(xt) as y, bwd(gt, xt) as g:
            assert y.device == g.device == device and y.dtype == g.dtype == xt.dtype
            assert y.shape == g.shape == tuple(x.shape)
            return y.numpy().astype(np.float32), g.numpy().astype(np.float32)


# ---- random values ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("n", [1, 7, 8, 9, 37, 4096 + 5, 150_001])
def test_matches_torch_and_float64(device, torch, rng, name, n):
    x = rng.uniform(-12.0, 12.0, n).astype(np.float32)
    x[: n // 4] = rng.standard_normal(n // 4).astype(np.float32)  # the curved middle, densely
    go = rng.standard_normal(n).astype(np.float32)
    y, g = _ours(name, x, go, device)
    ty, tg = _torch_both(torch, name, x, go)
    # float32 against float32: a few ulp of the transcendentals (host or device libm), which
    # the backward's cancellations (silu' and gelu' cross zero) turn into an absolute error;
    # PyTorch's vectorized CPU gelu is off by ~1e-6 near x = -3.5 (ours is within 4e-8 of
    # float64 there: the assert_close below)
    np.testing.assert_allclose(y, ty, rtol=1e-5, atol=1e-5, err_msg=name + " forward vs torch")
    np.testing.assert_allclose(g, tg, rtol=1e-5, atol=1e-5, err_msg=name + " backward vs torch")
    ref, ref_bwd = KINDS[name][3:]
    x64, go64 = x.astype(np.float64), go.astype(np.float64)
    assert_close(name, y, ref(x64))
    assert_close(name + " backward", g, ref_bwd(go64, x64))


@pytest.mark.parametrize("name", NAMES)
def test_any_shape(device, rng, name):
    x = rng.standard_normal((2, 3, 5, 7)).astype(np.float32)
    go = rng.standard_normal(x.shape).astype(np.float32)
    y, g = _ours(name, x, go, device)
    flat_y, flat_g = _ours(name, x.reshape(-1), go.reshape(-1), device)
    np.testing.assert_array_equal(y.reshape(-1), flat_y)
    np.testing.assert_array_equal(g.reshape(-1), flat_g)


@pytest.mark.parametrize("name", NAMES)
def test_the_float64_reference_itself(torch, rng, name):
    # utensil_ffi.reference's forms against PyTorch in float64 and their backward against central
    # differences of their forward (off the kinks), so the reference above is itself right
    ref, ref_bwd = KINDS[name][3:]
    x = rng.uniform(-8.0, 8.0, 301)
    x = x[np.abs(np.abs(x) - 3.0) > 1e-3]
    go = rng.standard_normal(x.size)
    t = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    y = _torch_fn(torch, name)(t)
    (g,) = torch.autograd.grad(y, t, torch.tensor(go))
    np.testing.assert_allclose(ref(x), y.detach().numpy(), rtol=1e-12, atol=1e-14)
    # rtol 1e-7: PyTorch's float64 hardsigmoid backward multiplies by 1/6 as a float32 literal
    np.testing.assert_allclose(ref_bwd(go, x), g.numpy(), rtol=1e-7, atol=1e-12)
    h = 1e-6
    fd = go * (ref(x + h) - ref(x - h)) / (2 * h)
    np.testing.assert_allclose(ref_bwd(go, x), fd, rtol=1e-6, atol=1e-8)


# ---- special values ---------------------------------------------------------------------------
_F32 = np.float32
SPECIAL = np.array([-np.inf, -1e20, -100.0, -88.0, -20.0, -3.0, np.nextafter(_F32(-3), _F32(0)),
                    np.nextafter(_F32(-3), _F32(-4)), -1.0, -1e-30, -0.0, 0.0, 1e-30, 1.0,
                    np.nextafter(_F32(3), _F32(0)), 3.0, np.nextafter(_F32(3), _F32(4)), 20.0,
                    88.0, 100.0, 1e20, np.inf, np.nan], np.float32)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("go_value", [1.0, -2.5, np.nan, np.inf])
def test_special_values_match_torch(device, torch, name, go_value):
    go = np.full(SPECIAL.shape, go_value, np.float32)
    y, g = _ours(name, SPECIAL, go, device)
    want_y, want_g = np.empty_like(y), np.empty_like(g)
    for i in range(SPECIAL.size):  # PyTorch's scalar path: its formulas, value by value
        want_y[i:i + 1], want_g[i:i + 1] = _torch_both(torch, name, SPECIAL[i:i + 1], go[i:i + 1])
    for what, got, want in (("forward", y, want_y), ("backward", g, want_g)):
        # NaN where PyTorch has NaN, the same infinities, the values within float32 rounding
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want),
                                      err_msg="%s %s NaN at x=%s" % (name, what, SPECIAL))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-30,
                                   err_msg="%s %s at x=%s" % (name, what, SPECIAL))


def test_the_kinks_take_torchs_gradients(device, torch):
    # hardswish: 0 at -3 (the left piece) and 1 at 3 (the right piece); hardsigmoid: 0 at both
    x = np.array([-3.0, 3.0], np.float32)
    go = np.ones(2, np.float32)
    for name, want in (("hardswish", [0.0, 1.0]), ("hardsigmoid", [0.0, 0.0])):
        _, g = _ours(name, x, go, device)
        np.testing.assert_array_equal(g, want)
        np.testing.assert_array_equal(g, _torch_both(torch, name, x, go)[1])


# ---- bfloat16 ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_bf16_is_the_float32_op_rounded_once(device, torch, rng, name):
    x = bf16_round(rng.uniform(-8.0, 8.0, 4099).astype(np.float32))  # odd: the GPU's tail too
    go = bf16_round(rng.standard_normal(x.size).astype(np.float32))
    y32, g32 = _ours(name, x, go, "cpu")
    yb, gb = _ours(name, x, go, device, ut.bfloat16)
    step = 2.0 ** -8
    for what, got, f32 in (("forward", yb, y32), ("backward", gb, g32)):
        if device == "cpu":  # float32 arithmetic, one rounding to nearest even
            np.testing.assert_array_equal(got, bf16_round(f32), err_msg=name + " " + what)
        else:  # the device's libm may land a float32 result across a rounding boundary:
            # one bf16 step apart at most, which is 2^-7 relative at the bottom of a binade
            # (GELU's gradient near its zero at x = -0.75: -5.49e-4 against -5.46e-4)
            np.testing.assert_allclose(got, bf16_round(f32), rtol=2 * step, atol=1e-30,
                                       err_msg=name + " " + what)
    # PyTorch on bf16 tensors computes in float32 and rounds once too, but its vectorized CPU
    # gelu is less exact (1e-5 absolute at the small negative values); its sigmoid backward
    # reads the bf16 output (1 - y rounded: 0 where y rounds to 1), ours x
    tx = torch.tensor(x).to(torch.bfloat16).requires_grad_(True)
    ty = _torch_fn(torch, name)(tx)
    (tg,) = torch.autograd.grad(ty, tx, torch.tensor(go).to(torch.bfloat16))
    np.testing.assert_allclose(yb, ty.detach().float().numpy(), rtol=step, atol=1e-4)
    if name != "sigmoid":
        np.testing.assert_allclose(gb, tg.float().numpy(), rtol=step, atol=1e-4)


def test_mixed_dtypes_are_refused(device):
    with ut.tensor(np.ones(4), device) as x, ut.tensor(np.ones(4), device, ut.bfloat16) as gb:
        with pytest.raises(ut.ArgumentError, match="fwd_input is float32 but grad_out is bfloat16"):
            ut.silu_backward(gb, x)


@pytest.mark.skipif("cuda" not in ut.devices(), reason="needs a GPU")
def test_devices_must_match():
    with ut.tensor(np.ones(4), "cuda") as x, ut.tensor(np.ones(4), "cpu") as g:
        with pytest.raises(ut.DeviceError):
            ut.gelu_backward(g, x)


# ---- the C entry points -----------------------------------------------------------------------
def _c_call(fn, *tensors_and_kind):
    r = fn(*tensors_and_kind)
    assert r != ffi.NULL, ffi.string(lib.ut_last_error()).decode()
    return ut.Tensor._wrap(r)


def test_c_api_every_kind(device, rng):
    x = rng.uniform(-5, 5, 33).astype(np.float32)
    go = rng.standard_normal(33).astype(np.float32)
    with ut.tensor(x, device) as xt, ut.tensor(go, device) as gt:
        for name, kind in C_KIND.items():
            assert ffi.string(lib.ut_activation_name(kind)).decode() == name
            with _c_call(lib.ut_activation_forward, xt._ptr, kind) as y, \
                    _c_call(lib.ut_activation_backward, gt._ptr, xt._ptr, kind) as g:
                want_y, want_g = _ours(name, x, go, device)
                np.testing.assert_array_equal(y.numpy(), want_y)
                np.testing.assert_array_equal(g.numpy(), want_g)
        # RELU and RELU6 are ut_relu / ut_relu6 and their backward, to the bit; NONE a copy
        for kind, fwd, bwd in ((lib.UT_ACT_RELU, ut.relu, ut.relu_backward),
                               (lib.UT_ACT_RELU6, ut.relu6, ut.relu6_backward)):
            with _c_call(lib.ut_activation_forward, xt._ptr, kind) as y, fwd(xt) as want:
                np.testing.assert_array_equal(y.numpy(), want.numpy())
            with _c_call(lib.ut_activation_backward, gt._ptr, xt._ptr, kind) as g, \
                    bwd(gt, xt) as want:
                np.testing.assert_array_equal(g.numpy(), want.numpy())
        with _c_call(lib.ut_activation_forward, xt._ptr, lib.UT_ACT_NONE) as y, \
                _c_call(lib.ut_activation_backward, gt._ptr, xt._ptr, lib.UT_ACT_NONE) as g:
            np.testing.assert_array_equal(y.numpy(), x)
            np.testing.assert_array_equal(g.numpy(), go)


def test_c_api_refuses_a_bad_kind():
    with ut.tensor(np.ones(3)) as x:
        for kind in (9, 1000):  # the enum is unsigned to cffi; native/test.c passes -1
            assert lib.ut_activation_forward(x._ptr, kind) == ffi.NULL
            assert "a must be a ut_activation (0 to 8), got %d" % kind in \
                ffi.string(lib.ut_last_error()).decode()
            assert lib.ut_activation_backward(x._ptr, x._ptr, kind) == ffi.NULL
            assert lib.ut_last_status() == lib.UT_ERR_ARG
        assert ffi.string(lib.ut_activation_name(9)).decode() == "?"


@pytest.mark.parametrize("name", NAMES)
def test_batchnorm_fuses_every_kind(device, rng, name):
    # BatchNorm2d(activation=name) is BatchNorm2d then the layer (tests/test_bn_activation.py
    # checks it in depth); here: the name maps to the C kind, and the eval forward matches
    assert ut.BatchNorm2d._ACTIVATIONS[name] == C_KIND[name]
    x = (rng.standard_normal((2, 3, 4, 5)) * 4).astype(np.float32)
    with ut.BatchNorm2d(3, activation=name, device=device) as fused, \
            ut.BatchNorm2d(3, device=device) as plain, ut.tensor(x, device) as xt:
        fused.eval(), plain.eval()
        with fused(xt) as y, plain(xt) as z:
            want, _ = _ours(name, z.numpy(), np.zeros_like(x), device)
            np.testing.assert_allclose(y.numpy(), want, rtol=1e-6, atol=1e-7)


# ---- the layers -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_layer_is_the_functional_op(device, rng, name):
    x = rng.standard_normal((4, 6)).astype(np.float32)
    go = rng.standard_normal((4, 6)).astype(np.float32)
    layer = LAYERS[name]().to(device)
    with ut.tensor(x, device) as xt, ut.tensor(go, device) as gt:
        with layer(xt) as y, layer.backward(gt) as g:
            want_y, want_g = _ours(name, x, go, device)
            np.testing.assert_array_equal(y.numpy(), want_y)
            np.testing.assert_array_equal(g.numpy(), want_g)
    assert layer.state_dict() == {} and list(layer.parameters()) == []


def test_layers_repr_and_arguments_as_torch(torch):
    nn = torch.nn
    pairs = [(ut.SiLU(), nn.SiLU()), (ut.SiLU(inplace=True), nn.SiLU(inplace=True)),
             (ut.Hardswish(), nn.Hardswish()), (ut.Hardswish(True), nn.Hardswish(True)),
             (ut.Hardsigmoid(), nn.Hardsigmoid()),
             (ut.Hardsigmoid(inplace=True), nn.Hardsigmoid(inplace=True)),
             (ut.Sigmoid(), nn.Sigmoid()), (ut.GELU(), nn.GELU()),
             (ut.GELU("tanh"), nn.GELU("tanh")), (ut.GELU(approximate="none"), nn.GELU()),
             (ut.ReLU(inplace=True), nn.ReLU(inplace=True)), (ut.ReLU6(), nn.ReLU6())]
    for ours, theirs in pairs:
        assert repr(ours) == repr(theirs)
    assert ut.SiLU(inplace=True).inplace is True and ut.GELU("tanh").approximate == "tanh"
    with pytest.raises(ut.ArgumentError, match="approximate must be one of 'none', 'tanh'"):
        ut.GELU("erf")
    with pytest.raises(ut.ArgumentTypeError, match="inplace must be True or False"):
        ut.Hardswish(inplace="yes")
    with pytest.raises(TypeError):
        ut.Sigmoid(inplace=True)  # torch.nn.Sigmoid takes no arguments


@pytest.mark.parametrize("name", NAMES)
def test_inplace_computes_out_of_place(device, rng, name):
    # torchvision passes inplace=True; the input stays, so backward still sees it
    if name == "sigmoid":
        pytest.skip("torch.nn.Sigmoid has no inplace")
    layer = (ut.GELU(approximate="tanh") if name == "gelu_tanh" else
             {"silu": ut.SiLU, "hardswish": ut.Hardswish, "hardsigmoid": ut.Hardsigmoid,
              "gelu": ut.GELU}[name](**({} if name.startswith("gelu") else {"inplace": True})))
    x = rng.standard_normal(10).astype(np.float32)
    with ut.tensor(x, device) as xt, layer(xt) as y:
        np.testing.assert_array_equal(xt.numpy(), x)
        assert y is not xt


def test_copy_and_pickle_keep_the_settings():
    for layer in (ut.GELU("tanh"), ut.SiLU(inplace=True), ut.Hardswish(True), ut.Sigmoid()):
        for again in (copy.copy(layer), copy.deepcopy(layer),
                      pickle.loads(pickle.dumps(layer))):
            assert type(again) is type(layer) and repr(again) == repr(layer)
            assert vars(again).get("approximate") == vars(layer).get("approximate")
            with again(np.linspace(-4, 4, 9)) as a, layer(np.linspace(-4, 4, 9)) as b:
                np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_a_network_trains_as_torchs(device, torch, rng):
    """Linear -> Hardswish -> Linear -> SiLU -> Linear -> GELU(tanh) -> Linear -> Hardsigmoid ->
    Linear -> Sigmoid -> Linear -> GELU: the loss's gradients of every weight, as PyTorch's."""
    dims = [5, 8, 8, 8, 8, 8, 8, 3]
    acts = [ut.Hardswish(inplace=True), ut.SiLU(), ut.GELU("tanh"), ut.Hardsigmoid(),
            ut.Sigmoid(), ut.GELU()]
    tacts = [torch.nn.Hardswish(), torch.nn.SiLU(), torch.nn.GELU("tanh"),
             torch.nn.Hardsigmoid(), torch.nn.Sigmoid(), torch.nn.GELU()]
    layers, tlayers = [], []
    for i in range(len(dims) - 1):
        lin = ut.Linear(dims[i], dims[i + 1], device=device)
        tlin = torch.nn.Linear(dims[i], dims[i + 1])
        w = rng.standard_normal((dims[i + 1], dims[i])).astype(np.float32)
        b = rng.standard_normal(dims[i + 1]).astype(np.float32) * 0.5
        lin.weight.copy_from(w), lin.bias.copy_from(b)
        with torch.no_grad():
            tlin.weight.copy_(torch.tensor(w)), tlin.bias.copy_(torch.tensor(b))
        layers.append(lin), tlayers.append(tlin)
        if i < len(acts):
            layers.append(acts[i]), tlayers.append(tacts[i])
    net, tnet = ut.Sequential(*layers), torch.nn.Sequential(*tlayers)
    x = rng.standard_normal((6, 5)).astype(np.float32) * 2
    labels = rng.integers(0, 3, 6)
    with ut.tensor(x, device) as xt, net(xt) as logits:
        with ut.cross_entropy_backward(logits, labels) as g:
            net.backward(g).close()
        tl = torch.nn.functional.cross_entropy(tnet(torch.tensor(x)), torch.tensor(labels))
        tl.backward()
        assert_close("network logits", logits.numpy(), tnet(torch.tensor(x)).detach().numpy())
    ours = dict(net.named_parameters())
    for k, tp in tnet.named_parameters():
        assert_close("network grad " + k, ours[k].grad.numpy(), tp.grad.numpy(), rtol=1e-4,
                     atol=1e-5)
    net.close()


# ---- ONNX -------------------------------------------------------------------------------------
@pytest.mark.parametrize("opset", [11, 14, 17, 20])
def test_onnx_export_runs_in_onnxruntime(tmp_path, rng, opset):
    pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from utensil_ffi.interop.onnx_export import export_onnx

    net = ut.Sequential(
        ut.Conv2d(3, 8, 3, padding=1), ut.Hardswish(inplace=True), ut.DWConv2d(8, 3, padding=1),
        ut.SiLU(), ut.Conv2d(8, 8, 1), ut.GELU(), ut.Conv2d(8, 8, 1), ut.GELU("tanh"),
        ut.Conv2d(8, 8, 1), ut.Hardsigmoid(), ut.Conv2d(8, 8, 1), ut.Sigmoid(),
        ut.GlobalAvgPool2d(), ut.Linear(8, 4))
    net.eval()
    path = str(tmp_path / "act.onnx")
    proto = export_onnx(net, path, (1, 3, 6, 6), opset=opset)
    ops = [n.op_type for n in proto.graph.node]
    assert ("HardSwish" in ops) == (opset >= 14) and ("Gelu" in ops) == (opset >= 20)
    assert ("Erf" in ops) == (opset < 20) and "HardSigmoid" in ops and "Sigmoid" in ops
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    sess = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    x = (rng.standard_normal((3, 3, 6, 6)) * 3).astype(np.float32)
    got = sess.run(None, {"input": x})[0]
    with net(x) as y:
        np.testing.assert_allclose(got, y.numpy(), rtol=1e-4, atol=1e-5)
    net.close()
