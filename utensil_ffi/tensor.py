"""Tensor: a Python handle on one reference to a C ut_tensor (float32, row-major, CPU or CUDA).

Every C call on a Tensor holds its pointer for the call and close() defers a free another
thread's call would meet: _lifetime.py's protocol, followed here through _hold, _let_go, _close.
"""

import weakref

import numpy as np

from . import _args
from . import dlpack as _dlpack
from . import dtypes as _dtypes
from ._errors import ArgumentTypeError, ClosedError, ShapeError, check_ptr, check_status
from ._lib import ffi, lib
from ._lifetime import _EXITING, _close, _hold, _let_go

__all__ = [
    "Tensor",
    "tensor",
    "from_numpy",
    "from_dlpack",
    "zeros",
    "ones",
    "full",
    "randn",
    "seed",
    "devices",
    "cuda_available",
    "set_num_threads",
    "get_num_threads",
    "live_tensors",
    "live_bytes",
    "peak_live_bytes",
    "empty_host_cache",
    "host_cached_bytes",
    "synchronize",
]


def _release(ptr):
    lib.ut_free(ptr)


def _release_view(ptr):
    lib.ut_view_close(ptr)
    lib.ut_free(ptr)


def _track_writes(ptr):
    """Tell C that every write to ptr's values from Python is seen (library calls, copy_from,
    and the writable views, which _HostView and DLPack export announce), so the CPU backend may
    keep what it derives from them (a weight's packed GEMM panels). Not for borrowed memory."""
    if not ptr.borrowed:
        lib.ut_track_writes(ptr)


class _HostView:
    """The base object of the arrays Tensor.numpy() returns.

    It owns its own C reference (ut_retain), so the memory stays valid for as long as any array
    made from it lives, whatever happens to the Tensor (deleted, collected or closed).
    """

    __slots__ = ("__array_interface__", "_finalizer", "__weakref__")

    def __init__(self, ptr, readonly):
        lib.ut_retain(ptr)
        if not readonly:  # writes through it are unseen while it lives (ut_view_open)
            lib.ut_view_open(ptr)
        self._finalizer = weakref.finalize(self, _release if readonly else _release_view, ptr)
        self._finalizer.atexit = False
        s = ptr.shape
        shape = tuple(ffi.unpack(s.shape, s.ndim))
        self.__array_interface__ = {
            "version": 3,
            "shape": shape,
            "typestr": "<f4",
            "data": (int(ffi.cast("uintptr_t", ptr.data)), bool(readonly)),
            "strides": None,
        }


_new_object = object.__new__


class Tensor:
    """A float32 (or bfloat16, see utensil.dtypes) tensor on "cpu" or "cuda".

    ``Tensor(data, device="cpu", dtype=None)`` copies array-like ``data`` (any real dtype,
    converted to float32, or rounded to bfloat16 with ``dtype=utensil.bfloat16``). The Python
    object owns exactly one reference to the C tensor; ``close()`` (or leaving a ``with`` block)
    drops it now, otherwise the garbage collector does. Methods on a closed tensor raise
    ClosedError (a ValueError).
    """

    __slots__ = ("_ptr", "_shape", "__weakref__")

    def __init__(self, data, device="cpu", dtype=None):
        self._ptr = None
        dev = _args.parse_device(device)
        dt = _dtypes.float32 if dtype is None else _dtypes.parse_dtype(dtype)
        arr = _args.to_float_array(data)
        shape = ffi.new("int[]", arr.shape)
        p = check_ptr(lib.ut_from_data(arr.ndim, shape, ffi.from_buffer("float[]", arr), dev),
                      "Tensor")
        if dt is not _dtypes.float32:
            q = lib.ut_to_dtype(p, dt.code)
            lib.ut_free(p)
            p = check_ptr(q, "Tensor")
        _track_writes(p)
        self._ptr = p

    # -- ownership ------------------------------------------------------------------------------
    # The object owns one C reference in _ptr (None once closed). A plain __del__ rather than
    # weakref.finalize: wrapping every op's result must be cheap (finalize costs ~1-2 us).
    def _adopt(self, ptr):
        self._ptr = ptr

    @classmethod
    def _wrap(cls, ptr):
        """A Tensor owning ``ptr``'s reference (a pointer a C op returned: rc already counts us)."""
        t = _new_object(cls)
        t._ptr = ptr
        return t

    @classmethod
    def _borrow(cls, ptr):
        """A Tensor holding a new reference to a borrowed pointer (a layer's weight)."""
        t = _new_object(cls)
        t._ptr = lib.ut_retain(ptr)
        _track_writes(ptr)
        return t

    def __del__(self, _free=lib.ut_free, _exiting=_EXITING):
        try:
            p = self._ptr
        except AttributeError:  # __init__ failed before setting it
            return
        if p is not None:
            self._ptr = None
            if not _exiting[0]:
                _free(p)

    @property
    def ptr(self):
        """The underlying ``ut_tensor*`` (cdata); raises ClosedError once closed."""
        try:
            p = self._ptr
        except AttributeError:
            p = None
        if p is None:
            raise ClosedError("operation on a closed Tensor")
        return p

    @property
    def closed(self):
        return getattr(self, "_ptr", None) is None

    def close(self):
        """Drop this object's reference now (idempotent). numpy views keep their own."""
        _close(self)

    def __enter__(self):
        self.ptr
        return self

    def __exit__(self, *exc):
        self.close()

    # -- description ----------------------------------------------------------------------------
    # Even reading the struct is done under _hold: a close() from another thread must not free it
    # between reading ndim and the dimensions.
    @property
    def shape(self):
        # a C tensor's shape never changes, so it is read once per pointer (optimizers and
        # containers ask for it on every step)
        try:
            ptr, shape = self._shape
            if ptr is self._ptr and ptr is not None:
                return shape
        except AttributeError:
            pass
        p = _hold(self)
        try:
            shape = tuple(ffi.unpack(p.shape.shape, p.shape.ndim))
        finally:
            _let_go(p)
        self._shape = (p, shape)
        return shape

    @property
    def ndim(self):
        p = _hold(self)
        try:
            return p.shape.ndim
        finally:
            _let_go(p)

    @property
    def size(self):
        p = _hold(self)
        try:
            return p.shape.nelem
        finally:
            _let_go(p)

    def numel(self):
        return self.size

    def __len__(self):
        return self.shape[0]

    @property
    def dtype(self):
        """utensil.float32 or utensil.bfloat16 (utensil.float32 == numpy.float32)."""
        p = _hold(self)
        try:
            return _dtypes.from_code(p.dtype)
        finally:
            _let_go(p)

    def is_floating_point(self):
        return True

    @property
    def device(self):
        p = _hold(self)
        try:
            return _args.device_name(p.dev)
        finally:
            _let_go(p)

    def __repr__(self):
        if self.closed:
            return "Tensor(<closed>)"
        body = np.array2string(
            self.numpy(), separator=", ", threshold=64, edgeitems=3, precision=4, prefix="Tensor("
        )
        return "Tensor(%s, shape=%s, device=%r)" % (body, self.shape, self.device)

    # -- host access ----------------------------------------------------------------------------
    def numpy(self):
        """A zero-copy numpy view of the host copy.

        CPU tensors: a writable view; writes are seen by later ops.
        CUDA tensors: the host copy is brought up to date first and the view is READ-ONLY: a
        snapshot valid until the next GPU op writes this tensor. Use copy_from() to write.
        bfloat16 tensors: a float32 view of the values (numpy has no bfloat16), READ-ONLY
        everywhere, so that every value stays a bfloat16 one; copy_from() rounds.
        The view keeps the memory alive by itself, even after this Tensor is closed or deleted.
        """
        p = _hold(self)
        try:
            # A CPU tensor's host copy is its only copy, so the read-only sync suffices; it leaves
            # the version alone: reading (print, item, np.asarray) between a layer's forward and
            # backward is fine, and writes through the view are not tracked anyway.
            check_status(lib.ut_sync_cpu_readonly(p), "Tensor.numpy")
            owner = _HostView(p, readonly=p.dev != lib.UT_CPU or p.dtype != lib.UT_F32)
        finally:
            _let_go(p)
        return np.asarray(owner)

    def __array__(self, dtype=None, copy=None):
        if copy is not None and not isinstance(copy, (bool, np.bool_)):
            raise ArgumentTypeError("__array__: copy must be None, True or False, got %r" % (copy,))
        if dtype is not None:
            try:
                dtype = np.dtype(dtype)
            except (TypeError, ValueError):  # ValueError: an object with an odd .dtype
                raise ArgumentTypeError("__array__: %r is not a numpy dtype" % (dtype,)) from None
        if copy is False and (self.device != "cpu" or self.dtype is not _dtypes.float32):
            raise ValueError("a CUDA or bfloat16 tensor cannot be viewed writable without a copy")
        a = self.numpy()
        if dtype is not None and dtype != a.dtype:
            return a.astype(dtype)
        return a.copy() if copy else a

    # -- DLPack (see dlpack.py) -----------------------------------------------------------------
    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        """A DLPack capsule sharing this tensor's memory (CPU host memory or CUDA device memory).

        Per the DLPack 1.x Python specification; the capsule keeps the memory alive."""
        return _dlpack.to_dlpack(self, stream, max_version, dl_device, copy)

    def __dlpack_device__(self):
        return _dlpack.dlpack_device(self)

    def tolist(self):
        return self.numpy().tolist()

    def item(self):
        """The value of a one-element tensor as a Python float."""
        if self.size != 1:
            raise ShapeError("item() needs a tensor with one element, shape is %s" % (self.shape,))
        return float(self.numpy().reshape(-1)[0])

    def copy_from(self, data):
        """Overwrite the values with ``data`` (array-like or Tensor of the same shape), in place.

        Works for every device: the host copy is made the owner first, so the GPU sees the write.
        """
        # The shape rule is this method's own (the C copy only needs equal element counts).
        if isinstance(data, Tensor):
            q = _hold(data)
            try:
                p = _hold(self)
                try:
                    if not _same_shape(p, q):
                        raise ShapeError("copy_from: shape %s into %s" % (_shape(q), _shape(p)))
                    if q.dev == p.dev:
                        check_status(lib.ut_copy_into(p, q), "copy_from")
                        return self
                finally:
                    _let_go(p)
            finally:
                _let_go(q)
            data = data.numpy()  # from the other device: through the host
        arr = _args.to_float_array(data)
        p = _hold(self)
        try:
            if arr.shape != _shape(p):
                raise ShapeError("copy_from: shape %s into %s" % (arr.shape, _shape(p)))
            if p.dtype != lib.UT_F32:
                arr = _dtypes.round_bf16(arr)
            check_status(lib.ut_sync_cpu(p), "copy_from")
            ffi.memmove(p.data, ffi.from_buffer("float[]", arr), arr.nbytes)
            if p.shared:  # others read the device memory directly: they must see the write now
                check_status(lib.ut_sync_gpu(p), "copy_from")
        finally:
            _let_go(p)
        return self

    # -- devices --------------------------------------------------------------------------------
    def to(self, *args, device=None, dtype=None):
        """This tensor on a device and/or as a dtype, as in PyTorch: ``t.to("cuda")``,
        ``t.to(utensil.bfloat16)``, ``t.to("cuda", utensil.bfloat16)``. ``self`` when nothing
        changes, else a new tensor (bfloat16 from float32: rounded to nearest even)."""
        if len(args) > 2:
            raise ArgumentTypeError("Tensor.to: at most a device and a dtype, got %d arguments"
                                    % len(args))
        for a in args:
            if _dtypes.is_dtype_like(a):
                if dtype is not None:
                    raise ArgumentTypeError("Tensor.to: two dtypes given")
                dtype = a
            else:
                if device is not None:
                    raise ArgumentTypeError("Tensor.to: two devices given")
                device = a
        if args and device is None and dtype is None:
            _args.parse_device(None)  # to(None) names nothing: the usual device error
        p = _hold(self)
        try:
            dev = p.dev if device is None else _args.parse_device(device)
            dt = p.dtype if dtype is None else _dtypes.parse_dtype(dtype).code
            if p.dev == dev and p.dtype == dt:
                return self
            out = Tensor._wrap(check_ptr(lib.ut_to_dtype(p, dt), "Tensor.to"))
        finally:
            _let_go(p)
        if dev != out.ptr.dev:
            try:
                check_status(lib.ut_to_device(out.ptr, dev), "Tensor.to")
            except BaseException:
                out.close()
                raise
        return out

    def cpu(self):
        return self.to("cpu")

    def cuda(self):
        return self.to("cuda")

    def float(self):
        """This tensor as float32 (``self`` when it is)."""
        return self.to(dtype=_dtypes.float32)

    def bfloat16(self):
        """This tensor as bfloat16 (``self`` when it is)."""
        return self.to(dtype=_dtypes.bfloat16)

    def sync(self):
        """Wait for the tensor's device data and bring the host copy up to date (read-only)."""
        p = _hold(self)
        try:
            check_status(lib.ut_sync_cpu_readonly(p), "Tensor.sync")
        finally:
            _let_go(p)
        return self

    # -- ops ------------------------------------------------------------------------------------
    def clone(self):
        p = _hold(self)
        try:
            return Tensor._wrap(check_ptr(lib.ut_copy(p), "Tensor.clone"))
        finally:
            _let_go(p)

    def reshape(self, *shape):
        """A copy with a new shape holding the same number of elements."""
        if len(shape) == 1 and not isinstance(shape[0], (int, np.integer)):
            shape = shape[0]
        if isinstance(shape, (int, np.integer)):
            shape = (shape,)
        try:
            dims = list(shape)
        except TypeError:
            raise ArgumentTypeError("reshape: shape must be a sequence of ints, got %r"
                                    % (shape,)) from None
        dims = [_args.to_int(d, "shape[%d]" % i, -_args.INT_MAX - 1) for i, d in enumerate(dims)]
        p = _hold(self)
        try:
            if dims.count(-1) == 1:  # -1 is Python's: the C call takes the dimensions themselves
                n = p.shape.nelem
                known = 1
                for d in dims:
                    if d != -1:
                        known *= _args.to_int(d, "shape", 1)
                if n % known:
                    raise ShapeError("cannot reshape %s into %s" % (_shape(p), tuple(shape)))
                dims[dims.index(-1)] = n // known
            dims = _args.to_shape(dims)
            c = ffi.new("int[]", dims)
            return Tensor._wrap(check_ptr(lib.ut_reshape(p, len(dims), c), "reshape"))
        finally:
            _let_go(p)

    def transpose(self, d0, d1):
        p = _hold(self)
        try:
            nd = p.shape.ndim  # negative dimensions are Python's; C checks the range
            d0 = _args.to_int(d0, "d0", -nd, nd - 1) % nd
            d1 = _args.to_int(d1, "d1", -nd, nd - 1) % nd
            return Tensor._wrap(check_ptr(lib.ut_transpose(p, d0, d1), "transpose"))
        finally:
            _let_go(p)

    def fill_(self, value):
        value = _args.to_float(value, "value", finite=False)
        p = _hold(self)
        try:
            check_status(lib.ut_fill(p, value), "fill_")
        finally:
            _let_go(p)
        return self

    def zero_(self):
        return self.fill_(0.0)

    def add_(self, other):
        """self += other (a Tensor on the same device with the same number of elements)."""
        if not isinstance(other, Tensor):
            raise ArgumentTypeError("add_: expected a Tensor, got %s" % type(other).__name__)
        p = _hold(self)
        try:
            q = _hold(other)
            try:
                check_status(lib.ut_add_into(p, q), "add_")
            finally:
                _let_go(q)
        finally:
            _let_go(p)
        return self

    def mul_(self, alpha):
        alpha = _args.to_float(alpha, "alpha", finite=False)
        p = _hold(self)
        try:
            check_status(lib.ut_scale(p, alpha), "mul_")
        finally:
            _let_go(p)
        return self

    def __matmul__(self, other):
        """``self @ other``: [M, K] @ [K, N] -> [M, N] (``other`` may be an array-like)."""
        b = other if isinstance(other, Tensor) else Tensor(other, self.device)
        try:
            return Tensor._wrap(check_ptr(lib.ut_matmul(self.ptr, b.ptr), "matmul"))
        finally:
            if b is not other:
                b.close()

    # -- copy and pickle ------------------------------------------------------------------------
    # copy.copy is a deep copy too: a shallow copy would duplicate the C pointer without a
    # reference (a double free, then a later tensor aliased). Neither shares memory with self.
    def __copy__(self):
        """``copy.copy(t)``: a new tensor with the same values on the same device (= clone)."""
        return self.clone()

    def __deepcopy__(self, memo):
        """``copy.deepcopy(t)``: a new tensor with the same values on the same device."""
        new = self.clone()
        memo[id(self)] = new
        return new

    def __reduce_ex__(self, protocol):
        """Pickle the values, shape, device and dtype; a CUDA tensor unpickles onto the GPU and
        raises DeviceError where there is none. A closed tensor raises ClosedError."""
        if self.dtype is _dtypes.float32:
            return (_rebuild_tensor, (_host_copy(self), self.device))
        return (_rebuild_tensor, (_host_copy(self), self.device, self.dtype.name))


def _shape(p):
    """The shape of a held ut_tensor* as a tuple."""
    return tuple(ffi.unpack(p.shape.shape, p.shape.ndim))


def _same_shape(p, q):
    return _shape(p) == _shape(q)


def _host_copy(t):
    """A float32 numpy copy of ``t``'s values (ClosedError if closed)."""
    return np.array(t.numpy(), dtype=np.float32, copy=True)


def _unpickle_device(device):
    """The C device for an unpickled tensor; a clear DeviceError for "cuda" without a GPU."""
    if device != "cpu" and not lib.ut_cuda_available():
        from ._errors import DeviceError

        raise DeviceError(
            "cannot unpickle a tensor saved on %r: no CUDA GPU is available here (the library "
            "was built without CUDA, or no GPU is present); pickle it from the CPU instead "
            "(tensor.cpu(), layer.to('cpu'))" % (device,)
        )
    return _args.parse_device(device)


def _rebuild_tensor(data, device, dtype=None):
    """Unpickle a Tensor (see Tensor.__reduce_ex__)."""
    _unpickle_device(device)
    return Tensor(data, device, dtype)


# -- construction -------------------------------------------------------------------------------
def from_dlpack(obj, device=None, copy=None):
    """A Tensor over the memory of any DLPack producer (numpy, PyTorch, CuPy, JAX...).

    Without a copy (the default) the producer's memory must be float32 (or bfloat16 on the
    CUDA device: a bfloat16 tensor) and C-contiguous, on the CPU or on the CUDA device; the tensor then shares it, and keeps the producer alive until it
    is freed. Anything else raises a clear error unless ``copy=True``, which converts (dtype,
    layout) into a new tensor. ``device`` ("cpu"/"cuda"), when given, must match the producer's
    device unless ``copy=True``.
    """
    if copy not in (None, True, False):
        raise ArgumentTypeError("from_dlpack: copy must be None, True or False")
    if not hasattr(obj, "__dlpack__"):
        raise ArgumentTypeError("from_dlpack: %s does not implement __dlpack__"
                                % type(obj).__name__)
    if isinstance(obj, Tensor):  # a new handle on the same C tensor (or a copy)
        if copy or (device is not None and _args.parse_device(device) != obj.ptr.dev):
            return obj.clone().to(device) if device is not None else obj.clone()
        return Tensor._borrow(obj.ptr)
    want_dev = _args.parse_device(device) if device is not None else None
    got = _dlpack.consume(obj, want_dev, copy)
    if got[0] == "array":
        return Tensor(got[1], device if device is not None else "cpu")
    _, p, src_dev = got
    t = Tensor._wrap(p)
    if copy or (want_dev is not None and want_dev != src_dev):
        out = t.to(device) if want_dev is not None and want_dev != src_dev else t.clone()
        t.close()
        return out
    return t


def tensor(data, device="cpu", dtype=None):
    """A new tensor holding a float32 (or ``dtype``) copy of array-like ``data`` on ``device``."""
    return Tensor(data, device, dtype)


def from_numpy(array, device="cpu"):
    """A new tensor holding a float32 copy of ``array`` (use Tensor.numpy() for a view back)."""
    return Tensor(array, device)


def zeros(shape, device="cpu", dtype=None):
    dims = _args.to_shape(shape)
    dev = _args.parse_device(device)
    dt = _dtypes.float32 if dtype is None else _dtypes.parse_dtype(dtype)
    c = ffi.new("int[]", dims)
    return Tensor._wrap(check_ptr(lib.ut_alloc_dtype(len(dims), c, dev, dt.code), "zeros"))


def full(shape, value, device="cpu", dtype=None):
    value = _args.to_float(value, "value", finite=False)
    t = zeros(shape, device, dtype)
    if value != 0.0:
        t.fill_(value)
    return t


def ones(shape, device="cpu", dtype=None):
    return full(shape, 1.0, device, dtype)


def randn(shape, mean=0.0, std=1.0, device="cpu"):
    """Normal samples from the library's shared RNG (see seed())."""
    dims = _args.to_shape(shape)
    mean = _args.to_float(mean, "mean")
    std = _args.to_float(std, "std", lo=0.0)
    dev = _args.parse_device(device)
    c = ffi.new("int[]", dims)
    return Tensor._wrap(check_ptr(lib.ut_randn(len(dims), c, mean, std, dev), "randn"))


# -- library ------------------------------------------------------------------------------------
def seed(value):
    """Reseed the RNG that randn() and layer initialization draw from."""
    lib.ut_seed(_args.to_int(value, "seed", 0, 2**64 - 1))


def cuda_available():
    return bool(lib.ut_cuda_available())


def devices():
    """The devices present: ["cpu"] or ["cpu", "cuda"]."""
    return ["cpu", "cuda"] if cuda_available() else ["cpu"]


def set_num_threads(n):
    """Threads each CPU op runs on (n >= 1)."""
    check_status(lib.ut_set_num_threads(_args.to_int(n, "n", 1)), "set_num_threads")


def get_num_threads():
    return int(lib.ut_get_num_threads())


def live_tensors():
    """C tensors allocated and not yet freed (for leak checks)."""
    return int(lib.ut_live_tensors())


def live_bytes():
    """The values of the C tensors allocated and not yet freed, 4 bytes each: what a network
    keeps from its forward for its backward shows here (memory tests, profiling)."""
    return int(lib.ut_live_bytes())


def empty_host_cache():
    """Hand the host memory utensil keeps cached for reuse (freed tensors' blocks of 128 KiB or
    more, up to ``UTENSIL_HOST_CACHE_MB``, 1024 by default) back to the system. The cache saves
    a page fault per 4 KiB on every large tensor a forward or a step makes; empty it when the
    process needs the memory for something else."""
    check_status(lib.ut_host_empty_cache(), "empty_host_cache")


def host_cached_bytes():
    """Bytes of freed host memory utensil keeps for its next tensors (see empty_host_cache)."""
    return int(lib.ut_host_cached_bytes())


def peak_live_bytes(reset=False):
    """The highest live_bytes() since the last reset; ``reset=True`` returns it and starts the
    count over from the bytes live now (a step's peak: reset, step, read)."""
    return int(lib.ut_peak_live_bytes(1 if _args.to_bool(reset, "reset") else 0))


def synchronize():
    """Wait for all queued GPU work (a no-op without a GPU)."""
    check_status(lib.ut_cuda_synchronize(), "synchronize")
