"""Gradient checks: every op with a backward, on every present device, against finite differences.

For each case, utensil's analytic gradients (float32 backward) of L = sum(op(inputs) * go), with
respect to every differentiable input (x, weight, bias; pred/logits for the losses), are compared
with:

  fd64  central differences (eps 1e-6) of an exact float64 numpy forward: the gradient is right;
  fd32  central differences (eps 1e-2) of utensil's own float32 forward: forward and backward of
        the library are consistent with each other;

and, on a GPU, output and gradients against the CPU. Errors are normalized, ||a - b|| / ||b||,
with the bounds of utensil_ffi.selftest.BOUNDS (fd64 <= 1e-4, fd32 <= 1e-3, forward and vs cpu
<= 1e-4). The float64 forward used for fd64 is the op's in utensil_ffi.reference (numpy only);
each case's forward is checked here to be that op with the case's own geometry, and the reference
itself is checked in tests/test_reference.py (its backward against finite differences, forward
and backward against PyTorch in float64 where it is installed).

Shapes are small (FD costs two forwards per input element) and cover batch > 1, stride 1 and 2,
padding 0..2, kh != kw, 1x1 kernels and odd sizes; depthwise also dilation 1..3 and channel
multipliers 1..3; they are the op table's samples marked "gradcheck" (utensil_ffi/testing/optable.py,
the cases themselves are built by the table as the self-check's are); a hypothesis test adds
random conv geometries.
"""

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import utensil_ffi as ut
from utensil_ffi.testing import optable
from utensil_ffi import selftest as S

EXAMPLES = int(os.environ.get("UTENSIL_HYPOTHESIS_EXAMPLES", "10"))

# (op, geometry): every op with a backward and its samples marked "gradcheck" in the op table
# (utensil_ffi/testing/optable.py): convolutions at stride 1 and 2, padding 0..2, kh != kw, 1x1 and odd
# sizes (depthwise also dilation 1..3 and multipliers 1..3), batchnorm, layernorm, linear,
# pooling, activations and losses at two or three shapes each
CASES = [(op.name, s.geom) for op, s in optable.samples("gradcheck")]


def _id(case):
    op, g = case
    return op + "-" + "_".join("%s%s" % (k, v if not isinstance(v, tuple) else "x".join(map(str, v)))
                               for k, v in g.items())


def _check(case, geom, device, seed):
    # The float64 forward the fd64 check differentiates is the table's reference op at this
    # test's geometry (not the one the case carries), on the case's inputs and constants.
    a64 = {k: v.astype(np.float64) for k, v in case.inputs.items()}
    other = optable.OP[case.op].reference(a64, case.consts, geom)
    np.testing.assert_allclose(case.ref(a64), other, rtol=1e-12, atol=1e-12)

    cpu = None
    if device != "cpu":
        _, cpu = S.check_case(case, "cpu", np.random.default_rng(seed), fd32=False)
    errs, _ = S.check_case(case, device, np.random.default_rng(seed), cpu_results=cpu)
    bad = {k: e for k, e in errs.items() if not e <= S.BOUNDS[k]}
    assert not bad, "%s on %s: %s exceed the bounds %s (all: %s)" % (case, device, bad, S.BOUNDS, errs)
    assert set(errs) >= {"forward", "fd64", "fd32"}


def _make(op, geom, seed):
    case = S.make_case(op, np.random.default_rng(seed), **geom)
    if op == "dwconv2d":
        assert case.inputs["w"].shape[0] == geom["c"] * geom.get("mult", 1)
    return case


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_gradcheck(device, case):
    op, geom = case
    _check(_make(op, geom, 1234), geom, device, 99)


def test_every_op_with_a_backward_is_covered():
    assert {op for op, _ in CASES} == set(S.CASES) == {
        "conv2d", "dwconv2d", "batchnorm2d", "layernorm", "linear", "global_avg_pool2d", "relu",
        "relu6", "softmax_cross_entropy", "mse_loss",
        "channel_scale", "layer_scale", "layernorm2d",  # issue 30
        "dropout", "stochastic_depth",  # issue 30: a reseeded mask (the op table's runner)
        "silu", "hardswish", "hardsigmoid", "sigmoid", "gelu"}  # issue 30's activations
    geoms = [g for op, g in CASES if op == "conv2d"]
    assert {g["stride"] for g in geoms} >= {1, 2}
    assert {g["pad"] for g in geoms} >= {0, 1, 2}
    assert any(g["kh"] != g["kw"] for g in geoms)
    assert all(g["n"] > 1 for g in geoms)
    dw = [g for op, g in CASES if op == "dwconv2d"]
    assert {g.get("dilation", 1) for g in dw} == {1, 2, 3}
    assert {g.get("mult", 1) for g in dw} == {1, 2, 3}
    assert {g["stride"] for g in dw if g.get("dilation", 1) > 1} >= {1, 2, 3}
    assert any(g["h"] + 2 * g["pad"] == g["dilation"] * (g["kh"] - 1) + 1 for g in dw
               if "dilation" in g)  # a window as large as the padded input


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(op=st.sampled_from(["conv2d", "dwconv2d"]), n=st.integers(1, 3), c=st.integers(1, 3),
       o=st.integers(1, 3), h=st.integers(1, 6), w=st.integers(1, 6), kh=st.integers(1, 3),
       kw=st.integers(1, 3), s=st.integers(1, 2), p=st.integers(0, 2), d=st.integers(1, 3),
       seed=st.integers(0, 2**31))
def test_gradcheck_random_conv_geometry(device, op, n, c, o, h, w, kh, kw, s, p, d, seed):
    if h + 2 * p < kh or w + 2 * p < kw:
        return  # not a valid geometry (tests/test_properties.py checks that it raises)
    geom = dict(n=n, c=c, h=h, w=w, kh=kh, kw=kw, stride=s, pad=p)
    if op == "conv2d":
        geom["o"] = o
    else:  # depthwise: o is the multiplier; the dilation, lowered until the window fits
        while d > 1 and (h + 2 * p < d * (kh - 1) + 1 or w + 2 * p < d * (kw - 1) + 1):
            d -= 1
        geom.update(dilation=d, mult=o)
    _check(_make(op, geom, seed), geom, device, seed + 1)


@pytest.mark.parametrize("factor", [1.001, 0.0])
def test_gradcheck_detects_a_wrong_gradient(factor):
    """The check has teeth: a gradient off by 0.1% (or zeroed) fails the fd64 bound."""
    case = _make("conv2d", dict(n=2, c=2, o=2, h=4, w=4, kh=3, kw=2, stride=1, pad=1), 7)
    opener = case._opener

    def broken(dev):
        r = opener(dev)
        bwd = r.backward

        def backward(inputs, go):
            y, g = bwd(inputs, go)
            g["w"] = g["w"] * factor
            return y, g

        r.backward = backward
        return r

    case._opener = broken
    errs, _ = S.check_case(case, "cpu", np.random.default_rng(0))
    assert errs["fd64"] > S.BOUNDS["fd64"]
    assert errs["fd32"] > S.BOUNDS["fd32"] or factor != 0.0
