"""A ring of batch slots in one shared-memory segment: the Loader's workers write decoded batches
straight into it and the parent reads them where they lie (loader.py says when a slot is whose).

Why: a 128 x 3 x 32 x 32 float32 batch is 1.5 MB. Through a pipe the parent reads it into a
bytes object and unpickles it into an array, over a millisecond per batch on the thread that
drives training; a GPU that trains 40k images/s leaves about 3 ms per batch for everything.
Through a slot the parent receives a few bytes (which slot, how many rows) and wraps arrays
around memory the worker has already filled.

Layout: ``slots`` equal slots, each y int64 [capacity] then x float32 [capacity, *sample_shape],
rounded up to whole pages. A batch of b <= capacity rows uses the first b rows of both.

Lifetime: the parent creates the segment (``Ring``) and alone unlinks it (``Ring.unlink()``,
idempotent), which takes its name out of /dev/shm at once. The parent's mapping stays until the
last array handed out over it is gone: the arrays keep a small owner object alive rather than a
buffer export, so nothing ever fails to close (SharedMemory.close() raises BufferError while a
numpy array exports its buffer) and no array can outlive its memory. Workers attach by name
(``attach``), never unlink, and leave without closing.
"""

import math
import mmap
import os
import secrets
from multiprocessing import shared_memory

import numpy as np

__all__ = ["Ring", "attach"]


def _layout(capacity, sample_shape):
    """(bytes of y, bytes of one slot) for slots of ``capacity`` samples of ``sample_shape``."""
    y_bytes = capacity * 8  # y first: x then starts 8-byte aligned
    x_bytes = capacity * math.prod(sample_shape) * 4
    page = mmap.PAGESIZE
    return y_bytes, -(-(y_bytes + x_bytes) // page) * page


class _Mapping:
    """The parent's mapping of the segment. Arrays over it hold this object (through _Block), so
    the SharedMemory, whose own finalizer unmaps it, goes only with the last of them."""

    def __init__(self, shm):
        self.shm = shm
        probe = np.frombuffer(shm.buf, np.uint8)
        self.address = probe.__array_interface__["data"][0]
        del probe  # release the buffer export at once: shm.close() must never meet one


class _Block:
    """One array's worth of the mapping, as numpy's array interface; numpy keeps it as the base."""

    __slots__ = ("owner", "__array_interface__")

    def __init__(self, owner, offset, shape, typestr):
        self.owner = owner
        self.__array_interface__ = {"version": 3, "shape": shape, "typestr": typestr,
                                    "data": (owner.address + offset, False), "strides": None}


def _reserve(shm, size):
    # tmpfs allocates a page when it is first written; on a full /dev/shm (64 MB in a default
    # Docker container) that write kills the worker with SIGBUS. Reserving every page now makes
    # a lack of room an OSError here instead. SharedMemory keeps its descriptor private.
    fd = getattr(shm, "_fd", -1)
    if fd >= 0 and hasattr(os, "posix_fallocate"):
        os.posix_fallocate(fd, 0, size)


class Ring:
    """The parent's side: ``Ring(slots, capacity, sample_shape)`` creates the segment (OSError
    when the system has no room for it). ``spec`` is what a worker attaches with.
    ``acquire()`` -> a free slot or None, ``release(slot)``, ``rows(slot, b)`` -> (x, y) arrays
    over the slot's first b rows, ``unlink()``."""

    def __init__(self, slots, capacity, sample_shape):
        sample_shape = tuple(int(s) for s in sample_shape)
        y_bytes, slot_bytes = _layout(capacity, sample_shape)
        size = slots * slot_bytes
        # named after this process, so a segment left behind says whose it was
        name = "utensil_%x_%s" % (os.getpid(), secrets.token_hex(4))
        shm = shared_memory.SharedMemory(name=name, create=True, size=size)
        try:
            _reserve(shm, size)
        except BaseException:
            shm.close()
            shm.unlink()
            raise
        self.name = shm.name
        self.spec = (shm.name, slots, capacity, sample_shape)
        self._mapping = m = _Mapping(shm)
        self._unlinked = False
        self._x = [np.asarray(_Block(m, s * slot_bytes + y_bytes, (capacity,) + sample_shape,
                                     "<f4")) for s in range(slots)]
        self._y = [np.asarray(_Block(m, s * slot_bytes, (capacity,), "<i8"))
                   for s in range(slots)]
        self._free = list(range(slots))[::-1]  # popped from the end: slot 0 first

    def acquire(self):
        return self._free.pop() if self._free else None

    def release(self, slot):
        self._free.append(slot)

    def rows(self, slot, b):
        return self._x[slot][:b], self._y[slot][:b]

    def unlink(self):
        """Take the segment's name away (idempotent); the memory goes with the last array over
        it. Only once every process that may attach is gone: a worker attaching afterwards
        would register the name with the resource tracker again."""
        if not self._unlinked:
            self._unlinked = True
            self._x = self._y = self._free = []
            try:
                self._mapping.shm.unlink()
            except FileNotFoundError:  # someone cleaned /dev/shm by hand
                pass


class _Attached:
    def __init__(self, shm, x, y):
        self.shm, self.x, self.y = shm, x, y  # the SharedMemory must outlive the arrays


def attach(spec):
    """A worker's side of the ring ``spec`` names: ``.x[slot]`` float32 [capacity, *shape] and
    ``.y[slot]`` int64 [capacity], writable. Kept until the worker exits."""
    name, slots, capacity, sample_shape = spec
    y_bytes, slot_bytes = _layout(capacity, sample_shape)
    shm = shared_memory.SharedMemory(name=name)
    x = [np.ndarray((capacity,) + tuple(sample_shape), np.float32, shm.buf,
                    s * slot_bytes + y_bytes) for s in range(slots)]
    y = [np.ndarray((capacity,), np.int64, shm.buf, s * slot_bytes) for s in range(slots)]
    return _Attached(shm, x, y)
