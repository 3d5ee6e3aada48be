"""The package's sub-packages (issue 28) changed no behaviour that code outside it can see.

What the flat package (commit eea0eae, before the split) exported and pickled is recorded in
tests/fixtures/flat_layout (names.json, *.pkl; make.py says how they were made). Checked here:

- ``import utensil_ffi`` names everything it named (a fresh interpreter's ``dir()``);
- every old module path imports and names what that module defined: a module that moved whole
  is the same module object under both names, ``utensil_ffi.layers`` (split) holds the names of
  the modules it became; ``python -m`` of the old paths runs the programs;
- pickles written by the flat package load, to equal values and working objects of the same
  classes; new pickles load and name only the new module paths;
- the packaging lists every sub-package, and the console scripts name functions that exist.
"""

import importlib
import json
import os
import pickle
import pickletools
import subprocess
import sys

import numpy as np
import pytest

import utensil_ffi as ut
from utensil_ffi import _compat

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "flat_layout")
with open(os.path.join(FIXTURES, "names.json")) as _f:
    OLD_NAMES = json.load(_f)  # {old module: {name: "module.qualname" or "=type"}}
PICKLES = sorted(f[:-4] for f in os.listdir(FIXTURES) if f.endswith(".pkl"))


def _python(*args, timeout=120):
    """Run the interpreter in a child from an empty folder, the checkout first on its path."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    return subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=os.path.join(ROOT, "tests"))


def _import_or_skip(name):
    try:
        return importlib.import_module(name)
    except ImportError as e:  # utensil_ffi.torch without PyTorch
        if "torch" in str(e) and "torch" not in sys.modules:
            pytest.skip("needs PyTorch: %s" % e)
        raise


# -- names ----------------------------------------------------------------------------------------
def test_the_facade_names_what_it_named():
    r = _python("-c", "import json, utensil_ffi; print(json.dumps(dir(utensil_ffi)))")
    assert r.returncode == 0, r.stderr
    now = set(json.loads(r.stdout))
    assert sorted(set(OLD_NAMES["utensil_ffi"]) - now) == []
    for name, where in OLD_NAMES["utensil_ffi"].items():
        if not where.startswith("="):  # a class or function: the same one, by its name
            assert getattr(ut, name).__qualname__ == where.rpartition(".")[2], name


# Names that left on purpose: the self-check's per-op case builders (case_conv2d, ...) became
# the op table's entries (utensil_ffi.testing.optable: OP["conv2d"].case), which the self-check
# and the tests now share; nothing pickled names them.
GONE = {"utensil_ffi.selftest": {"case_" + op for op in (
    "batchnorm2d", "conv2d", "cross_entropy", "dwconv2d", "global_avg_pool2d", "layernorm",
    "linear", "mse", "relu", "relu6")}}


def _required(module, names):
    """The names an old module must still have: those it defined itself (not what it merely
    imported; private helpers aside), its constants, and what its pickles reference."""
    return sorted(k for k, where in names.items()
                  if ((not k.startswith("_") and (where.startswith(module + ".")
                                                  or where.startswith("=builtins.")))
                      or k.startswith("_rebuild")) and k not in GONE.get(module, ()))


def test_what_left_on_purpose_is_in_the_op_table():
    from utensil_ffi.testing import optable

    for name in GONE["utensil_ffi.selftest"]:
        op = name[len("case_"):]
        op = {"cross_entropy": "softmax_cross_entropy", "mse": "mse_loss"}.get(op, op)
        assert callable(optable.OP[op].case), name


@pytest.mark.parametrize("old", sorted(m for m in OLD_NAMES if m != "utensil_ffi"))
def test_every_old_module_path_imports_and_names_its_names(old):
    mod = _import_or_skip(old)
    names = OLD_NAMES[old]
    missing = [k for k in _required(old, names) if not hasattr(mod, k)]
    assert missing == []
    for k in _required(old, names):
        where = names[k]
        if not where.startswith("="):  # the class or function it was, found at its new home
            assert getattr(mod, k).__qualname__ == where[len(old) + 1:], k


@pytest.mark.parametrize("old", sorted(k for k, v in _compat.MOVED.items() if len(v) == 1))
def test_a_moved_module_is_one_module_under_both_names(old):
    new = "utensil_ffi." + _compat.MOVED[old][0]
    mod = _import_or_skip("utensil_ffi." + old)
    assert mod is importlib.import_module(new) is sys.modules["utensil_ffi." + old]
    assert mod.__name__ == new and mod.__spec__.name == new  # it keeps its own spec
    assert getattr(importlib.import_module("utensil_ffi"), old) is mod


def test_layers_holds_the_names_of_the_modules_it_became():
    import utensil_ffi.layers as layers
    from utensil_ffi.layers import BatchNorm2d, Conv2d, Parameter, _CLayer, _rebuild_clayer

    assert ut.layers is layers  # bound by a bare import, as before
    assert Conv2d is ut.Conv2d is ut.nn.Conv2d and BatchNorm2d is ut.nn.norm.BatchNorm2d
    assert Parameter is ut.Parameter and _CLayer is ut.nn._clayer._CLayer
    assert _rebuild_clayer is ut.nn._clayer._rebuild_clayer
    assert layers._State is importlib.import_module("utensil_ffi._lifetime")._State
    star = {}
    exec("from utensil_ffi.layers import *", star)
    assert {"Module", "Sequential", "MSELoss", "CrossEntropyLoss"} <= set(star)
    assert sorted(set(OLD_NAMES["utensil_ffi.layers"]) - set(vars(layers))) == []


@pytest.mark.parametrize("old, new", [("selftest", "testing.selftest"), ("train", "cli.train"),
                                      ("export", "cli.export"), ("predict", "cli.predict"),
                                      ("launch", "distributed.launch")])
def test_python_m_runs_the_programs_under_old_and_new_paths(old, new):
    for path in (old, new):
        r = _python("-m", "utensil_ffi." + path, "--help")
        assert r.returncode == 0, (path, r.stderr)
        assert r.stdout.startswith("usage:"), (path, r.stdout)
        assert r.stderr == "", (path, r.stderr)  # no runpy warning: the module ran once


def test_python_m_runs_a_program_as_main_once():
    # the old path runs the new module as __main__: one run of main(), its exit status
    r = _python("-m", "utensil_ffi.selftest", "--device", "nope")
    assert r.returncode == 2 and "invalid choice" in r.stderr, r.stderr
    r = _python("-m", "utensil_ffi.layers")  # a split module had no program
    assert r.returncode != 0 and "utensil_ffi.layers" in r.stderr


# -- pickles --------------------------------------------------------------------------------------
def _load(name):
    with open(os.path.join(FIXTURES, name + ".pkl"), "rb") as f:
        return pickle.load(f)


def _np(t):
    return np.array(t.numpy(), dtype=np.float32, copy=True)


def _same_state(got, want):
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def _check_module(m, e):
    """A loaded module against what the flat package recorded: class, state, output, repr."""
    old_module, _, cls = e["type"].rpartition(".")
    assert type(m).__name__ == cls and getattr(importlib.import_module(old_module), cls) is type(m)
    assert repr(m) == e["repr"]
    _same_state(m.state_dict(), e["state_dict"])
    for sbn in m.modules():
        if isinstance(sbn, ut.SyncBatchNorm):
            # as its docstring says, a copy keeps the layer but not its group: set it again
            # (without, forward raises AttributeError: _sync_fn, in the flat package too)
            sbn.process_group = None
    m.eval()
    with ut.tensor(e["x"]) as x, m(x) as y:
        np.testing.assert_allclose(_np(y), e["y_eval"], rtol=1e-5, atol=1e-6)
    m.train()  # and it trains: forward, backward into the parameters' grads
    with ut.tensor(e["x"]) as x, m(x) as y, ut.ones(y.shape) as g:
        m.backward(g, input_grad=False)
    assert all(np.all(np.isfinite(_np(p.grad))) for p in m.parameters())


def _close(*objs):
    for o in objs:
        o.close()


@pytest.mark.parametrize("name", PICKLES)
def test_pickles_of_the_flat_package_load(name):
    entry = _load(name)
    obj, e = entry["obj"], entry["expect"]
    if name.startswith("tensor_"):
        assert type(obj) is ut.Tensor and obj.dtype.name == e["dtype"]
        np.testing.assert_array_equal(_np(obj), e["values"])
        obj.close()
    elif name == "parameter":
        assert type(obj) is ut.Parameter and obj.name == e["name"]
        np.testing.assert_array_equal(_np(obj), e["values"])
        np.testing.assert_array_equal(_np(obj.grad), e["grad"])
        obj.close()
    elif name == "model_and_sgd":
        net, opt = obj
        assert type(opt) is ut.SGD
        assert all(a is b for a, b in zip(opt.params, net.parameters()))
        sd = opt.state_dict()
        assert sd["param_groups"] == e["optim"]["param_groups"]
        for i, st in e["optim"]["state"].items():
            _same_state(sd["state"][i], st)
        _check_module(net, e)
        opt.step()  # still bound to the loaded network's parameters
        _close(opt, net)
    elif name == "sgd_state_dict":
        from utensil_ffi import models  # the old path, as README spells it

        net = models.mobilenet(in_channels=1, num_classes=3, width=2, blocks=((2, 2),))
        opt = ut.SGD(net.parameters(), lr=0.1, momentum=0.5)
        opt.load_state_dict(obj)
        assert opt.state_dict()["param_groups"] == obj["param_groups"]
        _close(opt, net)
    elif name == "losses":
        mse, ce = obj
        assert [type(mse).__name__, type(ce).__name__] == ["MSELoss", "CrossEntropyLoss"]
        with ut.tensor([[0.5, -1.0, 2.0]]) as p:
            with mse(p, np.zeros((1, 3), np.float32)) as l1, ce(p, np.array([2])) as l2:
                assert l1.item() == pytest.approx(1.75) and l2.item() > 0
            mse.backward().close()
            ce.backward().close()
        _close(mse, ce)
    else:
        _check_module(obj, e)
        obj.close()


def _globals(data):
    """The "module name" pairs a pickle refers to (GLOBAL and STACK_GLOBAL opcodes; the strings
    STACK_GLOBAL takes may come from the memo)."""
    out, strings, memo, prev = [], [], {}, None
    for op, arg, _ in pickletools.genops(data):
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE", "BINUNICODE8"):
            strings.append(arg)
        elif op.name == "MEMOIZE":
            memo[len(memo)] = strings[-1] if prev in ("string", "get") else None
        elif op.name in ("BINPUT", "LONG_BINPUT", "PUT"):
            memo[arg] = strings[-1] if prev in ("string", "get") else None
        elif op.name in ("BINGET", "LONG_BINGET", "GET") and memo.get(arg) is not None:
            strings.append(memo[arg])
            prev = "get"
            continue
        elif op.name == "GLOBAL":
            out.append(arg)
        elif op.name == "STACK_GLOBAL":
            out.append(strings[-2] + " " + strings[-1])
        if op.name not in ("MEMOIZE", "BINPUT", "LONG_BINPUT", "PUT"):
            prev = "string" if "UNICODE" in op.name else op.name
    return out


def test_the_fixtures_name_the_old_paths():
    refs = set()
    for name in PICKLES:
        with open(os.path.join(FIXTURES, name + ".pkl"), "rb") as f:
            refs.update(_globals(f.read()))
    assert {"utensil_ffi.layers Conv2d", "utensil_ffi.layers _rebuild_clayer",
            "utensil_ffi.layers _rebuild_parameter", "utensil_ffi.layers _rebuild_module",
            "utensil_ffi.layers _Stateless", "utensil_ffi.amp MixedPrecision",
            "utensil_ffi.blocks Residual", "utensil_ffi.sync_batchnorm SyncBatchNorm",
            "utensil_ffi.tensor _rebuild_tensor", "utensil_ffi.optim SGD"} <= refs


@pytest.mark.parametrize("protocol", [2, pickle.HIGHEST_PROTOCOL])
def test_new_pickles_load_and_name_the_new_paths(protocol):
    objs = [_load(n)["obj"] for n in PICKLES]
    data = pickle.dumps(objs, protocol=protocol)
    refs = _globals(data)
    assert any(r.startswith("utensil_ffi.nn.") for r in refs)
    old = {"utensil_ffi." + k for k in _compat.MOVED}
    assert [r for r in refs if r.split()[0] in old] == []  # no old path: no need of _compat
    again = pickle.loads(data)
    for a, b in zip(objs, again):
        if isinstance(a, ut.Module):
            _same_state(b.state_dict(), a.state_dict())
    for group in (objs, again):
        for o in group:
            for x in (o if isinstance(o, tuple) else (o,)):
                if hasattr(x, "close"):
                    x.close()


# -- packaging ------------------------------------------------------------------------------------
def test_the_wheel_lists_every_sub_package():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11
    from setuptools import find_packages

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)
    found = set(find_packages(ROOT, **project["tool"]["setuptools"]["packages"]["find"]))
    on_disk = {os.path.relpath(d, ROOT).replace(os.sep, ".")
               for d, _, files in os.walk(os.path.join(ROOT, "utensil_ffi"))
               if "__init__.py" in files}
    assert found == on_disk and {"utensil_ffi.nn", "utensil_ffi.cli"} <= found


def test_the_console_scripts_name_functions_that_exist():
    tomllib = pytest.importorskip("tomllib")

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        scripts = tomllib.load(f)["project"]["scripts"]
    assert sorted(scripts) == ["utensil-export", "utensil-predict", "utensil-train"]
    for target in scripts.values():
        module, _, fn = target.partition(":")
        assert module.startswith("utensil_ffi.cli.")
        assert callable(getattr(importlib.import_module(module), fn))
