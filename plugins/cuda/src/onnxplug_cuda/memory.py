"""Device, pinned and external allocators of the CUDA provider (the allocator protocol).

The device allocator takes memory from a private CUDA memory pool with stream-ordered
allocation (``cudaMallocFromPoolAsync``/``cudaFreeAsync``): a block is allocated on the stream
that will use it and freed on the stream it was allocated on, so nothing synchronises the
device. The pool keeps freed memory for reuse until ``shrink``.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

from onnxplug.ep import Allocator, CountingAllocator, MemoryInfo, counters

from .runtime import CAPTURING, DeviceGuard, check, cudart, defer_free

_UINT64_MAX = (1 << 64) - 1


def _cuuint64(n: int):
    from cuda.bindings import driver

    return driver.cuuint64_t(n)


class CudaDeviceAllocator(Allocator):
    def __init__(self, memory_info: MemoryInfo, ordinal: int, limit: int = _UINT64_MAX):
        self.memory_info = memory_info
        self.ordinal = ordinal
        self.limit = limit
        self._lock = threading.RLock()  # re-entrant: a GC-run free may land inside alloc
        self._live: dict[int, tuple[int, int]] = {}  # ptr -> (nbytes, stream handle)
        self._stats = {
            "InUse": 0,
            "MaxInUse": 0,
            "NumAllocs": 0,
            "MaxAllocSize": 0,
            "NumReserves": 0,
        }
        rt = cudart()
        with DeviceGuard(ordinal):
            props = rt.cudaMemPoolProps()
            props.allocType = rt.cudaMemAllocationType.cudaMemAllocationTypePinned
            props.handleTypes = rt.cudaMemAllocationHandleType.cudaMemHandleTypeNone
            props.location.type = rt.cudaMemLocationType.cudaMemLocationTypeDevice
            props.location.id = ordinal
            self.pool = check(rt.cudaMemPoolCreate(props), "cudaMemPoolCreate")
            # keep freed memory in the pool (reuse without going back to the driver)
            check(
                rt.cudaMemPoolSetAttribute(
                    self.pool,
                    rt.cudaMemPoolAttr.cudaMemPoolAttrReleaseThreshold,
                    _cuuint64(_UINT64_MAX),
                ),
                "cudaMemPoolSetAttribute",
            )

    @property
    def is_stream_aware(self) -> bool:
        return True

    def _alloc(self, size: int, stream: int) -> int:
        with self._lock:
            if self._stats["InUse"] + size > self.limit:
                return 0
        ptr = check(
            cudart().cudaMallocFromPoolAsync(size, self.pool, stream), "cudaMallocFromPoolAsync"
        )
        ptr = int(ptr)
        if stream == 0:
            # an allocation made outside any stream must be usable from every stream
            counters.bump(counters.HOST_SYNCS)
            check(cudart().cudaStreamSynchronize(0), "cudaStreamSynchronize")
        with self._lock:
            self._live[ptr] = (size, stream)
            s = self._stats
            s["InUse"] += size
            s["NumAllocs"] += 1
            s["MaxInUse"] = max(s["MaxInUse"], s["InUse"])
            s["MaxAllocSize"] = max(s["MaxAllocSize"], size)
        return ptr

    def alloc(self, size: int) -> int:
        return self._alloc(size, 0)

    def reserve(self, size: int) -> int:
        with self._lock:
            self._stats["NumReserves"] += 1
        return self._alloc(size, 0)

    def alloc_on_stream(self, size: int, stream: Any) -> int:
        return self._alloc(size, int(getattr(stream, "handle", stream) or 0))

    def free(self, ptr: int) -> None:
        with self._lock:
            rec = self._live.get(ptr)
            if rec is None:
                return
            if rec[1] in CAPTURING:
                # its stream records a graph: a free now would become part of it
                defer_free(self, ptr)
                return
            del self._live[ptr]
            self._stats["InUse"] -= rec[0]
        cudart().cudaFreeAsync(ptr, rec[1])

    def retire_stream(self, handle: int) -> None:
        """A stream is about to be destroyed: later frees of its blocks go to stream 0."""
        with self._lock:
            for p, (n, s) in list(self._live.items()):
                if s == handle:
                    self._live[p] = (n, 0)

    def get_stats(self) -> dict[str, int]:
        rt = cudart()
        with self._lock:
            out = dict(self._stats)
        err, value = rt.cudaMemPoolGetAttribute(
            self.pool, rt.cudaMemPoolAttr.cudaMemPoolAttrReservedMemCurrent
        )
        out["TotalAllocated"] = int(value) if int(err) == 0 else 0
        out["Limit"] = min(self.limit, (1 << 63) - 1)
        return out

    def shrink(self) -> None:
        with DeviceGuard(self.ordinal):
            check(cudart().cudaDeviceSynchronize(), "cudaDeviceSynchronize")
            check(cudart().cudaMemPoolTrimTo(self.pool, 0), "cudaMemPoolTrimTo")

    def close(self) -> None:
        rt = cudart()
        with DeviceGuard(self.ordinal):
            rt.cudaDeviceSynchronize()
            for p, (_, s) in list(self._live.items()):
                rt.cudaFreeAsync(p, s)
            self._live.clear()
            rt.cudaDeviceSynchronize()
            rt.cudaMemPoolDestroy(self.pool)


class CudaPinnedAllocator(CountingAllocator):
    """Page-locked host memory (cudaHostAlloc), for fast asynchronous copies."""

    def _raw_alloc(self, size: int) -> int:
        rt = cudart()
        return int(check(rt.cudaHostAlloc(size, rt.cudaHostAllocDefault), "cudaHostAlloc"))

    def _raw_free(self, ptr: int) -> None:
        cudart().cudaFreeHost(ptr)


class ExternalDeviceAllocator(CountingAllocator):
    """Device memory from the user's callbacks (``gpu_external_alloc/free/empty_cache``):
    C functions ``void* alloc(size_t)``, ``void free(void*)``, ``void empty_cache()``, given
    as addresses (e.g. PyTorch's ``torch.cuda.memory`` caching-allocator hooks)."""

    def __init__(
        self, memory_info: MemoryInfo, alloc_fn: int, free_fn: int, empty_cache_fn: int = 0
    ):
        super().__init__(memory_info)
        self._alloc = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t)(alloc_fn)
        self._free = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(free_fn)
        self._empty = ctypes.CFUNCTYPE(None)(empty_cache_fn) if empty_cache_fn else None

    def _raw_alloc(self, size: int) -> int:
        return self._alloc(size) or 0

    def _raw_free(self, ptr: int) -> None:
        self._free(ptr)

    def shrink(self) -> None:
        if self._empty is not None:
            self._empty()
