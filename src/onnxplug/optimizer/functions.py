"""Expanding an ONNX function-bodied op (e.g. Celu, LayerNormalization, Gelu) into its body.

The partitioner calls this for a node no provider has a kernel for; the body's nodes are then
partitioned like any other. Context-dependent bodies are built from the node's input types.
"""

from __future__ import annotations

import onnx
from onnx import AttributeProto, FunctionProto, NodeProto

from ..ir.graph import Graph, Node, _node_from_proto


def function_body(node: Node, graph: Graph) -> FunctionProto | None:
    try:
        schema = onnx.defs.get_schema(node.op_type, node.opset, node.domain)
    except Exception:
        return None
    data = b""
    plain = [v for v in schema.function_opset_versions if v <= node.opset]
    if plain:
        data = schema.get_function_with_opset_version(max(plain))
    if not data:
        ctx_versions = [
            v for v in schema.context_dependent_function_opset_versions if v <= node.opset
        ]
        if not ctx_versions or node.proto is None:
            return None
        types = []
        for name in node.inputs:
            t = _type_proto(graph, name) if name else onnx.TypeProto()
            if t is None:
                return None  # needs input types we do not know
            types.append(t.SerializeToString())
        try:
            data = schema.get_context_dependent_function_with_opset_version(
                max(ctx_versions), node.proto.SerializeToString(), types
            )
        except Exception:
            return None
    if not data:
        return None
    fp = FunctionProto()
    fp.ParseFromString(data)
    return fp


def _type_proto(graph: Graph, name: str) -> onnx.TypeProto | None:
    t = graph.type_of(name)
    if t is None or t.kind != "tensor" or not t.elem_type:
        return None
    dims = None if t.shape is None else [d if isinstance(d, int) else None for d in t.shape]
    return onnx.helper.make_tensor_type_proto(t.elem_type, dims)


def expand(node: Node, graph: Graph) -> list[Node] | None:
    """The body of ``node`` as graph nodes (names made unique), or None if it has none."""
    fp = function_body(node, graph)
    if fp is None:
        return None
    opsets = dict(graph.opsets)
    for imp in fp.opset_import:
        opsets["" if imp.domain == "ai.onnx" else imp.domain] = int(imp.version)
    rename: dict[str, str] = {"": ""}
    for formal, actual in zip(fp.input, node.inputs):
        rename[formal] = actual
    for formal in fp.input[len(node.inputs) :]:
        rename[formal] = ""
    for formal, actual in zip(fp.output, node.outputs):
        if actual:  # a skipped optional output stays internal to the body
            rename[formal] = actual
    prefix = graph.unique_name(f"{node.name}")
    defaults = {a.name: a for a in fp.attribute_proto}
    out: list[Node] = []
    for i, bn in enumerate(fp.node):
        p = NodeProto()
        p.CopyFrom(bn)
        p.name = f"{prefix}/{bn.name or bn.op_type}_{i}"
        del p.input[:]
        del p.output[:]
        for name in bn.input:
            p.input.append(rename.setdefault(name, f"{prefix}/{name}"))
        for name in bn.output:
            p.output.append(rename.setdefault(name, f"{prefix}/{name}"))
        attrs = []
        for a in bn.attribute:
            if a.ref_attr_name:
                src = node.proto.attribute if node.proto is not None else []
                found = next((x for x in src if x.name == a.ref_attr_name), None)
                if found is None:
                    found = defaults.get(a.ref_attr_name)
                if found is None:
                    continue
                b = AttributeProto()
                b.CopyFrom(found)
                b.name = a.name
                attrs.append(b)
            else:
                attrs.append(a)
        del p.attribute[:]
        p.attribute.extend(attrs)
        out.append(_node_from_proto(p, graph, opsets, i))
    return out
