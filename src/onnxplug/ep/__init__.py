"""``onnxplug.ep``: everything a provider plugin may use.

A plugin imports only from here: the factory/EP/device object model, the kernel API, the
allocator, stream and data-transfer protocols, the BFC arena and the shared-arena cache, ONNX
type helpers, shared shape logic, the host-provided control-flow kernels (If/Loop/Scan) and
the errors.
"""

from .. import errors
from ..errors import (
    EPFail,
    Fail,
    GraphCaptureViolation,
    InvalidArgument,
    InvalidGraph,
    NotImplemented,
    OutOfMemory,
)
from ..framework import counters, shapes
from ..framework.arena import (
    ARENA_OPTIONS,
    EXTEND_STRATEGIES,
    ArenaConfig,
    BFCArena,
    SharedArenas,
    parse_byte_count,
)
from ..framework.control_flow import IfKernel, LoopKernel, ScanKernel
from ..framework.kernel import (
    Kernel,
    KernelContext,
    KernelDef,
    KernelInfo,
    KernelRegistry,
    dtypes,
    types_match,
)
from ..framework.memory import (
    CPU,
    CPU_MEMORY,
    Allocation,
    Allocator,
    CountingAllocator,
    Device,
    DeviceTensor,
    HostAllocator,
    MemoryInfo,
    MemType,
    alloc_ptr,
    allocate,
    allocate_tensor,
    copy_host_bytes,
    host_view,
)
from ..framework.scratch import FrameScratch, current_scratch
from ..framework.seed import node_seed
from ..framework.stream import (
    DataTransfer,
    DeviceTimer,
    HostTimer,
    ImmediateNotification,
    ImmediateStream,
    SyncNotification,
    SyncStream,
    device_of,
)
from ..ir.types import ValueType, elem_type_name, elem_type_of, np_dtype, tensor_type_str
from .api import (
    API_VERSION,
    CAPABILITIES,
    CPU_HARDWARE,
    Ep,
    EpDevice,
    EpFactory,
    GraphView,
    HardwareDevice,
    SessionConfig,
    supports,
)

__all__ = [
    "API_VERSION",
    "ARENA_OPTIONS",
    "CAPABILITIES",
    "EXTEND_STRATEGIES",
    "CPU",
    "CPU_HARDWARE",
    "CPU_MEMORY",
    "Allocation",
    "Allocator",
    "ArenaConfig",
    "BFCArena",
    "CountingAllocator",
    "DataTransfer",
    "Device",
    "DeviceTensor",
    "DeviceTimer",
    "EPFail",
    "Ep",
    "EpDevice",
    "EpFactory",
    "Fail",
    "FrameScratch",
    "GraphCaptureViolation",
    "GraphView",
    "HardwareDevice",
    "HostAllocator",
    "HostTimer",
    "IfKernel",
    "ImmediateNotification",
    "ImmediateStream",
    "InvalidArgument",
    "InvalidGraph",
    "Kernel",
    "KernelContext",
    "KernelDef",
    "KernelInfo",
    "KernelRegistry",
    "LoopKernel",
    "MemType",
    "MemoryInfo",
    "NotImplemented",
    "OutOfMemory",
    "ScanKernel",
    "SessionConfig",
    "SharedArenas",
    "SyncNotification",
    "SyncStream",
    "ValueType",
    "alloc_ptr",
    "allocate",
    "allocate_tensor",
    "copy_host_bytes",
    "counters",
    "current_scratch",
    "device_of",
    "dtypes",
    "elem_type_name",
    "elem_type_of",
    "errors",
    "host_view",
    "node_seed",
    "np_dtype",
    "parse_byte_count",
    "shapes",
    "supports",
    "tensor_type_str",
    "types_match",
]
