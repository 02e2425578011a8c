"""Execution plans and the executor.

An ``ExecutionPlan`` is built once per (sub)graph: every value gets a slot, every node a
prepared kernel, every slot the step after which it is dead. Runs are grouped by the
*shape signature* of their feeds; for each signature the first run records

* the outputs of shape-only computations (Shape, and host ops that only combine shapes and
  constants): later runs with the same signature take them as constants and skip those nodes;
* every device allocation made through ``ctx.output``, its lifetime and the streams that touch
  it: later runs get a static memory plan, one block per device with precomputed offsets
  (onnxruntime's memory patterns). The block also holds a buffer per device feed (inputs are
  copied into it through pinned staging) and, for a session's top-level graph, the graph
  outputs, which are copied out at the end of the run.

A run executes a flat list of ``(call, ctx, release)`` tuples on a pooled *frame* (values list,
contexts, streams, planned block, scratch cache, staging buffers), so concurrent runs never
share mutable state. A frame's first run *binds* each kernel (``Kernel.bind``, the prepare
phase): a kernel may return a launcher with pointers, shapes and launch parameters bound once,
which replaces its ``compute`` for the frame's later runs. A launcher a provider can capture
says so (its ``segment`` attribute, ``Kernel.bind``): on the frame's next run each maximal
group of consecutive such steps on one stream is captured as one graph (``segment_program``),
and later runs launch that graph once instead of a launch per node, where the values the group
reads from outside are still the objects it was captured with (else its steps run one by one).

Steady state, counted by the tests: no allocation from any provider allocator (the plan's
block, the frame's ``FrameScratch`` and staging buffers are reused), no array views built, and
one host synchronisation, at the end, after the outputs were queued for copying.

Graph capture and replay (``graph_capture.GraphCapture``) run on frames of this module too.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

import numpy as np

from ..errors import Fail, InvalidArgument, OnnxPlugError
from .arena import BFCArena
from .control_flow import place
from .kernel import Kernel, KernelContext, KernelInfo
from .memory import (
    CPU,
    Allocation,
    Allocator,
    Device,
    DeviceTensor,
    allocate,
    allocate_tensor,
    host_view,
)
from .profiler import (
    NODE,
    SESSION,
    ArenaUsage,
    Profiler,
    RunTiming,
    input_facts,
    set_active_profiler,
    type_shapes,
)
from .scratch import FrameScratch, enter_scratch, exit_scratch
from .stream import await_ready

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
_UNSET = object()

# What a run delivers for each graph output (``GraphRunner.run``'s ``fetch``):
FETCH_HOST = "host"  # a fresh numpy array
FETCH_DEVICE = "device"  # a value the caller owns, where the graph produced it
# a numpy array or DeviceTensor instead of a mode: the output is copied into it
# None: not wanted


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
    # The kernel's provider has the kernel sync stream (plugin API 3): its workspaces are
    # tagged with its stream. False: onnxruntime's fallback, an untagged workspace.
    sync_stream: bool = True


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
    # provider key -> its device-timer factory (providers that time their nodes on their
    # streams while profiling; see profiler.py)
    timer_factories: dict[str, Callable[[], Any]] = field(default_factory=dict)
    # device -> allocator of host memory the device copies to and from asynchronously
    # (pinned memory): the frames' staging buffers for feeds and outputs
    staging: dict[Device, Allocator] = field(default_factory=dict)
    # whether graph outputs live in the static plan (a session's top-level graph, whose run
    # copies them out); a subgraph's outputs escape to its caller instead
    plan_outputs: bool = False
    eps: dict[str, Any] = field(default_factory=dict)  # provider key -> its EP


class _Recorder:
    """Collects what a signature's first run teaches: allocations and folded values."""

    def __init__(self) -> None:
        self.allocs: list[tuple[int, int, Device, int]] = []  # (step, out index, device, nbytes)
        self.last_use: list[int] = []
        self.streams: list[set[str | None]] = []  # providers whose streams touch each alloc
        self.escaped: set[int] = set()
        self.folded: dict[int, Any] = {}  # outputs of foldable steps, taken before release
        self.outputs: list[tuple[tuple[int, ...], np.dtype, Device] | None] = []


@dataclass
class SignaturePlan:
    """What the first run of a shape signature taught us."""

    folded: dict[int, Any]  # slot -> constant value
    skip_steps: frozenset[int]
    # (step, out index) -> (device, offset, nbytes)
    offsets: dict[tuple[int, int], tuple[Device, int, int]]
    block_sizes: dict[Device, int]
    # feed index -> (device, offset, shape, dtype): the static buffer a device feed is
    # copied into
    feeds: dict[int, tuple[Device, int, tuple[int, ...], np.dtype]] = field(default_factory=dict)
    # output index -> (shape, dtype, device) of device outputs (for pinned output staging)
    outputs: list[tuple[tuple[int, ...], np.dtype, Device] | None] = field(default_factory=list)
    frames: list[Frame] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    key: tuple = ()


class Frame:
    """The mutable state of one run: values, prepared contexts, streams, planned blocks."""

    __slots__ = (
        "blocks",
        "ctxs",
        "feed_bufs",
        "feed_calls",
        "folded",
        "in_stage",
        "out_calls",
        "out_stage",
        "program",
        "run_options",
        "scratch",
        "specs",
        "staging",
        "steps",
        "streams",
        "timers",
        "values",
    )

    def __init__(self) -> None:
        self.folded: dict[int, Any] = {}
        self.values: list[Any] = []
        self.steps: list[tuple[Callable[[Any], Any], Any, tuple[int, ...]]] = []
        # what an eager run executes once the steps are bound: None before the binding run,
        # _BOUND after it, then the steps with each capturable group as one step
        self.program: list[Any] | None = None
        self.specs: list[StepSpec | None] = []  # the node of each step (None: a wait, ...)
        self.ctxs: list[KernelContext | None] = []
        self.streams: dict[str, Any] = {}  # provider key -> its stream (None: synchronous)
        self.blocks: dict[Device, Allocation] = {}
        self.scratch: dict[Device, FrameScratch] = {}
        self.feed_bufs: list[DeviceTensor | None] = []
        self.in_stage: list[tuple[DeviceTensor, np.ndarray] | None] = []
        self.out_stage: list[tuple[DeviceTensor, np.ndarray] | None] = []
        self.feed_calls: list[Any] = []
        self.out_calls: list[Any] = []
        self.staging: list[Allocation] = []
        self.run_options: Any = _UNSET  # what the contexts hold (set once per change)
        self.timers: dict[str, Any] = {}  # provider key -> its device timer (while profiling)


def _nbytes(shape: tuple[int, ...], dtype: Any) -> int:
    n = np.dtype(dtype).itemsize
    for d in shape:
        n *= d
    return n


def _tag(t: DeviceTensor, rec: _Recorder) -> int | None:
    """Index of the allocation of ``rec`` a tensor lives in (None: not recorded by it)."""
    tag = getattr(t.memory, "tag", None)
    return tag[1] if tag is not None and tag[0] is rec else None


def _tags(v: Any, rec: _Recorder) -> list[int]:
    """Recorded allocations a value (a tensor or a sequence of them) lives in."""
    items = v if isinstance(v, list) else (v,)
    return [
        k for t in items if isinstance(t, DeviceTensor) for k in (_tag(t, rec),) if k is not None
    ]


class _NodeProfile:
    """A node as its profiler events name it: onnxruntime's event name (the node's name, or
    ``<op>_<index>`` when it has none), its index, op type, provider and the arena its outputs
    live in (for the ``mem_*`` args; None on the host, whose tensors are numpy arrays)."""

    __slots__ = ("arena", "event", "index", "op_type", "provider", "timed")

    def __init__(self, spec: StepSpec, index: int, plan: ExecutionPlan):
        info = spec.info
        name = info.name or f"{info.op_type}_{index}"
        self.event = f"{name}_kernel_time"
        self.index = str(index)
        self.op_type = info.op_type
        self.provider = getattr(info.ep, "name", "")
        dev = spec.out_devices[0] if spec.out_devices else None
        alloc = plan.allocators.get(dev) if dev is not None and not dev.is_cpu else None
        self.arena = alloc if isinstance(alloc, BFCArena) else None
        # what the node's Kernel event says: name, index, op type, provider
        self.timed = (name, index, self.op_type, self.provider)


class GraphRunner:
    """Runs an ``ExecutionPlan``; thread-safe (one frame per concurrent run)."""

    def __init__(self, plan: ExecutionPlan):
        self.plan = plan
        self._signatures: dict[tuple, SignaturePlan] = {}
        self._lock = threading.Lock()
        # the session's profiler while it profiles (a run may bring its own: ``run``)
        self.profiler: Profiler | None = None
        self._node_profiles: dict[int, _NodeProfile] = {}  # id(step spec) -> what it reports
        self.capture: Any = None  # graph_capture.GraphCapture, when a provider captures
        self._feed_streams = self._streams_of_feeds()
        self._output_streams = self._streams_of_outputs()
        kept = set(plan.constants)
        self._end_slots = tuple(
            s for s in dict.fromkeys([*plan.feed_slots, *plan.output_slots]) if s not in kept
        )

    def _streams_of_feeds(self) -> list[str | None]:
        """The provider stream each device feed is copied on: the one stream all its readers
        run on (None: several, or none; the copy is then synchronous)."""
        plan = self.plan
        readers: dict[int, set[str | None]] = {s: set() for s in plan.feed_slots}
        for spec in plan.steps:
            for s in itertools.chain(spec.in_slots, spec.implicit_slots):
                if s in readers:
                    readers[s].add(spec.ep_key)
        out: list[str | None] = []
        for s, dev in zip(plan.feed_slots, plan.feed_devices):
            keys = readers.get(s, set())
            one = next(iter(keys)) if len(keys) == 1 else None
            out.append(one if dev is not None and not dev.is_cpu else None)
        return out

    def _streams_of_outputs(self) -> list[str | None]:
        producer: dict[int, str | None] = {}
        for spec in self.plan.steps:
            for s in spec.out_slots:
                if s >= 0:
                    producer[s] = spec.ep_key
        return [producer.get(s) for s in self.plan.output_slots]

    # frames ---------------------------------------------------------------------------------
    def _make_frame(
        self, sig: SignaturePlan | None, recorder: _Recorder | None, bind: bool = True
    ) -> Frame:
        plan = self.plan
        f = Frame()
        values: list[Any] = [None] * plan.n_slots
        for s, v in plan.constants.items():
            values[s] = v
        folded: dict[int, Any] = {}
        for dev, alloc in plan.allocators.items():
            f.scratch[dev] = FrameScratch(alloc)
        if sig is not None:
            f.folded = folded = sig.folded
            for s, v in folded.items():
                values[s] = v
            for dev, size in sig.block_sizes.items():
                f.blocks[dev] = allocate(plan.allocators[dev], size)
            self._make_io_buffers(f, sig)
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
                    self._add(f, (_host_wait, note, ()), None)
                else:
                    self._add(f, (note.wait_on_device, stream, ()), None)
            if stream is not None and spec.info.node.subgraphs:
                # subgraphs run on frames (and streams) of their own and control flow reads
                # its inputs on the host: the work queued before must be done
                self._add(f, (_drain, stream, ()), None)
            out_alloc = tuple(
                self._out_allocator(i, j, dev, f, sig, recorder, stream)
                for j, dev in enumerate(spec.out_devices)
            )
            scratch = None
            dev0 = spec.out_devices[0] if spec.out_devices else None
            cache = f.scratch.get(dev0) if dev0 is not None else None
            if cache is not None:
                ws = cache.workspaces if spec.sync_stream else cache.untagged_workspaces
                scratch = _scratch_fn(ws, stream)
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
            if not spec.sync_stream:
                ctx._sync_stream = None
            if cache is not None:
                ctx._workspace = cache.stack(stream, spec.sync_stream)
            f.ctxs.append(ctx)
            release: tuple[int, ...] = ()
            if recorder is None:  # a recording run releases as it records
                # folded values stay in the frame for the next run on it
                release = tuple(r for r in pending + spec.release if r not in folded)
                pending = ()
            call: Callable[[Any], Any] = spec.kernel.compute
            if recorder is not None:
                call = spec.kernel.compute_first
            elif bind:
                call = _binder(f, len(f.steps), spec.kernel, release)
            self._add(f, (call, ctx, release), spec)
            if i in notes:
                self._add(f, (_activate, notes[i], ()), None)
        return f

    @staticmethod
    def _add(f: Frame, step: tuple, spec: StepSpec | None) -> None:
        f.steps.append(step)
        f.specs.append(spec)

    def _make_io_buffers(self, f: Frame, sig: SignaturePlan) -> None:
        """Static feed buffers (in the planned block) and pinned staging for feeds and
        outputs."""
        plan = self.plan
        n_feeds = len(plan.feed_slots)
        f.feed_bufs = [None] * n_feeds
        f.in_stage = [None] * n_feeds
        for k, (dev, offset, shape, dtype) in sig.feeds.items():
            block = f.blocks[dev]
            t = DeviceTensor(dev, dtype, shape, block.ptr + offset, block)
            t.stable_view = {}
            f.feed_bufs[k] = t
            f.in_stage[k] = self._stage_buffer(f, dev, shape, dtype)
        f.out_stage = [
            None if meta is None else self._stage_buffer(f, meta[2], meta[0], meta[1])
            for meta in sig.outputs
        ]
        f.feed_calls = [None] * n_feeds  # the bound staging copies, made on first use
        f.out_calls = [None] * len(sig.outputs)

    def _stage_buffer(
        self, f: Frame, dev: Device, shape: tuple[int, ...], dtype: np.dtype
    ) -> tuple[DeviceTensor, np.ndarray] | None:
        alloc = self.plan.staging.get(dev)
        nbytes = _nbytes(shape, dtype)
        if alloc is None or nbytes == 0:
            return None
        a = allocate(alloc, nbytes)
        f.staging.append(a)
        pinned = alloc.memory_info.device
        return DeviceTensor(pinned, dtype, shape, a.ptr, a), host_view(a.ptr, shape, dtype, a)

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
        scratch = frame.scratch[device]

        def dynamic(shape: tuple[int, ...], dtype: Any) -> DeviceTensor:
            dt = np.dtype(dtype)
            a = allocate(scratch, _nbytes(shape, dt), stream)
            return DeviceTensor(device, dt, shape, a.ptr, a)

        if recorder is not None:
            key = self.plan.steps[step].ep_key

            def recording(shape: tuple[int, ...], dtype: Any) -> DeviceTensor:
                dt = np.dtype(dtype)
                nbytes = _nbytes(shape, dt)
                a = allocate(scratch, nbytes, stream)
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

    def _close_frame(self, f: Frame) -> None:
        """Release what a frame no run will use again: streams it owns, scratch, staging,
        device timers."""
        for timer in f.timers.values():
            if timer is not None:
                timer.close()
        f.timers = {}
        _close_streams(f)
        f.program = None  # its graphs go (after the streams' last work)
        for cache in f.scratch.values():
            cache.close()
        for a in f.staging:
            a.release()
        f.staging = []

    def release_frames(self) -> None:
        """Close the pooled frames and let go of their memory-plan blocks and scratch (before
        an arena shrinks); the signature plans stay, and the next run of a signature makes a frame."""
        with self._lock:
            sigs = list(self._signatures.values())
        for sig in sigs:
            with sig.lock:
                frames, sig.frames = sig.frames, []
            for f in frames:
                self._close_frame(f)

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

    def _build_signature_plan(self, recorder: _Recorder, feeds: list[Any]) -> SignaturePlan:
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
        # static buffers for the device feeds, after the planned values in each block
        feed_bufs: dict[int, tuple[Device, int, tuple[int, ...], np.dtype]] = {}
        for k, (v, dev) in enumerate(zip(feeds, plan.feed_devices)):
            if dev is None or dev.is_cpu or dev not in plan.allocators:
                continue
            if not isinstance(v, (np.ndarray, DeviceTensor)) or v.dtype == object:
                continue
            dt = np.dtype(v.dtype)
            nbytes = _nbytes(tuple(v.shape), dt)
            if nbytes == 0:
                continue
            base = sizes.get(dev, 0)
            feed_bufs[k] = (dev, base, tuple(v.shape), dt)
            sizes[dev] = base + (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        return SignaturePlan(
            folded, frozenset(skip), offsets, sizes, feed_bufs, list(recorder.outputs)
        )

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

    def signature_plan(self, feeds: list[Any]) -> SignaturePlan | None:
        return self._signatures.get(self._signature(feeds))

    # running --------------------------------------------------------------------------------
    def run(
        self,
        feeds: list[Any],
        run_options: Any = None,
        fetch: Sequence[Any] | None = None,
        profiler: Profiler | None = None,
    ) -> list[Any]:
        """Run with ``feeds`` (in feed order). ``fetch`` says, per graph output, what to
        deliver (``FETCH_HOST``, ``FETCH_DEVICE``, an array to copy into, or None for an
        output not wanted); without it the outputs come back as the run left them. The run
        records into ``profiler``, or the runner's own while it profiles."""
        if profiler is None:
            profiler = self.profiler
        key = self._signature(feeds)
        sig = self._signatures.get(key)
        capture = self.capture
        if sig is None:
            outs = self._first_run(key, feeds, run_options, fetch, profiler)
            if capture is None or not capture.wants(run_options):
                return outs
            # as in onnxruntime, one run() goes on through the warm-up to the capture
            sig = self._signatures.get(key)
            if sig is None:
                return outs
        if capture is not None and capture.wants(run_options):
            return capture.run(sig, feeds, run_options, fetch, profiler)
        with sig.lock:
            frame = sig.frames.pop() if sig.frames else None
        if frame is None:
            frame = self._make_frame(sig, None)
        try:
            return self._execute(frame, feeds, run_options, None, fetch, profiler=profiler)
        finally:
            with sig.lock:
                pooled = len(sig.frames) < _MAX_POOLED_FRAMES
                if pooled:
                    sig.frames.append(frame)
            if not pooled:
                self._close_frame(frame)

    def _first_run(
        self,
        key: tuple,
        feeds: list[Any],
        run_options: Any,
        fetch: Sequence[Any] | None,
        profiler: Profiler | None,
    ) -> list[Any]:
        recorder = _Recorder()
        frame = self._make_frame(None, recorder)
        try:
            outs = self._execute(frame, feeds, run_options, recorder, fetch, profiler=profiler)
        finally:
            self._close_frame(frame)  # a recording frame is never reused
        sig = self._build_signature_plan(recorder, feeds)
        sig.key = key
        evicted = None
        with self._lock:
            if key not in self._signatures and len(self._signatures) >= _MAX_SIGNATURES:
                evicted = self._signatures.pop(next(iter(self._signatures)))
            self._signatures.setdefault(key, sig)
        if evicted is not None:
            with evicted.lock:
                frames, evicted.frames = evicted.frames, []
            for f in frames:
                self._close_frame(f)
            if self.capture is not None:
                self.capture.forget_signature(evicted.key)
        if self.capture is not None:
            self.capture.count_regular_run(key, run_options)
        return outs

    def _execute(
        self,
        frame: Frame,
        feeds: list[Any],
        run_options: Any,
        recorder: _Recorder | None,
        fetch: Sequence[Any] | None,
        body: Callable[[Frame, Any, list[Any]], None] | None = None,
        graph_mode: bool = False,
        extra_clear: Sequence[int] = (),
        profiler: Profiler | None = None,
    ) -> list[Any]:
        """One run on ``frame``: stage the feeds, run ``body`` (every step, by default),
        queue the outputs' copies, end the run on every stream (one synchronisation each),
        deliver the outputs. ``extra_clear``: slots besides feeds and outputs that may still
        hold a value when the body ends (a replayed graph's exports). With ``profiler`` the
        steps (not a ``body``'s) are timed into it, on the host and, where the provider
        times its streams, on the device: read after the synchronisation that ends the run."""
        plan = self.plan
        values = frame.values
        if frame.run_options is not run_options:
            frame.run_options = run_options
            for ctx in frame.ctxs:
                if ctx is not None:
                    ctx.run_options = run_options
        where: list[Any] = [None]  # the step running, for error messages
        failed = True
        prev = enter_scratch(frame.scratch)
        pending: list[tuple[int, Any]] = []
        timing: RunTiming | None = None
        prev_profiler: Profiler | None = None
        if profiler is not None:
            t_start = time.perf_counter_ns()
            prev_profiler = set_active_profiler(profiler)  # subgraph runs record into it
            if body is None:
                # before the feeds' copies: the anchors mark when the run's streams start
                timing = self._start_timing(frame)
        ended = False
        try:
            # a run that delivers its outputs (``fetch``) never hands out the frame's feed
            # buffer; a subgraph's run (no fetch) may: its device feeds stay in place
            self._stage_feeds(frame, feeds, graph_mode or fetch is not None)
            if body is not None:
                body(frame, run_options, where)
            elif recorder is not None:
                self._execute_recording(frame, recorder, where, profiler, timing)
            elif profiler is not None and timing is not None:
                self._execute_profiled(frame, where, run_options, profiler, timing)
            else:
                program = frame.program
                if program is _BOUND:
                    frame.program = segment_program(frame.steps, values, where, run_options)
                elif program is None:  # the binding run
                    _run_steps(frame.steps, values, where, run_options)
                    # a graph-capturing runner replays whole runs: no segments there
                    frame.program = _BOUND if self.capture is None else frame.steps
                else:
                    _run_steps(program, values, where, run_options)
            where[0] = None
            outs = [values[s] for s in plan.output_slots]
            if fetch is not None:
                pending = self._queue_outputs(frame, outs, fetch)
            failed = False
        except Exception as e:
            raise_run_error(where[0], e)
        finally:
            exit_scratch(prev)
            if failed:
                self._clear(frame)
            else:
                # a completed run released every value at its last reader: what is left is
                # the feeds, the outputs, and what the body names
                for s in itertools.chain(self._end_slots, extra_clear):
                    values[s] = None
            try:
                _end_run(frame, failed)
                ended = True
            finally:
                if profiler is not None:
                    set_active_profiler(prev_profiler)
                    if timing is not None:
                        timing.finish(profiler, ended and not failed)
        for i, done in pending:
            outs[i] = done()
        if profiler is not None:
            profiler.add(SESSION, "SequentialExecutor::Execute", t_start, time.perf_counter_ns())
        return outs

    def _start_timing(self, frame: Frame) -> RunTiming:
        """A run's device timing: each provider stream that has a timer gets its anchor."""
        timing = RunTiming()
        for key, make in self.plan.timer_factories.items():
            stream = frame.streams.get(key)
            if stream is None or stream.capturing:
                continue
            if key not in frame.timers:
                frame.timers[key] = make()
            timer = frame.timers[key]
            if timer is not None:
                timing.anchor(timer, stream)
        return timing

    def _stage_feeds(self, frame: Frame, feeds: list[Any], copy_device: bool) -> None:
        """Put each feed where its readers want it: in the frame's static buffer of the feed's
        shape, where it has one (host feeds through pinned staging, asynchronously on the
        readers' stream), so that the readers' prepared calls, and captured graphs, bound to
        that buffer, run. A feed already on the device is copied there with ``copy_device``
        (a device copy costs less than unprepared readers), used in place otherwise."""
        plan = self.plan
        values = frame.values
        bufs = frame.feed_bufs
        for k, (slot, dev) in enumerate(zip(plan.feed_slots, plan.feed_devices)):
            v = feeds[k]
            if dev is None or v is None or dev.is_cpu:
                values[slot] = v if not isinstance(v, DeviceTensor) else _to_host(v, plan)
                continue
            key = self._feed_streams[k]
            stream = frame.streams.get(key) if key is not None else None
            buf = bufs[k] if bufs else None
            if isinstance(v, DeviceTensor) and v.ready is not None:
                await_ready(v, stream)  # imported: its producer's work comes first
            if isinstance(v, DeviceTensor) and v.device == dev:
                if buf is not None and copy_device and v is not buf and v.shape == buf.shape:
                    # bound once for a value bound once, as with IOBinding
                    bound = frame.feed_calls[k]
                    if not isinstance(bound, tuple) or bound[0] is not v:
                        bound = frame.feed_calls[k] = (v, plan.transfer.bind_copy(v, buf, stream))
                    bound[1]()
                    values[slot] = buf
                else:
                    values[slot] = v
                continue
            if (
                buf is not None
                and isinstance(v, np.ndarray)
                and v.shape == buf.shape
                and v.dtype == buf.dtype
            ):
                stage = frame.in_stage[k]
                if stage is not None:
                    np.copyto(stage[1], v)
                    call = frame.feed_calls[k]
                    if not callable(call):
                        call = frame.feed_calls[k] = plan.transfer.bind_copy(stage[0], buf, stream)
                    call()
                else:
                    src = v if v.flags.c_contiguous else np.ascontiguousarray(v)
                    plan.transfer.copy(src, buf, stream)
                values[slot] = buf
                continue
            values[slot] = place(v, dev, plan.transfer, plan.allocators, stream)

    def _queue_outputs(
        self, frame: Frame, outs: list[Any], fetch: Sequence[Any]
    ) -> list[tuple[int, Any]]:
        """Queue what each output needs before the run's synchronisation; returns, for the
        outputs that need work after it, the calls that finish them."""
        plan = self.plan
        pending: list[tuple[int, Any]] = []
        for i, mode in enumerate(fetch):
            v = outs[i]
            if mode is None:
                outs[i] = None
                continue
            key = self._output_streams[i]
            stream = frame.streams.get(key) if key is not None else None
            if mode is FETCH_HOST:
                if not isinstance(v, DeviceTensor):
                    continue
                st = frame.out_stage[i] if frame.out_stage else None
                if st is not None and st[0].shape == v.shape and st[0].dtype == v.dtype:
                    bound = frame.out_calls[i]
                    if bound is None or bound[0] is not v or bound[2] is not st[0]:
                        bound = frame.out_calls[i] = (
                            v,
                            plan.transfer.bind_copy(v, st[0], stream),
                            st[0],
                        )
                    bound[1]()
                    pending.append((i, st[1].copy))
                else:
                    pending.append((i, lambda v=v: _to_host(v, plan)))
            elif mode is FETCH_DEVICE:
                if isinstance(v, DeviceTensor) and v.memory in frame.blocks.values():
                    # a planned output is the frame's memory: the caller gets its own copy
                    dst = allocate_tensor(plan.allocators[v.device], v.shape, v.dtype, stream)
                    plan.transfer.copy(v, dst, stream)
                    outs[i] = dst
            else:  # a destination to copy into (an IOBinding's bound value)
                await_ready(mode, stream)  # imported: its producer may still be using it
                got = (tuple(getattr(v, "shape", ())), getattr(v, "dtype", None))
                if got != (tuple(mode.shape), mode.dtype):
                    name = plan.slot_names[plan.output_slots[i]]
                    raise InvalidArgument(
                        f"output '{name}' is {got[1]}{list(got[0])} but the bound value is "
                        f"{mode.dtype}{list(mode.shape)}"
                    )
                if isinstance(mode, DeviceTensor) and isinstance(v, DeviceTensor):
                    bound = frame.out_calls[i] if frame.out_calls else None
                    if bound is None or bound[0] is not v or bound[2] is not mode:
                        bound = (v, plan.transfer.bind_copy(v, mode, stream), mode)
                        if frame.out_calls:
                            frame.out_calls[i] = bound
                    bound[1]()
                elif isinstance(mode, DeviceTensor) or isinstance(v, DeviceTensor):
                    if isinstance(mode, np.ndarray) and not mode.flags.c_contiguous:
                        pending.append((i, lambda v=v, d=mode: _copy_later(v, d, plan)))
                        continue
                    plan.transfer.copy(v, mode, stream)
                else:
                    np.copyto(mode, v)
                outs[i] = mode
        return pending

    def _clear(self, frame: Frame) -> None:
        values = frame.values
        keep = self.plan.constants
        folded = frame.folded
        for i in range(len(values)):
            if values[i] is not None and i not in keep and i not in folded:
                values[i] = None

    def _execute_recording(
        self,
        frame: Frame,
        rec: _Recorder,
        where: list[Any],
        profiler: Profiler | None,
        timing: RunTiming | None,
    ) -> None:
        plan = self.plan
        values = frame.values
        released_at: dict[int, int] = {}
        for i, spec in enumerate(plan.steps):
            for r in spec.release:
                released_at[r] = i
        step_of = {id(c): i for i, c in enumerate(frame.ctxs) if c is not None}
        for k, step in enumerate(frame.steps):
            where[0] = step
            if profiler is not None and timing is not None:
                self._call_profiled(frame, k, profiler, timing)
            else:
                step[0](step[1])
            ctx = step[1]
            if not isinstance(ctx, KernelContext):
                continue
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
        n_steps = len(plan.steps)
        for s in plan.output_slots:
            v = values[s]
            rec.outputs.append(
                (v.shape, v.dtype, v.device) if isinstance(v, DeviceTensor) else None
            )
            for k in _tags(v, rec):
                if plan.plan_outputs:
                    # the run copies its outputs out at the end: they live in the plan
                    # (copied on the producer's stream, so it stays in that stream's pool)
                    rec.escaped.discard(k)
                    rec.last_use[k] = n_steps
                else:
                    rec.escaped.add(k)  # a subgraph's outputs outlive its run

    def _execute_profiled(
        self,
        frame: Frame,
        where: list[Any],
        run_options: Any,
        profiler: Profiler,
        timing: RunTiming,
    ) -> None:
        values = frame.values
        for k, step in enumerate(frame.steps):
            where[0] = step
            if run_options is not None and run_options.terminate:
                raise Fail("Exiting due to terminate flag being set to true.")
            self._call_profiled(frame, k, profiler, timing)
            for r in step[2]:
                values[r] = None

    def _call_profiled(self, frame: Frame, k: int, profiler: Profiler, timing: RunTiming) -> None:
        """Run step ``k`` of ``frame`` and record its ``Node`` event (host time and
        onnxruntime's args); a node on a timed stream gets marks around its work for its
        ``Kernel`` event."""
        step = frame.steps[k]
        ctx = step[1]
        spec = frame.specs[k]
        if spec is None or not isinstance(ctx, KernelContext):
            step[0](ctx)  # a wait, a drain, a notification
            return
        node = self._node_profile(spec)
        values = ctx.values
        in_shapes, activations, parameters = input_facts(ctx.in_slots, values, self.plan.constants)
        stream = ctx.stream
        anchored = stream is not None and id(stream) in timing.anchors
        timer = frame.timers.get(spec.ep_key) if anchored and spec.ep_key is not None else None
        start = timer.mark(stream) if timer is not None else None
        usage = ArenaUsage(node.arena) if node.arena is not None else None
        t0 = time.perf_counter_ns()
        try:
            step[0](ctx)
        except BaseException:
            if timer is not None:
                timer.release([start])
            raise
        t1 = time.perf_counter_ns()
        if timer is not None:
            timing.pending.append((timer, stream, start, timer.mark(stream), *node.timed))
        out_shapes, out_bytes = type_shapes([values[s] for s in ctx.out_slots if s >= 0])
        args: dict[str, Any] = {
            "op_name": node.op_type,
            "provider": node.provider,
            "node_index": node.index,
            "activation_size": str(activations),
            "parameter_size": str(parameters),
            "output_size": str(out_bytes),
            "input_type_shape": in_shapes,
            "output_type_shape": out_shapes,
            "thread_scheduling_stats": "",  # no intra-op thread pool (onnxruntime's "")
        }
        if usage is not None:
            args.update(usage.args())
        profiler.add(NODE, node.event, t0, t1, args)

    def _node_profile(self, spec: StepSpec) -> _NodeProfile:
        """What a node's events say about it (made once per node)."""
        got = self._node_profiles.get(id(spec))
        if got is None:
            index = next(i for i, s in enumerate(self.plan.steps) if s is spec)
            got = self._node_profiles[id(spec)] = _NodeProfile(spec, index, self.plan)
        return got

    def close(self) -> None:
        """Release every pooled frame (the session is closing or its providers change)."""
        with self._lock:
            sigs, self._signatures = list(self._signatures.values()), {}
        for sig in sigs:
            with sig.lock:
                frames, sig.frames = sig.frames, []
            for f in frames:
                self._close_frame(f)
        if self.capture is not None:
            self.capture.release_all()

    def shrink(self) -> None:
        """Give back the free blocks of every pooled frame's scratch cache."""
        with self._lock:
            sigs = list(self._signatures.values())
        for sig in sigs:
            with sig.lock:
                frames = list(sig.frames)
            for f in frames:
                for cache in f.scratch.values():
                    cache.release_free()


def _run_steps(
    steps: Sequence[tuple[Callable[[Any], Any], Any, tuple[int, ...]]],
    values: list[Any],
    where: list[Any],
    run_options: Any,
) -> None:
    """The hot loop: call each step and release the values it read last."""
    if run_options is None:
        for step in steps:
            where[0] = step
            step[0](step[1])
            for r in step[2]:
                values[r] = None
        return
    for step in steps:
        if run_options.terminate:  # set from another thread: stop between nodes
            where[0] = None
            raise Fail("Exiting due to terminate flag being set to true.")
        where[0] = step
        step[0](step[1])
        for r in step[2]:
            values[r] = None


_BOUND: list[Any] = []  # a marker (by identity): Frame.program after the binding run


def segment_program(
    steps: Sequence[tuple[Callable[[Any], Any], Any, tuple[int, ...]]],
    values: list[Any],
    where: list[Any],
    run_options: Any,
) -> list[Any]:
    """Run a frame's bound ``steps`` once, capturing each maximal group of two or more
    consecutive steps whose launchers carry a ``segment`` on one stream as one graph (then
    launched: a capture records the work, it does not run it); the steps as later runs
    execute them, each captured group one step. A group that cannot be captured (a value
    it reads from outside is not the one its launchers bound, the provider refuses) keeps
    its steps."""
    program: list[Any] = []
    i, n = 0, len(steps)
    while i < n:
        seg = getattr(steps[i][0], "segment", None)
        j = i + 1
        if seg is not None:
            while j < n:
                nxt = getattr(steps[j][0], "segment", None)
                if nxt is None or nxt[0] is not seg[0]:
                    break
                j += 1
        group = tuple(steps[i:j])
        step = _captured_group(group, values) if j - i >= 2 else None
        if step is None:
            _run_steps(group, values, where, run_options)
            program.extend(group)
        else:
            _run_steps((step,), values, where, run_options)
            program.append(step)
        i = j
    return program


def _captured_group(
    group: tuple[tuple[Callable[[Any], Any], Any, tuple[int, ...]], ...], values: list[Any]
) -> tuple[Callable[[Any], Any], None, tuple[int, ...]] | None:
    """``group``'s steps captured as one graph, as one step (run it to run them); None where
    they cannot be. Each launcher's ``segment`` is (stream, its (slot, value) inputs, its
    (slot, value) outputs, a function capturing a call's work on the stream as a graph, or
    returning None)."""
    segs = [st[0].segment for st in group]  # type: ignore[attr-defined]
    produced: set[int] = set()
    reads: dict[int, Any] = {}
    sets: list[tuple[int, Any]] = []
    for seg in segs:
        for s, v in seg[1]:
            if s not in produced:
                reads.setdefault(s, v)
        for s, v in seg[2]:
            produced.add(s)
            sets.append((s, v))
    checks = tuple(reads.items())
    if any(values[s] is not v for s, v in checks):
        return None

    def work() -> None:
        for st in group:
            st[0](st[1])

    graph = segs[0][3](work)
    if graph is None:
        return None
    release = tuple(r for st in group for r in st[2])

    def launch(_: Any) -> None:
        for s, v in checks:
            if values[s] is not v:  # something else to read: the steps one by one
                _run_steps(group, values, [None], None)
                return
        for s, v in sets:
            values[s] = v
        graph()

    return (launch, None, release)


def _binder(frame: Frame, index: int, kernel: Kernel, release: tuple[int, ...]) -> Any:
    """The first call of a step on a frame: the kernel's prepare phase (``bind``), whose
    launcher (or ``compute``) then replaces the step for the frame's later runs."""

    def first(ctx: KernelContext) -> None:
        stack = ctx._workspace
        if stack is not None:
            stack.reset()  # this node's prepared calls start at the bottom of the workspace
        launcher = kernel.bind(ctx)
        frame.steps[index] = (launcher or kernel.compute, ctx, release)

    return first


def _node_message(info: KernelInfo, msg: str) -> str:
    if msg.startswith("Non-zero status code returned while running"):
        return msg
    return (
        f"Non-zero status code returned while running {info.op_type} node. "
        f"Name:'{info.name}' Status Message: {msg}"
    )


def step_info(step: Any) -> KernelInfo | None:
    """The node a step runs (None for waits, drains and the like)."""
    return step[1].info if isinstance(step, tuple) and isinstance(step[1], KernelContext) else None


def _run_error(step: Any, e: Exception) -> Exception:
    """The error a run raises for ``e``, naming the node of ``step`` when it was a kernel."""
    info = step_info(step)
    if isinstance(e, OnnxPlugError):
        return type(e)(_node_message(info, e.message)) if info is not None else e
    if info is None:
        return Fail(f"run failed: {type(e).__name__}: {e}")
    return Fail(_node_message(info, f"{type(e).__name__}: {e}"))


def raise_run_error(step: Any, e: Exception) -> NoReturn:
    """Raise, from the ``except`` block that caught ``e``, the error a run raises for it
    (``_run_error``)."""
    error = _run_error(step, e)
    if error is e:
        raise  # the exception being handled: e, with its own traceback
    try:
        raise error from e
    finally:
        # no reference cycle (error -> traceback -> the run's frame -> error) may keep the
        # run's device memory alive until the garbage collector runs
        del error


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
    """Release the streams of a frame no run will use again (not the ones a provider shares
    between frames: a unified stream, a user's stream)."""
    for stream in frame.streams.values():
        if stream is not None and getattr(stream, "frame_owned", True):
            stream.close()


def _to_host(v: DeviceTensor, plan: ExecutionPlan) -> np.ndarray:
    await_ready(v, None)
    return place(v, CPU, plan.transfer, {})


def _copy_later(v: Any, dst: np.ndarray, plan: ExecutionPlan) -> np.ndarray:
    np.copyto(dst, _to_host(v, plan) if isinstance(v, DeviceTensor) else v)
    return dst


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


__all__ = [
    "CPU",
    "FETCH_DEVICE",
    "FETCH_HOST",
    "ExecutionPlan",
    "GraphRunner",
    "StepSpec",
    "assign_offsets",
]
