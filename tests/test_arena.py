"""The BFC arena (framework/arena.py) on a fake raw allocator: onnxruntime's rounding, bins,
best fit, split/coalesce rules, growth strategies with back-off, ``max_mem``, reserve, shrink,
stats, thread safety, the stream rules, and property-based tests of its invariants."""

from __future__ import annotations

import random
import warnings

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from onnxplug.errors import InvalidArgument, OutOfMemory
from onnxplug.framework.arena import (
    INT_MAX,
    NUM_BINS,
    SIZE_MAX,
    ArenaConfig,
    BFCArena,
    SharedArenas,
    bin_num_for_size,
    rounded_bytes,
)
from onnxplug.framework.memory import Allocator, Device, MemoryInfo, allocate
from onnxplug.framework.stream import ImmediateStream, SyncStream
from tests.conftest import run_in_threads

KiB, MiB = 1 << 10, 1 << 20
FAKE = Device("fake", 0)


class FakeRaw(Allocator):
    """Hands out fake, never reused addresses; refuses requests above ``largest`` bytes or
    beyond ``capacity`` bytes live. Records every request."""

    def __init__(self, capacity: int = 1 << 40, largest: int = 1 << 40):
        self.memory_info = MemoryInfo("Fake", FAKE)
        self.capacity = capacity
        self.largest = largest
        self.live: dict[int, int] = {}
        self.requests: list[int] = []
        self.granted: list[int] = []
        self._next = 1 << 32
        self.on_alloc = None  # called inside alloc (to simulate a garbage-collected free)

    def alloc(self, size: int) -> int:
        self.requests.append(size)
        if self.on_alloc is not None:
            self.on_alloc()
        if size > self.largest or sum(self.live.values()) + size > self.capacity:
            return 0
        ptr = self._next
        self._next += size + 64 * KiB  # a gap, so regions are never adjacent
        self.live[ptr] = size
        self.granted.append(size)
        return ptr

    def free(self, ptr: int) -> None:
        del self.live[ptr]


class Stream(ImmediateStream):
    """A stream that counts its flushes."""

    def __init__(self, name: str = ""):
        super().__init__(FAKE)
        self.name = name
        self.flushes = 0

    def flush(self) -> None:
        self.flushes += 1

    def __repr__(self) -> str:
        return f"Stream({self.name})"


def notify(producer: SyncStream, consumer: SyncStream) -> None:
    n = producer.create_notification()
    n.activate()
    n.wait_on_device(consumer)


def regions(arena: BFCArena) -> list[tuple[int, int, list]]:
    return arena.dump()["regions"]


def check_invariants(arena: BFCArena, raw: FakeRaw) -> None:
    """Every structural and accounting invariant of the arena."""
    d = arena.dump()
    stats = arena.get_stats()
    free_chunks = set()
    in_use = 0
    tagged: dict = {}
    for rptr, rsize, chunks in d["regions"]:
        assert chunks and chunks[0][0] == rptr, "a region starts with a chunk"
        pos = rptr
        prev = None
        for ptr, size, used, stream, _sync in chunks:
            assert ptr == pos and size > 0 and size % 256 == 0, "chunks tile the region"
            pos += size
            if used:
                in_use += size
            else:
                free_chunks.add((size, ptr))
                if prev is not None and not prev[2]:
                    assert prev[3] is not stream, "adjacent free chunks of one stream coalesce"
            if stream is not None:
                tagged.setdefault(stream, set()).add(ptr)
            prev = (ptr, size, used, stream)
        assert pos == rptr + rsize, "chunks cover the region exactly"
    binned = set()
    for b, entries in enumerate(d["bins"]):
        assert entries == sorted(entries), "bins are ordered by (size, address)"
        for size, ptr in entries:
            assert bin_num_for_size(size) == b, "a free chunk is in its size's bin"
            binned.add((size, ptr))
    assert binned == free_chunks, "exactly the free chunks are in bins"
    assert tagged == d["tagged"], "the per-stream chunk sets match the tags"
    reserved = sum(d["reserved"].values())
    region_bytes = sum(r[1] for r in d["regions"])
    assert stats["InUse"] == in_use + reserved
    assert stats["TotalAllocated"] == region_bytes + reserved == sum(raw.live.values())
    assert stats["NumArenaExtensions"] == len(d["regions"])
    assert stats["MaxInUse"] >= stats["InUse"]
    assert stats["TotalAllocated"] <= arena.config.max_mem
    assert stats["Limit"] == min(arena.config.max_mem, (1 << 63) - 1)


# ---------------------------------------------------------------------------------------------
# sizes, bins, configuration


def test_rounding_and_bins():
    assert [rounded_bytes(n) for n in (1, 255, 256, 257, 1000)] == [256, 256, 256, 512, 1024]
    assert NUM_BINS == 21
    assert [bin_num_for_size(n) for n in (0, 256, 511, 512, 1024, 256 * MiB, 1 << 40)] == [
        0,
        0,
        0,
        1,
        2,
        20,
        20,
    ]


def test_alloc_zero_is_null_and_stats_of_a_fresh_arena():
    arena = BFCArena(FakeRaw())
    assert arena.alloc(0) == 0
    p = arena.alloc(16)
    arena.free(p)
    s = arena.get_stats()
    # onnxruntime's example-plugin test: Alloc(16) + Free on a fresh arena
    assert s["NumAllocs"] == 1 and s["NumArenaExtensions"] == 1
    assert s["TotalAllocated"] == 1 * MiB and s["InUse"] == 0 and s["MaxInUse"] == 256
    assert set(s) == {
        "Limit",
        "InUse",
        "TotalAllocated",
        "MaxInUse",
        "NumAllocs",
        "NumReserves",
        "NumArenaExtensions",
        "NumArenaShrinkages",
        "MaxAllocSize",
    }


def test_config_defaults_are_onnxruntimes():
    c = ArenaConfig()
    assert (c.max_mem, c.extend_strategy) == (SIZE_MAX, 0)
    assert c.initial_chunk_size_bytes == 1 * MiB
    assert c.max_dead_bytes_per_chunk == 128 * MiB
    assert c.initial_growth_chunk_size_bytes == 2 * MiB
    assert c.max_power_of_two_extend_bytes == 1 << 30


def test_config_from_options_and_back():
    opts = {
        "arena.extend_strategy": "1",
        "arena.initial_chunk_size_bytes": "4096",
        "arena.max_dead_bytes_per_chunk": "8192",
        "arena.initial_growth_chunk_size_bytes": "65536",
        "arena.max_power_of_two_extend_bytes": str(1 << 40),
        "arena.max_mem": "1000000",
    }
    c = ArenaConfig.from_options(opts)
    assert (c.extend_strategy, c.initial_chunk_size_bytes, c.max_mem) == (1, 4096, 1000000)
    assert c.max_power_of_two_extend_bytes == 1 << 40
    assert ArenaConfig.from_options(c.to_options()) == c
    assert ArenaConfig.from_options({"arena.max_mem": "0"}).max_mem == SIZE_MAX  # 0: no limit
    assert ArenaConfig().to_options() == {}


@pytest.mark.parametrize(
    "key, value, needle",
    [
        ("arena.max_mem", "-1", "negative"),
        ("arena.max_mem", "lots", "not a byte count"),
        ("arena.extend_strategy", "2", "kSameAsRequested"),
        ("arena.extend_strategy", "kNextPowerOfTwo", "must be 0"),
        ("arena.initial_chunk_size_bytes", "0", "> 0"),
        ("arena.initial_chunk_size_bytes", str(INT_MAX + 1), "<= 2147483647"),
        ("arena.max_dead_bytes_per_chunk", "-5", "> 0"),
        ("arena.initial_growth_chunk_size_bytes", "x", "not an integer"),
        ("arena.max_power_of_two_extend_bytes", "0", "> 0"),
        ("arena.no_such_key", "1", "unknown arena option"),
    ],
)
def test_invalid_arena_options_name_the_key(key, value, needle):
    with pytest.raises(InvalidArgument, match=needle) as e:
        ArenaConfig.from_options({key: value}, "TestEP")
    assert key in str(e.value) and "TestEP" in str(e.value)


# ---------------------------------------------------------------------------------------------
# growth


def test_next_power_of_two_doubles_the_next_region():
    raw = FakeRaw()
    arena = BFCArena(raw)
    for _ in range(7):
        arena.alloc(1 * MiB)
    assert raw.granted == [1 * MiB, 2 * MiB, 4 * MiB]


def test_a_request_larger_than_the_next_region_doubles_until_it_fits():
    raw = FakeRaw()
    arena = BFCArena(raw)
    arena.alloc(5 * MiB)
    arena.alloc(9 * MiB)
    assert raw.granted == [8 * MiB, 16 * MiB]


def test_power_of_two_growth_is_capped():
    raw = FakeRaw()
    arena = BFCArena(raw, ArenaConfig(max_power_of_two_extend_bytes=4 * MiB))
    for _ in range(15):
        arena.alloc(1 * MiB)
    assert raw.granted == [1 * MiB, 2 * MiB, 4 * MiB, 4 * MiB, 4 * MiB]


def test_same_as_requested_extends_by_the_request():
    raw = FakeRaw()
    arena = BFCArena(raw, ArenaConfig(extend_strategy=1))
    arena.alloc(100)
    arena.alloc(3 * MiB + 1)
    assert raw.granted == [256, 3 * MiB + 256]


def test_max_mem_limits_the_regions_and_fails_with_a_reason():
    raw = FakeRaw()
    arena = BFCArena(raw, ArenaConfig(max_mem=2 * MiB + 512 * KiB))
    a = allocate(arena, 1 * MiB)
    b = allocate(arena, 1 * MiB)  # the second region is cut to what is left
    assert raw.granted == [1 * MiB, 1 * MiB + 512 * KiB]
    with pytest.raises(OutOfMemory) as e:
        allocate(arena, 1 * MiB)
    msg = str(e.value)
    assert "Failed to allocate memory for requested buffer of size 1048576" in msg
    assert "Available memory of 0 is smaller than requested bytes of 1048576" in msg
    assert isinstance(e.value, MemoryError)
    del a, b
    assert arena.get_stats()["InUse"] == 0


def test_failed_extensions_back_off_to_ninety_percent():
    raw = FakeRaw(largest=3 * MiB)
    arena = BFCArena(raw, ArenaConfig(initial_chunk_size_bytes=4 * MiB))
    assert arena.alloc(1 * MiB)
    expected = [4 * MiB]
    n = 4 * MiB
    while n > 3 * MiB:
        n = rounded_bytes(int(n * 0.9))
        expected.append(n)
    assert raw.requests == expected
    assert raw.granted == [expected[-1]]


def test_back_off_stops_below_the_request():
    raw = FakeRaw(largest=1 * MiB)
    arena = BFCArena(raw, ArenaConfig(extend_strategy=0, initial_chunk_size_bytes=2 * MiB))
    assert arena.alloc(int(1.5 * MiB)) == 0
    assert all(r >= int(1.5 * MiB) for r in raw.requests)
    assert "Failed to allocate memory for requested buffer" in arena.failure_reason()
    assert arena.get_stats()["NumAllocs"] == 0


# ---------------------------------------------------------------------------------------------
# best fit, split, coalesce


def test_split_only_when_worth_it():
    raw = FakeRaw()
    arena = BFCArena(raw)
    p = arena.alloc(300 * KiB)  # 1 MiB >= 2 x 300 KiB: split
    chunks = regions(arena)[0][2]
    assert [(c[1], c[2]) for c in chunks] == [(300 * KiB, True), (724 * KiB, False)]
    arena.free(p)
    q = arena.alloc(600 * KiB)  # 1 MiB < 2 x 600 KiB and 424 KiB of waste is allowed
    assert regions(arena)[0][2] == [(q, 1 * MiB, True, None, 0)]
    assert arena.get_stats()["InUse"] == 1 * MiB
    arena.free(q)
    tight = BFCArena(FakeRaw(), ArenaConfig(max_dead_bytes_per_chunk=256 * KiB))
    tight.alloc(600 * KiB)  # waste 424 KiB >= 256 KiB: split
    assert [c[1] for c in regions(tight)[0][2]] == [600 * KiB, 424 * KiB]


def test_best_fit_takes_the_smallest_free_chunk_that_fits():
    arena = BFCArena(FakeRaw())
    a = arena.alloc(64 * KiB)
    b = arena.alloc(64 * KiB)
    c = arena.alloc(128 * KiB)
    d = arena.alloc(64 * KiB)
    arena.free(c)
    arena.free(a)  # free: a (64 KiB), c (128 KiB), and the region's tail
    assert arena.alloc(60 * KiB) == a
    assert arena.alloc(100 * KiB) == c
    del b, d


def test_freed_neighbours_coalesce_completely():
    raw = FakeRaw()
    arena = BFCArena(raw)
    ps = [arena.alloc(100 * KiB) for _ in range(5)]
    for i in (0, 4, 2, 1, 3):
        arena.free(ps[i])
        check_invariants(arena, raw)
    assert [(c[1], c[2]) for c in regions(arena)[0][2]] == [(1 * MiB, False)]


def test_free_of_an_unknown_pointer_is_an_error():
    arena = BFCArena(FakeRaw())
    p = arena.alloc(1000)
    with pytest.raises(ValueError, match="unknown pointer"):
        arena.free(p + 256)
    arena.free(p)
    with pytest.raises(ValueError, match="unknown pointer"):
        arena.free(p)  # double free


# ---------------------------------------------------------------------------------------------
# reserve, shrink, close


def test_reserve_bypasses_the_bins():
    raw = FakeRaw()
    arena = BFCArena(raw)
    r = arena.reserve(3000)
    assert raw.granted == [3000] and regions(arena) == []
    s = arena.get_stats()
    assert (s["NumReserves"], s["NumAllocs"], s["InUse"], s["TotalAllocated"]) == (1, 1, 3000, 3000)
    p = arena.alloc(1000)
    arena.shrink()
    arena.free(p)
    arena.shrink()  # frees the region, never the reserved block
    assert raw.live == {r: 3000}
    arena.free(r)
    assert raw.live == {} and arena.get_stats()["TotalAllocated"] == 0


def test_reserve_respects_max_mem():
    arena = BFCArena(FakeRaw(), ArenaConfig(max_mem=4096))
    assert arena.reserve(5000) == 0
    assert "exceed the arena limit" in arena.failure_reason()


def test_shrink_frees_only_fully_free_regions_and_resets_growth():
    raw = FakeRaw()
    arena = BFCArena(raw)
    a = arena.alloc(1 * MiB)
    b = arena.alloc(2 * MiB)  # second region (2 MiB)
    arena.free(a)
    arena.shrink()
    s = arena.get_stats()
    assert s["NumArenaShrinkages"] == 1 and s["NumArenaExtensions"] == 1
    assert s["TotalAllocated"] == 2 * MiB and list(raw.live.values()) == [2 * MiB]
    assert arena.dump()["next_region_bytes"] == 2 * MiB  # initial_growth_chunk_size_bytes
    arena.free(b)
    arena.shrink()
    assert raw.live == {} and arena.get_stats()["NumArenaShrinkages"] == 2
    assert arena.alloc(10) and raw.granted[-1] == 2 * MiB


def test_closed_arena_returns_regions_as_they_empty():
    raw = FakeRaw()
    arena = BFCArena(raw)
    a = arena.alloc(1 * MiB)
    b = arena.alloc(1 * MiB)
    arena.free(b)
    arena.close()
    assert list(raw.live.values()) == [1 * MiB]  # b's region went at once
    arena.free(a)
    assert raw.live == {}


def test_shrink_waits_for_streams_of_tagged_free_chunks():
    arena = BFCArena(FakeRaw())
    s = Stream("s")
    p = arena.alloc_on_stream(1000, s)
    arena.free(p)  # the stream's queued work may still use it
    arena.shrink()
    assert s.flushes == 1 and arena.get_stats()["TotalAllocated"] == 0


# ---------------------------------------------------------------------------------------------
# streams


def test_chunk_freed_on_one_stream_waits_for_a_notification_after_the_free():
    arena = BFCArena(FakeRaw())
    a, b = Stream("a"), Stream("b")
    notify(a, b)  # a wait from before the free does not count
    p = arena.alloc_on_stream(4096, a)
    arena.free(p)
    q = arena.alloc_on_stream(4096, b)
    assert q != p
    assert arena.alloc_on_stream(4096, a) == p  # its own stream reuses it at once
    arena.free(p)
    notify(a, b)
    assert arena.alloc_on_stream(4096, b) == p
    arena.free(q)


def test_allocations_without_a_stream_get_only_untagged_chunks():
    arena = BFCArena(FakeRaw())
    a = Stream("a")
    p = arena.alloc_on_stream(4096, a)
    arena.free(p)
    q = arena.alloc(4096)
    assert q != p


def test_chunks_of_different_streams_never_coalesce():
    raw = FakeRaw()
    arena = BFCArena(raw)
    a, b = Stream("a"), Stream("b")
    p = arena.alloc_on_stream(100 * KiB, a)
    q = arena.alloc_on_stream(100 * KiB, b)
    arena.free(p)
    arena.free(q)
    chunks = regions(arena)[0][2]
    assert [(c[1], c[3]) for c in chunks[:2]] == [(100 * KiB, a), (100 * KiB, b)]
    check_invariants(arena, raw)


def test_run_end_untags_and_coalesces():
    raw = FakeRaw()
    arena = BFCArena(raw)
    a, b = Stream("a"), Stream("b")
    p = arena.alloc_on_stream(100 * KiB, a)
    arena.free(p)
    a.on_session_run_end()  # flushed: a's chunks are free for every stream
    assert a.flushes == 1
    assert [(c[1], c[3]) for c in regions(arena)[0][2]] == [(1 * MiB, None)]
    assert arena.alloc_on_stream(100 * KiB, b) == p
    check_invariants(arena, raw)


def test_closing_a_stream_untags_its_chunks():
    arena = BFCArena(FakeRaw())
    a, b = Stream("a"), Stream("b")
    p = arena.alloc_on_stream(4096, a)
    arena.free(p)
    a.close()
    assert arena.alloc_on_stream(4096, b) == p
    assert arena.dump()["tagged"] == {b: {p}}


def test_in_use_chunk_untagged_at_run_end_frees_untagged():
    arena = BFCArena(FakeRaw())
    a, b = Stream("a"), Stream("b")
    p = arena.alloc_on_stream(4096, a)
    a.on_session_run_end()
    arena.free(p)  # its stream's run has ended: anyone may take it
    assert arena.alloc_on_stream(4096, b) == p


def test_arena_that_is_not_stream_aware_ignores_streams():
    arena = BFCArena(FakeRaw(), stream_aware=False)
    a, b = Stream("a"), Stream("b")
    p = arena.alloc_on_stream(4096, a)
    arena.free(p)
    assert arena.alloc_on_stream(4096, b) == p
    assert not arena.is_stream_aware and arena.dump()["tagged"] == {}
    assert a.release_listeners == []


def test_memory_info_says_arena():
    arena = BFCArena(FakeRaw())
    assert arena.memory_info.alloc_type == "arena" and arena.memory_info.device == FAKE


# ---------------------------------------------------------------------------------------------
# threads and re-entrance


def test_concurrent_alloc_and_free_keep_the_arena_consistent():
    raw = FakeRaw()
    arena = BFCArena(raw, ArenaConfig(initial_chunk_size_bytes=64 * KiB))

    def work(seed: int) -> None:
        rng = random.Random(seed)
        s = Stream(str(seed))
        live: list[int] = []
        for _ in range(400):
            if live and rng.random() < 0.5:
                arena.free(live.pop(rng.randrange(len(live))))
            else:
                size = rng.choice([100, 1000, 5000, 70000])
                ptr = arena.alloc_on_stream(size, s) if seed % 2 else arena.alloc(size)
                assert ptr
                live.append(ptr)
        for p in live:
            arena.free(p)
        s.close()

    run_in_threads(work, 6)
    check_invariants(arena, raw)
    assert arena.get_stats()["InUse"] == 0 and arena.get_stats()["NumAllocs"] > 0


def test_a_free_that_lands_inside_an_allocation_is_deferred():
    raw = FakeRaw()
    arena = BFCArena(raw, ArenaConfig(initial_chunk_size_bytes=4096))
    victim = arena.alloc(1000)

    def gc_free() -> None:  # what a garbage-collected Allocation does mid-operation
        raw.on_alloc = None
        arena.free(victim)

    raw.on_alloc = gc_free
    p = arena.alloc(1 * MiB)  # extends: the raw allocation runs the "collector"
    assert p
    check_invariants(arena, raw)
    assert arena.get_stats()["InUse"] == 1 * MiB


# ---------------------------------------------------------------------------------------------
# shared arenas


class Closing(FakeRaw):
    closed = 0

    def close(self) -> None:
        self.closed += 1


def test_shared_arenas_count_references_and_warn_about_ignored_options():
    shared = SharedArenas("TestEP")
    made: list[Closing] = []

    def make() -> Closing:
        made.append(Closing())
        return made[-1]

    a = shared.acquire(("Mem", 0), ArenaConfig(), make, explicit=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert shared.acquire(("Mem", 0), ArenaConfig(), make, explicit=True) is a  # same config
    with pytest.warns(RuntimeWarning, match="already exists; this session's arena options are"):
        assert shared.acquire(("Mem", 0), ArenaConfig(max_mem=1), make, explicit=True) is a
    other = shared.acquire(("Mem", 1), ArenaConfig(), make, explicit=False)
    assert other is not a and shared.refs(("Mem", 0)) == 3
    for _ in range(3):
        assert shared.release(a)
    assert made[0].closed == 1 and shared.get(("Mem", 0)) is None
    assert not shared.release(a)  # underflow: ignored
    assert shared.acquire(("Mem", 0), ArenaConfig(max_mem=1), make, explicit=True) is not a
    assert made[1].closed == 0


# ---------------------------------------------------------------------------------------------
# properties


class ArenaMachine(RuleBasedStateMachine):
    """Random allocations, frees, reserves, notifications, run ends and shrinks on an arena
    with a random configuration over a raw allocator of random capacity."""

    def __init__(self) -> None:
        super().__init__()
        self.streams = [Stream("a"), Stream("b"), Stream("c")]
        self.live: dict[int, tuple[int, object]] = {}  # ptr -> (rounded size, stream)
        self.reserved: list[int] = []
        self.freed: list[tuple[int, int, object, int]] = []  # (start, end, stream, sync id)
        self.allocs = 0
        self.reserves = 0

    @initialize(
        strategy=st.sampled_from([0, 1]),
        initial=st.sampled_from([4 * KiB, 64 * KiB, 1 * MiB]),
        max_dead=st.sampled_from([1 * KiB, 64 * KiB, 128 * MiB]),
        cap=st.sampled_from([256 * KiB, 2 * MiB, 1 << 30]),
        max_mem=st.sampled_from([512 * KiB, 4 * MiB, SIZE_MAX]),
        capacity=st.sampled_from([1 * MiB, 8 * MiB, 1 << 40]),
    )
    def setup(self, strategy, initial, max_dead, cap, max_mem, capacity):
        self.raw = FakeRaw(capacity=capacity)
        cfg = ArenaConfig(
            max_mem=max_mem,
            extend_strategy=strategy,
            initial_chunk_size_bytes=initial,
            max_dead_bytes_per_chunk=max_dead,
            initial_growth_chunk_size_bytes=initial,
            max_power_of_two_extend_bytes=cap,
        )
        self.arena = BFCArena(self.raw, cfg)

    def _stream(self, k: int):
        return None if k == 3 else self.streams[k]

    @rule(size=st.integers(1, 300 * KiB) | st.integers(1, 2048), k=st.integers(0, 3))
    def alloc(self, size, k):
        s = self._stream(k)
        ptr = self.arena.alloc_on_stream(size, s) if s is not None else self.arena.alloc(size)
        if not ptr:
            return
        self.allocs += 1
        chunk = next(c for r in regions(self.arena) for c in r[2] if c[0] == ptr)
        size_given = chunk[1]
        assert size_given >= rounded_bytes(size)
        end = ptr + size_given
        for start, stop, by, sync in self.freed:
            if start < end and ptr < stop and by is not s:
                # memory last freed on another stream: only after a wait recorded after it
                assert s is not None, "a request without a stream got a tagged chunk"
                assert s.last_wait_on(by) > sync, "a chunk crossed streams without a wait"
        self.freed = [f for f in self.freed if not (f[0] < end and ptr < f[1])]
        self.live[ptr] = (size_given, s)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        ptr = data.draw(st.sampled_from(sorted(self.live)))
        size, s = self.live.pop(ptr)
        self.arena.free(ptr)
        if s is not None:
            self.freed.append((ptr, ptr + size, s, s.sync_id))

    @rule(size=st.integers(1, 100 * KiB))
    def reserve(self, size):
        ptr = self.arena.reserve(size)
        if ptr:
            self.reserves += 1
            self.reserved.append(ptr)

    @precondition(lambda self: self.reserved)
    @rule()
    def free_reserved(self):
        self.arena.free(self.reserved.pop())

    @rule(p=st.integers(0, 2), c=st.integers(0, 2))
    def wait(self, p, c):
        if p != c:
            notify(self.streams[p], self.streams[c])

    @rule(k=st.integers(0, 2))
    def run_end(self, k):
        s = self.streams[k]
        s.on_session_run_end()
        # the stream's work is done: what it freed, and what it holds, is untagged
        self.freed = [f for f in self.freed if f[2] is not s]
        self.live = {p: (n, None if by is s else by) for p, (n, by) in self.live.items()}

    @rule()
    def shrink(self):
        self.arena.shrink()

    @invariant()
    def consistent(self):
        if not hasattr(self, "arena"):
            return
        check_invariants(self.arena, self.raw)
        live = {
            c[0]: c[1] for r in regions(self.arena) for c in r[2] if c[2]
        }  # in-use chunks of the arena
        assert live == {p: v[0] for p, v in self.live.items()}
        stats = self.arena.get_stats()
        assert stats["NumAllocs"] == self.allocs + self.reserves
        assert stats["NumReserves"] == self.reserves


ArenaMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_arena_invariants = ArenaMachine.TestCase
