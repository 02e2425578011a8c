"""The base class of CUDA kernels: array views of inputs and outputs on the provider's stream.

A kernel computes with ``self.xp`` (CuPy on the GPU, numpy under the host simulation used
by CI) on views of the provider's memory: ``self.arg(ctx, i)`` is input ``i`` as an array,
``self.alloc(ctx, i, shape, dtype)`` allocates output ``i`` through the provider (static
memory plan, stream-ordered) and returns it as an array to fill, ``self.put(ctx, i, arr)``
publishes an array the kernel computed as output ``i``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from onnxplug.ep import (
    DeviceTensor,
    Kernel,
    KernelContext,
    KernelInfo,
    bound_launcher,
    current_scratch,
    dtypes,
)

from ..compiler import precompile
from ..launch import _NOOP, ShapeOnly, bound_calls, dry_compiles, function_launch

FLOATS = dtypes("float32", "float16", "float64")
SIGNED_INTS = dtypes("int8", "int16", "int32", "int64")
UNSIGNED_INTS = dtypes("uint8", "uint16", "uint32", "uint64")
INTS = SIGNED_INTS + UNSIGNED_INTS
NUMERIC = FLOATS + INTS
ALL_FIXED = NUMERIC + dtypes("bool")


def _bf16() -> tuple[np.dtype, ...]:
    try:
        import ml_dtypes

        return (np.dtype(ml_dtypes.bfloat16),)
    except ImportError:
        return ()


BF16 = _bf16()
FLOATS_BF16 = FLOATS + BF16
ALL_FIXED_BF16 = ALL_FIXED + BF16


# op type -> why a node of it ran unprepared (the first reason seen): a diagnostic of the
# fast path (benchmarks/profile_host.py prints it)
UNPREPARED: dict[str, str] = {}


class CudaKernel(Kernel):
    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Every ``compute`` first makes the call's stream CuPy's current stream (and the one
        CuPy allocates on): a kernel may launch or allocate before touching any input, and
        the stream current before it may be a finished subgraph's, already destroyed."""
        super().__init_subclass__(**kwargs)
        fn = cls.__dict__.get("compute")
        if fn is None or getattr(fn, "_activates", False):
            return

        def compute(self: CudaKernel, ctx: KernelContext, _fn: Any = fn) -> None:
            self.be.activate(ctx.stream)
            _fn(self, ctx)

        compute._activates = True  # type: ignore[attr-defined]
        compute.__doc__ = fn.__doc__
        cls.compute = compute  # type: ignore[method-assign]

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.ep = info.ep
        self.be = info.ep.backend
        self.xp = self.be.xp

    @classmethod
    def claims(cls, node: Any, graph: Any) -> bool:
        """Whether this kernel computes ``node`` as written. The registry matched its opset
        and types already; a kernel that implements only some attribute values (or needs a
        constant input, ``graph.graph.initializers``) returns False for the others, and the
        node goes to the next provider."""
        return True

    # warm-up -------------------------------------------------------------------------------
    def precompile(
        self,
        name: str,
        source: Callable[[], str],
        functions: dict[tuple, Any] | None = None,
        key: tuple | None = None,
    ) -> None:
        """For ``warm_up``: start compiling, in the background, kernel ``name`` of
        ``source()`` for this provider's device, as ``compiled_function(xp, name, source,
        functions, key + (device,))`` will ask for it (``key`` None: the default cache)."""
        if self.xp is np:
            return
        device = self.ep.ordinal
        precompile(
            self.xp, device, name, source, functions, None if key is None else (*key, device)
        )

    def dry_prepare(self) -> None:
        """For ``warm_up``: where the graph's types fix every input's shape and type, bind the
        prepared form over ``ShapeOnly`` stand-ins, each elementwise kernel it would compile
        queued in the background instead (``launch.dry_compiles``): the first run then finds
        them compiled. A guess: an input that arrives strided or misaligned binds another
        variant, which the run compiles."""
        if self.xp is np:
            return
        info = self.info
        ins: list[Any] = []
        for i in range(info.input_count):
            if not info.has_input(i):
                ins.append(None)
                continue
            shape, dt = info.input_shape(i), info.input_dtype(i)
            if shape is None or dt is None or not all(type(d) is int for d in shape):
                return
            ins.append(ShapeOnly(shape, dt))  # type: ignore[arg-type]
        with dry_compiles(self):
            self.prepare(_DryContext(ins))  # type: ignore[arg-type]

    # the prepare phase -----------------------------------------------------------------------
    def prepare(self, ctx: KernelContext) -> Callable[[], None] | None:
        """What a kernel with a prepared form implements: allocate the outputs (``alloc``)
        and return a call that computes them from the inputs, with every launch parameter
        bound (``launch.Launch``, ``Elementwise.bind``, ``LtGemm.prepare``; numpy closures
        under the simulation). None: this node has no prepared form (``compute`` runs)."""
        return None

    def bind(self, ctx: KernelContext) -> Callable[[KernelContext], None] | None:
        """The frame's first run: prepare, run what was prepared, and return the launcher
        for the later runs (it checks that the inputs are the tensors it was bound to)."""
        run = self._prepared(ctx)
        if run is None:
            self.compute(ctx)
            return None
        if not isinstance(run, NodeGraph) and run is not _NOOP:
            # the node's calls as one CUDA graph: a graph launch costs a third of a kernel
            # launch from Python, and a node of several launches becomes one
            run = node_graph(self, ctx, run) or run
        run()
        launcher = self._launcher(ctx, run)
        if launcher is None:
            UNPREPARED.setdefault(self.info.op_type, "an input or output is not a planned tensor")
        return launcher

    def _prepared(self, ctx: KernelContext) -> Callable[[], None] | None:
        """``prepare``'s call for this run, or None where this node has no prepared form for
        it (the reason is noted in ``UNPREPARED``; ``compute`` then runs, and stays correct)."""
        if type(self).prepare is CudaKernel.prepare:
            return None
        op = self.info.op_type
        self.be.activate(ctx.stream)
        try:
            run = self.prepare(ctx)
        except Exception as e:
            UNPREPARED.setdefault(op, f"{type(e).__name__}: {e}")
            return None
        if run is None:
            UNPREPARED.setdefault(op, "no prepared form for these operands")
        return run

    #: True where ``compute`` runs kernels CuPy generates (ufuncs, ``take``, ``copyto``,
    #: ``ElementwiseKernel``) and the prepared form launches ours: a signature's first run
    #: then runs the prepared form (``compute_first``).
    first_run_prepared = False

    def compute_first(self, ctx: KernelContext) -> None:
        """A signature's first run: with ``first_run_prepared``, the prepared form, run once
        (no launcher, no node graph). Through ``compute`` a fresh process compiled CuPy's
        kernels for the first run and ours for the second (BERT-base: 13 NVRTC compiles in
        its first run, 6 more in its second). Kernels whose ``compute`` runs the same device
        code as their prepared form (cuDNN, cuBLASLt, the row kernels) keep ``compute``: their
        prepared form, built again on the frame's first run, cost a warm process's first run
        15-75 ms more (H100, medians of 4 processes)."""
        run = None
        if self.first_run_prepared:
            stack = ctx._workspace
            if stack is not None:
                stack.reset()  # as a frame's first run does (``executor._binder``)
            run = self._prepared(ctx)
        if run is None:
            self.compute(ctx)
        else:
            run()

    def stream_handle(self, ctx: KernelContext) -> int:
        s = ctx.stream
        return int(s.handle) if s is not None else 0

    def _launcher(
        self, ctx: KernelContext, run: Callable[[], None]
    ) -> Callable[[KernelContext], None] | None:
        values = ctx.values
        for s in (*ctx.in_slots, *ctx.out_slots):
            v = values[s] if s >= 0 else None
            if isinstance(v, DeviceTensor) and v.stable_view is None:
                return None  # memory that changes from run to run: nothing to bind to
        graph_of = None
        if isinstance(run, NodeGraph) or run is _NOOP:
            # capturable with its neighbours as one graph (executor.segment_program)
            def graph_of(work: Callable[[], None]) -> Any:
                return node_graph(self, ctx, work, whole=True)

        return bound_launcher(ctx, run, self.compute, graph_of)

    def arg(self, ctx: KernelContext, i: int) -> Any:
        """Input ``i`` as an array (None when an optional input is absent)."""
        t = ctx.input(i)
        if t is None:
            return None
        if isinstance(t, DeviceTensor):
            self.be.activate(ctx.stream)
            return self.be.view(t)
        return t  # a host input declared CPU_INPUT: a numpy array

    def alloc(self, ctx: KernelContext, i: int, shape: Any, dtype: Any) -> Any:
        """Allocate output ``i`` and return it as an array for the kernel to fill."""
        t = ctx.output(i, shape, dtype)
        if isinstance(t, DeviceTensor):
            self.be.activate(ctx.stream)
            return self.be.view(t)
        return t

    def put(self, ctx: KernelContext, i: int, arr: Any, dtype: Any = None) -> None:
        """Publish an array computed by the kernel as output ``i`` (no copy when it is dense)."""
        if isinstance(arr, np.ndarray) and self.xp is not np:
            ctx.set_output(i, arr)  # a host output (CPU_OUTPUT)
            return
        ctx.set_output(i, self.be.wrap(arr, dtype))


class _DryContext:
    """The kernel context of a dry prepare (``CudaKernel.dry_prepare``): stand-in inputs,
    stand-in outputs, no stream, no memory."""

    stream = None
    _workspace = None

    def __init__(self, inputs: list[Any]):
        self._inputs = inputs

    def input(self, index: int) -> Any:
        return self._inputs[index] if index < len(self._inputs) else None

    def output(self, index: int, shape: Any, dtype: Any = None) -> Any:
        return ShapeOnly(shape, dtype)


class CallListKernel(CudaKernel):
    """A kernel whose work is a list of calls made by ``calls(ctx, stream)``: ``compute`` runs
    them in order (``stream`` None: CuPy's calls on the current stream); ``prepare`` binds them
    (``stream``: the raw handle launches are packed for; temporaries from the frame's
    workspace). The helpers below make either form of a call."""

    def calls(self, ctx: KernelContext, stream: int | None) -> list[Any]:
        raise NotImplementedError

    def compute(self, ctx: KernelContext) -> None:
        for call in self.calls(ctx, None):
            call()

    def prepare(self, ctx: KernelContext) -> Callable[[], None] | None:
        calls = self.calls(ctx, self.stream_handle(ctx))
        if any(c is None for c in calls):
            return None  # a call without a prepared form: compute runs instead
        return bound_calls(calls)

    def buffer(self, ctx: KernelContext, shape: tuple, dtype: Any, stream: int | None) -> Any:
        """A temporary array: the frame's workspace for a prepared call, else CuPy's memory
        (the provider's, through its allocator hook)."""
        if stream is None:
            return self.xp.empty(shape, dtype)
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        return self.be.array_at(ctx.workspace(nbytes), shape, dtype, ctx)

    def elementwise(self, kernel: Any, args: tuple, stream: int | None) -> Any:
        """An ``_fused.Elementwise`` call over ``args`` (inputs, then outputs)."""
        if stream is None:
            return lambda: kernel(self.xp, *args)
        return kernel.bind(self.xp, *args, stream=stream)

    def module_call(
        self, module: Any, name: str, grid: tuple, block: tuple, args: tuple, stream: Any, twin: Any
    ) -> Any:
        """A call of function ``name`` of a row module (``_fused.row_module``); ``twin(*args)``
        under the simulation. None among ``args`` is a null pointer."""
        xp = self.xp
        if xp is np:
            return lambda: twin(*args)
        fn = module.function(xp, name)
        if stream is None:
            null = tuple(np.uint64(0) if a is None else a for a in args)
            return lambda: fn(grid, block, null)
        return function_launch(fn, grid, block, args, stream)


def node_graph(
    kernel: CudaKernel, ctx: KernelContext, work: Callable[[], None], whole: bool = False
) -> Any:
    """``work`` (one node's work on its stream, whose pointers stay fixed) captured once as a
    CUDA graph: a ``NodeGraph`` to call instead; None where it cannot be (the host simulation,
    a stream that captures a whole run already, work that refuses capture). ``whole``: the
    work of several nodes (a segment of an eager run), launched without the interpreter lock
    (``CupyBackend.launch_graph``)."""
    stream = ctx.stream
    if kernel.xp is np or stream is None or not hasattr(stream, "capture_call"):
        return None
    if stream.capturing:
        return None
    scratch = current_scratch(kernel.ep.device)
    if scratch is not None:
        scratch.begin_hold()  # temporaries the graph writes stay its own
    exe = stream.capture_call(work)
    held = scratch.end_hold() if scratch is not None else []
    if exe is None:
        if scratch is not None:
            scratch.release_held(held)
        return None
    be = kernel.be
    return NodeGraph(
        exe, stream, be.launch_graph if whole else be.launch_node_graph, work, scratch, held
    )


class NodeGraph:
    """One node's work as a CUDA graph launched on its stream (run as plain calls instead while
    the stream captures a whole run: the calls are recorded into that graph)."""

    __slots__ = ("eager", "exe", "held", "launch", "scratch", "stream")

    def __init__(
        self, exe: Any, stream: Any, launch: Any, eager: Any, scratch: Any, held: list[int]
    ):
        self.exe = exe
        self.stream = stream
        self.launch = launch
        self.eager = eager
        self.scratch = scratch  # the frame's, whose value blocks in ``held`` the graph uses
        self.held = held

    def __call__(self) -> None:
        stream = self.stream
        if stream.capturing:
            self.eager()
            return
        err = self.launch(self.exe, stream.handle)
        if err:
            from ..runtime import CudaError

            raise CudaError(f"launching a node's CUDA graph failed: {err}")

    def __del__(self) -> None:
        try:
            from ..runtime import cudart

            cudart().graphExecDestroy(self.exe)
            if self.scratch is not None:
                self.scratch.release_held(self.held)
        except Exception:
            pass
