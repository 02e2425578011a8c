"""Process-wide counters of what a run costs the host: synchronisations and views built.

The performance model is *counted, not hoped* (DESIGN.md §5): a steady-state run makes one
host synchronisation (for its outputs), no device allocation and builds no array views.
Providers bump these counters where the work happens (a stream synchronise, an event wait, a
view of a tensor); tests read ``snapshot()`` before and after a run and assert the difference.
Device allocations are counted by the allocators themselves (their ``NumAllocs`` stat).

The counters are plain integers updated without a lock: under concurrent runs a count may be
lost, never invented; the tests that assert exact figures run one thread.
"""

from __future__ import annotations

HOST_SYNCS = "host_syncs"
VIEWS_BUILT = "views_built"
GRAPH_REPLAYS = "graph_replays"
GRAPH_CAPTURES = "graph_captures"

_COUNTS: dict[str, int] = {HOST_SYNCS: 0, VIEWS_BUILT: 0, GRAPH_REPLAYS: 0, GRAPH_CAPTURES: 0}


def bump(name: str, n: int = 1) -> None:
    _COUNTS[name] = _COUNTS.get(name, 0) + n


def snapshot() -> dict[str, int]:
    return dict(_COUNTS)


def delta(before: dict[str, int]) -> dict[str, int]:
    """What happened since ``before`` (a snapshot)."""
    now = _COUNTS
    return {k: now.get(k, 0) - before.get(k, 0) for k in now}


__all__ = [
    "GRAPH_CAPTURES",
    "GRAPH_REPLAYS",
    "HOST_SYNCS",
    "VIEWS_BUILT",
    "bump",
    "delta",
    "snapshot",
]
