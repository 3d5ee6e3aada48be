"""One table of utensil's ops: each op once, with how to call it, its sample shapes, its float64
reference, its gradient check, its bfloat16 rule, its devices and its wrong-input cases.

After PyTorch's OpInfo (``torch/testing/_internal/common_methods_invocations.py``) and ggml's
``test-backend-ops``: the self-check (``python -m utensil_ffi.selftest``) and the tests draw
their cases from ``OPS`` instead of keeping lists of their own, so one op's description is in
one place (``grep -n '"dwconv2d"' utensil_ffi/testing/optable.py``)::

    from utensil_ffi.testing import optable
    op = optable.OP["conv2d"]
    for s in op.samples_for("gradcheck"):
        case = op.case(rng, **s.geom)   # float32 inputs, the float64 reference, a runner
    layer = op.make(s.geom, "cpu")      # the layer the sample describes, from the public API

An entry (``OpInfo``) holds:

  name        the op, as the self-check's rows and tests/test_gradcheck.py name it
  layer       the public layer class (``"Conv2d"``), or None for a function alone
  functions   the public functions of the op (``ut.relu``, ``ut.relu_backward``)
  defaults    the geometry a sample leaves out (``geometry(**geom)`` fills it in)
  shapes      geometry -> {input name: shape} of the differentiable inputs (x, w, b; pred)
  make        (geometry, device) -> the layer, built through the public API
  geometry_of a live layer -> the geometry it runs at (what its reference reads)
  reference   (float64 inputs, consts, geometry) -> the float64 forward (utensil_ffi.reference)
  grad        the inputs the gradient check differentiates (() where the op is not checked)
  samples     small geometries, each marked with the checks that use it (``USES``)
  bf16        the bfloat16 rule (``Bf16``)
  devices     the devices the op runs on (every test runs it on each of them that is present)
  errors      wrong calls (``ErrorCase``): entry point, call, exception name, message fragment

A sample's inputs come from ``sample_inputs(rng, geometry)`` -> (inputs, consts): the float32
arrays the gradient check differentiates, and the constant ones (labels, a loss's target).

Pure data and callables over numpy and the package: it imports no test framework and no torch,
and the library only when one of its callables runs, so the self-check can still report a
library that does not load.
"""

import numpy as np

from . import reference as R

__all__ = ["OPS", "OP", "USES", "OpInfo", "Sample", "Bf16", "ErrorCase", "Case", "samples",
           "for_layer"]

# what each use of a sample is (the file that draws it)
USES = {
    "selftest": "python -m utensil_ffi.selftest: one row per sample and device",
    "gradcheck": "tests/test_gradcheck.py: gradients against finite differences, every device",
    "bf16": "tests/test_bf16.py: the layer on bf16 activations against float32 (named)",
    "bf16_gemm": "tests/test_bf16_ops.py: bf16 GEMM shapes on the GPU, cuBLAS plans",
    "copy": "tests/test_copy_pickle.py: copy, deepcopy and pickle of the layer (named)",
    "nonfinite": "tests/test_numerics_extremes.py: NaN/inf propagation against PyTorch (named)",
    "cuda_vs_cpu": "tests/test_reference.py: the GPU layer against the CPU layer (named)",
    "params_only": "tests/test_input_grad.py: backward(input_grad=False) against backward (named)",
    "reference": "tests/test_optable.py: the op against its float64 reference (every sample is)",
}


def _ut():
    """The package facade, imported when a callable runs (not when this module loads)."""
    import utensil_ffi

    return utensil_ffi


# -- the pieces of an entry -----------------------------------------------------------------------
class Sample:
    """One geometry of an op, and the checks (keys of USES) that use it; ``name`` names it where
    a test's ids are names (bf16, copy, nonfinite, cuda_vs_cpu)."""

    __slots__ = ("geom", "uses", "name")

    def __init__(self, geom, uses, name=None):
        self.geom = dict(geom)
        self.uses = frozenset(uses)
        self.name = name
        unknown = self.uses - set(USES)
        if unknown:
            raise ValueError("unknown sample uses %s" % sorted(unknown))

    def __repr__(self):
        return "Sample(%s%r, %s)" % (self.name + " " if self.name else "", self.geom,
                                     sorted(self.uses))


class Bf16:
    """An op's bfloat16 rule.

    supported    bf16 activations are taken (otherwise ``refused``: (exception, fragment))
    inputs       "rounded": tests feed bf16 values (float32 rounded to nearest even), so the
                 float64 reference and the float32 run see exactly the numbers the bf16 run sees
    cpu          "exact": on the CPU bf16 is float32 arithmetic with each output rounded once,
                 so the bits equal nearest-even of the float32 op on the same values
    gpu_steps    on the GPU, outputs and dx within this many bf16 steps (2**-8) of max |ref|
    param_steps  the float32 parameter gradients within this many steps of the float32 layer's
    kernel       the GPU kernels' tolerance family (tests/test_bf16_ops.py): "exact" (moves and
                 one rounding), "reduce" (a sum into a bf16 output), "gemm" (final and one
                 intermediate rounding), "norm", "depthwise" (their own files)
    needs_cublas the GPU's bf16 form runs on cuBLAS only (the own GEMM kernels are float32)
    out          the dtype of the result on bf16 input ("bfloat16", or "float32": a loss)
    operands     the inputs that are activations, so may be bf16 (a layer's parameters, a
                 bias added in place, stay float32)
    """

    def __init__(self, supported=True, kernel="exact", gpu_steps=4, param_steps=8,
                 needs_cublas=False, out="bfloat16", refused=None, operands=("x",)):
        self.supported = supported
        self.operands = tuple(operands)
        self.inputs = "rounded"
        self.cpu = "exact"
        self.kernel = kernel
        self.gpu_steps = gpu_steps
        self.param_steps = param_steps
        self.needs_cublas = needs_cublas
        self.out = out
        self.refused = refused

    def __bool__(self):
        return self.supported

    def __repr__(self):
        if not self.supported:
            return "Bf16(refused %r)" % (self.refused,)
        return "Bf16(%s, gpu %d steps, params %d steps%s)" % (
            self.kernel, self.gpu_steps, self.param_steps, ", cuBLAS" if self.needs_cublas else "")


# bf16 activations refused: "x is bfloat16, and it must be float32 here"
_F32_ONLY = Bf16(False, refused=("ArgumentError", "must be float32"))


class ErrorCase:
    """A wrong call of one public entry point: ``call(ut)`` raises the exception named ``exc``
    (a name in utensil_ffi, or a builtin) whose message contains ``match`` (a literal fragment;
    None: any message)."""

    __slots__ = ("entry", "call", "exc", "match")

    def __init__(self, entry, call, exc, match=None):
        self.entry, self.call, self.exc, self.match = entry, call, exc, match

    def exception(self, ut=None):
        import builtins

        ut = ut or _ut()
        return getattr(ut, self.exc, None) or getattr(builtins, self.exc)

    def __repr__(self):
        return "ErrorCase(%s -> %s %r)" % (self.entry, self.exc, self.match)


def _t(ut, *shape):
    """A zero float32 tensor on the CPU (the wrong calls' operand)."""
    return ut.zeros(shape)


def _fwd(layer, x):
    """A layer after a forward pass in training mode."""
    layer(x).close()
    return layer


# -- cases: one op on one set of inputs (the self-check's unit, and the gradient check's) --------
class Case:
    """One op on one set of inputs.

    ``inputs``: name -> float32 array, the differentiable inputs (x, w, b or pred/logits);
    ``consts``: the inputs that are not differentiated (labels, a target);
    ``ref(inputs64)``: the float64 forward; ``open(device)``: a runner with
    ``forward(inputs) -> y`` and ``backward(inputs, go) -> (y, {name: grad})``, then ``close()``.
    """

    def __init__(self, op, desc, inputs, ref, opener, consts=None, geom=None):
        self.op = op
        self.desc = desc
        self.inputs = inputs
        self.ref = ref
        self._opener = opener
        self.consts = consts or {}
        self.geom = geom or {}

    def open(self, device):
        return self._opener(device)

    def __repr__(self):
        return "Case(%s %s)" % (self.op, self.desc)


def _dtype_of(dtype, name):
    """A runner's ``dtype`` for operand ``name``: one dtype for all, or {name: dtype} (float32
    for the names it leaves out)."""
    return dtype.get(name) if isinstance(dtype, dict) else dtype


class _Runner:
    """Holds a layer for repeated forward/backward calls with given parameter values.
    ``forward(inputs, dtype)``: ``dtype`` (one, or {name: dtype}) is the input's, as for every
    runner; the parameters stay float32."""

    def __init__(self, layer, device, names=("x", "w", "b")):
        self.layer = layer
        self.device = device
        self.names = names

    def _load(self, inputs, dtype=None):
        import utensil_ffi as ut

        if "w" in inputs:
            self.layer.weight.copy_from(inputs["w"])
        if "b" in inputs and self.layer.bias is not None:
            self.layer.bias.copy_from(inputs["b"])
        return ut.tensor(inputs["x"], self.device, _dtype_of(dtype, "x"))

    def forward(self, inputs, dtype=None):
        """The output as float64; ``dtype`` is x's (the parameters stay float32)."""
        x = self._load(inputs, dtype)
        with x, self.layer(x) as y:
            return y.numpy().astype(np.float64)

    def backward(self, inputs, go):
        import utensil_ffi as ut

        x = self._load(inputs)
        self.layer.zero_grad()
        with x, self.layer(x) as y, ut.tensor(go, self.device) as g:
            out = y.numpy().astype(np.float64)
            with self.layer.backward(g) as dx:
                grads = {"x": dx.numpy().astype(np.float64)}
        if "w" in inputs:
            grads["w"] = self.layer.weight.grad.numpy().astype(np.float64)
        if "b" in inputs:
            grads["b"] = self.layer.bias.grad.numpy().astype(np.float64)
        return out, grads

    def close(self):
        self.layer.close()


class _FnRunner:
    """For ops without parameters: fwd(x_tensor) -> Tensor, bwd(go_tensor, x_tensor) -> Tensor."""

    def __init__(self, device, fwd, bwd):
        self.device, self.fwd, self.bwd = device, fwd, bwd

    def forward(self, inputs, dtype=None):
        import utensil_ffi as ut

        with ut.tensor(inputs["x"], self.device, _dtype_of(dtype, "x")) as x, self.fwd(x) as y:
            return y.numpy().astype(np.float64)

    def backward(self, inputs, go):
        import utensil_ffi as ut

        with ut.tensor(inputs["x"], self.device) as x, self.fwd(x) as y:
            out = y.numpy().astype(np.float64)
            with ut.tensor(go, self.device) as g, self.bwd(g, x) as dx:
                return out, {"x": dx.numpy().astype(np.float64)}

    def close(self):
        pass


class _CallRunner:
    """Forward only, for ops with several operands or in-place ones: ``fn(tensors)`` -> the
    result Tensor (one of the operands where the op writes in place)."""

    def __init__(self, device, fn):
        self.device, self.fn = device, fn

    def forward(self, inputs, dtype=None):
        import utensil_ffi as ut

        ts = {k: ut.tensor(v, self.device, _dtype_of(dtype, k)) for k, v in inputs.items()}
        try:
            y = self.fn(ts)
            try:
                return y.numpy().astype(np.float64)
            finally:
                if all(y is not t for t in ts.values()):
                    y.close()
        finally:
            for t in ts.values():
                t.close()

    def close(self):
        pass


def _f32(rng, *shape, scale=1.0, shift=0.0):
    return (rng.standard_normal(shape) * scale + shift).astype(np.float32)


def _away_from(x, points, gap):
    """Move values within `gap` of any kink in `points` out to distance `gap` (so FD is smooth)."""
    x = x.copy()
    for p in points:
        d = x - p
        near = np.abs(d) < gap
        x[near] = p + np.where(d[near] >= 0, gap, -gap)
    return x


# -- the entry ------------------------------------------------------------------------------------
class OpInfo:
    """One op of the table (see the module's doc for the fields)."""

    def __init__(self, name, *, layer=None, functions=(), defaults, shapes, sample_inputs,
                 reference, describe, runner, make=None, geometry_of=None, grad=(), samples=(),
                 bf16=_F32_ONLY, devices=("cpu", "cuda"), errors=()):
        self.name = name
        self.layer = layer
        self.functions = tuple(functions)
        self.defaults = dict(defaults)
        self._shapes = shapes
        self._sample_inputs = sample_inputs
        self._reference = reference
        self._describe = describe
        self._runner = runner
        self._make = make
        self._geometry_of = geometry_of
        self.grad = tuple(grad)
        self.samples = list(samples)
        self.bf16 = bf16
        self.devices = tuple(devices)
        self.errors = list(errors)

    def __repr__(self):
        return "OpInfo(%s)" % self.name

    @property
    def gradcheck(self):
        """Whether the op's backward is checked against finite differences."""
        return bool(self.grad)

    def geometry(self, **geom):
        """The defaults overridden by ``geom``."""
        unknown = set(geom) - set(self.defaults)
        if unknown:
            raise TypeError("%s: unknown geometry %s" % (self.name, sorted(unknown)))
        g = dict(self.defaults)
        g.update(geom)
        return g

    def shapes(self, geom):
        """{input name: shape} of the differentiable inputs at ``geom``."""
        return self._shapes(self.geometry(**geom))

    def sample_inputs(self, rng, geom):
        """(inputs, consts): float32 arrays drawn from ``rng`` at ``geom``."""
        return self._sample_inputs(rng, self.geometry(**geom))

    def reference(self, inputs64, consts, geom):
        """The float64 forward of ``inputs64`` (utensil_ffi.reference) at ``geom``."""
        return self._reference(inputs64, consts, self.geometry(**geom))

    def describe(self, geom):
        return self._describe(self.geometry(**geom))

    def make(self, geom, device="cpu"):
        """The layer at ``geom`` on ``device``, through the public API (a new one per call)."""
        if self._make is None:
            raise TypeError("%s is a function, not a layer" % self.name)
        return self._make(_ut(), self.geometry(**geom), device)

    def geometry_of(self, layer):
        """The geometry ``layer`` (one of this op's layers) runs at: the hyper-parameters its
        reference reads (the input's sizes are left to the defaults)."""
        return self.geometry(**(self._geometry_of(layer) if self._geometry_of else {}))

    def runner(self, geom, consts, device):
        """A runner (``forward``, and ``backward`` where the op has one) at ``geom``."""
        return self._runner(_ut(), self.geometry(**geom), consts, device)

    def samples_for(self, use):
        """The samples that ``use`` (a key of USES) draws, in table order."""
        if use not in USES:
            raise ValueError("unknown use %r" % (use,))
        return [s for s in self.samples if use in s.uses]

    def case(self, rng, **geom):
        """A Case at ``geom`` (the defaults where left out) with inputs drawn from ``rng``."""
        g = self.geometry(**geom)
        inputs, consts = self._sample_inputs(rng, g)
        return Case(self.name, self._describe(g), inputs,
                    lambda a: self._reference(a, consts, g),
                    lambda dev: self._runner(_ut(), g, consts, dev), consts, g)


def _layer_runner(ut, g, consts, device, make):
    return _Runner(make(ut, g, device), device)


# -- convolutions ---------------------------------------------------------------------------------
def _conv_make(ut, g, device):
    return ut.Conv2d(g["c"], g["o"], (g["kh"], g["kw"]), stride=g["stride"], padding=g["pad"],
                     bias=g["bias"], device=device)


def _without_bias(shapes, g):
    if not g.get("bias", True):
        del shapes["b"]
    return shapes


def _xwb_inputs(shapes):
    """x, w (scale 0.5) and b (where the geometry has one), drawn in that order."""

    def draw(rng, g):
        s = shapes(g)
        inputs = {"x": _f32(rng, *s["x"]), "w": _f32(rng, *s["w"], scale=0.5)}
        if "b" in s:
            inputs["b"] = _f32(rng, *s["b"])
        return inputs, {}

    return draw


def _conv_shapes(g):
    return _without_bias({"x": (g["n"], g["c"], g["h"], g["w"]),
                          "w": (g["o"], g["c"], g["kh"], g["kw"]), "b": (g["o"],)}, g)


def _conv_geoms(rows, uses):
    """(N, C, O, H, W, kh, kw, stride, pad) rows -> samples."""
    return [Sample(dict(n=n, c=c, o=o, h=h, w=w, kh=kh, kw=kw, stride=s, pad=p), uses)
            for n, c, o, h, w, kh, kw, s, p in rows]


# the gradient check's convolutions: stride 1 and 2, padding 0..2, kh != kw, 1x1, odd sizes;
# (N, C, O, H, W, kh, kw, stride, pad); the depthwise check runs them too (O left out)
_GRADCHECK_CONV = [
    (2, 2, 3, 5, 6, 3, 2, 1, 0),
    (2, 3, 2, 6, 5, 2, 3, 2, 1),
    (3, 2, 2, 7, 7, 3, 3, 2, 2),
    (2, 1, 2, 4, 5, 1, 3, 1, 2),
    (2, 2, 2, 5, 5, 1, 1, 2, 0),
    (2, 2, 3, 3, 4, 2, 2, 1, 1),
]

# bf16 GEMMs on the GPU (N, C, H, W, O, (kh, kw), stride, pad): 3x3 stride 2 on im2col (the
# weight gradient's sum over the batch on either cuBLAS plan: few channels -> reduce, 64
# channels on 7x7 outputs -> concatenate), the strided stem, kh != kw, 1x1 pointwise (reduce and
# concatenate), odd sizes; 1x1 over planes of 7x7, 14x14 and 9x11 (not a multiple of 8
# positions) runs as one GEMM over the batch on channel-major regrouped operands
# (ut__conv_merges_batch)
_BF16_GEMM_CONV = [
    (4, 32, 7, 7, 48, (1, 1), 1, 0),
    (2, 16, 14, 14, 24, (1, 1), 1, 0),
    (2, 4, 9, 9, 6, (3, 3), 2, 1),
    (2, 64, 14, 14, 64, (3, 3), 2, 1),
    (2, 3, 33, 33, 32, (3, 3), 2, 1),
    (3, 5, 8, 7, 7, (3, 2), 2, 1),
    (3, 5, 9, 11, 7, (1, 1), 1, 0),
    (8, 64, 4, 4, 96, (1, 1), 1, 0),
    (4, 8, 20, 20, 16, (1, 1), 1, 0),
    # k = c*kh*kw off a multiple of 8, columns rounded up with zero rows (ut__conv_col_rows):
    # a stem over planes of 8-aligned rows (vector im2col) with and without padding, a 1x3
    (2, 3, 16, 16, 16, (3, 3), 2, 1),
    (2, 3, 17, 17, 8, (3, 3), 2, 0),
    (2, 5, 10, 10, 4, (1, 3), 1, 0),
]


def _conv_nonfinite(name, cin, cout, k, s, p, hw):
    return Sample(dict(n=2, c=cin, o=cout, h=hw, w=hw, kh=k, kw=k, stride=s, pad=p),
                  {"nonfinite"}, name)


CONV2D = OpInfo(
    "conv2d",
    layer="Conv2d",
    defaults=dict(n=2, c=3, o=4, h=7, w=6, kh=3, kw=2, stride=2, pad=1, bias=True),
    shapes=_conv_shapes,
    sample_inputs=_xwb_inputs(_conv_shapes),
    reference=lambda a, k, g: R.conv2d(a["x"], a["w"], a.get("b"), g["stride"], g["pad"]),
    describe=lambda g: "x[%d,%d,%d,%d] k%dx%d s%d p%d o%d" % (
        g["n"], g["c"], g["h"], g["w"], g["kh"], g["kw"], g["stride"], g["pad"], g["o"]),
    make=_conv_make,
    geometry_of=lambda l: dict(c=l.in_channels, o=l.out_channels, kh=l.kernel_size[0],
                               kw=l.kernel_size[1], stride=l.stride, pad=l.padding,
                               bias=l.bias is not None),
    runner=lambda ut, g, k, dev: _layer_runner(ut, g, k, dev, _conv_make),
    grad=("x", "w", "b"),
    samples=(
        _conv_geoms([(2, 3, 4, 7, 6, 3, 2, 2, 1), (2, 2, 3, 5, 5, 2, 3, 1, 2)], {"selftest"})
        + _conv_geoms(_GRADCHECK_CONV, {"gradcheck"})
        + [Sample(dict(n=2, c=3, o=8, h=9, w=9, kh=3, kw=3, stride=2, pad=1), {"bf16"},
                  "conv3x3s2"),
           Sample(dict(n=2, c=8, o=16, h=9, w=9, kh=1, kw=1, stride=1, pad=0), {"bf16"},
                  "pointwise"),
           Sample(dict(n=2, c=2, o=3, h=5, w=5, kh=3, kw=3, stride=2, pad=1), {"copy"}, "Conv2d"),
           Sample(dict(n=2, c=2, o=3, h=4, w=4, kh=1, kw=2, stride=1, pad=0, bias=False),
                  {"copy"}, "Conv2d-nobias"),
           _conv_nonfinite("conv3x3_s1p1", 3, 4, 3, 1, 1, 6),
           _conv_nonfinite("conv3x3_s2p1", 3, 4, 3, 2, 1, 7),
           _conv_nonfinite("conv3x3_s1p0", 3, 4, 3, 1, 0, 6),
           _conv_nonfinite("conv1x1", 3, 5, 1, 1, 0, 5),
           _conv_nonfinite("conv1x1_s2", 3, 5, 1, 2, 0, 5),
           _conv_nonfinite("conv5x5_s1p2", 2, 3, 5, 1, 2, 6),
           # the parameter-only backward's paths: im2col and col2im, 1x1 as one GEMM over the
           # batch, 1x1 per image, strided 1x1
           Sample(dict(n=2, c=3, o=4, h=9, w=7, kh=3, kw=3, stride=2, pad=1), {"params_only"},
                  "3x3s2p1"),
           Sample(dict(n=3, c=4, o=5, h=4, w=4, kh=1, kw=1, stride=1, pad=0), {"params_only"},
                  "1x1-merged"),
           Sample(dict(n=1, c=4, o=5, h=16, w=16, kh=1, kw=1, stride=1, pad=0, bias=False),
                  {"params_only"}, "1x1"),
           Sample(dict(n=2, c=3, o=2, h=5, w=5, kh=1, kw=1, stride=2, pad=0), {"params_only"},
                  "1x1s2"),
           Sample(dict(n=2, c=3, o=5, h=9, w=8, kh=3, kw=2, stride=2, pad=1), {"cuda_vs_cpu"},
                  "conv2d s2 p1 3x2"),
           Sample(dict(n=3, c=4, o=6, h=5, w=5, kh=1, kw=1, stride=1, pad=0), {"cuda_vs_cpu"},
                  "conv2d 1x1")]
        + [Sample(dict(n=n, c=c, o=o, h=h, w=w, kh=kh, kw=kw, stride=s, pad=p), {"bf16_gemm"})
           for n, c, h, w, o, (kh, kw), s, p in _BF16_GEMM_CONV]),
    bf16=Bf16(kernel="gemm", needs_cublas=True),
    errors=[
        ErrorCase("Conv2d", lambda ut: ut.Conv2d(0, 2, 3), "ArgumentError", "in_channels"),
        ErrorCase("Conv2d", lambda ut: ut.Conv2d(2, 2, (1, 2, 3)), "ArgumentError",
                  "kernel_size must be an int or a pair"),
        ErrorCase("Conv2d", lambda ut: ut.Conv2d(2, 2, (0, 3)), "ArgumentError", "kernel_size"),
        ErrorCase("Conv2d", lambda ut: ut.Conv2d(2, 2, 3, stride=0), "ArgumentError", "stride"),
        ErrorCase("Conv2d", lambda ut: ut.Conv2d(2, 2, 3, padding=-1), "ArgumentError",
                  "padding"),
        ErrorCase("Conv2d", lambda ut: ut.Conv2d(2**31, 2, 3), "ArgumentError", "in_channels"),
        ErrorCase("Conv2d", lambda ut: ut.Conv2d(50000, 50000, 3), "ShapeError",
                  "at most 2147483647"),
        ErrorCase("Conv2d", lambda ut: ut.Conv2d("2", 2, 3), "ArgumentTypeError", "in_channels"),
        ErrorCase("Conv2d", lambda ut: ut.Conv2d(2, 2, 3, device="tpu"), "ArgumentError",
                  "unknown device 'tpu'"),
        ErrorCase("Conv2d.forward", lambda ut: ut.Conv2d(2, 2, 3)(_t(ut, 2, 5, 5)), "ShapeError",
                  "x must be [N, C, H, W]"),
        ErrorCase("Conv2d.forward", lambda ut: ut.Conv2d(2, 2, 3)(_t(ut, 1, 3, 5, 5)),
                  "ShapeError", "x has 3 channels, the layer expects 2"),
        ErrorCase("Conv2d.forward", lambda ut: ut.Conv2d(2, 2, 3)(_t(ut, 1, 2, 2, 5)),
                  "ShapeError", "smaller than the 3x3 kernel"),
        ErrorCase("Conv2d.forward", lambda ut: ut.Conv2d(2, 2, 3)(np.array([["a"]])),
                  "ArgumentTypeError", "x must hold real numbers"),
        ErrorCase("Conv2d.forward", lambda ut: ut.Conv2d(2, 2, 3)(), "TypeError",
                  "required positional argument"),
        ErrorCase("Conv2d.backward", lambda ut: ut.Conv2d(2, 2, 3).backward(_t(ut, 1, 2, 1, 1)),
                  "ArgumentError", "no forward pass"),
        ErrorCase("Conv2d.backward",
                  lambda ut: _fwd(ut.Conv2d(2, 2, 3), _t(ut, 1, 2, 3, 3)).backward(
                      _t(ut, 1, 2, 2, 2)), "ShapeError", "grad_out has shape [1, 2, 2, 2]"),
        ErrorCase("Conv2d.backward",
                  lambda ut: _fwd(ut.Conv2d(2, 2, 3).eval(), _t(ut, 1, 2, 3, 3)).backward(
                      _t(ut, 1, 2, 1, 1)), "ArgumentError", "no forward pass"),
        ErrorCase("Conv2d.weight",
                  lambda ut: setattr(ut.Conv2d(2, 2, 3), "weight", np.zeros((2, 2, 3))),
                  "ShapeError", "shape (2, 2, 3) into (2, 2, 3, 3)"),
        ErrorCase("Conv2d.weight", lambda ut: setattr(ut.Conv2d(2, 2, 3), "weight", "w"),
                  "ArgumentTypeError", "real numbers"),
        ErrorCase("Conv2d.bias",
                  lambda ut: setattr(ut.Conv2d(2, 2, 3, bias=False), "bias", np.zeros(2)),
                  "ArgumentError", "bias=False"),
        ErrorCase("Conv2d.bias", lambda ut: setattr(ut.Conv2d(2, 2, 3), "bias", np.zeros(3)),
                  "ShapeError", "shape (3,) into (2,)"),
        ErrorCase("Conv2d.to", lambda ut: ut.Conv2d(2, 2, 3).to("tpu"), "ArgumentError",
                  "unknown device 'tpu'"),
    ],
)


def _dw_make(ut, g, device):
    return ut.DWConv2d(g["c"], (g["kh"], g["kw"]), stride=g["stride"], padding=g["pad"],
                       bias=g["bias"], device=device, dilation=g["dilation"],
                       out_channels=g["c"] * g["mult"])


def _dw_shapes(g):
    o = g["c"] * g["mult"]
    return _without_bias({"x": (g["n"], g["c"], g["h"], g["w"]), "w": (o, g["kh"], g["kw"]),
                          "b": (o,)}, g)


def _dw_describe(g):
    """The dilation and the multiplier are named only where they are not 1."""
    desc = "x[%d,%d,%d,%d] k%dx%d s%d p%d" % (g["n"], g["c"], g["h"], g["w"], g["kh"], g["kw"],
                                              g["stride"], g["pad"])
    if g["dilation"] != 1 or g["mult"] != 1:
        desc += " d%d m%d" % (g["dilation"], g["mult"])
    return desc


def _dw_nonfinite(name, c, k, s, p, hw):
    return Sample(dict(n=2, c=c, h=hw, w=hw, kh=k, kw=k, stride=s, pad=p), {"nonfinite"}, name)


# depthwise with dilation and a channel multiplier:
# (N, C, mult, H, W, kh, kw, stride, pad, dilation)
_GRADCHECK_DW_DILATED = [
    (2, 2, 2, 7, 6, 3, 3, 1, 2, 2),  # "same" padding at dilation 2
    (2, 1, 3, 5, 9, 2, 3, 2, 1, 3),  # kh != kw, stride 2
    (2, 3, 1, 5, 5, 3, 3, 1, 1, 3),  # the window is the whole padded input: 1x1 output
    (2, 2, 3, 4, 5, 1, 1, 2, 0, 2),  # 1x1 kernel: the dilation changes nothing
    (1, 2, 2, 9, 7, 5, 3, 3, 3, 2),  # stride 3, padding 3
    (2, 1, 2, 5, 5, 7, 7, 1, 3, 1),  # 7x7, multiplier only
]

DWCONV2D = OpInfo(
    "dwconv2d",
    layer="DWConv2d",
    defaults=dict(n=2, c=3, h=7, w=6, kh=3, kw=2, stride=2, pad=1, dilation=1, mult=1,
                  bias=True),
    shapes=_dw_shapes,
    sample_inputs=_xwb_inputs(_dw_shapes),
    reference=lambda a, k, g: R.dwconv2d(a["x"], a["w"], a.get("b"), g["stride"], g["pad"],
                                         g["dilation"]),
    describe=_dw_describe,
    make=_dw_make,
    geometry_of=lambda l: dict(c=l.channels, mult=l.out_channels // l.channels,
                               kh=l.kernel_size[0], kw=l.kernel_size[1], stride=l.stride,
                               pad=l.padding, dilation=l.dilation, bias=l.bias is not None),
    runner=lambda ut, g, k, dev: _layer_runner(ut, g, k, dev, _dw_make),
    grad=("x", "w", "b"),
    samples=(
        [Sample(dict(n=2, c=3, h=7, w=6, kh=3, kw=2, stride=2, pad=1), {"selftest"}),
         Sample(dict(n=2, c=2, h=5, w=4, kh=3, kw=3, stride=1, pad=0), {"selftest"}),
         Sample(dict(n=2, c=2, h=8, w=7, kh=3, kw=2, stride=2, pad=2, dilation=3, mult=2),
                {"selftest"})]
        + [Sample(dict(n=n, c=c, h=h, w=w, kh=kh, kw=kw, stride=s, pad=p), {"gradcheck"})
           for n, c, o, h, w, kh, kw, s, p in _GRADCHECK_CONV]
        + [Sample(dict(n=n, c=c, h=h, w=w, kh=kh, kw=kw, stride=s, pad=p, dilation=d, mult=m),
                  {"gradcheck"})
           for n, c, m, h, w, kh, kw, s, p, d in _GRADCHECK_DW_DILATED]
        + [Sample(dict(n=2, c=8, h=9, w=9, kh=3, kw=3, stride=1, pad=1), {"bf16"}, "depthwise"),
           Sample(dict(n=2, c=8, h=9, w=9, kh=3, kw=3, stride=2, pad=1), {"bf16"},
                  "depthwise_s2"),
           Sample(dict(n=2, c=2, h=4, w=4, kh=3, kw=3, stride=1, pad=1), {"copy"}, "DWConv2d"),
           _dw_nonfinite("dw3x3_s1p1", 3, 3, 1, 1, 6),
           _dw_nonfinite("dw3x3_s2p1", 3, 3, 2, 1, 7),
           _dw_nonfinite("dw3x3_s1p0", 3, 3, 1, 0, 6),
           _dw_nonfinite("dw5x5_s1p2", 3, 5, 1, 2, 6),
           _dw_nonfinite("dw5x5_s2p2", 3, 5, 2, 2, 7),
           Sample(dict(n=2, c=4, h=11, w=7, kh=5, kw=3, stride=2, pad=2), {"cuda_vs_cpu"},
                  "dwconv2d s2 p2 5x3"),
           Sample(dict(n=2, c=3, h=11, w=9, kh=3, kw=5, stride=2, pad=3, dilation=2, mult=3),
                  {"cuda_vs_cpu"}, "dwconv2d d2 m3 s2 p3 3x5")]),
    bf16=Bf16(kernel="depthwise"),
    errors=[
        ErrorCase("DWConv2d", lambda ut: ut.DWConv2d(-3, 3), "ArgumentError", "channels"),
        ErrorCase("DWConv2d", lambda ut: ut.DWConv2d(3, (3, "3")), "ArgumentTypeError",
                  "kernel_size"),
        ErrorCase("DWConv2d.forward", lambda ut: ut.DWConv2d(3, 3)(_t(ut, 1, 2, 5, 5)),
                  "ShapeError", "x has 2 channels, the layer expects 3"),
        ErrorCase("DWConv2d.forward", lambda ut: ut.DWConv2d(3, 3, padding=1)(_t(ut, 1, 3, 5)),
                  "ShapeError", "x must be [N, C, H, W]"),
        ErrorCase("DWConv2d.backward", lambda ut: ut.DWConv2d(3, 3).backward(_t(ut, 1, 3, 1, 1)),
                  "ArgumentError", "no forward pass"),
        ErrorCase("DWConv2d.backward",
                  lambda ut: _fwd(ut.DWConv2d(1, 3), _t(ut, 1, 1, 3, 3)).backward(
                      _t(ut, 1, 1, 3, 3)), "ShapeError", "grad_out has shape [1, 1, 3, 3]"),
    ],
)


# -- normalization --------------------------------------------------------------------------------
def _bn_make(ut, g, device):
    return ut.BatchNorm2d(g["c"], eps=g["eps"], momentum=g["momentum"],
                          device=device).train(g["training"])


def _bn_reference(a, k, g):
    """Training mode: the batch statistics; eval mode: consts' running_mean and running_var."""
    if g["training"]:
        return R.batchnorm2d_train(a["x"], a["w"], a["b"], g["eps"])[0]
    return R.batchnorm2d_eval(a["x"], a["w"], a["b"], np.asarray(k["running_mean"], np.float64),
                              np.asarray(k["running_var"], np.float64), g["eps"])


def _bn_inputs(rng, g):
    n, c, h, w = g["n"], g["c"], g["h"], g["w"]
    inputs = {"x": _f32(rng, n, c, h, w, scale=2.0, shift=0.5), "w": _f32(rng, c, shift=1.0),
              "b": _f32(rng, c)}
    # a layer made at this geometry starts from running statistics 0 and 1
    return inputs, ({} if g["training"] else {"running_mean": np.zeros(c, np.float32),
                                               "running_var": np.ones(c, np.float32)})


BATCHNORM2D = OpInfo(
    "batchnorm2d",
    layer="BatchNorm2d",
    defaults=dict(n=2, c=3, h=3, w=4, eps=1e-5, momentum=0.1, training=True),
    shapes=lambda g: {"x": (g["n"], g["c"], g["h"], g["w"]), "w": (g["c"],), "b": (g["c"],)},
    sample_inputs=_bn_inputs,
    reference=_bn_reference,
    describe=lambda g: "%s x[%d,%d,%d,%d]" % ("train" if g["training"] else "eval", g["n"],
                                              g["c"], g["h"], g["w"]),
    make=_bn_make,
    geometry_of=lambda l: dict(c=l.num_features, eps=l.eps, momentum=l.momentum,
                               training=l.training),
    runner=lambda ut, g, k, dev: _layer_runner(ut, g, k, dev, _bn_make),
    grad=("x", "w", "b"),
    samples=[
        Sample(dict(n=2, c=3, h=3, w=4), {"selftest", "gradcheck"}),
        Sample(dict(n=3, c=2, h=1, w=1), {"gradcheck"}),
        Sample(dict(n=2, c=1, h=5, w=3), {"gradcheck"}),
        Sample(dict(n=2, c=8, h=9, w=9), {"bf16"}, "batchnorm"),
        Sample(dict(n=3, c=2, h=2, w=2, eps=1e-3, momentum=0.3), {"copy"}, "BatchNorm2d"),
        Sample(dict(n=3, c=2, h=2, w=2, training=False), {"copy"}, "BatchNorm2d-eval"),
        Sample(dict(n=2, c=3, h=4, w=5, eps=1e-5, momentum=0.1), {"nonfinite"}, "batchnorm_train"),
        Sample(dict(n=2, c=3, h=4, w=5, eps=1e-5, momentum=0.1, training=False), {"nonfinite"},
               "batchnorm_eval"),
        Sample(dict(n=3, c=4, h=5, w=7), {"cuda_vs_cpu"}, "batchnorm2d"),
    ],
    bf16=Bf16(kernel="norm"),
    errors=[
        ErrorCase("BatchNorm2d", lambda ut: ut.BatchNorm2d(2, momentum=2.0), "ArgumentError",
                  "momentum must be <= 1"),
        ErrorCase("BatchNorm2d", lambda ut: ut.BatchNorm2d(2, eps=float("nan")), "ArgumentError",
                  "eps must be a finite number"),
        ErrorCase("BatchNorm2d.forward", lambda ut: ut.BatchNorm2d(2)(_t(ut, 1, 2, 1, 1)),
                  "ShapeError", "more than one value per channel"),
        ErrorCase("BatchNorm2d.forward", lambda ut: ut.BatchNorm2d(2)(_t(ut, 4, 3, 2, 2)),
                  "ShapeError", "x must be [N, 2, H, W]"),
        ErrorCase("BatchNorm2d.running_mean",
                  lambda ut: setattr(ut.BatchNorm2d(2), "running_mean", np.zeros(3)),
                  "ShapeError", "shape (3,) into (2,)"),
        ErrorCase("BatchNorm2d.running_var",
                  lambda ut: setattr(ut.BatchNorm2d(2), "running_var", [[1, 1]]),
                  "ShapeError", "shape (1, 2) into (2,)"),
    ],
)


def _ln_make(ut, g, device):
    return ut.LayerNorm(g["shape"][-1], eps=g["eps"], device=device)


def _ln_inputs(rng, g):
    d = g["shape"][-1]
    return {"x": _f32(rng, *g["shape"], scale=2.0, shift=0.5), "w": _f32(rng, d, shift=1.0),
            "b": _f32(rng, d)}, {}


LAYERNORM = OpInfo(
    "layernorm",
    layer="LayerNorm",
    defaults=dict(shape=(3, 2, 7), eps=1e-5),
    shapes=lambda g: {"x": tuple(g["shape"]), "w": (g["shape"][-1],), "b": (g["shape"][-1],)},
    sample_inputs=_ln_inputs,
    reference=lambda a, k, g: R.layernorm(a["x"], a["w"], a["b"], g["eps"]),
    describe=lambda g: "x%s" % (list(g["shape"]),),
    make=_ln_make,
    geometry_of=lambda l: dict(shape=(1, l.dim), eps=l.eps),
    runner=lambda ut, g, k, dev: _layer_runner(ut, g, k, dev, _ln_make),
    grad=("x", "w", "b"),
    samples=[
        Sample(dict(shape=(3, 2, 7)), {"selftest"}),
        Sample(dict(shape=(3, 7)), {"gradcheck"}),
        Sample(dict(shape=(2, 3, 5)), {"gradcheck"}),
        # not D = 2: the output is then +-1 whatever x is, dx is ~eps/var (1e-5) and float32
        # cancellation dominates any normalized error
        Sample(dict(shape=(4, 3)), {"gradcheck"}),
        Sample(dict(shape=(3, 4), eps=1e-3), {"copy"}, "LayerNorm"),
        Sample(dict(shape=(3, 6)), {"nonfinite"}, "layernorm"),
        Sample(dict(shape=(3, 5, 7)), {"cuda_vs_cpu"}, "layernorm"),
        Sample(dict(shape=(4, 3, 40)), {"bf16"}, "layernorm"),
    ],
    bf16=Bf16(kernel="norm"),
    errors=[
        ErrorCase("LayerNorm", lambda ut: ut.LayerNorm(0), "ArgumentError", "normalized_shape"),
        ErrorCase("LayerNorm", lambda ut: ut.LayerNorm(4, eps=-1.0), "ArgumentError",
                  "eps must be >= 0"),
        ErrorCase("LayerNorm", lambda ut: ut.LayerNorm((2, 4)), "ArgumentError",
                  "last dimension only"),
        ErrorCase("LayerNorm.forward", lambda ut: ut.LayerNorm(4)(_t(ut, 2, 5)), "ShapeError",
                  "x must be [..., 4]"),
        ErrorCase("LayerNorm.backward", lambda ut: ut.LayerNorm(4).backward(_t(ut, 2, 4)),
                  "ArgumentError", "no forward pass"),
    ],
)


# -- dense ----------------------------------------------------------------------------------------
def _linear_make(ut, g, device):
    return ut.Linear(g["i"], g["o"], bias=g["bias"], device=device)


def _linear_shapes(g):
    return _without_bias({"x": (g["n"], g["i"]), "w": (g["o"], g["i"]), "b": (g["o"],)}, g)


LINEAR = OpInfo(
    "linear",
    layer="Linear",
    defaults=dict(n=3, i=5, o=4, bias=True),
    shapes=_linear_shapes,
    sample_inputs=_xwb_inputs(_linear_shapes),
    reference=lambda a, k, g: R.linear(a["x"], a["w"], a.get("b")),
    describe=lambda g: "x[%d,%d] o%d" % (g["n"], g["i"], g["o"]),
    make=_linear_make,
    geometry_of=lambda l: dict(i=l.in_features, o=l.out_features, bias=l.bias is not None),
    runner=lambda ut, g, k, dev: _layer_runner(ut, g, k, dev, _linear_make),
    grad=("x", "w", "b"),
    samples=[
        Sample(dict(n=3, i=5, o=4), {"selftest", "gradcheck", "nonfinite"}, "linear"),
        Sample(dict(n=1, i=1, o=3), {"gradcheck"}),
        Sample(dict(n=4, i=9, o=2), {"gradcheck"}),
        Sample(dict(n=5, i=4, o=3), {"copy"}, "Linear"),
        Sample(dict(n=9, i=33, o=17), {"cuda_vs_cpu"}, "linear"),
        # bf16 GEMMs on the GPU (N, I, O)
        Sample(dict(n=5, i=37, o=11), {"bf16_gemm"}),
        Sample(dict(n=64, i=256, o=130), {"bf16_gemm"}),
        Sample(dict(n=1, i=8, o=3), {"bf16_gemm"}),
        Sample(dict(n=33, i=1000, o=17), {"bf16_gemm"}),
    ],
    bf16=Bf16(kernel="gemm", needs_cublas=True),
    errors=[
        ErrorCase("Linear", lambda ut: ut.Linear(3, 0), "ArgumentError", "out_features"),
        ErrorCase("Linear", lambda ut: ut.Linear(3, 2, device=["cpu"]), "ArgumentTypeError",
                  "device must be a string"),
        ErrorCase("Linear.forward", lambda ut: ut.Linear(3, 2)(_t(ut, 2, 4)), "ShapeError",
                  "x must be [N, 3], got shape [2, 4]"),
        ErrorCase("Linear.forward", lambda ut: ut.Linear(3, 2)(_t(ut, 3)), "ShapeError",
                  "x must be [N, 3], got shape [3]"),
        ErrorCase("Linear.backward",
                  lambda ut: _fwd(ut.Linear(3, 2), _t(ut, 4, 3)).backward(_t(ut, 4, 3)),
                  "ShapeError", "grad_out must be [N, 2]"),
        ErrorCase("Linear.backward",
                  lambda ut: _fwd(ut.Linear(3, 2), _t(ut, 4, 3)).backward("g"),
                  "ArgumentTypeError", "grad_out must hold real numbers"),
    ],
)


# -- pooling and activations ----------------------------------------------------------------------
def _gap_runner(ut, g, k, dev):
    h, w = g["h"], g["w"]
    return _FnRunner(dev, ut.global_avg_pool2d,
                     lambda go, x: ut.global_avg_pool2d_backward(go, h, w))


GLOBAL_AVG_POOL2D = OpInfo(
    "global_avg_pool2d",
    layer="GlobalAvgPool2d",
    functions=("global_avg_pool2d", "global_avg_pool2d_backward"),
    defaults=dict(n=2, c=3, h=5, w=3),
    shapes=lambda g: {"x": (g["n"], g["c"], g["h"], g["w"])},
    sample_inputs=lambda rng, g: ({"x": _f32(rng, g["n"], g["c"], g["h"], g["w"])}, {}),
    reference=lambda a, k, g: R.global_avg_pool2d(a["x"]),
    describe=lambda g: "x[%d,%d,%d,%d]" % (g["n"], g["c"], g["h"], g["w"]),
    make=lambda ut, g, device: ut.GlobalAvgPool2d(),
    runner=_gap_runner,
    grad=("x",),
    samples=[
        Sample(dict(n=2, c=3, h=5, w=3), {"selftest", "gradcheck"}),
        Sample(dict(n=3, c=2, h=1, w=4), {"gradcheck"}),
        Sample(dict(n=2, c=8, h=9, w=9), {"bf16"}, "avgpool"),
        Sample(dict(n=2, c=3, h=2, w=2), {"copy"}, "GlobalAvgPool2d"),
        Sample(dict(n=2, c=3, h=4, w=5), {"nonfinite"}, "global_avg_pool"),
    ],
    bf16=Bf16(kernel="reduce"),
    errors=[
        ErrorCase("global_avg_pool2d", lambda ut: ut.global_avg_pool2d(_t(ut, 2, 3, 4)),
                  "ShapeError", "x must be [N, C, H, W]"),
        ErrorCase("global_avg_pool2d_backward",
                  lambda ut: ut.global_avg_pool2d_backward(_t(ut, 2, 3), 0, 2), "ArgumentError",
                  "h must be in"),
        ErrorCase("global_avg_pool2d_backward",
                  lambda ut: ut.global_avg_pool2d_backward(_t(ut, 2, 3, 1), 2, 2), "ShapeError",
                  "grad_out must be [N, C]"),
        ErrorCase("global_avg_pool2d_backward",
                  lambda ut: ut.global_avg_pool2d_backward(_t(ut, 2, 3), 2**20, 2**20),
                  "ShapeError", "more than 2147483647 elements"),
        ErrorCase("global_avg_pool2d_backward",
                  lambda ut: ut.global_avg_pool2d_backward(_t(ut, 2, 3), 2, 2.0),
                  "ArgumentTypeError", "w must be an integer"),
        ErrorCase("GlobalAvgPool2d.forward", lambda ut: ut.GlobalAvgPool2d()(_t(ut, 2, 2)),
                  "ShapeError", "x must be [N, C, H, W]"),
        ErrorCase("GlobalAvgPool2d.backward",
                  lambda ut: ut.GlobalAvgPool2d().backward(_t(ut, 2, 2)), "ArgumentError",
                  "no forward pass"),
        ErrorCase("GlobalAvgPool2d.backward",
                  lambda ut: _fwd(ut.GlobalAvgPool2d(), _t(ut, 1, 2, 3, 3)).backward(
                      _t(ut, 1, 3)), "ShapeError", "grad_out has shape (1, 3)"),
    ],
)


def _relu_inputs(rng, g):
    x = _away_from(_f32(rng, *g["shape"], scale=2.0), [0.0], 0.05)
    return {"x": x}, {}


RELU = OpInfo(
    "relu",
    layer="ReLU",
    functions=("relu", "relu_backward"),
    defaults=dict(shape=(2, 3, 4)),
    shapes=lambda g: {"x": tuple(g["shape"])},
    sample_inputs=_relu_inputs,
    reference=lambda a, k, g: R.relu(a["x"]),
    describe=lambda g: "x%s" % (list(g["shape"]),),
    make=lambda ut, g, device: ut.ReLU(),
    runner=lambda ut, g, k, dev: _FnRunner(dev, ut.relu, ut.relu_backward),
    grad=("x",),
    samples=[
        Sample(dict(shape=(2, 3, 4)), {"selftest", "gradcheck"}),
        Sample(dict(shape=(7,)), {"gradcheck"}),
        Sample(dict(shape=(3, 4)), {"copy"}, "ReLU"),
    ],
    bf16=Bf16(kernel="exact"),
    errors=[
        ErrorCase("relu", lambda ut: ut.relu("abc"), "ArgumentTypeError",
                  "x must hold real numbers"),
        ErrorCase("relu", lambda ut: ut.relu(None), "ArgumentTypeError",
                  "x must be a Tensor or an array"),
        ErrorCase("relu_backward", lambda ut: ut.relu_backward(_t(ut, 2), _t(ut, 3)),
                  "ShapeError", "grad_out has shape [2] but fwd_input has shape [3]"),
        ErrorCase("ReLU.backward", lambda ut: ut.ReLU().backward(_t(ut, 2)), "ArgumentError",
                  "no forward pass"),
        ErrorCase("ReLU.backward", lambda ut: _fwd(ut.ReLU(), _t(ut, 2)).backward(_t(ut, 3)),
                  "ShapeError", "grad_out has shape [3] but fwd_input has shape [2]"),
    ],
)


def _relu6_inputs(rng, g):
    x = rng.uniform(-2.0, 8.0, size=g["shape"]).astype(np.float32)
    return {"x": _away_from(x, [0.0, 6.0], 0.05)}, {}


RELU6 = OpInfo(
    "relu6",
    layer="ReLU6",
    functions=("relu6", "relu6_backward"),
    defaults=dict(shape=(2, 3, 4)),
    shapes=lambda g: {"x": tuple(g["shape"])},
    sample_inputs=_relu6_inputs,
    reference=lambda a, k, g: R.relu6(a["x"]),
    describe=lambda g: "x%s" % (list(g["shape"]),),
    make=lambda ut, g, device: ut.ReLU6(),
    runner=lambda ut, g, k, dev: _FnRunner(dev, ut.relu6, ut.relu6_backward),
    grad=("x",),
    samples=[
        Sample(dict(shape=(2, 3, 4)), {"selftest", "gradcheck"}),
        Sample(dict(shape=(3, 11)), {"gradcheck"}),
        Sample(dict(shape=(2, 8, 9, 9)), {"bf16"}, "relu6"),
        Sample(dict(shape=(3, 4)), {"copy"}, "ReLU6"),
    ],
    bf16=Bf16(kernel="exact"),
    errors=[
        ErrorCase("relu6", lambda ut: ut.relu6(np.zeros(0)), "ShapeError", "x.shape[0]"),
        ErrorCase("relu6_backward", lambda ut: ut.relu6_backward(_t(ut, 2, 3), _t(ut, 3, 2)),
                  "ShapeError", "grad_out has shape [2, 3] but fwd_input has shape [3, 2]"),
        ErrorCase("relu6_backward", lambda ut: ut.relu6_backward(_t(ut, 2), [object(), 1]),
                  "ArgumentTypeError", "must hold real numbers"),
        ErrorCase("ReLU6.backward",
                  lambda ut: _fwd(ut.ReLU6(), _t(ut, 2)).backward([[1, 2]]), "ShapeError",
                  "grad_out has shape [1, 2]"),
        ErrorCase("ReLU6.forward", lambda ut: ut.ReLU6()("x"), "ArgumentTypeError",
                  "x must hold real numbers"),
    ],
)


# -- issue 30's activations: one entry per layer (SiLU, Hardswish, Hardsigmoid, Sigmoid, GELU in
# both forms), built by one function; inputs span [-6, 6] (both kinks of the hard ones, moved
# 0.05 off them for the finite differences; tests/test_activations.py checks the kinks themselves)
def _activation_inputs(kinks):
    def draw(rng, g):
        x = rng.uniform(-6.0, 6.0, size=g["shape"]).astype(np.float32)
        return {"x": _away_from(x, kinks, 0.05)}, {}

    return draw


def _activation_op(name, layer, kinks=(), gelu=False):
    """The entry of ``ut.<name>`` / ``ut.<name>_backward`` and layer ``ut.<layer>``; GELU's
    geometry carries ``approximate`` (its layer's argument)."""
    ref, ref_name = getattr(R, name), name
    defaults = dict(shape=(2, 3, 4))
    if gelu:
        defaults["approximate"] = "none"

    def fns(ut, g):
        fwd, bwd = getattr(ut, name), getattr(ut, name + "_backward")
        if not gelu:
            return fwd, bwd
        a = g["approximate"]
        return (lambda x: fwd(x, a)), (lambda go, x: bwd(go, x, a))

    def make(ut, g, device):
        return getattr(ut, layer)(g["approximate"]) if gelu else getattr(ut, layer)()

    tag = name + "_tanh"  # GELU's tanh form's bf16 sample name (names are unique per use)
    samples = [
        Sample(dict(shape=(2, 3, 4)), {"selftest", "gradcheck"}),
        Sample(dict(shape=(7,)), {"gradcheck"}),
        Sample(dict(shape=(2, 8, 9, 9)), {"bf16"}, name),
        Sample(dict(shape=(3, 4)), {"copy"}, layer),
    ]
    if gelu:  # the tanh form as a second geometry of the one entry
        samples += [
            Sample(dict(shape=(2, 3, 4), approximate="tanh"), {"gradcheck"}),
            Sample(dict(shape=(5, 3), approximate="tanh"), {"selftest"}),
            Sample(dict(shape=(2, 8, 9, 9), approximate="tanh"), {"bf16"}, tag),
            Sample(dict(shape=(3, 4), approximate="tanh"), {"copy"}, layer + "-tanh"),
        ]
    fwd_fn, bwd_fn = name, name + "_backward"
    errors = [
        ErrorCase(fwd_fn, lambda ut: getattr(ut, fwd_fn)("abc"), "ArgumentTypeError",
                  "x must hold real numbers"),
        ErrorCase(fwd_fn, lambda ut: getattr(ut, fwd_fn)(None), "ArgumentTypeError",
                  "x must be a Tensor or an array"),
        ErrorCase(bwd_fn, lambda ut: getattr(ut, bwd_fn)(_t(ut, 2, 3), _t(ut, 3, 2)),
                  "ShapeError", "grad_out has shape [2, 3] but fwd_input has shape [3, 2]"),
        ErrorCase(bwd_fn, lambda ut: getattr(ut, bwd_fn)(_t(ut, 2), [object(), 1]),
                  "ArgumentTypeError", "must hold real numbers"),
        ErrorCase(layer + ".backward", lambda ut: make(ut, defaults, "cpu").backward(_t(ut, 2)),
                  "ArgumentError", "no forward pass"),
        ErrorCase(layer + ".backward",
                  lambda ut: _fwd(make(ut, defaults, "cpu"), _t(ut, 2)).backward(_t(ut, 3)),
                  "ShapeError", "grad_out has shape [3] but fwd_input has shape [2]"),
    ]
    if gelu:
        errors += [
            ErrorCase("gelu", lambda ut: ut.gelu(_t(ut, 2), "erf"), "ArgumentError",
                      "approximate must be one of 'none', 'tanh'"),
            ErrorCase("gelu_backward", lambda ut: ut.gelu_backward(_t(ut, 2), _t(ut, 2), None),
                      "ArgumentTypeError", "approximate must be a string"),
            ErrorCase("GELU", lambda ut: ut.GELU(approximate="exact"), "ArgumentError",
                      "approximate must be one of 'none', 'tanh'"),
        ]
    elif layer != "Sigmoid":  # torch.nn.Sigmoid takes no inplace
        errors.append(ErrorCase(layer, lambda ut: getattr(ut, layer)(inplace="yes"),
                                "ArgumentTypeError", "inplace must be True or False"))
    return OpInfo(
        ref_name,
        layer=layer,
        functions=(fwd_fn, bwd_fn),
        defaults=defaults,
        shapes=lambda g: {"x": tuple(g["shape"])},
        sample_inputs=_activation_inputs(list(kinks)),
        reference=(lambda a, k, g: ref(a["x"], g["approximate"])) if gelu
        else (lambda a, k, g: ref(a["x"])),
        describe=(lambda g: "x%s %s" % (list(g["shape"]), g["approximate"])) if gelu
        else (lambda g: "x%s" % (list(g["shape"]),)),
        make=make,
        geometry_of=(lambda layer_: {"approximate": layer_.approximate}) if gelu else None,
        runner=lambda ut, g, k, dev: _FnRunner(dev, *fns(ut, g)),
        grad=("x",),
        samples=samples,
        bf16=Bf16(kernel="exact"),
        errors=errors,
    )


SILU = _activation_op("silu", "SiLU")
HARDSWISH = _activation_op("hardswish", "Hardswish", kinks=(-3.0, 3.0))
HARDSIGMOID = _activation_op("hardsigmoid", "Hardsigmoid", kinks=(-3.0, 3.0))
SIGMOID = _activation_op("sigmoid", "Sigmoid")
GELU = _activation_op("gelu", "GELU", gelu=True)
ACTIVATIONS = [SILU, HARDSWISH, HARDSIGMOID, SIGMOID, GELU]


# -- losses: the forward is a [1] array; the check chains d loss / d input with the upstream scalar
def _ce_runner(ut, g, k, dev):
    labels, eps = k["labels"], g.get("eps", 0.0)  # eps: label smoothing (issue 30)

    def bwd(go, z):
        d = ut.cross_entropy_backward(z, labels, label_smoothing=eps)
        return d.mul_(float(go.numpy().reshape(-1)[0]))

    return _FnRunner(dev, lambda z: ut.cross_entropy(z, labels, label_smoothing=eps), bwd)


def _ce_inputs(rng, g):
    labels = rng.integers(0, g["k"], size=g["n"])
    return {"x": _f32(rng, g["n"], g["k"], scale=2.0)}, {"labels": labels}


SOFTMAX_CROSS_ENTROPY = OpInfo(
    "softmax_cross_entropy",
    layer="CrossEntropyLoss",
    functions=("cross_entropy", "cross_entropy_backward"),
    defaults=dict(n=4, k=5, eps=0.0),
    shapes=lambda g: {"x": (g["n"], g["k"])},
    sample_inputs=_ce_inputs,
    reference=lambda a, k, g: R.cross_entropy(a["x"], k["labels"], g["eps"]),
    describe=lambda g: "logits[%d,%d]%s" % (g["n"], g["k"],
                                            " smoothing %g" % g["eps"] if g["eps"] else ""),
    make=lambda ut, g, device: ut.CrossEntropyLoss(label_smoothing=g["eps"]),
    geometry_of=lambda l: dict(eps=l.label_smoothing),
    runner=_ce_runner,
    grad=("x",),
    samples=[
        Sample(dict(n=4, k=5), {"selftest", "gradcheck", "nonfinite"}, "cross_entropy"),
        Sample(dict(n=1, k=2), {"gradcheck"}),
        Sample(dict(n=6, k=3), {"gradcheck"}),
        # issue 30: label smoothing (PyTorch's (1 - eps) onehot + eps / K target)
        Sample(dict(n=4, k=5, eps=0.1), {"selftest", "gradcheck"}, "cross_entropy_smoothed"),
        Sample(dict(n=3, k=7, eps=0.6), {"gradcheck"}),
    ],
    # bf16 logits: float32 math, a float32 loss, a bf16 gradient (the float32 one rounded)
    bf16=Bf16(kernel="exact", out="float32"),
    errors=[
        ErrorCase("cross_entropy", lambda ut: ut.cross_entropy(_t(ut, 2, 3), np.array([0.0, 1.0])),
                  "ArgumentTypeError", "labels must be integer class indices"),
        ErrorCase("cross_entropy", lambda ut: ut.cross_entropy(_t(ut, 2, 3), np.array([0, 3])),
                  "ArgumentError", "labels[1] = 3 is not a class index in [0, 3)"),
        ErrorCase("cross_entropy", lambda ut: ut.cross_entropy(_t(ut, 2, 3), np.array([-1, 0])),
                  "ArgumentError", "labels[0] = -1 is not a class index"),
        ErrorCase("cross_entropy",
                  lambda ut: ut.cross_entropy(_t(ut, 2, 3), np.array([0, 1, 2])), "ShapeError",
                  "labels must be [N] = [2]"),
        ErrorCase("cross_entropy",
                  lambda ut: ut.cross_entropy(_t(ut, 2, 3), np.array([[0, 1]])), "ShapeError",
                  "labels must be [N] = [2]"),
        ErrorCase("cross_entropy", lambda ut: ut.cross_entropy(_t(ut, 6), np.array([0])),
                  "ShapeError", "logits must be [N, K]"),
        ErrorCase("cross_entropy", lambda ut: ut.cross_entropy(_t(ut, 2, 3), "01"),
                  "ArgumentTypeError", "labels must be integer class indices"),
        ErrorCase("cross_entropy",  # refused by C
                  lambda ut: ut.cross_entropy(_t(ut, 2, 3), ut.tensor([0.0, 2.5])),
                  "ArgumentError", "labels[1] = 2.5 is not a class index"),
        ErrorCase("cross_entropy",
                  lambda ut: ut.cross_entropy(_t(ut, 2, 3), ut.tensor([0.0, float("nan")])),
                  "ArgumentError", "labels[1] = nan is not a class index"),
        ErrorCase("cross_entropy",
                  lambda ut: ut.cross_entropy(_t(ut, 2, 3), ut.tensor([0.0, 3.0])),
                  "ArgumentError", "labels[1] = 3 is not a class index"),
        ErrorCase("cross_entropy",
                  lambda ut: ut.cross_entropy(_t(ut, 2, 3), ut.tensor([0.0, 1.0, 2.0])),
                  "ShapeError", "labels must be [N] = [2]"),
        ErrorCase("cross_entropy_backward",
                  lambda ut: ut.cross_entropy_backward(_t(ut, 2, 3), np.array([5, 0])),
                  "ArgumentError", "labels[0] = 5 is not a class index"),
        ErrorCase("cross_entropy_backward",
                  lambda ut: ut.cross_entropy_backward(_t(ut, 2, 3), ut.tensor([-1.0, 0.0])),
                  "ArgumentError", "labels[0] = -1 is not a class index"),
        ErrorCase("CrossEntropyLoss",
                  lambda ut: ut.CrossEntropyLoss()(_t(ut, 2, 3), [0.5, 1]),
                  "ArgumentTypeError", "labels must be integer class indices"),
        ErrorCase("CrossEntropyLoss.backward", lambda ut: ut.CrossEntropyLoss().backward(),
                  "ArgumentError", "call the loss first"),
        ErrorCase("CrossEntropyLoss", lambda ut: ut.CrossEntropyLoss(label_smoothing=1.5),
                  "ArgumentError", "label_smoothing must be between 0.0 and 1.0. Got: 1.5"),
        ErrorCase("cross_entropy",
                  lambda ut: ut.cross_entropy(_t(ut, 2, 3), np.array([0, 1]), label_smoothing=-1),
                  "ArgumentError", "label_smoothing must be between 0.0 and 1.0"),
    ],
)


def _mse_runner(ut, g, k, dev):
    target = k["target"]

    def bwd(go, p):  # the loss backward is d loss / d pred; chain with the upstream scalar
        d = ut.mse_loss_backward(p, target)
        return d.mul_(float(go.numpy().reshape(-1)[0]))

    return _FnRunner(dev, lambda p: ut.mse_loss(p, target), bwd)


def _mse_inputs(rng, g):
    target = _f32(rng, *g["shape"])
    return {"x": _f32(rng, *g["shape"])}, {"target": target}


MSE_LOSS = OpInfo(
    "mse_loss",
    layer="MSELoss",
    functions=("mse_loss", "mse_loss_backward"),
    defaults=dict(shape=(3, 5)),
    shapes=lambda g: {"x": tuple(g["shape"])},
    sample_inputs=_mse_inputs,
    reference=lambda a, k, g: R.mse_loss(a["x"], np.asarray(k["target"], np.float64)),
    describe=lambda g: "pred%s" % (list(g["shape"]),),
    make=lambda ut, g, device: ut.MSELoss(),
    runner=_mse_runner,
    grad=("x",),
    samples=[
        Sample(dict(shape=(3, 5)), {"selftest", "gradcheck"}),
        Sample(dict(shape=(2, 2, 3)), {"gradcheck"}),
        Sample(dict(shape=(3, 4)), {"nonfinite"}, "mse_loss"),
    ],
    bf16=_F32_ONLY,
    errors=[
        ErrorCase("mse_loss", lambda ut: ut.mse_loss(_t(ut, 2, 3), _t(ut, 3, 2)), "ShapeError",
                  "pred has shape [2, 3] but target has shape [3, 2]"),
        ErrorCase("mse_loss", lambda ut: ut.mse_loss(_t(ut, 2), None), "ArgumentTypeError",
                  "target must be a Tensor or an array"),
        ErrorCase("mse_loss_backward", lambda ut: ut.mse_loss_backward(_t(ut, 4), _t(ut, 5)),
                  "ShapeError", "pred has shape [4] but target has shape [5]"),
        ErrorCase("MSELoss", lambda ut: ut.MSELoss()(_t(ut, 2), _t(ut, 3)), "ShapeError",
                  "pred has shape [2] but target has shape [3]"),
        ErrorCase("MSELoss.backward", lambda ut: ut.MSELoss().backward(), "ArgumentError",
                  "call the loss first"),
    ],
)


# -- ops without a backward: matrix product, transpose, in-place arithmetic, optimizer steps -----
MATMUL = OpInfo(
    "matmul",
    functions=("matmul",),
    defaults=dict(m=3, k=5, n=4),
    shapes=lambda g: {"a": (g["m"], g["k"]), "b": (g["k"], g["n"])},
    sample_inputs=lambda rng, g: ({"a": _f32(rng, g["m"], g["k"]),
                                   "b": _f32(rng, g["k"], g["n"])}, {}),
    reference=lambda a, k, g: R.matmul(a["a"], a["b"]),
    describe=lambda g: "a[%d,%d] b[%d,%d]" % (g["m"], g["k"], g["k"], g["n"]),
    runner=lambda ut, g, k, dev: _CallRunner(dev, lambda t: ut.matmul(t["a"], t["b"])),
    samples=[
        Sample(dict(m=3, k=5, n=4), {"nonfinite"}, "matmul_small"),
        Sample(dict(m=67, k=131, n=45), {"nonfinite"}, "matmul_big"),
    ],
    bf16=Bf16(False, refused=_F32_ONLY.refused, operands=("a", "b")),
    errors=[
        ErrorCase("matmul", lambda ut: ut.matmul(_t(ut, 2, 3), _t(ut, 2, 3)), "ShapeError",
                  "cannot multiply a [2, 3] by b [2, 3]"),
        ErrorCase("matmul", lambda ut: ut.matmul(_t(ut, 2, 3, 1), _t(ut, 3, 1)), "ShapeError",
                  "cannot multiply a [2, 3, 1] by b [3, 1]"),
        ErrorCase("matmul", lambda ut: ut.matmul(_t(ut, 2, 3), "x"), "ArgumentTypeError",
                  "b must hold real numbers"),
    ],
)

TRANSPOSE = OpInfo(
    "transpose",
    functions=("transpose",),
    defaults=dict(shape=(2, 3, 4), d0=0, d1=2),
    shapes=lambda g: {"x": tuple(g["shape"])},
    sample_inputs=lambda rng, g: ({"x": _f32(rng, *g["shape"])}, {}),
    reference=lambda a, k, g: R.transpose(a["x"], g["d0"], g["d1"]),
    describe=lambda g: "x%s d%d,%d" % (list(g["shape"]), g["d0"], g["d1"]),
    runner=lambda ut, g, k, dev: _CallRunner(dev, lambda t: ut.transpose(t["x"], g["d0"],
                                                                         g["d1"])),
    samples=[Sample(dict(shape=(2, 3, 4, 5), d0=1, d1=-1), {"reference"})],
    bf16=Bf16(kernel="exact"),
    errors=[
        ErrorCase("transpose", lambda ut: ut.transpose(_t(ut, 2, 3), 0, 7), "ArgumentError",
                  "d1 must be in [-2, 1]"),
        ErrorCase("transpose", lambda ut: ut.transpose(_t(ut, 2, 3), 0, 2**40), "ArgumentError",
                  "d1 must be in [-2, 1]"),
    ],
)

ADD = OpInfo(
    "add",
    functions=("add", "functional.add_"),
    defaults=dict(shape=(2, 3, 4)),
    shapes=lambda g: {"a": tuple(g["shape"]), "b": tuple(g["shape"])},
    sample_inputs=lambda rng, g: ({"a": _f32(rng, *g["shape"]), "b": _f32(rng, *g["shape"])}, {}),
    reference=lambda a, k, g: R.add(a["a"], a["b"]),
    describe=lambda g: "a%s" % (list(g["shape"]),),
    runner=lambda ut, g, k, dev: _CallRunner(dev, lambda t: ut.add(t["a"], t["b"])),
    samples=[Sample(dict(shape=(2, 3, 5)), {"reference"})],
    bf16=Bf16(kernel="exact", operands=("a", "b")),
    errors=[
        ErrorCase("functional.add_", lambda ut: ut.functional.add_(np.zeros(2), _t(ut, 2)),
                  "ArgumentTypeError", "dst must be a Tensor"),
        ErrorCase("functional.add_", lambda ut: ut.functional.add_(_t(ut, 2), _t(ut, 3)),
                  "ShapeError", "src must have 2 elements, got 3"),
        ErrorCase("add", lambda ut: ut.add(_t(ut, 2, 3), _t(ut, 3, 2)), "ShapeError",
                  "a has shape [2, 3] but b has shape [3, 2]"),
        ErrorCase("add", lambda ut: ut.add(_t(ut, 2), "x"), "ArgumentTypeError",
                  "b must hold real numbers"),
    ],
)

SCALE = OpInfo(
    "scale_",
    functions=("functional.scale_",),
    defaults=dict(shape=(2, 3, 4), alpha=-2.5),
    shapes=lambda g: {"x": tuple(g["shape"])},
    sample_inputs=lambda rng, g: ({"x": _f32(rng, *g["shape"])}, {}),
    reference=lambda a, k, g: R.scale(a["x"], g["alpha"]),
    describe=lambda g: "x%s alpha %g" % (list(g["shape"]), g["alpha"]),
    runner=lambda ut, g, k, dev: _CallRunner(dev, lambda t: ut.functional.scale_(t["x"],
                                                                                 g["alpha"])),
    samples=[Sample(dict(shape=(3, 7)), {"reference"})],
    bf16=Bf16(kernel="exact"),
    errors=[
        ErrorCase("functional.scale_", lambda ut: ut.functional.scale_([1.0], 2.0),
                  "ArgumentTypeError", "t must be a Tensor"),
        ErrorCase("functional.scale_", lambda ut: ut.functional.scale_(_t(ut, 1), "2"),
                  "ArgumentTypeError", "alpha must be a number"),
    ],
)

BIAS_ADD = OpInfo(
    "bias_add_",
    functions=("functional.bias_add_",),
    defaults=dict(shape=(2, 3, 4)),
    shapes=lambda g: {"x": tuple(g["shape"]), "b": (g["shape"][1],)},
    sample_inputs=lambda rng, g: ({"x": _f32(rng, *g["shape"]), "b": _f32(rng, g["shape"][1])},
                                  {}),
    reference=lambda a, k, g: R.bias_add(a["x"], a["b"]),
    describe=lambda g: "x%s" % (list(g["shape"]),),
    runner=lambda ut, g, k, dev: _CallRunner(dev, lambda t: ut.functional.bias_add_(t["x"],
                                                                                    t["b"])),
    samples=[Sample(dict(shape=(2, 3, 4, 5)), {"reference"}),
             Sample(dict(shape=(5, 11)), {"reference"})],
    bf16=Bf16(kernel="exact"),  # the bias stays float32
    errors=[
        ErrorCase("functional.bias_add_",
                  lambda ut: ut.functional.bias_add_(_t(ut, 2, 3, 4), _t(ut, 4)), "ShapeError",
                  "bias must have 3 elements, got 4"),
        ErrorCase("functional.bias_add_", lambda ut: ut.functional.bias_add_(_t(ut, 3), _t(ut, 3)),
                  "ShapeError", "x must be [N, C, ...]"),
        ErrorCase("functional.bias_add_", lambda ut: ut.functional.bias_add_(3, _t(ut, 3)),
                  "ArgumentTypeError", "x must be a Tensor"),
    ],
)


def _sgd_call(ut, g):
    def call(t):
        v = t.get("v")
        ut.sgd_step(t["p"], t["g"], v, g["lr"], g["momentum"] if v is not None else 0.0)
        return t["p"]

    return call


SGD_STEP = OpInfo(
    "sgd_step",
    functions=("sgd_step",),
    defaults=dict(shape=(4, 5), lr=0.1, momentum=0.9),
    shapes=lambda g: {"p": tuple(g["shape"]), "g": tuple(g["shape"]), "v": tuple(g["shape"])},
    sample_inputs=lambda rng, g: ({k: _f32(rng, *g["shape"]) for k in ("p", "g", "v")}, {}),
    reference=lambda a, k, g: R.sgd_step(a["p"], a["g"], a.get("v"), g["lr"], g["momentum"])[0],
    describe=lambda g: "p%s lr %g momentum %g" % (list(g["shape"]), g["lr"], g["momentum"]),
    runner=lambda ut, g, k, dev: _CallRunner(dev, _sgd_call(ut, g)),
    samples=[Sample(dict(shape=(4, 5)), {"reference"})],
    bf16=Bf16(False, refused=_F32_ONLY.refused, operands=("p",)),  # float32 master weights
    errors=[
        ErrorCase("sgd_step", lambda ut: ut.sgd_step(_t(ut, 3), _t(ut, 3), None, lr=-1.0),
                  "ArgumentError", "lr must be >= 0"),
        ErrorCase("sgd_step", lambda ut: ut.sgd_step(_t(ut, 3), _t(ut, 3), None, lr=float("nan")),
                  "ArgumentError", "lr must be a finite number"),
        ErrorCase("sgd_step", lambda ut: ut.sgd_step(_t(ut, 3), _t(ut, 3), None, lr=float("inf")),
                  "ArgumentError", "lr must be a finite number"),
        ErrorCase("sgd_step", lambda ut: ut.sgd_step(_t(ut, 3), _t(ut, 4)), "ShapeError",
                  "grad must have 3 elements, got 4"),
        ErrorCase("sgd_step",
                  lambda ut: ut.sgd_step(_t(ut, 3), _t(ut, 3), _t(ut, 2), momentum=0.9),
                  "ShapeError", "velocity must have 3 elements, got 2"),
        ErrorCase("sgd_step", lambda ut: ut.sgd_step(np.zeros(3), _t(ut, 3)),
                  "ArgumentTypeError", "param must be a Tensor"),
        ErrorCase("sgd_step", lambda ut: ut.sgd_step(_t(ut, 3), _t(ut, 3), np.zeros(3)),
                  "ArgumentTypeError", "velocity must be a Tensor or None"),
        ErrorCase("sgd_step", lambda ut: ut.sgd_step(_t(ut, 3), _t(ut, 3), momentum=-0.5),
                  "ArgumentError", "momentum must be >= 0"),
    ],
)


def _adam_call(ut, g):
    def call(t):
        ut.adam_step(t["p"], t["g"], t["m"], t["v"], g["step"], g["lr"], g["beta1"], g["beta2"],
                     g["eps"])
        return t["p"]

    return call


def _adam_inputs(rng, g):
    p, grad, m = (_f32(rng, *g["shape"]) for _ in range(3))
    return {"p": p, "g": grad, "m": m, "v": np.abs(_f32(rng, *g["shape"]))}, {}


ADAM_STEP = OpInfo(
    "adam_step",
    functions=("adam_step",),
    defaults=dict(shape=(3, 7), step=3, lr=0.01, beta1=0.9, beta2=0.999, eps=1e-8),
    shapes=lambda g: {k: tuple(g["shape"]) for k in ("p", "g", "m", "v")},
    sample_inputs=_adam_inputs,
    reference=lambda a, k, g: R.adam_step(a["p"], a["g"], a["m"], a["v"], g["step"], g["lr"],
                                          g["beta1"], g["beta2"], g["eps"])[0],
    describe=lambda g: "p%s step %d" % (list(g["shape"]), g["step"]),
    runner=lambda ut, g, k, dev: _CallRunner(dev, _adam_call(ut, g)),
    samples=[Sample(dict(shape=(3, 7)), {"reference"})],
    bf16=Bf16(False, refused=_F32_ONLY.refused, operands=("p",)),  # float32 master weights
    errors=[
        ErrorCase("adam_step",
                  lambda ut: ut.adam_step(_t(ut, 3), _t(ut, 3), _t(ut, 3), _t(ut, 3), 0),
                  "ArgumentError", "step must be in [1, 2147483647]"),
        ErrorCase("adam_step",
                  lambda ut: ut.adam_step(_t(ut, 3), _t(ut, 3), _t(ut, 3), _t(ut, 3), 2**31),
                  "ArgumentError", "step must be in [1, 2147483647]"),
        ErrorCase("adam_step",
                  lambda ut: ut.adam_step(_t(ut, 3), _t(ut, 3), _t(ut, 3), _t(ut, 3), 1.0),
                  "ArgumentTypeError", "step must be an integer"),
        ErrorCase("adam_step",
                  lambda ut: ut.adam_step(_t(ut, 3), _t(ut, 3), _t(ut, 3), _t(ut, 3), 1, beta1=1.0),
                  "ArgumentError", "beta1 must be < 1"),
        ErrorCase("adam_step",
                  lambda ut: ut.adam_step(_t(ut, 3), _t(ut, 3), _t(ut, 3), _t(ut, 3), 1,
                                          beta2=-0.1),
                  "ArgumentError", "beta2 must be >= 0"),
        ErrorCase("adam_step",
                  lambda ut: ut.adam_step(_t(ut, 3), _t(ut, 3), _t(ut, 3), _t(ut, 3), 1, eps=-1),
                  "ArgumentError", "eps must be >= 0"),
        ErrorCase("adam_step",
                  lambda ut: ut.adam_step(_t(ut, 3), _t(ut, 3), _t(ut, 2), _t(ut, 3), 1),
                  "ShapeError", "m must have 3 elements, got 2"),
        ErrorCase("adam_step",
                  lambda ut: ut.adam_step(_t(ut, 3), _t(ut, 3), np.zeros(3), _t(ut, 3), 1),
                  "ArgumentTypeError", "m must be a Tensor"),
    ],
)


# -- squeeze-and-excitation and ConvNeXt (issue 30) -----------------------------------------------
class _ScaleRunner:
    """channel_scale and layer_scale: two operands, x and a scale (``names``); ``fwd(x, s)`` ->
    y, ``bwd(go, x, s)`` -> {name: gradient Tensor}."""

    def __init__(self, device, names, fwd, bwd):
        self.device, self.names, self.fwd, self.bwd = device, names, fwd, bwd

    def _tensors(self, inputs, dtype=None):
        import utensil_ffi as ut

        return [ut.tensor(inputs[k], self.device, _dtype_of(dtype, k)) for k in self.names]

    def forward(self, inputs, dtype=None):
        ts = self._tensors(inputs, dtype)
        try:
            with self.fwd(*ts) as y:
                return y.numpy().astype(np.float64)
        finally:
            for t in ts:
                t.close()

    def backward(self, inputs, go):
        import utensil_ffi as ut

        ts = self._tensors(inputs)
        try:
            with self.fwd(*ts) as y, ut.tensor(go, self.device) as g:
                out = y.numpy().astype(np.float64)
                grads = self.bwd(g, *ts)
            try:
                return out, {k: t.numpy().astype(np.float64) for k, t in grads.items()}
            finally:
                for t in grads.values():
                    t.close()
        finally:
            for t in ts:
                t.close()

    def close(self):
        pass


def _channel_scale_bwd(ut, g, x, s):
    dx, ds = ut.channel_scale_backward(g, x, s)
    return {"x": dx, "s": ds}


def _layer_scale_bwd(ut, g, x, gamma):
    dgamma = ut.zeros(gamma.shape, gamma.device)
    return {"x": ut.layer_scale_backward(g, x, gamma, dgamma), "gamma": dgamma}


def _nchw(g):
    return (g["n"], g["c"], g["h"], g["w"])


CHANNEL_SCALE = OpInfo(
    "channel_scale",
    functions=("channel_scale", "channel_scale_backward"),
    defaults=dict(n=2, c=3, h=4, w=5),
    shapes=lambda g: {"x": _nchw(g), "s": (g["n"], g["c"], 1, 1)},
    sample_inputs=lambda rng, g: ({"x": _f32(rng, *_nchw(g)),
                                   "s": _f32(rng, g["n"], g["c"], 1, 1)}, {}),
    reference=lambda a, k, g: R.channel_scale(a["x"], a["s"]),
    describe=lambda g: "x[%d,%d,%d,%d]" % _nchw(g),
    runner=lambda ut, g, k, dev: _ScaleRunner(dev, ("x", "s"), ut.channel_scale,
                                              lambda go, x, s: _channel_scale_bwd(ut, go, x, s)),
    grad=("x", "s"),
    samples=[
        Sample(dict(n=2, c=3, h=4, w=5), {"selftest", "gradcheck"}),
        Sample(dict(n=1, c=5, h=1, w=1), {"gradcheck"}),
        Sample(dict(n=3, c=2, h=7, w=3), {"gradcheck"}),
        Sample(dict(n=4, c=33, h=9, w=9), {"reference"}),
    ],
    bf16=Bf16(kernel="exact", operands=("x", "s")),  # s is an activation: x's dtype
    errors=[
        ErrorCase("channel_scale", lambda ut: ut.channel_scale(_t(ut, 2, 3, 4, 4), _t(ut, 3)),
                  "ShapeError", "s must be [2, 3] or [2, 3, 1, ..., 1]"),
        ErrorCase("channel_scale", lambda ut: ut.channel_scale(_t(ut, 2, 3, 4, 4),
                                                               _t(ut, 2, 3, 2, 1)),
                  "ShapeError", "got shape [2, 3, 2, 1]"),
        ErrorCase("channel_scale", lambda ut: ut.channel_scale(_t(ut, 6), _t(ut, 6)),
                  "ShapeError", "x must be [N, C, ...]"),
        ErrorCase("channel_scale",
                  lambda ut: ut.channel_scale(_t(ut, 2, 3, 4, 4),
                                              ut.zeros((2, 3), dtype=ut.bfloat16)),
                  "ArgumentError", "s is bfloat16 but x is float32"),
        ErrorCase("channel_scale_backward",
                  lambda ut: ut.channel_scale_backward(_t(ut, 2, 3, 4, 5), _t(ut, 2, 3, 4, 4),
                                                       _t(ut, 2, 3)),
                  "ShapeError", "grad_out has shape [2, 3, 4, 5] but x has shape [2, 3, 4, 4]"),
        ErrorCase("channel_scale_backward",
                  lambda ut: ut.channel_scale_backward(_t(ut, 2, 3, 4, 4), _t(ut, 2, 3, 4, 4),
                                                       _t(ut, 3, 2)),
                  "ShapeError", "s must be [2, 3]"),
        ErrorCase("SqueezeExcitation", lambda ut: ut.SqueezeExcitation(0, 2, ut.ReLU, ut.ReLU6),
                  "ArgumentError", "input_channels"),
        ErrorCase("SqueezeExcitation", lambda ut: ut.SqueezeExcitation(4, 2, 3, ut.ReLU6),
                  "ArgumentTypeError", "activation must be a Module class"),
        ErrorCase("SqueezeExcitation.forward",
                  lambda ut: ut.SqueezeExcitation(4, 2, ut.ReLU, ut.ReLU6)(_t(ut, 2, 3, 4, 4)),
                  "ShapeError", "x has 3 channels, the layer expects 4"),
        ErrorCase("SqueezeExcitation.backward",
                  lambda ut: ut.SqueezeExcitation(4, 2, ut.ReLU, ut.ReLU6).backward(
                      _t(ut, 2, 4, 3, 3)), "ArgumentError", "no forward pass"),
    ],
)

LAYER_SCALE = OpInfo(
    "layer_scale",
    functions=("layer_scale", "layer_scale_backward"),
    defaults=dict(n=2, c=3, h=4, w=5),
    shapes=lambda g: {"x": _nchw(g), "gamma": (g["c"], 1, 1)},
    sample_inputs=lambda rng, g: ({"x": _f32(rng, *_nchw(g)),
                                   "gamma": _f32(rng, g["c"], 1, 1)}, {}),
    reference=lambda a, k, g: R.layer_scale(a["x"], a["gamma"]),
    describe=lambda g: "x[%d,%d,%d,%d]" % _nchw(g),
    runner=lambda ut, g, k, dev: _ScaleRunner(dev, ("x", "gamma"), ut.layer_scale,
                                              lambda go, x, s: _layer_scale_bwd(ut, go, x, s)),
    grad=("x", "gamma"),
    samples=[
        Sample(dict(n=2, c=3, h=4, w=5), {"selftest", "gradcheck"}),
        Sample(dict(n=3, c=4, h=1, w=2), {"gradcheck"}),
        Sample(dict(n=1, c=2, h=5, w=5), {"gradcheck"}),
        Sample(dict(n=4, c=33, h=9, w=9), {"reference"}),
    ],
    bf16=Bf16(kernel="exact"),  # gamma is a parameter: float32
    errors=[
        ErrorCase("layer_scale", lambda ut: ut.layer_scale(_t(ut, 2, 3, 4, 4), _t(ut, 2, 3)),
                  "ShapeError", "gamma must be [3] or [3, 1, ..., 1]"),
        ErrorCase("layer_scale",
                  lambda ut: ut.layer_scale(_t(ut, 2, 3, 4, 4), ut.zeros((3,), dtype=ut.bfloat16)),
                  "ArgumentError", "gamma is bfloat16, and it must be float32"),
        ErrorCase("layer_scale_backward",
                  lambda ut: ut.layer_scale_backward(_t(ut, 2, 3, 4, 4), _t(ut, 2, 3, 4, 4),
                                                     _t(ut, 3, 1, 1), _t(ut, 4)),
                  "ShapeError", "dgamma must have 3 elements, got 4"),
        ErrorCase("layer_scale_backward",
                  lambda ut: ut.layer_scale_backward(_t(ut, 2, 3, 4, 4), _t(ut, 2, 3, 4, 4),
                                                     _t(ut, 3, 1, 1), [0.0, 0.0, 0.0]),
                  "ArgumentTypeError", "dgamma must be a Tensor"),
        ErrorCase("layer_scale_backward",
                  lambda ut: ut.layer_scale_backward(_t(ut, 2, 3, 4), _t(ut, 2, 3, 4, 4),
                                                     _t(ut, 3)),
                  "ShapeError", "grad_out has shape [2, 3, 4] but x has shape [2, 3, 4, 4]"),
    ],
)


def _ln2d_make(ut, g, device):
    return ut.LayerNorm2d(g["c"], eps=g["eps"], device=device)


def _ln2d_inputs(rng, g):
    return {"x": _f32(rng, *_nchw(g), scale=2.0, shift=0.5), "w": _f32(rng, g["c"], shift=1.0),
            "b": _f32(rng, g["c"])}, {}


LAYERNORM2D = OpInfo(
    "layernorm2d",
    layer="LayerNorm2d",
    defaults=dict(n=2, c=5, h=3, w=4, eps=1e-6),
    shapes=lambda g: {"x": _nchw(g), "w": (g["c"],), "b": (g["c"],)},
    sample_inputs=_ln2d_inputs,
    reference=lambda a, k, g: R.layernorm2d(a["x"], a["w"], a["b"], g["eps"]),
    describe=lambda g: "x[%d,%d,%d,%d]" % _nchw(g),
    make=_ln2d_make,
    geometry_of=lambda l: dict(c=l.dim, eps=l.eps),
    runner=lambda ut, g, k, dev: _layer_runner(ut, g, k, dev, _ln2d_make),
    grad=("x", "w", "b"),
    samples=[
        Sample(dict(n=2, c=5, h=3, w=4), {"selftest", "gradcheck"}),
        # not C = 2: the output is then +-1 whatever x is (see LAYERNORM)
        Sample(dict(n=3, c=3, h=1, w=5), {"gradcheck"}),
        Sample(dict(n=1, c=7, h=2, w=2, eps=1e-5), {"gradcheck"}),
        Sample(dict(n=2, c=4, h=3, w=3), {"copy"}, "LayerNorm2d"),
        Sample(dict(n=3, c=33, h=9, w=7), {"cuda_vs_cpu", "reference"}, "layernorm2d"),
        Sample(dict(n=2, c=8, h=9, w=9), {"bf16"}, "layernorm2d"),
    ],
    bf16=Bf16(kernel="norm"),
    errors=[
        ErrorCase("LayerNorm2d", lambda ut: ut.LayerNorm2d(0), "ArgumentError",
                  "normalized_shape"),
        ErrorCase("LayerNorm2d.forward", lambda ut: ut.LayerNorm2d(4)(_t(ut, 2, 3, 5, 5)),
                  "ShapeError", "x must be [N, 4, H, W], got shape [2, 3, 5, 5]"),
        ErrorCase("LayerNorm2d.forward", lambda ut: ut.LayerNorm2d(4)(_t(ut, 2, 4)),
                  "ShapeError", "x must be [N, 4, H, W]"),
        ErrorCase("LayerNorm2d.backward",
                  lambda ut: _fwd(ut.LayerNorm2d(4), _t(ut, 2, 4, 3, 3)).backward(
                      _t(ut, 2, 4, 3, 4)), "ShapeError", "grad_out has shape [2, 4, 3, 4]"),
        ErrorCase("LayerNorm2d.backward", lambda ut: ut.LayerNorm2d(4).backward(_t(ut, 2, 4, 1, 1)),
                  "ArgumentError", "no forward pass"),
    ],
)


# -- issue 30, the training recipe: Dropout, StochasticDepth -------------------------------------
# A random op is a deterministic one once its mask is fixed: the runner reseeds the library's
# RNG before every forward, so each draws the mask sample_inputs drew (the const "mask", from the
# same seed); the reference is x times that mask in float64, and the gradient check's finite
# differences see the linear map backward must apply (the same mask).
_MASK_SEED = 30


class _MaskRunner(_FnRunner):
    """On the CPU the layer itself, reseeded before each forward. The GPU draws its masks from
    a stream of its own (the CPU's mask is not among them), so there the runner applies the
    const mask with mask_scale_, the op the layer's forward and backward apply; the GPU's draw
    is checked by tests/test_recipe.py and tests/test_cuda_graph.py."""

    def __init__(self, ut, layer, device, mask):
        self.layer = layer
        self._mask = None
        if device == "cpu":
            def fwd(x):
                ut.seed(_MASK_SEED)
                return layer(x)

            def bwd(g, x):
                return layer.backward(g)
        else:
            m = self._mask = ut.tensor(mask, device)

            def fwd(x):
                y = x.clone() if isinstance(x, ut.Tensor) else ut.tensor(x, device)
                ut.functional.mask_scale_(y, m)
                return y

            def bwd(g, x):
                d = g.clone()
                ut.functional.mask_scale_(d, m)
                return d

        super().__init__(device, fwd, bwd)

    def close(self):
        self.layer.close()
        if self._mask is not None:
            self._mask.close()


def _mask_inputs(mask_shape):
    def draw(rng, g):
        ut = _ut()
        x = _f32(rng, *g["shape"])
        ut.seed(_MASK_SEED)
        with ut.functional.dropout_mask(mask_shape(g), g["p"]) as m:
            mask = m.numpy().copy()
        return {"x": x}, {"mask": mask}
    return draw


def _mask_ref(a, k, g):
    x = a["x"]
    m = k["mask"].astype(np.float64)
    return x * m.reshape(m.shape + (1,) * (x.ndim - m.ndim))


DROPOUT = OpInfo(
    "dropout",
    layer="Dropout",
    functions=("functional.dropout", "functional.dropout_mask", "functional.mask_scale_"),
    defaults=dict(shape=(4, 6), p=0.3),
    shapes=lambda g: {"x": tuple(g["shape"])},
    sample_inputs=_mask_inputs(lambda g: g["shape"]),
    reference=_mask_ref,
    describe=lambda g: "x%s p %g" % (list(g["shape"]), g["p"]),
    make=lambda ut, g, device: ut.Dropout(g["p"]),
    geometry_of=lambda l: dict(p=l.p),
    runner=lambda ut, g, k, dev: _MaskRunner(ut, ut.Dropout(g["p"]), dev, k["mask"]),
    grad=("x",),
    samples=[
        Sample(dict(shape=(4, 6), p=0.3), {"selftest", "gradcheck"}, "dropout"),
        Sample(dict(shape=(2, 3, 5, 5), p=0.5), {"gradcheck"}),
    ],
    bf16=Bf16(kernel="exact"),
    errors=[
        ErrorCase("Dropout", lambda ut: ut.Dropout(1.5), "ArgumentError",
                  "dropout probability has to be between 0 and 1, but got 1.5"),
        ErrorCase("Dropout", lambda ut: ut.Dropout("x"), "ArgumentTypeError", "p must be a number"),
        ErrorCase("Dropout.backward", lambda ut: ut.Dropout().backward(_t(ut, 2)), "ArgumentError",
                  "no forward pass"),
        ErrorCase("functional.mask_scale_", lambda ut: ut.functional.mask_scale_(_t(ut, 2, 3), _t(ut, 4)),
                  "ShapeError", "do not divide"),
        ErrorCase("functional.dropout_mask", lambda ut: ut.functional.dropout_mask((2, 2), -0.5),
                  "ArgumentError", "dropout probability has to be between 0 and 1"),
    ],
)

STOCHASTIC_DEPTH = OpInfo(
    "stochastic_depth",
    layer="StochasticDepth",
    functions=("functional.stochastic_depth",),
    defaults=dict(shape=(8, 2, 3, 3), p=0.4, mode="row"),
    shapes=lambda g: {"x": tuple(g["shape"])},
    sample_inputs=_mask_inputs(lambda g: (g["shape"][0],) if g["mode"] == "row" else (1,)),
    reference=_mask_ref,
    describe=lambda g: "x%s p %g %s" % (list(g["shape"]), g["p"], g["mode"]),
    make=lambda ut, g, device: ut.StochasticDepth(g["p"], g["mode"]),
    geometry_of=lambda l: dict(p=l.p, mode=l.mode),
    runner=lambda ut, g, k, dev: _MaskRunner(ut, ut.StochasticDepth(g["p"], g["mode"]), dev,
                                              k["mask"]),
    grad=("x",),
    samples=[
        Sample(dict(shape=(8, 2, 3, 3), p=0.4), {"selftest", "gradcheck"}, "stochastic_depth"),
        Sample(dict(shape=(5, 7), p=0.5, mode="batch"), {"gradcheck"}),
    ],
    bf16=Bf16(kernel="exact"),
    errors=[
        ErrorCase("StochasticDepth", lambda ut: ut.StochasticDepth(-0.1, "row"), "ArgumentError",
                  "drop probability has to be between 0 and 1, but got -0.1"),
        ErrorCase("StochasticDepth", lambda ut: ut.StochasticDepth(0.1, "col"), "ArgumentError",
                  "mode has to be either 'batch' or 'row', but got col"),
    ],
)


# -- the table ------------------------------------------------------------------------------------
# Order: the ops with a backward first, in the self-check's row order, then the others.
OPS = [
    CONV2D, DWCONV2D, BATCHNORM2D, LAYERNORM, LINEAR, GLOBAL_AVG_POOL2D, RELU, RELU6,
    *ACTIVATIONS,  # issue 30
    SOFTMAX_CROSS_ENTROPY, MSE_LOSS,
    CHANNEL_SCALE, LAYER_SCALE, LAYERNORM2D,  # issue 30
    MATMUL, TRANSPOSE, ADD, SCALE, BIAS_ADD, SGD_STEP, ADAM_STEP,
    # issue 30, the training recipe
    DROPOUT, STOCHASTIC_DEPTH,
]
OP = {op.name: op for op in OPS}


def samples(use):
    """[(op, sample)] of every op's samples that ``use`` draws, in table order."""
    return [(op, s) for op in OPS for s in op.samples_for(use)]


def for_layer(layer):
    """The entry whose layer ``layer`` is an instance of (exact class first, then subclasses:
    SyncBatchNorm is a BatchNorm2d)."""
    ut = _ut()
    for exact in (True, False):
        for op in OPS:
            if op.layer is None:
                continue
            cls = getattr(ut, op.layer)
            if (type(layer) is cls) if exact else isinstance(layer, cls):
                return op
    raise KeyError("no op table entry for %s" % type(layer).__name__)
