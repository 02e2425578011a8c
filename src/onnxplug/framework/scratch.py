"""A frame's cache of device memory outside its static plan: kernel workspaces, library
temporaries (CuPy's, say) and outputs whose size the plan could not fix.

Every run of a shape signature on a frame makes the same requests in the same order, so a
block freed by one run is exactly what the next run asks for. ``FrameScratch`` keeps freed
blocks in free lists keyed by (size, stream) and hands them out again: after the first run a
frame takes nothing from the provider's allocator. Blocks never move between streams, so
stream order alone makes reuse safe; a frame runs one run at a time.

This is also what makes graph capture possible: while a frame's stream captures, a request
the cache cannot serve would be a device allocation inside the graph, and raises
``GraphCaptureViolation`` instead (the capture is abandoned and the run finishes eagerly).

The cache is an ``Allocator``, so the executor and kernels allocate from it with
``allocate(scratch, nbytes, stream)`` like from any allocator, and providers route library
allocations to it through ``current_scratch(device)`` (set for the thread by the executor for
the duration of a run).
"""

from __future__ import annotations

import threading
from typing import Any

from ..errors import GraphCaptureViolation
from .memory import Allocator, Device


class FrameScratch(Allocator):
    """Free lists of blocks of one device, served to the frame that owns them."""

    def __init__(self, allocator: Allocator):
        self.allocator = allocator
        self.memory_info = allocator.memory_info
        self._free: dict[tuple[int, Any], list[int]] = {}
        self._live: dict[int, tuple[int, Any]] = {}  # ptr -> (size, stream key) handed out
        self._owned: dict[int, int] = {}  # ptr -> size, every block taken from the allocator
        self._lock = threading.Lock()  # a free may come from any thread (a dropped output)
        self.capturing = False
        self.closed = False
        self.misses = 0  # blocks taken from the allocator (what a steady state must not do)

    @property
    def is_stream_aware(self) -> bool:
        return True

    def alloc(self, size: int) -> int:
        return self.alloc_on_stream(size, None)

    def alloc_on_stream(self, size: int, stream: Any) -> int:
        key = (size, stream)
        with self._lock:
            blocks = self._free.get(key)
            if blocks:
                ptr = blocks.pop()
                self._live[ptr] = key
                return ptr
            if self.capturing:
                raise GraphCaptureViolation(
                    f"a device allocation of {size} bytes while the stream captures a graph "
                    "(the warm-up runs did not make this request)"
                )
            self.misses += 1
        if stream is not None and self.allocator.is_stream_aware:
            ptr = self.allocator.alloc_on_stream(size, stream)
        else:
            ptr = self.allocator.alloc(size)
        if ptr:
            with self._lock:
                self._owned[ptr] = size
                self._live[ptr] = key
        return ptr

    def free(self, ptr: int) -> None:
        with self._lock:
            key = self._live.pop(ptr, None)
            if key is None:
                return
            if not self.closed:
                self._free.setdefault(key, []).append(ptr)
                return
            self._owned.pop(ptr, None)
        self.allocator.free(ptr)

    def owns(self, ptr: int) -> bool:
        return ptr in self._owned

    @property
    def cached_bytes(self) -> int:
        with self._lock:
            return sum(size for (size, _), ptrs in self._free.items() for _ in ptrs)

    def release_free(self) -> None:
        """Give the free blocks back to the allocator (blocks in use stay)."""
        with self._lock:
            ptrs = [p for ps in self._free.values() for p in ps]
            self._free.clear()
            for p in ptrs:
                self._owned.pop(p, None)
        for p in ptrs:
            self.allocator.free(p)

    def close(self) -> None:
        """The frame is gone: free blocks go back now, blocks in use when they are freed."""
        with self._lock:
            self.closed = True
        self.release_free()

    def get_stats(self) -> dict[str, int]:
        with self._lock:
            in_use = sum(size for size, _ in self._live.values())
            owned = sum(self._owned.values())
        return {"InUse": in_use, "TotalAllocated": owned, "NumAllocs": self.misses}


_tls = threading.local()


def current_scratch(device: Device) -> FrameScratch | None:
    """The scratch of the frame this thread is running on ``device`` (None outside runs)."""
    d = getattr(_tls, "scratch", None)
    return d.get(device) if d else None


def enter_scratch(scratch: dict[Device, FrameScratch]) -> Any:
    """Make ``scratch`` the thread's current scratch; returns what to restore."""
    prev = getattr(_tls, "scratch", None)
    _tls.scratch = scratch
    return prev


def exit_scratch(prev: Any) -> None:
    _tls.scratch = prev


__all__ = ["FrameScratch", "current_scratch", "enter_scratch", "exit_scratch"]
