"""Convolution rewrites, with onnxruntime's names and levels.

Basic level (onnxruntime's ``ConvBNFusion``, ``ConvAddFusion`` and ``ConvMulFusion`` rewrite
rules; they write only ONNX ops, so they apply whatever the provider): a constant
per-output-channel affine map after a Conv is folded into the Conv's constants, removing a pass
over the activation.

* Conv + BatchNormalization (inference, constant scale/bias/mean/var) -> Conv with
  ``W * s`` and ``(B - mean) * s + beta``, ``s = scale / sqrt(var + epsilon)``.
* Conv + Add of a per-output-channel constant k (shape ``[M, 1, ..., 1]`` or
  ``[1, M, 1, ..., 1]``, either operand) -> Conv with bias ``B + k`` (``k`` when B is absent).
* Conv + Mul by a per-output-channel constant s -> Conv with ``W * s`` and ``B * s``.

Chains (the Mul + Add that tf2onnx writes for a frozen batch norm, BN then Add) fold one after
the other. The Conv's output must be read by that one node only and not be a graph output.

Extended level (onnxruntime's ``ConvActivationFusion``): Conv + Relu / Sigmoid / Tanh /
LeakyRelu / Clip (constant bounds) / HardSigmoid -> ``com.microsoft`` ``FusedConv`` with
``activation`` and ``activation_params`` as onnxruntime writes them.

Level >= 3 (onnxruntime's ``ConvAddActivationFusion``, ``ORT_ENABLE_LAYOUT`` and above): Conv +
Add of a same-shape residual Z [+ one of those activations] -> ``FusedConv(X, W, B, Z)``,
``Y = act(conv(X, W) + B + Z)``. Both Add operands must have the same fully known shape (equal
numbers or equal symbolic dims): an Add that broadcasts is not a residual.

Fused nodes are made only for float16/float32/float64 and only where the provider that would
run the Conv has a FusedConv kernel that takes the node (``fusions.ProviderPolicy``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..ir.graph import Graph, Node
from .fusions import MS_DOMAIN, ProviderPolicy, _drop_unused_initializers, _new_node, _Rewriter
from .fusions import _View as View

FUSED_CONV_TYPES = frozenset({"float16", "float32", "float64"})


# ---------------------------------------------------------------------------------------------
# Basic level: constant per-channel maps folded into the Conv


def fold_conv_constants(g: Graph, disabled: frozenset[str] = frozenset()) -> dict[str, int]:
    """Fold BatchNormalization / Add / Mul of per-channel constants into the Conv before them
    (rules named in ``disabled`` are skipped); returns how many of each were folded."""
    rules = {
        "BatchNormalization": ("ConvBNFusion", _fold_batchnorm),
        "Add": ("ConvAddFusion", _fold_add),
        "Mul": ("ConvMulFusion", _fold_mul),
    }
    rules = {op: rule for op, rule in rules.items() if rule[0] not in disabled}
    counts = {name: 0 for name, _ in rules.values()}
    # folding renames a Conv's output and removes its reader: other edges stay as they are
    readers = g.consumers()
    outputs = {vi.name for vi in g.outputs}
    removed: set[int] = set()
    for conv in g.nodes:
        if conv.op_type != "Conv" or conv.domain != "" or len(conv.outputs) != 1:
            continue
        while conv.outputs[0] not in outputs:  # absorb the reader while it is a foldable map
            users = {id(n): n for n in readers.get(conv.outputs[0], [])}
            nxt = next(iter(users.values())) if len(users) == 1 else None
            rule = rules.get(nxt.op_type) if nxt is not None and nxt.domain == "" else None
            if nxt is None or rule is None or len(nxt.outputs) < 1 or not rule[1](g, conv, nxt):
                break
            counts[rule[0]] += 1
            conv.outputs = [nxt.outputs[0]]
            removed.add(id(nxt))
    if removed:
        g.nodes = [n for n in g.nodes if id(n) not in removed]
        _drop_unused_initializers(g)
    return counts


def _constants(g: Graph, conv: Node) -> tuple[np.ndarray, np.ndarray | None] | None:
    """(W, B or None) of a Conv whose W and B are constants of a float type."""
    if len(conv.inputs) < 2 or conv.inputs[1] not in g.initializers:
        return None
    w = g.initializers[conv.inputs[1]]
    if w.dtype.kind != "f" or w.ndim < 3:
        return None
    b_name = conv.inputs[2] if len(conv.inputs) > 2 else ""
    if b_name and b_name not in g.initializers:
        return None
    return w, (g.initializers[b_name] if b_name else None)


def _set_constants(g: Graph, conv: Node, w: np.ndarray | None, b: np.ndarray) -> None:
    """Give the Conv new W (None: keep it) and B, as new initializers (the old ones may be
    shared with other nodes)."""
    ins = list(conv.inputs[:2])
    if w is not None:
        ins[1] = g.unique_name(f"{conv.inputs[1]}_folded")
        g.initializers[ins[1]] = w
    b_name = g.unique_name(f"{conv.name or 'conv'}_bias_folded")
    g.initializers[b_name] = b
    conv.inputs = [*ins, b_name]


def _per_channel(g: Graph, name: str, w: np.ndarray) -> np.ndarray | None:
    """The M values of a constant of W's type shaped [M, 1, ...] (rank of the Conv's output
    minus one) or [1, M, 1, ...] (its rank): one value per output channel, broadcasting
    neither the batch nor the rank."""
    k = g.initializers.get(name)
    if k is None or k.dtype != w.dtype:
        return None
    m, rank = w.shape[0], w.ndim
    if k.ndim == rank - 1 and k.shape[0] == m and all(d == 1 for d in k.shape[1:]):
        return k.reshape(m)
    if k.ndim == rank and k.shape[:2] == (1, m) and all(d == 1 for d in k.shape[2:]):
        return k.reshape(m)
    return None


def _other_operand(node: Node, value: str) -> str | None:
    if len(node.inputs) != 2 or node.inputs[0] == node.inputs[1]:
        return None
    return node.inputs[1] if node.inputs[0] == value else node.inputs[0]


def _per_channel_scaled(w: np.ndarray, factor: np.ndarray) -> np.ndarray:
    """W with output channel m multiplied by factor[m]: the factors computed in float64 by the
    callers, the product in W's type (float16's in float32), as onnxruntime's Conv +
    BatchNormalization fusion computes it, within one unit in the last place of the product
    computed in float64. The float64 copy of W it replaces cost a session's creation 8 bytes
    written and read per weight: ResNet-50 with its BatchNormalizations (as the dynamo exporter
    writes it), CPU provider, fresh processes on the CPU machine: creation median 193 ms
    against 221 (5 each, alternated)."""
    dt = np.promote_types(w.dtype, np.float32)
    out = w.astype(dt, copy=True)
    out *= factor.astype(dt).reshape(-1, *([1] * (w.ndim - 1)))
    return out.astype(w.dtype, copy=False)


def _fold_batchnorm(g: Graph, conv: Node, bn: Node) -> bool:
    params = _constants(g, conv)
    if params is None or bn.inputs[0] != conv.outputs[0] or len(bn.inputs) < 5:
        return False
    if any(o for o in bn.outputs[1:]) or bn.attrs.get("training_mode", 0):
        return False
    if not all(i in g.initializers for i in bn.inputs[1:5]):
        return False
    w, b = params
    scale, beta, mean, var = (g.initializers[i].astype(np.float64) for i in bn.inputs[1:5])
    eps = float(bn.attrs.get("epsilon", 1e-5))
    factor = scale / np.sqrt(var + eps)
    if factor.shape != (w.shape[0],) or any(v.shape != factor.shape for v in (beta, mean)):
        return False
    b64 = b.astype(np.float64) if b is not None else np.zeros(w.shape[0])
    new_b = ((b64 - mean) * factor + beta).astype(w.dtype)
    _set_constants(g, conv, _per_channel_scaled(w, factor), new_b)
    return True


def _channel_map(
    g: Graph, conv: Node, node: Node
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(W, B (zeros when absent), per-channel constant), in float64 but W, when ``node``
    combines the Conv's output with a per-output-channel constant."""
    params = _constants(g, conv)
    other = _other_operand(node, conv.outputs[0])
    if params is None or other is None:
        return None
    w, b = params
    k = _per_channel(g, other, w)
    if k is None:
        return None
    b64 = b.astype(np.float64) if b is not None else np.zeros(w.shape[0])
    return w, b64, k.astype(np.float64)


def _fold_add(g: Graph, conv: Node, add: Node) -> bool:
    found = _channel_map(g, conv, add)
    if found is not None:
        w, b, k = found
        _set_constants(g, conv, None, (b + k).astype(w.dtype))
    return found is not None


def _fold_mul(g: Graph, conv: Node, mul: Node) -> bool:
    found = _channel_map(g, conv, mul)
    if found is not None:
        w, b, s = found
        _set_constants(g, conv, _per_channel_scaled(w, s), (b * s).astype(w.dtype))
    return found is not None


# ---------------------------------------------------------------------------------------------
# Extended level and above: FusedConv


def conv_activation(view: View, n: Node) -> tuple[str, list[float]] | None:
    """(activation, activation_params) of FusedConv for an activation node, None when ``n`` is
    not one FusedConv can take (Clip's bounds must be constants)."""
    if n.domain != "" or len(n.outputs) != 1 or not n.inputs or not n.inputs[0]:
        return None
    op, a = n.op_type, n.attrs
    if op in ("Relu", "Sigmoid", "Tanh"):
        return op, []
    if op == "LeakyRelu":
        return op, [float(a.get("alpha", 0.01))]
    if op == "HardSigmoid":
        return op, [float(a.get("alpha", 0.2)), float(a.get("beta", 0.5))]
    if op != "Clip":
        return None
    if n.since_version < 11:  # bounds as attributes
        return op, [float(a.get("min", -math.inf)), float(a.get("max", math.inf))]
    bounds = []
    for i, default in ((1, -math.inf), (2, math.inf)):
        name = n.inputs[i] if len(n.inputs) > i else ""
        if not name:
            bounds.append(default)
            continue
        c = view.g.initializers.get(name)
        if c is None or c.size != 1:
            return None
        bounds.append(float(c.reshape(())))
    return op, bounds


def _fused_conv(
    g: Graph, conv: Node, z: str, act: tuple[str, list[float]] | None, last: Node
) -> Node:
    ins = list(conv.inputs) + [""] * (3 - len(conv.inputs))
    if z:
        ins.append(z)
    while not ins[-1]:
        ins.pop()
    attrs: dict[str, Any] = dict(conv.attrs)
    if act is not None:
        attrs["activation"] = act[0]
        if act[1]:
            attrs["activation_params"] = act[1]
    return _new_node(g, "FusedConv", MS_DOMAIN, ins, [last.outputs[0]], attrs, conv)


def _fusable_conv(view: View, n: Node | None) -> bool:
    return (
        n is not None
        and n.op_type == "Conv"
        and n.domain == ""
        and len(n.outputs) == 1
        and len(n.inputs) >= 2
        and view.dtype(n.outputs[0], n.inputs[0]) in FUSED_CONV_TYPES
    )


def fuse_conv_activation(g: Graph, policy: ProviderPolicy | None = None) -> int:
    """Conv + activation -> FusedConv (ConvActivationFusion); returns how many."""
    view = View(g)
    rw = _Rewriter(g, policy or ProviderPolicy())
    for conv in g.nodes:
        if not _fusable_conv(view, conv):
            continue
        act_node = view.sole_reader(conv.outputs[0])
        if act_node is None or act_node.inputs[0] != conv.outputs[0]:
            continue
        act = conv_activation(view, act_node)
        if act is None:
            continue
        fused = _fused_conv(g, conv, "", act, act_node)
        if rw.free([conv, act_node], "FusedConv", MS_DOMAIN, fused):
            rw.add([conv, act_node], act_node, fused)
    return rw.apply()


def _same_shape(view: View, a: str, b: str) -> bool:
    """Both values have one fully known shape (numbers or symbolic dims, equal one by one)."""
    sa, sb = view.shape(a), view.shape(b)
    if sa is None or sb is None or len(sa) != len(sb):
        return False
    return all(x is not None and x == y for x, y in zip(sa, sb))


def fuse_conv_add_activation(g: Graph, policy: ProviderPolicy | None = None) -> int:
    """Conv + Add(same-shape residual) [+ activation] -> FusedConv with Z
    (ConvAddActivationFusion); returns how many."""
    view = View(g)
    rw = _Rewriter(g, policy or ProviderPolicy())
    for add in g.nodes:
        if add.op_type != "Add" or add.domain != "" or len(add.inputs) != 2:
            continue
        a, b = add.inputs
        if a == b or not _same_shape(view, a, b):
            continue
        # the first operand's Conv, as onnxruntime picks; the other operand is Z
        pick = next(
            (
                (view.producer[out], z)
                for out, z in ((a, b), (b, a))
                if _fusable_conv(view, view.producer.get(out)) and view.sole_reader(out) is add
            ),
            None,
        )
        if pick is None:
            continue
        conv, z = pick
        nodes, last, act = [conv, add], add, None
        act_node = view.sole_reader(add.outputs[0])
        if act_node is not None and act_node.inputs[0] == add.outputs[0]:
            act = conv_activation(view, act_node)
            if act is not None:
                nodes, last = [conv, add, act_node], act_node
        fused = _fused_conv(g, conv, z, act, last)
        if rw.free(nodes, "FusedConv", MS_DOMAIN, fused):
            rw.add(nodes, last, fused)
    return rw.apply()
