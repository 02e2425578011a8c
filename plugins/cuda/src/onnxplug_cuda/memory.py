"""The CUDA provider's memory: raw device and pinned allocators (under the BFC arenas), the
stream-ordered memory-pool allocator (``arena.use_cuda_mempool=1``) and the user's external
allocator (``gpu_external_alloc/free/empty_cache``).

By default device memory comes from a BFC arena (``onnxplug.ep.BFCArena``) over
``CudaDeviceAllocator`` (``cudaMalloc``/``cudaFree``): allocating and freeing a block is
bookkeeping on the host, no CUDA call and no synchronisation; the arena tags blocks with the
stream that uses them so another stream reuses them only after waiting for it. Pinned host
memory comes from a (not stream-aware) arena over ``CudaPinnedAllocator``.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import Any

from onnxplug.ep import Allocator, BFCArena, CountingAllocator, MemoryInfo, counters

from .runtime import CAPTURING, DeviceGuard, check, cudart, defer_free, device_synchronize

_UINT64_MAX = (1 << 64) - 1
_INT64_MAX = (1 << 63) - 1
_MEMPOOL_MIN_VERSION = 11020  # CUDA 11.2: cudaMallocAsync and memory pools


def _cuuint64(n: int):
    from cuda.bindings import driver

    return driver.cuuint64_t(n)


def _is_oom(err: Any) -> bool:
    return err == cudart().cudaError_t.cudaErrorMemoryAllocation


class CudaDeviceAllocator(CountingAllocator):
    """Raw device memory: ``cudaMalloc`` / ``cudaFree`` on one device (what the device arena
    extends with). Out of memory is a 0 pointer, as the arena expects; ``cudaFree`` waits for
    the device, so only the arena's extensions and shrinks pay for it."""

    def __init__(self, memory_info: MemoryInfo, ordinal: int):
        super().__init__(memory_info)
        self.ordinal = ordinal
        self._reason = threading.local()

    def _raw_alloc(self, size: int) -> int:
        rt = cudart()
        with DeviceGuard(self.ordinal):
            err, ptr = rt.cudaMalloc(size)
        if _is_oom(err):
            rt.cudaGetLastError()  # not sticky: clear it so later calls do not report it
            self._reason.text = f"cudaMalloc({size}) on device {self.ordinal}: out of memory"
            return 0
        check((err,), f"cudaMalloc({size})")
        return int(ptr)

    def _raw_free(self, ptr: int) -> None:
        with DeviceGuard(self.ordinal):
            check(cudart().cudaFree(ptr), "cudaFree")

    def failure_reason(self) -> str:
        return getattr(self._reason, "text", "")


class CudaPinnedAllocator(CountingAllocator):
    """Page-locked host memory (cudaHostAlloc), for fast asynchronous copies."""

    def _raw_alloc(self, size: int) -> int:
        rt = cudart()
        err, ptr = rt.cudaHostAlloc(size, rt.cudaHostAllocDefault)
        if _is_oom(err):
            rt.cudaGetLastError()
            return 0
        check((err,), f"cudaHostAlloc({size})")
        return int(ptr)

    def _raw_free(self, ptr: int) -> None:
        cudart().cudaFreeHost(ptr)


class CudaDeviceArena(BFCArena):
    """The device arena. Stream-aware; shrinking first waits for the device, so that no
    queued kernel still uses a region that goes back."""

    def __init__(self, raw: CudaDeviceAllocator, config: Any):
        super().__init__(raw, config, raw.memory_info, stream_aware=True)
        self.ordinal = raw.ordinal

    def shrink(self) -> None:
        device_synchronize(self.ordinal)
        super().shrink()


def mempool_unsupported(ordinal: int) -> str | None:
    """Why ``arena.use_cuda_mempool=1`` cannot work on this device (None: it can)."""
    rt = cudart()
    err, runtime = rt.cudaRuntimeGetVersion()
    if int(err) != 0 or runtime < _MEMPOOL_MIN_VERSION:
        return f"CUDA mempool requires CUDA runtime 11.2 or later (have {runtime})"
    err, driver = rt.cudaDriverGetVersion()
    if int(err) != 0 or driver < _MEMPOOL_MIN_VERSION:
        return f"CUDA mempool requires CUDA driver 11.2 or later (have {driver})"
    err, supported = rt.cudaDeviceGetAttribute(
        rt.cudaDeviceAttr.cudaDevAttrMemoryPoolsSupported, ordinal
    )
    if int(err) != 0 or not supported:
        return f"device {ordinal} does not support memory pools"
    return None


class CudaMempoolAllocator(Allocator):
    """Stream-ordered device memory from a private CUDA memory pool (onnxruntime's
    ``CudaMempoolOrtAllocator``): ``cudaMallocFromPoolAsync`` on the stream that will use a
    block, ``cudaFreeAsync`` on the stream it was allocated on. The pool keeps freed memory up
    to ``release_threshold`` bytes (0: the pool's default, which gives memory back at every
    synchronisation); ``shrink`` trims it to ``bytes_to_keep_on_shrink``."""

    def __init__(
        self,
        memory_info: MemoryInfo,
        ordinal: int,
        limit: int = _UINT64_MAX,
        release_threshold: int = 0,
        bytes_to_keep_on_shrink: int = 0,
    ):
        self.memory_info = MemoryInfo(
            memory_info.name, memory_info.device, memory_info.mem_type, "arena"
        )
        self.ordinal = ordinal
        self.limit = limit
        self.bytes_to_keep_on_shrink = bytes_to_keep_on_shrink
        self._lock = threading.RLock()  # re-entrant: a GC-run free may land inside alloc
        self._live: dict[int, tuple[int, int]] = {}  # ptr -> (nbytes, stream handle)
        self._closed = False
        self._reason = threading.local()
        self._stats = {
            "InUse": 0,
            "MaxInUse": 0,
            "NumAllocs": 0,
            "MaxAllocSize": 0,
            "NumReserves": 0,
            "NumArenaShrinkages": 0,
        }
        rt = cudart()
        with DeviceGuard(ordinal):
            props = rt.cudaMemPoolProps()
            props.allocType = rt.cudaMemAllocationType.cudaMemAllocationTypePinned
            props.handleTypes = rt.cudaMemAllocationHandleType.cudaMemHandleTypeNone
            props.location.type = rt.cudaMemLocationType.cudaMemLocationTypeDevice
            props.location.id = ordinal
            self.pool = check(rt.cudaMemPoolCreate(props), "cudaMemPoolCreate")
            if release_threshold:
                check(
                    rt.cudaMemPoolSetAttribute(
                        self.pool,
                        rt.cudaMemPoolAttr.cudaMemPoolAttrReleaseThreshold,
                        _cuuint64(release_threshold),
                    ),
                    "cudaMemPoolSetAttribute(ReleaseThreshold)",
                )

    @property
    def is_stream_aware(self) -> bool:
        return True

    def _alloc(self, size: int, stream: int) -> int:
        with self._lock:
            if self._stats["InUse"] + size > self.limit:
                self._reason.text = (
                    f"{self._stats['InUse']} bytes in use + {size} would exceed the limit of "
                    f"{self.limit} bytes"
                )
                return 0
        rt = cudart()
        if stream == 0:
            with DeviceGuard(self.ordinal):
                err, ptr = rt.cudaMallocFromPoolAsync(size, self.pool, 0)
        else:
            err, ptr = rt.cudaMallocFromPoolAsync(size, self.pool, stream)
        if _is_oom(err):
            rt.cudaGetLastError()
            self._reason.text = f"cudaMallocFromPoolAsync({size}): out of memory"
            return 0
        check((err,), "cudaMallocFromPoolAsync")
        ptr = int(ptr)
        if stream == 0:
            # Ordered on the legacy default stream, which our non-blocking streams do not
            # wait for: a block allocated outside any stream must be ready for all of them.
            counters.bump(counters.HOST_SYNCS)
            check(rt.cudaStreamSynchronize(0), "cudaStreamSynchronize")
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
            if rec[1] in CAPTURING and defer_free(self, ptr, rec[1]):
                return  # its stream records a graph: a free now would become part of it
            del self._live[ptr]
            self._stats["InUse"] -= rec[0]
            destroy = self._closed and not self._live
        if rec[1] == 0:  # ordered on the legacy default stream: the pool's device's
            with DeviceGuard(self.ordinal):
                cudart().cudaFreeAsync(ptr, 0)
        else:
            cudart().cudaFreeAsync(ptr, rec[1])
        if destroy:
            self._destroy()

    def failure_reason(self) -> str:
        return getattr(self._reason, "text", "")

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
            if self._closed and not self._live:
                out["TotalAllocated"] = 0
                out["Limit"] = min(self.limit, _INT64_MAX)
                return out
        err, value = rt.cudaMemPoolGetAttribute(
            self.pool, rt.cudaMemPoolAttr.cudaMemPoolAttrReservedMemCurrent
        )
        out["TotalAllocated"] = int(value) if int(err) == 0 else 0
        out["Limit"] = min(self.limit, _INT64_MAX)
        return out

    def shrink(self) -> None:
        device_synchronize(self.ordinal)
        with DeviceGuard(self.ordinal):
            check(
                cudart().cudaMemPoolTrimTo(self.pool, self.bytes_to_keep_on_shrink),
                "cudaMemPoolTrimTo",
            )
        with self._lock:
            self._stats["NumArenaShrinkages"] += 1

    def close(self) -> None:
        """No one allocates from the pool any more: it is destroyed once its last block is
        freed (blocks still live stay valid)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            idle = not self._live
        if idle:
            self._destroy()

    def _destroy(self) -> None:
        rt = cudart()
        device_synchronize(self.ordinal)
        with DeviceGuard(self.ordinal):
            rt.cudaMemPoolTrimTo(self.pool, 0)
            rt.cudaMemPoolDestroy(self.pool)


def _c_function(address: int, restype: Any, *argtypes: Any) -> Callable[..., Any]:
    return ctypes.CFUNCTYPE(restype, *argtypes)(address)


class ExternalDeviceAllocator(CountingAllocator):
    """Device memory from the user's allocator (``gpu_external_alloc/free/empty_cache``), for
    one session and with no arena on top. Each callback is a Python callable (``alloc(size) ->
    address``, ``free(address)``, ``empty_cache()``) or the address of a C function ``void*
    alloc(size_t)``, ``void free(void*)``, ``void empty_cache()`` (e.g. PyTorch's caching
    allocator hooks)."""

    def __init__(
        self, memory_info: MemoryInfo, alloc_fn: Any, free_fn: Any, empty_cache_fn: Any = 0
    ):
        super().__init__(memory_info)
        self._alloc = (
            alloc_fn
            if callable(alloc_fn)
            else _c_function(alloc_fn, ctypes.c_void_p, ctypes.c_size_t)
        )
        self._free = free_fn if callable(free_fn) else _c_function(free_fn, None, ctypes.c_void_p)
        self._empty: Callable[[], Any] | None = None
        if callable(empty_cache_fn):
            self._empty = empty_cache_fn
        elif empty_cache_fn:
            self._empty = _c_function(empty_cache_fn, None)

    def _raw_alloc(self, size: int) -> int:
        return int(self._alloc(size) or 0)

    def _raw_free(self, ptr: int) -> None:
        self._free(ptr)

    def failure_reason(self) -> str:
        return "the external allocator (gpu_external_alloc) returned no memory"

    def shrink(self) -> None:
        if self._empty is not None:
            self._empty()
