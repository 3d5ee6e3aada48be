"""One exception tree for everything utensil raises.

Each class also inherits the builtin a user would catch anyway, so ``except ValueError`` keeps
working for bad shapes and ``except MemoryError`` for allocation failures::

    UtensilError
    ├── ArgumentError (ValueError)          a bad argument value (C status UT_ERR_ARG)
    │   ├── ArgumentTypeError (TypeError)   an argument of the wrong kind (a list for a Tensor...)
    │   └── ClosedError                     a closed tensor, layer or optimizer was used
    ├── ShapeError (ValueError)             mismatched or invalid shapes (UT_ERR_SHAPE)
    ├── OutOfMemoryError (MemoryError)      host or device allocation failed (UT_ERR_MEMORY)
    └── DeviceError (RuntimeError)          no such device, or the GPU runtime failed (UT_ERR_DEVICE)
"""

from ._lib import ffi, lib

__all__ = [
    "UtensilError",
    "ArgumentError",
    "ArgumentTypeError",
    "ClosedError",
    "ShapeError",
    "OutOfMemoryError",
    "DeviceError",
    "DistributedError",
    "check",
    "check_ptr",
    "check_status",
]


class UtensilError(Exception):
    """Root of every exception utensil raises. ``status`` is the C ut_status (0 if none)."""

    status = 0

    def __init__(self, message="", status=None):
        super().__init__(message)
        if status is not None:
            self.status = status


class ArgumentError(UtensilError, ValueError):
    """An argument has a value the operation cannot accept."""

    status = lib.UT_ERR_ARG


class ArgumentTypeError(ArgumentError, TypeError):
    """An argument is of the wrong kind (also a TypeError)."""


class ClosedError(ArgumentError):
    """A tensor, layer or optimizer was used after close()."""


class ShapeError(UtensilError, ValueError):
    """Shapes that do not fit the operation."""

    status = lib.UT_ERR_SHAPE


class OutOfMemoryError(UtensilError, MemoryError):
    """Host or device memory could not be allocated."""

    status = lib.UT_ERR_MEMORY


class DeviceError(UtensilError, RuntimeError):
    """The device is absent or its runtime reported an error."""

    status = lib.UT_ERR_DEVICE


class DistributedError(UtensilError, RuntimeError):
    """Processes of a distributed run disagree, are missing, or did not meet in time."""


_BY_STATUS = {
    lib.UT_ERR_ARG: ArgumentError,
    lib.UT_ERR_SHAPE: ShapeError,
    lib.UT_ERR_MEMORY: OutOfMemoryError,
    lib.UT_ERR_DEVICE: DeviceError,
}


def check(what, status=None, cls=None):
    """Raise the exception for the C library's last failure on this thread: its message, as the
    class its status names (``cls`` overrides that).

    ``status``: the negative ut_status a call returned, or None to read ut_last_status().
    """
    if status is None:
        status = int(lib.ut_last_status())
    msg = ffi.string(lib.ut_last_error()).decode("utf-8", "replace")
    cls = cls or _BY_STATUS.get(status, UtensilError)
    raise cls("%s: %s" % (what, msg or "failed (no message from the C library)"), status)


def check_ptr(p, what):
    """Return ``p`` (a pointer a C call returned), raising the right exception if it is NULL."""
    if p == ffi.NULL:
        check(what)
    return p


def check_status(rc, what):
    """Raise the right exception if a C call returned a negative ut_status."""
    if rc < 0:
        check(what, int(rc))
    return rc
