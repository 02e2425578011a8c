"""CPU kernels of com.microsoft FusedConv and FusedMatMul against the ONNX ops they fuse."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

import onnxplug as ox

CPU = "CPUExecutionProvider"
RNG = np.random.default_rng(11)


def _run(nodes, inputs, feeds, ms=False):
    g = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in inputs],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    opsets = [helper.make_opsetid("", 17)] + (
        [helper.make_opsetid("com.microsoft", 1)] if ms else []
    )
    sess = ox.InferenceSession(helper.make_model(g, opset_imports=opsets).SerializeToString(),
                               providers=[CPU])  # fmt: skip
    return sess.run(None, feeds)[0]


@pytest.mark.parametrize("trans_a,trans_b,alpha", [(0, 1, 1.0), (1, 0, 0.5), (1, 1, 2.0)])
def test_fused_matmul(trans_a, trans_b, alpha):
    a = RNG.standard_normal((2, 3, 4, 5) if not trans_a else (2, 3, 5, 4)).astype(np.float32)
    b = RNG.standard_normal((3, 5, 6) if not trans_b else (3, 6, 5)).astype(np.float32)
    fused = _run(
        [
            helper.make_node(
                "FusedMatMul",
                ["a", "b"],
                ["y"],
                domain="com.microsoft",
                transA=trans_a,
                transB=trans_b,
                alpha=alpha,
            )
        ],  # fmt: skip
        "ab",
        {"a": a, "b": b},
        ms=True,
    )
    want = (
        alpha
        * (np.swapaxes(a, -1, -2) if trans_a else a)
        @ (np.swapaxes(b, -1, -2) if trans_b else b)
    )
    np.testing.assert_allclose(fused, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("activation", ["", "Relu", "LeakyRelu", "Sigmoid", "Clip"])
@pytest.mark.parametrize("with_z", [False, True])
def test_fused_conv(activation, with_z):
    x = RNG.standard_normal((2, 3, 6, 6)).astype(np.float32)
    w = RNG.standard_normal((4, 3, 3, 3)).astype(np.float32)
    b = RNG.standard_normal(4).astype(np.float32)
    z = RNG.standard_normal((2, 4, 6, 6)).astype(np.float32)
    params = {"LeakyRelu": [0.2], "Clip": [-0.5, 0.5]}.get(activation, [])
    attrs = {"pads": [1, 1, 1, 1]}
    if activation:
        attrs["activation"] = activation
        if params:
            attrs["activation_params"] = params
    ins = ["x", "w", "b"] + (["z"] if with_z else [])
    feeds = {"x": x, "w": w, "b": b} | ({"z": z} if with_z else {})
    fused = _run([helper.make_node("FusedConv", ins, ["y"], domain="com.microsoft", **attrs)],
                 ins, feeds, ms=True)  # fmt: skip
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1])]
    last = "c"
    if with_z:
        nodes.append(helper.make_node("Add", ["c", "z"], ["cz"]))
        last = "cz"
    act = {
        "Relu": helper.make_node("Relu", [last], ["y"]),
        "LeakyRelu": helper.make_node("LeakyRelu", [last], ["y"], alpha=0.2),
        "Sigmoid": helper.make_node("Sigmoid", [last], ["y"]),
        "Clip": helper.make_node("Clip", [last, "lo", "hi"], ["y"]),
    }.get(activation, helper.make_node("Identity", [last], ["y"]))
    nodes.append(act)
    if activation == "Clip":
        nodes.insert(0, helper.make_node("Constant", [], ["lo"], value_float=-0.5))
        nodes.insert(0, helper.make_node("Constant", [], ["hi"], value_float=0.5))
    want = _run(nodes, ins, feeds)
    np.testing.assert_allclose(fused, want, rtol=1e-5, atol=1e-5)


def test_fused_conv_rejects_an_unknown_activation():
    x = np.zeros((1, 1, 3, 3), np.float32)
    with pytest.raises(Exception, match="FusedConv node .* activation 'Swish'"):
        _run([helper.make_node("FusedConv", ["x", "w"], ["y"], domain="com.microsoft",
                               activation="Swish")], ["x", "w"],  # fmt: skip
             {"x": x, "w": np.zeros((1, 1, 1, 1), np.float32)}, ms=True)  # fmt: skip
