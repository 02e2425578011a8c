"""CUDA kernels of elementwise ops: broadcast arithmetic, unary math, activations, comparisons,
logic and bitwise ops, Where, Clip, Cast and CastLike.

Outputs are allocated through the provider (``self.alloc``) and written in place by CuPy
ufuncs (``xp.add(a, b, out=y)``) or by the fused kernels of ``_fused`` (activations, Gelu,
Erf, Where, Clip, BitShift, integer Div). Operands of a binary op share one dtype (ONNX requires
it), so the ufunc loop is the input dtype and nothing is promoted; scalars handed to ufuncs are
numpy scalars of the operand's dtype.

bfloat16 (uint16 storage on the GPU) is computed in float32 and rounded to nearest even once:
unary ops and activations in one fused kernel, the others by converting the operands to
float32, running the float32 op and rounding the result.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from onnxplug.ep import KernelContext, KernelInfo, KernelRegistry, MemType, np_dtype, shapes

from . import _fused as F
from ._base import ALL_FIXED, BF16, FLOATS, INTS, NUMERIC, SIGNED_INTS, CudaKernel, dtypes

FLOATS_B = FLOATS + BF16
NUMERIC_B = NUMERIC + BF16
ALL_B = ALL_FIXED + BF16
F32 = np.dtype(np.float32)


def is_bf16(dt: Any) -> bool:
    return dt is not None and np.dtype(dt).name == "bfloat16"


class TypedKernel(CudaKernel):
    """Shared state: the node's input dtype (bfloat16 or not) and a broadcast-shape cache."""

    first_run_prepared = True  # compute runs CuPy's kernels (see CudaKernel)

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.in_dtype = info.input_dtype(0)
        self.bf16 = is_bf16(self.in_dtype)
        self._shapes: tuple[Any, Any] = (None, None)

    def warm_up(self) -> None:
        if not self.bf16:  # (bfloat16 operands are uint16 arrays, not their graph type)
            self.dry_prepare()

    def out_shape(self, *arrays: Any) -> tuple[int, ...]:
        """The broadcast shape of the operands (cached for the last operand shapes)."""
        key = tuple(a.shape for a in arrays)
        cached = self._shapes  # one read: another thread may replace it meanwhile
        if cached[0] == key:
            return cached[1]
        shape = shapes.broadcast_shapes(*key)
        self._shapes = (key, shape)
        return shape

    def dtype_of(self, x: Any) -> Any:
        """The ONNX dtype of input 0 (bfloat16 arrays are uint16 on the GPU)."""
        return self.in_dtype if self.in_dtype is not None else x.dtype

    def like(self, ctx: KernelContext, x: Any) -> Any:
        """Output 0 with input 0's shape and ONNX dtype."""
        return self.alloc(ctx, 0, x.shape, self.dtype_of(x))


# ---------------------------------------------------------------------------------------------
# Binary ops


class Binary(TypedKernel):
    """``y = fn(a, b)`` with broadcasting; comparisons give bool."""

    ufunc = "add"
    boolean = False

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.fn = getattr(self.xp, self.ufunc)

    def compute(self, ctx: KernelContext) -> None:
        a, b = self.arg(ctx, 0), self.arg(ctx, 1)
        shape = self.out_shape(a, b)
        y = self.alloc(ctx, 0, shape, np.bool_ if self.boolean else self.dtype_of(a))
        if self.bf16:
            F.BF16_BINARY[self.ufunc](self.xp, a, b, y)
        else:
            self.fn(a, b, out=y)

    def prepare(self, ctx: KernelContext) -> Any:
        a, b = self.arg(ctx, 0), self.arg(ctx, 1)
        y = self.alloc(ctx, 0, self.out_shape(a, b), np.bool_ if self.boolean else self.dtype_of(a))
        op = (F.BF16_BINARY if self.bf16 else F.UFUNC_BINARY)[self.ufunc]
        return op.bind(self.xp, a, b, y, stream=self.stream_handle(ctx))


class Div(Binary):
    """Float division, or integer division truncating toward zero (C semantics, as ONNX)."""

    ufunc = "true_divide"

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        dt = self.in_dtype
        self.integer = dt is not None and dt.kind in "iu"

    def compute(self, ctx: KernelContext) -> None:
        if not self.integer:
            super().compute(ctx)
            return
        a, b = self.arg(ctx, 0), self.arg(ctx, 1)
        y = self.alloc(ctx, 0, self.out_shape(a, b), a.dtype)
        F.INT_DIV(self.xp, a, b, y)

    def prepare(self, ctx: KernelContext) -> Any:
        if not self.integer:
            return super().prepare(ctx)
        a, b = self.arg(ctx, 0), self.arg(ctx, 1)
        y = self.alloc(ctx, 0, self.out_shape(a, b), a.dtype)
        return F.INT_DIV.bind(self.xp, a, b, y, stream=self.stream_handle(ctx))


class Mod(TypedKernel):
    """fmod=1: C's fmod (the sign of A); fmod=0: Python's % (the sign of B), for integers
    and (Mod-28) floats; bfloat16 through float32."""

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.fmod = np.int32(int(info.attr("fmod", 0)) != 0)

    def compute(self, ctx: KernelContext) -> None:
        xp = self.xp
        a, b = self.arg(ctx, 0), self.arg(ctx, 1)
        shape = self.out_shape(a, b)
        y = self.alloc(ctx, 0, shape, self.dtype_of(a))
        if self.bf16:
            t = xp.empty(shape, F32)
            F.MOD_FLOAT(xp, F.to_f32(xp, a), F.to_f32(xp, b), self.fmod, t)
            F.from_f32(xp, t, y)
        else:
            (F.MOD_INT if a.dtype.kind in "iu" else F.MOD_FLOAT)(xp, a, b, self.fmod, y)


class Pow(TypedKernel):
    """Pow with an exponent of any numeric type; the result has the base's type.

    A float base takes the exponent in its own type; an integer base computes in the
    promoted type and casts back (as the CPU provider does). A constant exponent of 2 is a
    multiplication (exact, and no pow call).
    """

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.exp_dtype = info.input_dtype(1)
        self.exp_bf16 = is_bf16(self.exp_dtype)
        e = info.constant_input(1)
        self.square = (
            self.in_dtype is not None
            and self.in_dtype.kind == "f"
            and e is not None
            and np.size(e) == 1
            and np.asarray(e).dtype.kind in "fiu"
            and float(np.asarray(e, dtype=np.float64).reshape(-1)[0]) == 2.0
        )

    def compute(self, ctx: KernelContext) -> None:
        xp = self.xp
        a, b = self.arg(ctx, 0), self.arg(ctx, 1)
        shape = self.out_shape(a, b)
        y = self.alloc(ctx, 0, shape, self.dtype_of(a))
        if self.exp_bf16:
            b = F.to_f32(xp, b)
        if self.bf16:
            t = xp.empty(shape, F32)
            af = F.to_f32(xp, a)
            if self.square:
                xp.multiply(af, af, out=t)
            else:
                xp.power(af, b.astype(F32, copy=False), out=t)
            F.from_f32(xp, t, y)
        elif self.square:
            xp.multiply(a, a, out=y)
        elif a.dtype.kind == "f":
            xp.power(a, b.astype(a.dtype, copy=False), out=y)
        else:
            r = xp.power(a, b)
            if xp is np:
                with np.errstate(all="ignore"):
                    np.copyto(y, r, casting="unsafe")
            else:
                xp.copyto(y, r, casting="unsafe")


class Variadic(TypedKernel):
    """Max, Min, Sum, Mean: a broadcasting fold over the inputs, into the output."""

    ufunc = "maximum"
    mean = False

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.fn = getattr(self.xp, self.ufunc)

    def compute(self, ctx: KernelContext) -> None:
        xp = self.xp
        xs = [self.arg(ctx, i) for i in range(ctx.input_count)]
        y = self.alloc(ctx, 0, self.out_shape(*xs), self.dtype_of(xs[0]))
        if self.bf16:  # bfloat16 kernels, rounding after every step like the CPU provider
            fn = F.BF16_BINARY[self.ufunc]
            if len(xs) == 1:
                xp.copyto(y.view(np.uint16), xs[0].view(np.uint16))
            else:
                fn(xp, xs[0], xs[1], y)
                for x in xs[2:]:
                    fn(xp, y, x, y)
            if self.mean:
                F.BF16_BINARY["true_divide"](xp, y, F.bf16_bits(len(xs)), y)
            return
        if len(xs) == 1:
            xp.copyto(y, xs[0])
        else:
            self.fn(xs[0], xs[1], out=y)
            for x in xs[2:]:
                self.fn(y, x, out=y)
        if self.mean:
            xp.true_divide(y, y.dtype.type(len(xs)), out=y)


# ---------------------------------------------------------------------------------------------
# Unary ops


class Unary(TypedKernel):
    """``y = fn(x)`` with a CuPy/numpy ufunc (types the ufunc keeps); bfloat16 through f32."""

    ufunc = "negative"

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.fn = getattr(self.xp, self.ufunc)

    def compute(self, ctx: KernelContext) -> None:
        x = self.arg(ctx, 0)
        y = self.like(ctx, x)
        self.fn(x, out=y)


class Neg(Unary):
    def compute(self, ctx: KernelContext) -> None:
        x = self.arg(ctx, 0)
        y = self.like(ctx, x)
        if self.bf16:  # flip the sign bit (exact, NaN included)
            self.xp.bitwise_xor(x.view(np.uint16), np.uint16(0x8000), out=y.view(np.uint16))
        else:
            self.xp.negative(x, out=y)


class Abs(Unary):
    def compute(self, ctx: KernelContext) -> None:
        x = self.arg(ctx, 0)
        y = self.like(ctx, x)
        if self.bf16:  # clear the sign bit
            self.xp.bitwise_and(x.view(np.uint16), np.uint16(0x7FFF), out=y.view(np.uint16))
        else:
            self.xp.absolute(x, out=y)


class Sign(Unary):
    def compute(self, ctx: KernelContext) -> None:
        x = self.arg(ctx, 0)
        y = self.like(ctx, x)
        if self.bf16:
            F.UNARY_KERNELS["Sign"](self.xp, x, y, bf16=True)
        else:
            self.xp.sign(x, out=y)


class FloatUnary(TypedKernel):
    """A float-only unary op or activation: one fused kernel (``_fused.UNARY_FLOAT``);
    attributes are read once, as float32 (their type in the model)."""

    op = "Exp"
    defaults: tuple[float, ...] = ()

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.kernel = F.UNARY_KERNELS[self.kernel_name(info)]
        names = F.UNARY_FLOAT[self.kernel_name(info)][2]
        self.params = tuple(
            np.float32(info.attr(n, d)) for n, d in zip(names, self.defaults, strict=True)
        )

    def kernel_name(self, info: KernelInfo) -> str:
        return self.op

    def compute(self, ctx: KernelContext) -> None:
        x = self.arg(ctx, 0)
        y = self.like(ctx, x)
        self.kernel(self.xp, x, y, *self.params, bf16=self.bf16)

    def prepare(self, ctx: KernelContext) -> Any:
        x = self.arg(ctx, 0)
        y = self.like(ctx, x)
        sh = self.stream_handle(ctx)
        return self.kernel.bind(self.xp, x, y, *self.params, bf16=self.bf16, stream=sh)


class Gelu(FloatUnary):
    def kernel_name(self, info: KernelInfo) -> str:
        return "GeluTanh" if info.attr("approximate", "none") == "tanh" else "Gelu"


class IntRelu(Unary):
    """Relu on signed integers (floats take the fused kernel)."""

    def compute(self, ctx: KernelContext) -> None:
        x = self.arg(ctx, 0)
        y = self.alloc(ctx, 0, x.shape, x.dtype)
        self.xp.maximum(x, x.dtype.type(0), out=y)


class IsNaN(TypedKernel):
    def compute(self, ctx: KernelContext) -> None:
        x = self.arg(ctx, 0)
        y = self.alloc(ctx, 0, x.shape, np.bool_)
        F.IS_NAN(self.xp, x, y, bf16=self.bf16)

    def prepare(self, ctx: KernelContext) -> Any:
        x = self.arg(ctx, 0)
        y = self.alloc(ctx, 0, x.shape, np.bool_)
        return F.IS_NAN.bind(self.xp, x, y, bf16=self.bf16, stream=self.stream_handle(ctx))


class IsInf(TypedKernel):
    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.pos = np.float32(int(info.attr("detect_positive", 1)) != 0)
        self.neg = np.float32(int(info.attr("detect_negative", 1)) != 0)

    def compute(self, ctx: KernelContext) -> None:
        x = self.arg(ctx, 0)
        y = self.alloc(ctx, 0, x.shape, np.bool_)
        F.IS_INF(self.xp, x, y, self.pos, self.neg, bf16=self.bf16)


# ---------------------------------------------------------------------------------------------
# PRelu, Where, Clip, BitShift


class PRelu(TypedKernel):
    """PRelu-7+: the slope broadcasts to X (unidirectionally)."""

    def compute(self, ctx: KernelContext) -> None:
        xp = self.xp
        x, slope = self.arg(ctx, 0), self.arg(ctx, 1)
        if self.out_shape(x, slope) != x.shape:
            raise ValueError(f"PRelu: slope {slope.shape} does not broadcast to X {x.shape}")
        y = self.like(ctx, x)
        if self.bf16:
            t = xp.empty(x.shape, F32)
            F.PRELU(xp, F.to_f32(xp, x), F.to_f32(xp, slope), t)
            F.from_f32(xp, t, y)
        elif x.dtype.kind == "f":
            F.PRELU(xp, x, slope, y)
        else:
            F.PRELU_INT(xp, x, slope, y)


class Where(TypedKernel):
    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.dtype = info.input_dtype(1)

    def compute(self, ctx: KernelContext) -> None:
        c, a, b = self.arg(ctx, 0), self.arg(ctx, 1), self.arg(ctx, 2)
        y = self.alloc(ctx, 0, self.out_shape(c, a, b), self.dtype or a.dtype)
        F.WHERE(self.xp, c, a, b, y)  # selection only: bfloat16 storage is copied as is

    def prepare(self, ctx: KernelContext) -> Any:
        c, a, b = self.arg(ctx, 0), self.arg(ctx, 1), self.arg(ctx, 2)
        y = self.alloc(ctx, 0, self.out_shape(c, a, b), self.dtype or a.dtype)
        return F.WHERE.bind(self.xp, c, a, b, y, stream=self.stream_handle(ctx))


class Clip(TypedKernel):
    """Clip-11+: optional scalar bounds as host inputs; min > max gives max everywhere."""

    def bounds(self, ctx: KernelContext, dt: np.dtype) -> tuple[Any, Any]:
        lo, hi = ctx.input(1), ctx.input(2)
        lo = _lowest(dt) if lo is None else np.asarray(lo).reshape(-1)[0]
        hi = _highest(dt) if hi is None else np.asarray(hi).reshape(-1)[0]
        return lo, hi

    def compute(self, ctx: KernelContext) -> None:
        xp = self.xp
        x = self.arg(ctx, 0)
        dt = np.dtype(self.dtype_of(x))
        y = self.alloc(ctx, 0, x.shape, dt)
        lo, hi = self.bounds(ctx, dt)
        if self.bf16:
            t = xp.empty(x.shape, F32)
            F.CLIP(xp, F.to_f32(xp, x), np.float32(lo), np.float32(hi), t)
            F.from_f32(xp, t, y)
        else:
            F.CLIP(xp, x, x.dtype.type(lo), x.dtype.type(hi), y)


class Clip6(Clip):
    """Clip-6: bounds are attributes (float; defaults are float32's range, which float16
    sees as +-inf)."""

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.lo = float(info.attr("min", -3.4028234663852886e38))
        self.hi = float(info.attr("max", 3.4028234663852886e38))
        dt = self.in_dtype
        self.typed: tuple[Any, Any] | None = None
        if dt is not None and not self.bf16:
            with np.errstate(over="ignore"):
                self.typed = (dt.type(self.lo), dt.type(self.hi))

    def bounds(self, ctx: KernelContext, dt: np.dtype) -> tuple[Any, Any]:
        return self.lo, self.hi

    def compute(self, ctx: KernelContext) -> None:
        typed = self.typed
        if typed is None:
            super().compute(ctx)
            return
        x = self.arg(ctx, 0)
        y = self.alloc(ctx, 0, x.shape, x.dtype)
        F.CLIP(self.xp, x, typed[0], typed[1], y)


def _lowest(dt: np.dtype) -> Any:
    if dt.kind in "iu":
        return np.iinfo(dt).min
    return -np.inf


def _highest(dt: np.dtype) -> Any:
    if dt.kind in "iu":
        return np.iinfo(dt).max
    return np.inf


class BitShift(TypedKernel):
    """BitShift; shifts by a negative amount or by >= the width give the sign fill (-1 for a
    negative value shifted right, else 0), as BitShift-28 specifies (undefined before)."""

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.right = np.int32(info.attr("direction") in ("RIGHT", b"RIGHT"))

    def compute(self, ctx: KernelContext) -> None:
        x, s = self.arg(ctx, 0), self.arg(ctx, 1)
        y = self.alloc(ctx, 0, self.out_shape(x, s), x.dtype)
        F.BITSHIFT(self.xp, x, s, self.right, y)


# ---------------------------------------------------------------------------------------------
# Cast


class Cast(CudaKernel):
    """Cast between bool, the integer types, float16/32/64 and bfloat16.

    numpy/CuPy casts are ONNX's rules for these types (C truncation toward zero for float ->
    int, two's complement wrap-around between ints, nonzero -> True). bfloat16 goes through
    float32 with round-to-nearest-even, which is exactly ml_dtypes' (the CPU provider's)
    conversion, double rounding of float64 and int64 included.
    """

    first_run_prepared = True  # compute runs CuPy's kernels (see CudaKernel)

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.to = self.target(info)
        self.src_bf16 = is_bf16(info.input_dtype(0))
        self.dst_bf16 = is_bf16(self.to)

    def target(self, info: KernelInfo) -> np.dtype:
        return np_dtype(int(info.attr("to")))

    def warm_up(self) -> None:
        if not (self.src_bf16 or self.dst_bf16):  # (those have no prepared form)
            self.dry_prepare()

    def compute(self, ctx: KernelContext) -> None:
        xp = self.xp
        x = self.arg(ctx, 0)
        y = self.alloc(ctx, 0, x.shape, self.to)
        if self.src_bf16 and self.dst_bf16:
            xp.copyto(y.view(np.uint16), x.view(np.uint16))
        elif self.dst_bf16:
            F.from_f32(xp, x if x.dtype == F32 else x.astype(F32), y)
        elif self.src_bf16:
            if y.dtype == F32:
                F.BF16_TO_F32(xp, x, y)
            else:
                _cast_into(xp, y, F.to_f32(xp, x))
        else:
            _cast_into(xp, y, x)

    def prepare(self, ctx: KernelContext) -> Any:
        if self.src_bf16 or self.dst_bf16:
            return None
        x = self.arg(ctx, 0)
        y = self.alloc(ctx, 0, x.shape, self.to)
        return F.CAST.bind(self.xp, x, y, stream=self.stream_handle(ctx))


class CastLike(Cast):
    def target(self, info: KernelInfo) -> np.dtype:
        dt = info.input_dtype(1)
        if dt is None:
            raise ValueError(f"CastLike node '{info.name}': the target type is unknown")
        return dt


def _cast_into(xp: Any, y: Any, x: Any) -> None:
    if xp is np:
        with np.errstate(all="ignore"):  # NaN/inf to int: undefined in ONNX, no warning
            np.copyto(y, x, casting="unsafe")
    else:
        xp.copyto(y, x, casting="unsafe")


# ---------------------------------------------------------------------------------------------
# Registration

BINARY = {  # op -> (ufunc, since, types of T, boolean output)
    "Add": ("add", 7, NUMERIC_B, False),
    "Sub": ("subtract", 7, NUMERIC_B, False),
    "Mul": ("multiply", 7, NUMERIC_B, False),
    "Equal": ("equal", 7, ALL_B, True),
    "Less": ("less", 7, NUMERIC_B, True),
    "Greater": ("greater", 7, NUMERIC_B, True),
    "LessOrEqual": ("less_equal", 12, NUMERIC_B, True),
    "GreaterOrEqual": ("greater_equal", 12, NUMERIC_B, True),
    "And": ("logical_and", 7, dtypes("bool"), True),
    "Or": ("logical_or", 7, dtypes("bool"), True),
    "Xor": ("logical_xor", 7, dtypes("bool"), True),
    "BitwiseAnd": ("bitwise_and", 18, INTS, False),
    "BitwiseOr": ("bitwise_or", 18, INTS, False),
    "BitwiseXor": ("bitwise_xor", 18, INTS, False),
}
VARIADIC = {  # op -> (ufunc, since, types, mean)
    "Max": ("maximum", 6, NUMERIC_B, False),
    "Min": ("minimum", 6, NUMERIC_B, False),
    "Sum": ("add", 6, FLOATS_B, False),
    "Mean": ("add", 6, FLOATS_B, True),
}
# op -> (since, attribute defaults in UNARY_FLOAT's parameter order)
FLOAT_UNARY: dict[str, tuple[int, tuple[float, ...]]] = {
    "Sqrt": (6, ()),
    "Reciprocal": (6, ()),
    "Exp": (6, ()),
    "Log": (6, ()),
    "Floor": (6, ()),
    "Ceil": (6, ()),
    "Round": (11, ()),
    "Sin": (7, ()),
    "Cos": (7, ()),
    "Tan": (7, ()),
    "Asin": (7, ()),
    "Acos": (7, ()),
    "Atan": (7, ()),
    "Sinh": (9, ()),
    "Cosh": (9, ()),
    "Asinh": (9, ()),
    "Acosh": (9, ()),
    "Atanh": (9, ()),
    "Tanh": (6, ()),
    "Erf": (9, ()),
    "Sigmoid": (6, ()),
    "Softplus": (1, ()),
    "Softsign": (1, ()),
    "Mish": (18, ()),
    "LeakyRelu": (6, (0.01,)),
    "ThresholdedRelu": (10, (1.0,)),
    "Elu": (6, (1.0,)),
    "Selu": (6, (1.67326319217681884765625, 1.05070102214813232421875)),
    "Celu": (12, (1.0,)),
    "HardSigmoid": (6, (0.2, 0.5)),
    "HardSwish": (14, ()),
}


def register(reg: KernelRegistry, enable_cudnn: bool) -> None:
    for op, (ufunc, since, types, boolean) in BINARY.items():
        cls = type(op, (Binary,), {"ufunc": ufunc, "boolean": boolean})
        reg.kernel(op, since=since, types={"T": types})(cls)
    reg.kernel("Div", since=7, types={"T": NUMERIC_B})(Div)
    reg.kernel("Mod", since=10, types={"T": NUMERIC_B})(Mod)
    reg.kernel(
        "Pow",
        since=7,
        types={"T": dtypes("int32", "int64") + FLOATS_B, "T1": NUMERIC_B},
    )(Pow)
    for op, (ufunc, since, types, mean) in VARIADIC.items():
        cls = type(op, (Variadic,), {"ufunc": ufunc, "mean": mean})
        reg.kernel(op, since=since, types={"T": types})(cls)

    reg.kernel("Neg", since=6, types={"T": SIGNED_INTS + FLOATS_B})(Neg)
    reg.kernel("Abs", since=6, types={"T": NUMERIC_B})(Abs)
    reg.kernel("Sign", since=9, types={"T": NUMERIC_B})(Sign)
    reg.kernel("Not", since=1, types={"T": dtypes("bool")})(
        type("Not", (Unary,), {"ufunc": "logical_not"})
    )
    reg.kernel("BitwiseNot", since=18, types={"T": INTS})(
        type("BitwiseNot", (Unary,), {"ufunc": "invert"})
    )
    for op, (since, defaults) in FLOAT_UNARY.items():
        cls = type(op, (FloatUnary,), {"op": op, "defaults": defaults})
        reg.kernel(op, since=since, types={"T": FLOATS_B})(cls)
    reg.kernel("Relu", since=6, types={"T": FLOATS_B})(type("Relu", (FloatUnary,), {"op": "Relu"}))
    reg.kernel("Relu", since=14, types={"T": SIGNED_INTS})(IntRelu)
    reg.kernel("Gelu", since=20, types={"T": FLOATS_B})(Gelu)
    reg.kernel("IsNaN", since=9, types={"T1": FLOATS_B})(IsNaN)
    reg.kernel("IsInf", since=10, types={"T1": FLOATS_B})(IsInf)

    reg.kernel(
        "PRelu", since=7, types={"T": FLOATS_B + dtypes("int32", "int64", "uint32", "uint64")}
    )(PRelu)
    reg.kernel("Where", since=9, types={"B": dtypes("bool"), "T": ALL_B})(Where)
    reg.kernel("Clip", since=6, until=10, types={"T": FLOATS_B})(Clip6)
    reg.kernel(
        "Clip",
        since=11,
        types={"T": NUMERIC_B},
        input_memory={1: MemType.CPU_INPUT, 2: MemType.CPU_INPUT},
    )(Clip)
    reg.kernel("BitShift", since=11, types={"T": INTS})(BitShift)
    reg.kernel("Cast", since=6, types={"T1": ALL_B, "T2": ALL_B})(Cast)
    reg.kernel("CastLike", since=15, types={"T1": ALL_B, "T2": ALL_B})(CastLike)
