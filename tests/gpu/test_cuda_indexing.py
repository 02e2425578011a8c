"""Gathers, scatters and data-dependent selections on the CUDA provider, compared with the
CPU provider (kernels in plugins/cuda/src/onnxplug_cuda/kernels/indexing.py).

One-node models (node "n") run on [CUDA, CPU] and on CPU alone; "n" must run on CUDA and the
outputs must be equal. Everything here is exact, floats included: gathers and scatters move
values, and the scatter reductions are fed small whole numbers (add) and powers of two (mul),
whose sums and products are exact in any order, so atomics combining duplicates in any order
must still match the CPU bit for bit. Indices mix negative and non-negative values and come
as int32 and int64 where ONNX allows both.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from tests.gpu._cuda import CPU, CUDA, assignment, cuda_marks
from tests.gpu.test_cuda_tensor import BF16, MOVE_TYPES, check, check_expected, i64, ids, rand

import onnxplug as ox

pytestmark = cuda_marks

INDEX_TYPES = [np.int32, np.int64]
# Types the scatter reductions claim (all but bfloat16); bool is left out of the comparison:
# onnx.reference has no bool arithmetic.
REDUCE_TYPES = [t for t in MOVE_TYPES if t is not np.bool_ and t is not BF16]


def indices(shape: tuple[int, ...], dim: int, dtype: Any, seed: int) -> np.ndarray:
    """Valid indices into an axis of length ``dim``, about half of them negative."""
    rng = np.random.default_rng(seed)
    v = rng.integers(0, dim, shape)
    return np.where(rng.random(shape) < 0.5, v - dim, v).astype(dtype)


def reduce_values(shape: tuple[int, ...], dtype: Any, reduction: str, seed: int) -> np.ndarray:
    """Update values whose combination is exact in any order for ``reduction``."""
    rng = np.random.default_rng(seed)
    if reduction == "mul":
        v = rng.choice([1, 2], shape)
    else:
        v = rng.integers(0, 4, shape)
    return v.astype(dtype)


# ---------------------------------------------------------------------------------------------
# Gathers


@pytest.mark.parametrize("itype", INDEX_TYPES, ids=ids)
@pytest.mark.parametrize("dtype", MOVE_TYPES, ids=ids)
def test_gather(dtype, itype):
    x = rand((4, 5, 3), dtype)
    for axis in (0, 1, -1):
        dim = x.shape[axis]
        idx = indices((2, 3), dim, itype, axis + 5)
        check("Gather", [("x", x, False), ("i", idx, False)], opset=13, axis=axis)
    check("Gather", [("x", x, False), ("i", np.array(-2, itype), False)], opset=13, axis=1)
    empty = np.zeros((0, 2), itype)
    check("Gather", [("x", x, False), ("i", empty, False)], opset=13, axis=0)


@pytest.mark.parametrize("itype", INDEX_TYPES, ids=ids)
@pytest.mark.parametrize("dtype", MOVE_TYPES, ids=ids)
def test_gather_elements(dtype, itype):
    for shape in [(7,), (4, 5), (3, 4, 5), (2, 3, 2, 4)]:
        x = rand(shape, dtype)
        for axis in range(len(shape)):
            ishape = tuple(3 if d == axis else n for d, n in enumerate(shape))
            idx = indices(ishape, shape[axis], itype, axis)
            check("GatherElements", [("x", x, False), ("i", idx, False)], opset=13, axis=axis)


def test_gather_elements_negative_axis_and_smaller_indices():
    """Index dims smaller than the data's read from the data's corner (onnxruntime's and
    PyTorch's semantics; onnx.reference requires equal dims): compared by hand."""
    x = rand((4, 5, 6), np.float32)
    idx = indices((2, 3, 4), 6, np.int64, 1)
    want = np.take_along_axis(x[:2, :3, :], np.where(idx < 0, idx + 6, idx), axis=2)
    inputs = [("x", x, False), ("i", idx, False)]
    check_expected("GatherElements", inputs, [want], 13, tol=(0.0, 0.0), axis=-1)


@pytest.mark.parametrize("dtype", MOVE_TYPES, ids=ids)
def test_gather_nd(dtype):
    x = rand((2, 3, 4, 5), dtype)
    for k in (1, 2, 4):
        idx = np.stack([indices((3, 2), x.shape[j], np.int64, j) for j in range(k)], axis=-1)
        check("GatherND", [("x", x, False), ("i", idx, False)], opset=13)
    for k in (1, 3):  # batch_dims=1: indices (2, ..., k) pick within each batch item
        idx = np.stack([indices((2, 4), x.shape[1 + j], np.int64, j) for j in range(k)], -1)
        check("GatherND", [("x", x, False), ("i", idx, False)], opset=13, batch_dims=1)


@pytest.mark.parametrize("itype", INDEX_TYPES, ids=ids)
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.int64], ids=ids)
def test_prepared_gathers_move_rows_in_wide_units(dtype, itype):
    """An embedding lookup (rows of 64 elements: 16-byte units) and a GatherND of rows, in
    the first run and in the prepared runs after it (their own gather kernel), equal to numpy
    with negative indices wrapped."""
    from onnx import TensorProto, helper

    table = rand((50, 64), dtype)
    ids_ = np.array([[3, -1, 49, 0, 7], [-50, 12, 12, 1, 30]], itype)
    nd = np.array([[[1, 2]], [[-1, 0]], [[0, -3]]], np.int64)  # (3, 1, 2) into (2, 4, 64)
    data = rand((2, 4, 64), dtype)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    idx_t = helper.np_dtype_to_tensor_dtype(np.dtype(itype))
    g = helper.make_graph(
        [
            helper.make_node("Gather", ["t", "i"], ["y"], name="g", axis=0),
            helper.make_node("GatherND", ["d", "j"], ["z"], name="n"),
        ],
        "g",
        [
            helper.make_tensor_value_info("t", elem, table.shape),
            helper.make_tensor_value_info("i", idx_t, ids_.shape),
            helper.make_tensor_value_info("d", elem, data.shape),
            helper.make_tensor_value_info("j", TensorProto.INT64, nd.shape),
        ],
        [helper.make_tensor_value_info(n, elem, None) for n in "yz"],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    s = ox.InferenceSession(m.SerializeToString(), providers=[CUDA, CPU])
    assert assignment(s) == {"g": CUDA, "n": CUDA}
    want_y = np.take(table, ids_.astype(np.int64) % 50, axis=0)
    w = nd.astype(np.int64) % np.array([2, 4])
    want_z = data[w[..., 0], w[..., 1]]
    for _ in range(3):  # the recording run, the frame's first, a prepared run
        y, z = s.run(None, {"t": table, "i": ids_, "d": data, "j": nd})
        np.testing.assert_array_equal(y, want_y)
        np.testing.assert_array_equal(z, want_z)


# ---------------------------------------------------------------------------------------------
# Scatters


@pytest.mark.parametrize("dtype", MOVE_TYPES, ids=ids)
def test_scatter_nd_replace(dtype):
    x = rand((4, 3, 2), dtype)
    # distinct targets (duplicates have no defined winner)
    idx = i64([[0, 1], [-1, -1], [2, 0], [-3, 2]])
    upd = rand((4, 2), dtype, 5)
    check("ScatterND", [("x", x, False), ("i", idx, False), ("u", upd, False)], opset=18)
    idx1 = i64([[3], [-4]])
    upd1 = rand((2, 3, 2), dtype, 6)
    check("ScatterND", [("x", x, False), ("i", idx1, False), ("u", upd1, False)], opset=13)


@pytest.mark.parametrize("reduction", ["add", "mul", "max", "min"])
@pytest.mark.parametrize("dtype", REDUCE_TYPES, ids=ids)
def test_scatter_nd_reduce(dtype, reduction):
    x = reduce_values((5, 4), dtype, reduction, 0)
    # duplicate targets: the atomics must combine all of them
    idx = i64([[0], [2], [-5], [2], [4], [0], [-3]])
    upd = reduce_values((7, 4), dtype, reduction, 1)
    inputs = [("x", x, False), ("i", idx, False), ("u", upd, False)]
    check("ScatterND", inputs, opset=18, reduction=reduction)
    idx2 = i64([[1, 3], [1, -1], [4, 0], [-4, 3]])
    upd2 = reduce_values((4,), dtype, reduction, 2)
    check(
        "ScatterND",
        [("x", x, False), ("i", idx2, False), ("u", upd2, False)],
        opset=18,
        reduction=reduction,
    )


@pytest.mark.parametrize("itype", INDEX_TYPES, ids=ids)
@pytest.mark.parametrize("dtype", MOVE_TYPES, ids=ids)
def test_scatter_elements_replace(dtype, itype):
    x = rand((4, 5), dtype)
    # a permutation along axis 1: every target distinct
    perm = np.argsort(np.random.default_rng(3).random((4, 5)), axis=1)[:, :3]
    idx = np.where(perm % 2 == 0, perm - 5, perm).astype(itype)
    upd = rand((4, 3), dtype, 4)
    inputs = [("x", x, False), ("i", idx, False), ("u", upd, False)]
    check("ScatterElements", inputs, opset=18, axis=1)
    check("Scatter", inputs, opset=10, axis=1)
    idx0 = np.array([[1, -1, 0, 2, -4]], itype)
    upd0 = rand((1, 5), dtype, 5)
    check("ScatterElements", [("x", x, False), ("i", idx0, False), ("u", upd0, False)], opset=11)


@pytest.mark.parametrize("reduction", ["add", "mul", "max", "min"])
@pytest.mark.parametrize("dtype", REDUCE_TYPES, ids=ids)
def test_scatter_elements_reduce(dtype, reduction):
    x = reduce_values((3, 6), dtype, reduction, 0)
    rng = np.random.default_rng(7)
    for axis in (0, 1):
        ishape = (5, 6) if axis == 0 else (3, 4)
        idx = indices(ishape, x.shape[axis], np.int64, axis)  # many duplicates
        upd = reduce_values(ishape, dtype, reduction, int(rng.integers(100)))
        inputs = [("x", x, False), ("i", idx, False), ("u", upd, False)]
        check("ScatterElements", inputs, opset=18, axis=axis, reduction=reduction)


def test_scatter_reduction_on_bfloat16_is_left_to_cpu():
    x = rand((3, 4), BF16)
    idx = i64([[0, 1], [2, 2]])
    upd = rand((2, 2), BF16, 1)
    inputs = [("x", x, False), ("i", idx, False), ("u", upd, False)]
    check("ScatterElements", inputs, opset=18, axis=1, reduction="add", on="CPUExecutionProvider")


# ---------------------------------------------------------------------------------------------
# Data-dependent selections and encodings


@pytest.mark.parametrize("dtype", [t for t in MOVE_TYPES if t is not BF16], ids=ids)
def test_nonzero(dtype):
    x = rand((3, 4, 5), dtype, lo=-1, hi=2)
    check("NonZero", [("x", x, False)], opset=13)
    check("NonZero", [("x", np.zeros((2, 3), dtype), False)], opset=13)
    check("NonZero", [("x", rand((6,), dtype, 1, lo=-1, hi=2), False)], opset=13)


@pytest.mark.parametrize("dtype", MOVE_TYPES, ids=ids)
def test_compress(dtype):
    x = rand((4, 5), dtype)
    cond = np.array([True, False, True, True])
    check("Compress", [("x", x, False), ("c", cond, False)], opset=11, axis=0)
    check("Compress", [("x", x, False), ("c", cond[:3], False)], opset=11, axis=-1)
    check("Compress", [("x", x, False), ("c", cond, False)], opset=11)  # flattened
    check("Compress", [("x", x, False), ("c", np.zeros(5, bool), False)], opset=11, axis=1)


@pytest.mark.parametrize("vtype", [t for t in MOVE_TYPES if t is not np.bool_], ids=ids)
@pytest.mark.parametrize("itype", [np.int64, np.int32, np.float32, np.uint8], ids=ids)
def test_onehot(itype, vtype):
    depth = 5
    signed = np.dtype(itype).kind != "u"
    rng = np.random.default_rng(0)
    idx = rng.integers(-depth - 1 if signed else 0, depth + 2, (3, 4)).astype(itype)
    values = np.array([2, 7], vtype)  # whole numbers: exact in every type
    for axis in (-1, 0, 1):
        inputs = [("i", idx, False), ("d", np.array(depth, np.int64), True), ("v", values, False)]
        check("OneHot", inputs, opset=11, axis=axis)


@pytest.mark.parametrize("dtype", MOVE_TYPES, ids=ids)
def test_reverse_sequence(dtype):
    x = rand((5, 4, 3), dtype)
    lens = i64([5, 1, 3, 0])
    check("ReverseSequence", [("x", x, False), ("l", lens, False)], opset=10)
    xt = rand((4, 5, 2), dtype)
    inputs = [("x", xt, False), ("l", lens, False)]
    check("ReverseSequence", inputs, opset=10, time_axis=1, batch_axis=0)
