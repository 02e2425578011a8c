"""The virtual device's memory: host memory behind a counting allocator.

Fresh blocks are filled with 0xFF bytes (NaN for floats, -1 for integers) so that reading
memory nobody wrote, e.g. because a copy or a stream wait is missing, shows up as a wrong
result instead of passing by luck. The allocator knows every live block, so kernels can check
that the memory they are handed has not been freed.
"""

from __future__ import annotations

import bisect
import threading
import weakref

import numpy as np

from onnxplug.ep import Allocator, MemoryInfo

POISON = 0xFF
_ALL: weakref.WeakSet[VirtAllocator] = weakref.WeakSet()


def is_live(ptr: int, nbytes: int) -> bool:
    """Whether some virtual-device allocator has [ptr, ptr + nbytes) in a live block (two
    providers may share a device, and then one's kernels read the other's allocations)."""
    return nbytes == 0 or any(a.is_live(ptr, nbytes) for a in list(_ALL))


class VirtAllocator(Allocator):
    """Allocates host memory for a virtual device and counts everything it does."""

    def __init__(self, memory_info: MemoryInfo, alignment: int = 64):
        self.memory_info = memory_info
        self._alignment = alignment
        self._lock = threading.RLock()
        self._buffers: dict[int, np.ndarray] = {}  # ptr -> backing buffer
        self._sizes: dict[int, int] = {}  # ptr -> requested size
        self._starts: list[int] = []  # sorted live pointers, for containment checks
        self.reset_stats()
        _ALL.add(self)

    def reset_stats(self) -> None:
        with self._lock:
            in_use = sum(self._sizes.values())
            self._stats = {
                "InUse": in_use,
                "MaxInUse": in_use,
                "TotalAllocated": 0,
                "NumAllocs": 0,
                "NumFrees": 0,
                "NumReserves": 0,
                "MaxAllocSize": 0,
            }
            self.sizes: list[int] = []  # size of every alloc since the reset, in order

    def alloc(self, size: int) -> int:
        buf = np.empty(size + self._alignment, dtype=np.uint8)
        ptr = -(-buf.ctypes.data // self._alignment) * self._alignment
        off = ptr - buf.ctypes.data
        buf[off : off + size] = POISON
        with self._lock:
            self._buffers[ptr] = buf
            self._sizes[ptr] = size
            bisect.insort(self._starts, ptr)
            s = self._stats
            s["InUse"] += size
            s["TotalAllocated"] += size
            s["NumAllocs"] += 1
            s["MaxInUse"] = max(s["MaxInUse"], s["InUse"])
            s["MaxAllocSize"] = max(s["MaxAllocSize"], size)
            self.sizes.append(size)
        return ptr

    def reserve(self, size: int) -> int:
        ptr = self.alloc(size)
        with self._lock:
            self._stats["NumReserves"] += 1
        return ptr

    def free(self, ptr: int) -> None:
        with self._lock:
            if ptr not in self._buffers:
                raise ValueError(f"{self.memory_info.name}: free of unknown pointer 0x{ptr:x}")
            del self._buffers[ptr]
            size = self._sizes.pop(ptr)
            del self._starts[bisect.bisect_left(self._starts, ptr)]
            self._stats["InUse"] -= size
            self._stats["NumFrees"] += 1

    def get_stats(self) -> dict[str, int]:
        with self._lock:
            return {**self._stats, "LiveBlocks": len(self._sizes)}

    def is_live(self, ptr: int, nbytes: int) -> bool:
        """Whether [ptr, ptr + nbytes) lies inside one block that has not been freed."""
        with self._lock:
            i = bisect.bisect_right(self._starts, ptr) - 1
            if i < 0:
                return False
            start = self._starts[i]
            return ptr + nbytes <= start + self._sizes[start]
