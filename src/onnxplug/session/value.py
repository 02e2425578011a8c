"""``OrtValue`` (alias ``Value``): a tensor, sequence, map or optional held by the runtime,
on the host or in a provider's device memory, with onnxruntime's Python methods."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import InvalidArgument
from ..framework.memory import CPU, DeviceTensor, allocate_tensor
from ..framework.stream import device_of
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
        dev = getattr(data, "__dlpack_device__", None)
        if dev is not None and dev()[0] != 1:  # not kDLCPU: a provider must import it
            env = get_environment()
            for d in env.registry.ep_devices():
                importer = getattr(d.factory, "tensor_from_dlpack", None)
                if importer is not None:
                    t = importer(data)
                    if t is not None:
                        return OrtValue(t)
            raise InvalidArgument("no execution provider can import this DLPack device tensor")
        arr = np.from_dlpack(data)
        if is_bool_tensor and arr.dtype != np.bool_:
            arr = arr.astype(np.bool_)
        return OrtValue(arr)

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
            get_environment().transfer_for(t.device).copy(src, t)

    # DLPack -----------------------------------------------------------------------------------
    def to_dlpack(self) -> Any:
        t = self._tensor()
        if isinstance(t, np.ndarray):
            return t.__dlpack__()
        env = get_environment()
        d = env.find_device(t.device.type, t.device.id)
        exporter = getattr(d.factory, "tensor_to_dlpack", None)
        if exporter is None:
            raise InvalidArgument(f"execution provider '{d.ep_name}' cannot export DLPack tensors")
        return exporter(t)

    def __dlpack__(self, stream: Any = None, **kwargs: Any) -> Any:
        """DLPack export; keyword arguments of newer protocol versions (``max_version``,
        ``dl_device``, ``copy``) are passed on to numpy for host tensors."""
        t = self._tensor()
        if isinstance(t, np.ndarray):
            return t.__dlpack__(stream=stream, **kwargs)
        return self.to_dlpack()

    def __dlpack_device__(self) -> tuple[int, int]:
        t = self._tensor()
        if isinstance(t, np.ndarray):
            return (1, 0)
        return (2 if t.device.type == "cuda" else 1, t.device.id)

    def __repr__(self) -> str:
        v = self._value
        if self.is_tensor():
            return f"OrtValue({self.data_type()}, shape={self.shape()}, device={device_of(v)})"
        return f"OrtValue({self._kind()})"


Value = OrtValue


def unwrap(value: Any) -> Any:
    return value._value if isinstance(value, OrtValue) else value


__all__ = ["CPU", "OrtValue", "Value", "fresh_outputs", "to_numpy", "unwrap"]
