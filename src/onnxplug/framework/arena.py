"""The BFC arena: onnxruntime's best-fit-with-coalescing allocator over any raw allocator.

``BFCArena`` sits on top of an ``Allocator`` that hands out big regions (``cudaMalloc``,
pinned host memory, host memory in tests) and carves them into chunks, as onnxruntime's
``BFCArena`` / the CUDA plugin EP's ``ArenaImpl`` do ("a very simple version of Doug Lea's
malloc"):

* requests are rounded up to 256 bytes; free chunks live in 21 bins (bin ``b`` holds chunks of
  ``256 << b`` bytes and more), each ordered by ``(size, address)``; a request takes the first
  chunk that fits, scanning from its own bin upwards (best fit);
* a chunk is split when it is at least twice the request or would waste
  ``max_dead_bytes_per_chunk``; a freed chunk merges with free neighbours of its region;
* when nothing fits the arena *extends*: ``kNextPowerOfTwo`` grows the next region by powers of
  two (from ``initial_chunk_size_bytes``, up to ``max_power_of_two_extend_bytes`` per step),
  ``kSameAsRequested`` asks for exactly the request; a failing raw allocation is retried at
  90 % until it is smaller than the request; ``max_mem`` caps the total;
* ``reserve`` allocates outside the bins (initializers: they should not shape growth);
* ``shrink`` gives regions whose chunks are all free back to the raw allocator.

Stream awareness (onnxruntime's stream-aware arena): ``alloc_on_stream`` tags the chunk with
the stream. A chunk freed while tagged with stream A serves a request on stream B only once B
has waited on a notification A recorded *after the free* (streams count notifications:
``SyncStream.sync_id`` / ``last_wait_on``), and free chunks of different streams never merge.
When a stream's run ends (after the stream is flushed) or it closes, its chunks are untagged
and coalesced (onnxruntime's ``ResetChunksUsingStream``).

``SharedArenas`` keeps a provider factory's one-arena-per-device cache with reference counts.
"""

from __future__ import annotations

import bisect
import threading
import time
import warnings
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, fields, is_dataclass
from typing import Any

from ..errors import InvalidArgument
from .memory import Allocator, MemoryInfo

MIN_ALLOCATION_BITS = 8
MIN_ALLOCATION_SIZE = 1 << MIN_ALLOCATION_BITS  # 256 bytes
NUM_BINS = 21  # 256 B ... 256 MiB and larger
SIZE_MAX = (1 << 64) - 1
INT_MAX = (1 << 31) - 1
INT64_MAX = (1 << 63) - 1
BACKPEDAL_FACTOR = 0.9
_BACKPEDAL_FLOOR = 8 * 1024

NEXT_POWER_OF_TWO = 0  # kNextPowerOfTwo
SAME_AS_REQUESTED = 1  # kSameAsRequested
EXTEND_STRATEGIES = {"kNextPowerOfTwo": NEXT_POWER_OF_TWO, "kSameAsRequested": SAME_AS_REQUESTED}


def rounded_bytes(n: int) -> int:
    """``n`` rounded up to the arena's 256-byte granule."""
    return (n + MIN_ALLOCATION_SIZE - 1) & ~(MIN_ALLOCATION_SIZE - 1)


def bin_num_for_size(n: int) -> int:
    """The bin of a chunk of ``n`` bytes: floor(log2(n / 256)), at most 20."""
    return min(NUM_BINS - 1, (max(n, MIN_ALLOCATION_SIZE) >> MIN_ALLOCATION_BITS).bit_length() - 1)


# configuration ------------------------------------------------------------------------------


def _option_error(where: str, key: str, value: str, why: str) -> InvalidArgument:
    prefix = f"{where}: " if where else ""
    return InvalidArgument(f"{prefix}arena option '{key}': '{value}' {why}")


def _positive_int(limit: int) -> Callable[[str, str, str], int]:
    def parse(where: str, key: str, value: str) -> int:
        try:
            n = int(value.strip(), 0)
        except ValueError:
            raise _option_error(where, key, value, "is not an integer") from None
        if n <= 0 or n > limit:
            raise _option_error(where, key, value, f"must be > 0 and <= {limit}")
        return n

    return parse


def parse_byte_count(where: str, key: str, value: str) -> int:
    """A non-negative byte count up to 2**64 - 1 (what onnxruntime reads with stoull)."""
    s = value.strip()
    if s.startswith("-"):
        raise _option_error(where, key, value, "is negative; a byte count must be >= 0")
    try:
        n = int(s, 0)
    except ValueError:
        raise _option_error(where, key, value, "is not a byte count") from None
    if n > SIZE_MAX:
        raise _option_error(where, key, value, f"is larger than {SIZE_MAX}")
    return n


def _max_mem(where: str, key: str, value: str) -> int:
    n = parse_byte_count(where, key, value)
    return SIZE_MAX if n == 0 else n  # onnxruntime: 0 means no limit


def _extend_strategy(where: str, key: str, value: str) -> int:
    s = value.strip()
    if s in ("0", "1"):
        return int(s)
    raise _option_error(where, key, value, "must be 0 (kNextPowerOfTwo) or 1 (kSameAsRequested)")


@dataclass(frozen=True)
class ArenaConfig:
    """An arena's settings, with onnxruntime's defaults (``OrtArenaCfg`` / ``arena.*`` keys)."""

    max_mem: int = SIZE_MAX
    extend_strategy: int = NEXT_POWER_OF_TWO
    initial_chunk_size_bytes: int = 1 << 20
    max_dead_bytes_per_chunk: int = 128 << 20
    initial_growth_chunk_size_bytes: int = 2 << 20
    max_power_of_two_extend_bytes: int = 1 << 30

    @staticmethod
    def from_options(
        options: Mapping[str, str], where: str = "", extra_keys: frozenset[str] = frozenset()
    ) -> ArenaConfig:
        """Parse ``arena.*`` keys; a malformed value or an unknown ``arena.*`` key (other
        than ``extra_keys``, which the caller handles) is an InvalidArgument naming it."""
        values: dict[str, int] = {}
        for key, value in options.items():
            spec = ARENA_OPTIONS.get(key)
            if spec is None:
                if key.startswith("arena.") and key not in extra_keys:
                    known = ", ".join(sorted({*ARENA_OPTIONS, *extra_keys}))
                    raise InvalidArgument(
                        f"{where + ': ' if where else ''}unknown arena option '{key}'; "
                        f"known: {known}"
                    )
                continue
            field_name, parse = spec
            values[field_name] = parse(where, key, str(value))
        return ArenaConfig(**values)

    def to_options(self) -> dict[str, str]:
        """The ``arena.*`` keys of the settings that differ from the defaults."""
        default = ArenaConfig()
        by_field = {f: k for k, (f, _) in ARENA_OPTIONS.items()}
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if v != getattr(default, f.name):
                out[by_field[f.name]] = str(0 if f.name == "max_mem" and v == SIZE_MAX else v)
        return out


ARENA_OPTIONS: dict[str, tuple[str, Callable[[str, str, str], int]]] = {
    "arena.extend_strategy": ("extend_strategy", _extend_strategy),
    "arena.initial_chunk_size_bytes": ("initial_chunk_size_bytes", _positive_int(INT_MAX)),
    "arena.max_dead_bytes_per_chunk": ("max_dead_bytes_per_chunk", _positive_int(INT_MAX)),
    "arena.initial_growth_chunk_size_bytes": (
        "initial_growth_chunk_size_bytes",
        _positive_int(INT_MAX),
    ),
    "arena.max_power_of_two_extend_bytes": (
        "max_power_of_two_extend_bytes",
        _positive_int(INT64_MAX),
    ),
    "arena.max_mem": ("max_mem", _max_mem),
}


# chunks and regions -------------------------------------------------------------------------


class _Region:
    __slots__ = ("ptr", "size")

    def __init__(self, ptr: int, size: int):
        self.ptr = ptr
        self.size = size


class _Chunk:
    """A piece of a region: in use, or free and in exactly one bin."""

    __slots__ = (
        "in_use",
        "next",
        "prev",
        "ptr",
        "region",
        "requested",
        "size",
        "stream",
        "sync_id",
    )

    def __init__(self, ptr: int, size: int, region: _Region):
        self.ptr = ptr
        self.size = size
        self.region = region
        self.requested = 0
        self.in_use = False
        self.prev: _Chunk | None = None  # physically adjacent chunks of the same region
        self.next: _Chunk | None = None
        self.stream: Any = None  # the stream the chunk was last used on (None: any)
        self.sync_id = 0  # that stream's sync id when the chunk was freed


class BFCArena(Allocator):
    """onnxruntime's BFC arena over ``raw``; thread-safe. See the module docstring."""

    def __init__(
        self,
        raw: Allocator,
        config: ArenaConfig | None = None,
        memory_info: MemoryInfo | None = None,
        stream_aware: bool = True,
    ):
        self.raw = raw
        self.config = config = config if config is not None else ArenaConfig()
        mi = memory_info if memory_info is not None else raw.memory_info
        self.memory_info = MemoryInfo(mi.name, mi.device, mi.mem_type, "arena")
        self._stream_aware = stream_aware
        # Re-entrant: a free run by the garbage collector may land inside an operation of
        # this thread; it is deferred until the operation is done (see _enter/_leave).
        self._lock = threading.RLock()
        self._busy = False
        self._deferred: list[int] = []
        self._tls = threading.local()
        self._bins: list[list[tuple[int, int]]] = [[] for _ in range(NUM_BINS)]
        self._chunks: dict[int, _Chunk] = {}  # start address -> chunk (every chunk)
        self._regions: dict[int, _Region] = {}
        self._reserved: dict[int, int] = {}  # address -> size
        self._stream_chunks: dict[Any, set[_Chunk]] = {}  # stream -> chunks tagged with it
        self._retired = False
        # when a list: (time.perf_counter_ns(), bytes in use) after every allocation and free
        self.trace: list[tuple[int, int]] | None = None
        self._curr_region_bytes = rounded_bytes(
            min(config.max_mem, config.initial_chunk_size_bytes)
        )
        self._in_use = 0
        self._requested = 0  # bytes asked for by the blocks in use (before rounding)
        self._total = 0
        self._max_in_use = 0
        self._num_allocs = 0
        self._num_reserves = 0
        self._num_shrinkages = 0
        self._max_alloc = 0

    # protocol -----------------------------------------------------------------------------------
    @property
    def is_stream_aware(self) -> bool:
        return self._stream_aware

    def alloc(self, size: int) -> int:
        return self._allocate(size, None)

    def alloc_on_stream(self, size: int, stream: Any) -> int:
        return self._allocate(size, stream if self._stream_aware else None)

    def reserve(self, size: int) -> int:
        if size <= 0:
            return 0
        self._enter()
        try:
            if self._total + size > self.config.max_mem:
                self._fail(
                    f"reserving {size} bytes would exceed the arena limit of "
                    f"{self.config.max_mem} bytes ({self._total} allocated)"
                )
                return 0
            ptr = self.raw.alloc(size)
            if not ptr:
                self._fail(f"the raw allocator could not reserve {size} bytes")
                return 0
            self._reserved[ptr] = size
            self._total += size
            self._in_use += size
            self._requested += size
            self._num_reserves += 1
            self._num_allocs += 1
            self._max_in_use = max(self._max_in_use, self._in_use)
            self._max_alloc = max(self._max_alloc, size)
            if self.trace is not None:
                self.trace.append((time.perf_counter_ns(), self._in_use))
            return ptr
        finally:
            self._leave()

    def free(self, ptr: int) -> None:
        if not ptr:
            return
        with self._lock:
            if self._busy:  # re-entered from inside an operation of this thread
                self._deferred.append(ptr)
                return
            self._busy = True
            try:
                self._free(ptr)
                self._drain()
            finally:
                self._busy = False

    def failure_reason(self) -> str:
        return getattr(self._tls, "reason", "")

    def get_stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "Limit": min(self.config.max_mem, INT64_MAX),
                "InUse": self._in_use,
                "TotalAllocated": self._total,
                "MaxInUse": self._max_in_use,
                "NumAllocs": self._num_allocs,
                "NumReserves": self._num_reserves,
                "NumArenaExtensions": len(self._regions),
                "NumArenaShrinkages": self._num_shrinkages,
                "MaxAllocSize": self._max_alloc,
            }

    def usage(self) -> tuple[int, int, int, int]:
        """(bytes in use, bytes requested by the blocks in use, bytes held from the raw
        allocator, peak bytes in use): what the profiler reports per node (``mem_*``)."""
        with self._lock:
            return self._in_use, self._requested, self._total, self._max_in_use

    def shrink(self) -> None:
        """Give every region whose chunks are all free back to the raw allocator; the next
        extension starts again from ``initial_growth_chunk_size_bytes``."""
        self._enter()
        try:
            self._release_free_regions(list(self._regions.values()))
            self._curr_region_bytes = rounded_bytes(self.config.initial_growth_chunk_size_bytes)
        finally:
            self._leave()

    def close(self) -> None:
        """No one will allocate from the arena again: free regions go back now, the others as
        soon as their last chunk is freed. Live blocks stay valid until freed."""
        self._enter()
        try:
            self._retired = True
            self._release_free_regions(list(self._regions.values()))
        finally:
            self._leave()

    def release_stream(self, stream: Any) -> None:
        """``stream`` has been flushed (its run ended) or is closing: its chunks are free for
        every stream again and merge with their free neighbours."""
        self._enter()
        try:
            chunks = self._stream_chunks.pop(stream, None)
            if not chunks:
                return
            for c in chunks:
                c.stream = None
                c.sync_id = 0
            for c in chunks:
                if not c.in_use and self._chunks.get(c.ptr) is c:
                    self._remove_from_bin(c)
                    self._insert_in_bin(self._coalesce(c))
        finally:
            self._leave()

    def __del__(self) -> None:
        try:
            for region in list(self._regions.values()):
                self.raw.free(region.ptr)
            for ptr in list(self._reserved):
                self.raw.free(ptr)
        except Exception:
            pass

    # locking ------------------------------------------------------------------------------------
    def _enter(self) -> None:
        self._lock.acquire()
        if self._busy:  # a garbage-collected free must not re-enter a half-done operation
            self._lock.release()
            raise RuntimeError(f"arena '{self.memory_info.name}' re-entered during an operation")
        self._busy = True

    def _leave(self) -> None:
        try:
            self._drain()
        finally:
            self._busy = False
            self._lock.release()

    def _drain(self) -> None:
        while self._deferred:
            self._free(self._deferred.pop())

    def _fail(self, reason: str) -> None:
        self._tls.reason = reason

    # allocation ---------------------------------------------------------------------------------
    def _allocate(self, size: int, stream: Any) -> int:
        if size <= 0:
            return 0
        rounded = rounded_bytes(size)
        self._enter()
        try:
            if stream is not None and self._on_stream_released not in stream.release_listeners:
                stream.add_release_listener(self._on_stream_released)
            chunk = self._find(rounded, stream)
            if chunk is None:
                if not self._extend(rounded):
                    return 0
                chunk = self._find(rounded, stream)
                if chunk is None:  # cannot happen: the new region is one free chunk
                    self._fail(f"no chunk of {rounded} bytes after extending the arena")
                    return 0
            self._take(chunk, rounded, size, stream)
            return chunk.ptr
        finally:
            self._leave()

    def _usable(self, c: _Chunk, stream: Any) -> bool:
        cs = c.stream
        if cs is None or cs is stream:
            return True
        return stream is not None and c.sync_id < stream.last_wait_on(cs)

    def _find(self, rounded: int, stream: Any) -> _Chunk | None:
        chunks = self._chunks
        key = (rounded, 0)
        for entries in self._bins[min(NUM_BINS - 1, (rounded >> 8).bit_length() - 1) :]:
            if not entries:
                continue
            i = bisect.bisect_left(entries, key)
            while i < len(entries):
                c = chunks[entries[i][1]]
                if self._usable(c, stream):
                    del entries[i]
                    return c
                i += 1
        return None

    def _take(self, c: _Chunk, rounded: int, size: int, stream: Any) -> None:
        """Hand out free chunk ``c`` (already out of its bin) for a request."""
        if c.size >= 2 * rounded or c.size - rounded >= self.config.max_dead_bytes_per_chunk:
            self._split(c, rounded)
        if stream is not None or c.stream is not None:
            self._tag(c, stream)
        c.in_use = True
        c.requested = size
        self._num_allocs += 1
        self._in_use += c.size
        self._requested += size
        if self._in_use > self._max_in_use:
            self._max_in_use = self._in_use
        if c.size > self._max_alloc:
            self._max_alloc = c.size
        if self.trace is not None:
            self.trace.append((time.perf_counter_ns(), self._in_use))

    def _split(self, c: _Chunk, size: int) -> None:
        rest = _Chunk(c.ptr + size, c.size - size, c.region)
        rest.prev, rest.next = c, c.next
        if c.next is not None:
            c.next.prev = rest
        c.next = rest
        c.size = size
        self._chunks[rest.ptr] = rest
        if c.stream is not None:  # the remainder keeps the tag (and its safety condition)
            self._tag(rest, c.stream)
            rest.sync_id = c.sync_id
        self._insert_in_bin(rest)

    def _tag(self, c: _Chunk, stream: Any) -> None:
        old = c.stream
        if old is not None:
            tagged = self._stream_chunks.get(old)
            if tagged is not None:
                tagged.discard(c)
        c.stream = stream
        c.sync_id = 0
        if stream is not None:
            self._stream_chunks.setdefault(stream, set()).add(c)

    def _extend(self, rounded: int) -> bool:
        cfg = self.config
        available = max(0, cfg.max_mem - self._total) & ~(MIN_ALLOCATION_SIZE - 1)
        if rounded > available:
            self._fail(
                f"Available memory of {available} is smaller than requested bytes of {rounded} "
                f"(arena limit {cfg.max_mem}, {self._total} allocated, {self._in_use} in use)"
            )
            return False
        grew = False
        if cfg.extend_strategy == NEXT_POWER_OF_TWO:
            while rounded > self._curr_region_bytes:
                self._curr_region_bytes = min(self._curr_region_bytes * 2, SIZE_MAX)
                grew = True
            nbytes = min(self._curr_region_bytes, available)
        else:
            nbytes = rounded
        ptr = self.raw.alloc(nbytes)
        while not ptr:  # back off: ask for 90 % until that is smaller than the request
            nbytes = rounded_bytes(int(nbytes * BACKPEDAL_FACTOR))
            if nbytes < rounded or nbytes < _BACKPEDAL_FLOOR:
                break
            ptr = self.raw.alloc(nbytes)
        if not ptr:
            self._fail(
                f"Failed to allocate memory for requested buffer of size {rounded} (the raw "
                f"allocator refused an extension; {self._total} allocated, {self._in_use} in use)"
            )
            return False
        if not grew and cfg.extend_strategy == NEXT_POWER_OF_TWO:
            cap = cfg.max_power_of_two_extend_bytes
            if self._curr_region_bytes < cap // 2:
                self._curr_region_bytes *= 2
            else:
                self._curr_region_bytes = cap
        region = _Region(ptr, nbytes)
        self._regions[ptr] = region
        self._total += nbytes
        c = _Chunk(ptr, nbytes, region)
        self._chunks[ptr] = c
        self._insert_in_bin(c)
        return True

    # freeing ------------------------------------------------------------------------------------
    def _free(self, ptr: int) -> None:
        size = self._reserved.pop(ptr, None)
        if size is not None:
            self.raw.free(ptr)
            self._in_use -= size
            self._requested -= size
            self._total -= size
            if self.trace is not None:
                self.trace.append((time.perf_counter_ns(), self._in_use))
            return
        c = self._chunks.get(ptr)
        if c is None or not c.in_use:
            raise ValueError(f"arena '{self.memory_info.name}': free of unknown pointer 0x{ptr:x}")
        c.in_use = False
        self._requested -= c.requested
        c.requested = 0
        self._in_use -= c.size
        if c.stream is not None:
            # reusable on another stream once it waited on a notification recorded after now
            c.sync_id = c.stream.sync_id
        if self.trace is not None:
            self.trace.append((time.perf_counter_ns(), self._in_use))
        c = self._coalesce(c)
        self._insert_in_bin(c)
        if self._retired:
            self._release_free_regions([c.region])

    def _coalesce(self, c: _Chunk) -> _Chunk:
        """Merge free chunk ``c`` (in no bin) with free neighbours of the same stream."""
        n = c.next
        if n is not None and not n.in_use and n.stream is c.stream:
            self._remove_from_bin(n)
            self._absorb(c, n)
        p = c.prev
        if p is not None and not p.in_use and p.stream is c.stream:
            self._remove_from_bin(p)
            self._absorb(p, c)
            c = p
        return c

    def _absorb(self, c: _Chunk, n: _Chunk) -> None:
        """``c`` takes over its next neighbour ``n``."""
        c.size += n.size
        c.next = n.next
        if n.next is not None:
            n.next.prev = c
        if n.sync_id > c.sync_id:
            c.sync_id = n.sync_id
        del self._chunks[n.ptr]
        if n.stream is not None:
            self._stream_chunks[n.stream].discard(n)

    # chunk sizes are multiples of 256: their bin is floor(log2(size / 256)), at most 20
    def _insert_in_bin(self, c: _Chunk) -> None:
        size = c.size
        bisect.insort(self._bins[min(NUM_BINS - 1, (size >> 8).bit_length() - 1)], (size, c.ptr))

    def _remove_from_bin(self, c: _Chunk) -> None:
        size = c.size
        entries = self._bins[min(NUM_BINS - 1, (size >> 8).bit_length() - 1)]
        del entries[bisect.bisect_left(entries, (size, c.ptr))]

    def _release_free_regions(self, regions: list[_Region]) -> None:
        for region in regions:
            if self._regions.get(region.ptr) is not region:
                continue
            chunks = []
            c: _Chunk | None = self._chunks[region.ptr]
            while c is not None:
                if c.in_use:
                    break
                chunks.append(c)
                c = c.next
            else:
                # Chunks freed while tagged may still be read by their stream's queued work:
                # let that finish before the memory goes back.
                for s in {ch.stream for ch in chunks if ch.stream is not None}:
                    s.flush()
                for ch in chunks:
                    self._remove_from_bin(ch)
                    del self._chunks[ch.ptr]
                    if ch.stream is not None:
                        self._stream_chunks[ch.stream].discard(ch)
                del self._regions[region.ptr]
                self._total -= region.size
                self._num_shrinkages += 1
                self.raw.free(region.ptr)

    def _on_stream_released(self, stream: Any) -> None:
        self.release_stream(stream)

    # introspection (tests, memory dumps) --------------------------------------------------------
    def dump(self) -> dict[str, Any]:
        """Regions with their chunks ``(address, size, in use, stream)``, bins and reserved
        blocks: a consistent snapshot."""
        with self._lock:
            regions = []
            for r in sorted(self._regions.values(), key=lambda r: r.ptr):
                chunks = []
                c: _Chunk | None = self._chunks[r.ptr]
                while c is not None:
                    chunks.append((c.ptr, c.size, c.in_use, c.stream, c.sync_id))
                    c = c.next
                regions.append((r.ptr, r.size, chunks))
            return {
                "regions": regions,
                "bins": [list(b) for b in self._bins],
                "reserved": dict(self._reserved),
                "tagged": {s: {c.ptr for c in cs} for s, cs in self._stream_chunks.items() if cs},
                "next_region_bytes": self._curr_region_bytes,
            }


# shared per-device arenas -------------------------------------------------------------------


@dataclass
class _Shared:
    allocator: Allocator
    config: Hashable
    refs: int = 1


class SharedArenas:
    """A factory's shared allocators, one per key (memory kind and device ordinal), created on
    first request and reference-counted (onnxruntime's per-device ``DeviceCacheEntry``).

    A request with options for an allocator that already exists gets the existing one and a
    warning that its options were ignored (when they would configure it differently). When
    the last reference goes, the allocator is closed and dropped: the next request creates a
    new one, with the options it brings.
    """

    def __init__(self, owner: str):
        self.owner = owner
        self._lock = threading.Lock()
        self._entries: dict[Hashable, _Shared] = {}

    def acquire(
        self,
        key: Hashable,
        config: Hashable,
        make: Callable[[], Allocator],
        explicit: bool,
        what: str = "arena",
    ) -> Allocator:
        """The shared allocator for ``key`` (one more reference). ``config`` is the normalized
        configuration the caller's options ask for; ``explicit`` says whether it gave any."""
        with self._lock:
            e = self._entries.get(key)
            if e is not None:
                e.refs += 1
                if explicit and config != e.config:
                    warnings.warn(
                        f"{self.owner}: the shared {what} for {_key_str(key)} already exists; "
                        f"this session's arena options are ignored ({_difference(e.config, config)})",
                        RuntimeWarning,
                        stacklevel=4,
                    )
                return e.allocator
            alloc = make()
            self._entries[key] = _Shared(alloc, config)
            return alloc

    def release(self, allocator: Allocator) -> bool:
        """Drop one reference; False when ``allocator`` is not one of ours."""
        with self._lock:
            for key, e in self._entries.items():
                if e.allocator is allocator:
                    e.refs -= 1
                    if e.refs > 0:
                        return True
                    del self._entries[key]
                    break
            else:
                return False
        allocator.close()
        return True

    def get(self, key: Hashable) -> Allocator | None:
        with self._lock:
            e = self._entries.get(key)
            return e.allocator if e is not None else None

    def refs(self, key: Hashable) -> int:
        with self._lock:
            e = self._entries.get(key)
            return e.refs if e is not None else 0


def _flat(config: Any) -> dict[str, Any]:
    if not is_dataclass(config) or isinstance(config, type):
        return {"configuration": config}
    out: dict[str, Any] = {}
    for f in fields(config):
        v = getattr(config, f.name)
        out.update(_flat(v) if is_dataclass(v) else {f.name: v})
    return out


def _difference(kept: Any, asked: Any) -> str:
    """What the existing allocator keeps against what was asked for, field by field."""
    a, b = _flat(kept), _flat(asked)
    diffs = [f"{k} {a.get(k)} (asked {b.get(k)})" for k in a if a.get(k) != b.get(k)]
    return "it keeps " + ", ".join(diffs)


def _key_str(key: Hashable) -> str:
    if isinstance(key, tuple) and len(key) == 2:
        return f"'{key[0]}' memory of device {key[1]}"
    return str(key)


__all__ = [
    "ARENA_OPTIONS",
    "EXTEND_STRATEGIES",
    "NEXT_POWER_OF_TWO",
    "NUM_BINS",
    "SAME_AS_REQUESTED",
    "ArenaConfig",
    "BFCArena",
    "SharedArenas",
    "bin_num_for_size",
    "rounded_bytes",
]
