"""Execution plans and the executor.

An ``ExecutionPlan`` is built once per (sub)graph: every value gets a slot, every node a
prepared kernel, every slot the step after which it is dead. Runs are grouped by the
*shape signature* of their feeds; for each signature the first run records

* the outputs of shape-only computations (Shape, and host ops that only combine shapes and
  constants): later runs with the same signature take them as constants and skip those nodes;
* every device allocation made through ``ctx.output`` and its lifetime: later runs get a
  static memory plan, one block per device with precomputed offsets (onnxruntime's memory
  patterns), so the steady state makes no per-tensor allocations.

A run executes a flat list of ``(compute, ctx, release)`` tuples on a pooled *frame* (values
list + contexts + streams), so concurrent runs never share mutable state.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import Fail, OnnxPlugError
from .kernel import Kernel, KernelContext, KernelInfo
from .memory import CPU, Allocation, Allocator, Device, DeviceTensor, allocate

_ALIGN = 256
_FOLD_MAX_ELEMENTS = 1 << 16
_MAX_SIGNATURES = 32
_MAX_POOLED_FRAMES = 8
# Ops whose output is not a function of their inputs' values: never folded.
NONDETERMINISTIC_OPS = frozenset(
    {
        "RandomNormal",
        "RandomUniform",
        "RandomNormalLike",
        "RandomUniformLike",
        "Bernoulli",
        "Multinomial",
        "Dropout",
    }
)
SHAPE_SOURCE_OPS = frozenset({"Shape", "Size"})


@dataclass
class StepSpec:
    """One node, prepared: its kernel and where its inputs and outputs live."""

    kernel: Kernel
    info: KernelInfo
    in_slots: tuple[int, ...]
    out_slots: tuple[int, ...]
    implicit_slots: tuple[int, ...]
    out_devices: tuple[Device, ...]  # where each output is allocated
    ep_key: str | None  # provider whose stream the kernel runs on (None: host)
    release: tuple[int, ...] = ()
    foldable: bool = False  # output depends only on input shapes and constants


@dataclass
class ExecutionPlan:
    """Shape-independent plan of one (sub)graph."""

    name: str
    n_slots: int
    slot_names: list[str]
    constants: dict[int, Any]
    feed_slots: list[int]
    feed_devices: list[Device | None]  # where each feed must live (None: anywhere)
    output_slots: list[int]
    steps: list[StepSpec]
    # provider key -> (allocator for DEFAULT memory, stream factory or None)
    allocators: dict[Device, Allocator] = field(default_factory=dict)
    stream_factories: dict[str, Callable[[], Any]] = field(default_factory=dict)
    waits: dict[int, list[tuple[int, str]]] = field(
        default_factory=dict
    )  # step -> [(producer step, ep)]
    transfer: Any = None  # DataTransferManager
    profiler: Any = None


class _Recorder:
    """Collects allocations of a signature's first run to build its memory plan."""

    def __init__(self) -> None:
        self.allocs: list[tuple[int, int, Device, int]] = []  # (step, out index, device, nbytes)
        self.last_use: list[int] = []
        self.escaped: set[int] = set()


@dataclass
class SignaturePlan:
    """What the first run of a shape signature taught us."""

    folded: dict[int, Any]  # slot -> constant value
    skip_steps: frozenset[int]
    # (step, out index) -> (device, offset, nbytes)
    offsets: dict[tuple[int, int], tuple[Device, int, int]]
    block_sizes: dict[Device, int]
    frames: list[Frame] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


class Frame:
    """The mutable state of one run: values, prepared contexts, streams, planned blocks."""

    __slots__ = ("blocks", "ctxs", "folded", "steps", "streams", "values")

    def __init__(self) -> None:
        self.folded: dict[int, Any] = {}
        self.values: list[Any] = []
        self.steps: list[tuple[Callable[[Any], Any], Any, tuple[int, ...]]] = []
        self.ctxs: list[KernelContext | None] = []
        self.streams: dict[str, Any] = {}
        self.blocks: dict[Device, Allocation] = {}


def _nbytes(shape: tuple[int, ...], dtype: Any) -> int:
    n = np.dtype(dtype).itemsize
    for d in shape:
        n *= d
    return n


def _tag(t: DeviceTensor, rec: _Recorder) -> int | None:
    """Index of the allocation of ``rec`` a tensor lives in (None: not recorded by it)."""
    o = t.owner
    while isinstance(o, DeviceTensor):
        o = o.owner
    tag = getattr(o, "tag", None)
    return tag[1] if tag is not None and tag[0] is rec else None


class GraphRunner:
    """Runs an ``ExecutionPlan``; thread-safe (one frame per concurrent run)."""

    def __init__(self, plan: ExecutionPlan):
        self.plan = plan
        self._signatures: dict[tuple, SignaturePlan] = {}
        self._lock = threading.Lock()
        self.profiling = False
        self.profile_events: list[dict[str, Any]] = []
        self._release_after: list[tuple[int, ...]] = [s.release for s in plan.steps]

    # frames ---------------------------------------------------------------------------------
    def _make_frame(self, sig: SignaturePlan | None, recorder: _Recorder | None) -> Frame:
        plan = self.plan
        f = Frame()
        values: list[Any] = [None] * plan.n_slots
        for s, v in plan.constants.items():
            values[s] = v
        if sig is not None:
            f.folded = sig.folded
            for s, v in sig.folded.items():
                values[s] = v
            for dev, size in sig.block_sizes.items():
                f.blocks[dev] = allocate(plan.allocators[dev], size)
        f.values = values
        for key, make in plan.stream_factories.items():
            f.streams[key] = make()
        notes: dict[int, Any] = {}
        for waits in plan.waits.values():
            for prod, key in waits:
                if prod not in notes:
                    notes[prod] = f.streams[key].create_notification()
        for i, spec in enumerate(plan.steps):
            if sig is not None and i in sig.skip_steps:
                f.ctxs.append(None)
                continue
            for prod, _key in plan.waits.get(i, ()):
                stream = f.streams.get(spec.ep_key) if spec.ep_key else None
                note = notes[prod]
                if stream is None:
                    f.steps.append((_host_wait, note, ()))
                else:
                    f.steps.append((note.wait_on_device, stream, ()))
            stream = f.streams.get(spec.ep_key) if spec.ep_key else None
            out_alloc = tuple(
                self._out_allocator(i, j, dev, f, sig, recorder, stream)
                for j, dev in enumerate(spec.out_devices)
            )
            scratch = None
            alloc = plan.allocators.get(spec.out_devices[0]) if spec.out_devices else None
            if alloc is not None:
                scratch = _scratch_fn(alloc, stream)
            ctx = KernelContext(
                values,
                spec.in_slots,
                spec.out_slots,
                spec.implicit_slots,
                spec.info,
                out_alloc,
                scratch,
                stream,
            )
            f.ctxs.append(ctx)
            release = spec.release
            if recorder is not None:
                release = ()
            f.steps.append((spec.kernel.compute, ctx, release))
            if i in notes:
                f.steps.append((_activate, notes[i], ()))
        return f

    def _out_allocator(
        self,
        step: int,
        index: int,
        device: Device,
        frame: Frame,
        sig: SignaturePlan | None,
        recorder: _Recorder | None,
        stream: Any,
    ) -> Callable[[tuple[int, ...], Any], Any]:
        if device.is_cpu:
            return _host_empty
        allocator = self.plan.allocators[device]

        def dynamic(shape: tuple[int, ...], dtype: Any) -> DeviceTensor:
            dt = np.dtype(dtype)
            a = allocate(allocator, _nbytes(shape, dt), stream)
            return DeviceTensor(device, dt, shape, a.ptr, a)

        if recorder is not None:

            def recording(shape: tuple[int, ...], dtype: Any) -> DeviceTensor:
                dt = np.dtype(dtype)
                nbytes = _nbytes(shape, dt)
                a = allocate(allocator, nbytes, stream)
                if nbytes:
                    a.tag = (recorder, len(recorder.allocs))
                    recorder.allocs.append((step, index, device, nbytes))
                    recorder.last_use.append(step)
                return DeviceTensor(device, dt, shape, a.ptr, a)

            return recording
        if sig is not None:
            planned = sig.offsets.get((step, index))
            if planned is not None:
                dev, offset, size = planned
                block = frame.blocks[dev]
                base = block.ptr + offset

                def from_plan(shape: tuple[int, ...], dtype: Any) -> DeviceTensor:
                    dt = np.dtype(dtype)
                    if _nbytes(shape, dt) != size:  # data-dependent shape: allocate
                        return dynamic(shape, dt)
                    return DeviceTensor(device, dt, shape, base, block)

                return from_plan
        return dynamic

    # signature plans --------------------------------------------------------------------------
    def _signature(self, feeds: list[Any]) -> tuple:
        sig: list[Any] = []
        for v in feeds:
            shape = getattr(v, "shape", None)
            if shape is not None:
                sig.append((tuple(shape), v.dtype.str if hasattr(v, "dtype") else None))
            elif isinstance(v, list):
                sig.append(("seq", len(v), tuple(getattr(x, "shape", ()) for x in v)))
            else:
                sig.append(type(v).__name__)
        return tuple(sig)

    def _build_signature_plan(self, frame: Frame, recorder: _Recorder) -> SignaturePlan:
        plan = self.plan
        folded: dict[int, Any] = {}
        skip: set[int] = set()
        values = frame.values
        for i, spec in enumerate(plan.steps):
            if not spec.foldable:
                continue
            # fold only when every output is present and a small host array
            arrays: list[np.ndarray] = [
                o
                for o in (values[s] if s >= 0 else None for s in spec.out_slots)
                if isinstance(o, np.ndarray) and o.size <= _FOLD_MAX_ELEMENTS
            ]
            if len(arrays) == len(spec.out_slots):
                for s, o in zip(spec.out_slots, arrays):
                    o.flags.writeable = False
                    folded[s] = o
                skip.add(i)
        offsets, sizes = self._memory_plan(recorder)
        return SignaturePlan(folded, frozenset(skip), offsets, sizes)

    def _memory_plan(
        self, rec: _Recorder
    ) -> tuple[dict[tuple[int, int], tuple[Device, int, int]], dict[Device, int]]:
        by_device: dict[Device, list[tuple[int, int, int, int]]] = {}
        for k, (step, _index, dev, nbytes) in enumerate(rec.allocs):
            if k in rec.escaped:
                continue
            size = (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
            by_device.setdefault(dev, []).append((size, step, rec.last_use[k], k))
        offsets: dict[tuple[int, int], tuple[Device, int, int]] = {}
        sizes: dict[Device, int] = {}
        for dev, items in by_device.items():
            placed: list[tuple[int, int, int, int]] = []  # (offset, size, start, end)
            total = 0
            for size, start, end, k in sorted(items, key=lambda t: (-t[0], t[1])):
                conflicts = sorted((o, s) for o, s, a, b in placed if not (b < start or end < a))
                offset = 0
                for o, s in conflicts:
                    if offset + size <= o:
                        break
                    offset = max(offset, o + s)
                placed.append((offset, size, start, end))
                total = max(total, offset + size)
                step, index, _, nbytes = rec.allocs[k]
                offsets[(step, index)] = (dev, offset, nbytes)
            sizes[dev] = total
        return offsets, sizes

    # running --------------------------------------------------------------------------------
    def run(self, feeds: list[Any], run_options: Any = None) -> list[Any]:
        key = self._signature(feeds)
        sig = self._signatures.get(key)
        if sig is None:
            return self._first_run(key, feeds, run_options)
        with sig.lock:
            frame = sig.frames.pop() if sig.frames else None
        if frame is None:
            frame = self._make_frame(sig, None)
        try:
            return self._execute(frame, feeds, run_options, None)
        finally:
            with sig.lock:
                if len(sig.frames) < _MAX_POOLED_FRAMES:
                    sig.frames.append(frame)

    def _first_run(self, key: tuple, feeds: list[Any], run_options: Any) -> list[Any]:
        recorder = _Recorder()
        frame = self._make_frame(None, recorder)
        outs = self._execute(frame, feeds, run_options, recorder)
        sig = self._build_signature_plan(frame, recorder)
        with self._lock:
            if len(self._signatures) >= _MAX_SIGNATURES:
                self._signatures.pop(next(iter(self._signatures)))
            self._signatures.setdefault(key, sig)
        return outs

    def _execute(
        self, frame: Frame, feeds: list[Any], run_options: Any, recorder: _Recorder | None
    ) -> list[Any]:
        plan = self.plan
        values = frame.values
        for slot, v in zip(plan.feed_slots, feeds):
            values[slot] = v
        for ctx in frame.ctxs:
            if ctx is not None:
                ctx.run_options = run_options
        steps = frame.steps
        step: Any = None
        # the recording and profiled loops report the step they are in, for error messages
        current: list[Any] = [None]
        try:
            if recorder is not None:
                self._execute_recording(frame, recorder, current)
            elif self.profiling:
                self._execute_profiled(frame, current)
            else:
                for step in steps:
                    step[0](step[1])
                    for r in step[2]:
                        values[r] = None
            outs = [values[s] for s in plan.output_slots]
        except OnnxPlugError as e:
            self._clear(frame)
            step = step if step is not None else current[0]
            if isinstance(step, tuple) and isinstance(step[1], KernelContext):
                raise type(e)(self._node_message(step[1].info, e.message)) from e
            raise
        except Exception as e:
            self._clear(frame)
            step = step if step is not None else current[0]
            info = (
                step[1].info
                if isinstance(step, tuple) and isinstance(step[1], KernelContext)
                else None
            )
            if info is None:
                raise Fail(f"run failed: {type(e).__name__}: {e}") from e
            raise Fail(self._node_message(info, f"{type(e).__name__}: {e}")) from e
        finally:
            for stream in frame.streams.values():
                stream.on_session_run_end()
        self._clear(frame)
        return outs

    @staticmethod
    def _node_message(info: KernelInfo, msg: str) -> str:
        if msg.startswith("Non-zero status code returned while running"):
            return msg
        return (
            f"Non-zero status code returned while running {info.op_type} node. "
            f"Name:'{info.name}' Status Message: {msg}"
        )

    def _clear(self, frame: Frame) -> None:
        values = frame.values
        keep = self.plan.constants
        folded = frame.folded
        for i in range(len(values)):
            if values[i] is not None and i not in keep and i not in folded:
                values[i] = None

    def _execute_recording(self, frame: Frame, rec: _Recorder, current: list[Any]) -> None:
        plan = self.plan
        values = frame.values
        released_at: dict[int, int] = {}
        for i, spec in enumerate(plan.steps):
            for r in spec.release:
                released_at[r] = i
        step_of = {id(c): i for i, c in enumerate(frame.ctxs) if c is not None}
        for step in frame.steps:
            current[0] = step
            step[0](step[1])
            ctx = step[1]
            if not isinstance(ctx, KernelContext):
                continue
            i = step_of[id(ctx)]
            spec = plan.steps[i]
            for s in spec.out_slots:
                if s < 0:
                    continue
                v = values[s]
                if isinstance(v, DeviceTensor):
                    k = _tag(v, rec)
                    if k is not None:
                        end = released_at.get(s)
                        if end is None:
                            rec.escaped.add(k)
                        else:
                            rec.last_use[k] = max(rec.last_use[k], end)
                elif isinstance(v, list):
                    for item in v:
                        if isinstance(item, DeviceTensor):
                            k = _tag(item, rec)
                            if k is not None:
                                rec.escaped.add(k)
            for r in spec.release:
                values[r] = None
        # outputs that are views of recorded blocks escape the run
        for s in plan.output_slots:
            v = values[s]
            if isinstance(v, DeviceTensor):
                k = _tag(v, rec)
                if k is not None:
                    rec.escaped.add(k)

    def _execute_profiled(self, frame: Frame, current: list[Any]) -> None:
        values = frame.values
        events = self.profile_events
        for step in frame.steps:
            current[0] = step
            t0 = time.perf_counter_ns()
            step[0](step[1])
            t1 = time.perf_counter_ns()
            for r in step[2]:
                values[r] = None
            ctx = step[1]
            if isinstance(ctx, KernelContext):
                info = ctx.info
                events.append(
                    {
                        "cat": "Node",
                        "name": f"{info.name}_kernel_time",
                        "ph": "X",
                        "ts": t0 // 1000,
                        "dur": max(1, (t1 - t0) // 1000),
                        "pid": 0,
                        "tid": threading.get_ident() % 100000,
                        "args": {
                            "op_name": info.op_type,
                            "provider": getattr(info.ep, "name", ""),
                        },
                    }
                )


def _host_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    return np.empty(shape, dtype=dtype)


def _host_wait(note: Any) -> None:
    note.wait_on_host()


def _activate(note: Any) -> None:
    note.activate()


def _scratch_fn(allocator: Allocator, stream: Any) -> Callable[[int], Allocation]:
    def scratch(nbytes: int) -> Allocation:
        return allocate(allocator, nbytes, stream)

    return scratch


__all__ = ["CPU", "ExecutionPlan", "GraphRunner", "StepSpec"]
