"""Elementwise CPU kernels: unary and binary math, comparisons, logic, Where, Clip and Cast.

numpy broadcasting is ONNX's multidirectional broadcasting, and numpy keeps the dtype when
both operands share it, so most kernels are a single ufunc call. The traps are mixed dtypes
(Pow's exponent, integer Div) and ml_dtypes' bfloat16, which promotes with Python floats to
float32: kernels never let a result leave the input's dtype.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

from onnxplug.ep import Kernel, KernelContext, KernelInfo, KernelRegistry, np_dtype

from ._util import quiet


class Unary(Kernel):
    """``y = fn(x)`` for a numpy ufunc that keeps the dtype."""

    fn: np.ufunc = np.positive

    def compute(self, ctx: KernelContext) -> None:
        with quiet():
            ctx.set_output(0, np.asarray(self.fn(ctx.input(0))))


class Binary(Kernel):
    """``y = fn(a, b)`` with numpy broadcasting, for operands of one dtype."""

    fn: np.ufunc = np.add

    def compute(self, ctx: KernelContext) -> None:
        with quiet():
            ctx.set_output(0, np.asarray(self.fn(ctx.input(0), ctx.input(1))))


class Div(Kernel):
    def compute(self, ctx: KernelContext) -> None:
        a, b = ctx.input(0), ctx.input(1)
        if a.dtype.kind not in "iu":
            with quiet():
                ctx.set_output(0, np.asarray(np.divide(a, b)))
            return
        # ONNX integer division truncates toward zero (C semantics); numpy floors.
        q = np.floor_divide(a, b)
        if a.dtype.kind == "i":
            q += (np.remainder(a, b) != 0) & ((a < 0) ^ (b < 0))
        ctx.set_output(0, np.asarray(q))


class Pow(Kernel):
    def compute(self, ctx: KernelContext) -> None:
        a, b = ctx.input(0), ctx.input(1)
        with quiet():
            if a.dtype.kind == "f" or a.dtype == ml_dtypes.bfloat16:
                # an integer or wider exponent must not widen the result: compute in a's type
                ctx.set_output(0, np.asarray(np.power(a, b.astype(a.dtype, copy=False))))
            else:
                ctx.set_output(0, np.asarray(np.power(a, b)).astype(a.dtype, copy=False))


class Mod(Kernel):
    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.fn = np.fmod if info.attr("fmod", 0) else np.mod

    def compute(self, ctx: KernelContext) -> None:
        with quiet():
            ctx.set_output(0, np.asarray(self.fn(ctx.input(0), ctx.input(1))))


class Variadic(Kernel):
    """Max, Min, Sum: a broadcasting fold over any number of inputs."""

    fn: np.ufunc = np.add

    def compute(self, ctx: KernelContext) -> None:
        ctx.set_output(0, np.asarray(functools.reduce(self.fn, ctx.inputs)))


class Mean(Kernel):
    def compute(self, ctx: KernelContext) -> None:
        xs = ctx.inputs
        s = functools.reduce(np.add, xs)
        ctx.set_output(0, np.asarray(np.divide(s, s.dtype.type(len(xs)))))


class Where(Kernel):
    def compute(self, ctx: KernelContext) -> None:
        ctx.set_output(0, np.where(ctx.input(0), ctx.input(1), ctx.input(2)))


class Clip6(Kernel):
    """Clip-6: bounds are attributes."""

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.lo = info.attr("min", -3.4028234663852886e38)
        self.hi = info.attr("max", 3.4028234663852886e38)

    def compute(self, ctx: KernelContext) -> None:
        x = ctx.input(0)
        lo, hi = x.dtype.type(self.lo), x.dtype.type(self.hi)
        ctx.set_output(0, np.asarray(np.minimum(np.maximum(x, lo), hi)))


class Clip(Kernel):
    """Clip-11+: optional scalar bounds as inputs; min > max gives max everywhere."""

    def compute(self, ctx: KernelContext) -> None:
        x, lo, hi = ctx.input(0), ctx.input(1), ctx.input(2)
        y = x if lo is None else np.maximum(x, lo.astype(x.dtype, copy=False))
        y = y if hi is None else np.minimum(y, hi.astype(x.dtype, copy=False))
        ctx.set_output(0, np.asarray(y))


# Cast: numpy's astype implements ONNX's rules between these types (C truncation toward zero
# for float -> int, two's complement wrap-around between ints, nonzero -> True); string,
# float8/4 and int4 conversions (saturation, rounding modes) stay with the reference kernel.
CAST_TYPES = (
    np.bool_,
    np.int8,
    np.int16,
    np.int32,
    np.int64,
    np.uint8,
    np.uint16,
    np.uint32,
    np.uint64,
    np.float16,
    np.float32,
    np.float64,
    ml_dtypes.bfloat16,
)


class Cast(Kernel):
    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.to = np_dtype(int(info.attr("to")))

    def compute(self, ctx: KernelContext) -> None:
        x = ctx.input(0)
        if x.dtype == self.to:
            ctx.set_output(0, x)
        else:
            with quiet():
                ctx.set_output(0, x.astype(self.to))


# op -> (numpy function, first opset it serves)
UNARY: dict[str, tuple[Callable[..., Any], int]] = {
    "Abs": (np.abs, 6),
    "Neg": (np.negative, 6),
    "Sqrt": (np.sqrt, 6),
    "Exp": (np.exp, 6),
    "Log": (np.log, 6),
    "Reciprocal": (np.reciprocal, 6),
    "Floor": (np.floor, 6),
    "Ceil": (np.ceil, 6),
    "Sign": (np.sign, 9),
    "Not": (np.logical_not, 1),
    "Tanh": (np.tanh, 6),
}
BINARY: dict[str, tuple[Callable[..., Any], int]] = {
    "Add": (np.add, 7),
    "Sub": (np.subtract, 7),
    "Mul": (np.multiply, 7),
    "Equal": (np.equal, 7),
    "Greater": (np.greater, 7),
    "Less": (np.less, 7),
    "GreaterOrEqual": (np.greater_equal, 12),
    "LessOrEqual": (np.less_equal, 12),
    "And": (np.logical_and, 7),
    "Or": (np.logical_or, 7),
    "Xor": (np.logical_xor, 7),
}
VARIADIC = {"Max": np.maximum, "Min": np.minimum, "Sum": np.add}


def register(registry: KernelRegistry) -> None:
    for op, (fn, since) in UNARY.items():
        registry.kernel(op, since=since)(type(op, (Unary,), {"fn": fn}))
    for op, (fn, since) in BINARY.items():
        registry.kernel(op, since=since)(type(op, (Binary,), {"fn": fn}))
    for op, fn in VARIADIC.items():
        registry.kernel(op, since=8)(type(op, (Variadic,), {"fn": fn}))
    registry.kernel("Div", since=7)(Div)
    registry.kernel("Pow", since=7)(Pow)
    registry.kernel("Mod", since=10)(Mod)
    registry.kernel("Mean", since=8)(Mean)
    registry.kernel("Where", since=9)(Where)
    registry.kernel("Clip", since=6, until=10)(Clip6)
    registry.kernel("Clip", since=11)(Clip)
    registry.kernel("Cast", since=6, types={"T1": CAST_TYPES, "T2": CAST_TYPES})(Cast)
