"""Tensor manipulation, generators and Resize on the CUDA provider, compared with the CPU
provider (kernels in plugins/cuda/src/onnxplug_cuda/kernels/tensor.py, misc.py, resize.py).

Every test builds a one-node model (node "n"), runs it with providers [CUDA, CPU] and with CPU
alone, checks that "n" ran on CUDAExecutionProvider (or, for what the CUDA kernels decline,
on the CPU provider) and compares the outputs. Tolerances:
* data movement (views, copies, gathers, pads, nearest resizing, fills): exact, every dtype;
* float32 arithmetic (linear/cubic Resize, Einsum, Shrink, Range): rtol 1e-5, atol 1e-5
  (the GPU accumulates in float32, the CPU reference in float64);
* float16: rtol 2e-3, atol 2e-3 (one float16 ulp: both round once from a wider type);
* bfloat16 Einsum: rtol 1.6e-2, atol 1e-2 (two bfloat16 ulps);
* integer linear/cubic Resize: atol 1 (a result on a .5 tie may round the other way: the
  reference accumulates axis by axis, the GPU over all taps at once).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from onnx import helper, numpy_helper
from tests.gpu import _oneop
from tests.gpu._cuda import CPU, CUDA, cuda_marks, run_cuda_and_cpu

pytestmark = cuda_marks

import ml_dtypes  # noqa: E402 - a dependency of onnx

BF16: Any = np.dtype(ml_dtypes.bfloat16)

# Every fixed-size type the data-movement kernels claim (bfloat16 as its uint16 bits).
MOVE_TYPES = [
    np.float32,
    np.float16,
    np.float64,
    np.int8,
    np.int16,
    np.int32,
    np.int64,
    np.uint8,
    np.uint16,
    np.uint32,
    np.uint64,
    np.bool_,
    BF16,
]
EXACT = (0.0, 0.0)
F32 = (1e-5, 1e-5)
F16 = (2e-3, 2e-3)


def ids(v: Any) -> str:
    return np.dtype(v).name if isinstance(v, (type, np.dtype)) else str(v)


def rand(shape: tuple[int, ...], dtype: Any, seed: int = 0, lo: float = -9, hi: float = 9) -> Any:
    """Random values of ``dtype`` (whole numbers for integers, non-negative for unsigned)."""
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    if dt == np.bool_:
        return rng.random(shape) < 0.5
    v = rng.uniform(0 if dt.kind == "u" else lo, hi, shape)
    if dt.kind in "iu":
        return np.floor(v).astype(dt)
    return v.astype(np.float32).astype(dt)


def model(
    op: str,
    inputs: list[tuple[str, Any, bool] | None],
    n_out: int = 1,
    opset: int = 21,
    **attrs: Any,
) -> tuple[bytes, dict[str, np.ndarray]]:
    """A one-node model (node "n") and its feeds. ``inputs`` are (name, value, initializer?)
    in the node's order; None is an absent optional input."""
    names, feeds, vis, inits = [], {}, [], []
    for item in inputs:
        if item is None:
            names.append("")
            continue
        name, value, is_init = item
        value = np.asarray(value)
        names.append(name)
        if is_init:
            inits.append(numpy_helper.from_array(value, name))
        else:
            feeds[name] = value
            dt = helper.np_dtype_to_tensor_dtype(value.dtype)
            vis.append(helper.make_tensor_value_info(name, dt, value.shape))
    outs = [f"y{i}" for i in range(n_out)]
    node = helper.make_node(op, names, outs, name="n", **attrs)
    g = helper.make_graph(
        [node],
        "g",
        vis,
        [helper.make_empty_tensor_value_info(o) for o in outs],
        inits,
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    return m.SerializeToString(), feeds


def compare(got: list[Any], ref: list[Any], tol: tuple[float, float]) -> None:
    assert len(got) == len(ref)
    for g, r in zip(got, ref, strict=True):
        g, r = np.asarray(g), np.asarray(r)
        assert g.shape == r.shape and g.dtype == r.dtype, (g.shape, r.shape, g.dtype, r.dtype)
        if r.dtype == BF16:
            g, r = g.astype(np.float32), r.astype(np.float32)
        if tol == EXACT or r.dtype.kind not in "fiu" or r.dtype == np.bool_:
            np.testing.assert_array_equal(g, r)
        else:
            np.testing.assert_allclose(
                g.astype(np.float64), r.astype(np.float64), rtol=tol[0], atol=tol[1]
            )


def check(
    op: str,
    inputs: list[tuple[str, Any, bool] | None],
    n_out: int = 1,
    opset: int = 21,
    tol: tuple[float, float] = EXACT,
    on: str = CUDA,
    **attrs: Any,
) -> list[Any]:
    """Run ``op`` on [CUDA, CPU] and on CPU: "n" must run on ``on``; the outputs agree."""
    refused = _oneop._not_admitted(op, [i for i in inputs if i is not None], opset)
    if refused:  # an invalid model (onnxruntime refuses it too): nothing to compare
        if not _oneop.CHECKS_RUN:
            pytest.skip(refused)
        return []
    _oneop.CHECKS_RUN.append(op)
    m, feeds = model(op, inputs, n_out, opset, **attrs)
    got, ref, where = run_cuda_and_cpu(m, feeds)
    assert where["n"] == on, where
    compare(got, ref, tol)
    return got


def check_expected(
    op: str, inputs: list[Any], expected: list[Any], opset: int, tol: Any = F32, **attrs: Any
) -> None:
    """For what the CPU provider cannot run: "n" on CUDA, outputs equal to ``expected``."""
    from tests.gpu._cuda import assignment

    import onnxplug as ox

    m, feeds = model(op, inputs, len(expected), opset, **attrs)
    sess = ox.InferenceSession(m, providers=[CUDA, CPU])
    assert assignment(sess)["n"] == CUDA
    compare(sess.run(None, feeds), expected, tol)


def i64(v: Any) -> np.ndarray:
    return np.asarray(v, dtype=np.int64)


# ---------------------------------------------------------------------------------------------
# Views


@pytest.mark.parametrize("dtype", MOVE_TYPES, ids=ids)
def test_views(dtype):
    x = rand((2, 1, 3, 4), dtype)
    check("Reshape", [("x", x, False), ("s", i64([0, -1, 2]), True)], opset=14)
    check("Reshape", [("x", x, False), ("s", i64([6, 4]), False)], opset=14)
    check("Reshape", [("x", rand((0, 3), dtype), False), ("s", i64([3, 0]), True)], allowzero=1)
    check("Flatten", [("x", x, False)], axis=-2)
    check("Squeeze", [("x", x, False), ("a", i64([1]), True)], opset=13)
    check("Squeeze", [("x", x, False)], opset=11, axes=[1])
    check("Unsqueeze", [("x", x, False), ("a", i64([0, -1]), True)], opset=13)
    check("Unsqueeze", [("x", x, False)], opset=11, axes=[0, 5])
    check("Identity", [("x", x, False)])
    check("Identity", [("x", rand((), dtype), False)])


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64, BF16], ids=ids)
def test_dropout_inference(dtype):
    x = rand((3, 4), dtype)
    y, mask = check("Dropout", [("x", x, False)], n_out=2, opset=13)
    assert mask.dtype == np.bool_ and mask.all()
    check("Dropout", [("x", x, False), ("r", np.float32(0.3), True)], n_out=2, opset=13)
    false = np.array(False)
    check("Dropout", [("x", x, False), None, ("t", false, True)], n_out=2, opset=13)
    if dtype != BF16:
        check("Dropout", [("x", x, False)], n_out=2, opset=7)  # mask of T


def test_dropout_training_is_left_to_cpu():
    x = rand((3, 4), np.float32)
    true = np.array(True)
    # ratio 0: training mode, but the output is still the input (deterministic to compare)
    check("Dropout", [("x", x, False), ("r", np.float32(0), True), ("t", true, True)], on=CPU)


# ---------------------------------------------------------------------------------------------
# Copies


@pytest.mark.parametrize("dtype", MOVE_TYPES, ids=ids)
def test_transpose(dtype):
    x = rand((2, 3, 1, 5), dtype)
    check("Transpose", [("x", x, False)], perm=[3, 0, 2, 1])
    check("Transpose", [("x", x, False)])  # reversed dims
    check("Transpose", [("x", x, False)], perm=[0, 2, 1, 3])  # only moves a size-1 dim: a view


@pytest.mark.parametrize("dtype", MOVE_TYPES, ids=ids)
def test_concat_split(dtype):
    parts = [("a", rand((2, 3, 4), dtype, 1), False), ("b", rand((2, 3, 0), dtype, 2), False)]
    parts += [("c", rand((2, 3, 2), dtype, 3), True)]
    check("Concat", parts, axis=-1)
    many = [(f"x{i}", rand((i % 3, 2), dtype, i), False) for i in range(10)]  # > 8 inputs
    check("Concat", many, axis=0)
    x = rand((7, 5), dtype)
    check("Split", [("x", x, False), ("s", i64([2, 0, 5]), True)], n_out=3, opset=13)
    check("Split", [("x", x, False)], n_out=3, opset=18, axis=0, num_outputs=3)
    check("Split", [("x", x, False)], n_out=2, opset=11, axis=-1, split=[1, 4])


@pytest.mark.parametrize("dtype", MOVE_TYPES, ids=ids)
def test_slice(dtype):
    x = rand((5, 6, 7), dtype)
    big = np.iinfo(np.int64).max
    inputs = [
        ("x", x, False),
        ("s", i64([-1, 1, 10]), True),
        ("e", i64([-big, 5, -9]), True),
        ("a", i64([0, -2, 2]), True),
        ("st", i64([-2, 3, -1]), True),
    ]
    check("Slice", inputs, opset=13)
    check("Slice", [("x", x, False), ("s", i64([1]), False), ("e", i64([4]), False)], opset=13)
    check("Slice", [("x", x, False)], opset=9, starts=[1, -3], ends=[100, -1], axes=[2, 0])
    check("Slice", [("x", x, False), ("s", i64([4]), True), ("e", i64([2]), True)], opset=13)


@pytest.mark.parametrize("dtype", MOVE_TYPES, ids=ids)
def test_expand_tile(dtype):
    x = rand((3, 1, 2), dtype)
    check("Expand", [("x", x, False), ("s", i64([2, 1, 4, 1]), True)], opset=13)
    check("Tile", [("x", x, False), ("r", i64([2, 3, 1]), True)], opset=13)
    check("Tile", [("x", x, False), ("r", i64([1, 0, 2]), True)], opset=13)


@pytest.mark.parametrize("dtype", MOVE_TYPES, ids=ids)
def test_pad(dtype):
    x = rand((3, 4, 5), dtype)
    value = rand((), dtype, 7)
    pads = i64([1, 0, 2, 0, 3, 1])
    check("Pad", [("x", x, False), ("p", pads, True), ("v", value, True)], mode="constant")
    crop = i64([-1, 2, 0, 1, -2, -1])  # negative pads crop
    check("Pad", [("x", x, False), ("p", crop, True)], mode="constant")
    for mode in ("reflect", "edge", "wrap"):
        check("Pad", [("x", x, False), ("p", pads, True)], mode=mode)
    check("Pad", [("x", x, False), ("p", i64([2, 1]), True), None, ("a", i64([-1]), True)])
    check("Pad", [("x", x, False)], opset=10, pads=[0, 1, 0, 2, 0, 1], mode="edge")


@pytest.mark.parametrize("dtype", MOVE_TYPES, ids=ids)
def test_depth_space(dtype):
    x = rand((2, 8, 3, 4), dtype)
    for mode in ("DCR", "CRD"):
        check("DepthToSpace", [("x", x, False)], opset=13, blocksize=2, mode=mode)
        check(
            "SpaceToDepth",
            [("x", rand((2, 3, 4, 6), dtype), False)],
            opset=28,
            blocksize=2,
            mode=mode,
        )
    check("SpaceToDepth", [("x", rand((1, 2, 6, 3), dtype), False)], opset=13, blocksize=3)


# ---------------------------------------------------------------------------------------------
# Generators and small math


@pytest.mark.parametrize(
    "dtype,start,limit,delta",
    [
        (np.int64, 10, -7, -3),
        (np.int32, -4, 20, 5),
        (np.int16, 0, 9, 1),
        (np.float32, 1.5, 9.25, 0.75),
        (np.float64, -2.0, 3.0, 0.3),
        (np.int64, 5, 5, 1),  # empty
    ],
    ids=str,
)
def test_range(dtype, start, limit, delta):
    inputs = [(n, np.array(v, dtype=dtype), False) for n, v in zip("abc", (start, limit, delta))]
    check("Range", inputs, opset=11, tol=F32)


@pytest.mark.parametrize("dtype", MOVE_TYPES, ids=ids)
def test_constant_of_shape_and_eyelike(dtype):
    value = numpy_helper.from_array(np.asarray([rand((), dtype, 3)]), "value")
    check("ConstantOfShape", [("s", i64([2, 0 + 3, 4]), False)], value=value)
    check("ConstantOfShape", [("s", i64([]), False)], value=value)  # 0-d
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    for k in (0, 2, -1, 9):
        check("EyeLike", [("x", rand((4, 6), np.float32), False)], opset=22, dtype=elem, k=k)
    check("EyeLike", [("x", rand((5, 3), dtype), False)], opset=22)


def test_constant_of_shape_default_float():
    check("ConstantOfShape", [("s", i64([3, 2]), False)])


@pytest.mark.parametrize("dtype", MOVE_TYPES, ids=ids)
def test_trilu(dtype):
    x = rand((2, 4, 5), dtype)
    for upper in (0, 1):
        for k in (0, 2, -3, 100, -100):
            check("Trilu", [("x", x, False), ("k", i64(k), True)], opset=14, upper=upper)
        check("Trilu", [("x", x, False)], opset=14, upper=upper)


@pytest.mark.parametrize(
    "dtype,tol",
    [(np.float32, F32), (np.float16, F16), (np.float64, F32), (np.int32, EXACT)]
    + [(BF16, (1.6e-2, 1e-2))],
    ids=ids,
)
@pytest.mark.parametrize(
    "equation,shapes",
    [
        ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]),
        ("ij->ji", [(3, 4)]),
        ("ii->i", [(4, 4)]),
        ("i,i", [(6,), (6,)]),
        ("bhid,bhjd->bhij", [(1, 2, 3, 4), (1, 2, 5, 4)]),
        ("...ij->...j", [(2, 3, 4)]),
    ],
    ids=str,
)
def test_einsum(equation, shapes, dtype, tol):
    inputs = [(f"x{i}", rand(s, dtype, i, -3, 3), False) for i, s in enumerate(shapes)]
    check("Einsum", inputs, opset=12, tol=tol, equation=equation)


@pytest.mark.parametrize(
    "dtype,tol", [(np.float32, F32), (np.float16, F16), (np.int32, EXACT)], ids=ids
)
def test_shrink(dtype, tol):
    x = rand((4, 7), dtype)
    check("Shrink", [("x", x, False)], opset=9, tol=tol, lambd=1.5, bias=0.5)
    check("Shrink", [("x", x, False)], opset=9, tol=tol)


# ---------------------------------------------------------------------------------------------
# Resize and Upsample

COORDS = ["half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric", "half_pixel_symmetric"]


@pytest.mark.parametrize(
    "dtype", [np.float32, np.float16, np.uint8, np.int32, np.int64, BF16], ids=ids
)
@pytest.mark.parametrize("coord", COORDS)
@pytest.mark.parametrize("nearest", ["round_prefer_floor", "round_prefer_ceil", "floor", "ceil"])
def test_resize_nearest(dtype, coord, nearest):
    x = rand((2, 3, 5, 7), dtype)
    attrs = {"mode": "nearest", "coordinate_transformation_mode": coord, "nearest_mode": nearest}
    scales = np.array([1, 1, 1.7, 0.6], np.float32)
    check("Resize", [("x", x, False), None, ("sc", scales, True)], opset=19, **attrs)
    sizes = i64([2, 3, 9, 14])
    check("Resize", [("x", x, False), None, None, ("sz", sizes, True)], opset=19, **attrs)


@pytest.mark.parametrize(
    "dtype,tol", [(np.float32, F32), (np.float16, F16), (np.uint8, (0, 1))], ids=ids
)
@pytest.mark.parametrize("mode", ["linear", "cubic"])
@pytest.mark.parametrize("coord", COORDS)
def test_resize_interpolating(dtype, tol, mode, coord):
    x = rand((1, 2, 6, 5), dtype, lo=0, hi=200 if dtype == np.uint8 else 9)
    attrs = {"mode": mode, "coordinate_transformation_mode": coord}
    for s in ([1, 1, 2.0, 1.5], [1, 1, 0.5, 0.8]):
        scales = np.array(s, np.float32)
        check("Resize", [("x", x, False), None, ("sc", scales, True)], opset=19, tol=tol, **attrs)
    sizes = i64([1, 2, 4, 11])
    check("Resize", [("x", x, False), None, None, ("sz", sizes, True)], opset=19, tol=tol, **attrs)


@pytest.mark.parametrize("mode", ["linear", "cubic"])
def test_resize_antialias_exclude_outside_axes(mode):
    x = rand((2, 3, 12, 10), np.float32)
    scales = np.array([0.4, 0.55], np.float32)
    inputs = [("x", x, False), None, ("sc", scales, True)]
    check("Resize", inputs, opset=19, tol=F32, mode=mode, antialias=1, axes=[3, 2])
    check("Resize", inputs, opset=19, tol=F32, mode=mode, exclude_outside=1, axes=[2, 3])
    if mode == "cubic":
        check("Resize", inputs, opset=19, tol=F32, mode=mode, cubic_coeff_a=-0.5, axes=[2, 3])
    sizes = i64([7, 5])
    for policy in ("not_larger", "not_smaller"):
        check(
            "Resize",
            [("x", x, False), None, None, ("sz", sizes, True)],
            opset=19,
            tol=F32,
            mode=mode,
            axes=[2, 3],
            keep_aspect_ratio_policy=policy,
        )


def test_resize_five_dims_and_inner_axis():
    x = rand((2, 3, 4, 5, 6), np.float32)
    scales = np.array([1, 1.5, 1, 2, 0.5], np.float32)  # resized axes 1 and 3..4, not 2
    check("Resize", [("x", x, False), None, ("sc", scales, True)], opset=13, tol=F32, mode="linear")
    check("Resize", [("x", x, False), None, ("sc", scales, True)], opset=13, mode="nearest")


@pytest.mark.parametrize("mode", ["nearest", "linear", "cubic"])
def test_resize_tf_crop_and_resize(mode):
    x = rand((1, 1, 6, 8), np.float32)
    roi = np.array([0, 0, -0.2, 0.1, 1, 1, 0.9, 1.3], np.float32)
    sizes = i64([1, 1, 5, 7])
    check(
        "Resize",
        [("x", x, False), ("roi", roi, True), None, ("sz", sizes, True)],
        opset=13,
        tol=F32,
        mode=mode,
        coordinate_transformation_mode="tf_crop_and_resize",
        extrapolation_value=-7.5,
    )


@pytest.mark.parametrize("dtype", [np.float32, np.uint8, np.float16], ids=ids)
def test_upsample_nearest(dtype):
    x = rand((1, 2, 3, 4), dtype)
    scales = np.array([1, 1, 2, 3], np.float32)
    check("Upsample", [("x", x, False), ("s", scales, True)], opset=9, mode="nearest")
    # Upsample-7 (scales an attribute) is not in onnx.reference: repeat by hand
    want = np.repeat(np.repeat(x, 2, axis=1), 2, axis=3)
    attrs = {"mode": "nearest", "scales": [1.0, 2.0, 1.0, 2.0]}
    check_expected("Upsample", [("x", x, False)], [want], 7, tol=EXACT, **attrs)


def test_resize10_and_upsample_linear():
    """Resize-10 and Upsample have onnxruntime's semantics (asymmetric coordinates; nearest
    takes the floor when enlarging, the ceiling when shrinking), which onnx.reference does
    not implement: compared with values worked out by hand."""
    x = np.array([[0, 1, 4], [2, 6, 10]], np.float32).reshape(1, 1, 2, 3)
    scales = np.array([1, 1, 2, 0.5], np.float32)  # output (1, 1, 4, 1)
    # rows at 0, 0.5, 1, 1.5 (clamped to 1), column at 0
    linear = np.array([0, 1, 2, 2], np.float32).reshape(1, 1, 4, 1)
    check_expected("Resize", [("x", x, False), ("s", scales, True)], [linear], 10, mode="linear")
    # rows: floor of 0, 0.5, 1, 1.5; column: ceiling of 0
    nearest = np.array([0, 0, 2, 2], np.float32).reshape(1, 1, 4, 1)
    check_expected("Resize", [("x", x, False), ("s", scales, True)], [nearest], 10, mode="nearest")
    up = np.array([1, 1, 2, 2], np.float32)  # columns at 0, 0.5, ..., 2.5 (clamped to 2)
    want = np.array(
        [
            [0, 0.5, 1, 2.5, 4, 4],
            [1, 2.25, 3.5, 5.25, 7, 7],
            [2, 4, 6, 8, 10, 10],
            [2, 4, 6, 8, 10, 10],
        ],
        np.float32,
    ).reshape(1, 1, 4, 6)
    check_expected("Upsample", [("x", x, False), ("s", up, True)], [want], 9, mode="linear")
    check_expected("Upsample", [("x", x, False)], [want], 7, mode="linear", scales=[1, 1, 2, 2.0])
