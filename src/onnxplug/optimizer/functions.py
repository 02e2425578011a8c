"""Expanding an ONNX function-bodied op (e.g. Celu, LayerNormalization, Gelu) into its body.

The partitioner calls this for a node no provider has a kernel for; the body's nodes are then
partitioned like any other. Context-dependent bodies are built from the node's input types.

A body is written in terms of formal names and attribute references: formal inputs and
outputs become the node's actual values, every other name gets a unique prefix (also inside
subgraphs of the body, e.g. AffineGrid's ``If`` branches, so that two expansions of the same
function never collide), and ``@attr`` references take the node's attribute, else the
function's own default, else the schema's default.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, cast

import onnx
from onnx import AttributeProto, FunctionProto, GraphProto, NodeProto

from ..ir.graph import Graph, Node, _node_from_proto


class _FunctionSchema(Protocol):
    """The function-body accessors of ``onnx.defs.OpSchema`` (present in onnx's C++ bindings
    but missing from its type stubs)."""

    function_opset_versions: Sequence[int]
    context_dependent_function_opset_versions: Sequence[int]

    def get_function_with_opset_version(self, opset_version: int) -> bytes: ...

    def get_context_dependent_function_with_opset_version(
        self, opset_version: int, node_proto: bytes, input_types: list[bytes]
    ) -> bytes: ...


def _schema(node: Node) -> onnx.defs.OpSchema | None:
    try:
        return onnx.defs.get_schema(node.op_type, node.opset, node.domain)
    except Exception:
        return None


def function_body(node: Node, graph: Graph) -> FunctionProto | None:
    found = _schema(node)
    if found is None:
        return None
    schema = cast(_FunctionSchema, found)
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


def _attribute_source(node: Node, fp: FunctionProto) -> Callable[[str], AttributeProto | None]:
    """Looks up the value an ``@name`` reference in the body stands for."""
    given = {a.name: a for a in node.proto.attribute} if node.proto is not None else {}
    fn_defaults = {a.name: a for a in fp.attribute_proto}
    schema = _schema(node)
    schema_attrs = schema.attributes if schema is not None else {}

    def find(name: str) -> AttributeProto | None:
        if name in given:
            return given[name]
        if name in fn_defaults:
            return fn_defaults[name]
        # Functions such as MeanVarianceNormalization leave the default (axes=[0,2,3]) to the
        # schema; an attribute with no default that the node omits stays unset.
        spec = schema_attrs.get(name)
        if spec is not None and spec.default_value.type != AttributeProto.UNDEFINED:
            return spec.default_value
        return None

    return find


def _rewrite_attributes(
    attrs: list[AttributeProto],
    lookup: Callable[[str], AttributeProto | None],
    rename: Callable[[str], str],
) -> list[AttributeProto]:
    out: list[AttributeProto] = []
    for a in attrs:
        if a.ref_attr_name:
            found = lookup(a.ref_attr_name)
            if found is None:
                continue
            b = AttributeProto()
            b.CopyFrom(found)
            b.name = a.name
            out.append(b)
            continue
        b = AttributeProto()
        b.CopyFrom(a)
        if b.type == AttributeProto.GRAPH:
            _rewrite_graph(b.g, lookup, rename)
        elif b.type == AttributeProto.GRAPHS:
            for g in b.graphs:
                _rewrite_graph(g, lookup, rename)
        out.append(b)
    return out


def _rewrite_node(
    p: NodeProto,
    lookup: Callable[[str], AttributeProto | None],
    rename: Callable[[str], str],
) -> None:
    ins = [rename(x) for x in p.input]
    outs = [rename(x) for x in p.output]
    attrs = _rewrite_attributes(list(p.attribute), lookup, rename)
    del p.input[:]
    del p.output[:]
    del p.attribute[:]
    p.input.extend(ins)
    p.output.extend(outs)
    p.attribute.extend(attrs)


def _rewrite_graph(
    g: GraphProto,
    lookup: Callable[[str], AttributeProto | None],
    rename: Callable[[str], str],
) -> None:
    """Renames every value of a body subgraph in place (names it reads from the body map to
    the body's renamed values) and resolves attribute references inside it."""
    for vi in [*g.input, *g.output, *g.value_info]:
        vi.name = rename(vi.name)
    for t in g.initializer:
        t.name = rename(t.name)
    for sp in g.sparse_initializer:
        sp.values.name = rename(sp.values.name)
        sp.indices.name = rename(sp.indices.name)
    for n in g.node:
        _rewrite_node(n, lookup, rename)


def expand(node: Node, graph: Graph) -> list[Node] | None:
    """The body of ``node`` as graph nodes (names made unique), or None if it has none."""
    fp = function_body(node, graph)
    if fp is None:
        return None
    opsets = dict(graph.opsets)
    for imp in fp.opset_import:
        opsets["" if imp.domain == "ai.onnx" else imp.domain] = int(imp.version)
    names: dict[str, str] = {"": ""}
    for formal, actual in zip(fp.input, node.inputs):
        names[formal] = actual
    for formal in fp.input[len(node.inputs) :]:
        names[formal] = ""  # an omitted optional input
    for formal, actual in zip(fp.output, node.outputs):
        if actual:  # a skipped optional output stays internal to the body
            names[formal] = actual
    prefix = graph.unique_name(f"{node.name}")

    def rename(name: str) -> str:
        return names.setdefault(name, f"{prefix}/{name}")

    lookup = _attribute_source(node, fp)
    out: list[Node] = []
    for i, bn in enumerate(fp.node):
        p = NodeProto()
        p.CopyFrom(bn)
        p.name = f"{prefix}/{bn.name or bn.op_type}_{i}"
        _rewrite_node(p, lookup, rename)
        out.append(_node_from_proto(p, graph, opsets, i))
    return out
