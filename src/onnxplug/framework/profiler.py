"""Profiling: onnxruntime's trace events, and the device time of nodes.

A profiled session (``SessionOptions.enable_profiling``) or run (``RunOptions.enable_profiling``)
records Chrome-trace "complete" events (``"ph": "X"``) with onnxruntime's categories, names
and args:

* ``Session`` events: loading the model (``model_loading_uri``/``model_loading_array``),
  initialising the session (``session_initialization``), each run (``model_run``) and its
  executor (``SequentialExecutor::Execute``);
* ``Node`` events: the host time of each kernel call, ``<node>_kernel_time``, with args
  ``op_name``, ``provider``, ``node_index``, ``activation_size`` (bytes of the non-constant
  inputs), ``parameter_size`` (of the constant ones), ``output_size``, ``input_type_shape``,
  ``output_type_shape`` (``[{"float": [2, 3]}, ...]``), ``thread_scheduling_stats`` (``""``:
  onnxplug has no intra-op thread pool, which is what onnxruntime writes without one) and,
  for nodes whose outputs live in an arena (a device's BFC arena; host tensors are numpy
  arrays and have none, like onnxruntime with its CPU arena off), the ``mem_*`` figures of
  that arena after the node and their change over it;
* ``Kernel`` events: the device time of a node's work on its stream, as onnxruntime's CUDA
  provider reports its kernels (``"pid": -1, "tid": -1``, args ``op_name`` and ``stream``),
  one per node rather than per kernel (a node's launches run as one unit, a one-node CUDA
  graph on the CUDA provider), named after the node, with ``node_index`` and ``provider``
  to join it to its ``Node`` event. A provider times its nodes through a ``DeviceTimer``
  (``Ep.create_device_timer``): a mark queued on the node's stream before and after its work;
  the elapsed times are read after the run's own final synchronisation, so profiling adds no
  host synchronisation. The device timeline is placed on the host's by a mark queued when the
  run starts (every run ends synchronised, so the stream is idle then).

``ts`` is in microseconds since the profiler started (a session's creation:
``InferenceSession.get_profiling_start_time_ns`` gives it as epoch nanoseconds), ``dur`` in
microseconds, both rounded to the nearest microsecond.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Container, Sequence
from typing import Any

import numpy as np

from ..ir.types import elem_type_name, elem_type_of
from .arena import BFCArena
from .memory import DeviceTensor

SESSION = "Session"
NODE = "Node"
KERNEL = "Kernel"

_ACTIVE = threading.local()  # the profiler of the run executing on this thread, if any


class Profiler:
    """The events of one profiled session or run."""

    def __init__(self) -> None:
        self.start_ns = time.time_ns()  # epoch time of ``ts`` 0
        self._origin = time.perf_counter_ns()
        self.pid = os.getpid()
        self.events: list[dict[str, Any]] = []
        self.enabled = True

    def ts(self, t: int) -> int:
        """``time.perf_counter_ns()`` value ``t`` as microseconds since the start."""
        return round((t - self._origin) / 1000)

    def add(
        self,
        cat: str,
        name: str,
        t0: int,
        t1: int,
        args: dict[str, Any] | None = None,
        pid: int | None = None,
        tid: int | None = None,
    ) -> None:
        """Record an event from ``t0`` to ``t1`` (``time.perf_counter_ns()`` values) on this
        thread (or the given pid and tid)."""
        if not self.enabled:
            return
        self.events.append(
            {
                "cat": cat,
                "pid": self.pid if pid is None else pid,
                "tid": threading.get_native_id() if tid is None else tid,
                "dur": round((t1 - t0) / 1000),
                "ts": self.ts(t0),
                "ph": "X",
                "name": name,
                "args": {} if args is None else args,
            }
        )

    def end(self) -> list[dict[str, Any]]:
        """Stop recording; the events, by start time."""
        self.enabled = False
        events, self.events = self.events, []
        events.sort(key=lambda e: e["ts"])
        return events


def active_profiler() -> Profiler | None:
    """The profiler of the run executing on this thread (subgraph runs record into it)."""
    return getattr(_ACTIVE, "profiler", None)


def set_active_profiler(profiler: Profiler | None) -> Profiler | None:
    """Make ``profiler`` this thread's active one; returns the previous one."""
    prev = getattr(_ACTIVE, "profiler", None)
    _ACTIVE.profiler = profiler
    return prev


def write_trace(path: str, events: Sequence[dict[str, Any]]) -> None:
    """Write events as onnxruntime does: a JSON array, one event per line."""
    lines = ",\n".join(json.dumps(e, separators=(",", ":")) for e in events)
    with open(path, "w", encoding="utf-8") as f:
        f.write("[\n" + lines + ("\n" if lines else "") + "]\n")


def reserve_trace_file(prefix: str) -> str:
    """A new file for a trace, named as onnxruntime names it (``<prefix>_<local date and
    time>_<milliseconds>.json``) and created now, so that no other session or process takes
    the name: one made within the same millisecond gets ``_1``, ``_2``, ... appended.
    OSError when it cannot be created (its folder is missing, say)."""
    now = time.time()
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S", time.localtime(now))
    base = f"{prefix}_{stamp}_{int(now * 1000) % 1000:03d}"
    n = 0
    while True:
        path = f"{base}.json" if n == 0 else f"{base}_{n}.json"
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            n += 1
            continue
        os.close(fd)
        return path


# ---------------------------------------------------------------------------------------------
# a node's args


def _tensor_fact(v: Any) -> tuple[dict[str, list[int]], int] | None:
    """``({element type: shape}, bytes)`` of a tensor; None for anything else (onnxruntime
    skips non-tensors)."""
    if not isinstance(v, (np.ndarray, np.generic, DeviceTensor)):
        return None
    dt = np.dtype(v.dtype)
    try:
        name = elem_type_name(elem_type_of(dt))
    except ValueError:
        name = str(dt)
    return {name: [int(d) for d in v.shape]}, int(v.nbytes)


def type_shapes(values: Sequence[Any]) -> tuple[list[dict[str, list[int]]], int]:
    """``[{element type: shape}]`` of the tensors among ``values`` and their total bytes (a
    node's ``output_type_shape`` and ``output_size``)."""
    facts = [f for f in map(_tensor_fact, values) if f is not None]
    return [f[0] for f in facts], sum(f[1] for f in facts)


def input_facts(
    slots: Sequence[int], values: Sequence[Any], constants: Container[int]
) -> tuple[list[dict[str, list[int]]], int, int]:
    """A node's ``input_type_shape``, ``activation_size`` (bytes of its non-constant input
    tensors) and ``parameter_size`` (of its constant ones: initializers)."""
    shapes: list[dict[str, list[int]]] = []
    activations = parameters = 0
    for s in slots:
        f = _tensor_fact(values[s]) if s >= 0 else None
        if f is None:
            continue
        shapes.append(f[0])
        if s in constants:
            parameters += f[1]
        else:
            activations += f[1]
    return shapes, activations, parameters


class ArenaUsage:
    """The ``mem_*`` args of a node whose outputs live in an arena: the arena's figures after
    the node and their change over it."""

    __slots__ = ("arena", "held", "in_use", "requested")

    def __init__(self, arena: BFCArena):
        self.arena = arena
        self.in_use, self.requested, self.held = arena.usage()[:3]

    def args(self) -> dict[str, str]:
        in_use, requested, held, peak = self.arena.usage()
        return {
            "mem_bytes_in_use": str(in_use),
            "mem_bytes_requested_in_use": str(requested),
            "mem_in_use_peak": str(peak),
            "mem_arena_held": str(held),
            "mem_in_use_delta": str(in_use - self.in_use),
            "mem_requested_in_use_delta": str(requested - self.requested),
            "mem_arena_held_delta": str(held - self.held),
        }


# ---------------------------------------------------------------------------------------------
# device time of a run's nodes


class RunTiming:
    """The device timing of one run: per stream, the provider's timer and the run's anchor
    mark; per timed node, its marks. ``finish`` reads them after the run's synchronisation."""

    __slots__ = ("anchors", "pending")

    def __init__(self) -> None:
        # id(stream) -> (timer, anchor mark, host ns when it was queued)
        self.anchors: dict[int, tuple[Any, Any, int]] = {}
        # (timer, stream, start mark, end mark, node name, node index, op type, provider)
        self.pending: list[tuple[Any, Any, Any, Any, str, int, str, str]] = []

    def anchor(self, timer: Any, stream: Any) -> None:
        self.anchors[id(stream)] = (timer, timer.mark(stream), time.perf_counter_ns())

    def finish(self, profiler: Profiler, record: bool) -> None:
        """Record a ``Kernel`` event per timed node (``record``: the run completed and its
        streams are synchronised), then give every mark back to its timer."""
        used: dict[int, tuple[Any, list[Any]]] = {}
        for timer, mark, _ in self.anchors.values():
            used.setdefault(id(timer), (timer, []))[1].append(mark)
        for timer, stream, m0, m1, name, index, op, provider in self.pending:
            used.setdefault(id(timer), (timer, []))[1].extend((m0, m1))
            if not record:
                continue
            _, anchor, host = self.anchors[id(stream)]
            start_us = timer.elapsed_us(anchor, m0)
            dur_us = timer.elapsed_us(m0, m1)
            t0 = host + round(start_us * 1000)
            profiler.add(
                KERNEL,
                name,
                t0,
                t0 + round(dur_us * 1000),
                {
                    "op_name": op,
                    "stream": str(getattr(stream, "handle", 0) or id(stream)),
                    "node_index": str(index),
                    "provider": provider,
                },
                pid=-1,
                tid=-1,
            )
        for timer, marks in used.values():
            timer.release(marks)
        self.anchors.clear()
        self.pending.clear()


__all__ = [
    "KERNEL",
    "NODE",
    "SESSION",
    "ArenaUsage",
    "Profiler",
    "RunTiming",
    "active_profiler",
    "input_facts",
    "reserve_trace_file",
    "set_active_profiler",
    "type_shapes",
    "write_trace",
]
