"""The package's import graph: data flows one way (STYLE.md section 7).

    CLIs (cli.predict -> cli.export -> cli.train, testing.selftest) -> cli.train_data,
    cli.train_dist, cli.checkpoint -> distributed, interop.torch -> package facade (__init__)
    -> _compat -> data, interop
    -> optim, nn.models -> nn (the package) -> nn's layers -> functional -> tensor -> dlpack,
    blas, cuda -> _args, dtypes, _lifetime -> _errors -> _lib; testing.reference (float64 numpy
    references of the ops, for selftest and the tests) imports nothing of the package; testing.optable (the op table the
    self-check and the tests draw their cases from) sits above the facade, below selftest

Every import of a package module, at the top of a file or inside a function (a lazy import is
still an import), must name a module strictly below the importer; so there is no upward import
and no circle. Importing a module of a sub-package from outside it runs that sub-package's
__init__ first, so that counts as importing the sub-package too (``from ..nn.conv import
Conv2d`` in optim imports "nn" and "nn.conv"); from inside, the sub-package is already being
imported. A module is named by its dotted path under the package ("nn.conv"), a sub-package's
__init__ by the sub-package's name ("nn"), the package's own by "__init__". A new module must
be given its place in LAYERS.

_compat (the old flat module paths) imports the modules its table names by name, at run time,
when an old path is imported: those imports are not statements, and not checked here.
"""

import ast
import os

import pytest

PACKAGE = "utensil_ffi"
ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), PACKAGE)

# bottom first; modules on one line may not import each other
LAYERS = [
    ["testing.reference"],
    ["_lib"],
    ["_errors"],
    ["_args", "dtypes", "_lifetime"],
    ["dlpack", "blas", "cuda"],
    ["tensor"],
    ["functional"],
    ["nn.module", "nn.parameter", "nn.fold"],
    ["nn._clayer", "nn.activation", "nn.pooling", "nn.container", "nn.loss", "nn.dropout"],
    ["nn.conv", "nn.linear", "nn.norm", "nn.blocks", "nn.amp"],
    ["nn.sync_batchnorm", "nn.squeeze_excitation"],
    ["nn"],
    ["optim.lr_scheduler", "optim.swa_utils"],
    ["optim", "nn.models"],
    ["models._utils"],
    ["models._blocks"],
    ["models.mobilenetv2", "models.mobilenetv3", "models.efficientnet", "models.mnasnet",
     "models.convnext"],
    ["models"],
    ["data.datasets", "data.transforms", "data.shm_ring", "interop", "cli", "testing"],
    ["data", "data.images", "data.loader", "interop.onnx_export"],
    ["_compat"],
    ["__init__"],
    ["testing.optable"],
    ["distributed.data_parallel", "distributed.launch", "interop.torch"],
    ["distributed"],
    ["cli.paths", "cli.metrics", "cli.image_limits", "cli._warn"],
    ["cli.archs"],
    ["cli.train_data", "cli.train_dist", "cli.checkpoint", "cli.train_recipe"],
    ["cli.train", "testing.selftest"],
    ["cli.export"],
    ["cli.predict"],
]
RANK = {m: i for i, layer in enumerate(LAYERS) for m in layer}


def _modules():
    """The dotted name of every module of the package (see the module docstring)."""
    out = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = sorted(d for d in dirs if os.path.isfile(os.path.join(folder, d, "__init__.py")))
        rel = os.path.relpath(folder, ROOT)
        pkg = "" if rel == "." else rel.replace(os.sep, ".")
        for f in files:
            if f.endswith(".py"):
                name = f[:-3]
                if name == "__init__":
                    out.append(pkg or "__init__")
                else:
                    out.append(pkg + "." + name if pkg else name)
    return sorted(out)


def _package_of(module):
    """The sub-package a module is in ("" for the package itself)."""
    if module == "__init__":
        return ""
    if os.path.isfile(os.path.join(ROOT, *module.split("."), "__init__.py")):
        return module  # a sub-package's __init__
    return module.rpartition(".")[0]


def package_imports(source, module):
    """[(line, imported package module)] of every import in ``source`` (the module ``module``),
    the sub-packages whose __init__ the import runs included."""
    modules = set(_modules())
    here = _package_of(module)

    def name(dotted):  # "" is the package facade
        return dotted or "__init__"

    def targets(dotted):
        """dotted (a module or a sub-package) and the sub-packages above it, seen from here."""
        parts = dotted.split(".") if dotted else []
        out = []
        for i in range(1, len(parts)):
            pkg = ".".join(parts[:i])
            if not (here == pkg or here.startswith(pkg + ".")):
                out.append(pkg)
        return out + [name(dotted)]

    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] == PACKAGE:
                    out += [(node.lineno, t) for t in targets(".".join(parts[1:]))]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                parts = (node.module or "").split(".")
                if parts[0] != PACKAGE:
                    continue
                base = ".".join(parts[1:])
            else:
                up = here.split(".") if here else []
                if node.level - 1 > len(up):
                    raise AssertionError("%s:%d: relative import above the package"
                                         % (module, node.lineno))
                base = ".".join(up[:len(up) - (node.level - 1)] + (
                    node.module.split(".") if node.module else []))
            for a in node.names:  # from base import x: x is a module, or a name of base
                sub = base + "." + a.name if base else a.name
                out += [(node.lineno, t) for t in targets(sub if sub in modules else base)]
    return sorted(set(out))


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


def _path(module):
    parts = [] if module == "__init__" else module.split(".")
    pkg = os.path.join(ROOT, *parts, "__init__.py")
    return pkg if os.path.isfile(pkg) else os.path.join(ROOT, *parts) + ".py"


@pytest.mark.parametrize("module", _modules())
def test_imports_only_go_down(module):
    with open(_path(module)) as f:
        source = f.read()
    assert violations(source, module) == []


def test_the_checker_sees_upward_lazy_and_circular_imports():
    lazy_up = "def f():\n    from .functional import matmul\n"
    assert violations(lazy_up, "tensor") == ["tensor:2 imports functional, which is not below it"]
    assert violations("from ..cli import train\n", "nn.models")
    assert violations("import utensil_ffi as ut\n", "nn.module")  # the facade is above everything
    assert violations("from utensil_ffi.nn.models import mobilenet\n", "optim")  # one layer: peers
    assert violations("from . import module\n", "nn.module")  # itself
    assert violations("from ..nn.module import Module\n", "optim") == []  # optim: a package
    # from outside, a sub-package's module brings its __init__, which is above nn.module
    assert package_imports("from ..nn.module import Module\n", "cli.train") == [
        (1, "nn"), (1, "nn.module")]
    assert violations("from ..nn.module import Module\n", "nn.blocks") == []  # from inside
    assert violations("from .. import nn\n", "nn.module")
    assert violations("from ..data import DataError\n", "data.images")  # the package's __init__
    with pytest.raises(AssertionError, match="above the package"):
        package_imports("from ... import tensor\n", "nn.module")
