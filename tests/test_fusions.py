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


def test_identity_of_a_weight_folds_without_a_kernel():
    """An Identity on an initializer (torch.onnx puts one on 47 of ResNet-50's weights) folds
    to the same value without running a kernel: such a model alone does not make constant
    folding build the CPU provider's registry. An Identity that is a graph output stays."""
    from onnxplug.ir.graph import graph_from_model
    from onnxplug.ir.model import load_model
    from onnxplug.optimizer.passes import fold_constants

    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    g = helper.make_graph(
        [
            helper.make_node("Identity", ["W"], ["w1"]),
            helper.make_node("Add", ["x", "w1"], ["y"]),
            helper.make_node("Identity", ["W"], ["z"]),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3]),
            helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, 3]),
        ],
        [numpy_helper.from_array(w, "W")],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    loaded = load_model(m.SerializeToString())
    graph = graph_from_model(loaded.proto, loaded.weights)
    calls = []
    fold_constants(graph, lambda *a: calls.append(a))
    assert not calls
    assert [n.op_type for n in graph.nodes] == ["Add", "Identity"]
    np.testing.assert_array_equal(graph.initializers["w1"], w)
    assert not graph.initializers["w1"].flags.writeable
    s = ox.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.ones((2, 3), np.float32)
    y, z = s.run(None, {"x": x})
    np.testing.assert_array_equal(y, x + w)
    np.testing.assert_array_equal(z, w)
