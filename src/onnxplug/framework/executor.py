"""Execution plans and the executor.

An ``ExecutionPlan`` is built once per (sub)graph: every value gets a slot, every node a
prepared kernel, every slot the step after which it is dead. Runs are grouped by the
*shape signature* of their feeds; for each signature the first run records

* the outputs of shape-only computations (Shape, and host ops that only combine shapes and
  constants): later runs with the same signature take them as constants and skip those nodes;
* every device allocation made through ``ctx.output``, its lifetime and the streams that touch
  it: later runs get a static memory plan, one block per device with precomputed offsets
  (onnxruntime's memory patterns), so the steady state makes no per-tensor allocations.

A run executes a flat list of ``(compute, ctx, release)`` tuples on a pooled *frame* (values
list + contexts + streams), so concurrent runs never share mutable state.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence
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
_SHARED = object()  # memory-plan pool of allocations that more than one stream touches


def assign_offsets(
    items: Sequence[tuple[int, int, int]], align: int = _ALIGN
) -> tuple[list[int], int]:
    """Offsets in one block for allocations given as ``(nbytes, first step, last step)``.

    Allocations whose step intervals (inclusive) intersect get disjoint, ``align``-aligned
    byte ranges; the others may share memory. Greedy: largest first, each at the lowest
    offset that fits between the already placed allocations it is live with. Returns the
    offsets (in ``items`` order) and the block size.
    """
    order = sorted(range(len(items)), key=lambda k: (-items[k][0], items[k][1]))
    placed: list[tuple[int, int, int, int]] = []  # (offset, size, start, end)
    offsets = [0] * len(items)
    total = 0
    for k in order:
        nbytes, start, end = items[k]
        size = (nbytes + align - 1) // align * align
        live = sorted((o, s) for o, s, a, b in placed if not (b < start or end < a))
        offset = 0
        for o, s in live:
            if offset + size <= o:
                break
            offset = max(offset, o + s)
        placed.append((offset, size, start, end))
        offsets[k] = offset
        total = max(total, offset + size)
    return offsets, total


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
    # device -> allocator for DEFAULT memory; provider key -> its stream factory
    allocators: dict[Device, Allocator] = field(default_factory=dict)
    stream_factories: dict[str, Callable[[], Any]] = field(default_factory=dict)
    waits: dict[int, list[tuple[int, str]]] = field(
        default_factory=dict
    )  # step -> [(producer step, ep)]
    transfer: Any = None  # DataTransferManager
    profiler: Any = None


class _Recorder:
    """Collects what a signature's first run teaches: allocations and folded values."""

    def __init__(self) -> None:
        self.allocs: list[tuple[int, int, Device, int]] = []  # (step, out index, device, nbytes)
        self.last_use: list[int] = []
        self.streams: list[set[str | None]] = []  # providers whose streams touch each alloc
        self.escaped: set[int] = set()
        self.folded: dict[int, Any] = {}  # outputs of foldable steps, taken before release


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
        self.streams: dict[str, Any] = {}  # provider key -> its stream (None: synchronous)
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


def _tags(v: Any, rec: _Recorder) -> list[int]:
    """Recorded allocations a value (a tensor or a sequence of them) lives in."""
    items = v if isinstance(v, list) else (v,)
    return [
        k for t in items if isinstance(t, DeviceTensor) for k in (_tag(t, rec),) if k is not None
    ]


class GraphRunner:
    """Runs an ``ExecutionPlan``; thread-safe (one frame per concurrent run)."""

    def __init__(self, plan: ExecutionPlan):
        self.plan = plan
        self._signatures: dict[tuple, SignaturePlan] = {}
        self._lock = threading.Lock()
        self.profiling = False
        self.profile_events: list[dict[str, Any]] = []

    # frames ---------------------------------------------------------------------------------
    def _make_frame(self, sig: SignaturePlan | None, recorder: _Recorder | None) -> Frame:
        plan = self.plan
        f = Frame()
        values: list[Any] = [None] * plan.n_slots
        for s, v in plan.constants.items():
            values[s] = v
        folded: dict[int, Any] = {}
        if sig is not None:
            f.folded = folded = sig.folded
            for s, v in folded.items():
                values[s] = v
            for dev, size in sig.block_sizes.items():
                f.blocks[dev] = allocate(plan.allocators[dev], size)
        f.values = values
        for key, make in plan.stream_factories.items():
            f.streams[key] = make()
        # A producer without a stream has finished its work when its kernel returns: only
        # producers with a stream get a notification for their consumers to wait on.
        notes: dict[int, Any] = {}
        for waits in plan.waits.values():
            for prod, key in waits:
                stream = f.streams.get(key)
                if prod not in notes and stream is not None:
                    notes[prod] = stream.create_notification()
        pending: tuple[int, ...] = ()  # slots whose last reader is a skipped step
        for i, spec in enumerate(plan.steps):
            if sig is not None and i in sig.skip_steps:
                f.ctxs.append(None)
                pending += spec.release
                continue
            stream = f.streams.get(spec.ep_key) if spec.ep_key else None
            for prod, _key in plan.waits.get(i, ()):
                note = notes.get(prod)
                if note is None:
                    continue
                if stream is None:
                    f.steps.append((_host_wait, note, ()))
                else:
                    f.steps.append((note.wait_on_device, stream, ()))
            if stream is not None and spec.info.node.subgraphs:
                # subgraphs run on frames (and streams) of their own and control flow reads
                # its inputs on the host: the work queued before must be done
                f.steps.append((_drain, stream, ()))
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
            release: tuple[int, ...] = ()
            if recorder is None:  # a recording run releases as it records
                # folded values stay in the frame for the next run on it
                release = tuple(r for r in pending + spec.release if r not in folded)
                pending = ()
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
            key = self.plan.steps[step].ep_key

            def recording(shape: tuple[int, ...], dtype: Any) -> DeviceTensor:
                dt = np.dtype(dtype)
                nbytes = _nbytes(shape, dt)
                a = allocate(allocator, nbytes, stream)
                if nbytes:
                    a.tag = (recorder, len(recorder.allocs))
                    recorder.allocs.append((step, index, device, nbytes))
                    recorder.last_use.append(step)
                    recorder.streams.append({key})
                return DeviceTensor(device, dt, shape, a.ptr, a)

            return recording
        if sig is not None:
            planned = sig.offsets.get((step, index))
            if planned is not None:
                dev, offset, size = planned
                block = frame.blocks[dev]
                base = block.ptr + offset

                last: list[Any] = [None]  # the tensor handed out last run (same every run)

                def from_plan(shape: tuple[int, ...], dtype: Any) -> DeviceTensor:
                    t = last[0]
                    if t is not None and t.shape == shape and t.dtype == dtype:
                        return t
                    dt = np.dtype(dtype)
                    if _nbytes(shape, dt) != size:  # data-dependent shape: allocate
                        return dynamic(shape, dt)
                    t = DeviceTensor(device, dt, shape, base, block)
                    t.stable_view = {}
                    last[0] = t
                    return t

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

    def _build_signature_plan(self, recorder: _Recorder) -> SignaturePlan:
        plan = self.plan
        folded: dict[int, Any] = {}
        skip: set[int] = set()
        outputs = set(plan.output_slots)
        for i, spec in enumerate(plan.steps):
            if not spec.foldable:
                continue
            outs = [(s, recorder.folded.get(s)) for s in spec.out_slots if s >= 0]
            # Skip a step only when every output is a small host array that is not a graph
            # output: what a run returns belongs to the caller, who may write to it.
            if all(
                isinstance(o, (np.ndarray, np.generic))
                and o.size <= _FOLD_MAX_ELEMENTS
                and s not in outputs
                for s, o in outs
            ):
                for s, o in outs:
                    # a copy (the recorded array may be referenced elsewhere), and an array
                    # where a kernel left a numpy scalar
                    o = np.array(o)
                    o.flags.writeable = False
                    folded[s] = o
                skip.add(i)
        offsets, sizes = self._memory_plan(recorder)
        return SignaturePlan(folded, frozenset(skip), offsets, sizes)

    def _memory_plan(
        self, rec: _Recorder
    ) -> tuple[dict[tuple[int, int], tuple[Device, int, int]], dict[Device, int]]:
        # Memory is reused in step order, which is the order the work really runs in only on
        # one stream. So each provider's stream gets its own region of the device block, and
        # allocations that several streams touch live until the run ends (when every stream
        # has been flushed).
        n_steps = len(self.plan.steps)
        pools: dict[tuple[Device, Any], list[int]] = {}
        for k, (_step, _index, dev, _nbytes) in enumerate(rec.allocs):
            if k in rec.escaped:
                continue
            streams = rec.streams[k]
            pool = next(iter(streams)) if len(streams) == 1 else _SHARED
            pools.setdefault((dev, pool), []).append(k)
        offsets: dict[tuple[int, int], tuple[Device, int, int]] = {}
        sizes: dict[Device, int] = {}
        for (dev, pool), ks in pools.items():
            items = [
                (
                    rec.allocs[k][3],
                    rec.allocs[k][0],
                    n_steps if pool is _SHARED else rec.last_use[k],
                )
                for k in ks
            ]
            offs, total = assign_offsets(items)
            base = sizes.get(dev, 0)
            for k, off in zip(ks, offs):
                step, index, _, nbytes = rec.allocs[k]
                offsets[(step, index)] = (dev, base + off, nbytes)
            sizes[dev] = base + total
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
                pooled = len(sig.frames) < _MAX_POOLED_FRAMES
                if pooled:
                    sig.frames.append(frame)
            if not pooled:
                _close_streams(frame)

    def _first_run(self, key: tuple, feeds: list[Any], run_options: Any) -> list[Any]:
        recorder = _Recorder()
        frame = self._make_frame(None, recorder)
        try:
            outs = self._execute(frame, feeds, run_options, recorder)
        finally:
            _close_streams(frame)  # a recording frame is never reused
        sig = self._build_signature_plan(recorder)
        evicted = None
        with self._lock:
            if key not in self._signatures and len(self._signatures) >= _MAX_SIGNATURES:
                evicted = self._signatures.pop(next(iter(self._signatures)))
            self._signatures.setdefault(key, sig)
        if evicted is not None:
            with evicted.lock:
                frames, evicted.frames = evicted.frames, []
            for f in frames:
                _close_streams(f)
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
        step: Any = None  # the step running, for error messages
        where: list[Any] = [None]  # the same, from the recording and profiling loops
        failed = True
        try:
            if recorder is not None:
                self._execute_recording(frame, recorder, where)
            elif self.profiling:
                self._execute_profiled(frame, where)
            else:
                for step in frame.steps:
                    step[0](step[1])
                    for r in step[2]:
                        values[r] = None
            outs = [values[s] for s in plan.output_slots]
            failed = False
        except Exception as e:
            error = _run_error(where[0] if where[0] is not None else step, e)
            if error is e:
                raise
            raise error from e
        finally:
            self._clear(frame)
            _end_run(frame, failed)
        return outs

    def _clear(self, frame: Frame) -> None:
        values = frame.values
        keep = self.plan.constants
        folded = frame.folded
        for i in range(len(values)):
            if values[i] is not None and i not in keep and i not in folded:
                values[i] = None

    def _execute_recording(self, frame: Frame, rec: _Recorder, where: list[Any]) -> None:
        plan = self.plan
        values = frame.values
        released_at: dict[int, int] = {}
        for i, spec in enumerate(plan.steps):
            for r in spec.release:
                released_at[r] = i
        step_of = {id(c): i for i, c in enumerate(frame.ctxs) if c is not None}
        profiling = self.profiling
        for step in frame.steps:
            where[0] = step
            t0 = time.perf_counter_ns() if profiling else 0
            step[0](step[1])
            ctx = step[1]
            if not isinstance(ctx, KernelContext):
                continue
            if profiling:
                self._profile(ctx.info, t0, time.perf_counter_ns())
            i = step_of[id(ctx)]
            spec = plan.steps[i]
            runs_subgraphs = bool(spec.info.node.subgraphs)
            for s in itertools.chain(spec.in_slots, spec.implicit_slots):
                if s >= 0:
                    for k in _tags(values[s], rec):
                        rec.streams[k].add(spec.ep_key)
                        if runs_subgraphs:
                            # a subgraph may return what it read (an Identity in one If
                            # branch, say): this run cannot tell how long that lives
                            rec.escaped.add(k)
            for s in spec.out_slots:
                if s < 0:
                    continue
                v = values[s]
                if spec.foldable:
                    rec.folded[s] = v
                if isinstance(v, DeviceTensor):
                    tagged = _tag(v, rec)
                    if tagged is not None:
                        rec.streams[tagged].add(spec.ep_key)  # a view made by another provider
                        end = released_at.get(s)
                        if end is None:
                            rec.escaped.add(tagged)
                        else:
                            rec.last_use[tagged] = max(rec.last_use[tagged], end)
                else:
                    rec.escaped.update(_tags(v, rec))
            for r in spec.release:
                values[r] = None
        # outputs that are views of recorded blocks escape the run
        for s in plan.output_slots:
            rec.escaped.update(_tags(values[s], rec))

    def _execute_profiled(self, frame: Frame, where: list[Any]) -> None:
        values = frame.values
        for step in frame.steps:
            where[0] = step
            t0 = time.perf_counter_ns()
            step[0](step[1])
            t1 = time.perf_counter_ns()
            for r in step[2]:
                values[r] = None
            ctx = step[1]
            if isinstance(ctx, KernelContext):
                self._profile(ctx.info, t0, t1)

    def _profile(self, info: KernelInfo, t0: int, t1: int) -> None:
        self.profile_events.append(
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


def _node_message(info: KernelInfo, msg: str) -> str:
    if msg.startswith("Non-zero status code returned while running"):
        return msg
    return (
        f"Non-zero status code returned while running {info.op_type} node. "
        f"Name:'{info.name}' Status Message: {msg}"
    )


def _run_error(step: Any, e: Exception) -> Exception:
    """The error a run raises for ``e``, naming the node of ``step`` when it was a kernel."""
    info = step[1].info if isinstance(step, tuple) and isinstance(step[1], KernelContext) else None
    if isinstance(e, OnnxPlugError):
        return type(e)(_node_message(info, e.message)) if info is not None else e
    if info is None:
        return Fail(f"run failed: {type(e).__name__}: {e}")
    return Fail(_node_message(info, f"{type(e).__name__}: {e}"))


def _end_run(frame: Frame, failed: bool) -> None:
    """Tell every stream of the run that it ended (they drain their queued work).

    Every stream is told even when one fails; a failure is raised only when the run itself
    succeeded, so that it never hides the error that made the run fail.
    """
    first: Exception | None = None
    for stream in frame.streams.values():
        if stream is None:
            continue
        try:
            stream.on_session_run_end()
        except Exception as e:
            first = first or e
    if first is not None and not failed:
        raise Fail(f"run failed: {type(first).__name__}: {first}") from first


def _close_streams(frame: Frame) -> None:
    """Release the streams of a frame no run will use again."""
    for stream in frame.streams.values():
        if stream is not None:
            stream.close()


def _host_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    return np.empty(shape, dtype=dtype)


def _drain(stream: Any) -> None:
    stream.flush()


def _host_wait(note: Any) -> None:
    note.wait_on_host()


def _activate(note: Any) -> None:
    note.activate()


def _scratch_fn(allocator: Allocator, stream: Any) -> Callable[[int], Allocation]:
    def scratch(nbytes: int) -> Allocation:
        return allocate(allocator, nbytes, stream)

    return scratch


__all__ = ["CPU", "ExecutionPlan", "GraphRunner", "StepSpec", "assign_offsets"]
