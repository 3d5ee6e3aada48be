"""The op table itself (utensil_ffi/testing/optable.py), and the checks run over all of it.

The other files draw their cases from the table (test_gradcheck, test_bf16, test_copy_pickle,
test_errors, test_numerics_extremes, test_reference, test_bf16_ops, test_network_grad,
test_input_grad and the self-check); here, as in PyTorch's OpInfo tests, every entry and every
sample at once:

- the table is well formed: its names are the library's public ones, every sample's geometry is
  the op's, every use is known and names are unique within it, the gradient-checked ops are the
  self-check's;
- every sample of every op, on every device, against the op's float64 reference;
- a layer's geometry read back (``geometry_of``) builds the same layer;
- the bf16 rule: an op that refuses bf16 activations says so (every device); one that takes
  them is, on the CPU, the float32 op on the same (bf16) values rounded once to nearest even.
"""

import numpy as np
import pytest

import utensil_ffi as ut
from bf16_reference import bf16_round
from conftest import ALL_DEVICES
from tolerances import assert_close
from utensil_ffi.testing import optable
from utensil_ffi import selftest as S

# every sample of every op, named op-index[-name]
ALL = [pytest.param(op, s, id="%s-%d%s" % (op.name, i, "-" + s.name if s.name else ""))
       for op in optable.OPS for i, s in enumerate(op.samples)]
LAYER_OPS = [op for op in optable.OPS if op.layer is not None]


def _public(name):
    """ut.<name> or ut.functional.<name> (a dotted name: ut.functional.add_)."""
    obj = ut
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def test_the_table_is_well_formed():
    names = [op.name for op in optable.OPS]
    assert len(names) == len(set(names)) and optable.OP == {op.name: op for op in optable.OPS}
    for op in optable.OPS:
        if op.layer is not None:
            assert op.layer in ut.__all__ and isinstance(_public(op.layer), type), op
        for f in op.functions:
            assert callable(_public(f)), (op, f)
        assert op.samples, "%s has no sample" % op
        assert set(op.devices) <= set(ALL_DEVICES), op
        assert set(op.grad) <= set(op.shapes({})), op
        for s in op.samples:
            g = op.geometry(**s.geom)  # raises on a key the op does not have
            assert set(op.sample_inputs(np.random.default_rng(0), g)[0]) == set(op.shapes(g))
        rule = op.bf16
        assert (rule.refused is None) == rule.supported, op
        assert set(rule.operands) <= set(op.shapes({})), op
        for c in op.errors:
            assert c.entry.split(".")[0] in set(ut.__all__) | {"functional"}, c
            assert issubclass(c.exception(ut), BaseException) and c.match, c
    for use in optable.USES:  # the tests' ids are these names: unique within each use
        named = [s.name for _, s in optable.samples(use) if s.name]
        assert len(named) == len(set(named)), use
    # the self-check's ops are the ones with a gradient check, in the table's order
    assert list(S.CASES) == [op.name for op in optable.OPS if op.gradcheck]


def test_every_layer_has_an_entry():
    layers = {n for n in ut.__all__ if isinstance(getattr(ut, n), type)
              and issubclass(getattr(ut, n), ut.Module)}
    # containers and wrappers hold ops, they are none; SyncBatchNorm is BatchNorm2d's
    layers -= {"Module", "Sequential", "Residual", "MixedPrecision", "SyncBatchNorm"}
    layers -= {"SqueezeExcitation"}  # a block of layers (tests/test_se_layernorm2d.py)
    assert layers <= {op.layer for op in LAYER_OPS}, layers - {op.layer for op in LAYER_OPS}


@pytest.mark.parametrize("op, sample", ALL)
def test_sample_matches_reference(device, op, sample):
    case = op.case(np.random.default_rng(7), **sample.geom)
    runner = case.open(device)
    try:
        y = runner.forward(case.inputs)
    finally:
        runner.close()
    a64 = {k: v.astype(np.float64) for k, v in case.inputs.items()}
    assert_close("%s %s" % (op.name, case.desc), y, case.ref(a64))


@pytest.mark.parametrize("op", LAYER_OPS, ids=[op.name for op in LAYER_OPS])
def test_geometry_of_builds_the_same_layer(op):
    for s in op.samples:
        layer = op.make(s.geom, "cpu")
        try:
            full = op.geometry(**s.geom)
            own = op._geometry_of(layer) if op._geometry_of else {}  # the layer's own settings
            if "shape" in own:  # LayerNorm knows only the normalized (last) dimension
                assert own.pop("shape")[-1] == full["shape"][-1], (op, s)
            assert {k: full[k] for k in own} == own, (op, s)
            again = op.make(op.geometry_of(layer), "cpu")
            assert type(again) is type(layer), (op, s)
            if " object at " not in repr(layer):  # the losses have no repr of their own
                assert repr(again) == repr(layer), (op, s)
            again.close()
        finally:
            layer.close()


REFUSED = [op for op in optable.OPS if not op.bf16.supported]
TAKEN = [op for op in optable.OPS if op.bf16.supported]


@pytest.mark.parametrize("op", REFUSED, ids=[op.name for op in REFUSED])
def test_bf16_refused(device, op):
    exc, match = op.bf16.refused
    case = op.case(np.random.default_rng(3), **op.samples[0].geom)
    runner = case.open(device)
    try:
        with pytest.raises(getattr(ut, exc), match=match):
            runner.forward(case.inputs, {k: ut.bfloat16 for k in op.bf16.operands})
    finally:
        runner.close()


@pytest.mark.parametrize("op", TAKEN, ids=[op.name for op in TAKEN])
def test_bf16_is_float32_rounded_once_on_the_cpu(op):
    rule = op.bf16
    assert rule.inputs == "rounded" and rule.cpu == "exact"
    case = op.case(np.random.default_rng(4), **op.samples[0].geom)
    inputs = {k: bf16_round(v) for k, v in case.inputs.items()}  # bf16 values, in float32
    runner = case.open("cpu")
    try:
        f32 = runner.forward(inputs)
        got = runner.forward(inputs, {k: ut.bfloat16 for k in rule.operands})
    finally:
        runner.close()
    want = f32 if rule.out == "float32" else bf16_round(f32).astype(np.float64)
    np.testing.assert_array_equal(got, want, err_msg=op.name)


def test_a_wrong_reference_fails_the_checks(monkeypatch):
    """The table has teeth: a reference off by 0.1% fails the self-check's forward and fd64
    bounds, and this file's forward check."""
    op = optable.OP["linear"]
    real = op._reference
    monkeypatch.setattr(op, "_reference", lambda a, k, g: 1.001 * real(a, k, g))
    case = op.case(np.random.default_rng(0), **op.samples[0].geom)
    errs, _ = S.check_case(case, "cpu", np.random.default_rng(0))
    assert errs["forward"] > S.BOUNDS["forward"] and errs["fd64"] > S.BOUNDS["fd64"]
    with pytest.raises(AssertionError):
        test_sample_matches_reference("cpu", op, op.samples[0])
