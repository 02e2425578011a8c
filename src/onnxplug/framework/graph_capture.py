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
"""

from __future__ import annotations

import itertools
import threading
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from ..errors import InvalidArgument
from . import counters
from .executor import Frame, GraphRunner, SignaturePlan, StepSpec, _run_steps, step_info

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
                    return self._replay(ctx, feeds, run_options, fetch)
                if ctx.state == _Context.DISABLED or not ctx.segments:
                    return runner._execute(
                        ctx.frame, feeds, run_options, None, fetch, profiler=profiler
                    )
                for _ in range(MAX_WARMUP_RUNS):
                    if ctx.runs >= self.min_runs and ctx.frame_runs >= 1:
                        return self._capture(ctx, feeds, run_options, fetch)
                    outs = runner._execute(
                        ctx.frame, feeds, run_options, None, fetch, profiler=profiler
                    )
                    ctx.runs += 1
                    ctx.frame_runs += 1
                return outs

    def _capture(
        self, ctx: _Context, feeds: list[Any], run_options: Any, fetch: Sequence[Any] | None
    ) -> list[Any]:
        def body(frame: Frame, run_options: Any, where: list[Any]) -> None:
            values = frame.values
            steps = frame.steps
            for item in ctx.program:
                if isinstance(item, _Segment):
                    if ctx.state == _Context.DISABLED:
                        _run_steps(steps[item.start : item.end], values, where, run_options)
                    else:
                        self._capture_segment(ctx, item, frame, where, run_options)
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

    def _capture_segment(
        self, ctx: _Context, seg: _Segment, frame: Frame, where: list[Any], run_options: Any
    ) -> None:
        values = frame.values
        steps = frame.steps[seg.start : seg.end]
        saved = [(s, values[s]) for s in seg.import_slots]
        caches = list(frame.scratch.values())
        ep = seg.ep
        ep.begin_graph_capture(seg.stream)
        for c in caches:
            c.capturing = True
            c.begin_hold()  # the temporaries the graph writes on every replay stay its own
        try:
            _run_steps(steps, values, where, run_options)
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


__all__ = ["GRAPH_ID_KEY", "SKIP_CAPTURE", "GraphCapture", "annotation_id"]
