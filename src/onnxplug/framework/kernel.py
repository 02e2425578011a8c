"""The kernel API: kernel definitions, kernels, their info and context, and the registry.

A provider registers one class per op (and opset range), like ``onnx.reference`` does::

    @registry.kernel("Relu", since=14)
    class Relu(Kernel):
        def compute(self, ctx):
            x = ctx.input(0)
            ctx.set_output(0, np.maximum(x, 0))

A kernel is created once per node when the session is built (``__init__(info)``: read
attributes, pre-pack constant weights) and ``compute(ctx)`` is called for every run.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx

from ..ir.types import ValueType, np_dtype
from .memory import MemType

# ---------------------------------------------------------------------------------------------
# Kernel definitions and lookup


@dataclass(frozen=True)
class KernelDef:
    """What a kernel implements: op, domain, opset range and the types it accepts.

    ``type_constraints`` maps a schema type parameter ('T', 'T1', ...) or an input index to the
    numpy dtypes the kernel accepts; a missing entry accepts anything. ``shape_only_inputs``
    are inputs the kernel reads only the shape of (Shape, Size): they are never copied.
    """

    op_type: str
    domain: str = ""
    since_version: int = 1
    end_version: int | None = None  # inclusive; None = still current
    type_constraints: Mapping[str | int, tuple[np.dtype, ...]] = field(default_factory=dict)
    input_memory: Mapping[int, MemType] = field(default_factory=dict)
    output_memory: Mapping[int, MemType] = field(default_factory=dict)
    shape_only_inputs: tuple[int, ...] = ()
    provider: str = ""

    def version_matches(self, since_version: int) -> bool:
        if since_version < self.since_version:
            return False
        return self.end_version is None or since_version <= self.end_version

    def input_mem(self, index: int) -> MemType:
        return self.input_memory.get(index, MemType.DEFAULT)

    def output_mem(self, index: int) -> MemType:
        return self.output_memory.get(index, MemType.DEFAULT)

    def version_str(self) -> str:
        end = "" if self.end_version is None else str(self.end_version)
        return f"[{self.since_version}, {end}]"


@functools.lru_cache(maxsize=4096)
def _schema_type_params(op_type: str, domain: str, version: int) -> tuple[list[str], list[str]]:
    """Type parameter of each formal input and output ('' when the schema is unknown)."""
    try:
        s = onnx.defs.get_schema(op_type, version, domain)
    except Exception:
        return [], []
    return [p.type_str for p in s.inputs], [p.type_str for p in s.outputs]


def _param_for(params: list[str], index: int) -> str:
    if not params:
        return ""
    return params[index] if index < len(params) else params[-1]  # variadic tail


def types_match(
    kdef: KernelDef,
    since_version: int,
    input_dtypes: list[np.dtype | None],
    output_dtypes: list[np.dtype | None] | None = None,
) -> bool:
    if not kdef.type_constraints:
        return True
    in_params, out_params = _schema_type_params(kdef.op_type, kdef.domain, since_version)
    for key, allowed in kdef.type_constraints.items():
        candidates: list[np.dtype | None] = []
        if isinstance(key, int):
            if key < len(input_dtypes):
                candidates.append(input_dtypes[key])
        else:
            candidates.extend(
                dt for i, dt in enumerate(input_dtypes) if _param_for(in_params, i) == key
            )
            if output_dtypes:
                candidates.extend(
                    dt for i, dt in enumerate(output_dtypes) if _param_for(out_params, i) == key
                )
        for dt in candidates:
            if dt is not None and dt not in allowed:
                return False
    return True


def dtypes(*names: Any) -> tuple[np.dtype, ...]:
    return tuple(np.dtype(n) for n in names)


class KernelRegistry:
    """The kernels of one provider, looked up by (op, domain), opset version and types."""

    def __init__(self, provider: str = ""):
        self.provider = provider
        self._by_op: dict[tuple[str, str], list[tuple[KernelDef, Callable[..., Kernel]]]] = {}

    def register(self, kdef: KernelDef, factory: Callable[..., Kernel]) -> None:
        self._by_op.setdefault((kdef.domain, kdef.op_type), []).append((kdef, factory))

    def kernel(
        self,
        op_type: str,
        *,
        domain: str = "",
        since: int = 1,
        until: int | None = None,
        types: Mapping[str | int, Iterable[Any]] | None = None,
        input_memory: Mapping[int, MemType] | None = None,
        output_memory: Mapping[int, MemType] | None = None,
        shape_only_inputs: tuple[int, ...] = (),
    ) -> Callable[[type[Kernel]], type[Kernel]]:
        """Class decorator registering a kernel for ``op_type`` over opsets [since, until]."""

        def deco(cls: type[Kernel]) -> type[Kernel]:
            self.register(
                KernelDef(
                    op_type,
                    domain,
                    since,
                    until,
                    {k: tuple(np.dtype(t) for t in v) for k, v in (types or {}).items()},
                    dict(input_memory or {}),
                    dict(output_memory or {}),
                    tuple(shape_only_inputs),
                    self.provider,
                ),
                cls,
            )
            return cls

        return deco

    def lookup(
        self,
        op_type: str,
        domain: str,
        since_version: int,
        input_dtypes: list[np.dtype | None] | None = None,
        output_dtypes: list[np.dtype | None] | None = None,
    ) -> tuple[KernelDef, Callable[..., Kernel]] | None:
        entries = self._by_op.get((domain, op_type))
        if not entries:
            return None
        for kdef, factory in reversed(entries):  # later registrations override earlier ones
            if kdef.version_matches(since_version) and (
                input_dtypes is None
                or types_match(kdef, since_version, input_dtypes, output_dtypes)
            ):
                return kdef, factory
        return None

    def kernel_defs(self) -> list[KernelDef]:
        return [kdef for entries in self._by_op.values() for kdef, _ in entries]

    def has_op(self, op_type: str, domain: str = "") -> bool:
        return (domain, op_type) in self._by_op

    def layers(self) -> list[KernelRegistry]:
        """The plain registries this one answers from, lowest precedence first."""
        return [self]

    def merge(self, other: KernelRegistry) -> None:
        for layer in other.layers():  # in precedence order: later entries win
            for key, entries in layer._by_op.items():
                self._by_op.setdefault(key, []).extend(entries)


class FallbackKernelRegistry(KernelRegistry):
    """Kernels of its own, then, for a query they do not answer, those of a fallback registry
    built on first need. Equivalent to registering the fallback's kernels first (later
    registrations win) without building them before a query needs them: the CPU provider's
    native kernels, then onnx.reference's, whose import costs ~0.4 s that constant folding and
    partitioning rarely need."""

    def __init__(self, provider: str, fallback: Callable[[], KernelRegistry]):
        super().__init__(provider)
        self._make_fallback = fallback
        self._fallback: KernelRegistry | None = None
        self._fallback_lock = threading.Lock()
        self._deferred: list[Callable[[KernelRegistry], None]] = []

    def defer(self, register: Callable[[KernelRegistry], None]) -> None:
        """``register(fallback)`` when the fallback is built, after its own kernels (so
        over them): kernels that need what the fallback imports."""
        with self._fallback_lock:
            if self._fallback is None:
                self._deferred.append(register)
                return
        register(self._fallback)

    def fallback(self) -> KernelRegistry:
        with self._fallback_lock:
            if self._fallback is None:
                reg = self._make_fallback()
                for register in self._deferred:
                    register(reg)
                self._fallback = reg
            return self._fallback

    def lookup(self, *args: Any, **kwargs: Any) -> tuple[KernelDef, Callable[..., Kernel]] | None:
        found = super().lookup(*args, **kwargs)
        return found if found is not None else self.fallback().lookup(*args, **kwargs)

    def kernel_defs(self) -> list[KernelDef]:
        return self.fallback().kernel_defs() + super().kernel_defs()

    def has_op(self, op_type: str, domain: str = "") -> bool:
        return super().has_op(op_type, domain) or self.fallback().has_op(op_type, domain)

    def layers(self) -> list[KernelRegistry]:
        own = KernelRegistry(self.provider)
        own._by_op = self._by_op
        return [*self.fallback().layers(), own]

    def merge(self, other: KernelRegistry) -> None:
        raise TypeError("a registry with a fallback is not merged into (register its kernels)")


class DeferredKernelRegistry(KernelRegistry):
    """A registry built by ``build()`` on its first query, not when a provider hands it out:
    the CPU provider's imports every kernel module (and, for what they do not answer,
    onnx.reference), which a session whose nodes all go to another provider never asks for.
    Every query goes to the built registry."""

    def __init__(self, provider: str, build: Callable[[], KernelRegistry]):
        self.provider = provider
        self._build = build
        self._build_lock = threading.Lock()
        self._built: KernelRegistry | None = None

    def _registry(self) -> KernelRegistry:
        with self._build_lock:
            if self._built is None:
                self._built = self._build()
            return self._built

    @property
    def built(self) -> bool:
        return self._built is not None

    @property
    def _by_op(self) -> dict:  # type: ignore[override]
        return self._registry()._by_op

    def register(self, kdef: KernelDef, factory: Callable[..., Kernel]) -> None:
        self._registry().register(kdef, factory)

    def lookup(self, *args: Any, **kwargs: Any) -> tuple[KernelDef, Callable[..., Kernel]] | None:
        return self._registry().lookup(*args, **kwargs)

    def kernel_defs(self) -> list[KernelDef]:
        return self._registry().kernel_defs()

    def has_op(self, op_type: str, domain: str = "") -> bool:
        return self._registry().has_op(op_type, domain)

    def layers(self) -> list[KernelRegistry]:
        return self._registry().layers()


# ---------------------------------------------------------------------------------------------
# Kernels


class KernelInfo:
    """What a kernel knows when it is created: its node, attributes, types and provider."""

    def __init__(
        self,
        node: Any,
        kernel_def: KernelDef,
        ep: Any,
        input_types: list[ValueType | None],
        output_types: list[ValueType | None],
        constant_inputs: dict[int, Any],
        subgraph_runners: dict[str, Any] | None = None,
        allocators: Mapping[MemType, Any] | None = None,
    ):
        self.node = node
        self.name: str = node.name
        self.op_type: str = node.op_type
        self.domain: str = node.domain
        self.since_version: int = node.since_version
        self.opset: int = node.opset
        self.attrs: dict[str, Any] = node.attrs
        self.kernel_def = kernel_def
        self.ep = ep
        self.input_types = input_types
        self.output_types = output_types
        self._constants = constant_inputs
        self._subgraphs = subgraph_runners or {}
        self._allocators = dict(allocators or {})

    @property
    def input_count(self) -> int:
        return len(self.node.inputs)

    @property
    def output_count(self) -> int:
        return len(self.node.outputs)

    def attr(self, name: str, default: Any = None) -> Any:
        return self.attrs.get(name, default)

    def has_input(self, index: int) -> bool:
        ins = self.node.inputs
        return index < len(ins) and bool(ins[index])

    def has_output(self, index: int) -> bool:
        outs = self.node.outputs
        return index < len(outs) and bool(outs[index])

    def constant_input(self, index: int) -> Any:
        """The value of input ``index`` when it is a constant (initializer), else None."""
        return self._constants.get(index)

    def input_dtype(self, index: int) -> np.dtype | None:
        t = self.input_types[index] if index < len(self.input_types) else None
        if t is None or t.kind != "tensor" or not t.elem_type:
            return None
        try:
            return np_dtype(t.elem_type)
        except ValueError:
            return None

    def input_shape(self, index: int) -> tuple[int | str | None, ...] | None:
        """Input ``index``'s shape as the graph's types give it (ints for fixed dims, names
        of symbolic ones, None for unknown ones); None when its rank is unknown."""
        c = self._constants.get(index)
        if c is not None and hasattr(c, "shape"):
            return tuple(int(d) for d in c.shape)
        t = self.input_types[index] if index < len(self.input_types) else None
        return None if t is None or t.kind != "tensor" else t.shape

    def output_dtype(self, index: int) -> np.dtype | None:
        t = self.output_types[index] if index < len(self.output_types) else None
        if t is None or t.kind != "tensor" or not t.elem_type:
            return None
        try:
            return np_dtype(t.elem_type)
        except ValueError:
            return None

    def subgraph(self, attr_name: str) -> Any:
        """A runner for a subgraph attribute (If/Loop/Scan): ``runner.run(inputs, outer)``."""
        try:
            return self._subgraphs[attr_name]
        except KeyError:
            raise KeyError(
                f"{self.op_type} node '{self.name}' has no subgraph '{attr_name}'"
            ) from None

    def get_allocator(self, mem_type: MemType = MemType.DEFAULT) -> Any:
        return self._allocators.get(mem_type)


class Kernel:
    """Base class of all kernels. Subclasses implement ``compute``, and may implement
    ``bind`` (the prepare phase) to make a frame's later runs cheaper."""

    #: False when the kernel cannot be captured in a device graph: it synchronises with the
    #: host, reads device data on the host, or launches work whose parameters change per run
    #: in ways the executor cannot see. Such nodes run eagerly between captured segments.
    graph_capturable = True

    def __init__(self, info: KernelInfo):
        self.info = info

    def warm_up(self) -> None:
        """Called once when the session has created the kernel, before any run: start, in the
        background, work that the node's first run would otherwise wait for (compiling device
        code that its info, types and constant inputs tell it will run). It must return at
        once; the session ignores one that raises (a guess that fails: the run that needs the
        work does it, and reports its errors). Nothing by default."""

    def compute(self, ctx: KernelContext) -> None:
        raise NotImplementedError(f"{type(self).__name__}.compute")

    def bind(self, ctx: KernelContext) -> Callable[[KernelContext], None] | None:
        """The prepare phase, called on a frame's first run instead of ``compute``: run the
        node and return the call that runs it on the frame's later runs, with what can be
        fixed bound once (pointers, shapes, launch parameters, descriptors), or None to keep
        calling ``compute``.

        The executor hands out the same tensor objects for a frame's planned values every
        run, so a launcher checks that its inputs are the objects it bound (``is``) and falls
        back to ``compute`` when one is not: ``bound_launcher`` makes one."""
        self.compute(ctx)
        return None

    def compute_first(self, ctx: KernelContext) -> None:
        """A shape signature's first (recording) run of the node, on memory that later runs
        do not reuse: ``compute`` here. A kernel whose prepared form runs other device code
        than ``compute`` may run that form instead, so that a process builds each piece of
        device code once (not ``compute``'s for the first run, then the prepared form's) and
        the first run gives the later runs' results."""
        self.compute(ctx)


def bound_launcher(
    ctx: KernelContext,
    run: Callable[[], None],
    compute: Callable[[KernelContext], None],
    graph_of: Callable[[Callable[[], None]], Any] | None = None,
) -> Callable[[KernelContext], None]:
    """A launcher for ``Kernel.bind`` to return: ``run()`` (the node's work with what it reads
    and writes bound) where the frame's inputs are still the objects they are now, after putting
    the outputs bound now back in the frame; ``compute`` otherwise. With ``graph_of`` (a function
    capturing a call's work on the node's stream as a graph, returning a call that launches it,
    or None) the executor may capture the launcher with its neighbours on that stream as one
    graph (``executor.segment_program``, through the launcher's ``segment``)."""
    values = ctx.values
    ins = tuple((s, values[s]) for s in ctx.in_slots if s >= 0)
    outs = tuple((s, values[s]) for s in ctx.out_slots if s >= 0)
    launcher: Callable[[KernelContext], None]
    if len(ins) == 1 and len(outs) == 1:  # the usual shapes, without the loops
        ((si, ti),) = ins
        ((so, to),) = outs

        def one(c: KernelContext) -> None:
            if values[si] is ti:
                values[so] = to
                run()
            else:
                compute(c)

        launcher = one
    elif len(ins) == 2 and len(outs) == 1:
        (sa, ta), (sb, tb) = ins
        ((so, to),) = outs

        def two(c: KernelContext) -> None:
            if values[sa] is ta and values[sb] is tb:
                values[so] = to
                run()
            else:
                compute(c)

        launcher = two
    else:

        def many(c: KernelContext) -> None:
            for s, t in ins:
                if values[s] is not t:
                    compute(c)
                    return
            for s, t in outs:
                values[s] = t
            run()

        launcher = many
    if graph_of is not None:
        launcher.segment = (ctx.stream, ins, outs, graph_of)  # type: ignore[attr-defined]
    return launcher


class KernelContext:
    """A kernel's view of one run: its inputs, output allocation, scratch and stream.

    One context per node per execution frame is prepared ahead of time; ``compute`` reads
    inputs by index from the frame's value list and writes outputs into it.
    """

    __slots__ = (
        "_implicit",
        "_in",
        "_out",
        "_out_alloc",
        "_scratch",
        "_sync_stream",
        "_workspace",
        "_values",
        "info",
        "run_options",
        "stream",
    )

    def __init__(
        self,
        values: list[Any],
        in_slots: tuple[int, ...],
        out_slots: tuple[int, ...],
        implicit_slots: tuple[int, ...],
        info: KernelInfo,
        out_alloc: tuple[Callable[[tuple[int, ...], Any], Any], ...],
        scratch: Callable[[int], Any] | None,
        stream: Any,
    ):
        self._values = values
        self._in = in_slots
        self._out = out_slots
        self._implicit = implicit_slots
        self.info = info
        self._out_alloc = out_alloc
        self._scratch = scratch
        self._workspace: Any = None  # the frame's workspace stack for this stream (see below)
        self.stream = stream
        # what get_sync_stream() returns: the stream, or None for a provider written against
        # an API without the kernel sync stream (its workspaces are untagged)
        self._sync_stream = stream
        self.run_options: Any = None

    @property
    def values(self) -> list[Any]:
        """The frame's value list (what ``in_slots``/``out_slots`` index)."""
        return self._values

    @property
    def in_slots(self) -> tuple[int, ...]:
        return self._in

    @property
    def out_slots(self) -> tuple[int, ...]:
        return self._out

    # inputs -----------------------------------------------------------------------------
    def input(self, index: int) -> Any:
        """Input ``index``: a numpy array (host), a DeviceTensor, a list (sequence) or None
        when an optional input is absent."""
        slots = self._in
        if index >= len(slots):
            return None
        s = slots[index]
        return None if s < 0 else self._values[s]

    @property
    def inputs(self) -> list[Any]:
        v = self._values
        return [None if s < 0 else v[s] for s in self._in]

    @property
    def input_count(self) -> int:
        return len(self._in)

    @property
    def implicit_inputs(self) -> list[Any]:
        """Outer-scope values read by this node's subgraphs, in ``node.implicit_inputs`` order."""
        v = self._values
        return [v[s] for s in self._implicit]

    # outputs ----------------------------------------------------------------------------
    @property
    def output_count(self) -> int:
        return len(self._out)

    def has_output(self, index: int) -> bool:
        return index < len(self._out) and self._out[index] >= 0

    def output(self, index: int, shape: Iterable[int], dtype: Any = None) -> Any:
        """Allocate output ``index`` with ``shape`` in the memory the kernel def declares
        for it and return it for the kernel to fill."""
        shape = tuple(int(d) for d in shape)
        if dtype is None:
            dtype = self.info.output_dtype(index)
            if dtype is None:
                raise ValueError(
                    f"{self.info.op_type} node '{self.info.name}': output {index} has no known "
                    "dtype; pass dtype= to ctx.output"
                )
        t = self._out_alloc[index](shape, dtype)
        s = self._out[index]
        if s >= 0:
            self._values[s] = t
        return t

    def set_output(self, index: int, value: Any) -> None:
        """Set output ``index`` to an existing value (a host array, a tensor view, a list)."""
        s = self._out[index]
        if s >= 0:
            self._values[s] = value

    # resources --------------------------------------------------------------------------
    def workspace(self, nbytes: int) -> int:
        """Device memory for a prepared call (``Kernel.bind``) to use as scratch each time it
        runs: a slice of a block the frame shares between the prepared calls of its stream
        (their runs never overlap on one stream). Slices taken by one node's ``bind`` never
        overlap; another node's may reuse the same memory. Returns the address."""
        if self._workspace is None:
            raise RuntimeError("this context has no workspace (a host kernel, or no frame)")
        return int(self._workspace.take(nbytes))

    def scratch(self, nbytes: int) -> Any:
        """Temporary device memory for this call (an Allocation tagged with the stream)."""
        if self._scratch is None:
            return np.empty(nbytes, dtype=np.uint8)
        return self._scratch(nbytes)

    def get_sync_stream(self) -> Any:
        """The run's stream this kernel's work is ordered on, for memory bookkeeping
        (onnxruntime's ``KernelContext_GetSyncStream``): the workspaces of ``scratch`` and
        ``workspace`` are tagged with it in a stream-aware arena. None where the provider was
        written against a plugin API without it (< 3), or runs without a stream."""
        return self._sync_stream
