"""Devices, memory infos, the allocator protocol and device tensors.

Host (CPU) tensors are plain numpy arrays everywhere in the runtime. Tensors that live in an
execution provider's own memory are ``DeviceTensor``s: a dtype, a shape and a raw pointer into
an allocation made by that provider's allocator. The allocator protocol mirrors onnxruntime's
``OrtAllocator`` (alloc, free, reserve, alloc_on_stream, stats, shrink).
"""

from __future__ import annotations

import ctypes
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import numpy as np

from ..errors import OutOfMemory


class MemType(IntEnum):
    """Where a kernel wants an input or produces an output (onnxruntime's OrtMemType)."""

    DEFAULT = 0  # the provider's device memory
    CPU_INPUT = 1  # an input the kernel reads on the host (e.g. Reshape's shape)
    CPU_OUTPUT = 2  # an output the kernel writes on the host


@dataclass(frozen=True)
class Device:
    """A memory device (onnxruntime's OrtDevice): 'cpu', 'cuda', ... with an ordinal."""

    type: str
    id: int = 0
    vendor_id: int = 0
    host_accessible: bool = False  # e.g. pinned host memory or a host-backed test device

    @property
    def is_cpu(self) -> bool:
        return self.type == "cpu"

    def __str__(self) -> str:
        return f"{self.type}:{self.id}"


CPU = Device("cpu", 0, host_accessible=True)


@dataclass(frozen=True)
class MemoryInfo:
    """Names an allocator's memory (onnxruntime's OrtMemoryInfo)."""

    name: str
    device: Device
    mem_type: MemType = MemType.DEFAULT
    alloc_type: str = "device"  # "device" | "arena"


CPU_MEMORY = MemoryInfo("Cpu", CPU)


class Allocator(ABC):
    """The allocator protocol every provider implements for its memory.

    Pointers are plain ints. ``alloc_on_stream`` lets a stream-aware allocator (an arena) tag
    the block with the stream that will use it; others just allocate.
    """

    memory_info: MemoryInfo

    @abstractmethod
    def alloc(self, size: int) -> int: ...

    @abstractmethod
    def free(self, ptr: int) -> None: ...

    def reserve(self, size: int) -> int:
        """Allocate outside any arena growth pattern (used for initializers)."""
        return self.alloc(size)

    def alloc_on_stream(self, size: int, stream: Any) -> int:
        return self.alloc(size)

    @property
    def is_stream_aware(self) -> bool:
        return False

    def get_stats(self) -> dict[str, int]:
        return {}

    def shrink(self) -> None:
        """Return unused memory to the system, if the allocator holds any."""

    def failure_reason(self) -> str:
        """Why the last allocation of this thread that returned 0 failed ("" if unknown)."""
        return ""

    def close(self) -> None:
        """No one will allocate from this allocator again: give back what it holds. Blocks
        still live stay valid until they are freed."""


class Allocation:
    """Owns one block from an allocator and frees it when released or garbage collected."""

    __slots__ = ("__weakref__", "allocator", "nbytes", "ptr", "tag")

    def __init__(self, allocator: Allocator | None, ptr: int, nbytes: int):
        self.allocator = allocator
        self.ptr = ptr
        self.nbytes = nbytes
        self.tag: Any = None  # the executor's memory-plan recorder marks blocks it tracks

    def release(self) -> None:
        a = self.allocator
        if a is not None and self.ptr:
            self.allocator = None
            a.free(self.ptr)

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:
            pass


def alloc_ptr(allocator: Allocator, nbytes: int, stream: Any = None, reserve: bool = False) -> int:
    """A block of ``nbytes`` > 0 from ``allocator`` (on ``stream`` when it is stream aware,
    outside its growth pattern with ``reserve``), or ``OutOfMemory`` saying why not."""
    if reserve:
        ptr = allocator.reserve(nbytes)
    elif stream is not None and allocator.is_stream_aware:
        ptr = allocator.alloc_on_stream(nbytes, stream)
    else:
        ptr = allocator.alloc(nbytes)
    if not ptr:
        mi = allocator.memory_info
        why = allocator.failure_reason()
        raise OutOfMemory(
            f"Failed to allocate memory for requested buffer of size {nbytes} from allocator "
            f"'{mi.name}' on {mi.device}" + (f": {why}" if why else "")
        )
    return ptr


def allocate(
    allocator: Allocator, nbytes: int, stream: Any = None, reserve: bool = False
) -> Allocation:
    if nbytes <= 0:
        return Allocation(None, 0, 0)
    return Allocation(allocator, alloc_ptr(allocator, nbytes, stream, reserve), nbytes)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class DeviceTensor:
    """A dense, row-major tensor in a provider's memory.

    ``owner`` keeps the memory alive: an ``Allocation`` or another object (the tensor a view
    was taken from, a foreign buffer, a planned block). ``ready``: for a tensor imported from
    another library (DLPack), the notification that the producer's pending work on it is
    done; whoever reads or writes the tensor waits for it first (``stream.await_ready``).
    """

    __slots__ = ("device", "dtype", "owner", "ptr", "ready", "shape", "stable_view")

    def __init__(self, device: Device, dtype: Any, shape: tuple[int, ...], ptr: int, owner: Any):
        self.device = device
        self.dtype = np.dtype(dtype)
        self.shape = tuple(int(d) for d in shape)
        self.ptr = ptr
        self.owner = owner
        self.ready: Any = None
        # A tensor the executor hands out again on every run (same memory, shape and dtype: a
        # slot of a static memory plan) carries a dict here where a provider may keep its
        # array view of it, to skip rebuilding the view every run; None for other tensors.
        self.stable_view: dict[Any, Any] | None = None

    @property
    def memory(self) -> Any:
        """What owns the memory (the owner of the tensor a view was taken from, and so on):
        an ``Allocation``, a planned block, a foreign buffer. A cached array view of a stable
        tensor keeps this, never the tensor, whose ``stable_view`` holds the view: a
        reference cycle through a numpy array's base is never collected."""
        o = self.owner
        while isinstance(o, DeviceTensor):
            o = o.owner
        return o

    @property
    def size(self) -> int:
        return _numel(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * self.dtype.itemsize

    def view(self, shape: tuple[int, ...], dtype: Any = None) -> DeviceTensor:
        """Same memory, another shape (and optionally another dtype of the same size).

        A view of a stable tensor (one the executor hands out every run) is itself stable:
        it is made once and returned again, so a chain of Reshapes builds nothing per run."""
        shape = tuple(shape)
        cache = self.stable_view
        if cache is not None:
            key = (shape, dtype)
            v = cache.get(key)
            if v is None:
                v = cache[key] = self._view(shape, dtype)
                v.stable_view = {}
            return v
        return self._view(shape, dtype)

    def _view(self, shape: tuple[int, ...], dtype: Any) -> DeviceTensor:
        dt = self.dtype if dtype is None else np.dtype(dtype)
        if _numel(shape) * dt.itemsize != self.nbytes:
            raise ValueError(f"cannot view {self.shape} {self.dtype} as {shape} {dt}")
        v = DeviceTensor(self.device, dt, shape, self.ptr, self)
        v.ready = self.ready
        return v

    def host_array(self) -> np.ndarray:
        """A numpy view of the memory; only for host-accessible devices."""
        if not self.device.host_accessible:
            raise TypeError(f"memory on {self.device} is not host accessible")
        return host_view(self.ptr, self.shape, self.dtype, self)

    def __repr__(self) -> str:
        return f"DeviceTensor({self.device}, {self.dtype}, {self.shape}, ptr=0x{self.ptr:x})"


def allocate_tensor(
    allocator: Allocator,
    shape: tuple[int, ...],
    dtype: Any,
    stream: Any = None,
    reserve: bool = False,
) -> DeviceTensor:
    """A tensor in a new block of ``allocator``; ``reserve`` for initializers (outside an
    arena's bins, so that they do not shape its growth)."""
    dt = np.dtype(dtype)
    alloc = allocate(allocator, _numel(tuple(shape)) * dt.itemsize, stream, reserve)
    return DeviceTensor(allocator.memory_info.device, dt, tuple(shape), alloc.ptr, alloc)


# where each tensor of a shared block starts (cudaMalloc's own alignment; cuBLASLt and cuDNN
# want at least 16 bytes)
BLOCK_ALIGN = 256


def allocate_tensors_in_block(
    allocator: Allocator, specs: list[tuple[tuple[int, ...], Any]]
) -> list[DeviceTensor]:
    """Tensors of the given (shape, dtype)s in one block reserved from ``allocator``, each
    starting on a ``BLOCK_ALIGN`` boundary; the block is freed when the last of them goes.
    For initializers: one reservation per device instead of one per tensor (each cudaMalloc
    cost 1.3 ms of ResNet-50's session creation, 108 of them), as onnxruntime plans them."""
    offsets, total = [], 0
    for shape, dtype in specs:
        offsets.append(total)
        nbytes = _numel(tuple(shape)) * np.dtype(dtype).itemsize
        total += -(-nbytes // BLOCK_ALIGN) * BLOCK_ALIGN
    alloc = allocate(allocator, total, None, reserve=True)
    device = allocator.memory_info.device
    block = DeviceTensor(device, np.uint8, (total,), alloc.ptr, alloc)
    return [
        DeviceTensor(device, dtype, tuple(shape), alloc.ptr + off if alloc.ptr else 0, block)
        for (shape, dtype), off in zip(specs, offsets)
    ]


class _HostBuffer:
    __slots__ = ("__array_interface__", "keep")

    def __init__(self, ptr: int, nbytes: int, keep: Any):
        self.__array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
        }
        self.keep = keep


def host_view(ptr: int, shape: tuple[int, ...], dtype: Any, keep: Any) -> np.ndarray:
    """numpy array over host memory at ``ptr`` that keeps ``keep`` alive."""
    dt = np.dtype(dtype)
    nbytes = _numel(tuple(shape)) * dt.itemsize
    if nbytes == 0:
        return np.empty(shape, dt)
    raw = np.asarray(_HostBuffer(ptr, nbytes, keep))
    return raw.view(dt).reshape(shape)


class CountingAllocator(Allocator):
    """An allocator over raw alloc/free functions that keeps onnxruntime's basic stats
    (``InUse``, ``TotalAllocated``, ``MaxInUse``, ``NumAllocs``). Subclasses implement
    ``_raw_alloc(size) -> ptr`` (0 on failure) and ``_raw_free(ptr)``."""

    def __init__(self, memory_info: MemoryInfo):
        self.memory_info = memory_info
        self._lock = threading.RLock()  # re-entrant: a GC-run free may land inside alloc
        self._live: dict[int, int] = {}
        self._stats = {"InUse": 0, "TotalAllocated": 0, "MaxInUse": 0, "NumAllocs": 0}

    def _raw_alloc(self, size: int) -> int:
        raise NotImplementedError

    def _raw_free(self, ptr: int) -> None:
        raise NotImplementedError

    def alloc(self, size: int) -> int:
        ptr = self._raw_alloc(size)
        if ptr:
            with self._lock:
                self._live[ptr] = size
                s = self._stats
                s["InUse"] += size
                s["TotalAllocated"] += size
                s["NumAllocs"] += 1
                s["MaxInUse"] = max(s["MaxInUse"], s["InUse"])
        return ptr

    def free(self, ptr: int) -> None:
        with self._lock:
            size = self._live.pop(ptr, None)
            if size is None:
                return
            self._stats["InUse"] -= size
        self._raw_free(ptr)

    def get_stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self._stats)


class HostAllocator(CountingAllocator):
    """Host memory from numpy buffers; pointers stay valid until ``free``."""

    def __init__(self, memory_info: MemoryInfo = CPU_MEMORY, alignment: int = 64):
        super().__init__(memory_info)
        self._alignment = alignment
        self._blocks: dict[int, np.ndarray] = {}

    def _raw_alloc(self, size: int) -> int:
        buf = np.empty(size + self._alignment, dtype=np.uint8)
        base = buf.ctypes.data
        ptr = (base + self._alignment - 1) // self._alignment * self._alignment
        with self._lock:
            self._blocks[ptr] = buf
        return ptr

    def _raw_free(self, ptr: int) -> None:
        with self._lock:
            self._blocks.pop(ptr, None)


def copy_host_bytes(dst_ptr: int, src_ptr: int, nbytes: int) -> None:
    if nbytes:
        ctypes.memmove(dst_ptr, src_ptr, nbytes)
