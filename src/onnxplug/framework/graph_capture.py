"""Graph capture and replay, orchestrated by the runner for the providers that capture.

onnxruntime's protocol (../shared/reference/ort_cuda_plugin_ep.md §4), driven by the host and
carried out by the provider:

* a run carries an annotation id (run config ``gpu_graph_id``, default 0; ``-1`` never
  captures); each id counts its regular runs, and once the count reaches the provider's
  ``graph_capture_warmup_runs()`` (``min_num_runs_before_cuda_graph_capture``) the run is
  captured and replayed once; later runs replay. As in onnxruntime a single ``run()`` performs
  the whole warm-up and capture sequence (at most 8 internal runs);
* different ids are independent graphs; graphs and counts belong to the thread that made them
  (a new thread warms up and captures its own), so two threads never share a graph's buffers.

Beyond onnxruntime:

* graphs are kept per **shape signature** too, so plain ``run()`` with numpy inputs replays:
  a graph's frame owns static feed buffers (filled through pinned staging), its planned
  outputs (copied out after the replay) and its scratch; a bounded LRU per thread
  (``session.graph_capture_cache_size``) holds them;
* **piecewise capture**: a model with host nodes, control flow or data-dependent shapes is
  captured as its maximal capturable segments (consecutive steps on one capturing provider's
  stream whose host inputs are fixed for the signature), and the rest runs eagerly between
  them. Before a segment replays, the values it reads from outside are checked to be the
  objects it captured (the executor hands out the same planned tensors every run); if one is
  not, that segment runs eagerly instead;
* safety: while a stream captures, the frame's scratch refuses to allocate and the provider's
  stream refuses to synchronise (``GraphCaptureViolation``); any error while capturing
  abandons the capture (a warning names the node), the segment runs eagerly and the graph
  stays disabled for that (signature, id, thread): a failed capture never breaks the session.

The replay fast path (``_Binding``): a captured context whose program is all graphs binds,
once per way of calling it (which feeds are arrays, which device values are bound, what each
output is fetched as), the host work of a replay: the staging of each feed, the copies the
graph does not hold, the launches, the streams to end and what each output becomes after the
run's synchronisation. A replay checks that the call is still that one (identity of the bound
values) and runs that list; anything else (a profiled run, a piecewise program, a value it
was not bound for) takes the general path through the executor.

A graph of one segment also **holds its feed and output copies**: the copy from a feed's
pinned staging buffer (or from a bound device value) into the frame's feed buffer is captured
at the start of the graph, and the copy of each output into its pinned staging buffer (or a
bound output value) at its end, so a steady replay issues one launch and no copy from the
host. The graph then reads and writes those objects' memory: the context remembers them, and
a run that feeds or fetches anything else where the graph holds a bound value's copy (another
OrtValue, an array where a device value was bound, an output no longer bound) never replays
that graph: the context drops the held copies for good and captures again, with the copies
made by the host from then on. Staging buffers belong to the frame, so those copies never
read or write memory the user owns.
"""

from __future__ import annotations

import itertools
import threading
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import InvalidArgument
from . import counters
from .executor import (
    FETCH_HOST,
    Frame,
    GraphRunner,
    SignaturePlan,
    StepSpec,
    _end_run,
    _run_steps,
    _to_host,
    raise_run_error,
    step_info,
)
from .memory import DeviceTensor

GRAPH_ID_KEY = "gpu_graph_id"
SKIP_CAPTURE = -1
MAX_WARMUP_RUNS = 8  # onnxruntime's kMaxGraphCaptureWarmupRuns
DEFAULT_CACHE_SIZE = 16
_ids = itertools.count(1)


def annotation_id(run_options: Any) -> int:
    """The run's graph annotation id (run config ``gpu_graph_id``; 0 when unset)."""
    if run_options is None:
        return 0
    raw = run_options.get(GRAPH_ID_KEY)
    if raw is None:
        return 0
    try:
        return int(raw)
    except (TypeError, ValueError):
        raise InvalidArgument(
            f"run config entry '{GRAPH_ID_KEY}' must be an integer (-1 skips capture), not {raw!r}"
        ) from None


class _Segment:
    """Consecutive steps captured as one graph on one provider's stream."""

    __slots__ = (
        "end",
        "ep",
        "ep_key",
        "export_slots",
        "exports",
        "graph_id",
        "import_slots",
        "imports",
        "start",
        "stream",
    )

    def __init__(self, ep_key: str, ep: Any, stream: Any, start: int):
        self.ep_key = ep_key
        self.ep = ep
        self.stream = stream
        self.start = start
        self.end = start + 1
        self.graph_id = 0
        self.import_slots: tuple[int, ...] = ()
        self.export_slots: tuple[int, ...] = ()
        self.imports: list[tuple[int, Any]] = []
        self.exports: list[tuple[int, Any]] = []


class _Resources:
    """What a context holds on the provider side, released when it is dropped."""

    def __init__(self, runner: GraphRunner, frame: Frame):
        self.runner = runner
        self.frame = frame
        self.graphs: list[tuple[Any, int]] = []  # (ep, graph id)
        self.held: list[tuple[Any, list[int]]] = []  # (frame scratch, blocks the graphs use)
        self.closed = False

    def release_graphs(self) -> None:
        graphs, self.graphs = self.graphs, []
        for ep, gid in graphs:
            try:
                ep.release_graph(gid)
            except Exception:  # a provider already gone: nothing left to free
                pass
        held, self.held = self.held, []
        for cache, ptrs in held:
            cache.release_held(ptrs)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.release_graphs()
        self.runner._close_frame(self.frame)


class _Context:
    """One thread's graph of one (shape signature, annotation id)."""

    WARMING, CAPTURED, DISABLED = "warming", "captured", "disabled"

    def __init__(self, capture: GraphCapture, sig: SignaturePlan, aid: int, runs: int):
        self.sig_key = sig.key
        self.annotation = aid
        self.runs = runs  # regular runs of this id and signature on this thread
        self.frame_runs = 0  # of which on this context's frame
        self.state = self.WARMING
        self.reason = ""
        self.lock = threading.Lock()
        self.released = False
        self.frame = capture.runner._make_frame(sig, None)
        self.res = _Resources(capture.runner, self.frame)
        self._finalizer = weakref.finalize(self, self.res.close)
        self.replay_body: Any = None
        self.program: list[Any] = []  # step indices and _Segments, in run order
        self.segments: list[_Segment] = []
        self.export_slots: tuple[int, ...] = ()
        # the copies the graph holds (see the module's docstring): whether the next capture
        # may hold them, and what the captured graph holds, as (feed index -> the bound value,
        # or None for the feed's pinned staging) and (output index -> the bound value, or
        # None for the output's pinned staging)
        self.hold_copies = True
        self.held_feeds: dict[int, Any] = {}
        self.held_outputs: dict[int, Any] = {}
        self.binding: _Binding | None = None  # the replay fast path, bound for one call

    def holds_copies_for(self, feeds: list[Any], fetch: Sequence[Any] | None) -> bool:
        """Whether a replay of the captured graph reads and writes only what this call
        feeds and fetches (the bound values the graph's held copies use are this call's)."""
        for k, v in self.held_feeds.items():
            if v is None:
                if not isinstance(feeds[k], np.ndarray):
                    return False
            elif feeds[k] is not v:
                return False
        for i, v in self.held_outputs.items():
            if v is not None and (fetch is None or fetch[i] is not v):
                return False
        return True

    def drop_graphs(self) -> None:
        """Release the captured graphs: the context warms up (at once) and captures again."""
        self.res.release_graphs()
        self.state = self.WARMING
        self.held_feeds = {}
        self.held_outputs = {}
        self.binding = None
        self.replay_body = None

    def close(self) -> None:
        self.released = True
        self._finalizer()


class GraphCapture:
    """The capture state machine of one runner (a session's top-level graph)."""

    def __init__(self, runner: GraphRunner, eps: dict[str, Any], cache_size: int):
        self.runner = runner
        self.eps = eps  # provider key -> EP, for the providers that capture
        self.min_runs = max((int(ep.graph_capture_warmup_runs()) for ep in eps.values()), default=2)
        self.cache_size = max(1, int(cache_size))
        self._tls = threading.local()
        self._all: weakref.WeakSet[_Context] = weakref.WeakSet()
        self._lock = threading.Lock()
        plan = runner.plan
        self._host_slots = self._slots_on_host()
        self._constants = set(plan.constants)

    def _slots_on_host(self) -> set[int]:
        plan = self.runner.plan
        host = {s for s, d in zip(plan.feed_slots, plan.feed_devices) if d is None or d.is_cpu}
        for spec in plan.steps:
            for s, d in zip(spec.out_slots, spec.out_devices):
                if s >= 0 and d.is_cpu:
                    host.add(s)
        return host

    # bookkeeping --------------------------------------------------------------------------------
    def wants(self, run_options: Any) -> bool:
        return annotation_id(run_options) != SKIP_CAPTURE

    def _contexts(self) -> OrderedDict[tuple, _Context]:
        d = getattr(self._tls, "contexts", None)
        if d is None:
            d = self._tls.contexts = OrderedDict()
            self._tls.counts = {}
        return d

    def count_regular_run(self, sig_key: tuple, run_options: Any) -> None:
        """A regular (recording) run of a signature happened on this thread."""
        aid = annotation_id(run_options)
        if aid == SKIP_CAPTURE:
            return
        self._contexts()
        counts = self._tls.counts
        counts[(sig_key, aid)] = counts.get((sig_key, aid), 0) + 1

    def _context(self, sig: SignaturePlan, aid: int) -> _Context:
        contexts = self._contexts()
        key = (sig.key, aid)
        ctx = contexts.get(key)
        if ctx is not None and not ctx.released:
            contexts.move_to_end(key)
            return ctx
        ctx = _Context(self, sig, aid, self._tls.counts.pop(key, 0))
        self._plan_segments(ctx, sig)
        contexts[key] = ctx
        with self._lock:
            self._all.add(ctx)
        while len(contexts) > self.cache_size:
            _, old = contexts.popitem(last=False)
            with old.lock:
                old.close()
        return ctx

    def release(self, annotation: int) -> int:
        """Release the captured graphs of ``annotation`` on every thread; returns how many
        contexts there were."""
        with self._lock:
            found = [c for c in list(self._all) if c.annotation == annotation and not c.released]
        for c in found:
            with c.lock:
                c.close()
        return len(found)

    def forget_signature(self, sig_key: tuple) -> None:
        """The runner evicted a signature plan: its contexts (on every thread) go with it."""
        with self._lock:
            found = [c for c in list(self._all) if c.sig_key == sig_key and not c.released]
        for c in found:
            with c.lock:
                c.close()

    def release_all(self) -> None:
        with self._lock:
            found = list(self._all)
        for c in found:
            with c.lock:
                c.close()

    def captured_annotations(self) -> set[int]:
        with self._lock:
            return {
                c.annotation
                for c in list(self._all)
                if not c.released and c.state == _Context.CAPTURED
            }

    def states(self) -> list[tuple[tuple, int, str, str]]:
        """(signature, annotation id, state, reason) of this thread's contexts."""
        return [
            (c.sig_key, c.annotation, c.state, c.reason)
            for c in self._contexts().values()
            if not c.released
        ]

    # segments -----------------------------------------------------------------------------------
    def _capturable(self, spec: StepSpec, stable: set[int]) -> bool:
        if spec.ep_key not in self.eps or spec.info.node.subgraphs:
            return False
        if not getattr(spec.kernel, "graph_capturable", True):
            return False
        if any(d.is_cpu for d in spec.out_devices):
            return False  # writes host memory: its readers need it now
        shape_only = spec.info.kernel_def.shape_only_inputs
        for k, s in enumerate(spec.in_slots):
            # a host value baked into the graph must be the same every run
            if s >= 0 and k not in shape_only and s in self._host_slots and s not in stable:
                return False
        return True

    def _plan_segments(self, ctx: _Context, sig: SignaturePlan) -> None:
        frame = ctx.frame
        stable = self._constants | set(sig.folded)
        program: list[Any] = []
        segments: list[_Segment] = []
        cur: _Segment | None = None
        for i, spec in enumerate(frame.specs):
            ok = spec is not None and self._capturable(spec, stable)
            if ok and cur is not None and spec is not None and spec.ep_key == cur.ep_key:
                cur.end = i + 1
                continue
            if ok:
                assert spec is not None and spec.ep_key is not None
                key = spec.ep_key
                cur = _Segment(key, self.eps[key], frame.streams.get(key), i)
                segments.append(cur)
                program.append(cur)
                continue
            cur = None
            program.append(i)
        plan = self.runner.plan
        outputs = set(plan.output_slots)
        for seg in segments:
            produced: set[int] = set()
            imports: dict[int, None] = {}
            for spec in frame.specs[seg.start : seg.end]:
                assert spec is not None
                shape_only = spec.info.kernel_def.shape_only_inputs
                for k, s in enumerate(spec.in_slots):
                    if s >= 0 and k not in shape_only and s not in produced and s not in stable:
                        imports[s] = None
                produced.update(s for s in spec.out_slots if s >= 0)
            later: set[int] = set(outputs)
            for spec in frame.specs[seg.end :]:
                if spec is not None:
                    later.update(spec.in_slots)
                    later.update(spec.implicit_slots)
            seg.import_slots = tuple(imports)
            seg.export_slots = tuple(s for s in produced if s in later)
        ctx.program = program
        ctx.segments = segments
        # what a replay may leave set: exports, and imports whose last reader was replayed
        ctx.export_slots = tuple(
            dict.fromkeys(s for seg in segments for s in (*seg.export_slots, *seg.import_slots))
        )

    # running ------------------------------------------------------------------------------------
    def run(
        self,
        sig: SignaturePlan,
        feeds: list[Any],
        run_options: Any,
        fetch: Sequence[Any] | None,
        profiler: Any = None,
    ) -> list[Any]:
        """A run of a capturing session. With ``profiler``, the eager runs (warm-up, a
        disabled capture) record their nodes; a capturing or replaying run records none (its
        work is one graph per segment)."""
        aid = annotation_id(run_options)
        runner = self.runner
        while True:
            ctx = self._context(sig, aid)
            with ctx.lock:
                if ctx.released:
                    continue  # released by another thread meanwhile: make a new one
                if ctx.state == _Context.CAPTURED:
                    b = ctx.binding
                    if profiler is None and b is not None and b.matches(feeds, fetch):
                        return b.run(feeds)
                    if ctx.holds_copies_for(feeds, fetch):
                        if profiler is None:
                            b = ctx.binding = _Binding.of(ctx, feeds, fetch)
                            if b is not None:
                                return b.run(feeds)
                        return self._replay(ctx, feeds, run_options, fetch)
                    # the graph holds copies of other values than this call's: from now on
                    # the host makes the copies (a graph captured again holds none of them)
                    ctx.hold_copies = False
                    ctx.drop_graphs()
                if ctx.state == _Context.DISABLED or not ctx.segments:
                    return runner._execute(
                        ctx.frame, feeds, run_options, None, fetch, profiler=profiler
                    )
                for _ in range(MAX_WARMUP_RUNS):
                    if ctx.runs >= self.min_runs and ctx.frame_runs >= 1:
                        return self._capture(ctx, feeds, run_options, fetch)
                    # feeds staged as the capture will stage them (a device feed copied
                    # into the frame's buffer): the prepared calls bind the buffers the
                    # graph reads, not a bound value that the capture then replaces
                    outs = runner._execute(
                        ctx.frame, feeds, run_options, None, fetch, None, True, profiler=profiler
                    )
                    ctx.runs += 1
                    ctx.frame_runs += 1
                return outs

    def _capture(
        self, ctx: _Context, feeds: list[Any], run_options: Any, fetch: Sequence[Any] | None
    ) -> list[Any]:
        held = self._copies_to_hold(ctx, feeds, fetch) if ctx.hold_copies else None

        def body(frame: Frame, run_options: Any, where: list[Any]) -> None:
            values = frame.values
            steps = frame.steps
            for item in ctx.program:
                if isinstance(item, _Segment):
                    if ctx.state == _Context.DISABLED:
                        _run_steps(steps[item.start : item.end], values, where, run_options)
                    else:
                        self._capture_segment(ctx, item, frame, where, run_options, held)
                else:
                    _run_steps((steps[item],), values, where, run_options)

        outs = self.runner._execute(
            ctx.frame, feeds, run_options, None, fetch, body, True, ctx.export_slots
        )
        if ctx.state != _Context.DISABLED:
            ctx.state = _Context.CAPTURED
        else:
            ctx.res.release_graphs()
        return outs

    def _copies_to_hold(
        self, ctx: _Context, feeds: list[Any], fetch: Sequence[Any] | None
    ) -> _HeldCopies | None:
        """The feed copies a graph of the whole model may hold (the module's docstring): from
        each feed's pinned staging buffer, or from a bound device value, into the frame's
        feed buffer, on the segment's stream. The output copies are found once the captured
        steps have run (``_hold_output_copies``)."""
        if len(ctx.program) != 1:
            return None
        (seg,) = ctx.program
        if not isinstance(seg, _Segment) or seg.stream is None:
            return None
        runner = self.runner
        plan = runner.plan
        frame = ctx.frame
        held = _HeldCopies()
        for k, v in enumerate(feeds):
            buf = frame.feed_bufs[k] if frame.feed_bufs else None
            if buf is None or runner._feed_streams[k] != seg.ep_key:
                continue
            if isinstance(v, np.ndarray):
                stage = frame.in_stage[k]
                if stage is None:
                    continue  # copied from the caller's array: read when the run is made
                held.feeds[k] = None
                held.feed_calls.append(plan.transfer.bind_copy(stage[0], buf, seg.stream))
            elif (
                isinstance(v, DeviceTensor)
                and v is not buf
                and v.ready is None
                and v.device == buf.device
                and v.shape == buf.shape
                and v.dtype == buf.dtype
            ):
                held.feeds[k] = v
                held.feed_calls.append(plan.transfer.bind_copy(v, buf, seg.stream))
        for i, mode in enumerate(fetch or ()):
            if mode is None or runner._output_streams[i] != seg.ep_key:
                continue
            if mode is FETCH_HOST:
                st = frame.out_stage[i] if frame.out_stage else None
                if st is not None:
                    held.outputs[i] = (None, st[0])
            elif isinstance(mode, DeviceTensor) and mode.ready is None:
                held.outputs[i] = (mode, mode)
        return held

    def _hold_output_copies(self, held: _HeldCopies, seg: _Segment, frame: Frame) -> None:
        """Queue, on the capturing stream, the copy of each output the graph holds: from the
        value the captured steps left (the same object every replay) into its target."""
        plan = self.runner.plan
        for i, (bound, target) in list(held.outputs.items()):
            v = frame.values[plan.output_slots[i]]
            ok = (
                isinstance(v, DeviceTensor)
                and plan.output_slots[i] in seg.export_slots
                and v.shape == target.shape
                and v.dtype == target.dtype
                and (bound is None or v.device == bound.device)
            )
            if not ok:
                del held.outputs[i]  # the host copies it, as without a graph
                continue
            plan.transfer.bind_copy(v, target, seg.stream)()

    def _capture_segment(
        self,
        ctx: _Context,
        seg: _Segment,
        frame: Frame,
        where: list[Any],
        run_options: Any,
        held: _HeldCopies | None = None,
    ) -> None:
        values = frame.values
        steps = frame.steps[seg.start : seg.end]
        saved = [(s, values[s]) for s in seg.import_slots]
        caches = list(frame.scratch.values())
        ep = seg.ep
        try:
            ep.begin_graph_capture(seg.stream)
        except Exception as e:  # a stream that cannot capture: the run goes on without graphs
            self._disable(ctx, f"the capture cannot start: {type(e).__name__}: {e}")
            _run_steps(steps, values, where, run_options)
            return
        for c in caches:
            c.capturing = True
            c.begin_hold()  # the temporaries the graph writes on every replay stay its own
        try:
            if held is not None:
                for copy in held.feed_calls:
                    copy()
            _run_steps(steps, values, where, run_options)
            if held is not None:
                self._hold_output_copies(held, seg, frame)
            gid = next(_ids)
            self._end_holds(ctx, caches)
            ep.end_graph_capture(seg.stream, gid)
        except Exception as e:
            for c, ptrs in self._end_holds(ctx, caches, keep=False):
                c.release_held(ptrs)
            try:
                ep.abort_graph_capture(seg.stream)
            except Exception:
                pass
            info = step_info(where[0])
            at = f" at {info.op_type} node '{info.name}'" if info is not None else ""
            self._disable(ctx, f"capture failed{at}: {type(e).__name__}: {e}")
            # nothing captured ran: run the segment eagerly on the values it started from
            for s, v in saved:
                values[s] = v
            _run_steps(steps, values, where, run_options)
            return
        ctx.res.graphs.append((ep, gid))
        if held is not None:
            ctx.held_feeds = held.feeds
            ctx.held_outputs = {i: bound for i, (bound, _) in held.outputs.items()}
        seg.graph_id = gid
        seg.imports = saved
        seg.exports = [(s, values[s]) for s in seg.export_slots]
        counters.bump(counters.GRAPH_CAPTURES)
        ep.replay_graph(gid)  # the captured work has not run yet
        counters.bump(counters.GRAPH_REPLAYS)

    @staticmethod
    def _end_holds(
        ctx: _Context, caches: list[Any], keep: bool = True
    ) -> list[tuple[Any, list[int]]]:
        out = []
        for c in caches:
            c.capturing = False
            out.append((c, c.end_hold()))
        if keep:
            ctx.res.held.extend(out)
        return out

    def _disable(self, ctx: _Context, reason: str) -> None:
        ctx.state = _Context.DISABLED
        ctx.reason = reason
        warnings.warn(
            f"graph capture abandoned for signature {list(ctx.sig_key)} (gpu_graph_id "
            f"{ctx.annotation}): {reason}; these runs continue without a graph",
            RuntimeWarning,
            stacklevel=2,
        )

    def _replay(
        self, ctx: _Context, feeds: list[Any], run_options: Any, fetch: Sequence[Any] | None
    ) -> list[Any]:
        body = ctx.replay_body
        if body is None:
            body = ctx.replay_body = self._replay_body(ctx)
        return self.runner._execute(
            ctx.frame, feeds, run_options, None, fetch, body, True, ctx.export_slots
        )

    def _replay_body(self, ctx: _Context) -> Any:
        program = ctx.program

        def body(frame: Frame, run_options: Any, where: list[Any]) -> None:
            values = frame.values
            for item in program:
                if type(item) is _Segment:
                    for s, o in item.imports:
                        if values[s] is not o:
                            # a value the graph reads is not where it was captured: run
                            # this segment eagerly
                            steps = frame.steps[item.start : item.end]
                            _run_steps(steps, values, where, run_options)
                            break
                    else:
                        item.ep.replay_graph(item.graph_id)
                        counters.bump(counters.GRAPH_REPLAYS)
                        for s, o in item.exports:
                            values[s] = o
                else:
                    _run_steps((frame.steps[item],), values, where, run_options)

        return body


class _HeldCopies:
    """What a capture puts in the graph besides the steps (see ``_copies_to_hold``)."""

    __slots__ = ("feed_calls", "feeds", "outputs")

    def __init__(self) -> None:
        self.feeds: dict[int, Any] = {}  # feed index -> the bound value (None: staging)
        self.feed_calls: list[Any] = []
        # output index -> (the bound value or None for staging, the copy's target)
        self.outputs: dict[int, tuple[Any, Any]] = {}


class _Binding:
    """A captured context's replay for one way of calling it, bound once: which feeds are
    arrays (and how each is staged) and which are device values (the same objects every
    run), the copies the graph does not hold, the launches, and what each fetched output
    becomes. ``of`` returns None where the general path is needed."""

    __slots__ = (
        "after",
        "checks",
        "fetch",
        "frame",
        "launches",
        "n_launches",
        "outs",
        "post",
        "pre",
        "staged",
    )

    def __init__(self, frame: Frame, fetch: Sequence[Any]) -> None:
        self.frame = frame
        self.fetch = fetch
        self.checks: list[tuple[int, Any]] = []  # (feed index, its value, or None: an array)
        self.staged: list[tuple[int, Any]] = []  # (feed index, call staging the array)
        self.pre: list[Any] = []  # copies before the launches
        self.launches: list[tuple[Any, int]] = []  # (ep, graph id)
        self.n_launches = 0
        self.post: list[Any] = []  # copies after them
        self.outs: list[Any] = []  # what the run returns, before ``after``
        self.after: list[tuple[int, Any]] = []  # (output index, its value after the sync)

    @staticmethod
    def of(ctx: _Context, feeds: list[Any], fetch: Sequence[Any] | None) -> _Binding | None:
        program = ctx.program
        if fetch is None or not program or any(type(p) is not _Segment for p in program):
            return None
        runner = ctx.res.runner
        plan = runner.plan
        frame = ctx.frame
        transfer = plan.transfer
        b = _Binding(frame, fetch)
        for k, v in enumerate(feeds):
            buf = frame.feed_bufs[k] if frame.feed_bufs else None
            if buf is None:
                return None
            key = runner._feed_streams[k]
            stream = frame.streams.get(key) if key is not None else None
            held = k in ctx.held_feeds
            if isinstance(v, np.ndarray):
                b.checks.append((k, None))
                stage = frame.in_stage[k]
                if stage is None:
                    b.staged.append((k, _copier(transfer, buf, stream)))
                elif held:
                    b.staged.append((k, _stager(stage[1], None)))
                else:
                    b.staged.append(
                        (k, _stager(stage[1], transfer.bind_copy(stage[0], buf, stream)))
                    )
            elif isinstance(v, DeviceTensor):
                if v.ready is not None or v.device != buf.device or v.shape != buf.shape:
                    return None
                b.checks.append((k, v))
                if not held and v is not buf:
                    b.pre.append(transfer.bind_copy(v, buf, stream))
            else:
                return None
        for seg in program:
            b.launches.append((seg.ep, seg.graph_id))
        b.n_launches = len(b.launches)
        exported = {s: o for seg in program for s, o in seg.exports}
        b.outs = [None] * len(fetch)
        for i, mode in enumerate(fetch):
            if mode is None:
                continue
            v = exported.get(plan.output_slots[i])
            if not isinstance(v, DeviceTensor):
                return None
            key = runner._output_streams[i]
            stream = frame.streams.get(key) if key is not None else None
            held = i in ctx.held_outputs
            if mode is FETCH_HOST:
                st = frame.out_stage[i] if frame.out_stage else None
                if st is not None and st[0].shape == v.shape and st[0].dtype == v.dtype:
                    if not held:
                        b.post.append(transfer.bind_copy(v, st[0], stream))
                    b.after.append((i, st[1].copy))
                else:
                    b.after.append((i, lambda v=v: _to_host(v, plan)))
            elif isinstance(mode, DeviceTensor):
                if mode.ready is not None or (mode.shape, mode.dtype) != (v.shape, v.dtype):
                    return None  # the general path says what is wrong
                if not held:
                    b.post.append(transfer.bind_copy(v, mode, stream))
                b.outs[i] = mode
            else:
                return None  # a new device value, or a host array to copy into
        return b

    def matches(self, feeds: list[Any], fetch: Sequence[Any] | None) -> bool:
        """Whether this call feeds and fetches as the one it was bound for."""
        if fetch is not self.fetch:
            if fetch is None:
                return False
            for a, b in zip(fetch, self.fetch):
                if a is not b:
                    return False
        for k, want in self.checks:
            if want is None:
                if not isinstance(feeds[k], np.ndarray):
                    return False
            elif feeds[k] is not want:
                return False
        return True

    def run(self, feeds: list[Any]) -> list[Any]:
        failed = True
        try:
            for k, stage in self.staged:
                stage(feeds[k])
            for copy in self.pre:
                copy()
            for ep, gid in self.launches:
                ep.replay_graph(gid)
            counters.bump(counters.GRAPH_REPLAYS, self.n_launches)
            for copy in self.post:
                copy()
            failed = False
        except Exception as e:
            raise_run_error(None, e)
        finally:
            _end_run(self.frame, failed)
        outs = list(self.outs)
        for i, done in self.after:
            outs[i] = done()
        return outs


def _stager(host: np.ndarray, copy: Any) -> Any:
    """Stage an array: into the pinned buffer, then (unless the graph holds it) the copy."""
    if copy is None:
        return lambda v: np.copyto(host, v)

    def stage(v: np.ndarray) -> None:
        np.copyto(host, v)
        copy()

    return stage


def _copier(transfer: Any, buf: DeviceTensor, stream: Any) -> Any:
    """Copy an array straight into the feed buffer (no pinned staging for its device)."""

    def copy(v: np.ndarray) -> None:
        transfer.copy(v if v.flags.c_contiguous else np.ascontiguousarray(v), buf, stream)

    return copy


__all__ = ["GRAPH_ID_KEY", "SKIP_CAPTURE", "GraphCapture", "annotation_id"]
