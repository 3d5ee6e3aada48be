"""The API fuzzer, run in a child process by tests/test_fuzz.py (a crash kills only the child).

    python tests/fuzz_child.py CASES SEED

Each case calls one public function, constructor or method of utensil_ffi with arguments drawn by
hypothesis from a pool of hostile values: wrong types, shapes of every rank (zero, negative and
huge dimensions), numpy arrays of every dtype with NaN/inf, closed tensors and layers, tensors of
other shapes and devices, NaN/inf/huge scalars, bad device strings. A case passes when the call
returns or raises a documented exception: utensil_ffi.UtensilError (whose subclasses are also
ValueError, TypeError, MemoryError, RuntimeError) or MemoryError. Anything else escaping is
recorded as a finding; a crash of the interpreter shows as the child's exit by a signal.

Without a GPU the address space is capped (RLIMIT_AS, +4 GiB over the start) so that huge but
valid sizes (2**31 - 1 elements = 8 GiB) fail as MemoryError instead of swapping the machine.
Under ASan (LD_PRELOAD of libasan) the cap is ASan's:
ASAN_OPTIONS=allocator_may_return_null=1:max_allocation_size_mb=2048.

The last line of stdout is a JSON report: cases run, findings, live C tensors before and after.
"""

import gc
import inspect
import json
import math
import os
import resource
import sys
import time
import traceback

import numpy as np

try:
    import utensil_ffi as ut
except ImportError:  # run directly from a checkout: python tests/fuzz_child.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import utensil_ffi as ut
from utensil_ffi import functional as F

ALLOWED = (ut.UtensilError, MemoryError)

# Everything made during one case, closed at its end.
_MADE = []


def _track(obj):
    _MADE.append(obj)
    return obj


def _close_all():
    while _MADE:
        obj = _MADE.pop()
        close = getattr(obj, "close", None)
        if close is not None:
            try:
                close()
            except ALLOWED:
                pass


def first_param(layer):
    try:
        ps = layer.parameters() if layer is not None else []
    except ALLOWED:  # a closed layer
        return None
    return ps[0] if ps else None


def _cap_address_space():
    if ut.cuda_available():
        return None  # the CUDA runtime needs a large address space
    if "asan" in os.environ.get("LD_PRELOAD", ""):
        return None  # ASan maps terabytes of shadow; its own cap: max_allocation_size_mb
    with open("/proc/self/statm") as f:
        vm = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    cap = vm + (4 << 30)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    return cap


# -- values ---------------------------------------------------------------------------------------
def strategies():
    from hypothesis import strategies as st
    from hypothesis.extra import numpy as hnp

    devs = ut.devices()
    huge = [2**31 - 1, 2**31, 2**32 + 1, 2**62, 2**63, -(2**63), 2**70, -(2**31), 10**100]
    ints = st.one_of(st.integers(-3, 12), st.integers(-3, 12), st.integers(-(2**40), 2**40),
                     st.sampled_from(huge))
    small = st.integers(1, 5)
    special_f = [math.nan, math.inf, -math.inf, 1e308, -1e308, 3.5e38, -0.0, 5e-324, 1e-45]
    floats = st.one_of(st.floats(-10, 10), st.sampled_from(special_f),
                       st.floats(allow_nan=True, allow_infinity=True))
    np_scalars = st.one_of(
        st.builds(np.float32, st.floats(width=32, allow_nan=True)),
        st.builds(np.int64, st.integers(-(2**63), 2**63 - 1)),
        st.builds(np.uint8, st.integers(0, 255)),
        st.just(np.bool_(True)), st.just(np.float16("nan")), st.just(np.complex64(1 + 2j)))
    strings = st.sampled_from(["cpu", "cuda", "cuda:0", "cuda:1", "gpu", "CPU ", "", "tpu",
                               "cpu\x00", "x" * 300, "nan", "1"])
    shape_dims = st.one_of(st.integers(-2, 6), st.sampled_from([0, -1, 2**31 - 1, 2**31, 2**40]))
    shapes = st.one_of(st.lists(shape_dims, min_size=0, max_size=10).map(tuple),
                       st.lists(st.integers(1, 4), min_size=1, max_size=4).map(tuple),
                       st.lists(st.integers(1, 4), min_size=1, max_size=4))
    dtypes = st.sampled_from([np.float32, np.float64, np.float16, np.int8, np.int32, np.int64,
                              np.uint16, np.bool_, np.complex64])
    arrays = st.one_of(
        hnp.arrays(np.float32, hnp.array_shapes(min_dims=0, max_dims=5, min_side=0, max_side=4),
                   elements=st.floats(width=32, allow_nan=True, allow_infinity=True)),
        hnp.arrays(np.float32, hnp.array_shapes(min_dims=1, max_dims=4, min_side=1, max_side=5),
                   elements=st.floats(-4, 4, width=32)),
        hnp.arrays(dtypes, hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=4)),
        st.just(np.zeros((3, 4), np.float32)[:, ::2]),  # non-contiguous
        st.just(np.array(["a", "b"])), st.just(np.array([object(), 1], dtype=object)),
        st.just(np.zeros((2, 0, 3), np.float32)), st.just(np.ones((1,) * 9, np.float32)),
        st.just(np.arange(6, dtype=np.int64)),
    )
    nested = st.one_of(st.lists(floats, max_size=5), st.lists(st.lists(ints, max_size=3), max_size=3),
                       st.just([[1, 2], [3]]), st.just([1, "a"]), st.just([[[]]]))

    def make_tensor(shape, dev, closed, scale):
        t = _track(ut.randn(shape, std=scale, device=dev))
        if closed:
            t.close()
        return t

    tensors = st.builds(make_tensor, st.lists(small, min_size=1, max_size=4).map(tuple),
                        st.sampled_from(devs), st.sampled_from([False, False, False, True]),
                        st.sampled_from([1.0, 1.0, 1e30, 0.0]))
    nan_tensor = st.builds(lambda d: _track(ut.tensor(np.array([[math.nan, math.inf, -math.inf]] * 2), d)),
                           st.sampled_from(devs))

    def make_layer(kind, dev, closed, n):
        try:
            if kind == "conv":
                l = ut.Conv2d(n, n + 1, (n, 2), stride=1 + n % 2, padding=n % 3, device=dev)
            elif kind == "dw":
                l = ut.DWConv2d(n, 3, stride=2, padding=1, device=dev)
            elif kind == "lin":
                l = ut.Linear(n, 3, bias=n % 2 == 0, device=dev)
            elif kind == "ln":
                l = ut.LayerNorm(n, device=dev)
            elif kind == "bn":
                l = ut.BatchNorm2d(n, device=dev)
            elif kind == "relu":
                l = ut.ReLU()
            elif kind == "relu6":
                l = ut.ReLU6()
            elif kind == "pool":
                l = ut.GlobalAvgPool2d()
            else:
                l = ut.Sequential(ut.Linear(n, 2, device=dev), ut.ReLU())
        except ALLOWED:
            return None
        _track(l)
        if closed:
            l.close()
        return l

    layers = st.builds(make_layer, st.sampled_from(["conv", "dw", "lin", "ln", "bn", "relu",
                                                    "relu6", "pool", "seq"]),
                       st.sampled_from(devs), st.booleans(), small)
    params = layers.map(first_param)
    misc = st.sampled_from([None, True, False, object(), (lambda: 1), {}, {"a": 1}, slice(1, 2),
                            1 + 2j, b"cpu", bytearray(4), Ellipsis, type, ut.Tensor, range(3),
                            iter([1, 2])])
    values = st.one_of(ints, floats, np_scalars, strings, shapes, arrays, nested, tensors,
                       tensors, nan_tensor, layers, params, misc)
    return {"values": values, "tensors": tensors, "layers": layers, "small": small,
            "strings": strings}


# -- targets --------------------------------------------------------------------------------------
FUNCTIONS = [
    ut.tensor, ut.from_numpy, ut.zeros, ut.ones, ut.full, ut.randn, ut.seed, ut.devices,
    ut.cuda_available, ut.synchronize, ut.set_num_threads, ut.get_num_threads, ut.live_tensors,
    ut.relu, ut.relu6, ut.relu_backward, ut.relu6_backward, ut.matmul, ut.transpose,
    ut.global_avg_pool2d, ut.global_avg_pool2d_backward, ut.mse_loss, ut.mse_loss_backward,
    ut.cross_entropy, ut.cross_entropy_backward, ut.sgd_step, ut.adam_step, F.reshape, F.add_,
    F.scale_, F.bias_add_,
    ut.Tensor, ut.Conv2d, ut.DWConv2d, ut.BatchNorm2d, ut.LayerNorm, ut.Linear, ut.ReLU, ut.ReLU6,
    ut.GlobalAvgPool2d, ut.Sequential, ut.MSELoss, ut.CrossEntropyLoss, ut.SGD, ut.Adam,
]

TENSOR_METHODS = ["numpy", "tolist", "item", "copy_from", "to", "cpu", "cuda", "sync", "clone",
                  "reshape", "transpose", "fill_", "zero_", "add_", "mul_", "__matmul__",
                  "__array__", "__len__", "__repr__", "close", "__enter__", "numel"]
TENSOR_PROPS = ["shape", "ndim", "size", "dtype", "device", "closed", "ptr"]
LAYER_METHODS = ["forward", "backward", "__call__", "train", "eval", "to", "zero_grad",
                 "parameters", "close", "__repr__"]
LAYER_SETTERS = ["weight", "bias", "running_mean", "running_var"]


def _positional(fn):
    """(min, max) positional arguments of fn (max 6 for *args)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return 0, 3
    lo = hi = 0
    for p in sig.parameters.values():
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            hi += 1
            if p.default is p.empty:
                lo += 1
        elif p.kind == p.VAR_POSITIONAL:
            hi = max(hi, lo) + 6
    return lo, hi


def _describe(x):
    try:
        if isinstance(x, np.ndarray):
            return "ndarray(%s, shape=%s)" % (x.dtype, x.shape)
        if isinstance(x, ut.Tensor):
            return "Tensor(<closed>)" if x.closed else "Tensor(shape=%s, %s)" % (x.shape, x.device)
        r = repr(x)
        return r if len(r) < 80 else r[:77] + "..."
    except Exception as e:  # a repr that fails is itself reported by the __repr__ target
        return "<%s: repr failed: %s>" % (type(x).__name__, type(e).__name__)


def _cleanup_result(r):
    if isinstance(r, (ut.Tensor, ut.Module, ut.Optimizer)):
        _track(r)
    elif isinstance(r, (list, tuple)):
        for x in r:
            _cleanup_result(x)


def run(n_cases, seed_value):
    from hypothesis import HealthCheck, Phase, given, seed, settings
    from hypothesis import strategies as st

    S = strategies()
    values = S["values"]
    stats = {"cases": 0, "ok": 0, "raised": 0, "by_exception": {}, "findings": [], "targets": {}}
    threads0 = ut.get_num_threads()

    def record_finding(where, args, e):
        key = (where, type(e).__name__)
        if any((f["target"], f["exception"]) == key for f in stats["findings"]):
            for f in stats["findings"]:
                if (f["target"], f["exception"]) == key:
                    f["count"] += 1
            return
        stats["findings"].append({
            "target": where, "exception": type(e).__name__, "message": str(e)[:300],
            "args": [_describe(a) for a in args], "count": 1,
            "traceback": "".join(traceback.format_exception(type(e), e, e.__traceback__)[-3:])[-800:],
        })

    def call(where, fn, args, kwargs):
        stats["cases"] += 1
        stats["targets"][where] = stats["targets"].get(where, 0) + 1
        try:
            r = fn(*args, **kwargs)
            _cleanup_result(r)
            stats["ok"] += 1
        except ALLOWED as e:
            stats["raised"] += 1
            name = type(e).__name__
            stats["by_exception"][name] = stats["by_exception"].get(name, 0) + 1
        except RecursionError as e:
            record_finding(where, args, e)
        except Exception as e:
            record_finding(where, args, e)

    @settings(max_examples=n_cases, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck), derandomize=False)
    @seed(seed_value)
    @given(st.data())
    def one_case(data):
        try:
            kind = data.draw(st.sampled_from(["function"] * 3 + ["tensor", "prop", "layer", "setter",
                                                                 "optimizer", "loss"]))
            if kind == "function":
                fn = data.draw(st.sampled_from(FUNCTIONS))
                lo, hi = _positional(fn)
                n = data.draw(st.integers(lo, hi))
                args = [data.draw(values) for _ in range(n)]
                call(getattr(fn, "__qualname__", str(fn)), fn, args, {})
            elif kind == "tensor":
                t = data.draw(S["tensors"])
                name = data.draw(st.sampled_from(TENSOR_METHODS))
                fn = getattr(t, name)
                lo, hi = _positional(fn)
                args = [data.draw(values) for _ in range(data.draw(st.integers(lo, hi)))]
                call("Tensor." + name, fn, args, {})
            elif kind == "prop":
                t = data.draw(S["tensors"])
                name = data.draw(st.sampled_from(TENSOR_PROPS))
                call("Tensor." + name, lambda: getattr(t, name), [], {})
            elif kind in ("layer", "setter"):
                l = data.draw(S["layers"])
                if l is None:
                    return
                if kind == "layer":
                    name = data.draw(st.sampled_from(LAYER_METHODS))
                    fn = getattr(l, name)
                    lo, hi = _positional(l.forward if name == "__call__" else fn)
                    # a valid forward first, sometimes, so backward has something to work on
                    if data.draw(st.booleans()) and not getattr(l, "closed", False):
                        x = data.draw(st.sampled_from([(2, 3, 5, 5), (2, 4), (3, 2, 4, 4), (2, 1, 3, 3)]))
                        call("%s.forward" % type(l).__name__, l, [_track(ut.randn(x))], {})
                    args = [data.draw(values) for _ in range(data.draw(st.integers(lo, hi)))]
                    call("%s.%s" % (type(l).__name__, name), fn, args, {})
                else:
                    name = data.draw(st.sampled_from(LAYER_SETTERS))
                    v = data.draw(values)
                    call("%s.%s=" % (type(l).__name__, name), setattr, [l, name, v], {})
            elif kind == "optimizer":
                l = data.draw(S["layers"])
                cls = data.draw(st.sampled_from([ut.SGD, ut.Adam]))
                p = first_param(l)
                opt = _track(cls([p] if p is not None else [_track(ut.Linear(2, 2)).weight]))
                if data.draw(st.booleans()) and l is not None:
                    l.close()  # parameters closed under the optimizer
                if data.draw(st.booleans()):
                    opt.close()
                name = data.draw(st.sampled_from(["step", "zero_grad", "close"]))
                call("%s.%s" % (cls.__name__, name), getattr(opt, name), [], {})
                kw = data.draw(st.sampled_from(["lr", "momentum"] if cls is ut.SGD
                                               else ["lr", "betas", "eps"]))
                args = [data.draw(values)]
                call("%s(%s=)" % (cls.__name__, kw), cls,
                     [[_track(ut.Linear(2, 2)).weight]], {kw: args[0]})
            else:
                cls = data.draw(st.sampled_from([ut.MSELoss, ut.CrossEntropyLoss]))
                crit = _track(cls())
                args = [data.draw(values) for _ in range(2)]
                call(cls.__name__ + ".forward", crit, args, {})
                call(cls.__name__ + ".backward", crit.backward, [], {})
        finally:
            _close_all()
            if ut.get_num_threads() != threads0:
                ut.set_num_threads(threads0)

    one_case()
    return stats


def main():
    n_cases = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    seed_value = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    cap = _cap_address_space()
    ut.set_num_threads(min(ut.get_num_threads(), 2))
    gc.collect()
    live0 = ut.live_tensors()
    t0 = time.perf_counter()
    stats = run(n_cases, seed_value)
    gc.collect()
    stats.update(live_start=live0, live_end=ut.live_tensors(), seconds=time.perf_counter() - t0,
                 address_space_cap=cap, seed=seed_value, devices=ut.devices())
    print(json.dumps(stats))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
