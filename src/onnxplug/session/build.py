"""From a graph and a list of providers to an execution plan.

1. **Partition**: providers in priority order claim nodes with ``get_capability``; the CPU
   provider is last (the fallback). A node nobody claims is expanded into its ONNX function
   body when it has one; otherwise the session cannot be created.
2. **Place**: each value lives where its producer's kernel writes it; each input must be
   where the consumer's kernel def wants it. Mismatches get explicit copy nodes
   (MemcpyFromHost / MemcpyToHost), initializers are copied once, at build time.
3. **Plan**: slots, prepared kernels, release points, cross-stream waits, foldable shape
   computations, subgraph runners for control flow (built recursively).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..ep.api import Ep, GraphView, has_kernel_sync_stream, supports
from ..errors import Fail, InvalidGraph, NotImplemented, OnnxPlugError
from ..framework.control_flow import (
    SubgraphRunner,
    contiguous_copies,
    place,
    place_in_one_block,
)
from ..framework.copy_kernels import MEMCPY_FROM_HOST, MEMCPY_TO_HOST, CopyKernel
from ..framework.executor import (
    NONDETERMINISTIC_OPS,
    SHAPE_SOURCE_OPS,
    ExecutionPlan,
    GraphRunner,
    StepSpec,
)
from ..framework.kernel import KernelDef, KernelInfo
from ..framework.memory import CPU, Device, DeviceTensor, MemType
from ..framework.stream import DataTransferManager
from ..ir.graph import Graph, Node, tensor_dtype
from ..optimizer.functions import expand

_MAX_EXPANSION_DEPTH = 8
_COPY_DEF = KernelDef(MEMCPY_FROM_HOST)
# Ops whose output shapes follow from the *values* of these inputs: the shapes are fixed by
# the input-shape signature only when those inputs are constants or folded shape values.
_VALUE_SHAPED_INPUTS: dict[str, tuple[int, ...]] = {
    "Reshape": (1,),
    "Expand": (1,),
    "Tile": (1,),
    "Slice": (1, 2, 3, 4),
    "Range": (0, 1, 2),
    "ConstantOfShape": (0,),
    "OneHot": (1,),
    "TopK": (1,),
    "Resize": (1, 2, 3),
    "Upsample": (1,),
    "Pad": (1, 3),
    "Squeeze": (1,),
    "Unsqueeze": (1,),
    "Split": (1,),
    "CenterCropPad": (1,),
    "MaxUnpool": (2,),
    "Col2Im": (1, 2),
    "AffineGrid": (1,),
    "DFT": (1, 2),
    "STFT": (1, 2, 3),
    "MelWeightMatrix": (0, 1, 2),
    "HannWindow": (0,),
    "HammingWindow": (0,),
    "BlackmanWindow": (0,),
    **{
        f"Reduce{r}": (1,)
        for r in ("Sum", "Mean", "Max", "Min", "Prod", "L1", "L2", "LogSum", "LogSumExp")
    },
    "ReduceSumSquare": (1,),
}
# Ops whose output shapes depend on input data or on control flow: never fixed by the signature
# (onnxruntime's data-dependent ops; their dependants fall back to dynamic shapes).
_DATA_SHAPED_OPS = frozenset(
    {
        "NonZero",
        "Unique",
        "NonMaxSuppression",
        "Compress",
        "StringSplit",
        "StringNormalizer",
        "ImageDecoder",
        "If",
        "Loop",
        "Scan",
        "Optional",
        "OptionalGetElement",
        "SplitToSequence",
        "SequenceAt",
        "SequenceConstruct",
        "SequenceEmpty",
        "SequenceErase",
        "SequenceInsert",
        "SequenceMap",
        "ConcatFromSequence",
    }
)


@dataclass
class Assignment:
    ep: Ep
    kdef: KernelDef
    factory: Any


@dataclass
class BuildContext:
    eps: list[Ep]  # priority order; CPU last when fallback is on
    transfer: DataTransferManager
    allocator_for: Any  # (ep, device) -> Allocator
    by_name: dict[str, Ep] = field(default_factory=dict)
    # (graph, node, op, ep, domain) of every step, copy nodes included
    records: list[tuple[str, str, str, str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.by_name = {ep.name: ep for ep in self.eps}


def _lookup(ep: Ep, graph: Graph, node: Node) -> tuple[KernelDef, Any] | None:
    reg = ep.get_kernel_registry()
    ins = [tensor_dtype(graph, i) if i else None for i in node.inputs]
    outs = [tensor_dtype(graph, o) if o else None for o in node.outputs]
    return reg.lookup(node.op_type, node.domain, node.since_version, ins, outs)


class FusionTarget:
    """One provider as the optimizer's fusions and layout pass see it
    (``optimizer.fusions.ProviderPolicy``, ``optimizer.layout``): which ops its registry has,
    whether it would run a node the optimizer is about to make (what partitioning asks: its
    ``get_capability`` claims the node and a kernel matches the node's types), and the data
    layout it prefers, op by op."""

    def __init__(self, ep: Ep):
        self.ep = ep
        self.registry = ep.get_kernel_registry()

    def has_op(self, op_type: str, domain: str = "") -> bool:
        return bool(self.registry.has_op(op_type, domain))

    def takes(self, node: Node, graph: Graph) -> bool:
        claimed = self.ep.get_capability(GraphView(graph, [node], self.registry))
        return any(n is node for n in claimed) and _lookup(self.ep, graph, node) is not None

    def get_preferred_data_layout(self) -> str:
        return str(self.ep.get_preferred_data_layout())

    def should_convert_data_layout_for_op(
        self, domain: str, op_type: str, target_layout: str
    ) -> int:
        return int(self.ep.should_convert_data_layout_for_op(domain, op_type, target_layout))


def partition(graph: Graph, ctx: BuildContext) -> dict[int, Assignment]:
    """Assign every node of ``graph`` (not its subgraphs) to a provider."""
    assignment: dict[int, Assignment] = {}
    pending = [n for n in graph.nodes]
    for depth in range(_MAX_EXPANSION_DEPTH + 1):
        for ep in ctx.eps:
            if not pending:
                break
            view = GraphView(graph, pending, ep.get_kernel_registry())
            claimed = {id(n) for n in ep.get_capability(view)}
            still = []
            for n in pending:
                hit = _lookup(ep, graph, n) if id(n) in claimed else None
                if hit is not None:
                    n.ep = ep.name
                    assignment[id(n)] = Assignment(ep, hit[0], hit[1])
                else:
                    still.append(n)
            pending = still
        if not pending:
            break
        expanded_any = False
        new_pending: list[Node] = []
        for n in pending:
            body = expand(n, graph) if depth < _MAX_EXPANSION_DEPTH else None
            if body is None:
                new_pending.append(n)
                continue
            idx = graph.nodes.index(n)
            graph.nodes[idx : idx + 1] = body
            new_pending.extend(body)
            expanded_any = True
        pending = new_pending
        if not expanded_any:
            break
    if pending:
        n = pending[0]
        names = ", ".join(ep.name for ep in ctx.eps)
        raise NotImplemented(  # noqa: F901 (onnxplug.errors.NotImplemented, a NotImplementedError)
            f"Could not find an implementation for {n.op_type}({n.since_version}) node with name "
            f"'{n.name}' (domain '{n.domain or 'ai.onnx'}', input types "
            f"{[str(tensor_dtype(graph, i)) if i else '-' for i in n.inputs]}) in any of the "
            f"session's providers: {names}"
        )
    graph.toposort()
    return assignment


def _out_device(a: Assignment, j: int) -> Device:
    dev = a.ep.device
    if dev.is_cpu or a.kdef.output_mem(j) == MemType.CPU_OUTPUT:
        return CPU
    return dev


def _in_device(a: Assignment, i: int) -> Device | None:
    if i in a.kdef.shape_only_inputs:
        return None
    dev = a.ep.device
    if dev.is_cpu or a.kdef.input_mem(i) == MemType.CPU_INPUT:
        return CPU
    return dev


def _ep_for_device(ctx: BuildContext, device: Device) -> Ep:
    for ep in ctx.eps:
        if ep.device == device:
            return ep
    raise Fail(f"no provider of this session owns device {device}")


def build_runner(
    graph: Graph,
    ctx: BuildContext,
    implicit_names: list[str] | None = None,
    output_devices: list[Device] | None = None,
) -> tuple[GraphRunner, list[Device | None]]:
    """Partition, place and plan ``graph``; returns the runner and where each feed must be.

    Feeds are the graph's inputs (minus initializers) followed by ``implicit_names`` (values a
    subgraph reads from enclosing scopes).
    """
    assignment = partition(graph, ctx)
    feed_names = [vi.name for vi in graph.inputs if vi.name not in graph.initializers]
    feed_names += [n for n in (implicit_names or []) if n not in feed_names]

    # where each input is wanted -------------------------------------------------------------
    wanted: dict[str, set[Device]] = {}
    for n in graph.nodes:
        a = assignment[id(n)]
        for i, name in enumerate(n.inputs):
            if name:
                d = _in_device(a, i)
                if d is not None:
                    wanted.setdefault(name, set()).add(d)
    feed_devices: list[Device | None] = []
    for name in feed_names:
        devs = wanted.get(name, set())
        feed_devices.append(next(iter(devs)) if len(devs) == 1 else (CPU if devs else None))

    location: dict[str, Device | None] = dict(zip(feed_names, feed_devices))
    for n in graph.nodes:
        a = assignment[id(n)]
        for j, o in enumerate(n.outputs):
            if o:
                location[o] = _out_device(a, j)

    # copies -----------------------------------------------------------------------------------
    slot_of: dict[str, int] = {}
    slot_names: list[str] = []

    def slot(name: str) -> int:
        s = slot_of.get(name)
        if s is None:
            s = slot_of[name] = len(slot_names)
            slot_names.append(name)
        return s

    for name in feed_names:
        slot(name)
    constants: dict[int, Any] = {}
    to_place: dict[Device, list[tuple[int, np.ndarray]]] = {}  # initializers for a device
    copies: dict[tuple[str, Device], str] = {}
    steps_nodes: list[tuple[Node, Assignment | None, list[str]]] = []
    counter = itertools.count()

    def value_on(name: str, dev: Device) -> str:
        """Name of ``name``'s value on ``dev``, adding copies if needed (device to device goes
        through the host)."""
        src = location.get(name)
        if (
            name not in graph.initializers
            and src is not None
            and not src.is_cpu
            and not dev.is_cpu
            and src != dev
            and (name, dev) not in copies
        ):
            via = copy_to(name, CPU)
            return copy_to(via, dev) if via != name else via
        return copy_to(name, dev)

    # (not recursive: a closure calling itself is a reference cycle, which would keep the
    # initializers' device copies alive until the garbage collector runs)
    def copy_to(name: str, dev: Device) -> str:
        """Name of ``name``'s value on ``dev``, adding one copy (host <-> device) if needed."""
        if name in graph.initializers:
            key = (name, dev)
            if key not in copies:
                cname = name if dev.is_cpu else f"{name}@{dev}"
                copies[key] = cname
                value = graph.initializers[name]
                if not dev.is_cpu and isinstance(value, np.ndarray) and value.dtype != object:
                    # placed with the device's other initializers, in one block, below
                    to_place.setdefault(dev, []).append((slot(cname), value))
                    return cname
                value = place(value, dev, ctx.transfer, _allocators(ctx, dev), reserve=True)
                if isinstance(value, DeviceTensor):
                    value.stable_view = {}  # the same tensor every run: views are kept
                constants[slot(cname)] = value
            return copies[key]
        src = location.get(name)
        if src is None or src == dev:
            return name
        key = (name, dev)
        if key in copies:
            return copies[key]
        cname = f"{name}@{dev}"
        op = MEMCPY_FROM_HOST if src.is_cpu else MEMCPY_TO_HOST
        owner = _ep_for_device(ctx, dev if src.is_cpu else src)
        cnode = Node(
            name=f"{op}_{next(counter)}_{name}",
            op_type=op,
            domain="",
            inputs=[name],
            outputs=[cname],
            attrs={},
            since_version=1,
            opset=1,
        )
        cnode.ep = owner.name
        location[cname] = dev
        steps_nodes.append((cnode, None, [name]))
        copies[key] = cname
        return cname

    for n in graph.nodes:
        a = assignment[id(n)]
        actual: list[str] = []
        for i, name in enumerate(n.inputs):
            if not name:
                actual.append("")
                continue
            want = _in_device(a, i)
            if want is None:
                if name in graph.initializers:
                    actual.append(value_on(name, CPU))
                else:
                    actual.append(name)
                continue
            actual.append(value_on(name, want))
        steps_nodes.append((n, a, actual))

    # graph outputs that are initializers or feeds
    for vi in graph.outputs:
        if vi.name in graph.initializers:
            value_on(vi.name, CPU)
            slot_of.setdefault(vi.name, slot_of[copies[(vi.name, CPU)]])
    # slots of the initializers placed on a device below, after the kernels are made; those
    # that are views (weights repacked for NHWC) are copied out meanwhile
    placed_slots = {s for items in to_place.values() for s, _ in items}
    contiguous = {dev: contiguous_copies([v for _, v in items]) for dev, items in to_place.items()}

    # steps ------------------------------------------------------------------------------------
    specs: list[StepSpec] = []
    producer_step: dict[int, int] = {}
    static: set[int] = set(constants) | placed_slots
    # slots whose shapes the input-shape signature fixes (Shape/Size of them can be folded)
    shaped: set[int] = set(constants) | placed_slots | {slot_of[f] for f in feed_names}
    allocators: dict[Device, Any] = {}
    stream_factories: dict[str, Any] = {}
    timer_factories: dict[str, Any] = {}
    for n, step_a, actual in steps_nodes:
        out_devs: tuple[Device, ...]
        if step_a is None:  # a copy node
            assert n.ep is not None  # value_on() names the provider of every copy node
            owner = ctx.by_name[n.ep]
            kernel = CopyKernel(_copy_info(n, owner, ctx), ctx.transfer)
            info = kernel.info
            out_devs = (location[n.outputs[0]] or CPU,)
            ep = owner
        else:
            ep = step_a.ep
            info = _kernel_info(n, step_a, graph, ctx)
            try:
                kernel = step_a.factory(info)
            except (NotImplemented, InvalidGraph):
                raise
            except Exception as e:
                raise Fail(
                    f"{n.op_type} node '{n.name}' could not be prepared by {ep.name}: "
                    f"{type(e).__name__}: {e}"
                ) from e
            warm_up = getattr(kernel, "warm_up", None)  # (a kernel of an older plugin API)
            try:
                if warm_up is not None:
                    warm_up()
            except Exception:  # a guess: the first run does the work, and reports its errors
                pass
            out_devs = tuple(_out_device(step_a, j) for j in range(len(n.outputs)))
        for d in out_devs:
            if not d.is_cpu and d not in allocators:
                allocators[d] = ctx.allocator_for(ep, d)
        ep_key = None if ep.device.is_cpu else ep.name
        if ep_key is not None and ep_key not in stream_factories:
            stream_factories[ep_key] = ep.create_sync_stream
            if supports(getattr(ep.factory, "api_version", 1), "device_timing"):
                timer_factories[ep_key] = ep.create_device_timer
            if ep.device not in allocators:
                allocators[ep.device] = ctx.allocator_for(ep, ep.device)
        in_slots = tuple(slot(x) if x else -1 for x in actual)
        out_slots = tuple(slot(o) if o else -1 for o in n.outputs)
        # An outer-scope value a subgraph reads may be an initializer of this graph (e.g. a
        # Constant the optimizer turned into one) that no node here reads directly: it still
        # needs its constant slot.
        implicit = tuple(
            slot(value_on(x, CPU) if x in graph.initializers else x) for x in n.implicit_inputs
        )
        if _shape_follows_signature(n, in_slots, shaped, static):
            shaped.update(s for s in out_slots if s >= 0)
        foldable = False
        if (
            ep.device.is_cpu
            and not n.subgraphs
            and n.op_type not in NONDETERMINISTIC_OPS
            and step_a is not None
        ):
            if n.op_type in SHAPE_SOURCE_OPS and n.domain == "":
                foldable = bool(in_slots) and in_slots[0] in shaped
            else:
                foldable = all(s < 0 or s in static for s in in_slots)
        if foldable:
            static.update(s for s in out_slots if s >= 0)
        for s in out_slots:
            if s >= 0:
                producer_step[s] = len(specs)
        spec = StepSpec(kernel, info, in_slots, out_slots, implicit, out_devs, ep_key, (), foldable)
        # the host's copy kernels have every capability; a plugin's kernels those of its API
        spec.sync_stream = step_a is None or has_kernel_sync_stream(ep)
        specs.append(spec)

    # The initializers go to their devices once every kernel is made: kernels read them on
    # the host, and their warm_up (background compiles) then starts before the upload, not
    # after it.
    for dev, items in to_place.items():
        values = contiguous[dev].result()
        placed = place_in_one_block(values, dev, ctx.transfer, _allocators(ctx, dev))
        constants.update(zip((s for s, _ in items), placed))

    output_slots = []
    for vi in graph.outputs:
        if vi.name not in slot_of:
            raise InvalidGraph(
                f"graph '{graph.name}' output '{vi.name}' is not produced by any node, input "
                "or initializer"
            )
        output_slots.append(slot_of[vi.name])
    _check_inputs_defined(
        graph, specs, slot_names, producer_step, set(slot_of[f] for f in feed_names), constants
    )

    # release points: after the last step that reads a slot
    last_use: dict[int, int] = {}
    for i, spec in enumerate(specs):
        for s in itertools.chain(spec.in_slots, spec.implicit_slots):
            if s >= 0:
                last_use[s] = i
        for s in spec.out_slots:
            if s >= 0 and s not in last_use:
                last_use[s] = i
    keep = set(output_slots) | set(constants)
    releases: dict[int, list[int]] = {}
    for s, i in last_use.items():
        if s not in keep:
            releases.setdefault(i, []).append(s)
    for i, spec in enumerate(specs):
        spec.release = tuple(releases.get(i, ()))

    # cross-stream waits: a step reading a value that another provider's stream produced
    # waits for it, on its own stream or, for host steps, on the host (subgraphs read outer
    # values as implicit inputs). Not needed for inputs read for their shape only, nor after
    # MemcpyToHost, which drains its stream before returning.
    waits: dict[int, list[tuple[int, str]]] = {}
    for i, spec in enumerate(specs):
        shape_only = spec.info.kernel_def.shape_only_inputs
        reads = [s for k, s in enumerate(spec.in_slots) if k not in shape_only]
        for s in itertools.chain(reads, spec.implicit_slots):
            p = producer_step.get(s)
            if p is None:
                continue
            pk = specs[p].ep_key
            if pk is None or pk == spec.ep_key:
                continue
            if spec.ep_key is None and specs[p].info.op_type == MEMCPY_TO_HOST:
                continue
            if (p, pk) not in waits.get(i, []):
                waits.setdefault(i, []).append((p, pk))

    # pinned (host-accessible) memory of each device provider: the frames' staging buffers
    staging: dict[Device, Any] = {}
    for ep in ctx.eps:
        hm = ep.ep_device.host_accessible_memory_info if ep.ep_device is not None else None
        if ep.device.is_cpu or hm is None or ep.device in staging:
            continue
        try:
            staging[ep.device] = ctx.allocator_for(ep, hm.device)
        except OnnxPlugError:
            pass  # no allocator for it: feeds and outputs are copied without staging
    plan = ExecutionPlan(
        name=graph.name,
        n_slots=len(slot_names),
        slot_names=slot_names,
        constants=constants,
        feed_slots=[slot_of[f] for f in feed_names],
        feed_devices=feed_devices,
        output_slots=output_slots,
        steps=specs,
        allocators=allocators,
        stream_factories=stream_factories,
        timer_factories=timer_factories,
        waits=waits,
        transfer=ctx.transfer,
        staging=staging,
        eps={ep.name: ep for ep in ctx.eps if not ep.device.is_cpu},
    )
    for spec in specs:
        ctx.records.append(
            (
                graph.name,
                spec.info.name,
                spec.info.op_type,
                getattr(spec.info.ep, "name", ""),
                spec.info.domain,
            )
        )
    runner = GraphRunner(plan)
    return runner, feed_devices


def _shape_follows_signature(
    node: Node, in_slots: tuple[int, ...], shaped: set[int], static: set[int]
) -> bool:
    """Whether the shapes of ``node``'s outputs are fixed by the input-shape signature."""
    if node.domain not in ("", "ai.onnx") or node.op_type in _DATA_SHAPED_OPS:
        return False  # unknown domains: assume the worst
    if not all(s < 0 or s in shaped for s in in_slots):
        return False
    value_inputs = _VALUE_SHAPED_INPUTS.get(node.op_type, ())
    return all(i >= len(in_slots) or in_slots[i] < 0 or in_slots[i] in static for i in value_inputs)


def _check_inputs_defined(graph, specs, slot_names, producer_step, feed_slots, constants) -> None:
    for spec in specs:
        for k, s in enumerate(spec.in_slots):
            if s >= 0 and s not in producer_step and s not in feed_slots and s not in constants:
                raise InvalidGraph(
                    f"{spec.info.op_type} node '{spec.info.name}' input {k} '{slot_names[s]}' is "
                    "not a graph input, an initializer or the output of another node"
                )


def _allocators(ctx: BuildContext, dev: Device) -> dict[Device, Any]:
    if dev.is_cpu:
        return {}
    return {dev: ctx.allocator_for(_ep_for_device(ctx, dev), dev)}


def _copy_info(node: Node, ep: Ep, ctx: BuildContext) -> KernelInfo:
    allocs = {} if ep.device.is_cpu else {MemType.DEFAULT: ctx.allocator_for(ep, ep.device)}
    return KernelInfo(node, _COPY_DEF, ep, [None], [None], {}, None, allocs)


def _kernel_info(node: Node, a: Assignment, graph: Graph, ctx: BuildContext) -> KernelInfo:
    consts: dict[int, Any] = {}
    for i, name in enumerate(node.inputs):
        if name and name in graph.initializers:
            consts[i] = graph.initializers[name]
    runners: dict[str, SubgraphRunner] = {}
    if node.subgraphs:
        out_dev = _out_device(a, 0)
        for attr, sg in node.subgraphs.items():
            runner, feed_devs = build_runner(sg, ctx, list(node.implicit_inputs))
            allocs = {}
            for d in set(feed_devs) | {out_dev}:
                if d is not None and not d.is_cpu:
                    allocs[d] = ctx.allocator_for(_ep_for_device(ctx, d), d)
            outs_on: list[Device] | None = None
            if node.op_type == "Loop":
                # the loop condition is read on the host; carried values stay on the device
                outs_on = [CPU] + [out_dev] * (len(sg.outputs) - 1)
            runners[attr] = SubgraphRunner(
                runner, feed_devs, out_dev, ctx.transfer, allocs, outs_on
            )
    allocs_by_mem: dict[MemType, Any] = {}
    if not a.ep.device.is_cpu:
        allocs_by_mem[MemType.DEFAULT] = ctx.allocator_for(a.ep, a.ep.device)
    return KernelInfo(
        node,
        a.kdef,
        a.ep,
        [graph.type_of(i) if i else None for i in node.inputs],
        [graph.type_of(o) if o else None for o in node.outputs],
        consts,
        runners,
        allocs_by_mem,
    )


def make_constant_folder(ep: Ep) -> Any:
    """Evaluates one node on ``ep`` (the CPU provider) for constant folding."""
    from ..framework.executor import _host_empty
    from ..framework.kernel import KernelContext

    def fold(graph: Graph, node: Node, inputs: list[Any]) -> list[Any] | None:
        hit = _lookup(ep, graph, node)
        if hit is None:
            return None
        kdef, factory = hit
        consts = {i: v for i, v in enumerate(inputs) if v is not None}
        info = KernelInfo(
            node,
            kdef,
            ep,
            [graph.type_of(i) if i else None for i in node.inputs],
            [graph.type_of(o) if o else None for o in node.outputs],
            consts,
        )
        kernel = factory(info)
        n_in = len(inputs)
        values: list[Any] = list(inputs) + [None] * len(node.outputs)
        in_slots = tuple(i if v is not None else -1 for i, v in enumerate(inputs))
        out_slots = tuple(n_in + j if o else -1 for j, o in enumerate(node.outputs))
        ctx = KernelContext(
            values, in_slots, out_slots, (), info, (_host_empty,) * len(node.outputs), None, None
        )
        kernel.compute(ctx)
        return [values[n_in + j] for j, o in enumerate(node.outputs) if o]

    return fold
