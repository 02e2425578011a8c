"""GEMM layout fusions (extended level): Transposes and scalar scales folded into the GEMM as
``com.microsoft`` ``FusedMatMul(A, B) = alpha * op(A) @ op(B)``, where op swaps the last two
axes when ``transA`` / ``transB`` is 1; the GEMM reads the operand transposed in place instead
of a Transpose node copying it. onnxruntime's two rules, with their names:

* ``MatmulTransposeFusion``: a Transpose whose perm swaps the last two axes (``[0, ..., r-3,
  r-1, r-2]``; no perm on a rank-2 input) feeding MatMul (or FusedMatMul) -> FusedMatMul with
  transA / transB. The Transpose goes when nothing else reads it; it must not be a graph output.
  Batch-axis permutations (onnxruntime's transBatchA/B) are not folded.
* ``MatMulScaleFusion``: Mul or Div by a scalar constant (one element, of a rank no larger than
  the other operand's, so it broadcasts nothing) before either input or after the output of
  MatMul (or FusedMatMul) -> its ``alpha``. A scale before an input goes when nothing else reads
  it; a scale after the output needs the MatMul's output read by it alone (not a graph output).
  ``x / c`` scales by 1/c; ``c / x`` is not a scale. float64 models keep a scale whose product
  is not exactly a float32 (``alpha`` is a float attribute).

float16/float32/float64/bfloat16 only (FusedMatMul's types), both operands of known rank >= 2,
and only where the provider that would run the MatMul has a FusedMatMul kernel that takes the
node (``fusions.ProviderPolicy``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from ..ir.graph import Graph, Node
from .fusions import MS_DOMAIN, ProviderPolicy, _new_node, _Rewriter
from .fusions import _View as View

FUSED_MATMUL_TYPES = frozenset({"float16", "float32", "float64", "bfloat16"})


def _gemm_attrs(view: View, n: Node) -> dict[str, Any] | None:
    """The FusedMatMul attributes a MatMul (or a FusedMatMul without batch transposes)
    computes with, when its inputs are of FusedMatMul's types."""
    if len(n.inputs) != 2 or len(n.outputs) != 1 or not all(n.inputs):
        return None
    if n.domain == "" and n.op_type == "MatMul":
        attrs: dict[str, Any] = {"alpha": 1.0, "transA": 0, "transB": 0}
    elif n.domain == MS_DOMAIN and n.op_type == "FusedMatMul":
        if n.attrs.get("transBatchA", 0) or n.attrs.get("transBatchB", 0):
            return None
        attrs = {k: n.attrs.get(k, d) for k, d in (("alpha", 1.0), ("transA", 0), ("transB", 0))}
    else:
        return None
    if any(view.dtype(i) not in FUSED_MATMUL_TYPES for i in n.inputs):
        return None
    # a 1-D operand is left alone: onnxruntime's FusedMatMul kernel (1.32) computes a wrong
    # result for one with transA, and an optimized model must give the same results there
    if any(len(view.shape(i) or ()) < 2 for i in n.inputs):
        return None
    return attrs


def _fused_matmul(g: Graph, at: Node, ins: list[str], out: str, attrs: dict[str, Any]) -> Node:
    attrs = {
        "alpha": float(attrs["alpha"]),
        "transA": int(attrs["transA"]),
        "transB": int(attrs["transB"]),
    }
    return _new_node(g, "FusedMatMul", MS_DOMAIN, ins, [out], attrs, at)


def _drop_unread(g: Graph, candidates: Iterable[Node]) -> None:
    """Candidates whose outputs nothing reads any more (their readers were fused)."""
    outputs = {vi.name for vi in g.outputs}
    read = {i for n in g.nodes for i in (*n.inputs, *n.implicit_inputs) if i}
    dead = {id(n) for n in candidates if not any(o in read or o in outputs for o in n.outputs if o)}
    if dead:
        g.nodes = [n for n in g.nodes if id(n) not in dead]


def _last_two_swapped(view: View, name: str) -> Node | None:
    """The Transpose producing ``name`` when it swaps the last two axes and only them."""
    t = view.producer.get(name)
    if t is None or t.op_type != "Transpose" or t.domain != "" or len(t.outputs) != 1:
        return None
    if name in view.outputs:
        return None
    perm = t.attrs.get("perm")
    if perm is None:  # the default reverses the axes: a swap of the last two at rank 2 only
        shape = view.shape(t.inputs[0])
        return t if shape is not None and len(shape) == 2 else None
    r = len(perm)
    return t if r >= 2 and list(perm) == [*range(r - 2), r - 1, r - 2] else None


# a match: (inputs, output, the node the fused one replaces last, attributes, the Transposes or
# scales before the inputs that fold into it)
Match = tuple[list[str], str, Node, dict[str, Any], list[Node]]


def _fuse(g: Graph, policy: ProviderPolicy | None, match: Callable[..., Match | None]) -> int:
    """Each MatMul (or FusedMatMul) that ``match(view, node, attrs)`` matches becomes one
    FusedMatMul; returns how many."""
    view = View(g)
    rw = _Rewriter(g, policy or ProviderPolicy())
    folded: list[Node] = []
    for mm in g.nodes:
        attrs = _gemm_attrs(view, mm)
        found = match(view, mm, attrs) if attrs is not None else None
        if found is None:
            continue
        ins, out, last, attrs, before = found
        fused = _fused_matmul(g, last, ins, out, attrs)
        # a node before an input that others read stays (it goes later if they all fused)
        own = [p for p in before if view.sole_reader(p.outputs[0]) is mm]
        nodes = [mm, *own, *([last] if last is not mm else [])]
        if rw.free([*nodes, *before], "FusedMatMul", MS_DOMAIN, fused):
            rw.add(nodes, last, fused)
            folded.extend(before)
    count = rw.apply()
    _drop_unread(g, folded)
    return count


def fuse_matmul_transpose(g: Graph, policy: ProviderPolicy | None = None) -> int:
    """Transpose(last two axes) + MatMul -> FusedMatMul with transA/transB; returns how many."""
    return _fuse(g, policy, _transposes)


def fuse_matmul_scale(g: Graph, policy: ProviderPolicy | None = None) -> int:
    """Mul/Div by scalar constants around MatMul -> FusedMatMul's alpha; returns how many."""
    return _fuse(g, policy, _scales)


def _transposes(view: View, mm: Node, attrs: dict[str, Any]) -> Match | None:
    ins, transposes = list(mm.inputs), []
    for i, key in ((0, "transA"), (1, "transB")):
        t = _last_two_swapped(view, ins[i])
        if t is not None:
            transposes.append(t)
            ins[i] = t.inputs[0]
            attrs[key] = 1 - int(attrs[key])
    return (ins, mm.outputs[0], mm, attrs, transposes) if transposes else None


def _scalar(view: View, name: str, other: str) -> float | None:
    """The value of a one-element constant that broadcasts ``other`` to no higher rank."""
    c = view.g.initializers.get(name)
    if c is None or c.size != 1 or c.dtype.kind != "f" and c.dtype.name != "bfloat16":
        return None
    shape = view.shape(other)
    if c.ndim > (len(shape) if shape is not None else 0):
        return None
    return float(c.reshape(()))


def _scale(view: View, n: Node | None, x: str | None = None) -> tuple[float, str] | None:
    """(factor, scaled value) when ``n`` is Mul / Div of a value by a scalar constant (the
    scaled value must be ``x`` when given)."""
    if n is None or n.domain != "" or len(n.inputs) != 2 or len(n.outputs) != 1:
        return None
    if n.op_type == "Div":
        d = _scalar(view, n.inputs[1], n.inputs[0])
        if d is None or d == 0.0 or x not in (None, n.inputs[0]):
            return None
        return 1.0 / d, n.inputs[0]
    if n.op_type != "Mul":
        return None
    for j in (1, 0):
        value, c = n.inputs[1 - j], n.inputs[j]
        s = _scalar(view, c, value) if x in (None, value) else None
        if s is not None and value not in view.g.initializers:
            return s, value
    return None


def _scales(view: View, mm: Node, attrs: dict[str, Any]) -> Match | None:
    ins, factor, scales = list(mm.inputs), 1.0, []
    for i in (0, 1):
        sc = view.producer.get(ins[i])
        found = _scale(view, sc)
        unscaled = view.shape(found[1]) if found is not None else None
        if found is None or sc is None or not unscaled:  # onnxruntime: rank > 0, known
            continue
        factor *= found[0]
        ins[i] = found[1]
        scales.append(sc)
    out, last = mm.outputs[0], mm
    after = view.sole_reader(out)
    found = _scale(view, after, out)
    if found is not None and after is not None:
        factor *= found[0]
        out, last = after.outputs[0], after
    if last is mm and not scales:
        return None
    total = float(attrs["alpha"]) * factor
    alpha = float(np.float32(total))
    if view.dtype(mm.inputs[0]) == "float64" and alpha != total:
        return None  # alpha is a float: the float64 model's scale would be rounded
    attrs["alpha"] = alpha
    return ins, out, last, attrs, scales
