"""DLPack in ctypes: reading a producer's capsule, and exporting a tensor as a capsule.

DLPack (https://dmlc.github.io/dlpack/latest/) hands a tensor from one library to another as
a PyCapsule holding a ``DLManagedTensor`` (name "dltensor") or a ``DLManagedTensorVersioned``
(DLPack 1.x, "dltensor_versioned"): an address, a device ``(device_type, device_id)``, a dtype,
a shape, strides, and a deleter the consumer calls when it no longer needs the memory. The
consumer renames the capsule ("used_dltensor") so that it is imported once.

Nothing here depends on a device: the address is one in whatever memory the device type
names, so the same code serves host memory, CUDA memory and the test plugins' devices; which
device type a provider's memory is, and the stream handshake, are the providers' business
(``EpFactory.dlpack_device_type``, ``SyncNotification.wait_on_handle``).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

# DLDeviceType values
CPU = 1
CUDA = 2
CUDA_HOST = 3  # pinned host memory
ROCM_HOST = 11
EXT_DEV = 12  # "reserved extension device type, used for quickly test extension device"
CUDA_MANAGED = 13
# device types whose memory the host can read: imported as numpy arrays
HOST_TYPES = frozenset({CPU, CUDA_HOST, ROCM_HOST, CUDA_MANAGED})
# __dlpack__'s stream argument for CUDA: None means the legacy default stream, -1 "do not
# synchronise"
LEGACY_DEFAULT_STREAM = 1
NO_SYNC = -1

_LEGACY = b"dltensor"
_VERSIONED = b"dltensor_versioned"
_USED_LEGACY = b"used_dltensor"
_USED_VERSIONED = b"used_dltensor_versioned"
_READ_ONLY = 1  # DLManagedTensorVersioned.flags bit


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
    _fields_ = [
        ("dl_tensor", _DLTensor),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
    ]


class _DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [
        ("version", _DLPackVersion),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", _DLTensor),
    ]


_DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


def _capi(name: str, restype: Any, *argtypes: Any) -> Any:
    # prototypes of our own: the shared ctypes.pythonapi attributes stay untouched
    return ctypes.PYFUNCTYPE(restype, *argtypes)((name, ctypes.pythonapi))


_is_valid = _capi("PyCapsule_IsValid", ctypes.c_int, ctypes.py_object, ctypes.c_char_p)
_get_pointer = _capi("PyCapsule_GetPointer", ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)
_set_name = _capi("PyCapsule_SetName", ctypes.c_int, ctypes.py_object, ctypes.c_char_p)
_new = _capi("PyCapsule_New", ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)


def _word(address: int) -> int:
    return ctypes.c_void_p.from_address(address).value or 0


def _capsule_layout() -> tuple[int, int]:
    """Offsets of a capsule's pointer and name fields, found on a probe capsule. A capsule's
    destructor runs while the capsule is being freed, maybe with an exception propagating
    (a consumer that failed): calling the C API there would fail, reading the fields does
    not."""
    marker = ctypes.c_int64()
    probe = _new(ctypes.addressof(marker), _LEGACY, None)
    name = ctypes.cast(ctypes.c_char_p(_LEGACY), ctypes.c_void_p).value
    base = id(probe)
    for offset in range(8, 128, ctypes.sizeof(ctypes.c_void_p)):
        if _word(base + offset) == ctypes.addressof(marker):
            if _word(base + offset + ctypes.sizeof(ctypes.c_void_p)) == name:
                return offset, offset + ctypes.sizeof(ctypes.c_void_p)
    raise ImportError("unexpected PyCapsule layout")


_POINTER_AT, _NAME_AT = _capsule_layout()
_LEGACY_NAME = ctypes.cast(ctypes.c_char_p(_LEGACY), ctypes.c_void_p).value

# (DLDataTypeCode, bits) <-> numpy dtype; float8 codes as onnxruntime 1.32 exports them
_INT, _UINT, _FLOAT, _BFLOAT, _COMPLEX, _BOOL = 0, 1, 2, 4, 5, 6
_DTYPES: dict[tuple[int, int], np.dtype] = {
    **{(_INT, 8 * n): np.dtype(f"int{8 * n}") for n in (1, 2, 4, 8)},
    **{(_UINT, 8 * n): np.dtype(f"uint{8 * n}") for n in (1, 2, 4, 8)},
    (_FLOAT, 16): np.dtype(np.float16),
    (_FLOAT, 32): np.dtype(np.float32),
    (_FLOAT, 64): np.dtype(np.float64),
    (_BFLOAT, 16): np.dtype(ml_dtypes.bfloat16),
    (_COMPLEX, 64): np.dtype(np.complex64),
    (_COMPLEX, 128): np.dtype(np.complex128),
    (_BOOL, 8): np.dtype(np.bool_),
    (10, 8): np.dtype(ml_dtypes.float8_e4m3fn),
    (11, 8): np.dtype(ml_dtypes.float8_e4m3fnuz),
    (12, 8): np.dtype(ml_dtypes.float8_e5m2),
    (13, 8): np.dtype(ml_dtypes.float8_e5m2fnuz),
    (14, 8): np.dtype(ml_dtypes.float8_e8m0fnu),
}
_CODES = {dt: key for key, dt in _DTYPES.items()}
DTYPES = tuple(_DTYPES.values())  # what can be exchanged


def dl_dtype(dtype: Any) -> tuple[int, int]:
    """(DLDataTypeCode, bits) of a numpy dtype, or TypeError naming it."""
    key = _CODES.get(np.dtype(dtype))
    if key is None:
        raise TypeError(f"{np.dtype(dtype)} tensors cannot be exchanged through DLPack")
    return key


def np_dtype(code: int, bits: int, lanes: int = 1) -> np.dtype:
    dt = _DTYPES.get((code, bits))
    if dt is None or lanes != 1:
        raise TypeError(
            f"DLPack dtype (code {code}, {bits} bits, {lanes} lanes) has no numpy equivalent "
            "here (sub-byte and vector types are not supported)"
        )
    return dt


@dataclass
class Imported:
    """A tensor read from a DLPack capsule. ``owner`` keeps the producer's memory alive (the
    deleter runs when it is collected); ``strides`` are in elements (None: row-major)."""

    device_type: int
    device_id: int
    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...] | None
    dtype: np.dtype
    readonly: bool
    owner: Any

    @property
    def is_contiguous(self) -> bool:
        return is_row_major(self.shape, self.strides)


def is_row_major(shape: tuple[int, ...], strides: tuple[int, ...] | None) -> bool:
    """Whether element ``strides`` (None: none given) describe a dense row-major tensor, the
    layout every onnxplug tensor has (dims of size 1 may have any stride)."""
    if strides is None or 0 in shape:
        return True
    expected = 1
    for dim, stride in zip(reversed(shape), reversed(strides)):
        if dim != 1 and stride != expected:
            return False
        expected *= dim
    return True


class _ImportedMemory:
    """Calls the producer's deleter when the last tensor over its memory is gone."""

    __slots__ = ("_address", "_deleter")

    def __init__(self, address: int, deleter: int | None):
        self._address = address
        self._deleter = deleter

    def __del__(self) -> None:
        deleter, self._deleter = self._deleter, None
        if deleter:
            _DELETER(deleter)(self._address)


def is_capsule(obj: Any) -> bool:
    return type(obj).__name__ == "PyCapsule"


def capsule_device(capsule: Any) -> tuple[int, int]:
    """The device of an unconsumed capsule, without consuming it."""
    managed, _ = _managed(capsule)
    d = managed.dl_tensor.device
    return int(d.device_type), int(d.device_id)


def _managed(capsule: Any) -> tuple[Any, bool]:
    if not is_capsule(capsule):
        raise TypeError(f"expected a DLPack capsule, got {type(capsule).__name__}")
    if _is_valid(capsule, _VERSIONED):
        managed = _DLManagedTensorVersioned.from_address(_get_pointer(capsule, _VERSIONED))
        if managed.version.major != 1:
            v = managed.version
            raise BufferError(f"DLPack {v.major}.{v.minor} capsules are not supported (1.x)")
        return managed, True
    if _is_valid(capsule, _LEGACY):
        return _DLManagedTensor.from_address(_get_pointer(capsule, _LEGACY)), False
    raise TypeError("not a DLPack capsule, or one already consumed (a capsule is imported once)")


def from_capsule(capsule: Any) -> Imported:
    """Consume a DLPack capsule: the tensor it describes, owning the producer's memory."""
    managed, versioned = _managed(capsule)
    t = managed.dl_tensor
    dtype = np_dtype(t.dtype.code, t.dtype.bits, t.dtype.lanes)
    ndim = int(t.ndim)
    shape = tuple(int(t.shape[i]) for i in range(ndim))
    strides = tuple(int(t.strides[i]) for i in range(ndim)) if t.strides else None
    ptr = (t.data or 0) + int(t.byte_offset)
    readonly = versioned and bool(managed.flags & _READ_ONLY)
    # from here the memory is ours to release: the owner calls the deleter, and the capsule,
    # renamed, no longer does
    owner = _ImportedMemory(ctypes.addressof(managed), managed.deleter)
    _set_name(capsule, _USED_VERSIONED if versioned else _USED_LEGACY)
    device = t.device
    return Imported(
        int(device.device_type),
        int(device.device_id),
        ptr,
        shape,
        strides,
        dtype,
        readonly,
        owner,
    )


# Exported tensors: the managed structs (with their shape and strides arrays) and what keeps
# the memory alive, by the struct's address, until the consumer calls the deleter (or the
# capsule dies unconsumed).
_EXPORTED: dict[int, tuple[Any, ...]] = {}


def _release_exported(address: int) -> None:
    _EXPORTED.pop(address, None)


def _capsule_destructor(capsule: int) -> None:
    # a consumer renames the capsule when it takes the tensor (and calls the deleter later)
    if _word(capsule + _NAME_AT) == _LEGACY_NAME:  # never consumed: nobody else will release it
        _EXPORTED.pop(_word(capsule + _POINTER_AT), None)


_release_exported_c = _DELETER(_release_exported)
_capsule_destructor_c = _DELETER(_capsule_destructor)


def to_capsule(
    ptr: int,
    shape: tuple[int, ...],
    dtype: Any,
    device_type: int,
    device_id: int,
    owner: Any,
) -> Any:
    """A legacy ("dltensor") capsule for a dense row-major tensor at ``ptr``; ``owner`` stays
    alive until the consumer is done with the memory."""
    code, bits = dl_dtype(dtype)
    ndim = len(shape)
    shape_arr = (ctypes.c_int64 * max(ndim, 1))(*shape)
    strides: list[int] = []
    step = 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(int(d), 1)
    strides_arr = (ctypes.c_int64 * max(ndim, 1))(*reversed(strides))
    managed = _DLManagedTensor()
    t = managed.dl_tensor
    t.data = ptr or None
    t.device = _DLDevice(device_type, device_id)
    t.ndim = ndim
    t.dtype = _DLDataType(code, bits, 1)
    t.shape = ctypes.cast(shape_arr, ctypes.POINTER(ctypes.c_int64))
    t.strides = ctypes.cast(strides_arr, ctypes.POINTER(ctypes.c_int64))
    t.byte_offset = 0
    managed.deleter = ctypes.cast(_release_exported_c, ctypes.c_void_p).value
    address = ctypes.addressof(managed)
    _EXPORTED[address] = (managed, shape_arr, strides_arr, owner)
    return _new(address, _LEGACY, ctypes.cast(_capsule_destructor_c, ctypes.c_void_p))


def exported_count() -> int:
    """Exported tensors whose memory a consumer (or an unconsumed capsule) still holds."""
    return len(_EXPORTED)


__all__ = [
    "CPU",
    "CUDA",
    "DTYPES",
    "EXT_DEV",
    "HOST_TYPES",
    "LEGACY_DEFAULT_STREAM",
    "NO_SYNC",
    "Imported",
    "capsule_device",
    "dl_dtype",
    "from_capsule",
    "is_capsule",
    "is_row_major",
    "np_dtype",
    "to_capsule",
]
