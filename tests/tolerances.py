"""assert_close: a float32 result against its float64 reference (utensil_ffi.reference), and the
record of the worst error per op that conftest.py prints at the end of the run."""

import numpy as np

WORST = {}


def assert_close(op, got, ref, rtol=1e-4, atol=1e-5):
    """assert_allclose with float32 tolerances (atol scaled by ref's magnitude); records the error."""
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape, "%s: shape %s, expected %s" % (op, got.shape, ref.shape)
    scale = float(np.max(np.abs(ref))) if ref.size else 0.0
    err = float(np.max(np.abs(got - ref))) / max(scale, 1e-30) if ref.size else 0.0
    WORST[op] = max(WORST.get(op, 0.0), err)
    np.testing.assert_allclose(got, ref, rtol=rtol, atol=atol * max(scale, 1.0), err_msg=op)
