"""The cffi declarations match the C library: every function reachable, every struct laid out
the same, and a library from another header version refused at import. (Enum values:
test_enum_values.py.)"""

import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

import utensil_ffi as ut
from utensil_ffi import _lib
from utensil_ffi._lib import ffi, lib

CDEF = _lib.cdef_text(_lib.HEADER_PATH.read_text())
FUNCTIONS = sorted(set(re.findall(r"\b(ut_\w+)\s*\(", CDEF)) - {"release"})
STRUCTS = sorted(set(re.findall(r"typedef\s+struct\s+(\w+)\s*\{", CDEF)))
PKG_DIR = os.path.dirname(os.path.dirname(ut.__file__))


def test_header_declares_the_api():
    assert len(FUNCTIONS) > 50 and len(STRUCTS) >= 12
    assert "ut_conv2d_forward" in FUNCTIONS and "ut_tensor" in STRUCTS


@pytest.mark.parametrize("name", FUNCTIONS)
def test_function_is_reachable(name):
    fn = getattr(lib, name)  # AttributeError if the library does not export it
    assert ffi.typeof(fn).kind == "function"


@pytest.mark.parametrize("name", STRUCTS)
def test_struct_layout_matches_c(name):
    size = lib.ut_type_size(name.encode())
    assert size != -1, "the C library does not report the layout of %s" % name
    assert ffi.sizeof(name) == size
    for field, _ in ffi.typeof(name).fields:
        off = lib.ut_field_offset(name.encode(), field.encode())
        assert off != -1, "the C library does not report %s.%s" % (name, field)
        assert ffi.offsetof(name, field) == off, "%s.%s" % (name, field)


def test_layout_query_rejects_unknown_names():
    assert lib.ut_type_size(b"no_such_type") == -1
    assert lib.ut_field_offset(b"ut_tensor", b"no_such_field") == -1
    assert lib.ut_field_offset(b"ut_tensor", ffi.NULL) == -1


def test_version_matches():
    assert lib.ut_version() == _lib.HEADER_VERSION == ut.__c_version__
    assert ut.library_path.is_file()


def test_check_version_message():
    _lib.check_version(3, 3, "/x/libutensil.so")
    with pytest.raises(ImportError) as info:
        _lib.check_version(2, 3, "/x/libutensil.so")
    msg = str(info.value)
    assert "/x/libutensil.so" in msg and "version 2" in msg and "version 3" in msg


def test_cdef_text_strips_comments():
    text = "x /* UT_CDEF_BEGIN */\n#define UT_VERSION 7 /* c */\nint f(void); // g\n/* UT_CDEF_END */ y"
    assert "/*" not in _lib.cdef_text(text) and "//" not in _lib.cdef_text(text)
    assert _lib.header_version(text) == 7
    with pytest.raises(ImportError):
        _lib.cdef_text("no markers")


def _import_with(env_extra):
    # keep the caller's PYTHONPATH: it may be where numpy or cffi come from
    path = os.pathsep.join([PKG_DIR] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    env = dict(os.environ, PYTHONPATH=path, **env_extra)
    return subprocess.run([sys.executable, "-c", "import utensil_ffi"], capture_output=True,
                          text=True, timeout=60, env=env)


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")
def test_mismatched_library_fails_loudly_at_import(tmp_path):
    """A library built from another header version is refused with both versions and the path."""
    src = tmp_path / "fake.c"
    src.write_text("int ut_version(void) { return %d; }\n" % (_lib.HEADER_VERSION + 41))
    so = tmp_path / "libfake.so"
    cc = shutil.which("cc") or shutil.which("gcc")
    subprocess.run([cc, "-shared", "-fPIC", str(src), "-o", str(so)], check=True)
    r = _import_with({"UTENSIL_LIB": str(so)})
    assert r.returncode != 0
    assert "ImportError" in r.stderr
    assert str(so) in r.stderr
    assert "version %d" % (_lib.HEADER_VERSION + 41) in r.stderr
    assert "version %d" % _lib.HEADER_VERSION in r.stderr


def test_utensil_lib_override(tmp_path):
    r = _import_with({"UTENSIL_LIB": str(ut.library_path)})
    assert r.returncode == 0, r.stderr
    r = _import_with({"UTENSIL_LIB": "relative/libutensil.so"})
    assert r.returncode != 0 and "absolute path" in r.stderr
    r = _import_with({"UTENSIL_LIB": str(tmp_path / "missing.so")})
    assert r.returncode != 0 and "does not exist" in r.stderr
    (tmp_path / "junk.so").write_text("not a library")
    r = _import_with({"UTENSIL_LIB": str(tmp_path / "junk.so")})
    assert r.returncode != 0 and "cannot load" in r.stderr
