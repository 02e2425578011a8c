"""The in-memory graph the runtime works on (built once from a ModelProto).

Nodes keep decoded attributes, the schema version they resolve to (``since_version``, used for
version-aware kernel lookup), their subgraphs as ``Graph`` objects and the outer-scope values
those subgraphs read (``implicit_inputs``), which the executor passes in like extra inputs.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import AttributeProto, GraphProto, ModelProto, NodeProto, numpy_helper

from ..errors import InvalidGraph, OnnxPlugError
from .infer import infer_graph
from .types import ValueType, np_dtype
from .validate import check_graph


@dataclass
class ValueInfo:
    name: str
    type: ValueType

    @property
    def shape(self):
        return self.type.shape

    @property
    def elem_type(self) -> int:
        return self.type.elem_type


@dataclass(eq=False)
class Node:
    name: str
    op_type: str
    domain: str
    inputs: list[str]
    outputs: list[str]
    attrs: dict[str, Any]
    since_version: int
    opset: int
    proto: NodeProto | None = None
    subgraphs: dict[str, Graph] = field(default_factory=dict)
    implicit_inputs: list[str] = field(default_factory=list)
    ep: str | None = None  # name of the execution provider the node is assigned to

    def __repr__(self) -> str:
        return f"Node({self.op_type}:{self.name!r})"

    def label(self) -> str:
        return f"{self.op_type} node '{self.name}'"


@dataclass(eq=False)
class Graph:
    name: str
    nodes: list[Node]
    inputs: list[ValueInfo]
    outputs: list[ValueInfo]
    initializers: dict[str, np.ndarray]
    value_types: dict[str, ValueType]
    opsets: dict[str, int]
    parent: Graph | None = None
    doc: str = ""
    ir_version: int = 0
    _names: itertools.count = field(default_factory=lambda: itertools.count())

    def unique_name(self, base: str) -> str:
        return f"{base}__{next(self._names)}"

    def producers(self) -> dict[str, Node]:
        return {o: n for n in self.nodes for o in n.outputs if o}

    def consumers(self) -> dict[str, list[Node]]:
        out: dict[str, list[Node]] = {}
        for n in self.nodes:
            for i in itertools.chain(n.inputs, n.implicit_inputs):
                if i:
                    out.setdefault(i, []).append(n)
        return out

    def type_of(self, name: str) -> ValueType | None:
        g: Graph | None = self
        while g is not None:
            t = g.value_types.get(name)
            if t is not None:
                return t
            arr = g.initializers.get(name)
            if arr is not None:
                from .types import elem_type_of

                return ValueType("tensor", elem_type_of(arr.dtype), tuple(arr.shape))
            g = g.parent
        return None

    def toposort(self) -> None:
        """Order nodes so that every input is produced before it is used; a cycle (a node
        reading its own output, directly or through a subgraph, included) is an error naming
        the nodes on it."""
        produced = {o: n for n in self.nodes for o in n.outputs if o}

        def deps(node: Node) -> Iterator[Node]:
            for inp in itertools.chain(node.inputs, node.implicit_inputs):
                p = produced.get(inp)
                if p is not None:
                    yield p

        order: list[Node] = []
        state: dict[int, int] = {}  # 1: on the current path, 2: placed
        for root in self.nodes:
            if id(root) in state:
                continue
            state[id(root)] = 1
            stack: list[tuple[Node, Iterator[Node]]] = [(root, deps(root))]
            while stack:
                node, pending = stack[-1]
                for p in pending:
                    s = state.get(id(p))
                    if s == 2:
                        continue
                    if s == 1:
                        path = [n for n, _ in stack]
                        raise InvalidGraph(self._cycle_message(path[path.index(p) :]))
                    state[id(p)] = 1
                    stack.append((p, deps(p)))
                    break
                else:
                    stack.pop()
                    state[id(node)] = 2
                    order.append(node)
        self.nodes = order

    def _cycle_message(self, path: list[Node]) -> str:
        """``path``: nodes each reading an output of the next; the last reads the first's."""
        head = path[0]
        if len(path) == 1:
            reads = [o for o in head.outputs if o and o in (*head.inputs, *head.implicit_inputs)]
            via = " (through a subgraph)" if not set(reads) & set(head.inputs) else ""
            return (
                f"the graph '{self.name}' is not acyclic: {head.label()} reads its own output "
                f"'{reads[0] if reads else '?'}'{via}"
            )
        flow = [head, *reversed(path[1:]), head]  # data-flow order: each feeds the next
        return f"the graph '{self.name}' is not acyclic: " + " -> ".join(n.label() for n in flow)


def decode_attribute(attr: AttributeProto, parent: Graph, opsets: dict[str, int]) -> Any:
    t = attr.type
    A = AttributeProto
    if t == A.FLOAT:
        return float(attr.f)
    if t == A.INT:
        return int(attr.i)
    if t == A.STRING:
        return attr.s.decode("utf-8", errors="surrogateescape")
    if t == A.TENSOR:
        return numpy_helper.to_array(attr.t)
    if t == A.GRAPH:
        return graph_from_proto(attr.g, opsets, parent)
    if t == A.SPARSE_TENSOR:
        return _sparse_to_dense(attr.sparse_tensor)
    if t == A.TYPE_PROTO:
        return ValueType.from_proto(attr.tp)
    if t == A.FLOATS:
        return [float(x) for x in attr.floats]
    if t == A.INTS:
        return [int(x) for x in attr.ints]
    if t == A.STRINGS:
        return [s.decode("utf-8", errors="surrogateescape") for s in attr.strings]
    if t == A.TENSORS:
        return [numpy_helper.to_array(x) for x in attr.tensors]
    if t == A.GRAPHS:
        return [graph_from_proto(g, opsets, parent) for g in attr.graphs]
    if t == A.SPARSE_TENSORS:
        return [_sparse_to_dense(x) for x in attr.sparse_tensors]
    if t == A.TYPE_PROTOS:
        return [ValueType.from_proto(x) for x in attr.type_protos]
    # Untyped attribute (old models): guess from the populated field.
    return onnx.helper.get_attribute_value(attr)


def read_only(a: np.ndarray) -> np.ndarray:
    """A read-only view of ``a``: initializers are shared by every run, so neither a kernel
    nor a caller holding an output that is a view of one may write into them."""
    v = a.view()
    v.flags.writeable = False
    return v


def _sparse_to_dense(sp: onnx.SparseTensorProto) -> np.ndarray:
    values = numpy_helper.to_array(sp.values)
    indices = numpy_helper.to_array(sp.indices).astype(np.int64)
    dims = tuple(int(d) for d in sp.dims)
    dense = np.zeros(dims, dtype=values.dtype)
    if indices.ndim == 1:
        dense.reshape(-1)[indices] = values
    else:
        dense[tuple(indices.T)] = values
    return dense


# Domains whose every op onnx defines: an op without a schema there is not an ONNX op.
_STANDARD_DOMAINS = frozenset({"", "ai.onnx.ml"})


# Ops onnxruntime registers in the default domain at version 1 and writes into the models its
# optimizer saves (LayerNormalization before ONNX had it at opset 17; RMS normalization).
_ORT_DEFAULT_DOMAIN_OPS = frozenset({"LayerNormalization", "SimplifiedLayerNormalization"})


def _resolve_since_version(op_type: str, domain: str, opset: int, where: str) -> int:
    """The schema version a node of ``opset`` resolves to (its kernel lookup key)."""
    try:
        schema = onnx.defs.get_schema(op_type, opset, domain)
    except Exception:
        if domain == "" and op_type in _ORT_DEFAULT_DOMAIN_OPS:
            return 1  # onnxruntime's own op, written in the default domain: kernels decide
        if domain in _STANDARD_DOMAINS:
            raise InvalidGraph(
                f"{where}: no op {op_type} is registered in domain "
                f"'{domain or 'ai.onnx'}' at version {opset} (misspelt, or newer than the "
                "model's opset import?)"
            ) from None
        return opset  # custom domains: providers' kernels decide
    if schema.deprecated:
        raise InvalidGraph(
            f"{where}: op {op_type} is deprecated in domain '{domain or 'ai.onnx'}' since "
            f"version {schema.since_version} and the model imports version {opset}"
        )
    return schema.since_version


def _node_from_proto(p: NodeProto, graph: Graph, opsets: dict[str, int], index: int) -> Node:
    domain = "" if p.domain == "ai.onnx" else p.domain
    opset = opsets.get(domain)
    where = f"{p.op_type} node '{p.name or f'{p.op_type}_{index}'}'"
    if opset is None:
        if domain == "":
            raise InvalidGraph(f"the model imports no default-domain opset but uses {p.op_type}")
        raise InvalidGraph(
            f"{where} uses domain '{domain}', which the model does not import (opset_import)"
        )
    attrs: dict[str, Any] = {}
    subgraphs: dict[str, Graph] = {}
    for a in p.attribute:
        try:
            val = decode_attribute(a, graph, opsets)
        except OnnxPlugError:
            raise
        except Exception as e:  # a tensor whose data does not fit its dims, say
            raise InvalidGraph(f"{where}: attribute '{a.name}' cannot be read: {e}") from e
        attrs[a.name] = val
        if isinstance(val, Graph):
            subgraphs[a.name] = val
    name = p.name or f"{p.op_type}_{index}"
    node = Node(
        name=name,
        op_type=p.op_type,
        domain=domain,
        inputs=list(p.input),
        outputs=list(p.output),
        attrs=attrs,
        since_version=_resolve_since_version(p.op_type, domain, opset, where),
        opset=opset,
        proto=p,
        subgraphs=subgraphs,
    )
    if subgraphs:
        seen: set[str] = set()
        for sg in subgraphs.values():
            for name_ in outer_scope_names(sg):
                if name_ not in seen:
                    seen.add(name_)
                    node.implicit_inputs.append(name_)
    return node


def outer_scope_names(g: Graph) -> list[str]:
    """Values a (sub)graph reads but does not define (from enclosing graphs)."""
    defined = {vi.name for vi in g.inputs} | set(g.initializers)
    out: list[str] = []
    seen: set[str] = set()
    for n in g.nodes:
        for i in itertools.chain(n.inputs, n.implicit_inputs):
            if i and i not in defined and i not in seen:
                seen.add(i)
                out.append(i)
        defined.update(o for o in n.outputs if o)
    return out


def graph_from_proto(
    gp: GraphProto,
    opsets: dict[str, int],
    parent: Graph | None = None,
    ir_version: int = 0,
    weights: dict[str, np.ndarray] | None = None,
) -> Graph:
    """``weights``: initializers the loader read from the model's bytes (their tensors in
    ``gp`` hold no data), by name."""
    inits: dict[str, np.ndarray] = {}
    for t in gp.initializer:
        if weights and t.name in weights:
            inits[t.name] = weights[t.name]
            continue
        try:
            inits[t.name] = read_only(numpy_helper.to_array(t))
        except Exception as e:
            raise InvalidGraph(f"initializer '{t.name}' cannot be read: {e}") from e
    for sp in gp.sparse_initializer:
        inits[sp.values.name] = read_only(_sparse_to_dense(sp))
    value_types: dict[str, ValueType] = {}
    for vi in itertools.chain(gp.input, gp.output, gp.value_info):
        if vi.HasField("type"):
            value_types[vi.name] = ValueType.from_proto(vi.type)
    g = Graph(
        name=gp.name or "graph",
        nodes=[],
        inputs=[
            ValueInfo(vi.name, value_types.get(vi.name, ValueType("unknown"))) for vi in gp.input
        ],
        outputs=[
            ValueInfo(vi.name, value_types.get(vi.name, ValueType("unknown"))) for vi in gp.output
        ],
        initializers=inits,
        value_types=value_types,
        opsets=opsets,
        parent=parent,
        doc=gp.doc_string,
        ir_version=ir_version,
    )
    g.nodes = [_node_from_proto(p, g, opsets, i) for i, p in enumerate(gp.node)]
    _check_unique_names(g)
    g.toposort()
    return g


def _check_unique_names(g: Graph) -> None:
    """Every value is defined once: by a graph input, an initializer or one node output."""
    seen: dict[str, str] = {}
    for vi in g.inputs:
        seen[vi.name] = f"graph input of '{g.name}'"
    for name in g.initializers:
        seen.setdefault(name, f"initializer of '{g.name}'")
    for n in g.nodes:
        for o in n.outputs:
            if not o:
                continue
            if o in seen:
                raise InvalidGraph(
                    f"value '{o}' is defined twice (by the {seen[o]} and {n.label()}); "
                    "ONNX graphs must be in SSA form"
                )
            seen[o] = n.label()


def _newest_opsets() -> dict[str, int]:
    """The newest opset of each standard domain the installed onnx knows."""
    newest = {"": onnx.defs.onnx_opset_version()}
    table = getattr(onnx.helper, "VERSION_TABLE", None)
    if table:
        newest["ai.onnx.ml"] = max(row[3] for row in table)
    return newest


def graph_from_model(proto: ModelProto, weights: dict[str, np.ndarray] | None = None) -> Graph:
    """The graph of a loaded model (``weights``: as ir.model.LoadedModel has them)."""
    opsets: dict[str, int] = {}
    for imp in proto.opset_import:
        dom = "" if imp.domain == "ai.onnx" else imp.domain
        opsets[dom] = int(imp.version)
    if "" not in opsets and any(n.domain in ("", "ai.onnx") for n in proto.graph.node):
        raise InvalidGraph("the model uses default-domain ops but imports no default opset")
    if proto.ir_version > onnx.IR_VERSION:
        raise InvalidGraph(
            f"the model has IR version {proto.ir_version}; this onnx ({onnx.__version__}) "
            f"reads IR versions up to {onnx.IR_VERSION}"
        )
    for dom, newest in _newest_opsets().items():
        if opsets.get(dom, 0) > newest:
            raise InvalidGraph(
                f"the model needs opset {opsets[dom]} of domain '{dom or 'ai.onnx'}'; this "
                f"onnx ({onnx.__version__}) knows opsets up to {newest}: upgrade onnx or "
                "export the model for an older opset"
            )
    g = graph_from_proto(proto.graph, opsets, None, proto.ir_version, weights)
    _check_defined(g, frozenset())
    inferred: dict[str, ValueType] = {}
    refused = infer_graph(g, proto.ir_version, inferred=inferred)
    check_graph(g, proto.ir_version)
    if refused:
        raise refused[0]
    _refine_outputs(g, inferred)
    return g


def _refine_outputs(g: Graph, inferred: dict[str, ValueType]) -> None:
    """Graph outputs take the sizes shape inference found where the model declares none (an
    unknown or symbolic dim, or no shape at all), and the inferred element type where the
    model declares no type, as onnxruntime reports them."""
    for k, vi in enumerate(g.outputs):
        t, it = vi.type, inferred.get(vi.name)
        if it is None or it.kind != "tensor":
            continue
        if t.kind == "unknown" and it.elem_type:
            t = ValueType("tensor", it.elem_type, None)
        if t.kind != "tensor":
            continue
        shape: tuple[int | str | None, ...] | None = t.shape
        if it.shape is None:
            pass
        elif t.shape is None:  # onnx names the dims it cannot size ('unk__0'): unknown here
            shape = tuple(i if isinstance(i, int) else None for i in it.shape)
        elif len(t.shape) == len(it.shape):
            shape = tuple(
                i if isinstance(i, int) and not isinstance(d, int) else d
                for d, i in zip(t.shape, it.shape)
            )
        if t is not vi.type or shape != t.shape:
            nt = ValueType("tensor", t.elem_type, shape)
            g.outputs[k] = ValueInfo(vi.name, nt)
            g.value_types[vi.name] = nt


def _check_defined(g: Graph, visible: frozenset[str]) -> None:
    """Every value a node reads is defined in its graph or an enclosing one (a subgraph's
    undefined name would otherwise surface as a None at run time)."""
    defined = visible | {vi.name for vi in g.inputs} | set(g.initializers)
    defined |= {o for n in g.nodes for o in n.outputs if o}
    for n in g.nodes:
        for k, name in enumerate(n.inputs):
            if name and name not in defined:
                scope = " or a value of an enclosing graph" if g.parent is not None else ""
                raise InvalidGraph(
                    f"{n.label()} input {k} '{name}' is not a graph input, an initializer or the "
                    f"output of another node{scope} (graph '{g.name}')"
                )
        for sg in n.subgraphs.values():
            _check_defined(sg, defined)


def tensor_dtype(graph: Graph, name: str) -> np.dtype | None:
    t = graph.type_of(name)
    if t is None or t.kind != "tensor" or not t.elem_type:
        return None
    try:
        return np_dtype(t.elem_type)
    except ValueError:
        return None
