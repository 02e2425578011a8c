"""Load-time validation of a model against the ONNX schemas, as strict as onnxruntime's.

Two passes, each raising one typed error that names the node, the attribute or input, and the
rule broken:

* ``check_proto`` runs on the ModelProto *before* any native code sees it (onnx's C++ shape
  inference and inliner abort the process on some malformed input, e.g. a negative tensor
  dimension): every tensor has a real element type, non-negative dims and a data size that
  matches them; every declared value type names a real element type.
* ``check_graph`` runs on the IR once types are inferred: every node of a standard domain
  against its schema (attribute names, attribute type tags, required attributes, input and
  output counts, type constraints and their bindings), window attributes of convolutions and
  pools, initializers shadowed by graph inputs of another type or shape.

Ops of custom domains have no schema here; their providers' kernels validate them.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
from onnx import AttributeProto, GraphProto, ModelProto, TensorProto, TypeProto

from ..errors import Fail, InvalidArgument, InvalidGraph, InvalidProtobuf
from .infer import shapes_conflict, sliced_type
from .types import ValueType, elem_type_name, elem_type_of, shape_text

if TYPE_CHECKING:
    from .graph import Graph, Node

_VALID_ELEM_TYPES = frozenset(
    v for v in TensorProto.DataType.values() if v != TensorProto.UNDEFINED
)
_STANDARD_DOMAINS = frozenset({"", "ai.onnx.ml", "ai.onnx.preview.training", "ai.onnx.preview"})
# bytes per element of the fixed-size types (None: strings; packed 4/2-bit types handled apart)
SUB_BYTE_BITS = {
    TensorProto.INT4: 4,
    TensorProto.UINT4: 4,
    TensorProto.FLOAT4E2M1: 4,
    **{getattr(TensorProto, n): 2 for n in ("INT2", "UINT2") if hasattr(TensorProto, n)},
}


# ---------------------------------------------------------------------------------------------
# The proto, before native code sees it


def check_proto(proto: ModelProto, lifted: Mapping[str, int] | None = None) -> None:
    """Text fields, tensors and declared types of the whole model (subgraphs and functions
    included). ``lifted``: the byte counts of main-graph initializers whose data the loader
    lifted out of the proto (ir.wire), by name."""
    _check_text(proto, "model")
    for where, graph in _graphs(proto.graph, "graph"):
        _check_graph_proto(graph, where, lifted if graph is proto.graph else None)
    _check_subgraph_scopes(proto.graph)
    for f in proto.functions:
        for node in f.node:
            _check_node_tensors(node, f"function '{_text(f.name)}'")


def _check_text(msg: Any, where: str) -> None:
    """Every string field is UTF-8 text (protobuf hands other bytes back as ``bytes``, which
    would fail later, far from the cause, as a raw UnicodeDecodeError or a name mismatch)."""
    for fd in _text_fields(msg.DESCRIPTOR):
        if fd.type == fd.TYPE_STRING:
            value = getattr(msg, fd.name)
            items = value if _repeated(fd) else (value,)
            for k, v in enumerate(items):
                if isinstance(v, bytes):
                    at = f"{fd.name}[{k}]" if _repeated(fd) else fd.name
                    raise InvalidProtobuf(f"{where}.{at} is not valid UTF-8 text: {v[:40]!r}")
        elif _repeated(fd):
            for k, v in enumerate(getattr(msg, fd.name)):
                _check_text(v, f"{where}.{fd.name}[{k}]")
        elif msg.HasField(fd.name):
            _check_text(getattr(msg, fd.name), f"{where}.{fd.name}")


@functools.cache
def _text_fields(descriptor: Any) -> tuple[Any, ...]:
    """The string and message fields of a message type: what ``_check_text`` reads, by name,
    so that a tensor's ``raw_data`` is never copied out of the proto (``ListFields`` would
    copy every value, hundreds of MB for a large model's weights)."""
    return tuple(f for f in descriptor.fields if f.type in (f.TYPE_STRING, f.TYPE_MESSAGE))


def _repeated(fd: Any) -> bool:
    flag = getattr(fd, "is_repeated", None)
    return bool(flag) if flag is not None else fd.label == fd.LABEL_REPEATED


def _graphs(g: GraphProto, where: str) -> Iterator[tuple[str, GraphProto]]:
    yield where, g
    for node in g.node:
        for attr in node.attribute:
            sub = [attr.g] if attr.HasField("g") else []
            for k, sg in enumerate(itertools.chain(sub, attr.graphs)):
                label = f"{_node_label(node)} attribute '{_text(attr.name)}'"
                yield from _graphs(sg, label if not k else f"{label}[{k}]")


def _check_graph_proto(g: GraphProto, where: str, lifted: Mapping[str, int] | None) -> None:
    for t in g.initializer:
        raw = lifted.get(t.name) if lifted else None
        check_tensor(t, f"initializer '{_text(t.name)}' of {where}", raw)
    for sp in g.sparse_initializer:
        check_sparse_tensor(sp, f"sparse initializer '{_text(sp.values.name)}' of {where}")
    # Every declared type names real element types, as onnxruntime requires ("Invalid tensor
    # data type 0"); a value_info of a name nothing in the graph uses is ignored, as there.
    used = {vi.name for vi in itertools.chain(g.input, g.output)}
    used.update(x for node in g.node for x in itertools.chain(node.input, node.output))
    for kind, infos in (("input", g.input), ("output", g.output), ("value_info", g.value_info)):
        for vi in infos:
            if vi.HasField("type") and (kind != "value_info" or vi.name in used):
                _check_type_proto(vi.type, f"{kind} '{_text(vi.name)}' of {where}")
    for node in g.node:
        _check_node_tensors(node, where)


def _subgraphs(node: onnx.NodeProto, index: int) -> Iterator[tuple[str, GraphProto]]:
    for attr in node.attribute:
        sub = [attr.g] if attr.HasField("g") else []
        for k, sg in enumerate(itertools.chain(sub, attr.graphs)):
            label = f"attribute '{_text(attr.name)}'" + (f"[{k}]" if k else "")
            yield f"{label} of {_node_label(node, index)}", sg


def _check_subgraph_scopes(g: GraphProto) -> None:
    """The rules onnxruntime checks (with onnx's checker) on every subgraph, which it reads in
    the order written, unlike the main graph, which it sorts itself: a node reads only values
    defined before it (the subgraph's inputs, initializers, earlier nodes' outputs) or values
    of an enclosing graph; no node output redefines a name already defined (SSA, enclosing
    graphs included); the default domain is written '' (the alias 'ai.onnx' is read as it
    only in the main graph)."""
    every = {vi.name for vi in g.input} | {t.name for t in g.initializer}
    every |= {sp.values.name for sp in g.sparse_initializer}
    base = set(every)
    producer = {o: n for n in g.node for o in n.output if o}
    every |= set(producer)
    for index, node in enumerate(g.node):
        bodies = list(_subgraphs(node, index))
        if not bodies:
            continue
        # The main graph's values a subgraph certainly sees defined: the main graph's inputs and
        # initializers, and what the node computes from (any topological order has those
        # first; onnxruntime's order of the other nodes is its own).
        definite = base | _ancestor_values(node, producer)
        for where, body in bodies:
            _check_subgraph_scope(body, where, every, definite)


def _ancestor_values(node: onnx.NodeProto, producer: dict[str, onnx.NodeProto]) -> set[str]:
    out: set[str] = set()
    stack = [x for x in node.input if x]
    while stack:
        name = stack.pop()
        p = producer.get(name)
        if p is None or name in out:
            continue
        out.update(o for o in p.output if o)
        stack.extend(x for x in p.input if x)
    return out


def _check_subgraph_scope(
    g: GraphProto, where: str, outer: set[str], outer_definite: set[str]
) -> None:
    defined = {vi.name for vi in g.input} | {t.name for t in g.initializer}
    defined |= {sp.values.name for sp in g.sparse_initializer}
    for index, node in enumerate(g.node):
        label = f"{_node_label(node, index)} in the {where}"
        if node.domain == "ai.onnx":
            raise InvalidGraph(
                f"{label}: no opset import for domain 'ai.onnx' (in a subgraph the default "
                "domain is written ''; onnxruntime reads the alias 'ai.onnx' only in the main "
                "graph)"
            )
        for k, name in enumerate(node.input):
            if name and name not in defined and name not in outer:
                raise InvalidGraph(
                    f"{label}: input {k} '{_text(name)}' is not a graph input, an initializer, "
                    "the output of an earlier node or a value of an enclosing graph (the nodes "
                    "of a subgraph must be topologically sorted)"
                )
        for sub_where, body in _subgraphs(node, index):
            _check_subgraph_scope(
                body, f"{sub_where}, in the {where}", outer | defined, outer_definite | defined
            )
        for name in node.output:
            if name and (name in defined or name in outer_definite):
                scope = "in its graph" if name in defined else "by an enclosing graph"
                raise InvalidGraph(
                    f"{label}: output '{_text(name)}' is already defined {scope} (graphs are "
                    "in SSA form: a subgraph cannot redefine a name it can see)"
                )
            defined.add(name)


def _check_node_tensors(node: onnx.NodeProto, where: str) -> None:
    for attr in node.attribute:
        label = f"{_node_label(node)} attribute '{_text(attr.name)}' ({where})"
        if attr.HasField("t"):
            check_tensor(attr.t, label)
        for t in attr.tensors:
            check_tensor(t, label)
        if attr.HasField("sparse_tensor"):
            check_sparse_tensor(attr.sparse_tensor, label)
        for sp in attr.sparse_tensors:
            check_sparse_tensor(sp, label)
        if attr.HasField("tp"):
            _check_type_proto(attr.tp, label)
        for tp in attr.type_protos:
            _check_type_proto(tp, label)


def _check_type_proto(tp: TypeProto, where: str, nested: str = "") -> None:
    """A declared type names real element types all the way down. An empty type at the top
    reads as "unknown"; inside a sequence, optional or map it names nothing (onnxruntime:
    "Unsupported type proto value case")."""
    which = tp.WhichOneof("value")
    if which is None and nested:
        raise InvalidArgument(f"{where}: the element type of a {nested} type is not set")
    if which in ("tensor_type", "sparse_tensor_type"):
        tt = getattr(tp, which)
        if tt.elem_type not in _VALID_ELEM_TYPES:
            raise InvalidArgument(f"{where}: invalid tensor element type {tt.elem_type}")
    elif which == "sequence_type":
        _check_type_proto(tp.sequence_type.elem_type, where, "sequence")
    elif which == "optional_type":
        _check_type_proto(tp.optional_type.elem_type, where, "optional")
    elif which == "map_type":
        if tp.map_type.key_type not in _VALID_ELEM_TYPES:
            raise InvalidArgument(f"{where}: invalid map key type {tp.map_type.key_type}")
        _check_type_proto(tp.map_type.value_type, where, "map")


def check_tensor(t: TensorProto, where: str, raw_nbytes: int | None = None) -> None:
    """A tensor's element type is real, its dims are non-negative and its data fills them.
    ``raw_nbytes``: the size of its raw data where the loader lifted it out of the proto."""
    if t.data_type not in _VALID_ELEM_TYPES:
        raise InvalidGraph(f"{where}: tensor does not have a valid data type ({t.data_type})")
    dims = [int(d) for d in t.dims]
    if any(d < 0 for d in dims):
        raise InvalidGraph(f"{where}: tensor dims {dims} contain a negative dimension")
    if t.data_location == TensorProto.EXTERNAL:
        return  # sized when read (ir.model.load_external_data)
    numel = 1
    for d in dims:
        numel *= d
    have = _stored_count(t, raw_nbytes)
    if have is not None and have != numel:
        raise InvalidGraph(f"{where}: tensor of dims {dims} needs {numel} values but holds {have}")


def _stored_count(t: TensorProto, raw_nbytes: int | None) -> int | None:
    """How many elements a tensor's data holds (None when the layout is not checked here)."""
    dt = t.data_type
    if raw_nbytes is not None or t.HasField("raw_data"):
        if dt == TensorProto.STRING:
            return None
        bits = SUB_BYTE_BITS.get(dt)
        if bits is not None:
            return None  # packed: the last byte may hold padding; numpy_helper checks it
        size = onnx.helper.tensor_dtype_to_np_dtype(dt).itemsize
        n = len(t.raw_data) if raw_nbytes is None else raw_nbytes
        return n // size if n % size == 0 else -1
    field = onnx.helper.tensor_dtype_to_field(dt) if dt != TensorProto.STRING else "string_data"
    count = len(getattr(t, field))
    if dt in (TensorProto.COMPLEX64, TensorProto.COMPLEX128):
        return count // 2 if count % 2 == 0 else -1
    if dt in SUB_BYTE_BITS:
        return None
    return count


def check_sparse_tensor(sp: onnx.SparseTensorProto, where: str) -> None:
    """A sparse tensor's values are 1-D, its indices [NNZ] or [NNZ, rank], all in range."""
    check_tensor(sp.values, f"{where} (values)")
    check_tensor(sp.indices, f"{where} (indices)")
    dims = [int(d) for d in sp.dims]
    if any(d < 0 for d in dims):
        raise InvalidGraph(f"{where}: sparse tensor dims {dims} contain a negative dimension")
    if len(sp.values.dims) != 1:
        raise InvalidGraph(f"{where}: sparse values must be 1-D, not dims {list(sp.values.dims)}")
    nnz = int(sp.values.dims[0])
    if sp.indices.data_type != TensorProto.INT64:
        raise InvalidGraph(f"{where}: sparse indices must be int64")
    idims = [int(d) for d in sp.indices.dims]
    numel = 1
    for d in dims:
        numel *= d
    if idims == [nnz]:
        bound = [numel]
    elif idims == [nnz, len(dims)]:
        bound = dims
    else:
        raise InvalidGraph(
            f"{where}: sparse indices have dims {idims}; expected [{nnz}] or [{nnz}, {len(dims)}]"
        )
    if nnz == 0:
        return
    idx = onnx.numpy_helper.to_array(sp.indices).reshape(nnz, -1)
    if (idx < 0).any() or (idx >= np.asarray(bound, dtype=np.int64)).any():
        raise InvalidGraph(f"{where}: sparse indices out of range for dims {dims}")


# ---------------------------------------------------------------------------------------------
# The IR, against the schemas


def check_graph(g: Graph, ir_version: int) -> None:
    """Every node of ``g`` and its subgraphs against its schema; shadowed initializers."""
    _check_shadowed_initializers(g)
    for node in g.nodes:
        if node.proto is not None:
            check_node(node, g, ir_version)
        for sg in node.subgraphs.values():
            check_graph(sg, ir_version)


def _check_shadowed_initializers(g: Graph) -> None:
    for vi in g.inputs:
        arr = g.initializers.get(vi.name)
        t = vi.type
        if arr is None or t.kind != "tensor":
            continue
        try:
            actual = elem_type_of(arr.dtype)
        except ValueError:
            continue
        if t.elem_type and t.elem_type != actual:
            raise Fail(
                f"Type Error: Data in initializer '{vi.name}' has element type "
                f"tensor({elem_type_name(actual)}) but the graph input of that name declares "
                f"tensor({elem_type_name(t.elem_type)})"
            )
        if t.shape is not None:
            fixed = [
                (k, want) for k, want in enumerate(t.shape) if isinstance(want, int) and want >= 0
            ]
            if len(t.shape) != arr.ndim or any(arr.shape[k] != want for k, want in fixed):
                raise Fail(
                    f"Type Error: Shape of initializer '{vi.name}' {list(arr.shape)} does not "
                    f"match the graph input of that name, declared {list(t.shape)}"
                )


def _schema(node: Node) -> Any:
    if node.domain not in _STANDARD_DOMAINS:
        return None
    return _schema_of(node.op_type, node.opset, node.domain)


@functools.lru_cache(maxsize=4096)
def _schema_of(op_type: str, opset: int, domain: str) -> Any:
    try:
        return onnx.defs.get_schema(op_type, opset, domain)
    except Exception:
        return None  # graph.py already refused unknown ops of the standard domains


@functools.lru_cache(maxsize=4096)
def _allowed_types(op_type: str, opset: int, domain: str) -> dict[str, frozenset[str]]:
    schema = _schema_of(op_type, opset, domain)
    return {tc.type_param_str: frozenset(tc.allowed_type_strs) for tc in schema.type_constraints}


def check_node(node: Node, g: Graph, ir_version: int) -> None:
    schema = _schema(node)
    if schema is None:
        return
    label = node.label()
    proto = node.proto
    assert proto is not None
    attrs = schema.attributes
    seen: set[str] = set()
    for a in proto.attribute:
        name = _text(a.name)
        if name in seen:
            raise InvalidGraph(f"{label}: attribute '{name}' is given twice")
        seen.add(name)
        spec = attrs.get(name)
        if spec is None:
            raise InvalidGraph(
                f"{label}: unrecognized attribute '{name}' for operator {node.op_type} "
                f"(its attributes are {sorted(attrs) or 'none'})"
            )
        want = int(spec.type.value)
        if a.type == AttributeProto.UNDEFINED and ir_version >= 2:
            raise InvalidGraph(
                f"{label}: attribute '{name}' has no type (field 'type' is required)"
            )
        if a.type != AttributeProto.UNDEFINED and a.type != want:
            raise InvalidGraph(
                f"{label}: attribute '{name}' has type {_attr_type_name(a.type)}, the schema of "
                f"{node.op_type}-{schema.since_version} wants {_attr_type_name(want)}"
            )
    for name, spec in attrs.items():
        if spec.required and name not in seen:
            raise InvalidGraph(f"{label}: required attribute '{name}' is missing")
    n_in, n_out = len(node.inputs), len(node.outputs)
    if not schema.min_input <= n_in <= schema.max_input:
        raise InvalidGraph(
            f"{label}: has {n_in} inputs; {node.op_type}-{schema.since_version} takes "
            f"{_arity(schema.min_input, schema.max_input)}"
        )
    if not schema.min_output <= n_out <= schema.max_output:
        raise InvalidGraph(
            f"{label}: has {n_out} outputs; {node.op_type}-{schema.since_version} gives "
            f"{_arity(schema.min_output, schema.max_output)}"
        )
    for i, formal in _formals(list(schema.inputs), n_in):
        if not node.inputs[i] and formal.option == onnx.defs.OpSchema.FormalParameterOption.Single:
            raise InvalidGraph(f"{label}: required input {i} ('{formal.name}') is missing")
    _check_types(node, g, schema)
    _check_element_type_attrs(node, schema)
    if node.op_type in ("If", "Loop", "Scan") and node.domain == "":
        _check_subgraph_signature(node, g)
    if node.op_type in _WINDOW_OPS and node.domain == "":
        _check_window(node, g)
    rule = _OP_RULES.get(node.op_type) if node.domain == "" else None
    if rule is not None:
        rule(node, g)


def _arity(lo: int, hi: int) -> str:
    if lo == hi:
        return f"exactly {lo}"
    return f"at least {lo}" if hi >= 2**31 - 1 else f"{lo} to {hi}"


def _formals(params: list[Any], count: int) -> Iterator[tuple[int, Any]]:
    """(actual index, formal parameter) pairs; a variadic last formal takes the rest."""
    for i in range(count):
        if i < len(params):
            yield i, params[i]
        elif params and params[-1].option == onnx.defs.OpSchema.FormalParameterOption.Variadic:
            yield i, params[-1]


def _type_string(t: ValueType | None) -> str | None:
    """onnx's type string of a value type ('tensor(float)', 'seq(tensor(int64))'); None when
    unknown or not comparable (maps, elements of unknown type)."""
    if t is None:
        return None
    if t.kind in ("tensor", "sparse_tensor"):
        return t.type_str() if t.elem_type in _VALID_ELEM_TYPES else None
    if t.kind in ("sequence", "optional"):
        inner = _type_string(t.inner)
        if inner is None:
            return None
        return f"{'seq' if t.kind == 'sequence' else 'optional'}({inner})"
    return None


def _check_types(node: Node, g: Graph, schema: Any) -> None:
    """Every input's type is allowed by its type constraint, and inputs bound to one type
    parameter (homogeneous variadics included) agree."""
    allowed = _allowed_types(node.op_type, node.opset, node.domain)
    bound: dict[str, tuple[str, str]] = {}  # type param -> (type string, input name)
    for i, formal in _formals(list(schema.inputs), len(node.inputs)):
        name = node.inputs[i]
        if not name:
            continue
        actual = _type_string(g.type_of(name))
        if actual is None:
            continue
        param = formal.type_str
        ok = allowed.get(param, frozenset({param}))
        if any(s.startswith("map(") for s in ok):
            continue  # onnx-ml's map notation differs from ours: not compared
        if actual not in ok:
            raise Fail(
                f"Type Error: Type '{actual}' of input {i} '{name}' of {node.label()} is "
                f"invalid: {node.op_type}-{schema.since_version} accepts "
                f"{sorted(ok)} there"
            )
        homogeneous = (
            formal.option != onnx.defs.OpSchema.FormalParameterOption.Variadic
            or formal.is_homogeneous
        )
        if param in allowed and homogeneous:
            prev = bound.setdefault(param, (actual, name))
            if prev[0] != actual:
                raise Fail(
                    f"Type Error: Type parameter ({param}) of Optype ({node.op_type}) bound to "
                    f"different types ({prev[0]} for '{prev[1]}' and {actual} for '{name}') in "
                    f"{node.label()}"
                )


# Attributes that name an element type, and which ops have them.
_ELEM_TYPE_ATTRS = {"to", "dtype", "output_datatype", "saturate_to"}


def _check_element_type_attrs(node: Node, schema: Any) -> None:
    for name in _ELEM_TYPE_ATTRS & set(node.attrs):
        spec = schema.attributes.get(name)
        if spec is None or spec.type != onnx.defs.OpSchema.AttrType.INT:
            continue
        value = node.attrs[name]
        if value not in _VALID_ELEM_TYPES:
            raise Fail(
                f"{node.label()}: attribute '{name}' ({value}) does not specify a valid type"
            )


def _check_subgraph_signature(node: Node, g: Graph) -> None:
    """A control-flow node's bodies take and give what the node passes and expects: If's
    branches have no inputs and one output per node output; a Loop body takes (iteration,
    condition, carried...) and gives (condition, carried..., scan outputs...); a Scan body
    takes (states..., scan slices...) and gives (states..., scan outputs...). Carried values
    and states keep their element type."""
    label = node.label()
    n_in, n_out = len(node.inputs), len(node.outputs)
    if node.op_type == "If":
        for name in ("then_branch", "else_branch"):
            body = node.subgraphs.get(name)
            if body is None:
                continue
            if body.inputs:
                raise InvalidGraph(
                    f"{label}: {name} must take no inputs, it has {len(body.inputs)}"
                )
            if len(body.outputs) != n_out:
                raise InvalidGraph(
                    f"{label}: {name} gives {len(body.outputs)} outputs for the node's {n_out}"
                )
        return
    body = node.subgraphs.get("body")
    if body is None:
        return
    # What the node passes to each body input, as onnxruntime checks it against the type the
    # body declares there: Loop's iteration number is an int64 tensor (of any shape), its
    # condition what the node is given, its carried values their element types (their shapes
    # may change between iterations); Scan's states their types and shapes, and its scan
    # inputs the shape of one slice.
    passed: list[tuple[str, ValueType | None, str]]  # (name, type, what the type is of)
    if node.op_type == "Loop":
        want_in, want_out = n_in, 1 + n_out
        cond = node.inputs[1] if n_in > 1 else ""
        passed = [("", ValueType("tensor", TensorProto.INT64, None), "")]
        passed.append((cond, g.type_of(cond) if cond else None, ""))
        for name in node.inputs[2:]:
            t = g.type_of(name) if name else None
            passed.append((name, _without_shape(t), ""))
    else:
        n_scan = node.attrs.get("num_scan_inputs")
        first = 1 if node.since_version < 9 else 0  # Scan-8's sequence_lens
        if not isinstance(n_scan, int) or not 1 <= n_scan <= n_in - first:
            raise InvalidGraph(
                f"{label}: num_scan_inputs {n_scan} must be in [1, {n_in - first}] (the inputs)"
            )
        want_in, want_out = n_in - first, n_out
        axes = list(node.attrs.get("scan_input_axes") or [])
        passed = []
        for k, name in enumerate(node.inputs[first:]):
            t = g.type_of(name) if name else None
            j = k - (n_in - first - n_scan)
            of = ""
            if first:  # Scan-8: batched inputs; only element types are compared
                t = _without_shape(t)
            elif j >= 0:
                t, of = sliced_type(t, axes[j] if j < len(axes) else 0), "a slice of "
            passed.append((name, t, of))
    if len(body.inputs) != want_in or len(body.outputs) != want_out:
        raise InvalidGraph(
            f"{label}: its body takes {len(body.inputs)} inputs and gives {len(body.outputs)} "
            f"outputs; with {n_in} node inputs and {n_out} outputs it must take {want_in} and "
            f"give {want_out}"
        )
    for (name, actual, of), formal in zip(passed, body.inputs):
        _check_passed(label, name, actual, of, formal.name, formal.type)


def _without_shape(t: ValueType | None) -> ValueType | None:
    if t is None or t.kind not in ("tensor", "sparse_tensor"):
        return t
    return ValueType(t.kind, t.elem_type, None)


def _check_passed(
    label: str, name: str, actual: ValueType | None, of: str, formal: str, want: ValueType
) -> None:
    """A value passed to a body input agrees with the type the body declares there: the same
    kind of value, element type and rank, and no dim of two different sizes."""
    if actual is None or actual.kind == "unknown" or want.kind == "unknown":
        return
    what = f"'{name}'" if name else "the iteration number"
    if actual.kind != want.kind or (
        actual.kind in ("tensor", "sparse_tensor")
        and actual.elem_type
        and want.elem_type
        and actual.elem_type != want.elem_type
    ):
        raise Fail(
            f"Type Error: {label} passes {what} of type {actual.type_str()} to body input "
            f"'{formal}' of type {want.type_str()}"
        )
    if shapes_conflict(actual, want):
        raise Fail(
            f"{label}: body input '{formal}' is declared with shape {shape_text(want.shape)} but "
            f"the node passes {of}{what}, of shape {shape_text(actual.shape)}"
        )


_WINDOW_OPS = frozenset(
    {"Conv", "ConvTranspose", "ConvInteger", "QLinearConv", "MaxPool", "AveragePool", "LpPool"}
)
_POOL_OPS = frozenset({"MaxPool", "AveragePool", "LpPool"})


def _check_window(node: Node, g: Graph) -> None:
    """kernel_shape, strides, dilations and pads of a convolution or pool (the values every
    provider's kernel would otherwise compute with), and pads smaller than a pool's window."""
    a = node.attrs
    kernel = a.get("kernel_shape")
    n = len(kernel) if kernel else None
    x = g.type_of(node.inputs[0]) if node.inputs and node.inputs[0] else None
    x_rank = len(x.shape) if x is not None and x.kind == "tensor" and x.shape is not None else None
    if node.op_type not in _POOL_OPS:
        w_index = 3 if node.op_type == "QLinearConv" else 1
        w = g.type_of(node.inputs[w_index]) if len(node.inputs) > w_index else None
        if w is not None and w.kind == "tensor" and w.shape is not None:
            if x_rank is not None and x_rank != len(w.shape):
                raise Fail(
                    f"{node.label()}: input X has rank {x_rank} but the weights W have rank "
                    f"{len(w.shape)}; they must agree (N, C, spatial dims...)"
                )
            if n is None and len(w.shape) >= 2:
                n = len(w.shape) - 2
    if x_rank is not None and n is not None and x_rank != n + 2:
        raise Fail(
            f"{node.label()}: input X has rank {x_rank}, the window has {n} spatial dims "
            f"(X must be N, C and {n} spatial dims)"
        )
    if n is None:
        if x_rank is None or x_rank < 2:
            return  # no rank known: the kernels check at run time
        n = x_rank - 2
    pads = a.get("pads") if a.get("auto_pad", "NOTSET") == "NOTSET" else None
    try:
        check_window_attrs(n, kernel, a.get("strides"), a.get("dilations"), pads)
    except ValueError as e:
        raise Fail(f"{node.label()}: {e}") from None
    if node.op_type in _POOL_OPS and kernel and pads:
        for i, k in enumerate(kernel):
            if pads[i] >= k or pads[n + i] >= k:
                raise Fail(
                    f"{node.label()}: pads {list(pads)} must be smaller than kernel_shape "
                    f"{list(kernel)} (a window inside the padding has no input)"
                )


def _constant(g: Graph, name: str) -> np.ndarray | None:
    """The value of an initializer visible from ``g`` (None for anything else)."""
    scope: Graph | None = g
    while scope is not None and name:
        if name in scope.initializers:
            return np.asarray(scope.initializers[name])
        scope = scope.parent
    return None


def _check_recurrent(node: Node, g: Graph) -> None:
    """RNN, GRU and LSTM need ``hidden_size`` (the schema leaves it optional; onnxruntime's
    kernels refuse a node without it), GRU and LSTM a positive one that fits in 32 bits."""
    hidden = node.attrs.get("hidden_size")
    if hidden is None:
        raise Fail(f"{node.label()}: attribute 'hidden_size' must be given")
    if node.op_type != "RNN" and not 0 < hidden <= 2**31 - 1:
        raise Fail(
            f"{node.label()}: attribute 'hidden_size' must be in [1, 2^31 - 1], got {hidden}"
        )


def _check_constant_scales(node: Node, g: Graph) -> None:
    """Resize and Upsample scales given as an attribute (Upsample-7) or an initializer."""
    if node.op_type == "Upsample" and node.since_version < 9:
        scales = node.attrs.get("scales")
    else:
        at = 2 if node.op_type == "Resize" and node.since_version >= 11 else 1
        scales = _constant(g, node.inputs[at]) if len(node.inputs) > at else None
    if scales is None or not np.size(scales):
        return
    try:
        check_resize_scales(node.op_type, np.asarray(scales).reshape(-1))
    except ValueError as e:
        raise Fail(f"{node.label()}: {e}") from None


_OP_RULES = {
    "RNN": _check_recurrent,
    "GRU": _check_recurrent,
    "LSTM": _check_recurrent,
    "Resize": _check_constant_scales,
    "Upsample": _check_constant_scales,
}


def check_window_attrs(
    n_spatial: int,
    kernel: Sequence[int] | None = None,
    strides: Sequence[int] | None = None,
    dilations: Sequence[int] | None = None,
    pads: Sequence[int] | None = None,
) -> None:
    """Raise ValueError when a window attribute of Conv, ConvTranspose or a pooling op breaks
    the op's rules: kernel_shape, strides and dilations positive, pads non-negative, one value
    per spatial dim (two for pads). Checked at load (``check_graph``) and again by the shared
    geometry functions (``framework.shapes``) that every provider's kernels call, so no
    provider computes with, say, a negative dilation (which reads outside the input)."""
    for name, values, lo, per_dim in (
        ("kernel_shape", kernel, 1, 1),
        ("strides", strides, 1, 1),
        ("dilations", dilations, 1, 1),
        ("pads", pads, 0, 2),
    ):
        if values is None or not len(values):
            continue
        if len(values) != per_dim * n_spatial:
            raise ValueError(
                f"Attribute {name} has incorrect size: {len(values)} values for "
                f"{n_spatial} spatial dims (expected {per_dim * n_spatial})"
            )
        if any(int(v) < lo for v in values):
            rule = "only contain positive values" if lo else "not contain negative values"
            raise ValueError(f"Attribute {name} must {rule}, got {[int(v) for v in values]}")


def check_resize_scales(op_type: str, scales: Iterable[float]) -> None:
    """Raise ValueError when a scale of Resize (> 0) or Upsample (>= 1: it only enlarges)
    breaks the op's rule (NaN breaks both). Checked at load for constant scales
    (``check_graph``) and by the kernels for fed ones."""
    values = [float(v) for v in scales]
    if op_type == "Upsample":
        ok, rule = all(v >= 1.0 for v in values), "greater than or equal to 1"
    else:
        ok, rule = all(v > 0.0 for v in values), "greater than 0"
    if not ok:
        raise ValueError(f"Scale value should be {rule}; the scales are {values}")


def _attr_type_name(t: int) -> str:
    try:
        return AttributeProto.AttributeType.Name(t)
    except ValueError:
        return str(t)


def _node_label(node: onnx.NodeProto, index: int | None = None) -> str:
    """How messages name a node: by its name, or as the IR names an unnamed one (its op and
    its index in its graph) when the index is known."""
    name = _text(node.name) or (f"{_text(node.op_type)}_{index}" if index is not None else "")
    return f"{_text(node.op_type)} node '{name}'"


def _text(s: Any) -> str:
    """A proto string field for a message (protobuf may hand non-UTF-8 text as bytes)."""
    if isinstance(s, bytes):
        return s.decode("utf-8", errors="replace")
    return str(s)


def all_value_infos(g: GraphProto) -> Iterable[onnx.ValueInfoProto]:
    return itertools.chain(g.input, g.output, g.value_info)
