"""The flat package's module paths, still importable after issue 28 moved modules into sub-packages.

Until then every module sat directly in utensil_ffi/, and code, documentation, scripts and pickles
name those paths: ``from utensil_ffi.layers import Conv2d``, ``python -m utensil_ffi.train``,
``python -m utensil_ffi.selftest``, and a pickled Conv2d, which records
``utensil_ffi.layers.Conv2d`` and ``utensil_ffi.layers._rebuild_clayer``. MOVED says where each
of those modules lives now; a finder at the end of ``sys.meta_path`` (installed by the package's
``__init__``) answers an old name that no file answers any more:

- A module that moved whole is the SAME module object under its old name
  (``sys.modules["utensil_ffi.train"] is sys.modules["utensil_ffi.cli.train"]``): one set of
  globals, so a monkeypatch through either name is seen by both, and classes and functions are
  the same objects whichever name loaded them.
- A module that was split (``layers``) becomes a module of its own holding the union of the
  names of the modules it became, first listed first: ``utensil_ffi.layers.Conv2d`` is
  ``utensil_ffi.nn.conv.Conv2d``, ``utensil_ffi.layers._rebuild_clayer`` is
  ``utensil_ffi.nn._clayer._rebuild_clayer``. Assigning to its attributes changes nothing else.
- ``python -m utensil_ffi.<old name>``: runpy asks the finder's loader for code, and gets two
  lines that run the new module as ``__main__`` (``runpy.run_module``) under its own name, so
  relative imports, ``sys.argv[0]`` and multiprocessing's re-import in spawned workers see the
  new module, as ``python -m`` of the new name would.

Why a finder and not files: one table here instead of a shim file per old module (19 of them) at
the top of the package, which is the clutter the sub-packages are there to remove; and a shim
``from .cli.train import *`` would be a second module object, which a monkeypatch of one would
not reach. The finder answers only the names in MOVED, only under this package, and only after
the regular finders found nothing. ``data`` and ``distributed`` need no entry: they are packages
of the same name now, whose ``__init__`` holds the old module's names; so is ``models`` (now
torchvision's networks, utensil_ffi/models/), which holds nn.models' names but for
``mobilenet_v2``, whose layout is torchvision's there (the flat one is nn.models').
"""

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

# old module -> the module(s), relative to the package, that hold its code now (several: it
# was split, and the old name holds the union of their names)
MOVED = {
    # nn: layers and networks
    "layers": ("nn.module", "nn.parameter", "nn._clayer", "nn.conv", "nn.linear", "nn.norm",
               "nn.activation", "nn.pooling", "nn.container", "nn.loss", "_lifetime"),
    "amp": ("nn.amp",),
    "blocks": ("nn.blocks",),
    "sync_batchnorm": ("nn.sync_batchnorm",),
    # data
    "images": ("data.images",),
    "transforms": ("data.transforms",),
    "loader": ("data.loader",),
    "shm_ring": ("data.shm_ring",),
    # distributed
    "launch": ("distributed.launch",),
    # interop
    "torch": ("interop.torch",),
    "onnx_export": ("interop.onnx_export",),
    # cli
    "train": ("cli.train",),
    "train_data": ("cli.train_data",),
    "train_dist": ("cli.train_dist",),
    "export": ("cli.export",),
    "predict": ("cli.predict",),
    # testing
    "reference": ("testing.reference",),
    "selftest": ("testing.selftest",),
}

# what ``import utensil_ffi`` bound as attributes of the package before (``ut.layers``): the
# modules its own imports loaded. Imported again at once; the others load on first import.
EAGER = ("layers", "amp", "blocks", "sync_batchnorm")


def _union(name, targets):
    """A module named ``name`` holding every name of the modules ``targets`` (first wins)."""
    mod = types.ModuleType(name, "The names of %s, under the module path they had before "
                                 "issue 28 split the module (utensil_ffi._compat)."
                           % ", ".join(targets))
    public = []
    for target in targets:
        m = importlib.import_module(target)
        for k, v in vars(m).items():
            if not (k.startswith("__") and k.endswith("__")):
                mod.__dict__.setdefault(k, v)
        public += [k for k in getattr(m, "__all__", ()) if k not in public]
    mod.__all__ = public
    return mod


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finder and loader of the old module names of one package (see the module docstring)."""

    def __init__(self, package):
        self.package = package

    def _targets(self, fullname):
        parent, _, name = fullname.rpartition(".")
        if parent != self.package or name not in MOVED:
            return None
        return tuple("%s.%s" % (self.package, t) for t in MOVED[name])

    def find_spec(self, fullname, path=None, target=None):
        targets = self._targets(fullname)
        if targets is None:
            return None
        # origin: the new file, which python -m gives the old name as sys.argv[0] until the new
        # module runs (finding it imports the new module's package, not the module)
        new = importlib.util.find_spec(targets[0])
        return importlib.machinery.ModuleSpec(fullname, self, origin=new and new.origin,
                                              loader_state={"targets": targets})

    def create_module(self, spec):
        targets = spec.loader_state["targets"]
        if len(targets) > 1:
            return _union(spec.name, targets)
        mod = importlib.import_module(targets[0])
        spec.loader_state["own_spec"] = mod.__spec__
        return mod

    def exec_module(self, module):
        # importlib gave the module the old name's spec (module_from_spec sets __spec__ on
        # whatever create_module returned): a moved module keeps its own
        own = module.__spec__.loader_state.get("own_spec")
        if own is not None:
            module.__spec__ = own

    def get_code(self, fullname):
        """python -m <old name> (runpy): code running the new module as __main__ (__name__ is
        also passed on when it is not "__main__": multiprocessing's re-import of the main module
        in a spawned worker runs it as "__mp_main__", which must not start the program)."""
        targets = self._targets(fullname)
        if targets is None or len(targets) > 1:
            return None  # runpy: "No code object available"; a split module had no main
        src = "import runpy\nrunpy.run_module(%r, run_name=__name__, alter_sys=True)\n" % targets[0]
        return compile(src, "<%s, moved to %s>" % (fullname, targets[0]), "exec")


def install(package):
    """Answer ``package``'s old module names from now on; import the EAGER ones."""
    if not any(isinstance(f, _OldPaths) and f.package == package for f in sys.meta_path):
        sys.meta_path.append(_OldPaths(package))
    for name in EAGER:
        importlib.import_module("%s.%s" % (package, name))
