"""onnxruntime's public device and memory classes: ``OrtDevice``, ``OrtMemoryInfo``,
``OrtHardwareDevice``, ``OrtEpDevice``, their enums, the graph-assignment
records (``OrtEpAssignedSubgraph``/``OrtEpAssignedNode``) and ``SparseTensor``.

They are views of the runtime's own types (``framework.memory.Device``/``MemoryInfo``, the plugin
API's ``EpDevice``), with onnxruntime's names, values and methods, so that scripts written for
onnxruntime read them unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import numpy as np

from ..ep.api import EpDevice
from ..errors import InvalidArgument
from ..framework.memory import CPU, Device, MemoryInfo, MemType
from ..ir.types import tensor_type_str


class _OrtEnum(IntEnum):
    def __str__(self) -> str:  # onnxruntime prints 'OrtMemType.DEFAULT'
        return f"{type(self).__name__}.{self.name}"


class OrtMemType(_OrtEnum):
    CPU_INPUT = -2
    CPU_OUTPUT = -1
    CPU = -1
    DEFAULT = 0


class OrtAllocatorType(_OrtEnum):
    INVALID = -1
    ORT_DEVICE_ALLOCATOR = 0
    ORT_ARENA_ALLOCATOR = 1


class OrtHardwareDeviceType(_OrtEnum):
    CPU = 0
    GPU = 1
    NPU = 2


class OrtExecutionProviderDevicePolicy(_OrtEnum):
    DEFAULT = 0
    PREFER_CPU = 1
    PREFER_NPU = 2
    PREFER_GPU = 3
    MAX_PERFORMANCE = 4
    MAX_EFFICIENCY = 5
    MIN_OVERALL_POWER = 6


class OrtDeviceMemoryType(_OrtEnum):
    DEFAULT = 0
    HOST_ACCESSIBLE = 5


class OrtMemoryInfoDeviceType(_OrtEnum):
    CPU = 0
    GPU = 1
    FPGA = 2
    NPU = 3


class OrtSparseFormat(_OrtEnum):
    ORT_SPARSE_UNDEFINED = 0
    ORT_SPARSE_COO = 1
    ORT_SPARSE_CSRC = 2
    ORT_SPARSE_BLOCK_SPARSE = 4


class OrtDeviceVendorId(IntEnum):
    """PCI vendor ids, as onnxruntime names them."""

    NONE = 0x0000
    AMD = 0x1002
    NVIDIA = 0x10DE
    ARM = 0x13B5
    MICROSOFT = 0x1414
    HUAWEI = 0x19E5
    QUALCOMM = 0x5143
    INTEL = 0x8086


# device type names of OrtDevice.make and their OrtMemoryInfoDeviceType, vendor and memory name
_DEVICE_TYPES = {
    "cpu": (OrtMemoryInfoDeviceType.CPU, OrtDeviceVendorId.NONE, "Cpu"),
    "cuda": (OrtMemoryInfoDeviceType.GPU, OrtDeviceVendorId.NVIDIA, "Cuda"),
    "gpu": (OrtMemoryInfoDeviceType.GPU, OrtDeviceVendorId.NONE, "Gpu"),
    "dml": (OrtMemoryInfoDeviceType.GPU, OrtDeviceVendorId.MICROSOFT, "DML"),
    "cann": (OrtMemoryInfoDeviceType.NPU, OrtDeviceVendorId.HUAWEI, "Cann"),
    "npu": (OrtMemoryInfoDeviceType.NPU, OrtDeviceVendorId.NONE, "Npu"),
    "webgpu": (OrtMemoryInfoDeviceType.GPU, OrtDeviceVendorId.NONE, "WebGPU_Buffer"),
}


def _device_type_of(device: Device) -> OrtMemoryInfoDeviceType:
    entry = _DEVICE_TYPES.get(device.type)
    return entry[0] if entry else OrtMemoryInfoDeviceType.GPU


class OrtDevice:
    """A memory device: type, id, vendor and memory type (onnxruntime's ``OrtDevice``)."""

    def __init__(self, device: Device):
        if not isinstance(device, Device):
            raise InvalidArgument("OrtDevice is made with OrtDevice.make(name, device_id)")
        self._device = device

    @staticmethod
    def make(ort_device_name: str, device_id: int, vendor_id: int = -1) -> OrtDevice:
        name = str(ort_device_name).lower()
        if name not in _DEVICE_TYPES:
            raise InvalidArgument(
                f"Unsupported device type: {ort_device_name} (known: {sorted(_DEVICE_TYPES)})"
            )
        vendor = int(vendor_id) if int(vendor_id) >= 0 else int(_DEVICE_TYPES[name][1])
        return OrtDevice(Device(name, int(device_id), vendor, host_accessible=name == "cpu"))

    def device_id(self) -> int:
        return self._device.id

    def device_type(self) -> int:
        return int(_device_type_of(self._device))

    def device_vendor_id(self) -> int:
        return self._device.vendor_id

    def device_mem_type(self) -> int:
        pinned = self._device.is_cpu and self._device.vendor_id != 0
        return int(OrtDeviceMemoryType.HOST_ACCESSIBLE if pinned else OrtDeviceMemoryType.DEFAULT)

    def __repr__(self) -> str:
        return f"OrtDevice({self._device})"


class OrtMemoryInfo:
    """Names an allocator's memory (onnxruntime's ``OrtMemoryInfo``).

    ``OrtMemoryInfo(name, allocator_type, device_id, mem_type)`` as in onnxruntime: the name
    says the device ("Cpu", "Cuda", "CudaPinned", ...).
    """

    def __init__(
        self,
        name: str,
        allocator_type: OrtAllocatorType | int,
        device_id: int,
        mem_type: OrtMemType | int,
    ):
        self._name = str(name)
        self._allocator_type = OrtAllocatorType(int(allocator_type))
        self._mem_type = OrtMemType(int(mem_type))
        self._info = _memory_info_named(self._name, int(device_id), self._mem_type)

    @staticmethod
    def create_v2(
        name: str,
        device_type: OrtMemoryInfoDeviceType | int,
        vendor_id: int,
        device_id: int,
        mem_type: OrtDeviceMemoryType | int,
        alignment: int,
        allocator_type: OrtAllocatorType | int,
    ) -> OrtMemoryInfo:
        dt = OrtMemoryInfoDeviceType(int(device_type))
        host = OrtDeviceMemoryType(int(mem_type)) == OrtDeviceMemoryType.HOST_ACCESSIBLE
        if dt == OrtMemoryInfoDeviceType.CPU or host:
            device = Device("cpu", 0 if not host else int(device_id), int(vendor_id), True)
        else:
            vendor = OrtDeviceVendorId(int(vendor_id)) if int(vendor_id) in _VENDORS else None
            kind = "cuda" if vendor == OrtDeviceVendorId.NVIDIA else dt.name.lower()
            device = Device(kind, int(device_id), int(vendor_id))
        return OrtMemoryInfo.of(
            MemoryInfo(str(name), device), OrtAllocatorType(int(allocator_type))
        )

    @staticmethod
    def of(
        info: MemoryInfo,
        allocator_type: OrtAllocatorType = OrtAllocatorType.ORT_ARENA_ALLOCATOR,
    ) -> OrtMemoryInfo:
        """The onnxruntime view of a runtime MemoryInfo."""
        self = OrtMemoryInfo.__new__(OrtMemoryInfo)
        self._name = info.name
        self._allocator_type = allocator_type
        self._mem_type = (
            OrtMemType.CPU_OUTPUT
            if info.mem_type == MemType.CPU_OUTPUT
            else OrtMemType.CPU_INPUT
            if info.mem_type == MemType.CPU_INPUT
            else OrtMemType.DEFAULT
        )
        self._info = info
        return self

    @property
    def name(self) -> str:
        return self._name

    @property
    def device_id(self) -> int:
        return self._info.device.id

    @property
    def mem_type(self) -> OrtMemType:
        return self._mem_type

    @property
    def allocator_type(self) -> OrtAllocatorType:
        return self._allocator_type

    @property
    def device_mem_type(self) -> OrtDeviceMemoryType:
        d = self._info.device
        pinned = d.is_cpu and self._name != "Cpu"
        return OrtDeviceMemoryType.HOST_ACCESSIBLE if pinned else OrtDeviceMemoryType.DEFAULT

    @property
    def device_vendor_id(self) -> int:
        return self._info.device.vendor_id

    @property
    def device(self) -> Device:
        """Where this memory is (onnxplug: the runtime's Device)."""
        return self._info.device

    def __eq__(self, other: object) -> bool:
        return isinstance(other, OrtMemoryInfo) and (self._name, self._info.device) == (
            other._name,
            other._info.device,
        )

    def __hash__(self) -> int:
        return hash((self._name, self._info.device))

    def __repr__(self) -> str:
        return f"OrtMemoryInfo({self._name!r}, {self._info.device}, {self._mem_type})"


_VENDORS = {int(v) for v in OrtDeviceVendorId}


def _memory_info_named(name: str, device_id: int, mem_type: OrtMemType) -> MemoryInfo:
    low = name.lower()
    if low == "cpu" or mem_type in (OrtMemType.CPU_INPUT, OrtMemType.CPU_OUTPUT):
        mt = MemType.CPU_INPUT if mem_type == OrtMemType.CPU_INPUT else MemType.DEFAULT
        return MemoryInfo(name, CPU, mt)
    if low.endswith("pinned"):
        vendor = OrtDeviceVendorId.NVIDIA if low.startswith("cuda") else OrtDeviceVendorId.NONE
        return MemoryInfo(name, Device("cpu", 0, int(vendor), True), MemType.CPU_OUTPUT)
    for kind, (_, vendor, mem_name) in _DEVICE_TYPES.items():
        if mem_name.lower() == low:
            return MemoryInfo(name, Device(kind, device_id, int(vendor)))
    return MemoryInfo(name, Device(low, device_id))


@dataclass(frozen=True)
class OrtHardwareDevice:
    """A physical device (onnxruntime's ``OrtHardwareDevice``)."""

    type: OrtHardwareDeviceType
    vendor: str
    vendor_id: int
    device_id: int
    metadata: dict[str, str]


class OrtEpDevice:
    """One (provider, device) pair from ``get_ep_devices()`` (onnxruntime's ``OrtEpDevice``)."""

    __slots__ = ("_d",)

    def __init__(self, ep_device: EpDevice):
        self._d = ep_device

    @property
    def ep_name(self) -> str:
        return self._d.ep_name

    @property
    def ep_vendor(self) -> str:
        return self._d.ep_vendor

    @property
    def ep_metadata(self) -> dict[str, str]:
        return dict(self._d.ep_metadata)

    @property
    def ep_options(self) -> dict[str, str]:
        return dict(self._d.ep_options)

    @property
    def device(self) -> OrtHardwareDevice:
        hw = self._d.device
        kind = (
            OrtHardwareDeviceType[hw.type]
            if hw.type in OrtHardwareDeviceType.__members__
            else (OrtHardwareDeviceType.GPU)
        )
        return OrtHardwareDevice(kind, hw.vendor, hw.vendor_id, hw.device_id, dict(hw.metadata))

    def memory_info(self, memory_type: OrtDeviceMemoryType | int) -> OrtMemoryInfo | None:
        """The memory of this device of ``memory_type``; None where the provider has none of
        its own (host memory of a CPU provider), as in onnxruntime."""
        if OrtDeviceMemoryType(int(memory_type)) == OrtDeviceMemoryType.HOST_ACCESSIBLE:
            hm = self._d.host_accessible_memory_info
            return OrtMemoryInfo.of(hm) if hm is not None else None
        mi = self._d.memory_info
        return None if mi.device.is_cpu else OrtMemoryInfo.of(mi)

    def create_sync_stream(self) -> Any:
        """A stream of this device from its provider (``OrtSyncStream``: ``get_handle()``)."""
        factory = self._d.factory
        stream = factory.create_sync_stream(self._d.memory_info) if factory else None
        if stream is None:
            raise InvalidArgument(f"execution provider '{self.ep_name}' has no streams")
        return stream

    @property
    def factory(self) -> Any:
        """The provider plugin's factory (onnxplug's plugin API)."""
        return self._d.factory

    @property
    def ep_device(self) -> EpDevice:
        """The plugin API's EpDevice behind this one."""
        return self._d

    def __eq__(self, other: object) -> bool:
        return isinstance(other, OrtEpDevice) and other._d is self._d

    def __hash__(self) -> int:
        return id(self._d)

    def __repr__(self) -> str:
        return f"OrtEpDevice({self._d.ep_name}, {self._d.device.type}:{self._d.device.device_id})"


@dataclass(frozen=True)
class OrtEpAssignedNode:
    """A node in ``get_provider_graph_assignment_info()`` (onnxruntime's type)."""

    name: str
    op_type: str
    domain: str
    graph: str = ""  # onnxplug: the (sub)graph the node is in


class OrtEpAssignedSubgraph:
    """Nodes one provider runs (onnxruntime's ``OrtEpAssignedSubgraph``): one node each, as
    onnxruntime reports its kernel-based providers.

    onnxplug: also readable as the record ``{"graph", "node_name", "op_type", "ep"}`` of its
    node (``r["ep"]``), the form earlier onnxplug versions returned.
    """

    __slots__ = ("_nodes", "ep_name")
    _KEYS = ("graph", "node_name", "op_type", "ep")

    def __init__(self, ep_name: str, nodes: list[OrtEpAssignedNode]):
        self.ep_name = ep_name
        self._nodes = list(nodes)

    def get_nodes(self) -> list[OrtEpAssignedNode]:
        return list(self._nodes)

    def __getitem__(self, key: str) -> str:
        n = self._nodes[0]
        values = {"graph": n.graph, "node_name": n.name, "op_type": n.op_type, "ep": self.ep_name}
        try:
            return values[key]
        except KeyError:
            raise KeyError(f"{key!r}: the record's keys are {list(self._KEYS)}") from None

    def keys(self) -> tuple[str, ...]:
        return self._KEYS

    def __repr__(self) -> str:
        names = [n.name for n in self._nodes]
        return f"OrtEpAssignedSubgraph({self.ep_name}, {names})"


class _CooView:
    __slots__ = ("_indices",)

    def __init__(self, indices: np.ndarray):
        self._indices = indices

    def indices(self) -> np.ndarray:
        return self._indices


class _CsrView:
    __slots__ = ("_inner", "_outer")

    def __init__(self, inner: np.ndarray, outer: np.ndarray):
        self._inner, self._outer = inner, outer

    def inner(self) -> np.ndarray:
        return self._inner

    def outer(self) -> np.ndarray:
        return self._outer


class SparseTensor:
    """A sparse tensor in COO or CSR format, on the host (onnxruntime's ``SparseTensor``)."""

    def __init__(
        self,
        fmt: OrtSparseFormat,
        dense_shape: Any,
        values: np.ndarray,
        indices: tuple[np.ndarray, ...],
    ):
        self._format = fmt
        self._shape = [int(d) for d in np.asarray(dense_shape).reshape(-1)]
        self._values = values
        self._indices = indices

    @classmethod
    def sparse_coo_from_numpy(
        cls, dense_shape: Any, values: np.ndarray, coo_indices: np.ndarray, ort_device: OrtDevice
    ) -> SparseTensor:
        _host_only(ort_device)
        vals, idx = _values(values), np.ascontiguousarray(coo_indices, dtype=np.int64)
        if idx.size not in (vals.size, 2 * vals.size) or (idx.ndim == 2 and idx.shape[1] != 2):
            raise InvalidArgument(
                f"sparse_coo_from_numpy: {idx.shape} indices for {vals.size} values (a linear "
                "index per value, or (row, column) pairs)"
            )
        return cls(OrtSparseFormat.ORT_SPARSE_COO, dense_shape, vals, (idx,))

    @classmethod
    def sparse_csr_from_numpy(
        cls,
        dense_shape: Any,
        values: np.ndarray,
        inner_indices: np.ndarray,
        outer_indices: np.ndarray,
        ort_device: OrtDevice,
    ) -> SparseTensor:
        _host_only(ort_device)
        vals = _values(values)
        inner = np.ascontiguousarray(inner_indices, dtype=np.int64)
        outer = np.ascontiguousarray(outer_indices, dtype=np.int64)
        rows = int(np.asarray(dense_shape).reshape(-1)[0])
        if inner.size != vals.size or outer.size != rows + 1:
            raise InvalidArgument(
                f"sparse_csr_from_numpy: {inner.size} inner indices for {vals.size} values and "
                f"{outer.size} outer indices for {rows} rows (must be {rows + 1})"
            )
        return cls(OrtSparseFormat.ORT_SPARSE_CSRC, dense_shape, vals, (inner, outer))

    def format(self) -> OrtSparseFormat:
        return self._format

    def values(self) -> np.ndarray:
        return self._values

    def dense_shape(self) -> np.ndarray:
        return np.asarray(self._shape, dtype=np.int64)

    def data_type(self) -> str:
        return f"sparse_{tensor_type_str(self._values.dtype)}"

    def device_name(self) -> str:
        return "cpu"

    def as_coo_view(self) -> _CooView:
        if self._format != OrtSparseFormat.ORT_SPARSE_COO:
            raise InvalidArgument("this sparse tensor is not in COO format")
        return _CooView(self._indices[0])

    def as_csrc_view(self) -> _CsrView:
        if self._format != OrtSparseFormat.ORT_SPARSE_CSRC:
            raise InvalidArgument("this sparse tensor is not in CSR format")
        return _CsrView(*self._indices)

    def to_dense(self) -> np.ndarray:
        """The dense tensor (onnxplug)."""
        out = np.zeros(self._shape, dtype=self._values.dtype)
        if self._format == OrtSparseFormat.ORT_SPARSE_COO:
            idx = self._indices[0]
            if idx.ndim == 1:
                out.reshape(-1)[idx] = self._values
            else:
                out[tuple(idx.T)] = self._values
        else:
            inner, outer = self._indices
            rows = np.repeat(np.arange(len(outer) - 1), np.diff(outer))
            out[rows, inner] = self._values
        return out


def _host_only(device: OrtDevice) -> None:
    if not isinstance(device, OrtDevice) or device.device_type() != 0:
        raise InvalidArgument(
            "onnxplug keeps sparse tensors on the CPU: pass OrtDevice.make('cpu', 0)"
        )


def _values(values: Any) -> np.ndarray:
    v = np.ascontiguousarray(values)
    if v.dtype.kind in "US":
        v = v.astype(object)
    return v.reshape(-1)


__all__ = [
    "OrtAllocatorType",
    "OrtDevice",
    "OrtDeviceMemoryType",
    "OrtDeviceVendorId",
    "OrtEpAssignedNode",
    "OrtEpAssignedSubgraph",
    "OrtEpDevice",
    "OrtExecutionProviderDevicePolicy",
    "OrtHardwareDevice",
    "OrtHardwareDeviceType",
    "OrtMemType",
    "OrtMemoryInfo",
    "OrtMemoryInfoDeviceType",
    "OrtSparseFormat",
    "SparseTensor",
]
