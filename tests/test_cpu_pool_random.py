"""GlobalLpPool, MaxRoiPool and Multinomial on the CPU provider against their definitions."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

import onnxplug as ox


def _session(node, inputs, outputs, opset=22):
    g = helper.make_graph([node], "g", inputs, outputs)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    return ox.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("p", [1, 2, 3])
def test_global_lp_pool(p):
    x = np.random.default_rng(p).standard_normal((2, 3, 4, 5)).astype(np.float32)
    s = _session(
        helper.make_node("GlobalLpPool", ["x"], ["y"], p=p),
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    want = (np.abs(x.astype(np.float64)) ** p).sum(axis=(2, 3), keepdims=True) ** (1 / p)
    np.testing.assert_allclose(s.run(None, {"x": x})[0], want, rtol=1e-5)


def test_max_roi_pool_by_hand():
    x = np.arange(2 * 1 * 6 * 6, dtype=np.float32).reshape(2, 1, 6, 6)
    rois = np.array([[0, 0, 0, 3, 3], [1, 2, 2, 5, 5], [0, 0, 0, 5, 5]], dtype=np.float32)
    s = _session(
        helper.make_node(
            "MaxRoiPool", ["x", "rois"], ["y"], pooled_shape=[2, 2], spatial_scale=1.0
        ),
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 1, 6, 6]),
            helper.make_tensor_value_info("rois", TensorProto.FLOAT, [3, 5]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    y = s.run(None, {"x": x, "rois": rois})[0]
    assert y.shape == (3, 1, 2, 2)
    # ROI 0: rows/cols 0..3 of image 0 in 2x2 bins -> maxima at (1,1), (1,3), (3,1), (3,3)
    np.testing.assert_array_equal(
        y[0, 0], [[x[0, 0, 1, 1], x[0, 0, 1, 3]], [x[0, 0, 3, 1], x[0, 0, 3, 3]]]
    )
    np.testing.assert_array_equal(
        y[1, 0], [[x[1, 0, 3, 3], x[1, 0, 3, 5]], [x[1, 0, 5, 3], x[1, 0, 5, 5]]]
    )
    np.testing.assert_array_equal(
        y[2, 0], [[x[0, 0, 2, 2], x[0, 0, 2, 5]], [x[0, 0, 5, 2], x[0, 0, 5, 5]]]
    )


def test_multinomial_follows_the_distribution_and_the_seed():
    logits = np.log(np.array([[0.7, 0.2, 0.1], [0.0001, 0.0001, 0.9998]], dtype=np.float32))
    node = helper.make_node(
        "Multinomial", ["x"], ["y"], sample_size=20000, seed=3.0, dtype=TensorProto.INT64
    )
    args = (
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.INT64, None)],
    )
    y = _session(node, *args).run(None, {"x": logits})[0]
    assert y.shape == (2, 20000) and y.dtype == np.int64
    freq = np.bincount(y[0], minlength=3) / 20000
    np.testing.assert_allclose(freq, [0.7, 0.2, 0.1], atol=0.02)
    assert (y[1] == 2).mean() > 0.99
    again = _session(node, *args).run(None, {"x": logits})[0]
    np.testing.assert_array_equal(y, again)
