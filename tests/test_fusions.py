"""Optimizer fusions give the same results as the unfused graph."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxplug as ox


def _conv_bn_model(bias: bool, groups: int = 1) -> bytes:
    rng = np.random.default_rng(0)
    c, m = 4, 6
    w = rng.standard_normal((m, c // groups, 3, 3)).astype(np.float32)
    inits = [numpy_helper.from_array(w, "W")]
    conv_in = ["x", "W"]
    if bias:
        inits.append(numpy_helper.from_array(rng.standard_normal(m).astype(np.float32), "B"))
        conv_in.append("B")
    for name, arr in {
        "scale": rng.uniform(0.5, 2, m),
        "beta": rng.standard_normal(m),
        "mean": rng.standard_normal(m),
        "var": rng.uniform(0.1, 3, m),
    }.items():
        inits.append(numpy_helper.from_array(arr.astype(np.float32), name))
    nodes = [
        helper.make_node("Conv", conv_in, ["c"], pads=[1, 1, 1, 1], group=groups),
        helper.make_node(
            "BatchNormalization", ["c", "scale", "beta", "mean", "var"], ["y"], epsilon=1e-3
        ),
    ]
    g = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, c, 5, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 15)]).SerializeToString()


@pytest.mark.parametrize("bias,groups", [(True, 1), (False, 1), (True, 2)])
def test_conv_batchnorm_fold(bias, groups):
    model = _conv_bn_model(bias, groups)
    x = np.random.default_rng(1).standard_normal((2, 4, 5, 5)).astype(np.float32)
    off = ox.SessionOptions()
    off.graph_optimization_level = ox.GraphOptimizationLevel.ORT_DISABLE_ALL
    ref = ox.InferenceSession(model, off, providers=["CPUExecutionProvider"])
    fused = ox.InferenceSession(model, providers=["CPUExecutionProvider"])
    ops = [r["op_type"] for r in fused.get_provider_graph_assignment_info()]
    assert ops == ["Conv"], ops
    assert [r["op_type"] for r in ref.get_provider_graph_assignment_info()] == [
        "Conv",
        "BatchNormalization",
    ]
    np.testing.assert_allclose(
        fused.run(None, {"x": x})[0], ref.run(None, {"x": x})[0], rtol=1e-5, atol=1e-5
    )
