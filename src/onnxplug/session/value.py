"""``OrtValue`` (alias ``Value``): a tensor, sequence, map or optional held by the runtime,
on the host or in a provider's device memory, with onnxruntime's Python methods."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import InvalidArgument
from ..framework import dlpack
from ..framework.memory import CPU, DeviceTensor, allocate_tensor, host_view
from ..framework.stream import await_ready, device_of
from ..ir.types import elem_type_from_name, elem_type_of, np_dtype, tensor_type_str
from .environment import get_environment


def _as_dtype(element_type: Any) -> np.dtype:
    """An element type as onnxruntime reads it: an int is an ONNX type code
    (``TensorProto.FLOAT``), anything else a numpy dtype (``np.float32``, ``"float64"``; note
    that numpy reads ``"float"`` as float64). onnxplug also reads ``"tensor(float)"``."""
    if isinstance(element_type, (int, np.integer)) and not isinstance(element_type, bool):
        try:
            return np_dtype(int(element_type))
        except ValueError:
            raise InvalidArgument(f"{element_type} is not an ONNX element type code") from None
    if isinstance(element_type, str) and element_type.startswith("tensor("):
        try:
            return np_dtype(elem_type_from_name(element_type))
        except ValueError:
            raise InvalidArgument(f"unknown element type {element_type!r}") from None
    try:
        return np.dtype(element_type)
    except TypeError:
        raise InvalidArgument(
            f"element_type must be a numpy dtype or an ONNX type code, not {element_type!r}"
        ) from None


def to_numpy(value: Any) -> Any:
    """A host copy of a runtime value (tensors to numpy, sequences to lists)."""
    if isinstance(value, DeviceTensor):
        out = np.empty(value.shape, dtype=value.dtype)
        await_ready(value, None)
        get_environment().transfer_for(value.device).copy(value, out)
        return out
    if isinstance(value, np.ndarray) and value.dtype.kind in "US":
        # string tensors leave the runtime as object arrays of str, as in onnxruntime, even
        # where a kernel (onnx.reference's Cast to string) produced a fixed-width array
        return value.astype(object)
    if isinstance(value, list):
        return [to_numpy(v) for v in value]
    if isinstance(value, dict):
        return {k: to_numpy(v) for k, v in value.items()}
    return value


def fresh_outputs(outputs: list[Any], feeds: list[Any]) -> list[Any]:
    """Outputs the caller owns, as onnxruntime returns them: an array that shares memory with
    a feed (an Identity, Reshape or Squeeze hands its input on as a view), with an earlier
    output, or that is read-only (a constant the session keeps) is copied; every other array
    is already fresh and is returned as it is."""
    seen = {id(_root(a)) for a in _arrays(feeds)}

    def fresh(v: Any) -> Any:
        if isinstance(v, np.ndarray):
            root = id(_root(v))
            if root in seen or not v.flags.writeable:
                return v.copy()
            seen.add(root)
            return v
        if isinstance(v, list):
            return [fresh(x) for x in v]
        if isinstance(v, dict):
            return {k: fresh(x) for k, x in v.items()}
        return v

    return [fresh(v) for v in outputs]


def _root(a: np.ndarray) -> np.ndarray:
    """The array that owns ``a``'s memory (``a`` itself when it is not a view)."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def _arrays(values: list[Any]) -> list[np.ndarray]:
    out: list[np.ndarray] = []
    for v in values:
        if isinstance(v, np.ndarray):
            out.append(v)
        elif isinstance(v, list):
            out.extend(_arrays(v))
    return out


class OrtValue:
    """A runtime value. Create with the ``ortvalue_from_*`` static methods."""

    __slots__ = ("_value",)

    def __init__(self, value: Any):
        self._value = value

    # construction ---------------------------------------------------------------------------
    @staticmethod
    def ortvalue_from_numpy(
        numpy_obj: Any, device_type: str = "cpu", device_id: int = 0, vendor_id: int = -1
    ) -> OrtValue:
        arr = numpy_obj if isinstance(numpy_obj, np.ndarray) else np.asarray(numpy_obj)
        if arr.dtype.kind in "US":
            arr = arr.astype(object)  # string tensors are object arrays (a copy, unavoidably)
        if device_type.lower() == "cpu":
            return OrtValue(arr)  # shares the array's memory, like onnxruntime
        env = get_environment()
        alloc, _ = env.allocator_for_device(device_type, device_id)
        t = allocate_tensor(alloc, arr.shape, arr.dtype)
        env.transfer.copy(np.asarray(arr, order="C"), t)  # keeps 0-d shapes
        return OrtValue(t)

    @staticmethod
    def ortvalue_from_numpy_with_onnx_type(data: Any, onnx_element_type: int) -> OrtValue:
        return OrtValue(np.asarray(data).view(np_dtype(onnx_element_type)))

    @staticmethod
    def ortvalue_from_shape_and_type(
        shape: Any,
        element_type: Any,
        device_type: str = "cpu",
        device_id: int = 0,
        vendor_id: int = -1,
        memory_info: Any = None,
    ) -> OrtValue:
        """A new tensor of ``shape`` and ``element_type`` (a numpy dtype or an ONNX type
        code) on ``device_type:device_id``, or in the memory ``memory_info`` names (an
        OrtMemoryInfo, e.g. ``ep_device.memory_info(OrtDeviceMemoryType.HOST_ACCESSIBLE)``;
        then the device arguments are ignored), as in onnxruntime."""
        dt = _as_dtype(element_type)
        shape = tuple(int(d) for d in shape)
        env = get_environment()
        if memory_info is not None:
            info = getattr(memory_info, "_info", memory_info)
            if info.device.is_cpu and not info.device.vendor_id:
                return OrtValue(np.zeros(shape, dtype=dt))
            for d in env.registry.ep_devices():
                if info in (d.memory_info, d.host_accessible_memory_info):
                    env.ensure_transfer(d.factory)
                    return OrtValue(
                        allocate_tensor(env.shared_allocator(d.factory, info), shape, dt)
                    )
            raise InvalidArgument(f"no execution provider offers the memory {memory_info}")
        kind = device_type.lower()
        if kind == "gpu" and int(vendor_id) == 0x10DE:
            kind = "cuda"  # onnxruntime's generic device name with NVIDIA's vendor id
        if kind == "cpu":
            return OrtValue(np.zeros(shape, dtype=dt))
        alloc, _ = env.allocator_for_device(kind, device_id)
        return OrtValue(allocate_tensor(alloc, shape, dt))

    @staticmethod
    def ortvalue_from_sequence(values: list[Any]) -> OrtValue:
        return OrtValue([v._value if isinstance(v, OrtValue) else np.asarray(v) for v in values])

    @staticmethod
    def from_dlpack(data: Any, is_bool_tensor: bool = False) -> OrtValue:
        """An OrtValue sharing the memory of ``data``: an object with ``__dlpack__`` (a
        PyTorch tensor, a CuPy or JAX array, a numpy array) or a DLPack capsule. Host memory
        becomes a numpy array; device memory a tensor of the provider whose DLPack device it
        is, whose streams wait for the producer's pending work before reading it.
        ``is_bool_tensor`` reads a uint8 tensor as bool (DLPack producers without kDLBool)."""
        v = import_dlpack(data)
        if is_bool_tensor and v.dtype == np.uint8:
            v = v.view(np.bool_) if isinstance(v, np.ndarray) else v.view(v.shape, np.bool_)
        return OrtValue(v)

    # introspection --------------------------------------------------------------------------
    def _tensor(self) -> Any:
        if not isinstance(self._value, (np.ndarray, DeviceTensor)):
            raise InvalidArgument(f"the value is a {self._kind()}, not a tensor")
        return self._value

    def _kind(self) -> str:
        v = self._value
        if v is None:
            return "empty optional"
        if isinstance(v, list):
            return "sequence"
        if isinstance(v, dict):
            return "map"
        return "tensor"

    def is_tensor(self) -> bool:
        return isinstance(self._value, (np.ndarray, DeviceTensor))

    def is_tensor_sequence(self) -> bool:
        return isinstance(self._value, list)

    def is_sparse_tensor(self) -> bool:
        return False

    def has_value(self) -> bool:
        return self._value is not None

    def shape(self) -> list[int]:
        return list(self._tensor().shape)

    def data_type(self) -> str:
        v = self._value
        if isinstance(v, list):
            inner = tensor_type_str(v[0].dtype) if v else "tensor(float)"
            return f"seq({inner})"
        return tensor_type_str(self._tensor().dtype)

    def element_type(self) -> int:
        return elem_type_of(self._tensor().dtype)

    def tensor_size_in_bytes(self) -> int:
        t = self._tensor()
        return int(np.prod(t.shape, dtype=np.int64)) * np.dtype(t.dtype).itemsize

    def device_name(self) -> str:
        return device_of(self._value).type if self.is_tensor() else "cpu"

    def device(self) -> Any:
        return device_of(self._value)

    def data_ptr(self) -> int:
        t = self._tensor()
        if isinstance(t, DeviceTensor):
            return t.ptr
        return int(t.ctypes.data)

    def numpy(self) -> Any:
        v = self._value
        if isinstance(v, (list, dict)) or v is None:
            return to_numpy(v)
        return to_numpy(self._tensor())

    def as_sparse_tensor(self) -> Any:
        raise InvalidArgument("the value is not a sparse tensor")

    # mutation -------------------------------------------------------------------------------
    def update_inplace(self, np_arr: Any) -> None:
        """Copy ``np_arr`` into this tensor's memory (same shape and dtype), on any device."""
        t = self._tensor()
        src = np.asarray(np_arr, order="C")  # (ascontiguousarray makes 0-d arrays 1-d)
        if tuple(src.shape) != tuple(t.shape) or src.dtype != t.dtype:
            raise InvalidArgument(
                f"update_inplace: got {src.dtype}{list(src.shape)}, the value is "
                f"{t.dtype}{list(t.shape)}"
            )
        if isinstance(t, np.ndarray):
            np.copyto(t, src)
        else:
            await_ready(t, None)
            get_environment().transfer_for(t.device).copy(src, t)

    # DLPack -----------------------------------------------------------------------------------
    def to_dlpack(self) -> Any:
        """A DLPack capsule sharing this tensor's memory (see ``__dlpack__``)."""
        return self.__dlpack__()

    def __dlpack__(
        self,
        *,
        stream: Any = None,
        max_version: Any = None,
        dl_device: Any = None,
        copy: Any = None,
    ) -> Any:
        """A DLPack capsule sharing this tensor's memory, for ``torch.from_dlpack``,
        ``cupy.from_dlpack``, ``np.from_dlpack``... ``stream`` is the consumer's stream (CUDA:
        a ``cudaStream_t``, None the legacy default stream, -1 no synchronisation): work still
        pending on the tensor is ordered before it. No copy is ever made (``copy=True`` and a
        ``dl_device`` other than the tensor's are a BufferError); device tensors come as
        legacy ("dltensor") capsules, which every consumer reads."""
        t = self._tensor()
        if isinstance(t, np.ndarray) and t.dtype.kind != "V":
            extra = {
                k: v
                for k, v in (("max_version", max_version), ("dl_device", dl_device), ("copy", copy))
                if v is not None
            }
            return t.__dlpack__(stream=stream, **extra)
        device = self.__dlpack_device__()
        if dl_device is not None and tuple(int(x) for x in dl_device) != device:
            raise BufferError(f"the tensor is on DLPack device {device}, not {tuple(dl_device)}")
        if copy:
            raise BufferError("OrtValue.__dlpack__ shares memory; copy=True is not supported")
        if isinstance(t, np.ndarray):  # bfloat16, float8 (ml_dtypes): numpy has no DLPack code
            if not t.flags.c_contiguous:
                raise BufferError(f"a non-contiguous {t.dtype} array cannot be shared")
            return dlpack.to_capsule(t.ctypes.data, t.shape, t.dtype, dlpack.CPU, 0, t)
        if t.ready is not None and stream != dlpack.NO_SYNC:
            t.ready.wait_on_handle(dlpack.LEGACY_DEFAULT_STREAM if stream is None else stream)
        return dlpack.to_capsule(t.ptr, t.shape, t.dtype, device[0], device[1], t)

    def __dlpack_device__(self) -> tuple[int, int]:
        t = self._tensor()
        if isinstance(t, np.ndarray):
            return (dlpack.CPU, 0)
        return dlpack_device_of(t)

    def __repr__(self) -> str:
        v = self._value
        if self.is_tensor():
            return f"OrtValue({self.data_type()}, shape={self.shape()}, device={device_of(v)})"
        return f"OrtValue({self._kind()})"


Value = OrtValue


def unwrap(value: Any) -> Any:
    return value._value if isinstance(value, OrtValue) else value


def dlpack_device_of(t: DeviceTensor) -> tuple[int, int]:
    """The DLPack device of a tensor in a provider's memory: the provider's DLPack device type
    and the device ordinal; host-accessible memory of a provider without one is host memory."""
    env = get_environment()
    for d in env.registry.ep_devices():
        if d.memory_info.device == t.device:
            kind = d.factory.dlpack_device_type
            if kind is not None:
                return (int(kind), t.device.id)
    if t.device.host_accessible:
        return (dlpack.CPU, 0)
    raise BufferError(f"tensors on {t.device} cannot be exchanged through DLPack")


def import_dlpack(data: Any) -> Any:
    """The tensor a DLPack producer (an object with ``__dlpack__``, or a capsule) holds, in
    place: a numpy array for host memory, a DeviceTensor of the provider whose DLPack device
    it is for device memory, with ``ready`` set when that provider has an import stream."""
    capsule = data if dlpack.is_capsule(data) else None
    if capsule is not None:
        kind, dev_id = dlpack.capsule_device(capsule)
    else:
        try:
            kind, dev_id = (int(x) for x in data.__dlpack_device__())
        except AttributeError:
            raise InvalidArgument(
                f"{type(data).__name__} is neither a DLPack capsule nor an object with "
                "__dlpack__ and __dlpack_device__"
            ) from None
    if kind in dlpack.HOST_TYPES:
        # our reader, not numpy's: it also reads bfloat16 and float8 (ml_dtypes)
        return _host_array(dlpack.from_capsule(capsule or _request(data)))
    env = get_environment()
    ep_device = next(
        (
            d
            for d in env.registry.ep_devices()
            if d.factory.dlpack_device_type == kind and d.memory_info.device.id == dev_id
        ),
        None,
    )
    if ep_device is None:
        raise InvalidArgument(
            f"no execution provider offers DLPack device ({kind}, {dev_id}) (device type "
            f"{kind}, id {dev_id}); available providers: "
            f"{sorted({d.ep_name for d in env.registry.ep_devices()})}"
        )
    factory, device = ep_device.factory, ep_device.memory_info.device
    env.ensure_transfer(factory)
    stream = factory.dlpack_import_stream(device)
    if capsule is None:
        capsule = _request(data, stream.handle if stream is not None else None)
    imp = dlpack.from_capsule(capsule)
    if (imp.device_type, imp.device_id) != (kind, dev_id):
        raise InvalidArgument(
            f"the DLPack capsule is on device ({imp.device_type}, {imp.device_id}), but its "
            f"producer said ({kind}, {dev_id})"
        )
    if not imp.is_contiguous:
        raise InvalidArgument(
            f"a DLPack tensor of shape {list(imp.shape)} with strides {list(imp.strides or ())} "
            "is not dense row-major; make it contiguous first (e.g. .contiguous())"
        )
    t = DeviceTensor(device, imp.dtype, imp.shape, imp.ptr, imp.owner)
    if stream is not None:
        note = stream.create_notification()
        note.activate()
        t.ready = note
    return t


def import_cuda_array(data: Any) -> DeviceTensor:
    """A tensor given by ``__cuda_array_interface__`` (Numba, older CuPy...), in place, on the
    device its pointer belongs to; the interface's ``stream`` (where the producer's pending
    work is queued) is waited for by every reader, through the provider's import stream."""
    cai = data.__cuda_array_interface__
    if cai.get("mask") is not None:
        raise InvalidArgument("__cuda_array_interface__ tensors with a mask are not supported")
    ptr, _ = cai["data"]
    shape = tuple(int(d) for d in cai["shape"])
    dtype = np.dtype(cai["typestr"])
    strides = cai.get("strides")
    if strides is not None and (
        any(s % dtype.itemsize for s in strides)
        or not dlpack.is_row_major(shape, tuple(s // dtype.itemsize for s in strides))
    ):
        raise InvalidArgument(
            f"a __cuda_array_interface__ tensor of shape {list(shape)} with byte strides "
            f"{list(strides)} is not dense row-major; make it contiguous first"
        )
    env = get_environment()
    for d in env.registry.ep_devices():
        f = d.factory
        if f.dlpack_device_type != dlpack.CUDA or not ptr:
            continue
        if f.device_id_of(int(ptr)) != d.memory_info.device.id:
            continue
        device = d.memory_info.device
        env.ensure_transfer(f)
        t = DeviceTensor(device, dtype, shape, int(ptr), data)
        producer = cai.get("stream")
        stream = f.dlpack_import_stream(device)
        if producer is not None and stream is not None:
            stream.wait_for_handle(int(producer))
            note = stream.create_notification()
            note.activate()
            t.ready = note
        return t
    raise InvalidArgument(
        "no execution provider owns the memory of this __cuda_array_interface__ tensor "
        f"(address 0x{int(ptr):x})"
    )


def _request(data: Any, stream: int | None = None) -> Any:
    """``data``'s capsule, asked for as DLPack 1.x (which can say "read-only"), else as the
    producer's older protocol allows; ``stream``: the consumer's stream, if any."""
    kwargs: dict[str, Any] = {} if stream is None else {"stream": stream}
    try:
        return data.__dlpack__(max_version=(1, 0), **kwargs)
    except TypeError:  # a producer older than DLPack 1.0's keywords
        pass
    try:
        return data.__dlpack__(**kwargs)
    except TypeError:  # ... or than the stream argument
        return data.__dlpack__()


def _host_array(imp: dlpack.Imported) -> np.ndarray:
    """A numpy array over host memory a DLPack import describes."""
    if imp.is_contiguous:
        arr = host_view(imp.ptr, imp.shape, imp.dtype, imp.owner)
    else:
        assert imp.strides is not None
        # the elements span [ptr + low, ptr + high] (negative strides reach below ptr): view
        # exactly that memory, and stride from ptr within it
        extents = [(d - 1) * s for d, s in zip(imp.shape, imp.strides, strict=True) if d > 0]
        low = sum(e for e in extents if e < 0)
        high = sum(e for e in extents if e > 0)
        size = imp.dtype.itemsize
        flat = host_view(imp.ptr + low * size, (high - low + 1,), imp.dtype, imp.owner)
        arr = np.lib.stride_tricks.as_strided(
            flat[-low:], imp.shape, tuple(s * size for s in imp.strides)
        )
    if imp.readonly:
        arr.flags.writeable = False
    return arr


__all__ = [
    "CPU",
    "OrtValue",
    "Value",
    "dlpack_device_of",
    "fresh_outputs",
    "import_cuda_array",
    "import_dlpack",
    "to_numpy",
    "unwrap",
]
