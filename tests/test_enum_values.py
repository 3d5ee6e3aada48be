"""The enum values the bindings use are the C library's (issue 29, item 23).

cffi's ABI mode takes enum values from the cdef text, never from the library, so comparing
`lib.UT_X` with the cdef proves nothing: a library built with another value would pass. Here the
values are checked against (1) what a C compiler makes of native/utensil.h (a tiny program that
includes the header and prints every constant) and (2) what the loaded library itself returns
at run time (its status codes, its default dtype, its CPU backend). The seed
(shared/seed/000_6483ff59e30eca9d.txt) only uses the names (UT_CPU, UT_METAL, now UT_CUDA),
never their values, so it gives no fixture to compare with.
"""

import os
import re
import shutil
import subprocess

import pytest

from utensil_ffi import _lib
from utensil_ffi._lib import ffi, lib

HEADER = _lib.HEADER_PATH
CDEF = _lib.cdef_text(HEADER.read_text())


def cdef_enums(cdef):
    """{name: value} of every enumerator with an explicit value in a cdef."""
    return {k: int(v) for k, v in re.findall(r"\b(UT_[A-Z0-9_]+)\s*=\s*(-?\d+)", cdef)}


ENUMS = cdef_enums(CDEF)


def c_enum_values(names, header, tmp_path):
    """{name: value} as the C compiler sees them when a program includes `header`."""
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        pytest.skip("no C compiler (%s) to read the header's enum values with" % cc)
    src = tmp_path / "enums.c"
    src.write_text('#include <stdio.h>\n#include "%s"\nint main(void) {\n%s  return 0;\n}\n' % (
        header, "".join('  printf("%s %%d\\n", (int)%s);\n' % (n, n) for n in names)))
    exe = tmp_path / "enums"
    subprocess.run([cc, "-std=c11", str(src), "-o", str(exe)], check=True, timeout=120)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True, timeout=60).stdout
    return {k: int(v) for k, v in (line.split() for line in out.splitlines())}


def mismatches(cdef_values, c_values):
    return {n: (v, c_values.get(n)) for n, v in cdef_values.items() if c_values.get(n) != v}


def test_the_cdef_declares_every_enum():
    # UT_F32, UT_BF16 and UT_ACT_RELU6 have digits in their names (an earlier pattern missed them)
    assert {"UT_CPU", "UT_CUDA", "UT_OK", "UT_ERR_ARG", "UT_ERR_SHAPE", "UT_ERR_MEMORY",
            "UT_ERR_DEVICE", "UT_F32", "UT_BF16", "UT_ACT_NONE", "UT_ACT_RELU",
            "UT_ACT_RELU6"} <= set(ENUMS)


def test_enum_values_are_the_c_compilers(tmp_path):
    assert mismatches(ENUMS, c_enum_values(sorted(ENUMS), HEADER, tmp_path)) == {}
    # and cffi holds the cdef's values
    assert {n: getattr(lib, n) for n in ENUMS} == ENUMS


@pytest.mark.parametrize("name,wrong", [("UT_ERR_SHAPE", -7), ("UT_BF16", 5), ("UT_CUDA", 0)])
def test_a_cdef_with_another_value_is_caught(tmp_path, name, wrong):
    """The check above fails when the bindings and the C header disagree on one value."""
    altered = re.sub(r"\b%s\s*=\s*-?\d+" % name, "%s = %d" % (name, wrong), CDEF)
    assert cdef_enums(altered)[name] == wrong
    got = mismatches(cdef_enums(altered), c_enum_values(sorted(ENUMS), HEADER, tmp_path))
    assert got == {name: (wrong, ENUMS[name])}


def test_status_values_are_the_ones_the_library_returns():
    a = lib.ut_alloc(1, ffi.new("int[]", [2]), lib.UT_CPU)
    b = lib.ut_alloc(1, ffi.new("int[]", [2]), lib.UT_CPU)
    c = lib.ut_alloc(1, ffi.new("int[]", [3]), lib.UT_CPU)
    try:
        assert lib.ut_add_into(a, b) == lib.UT_OK
        assert lib.ut_add_into(a, c) == lib.UT_ERR_SHAPE
        assert lib.ut_add_into(a, ffi.NULL) == lib.UT_ERR_ARG
        assert lib.ut_last_status() == lib.UT_ERR_ARG
        assert a.dtype == lib.UT_F32  # the library's own default
    finally:
        for t in (a, b, c):
            lib.ut_free(t)


def test_device_values_are_the_ones_the_library_knows():
    assert ffi.string(lib.ut_backend_name(lib.UT_CPU)) == b"cpu"
    want = b"cuda" if lib.ut_cuda_available() else b"cpu"
    assert ffi.string(lib.ut_backend_name(lib.UT_CUDA)) == want
