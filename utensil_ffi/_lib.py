"""Locate, load and declare the C library (cffi ABI mode, in-line).

The declarations are not kept by hand: they are read at import from the header, between the
markers ``/* UT_CDEF_BEGIN */`` and ``/* UT_CDEF_END */``, so they cannot drift from the C side.

Where things are looked for, first match wins:

- the header: ``utensil_ffi/utensil.h`` (installed package), else ``native/utensil.h`` (checkout);
- the library: ``$UTENSIL_LIB`` (an absolute path), else ``utensil_ffi/libutensil.so``
  (installed package), else ``$BUILD_DIR/libutensil.so`` in the checkout (``build/`` by default).

A library built from another header version (``ut_version()`` != ``UT_VERSION``) is refused with
an ImportError that names both versions and the library's path.
"""

import os
import re
from pathlib import Path

import cffi

__all__ = ["ffi", "lib", "LIB_PATH", "HEADER_PATH", "HEADER_VERSION", "cdef_text"]

_PKG = Path(__file__).resolve().parent
_ROOT = _PKG.parent
_BEGIN = "/* UT_CDEF_BEGIN */"
_END = "/* UT_CDEF_END */"


def _find_header():
    for p in (_PKG / "utensil.h", _ROOT / "native" / "utensil.h"):
        if p.is_file():
            return p
    raise ImportError(
        "utensil_ffi: cannot find utensil.h (looked in %s and %s); reinstall the package or "
        "run it from a source checkout" % (_PKG, _ROOT / "native")
    )


def _find_library():
    env = os.environ.get("UTENSIL_LIB")
    if env:
        p = Path(env)
        if not p.is_absolute():
            raise ImportError("utensil_ffi: UTENSIL_LIB must be an absolute path, got %r" % env)
        if not p.is_file():
            raise ImportError("utensil_ffi: UTENSIL_LIB=%s does not exist" % env)
        return p
    build_dir = Path(os.environ.get("BUILD_DIR", "build"))
    if not build_dir.is_absolute():
        build_dir = _ROOT / build_dir
    candidates = (_PKG / "libutensil.so", build_dir / "libutensil.so")
    for p in candidates:
        if p.is_file():
            return p
    raise ImportError(
        "utensil_ffi: cannot find libutensil.so (looked in: %s). Install the package with "
        "`pip install .`, build it with `./build.sh`, or set UTENSIL_LIB to an absolute path."
        % ", ".join(str(c) for c in candidates)
    )


def cdef_text(header_text):
    """The cdef declarations between the UT_CDEF markers of ``header_text``, comments removed."""
    start = header_text.find(_BEGIN)
    end = header_text.find(_END)
    if start < 0 or end < start:
        raise ImportError("utensil_ffi: the header has no %s ... %s section" % (_BEGIN, _END))
    text = header_text[start + len(_BEGIN) : end]
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    return text


def header_version(header_text):
    m = re.search(r"^\s*#\s*define\s+UT_VERSION\s+(\d+)", cdef_text(header_text), flags=re.M)
    if not m:
        raise ImportError("utensil_ffi: the header does not #define UT_VERSION")
    return int(m.group(1))


def check_version(lib_version, hdr_version, lib_path):
    """Raise ImportError unless the library was built from the header version we declare."""
    if lib_version != hdr_version:
        raise ImportError(
            "utensil_ffi: %s was built from utensil.h version %s, but these bindings declare "
            "version %s. Rebuild the library (./build.sh, or reinstall with `pip install .`) "
            "or point UTENSIL_LIB at a matching build." % (lib_path, lib_version, hdr_version)
        )


def _load():
    header = _find_header()
    text = header.read_text()
    ffi = cffi.FFI()
    ffi.cdef(cdef_text(text))
    path = _find_library()
    # RTLD_NODELETE (the library is also linked -z nodelete): the library's worker threads may
    # still be running or parked in its code when the interpreter unloads it at exit.
    flags = ffi.RTLD_NOW | getattr(ffi, "RTLD_NODELETE", 0)
    try:
        lib = ffi.dlopen(str(path), flags)
    except OSError as e:
        raise ImportError("utensil_ffi: cannot load %s: %s" % (path, e)) from e
    try:
        lib_version = lib.ut_version()
    except AttributeError:
        raise ImportError("utensil_ffi: %s does not export ut_version(); is it libutensil?" % path)
    version = header_version(text)
    check_version(lib_version, version, path)
    return ffi, lib, path, header, version


# `lib` must stay referenced for the life of the process: collecting it would dlclose the library.
ffi, lib, LIB_PATH, HEADER_PATH, HEADER_VERSION = _load()
