"""A one-node ``Attention`` model (packed Q/K/V projection) with a padding mask, an attention
bias or neither, shared by the simulated-device and GPU attention tests."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper


def attention_node_model(
    b: int, s: int, d: int, heads: int, mask: str, causal: bool, dtype, filter_value=None
) -> bytes:
    ttype = TensorProto.FLOAT16 if dtype == np.float16 else TensorProto.FLOAT
    rng = np.random.default_rng(s)
    w = (rng.standard_normal((d, 3 * d)) / np.sqrt(d)).astype(dtype)
    bias = (rng.standard_normal(3 * d) * 0.1).astype(dtype)
    inputs = ["x", "w", "bias"]
    graph_inputs = [helper.make_tensor_value_info("x", ttype, [b, s, d])]
    attrs: dict = {"num_heads": heads, "unidirectional": int(causal)}
    if filter_value is not None:
        attrs["mask_filter_value"] = filter_value
    domain = "com.microsoft"
    if mask in ("2d", "3d"):
        inputs.append("mask")
        shape = [b, s] if mask == "2d" else [b, s, s]
        graph_inputs.append(helper.make_tensor_value_info("mask", TensorProto.INT32, shape))
    elif mask.startswith("bias"):  # an attention bias (B, 1, S, S), as the fusion writes it
        inputs += ["", "", "attn_bias"]
        graph_inputs.append(helper.make_tensor_value_info("attn_bias", ttype, [b, 1, s, s]))
        if mask == "bias_zero_nan":
            domain, attrs["zero_nan_probabilities"] = "ai.onnxplug", 1
    node = helper.make_node("Attention", inputs, ["y"], domain=domain, **attrs)
    g = helper.make_graph(
        [node],
        "attention",
        graph_inputs,
        [helper.make_tensor_value_info("y", ttype, [b, s, d])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(bias, "bias")],
    )
    m = helper.make_model(
        g,
        opset_imports=[
            helper.make_opsetid("", 17),
            helper.make_opsetid("com.microsoft", 1),
            helper.make_opsetid("ai.onnxplug", 1),
        ],
    )
    return m.SerializeToString()
