"""Type and shape inference over the IR, one node at a time with onnx's inference functions.

onnx's whole-model ``infer_shapes`` aborts the process when one node's inference computes a
negative dimension and a later node (Slice's ``std::clamp``) asserts on it: a Pad with
negative pads feeding a Slice is enough. So inference is driven here, node by node in
topological order through ``onnx.shape_inference.infer_node_outputs``, and every dimension a
node is given is a real one: negative or unknown dims become unknown before the next node
sees them. Control flow (If, Loop, Scan) is inferred by inferring its bodies with the types
the node passes in. Small constant inputs (shape tensors, scales, pads) are given as values, as
onnx does for initializers and Constant nodes.

Inferred types fill the values the model does not declare; a node output whose inferred
element type contradicts the declared one is an error naming the node.
"""

from __future__ import annotations

import functools
import itertools
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
from onnx import TypeProto, numpy_helper

from ..errors import Fail
from .types import ValueType, elem_type_of, shape_text

if TYPE_CHECKING:
    from .graph import Graph, Node

# Constant inputs up to this many elements are given to inference as values.
DATA_ELEMENTS = 4096
_CONTROL_FLOW = frozenset({"If", "Loop", "Scan"})


def infer_graph(
    g: Graph,
    ir_version: int,
    data: dict[str, Any] | None = None,
    symbols: itertools.count | None = None,
    refused: list[Fail] | None = None,
    inferred: dict[str, ValueType] | None = None,
) -> list[Fail]:
    """Infer the types of ``g``'s values (and its subgraphs') in place; ``data``: constant
    values visible from enclosing graphs. A dim inference leaves unknown gets a fresh symbol
    (``unk__N``, as onnx names them), so that later nodes carry it on and dims that are
    provably equal (a Transpose's, a Reshape's) can be recognised as equal.

    Returns the errors of nodes whose inference refused inputs of fully known types (such a
    node is wrong for its inputs): the caller raises the first once the schema checks, whose
    messages are more precise, have had their say. ``inferred``, when given, receives what
    inference found for each node output of ``g`` (declared or not)."""
    symbols = symbols if symbols is not None else itertools.count()
    refused = refused if refused is not None else []
    consts: dict[str, onnx.TensorProto] = dict(data or {})
    for name, arr in g.initializers.items():
        tensor = _small_tensor(name, arr)
        if tensor is not None:
            consts[name] = tensor
    producers = g.producers()
    for node in g.nodes:
        if node.domain == "" and node.op_type in _CONTROL_FLOW:
            outs = _infer_control_flow(node, g, ir_version, consts, symbols, refused)
        else:
            outs = _infer_node(node, g, ir_version, consts, refused)
        for name, t in outs.items():
            t = _namedshape_text(t, symbols)
            if inferred is not None:
                inferred[name] = t
            _merge(g, name, t, producers.get(name))
        if node.op_type == "Constant" and node.domain == "" and node.outputs:
            value = _constant_value(node.attrs)
            if value is not None:
                tensor = _small_tensor(node.outputs[0], value)
                if tensor is not None:
                    consts[node.outputs[0]] = tensor
    return refused


_CONSTANT_ATTRS = {
    "value_int": np.int64,
    "value_ints": np.int64,
    "value_float": np.float32,
    "value_floats": np.float32,
}


def _constant_value(attrs: dict[str, Any]) -> np.ndarray | None:
    """The value of a Constant node with a numeric value attribute."""
    if isinstance(attrs.get("value"), np.ndarray):
        return attrs["value"]
    for name, dtype in _CONSTANT_ATTRS.items():
        if name in attrs:
            return np.asarray(attrs[name], dtype=dtype)
    return None


def _merge(g: Graph, name: str, inferred: ValueType, node: Node | None) -> None:
    declared = g.value_types.get(name)
    if declared is None or declared.kind == "unknown":
        if inferred.kind != "unknown":
            g.value_types[name] = inferred
        return
    if node is not None and _conflicting(declared, inferred):
        raise Fail(
            f"Type Error: Type ({declared.type_str()}) of output arg ({name}) of "
            f"{node.label()} does not match expected type ({inferred.type_str()})"
        )
    if node is not None and shapes_conflict(declared, inferred):
        # A declared shape that contradicts the node's is not an error, as in onnxruntime
        # (which warns "Error merging shape info ... Falling back to lenient merge"): the
        # value keeps only what both agree on, so later nodes are not judged by a wrong shape.
        g.value_types[name] = _union(declared, inferred)


def shapes_conflict(a: ValueType, b: ValueType) -> bool:
    """Whether two tensor types of one value have known shapes of different ranks, or a dim
    whose sizes both know and differ."""
    if a.kind not in ("tensor", "sparse_tensor") or a.kind != b.kind:
        return False
    if a.shape is None or b.shape is None:
        return False
    if len(a.shape) != len(b.shape):
        return True
    return any(_known(x) and _known(y) and x != y for x, y in zip(a.shape, b.shape))


def _known(d: Any) -> bool:
    return isinstance(d, int) and d >= 0


def _union(declared: ValueType, inferred: ValueType) -> ValueType:
    """What two conflicting shapes of one value agree on (onnx's UnionShapeInfo): nothing
    when the ranks differ, else the dims they share."""
    assert declared.shape is not None and inferred.shape is not None
    if len(declared.shape) != len(inferred.shape):
        return ValueType(declared.kind, declared.elem_type, None)
    dims = tuple(d if d == i else None for d, i in zip(declared.shape, inferred.shape))
    return ValueType(declared.kind, declared.elem_type, dims)


def _conflicting(declared: ValueType, inferred: ValueType) -> bool:
    """Whether two types of one value disagree on the kind or element type of a tensor."""
    if declared.kind == "unknown" or inferred.kind == "unknown":
        return False
    if declared.kind != inferred.kind:
        return True
    if declared.kind in ("tensor", "sparse_tensor"):
        return bool(declared.elem_type and inferred.elem_type) and (
            declared.elem_type != inferred.elem_type
        )
    if declared.inner is not None and inferred.inner is not None:
        return _conflicting(declared.inner, inferred.inner)
    return False


def _small_tensor(name: str, arr: Any) -> onnx.TensorProto | None:
    if not isinstance(arr, np.ndarray) or arr.size > DATA_ELEMENTS or arr.dtype == object:
        return None
    try:
        elem_type_of(arr.dtype)
        return numpy_helper.from_array(np.asarray(arr, order="C"), name)
    except Exception:
        return None


def _namedshape_text(t: ValueType, symbols: itertools.count) -> ValueType:
    """``t`` with negative dims (the next node must never see one) and unknown dims replaced
    by fresh symbols."""
    if t.kind in ("tensor", "sparse_tensor") and t.shape is not None:
        if any(d is None or (isinstance(d, int) and d < 0) for d in t.shape):
            shape = tuple(
                f"unk__{next(symbols)}" if d is None or (isinstance(d, int) and d < 0) else d
                for d in t.shape
            )
            return ValueType(t.kind, t.elem_type, shape)
        return t
    if t.inner is not None:
        return ValueType(
            t.kind, t.elem_type, t.shape, _namedshape_text(t.inner, symbols), t.key_type
        )
    return t


def type_proto(t: ValueType | None) -> TypeProto:
    """A TypeProto of a value type (empty when unknown), with only real dims."""
    tp = TypeProto()
    if t is None:
        return tp
    if t.kind in ("tensor", "sparse_tensor"):
        tt = tp.tensor_type if t.kind == "tensor" else tp.sparse_tensor_type
        tt.elem_type = t.elem_type
        if t.shape is not None:
            shape = tt.shape
            shape.SetInParent()
            for d in t.shape:
                dim = shape.dim.add()
                if isinstance(d, int) and d >= 0:
                    dim.dim_value = d
                elif isinstance(d, str) and d:
                    dim.dim_param = d
    elif t.kind == "sequence" and t.inner is not None:
        tp.sequence_type.elem_type.CopyFrom(type_proto(t.inner))
    elif t.kind == "optional" and t.inner is not None:
        tp.optional_type.elem_type.CopyFrom(type_proto(t.inner))
    elif t.kind == "map" and t.inner is not None:
        tp.map_type.key_type = t.key_type
        tp.map_type.value_type.CopyFrom(type_proto(t.inner))
    return tp


def _infer_node(
    node: Node,
    g: Graph,
    ir_version: int,
    consts: dict[str, onnx.TensorProto],
    refused: list[Fail],
) -> dict[str, ValueType]:
    if node.proto is None or node.subgraphs:
        return {}
    schema = _schema(node.op_type, node.opset, node.domain)
    if schema is None:
        return {}  # custom domains: no inference function here
    known = {name: g.type_of(name) for name in node.inputs if name}
    types = {name: type_proto(t) for name, t in known.items()}
    data = {name: consts[name] for name in node.inputs if name in consts}
    opsets = _opset_ids(tuple(sorted(g.opsets.items())))
    try:
        out = onnx.shape_inference.infer_node_outputs(
            schema, node.proto, types, data, opset_imports=opsets, ir_version=ir_version
        )
    except Exception as e:
        # With every input's type known, the node is wrong for its inputs (onnxruntime
        # refuses such a model too); with some unknown, inference may only lack them.
        if all(_fully_typed(t) for t in known.values()):
            refused.append(Fail(f"{node.label()}: {str(e).strip()}"))
        return {}
    return {name: ValueType.from_proto(tp) for name, tp in out.items() if name}


@functools.lru_cache(maxsize=4096)
def _schema(op_type: str, opset: int, domain: str) -> Any:
    try:
        return onnx.defs.get_schema(op_type, opset, domain)
    except Exception:
        return None


@functools.lru_cache(maxsize=64)
def _opset_ids(opsets: tuple[tuple[str, int], ...]) -> list[onnx.OperatorSetIdProto]:
    return [onnx.helper.make_opsetid(dom, ver) for dom, ver in opsets]


def _fully_typed(t: ValueType | None) -> bool:
    if t is None:
        return False
    if t.kind in ("tensor", "sparse_tensor"):
        return bool(t.elem_type) and t.shape is not None
    if t.kind in ("sequence", "optional"):
        return _fully_typed(t.inner)
    return False


def _body_inputs(body: Graph, passed: list[ValueType | None]) -> None:
    """Untyped body inputs take the types the node passes in."""
    for vi, t in zip(body.inputs, passed):
        declared = body.value_types.get(vi.name)
        if (declared is None or declared.kind == "unknown") and t is not None:
            body.value_types[vi.name] = t


def _infer_control_flow(
    node: Node,
    g: Graph,
    ir_version: int,
    consts: dict[str, onnx.TensorProto],
    symbols: itertools.count,
    refused: list[Fail],
) -> dict[str, ValueType]:
    out: dict[str, ValueType] = {}
    if node.op_type == "If":
        branches = [node.subgraphs.get(k) for k in ("then_branch", "else_branch")]
        for body in branches:
            if body is not None:
                infer_graph(body, ir_version, consts, symbols, refused)
        then = branches[0]
        if then is not None:
            for name, vi in zip(node.outputs, then.outputs):
                t = then.type_of(vi.name)
                if name and t is not None:
                    out[name] = t
        return out
    body = node.subgraphs.get("body")
    if body is None:
        return out
    scalar = ValueType("tensor", onnx.TensorProto.INT64, ())
    if node.op_type == "Loop":
        n_carried = len(node.inputs) - 2
        carried = [g.type_of(x) if x else None for x in node.inputs[2:]]
        _body_inputs(body, [scalar, ValueType("tensor", onnx.TensorProto.BOOL, ()), *carried])
        infer_graph(body, ir_version, consts, symbols, refused)
        body_outs = [body.type_of(vi.name) for vi in body.outputs[1:]]
        for k, name in enumerate(node.outputs):
            t = body_outs[k] if k < len(body_outs) else None
            if not name or t is None:
                continue
            out[name] = t if k < n_carried else _stacked(t, 0)
        return out
    # Scan-9+: (states..., scan inputs...) -> (states..., scan outputs...)
    n_scan = node.attrs.get("num_scan_inputs")
    if node.since_version < 9 or not isinstance(n_scan, int):
        return out
    n_state = len(node.inputs) - n_scan
    passed: list[ValueType | None] = [g.type_of(x) if x else None for x in node.inputs[:n_state]]
    in_axes = list(node.attrs.get("scan_input_axes") or [])
    for j, x in enumerate(node.inputs[n_state:]):  # a slice: the input without its scan axis
        axis = in_axes[j] if j < len(in_axes) else 0
        passed.append(sliced_type(g.type_of(x) if x else None, axis))
    _body_inputs(body, passed)
    found: dict[str, ValueType] = {}
    infer_graph(body, ir_version, consts, symbols, refused, found)
    refused.extend(_scan_body_output_errors(node, g, body, found, n_state))
    axes = list(node.attrs.get("scan_output_axes") or [])
    for k, (name, vi) in enumerate(zip(node.outputs, body.outputs)):
        t = body.type_of(vi.name)
        if not name or t is None:
            continue
        if k < n_state:
            out[name] = t
        else:
            j = k - n_state
            out[name] = _stacked(t, axes[j] if j < len(axes) else 0)
    return out


def _scan_body_output_errors(
    node: Node, g: Graph, body: Graph, found: dict[str, ValueType], n_state: int
) -> list[Fail]:
    """What onnxruntime refuses in a Scan's body outputs: a declared rank the producing node
    contradicts (the value is left without a shape, and onnxruntime's Scan needs one for
    every body output, "Subgraph must have the shape set for all outputs"), and a state
    whose shape the body changes (a state keeps the shape it enters with)."""
    errors: list[Fail] = []
    for k, vi in enumerate(body.outputs):
        declared, computed = vi.type, found.get(vi.name)
        if (
            computed is not None
            and declared.shape is not None
            and computed.shape is not None
            and len(declared.shape) != len(computed.shape)
        ):
            errors.append(
                Fail(
                    f"{node.label()}: body output '{vi.name}' is declared with rank "
                    f"{len(declared.shape)} but computed with rank {len(computed.shape)}; a "
                    "Scan body output needs a consistent shape"
                )
            )
        if k < n_state and k < len(node.inputs) and node.inputs[k]:
            entering, leaving = g.type_of(node.inputs[k]), body.type_of(vi.name)
            if leaving is not None and leaving.shape is None and computed is not None:
                leaving = computed  # what the body declares without a shape, it computes
            if entering is not None and leaving is not None and shapes_conflict(entering, leaving):
                errors.append(
                    Fail(
                        f"{node.label()}: state {k} enters the body as '{node.inputs[k]}' of "
                        f"shape {shape_text(entering.shape)} and leaves it as '{vi.name}' of shape "
                        f"{shape_text(leaving.shape)}; a Scan state keeps its shape"
                    )
                )
    return errors


def sliced_type(t: ValueType | None, axis: int) -> ValueType | None:
    """The type of one slice of a value of type ``t`` along ``axis``."""
    if t is None or t.kind != "tensor":
        return None
    if t.shape is None:
        return ValueType("tensor", t.elem_type, None)
    rank = len(t.shape)
    axis = axis + rank if axis < 0 else axis
    if not 0 <= axis < rank:
        return None
    return ValueType("tensor", t.elem_type, t.shape[:axis] + t.shape[axis + 1 :])


def _stacked(t: ValueType, axis: int) -> ValueType:
    """The type of values of type ``t`` stacked along a new ``axis`` of unknown length."""
    if t.kind != "tensor":
        return ValueType("unknown")
    if t.shape is None:
        return ValueType("tensor", t.elem_type, None)
    rank = len(t.shape) + 1
    axis = axis + rank if axis < 0 else axis
    if not 0 <= axis < rank:
        return ValueType("tensor", t.elem_type, None)
    shape = list(t.shape)
    shape.insert(axis, None)
    return ValueType("tensor", t.elem_type, tuple(shape))
