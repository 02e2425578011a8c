"""Transformer fusions and the machinery every fusion shares.

Extended level (``fuse_transformer``, graph_optimization_level >= 2): the decomposed patterns
that transformer exporters emit become single nodes, so that each costs one kernel dispatch:

* Gelu, written out with Erf -> ``com.microsoft`` ``Gelu``; with the tanh approximation ->
  ``com.microsoft`` ``FastGelu``. The pattern is matched by meaning, not by node order: the
  Erf/Tanh argument and the expression around it are read back as polynomials of one value
  ``x`` through Add/Sub/Mul/Div/Pow/Neg/Sum nodes with scalar constants, and must equal
  ``0.5 * x * (1 + erf(x / sqrt(2)))`` (or the tanh form) up to the rounding of the constants
  in the model's float type. Every operand order the exporters produce (torch's erf and tanh
  gelu, transformers' gelu_new with Pow, Megatron's ``x * (1 + 0.044715 * x * x)``, ONNX's
  Gelu-20 function body with Sum and CastLike constants) matches.
* Add(residual) + LayerNormalization(last axis) -> ``com.microsoft`` ``SkipLayerNormalization``
  (a bias Add feeding the residual Add is absorbed as its ``bias`` input; when the residual sum
  is read elsewhere, as in pre-LN models, it becomes the ``input_skip_bias_sum`` output).
* MatMul(x, 2-D constant W) + Add(1-D constant bias) [+ Relu / Gelu / FastGelu] ->
  ``ai.onnxplug`` ``MatMulBias(A, B, bias)`` with ``activation`` "", "Relu", "Gelu" or
  "FastGelu": one GEMM with a bias (and activation) epilogue on the GPU.
* The exporters' multi-head attention subgraph -> ``Attention`` / ``MultiHeadAttention``
  (``com.microsoft``, or ``ai.onnxplug`` with the sdpa export's NaN guard): see ``attention``.
* Add(x, 1-D constant bias) + Gelu -> ``com.microsoft`` ``BiasGelu``; + FastGelu (or ONNX's
  tanh Gelu) -> ``FastGelu(x, bias)``.

A pattern is fused only when its constants are right and its intermediate values are read by
nothing else and are not graph outputs. The com.microsoft ops have onnxruntime's names,
inputs and attributes, so models optimized by onnxruntime's tools also run here.

The fusions run before partitioning, so they must not take nodes away from a provider: given
the session's providers (priority order), a pattern is fused only when the first provider with
a kernel for the fused op or for one of the pattern's ops has the fused op, and, where the
fusion asks, would run the fused node itself (``ProviderPolicy``; onnxruntime likewise applies
its extended fusions only for the providers that implement the fused ops). A plugin that runs
MatMul but not MatMulBias keeps its MatMul.

The convolution rewrites are in ``conv``, the GEMM layout ones (FusedMatMul) in ``matmul``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import onnx

from ..ir.graph import Graph, Node, tensor_dtype


def _drop_unused_initializers(g: Graph) -> None:
    used = {i for n in g.nodes for i in n.inputs} | {i for n in g.nodes for i in n.implicit_inputs}
    used |= {vi.name for vi in g.outputs} | {vi.name for vi in g.inputs}
    for name in [k for k in g.initializers if k not in used]:
        del g.initializers[name]


# ---------------------------------------------------------------------------------------------
# Transformer fusions (extended level)

MS_DOMAIN = "com.microsoft"
PLUG_DOMAIN = "ai.onnxplug"

# Float types each fused op is defined for (onnxruntime's contrib op type constraints; MatMulBias
# and SkipLayerNormalization also take float64, which onnxruntime's CPU kernels accept too).
_GELU_TYPES = frozenset({"float16", "float32", "float64", "bfloat16"})
_FAST_GELU_TYPES = frozenset({"float16", "float32", "bfloat16"})
_SKIP_LN_TYPES = _GELU_TYPES
_MATMUL_BIAS_TYPES = _GELU_TYPES
# Unit roundoff of each type: a pattern's constants must equal the exact values to a few of
# these (they are the exact values rounded to the model's type, and products of two of them).
_EPS = {"float16": 2.0**-10, "bfloat16": 2.0**-7, "float32": 2.0**-23, "float64": 2.0**-52}
_CONST_RTOL_ULPS = 4

_SQRT1_2 = 1.0 / math.sqrt(2.0)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
# (power of x, power of t) -> coefficient
Poly = dict[tuple[int, int], float]
# The Erf/Tanh argument of each form, and the expression around its result t: 0.5 * x * (1 + t)
_GELU_FORMS: dict[str, tuple[Poly, str, frozenset[str]]] = {
    "Erf": ({(1, 0): _SQRT1_2}, "Gelu", _GELU_TYPES),
    "Tanh": (
        {(1, 0): _SQRT_2_OVER_PI, (3, 0): _SQRT_2_OVER_PI * 0.044715},
        "FastGelu",
        _FAST_GELU_TYPES,
    ),
}
_GELU_OUTER: Poly = {(1, 0): 0.5, (1, 1): 0.5}
_MAX_X_DEGREE = 4
_MAX_OUTER_STEPS = 4  # nodes between the Erf/Tanh and the end of the pattern


class _View:
    """Producers and (distinct) readers of the values of one graph; rebuilt after each pass."""

    def __init__(self, g: Graph):
        self.g = g
        self.producer = g.producers()
        readers: dict[str, dict[int, Node]] = {}
        for n in g.nodes:
            for i in itertools.chain(n.inputs, n.implicit_inputs):
                if i:
                    readers.setdefault(i, {})[id(n)] = n
        self.readers = {k: list(v.values()) for k, v in readers.items()}
        self.outputs = {vi.name for vi in g.outputs}

    def sole_reader(self, name: str) -> Node | None:
        """The one node reading ``name`` when nothing else can see it (not a graph output)."""
        if name in self.outputs:
            return None
        users = self.readers.get(name, [])
        return users[0] if len(users) == 1 else None

    def private_producer(self, name: str, ops: Iterable[str]) -> Node | None:
        """The default-domain node in ``ops`` producing ``name`` when ``name`` is read by one
        node only (so the producer can be fused into that reader)."""
        n = self.producer.get(name)
        if n is None or n.domain != "" or n.op_type not in ops or len(n.outputs) != 1:
            return None
        return n if self.sole_reader(name) is not None else None

    def scalar(self, name: str) -> tuple[float, int] | None:
        """(value, rank) of a one-element numeric initializer."""
        v = self.g.initializers.get(name)
        if v is None or v.size != 1 or v.dtype.kind not in "fiu" and v.dtype.name != "bfloat16":
            return None
        return float(v.reshape(())), v.ndim

    def vector(self, name: str, length: int, dtype: str) -> bool:
        """Whether ``name`` is a 1-D initializer of ``length`` elements of ``dtype``."""
        v = self.g.initializers.get(name)
        return v is not None and v.shape == (length,) and v.dtype.name == dtype

    def dtype(self, *names: str) -> str:
        """The element type of the first of ``names`` whose type is known ('' if none is)."""
        for name in names:
            dt = tensor_dtype(self.g, name)
            if dt is not None:
                return dt.name
        return ""

    def shape(self, name: str) -> tuple | None:
        t = self.g.type_of(name)
        if t is None or t.kind != "tensor" or t.shape is None:
            return None
        return tuple(t.shape)


def _padd(a: Poly, b: Poly, sign: float = 1.0) -> Poly:
    r = dict(a)
    for k, v in b.items():
        r[k] = r.get(k, 0.0) + sign * v
    return r


def _pmul(a: Poly, b: Poly) -> Poly | None:
    r: Poly = {}
    for (i, j), u in a.items():
        for (k, m), v in b.items():
            key = (i + k, j + m)
            if key[0] > _MAX_X_DEGREE or key[1] > 1:
                return None
            r[key] = r.get(key, 0.0) + u * v
    return r


def _matches(p: Poly, target: Poly, rtol: float) -> bool:
    """``p`` equals ``target`` coefficient by coefficient within ``rtol`` (terms that cancel to
    rounding noise count as absent)."""
    scale = max(abs(v) for v in target.values())
    present = {k for k, v in p.items() if abs(v) > rtol * scale}
    if present != set(target):
        return False
    return all(abs(p[k] - v) <= rtol * abs(v) for k, v in target.items())


def _constant(p: Poly) -> float | None:
    """The value of a polynomial without x or t (None: it has them)."""
    if any(k != (0, 0) for k in p):
        return None
    return p.get((0, 0), 0.0)


class _Expr:
    """A value read back as a polynomial of one graph value ``x`` (the root) and of the output
    ``t`` of one Erf/Tanh node, through arithmetic nodes whose outputs nothing else reads.
    Constants are one-element initializers, and CastLike/Sqrt of constants (ONNX's own Gelu
    function body writes its constants that way). ``nodes`` collects the nodes read through."""

    OPS = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Neg", "Sum", "Sqrt", "CastLike"})
    _ARITY = {"Neg": 1, "Sqrt": 1, "Sum": 1}

    def __init__(self, view: _View, root: str | None = None, t: str | None = None):
        self.view = view
        self.root = root
        self.t = t
        self.nodes: dict[int, Node] = {}
        self.const_rank = 0  # the largest rank of a constant used (it must not broadcast x)

    def value(self, name: str) -> Poly | None:
        if name == self.t:
            return {(0, 1): 1.0}
        c = self._const(name)
        if c is not None:
            return {(0, 0): c}
        n = None if name == self.root else self.view.private_producer(name, self.OPS)
        if n is None:  # a leaf: it must be the root
            if self.root is None:
                self.root = name
            return {(1, 0): 1.0} if name == self.root else None
        return self.node(n)

    def _const(self, name: str) -> float | None:
        c = self.view.scalar(name)
        if c is None:
            return None
        self.const_rank = max(self.const_rank, c[1])
        return c[0]

    def node(self, n: Node) -> Poly | None:
        op, ins = n.op_type, n.inputs
        arity = self._ARITY.get(op, 2)
        if len(self.nodes) > 32 or len(ins) < arity or not all(ins):
            return None
        self.nodes[id(n)] = n
        if op == "CastLike":  # a constant in the type of input 1 (whose value is not read)
            c, dt = self._const(ins[0]), tensor_dtype(self.view.g, ins[1])
            if c is None or dt is None or dt.kind not in "fV":
                return None
            return {(0, 0): float(np.asarray(c).astype(dt))}
        polys = []
        for i in ins if op == "Sum" else ins[:arity]:
            p = self.value(i)
            if p is None:
                return None
            polys.append(p)
        a = polys[0]
        if op == "Neg":
            return {key: -v for key, v in a.items()}
        if op == "Sum":
            for p in polys[1:]:
                a = _padd(a, p)
            return a
        if op == "Sqrt":
            v = _constant(a)
            return None if v is None or v < 0 else {(0, 0): math.sqrt(v)}
        b = polys[1]
        if op == "Mul":
            return _pmul(a, b)
        if op in ("Add", "Sub"):
            return _padd(a, b, -1.0 if op == "Sub" else 1.0)
        k = _constant(b)  # Div and Pow: by constants only
        if k is None:
            return None
        if op == "Div":
            return {key: v / k for key, v in a.items()} if k != 0 else None
        if k != int(k) or not 1 <= k <= _MAX_X_DEGREE:
            return None
        r: Poly | None = a
        for _ in range(int(k) - 1):
            r = _pmul(r, a) if r is not None else None
        return r


def _rank_allows(view: _View, root: str, const_rank: int) -> bool:
    """Constants of rank > 0 must not broadcast the root to a higher rank."""
    if const_rank == 0:
        return True
    shape = view.shape(root)
    return shape is not None and len(shape) >= const_rank


def _new_node(
    g: Graph, op: str, domain: str, inputs: list[str], outputs: list[str], attrs: dict, at: Node
) -> Node:
    return Node(
        name=g.unique_name(f"{op}_{at.name}"),
        op_type=op,
        domain=domain,
        inputs=inputs,
        outputs=outputs,
        attrs=attrs,
        since_version=1,
        opset=g.opsets.get(domain, 1),  # the domain joins the graph's opsets when it is used
    )


def _new_onnx_node(
    g: Graph, op: str, inputs: list[str], outputs: list[str], attrs: dict, at: Node
) -> Node:
    """A default-domain node at the graph's opset (its schema version resolved)."""
    opset = g.opsets.get("", 1)
    return Node(
        name=g.unique_name(f"{op}_{at.name}"),
        op_type=op,
        domain="",
        inputs=inputs,
        outputs=outputs,
        attrs=attrs,
        since_version=onnx.defs.get_schema(op, opset, "").since_version,
        opset=opset,
    )


class ProviderPolicy:
    """Whether fusing some nodes into an op leaves every node with the provider that would have
    run it: the first provider (priority order) knowing the fused op or one of the nodes' ops
    must know the fused op. Providers are matched by op and domain (``has_op(op, domain)``, as
    a KernelRegistry answers); one that also answers ``takes(node, graph)`` (the session's
    providers: their ``get_capability`` claims the node and a kernel matches its types) must
    take the fused node when the fusion gives it. No providers: every fusion is allowed."""

    def __init__(self, registries: Sequence[Any] | None = None):
        self.registries = list(registries or [])

    def allows(
        self,
        op: str,
        domain: str,
        nodes: Iterable[Node],
        fused: Node | None = None,
        graph: Graph | None = None,
    ) -> bool:
        ops = {(n.domain, n.op_type) for n in nodes}
        for reg in self.registries:
            if reg.has_op(op, domain):
                takes = getattr(reg, "takes", None)
                return fused is None or takes is None or bool(takes(fused, graph))
            if any(reg.has_op(o, d) for d, o in ops):
                return False
        return True


class _Rewriter:
    """Collects non-overlapping rewrites (nodes replaced by one new node placed where the
    last of them was) and applies them at once."""

    def __init__(self, g: Graph, policy: ProviderPolicy):
        self.g = g
        self.policy = policy
        self.taken: set[int] = set()
        self.replace: dict[int, list[Node]] = {}

    def free(self, nodes: Iterable[Node], op: str, domain: str, fused: Node | None = None) -> bool:
        """The nodes are in no other rewrite and the providers let them become ``op`` (given
        ``fused``, the node that replaces them: the chosen provider must take it)."""
        nodes = list(nodes)
        if any(id(n) in self.taken for n in nodes):
            return False
        return self.policy.allows(op, domain, nodes, fused, self.g)

    def add(self, nodes: list[Node], at: Node, new: Node | list[Node]) -> None:
        """Replace ``nodes`` by ``new`` (one node, or several in order) placed at ``at``."""
        self.taken.update(id(n) for n in nodes)
        self.replace[id(at)] = new if isinstance(new, list) else [new]
        for n in self.replace[id(at)]:
            self.g.opsets.setdefault(n.domain, n.opset)

    def apply(self) -> int:
        if not self.replace:
            return 0
        g = self.g
        g.nodes = [
            m
            for n in g.nodes
            if id(n) not in self.taken or id(n) in self.replace
            for m in self.replace.get(id(n), [n])
        ]
        _drop_unused_initializers(g)
        g.toposort()
        return len(self.replace)


def fuse_gelu(
    g: Graph, policy: ProviderPolicy | None = None, forms: Iterable[str] = ("Erf", "Tanh")
) -> int:
    """Erf/Tanh GELU subgraphs -> com.microsoft Gelu / FastGelu (``forms``: which of the two);
    returns how many."""
    view = _View(g)
    rw = _Rewriter(g, policy or ProviderPolicy())
    wanted = frozenset(forms)
    for e in g.nodes:
        form = None
        if e.domain == "" and len(e.inputs) == 1 and e.op_type in wanted:
            form = _GELU_FORMS.get(e.op_type)
        if form is None:
            continue
        inner_target, op, types = form
        inner = _Expr(view)
        p = inner.value(e.inputs[0])
        root = inner.root
        if p is None or root is None:
            continue
        dt = view.dtype(root)
        if dt not in types:
            continue
        rtol = _CONST_RTOL_ULPS * _EPS[dt]
        if not _matches(p, inner_target, rtol):
            continue
        # follow the private readers of t until the expression is 0.5 * x * (1 + t)
        cur, found = e.outputs[0], None
        for _ in range(_MAX_OUTER_STEPS):
            nxt = view.sole_reader(cur)
            if nxt is None or nxt.domain != "" or nxt.op_type not in _Expr.OPS:
                break
            if len(nxt.outputs) != 1:
                break
            outer = _Expr(view, root=root, t=e.outputs[0])
            q = outer.node(nxt)
            if q is None:
                break
            if _matches(q, _GELU_OUTER, rtol):
                found = (nxt, outer)
                break
            cur = nxt.outputs[0]
        if found is None:
            continue
        last, outer = found
        nodes = [*inner.nodes.values(), e, *outer.nodes.values()]
        const_rank = max(inner.const_rank, outer.const_rank)
        if not _rank_allows(view, root, const_rank) or not rw.free(nodes, op, MS_DOMAIN):
            continue
        rw.add(nodes, last, _new_node(g, op, MS_DOMAIN, [root], [last.outputs[0]], {}, last))
    return rw.apply()


def fuse_skip_layer_norm(g: Graph, policy: ProviderPolicy | None = None) -> int:
    """Add (+ bias Add) + LayerNormalization over the last axis -> SkipLayerNormalization."""
    view = _View(g)
    rw = _Rewriter(g, policy or ProviderPolicy())
    for ln in g.nodes:
        if ln.op_type != "LayerNormalization" or ln.domain != "" or len(ln.inputs) < 2:
            continue
        if any(o for o in ln.outputs[1:]) or int(ln.attrs.get("stash_type", 1)) != 1:
            continue
        s = ln.inputs[0]
        add = view.producer.get(s)
        if add is None or add.op_type != "Add" or add.domain != "" or len(add.inputs) != 2:
            continue
        a, b = add.inputs
        dt = view.dtype(s, a, b)
        dims = _sum_dims(view, s, a, b)
        if dt not in _SKIP_LN_TYPES or dims is None:
            continue
        hidden, rank = dims
        axis = int(ln.attrs.get("axis", -1))
        if axis != -1 and (rank is None or axis != rank - 1):
            continue  # a positive axis must be provably the last one
        gamma = ln.inputs[1]
        beta = ln.inputs[2] if len(ln.inputs) > 2 else ""
        if any(view.shape(v) != (hidden,) for v in (gamma, beta) if v):
            continue
        sa, sb = view.shape(a), view.shape(b)
        if sb is not None and sa is not None and len(sb) > len(sa):
            a, b = b, a  # the operand of the larger rank is the input, the other the skip
        nodes = [add, ln]
        bias = ""
        operands = [a, b]
        for k, operand in enumerate(operands):
            ba = view.private_producer(operand, ("Add",))
            if ba is None or len(ba.inputs) != 2:
                continue
            j = next((j for j in (1, 0) if view.vector(ba.inputs[j], hidden, dt)), None)
            if j is None or ba.inputs[1 - j] in g.initializers:
                continue
            operands[k], bias = ba.inputs[1 - j], ba.inputs[j]
            nodes.append(ba)
            break
        if not rw.free(nodes, "SkipLayerNormalization", MS_DOMAIN):
            continue
        inputs = [*operands, gamma, beta, bias]
        while not inputs[-1]:
            inputs.pop()
        outputs = [ln.outputs[0]]
        if s in view.outputs or len(view.readers.get(s, [])) > 1:
            outputs += ["", "", s]  # the residual sum is read elsewhere: input_skip_bias_sum
        attrs = {"epsilon": float(ln.attrs.get("epsilon", 1e-5))}
        new = _new_node(g, "SkipLayerNormalization", MS_DOMAIN, inputs, outputs, attrs, ln)
        rw.add(nodes, ln, new)
    return rw.apply()


def _sum_dims(view: _View, s: str, a: str, b: str) -> tuple[int, int | None] | None:
    """(last dim, rank or None when unknown) of ``s = a + b``, when the last dim is known: from
    s's type, else from an operand whose last dim is a number > 1 (broadcasting keeps it)."""
    shape = view.shape(s)
    if shape and isinstance(shape[-1], int):
        return shape[-1], len(shape)
    known = [x for x in (view.shape(a), view.shape(b)) if x]
    dims = {x[-1] for x in known if isinstance(x[-1], int) and x[-1] > 1}
    if len(dims) != 1:
        return None
    return dims.pop(), (max(len(x) for x in known) if len(known) == 2 else None)


def _activation(n: Node) -> str | None:
    """The MatMulBias activation a node computes on its first input (None: not one)."""
    if n.domain == "" and n.op_type == "Relu":
        return "Relu"
    if n.domain == "" and n.op_type == "Gelu":
        approx = n.attrs.get("approximate", "none")
        return {"none": "Gelu", "tanh": "FastGelu"}.get(approx)
    if n.domain == MS_DOMAIN and n.op_type == "Gelu":
        return "Gelu"
    if n.domain == MS_DOMAIN and n.op_type == "FastGelu" and not any(n.inputs[1:]):
        return "FastGelu"
    return None


def fuse_matmul_bias(g: Graph, policy: ProviderPolicy | None = None) -> int:
    """MatMul(x, 2-D constant) + Add(1-D constant) [+ [Reshape +] activation] -> ai.onnxplug
    MatMulBias [+ the Reshape]."""
    view = _View(g)
    rw = _Rewriter(g, policy or ProviderPolicy())
    inits = g.initializers
    for mm in g.nodes:
        if mm.op_type != "MatMul" or mm.domain != "" or len(mm.inputs) != 2:
            continue
        a, w_name = mm.inputs
        w = inits.get(w_name)
        if w is None or w.ndim != 2 or a in inits or w.dtype.name not in _MATMUL_BIAS_TYPES:
            continue
        if view.dtype(a) != w.dtype.name:
            continue
        add = view.sole_reader(mm.outputs[0])
        if add is None or add.op_type != "Add" or add.domain != "" or len(add.inputs) != 2:
            continue
        bias = add.inputs[1] if add.inputs[0] == mm.outputs[0] else add.inputs[0]
        if bias == mm.outputs[0] or not view.vector(bias, w.shape[1], w.dtype.name):
            continue
        nodes = [mm, add]
        reshape, act, kind = _reshaped_activation(view, add.outputs[0])
        if act is not None:
            nodes += [reshape, act] if reshape is not None else [act]
        if not rw.free(nodes, "MatMulBias", PLUG_DOMAIN):
            continue
        attrs = {"activation": kind} if act is not None else {}
        out = act.outputs[0] if act is not None and reshape is None else add.outputs[0]
        at = nodes[-1]
        new = _new_node(g, "MatMulBias", PLUG_DOMAIN, [a, w_name, bias], [out], attrs, at)
        rw.add(nodes, at, [new, *_reshape_after(g, reshape, act, add.outputs[0])])
    return rw.apply()


def _reshaped_activation(view: _View, value: str) -> tuple[Node | None, Node | None, str | None]:
    """(Reshape or None, activation node, MatMulBias activation) reading ``value`` alone, with
    at most one Reshape between (activations commute with it); (None, None, None) if none."""
    reshape = None
    nxt = view.sole_reader(value)
    if nxt is not None and nxt.op_type == "Reshape" and nxt.domain == "":
        if nxt.inputs[0] != value or len(nxt.outputs) != 1:
            return None, None, None
        reshape, value = nxt, nxt.outputs[0]
        nxt = view.sole_reader(value)
    kind = _activation(nxt) if nxt is not None and nxt.inputs[0] == value else None
    if nxt is None or kind is None or len(nxt.outputs) != 1:
        return None, None, None
    return reshape, nxt, kind


def _reshape_after(g: Graph, reshape: Node | None, act: Node | None, value: str) -> list[Node]:
    """The Reshape moved after the fused activation: it views ``value`` (the fused node's
    output) as the activation's output did."""
    if reshape is None or act is None:
        return []
    return [
        Node(
            name=g.unique_name(reshape.name or "Reshape"),
            op_type="Reshape",
            domain="",
            inputs=[value, *reshape.inputs[1:]],
            outputs=[act.outputs[0]],
            attrs=dict(reshape.attrs),
            since_version=reshape.since_version,
            opset=reshape.opset,
        )
    ]


def fuse_gemm_activation(g: Graph, policy: ProviderPolicy | None = None) -> int:
    """Gemm(x, 2-D constant W[, 1-D constant bias]) [+ Reshape] + activation -> MatMulBias with
    the activation [+ the Reshape after it]: transformers' GPT-2 ``Conv1D`` (addmm on the 2-D
    view, viewed back, then gelu_new) becomes one GEMM with a (bias +) GELU epilogue (an
    exporter drops an all-zero bias: a Gemm without C). Only alpha = 1, beta = 1 (with C)
    and transA = 0; transB = 1 where this Gemm is W's only reader (W is stored transposed). A
    Gemm without an activation keeps its bias epilogue as it is."""
    view = _View(g)
    rw = _Rewriter(g, policy or ProviderPolicy())
    inits = g.initializers
    for gemm in g.nodes:
        if gemm.op_type != "Gemm" or gemm.domain != "" or len(gemm.inputs) not in (2, 3):
            continue
        a, w_name = gemm.inputs[:2]
        bias = gemm.inputs[2] if len(gemm.inputs) == 3 else ""
        w = inits.get(w_name)
        at = gemm.attrs
        if w is None or w.ndim != 2 or a in inits or w.dtype.name not in _MATMUL_BIAS_TYPES:
            continue
        if at.get("alpha", 1.0) != 1.0 or at.get("transA", 0):
            continue
        if bias and at.get("beta", 1.0) != 1.0:
            continue
        trans_b = bool(at.get("transB", 0))
        n_out = w.shape[0] if trans_b else w.shape[1]
        if view.dtype(a) != w.dtype.name:
            continue
        if bias and not view.vector(bias, n_out, w.dtype.name):
            continue
        if trans_b and len(view.readers.get(w_name, [])) != 1:
            continue
        reshape, act, kind = _reshaped_activation(view, gemm.outputs[0])
        if act is None:
            continue
        nodes = [gemm, reshape, act] if reshape is not None else [gemm, act]
        if not rw.free(nodes, "MatMulBias", PLUG_DOMAIN):
            continue
        if trans_b:
            w_name = g.unique_name(f"{w_name}_transposed")
            inits[w_name] = np.ascontiguousarray(w.T)
        out = act.outputs[0] if reshape is None else gemm.outputs[0]
        attrs = {"activation": kind}
        ins = [a, w_name, bias] if bias else [a, w_name]
        new = _new_node(g, "MatMulBias", PLUG_DOMAIN, ins, [out], attrs, gemm)
        rw.add(nodes, act, [new, *_reshape_after(g, reshape, act, gemm.outputs[0])])
    return rw.apply()


def fuse_bias_gelu(g: Graph, policy: ProviderPolicy | None = None) -> int:
    """Add(x, 1-D constant) + Gelu -> BiasGelu; + FastGelu / tanh Gelu -> FastGelu(x, bias)."""
    view = _View(g)
    rw = _Rewriter(g, policy or ProviderPolicy())
    for add in g.nodes:
        if add.op_type != "Add" or add.domain != "" or len(add.inputs) != 2:
            continue
        dt = view.dtype(add.outputs[0], *add.inputs)
        j = next((j for j in (1, 0) if _is_bias(view, add.inputs[j], dt)), None)
        if j is None or add.inputs[1 - j] in g.initializers:
            continue
        act = view.sole_reader(add.outputs[0])
        kind = _activation(act) if act is not None and act.inputs[0] == add.outputs[0] else None
        if kind == "Gelu" and dt in _GELU_TYPES:
            op = "BiasGelu"
        elif kind == "FastGelu" and dt in _FAST_GELU_TYPES:
            op = "FastGelu"
        else:
            continue
        if act is None or len(act.outputs) != 1 or not rw.free([add, act], op, MS_DOMAIN):
            continue
        ins = [add.inputs[1 - j], add.inputs[j]]
        rw.add([add, act], act, _new_node(g, op, MS_DOMAIN, ins, [act.outputs[0]], {}, act))
    return rw.apply()


def _is_bias(view: _View, name: str, dtype: str) -> bool:
    v = view.g.initializers.get(name)
    return v is not None and v.ndim == 1 and v.dtype.name == dtype


# onnxruntime's names of the transformer fusions (``disabled_optimizers``), per fused op
TRANSFORMER_FUSION_NAMES = {
    "Gelu": ("GeluFusion", "FastGeluFusion"),
    "SkipLayerNormalization": ("SkipLayerNormFusion",),
    "MatMulBias": ("MatMulBiasFusion",),
    "GemmActivation": ("GemmActivationFusion",),
    "Attention": ("AttentionFusion",),
    "BiasGelu": ("BiasGeluFusion",),
}


def fuse_transformer(
    g: Graph, registries: Sequence[Any] | None = None, disabled: frozenset[str] = frozenset()
) -> dict[str, int]:
    """The extended-level fusions of one graph, in dependency order (Gelu first, so that the
    bias and GEMM fusions see the fused Gelu nodes); ``registries``: the session's providers
    in priority order (see ``ProviderPolicy``); fusions named in ``disabled`` (onnxruntime's
    names, ``TRANSFORMER_FUSION_NAMES``; GeluFusion is the Erf form, FastGeluFusion the tanh
    one) are skipped. Returns how many of each were made."""
    from .attention import fuse_attention

    policy = ProviderPolicy(registries)
    gelu_forms = [
        f for f, name in (("Erf", "GeluFusion"), ("Tanh", "FastGeluFusion")) if name not in disabled
    ]
    passes = {
        "Gelu": lambda: fuse_gelu(g, policy, gelu_forms),
        "SkipLayerNormalization": lambda: fuse_skip_layer_norm(g, policy),
        "MatMulBias": lambda: fuse_matmul_bias(g, policy),
        "GemmActivation": lambda: fuse_gemm_activation(g, policy),
        "Attention": lambda: fuse_attention(g, policy),
        "BiasGelu": lambda: fuse_bias_gelu(g, policy),
    }
    return {
        op: run() if not all(n in disabled for n in TRANSFORMER_FUSION_NAMES[op]) else 0
        for op, run in passes.items()
    }
