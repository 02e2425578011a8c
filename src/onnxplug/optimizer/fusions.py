"""Provider-independent fusions (onnxruntime's basic-level rewrites).

* Conv + BatchNormalization (inference) with constant parameters: the normalization is folded
  into the convolution's weights and bias, removing a whole pass over the activation.
"""

from __future__ import annotations

import numpy as np

from ..ir.graph import Graph, Node


def _single_consumer(g: Graph, name: str, outputs: set[str]) -> Node | None:
    if name in outputs:
        return None
    users = [n for n in g.nodes if name in n.inputs or name in n.implicit_inputs]
    return users[0] if len(users) == 1 else None


def fold_conv_batchnorm(g: Graph) -> int:
    """Fold BatchNormalization into the Conv that feeds it; returns how many were folded."""
    outputs = {vi.name for vi in g.outputs}
    inits = g.initializers
    removed: set[int] = set()
    folded = 0
    for conv in g.nodes:
        if conv.op_type != "Conv" or conv.domain != "" or len(conv.outputs) != 1:
            continue
        if len(conv.inputs) < 2 or conv.inputs[1] not in inits:
            continue
        bias_name = conv.inputs[2] if len(conv.inputs) > 2 and conv.inputs[2] else None
        if bias_name is not None and bias_name not in inits:
            continue
        bn = _single_consumer(g, conv.outputs[0], outputs)
        if bn is None or bn.op_type != "BatchNormalization" or bn.domain != "":
            continue
        if bn.inputs[0] != conv.outputs[0] or len(bn.inputs) < 5:
            continue
        if any(o for o in bn.outputs[1:]) or bn.attrs.get("training_mode", 0):
            continue
        if not all(i in inits for i in bn.inputs[1:5]):
            continue
        w = inits[conv.inputs[1]]
        if w.dtype.kind != "f":
            continue
        scale, beta, mean, var = (inits[i].astype(np.float64) for i in bn.inputs[1:5])
        eps = float(bn.attrs.get("epsilon", 1e-5))
        factor = scale / np.sqrt(var + eps)
        if factor.shape[0] != w.shape[0]:
            continue
        b = inits[bias_name].astype(np.float64) if bias_name else np.zeros(w.shape[0])
        new_w = (w.astype(np.float64) * factor.reshape(-1, *([1] * (w.ndim - 1)))).astype(w.dtype)
        new_b = ((b - mean) * factor + beta).astype(w.dtype)
        w_name = g.unique_name(f"{conv.inputs[1]}_bnfold")
        b_name = g.unique_name(f"{conv.name}_bias_bnfold")
        inits[w_name] = new_w
        inits[b_name] = new_b
        conv.inputs = [conv.inputs[0], w_name, b_name]
        conv.outputs = [bn.outputs[0]]
        removed.add(id(bn))
        folded += 1
    if removed:
        g.nodes = [n for n in g.nodes if id(n) not in removed]
        _drop_unused_initializers(g)
    return folded


def _drop_unused_initializers(g: Graph) -> None:
    used = {i for n in g.nodes for i in n.inputs} | {i for n in g.nodes for i in n.implicit_inputs}
    used |= {vi.name for vi in g.outputs} | {vi.name for vi in g.inputs}
    for name in [k for k in g.initializers if k not in used]:
        del g.initializers[name]
