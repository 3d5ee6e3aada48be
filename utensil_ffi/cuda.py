"""Captured GPU work: record a training step once, replay it with one launch (CUDA graphs).

PyTorch's names and shape of use::

    g = ut.cuda.CUDAGraph()
    step()                      # once before recording: loads cuBLAS, sizes workspaces
    with ut.cuda.graph(g):      # record: the calls return, the GPU work is kept, not run
        loss = step()
    for x, y in batches:
        static_x.copy_from(x)   # the recorded inputs: write the next batch into them
        static_y.copy_from(y)
        g.replay()              # the whole step, one launch
        print(loss.item())      # the recorded outputs hold the replay's results

A replay runs the same kernels on the same memory: it reads whatever the recorded input tensors
hold then (tensors written on the host are uploaded first) and writes the same output tensors,
which the graph keeps alive until it is closed. Values decided on the host are recorded as they
were (a learning rate, Adam's bias correction, train/eval mode). While recording, reading a GPU
tensor on the host (``.item()``, ``.numpy()``) or uploading one raises, GPU calls from other
threads raise, and nothing may wait for the GPU (run the step once first). Rules in full:
``native/utensil.h``, "captured GPU work".
"""

import threading
import weakref

from ._errors import ClosedError, check, check_status
from ._lib import ffi, lib

__all__ = ["CUDAGraph", "graph", "is_current_stream_capturing", "empty_cache", "cached_bytes",
           "mem_get_info"]

# the thread recording now (the library allows one recording at a time), or None
_RECORDING_THREAD = [None]


def is_current_stream_capturing():
    """True while the calling thread records a CUDA graph (PyTorch's name): code that would
    wait for the GPU (reads, synchronize) must not run then."""
    return _RECORDING_THREAD[0] == threading.get_ident()


def empty_cache():
    """Hand the GPU memory utensil keeps cached for reuse back to the driver (PyTorch's name), so
    that PyTorch in the same process or another process can have it. Memory that live tensors or
    recorded graphs hold stays. A no-op without a GPU; raises while a graph is being recorded."""
    check_status(lib.ut_cuda_empty_cache(), "empty_cache")


def cached_bytes():
    """Bytes of freed GPU memory utensil keeps for its next allocations (0 without a GPU)."""
    return int(lib.ut_cuda_cached_bytes())


def mem_get_info():
    """``(free, total)`` bytes of the GPU (PyTorch's name); utensil's cached blocks count as free.
    Raises DeviceError without a GPU."""
    free, total = ffi.new("size_t*"), ffi.new("size_t*")
    check_status(lib.ut_cuda_mem_info(free, total), "mem_get_info")
    return int(free[0]), int(total[0])


def _free(holder):
    p = holder[0]
    holder[0] = ffi.NULL
    if p != ffi.NULL:
        lib.ut_cuda_graph_free(p)


class CUDAGraph:
    """A recording of the library's GPU work (``torch.cuda.CUDAGraph``): ``capture_begin``,
    ``capture_end``, ``replay``; ``close()`` (or ``with``) frees it and its device memory."""

    def __init__(self):
        self._holder = [ffi.NULL]
        self._lock = threading.Lock()
        self._recording = False
        self._finalizer = weakref.finalize(self, _free, self._holder)

    @property
    def recorded(self):
        """True once a recording has ended successfully (and the graph is not closed)."""
        return self._holder[0] != ffi.NULL

    def capture_begin(self):
        """Start recording the calling thread's GPU work."""
        with self._lock:
            if self._holder[0] != ffi.NULL:
                raise ClosedError("CUDAGraph.capture_begin: this graph holds a recording "
                                  "already; make a new CUDAGraph")
            check_status(lib.ut_cuda_graph_begin(), "CUDAGraph.capture_begin")
            self._recording = True
            _RECORDING_THREAD[0] = threading.get_ident()

    def capture_end(self):
        """End the recording; raises DeviceError (and keeps nothing) when it failed."""
        with self._lock:
            if not self._recording:
                raise ClosedError("CUDAGraph.capture_end: no recording was begun on this graph")
            self._recording = False
            _RECORDING_THREAD[0] = None
            p = lib.ut_cuda_graph_end()
            if p == ffi.NULL:
                check("CUDAGraph.capture_end")
            self._holder[0] = p

    def replay(self):
        """Run the recording again."""
        p = self._holder[0]
        if p == ffi.NULL:
            raise ClosedError("CUDAGraph.replay: nothing recorded (or the graph is closed)")
        check_status(lib.ut_cuda_graph_replay(p), "CUDAGraph.replay")

    def close(self):
        """Free the recording and the device memory it holds (idempotent)."""
        with self._lock:
            self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        state = "recorded" if self.recorded else ("recording" if self._recording else "empty")
        return "CUDAGraph(<%s>)" % state


class graph:
    """``with ut.cuda.graph(g):`` records the block into ``g`` (``torch.cuda.graph``). When the
    block raises, the recording is ended and dropped and the block's exception propagates."""

    def __init__(self, cuda_graph):
        if not isinstance(cuda_graph, CUDAGraph):
            raise TypeError("graph: expected a CUDAGraph, got %s" % type(cuda_graph).__name__)
        self.cuda_graph = cuda_graph

    def __enter__(self):
        self.cuda_graph.capture_begin()
        return self.cuda_graph

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.cuda_graph.capture_end()
            return False
        try:
            self.cuda_graph.capture_end()
        except Exception:  # the recording is broken by the block's failure; the block's error wins
            pass
        self.cuda_graph.close()
        return False
