"""python -m utensil_ffi.selftest: runs, prints one table, exits 0 on pass and 1 on failure."""

import io
import subprocess
import sys
from pathlib import Path

import numpy as np

import utensil_ffi as ut
from utensil_ffi import selftest as S

ROOT = Path(__file__).resolve().parent.parent


def test_selftest_command_passes():
    r = subprocess.run([sys.executable, "-m", "utensil_ffi.selftest"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert any(l.split()[:2] == ["op", "device"] for l in lines)
    assert lines[-1] == "RESULT: PASS"
    for dev in ut.devices():  # every op with a backward on every present device
        ops = {l.split()[0] for l in lines if len(l.split()) > 1 and l.split()[1] == dev}
        assert ops == set(S.CASES), (dev, ops)
    assert "FAIL" not in r.stdout.replace("RESULT: PASS", "")


def test_selftest_does_not_import_pytest_or_torch():
    code = ("import sys, io, contextlib; import utensil_ffi.selftest as s; "
            "f = io.StringIO(); rc = 0\n"
            "with contextlib.redirect_stdout(f): rc = s.main(['--no-fd32'])\n"
            "bad = [m for m in ('pytest', 'torch', 'hypothesis') if m in sys.modules]\n"
            "print(rc, bad)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.stdout.strip() == "0 []", r.stdout + r.stderr


def test_selftest_fails_on_a_wrong_gradient(monkeypatch):
    """A backward that is slightly wrong, or an op that raises, gives FAIL rows and exit 1."""
    real = S.default_cases

    def cases(rng):
        cs = real(rng)
        lin = cs[[c.op for c in cs].index("linear")]
        opener = lin._opener

        def broken(dev):
            r = opener(dev)
            bwd = r.backward

            def backward(inputs, go):
                y, g = bwd(inputs, go)
                g["b"] = g["b"] * 1.01
                return y, g

            r.backward = backward
            return r

        lin._opener = broken
        relu = cs[[c.op for c in cs].index("relu")]

        def raising(dev):
            raise ut.DeviceError("simulated driver failure")

        relu._opener = raising
        return cs

    monkeypatch.setattr(S, "default_cases", cases)
    out = io.StringIO()
    rows = S.run(["cpu"], out=out)
    text = out.getvalue()
    failed = {r["op"] for r in rows if not r["passed"]}
    assert failed == {"linear", "relu"}, text
    assert "simulated driver failure" in text
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    assert S.main(["--device", "cpu", "--no-fd32"]) == 1


def test_nerr():
    assert S.nerr([1.0, 2.0], [1.0, 2.0]) == 0.0
    assert abs(S.nerr([1.0, 0.0], [0.0, 1.0]) - np.sqrt(2)) < 1e-12
    assert S.nerr([np.nan], [1.0]) == float("inf")
    assert S.nerr([1.0], [1.0, 2.0]) == float("inf")
