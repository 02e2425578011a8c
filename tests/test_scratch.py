"""The frame scratch cache: reuse by (size, stream, kind), the capture guard, and holds (the
blocks a captured graph bakes in are never handed to anything else until it is released)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from onnxplug.errors import GraphCaptureViolation
from onnxplug.framework.memory import HostAllocator
from onnxplug.framework.scratch import FrameScratch


def test_freed_blocks_serve_the_next_run_without_allocating():
    alloc = HostAllocator()
    s = FrameScratch(alloc)
    a = s.alloc_on_stream(1000, "s")
    w = s.workspaces.alloc_on_stream(1000, "s")
    assert a != w
    s.free(a)
    s.free(w)
    n = alloc.get_stats()["NumAllocs"]
    assert s.alloc_on_stream(1000, "s") == a  # values and workspaces never share blocks
    assert s.workspaces.alloc_on_stream(1000, "s") == w
    assert s.alloc_on_stream(1000, "other stream") not in (a, w)
    assert alloc.get_stats()["NumAllocs"] == n + 1


def test_a_miss_while_capturing_is_a_violation():
    s = FrameScratch(HostAllocator())
    s.free(s.alloc(64))
    s.capturing = True
    assert s.alloc(64)  # served from the cache: fine
    with pytest.raises(GraphCaptureViolation, match="128 bytes"):
        s.alloc(128)


def test_held_blocks_are_reused_inside_the_capture_but_not_after():
    alloc = HostAllocator()
    s = FrameScratch(alloc)
    s.free(s.alloc(256))  # the warm-up run's temporary
    s.begin_hold()
    s.capturing = True
    a = s.alloc(256)
    s.free(a)
    assert s.alloc(256) == a  # the graph reuses it in stream order, as the eager run did
    s.free(a)
    s.capturing = False
    held = s.end_hold()
    assert held == [a]
    # an eager value of the same size must not land in the graph's temporary
    b = s.alloc(256)
    assert b != a
    s.free(b)
    s.release_held(held)
    assert sorted([s.alloc(256), s.alloc(256)]) == sorted([a, b])


def test_a_held_block_still_in_use_is_freed_by_its_user_after_the_release():
    s = FrameScratch(HostAllocator())
    s.begin_hold()
    a = s.alloc(64)
    held = s.end_hold()
    s.release_held(held)  # the graph is gone, the value still holds the block
    s.free(a)  # its user frees it: back in the cache
    assert s.alloc(64) == a


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["take", "free", "hold", "end"]), st.integers(0, 3))))
def test_no_block_is_handed_out_twice(ops):
    s = FrameScratch(HostAllocator())
    live: list[int] = []
    held: list[int] = []
    holding = False
    for op, k in ops:
        if op == "take":
            p = s.alloc(64 * (k + 1))
            assert p not in live
            live.append(p)
        elif op == "free" and live:
            s.free(live.pop(k % len(live)))
        elif op == "hold" and not holding:
            s.begin_hold()
            holding = True
        elif op == "end" and holding:
            held = s.end_hold()
            holding = False
            # what the graph holds is never handed out again while held
            assert not set(held) & {s.alloc(64 * (j + 1)) for j in range(4)} - set(live)
            s.release_held(held)


def test_a_collected_session_closes_its_frames_and_their_scratch_gives_its_blocks_back(virt):
    """A session that is dropped, not closed: its frames' scratch caches give their blocks
    back to the provider's allocator (they once stayed with the caches, lost: with an external
    allocator, blocks of the user's pool that never came back)."""
    import gc

    import numpy as np

    import onnxplug as ox
    from tests.plugins import graphs
    from tests.plugins import virtual_device as vd

    model = graphs.chain("Softmax", 2)  # Softmax takes a workspace from the frame's scratch
    s = ox.InferenceSession(model, providers=[vd.NAME, "CPUExecutionProvider"])
    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    for _ in range(3):
        s.run(None, {"x": x})
    caches = [
        c for sig in s._runner._signatures.values() for f in sig.frames for c in f.scratch.values()
    ]
    assert caches and all(c.cached_bytes > 0 for c in caches)
    del s
    gc.collect()
    assert all(c.closed and c.get_stats()["TotalAllocated"] == 0 for c in caches)
