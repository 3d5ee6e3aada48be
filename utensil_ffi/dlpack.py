"""DLPack exchange: the capsules behind Tensor.__dlpack__ / __dlpack_device__ and from_dlpack().

Below tensor.py (it never imports it): export works on any Tensor it is given, and import
returns the C tensor for tensor.from_dlpack to wrap.

Follows the DLPack 1.x Python specification. A consumer that passes ``max_version >= (1, 0)``
gets a ``DLManagedTensorVersioned`` in a capsule named ``"dltensor_versioned"``; older consumers
get the legacy ``DLManagedTensor`` in ``"dltensor"``. The exported memory is the tensor's own
(no copy): host memory for CPU tensors, device memory for CUDA tensors. The capsule holds its own
reference to the C tensor, so the memory outlives the Tensor object; the consumer's deleter (or
the capsule's destructor, when nobody consumed it) drops that reference.

Streams: the library queues all GPU work on the legacy default stream. On export the consumer's
stream is made to wait for that work; on import the producer is asked to order its work before
the legacy default stream (``stream=1``).

bfloat16: a CUDA bfloat16 tensor is exported as bfloat16 (its device memory holds 2-byte
values), and a CUDA bfloat16 producer's memory is shared as a bfloat16 tensor. A CPU bfloat16
tensor has no bfloat16 memory (its values live in its float32 host copy, see utensil.dtypes),
so it is exported as a float32 copy (values as numpy() shows them; a consumer writing them must not
leave values bfloat16 cannot hold). A CPU bfloat16 producer cannot be shared; copy=True widens
it to float32 (exact).
"""

import ctypes

import numpy as np

from ._errors import ArgumentError, ArgumentTypeError, DeviceError, check_ptr, check_status
from ._lib import ffi, lib
__all__ = ["dlpack_device", "to_dlpack", "consume"]

_CPU, _CUDA, _CUDA_HOST = 1, 2, 3
_FLOAT_CODE, _BFLOAT_CODE = 2, 4
_FLAG_READ_ONLY, _FLAG_IS_COPIED = 1, 2
_VERSION = (1, 0)


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    pass


_Deleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [
    ("dl_tensor", _DLTensor),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", _Deleter),
]


class _DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _DLManagedTensorVersioned(ctypes.Structure):
    pass


_DeleterVersioned = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensorVersioned))
_DLManagedTensorVersioned._fields_ = [
    ("version", _DLPackVersion),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", _DeleterVersioned),
    ("flags", ctypes.c_uint64),
    ("dl_tensor", _DLTensor),
]

# The capsule API, once with raw pointers (for the destructor, which runs while the capsule is
# being deallocated) and once with Python objects (for the consumer side).
_api = ctypes.pythonapi
_CapsuleDestructor = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_capsule_new = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p,
                                 _CapsuleDestructor)(("PyCapsule_New", _api))
_raw_is_valid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_IsValid", _api))
_raw_get_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", _api))
_is_valid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_IsValid", _api))
_get_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", _api))
_set_name = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_SetName", _api))

_NAME, _USED = b"dltensor", b"used_dltensor"
_NAME_V, _USED_V = b"dltensor_versioned", b"used_dltensor_versioned"


# -- export ---------------------------------------------------------------------------------------
class _Export:
    """What one exported capsule keeps alive: a C reference to the tensor, the struct, its shape."""

    __slots__ = ("ptr", "managed", "shape")

    def __init__(self, ptr, managed, shape):
        self.ptr = lib.ut_retain(ptr)
        lib.ut_view_open(ptr)  # the consumer may write the memory, unseen by the library
        self.managed = managed
        self.shape = shape

    def release(self):
        if self.ptr is not None:
            lib.ut_view_close(self.ptr)
            lib.ut_free(self.ptr)
            self.ptr = None


_exports = {}  # address of the managed struct -> _Export


def _drop_export(address):
    export = _exports.pop(address, None)
    if export is not None:
        export.release()


@_Deleter
def _delete_legacy(managed):
    _drop_export(ctypes.cast(managed, ctypes.c_void_p).value)


@_DeleterVersioned
def _delete_versioned(managed):
    _drop_export(ctypes.cast(managed, ctypes.c_void_p).value)


@_CapsuleDestructor
def _capsule_destructor(capsule):
    # Only a capsule nobody consumed still carries its original name; a consumer renamed it to
    # "used_..." and became responsible for calling the deleter.
    for name in (_NAME_V, _NAME):
        if _raw_is_valid(capsule, name):
            _drop_export(_raw_get_pointer(capsule, name))
            return


def dlpack_device(t):
    """(device_type, device_id): (1, 0) for host memory, (2, 0) for CUDA device memory."""
    p = t.ptr
    if p.dev == lib.UT_CUDA and p.gpu_buf != ffi.NULL:
        return (_CUDA, 0)
    return (_CPU, 0)


def _parse_stream(stream, device_type):
    if device_type == _CPU:
        if stream not in (None, -1):
            raise ArgumentError("__dlpack__: stream must be None for a CPU tensor, got %r" % (stream,))
        return None
    if stream is None or stream == -1:
        return stream
    if isinstance(stream, bool) or not isinstance(stream, int):
        raise ArgumentTypeError("__dlpack__: stream must be an int or None, got %r" % (stream,))
    if stream == 0:
        raise ArgumentError("__dlpack__: stream 0 is ambiguous for CUDA; use 1 (legacy default) "
                            "or 2 (per-thread default)")
    if stream < 0:
        raise ArgumentError("__dlpack__: invalid stream %r" % (stream,))
    return stream


def to_dlpack(t, stream=None, max_version=None, dl_device=None, copy=None):
    """The capsule Tensor.__dlpack__ returns (see the module docstring)."""
    here = dlpack_device(t)
    if dl_device is not None:
        try:
            want = (int(dl_device[0]), int(dl_device[1]))
        except (TypeError, ValueError, IndexError):
            raise ArgumentTypeError("__dlpack__: dl_device must be a (type, id) pair, got %r"
                                    % (dl_device,)) from None
        if want != here:
            if want != (_CPU, 0) or copy is False:
                raise BufferError("__dlpack__: cannot export a tensor on %s to device %s%s"
                                  % (here, want, " without a copy" if copy is False else ""))
            # the consumer wants host memory: hand it a host copy
            host = t.cpu()
            return to_dlpack(host, None, max_version, None, None) if not _versioned(max_version) \
                else _export(host, None, True, copied=True)
    stream = _parse_stream(stream, here[0])
    if here[0] == _CPU and t.ptr.dtype == lib.UT_BF16:
        # Its host values are float32 (utensil.dtypes): shared, a consumer could write values a
        # bfloat16 tensor cannot hold. Exported as a float32 copy instead (copy=None allows it).
        if copy is False:
            raise BufferError("__dlpack__: a CPU bfloat16 tensor is exported as a float32 copy "
                              "(its host memory holds float32 values); copy=False cannot be met")
        c = t.float()
        try:
            return _export(c, stream, _versioned(max_version), copied=True)
        finally:
            c.close()
    if copy:
        c = t.clone()
        try:
            return _export(c, stream, _versioned(max_version), copied=True)
        finally:
            c.close()
    return _export(t, stream, _versioned(max_version), copied=False)


def _versioned(max_version):
    if max_version is None:
        return False
    try:
        return int(max_version[0]) >= 1
    except (TypeError, ValueError, IndexError):
        raise ArgumentTypeError("__dlpack__: max_version must be a (major, minor) pair, got %r"
                                % (max_version,)) from None


def _export(t, stream, versioned, copied):
    p = t.ptr
    device = dlpack_device(t)
    if device[0] == _CUDA:
        check_status(lib.ut_sync_gpu(p), "__dlpack__")
        if stream not in (None, -1, 1):
            check_status(lib.ut_cuda_stream_wait(ffi.cast("void*", stream), ffi.NULL), "__dlpack__")
        # The consumer may write the device memory at any time from now on: it holds the values,
        # and the host copy becomes a snapshot taken again at every read (C's `shared`).
        p.dirty_cpu = True
        p.dirty_gpu = False
        p.shared = True
        data = int(ffi.cast("uintptr_t", p.gpu_buf))
    else:
        # As Tensor.numpy(): a CPU tensor's host copy is its only copy, so the read-only sync
        # suffices, and it leaves the version alone (exporting a layer's input between forward
        # and backward, to read it, must not make backward refuse).
        check_status(lib.ut_sync_cpu_readonly(p), "__dlpack__")
        data = int(ffi.cast("uintptr_t", p.data))
    dims = [p.shape.shape[i] for i in range(p.shape.ndim)]
    shape = (ctypes.c_int64 * len(dims))(*dims)
    managed = _DLManagedTensorVersioned() if versioned else _DLManagedTensor()
    dl = managed.dl_tensor
    dl.data = data
    dl.device = _DLDevice(*device)
    dl.ndim = len(dims)
    bf16 = device[0] == _CUDA and p.dtype == lib.UT_BF16
    dl.dtype = _DLDataType(_BFLOAT_CODE, 16, 1) if bf16 else _DLDataType(_FLOAT_CODE, 32, 1)
    dl.shape = shape
    dl.strides = None  # compact row-major
    dl.byte_offset = 0
    if versioned:
        managed.version = _DLPackVersion(*_VERSION)
        managed.flags = _FLAG_IS_COPIED if copied else 0
        managed.deleter = _delete_versioned
    else:
        managed.deleter = _delete_legacy
    address = ctypes.addressof(managed)
    _exports[address] = _Export(p, managed, shape)
    try:
        return _capsule_new(address, _NAME_V if versioned else _NAME, _capsule_destructor)
    except BaseException:
        _drop_export(address)
        raise


# -- import ---------------------------------------------------------------------------------------
_imports = {}  # address of a consumed managed struct -> True if versioned


@ffi.callback("void(void*)")
def _release_import(ctx):
    address = int(ffi.cast("uintptr_t", ctx))
    versioned = _imports.pop(address, None)
    if versioned is None:
        return
    kind = _DLManagedTensorVersioned if versioned else _DLManagedTensor
    managed = kind.from_address(address)
    if managed.deleter:
        managed.deleter(ctypes.pointer(managed))


def _contiguous(dl, dims):
    if not dl.strides:
        return True
    expected = 1
    for i in reversed(range(len(dims))):
        if dims[i] != 1 and dl.strides[i] != expected:
            return False
        expected *= dims[i]
    return True


def _widen_bf16(dl, dims):
    """A float32 copy of host bfloat16 memory, any non-negative strides (exact: bfloat16 is
    float32's upper half)."""
    strides = [int(dl.strides[i]) for i in range(len(dims))] if dl.strides else None
    if strides is None:
        strides, step = [0] * len(dims), 1
        for i in reversed(range(len(dims))):
            strides[i], step = step, step * dims[i]
    if any(st < 0 for st in strides):
        raise BufferError("from_dlpack: bfloat16 memory with negative strides cannot be converted")
    extent = 1 + sum((d - 1) * st for d, st in zip(dims, strides))
    raw = np.frombuffer((ctypes.c_uint16 * extent).from_address((dl.data or 0) + dl.byte_offset),
                        dtype=np.uint16)
    view = np.lib.stride_tricks.as_strided(raw, dims, [2 * st for st in strides], writeable=False)
    return (view.astype(np.uint32) << 16).view(np.float32)


def consume(obj, want_dev, copy):
    """Take the DLPack capsule of ``obj`` (not a Tensor) for tensor.from_dlpack: returns
    ``("tensor", C tensor, its device)`` sharing the producer's memory, or ``("array", ndarray)``
    when ``copy`` converts what cannot be shared; raises BufferError otherwise."""
    src_type = obj.__dlpack_device__()[0] if hasattr(obj, "__dlpack_device__") else _CPU
    kwargs = {"stream": 1} if src_type == _CUDA else {}
    try:
        capsule = obj.__dlpack__(max_version=_VERSION, **kwargs)
    except TypeError:
        capsule = obj.__dlpack__(**kwargs)
    if _is_valid(capsule, _NAME_V):
        versioned = True
        address = _get_pointer(capsule, _NAME_V)
        managed = _DLManagedTensorVersioned.from_address(address)
        if managed.version.major > _VERSION[0]:
            raise BufferError("from_dlpack: DLPack %d.%d is newer than this library supports"
                              % (managed.version.major, managed.version.minor))
        readonly = bool(managed.flags & _FLAG_READ_ONLY)
    elif _is_valid(capsule, _NAME):
        versioned = False
        address = _get_pointer(capsule, _NAME)
        managed = _DLManagedTensor.from_address(address)
        readonly = False
    else:
        raise ArgumentTypeError("from_dlpack: __dlpack__ did not return a DLPack capsule")
    dl = managed.dl_tensor
    dims = [int(dl.shape[i]) for i in range(dl.ndim)]
    dev_type = dl.device.device_type
    problems = []
    kind = (dl.dtype.code, dl.dtype.bits, dl.dtype.lanes)
    bf16 = kind == (_BFLOAT_CODE, 16, 1)
    if bf16 and dev_type != _CUDA:
        problems.append("bfloat16 memory on the host cannot be shared (utensil keeps a bfloat16 "
                        "tensor's host values as float32)")
    elif kind != (_FLOAT_CODE, 32, 1) and not bf16:
        problems.append("dtype is neither float32 nor bfloat16 (code %d, %d bits, %d lanes)"
                        % kind)
    if not _contiguous(dl, dims):
        problems.append("memory is not C-contiguous")
    if readonly:
        problems.append("memory is read-only")
    if dev_type not in (_CPU, _CUDA_HOST, _CUDA):
        problems.append("device type %d is neither CPU nor CUDA" % dev_type)
    if dev_type == _CUDA and not lib.ut_cuda_available():
        problems.append("the data is on a CUDA device but no CUDA device is available here")
    if dev_type == _CUDA and dl.device.device_id != 0:
        problems.append("the data is on CUDA device %d; utensil uses device 0" % dl.device.device_id)
    if not dims or any(d < 1 for d in dims) or len(dims) > lib.UT_MAX_DIMS:
        problems.append("shape %s is not supported (1 to %d dimensions, none empty)"
                        % (tuple(dims), lib.UT_MAX_DIMS))
    src_dev = lib.UT_CUDA if dev_type == _CUDA else lib.UT_CPU
    if want_dev is not None and want_dev != src_dev and not copy:
        problems.append("the data is on %s, not on the device asked for"
                        % ("cuda" if src_dev == lib.UT_CUDA else "cpu"))
    if problems:
        # not consumed: the capsule's destructor frees it
        host = dev_type in (_CPU, _CUDA_HOST)
        if copy and host and bf16 and not any("shape" in p for p in problems):
            arr = _widen_bf16(dl, dims)  # numpy has no bfloat16 to read it with
            del capsule, managed, dl
            return ("array", arr)
        if copy and host and not any("shape" in p for p in problems):
            del capsule, managed, dl
            return ("array", np.from_dlpack(obj) if hasattr(np, "from_dlpack") else np.asarray(obj))
        raise BufferError("from_dlpack: cannot share this memory: %s%s" % (
            "; ".join(problems), "" if copy else " (pass copy=True to convert it into a new tensor)"))
    _set_name(capsule, _USED_V if versioned else _USED)
    _imports[address] = versioned
    data = (dl.data or 0) + dl.byte_offset
    c_shape = ffi.new("int[]", dims)
    p = lib.ut_wrap(len(dims), c_shape, src_dev, ffi.cast("void*", data), _release_import,
                    ffi.cast("void*", address))
    if p == ffi.NULL:
        _release_import(ffi.cast("void*", address))
        check_ptr(p, "from_dlpack")
    if bf16:  # ut_wrap makes float32; nothing has read the memory yet
        p.dtype = lib.UT_BF16
    return ("tensor", p, src_dev)
