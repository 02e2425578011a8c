"""Small models for the integration tests (``onnxplug.integrations``), built in memory."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET, IR_VERSION = 17, 8
W = np.array([0.5, -1.0, 2.0, 0.25], np.float32)
B = np.array([0.1, 0.2, -0.3, 0.0], np.float32)


def tabular_model(batch: str | int = "N") -> onnx.ModelProto:
    """Two inputs, three outputs, one row per input row; only elementwise ops and a 4-term
    row sum, so results do not depend on how rows are batched:

        x float [batch, 4], k int64 [batch] -> y = relu(x * W + B) [batch, 4],
                                               s = sum(y, axis 1) [batch], z = 3 * k [batch]
    """
    nodes = [
        helper.make_node("Mul", ["x", "W"], ["xw"]),
        helper.make_node("Add", ["xw", "B"], ["pre"]),
        helper.make_node("Relu", ["pre"], ["y"]),
        helper.make_node("ReduceSum", ["y", "axis1"], ["s"], keepdims=0),
        helper.make_node("Mul", ["k", "three"], ["z"]),
    ]
    graph = helper.make_graph(
        nodes,
        "tabular",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 4]),
            helper.make_tensor_value_info("k", TensorProto.INT64, [batch]),
        ],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 4]),
            helper.make_tensor_value_info("s", TensorProto.FLOAT, [batch]),
            helper.make_tensor_value_info("z", TensorProto.INT64, [batch]),
        ],
        [
            numpy_helper.from_array(W, "W"),
            numpy_helper.from_array(B, "B"),
            numpy_helper.from_array(np.array([1], np.int64), "axis1"),
            numpy_helper.from_array(np.array(3, np.int64), "three"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = IR_VERSION
    return model


def tabular_expected(x: np.ndarray, k: np.ndarray) -> dict[str, np.ndarray]:
    """What ``tabular_model`` computes, in numpy."""
    y = np.maximum(x.astype(np.float32) * W + B, 0)
    return {"y": y, "s": y.sum(axis=1), "z": k.astype(np.int64) * 3}


def total_model() -> onnx.ModelProto:
    """x float [N, 2] -> total float [1]: the sum of the whole batch (not one row per row)."""
    graph = helper.make_graph(
        [
            helper.make_node("ReduceSum", ["x"], ["t"], keepdims=0),
            helper.make_node("Reshape", ["t", "one"], ["total"]),
        ],
        "total",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2])],
        [helper.make_tensor_value_info("total", TensorProto.FLOAT, [1])],
        [numpy_helper.from_array(np.array([1], np.int64), "one")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = IR_VERSION
    return model
