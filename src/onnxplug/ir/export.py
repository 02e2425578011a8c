"""The in-memory graph back to ONNX: what ``SessionOptions.optimized_model_filepath`` writes.

Nodes are written from their decoded attributes (the optimizer changes and creates nodes), with
each attribute's type taken from the node's original NodeProto where it had one (so that an
empty list keeps its type). Types of values come from the graph's value types, shapes included.
The fused ops the optimizer writes keep their domains (``com.microsoft``, ``ai.onnxplug``), which
are imported at version 1.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import AttributeProto, GraphProto, ModelProto, TypeProto, helper, numpy_helper

from .graph import Graph, Node
from .types import ValueType

_A = AttributeProto


def type_proto(t: ValueType) -> TypeProto | None:
    """The TypeProto of a value type (None for an unknown type)."""
    tp = TypeProto()
    if t.kind in ("tensor", "sparse_tensor"):
        if not t.elem_type:  # element type 0 is not a type (onnxruntime refuses it)
            return None
        tt = tp.tensor_type if t.kind == "tensor" else tp.sparse_tensor_type
        tt.elem_type = t.elem_type
        if t.shape is not None:
            tt.shape.SetInParent()
            for d in t.shape:
                dim = tt.shape.dim.add()
                if isinstance(d, int):
                    dim.dim_value = d
                elif isinstance(d, str):
                    dim.dim_param = d
        return tp
    if t.kind in ("sequence", "optional") and t.inner is not None:
        inner = type_proto(t.inner)
        if inner is None:
            return None
        target = tp.sequence_type if t.kind == "sequence" else tp.optional_type
        target.elem_type.CopyFrom(inner)
        return tp
    if t.kind == "map" and t.inner is not None:
        inner = type_proto(t.inner)
        if inner is None:
            return None
        tp.map_type.key_type = t.key_type
        tp.map_type.value_type.CopyFrom(inner)
        return tp
    return None


def _value_info(name: str, t: ValueType | None) -> onnx.ValueInfoProto:
    vi = onnx.ValueInfoProto(name=name)
    tp = type_proto(t) if t is not None else None
    if tp is not None:
        vi.type.CopyFrom(tp)
    return vi


def _attribute(name: str, value: Any, old: AttributeProto | None) -> AttributeProto:
    kind = old.type if old is not None else None
    if isinstance(value, Graph):
        return helper.make_attribute(name, graph_to_proto(value))
    if isinstance(value, ValueType):
        return helper.make_attribute(name, type_proto(value))
    if isinstance(value, np.ndarray) and kind != _A.SPARSE_TENSOR:
        return helper.make_attribute(name, numpy_helper.from_array(value, name=""))
    if kind == _A.SPARSE_TENSOR and old is not None:
        return old  # kept as the model wrote it (the runtime holds it dense)
    if isinstance(value, str):
        a = AttributeProto(name=name, type=_A.STRING)
        a.s = value.encode("utf-8", errors="surrogateescape")
        return a
    if isinstance(value, list):
        if not value and kind is not None:
            return AttributeProto(name=name, type=kind)
        if value and isinstance(value[0], Graph):
            return helper.make_attribute(name, [graph_to_proto(g) for g in value])
        if value and isinstance(value[0], np.ndarray):
            return helper.make_attribute(name, [numpy_helper.from_array(v) for v in value])
        if value and isinstance(value[0], str):
            a = AttributeProto(name=name, type=_A.STRINGS)
            a.strings.extend(v.encode("utf-8", errors="surrogateescape") for v in value)
            return a
        if kind == _A.FLOATS:
            return helper.make_attribute(name, [float(v) for v in value], attr_type=_A.FLOATS)
    if kind == _A.FLOAT:
        return helper.make_attribute(name, float(value), attr_type=_A.FLOAT)
    return helper.make_attribute(name, value)


def node_to_proto(node: Node) -> onnx.NodeProto:
    old = {a.name: a for a in node.proto.attribute} if node.proto is not None else {}
    p = onnx.NodeProto(op_type=node.op_type, name=node.name, domain=node.domain, input=node.inputs)
    p.output.extend(node.outputs)
    if node.proto is not None:
        p.doc_string = node.proto.doc_string
    for k, v in node.attrs.items():
        p.attribute.append(_attribute(k, v, old.get(k)))
    return p


def graph_to_proto(g: Graph, extra_initializers: dict[str, np.ndarray] | None = None) -> GraphProto:
    """``g`` as a GraphProto; ``extra_initializers`` are written with its own (the session
    keeps initializers that are also graph inputs apart from the graph)."""
    gp = GraphProto(name=g.name, doc_string=g.doc)
    gp.node.extend(node_to_proto(n) for n in g.nodes)
    gp.input.extend(_value_info(vi.name, vi.type) for vi in g.inputs)
    gp.output.extend(_value_info(vi.name, vi.type) for vi in g.outputs)
    inits = {**g.initializers, **(extra_initializers or {})}
    gp.initializer.extend(numpy_helper.from_array(np.asarray(v), name=k) for k, v in inits.items())
    listed = {vi.name for vi in (*g.inputs, *g.outputs)} | set(inits)
    for n in g.nodes:
        for o in n.outputs:
            t = g.value_types.get(o)
            if o and o not in listed and t is not None and type_proto(t) is not None:
                gp.value_info.append(_value_info(o, t))
    return gp


def _domains(g: Graph, out: set[str]) -> set[str]:
    for n in g.nodes:
        out.add(n.domain)
        for sg in n.subgraphs.values():
            _domains(sg, out)
    return out


def model_to_proto(
    g: Graph, like: ModelProto, extra_initializers: dict[str, np.ndarray] | None = None
) -> ModelProto:
    """The model ``like`` with its graph replaced by ``g``; opset imports for every domain
    the graph uses (fused ops' domains at version 1)."""
    m = ModelProto()
    m.CopyFrom(like)
    m.graph.CopyFrom(graph_to_proto(g, extra_initializers))
    opsets = {("" if i.domain == "ai.onnx" else i.domain): i.version for i in like.opset_import}
    for d in _domains(g, set()) - set(opsets):
        opsets[d] = 1
    del m.opset_import[:]
    m.opset_import.extend(helper.make_opsetid(d, v) for d, v in sorted(opsets.items()))
    del m.functions[:]  # local functions were inlined when the model was loaded
    return m
