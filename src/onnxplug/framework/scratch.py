"""A frame's cache of device memory outside its static plan: kernel workspaces, library
temporaries (CuPy's, say) and outputs whose size the plan could not fix.

Every run of a shape signature on a frame makes the same requests in the same order, so a
block freed by one run is exactly what the next run asks for. ``FrameScratch`` keeps freed
blocks in free lists keyed by (size, stream, kind) and hands them out again: after the first
run a frame takes nothing from the provider's allocator. Blocks never move between streams, so
stream order alone makes reuse safe; a frame runs one run at a time.

Two kinds of blocks never share memory:

* *workspaces* (``ctx.scratch``: cuBLASLt's, cuDNN's) are only ever used inside one library
  call, so any later workspace request of the stream may reuse one, even a block a captured
  graph or a prepared call keeps using: on one stream their uses never overlap;
* *values* (library temporaries, outputs) may live across calls. A captured graph writes the
  temporaries it was recorded with on every replay, so blocks handed out while a capture is
  recorded are *held*: they are never handed to anything else until the graph is released
  (``begin_hold``/``end_hold``/``release_held``).

This is also what makes graph capture possible at all: while a frame's stream captures, a
request the cache cannot serve would be a device allocation inside the graph, and raises
``GraphCaptureViolation`` instead (the capture is abandoned and the run finishes eagerly).

Workspaces of a kernel whose provider has the kernel sync stream (plugin API 3) are tagged with
the stream in the provider's stream-aware arena; for an older provider they are taken untagged
(``untagged_workspaces``, onnxruntime's fallback). Either way the frame's own free lists keep
each stream's blocks apart.

The cache is an ``Allocator`` (of values; ``workspaces`` is the allocator of workspaces), so
the executor and kernels allocate from it with ``allocate(scratch, nbytes, stream)``, and
providers route library allocations to it through ``current_scratch(device)`` (set for the
thread by the executor for the duration of a run).
"""

from __future__ import annotations

import threading
from typing import Any

from ..errors import GraphCaptureViolation
from .memory import Allocator, Device

VALUE = 0
WORKSPACE = 1


class FrameScratch(Allocator):
    """Free lists of blocks of one device, served to the frame that owns them."""

    def __init__(self, allocator: Allocator):
        self.allocator = allocator
        self.memory_info = allocator.memory_info
        self._free: dict[tuple[int, Any, int], list[int]] = {}
        self._live: dict[int, tuple[int, Any, int]] = {}  # ptr -> its free-list key, in use
        self._owned: dict[int, int] = {}  # ptr -> size, every block taken from the allocator
        self._lock = threading.Lock()  # a free may come from any thread (a dropped output)
        self.capturing = False
        self.closed = False
        self.misses = 0  # blocks taken from the allocator (what a steady state must not do)
        self._holding: list[int] | None = None  # value blocks handed out while holding
        self._held: set[int] = set()
        self._freed_held: set[int] = set()  # held blocks their user freed meanwhile
        self._hold_free: dict[tuple[int, Any, int], list[int]] = {}  # ... during this hold
        self.workspaces = _Workspaces(self, tagged=True)
        self.untagged_workspaces = _Workspaces(self, tagged=False)
        # (stream, tagged) -> the prepared calls' workspace
        self.stacks: dict[tuple[Any, bool], WorkspaceStack] = {}

    def stack(self, stream: Any, tagged: bool = True) -> WorkspaceStack:
        st = self.stacks.get((stream, tagged))
        if st is None:
            st = self.stacks[stream, tagged] = WorkspaceStack(self, stream, tagged)
        return st

    @property
    def is_stream_aware(self) -> bool:
        return True

    def alloc(self, size: int) -> int:
        return self.take(size, None, VALUE)

    def alloc_on_stream(self, size: int, stream: Any) -> int:
        return self.take(size, stream, VALUE)

    def take(self, size: int, stream: Any, kind: int, tagged: bool = True) -> int:
        """A block of ``size`` bytes for ``stream``; ``tagged``: a new block is tagged with the
        stream in a stream-aware allocator (else allocated untagged)."""
        key = (size, stream, kind)
        hold = kind == VALUE and self._holding is not None
        with self._lock:
            if hold:
                # a held block freed earlier in the same capture: the graph reuses it in
                # stream order, as the eager run did
                reuse = self._hold_free.get(key)
                if reuse:
                    ptr = reuse.pop()
                    self._freed_held.discard(ptr)
                    return ptr
            blocks = self._free.get(key)
            if blocks:
                ptr = blocks.pop()
                self._live[ptr] = key
                if hold:
                    self._hold(ptr)
                return ptr
            if self.capturing:
                raise GraphCaptureViolation(
                    f"a device allocation of {size} bytes while the stream captures a graph "
                    "(the warm-up runs did not make this request)"
                )
            self.misses += 1
        if tagged and stream is not None and self.allocator.is_stream_aware:
            ptr = self.allocator.alloc_on_stream(size, stream)
        else:
            ptr = self.allocator.alloc(size)
        if ptr:
            with self._lock:
                self._owned[ptr] = size
                self._live[ptr] = key
                if hold:
                    self._hold(ptr)
        return ptr

    def _hold(self, ptr: int) -> None:
        assert self._holding is not None
        self._holding.append(ptr)
        self._held.add(ptr)

    def free(self, ptr: int) -> None:
        with self._lock:
            if ptr in self._held:
                self._freed_held.add(ptr)  # the holder's release frees it
                if self._holding is not None:
                    self._hold_free.setdefault(self._live[ptr], []).append(ptr)
                return
            key = self._live.pop(ptr, None)
            if key is None:
                return
            if not self.closed:
                self._free.setdefault(key, []).append(ptr)
                return
            self._owned.pop(ptr, None)
        self.allocator.free(ptr)

    # holds: value blocks a captured graph baked in stay its own -------------------------------
    def begin_hold(self) -> None:
        """From now, value blocks handed out stay reserved when freed, until ``release_held``:
        a captured graph reuses their addresses on every replay, so nothing else may get them
        (a value that outlives a replay would be overwritten)."""
        with self._lock:
            self._holding = []

    def end_hold(self) -> list[int]:
        with self._lock:
            held, self._holding = self._holding or [], None
            self._hold_free.clear()
        return held

    def release_held(self, ptrs: list[int]) -> None:
        """The graph that held these blocks is gone: they are free blocks again."""
        done = []
        with self._lock:
            for p in ptrs:
                if p not in self._held:
                    continue
                self._held.discard(p)
                if p in self._freed_held:  # else still in use: its own free returns it
                    self._freed_held.discard(p)
                    done.append(p)
        for p in done:
            self.free(p)

    # bookkeeping ------------------------------------------------------------------------------
    def failure_reason(self) -> str:
        return self.allocator.failure_reason()

    def owns(self, ptr: int) -> bool:
        return ptr in self._owned

    @property
    def cached_bytes(self) -> int:
        with self._lock:
            return sum(key[0] * len(ptrs) for key, ptrs in self._free.items())

    def release_free(self) -> None:
        """Give the free blocks back to the allocator (blocks in use, or held, stay)."""
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
            freed = list(self._freed_held)
            self._freed_held.clear()
            self._held.clear()
            stacks, self.stacks = list(self.stacks.values()), {}
        for p in freed:
            self.free(p)
        for st in stacks:
            for ptr, _ in st.blocks:
                self.free(ptr)
        self.release_free()

    def get_stats(self) -> dict[str, int]:
        with self._lock:
            in_use = sum(key[0] for key in self._live.values())
            owned = sum(self._owned.values())
        return {"InUse": in_use, "TotalAllocated": owned, "NumAllocs": self.misses}


class WorkspaceStack:
    """The workspace of a frame's prepared calls on one stream: slices of blocks that live as
    long as the frame. Each node's prepare phase starts again at the bottom (``reset``) and takes
    consecutive slices, so its slices never overlap while different nodes share the memory
    (their calls run one after another on the stream). A request that does not fit adds a
    block; blocks are never freed before the frame, since prepared calls hold their addresses.
    """

    ALIGN = 256
    MIN_BLOCK = 4 << 20

    def __init__(self, cache: FrameScratch, stream: Any, tagged: bool = True):
        self.cache = cache
        self.stream = stream
        self.tagged = tagged
        self.blocks: list[tuple[int, int]] = []  # (ptr, size)
        self._at = (0, 0)  # (block index, offset)

    def reset(self) -> None:
        self._at = (0, 0)

    def take(self, nbytes: int) -> int:
        size = max(self.ALIGN, (nbytes + self.ALIGN - 1) // self.ALIGN * self.ALIGN)
        k, off = self._at
        while k < len(self.blocks):
            ptr, cap = self.blocks[k]
            if off + size <= cap:
                self._at = (k, off + size)
                return ptr + off
            k, off = k + 1, 0
        cap = max(size, self.MIN_BLOCK)
        # never freed before the frame
        ptr = self.cache.take(cap, self.stream, WORKSPACE, self.tagged)
        self.blocks.append((ptr, cap))
        self._at = (len(self.blocks) - 1, size)
        return ptr


class _Workspaces(Allocator):
    """The allocator of a frame's workspace blocks (``KernelContext.scratch``); ``tagged``:
    new blocks are tagged with the request's stream."""

    def __init__(self, cache: FrameScratch, tagged: bool):
        self.cache = cache
        self.tagged = tagged
        self.memory_info = cache.memory_info

    @property
    def is_stream_aware(self) -> bool:
        return True

    def alloc(self, size: int) -> int:
        return self.cache.take(size, None, WORKSPACE)

    def alloc_on_stream(self, size: int, stream: Any) -> int:
        return self.cache.take(size, stream, WORKSPACE, self.tagged)

    def free(self, ptr: int) -> None:
        self.cache.free(ptr)


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


__all__ = ["FrameScratch", "WorkspaceStack", "current_scratch", "enter_scratch", "exit_scratch"]
