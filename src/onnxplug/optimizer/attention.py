"""Attention fusion (extended level): the multi-head attention subgraph the PyTorch exporters
write becomes one ``MultiHeadAttention`` or ``Attention`` node.

Matched from each Softmax over the last axis of a rank-4 tensor::

    Q4 = Transpose[0,2,1,3](Reshape(q, [B, S, N, H]))        (same for V4)
    Kt = Transpose[0,2,3,1](Reshape(k, [B, L, N, H]))         or Transpose[0,1,3,2](K4), or
         Reshape(Transpose[0,2,1](Reshape(K4, [-1, L, H])), [B, N, H, L])   (dynamo's sdpa)
    s  = MatMul(Q4 [* c1], Kt [* c2]) [* c | / c]
    s  = s + bias | Where(mask, s, fill) | both          (fill: -inf or the type's lowest)
    P  = Softmax(s) [Cast to the same type] [Where(IsNaN(P), 0, P)]
    out = Reshape(Transpose[0,2,1,3](MatMul(P, V4) [identity Reshape]), shape)

as the TorchScript exporter (eager attention and scaled_dot_product_attention) and the dynamo
exporter write it for BERT (padding mask) and GPT-2 (causal + padding mask). The scale is the
product of the constants; the additive mask (or the Where mask turned into one, which equals it
exactly for those fills) is the op's ``attention_bias``. The ``Where(IsNaN)`` guard makes the
op an ``ai.onnxplug`` one with ``zero_nan_probabilities=1`` (com.microsoft's ops have no such
attribute; without it a fully masked row would be NaN instead of 0).

When q, k and v are projections of one input x (three ``MatMulBias(x, W, b)``, or one GEMM
split in three: ``Split(Reshape(Gemm(Reshape(x, [-1, D]), W, b), [B, S, 3D]))``), the node is
``Attention(x, [Wq|Wk|Wv], [bq|bk|bv], "", "", attention_bias)``: one GEMM for the projections.
Otherwise it is ``MultiHeadAttention(q, k, v, "", "", attention_bias)``.

Shapes are checked, not assumed: the reshape targets are read as dims of named values (Shape,
Gather, Slice, Concat, Unsqueeze, Squeeze, Cast of them) and each must be provably the dim the
fused op uses (the same value's dim, followed through Transpose, Reshape, Split, MatMul-like
and elementwise producers, or the same symbolic dim, or the same number); the head count and
size must be constants. The output keeps the pattern's last Reshape (applied to the fused op's
(B, S, N*H) output, which has the same element order) unless it is provably the identity.
Intermediate values must be read only inside the pattern, except by shape computations that
only the pattern reads (they are removed with it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..ir.graph import Graph, Node
from .fusions import (
    MS_DOMAIN,
    PLUG_DOMAIN,
    ProviderPolicy,
    _new_node,
    _new_onnx_node,
    _Rewriter,
    _View,
)

ATTENTION_TYPES = frozenset({"float16", "float32", "bfloat16", "float64"})
# shape computations that die with a pattern when only the pattern reads them
_SHAPE_HELPERS = frozenset(
    {"Shape", "Gather", "Unsqueeze", "Squeeze", "Concat", "Slice", "Cast", "Reshape", "Size"}
)
_ELEMENTWISE_SAME = frozenset({"Softmax", "Cast", "IsNaN", "Relu", "Erf", "Tanh", "Sigmoid"})

Term = Any  # int, or ("dim", value name, axis)


class _Dims:
    """Reads 1-D int64 shape values as lists of terms and decides whether two dims are equal."""

    def __init__(self, view: _View):
        self.view = view
        self._terms: dict[str, list[Term] | None] = {}
        # dims a matched pattern fixes (the fused op checks them when it runs)
        self.alias: dict[tuple[str, int], tuple[str, int]] = {}

    # shape values ------------------------------------------------------------------------------
    def terms(self, name: str) -> list[Term] | None:
        if name not in self._terms:
            self._terms[name] = None  # cycles
            self._terms[name] = self._eval(name)
        return self._terms[name]

    def _const_ints(self, name: str) -> list[int] | None:
        v = self.view.g.initializers.get(name)
        if v is None or v.dtype.kind not in "iu" or v.ndim > 1:
            return None
        return [int(x) for x in v.reshape(-1)]

    def _eval(self, name: str) -> list[Term] | None:
        c = self._const_ints(name)
        if c is not None:
            return c
        n = self.view.producer.get(name)
        if n is None or n.domain != "":
            return None
        op, ins = n.op_type, n.inputs
        if op == "Shape":
            rank = self._rank(ins[0])
            if rank is None:
                return None
            start = int(n.attrs.get("start", 0))
            end = n.attrs.get("end")
            idx = list(range(rank))[slice(start, None if end is None else int(end))]
            return [("dim", ins[0], i) for i in idx]
        if op in ("Unsqueeze", "Squeeze", "Cast") or (op == "Reshape" and self._flat(ins)):
            return self.terms(ins[0])
        if op == "Concat":
            out: list[Term] = []
            for i in ins:
                t = self.terms(i)
                if t is None:
                    return None
                out += t
            return out
        if op == "Gather" and int(n.attrs.get("axis", 0)) == 0:
            src, picks = self.terms(ins[0]), self._const_ints(ins[1])
            if src is None or picks is None or any(not -len(src) <= i < len(src) for i in picks):
                return None
            return [src[i] for i in picks]
        if op == "Slice" and len(ins) >= 3:
            src = self.terms(ins[0])
            starts, ends = self._const_ints(ins[1]), self._const_ints(ins[2])
            axes = self._const_ints(ins[3]) if len(ins) > 3 and ins[3] else [0]
            steps = self._const_ints(ins[4]) if len(ins) > 4 and ins[4] else [1]
            if src is None or starts is None or ends is None or axes != [0] or steps != [1]:
                return None
            big = len(src)
            s, e = (max(-big - 1, min(big + 1, v)) for v in (starts[0], ends[0]))
            return src[slice(s, e)]
        return None

    def _flat(self, ins: list[str]) -> bool:
        return self._const_ints(ins[1]) == [-1] if len(ins) > 1 else False

    # dims ----------------------------------------------------------------------------------------
    def _rank(self, name: str) -> int | None:
        s = self.view.shape(name)
        return None if s is None else len(s)

    def canon(self, name: str, axis: int) -> tuple[str, int]:
        """The value and axis a dim is provably equal to, followed back through producers."""
        for _ in range(64):
            rank = self._rank(name)
            if rank is None:
                break
            axis = axis % rank
            if (name, axis) in self.alias:
                name, axis = self.alias[(name, axis)]
                continue
            n = self.view.producer.get(name)
            if n is None:
                break
            nxt = self._source(n, name, axis, rank)
            if nxt is None:
                break
            name, axis = nxt
        return name, axis

    def _source(self, n: Node, out: str, axis: int, rank: int) -> tuple[str, int] | None:
        op, ins = n.op_type, n.inputs
        if n.domain == "" and op == "Transpose":
            perm = n.attrs.get("perm") or list(range(rank))[::-1]
            return ins[0], int(perm[axis])
        if (n.domain == "" and op == "MatMul" or op == "MatMulBias") and axis < rank - 1:
            w = self.view.shape(ins[1])
            if w is not None and len(w) == 2 and self._rank(ins[0]) == rank:
                return ins[0], axis
        if n.domain == "" and op == "Reshape":
            t = self.terms(ins[1])
            if t is not None and len(t) == rank:
                if t[axis] == 0 and not n.attrs.get("allowzero", 0):
                    return ins[0], axis
                if isinstance(t[axis], tuple):
                    return t[axis][1], t[axis][2]
        if n.domain == "" and op == "Split":
            if int(n.attrs.get("axis", 0)) % rank != axis:
                return ins[0], axis
        if n.domain == "" and op in _ELEMENTWISE_SAME and self._rank(ins[0]) == rank:
            return ins[0], axis
        return None

    def value(self, name: str, axis: int) -> int | str | None:
        s = self.view.shape(name)
        if s is None or not -len(s) <= axis < len(s):
            return None
        d = s[axis]
        return d if isinstance(d, (int, str)) and d != "" else None

    def size(self, name: str, axis: int) -> int | None:
        """Dim ``axis`` of ``name`` as a number: from its type, else from the constant sizes of
        the Split, Reshape or Transpose producing it."""
        for _ in range(16):
            d = self.value(name, axis)
            if isinstance(d, int):
                return d
            n = self.view.producer.get(name)
            rank = self._rank(name)
            if n is None or n.domain != "" or rank is None:
                return None
            axis %= rank
            if n.op_type == "Split" and int(n.attrs.get("axis", 0)) % rank == axis:
                sizes = self._const_ints(n.inputs[1]) if len(n.inputs) > 1 and n.inputs[1] else None
                k = list(n.outputs).index(name)
                return sizes[k] if sizes is not None and k < len(sizes) else None
            if n.op_type == "Reshape":
                t = self.terms(n.inputs[1])
                return (
                    t[axis]
                    if t is not None and len(t) == rank and isinstance(t[axis], int) and t[axis] > 0
                    else None
                )
            if n.op_type != "Transpose":
                return None
            name, axis = self._source(n, name, axis, rank) or (name, axis)
        return None

    def same(self, term: Term, name: str, axis: int) -> bool:
        """Whether ``term`` is provably dim ``axis`` of ``name``."""
        target = self.value(name, axis)
        if isinstance(term, int):
            return isinstance(target, int) and target == term
        _, tv, ta = term
        if self.canon(tv, ta) == self.canon(name, axis):
            return True
        mine = self.value(tv, ta)
        if mine is None or target is None:
            return False
        return mine == target  # equal numbers, or the same symbolic dim


@dataclass
class _Heads:
    """A head split: ``x3`` (B, S, N*H) viewed as (B, N, S, H) (or (B, N, H, S) for K^T)."""

    x3: str
    heads: int
    size: int
    nodes: list[Node] = field(default_factory=list)


class _Matcher:
    def __init__(self, view: _View):
        self.view = view
        self.dims = _Dims(view)
        self.g = view.g

    # helpers -----------------------------------------------------------------------------------
    def prod(self, name: str, op: str) -> Node | None:
        n = self.view.producer.get(name)
        if n is None or n.domain != "" or n.op_type != op or len(n.outputs) != 1:
            return None
        return n

    def scalar(self, name: str) -> float | None:
        c = self.view.scalar(name)
        return None if c is None else c[0]

    def peel_scale(self, name: str, nodes: list[Node]) -> tuple[str, float]:
        """Follows Mul/Div by scalar constants back from ``name``: (the scaled value, factor)."""
        factor = 1.0
        for _ in range(3):
            n = self.view.producer.get(name)
            if n is None or n.domain != "" or n.op_type not in ("Mul", "Div") or len(n.inputs) != 2:
                break
            a, b = n.inputs
            cb, ca = self.scalar(b), self.scalar(a)
            if cb is not None and (n.op_type == "Mul" or cb != 0):
                factor *= cb if n.op_type == "Mul" else 1.0 / cb
                name = a
            elif n.op_type == "Mul" and ca is not None:
                factor *= ca
                name = b
            else:
                break
            nodes.append(n)
        return name, factor

    def perm(self, n: Node) -> list[int]:
        return [int(p) for p in n.attrs.get("perm") or []]

    def heads(self, x4: str, perm: list[int]) -> _Heads | None:
        """``x4 = Transpose[perm](Reshape(x3, [B, S, N, H]))`` with x3 (B, S, N*H)."""
        t = self.prod(x4, "Transpose")
        if t is None or self.perm(t) != perm:
            return None
        r = self.prod(t.inputs[0], "Reshape")
        if r is None:
            return None
        x3 = r.inputs[0]
        shape = self.view.shape(x3)
        terms = self.dims.terms(r.inputs[1])
        if shape is None or len(shape) != 3 or terms is None or len(terms) != 4:
            return None
        d = self.dims.size(x3, 2)
        n_h = terms[2:]
        if not isinstance(d, int) or not all(isinstance(v, int) for v in n_h):
            return None
        n, h = n_h
        if n == -1 and h > 0 and d % h == 0:
            n = d // h
        elif h == -1 and n > 0 and d % n == 0:
            h = d // n
        if n <= 0 or h <= 0 or n * h != d:
            return None
        zero_copies = not r.attrs.get("allowzero", 0)

        def given(pos: int) -> bool:
            term = terms[pos]
            if term == 0:
                return zero_copies
            return term != -1 and self.dims.same(term, x3, pos)

        # a -1 infers its dim: right when the three others are
        exact = terms[2:] == [n, h]
        ok0 = given(0) or (terms[0] == -1 and exact and given(1))
        ok1 = given(1) or (terms[1] == -1 and exact and given(0))
        if not (ok0 and ok1):
            return None
        return _Heads(x3, n, h, [r, t])

    def key_transposed(self, kt: str) -> _Heads | None:
        """K^T as (B, N, H, L) in one of the exporters' three spellings."""
        h = self.heads(kt, [0, 2, 3, 1])
        if h is not None:
            return h
        t = self.prod(kt, "Transpose")
        if t is not None and self.perm(t) == [0, 1, 3, 2]:
            h = self.heads(t.inputs[0], [0, 2, 1, 3])
            if h is not None:
                h.nodes.append(t)
            return h
        # dynamo: Reshape(Transpose[0,2,1](Reshape(K4, [-1, L, H])), [B, N, H, L])
        r2 = self.prod(kt, "Reshape")
        t = self.prod(r2.inputs[0], "Transpose") if r2 is not None else None
        r1 = (
            self.prod(t.inputs[0], "Reshape")
            if t is not None and self.perm(t) == [0, 2, 1]
            else None
        )
        if r1 is None or r2 is None or t is None:
            return None
        k4 = r1.inputs[0]
        t1, t2 = self.dims.terms(r1.inputs[1]), self.dims.terms(r2.inputs[1])
        if t1 is None or t2 is None or len(t1) != 3 or len(t2) != 4 or t1[0] != -1:
            return None
        same = self.dims.same
        if not (same(t1[1], k4, 2) and same(t1[2], k4, 3)):
            return None
        if not all(same(t2[i], k4, a) for i, a in enumerate((0, 1, 3, 2))):
            return None
        h = self.heads(k4, [0, 2, 1, 3])
        if h is not None:
            h.nodes += [r1, t, r2]
        return h

    # the pattern -------------------------------------------------------------------------------
    def match(self, sm: Node) -> dict | None:
        view = self.view
        if sm.domain != "" or sm.op_type != "Softmax" or len(sm.outputs) != 1:
            return None
        s_in = sm.inputs[0]
        shape = view.shape(s_in)
        if shape is None or len(shape) != 4 or int(sm.attrs.get("axis", -1)) not in (-1, 3):
            return None
        dt = view.dtype(s_in)
        if dt not in ATTENTION_TYPES:
            return None
        nodes: list[Node] = [sm]
        # forward: optional same-type Cast, optional IsNaN guard, then P @ V4
        p = sm.outputs[0]
        guard = False
        readers = view.readers.get(p, [])
        if len(readers) == 1 and readers[0].op_type == "Cast" and readers[0].domain == "":
            cast = readers[0]
            if view.dtype(cast.outputs[0]) != dt:
                return None
            nodes.append(cast)
            p = cast.outputs[0]
            readers = view.readers.get(p, [])
        if len(readers) == 2:
            isnan = next((r for r in readers if r.op_type == "IsNaN" and r.domain == ""), None)
            where = next((r for r in readers if r.op_type == "Where" and r.domain == ""), None)
            if isnan is None or where is None or where.inputs[2] != p:
                return None
            if where.inputs[0] != isnan.outputs[0] or self.scalar(where.inputs[1]) != 0.0:
                return None
            if view.readers.get(isnan.outputs[0], []) != [where]:
                return None
            nodes += [isnan, where]
            guard = True
            p = where.outputs[0]
            readers = view.readers.get(p, [])
        if len(readers) != 1 or p in view.outputs:
            return None
        pv = readers[0]
        if pv.op_type != "MatMul" or pv.domain != "" or pv.inputs[0] != p:
            return None
        nodes.append(pv)
        v = self.heads(pv.inputs[1], [0, 2, 1, 3])
        if v is None:
            return None
        # backward: mask, scale, Q K^T
        mask, fill, cond, s = None, None, None, s_in
        add = self.prod(s, "Add")
        if add is not None:
            for j in (0, 1):
                if self.scores(add.inputs[j]) is not None or self.prod(add.inputs[j], "Where"):
                    s, mask = add.inputs[j], add.inputs[1 - j]
                    nodes.append(add)
                    break
            else:
                return None
        wh = self.prod(s, "Where")
        if wh is not None:
            fill_j = next((j for j in (1, 2) if self._is_fill(wh.inputs[j], dt)), None)
            if fill_j is None:
                return None
            cond, fill = wh.inputs[0], (wh, fill_j)
            s = wh.inputs[3 - fill_j]
            nodes.append(wh)
        found = self.scores(s)
        if found is None:
            return None
        q, kt, scale, score_nodes = found
        nodes += score_nodes
        heads = {q.heads, kt.heads, v.heads}
        if len(heads) != 1 or q.size != kt.size:
            return None
        # the mask must not broadcast the scores to a larger shape (checked again at run time)
        sshape = view.shape(s)
        if sshape is not None and not self._broadcasts(sshape, shape, exact=True):
            return None
        for m in (mask, cond):
            ms = view.shape(m) if m is not None else None
            if m is not None and (ms is None or len(ms) > 4 or not self._broadcasts(ms, shape)):
                return None
        # the fused op runs (B, N, S, T) scores for q (B, S, .) and k (B, T, .): the values
        # between the scores and the output have those dims
        o = pv.outputs[0]
        for x in (s_in, p, o):
            self.dims.alias[(x, 0)] = (q.x3, 0)
            self.dims.alias[(x, 2)] = (q.x3, 1)
        self.dims.alias[(s_in, 3)] = self.dims.alias[(p, 3)] = (kt.x3, 1)
        # output: [identity Reshape] -> Transpose[0,2,1,3] -> Reshape
        nxt = self._sole(o)
        r = self.prod(nxt, "Reshape") if nxt is not None else None
        if r is not None and self._identity(r):
            nodes.append(r)
            o = r.outputs[0]
        nxt = self._sole(o)
        t = self.prod(nxt, "Transpose") if nxt is not None else None
        if t is None or self.perm(t) != [0, 2, 1, 3]:
            return None
        nodes.append(t)
        final = self._sole(t.outputs[0])
        last = self.prod(final or "", "Reshape") if final else None
        if last is None:
            return None
        nodes.append(last)
        out_terms = self.dims.terms(last.inputs[1])
        keep_reshape = True
        if out_terms is not None:
            if not last.attrs.get("allowzero", 0) and 0 in out_terms[2:]:
                return None  # a 0 there would copy a dim the fused output does not have
            if len(out_terms) == 3 and self._out_identity(out_terms, q.x3, v.heads * v.size):
                keep_reshape = False
        elif not last.attrs.get("allowzero", 0):
            return None
        return {
            "nodes": nodes,
            "q": q,
            "k": kt,
            "v": v,
            "scale": scale,
            "mask": mask,
            "cond": cond,
            "fill": fill,
            "guard": guard,
            "dtype": dt,
            "last": last,
            "keep_reshape": keep_reshape,
        }

    def _sole(self, name: str) -> str | None:
        """The output of the one node reading ``name`` other than Shape/Size nodes (whose
        reads of the shape only are checked when the pattern's helpers are collected)."""
        readers = [r for r in self.view.readers.get(name, []) if r.op_type not in ("Shape", "Size")]
        if name in self.view.outputs or len(readers) != 1 or not readers[0].outputs:
            return None
        return readers[0].outputs[0]

    def _is_fill(self, name: str, dt: str) -> bool:
        c = self.scalar(name)
        if c is None:
            return False
        lowest = float(np.finfo(np.dtype(dt) if dt != "bfloat16" else np.float32).min)
        if dt == "bfloat16":
            import ml_dtypes

            lowest = float(ml_dtypes.finfo(ml_dtypes.bfloat16).min)
        return c == -math.inf or c <= lowest

    @staticmethod
    def _broadcasts(ms: tuple, scores: tuple, exact: bool = False) -> bool:
        """A value of shape ``ms`` does not enlarge one of shape ``scores`` (known dims);
        ``exact``: the known dims are equal (the scores before and after the mask)."""
        for a, b in zip(reversed(ms), reversed(scores)):
            if not (isinstance(a, int) and isinstance(b, int)):
                continue
            if a != b and (exact or a != 1):
                return False
        return True

    def _identity(self, r: Node) -> bool:
        """Reshape of a 4-D value to its own shape (one -1 allowed)."""
        x = r.inputs[0]
        terms = self.dims.terms(r.inputs[1])
        if terms is None or len(terms) != 4 or terms.count(-1) > 1:
            return False
        return all(t == -1 or self.dims.same(t, x, i) for i, t in enumerate(terms))

    def _out_identity(self, terms: list[Term], q3: str, d: int) -> bool:
        same = self.dims.same
        return (
            (terms[0] == 0 or (terms[0] != -1 and same(terms[0], q3, 0)))
            and (terms[1] == 0 or (terms[1] != -1 and same(terms[1], q3, 1)))
            and terms[2] in (d, -1)
        )

    def scores(self, s: str) -> tuple[_Heads, _Heads, float, list[Node]] | None:
        nodes: list[Node] = []
        mm_out, c = self.peel_scale(s, nodes)
        mm = self.prod(mm_out, "MatMul")
        if mm is None:
            return None
        nodes.append(mm)
        qn, c1 = self.peel_scale(mm.inputs[0], nodes)
        kn, c2 = self.peel_scale(mm.inputs[1], nodes)
        q = self.heads(qn, [0, 2, 1, 3])
        k = self.key_transposed(kn)
        if q is None or k is None:
            return None
        return q, k, c * c1 * c2, nodes + q.nodes + k.nodes


def _dead_helpers(view: _View, taken: set[int], keep: set[str]) -> list[Node]:
    """Shape computations read only by ``taken`` nodes (and by each other), to fixpoint,
    except those computing (transitively) a value in ``keep`` (read by the new nodes)."""
    out: list[Node] = []
    dead = set(taken)
    changed = True
    while changed:
        changed = False
        for n in view.g.nodes:
            if id(n) in dead or n.domain != "" or n.op_type not in _SHAPE_HELPERS:
                continue
            if any(o in view.outputs for o in n.outputs):
                continue
            readers = [r for o in n.outputs if o for r in view.readers.get(o, [])]
            if readers and all(id(r) in dead for r in readers):
                dead.add(id(n))
                out.append(n)
                changed = True
    needed = set(keep)
    changed = True
    while changed:
        changed = False
        for n in out:
            if id(n) in dead and any(o in needed for o in n.outputs):
                dead.discard(id(n))
                needed.update(i for i in n.inputs if i)
                changed = True
    return [n for n in out if id(n) in dead]


def _private(view: _View, nodes: list[Node], final: str) -> bool:
    """Every value the nodes make, except ``final``, is read only by the nodes."""
    ids = {id(n) for n in nodes}
    for n in nodes:
        for o in n.outputs:
            if not o or o == final:
                continue
            if o in view.outputs or any(id(r) not in ids for r in view.readers.get(o, [])):
                return False
    return True


def _projections(m: _Matcher, q: str, k: str, v: str) -> dict | None:
    """The shared input, packed weights and bias when q, k and v are projections of one x."""
    view, inits = m.view, m.g.initializers
    prods = [view.producer.get(x) for x in (q, k, v)]
    if all(p is not None and p.op_type == "MatMulBias" and p.domain == PLUG_DOMAIN for p in prods):
        ps = [p for p in prods if p is not None]
        xs = {p.inputs[0] for p in ps}
        if len(xs) != 1 or any(p.attrs.get("activation", "") for p in ps):
            return None
        ws = [inits.get(p.inputs[1]) for p in ps]
        bs = [inits.get(p.inputs[2]) if len(p.inputs) > 2 else None for p in ps]
        if any(w is None or w.ndim != 2 for w in ws) or any(b is None for b in bs):
            return None
        return {
            "x": xs.pop(),
            "w": np.concatenate(ws, axis=1),  # type: ignore[arg-type]
            "b": np.concatenate(bs),  # type: ignore[arg-type]
            "nodes": ps,
            "sizes": [w.shape[1] for w in ws],  # type: ignore[union-attr]
        }
    # one GEMM split in three: Split(Reshape(Gemm(Reshape(x, [-1, D]), W, b), [B, S, 3D]))
    sp = prods[0]
    if sp is None or any(p is not sp for p in prods) or sp.op_type != "Split" or sp.domain != "":
        return None
    if list(sp.outputs) != [q, k, v] or int(sp.attrs.get("axis", 0)) not in (2, -1):
        return None
    r3 = m.prod(sp.inputs[0], "Reshape")
    gemm = m.prod(r3.inputs[0], "Gemm") if r3 is not None else None
    r2 = m.prod(gemm.inputs[0], "Reshape") if gemm is not None else None
    if r3 is None or gemm is None or r2 is None:
        return None
    if float(gemm.attrs.get("alpha", 1.0)) != 1.0 or gemm.attrs.get("transA", 0):
        return None
    if len(gemm.inputs) > 2 and gemm.inputs[2] and float(gemm.attrs.get("beta", 1.0)) != 1.0:
        return None
    w = inits.get(gemm.inputs[1])
    b = inits.get(gemm.inputs[2]) if len(gemm.inputs) > 2 and gemm.inputs[2] else None
    if (
        w is None
        or w.ndim != 2
        or (b is not None and b.shape != (w.shape[1 - int(gemm.attrs.get("transB", 0))],))
    ):
        return None
    if gemm.attrs.get("transB", 0):
        w = np.ascontiguousarray(w.T)
    x = r2.inputs[0]
    x_shape = view.shape(x)
    t2, t3 = m.dims.terms(r2.inputs[1]), m.dims.terms(r3.inputs[1])
    if x_shape is None or len(x_shape) != 3 or t2 is None or t3 is None:
        return None
    if (
        len(t2) != 2
        or len(t3) != 3
        or x_shape[2] != w.shape[0]
        or t3[2] not in (w.shape[1], -1)
        or t2[0] != -1
    ):
        return None
    if t2[1] != w.shape[0] and not (t2[1] != -1 and m.dims.same(t2[1], x, 2)):
        return None
    if not (m.dims.same(t3[0], x, 0) and m.dims.same(t3[1], x, 1)):
        return None
    given = m.g.initializers.get(sp.inputs[1]) if len(sp.inputs) > 1 and sp.inputs[1] else None
    total = w.shape[1]
    split = [int(s) for s in given] if given is not None else [total // 3] * 3
    if sum(split) != total or len(split) != 3:
        return None
    if b is None:
        b = np.zeros(total, dtype=w.dtype)
    return {"x": x, "w": w, "b": b, "nodes": [r2, gemm, r3, sp], "sizes": split}


def fuse_attention(g: Graph, policy: ProviderPolicy | None = None) -> int:
    """Attention subgraphs -> (com.microsoft or ai.onnxplug) MultiHeadAttention / Attention."""
    view = _View(g)
    rw = _Rewriter(g, policy or ProviderPolicy())
    m = _Matcher(view)
    for sm in list(g.nodes):
        found = m.match(sm) if sm.op_type == "Softmax" else None
        if found is None:
            continue
        nodes: list[Node] = found["nodes"]
        q, k, v, last = found["q"], found["k"], found["v"], found["last"]
        dt = found["dtype"]
        final = last.outputs[0]
        domain = PLUG_DOMAIN if found["guard"] else MS_DOMAIN
        attrs: dict[str, Any] = {"num_heads": q.heads, "scale": float(found["scale"])}
        if found["guard"]:
            attrs["zero_nan_probabilities"] = 1
        proj = _projections(m, q.x3, k.x3, v.x3)
        inner = nodes + [n for n in q.nodes + k.nodes + v.nodes if n not in nodes]
        op = "MultiHeadAttention"
        if proj is not None and proj["sizes"][0] == proj["sizes"][1]:
            op, inner = "Attention", inner + proj["nodes"]
        keep = {found["mask"], found["cond"], last.inputs[1] if found["keep_reshape"] else None}
        keep |= {proj["x"]} if proj is not None and op == "Attention" else {q.x3, k.x3, v.x3}
        helpers = _dead_helpers(view, {id(n) for n in inner}, {x for x in keep if x})
        if not _private(view, inner + helpers, final) and proj is not None and op == "Attention":
            op, inner = "MultiHeadAttention", inner[: -len(proj["nodes"])]
            keep = {found["mask"], found["cond"], q.x3, k.x3, v.x3}
            keep.add(last.inputs[1] if found["keep_reshape"] else None)
            helpers = _dead_helpers(view, {id(n) for n in inner}, {x for x in keep if x})
        if op == "MultiHeadAttention":
            proj = None
        if not _private(view, inner + helpers, final) or not rw.free(inner + helpers, op, domain):
            continue
        new_nodes: list[Node] = []
        bias = found["mask"] or ""
        if found["cond"] is not None:
            # Where(cond, s, fill) == s + Where(cond, 0, fill) for fill -inf or the lowest value
            wh, fill_j = found["fill"]
            dtype = _np_dtype(dt)
            zero = g.unique_name(f"{sm.name}_zero")
            fill = g.unique_name(f"{sm.name}_fill")
            g.initializers[zero] = np.zeros((), dtype=dtype)
            g.initializers[fill] = np.asarray(g.initializers[wh.inputs[fill_j]]).astype(dtype)
            g.initializers[fill] = g.initializers[fill].reshape(())
            branches = [zero, fill] if fill_j == 2 else [fill, zero]
            mask_bias = g.unique_name(f"{sm.name}_mask_bias")
            new_nodes.append(
                _new_onnx_node(g, "Where", [found["cond"], *branches], [mask_bias], {}, sm)
            )
            if bias:
                total = g.unique_name(f"{sm.name}_attention_bias")
                new_nodes.append(_new_onnx_node(g, "Add", [bias, mask_bias], [total], {}, sm))
                bias = total
            else:
                bias = mask_bias
        out3 = final if not found["keep_reshape"] else g.unique_name(f"{sm.name}_attention_out")
        if proj is not None:
            w_name = g.unique_name(f"{sm.name}_qkv_weight")
            b_name = g.unique_name(f"{sm.name}_qkv_bias")
            g.initializers[w_name] = np.ascontiguousarray(proj["w"])
            g.initializers[b_name] = np.ascontiguousarray(proj["b"])
            if proj["sizes"][2] != proj["sizes"][0]:
                attrs["qkv_hidden_sizes"] = proj["sizes"]
            ins = [proj["x"], w_name, b_name, "", "", bias]
        else:
            ins = [q.x3, k.x3, v.x3, "", "", bias]
        while ins and not ins[-1]:
            ins.pop()
        new_nodes.append(_new_node(g, op, domain, ins, [out3], attrs, last))
        if found["keep_reshape"]:
            shape_in = last.inputs[1]
            new_nodes.append(
                _new_onnx_node(g, "Reshape", [out3, shape_in], [final], dict(last.attrs), last)
            )
        rw.add(inner + helpers, last, new_nodes)
    count = rw.apply()
    if count:
        _drop_dead_shape_nodes(g)
    return count


def _drop_dead_shape_nodes(g: Graph) -> None:
    """Shape computations nothing reads any more (shared by several fused patterns)."""
    while True:
        outputs = {vi.name for vi in g.outputs}
        read = {i for n in g.nodes for i in (*n.inputs, *n.implicit_inputs) if i}
        dead = [
            n
            for n in g.nodes
            if n.domain == ""
            and n.op_type in _SHAPE_HELPERS
            and not any(o in read or o in outputs for o in n.outputs if o)
        ]
        if not dead:
            return
        ids = {id(n) for n in dead}
        g.nodes = [n for n in g.nodes if id(n) not in ids]


def _np_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)
