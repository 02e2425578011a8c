"""NHWC layout transformation and the transpose optimizer (level >= 3, ``ORT_ENABLE_LAYOUT``).

**Layout** (onnxruntime's layout transformer, for a provider whose ``get_preferred_data_layout``
is ``"NHWC"``, e.g. the CUDA provider with ``prefer_nhwc=1``): each 2-D (rank-4 X) float16 /
float32 node of an op with an NHWC form (``ir.nhwc.NHWC_OPS``: Conv, FusedConv, MaxPool without
Indices, AveragePool, GlobalAveragePool, GlobalMaxPool) becomes

    Transpose(X, perm=[0, 2, 3, 1]) -> <op in NHWC_DOMAIN> -> Transpose(perm=[0, 3, 1, 2]) -> Y

where Y keeps its name and NCHW layout (graph outputs are unchanged). A convolution's W becomes
(M, kH, kW, C/group): a constant W is repacked once into a new initializer (the original stays
while other nodes read it), another W gets a ``Transpose(perm=[0, 2, 3, 1])``; FusedConv's Z is
transposed like X. A node is converted only where the provider that would run it prefers NHWC:
the first provider (priority order) whose registry has the NHWC op or the node's own op must
have the NHWC op, prefer NHWC, not refuse the op (``should_convert_data_layout_for_op`` 0; -1
lets the host decide, which converts every op of ``NHWC_OPS``) and take the NHWC node (its
``takes``: get_capability and a kernel for the node's types, see ``fusions.ProviderPolicy``).

**Transpose optimizer** (``TransposeOptimizer``), on graphs the layout pass changed, to a fixed
point: ``Transpose(p2)(Transpose(p1)(x))`` -> x when the two cancel (one Transpose of the
composed perm otherwise); Transposes of one value with one perm become one; a Transpose is
pushed down through a layout-agnostic elementwise node
(unary ops; Add/Sub/Mul/Div/Max/Min whose inputs are all Transposes of one perm or constants,
which are transposed instead), when that removes a Transpose or lets one cancel, so that the
Transposes between consecutive NHWC nodes go and a CNN's trunk runs channels-last with one
Transpose at its input and one at its end. Graph outputs keep their names and layout; values
read by subgraphs (implicit inputs) are not renamed; nodes with subgraphs are not pushed
through. Dead Transposes and unused initializers go.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx

from ..ir.graph import Graph, Node, read_only, tensor_dtype
from ..ir.nhwc import NHWC_DOMAIN, NHWC_OPS
from ..ir.types import ValueType
from .fusions import _drop_unused_initializers, _new_onnx_node

NHWC = "NHWC"
NHWC_TYPES = frozenset({"float16", "float32"})
TO_NHWC = (0, 2, 3, 1)
TO_NCHW = (0, 3, 1, 2)

# Elementwise ops that commute with a Transpose of their (first) input: every other input is a
# constant scalar (Clip's bounds) or absent
UNARY_OPS = frozenset(
    {
        "Relu",
        "LeakyRelu",
        "Sigmoid",
        "HardSigmoid",
        "HardSwish",
        "Tanh",
        "Elu",
        "Selu",
        "Celu",
        "Softplus",
        "Softsign",
        "Gelu",
        "Clip",
        "Cast",
        "Identity",
        "Neg",
        "Abs",
        "Exp",
        "Log",
        "Sqrt",
        "Reciprocal",
        "Floor",
        "Ceil",
        "Round",
        "Erf",
        "Sign",
    }
)
# Broadcasting elementwise ops: pushed through when every input is a Transpose of one perm or a
# constant
BINARY_OPS = frozenset({"Add", "Sub", "Mul", "Div", "Max", "Min"})


def _layout(target: Any) -> str:
    get = getattr(target, "get_preferred_data_layout", None)
    return str(get()) if get is not None else "NCHW"


def _permuted(t: ValueType | None, perm: Sequence[int]) -> ValueType | None:
    """The type of ``Transpose(v, perm)`` for ``v`` of type ``t`` (None: not a known tensor)."""
    if t is None or t.kind != "tensor" or not t.elem_type:
        return None
    shape = None
    if t.shape is not None and len(t.shape) == len(perm):
        shape = tuple(t.shape[p] for p in perm)
    return ValueType("tensor", t.elem_type, shape)


def _inverse(perm: Sequence[int]) -> list[int]:
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return inv


# ---------------------------------------------------------------------------------------------
# Layout transformation


def convert_to_nhwc(g: Graph, targets: Sequence[Any] | None) -> int:
    """Rewrite the nodes of ``g`` (not its subgraphs) that the provider which would run them
    wants in NHWC (``targets``: the session's providers in priority order); returns how many."""
    targets = list(targets or [])
    if not any(_layout(t) == NHWC for t in targets):
        return 0
    repacked: dict[str, str] = {}  # OIHW weight initializer -> its OHWI copy
    nodes: list[Node] = []
    count = 0
    for n in g.nodes:
        new = _to_nhwc(g, n, targets, repacked)
        nodes.extend(new if new is not None else [n])
        count += new is not None
    if count:
        g.nodes = nodes
        g.opsets.setdefault(NHWC_DOMAIN, 1)
        _drop_unused_initializers(g)
    return count


def _eligible(g: Graph, n: Node) -> bool:
    """An op with an NHWC form, 2-D (rank-4 X) float16/float32, with a single output."""
    if (n.domain, n.op_type) not in NHWC_OPS or n.subgraphs:
        return False
    if len(n.outputs) != 1 or not n.outputs[0] or not n.inputs or not n.inputs[0]:
        return False  # MaxPool with Indices has two outputs
    x = g.type_of(n.inputs[0])
    dt = tensor_dtype(g, n.inputs[0])
    if x is None or x.shape is None or len(x.shape) != 4 or dt is None:
        return False
    if dt.name not in NHWC_TYPES or len(n.attrs.get("kernel_shape", (1, 1))) != 2:
        return False
    if n.op_type in ("Conv", "FusedConv"):
        if len(n.inputs) < 2 or not n.inputs[1] or tensor_dtype(g, n.inputs[1]) != dt:
            return False
        w = g.type_of(n.inputs[1])
        if w is not None and w.shape is not None and len(w.shape) != 4:
            return False
    return True


def _to_nhwc(g: Graph, n: Node, targets: list[Any], repacked: dict[str, str]) -> list[Node] | None:
    """The nodes replacing ``n`` (Transposes around its NHWC form), None when it stays."""
    if not _eligible(g, n):
        return None
    before: list[Node] = []
    typed: list[str] = []  # values typed here: untyped again when the node stays

    def transposed(name: str, perm: Sequence[int]) -> str:
        new = g.unique_name(f"{name}_nhwc")
        t = _permuted(g.type_of(name), perm)
        if t is not None:
            g.value_types[new] = t
            typed.append(new)
        before.append(_new_onnx_node(g, "Transpose", [name], [new], {"perm": list(perm)}, n))
        return new

    ins = list(n.inputs)
    ins[0] = transposed(ins[0], TO_NHWC)
    if n.op_type in ("Conv", "FusedConv"):
        w = ins[1]
        if w in g.initializers:
            if w not in repacked:
                repacked[w] = g.unique_name(f"{w}_ohwi")
                # a transposed view: the build copies it out, on a helper thread, for the
                # device it goes to (``control_flow.contiguous_copies``)
                g.initializers[repacked[w]] = read_only(np.transpose(g.initializers[w], TO_NHWC))
            ins[1] = repacked[w]
        else:
            ins[1] = transposed(w, TO_NHWC)
        if n.op_type == "FusedConv" and len(ins) > 3 and ins[3]:
            ins[3] = transposed(ins[3], TO_NHWC)
    y = n.outputs[0]
    y_nhwc = g.unique_name(f"{y}_nhwc")
    y_type = g.type_of(y)
    if y_type is None or y_type.kind != "tensor" or not y_type.elem_type:
        x_type = g.type_of(n.inputs[0])
        y_type = ValueType("tensor", x_type.elem_type if x_type else 0, (None,) * 4)
    g.value_types[y_nhwc] = _permuted(y_type, TO_NHWC) or y_type
    typed.append(y_nhwc)
    node = Node(
        name=n.name,
        op_type=n.op_type,
        domain=NHWC_DOMAIN,
        inputs=ins,
        outputs=[y_nhwc],
        attrs=dict(n.attrs),
        since_version=1,
        opset=1,
    )
    if not _converts(g, n, node, targets):
        for name in typed:
            del g.value_types[name]
        return None
    after = _new_onnx_node(g, "Transpose", [y_nhwc], [y], {"perm": list(TO_NCHW)}, n)
    return [*before, node, after]


def _converts(g: Graph, old: Node, new: Node, targets: list[Any]) -> bool:
    """Whether the provider that would run ``old`` wants it as ``new`` (see the module doc)."""
    for t in targets:
        if t.has_op(new.op_type, NHWC_DOMAIN):
            if _layout(t) != NHWC:
                return False
            ask = getattr(t, "should_convert_data_layout_for_op", None)
            if ask is not None and ask(old.domain, old.op_type, NHWC) == 0:
                return False
            takes = getattr(t, "takes", None)
            return takes is None or bool(takes(new, g))
        if t.has_op(old.op_type, old.domain):
            return False
    return False


# ---------------------------------------------------------------------------------------------
# Transpose optimizer


class _Edges:
    """Producers and readers of the values of one graph (rebuilt after each rewrite)."""

    def __init__(self, g: Graph):
        self.g = g
        self.producer = g.producers()
        self.readers = g.consumers()
        self.outputs = {vi.name for vi in g.outputs}

    def perm(self, n: Node | None) -> list[int] | None:
        """The perm of a Transpose node (its default, reversed axes, when the rank is known)."""
        if n is None or n.op_type != "Transpose" or n.domain != "" or len(n.inputs) != 1:
            return None
        if len(n.outputs) != 1 or not n.outputs[0]:
            return None
        perm = n.attrs.get("perm")
        if perm is None:
            t = self.g.type_of(n.inputs[0])
            if t is None or t.shape is None:
                return None
            perm = list(reversed(range(len(t.shape))))
        return [int(p) for p in perm]

    def transpose_of(self, name: str) -> tuple[Node, list[int]] | None:
        n = self.producer.get(name)
        perm = self.perm(n)
        return (n, perm) if n is not None and perm is not None else None

    def renamable(self, name: str) -> bool:
        """Whether the readers of ``name`` can be given another value instead: not a graph
        output, not read by a subgraph."""
        if name in self.outputs:
            return False
        return not any(name in r.implicit_inputs for r in self.readers.get(name, []))

    def read_only_by(self, name: str, node: Node) -> bool:
        return self.renamable(name) and all(r is node for r in self.readers.get(name, []))


def optimize_transposes(g: Graph) -> int:
    """Cancel and push down the Transposes of ``g`` (not its subgraphs) to a fixed point;
    returns how many rewrites were made."""
    rewrites = 0
    for _ in range(4 * len(g.nodes) + 16):  # each round removes or lowers a Transpose
        _remove_dead_transposes(g)
        edges = _Edges(g)
        done = _cancel_all(edges) or int(_merge_one(edges) or _push_one(edges))
        if not done:
            break
        rewrites += done
    _remove_dead_transposes(g)
    _drop_unused_initializers(g)
    return rewrites


def _remove_dead_transposes(g: Graph) -> None:
    while True:
        outputs = {vi.name for vi in g.outputs}
        read = {i for n in g.nodes for i in (*n.inputs, *n.implicit_inputs)}
        dead = {
            id(n)
            for n in g.nodes
            if n.op_type == "Transpose"
            and n.domain == ""
            and not any(o in read or o in outputs for o in n.outputs if o)
        }
        if not dead:
            return
        g.nodes = [n for n in g.nodes if id(n) not in dead]


def _cancel_all(e: _Edges) -> int:
    """``_cancel_one`` for every Transpose of a Transpose whose rewrite touches no node an
    earlier one of the round touched (so ``e`` still holds for it): ResNet-50's 70
    cancellations take a few rounds instead of 70, each rebuilding the edges. Returns how
    many rewrites were made."""
    touched: set[int] = set()
    made = 0
    for t2 in list(e.g.nodes):
        if _cancel_one(e, t2, touched):
            made += 1
    return made


def _cancel_one(e: _Edges, t2: Node, touched: set[int]) -> bool:
    """A Transpose ``t2`` of a Transpose: removed when the perms cancel (its readers read the
    first one's input), else made one Transpose of the composed perm. Not where a node it
    would change is in ``touched`` (changed earlier in this round); the nodes it changes are
    added there."""
    g = e.g
    p2 = e.perm(t2)
    first = e.transpose_of(t2.inputs[0]) if p2 is not None else None
    if p2 is None or first is None or len(first[1]) != len(p2):
        return False
    t1, p1 = first
    src, y = t1.inputs[0], t2.outputs[0]
    readers = e.readers.get(y, [])
    src_side = [e.producer.get(src), *e.readers.get(src, [])]
    if any(id(n) in touched for n in (t1, t2, *readers, *src_side) if n is not None):
        return False
    touched.update(id(n) for n in (t1, t2, *readers, *src_side) if n is not None)
    composed = [p1[i] for i in p2]
    if composed != list(range(len(p2))):
        merged = _new_onnx_node(g, "Transpose", [src], [y], {"perm": composed}, t2)
        g.nodes[g.nodes.index(t2)] = merged
        return True
    # readers that name y as an input read src instead; t2 stays for a graph output or a
    # subgraph reading y, unless y (a graph output) can be made by src's producer
    moved = [r for r in readers if y not in r.implicit_inputs and y in r.inputs]
    for r in moved:
        r.inputs = [src if i == y else i for i in r.inputs]
    if e.renamable(y) or _renames_to(e, src, y):
        g.nodes.remove(t2)
        return True
    return bool(moved)


def _merge_one(e: _Edges) -> bool:
    """Two Transposes of one value with one perm (a graph input read by a convolution and as
    FusedConv's residual, each given its own): the readers of the second read the first."""
    seen: dict[tuple[str, tuple[int, ...]], str] = {}
    for t in e.g.nodes:
        perm = e.perm(t)
        if perm is None:
            continue
        key = (t.inputs[0], tuple(perm))
        kept = seen.get(key)
        if kept is None:
            seen[key] = t.outputs[0]
            continue
        y = t.outputs[0]
        if not e.renamable(y):
            continue
        for r in e.readers.get(y, []):
            r.inputs = [kept if i == y else i for i in r.inputs]
        e.g.nodes.remove(t)
        return True
    return False


def _renames_to(e: _Edges, src: str, y: str) -> bool:
    """Give ``src`` the name ``y`` (its producer writes y, its readers read y) where ``src`` is
    a node's output that neither a graph output nor a subgraph reads; whether it did."""
    producer = e.producer.get(src)
    if producer is None or not e.renamable(src) or any(r.subgraphs for r in e.readers.get(y, [])):
        return False
    producer.outputs = [y if o == src else o for o in producer.outputs]
    for r in e.readers.get(src, []):
        r.inputs = [y if i == src else i for i in r.inputs]
    return True


def _push_one(e: _Edges) -> bool:
    """One elementwise node with Transposed inputs becomes the node on the untransposed
    values followed by one Transpose, where that removes or cancels a Transpose."""
    for u in e.g.nodes:
        if _push(e, u):
            return True
    return False


def _elementwise(n: Node) -> bool:
    """A node a Transpose can be pushed through (when its inputs allow)."""
    if n.domain != "" or n.subgraphs or len(n.outputs) != 1 or not n.outputs[0]:
        return False
    return n.op_type in UNARY_OPS or n.op_type in BINARY_OPS


def _push(e: _Edges, u: Node) -> bool:
    g = e.g
    if not _elementwise(u):
        return False
    unary = u.op_type in UNARY_OPS
    out = u.outputs[0]
    out_type = g.type_of(out)
    if out_type is None or out_type.kind != "tensor" or not out_type.elem_type:
        return False
    data = [0] if unary else list(range(len(u.inputs)))
    if unary and any(i and _scalar(g, i) is None for i in u.inputs[1:]):
        return False
    perm: list[int] | None = None
    sources: dict[int, Node] = {}
    for k in data:
        name = u.inputs[k]
        found = e.transpose_of(name) if name else None
        if found is not None:
            if perm is not None and found[1] != perm:
                return False
            sources[k], perm = found
        elif not name or name not in g.initializers:
            return False
    if perm is None:
        return False
    constants = [k for k in data if k not in sources]
    if any(g.initializers[u.inputs[k]].ndim > len(perm) for k in constants):
        return False
    # worth it: a Transpose before goes (only this node reads it), or the moved one meets a
    # Transpose or another elementwise node after this one (where it may cancel later: SiLU's
    # Mul reads the Sigmoid and its input); not for a node read only by graph outputs or
    # layout-sensitive nodes, where it would add a Transpose; nor, without removing one, for a
    # node whose output is a graph output: the Transpose that makes it stays, one more
    removes = any(e.read_only_by(t.outputs[0], u) for t in sources.values())
    onward = e.renamable(out) and any(
        r.op_type == "Transpose" or _elementwise(r) for r in e.readers.get(out, [])
    )
    if not (removes or onward):
        return False
    inverse = _inverse(perm)
    ins = list(u.inputs)
    for k, t in sources.items():
        ins[k] = t.inputs[0]
    for k in constants:
        ins[k] = _untransposed_constant(g, ins[k], inverse)
    inner = g.unique_name(f"{out}_t")
    g.value_types[inner] = _permuted(out_type, inverse) or out_type
    moved = Node(
        name=u.name,
        op_type=u.op_type,
        domain=u.domain,
        inputs=ins,
        outputs=[inner],
        attrs=dict(u.attrs),
        since_version=u.since_version,
        opset=u.opset,
        proto=_proto_with(u, ins, [inner]),
    )
    after = _new_onnx_node(g, "Transpose", [inner], [out], {"perm": perm}, u)
    at = g.nodes.index(u)
    g.nodes[at : at + 1] = [moved, after]
    return True


def _scalar(g: Graph, name: str) -> np.ndarray | None:
    v = g.initializers.get(name)
    return v if v is not None and v.size == 1 else None


def _untransposed_constant(g: Graph, name: str, inverse: list[int]) -> str:
    """The constant c' with ``Transpose(c', perm)`` = c broadcast to the perm's rank (a
    one-element constant is its own)."""
    c = g.initializers[name]
    if c.size == 1:
        return name
    full = c.reshape((1,) * (len(inverse) - c.ndim) + c.shape)
    new = g.unique_name(f"{name}_t")
    g.initializers[new] = read_only(np.ascontiguousarray(np.transpose(full, inverse)))
    return new


def _proto_with(n: Node, inputs: list[str], outputs: list[str]) -> onnx.NodeProto | None:
    """``n``'s NodeProto with other inputs and outputs (kernels built on onnx.reference run
    from the proto)."""
    if n.proto is None:
        return None
    p = onnx.NodeProto()
    p.CopyFrom(n.proto)
    del p.input[:]
    p.input.extend(inputs)
    del p.output[:]
    p.output.extend(outputs)
    return p
