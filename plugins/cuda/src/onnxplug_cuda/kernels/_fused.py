"""Custom CUDA kernels of the elementwise, reduction and normalization families, each with a
numpy twin that the host simulation runs instead.

Two shapes of kernel:

* ``Elementwise``: a ``cupy.ElementwiseKernel`` (broadcasting, one thread per output element)
  built on first use, for chains that CuPy's ufuncs would run as several kernels with
  temporaries (activations, Gelu/Erf, Where, Clip, BitShift, bfloat16 conversions, ...).
* ``RowKernels``: a ``cupy.RawModule`` of row kernels (one block per row, block reductions in
  registers and shared memory): Softmax/LogSoftmax and the mean/variance normalizations
  (LayerNormalization, InstanceNormalization, GroupNormalization) as single kernels.

Precision: float16 and bfloat16 are computed in float32 and rounded once when stored; float64
in float64 (``W`` is that compute type in the CUDA sources). bfloat16 tensors are uint16 arrays
on the GPU (CuPy has no bfloat16 here); the kernels convert them with round-to-nearest-even,
which is exactly what ml_dtypes (the CPU provider's bfloat16) does.

The twins compute the same formulas with numpy in float32/float64 and cast into the output
with ``np.copyto``: they define the expected values of the CUDA code, which the GPU tests
compare against the CPU provider.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import numpy as np

from ..compiler import compiled_function, ship

F32 = np.dtype(np.float32)
try:
    import ml_dtypes

    BF16: Any = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # no bfloat16 anywhere then
    BF16 = None


def widen(x: np.ndarray) -> np.ndarray:
    """A numpy array in its compute dtype: float16/bfloat16 as float32, others unchanged."""
    dt = x.dtype  # ml_dtypes' bfloat16 is not of kind "f"
    return x.astype(np.float32) if dt.itemsize < 4 and (dt.kind == "f" or dt == BF16) else x


# ---------------------------------------------------------------------------------------------
# CUDA preambles

# ``W``: the compute type of a kernel whose placeholder type is ``T`` (CuPy typedefs ``T``
# before the preamble); float16 values convert through float16's ``operator float``.
WIDE_PRE = r"""
template <typename X> struct ox_wide_t { typedef float type; };
template <> struct ox_wide_t<double> { typedef double type; };
"""

BF16_PRE = r"""
__device__ __forceinline__ float ox_bf16_ld(unsigned short b) {
  return __uint_as_float(((unsigned int)b) << 16);
}
__device__ __forceinline__ unsigned short ox_bf16_st(float f) {
  unsigned int u = __float_as_uint(f);
  if (isnan(f)) return (unsigned short)((u >> 16) | 0x40u);  // quiet NaN, sign kept
  return (unsigned short)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);  // nearest even
}
"""

# Helpers the activation expressions use (templated on the compute type).
MATH_PRE = r"""
template <typename W> __device__ __forceinline__ W ox_clamp(W t, W lo, W hi) {
  return t < lo ? lo : (t > hi ? hi : t);  // NaN stays NaN (unlike fmin/fmax)
}
template <typename W> __device__ __forceinline__ W ox_sigmoid(W v) {
  return v >= W(0) ? W(1) / (W(1) + exp(-v)) : exp(v) / (W(1) + exp(v));
}
template <typename W> __device__ __forceinline__ W ox_softplus(W v) {
  return v > W(0) ? v + log1p(exp(-v)) : log1p(exp(v));
}
"""


# ---------------------------------------------------------------------------------------------
# Elementwise kernels


class Elementwise:
    """A ``cupy.ElementwiseKernel`` built on first use, or its numpy twin under the simulation.

    ``k(xp, *inputs, *outputs)``: the outputs are preallocated arrays (the provider's memory);
    ``twin`` receives the same arguments as numpy arrays and scalars and fills the outputs.
    """

    registry: list[Elementwise] = []  # every kernel, for compile checks of the CUDA sources

    __slots__ = (
        "_kernel",
        "_raw",
        "in_params",
        "name",
        "operation",
        "out_params",
        "preamble",
        "twin",
    )

    def __init__(
        self,
        in_params: str,
        out_params: str,
        operation: str,
        name: str,
        twin: Callable[..., None],
        preamble: str = "",
    ):
        self.in_params = in_params
        self.out_params = out_params
        self.operation = operation
        self.name = name
        self.preamble = preamble
        self.twin = twin
        self._kernel: Any = None
        self._raw: Any = None
        Elementwise.registry.append(self)

    def bind(self, xp: Any, *args: Any, stream: int = 0) -> Callable[[], None] | None:
        """The prepared form of ``self(xp, *args)``: a call that does the same work on the
        same (preallocated) arrays every time, with its launch parameters packed once; None
        when this operation or these operands have no prepared form."""
        if xp is np:
            twin = self.twin
            return lambda: twin(*args)
        raw = self.raw()
        if not raw.supported():
            return None
        return raw.bind(xp, args, stream)

    def raw(self) -> Any:
        """The operation as our raw kernel (``launch.RawElementwise``), made on first use."""
        raw = self._raw
        if raw is None:
            from ..launch import RawElementwise

            raw = self._raw = RawElementwise(
                self.in_params, self.out_params, self.operation, self.name, self.preamble
            )
        return raw

    def __call__(self, xp: Any, *args: Any) -> None:
        """Run now on CuPy's current stream: the raw kernel the prepared form launches (a
        process compiles one kernel for both), else CuPy's ElementwiseKernel."""
        if xp is np:
            self.twin(*args)
            return
        run = self.bind(xp, *args, stream=xp.cuda.get_current_stream().ptr)
        if run is not None:
            run()
            return
        k = self._kernel
        if k is None:
            k = self._kernel = xp.ElementwiseKernel(
                self.in_params, self.out_params, self.operation, self.name, preamble=self.preamble
            )
        k(*args)


# -- the elementwise kernels a build ships (compiler.ship) ----------------------------------------
# A first run on a machine compiles (NVRTC, 0.1-0.3 s each beside others on an H100 host) every
# elementwise variant it binds that the install did not build: BERT-base's first run waited
# about 0.3 s for six. The catalogue: each operation whose parameters are all arrays (a
# placeholder type, or bool masks and bfloat16 bits) over the element types below, in the
# variants ``RawElementwise.catalogue`` lists. Operations with attributes passed by value
# (``float32 alpha``) or raw operands compile at first use, as before.
_FLOAT_TYPES = ("float32", "float16")
_INT_TYPES = ("int64", "int32")
_SHIPPED_TYPES: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("ox_u_logical_and", "ox_u_logical_or", "ox_u_logical_xor"), ("bool",)),
    **dict.fromkeys(
        ("ox_u_bitwise_and", "ox_u_bitwise_or", "ox_u_bitwise_xor", "ox_int_div", "ox_prelu_int"),
        _INT_TYPES,
    ),
    **dict.fromkeys(
        (
            "ox_u_add",
            "ox_u_subtract",
            "ox_u_multiply",
            "ox_u_maximum",
            "ox_u_minimum",
            "ox_u_less",
            "ox_u_greater",
            "ox_u_less_equal",
            "ox_u_greater_equal",
            "ox_clip",
        ),
        _FLOAT_TYPES + _INT_TYPES,
    ),
    # (Copy's strided variant is also the copy a Transpose that moves the last axis runs)
    **dict.fromkeys(("ox_copy", "ox_where", "ox_u_equal"), (*_FLOAT_TYPES, *_INT_TYPES, "bool")),
}
_CAST_TYPES = ("float32", "float16", "int64", "int32", "bool")
_ARRAY_TYPES = ("bool", "uint16")  # concrete parameter types that are arrays, not attributes


def _shipped_elementwise() -> list[tuple[str, Callable[[], str]]]:
    from ..launch import _parse_params

    out: list[tuple[str, Callable[[], str]]] = []
    for op in Elementwise.registry:
        params = _parse_params(op.in_params) + _parse_params(op.out_params)
        holders = sorted({t for t, _, _ in params if t.isupper()})
        if any(raw for _, _, raw in params) or any(
            not t.isupper() and t not in _ARRAY_TYPES for t, _, _ in params
        ):
            continue
        if holders == ["X", "Y"]:  # Cast
            combos = [{"X": a, "Y": b} for a in _CAST_TYPES for b in _CAST_TYPES if a != b]
        elif holders == ["T"]:
            combos = [{"T": t} for t in _SHIPPED_TYPES.get(op.name, _FLOAT_TYPES)]
        elif not holders:
            combos = [{}]
        else:
            continue
        for combo in combos:
            dtypes = [np.dtype(combo.get(t, t)) for t, _, _ in params]
            out += op.raw().catalogue(dtypes)
    return out


ship(_shipped_elementwise)


def _bits_to_f32(v: Any) -> np.ndarray:
    """bfloat16 values (an ml_dtypes array, or uint16 bits) as float32 (exact)."""
    return (np.asarray(v).view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def _bf16_to_f32_np(x: np.ndarray, y: np.ndarray) -> None:
    np.copyto(y, _bits_to_f32(x))


def _f32_to_bf16_np(f: np.ndarray, y: np.ndarray) -> None:
    f = np.ascontiguousarray(f, dtype=np.float32)
    u = f.view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    quiet_nan = ((u >> 16) | np.uint32(0x40)).astype(np.uint16)
    np.copyto(y.view(np.uint16), np.where(np.isnan(f), quiet_nan, rounded))


BF16_TO_F32 = Elementwise(
    "uint16 x", "float32 y", "y = ox_bf16_ld(x)", "ox_bf16_to_f32", _bf16_to_f32_np, BF16_PRE
)
F32_TO_BF16 = Elementwise(
    "float32 x", "uint16 y", "y = ox_bf16_st(x)", "ox_f32_to_bf16", _f32_to_bf16_np, BF16_PRE
)


def to_f32(xp: Any, x: Any) -> Any:
    """A bfloat16 array (uint16 storage on the GPU) as a new float32 array (exact)."""
    y = xp.empty(x.shape, np.float32)
    BF16_TO_F32(xp, x, y)
    return y


def from_f32(xp: Any, f: Any, y: Any) -> None:
    """Round float32 ``f`` to bfloat16 (nearest even) into ``y`` (bfloat16 storage)."""
    F32_TO_BF16(xp, f, y)


def _bf16_binary_twin(name: str) -> Callable[..., None]:
    fn = getattr(np, name)

    def twin(a: Any, b: Any, y: np.ndarray) -> None:
        with np.errstate(all="ignore"):
            r = fn(_bits_to_f32(a), _bits_to_f32(b))
        if r.dtype == np.bool_:
            np.copyto(y, r)
        else:
            _f32_to_bf16_np(r, y)

    return twin


# Binary ops on bfloat16 storage in one kernel: both operands to float32, the op, the result
# rounded to nearest even (comparisons give bool). maximum/minimum propagate NaN like numpy.
BF16_BINARY = {
    name: Elementwise(
        "uint16 a, uint16 b",
        "bool y" if boolean else "uint16 y",
        "const float p = ox_bf16_ld(a), q = ox_bf16_ld(b);"
        + (f" y = {expr};" if boolean else f" y = ox_bf16_st({expr});"),
        f"ox_bf16_{name}",
        _bf16_binary_twin(name),
        BF16_PRE,
    )
    for name, expr, boolean in (
        ("add", "p + q", False),
        ("subtract", "p - q", False),
        ("multiply", "p * q", False),
        ("true_divide", "p / q", False),
        ("maximum", "(p != p || p > q) ? p : q", False),
        ("minimum", "(p != p || p < q) ? p : q", False),
        ("equal", "p == q", True),
        ("less", "p < q", True),
        ("greater", "p > q", True),
        ("less_equal", "p <= q", True),
        ("greater_equal", "p >= q", True),
    )
}


def _ufunc_twin(name: str) -> Callable[..., None]:
    fn = getattr(np, name)

    def twin(a: Any, b: Any, y: np.ndarray) -> None:
        with np.errstate(all="ignore"):
            fn(a, b, out=y)

    return twin


# Binary ops on any one type (numpy's ufunc semantics; maximum/minimum propagate NaN), for
# the prepared calls of Add, Mul, comparisons, ...: the unprepared path calls the ufunc itself
UFUNC_BINARY = {
    name: Elementwise("T a, T b", f"{out} y", f"y = {expr}", f"ox_u_{name}", _ufunc_twin(name))
    for name, expr, out in (
        ("add", "a + b", "T"),
        ("subtract", "a - b", "T"),
        ("multiply", "a * b", "T"),
        ("true_divide", "a / b", "T"),
        ("maximum", "(a != a || a > b) ? a : b", "T"),
        ("minimum", "(a != a || a < b) ? a : b", "T"),
        ("equal", "a == b", "bool"),
        ("less", "a < b", "bool"),
        ("greater", "a > b", "bool"),
        ("less_equal", "a <= b", "bool"),
        ("greater_equal", "a >= b", "bool"),
        ("logical_and", "a && b", "bool"),
        ("logical_or", "a || b", "bool"),
        ("logical_xor", "(bool)a != (bool)b", "bool"),
        ("bitwise_and", "a & b", "T"),
        ("bitwise_or", "a | b", "T"),
        ("bitwise_xor", "a ^ b", "T"),
    )
}


def _copy_twin(x: Any, y: np.ndarray) -> None:
    np.copyto(y, x)


# y = x for two arrays of one type, any strides and broadcasting: Transpose, Split, Slice,
# Concat and Expand as one prepared kernel each
class _Copy(Elementwise):
    """``y = x``; prepared copies of views with a contiguous innermost dim move wide units
    (``launch.bind_unit_copy``), the others take the generic strided kernel."""

    __slots__ = ()

    def bind(self, xp: Any, *args: Any, stream: int = 0) -> Callable[[], None] | None:
        if xp is not np and len(args) == 2:
            from ..launch import bind_unit_copy

            fast = bind_unit_copy(xp, args[0], args[1], stream)
            if fast is not None:
                return fast
        return super().bind(xp, *args, stream=stream)


COPY = _Copy("T x", "T y", "y = x", "ox_copy", _copy_twin)


def _cast_twin(x: Any, y: np.ndarray) -> None:
    with np.errstate(all="ignore"):
        np.copyto(y, x, casting="unsafe")


CAST_PRE = r"""
#include <cuda_fp16.h>
template <typename Y, typename X> struct OxCast {
  __device__ static __forceinline__ Y f(X x) { return (Y)x; }
};
template <typename Y> struct OxCast<Y, __half> {
  __device__ static __forceinline__ Y f(__half x) { return (Y)__half2float(x); }
};
template <typename X> struct OxCast<__half, X> {
  __device__ static __forceinline__ __half f(X x) { return __float2half_rn((float)x); }
};
template <> struct OxCast<__half, double> {
  __device__ static __forceinline__ __half f(double x) { return __double2half(x); }
};
template <> struct OxCast<__half, __half> {
  __device__ static __forceinline__ __half f(__half x) { return x; }
};
"""

# numeric casts with C semantics (CuPy's astype: float -> int truncates, nonzero -> true)
CAST = Elementwise("X x", "Y y", "y = OxCast<Y, X>::f(x)", "ox_cast", _cast_twin, CAST_PRE)


def bf16_bits(value: float) -> np.uint16:
    """The bfloat16 bits of a float32-exact ``value`` (small integers: exact)."""
    return np.uint16(int(np.float32(value).view(np.uint32)) >> 16)


class UnaryFloat:
    """``y = f(x)`` for float x: one CUDA expression of ``v`` (x in its compute type ``W``)
    compiled for float16/32/64 and for bfloat16 storage, and a numpy twin."""

    __slots__ = ("bf16", "params", "plain", "twin")

    def __init__(
        self,
        name: str,
        expr: str,
        twin: Callable[..., Any],
        params: tuple[str, ...] = (),
        out: str = "T",
    ):
        decl = "".join(f", float32 {p}" for p in params)

        def variant(suffix: str, storage: str, load: str, store: str, pre: str) -> Elementwise:
            out_type, store = ("bool", "(bool)") if out == "bool" else (storage, store)
            return Elementwise(
                f"{storage} x{decl}",
                f"{out_type} y",
                f"{load} y = {store}({expr});",
                f"ox_{name}{suffix}",
                self._twin,
                pre + MATH_PRE,
            )

        self.plain = variant(
            "", "T", "typedef ox_wide_t<T>::type W; const W v = W(x);", "T", WIDE_PRE
        )
        self.bf16 = variant(
            "_bf16", "uint16", "typedef float W; const W v = ox_bf16_ld(x);", "ox_bf16_st", BF16_PRE
        )
        self.twin = twin
        self.params = params

    def _twin(self, x: np.ndarray, *rest: Any) -> None:
        *params, y = rest
        with np.errstate(all="ignore"):
            r = self.twin(widen(x), *params)
        np.copyto(y, r, casting="unsafe")

    def __call__(self, xp: Any, x: Any, y: Any, *params: np.float32, bf16: bool = False) -> None:
        """``y = f(x)``; ``params`` are the attributes as float32 scalars."""
        (self.bf16 if bf16 else self.plain)(xp, x, *params, y)

    def bind(
        self, xp: Any, x: Any, y: Any, *params: np.float32, bf16: bool = False, stream: int = 0
    ) -> Callable[[], None] | None:
        return (self.bf16 if bf16 else self.plain).bind(xp, x, *params, y, stream=stream)


_erf_py = np.frompyfunc(math.erf, 1, 1)


def erf_np(v: np.ndarray) -> np.ndarray:
    """erf in float64 (math.erf), returned in ``v``'s dtype."""
    return _erf_py(v.astype(np.float64)).astype(np.float64).astype(v.dtype)


def _sigmoid_np(v: np.ndarray) -> np.ndarray:
    e = np.exp(-np.abs(v))
    return np.where(v >= 0, 1, e) / (1 + e)


def _softplus_np(v: np.ndarray) -> np.ndarray:
    return np.where(v > 0, v + np.log1p(np.exp(-np.abs(v))), np.log1p(np.exp(-np.abs(v))))


_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)

# op -> (CUDA expression of v and the params, numpy twin of (v, *params), params)
UNARY_FLOAT: dict[str, tuple[str, Callable[..., Any], tuple[str, ...]]] = {
    "Sqrt": ("sqrt(v)", np.sqrt, ()),
    "Reciprocal": ("W(1) / v", lambda v: 1 / v, ()),
    "Exp": ("exp(v)", np.exp, ()),
    "Log": ("log(v)", np.log, ()),
    "Floor": ("floor(v)", np.floor, ()),
    "Ceil": ("ceil(v)", np.ceil, ()),
    "Round": ("rint(v)", np.rint, ()),  # rint: halves to even in the default rounding mode
    "Sin": ("sin(v)", np.sin, ()),
    "Cos": ("cos(v)", np.cos, ()),
    "Tan": ("tan(v)", np.tan, ()),
    "Asin": ("asin(v)", np.arcsin, ()),
    "Acos": ("acos(v)", np.arccos, ()),
    "Atan": ("atan(v)", np.arctan, ()),
    "Sinh": ("sinh(v)", np.sinh, ()),
    "Cosh": ("cosh(v)", np.cosh, ()),
    "Asinh": ("asinh(v)", np.arcsinh, ()),
    "Acosh": ("acosh(v)", np.arccosh, ()),
    "Atanh": ("atanh(v)", np.arctanh, ()),
    "Tanh": ("tanh(v)", np.tanh, ()),
    "Erf": ("erf(v)", erf_np, ()),
    "Sigmoid": ("ox_sigmoid(v)", _sigmoid_np, ()),
    "Softplus": ("ox_softplus(v)", _softplus_np, ()),
    "Softsign": ("v / (W(1) + fabs(v))", lambda v: v / (1 + np.abs(v)), ()),
    "Mish": ("v * tanh(ox_softplus(v))", lambda v: v * np.tanh(_softplus_np(v)), ()),
    "Relu": ("v > W(0) ? v : (v == v ? W(0) : v)", lambda v: np.maximum(v, 0), ()),
    "LeakyRelu": (
        "v < W(0) ? v * W(alpha) : v",
        lambda v, alpha: np.where(v < 0, v * alpha, v),
        ("alpha",),
    ),
    "ThresholdedRelu": (
        "v > W(alpha) ? v : W(0)",
        lambda v, alpha: np.where(v > alpha, v, 0),
        ("alpha",),
    ),
    "Elu": (
        "v > W(0) ? v : W(alpha) * expm1(v)",
        lambda v, alpha: np.where(v > 0, v, alpha * np.expm1(np.minimum(v, 0))),
        ("alpha",),
    ),
    "Selu": (
        "W(gamma) * (v > W(0) ? v : W(alpha) * expm1(v))",
        lambda v, alpha, gamma: gamma * np.where(v > 0, v, alpha * np.expm1(np.minimum(v, 0))),
        ("alpha", "gamma"),
    ),
    "Celu": (
        "v > W(0) ? v : W(alpha) * expm1(v / W(alpha))",
        lambda v, alpha: np.where(v > 0, v, alpha * np.expm1(np.minimum(v, 0) / alpha)),
        ("alpha",),
    ),
    "HardSigmoid": (
        "ox_clamp(W(alpha) * v + W(beta), W(0), W(1))",
        lambda v, alpha, beta: np.clip(v * alpha + beta, 0, 1),
        ("alpha", "beta"),
    ),
    "HardSwish": (
        "v * ox_clamp(v * W(1.0 / 6.0) + W(0.5), W(0), W(1))",
        lambda v: v * np.clip(v * (1 / 6) + 0.5, 0, 1),
        (),
    ),
    "Gelu": (
        "W(0.5) * v * (W(1) + erf(v * W(0.70710678118654752440)))",
        lambda v: 0.5 * v * (1 + erf_np(v * (1 / math.sqrt(2)))),
        (),
    ),
    "GeluTanh": (
        f"W(0.5) * v * (W(1) + tanh(W({_SQRT_2_OVER_PI!r}) * (v + W(0.044715) * v * v * v)))",
        lambda v: 0.5 * v * (1 + np.tanh(_SQRT_2_OVER_PI * (v + 0.044715 * v**3))),
        (),
    ),
    # com.microsoft QuickGelu, the CPU provider's formula (large negative v: v / inf = -0)
    "QuickGelu": (
        "v / (W(1) + exp(-(W(alpha) * v)))",
        lambda v, alpha: v / (1 + np.exp(-(alpha * v))),
        ("alpha",),
    ),
    # Sign of a float: +-1, zeros and NaN unchanged (bfloat16 only; other dtypes use xp.sign)
    "Sign": (
        "v > W(0) ? W(1) : (v < W(0) ? W(-1) : v)",
        np.sign,
        (),
    ),
}
UNARY_KERNELS = {
    op: UnaryFloat(op.lower(), expr, twin, params)
    for op, (expr, twin, params) in UNARY_FLOAT.items()
}

IS_NAN = UnaryFloat("isnan", "isnan(v)", np.isnan, out="bool")
IS_INF = UnaryFloat(
    "isinf",
    "isinf(v) && (v > W(0) ? pos != 0.0f : neg != 0.0f)",
    lambda v, pos, neg: np.isinf(v) & np.where(v > 0, pos != 0, neg != 0),
    ("pos", "neg"),
    out="bool",
)


# ---------------------------------------------------------------------------------------------
# Non-float elementwise kernels


def _where_np(c: np.ndarray, a: np.ndarray, b: np.ndarray, y: np.ndarray) -> None:
    np.copyto(y, b)
    np.copyto(y, a, where=np.broadcast_to(c, y.shape))


WHERE = Elementwise("bool c, T a, T b", "T y", "y = c ? a : b", "ox_where", _where_np)


def _clip_np(x: np.ndarray, lo: Any, hi: Any, y: np.ndarray) -> None:
    np.copyto(y, np.minimum(np.maximum(x, lo), hi))


# x < lo ? lo : x keeps NaN (fmax/fmin would drop it); lo > hi gives hi, like the CPU provider.
CLIP = Elementwise(
    "T x, T lo, T hi", "T y", "T t = x < lo ? lo : x; y = t > hi ? hi : t", "ox_clip", _clip_np
)


def _prelu_np(x: np.ndarray, s: np.ndarray, y: np.ndarray) -> None:
    w, ws = widen(x), widen(s)
    np.copyto(y, np.where(w < 0, w * ws, w), casting="unsafe")


PRELU = Elementwise(
    "T x, T s",
    "T y",
    "typedef ox_wide_t<T>::type W; y = x < T(0) ? T(W(x) * W(s)) : x",
    "ox_prelu",
    _prelu_np,
    WIDE_PRE,
)
PRELU_INT = Elementwise("T x, T s", "T y", "y = x < T(0) ? T(x * s) : x", "ox_prelu_int", _prelu_np)


def _int_div_np(a: np.ndarray, b: np.ndarray, y: np.ndarray) -> None:
    with np.errstate(all="ignore"):
        q = np.floor_divide(a, b)
        if a.dtype.kind == "i":  # numpy floors; ONNX truncates toward zero (C semantics)
            q += (np.remainder(a, b) != 0) & ((a < 0) ^ (b < 0))
    np.copyto(y, q)


# C division truncates toward zero, which is ONNX's integer Div; x / 0 is undefined in ONNX
# and a hardware-dependent value in CUDA: it is 0 here, as in numpy.
INT_DIV = Elementwise(
    "T a, T b", "T y", "y = b == T(0) ? T(0) : T(a / b)", "ox_int_div", _int_div_np
)


def _mod_np(a: np.ndarray, b: np.ndarray, fmod: Any, y: np.ndarray) -> None:
    with np.errstate(all="ignore"):
        w = widen(a), widen(b)
        np.copyto(y, np.fmod(*w) if fmod else np.remainder(*w), casting="unsafe")


# Mod: fmod=1 is C's fmod (the sign of a), fmod=0 Python's % (the sign of b), computed as
# numpy does (CuPy's integer fmod goes through double and its float % is a - floor(a/b)*b).
# x % 0 is 0 for integers (numpy's value; undefined in ONNX) and NaN for floats.
MOD_INT = Elementwise(
    "T a, T b, int32 truncated",
    "T y",
    "if (b == T(0)) { y = T(0); } else {"
    " T m = T(a % b);"
    " if (!truncated && m != T(0) && ((m < T(0)) != (b < T(0)))) m = T(m + b);"
    " y = m; }",
    "ox_mod_int",
    _mod_np,
)
MOD_FLOAT = Elementwise(
    "T a, T b, int32 truncated",
    "T y",
    "typedef ox_wide_t<T>::type W;"
    " const W wb = W(b);"
    " W m = fmod(W(a), wb);"
    " if (!truncated) {"
    "   if (m != W(0)) { if ((wb < W(0)) != (m < W(0))) m += wb; }"
    "   else m = copysign(W(0), wb); }"
    " y = T(m);",
    "ox_mod_float",
    _mod_np,
    WIDE_PRE,
)


def _bitshift_np(x: np.ndarray, s: np.ndarray, right: int, y: np.ndarray) -> None:
    # numpy shifts by >= the width (or by a negative amount, seen as huge) give 0, or -1 for a
    # right shift of a negative value: the sign fill BitShift-28 specifies.
    np.copyto(y, np.right_shift(x, s) if right else np.left_shift(x, s))


# Shifting by >= the width is undefined in C: the fill is explicit. Left shifts go through
# unsigned 64-bit so that bits shifted past a signed type's sign bit are simply dropped.
BITSHIFT = Elementwise(
    "T x, T s, int32 right",
    "T y",
    "const long long n = (long long)s;"
    " if (n < 0 || n >= (long long)(8 * sizeof(T))) y = (right && x < T(0)) ? T(-1) : T(0);"
    " else if (right) y = T(x >> n);"
    " else y = T((unsigned long long)x << n);",
    "ox_bitshift",
    _bitshift_np,
)


def _lrn_np(
    x: np.ndarray,
    channels: Any,
    inner: Any,
    before: Any,
    after: Any,
    alpha: Any,
    beta: Any,
    bias: Any,
    y: np.ndarray,
) -> None:
    w = widen(x)
    sq = np.square(w)
    C = int(channels)
    ss = sq.copy()
    for off in range(1, max(int(before), int(after)) + 1):
        if off <= before and off < C:  # channel c - off
            ss[:, off:] += sq[:, : C - off]
        if off <= after and off < C:  # channel c + off
            ss[:, : C - off] += sq[:, off:]
    ss *= float(alpha)
    ss += float(bias)
    np.copyto(y, w / np.power(ss, float(beta)), casting="unsafe")


# LRN over channels (axis 1) of a dense (N, C, *spatial) tensor; alpha is already alpha/size.
LRN = Elementwise(
    "raw T x, int64 channels, int64 inner, int64 before, int64 after,"
    " float32 alpha, float32 beta, float32 bias",
    "T y",
    "typedef ox_wide_t<T>::type W;"
    " const long long c = (i / inner) % channels;"
    " const long long base = i - c * inner;"
    " const long long lo = c - before < 0 ? 0 : c - before;"
    " const long long hi = c + after >= channels ? channels - 1 : c + after;"
    " W s = W(0);"
    " for (long long k = lo; k <= hi; ++k) { const W t = W(x[base + k * inner]); s += t * t; }"
    " y = T(W(x[i]) / pow(W(bias) + W(alpha) * s, W(beta)))",
    "ox_lrn",
    _lrn_np,
    WIDE_PRE,
)


def _bn_np(
    x: np.ndarray,
    s: np.ndarray,
    b: np.ndarray,
    m: np.ndarray,
    v: np.ndarray,
    eps: Any,
    y: np.ndarray,
) -> None:
    w = widen(x)
    a = (widen(s) / np.sqrt(widen(v) + float(eps))).astype(w.dtype, copy=False)
    shift = (widen(b) - widen(m) * a).astype(w.dtype, copy=False)
    np.copyto(y, w * a + shift, casting="unsafe")


# Inference BatchNormalization; scale/bias/mean/var are (C, 1, ...) views broadcast over x.
BATCHNORM = Elementwise(
    "T x, S s, S b, M m, M v, float64 eps",
    "T y",
    "typedef ox_wide_t<T>::type W;"
    " const W a = W(s) / sqrt(W(v) + W(eps));"
    " y = T(W(x) * a + (W(b) - W(m) * a))",
    "ox_batchnorm",
    _bn_np,
    WIDE_PRE,
)


# ---------------------------------------------------------------------------------------------
# Row kernels: Softmax / LogSoftmax and mean-variance normalization

ROWS_SRC = r"""
#include <cuda_fp16.h>

// Storage traits: S the stored type, W the compute type, ld/st the conversions; rnd rounds a
// softmax intermediate to the storage precision for float16 only (see ox_softmax_rows).
struct OxF32 {
  typedef float S; typedef float W;
  __device__ static __forceinline__ W ld(S v) { return v; }
  __device__ static __forceinline__ S st(W v) { return v; }
  __device__ static __forceinline__ W rnd(W v) { return v; }
};
struct OxF64 {
  typedef double S; typedef double W;
  __device__ static __forceinline__ W ld(S v) { return v; }
  __device__ static __forceinline__ S st(W v) { return v; }
  __device__ static __forceinline__ W rnd(W v) { return v; }
};
struct OxF16 {
  typedef __half S; typedef float W;
  __device__ static __forceinline__ W ld(S v) { return __half2float(v); }
  __device__ static __forceinline__ S st(W v) { return __float2half_rn(v); }
  __device__ static __forceinline__ W rnd(W v) { return __half2float(__float2half_rn(v)); }
};
struct OxBF16 {
  typedef unsigned short S; typedef float W;
  __device__ static __forceinline__ W ld(S v) { return __uint_as_float(((unsigned int)v) << 16); }
  __device__ static __forceinline__ S st(W v) {
    unsigned int u = __float_as_uint(v);
    if (isnan(v)) return (unsigned short)((u >> 16) | 0x40u);
    return (unsigned short)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  }
  __device__ static __forceinline__ W rnd(W v) { return v; }
};

__device__ __forceinline__ float ox_neg_inf(float) { return __uint_as_float(0xff800000u); }
__device__ __forceinline__ double ox_neg_inf(double) {
  return __longlong_as_double((long long)0xfff0000000000000ULL);
}

// Block reductions; blockDim.x is a multiple of 32 (at most 1024). The leading barrier lets
// a block reduce twice in a row with the same shared buffer.
template <typename W> __device__ __forceinline__ W ox_block_sum(W v, W* sh) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
  __syncthreads();
  if (lane == 0) sh[wid] = v;
  __syncthreads();
  if (wid == 0) {
    W r = lane < nw ? sh[lane] : W(0);
    for (int o = 16; o > 0; o >>= 1) r += __shfl_xor_sync(0xffffffffu, r, o);
    if (lane == 0) sh[0] = r;
  }
  __syncthreads();
  return sh[0];
}
template <typename W> __device__ __forceinline__ W ox_block_max(W v, W* sh) {
  for (int o = 16; o > 0; o >>= 1) {
    const W u = __shfl_xor_sync(0xffffffffu, v, o);
    v = u > v ? u : v;
  }
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
  __syncthreads();
  if (lane == 0) sh[wid] = v;
  __syncthreads();
  if (wid == 0) {
    W r = lane < nw ? sh[lane] : ox_neg_inf(W(0));
    for (int o = 16; o > 0; o >>= 1) {
      const W u = __shfl_xor_sync(0xffffffffu, r, o);
      r = u > r ? u : r;
    }
    if (lane == 0) sh[0] = r;
  }
  __syncthreads();
  return sh[0];
}

// Softmax (log_mode 0) or LogSoftmax (1) of contiguous rows: one block per row. NaN never
// wins the max, but exp(NaN - m) makes the sum and so the whole row NaN, as in numpy.
// float16 rounds each step to float16 (x - max, exp, the float sum, log, the quotient) like
// the CPU provider, whose numpy float16 arithmetic produced onnx's expected outputs; the
// other types compute in W and round once.
template <class Tr>
__device__ void ox_softmax_rows(const typename Tr::S* __restrict__ x, typename Tr::S* __restrict__ y,
                                long long cols, int log_mode) {
  typedef typename Tr::W W;
  __shared__ W sh[32];
  const long long base = (long long)blockIdx.x * cols;
  const typename Tr::S* xr = x + base;
  typename Tr::S* yr = y + base;
  W m = ox_neg_inf(W(0));
  for (long long c = threadIdx.x; c < cols; c += blockDim.x) {
    const W v = Tr::ld(xr[c]);
    m = v > m ? v : m;
  }
  m = ox_block_max(m, sh);
  W s = W(0);
  for (long long c = threadIdx.x; c < cols; c += blockDim.x)
    s += Tr::rnd(exp(Tr::rnd(Tr::ld(xr[c]) - m)));
  s = Tr::rnd(ox_block_sum(s, sh));
  if (log_mode) {
    const W ls = Tr::rnd(log(s));
    for (long long c = threadIdx.x; c < cols; c += blockDim.x)
      yr[c] = Tr::st(Tr::rnd(Tr::ld(xr[c]) - m) - ls);
  } else {
    for (long long c = threadIdx.x; c < cols; c += blockDim.x)
      yr[c] = Tr::st(Tr::rnd(exp(Tr::rnd(Tr::ld(xr[c]) - m))) / s);
  }
}

// Softmax over the middle axis of (outer, n, inner) with inner > 1: one thread per
// (outer, inner) pair, adjacent threads reading adjacent memory. The sum runs in axis order;
// float16 rounds it after every addition (numpy's float16 reduction along a strided axis).
template <class Tr>
__device__ void ox_softmax_strided(const typename Tr::S* __restrict__ x, typename Tr::S* __restrict__ y,
                                   long long outer, long long n, long long inner, int log_mode) {
  typedef typename Tr::W W;
  const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= outer * inner) return;
  const long long o = t / inner;
  const long long off = o * n * inner + (t - o * inner);
  const typename Tr::S* xr = x + off;
  typename Tr::S* yr = y + off;
  W m = ox_neg_inf(W(0));
  for (long long k = 0; k < n; ++k) {
    const W v = Tr::ld(xr[k * inner]);
    m = v > m ? v : m;
  }
  W s = W(0);
  for (long long k = 0; k < n; ++k) s = Tr::rnd(s + Tr::rnd(exp(Tr::rnd(Tr::ld(xr[k * inner]) - m))));
  if (log_mode) {
    const W ls = Tr::rnd(log(s));
    for (long long k = 0; k < n; ++k) yr[k * inner] = Tr::st(Tr::rnd(Tr::ld(xr[k * inner]) - m) - ls);
  } else {
    for (long long k = 0; k < n; ++k)
      yr[k * inner] = Tr::st(Tr::rnd(exp(Tr::rnd(Tr::ld(xr[k * inner]) - m))) / s);
  }
}

// Mean-variance normalization of contiguous rows (two passes over the row for the statistics,
// so no cancellation), one block per row, then an optional affine step:
//   mode 0: none;  mode 1: scale[col] (+ bias[col] when bias is not null);
//   mode 2: scale[ch] + bias[ch] with ch = (row % groups) * cpg + col / inner.
// mean_out/rstd_out (float, one per row) are written when not null.
template <class Tr>
__device__ void ox_rownorm(const typename Tr::S* __restrict__ x, typename Tr::S* __restrict__ y,
                           const typename Tr::S* __restrict__ scale, const typename Tr::S* __restrict__ bias,
                           float* __restrict__ mean_out, float* __restrict__ rstd_out,
                           long long cols, double eps, int mode, long long groups, long long cpg,
                           long long inner) {
  typedef typename Tr::W W;
  __shared__ W sh[32];
  const long long row = blockIdx.x;
  const typename Tr::S* xr = x + row * cols;
  typename Tr::S* yr = y + row * cols;
  W s = W(0);
  for (long long c = threadIdx.x; c < cols; c += blockDim.x) s += Tr::ld(xr[c]);
  const W mean = ox_block_sum(s, sh) / W(cols);
  W q = W(0);
  for (long long c = threadIdx.x; c < cols; c += blockDim.x) {
    const W d = Tr::ld(xr[c]) - mean;
    q += d * d;
  }
  const W rstd = W(1) / sqrt(ox_block_sum(q, sh) / W(cols) + W(eps));
  if (threadIdx.x == 0) {
    if (mean_out) mean_out[row] = (float)mean;
    if (rstd_out) rstd_out[row] = (float)rstd;
  }
  if (mode == 1) {
    for (long long c = threadIdx.x; c < cols; c += blockDim.x) {
      W v = (Tr::ld(xr[c]) - mean) * rstd * Tr::ld(scale[c]);
      if (bias) v += Tr::ld(bias[c]);
      yr[c] = Tr::st(v);
    }
  } else if (mode == 2) {
    const long long cbase = (row % groups) * cpg;
    for (long long c = threadIdx.x; c < cols; c += blockDim.x) {
      const long long ch = cbase + c / inner;
      yr[c] = Tr::st((Tr::ld(xr[c]) - mean) * rstd * Tr::ld(scale[ch]) + Tr::ld(bias[ch]));
    }
  } else {
    for (long long c = threadIdx.x; c < cols; c += blockDim.x) yr[c] = Tr::st((Tr::ld(xr[c]) - mean) * rstd);
  }
}
"""

_ROW_ENTRY = r"""
extern "C" __global__ void ox_softmax_rows_{k}(const {S}* x, {S}* y, long long cols, int log_mode) {{
  ox_softmax_rows<{Tr}>(x, y, cols, log_mode);
}}
extern "C" __global__ void ox_softmax_strided_{k}(const {S}* x, {S}* y, long long outer, long long n,
                                                 long long inner, int log_mode) {{
  ox_softmax_strided<{Tr}>(x, y, outer, n, inner, log_mode);
}}
extern "C" __global__ void ox_rownorm_{k}(const {S}* x, {S}* y, const {S}* scale, const {S}* bias,
                                         float* mean_out, float* rstd_out, long long cols, double eps,
                                         int mode, long long groups, long long cpg, long long inner) {{
  ox_rownorm<{Tr}>(x, y, scale, bias, mean_out, rstd_out, cols, eps, mode, groups, cpg, inner);
}}
"""

_EXTERN_C = 'extern "C"'
_ENTRY_NAME = re.compile(r"__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(")

# storage key -> (traits struct, C storage type)
ROW_TYPES = {
    "f32": ("OxF32", "float"),
    "f64": ("OxF64", "double"),
    "f16": ("OxF16", "__half"),
    "bf16": ("OxBF16", "unsigned short"),
}
ROWS_MODULE_SRC = ROWS_SRC + "".join(
    _ROW_ENTRY.format(k=k, Tr=tr, S=s) for k, (tr, s) in ROW_TYPES.items()
)


def storage_key(dtype: Any) -> str:
    """The row kernels' name suffix for a float dtype (bfloat16 by name: ml_dtypes)."""
    dt = np.dtype(dtype)
    if dt.name == "bfloat16":
        return "bf16"
    return {"float32": "f32", "float64": "f64", "float16": "f16"}[dt.name]


class _RowModule:
    """A module's CUDA source (``ROWS_MODULE_SRC`` here; other kernel families build on its
    traits and block reductions): shared code, then ``extern "C"`` entry points. Each entry
    point is compiled on its first use, on its own with the shared code: a process compiles
    only the kernels its models run (the whole row module, every entry for four storage types,
    took NVRTC 2.2 s on an H100 host; BERT-base runs one of them)."""

    def __init__(self, code: str = ROWS_MODULE_SRC) -> None:
        start = code.find(_EXTERN_C)
        if start < 0:
            raise ValueError('a row module needs an extern "C" entry point')
        self._shared = code[:start]
        self._entries: dict[str, str] = {}
        for piece in code[start:].split(_EXTERN_C)[1:]:
            m = _ENTRY_NAME.search(piece)
            if m is None or m.group(1) in self._entries:
                raise ValueError(f"no kernel name, or a repeated one, in entry {piece[:80]!r}")
            self._entries[m.group(1)] = _EXTERN_C + piece
        self._functions: dict[tuple, Any] = {}  # (name, device) -> function

    def source(self, name: str) -> str:
        """The code compiled for entry point ``name``: the shared code and that entry."""
        entry = self._entries.get(name)
        if entry is None:
            raise KeyError(f"no kernel {name!r} in this module")
        return self._shared + entry

    def function(self, xp: Any, name: str) -> Any:
        return compiled_function(xp, *self.kernel(name), self._functions)

    def kernel(self, name: str) -> tuple[str, Callable[[], str]]:
        """(name, source) of entry point ``name``, as ``function`` compiles it."""
        return name, lambda: self.source(name)

    def kernels(self) -> list[tuple[str, Callable[[], str]]]:
        """Every entry point's (name, source): the shipped kernels (``compiler.ship``)."""
        return [self.kernel(name) for name in self._entries]

    def precompile(self, kernel: Any, name: str) -> None:
        """Start compiling entry ``name`` for ``kernel``'s device, in the background (its
        ``warm_up``)."""
        self.source(name)  # a name that is not here fails now, not in the background
        kernel.precompile(*self.kernel(name), self._functions, (name,))


ROWS = _RowModule()
ship(ROWS.kernels)

# storage key -> the C compute type W of its traits
WIDE_C = {"f32": "float", "f64": "double", "f16": "float", "bf16": "float"}


def row_module(src: str, entry: str) -> _RowModule:
    """A module of ``ROWS_SRC`` (traits, block reductions) and ``src``, with ``entry`` formatted
    once per storage type: ``{k}`` its key, ``{Tr}`` its traits, ``{S}`` the stored C type and
    ``{W}`` the compute type."""
    entries = "".join(
        entry.format(k=k, Tr=tr, S=c, W=WIDE_C[k]) for k, (tr, c) in ROW_TYPES.items()
    )
    return _RowModule(ROWS_SRC + src + entries)


def function_devices() -> list[int]:
    """The device of every compiled kernel function loaded so far (packed elementwise
    launches and row kernels; CuPy keeps its own kernels per device): each is usable only on
    its device, so they are cached per device."""
    out = [k[-1] for e in Elementwise.registry if e._raw is not None for k in e._raw._functions]
    return out + [k[-1] for k in ROWS._functions]


def block_size(cols: int) -> int:
    """Threads per row block: up to ~4 elements per thread, a multiple of 32, at most 512."""
    b = 32
    while b < 512 and b * 4 < cols:
        b *= 2
    return b


def softmax(xp: Any, x: Any, y: Any, outer: int, n: int, inner: int, key: str, log: bool) -> None:
    """Softmax/LogSoftmax of dense ``x`` viewed as (outer, n, inner) over n, into ``y``."""
    softmax_call(xp, x, y, outer, n, inner, key, log)()


def softmax_call(
    xp: Any,
    x: Any,
    y: Any,
    outer: int,
    n: int,
    inner: int,
    key: str,
    log: bool,
    stream: int | None = None,
) -> Callable[[], None]:
    """``softmax`` as a call bound to these arrays (the prepared form; ``stream``: a raw
    stream handle for a packed launch, None for CuPy's current stream)."""
    if outer * n * inner == 0:
        return _nothing
    if xp is np:
        return lambda: _softmax_np(x, y, outer, n, inner, log)
    mode = np.int32(1 if log else 0)
    if inner == 1:
        fn = ROWS.function(xp, "ox_softmax_rows_" + key)
        return _call(fn, (outer,), (block_size(n),), (x, y, np.int64(n), mode), stream)
    total = outer * inner
    fn = ROWS.function(xp, "ox_softmax_strided_" + key)
    args = (x, y, np.int64(outer), np.int64(n), np.int64(inner), mode)
    return _call(fn, ((total + 255) // 256,), (256,), args, stream)


def _softmax_np(x: Any, y: Any, outer: int, n: int, inner: int, log: bool) -> None:
    # float16 steps in float16 (see ox_softmax_rows); numpy sums a contiguous axis
    # pairwise in float32 and a strided one in float16, as the CUDA kernels do
    x3 = x.reshape(outer, n, inner)
    w = x3 if x3.dtype == np.float16 else widen(x3)
    with np.errstate(all="ignore"):
        z = w - w.max(axis=1, keepdims=True)
        if log:
            z -= np.log(np.exp(z).sum(axis=1, keepdims=True))
        else:
            np.exp(z, out=z)
            z /= z.sum(axis=1, keepdims=True)
    np.copyto(y.reshape(outer, n, inner), z, casting="unsafe")


def _nothing() -> None:
    pass


def _call(fn: Any, grid: tuple, block: tuple, args: tuple, stream: int | None) -> Any:
    """A RawModule function call: packed once for a raw stream handle, else CuPy's call."""
    if stream is None:
        return lambda: fn(grid, block, args)
    from ..launch import function_launch

    return function_launch(fn, grid, block, args, stream)


_NULL = np.uint64(0)


def rownorm(
    xp: Any,
    x: Any,
    y: Any,
    rows: int,
    cols: int,
    eps: float,
    key: str,
    scale: Any = None,
    bias: Any = None,
    mean: Any = None,
    rstd: Any = None,
    mode: int = 0,
    groups: int = 1,
    cpg: int = 1,
    inner: int = 1,
    stream: int | None = None,
) -> Callable[[], None]:
    """Normalize the rows of dense ``x`` viewed as (rows, cols) into ``y`` (see ox_rownorm);
    returns the call, bound to these arrays (run it; ``stream`` as for ``softmax_call``).

    ``scale``/``bias`` are dense vectors (cols entries for mode 1, channels for mode 2);
    ``mean``/``rstd`` are float32 arrays of ``rows`` entries, or None.
    """
    if rows == 0:
        return _nothing
    if xp is np:
        args = (x, y, rows, cols, eps, scale, bias, mean, rstd, mode, groups, cpg, inner)
        return lambda: _rownorm_np(*args)
    fn = ROWS.function(xp, "ox_rownorm_" + key)
    return _call(
        fn,
        (rows,),
        (block_size(cols),),
        (
            x,
            y,
            _NULL if scale is None else scale,
            _NULL if bias is None else bias,
            _NULL if mean is None else mean,
            _NULL if rstd is None else rstd,
            np.int64(cols),
            np.float64(eps),
            np.int32(mode),
            np.int64(groups),
            np.int64(cpg),
            np.int64(inner),
        ),
        stream,
    )


def _rownorm_np(
    x: np.ndarray,
    y: np.ndarray,
    rows: int,
    cols: int,
    eps: float,
    scale: Any,
    bias: Any,
    mean: Any,
    rstd: Any,
    mode: int,
    groups: int,
    cpg: int,
    inner: int,
) -> None:
    w = widen(x.reshape(rows, cols))
    with np.errstate(all="ignore"):
        m = w.mean(axis=1, keepdims=True)
        d = w - m
        r = 1 / np.sqrt(np.mean(d * d, axis=1, keepdims=True) + eps)
        z = d * r
        if mode == 1:
            z *= widen(scale.reshape(-1))
            if bias is not None:
                z += widen(bias.reshape(-1))
        elif mode == 2:
            ch = ((np.arange(rows) % groups) * cpg)[:, None] + (np.arange(cols) // inner)[None, :]
            z = z * widen(scale.reshape(-1))[ch] + widen(bias.reshape(-1))[ch]
    np.copyto(y.reshape(rows, cols), z, casting="unsafe")
    if mean is not None:
        np.copyto(mean.reshape(rows), m.reshape(rows), casting="unsafe")
    if rstd is not None:
        np.copyto(rstd.reshape(rows), r.reshape(rows), casting="unsafe")
