"""The package's import graph: data flows one way (STYLE.md section 7).

    CLIs (predict -> export -> train, selftest) -> train_dist -> distributed, launch, torch
    -> package facade (__init__) -> onnx_export, images, loader -> models, data, transforms
    -> optim, blocks, sync_batchnorm -> layers -> functional -> tensor -> dlpack -> _args
    -> _errors -> _lib; reference (float64 numpy references of the ops, for selftest and the
    tests) imports nothing of the package; optable (the op table the self-check and the tests
    draw their cases from) sits above the facade, below selftest

Every import of a package module, at the top of a file or inside a function (a lazy import is
still an import), must name a module strictly below the importer; so there is no upward import
and no circle. A new module must be given its place in LAYERS.
"""

import ast
import os

import pytest

PACKAGE = "utensil_ffi"
ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), PACKAGE)

# bottom first; modules on one line may not import each other
LAYERS = [
    ["reference"],
    ["_lib"],
    ["_errors"],
    ["_args", "dtypes"],
    ["dlpack", "blas", "cuda"],
    ["tensor"],
    ["functional"],
    ["layers"],
    ["optim", "blocks", "sync_batchnorm", "amp"],
    ["models", "data", "transforms", "shm_ring"],
    ["onnx_export", "images", "loader"],
    ["__init__"],
    ["optable"],
    ["distributed", "launch", "torch", "train_data"],
    ["train_dist"],
    ["train", "selftest"],
    ["export"],
    ["predict"],
]
RANK = {m: i for i, layer in enumerate(LAYERS) for m in layer}


def _modules():
    return sorted(f[:-3] for f in os.listdir(ROOT) if f.endswith(".py"))


def package_imports(source, module):
    """[(line, imported package module)] of every import in ``source`` (the module ``module``)."""
    modules = set(_modules())
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] == PACKAGE:
                    out.append((node.lineno, parts[1] if len(parts) > 1 else "__init__"))
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                parts = (node.module or "").split(".")
                if parts[0] != PACKAGE:
                    continue
                base = parts[1:]
            else:
                if node.level > 1:  # the package is flat: ".." leaves it
                    raise AssertionError("%s:%d: relative import above the package"
                                         % (module, node.lineno))
                base = (node.module or "").split(".") if node.module else []
            if base:
                out.append((node.lineno, base[0]))
            else:  # from . import x: x is a module, or a name from the package facade
                for a in node.names:
                    out.append((node.lineno, a.name if a.name in modules else "__init__"))
    return out


def violations(source, module):
    """Messages for each import in ``source`` that does not go strictly down."""
    bad = []
    for line, target in package_imports(source, module):
        if target not in RANK:
            bad.append("%s:%d imports %s, which has no place in LAYERS" % (module, line, target))
        elif RANK[target] >= RANK[module]:
            bad.append("%s:%d imports %s, which is not below it" % (module, line, target))
    return bad


def test_every_module_has_a_place():
    assert sorted(set(_modules()) - set(RANK)) == []


@pytest.mark.parametrize("module", _modules())
def test_imports_only_go_down(module):
    with open(os.path.join(ROOT, module + ".py")) as f:
        source = f.read()
    assert violations(source, module) == []


def test_the_checker_sees_upward_lazy_and_circular_imports():
    lazy_up = "def f():\n    from .functional import matmul\n"
    assert violations(lazy_up, "tensor") == ["tensor:2 imports functional, which is not below it"]
    assert violations("from . import train\n", "models")
    assert violations("import utensil_ffi as ut\n", "layers")  # the facade is above everything
    assert violations("from utensil_ffi.models import mobilenet\n", "data")  # one layer: peers
    assert violations("from . import layers\n", "layers")  # itself
    assert violations("from .layers import Module\n", "optim") == []
