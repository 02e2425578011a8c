"""Native CPU GatherElements against its definition, including BERT's token-type lookup."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxplug as ox


def _run(data: np.ndarray, idx: np.ndarray, axis: int) -> np.ndarray:
    g = helper.make_graph(
        [helper.make_node("GatherElements", ["d", "i"], ["y"], axis=axis)],
        "g",
        [],
        [helper.make_tensor_value_info("y", TensorProto.INT64, None)],
        [numpy_helper.from_array(data, "d"), numpy_helper.from_array(idx, "i")],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    off = ox.SessionOptions()
    off.graph_optimization_level = ox.GraphOptimizationLevel.ORT_DISABLE_ALL  # no folding
    return ox.InferenceSession(m.SerializeToString(), off, providers=["CPUExecutionProvider"]).run(
        None, {}
    )[0]


def _definition(data: np.ndarray, idx: np.ndarray, axis: int) -> np.ndarray:
    out = np.empty(idx.shape, data.dtype)
    for pos in np.ndindex(*idx.shape):
        src = list(pos)
        src[axis] = idx[pos] % data.shape[axis]
        out[pos] = data[tuple(src)]
    return out


def test_bert_token_type_lookup():
    data = np.arange(512, dtype=np.int64).reshape(1, 512) * 3
    idx = np.arange(128, dtype=np.int64).reshape(1, 128)
    np.testing.assert_array_equal(_run(data, idx, 1), data[:, :128])


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_random_with_negative_indices_and_smaller_index_dims(axis):
    rng = np.random.default_rng(axis + 5)
    data = rng.integers(0, 100, (4, 6)).astype(np.int64)
    n = data.shape[axis]
    shape = [3, 5]
    idx = rng.integers(-n, n, shape).astype(np.int64)
    np.testing.assert_array_equal(_run(data, idx, axis), _definition(data, idx, axis % 2))


def test_out_of_range_index_names_the_axis():
    with pytest.raises(ox.errors.Fail, match="outside"):
        _run(np.zeros((2, 3), np.int64), np.array([[3]], np.int64), 1)
