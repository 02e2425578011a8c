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

from .runtime import (
    CAPTURING,
    ERROR_MEMORY_ALLOCATION,
    DeviceGuard,
    call,
    cuda_error,
    cuda_status,
    cudart,
    defer_free,
    device_synchronize,
)

_UINT64_MAX = (1 << 64) - 1
_INT64_MAX = (1 << 63) - 1
_MEMPOOL_MIN_VERSION = 11020  # CUDA 11.2: cudaMallocAsync and memory pools


def _allocated(what: str, fn: Callable[..., int], *args: Any) -> int:
    """The pointer an allocation call returns; 0 when the device (or host) is out of memory
    (the runtime call has cleared that error: it is not sticky); other errors raised."""
    try:
        return int(fn(*args))
    except Exception as e:
        if cuda_status(e) == ERROR_MEMORY_ALLOCATION:
            return 0
        raise cuda_error(what, e) from e


class CudaDeviceAllocator(CountingAllocator):
    """Raw device memory: ``cudaMalloc`` / ``cudaFree`` on one device (what the device arena
    extends with). Out of memory is a 0 pointer, as the arena expects; ``cudaFree`` waits for
    the device, so only the arena's extensions and shrinks pay for it."""

    def __init__(self, memory_info: MemoryInfo, ordinal: int):
        super().__init__(memory_info)
        self.ordinal = ordinal
        self._reason = threading.local()

    def _raw_alloc(self, size: int) -> int:
        with DeviceGuard(self.ordinal):
            ptr = _allocated(f"cudaMalloc({size})", cudart().malloc, size)
        if not ptr:
            self._reason.text = f"cudaMalloc({size}) on device {self.ordinal}: out of memory"
        return ptr

    def _raw_free(self, ptr: int) -> None:
        with DeviceGuard(self.ordinal):
            call("cudaFree", cudart().free, ptr)

    def failure_reason(self) -> str:
        return getattr(self._reason, "text", "")


class CudaPinnedAllocator(CountingAllocator):
    """Page-locked host memory (cudaHostAlloc), for fast asynchronous copies."""

    def _raw_alloc(self, size: int) -> int:
        rt = cudart()
        return _allocated(f"cudaHostAlloc({size})", rt.hostAlloc, size, rt.hostAllocDefault)

    def _raw_free(self, ptr: int) -> None:
        cudart().freeHost(ptr)


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
    try:
        runtime = rt.runtimeGetVersion()
        driver = rt.driverGetVersion()
        supported = rt.deviceGetAttribute(rt.cudaDevAttrMemoryPoolsSupported, ordinal)
    except Exception as e:
        if cuda_status(e) is None:
            raise
        return f"CUDA mempool support could not be queried on device {ordinal}: {e}"
    if runtime < _MEMPOOL_MIN_VERSION:
        return f"CUDA mempool requires CUDA runtime 11.2 or later (have {runtime})"
    if driver < _MEMPOOL_MIN_VERSION:
        return f"CUDA mempool requires CUDA driver 11.2 or later (have {driver})"
    if not supported:
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
            props = rt.MemPoolProps(
                rt.cudaMemAllocationTypePinned,
                rt.cudaMemHandleTypeNone,
                rt.cudaMemLocationTypeDevice,
                ordinal,
            )
            self.pool = call("cudaMemPoolCreate", rt.memPoolCreate, props)
            if release_threshold:
                call(
                    "cudaMemPoolSetAttribute(ReleaseThreshold)",
                    rt.memPoolSetAttribute,
                    self.pool,
                    rt.cudaMemPoolAttrReleaseThreshold,
                    release_threshold,
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
        what = "cudaMallocFromPoolAsync"
        if stream == 0:
            with DeviceGuard(self.ordinal):
                ptr = _allocated(what, rt.mallocFromPoolAsync, size, self.pool, 0)
        else:
            ptr = _allocated(what, rt.mallocFromPoolAsync, size, self.pool, stream)
        if not ptr:
            self._reason.text = f"cudaMallocFromPoolAsync({size}): out of memory"
            return 0
        if stream == 0:
            # Ordered on the legacy default stream, which our non-blocking streams do not
            # wait for: a block allocated outside any stream must be ready for all of them.
            counters.bump(counters.HOST_SYNCS)
            call("cudaStreamSynchronize", rt.streamSynchronize, 0)
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
                cudart().freeAsync(ptr, 0)
        else:
            cudart().freeAsync(ptr, rec[1])
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
        try:
            reserved = rt.memPoolGetAttribute(self.pool, rt.cudaMemPoolAttrReservedMemCurrent)
        except Exception as e:
            if cuda_status(e) is None:
                raise
            reserved = 0
        out["TotalAllocated"] = int(reserved)
        out["Limit"] = min(self.limit, _INT64_MAX)
        return out

    def shrink(self) -> None:
        device_synchronize(self.ordinal)
        with DeviceGuard(self.ordinal):
            call(
                "cudaMemPoolTrimTo", cudart().memPoolTrimTo, self.pool, self.bytes_to_keep_on_shrink
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
            rt.memPoolTrimTo(self.pool, 0)
            rt.memPoolDestroy(self.pool)


def _c_function(address: int, restype: Any, *argtypes: Any) -> Callable[..., Any]:
    return ctypes.CFUNCTYPE(restype, *argtypes)(address)


class ExternalDeviceAllocator(CountingAllocator):
    """Device memory from the user's allocator (``gpu_external_alloc/free/empty_cache``), for
    one session and with no arena on top. Each callback is a Python callable (``alloc(size) ->
    address``, ``free(address)``, ``empty_cache()``) or the address of a C function ``void*
    alloc(size_t)``, ``void free(void*)``, ``void empty_cache()`` (e.g. PyTorch's caching
    allocator hooks).

    The user's allocator orders its blocks' reuse on the legacy default stream (PyTorch's
    caching allocator reuses a freed block at once for work on the stream it was allocated
    on). The session works on a stream of its own joined to that one (``stream``, set with
    it: ``CudaSyncStream``), so each block joins too: the session's stream waits for the
    user's stream's work when it gets a block, and the user's stream for the session's work
    before a block goes back; a free while the stream captures a graph waits for the
    capture's end."""

    stream: Any = None  # the session's stream, joined to the user's legacy default stream

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
        ptr = int(self._alloc(size) or 0)
        stream = self.stream
        if ptr and stream is not None and not stream.capturing:
            stream.wait_for_user()  # after the user's work on the block before it was freed
        return ptr

    def free(self, ptr: int) -> None:
        stream = self.stream
        # a free may come from any thread (a dropped output): the user's stream waits for the
        # session's work, unless the stream records a graph, whose end the free then waits for
        if stream is not None and ptr in self._live:
            if defer_free(self, ptr, stream.handle, stream.user_waits):
                return
        super().free(ptr)

    def _raw_free(self, ptr: int) -> None:
        self._free(ptr)

    def failure_reason(self) -> str:
        return "the external allocator (gpu_external_alloc) returned no memory"

    def shrink(self) -> None:
        if self._empty is not None:
            self._empty()
