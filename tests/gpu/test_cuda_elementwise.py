"""Elementwise ops on the CUDA provider, compared with the CPU provider: broadcast arithmetic,
unary math, activations, comparisons, logic and bitwise ops, Where, Clip, Cast and CastLike.

Every test builds a one-node model (node "n"), runs it with providers [CUDA, CPU] and with
CPU alone, checks that the node ran on CUDAExecutionProvider and compares the outputs.
Tolerances (relative, and absolute for values near zero):
* integer and bool outputs: exact;
* float32: rtol 1e-5, atol 1e-6 (CUDA's libm and numpy's differ by a few ulps, ~1e-7);
* float16: rtol 2e-3, atol 1e-3 (one float16 ulp is ~1e-3: both sides compute in float32
  and round once, and may round a value on a half-ulp boundary differently);
* bfloat16: rtol 1.6e-2, atol 1e-2 (two bfloat16 ulps);
* float64: rtol 1e-10, atol 1e-12.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from onnx import TensorProto
from tests.gpu import _oneop
from tests.gpu._cuda import cuda_marks
from tests.gpu._oneop import BF16, ELEM, FLOATS, ids, rand

pytestmark = cuda_marks

INTS = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]
TOL = {  # dtype name -> (rtol, atol)
    "float32": (1e-5, 1e-6),
    "float16": (2e-3, 1e-3),
    "bfloat16": (1.6e-2, 1e-2),
    "float64": (1e-10, 1e-12),
}


def check(op: str, feeds: dict[str, np.ndarray], **kw: Any) -> list[np.ndarray]:
    """``_oneop.check`` with this module's tolerances and opset 22 by default."""
    kw.setdefault("opset", 22)
    return _oneop.check(op, feeds, TOL, **kw)


# ---------------------------------------------------------------------------------------------
# Binary arithmetic with broadcasting

ARITH_TYPES = [*FLOATS, np.int8, np.int32, np.int64, np.uint8, np.uint32]


@pytest.mark.parametrize("dtype", ARITH_TYPES, ids=ids)
@pytest.mark.parametrize("op", ["Add", "Sub", "Mul"])
def test_add_sub_mul(op, dtype):
    a = rand((3, 1, 5), dtype, 0, 12, seed=1)
    b = rand((4, 5), dtype, 0, 12, seed=2)
    check(op, {"a": a, "b": b})


@pytest.mark.parametrize("dtype", ARITH_TYPES, ids=ids)
def test_div(dtype):
    signed = np.dtype(dtype).kind != "u"
    a = rand((2, 3, 4), dtype, -50 if signed else 0, 50, seed=1)
    b = rand((3, 1), dtype, 1, 9, seed=2)
    if signed:
        b[::2] = -b[::2]  # negative divisors: integer division truncates toward zero
    check("Div", {"a": a, "b": b})


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.int64, np.uint16], ids=ids)
def test_mod_integer(dtype):
    signed = np.dtype(dtype).kind == "i"
    a = rand((4, 6), dtype, -40 if signed else 0, 40, seed=3)
    b = rand((6,), dtype, 1, 7, seed=4)
    if signed:
        b[1::2] = -b[1::2]
    check("Mod", {"a": a, "b": b}, fmod=0)  # Python's %: the sign of the divisor
    check("Mod", {"a": a, "b": b}, fmod=1)  # C's fmod: the sign of the dividend


@pytest.mark.parametrize("dtype", FLOATS, ids=ids)
def test_mod_float(dtype):
    a = rand((4, 6), dtype, -10, 10, seed=3)
    b = rand((6,), dtype, 0.5, 3, seed=4)
    b[1::2] = -b[1::2]
    check("Mod", {"a": a, "b": b}, fmod=1)  # C's fmod
    check("Mod", {"a": a, "b": b}, opset=28, fmod=0)  # Mod-28: Python's % on floats too
    edge = np.array([3.0, -3.0, 0.0, 5.5, -5.5, 1.0], dtype)
    by = np.array([1.5, 1.5, -2.0, np.inf, np.inf, -np.inf], dtype)
    check("Mod", {"a": edge, "b": by}, opset=28, fmod=0)


@pytest.mark.parametrize("dtype", FLOATS, ids=ids)
def test_pow_float(dtype):
    a = rand((3, 4), dtype, 0.5, 2, seed=5)
    b = rand((4,), dtype, -2, 2, seed=6)
    check("Pow", {"a": a, "b": b})


def test_pow_mixed_types():
    a = rand((3, 4), np.float32, 0.5, 2, seed=5)
    check("Pow", {"a": a, "b": np.array([0, 1, 2, 3], np.int64)})  # integer exponent
    check("Pow", {"a": a}, inits={"b": np.array(2.0, np.float32)})  # constant square
    base = rand((3, 4), np.int32, 0, 6, seed=7)
    check("Pow", {"a": base, "b": np.array([0, 1, 2, 3], np.int32)})
    check("Pow", {"a": base, "b": np.array([0.0, 1.0, 2.0, 0.5], np.float32)})


@pytest.mark.parametrize("dtype", [*FLOATS, np.int32, np.uint8], ids=ids)
@pytest.mark.parametrize("op", ["Max", "Min", "Sum", "Mean"])
def test_variadic(op, dtype):
    if op in ("Sum", "Mean") and np.dtype(dtype).kind != "f" and dtype != BF16:
        pytest.skip("Sum and Mean are float-only")
    feeds = {
        "a": rand((2, 1, 4), dtype, 0, 9, seed=1),
        "b": rand((3, 4), dtype, 0, 9, seed=2),
        "c": rand((1, 4), dtype, 0, 9, seed=3),
    }
    check(op, feeds)
    check(op, {"a": feeds["a"]})  # a single input is copied


# ---------------------------------------------------------------------------------------------
# Unary math and activations

# op -> (low, high) of the test inputs (inside the op's domain), attributes
UNARY = {
    "Sqrt": (0.1, 9.0, {}),
    "Reciprocal": (0.2, 5.0, {}),
    "Exp": (-5.0, 5.0, {}),
    "Log": (0.1, 9.0, {}),
    "Floor": (-4.0, 4.0, {}),
    "Ceil": (-4.0, 4.0, {}),
    "Sin": (-3.0, 3.0, {}),
    "Cos": (-3.0, 3.0, {}),
    "Tan": (-1.2, 1.2, {}),
    "Asin": (-0.95, 0.95, {}),
    "Acos": (-0.95, 0.95, {}),
    "Atan": (-4.0, 4.0, {}),
    "Sinh": (-3.0, 3.0, {}),
    "Cosh": (-3.0, 3.0, {}),
    "Asinh": (-4.0, 4.0, {}),
    "Acosh": (1.0, 5.0, {}),
    "Atanh": (-0.9, 0.9, {}),
    "Tanh": (-4.0, 4.0, {}),
    "Erf": (-3.0, 3.0, {}),
    "Sigmoid": (-8.0, 8.0, {}),
    "Softplus": (-8.0, 8.0, {}),
    "Softsign": (-5.0, 5.0, {}),
    "Mish": (-6.0, 6.0, {}),
    "Relu": (-3.0, 3.0, {}),
    "LeakyRelu": (-3.0, 3.0, {"alpha": 0.2}),
    "ThresholdedRelu": (-3.0, 3.0, {"alpha": 0.7}),
    "Elu": (-3.0, 3.0, {"alpha": 0.8}),
    "Selu": (-3.0, 3.0, {}),
    "Celu": (-3.0, 3.0, {"alpha": 1.5}),
    "HardSigmoid": (-4.0, 4.0, {"alpha": 0.3, "beta": 0.4}),
    "HardSwish": (-5.0, 5.0, {}),
    "Neg": (-3.0, 3.0, {}),
    "Abs": (-3.0, 3.0, {}),
    "Sign": (-3.0, 3.0, {}),
}


@pytest.mark.parametrize("dtype", FLOATS, ids=ids)
@pytest.mark.parametrize("op", sorted(UNARY))
def test_unary_float(op, dtype):
    lo, hi, attrs = UNARY[op]
    x = rand((4, 33), dtype, lo, hi, seed=11)
    if op in ("Relu", "Sign", "Abs", "Neg"):
        x[0, :3] = [0.0, -0.0, 2.0]
    check(op, {"x": x}, **attrs)


@pytest.mark.parametrize("dtype", FLOATS, ids=ids)
def test_round_half_to_even(dtype):
    x = np.array([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 3.5, -3.7, 0.2, 7.5], np.float32)
    got = check("Round", {"x": x.astype(dtype)})
    np.testing.assert_array_equal(got[0].astype(np.float32), np.rint(x))


@pytest.mark.parametrize("dtype", FLOATS, ids=ids)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu(dtype, approximate):
    check("Gelu", {"x": rand((8, 64), dtype, -4, 4, seed=12)}, opset=20, approximate=approximate)


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32, np.int64], ids=ids)
@pytest.mark.parametrize("op", ["Neg", "Abs", "Sign", "Relu"])
def test_unary_signed_int(op, dtype):
    check(op, {"x": rand((5, 7), dtype, -100, 100, seed=13)})


@pytest.mark.parametrize("dtype", [np.uint8, np.uint32, np.uint64], ids=ids)
@pytest.mark.parametrize("op", ["Abs", "Sign"])
def test_unary_unsigned_int(op, dtype):
    check(op, {"x": rand((5, 7), dtype, 0, 200, seed=13)})


@pytest.mark.parametrize("dtype", FLOATS, ids=ids)
def test_isnan_isinf(dtype):
    x = rand((3, 8), dtype, -2, 2, seed=14)
    x[0, :4] = [np.nan, np.inf, -np.inf, 0.0]
    check("IsNaN", {"x": x})
    check("IsInf", {"x": x})
    check("IsInf", {"x": x}, detect_negative=0)
    check("IsInf", {"x": x}, detect_positive=0)


@pytest.mark.parametrize("dtype", [*FLOATS, np.int32, np.int64], ids=ids)
def test_prelu(dtype):
    x = rand((2, 3, 4, 5), dtype, -5, 5, seed=15)
    check("PRelu", {"x": x, "slope": rand((3, 1, 1), dtype, 0, 3, seed=16)})
    check("PRelu", {"x": x, "slope": rand((5,), dtype, 0, 3, seed=17)})


# ---------------------------------------------------------------------------------------------
# Comparisons, logic, bitwise


@pytest.mark.parametrize("dtype", [*FLOATS, np.int8, np.int32, np.int64, np.uint8], ids=ids)
@pytest.mark.parametrize("op", ["Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual"])
def test_compare(op, dtype):
    a = rand((3, 1, 4), dtype, 0, 4, seed=21)  # small whole numbers: many equal pairs
    b = rand((2, 4), dtype, 0, 4, seed=22)
    check(op, {"a": a, "b": b})


def test_compare_bool_and_nan():
    check("Equal", {"a": rand((4, 5), np.bool_, seed=1), "b": rand((5,), np.bool_, seed=2)})
    a = np.array([np.nan, 1.0, np.nan, -0.0], np.float32)
    b = np.array([np.nan, np.nan, 1.0, 0.0], np.float32)
    for op in ("Equal", "Less", "Greater"):
        check(op, {"a": a, "b": b})


@pytest.mark.parametrize("op", ["And", "Or", "Xor"])
def test_logic(op):
    check(op, {"a": rand((3, 1, 6), np.bool_, seed=3), "b": rand((2, 6), np.bool_, seed=4)})


def test_not():
    check("Not", {"x": rand((3, 6), np.bool_, seed=5)})


@pytest.mark.parametrize("dtype", INTS, ids=ids)
@pytest.mark.parametrize("op", ["BitwiseAnd", "BitwiseOr", "BitwiseXor"])
def test_bitwise(op, dtype):
    hi = 120 if np.dtype(dtype).itemsize == 1 else 30000
    a = rand((3, 5), dtype, 0, hi, seed=6)
    b = rand((5,), dtype, 0, hi, seed=7)
    check(op, {"a": a, "b": b})


@pytest.mark.parametrize("dtype", INTS, ids=ids)
def test_bitwise_not(dtype):
    check("BitwiseNot", {"x": rand((3, 5), dtype, 0, 100, seed=8)})


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32, np.uint64], ids=ids)
@pytest.mark.parametrize("direction", ["LEFT", "RIGHT"])
def test_bitshift_unsigned(dtype, direction):
    x = rand((4, 6), dtype, 0, 100, seed=9)
    s = rand((6,), dtype, 0, 7, seed=10)
    check("BitShift", {"x": x, "s": s}, opset=18, direction=direction)


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.int64, np.uint16], ids=ids)
@pytest.mark.parametrize("direction", ["LEFT", "RIGHT"])
def test_bitshift_out_of_range(dtype, direction):
    """BitShift-28: signed types; shifts >= the width or negative give the sign fill."""
    bits = 8 * np.dtype(dtype).itemsize
    x = np.array([5, 100, 7, 1, 3, 64, 9, 2], dtype)
    s = np.array([0, 1, bits - 1, bits, bits + 3, 2, 3, 1], dtype)
    if np.dtype(dtype).kind == "i":
        x[::3] = -x[::3]
        s[6] = -1
    check("BitShift", {"x": x, "s": s}, opset=28, direction=direction)


# ---------------------------------------------------------------------------------------------
# Where, Clip


@pytest.mark.parametrize("dtype", [*FLOATS, np.int64, np.uint8, np.bool_], ids=ids)
def test_where(dtype):
    c = rand((3, 1, 5), np.bool_, seed=31)
    a = rand((4, 5), dtype, -5, 5, seed=32)
    b = rand((5,), dtype, -5, 5, seed=33)
    check("Where", {"c": c, "a": a, "b": b})


@pytest.mark.parametrize("dtype", FLOATS, ids=ids)
def test_clip(dtype):
    x = rand((4, 9), dtype, -5, 5, seed=34)
    x[0, 0] = np.nan
    lo, hi = np.array(-1.5, dtype), np.array(2.25, dtype)
    check("Clip", {"x": x}, inits={"lo": lo, "hi": hi}, opset=13)
    check("Clip", {"x": x}, inits={"hi": hi}, opset=13, order=["x", "", "hi"])
    check("Clip", {"x": x}, inits={"lo": lo}, opset=13)
    check("Clip", {"x": x}, inits={"lo": hi, "hi": lo}, opset=13)  # min > max: all max
    check("Clip", {"x": x}, opset=13)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64], ids=ids)
def test_clip_attributes(dtype):
    x = rand((4, 9), dtype, -5, 5, seed=35)
    check("Clip", {"x": x}, opset=6, min=-1.0, max=3.5)
    check("Clip", {"x": x}, opset=6)  # float32's range: nothing clipped


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.int64, np.uint8], ids=ids)
def test_clip_integer(dtype):
    signed = np.dtype(dtype).kind == "i"
    x = rand((4, 9), dtype, -100 if signed else 0, 100, seed=36)
    check("Clip", {"x": x}, inits={"lo": np.array(10, dtype), "hi": np.array(60, dtype)})
    check("Clip", {"x": x}, inits={"hi": np.array(60, dtype)}, order=["x", "", "hi"])


# ---------------------------------------------------------------------------------------------
# Cast, CastLike

CAST_TYPES = [
    np.bool_,
    np.int8,
    np.int32,
    np.int64,
    np.uint8,
    np.uint16,
    np.uint64,
    np.float16,
    np.float32,
    np.float64,
    BF16,
]


def cast_source(dtype: Any) -> np.ndarray:
    """Values every target type represents (no NaN or out-of-range float -> int, which ONNX
    leaves undefined), with fractions for float sources and zeros for bool targets."""
    dt = np.dtype(dtype)
    if dt == np.bool_:
        return rand((3, 7), dt, seed=41)
    if dt.kind in "iu":
        return rand((3, 7), dt, 0, 120, seed=41)
    v = rand((3, 7), np.float64, 0, 120, seed=41)
    v[0, :3] = [0.0, 0.5, 1.75]
    return v.astype(np.float32).astype(dt)


@pytest.mark.parametrize("dst", CAST_TYPES, ids=ids)
@pytest.mark.parametrize("src", CAST_TYPES, ids=ids)
def test_cast(src, dst):
    if np.dtype(src) == np.dtype(dst):
        pytest.skip("a cast to the same type is removed before it reaches a provider")
    x = cast_source(src)
    check("Cast", {"x": x}, opset=21, to=ELEM[np.dtype(dst)])


def test_cast_signed_and_wraparound():
    x = np.array([-7.9, -0.5, 0.5, 3.99, -120.25, 100.0], np.float32)
    for to in (TensorProto.INT8, TensorProto.INT32, TensorProto.INT64):  # truncation toward 0
        check("Cast", {"x": x}, to=to)
    ints = np.array([300, -1, 255, -129, 70000, 0], np.int32)
    for to in (TensorProto.INT8, TensorProto.UINT8, TensorProto.INT16, TensorProto.UINT16):
        check("Cast", {"x": ints}, to=to)  # two's complement wrap-around
    special = np.array([np.nan, np.inf, -np.inf, -0.0, 1e-30, 7e4], np.float32)
    for to in (TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.BOOL, TensorProto.BFLOAT16):
        check("Cast", {"x": special}, to=to)


def test_cast_rounding_to_bfloat16():
    """float64/int64 -> bfloat16 round through float32 (ml_dtypes does the same)."""
    d = np.array([1 + 2**-8 + 2**-40, 1 + 2**-8, 1 + 3 * 2**-8, -3.3e38, 1e39, 0.1], np.float64)
    check("Cast", {"x": d}, to=TensorProto.BFLOAT16)
    i = np.array([2**24 + 1 + 2**16, 16777217 + 65536 * 3, 2**31 - 1, -(2**31)], np.int64)
    check("Cast", {"x": i}, to=TensorProto.BFLOAT16)


@pytest.mark.parametrize("dst", [np.float16, np.int32, np.bool_, np.float64], ids=ids)
def test_castlike(dst):
    x = cast_source(np.float32)
    check("CastLike", {"x": x, "like": np.zeros((1,), dst)})
