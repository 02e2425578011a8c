"""Graph optimization passes, run in place on the IR before partitioning.

Levels follow onnxruntime's: 0 disables everything; 1 (basic) folds constants, removes no-op
nodes and folds per-channel constant maps into convolutions (``conv``); 2 (extended) adds the
fusions into contrib ops: the transformer fusions (Gelu, SkipLayerNormalization, MatMulBias,
attention, BiasGelu: see ``fusions`` and ``attention``), Conv + activation -> FusedConv
(``conv``) and Transposes and scalar scales into FusedMatMul (``matmul``); 3
(``ORT_ENABLE_LAYOUT``) and above add Conv + residual Add [+ activation] -> FusedConv, which
onnxruntime runs at that level (``ConvAddActivationFusion``), and, after every fusion, the
layout transformation for providers that prefer NHWC (their convolutions and pools become
``com.ms.internal.nhwc`` ops between Transposes) with the transpose optimizer that cancels
those Transposes (``TransposeOptimizer``; see ``layout``).

Each pass has onnxruntime's name (``OPTIMIZER_NAMES``); the names a session disables
(``InferenceSession(..., disabled_optimizers=[...])`` or the session config entry
``optimization.disable_specified_optimizers``, names separated by ``;``) are skipped, and
names of onnxruntime optimizers onnxplug does not have are accepted and ignored, as there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import onnx

from ..ir.graph import Graph, Node, read_only
from .conv import fold_conv_constants, fuse_conv_activation, fuse_conv_add_activation
from .fusions import TRANSFORMER_FUSION_NAMES, ProviderPolicy, fuse_transformer
from .layout import convert_to_nhwc, optimize_transposes
from .matmul import fuse_matmul_scale, fuse_matmul_transpose

Folder = Callable[[Graph, Node, list[Any]], list[Any] | None]

# the level from which each of onnxruntime's optimizers that onnxplug implements runs
OPTIMIZER_NAMES: dict[str, int] = {
    "ConstantFolding": 1,
    "EliminateIdentity": 1,
    "ConvBNFusion": 1,
    "ConvAddFusion": 1,
    "ConvMulFusion": 1,
    **{name: 2 for names in TRANSFORMER_FUSION_NAMES.values() for name in names},
    "ConvActivationFusion": 2,
    "MatmulTransposeFusion": 2,
    "MatMulScaleFusion": 2,
    "ConvAddActivationFusion": 3,
    # onnxruntime runs it from level 1 on every graph; here it cleans up after the layout
    # transformation (level 3), on the graphs that one changed
    "TransposeOptimizer": 3,
}
# the level of the layout transformation (onnxruntime's ORT_ENABLE_LAYOUT)
LAYOUT_LEVEL = 3

_NO_FOLD = frozenset(
    {
        "RandomNormal",
        "RandomUniform",
        "RandomNormalLike",
        "RandomUniformLike",
        "Bernoulli",
        "Multinomial",
        "Dropout",
        "If",
        "Loop",
        "Scan",
        "SequenceEmpty",
        "Optional",
    }
)
_FOLD_MAX_ELEMENTS = 1 << 20
_FUSION_ROUNDS = 5


def disabled_optimizers(names: Iterable[str] | str | None) -> frozenset[str]:
    """The optimizer names a session disables: a list, or the config entry's ``;``-separated
    text (spaces around a name are ignored)."""
    if names is None:
        return frozenset()
    if isinstance(names, str):
        names = names.split(";")
    return frozenset(n.strip() for n in names if n.strip())


def optimize(
    graph: Graph,
    level: int,
    folder: Folder | None = None,
    registries: list[Any] | None = None,
    disabled: frozenset[str] = frozenset(),
) -> None:
    """Optimize ``graph`` and its subgraphs in place; ``registries``: the session's providers
    in priority order (fusions never take nodes away from a provider, see
    ``fusions.ProviderPolicy``); ``disabled``: onnxruntime names of passes to skip."""
    if level <= 0:
        return
    policy = ProviderPolicy(registries)
    later: list[tuple[str, Callable[[Graph, ProviderPolicy], int]]] = [
        ("ConvActivationFusion", fuse_conv_activation),
        ("MatmulTransposeFusion", fuse_matmul_transpose),
        ("MatMulScaleFusion", fuse_matmul_scale),
        ("ConvAddActivationFusion", fuse_conv_add_activation),
    ]
    for g in _all_graphs(graph):
        _constant_to_initializer(g)
        if folder is not None and "ConstantFolding" not in disabled:
            fold_constants(g, folder)
        if "EliminateIdentity" not in disabled:
            _remove_identity(g)
        fold_conv_constants(g, disabled)
        if level >= 2:
            fuse_transformer(g, registries, disabled)
        # one fusion can make another possible (a scale folded into FusedMatMul leaves a
        # Transpose in reach): rounds until nothing changes, at most onnxruntime's 5 steps
        active = [f for name, f in later if level >= OPTIMIZER_NAMES[name] and name not in disabled]
        for _ in range(_FUSION_ROUNDS):
            if not sum(fuse(g, policy) for fuse in active):
                break
        # after the fusions: FusedConv must exist before it is given its NHWC form
        if level >= LAYOUT_LEVEL and convert_to_nhwc(g, registries):
            if "TransposeOptimizer" not in disabled:
                optimize_transposes(g)


def _all_graphs(g: Graph) -> list[Graph]:
    out = [g]
    for n in g.nodes:
        for sg in n.subgraphs.values():
            out.extend(_all_graphs(sg))
    return out


def _outer_refs(g: Graph) -> set[str]:
    refs: set[str] = set()
    for n in g.nodes:
        refs.update(n.implicit_inputs)
    return refs


def _constant_to_initializer(g: Graph) -> None:
    """``Constant`` nodes with a tensor value become initializers."""
    keep: list[Node] = []
    outputs = {vi.name for vi in g.outputs}
    for n in g.nodes:
        if (
            n.op_type == "Constant"
            and n.domain == ""
            and len(n.outputs) == 1
            and n.outputs[0] not in outputs
        ):
            v = _constant_value(n)
            if v is not None:
                g.initializers[n.outputs[0]] = v
                continue
        keep.append(n)
    g.nodes = keep


def _constant_value(n: Node) -> np.ndarray | None:
    a = n.attrs
    if "value" in a and isinstance(a["value"], np.ndarray):
        return a["value"]
    if "value_float" in a:
        return np.array(a["value_float"], dtype=np.float32)
    if "value_floats" in a:
        return np.array(a["value_floats"], dtype=np.float32)
    if "value_int" in a:
        return np.array(a["value_int"], dtype=np.int64)
    if "value_ints" in a:
        return np.array(a["value_ints"], dtype=np.int64)
    if "value_string" in a:
        return np.array(a["value_string"], dtype=object)
    if "value_strings" in a:
        return np.array(a["value_strings"], dtype=object)
    return None


def fold_constants(g: Graph, folder: Folder) -> None:
    outputs = {vi.name for vi in g.outputs}
    keep: list[Node] = []
    for n in g.nodes:
        if (
            n.op_type in _NO_FOLD
            or n.subgraphs
            or not n.inputs
            or any(o in outputs for o in n.outputs)
            or not all((not i) or i in g.initializers for i in n.inputs)
        ):
            keep.append(n)
            continue
        ins = [g.initializers[i] if i else None for i in n.inputs]
        if n.op_type == "Identity" and n.domain == "" and isinstance(ins[0], np.ndarray):
            # the value itself, without a kernel: exporters put an Identity on weights
            # (torch.onnx: 47 of ResNet-50's), which alone would build the folder's registry
            g.initializers[n.outputs[0]] = read_only(ins[0])
            continue
        limit = max(_FOLD_MAX_ELEMENTS, sum(getattr(x, "size", 0) for x in ins))
        sizes = predicted_sizes(n, ins)
        if sizes is None or any(size > limit for size in sizes):
            keep.append(n)  # too big (or of unknown size) to keep as a constant: run time
            continue
        try:
            outs = folder(g, n, ins)
        except Exception:
            outs = None
        if (
            outs is None
            or len(outs) < len([o for o in n.outputs if o])
            or not all(isinstance(o, np.ndarray) and o.size <= limit for o in outs)
        ):
            keep.append(n)
            continue
        for name, value in zip(n.outputs, outs):
            if name:
                g.initializers[name] = read_only(value)
    g.nodes = keep


# Constant inputs up to this many elements are given to shape inference as values (shape
# tensors, repeats, pads): enough for the output shapes of Expand, Tile, ConstantOfShape...
_INFER_DATA_ELEMENTS = 4096


def predicted_sizes(n: Node, ins: list[Any]) -> list[int] | None:
    """Element counts of ``n``'s outputs for these constant inputs, from onnx's shape inference
    of the node alone, *before* computing them (an all-constant Expand to 8 GB must not be
    folded to find out); None when inference cannot tell."""
    if n.proto is None:
        return None
    try:
        schema = onnx.defs.get_schema(n.op_type, n.opset, n.domain)
        types: dict[str, onnx.TypeProto] = {}
        data: dict[str, onnx.TensorProto] = {}
        for name, v in zip(n.inputs, ins):
            if not name or not isinstance(v, np.ndarray) or v.dtype == object:
                continue
            elem = onnx.helper.np_dtype_to_tensor_dtype(v.dtype)
            types[name] = onnx.helper.make_tensor_type_proto(elem, list(v.shape))
            if v.size <= _INFER_DATA_ELEMENTS and v.dtype.kind in "iu":
                data[name] = onnx.numpy_helper.from_array(np.asarray(v, order="C"), name)
        inferred = onnx.shape_inference.infer_node_outputs(schema, n.proto, types, data)
    except Exception:
        return None
    sizes: list[int] = []
    for o in n.outputs:
        if not o:
            continue
        tp = inferred.get(o)
        if tp is None or tp.WhichOneof("value") != "tensor_type":
            return None
        tt = tp.tensor_type
        if not tt.HasField("shape"):
            return None
        size = 1
        for d in tt.shape.dim:
            if not d.HasField("dim_value") or d.dim_value < 0:
                return None
            size *= d.dim_value
        sizes.append(size)
    return sizes


def _remove_identity(g: Graph) -> None:
    outputs = {vi.name for vi in g.outputs}
    refs = _outer_refs(g)
    rename: dict[str, str] = {}
    keep: list[Node] = []
    for n in g.nodes:
        if (
            n.op_type == "Identity"
            and n.domain == ""
            and n.outputs[0] not in outputs
            and n.outputs[0] not in refs
            and _tensor_or_untyped(g, n.inputs[0])
        ):
            src = n.inputs[0]
            rename[n.outputs[0]] = rename.get(src, src)
            continue
        keep.append(n)
    if not rename:
        return
    for n in keep:
        n.inputs = [rename.get(i, i) for i in n.inputs]
    g.nodes = keep


def _tensor_or_untyped(g: Graph, name: str) -> bool:
    """Whether ``name`` is a tensor or of unknown type: only such Identity nodes are removed."""
    t = g.type_of(name)
    return t is None or t.kind == "tensor"
