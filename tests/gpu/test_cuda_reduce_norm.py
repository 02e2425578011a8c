"""Reductions, ops along an axis and normalizations on the CUDA provider, compared with the CPU
provider: Reduce*, ArgMax/ArgMin, TopK, CumSum, Softmax/LogSoftmax, Hardmax,
BatchNormalization, LayerNormalization, InstanceNormalization, GroupNormalization,
LpNormalization, MeanVarianceNormalization and LRN.

Every test builds a one-node model (node "n"), runs it with providers [CUDA, CPU] and with
CPU alone, checks that the node ran on CUDAExecutionProvider (the CPU provider for the cases
CUDA declines) and compares the outputs. Tolerances (relative, and absolute near zero):
* integer and bool outputs, TopK and ArgMax/ArgMin indices: exact;
* float32: rtol 1e-5, atol 1e-5 (sums in another order than numpy's);
* float16: rtol 2e-3, atol 2e-3 (both sides reduce in float32 and round once);
* bfloat16: rtol 1.6e-2, atol 1e-2 (two bfloat16 ulps);
* float64: rtol 1e-10, atol 1e-10.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from onnx import TensorProto
from tests.gpu import _oneop
from tests.gpu._cuda import CPU, CUDA, assignment, cuda_marks
from tests.gpu._oneop import ELEM, FLOATS, ids, model, rand

import onnxplug as ox

pytestmark = cuda_marks

TOL = {  # dtype name -> (rtol, atol)
    "float32": (1e-5, 1e-5),
    "float16": (2e-3, 2e-3),
    "bfloat16": (1.6e-2, 1e-2),
    "float64": (1e-10, 1e-10),
}


def check(op: str, feeds: dict[str, np.ndarray], **kw: Any) -> list[np.ndarray]:
    """``_oneop.check`` with this module's tolerances and opset 18 by default."""
    kw.setdefault("opset", 18)
    return _oneop.check(op, feeds, TOL, **kw)


F = TensorProto.FLOAT  # the type of LayerNormalization's Mean and InvStdDev (stash_type)


def i64(*v: int) -> np.ndarray:
    return np.array(v, np.int64)


# ---------------------------------------------------------------------------------------------
# Reductions

REDUCE_OPS = [
    "ReduceSum",
    "ReduceMean",
    "ReduceMax",
    "ReduceMin",
    "ReduceProd",
    "ReduceL1",
    "ReduceL2",
    "ReduceSumSquare",
    "ReduceLogSum",
    "ReduceLogSumExp",
]
LOG_OPS = ("ReduceLogSum", "ReduceLogSumExp")


def reduce_input(op: str, dtype: Any, shape: tuple[int, ...] = (3, 4, 5)) -> np.ndarray:
    if op == "ReduceProd":
        return rand(shape, dtype, 0.5, 1.5 if np.dtype(dtype).kind == "f" else 3, seed=51)
    if op == "ReduceLogSum":
        return rand(shape, dtype, 0.1, 2, seed=51)
    return rand(shape, dtype, -3 if np.dtype(dtype).kind != "u" else 0, 3, seed=51)


@pytest.mark.parametrize("dtype", [*FLOATS, np.int32, np.int64], ids=ids)
@pytest.mark.parametrize("op", REDUCE_OPS)
def test_reduce_axes_input(op, dtype):
    if op in LOG_OPS and np.dtype(dtype).kind in "iu":
        pytest.skip("LogSum/LogSumExp are float-only")
    x = reduce_input(op, dtype)
    for axes in (i64(1), i64(0, 2), i64(-1), i64(0, 1, 2)):
        for keepdims in (0, 1):
            check(op, {"x": x}, inits={"axes": axes}, keepdims=keepdims)
    check(op, {"x": x})  # no axes: all of them
    check(op, {"x": x}, noop_with_empty_axes=1)  # no axes and noop: the input


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int32], ids=ids)
@pytest.mark.parametrize("op", REDUCE_OPS)
def test_reduce_axes_attribute(op, dtype):
    if op in LOG_OPS and np.dtype(dtype).kind in "iu":
        pytest.skip("LogSum/LogSumExp are float-only")
    x = reduce_input(op, dtype)
    check(op, {"x": x}, opset=11, axes=[1], keepdims=1)
    check(op, {"x": x}, opset=11, axes=[0, -1], keepdims=0)
    check(op, {"x": x}, opset=11)


@pytest.mark.parametrize("op", REDUCE_OPS)
def test_reduce_empty_set(op):
    x = np.zeros((2, 0, 3), np.float32)
    check(op, {"x": x}, inits={"axes": i64(1)}, keepdims=1)
    check(op, {"x": x}, inits={"axes": i64(0)}, keepdims=0)  # nothing left: empty output


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.bool_], ids=ids)
@pytest.mark.parametrize("op", ["ReduceMax", "ReduceMin"])
def test_reduce_max_min_small_types(op, dtype):
    x = rand((3, 4, 5), dtype, 0, 100, seed=52)
    check(op, {"x": x}, opset=20, inits={"axes": i64(1)}, keepdims=0)


def test_reduce_large_rows():
    # positive values: a sum of 4097 numbers of both signs could cancel to near zero, where
    # the float32 rounding of two summation orders differs by more than the tolerance
    x = rand((37, 4097), np.float32, 0, 1, seed=53)
    for op in ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceLogSumExp"):
        check(op, {"x": x}, inits={"axes": i64(-1)})
        check(op, {"x": x}, inits={"axes": i64(0)})


# ---------------------------------------------------------------------------------------------
# ArgMax/ArgMin, TopK, CumSum


@pytest.mark.parametrize("dtype", [*FLOATS, np.int32, np.uint8], ids=ids)
@pytest.mark.parametrize("op", ["ArgMax", "ArgMin"])
def test_argmax_argmin(op, dtype):
    x = rand((4, 6, 5), dtype, 0, 4, seed=61)  # few distinct values: ties everywhere
    for axis in (0, 1, -1):
        for keepdims in (0, 1):
            for last in (0, 1):
                check(op, {"x": x}, opset=13, axis=axis, keepdims=keepdims, select_last_index=last)


@pytest.mark.parametrize("dtype", [*FLOATS, np.int64, np.int32, np.uint8], ids=ids)
@pytest.mark.parametrize("largest", [1, 0])
def test_topk(dtype, largest):
    x = rand((5, 9), dtype, 0, 6, seed=62)  # ties: the lower index comes first
    for axis, k in ((-1, 4), (0, 2), (-1, 9), (1, 1)):
        check(
            "TopK",
            {"x": x},
            inits={"k": i64(k)},
            outputs=("values", "indices"),
            opset=11,
            axis=axis,
            largest=largest,
        )


def test_topk_nan_and_attribute_k():
    x = np.array([[1.0, np.nan, 3.0, 3.0, -1.0], [2.0, 2.0, 2.0, np.nan, 0.0]], np.float32)
    for largest in (0, 1):
        check("TopK", {"x": x}, inits={"k": i64(3)}, outputs=("v", "i"), opset=11, largest=largest)
    check("TopK", {"x": x}, outputs=("v", "i"), opset=9, k=2)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, np.int32, np.int64], ids=ids)
def test_cumsum(dtype):
    x = rand((3, 4, 5), dtype, 0, 5, seed=63)  # small whole numbers: exact float16 sums
    for axis in (0, 1, -1):
        for exclusive in (0, 1):
            for reverse in (0, 1):
                check(
                    "CumSum",
                    {"x": x},
                    inits={"axis": np.array(axis, np.int64)},
                    opset=14,
                    exclusive=exclusive,
                    reverse=reverse,
                )


# ---------------------------------------------------------------------------------------------
# Softmax, LogSoftmax, Hardmax


@pytest.mark.parametrize("dtype", FLOATS, ids=ids)
@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
def test_softmax(op, dtype):
    x = rand((3, 4, 5), dtype, -4, 4, seed=71)
    for axis in (-1, 1, 0):  # the last axis (row kernel) and strided axes
        check(op, {"x": x}, opset=13, axis=axis)
    for axis in (1, 2, 0):  # opset < 13: coerced to 2-D at axis
        check(op, {"x": x}, opset=11, axis=axis)


@pytest.mark.parametrize("dtype", FLOATS, ids=ids)
@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
def test_softmax_large_and_masked(op, dtype):
    x = rand((6, 1000), dtype, -8, 8, seed=72)
    check(op, {"x": x}, opset=13)
    m = rand((2, 4, 33), dtype, -3, 3, seed=73)
    m[:, :, 10:] = -np.inf  # a causal-style mask: -inf never contributes
    check(op, {"x": m}, opset=13, axis=-1)
    check(op, {"x": rand((2, 300, 7), dtype, -5, 5, seed=74)}, opset=13, axis=1)


@pytest.mark.parametrize("dtype", FLOATS, ids=ids)
def test_hardmax(dtype):
    x = rand((3, 4, 5), dtype, 0, 3, seed=75)  # ties: the first maximum wins
    for axis in (-1, 1, 0):
        check("Hardmax", {"x": x}, opset=13, axis=axis)


@pytest.mark.parametrize("dtype", FLOATS, ids=ids)
def test_hardmax_coerced_2d(dtype):
    """Hardmax-11 takes the maximum over the flattened dims from ``axis`` on. Compared with
    the spec, not the CPU provider: onnx's reference (which the CPU provider runs for it)
    applies Hardmax-13's single-axis rule at every opset."""
    x = rand((3, 4, 5), dtype, 0, 3, seed=76)
    refused = _oneop._not_admitted("Hardmax", {"x": x}, 11)
    if refused:
        pytest.skip(refused)
    sess = ox.InferenceSession(model("Hardmax", {"x": x}, opset=11, axis=1), providers=[CUDA])
    assert assignment(sess)["n"] == CUDA
    (got,) = sess.run(None, {"x": x})
    rows = x.reshape(3, 20).astype(np.float64)
    want = np.zeros_like(rows)
    want[np.arange(3), rows.argmax(axis=1)] = 1
    assert got.dtype == x.dtype
    np.testing.assert_array_equal(got.astype(np.float64), want.reshape(x.shape))


# ---------------------------------------------------------------------------------------------
# Normalizations


@pytest.mark.parametrize("dtype", FLOATS, ids=ids)
def test_batchnorm_inference(dtype):
    c = 3
    feeds = {
        "x": rand((2, c, 4, 5), dtype, -3, 3, seed=81),
        "scale": rand((c,), dtype, 0.5, 2, seed=82),
        "bias": rand((c,), dtype, -1, 1, seed=83),
        "mean": rand((c,), dtype, -1, 1, seed=84),
        "var": rand((c,), dtype, 0.5, 2, seed=85),
    }
    check("BatchNormalization", feeds, opset=15, epsilon=1e-3)
    two_d = dict(feeds, x=rand((7, c), dtype, -3, 3, seed=86))
    check("BatchNormalization", two_d, opset=15)


def test_batchnorm_mixed_types_and_training():
    c = 4
    feeds = {
        "x": rand((2, c, 3), np.float16, -3, 3, seed=87),
        "scale": rand((c,), np.float32, 0.5, 2, seed=88),
        "bias": rand((c,), np.float32, -1, 1, seed=89),
        "mean": rand((c,), np.float32, -1, 1, seed=90),
        "var": rand((c,), np.float32, 0.5, 2, seed=91),
    }
    check("BatchNormalization", feeds, opset=15)
    f32 = {k: v.astype(np.float32) for k, v in feeds.items()}
    check(
        "BatchNormalization",
        f32,
        on=CPU,
        opset=15,
        training_mode=1,
        outputs=("y", "running_mean", "running_var"),
    )


@pytest.mark.parametrize("dtype", FLOATS, ids=ids)
def test_layer_normalization(dtype):
    x = rand((2, 3, 4, 5), dtype, -3, 3, seed=101)
    stats = {"outputs": ("y", "mean", "inv_std"), "out_types": (ELEM[np.dtype(dtype)], F, F)}
    for axis in (-1, 1, 0, -2):
        shape = x.shape[axis % 4 :]
        feeds = {"x": x, "scale": rand(shape, dtype, 0.5, 2, seed=102)}
        feeds["bias"] = rand(shape, dtype, -1, 1, seed=103)
        check("LayerNormalization", feeds, opset=17, axis=axis, **stats)
        no_bias = {"x": x, "scale": feeds["scale"]}
        check("LayerNormalization", no_bias, opset=17, axis=axis, epsilon=1e-3)


@pytest.mark.parametrize("dtype", FLOATS, ids=ids)
def test_layer_normalization_bert_rows(dtype):
    x = rand((4, 64, 768), dtype, -2, 2, seed=104)
    feeds = {
        "x": x,
        "scale": rand((768,), dtype, 0.5, 1.5, seed=105),
        "bias": rand((768,), dtype, -0.5, 0.5, seed=106),
    }
    outs = {"outputs": ("y", "mean", "rstd"), "out_types": (ELEM[np.dtype(dtype)], F, F)}
    check("LayerNormalization", feeds, opset=17, epsilon=1e-12, **outs)


def test_layer_normalization_broadcast_scale():
    x = rand((3, 4, 6), np.float32, -2, 2, seed=107)
    feeds = {"x": x, "scale": rand((6,), np.float32, 0.5, 2, seed=108)}
    feeds["bias"] = rand((1, 6), np.float32, -1, 1, seed=109)
    check("LayerNormalization", feeds, opset=17, axis=1)


@pytest.mark.parametrize("dtype", FLOATS, ids=ids)
def test_instance_normalization(dtype):
    feeds = {
        "x": rand((2, 3, 4, 5), dtype, -3, 3, seed=111),
        "scale": rand((3,), dtype, 0.5, 2, seed=112),
        "bias": rand((3,), dtype, -1, 1, seed=113),
    }
    check("InstanceNormalization", feeds, opset=22, epsilon=1e-4)
    feeds["x"] = rand((2, 3, 7), dtype, -3, 3, seed=114)
    check("InstanceNormalization", feeds, opset=22)


@pytest.mark.parametrize("dtype", FLOATS, ids=ids)
def test_group_normalization(dtype):
    """float64 normalizes in float32 (stash_type), so it is float32-accurate."""
    x = rand((3, 6, 2, 5), dtype, -3, 3, seed=121)
    tol = "float32" if np.dtype(dtype) == np.float64 else ""
    for groups in (1, 2, 3, 6):
        per_channel = {
            "x": x,
            "scale": rand((6,), dtype, 0.5, 2, seed=122),
            "bias": rand((6,), dtype, -1, 1, seed=123),
        }
        check("GroupNormalization", per_channel, tol=tol, opset=21, num_groups=groups, epsilon=1e-4)


@pytest.mark.parametrize("dtype", FLOATS, ids=ids)
def test_lp_normalization(dtype):
    x = rand((3, 4, 5), dtype, -3, 3, seed=131)
    for axis in (-1, 0, 1):
        check("LpNormalization", {"x": x}, opset=22, axis=axis, p=2)
    # p=1 on positive values (onnx's reference sums x, not |x|: they agree there)
    pos = rand((3, 4, 5), dtype, 0.1, 3, seed=132)
    check("LpNormalization", {"x": pos}, opset=22, axis=-1, p=1)
    zeros = np.zeros((2, 3), dtype)  # a zero norm gives 0
    check("LpNormalization", {"x": zeros}, opset=22, axis=-1, p=2)


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=ids)
def test_mean_variance_normalization(dtype):
    """float32/float64 only: the CPU provider runs the op's function body, whose float32
    epsilon turns a float16 input's result into float32 (the schema says float16)."""
    x = rand((3, 3, 4, 2), dtype, -3, 3, seed=141)
    check("MeanVarianceNormalization", {"x": x}, opset=13)
    check("MeanVarianceNormalization", {"x": x}, opset=13, axes=[1, 2])


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64], ids=ids)
def test_lrn(dtype):
    x = rand((2, 6, 4, 3), dtype, -2, 2, seed=151)
    check("LRN", {"x": x}, opset=13, size=3)
    check("LRN", {"x": x}, opset=13, size=4, alpha=1e-3, beta=0.6, bias=2.0)
    check("LRN", {"x": x[:, :2]}, opset=13, size=5)  # window wider than the channels
