"""What checks the library: the float64 reference and the installation's self-check.

    reference.py   float64 numpy references of every op (numpy only, never calls utensil)
    selftest.py    python -m utensil_ffi.testing.selftest: every op on every device against it

Nothing is imported here, so ``python -m utensil_ffi.testing.selftest`` runs it once.
"""
