"""CUDA kernels of the fused transformer ops (see ``onnxplug.optimizer.fusions``; the CPU
provider's ``contrib`` kernels are the reference): one kernel launch per fused node.

* ``com.microsoft`` ``Gelu``, ``BiasGelu``, ``FastGelu(X, bias?)``: one CuPy ElementwiseKernel
  each (the bias is broadcast by CuPy), computing in float32 (float64 for float64) and rounding
  once; bfloat16 (uint16 storage) has its own variants converting with round-to-nearest-even.
* ``com.microsoft`` ``SkipLayerNormalization``: one row kernel (a block per row of the last
  axis): ``s = input + skip (+ bias)`` rounded to the tensor type and written once (to the
  output, and to ``input_skip_bias_sum`` when asked), then the mean and the variance in two
  passes over the row (no cancellation), then the affine step in place. ``skip`` of shape
  (..., S, H) repeating over the leading dims is read in place; other broadcasts are made dense.
* ``com.microsoft`` ``QuickGelu`` (``alpha``): ``_fused``'s unary float kernel.
* ``com.microsoft`` ``EmbedLayerNormalization``: a gather-sum row kernel (NaN rows for ids out
  of range), then the LayerNormalization row kernel of ``_fused``; ``mask_index`` one launch.
* ``com.microsoft`` ``MatMulNBits``: the 2..8-bit blocks dequantized into a scratch weight by
  one kernel, then one GEMM with the bias epilogue.
* ``com.microsoft`` ``BiasSoftmax(data, bias)`` (``axis``): the sum in float32 (float64), then
  ``_fused``'s softmax row kernel over the dims from ``axis`` on, then one rounding.
* ``ai.onnxplug`` ``MatMulBias``: one cuBLASLt GEMM over ``A`` folded to (rows, K), with the
  BIAS, RELU_BIAS or GELU_BIAS epilogue. cuBLASLt's GELU epilogue is the tanh approximation
  (FastGelu) and it has no erf GELU epilogue, so ``activation="Gelu"`` is the BIAS epilogue and
  then the Gelu kernel in place on the output: two launches instead of three.

The Gelu formulas, bfloat16 conversions, storage traits and block reductions are the ones of
``_fused`` (the elementwise/normalization kernels). Under the host simulation the kernels'
numpy twins (the same formulas in float32, float64 for float64, rounded once) and the GEMM
engine's numpy path run instead.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from onnxplug.ep import KernelContext, KernelInfo, KernelRegistry, dtypes, shapes

from .. import blas
from ..compiler import ship
from ..launch import ShapeOnly, bound_calls, dry_compiles, function_launch
from . import _fused as F
from ._base import BF16, CallListKernel, CudaKernel
from .elementwise import FloatUnary

MS = "com.microsoft"
PLUG = "ai.onnxplug"
F16_32_64 = dtypes("float16", "float32", "float64")
GELU_TYPES = F16_32_64 + BF16  # Gelu, BiasGelu, SkipLayerNormalization, MatMulBias
FAST_GELU_TYPES = dtypes("float16", "float32") + BF16
F32 = np.dtype(np.float32)
_NULL = np.uint64(0)  # a null pointer argument of a RawKernel


def _is_bf16(dtype: Any) -> bool:
    return dtype is not None and np.dtype(dtype).name == "bfloat16"


# ---------------------------------------------------------------------------------------------
# Gelu family: elementwise kernels (the formulas and their twins are ``_fused``'s Gelu/GeluTanh)


class GeluKernel:
    """``y = f(x (+ b))`` for f = Gelu (erf) or GeluTanh (FastGelu): ``_fused``'s unary kernel
    without a bias; with one, an ElementwiseKernel of the same expression of ``v = x + b``
    (broadcast by CuPy) for float16/32/64 and for bfloat16 storage, with its numpy twin."""

    def __init__(self, op: str, bias: bool):
        self.unary = F.UNARY_KERNELS[op]
        self.bias = bias
        expr, f, _ = F.UNARY_FLOAT[op]

        def twin(x: np.ndarray, b: np.ndarray, y: np.ndarray) -> None:
            with np.errstate(all="ignore"):
                np.copyto(y, f(F.widen(x) + F.widen(b)), casting="unsafe")

        name = f"oxc_{op.lower()}_bias"
        self.plain = F.Elementwise(
            "T x, T b",
            "T y",
            f"typedef ox_wide_t<T>::type W; const W v = W(x) + W(b); y = T({expr});",
            name,
            twin,
            F.WIDE_PRE + F.MATH_PRE,
        )
        self.bf16 = F.Elementwise(
            "uint16 x, uint16 b",
            "uint16 y",
            f"typedef float W; const W v = ox_bf16_ld(x) + ox_bf16_ld(b); y = ox_bf16_st({expr});",
            name + "_bf16",
            twin,
            F.BF16_PRE + F.MATH_PRE,
        )

    def __call__(self, xp: Any, x: Any, b: Any, y: Any, bf16: bool) -> None:
        if b is None:
            self.unary(xp, x, y, bf16=bf16)
        else:
            (self.bf16 if bf16 else self.plain)(xp, x, b, y)

    def bind(self, xp: Any, x: Any, b: Any, y: Any, bf16: bool, stream: int) -> Any:
        if b is None:
            return self.unary.bind(xp, x, y, bf16=bf16, stream=stream)
        return (self.bf16 if bf16 else self.plain).bind(xp, x, b, y, stream=stream)


GELU = GeluKernel("Gelu", bias=False)
BIAS_GELU = GeluKernel("Gelu", bias=True)
FAST_GELU = GeluKernel("GeluTanh", bias=False)
FAST_GELU_BIAS = GeluKernel("GeluTanh", bias=True)


class _Typed(CudaKernel):
    """Knows whether its tensors are bfloat16 (uint16 storage on the GPU): from the graph's
    types when known, else from the input tensor at run time."""

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        dt = info.input_dtype(0)
        self.dtype: np.dtype | None = dt
        self.bf16 = _is_bf16(dt)

    def dtype_of(self, ctx: KernelContext) -> np.dtype:
        return self.dtype if self.dtype is not None else ctx.input(0).dtype

    def is_bf16(self, ctx: KernelContext) -> bool:
        return self.bf16 if self.dtype is not None else _is_bf16(ctx.input(0).dtype)


class _GeluBase(_Typed):
    plain: GeluKernel
    with_bias: GeluKernel

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self._shapes: dict[tuple, tuple[int, ...]] = {}  # (x, bias) shapes -> output shape

    def compute(self, ctx: KernelContext) -> None:
        x, b = self.arg(ctx, 0), self.arg(ctx, 1)
        dt = self.dtype_of(ctx)
        if b is None:
            shape = x.shape
        else:
            shape = self._shapes.get((x.shape, b.shape)) or self._shapes.setdefault(
                (x.shape, b.shape), shapes.broadcast_shapes(x.shape, b.shape)
            )
        y = self.alloc(ctx, 0, shape, dt)
        if y.size:
            k = self.plain if b is None else self.with_bias
            k(self.xp, x, b, y, self.is_bf16(ctx))

    def prepare(self, ctx: KernelContext) -> Any:
        x, b = self.arg(ctx, 0), self.arg(ctx, 1)
        shape = x.shape if b is None else shapes.broadcast_shapes(x.shape, b.shape)
        y = self.alloc(ctx, 0, shape, self.dtype_of(ctx))
        k = self.plain if b is None else self.with_bias
        return k.bind(self.xp, x, b, y, self.is_bf16(ctx), self.stream_handle(ctx))


class Gelu(_GeluBase):
    plain = with_bias = GELU


class BiasGelu(_GeluBase):
    plain = with_bias = BIAS_GELU


class FastGelu(_GeluBase):
    plain, with_bias = FAST_GELU, FAST_GELU_BIAS


class QuickGelu(FloatUnary):
    """``x * sigmoid(alpha * x)`` (``alpha`` 1.702): ``_fused``'s unary kernel of the CPU
    provider's formula ``x / (1 + exp(-alpha * x))``."""

    op = "QuickGelu"
    defaults = (1.702,)


# ---------------------------------------------------------------------------------------------
# SkipLayerNormalization: a row kernel on ``_fused``'s storage traits and block reductions

_SKIP_LN_SRC = r"""
// One block per row. Each thread reads back only the elements it wrote itself, so the sum can
// live in y between the passes.
template <class Tr>
__device__ void oxc_skip_ln(const typename Tr::S* __restrict__ x, const typename Tr::S* __restrict__ skip,
                            const typename Tr::S* __restrict__ gamma, const typename Tr::S* __restrict__ beta,
                            const typename Tr::S* __restrict__ bias, typename Tr::S* y,
                            typename Tr::S* __restrict__ sum_out, float* __restrict__ mean_out,
                            float* __restrict__ rstd_out, long long cols, long long skip_rows, double eps) {
  typedef typename Tr::W W;
  typedef typename Tr::S S;
  __shared__ W sh[32];
  const long long row = blockIdx.x;
  const S* xr = x + row * cols;
  const S* sr = skip + (row % skip_rows) * cols;
  S* yr = y + row * cols;
  S* qr = sum_out ? sum_out + row * cols : (S*)0;
  W acc = W(0);
  for (long long c = threadIdx.x; c < cols; c += blockDim.x) {
    W v = Tr::ld(xr[c]) + Tr::ld(sr[c]);
    if (bias) v += Tr::ld(bias[c]);
    const S sv = Tr::st(v);  // the sum in the tensor type: what input_skip_bias_sum holds
    yr[c] = sv;
    if (qr) qr[c] = sv;
    acc += Tr::ld(sv);
  }
  const W mean = ox_block_sum(acc, sh) / W(cols);
  W q = W(0);
  for (long long c = threadIdx.x; c < cols; c += blockDim.x) {
    const W d = Tr::ld(yr[c]) - mean;
    q += d * d;
  }
  const W rstd = W(1) / sqrt(ox_block_sum(q, sh) / W(cols) + W(eps));
  if (threadIdx.x == 0) {
    if (mean_out) mean_out[row] = (float)mean;
    if (rstd_out) rstd_out[row] = (float)rstd;
  }
  for (long long c = threadIdx.x; c < cols; c += blockDim.x) {
    W v = (Tr::ld(yr[c]) - mean) * rstd * Tr::ld(gamma[c]);
    if (beta) v += Tr::ld(beta[c]);
    yr[c] = Tr::st(v);
  }
}
"""

_SKIP_LN_VEC_SRC = r"""
// The row held in registers: each thread moves VEC elements (16 bytes) per load and store, NV
// vectors per thread (a block of ceil(cols / VEC / NV) threads, rounded up to a warp), so the
// row is read once and written once (the kernel above reads y back twice). The same
// arithmetic: the sum rounded to the tensor type, its mean, the mean of squared deviations.
template <class S, int VEC> struct alignas(16) OxcVec { S e[VEC]; };
template <class Tr, int VEC, int NV>
__device__ void oxc_skip_ln_vec(const typename Tr::S* __restrict__ x, const typename Tr::S* __restrict__ skip,
                                const typename Tr::S* __restrict__ gamma, const typename Tr::S* __restrict__ beta,
                                const typename Tr::S* __restrict__ bias, typename Tr::S* __restrict__ y,
                                typename Tr::S* __restrict__ sum_out, float* __restrict__ mean_out,
                                float* __restrict__ rstd_out, long long cols, long long skip_rows, double eps) {
  typedef typename Tr::W W;
  typedef typename Tr::S S;
  typedef OxcVec<S, VEC> V;
  __shared__ W sh[32];
  const long long row = blockIdx.x, nvec = cols / VEC;
  const V* xr = reinterpret_cast<const V*>(x + row * cols);
  const V* sr = reinterpret_cast<const V*>(skip + (row % skip_rows) * cols);
  W v[NV][VEC];
  W acc = W(0);
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const long long j = threadIdx.x + (long long)i * blockDim.x;
    if (j < nvec) {
      const V a = xr[j], b = sr[j];
      V c;
      if (bias) c = reinterpret_cast<const V*>(bias)[j];
      V q;
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        W t = Tr::ld(a.e[e]) + Tr::ld(b.e[e]);
        if (bias) t += Tr::ld(c.e[e]);
        q.e[e] = Tr::st(t);  // the sum in the tensor type: what input_skip_bias_sum holds
        v[i][e] = Tr::ld(q.e[e]);
        acc += v[i][e];
      }
      if (sum_out) reinterpret_cast<V*>(sum_out + row * cols)[j] = q;
    }
  }
  const W mean = ox_block_sum(acc, sh) / W(cols);
  W dev = W(0);
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    if (threadIdx.x + (long long)i * blockDim.x < nvec) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const W d = v[i][e] - mean;
        dev += d * d;
      }
    }
  }
  const W rstd = W(1) / sqrt(ox_block_sum(dev, sh) / W(cols) + W(eps));
  if (threadIdx.x == 0) {
    if (mean_out) mean_out[row] = (float)mean;
    if (rstd_out) rstd_out[row] = (float)rstd;
  }
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const long long j = threadIdx.x + (long long)i * blockDim.x;
    if (j < nvec) {
      const V g = reinterpret_cast<const V*>(gamma)[j];
      V bt;
      if (beta) bt = reinterpret_cast<const V*>(beta)[j];
      V o;
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        W t = (v[i][e] - mean) * rstd * Tr::ld(g.e[e]);
        if (beta) t += Tr::ld(bt.e[e]);
        o.e[e] = Tr::st(t);
      }
      reinterpret_cast<V*>(y + row * cols)[j] = o;
    }
  }
}
"""
_SKIP_LN_VEC_ENTRY = r"""
extern "C" __global__ void oxc_skip_ln_v{nv}_{k}(const {S}* x, const {S}* skip,
    const {S}* gamma, const {S}* beta, const {S}* bias, {S}* y, {S}* sum_out, float* mean_out,
    float* rstd_out, long long cols, long long skip_rows, double eps) {{
  oxc_skip_ln_vec<{Tr}, {vec}, {nv}>(x, skip, gamma, beta, bias, y, sum_out, mean_out, rstd_out,
                                   cols, skip_rows, eps);
}}
"""
_SKIP_LN_NV = (1, 2, 4)  # vectors per thread of the register-resident kernel
_ITEMSIZE = {"f32": 4, "f64": 8, "f16": 2, "bf16": 2}

_SKIP_LN_ENTRY = r"""
extern "C" __global__ void oxc_skip_ln_{k}(const {S}* x, const {S}* skip, const {S}* gamma,
    const {S}* beta, const {S}* bias, {S}* y, {S}* sum_out, float* mean_out, float* rstd_out,
    long long cols, long long skip_rows, double eps) {{
  oxc_skip_ln<{Tr}>(x, skip, gamma, beta, bias, y, sum_out, mean_out, rstd_out, cols, skip_rows, eps);
}}
"""
SKIP_LN_MODULE_SRC = (
    F.ROWS_SRC
    + _SKIP_LN_SRC
    + _SKIP_LN_VEC_SRC
    + "".join(_SKIP_LN_ENTRY.format(k=k, Tr=tr, S=c) for k, (tr, c) in F.ROW_TYPES.items())
    + "".join(
        _SKIP_LN_VEC_ENTRY.format(k=k, Tr=tr, S=c, vec=16 // _ITEMSIZE[k], nv=nv)
        for k, (tr, c) in F.ROW_TYPES.items()
        for nv in _SKIP_LN_NV
    )
)
SKIP_LN_ROWS = F._RowModule(SKIP_LN_MODULE_SRC)
ship(SKIP_LN_ROWS.kernels)


def skip_ln_kernel(key: str, cols: int, operands: tuple) -> tuple[str, int]:
    """(function, threads per block) of the SkipLayerNormalization row kernel for storage type
    ``key``: the register-resident one where a row splits into 16-byte vectors and every
    operand (arrays or None) is 16-byte aligned, the block loop otherwise."""
    vec = 16 // _ITEMSIZE[key]
    if cols % vec == 0 and all(a is None or int(a.data.ptr) % 16 == 0 for a in operands):
        nvec = cols // vec
        for nv in _SKIP_LN_NV:
            threads = -(-nvec // nv)
            if threads <= 512 or (nv == _SKIP_LN_NV[-1] and threads <= 1024):
                return f"oxc_skip_ln_v{nv}_{key}", -(-threads // 32) * 32
    return "oxc_skip_ln_" + key, F.block_size(cols)


def _skip_ln_np(x, skip, gamma, beta, bias, y, sum_out, mean_out, rstd_out, eps) -> None:
    """The row kernel's twin on dense (rows, cols) views and a (k, cols) skip repeating over the
    rows: the sum rounded to the tensor type, then ``_fused``'s row normalization twin."""
    rows, cols = y.shape
    s = F.widen(x) + np.tile(F.widen(skip), (rows // skip.shape[0], 1))
    if bias is not None:
        s += F.widen(bias)
    total = sum_out if sum_out is not None else np.empty_like(y)
    np.copyto(total, s, casting="unsafe")
    F.rownorm(np, total, y, rows, cols, eps, "", gamma, beta, mean_out, rstd_out, mode=1)()


def _dense(xp: Any, v: Any, shape: tuple[int, ...]) -> Any:
    if v.shape == shape:
        return v
    return xp.ascontiguousarray(xp.broadcast_to(v, shape))


class SkipLayerNormalization(_Typed):
    """SkipLayerNormalization-1 (com.microsoft); ``mean``/``inv_std_var`` are float32 with the
    input's shape and a last dim of 1."""

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.eps = float(info.attr("epsilon", 1e-12))  # onnxruntime's default
        self._plans: dict[tuple, tuple] = {}

    def warm_up(self) -> None:
        gamma = self.info.input_shape(2)  # (cols,)
        if self.dtype is not None and self.dtype in GELU_TYPES and gamma and gamma[0]:
            if isinstance(gamma[0], int):  # planned memory: 16-byte aligned operands
                name, _ = skip_ln_kernel(F.storage_key(self.dtype), gamma[0], ())
                SKIP_LN_ROWS.precompile(self, name)

    def _plan(self, xs: tuple, ss: tuple, has_bias: bool) -> tuple:
        """(output shape, whether x and skip must be made dense, skip rows read in place)."""
        shape = shapes.broadcast_shapes(xs, ss)
        if not shape:
            raise ValueError("SkipLayerNormalization: the input is a scalar")
        cols = shape[-1]
        trimmed = ss
        while trimmed and trimmed[0] == 1 and len(trimmed) > 1:
            trimmed = trimmed[1:]
        in_place = xs == shape and shape[len(shape) - len(trimmed) :] == trimmed
        skip_rows = shapes.size_of(trimmed) // cols if in_place and cols else 1
        plan = (shape, not in_place, max(skip_rows, 1))
        self._plans[(xs, ss, has_bias)] = plan
        return plan

    def compute(self, ctx: KernelContext) -> None:
        xp = self.xp
        x, skip, gamma, beta, bias = (self.arg(ctx, i) for i in range(5))
        dt = self.dtype_of(ctx)
        key = (x.shape, skip.shape, bias is not None)
        shape, make_dense, skip_rows = self._plans.get(key) or self._plan(*key)
        cols = shape[-1]
        for name, v in (("gamma", gamma), ("beta", beta), ("bias", bias)):
            if v is not None and v.shape != (cols,):
                raise ValueError(
                    f"SkipLayerNormalization: {name} has shape {v.shape}, not ({cols},)"
                )
        y = self.alloc(ctx, 0, shape, dt)
        stats = shape[:-1] + (1,)
        mean = self.alloc(ctx, 1, stats, F32) if ctx.has_output(1) else None
        rstd = self.alloc(ctx, 2, stats, F32) if ctx.has_output(2) else None
        total = self.alloc(ctx, 3, shape, dt) if ctx.has_output(3) else None
        if y.size == 0:
            return
        if make_dense:
            x, skip, skip_rows = _dense(xp, x, shape), _dense(xp, skip, shape), y.size // cols
        rows = y.size // cols
        if xp is np:
            _skip_ln_np(
                x.reshape(rows, cols), skip.reshape(skip_rows, cols), gamma, beta, bias,
                y.reshape(rows, cols), None if total is None else total.reshape(rows, cols),
                None if mean is None else mean.reshape(rows),
                None if rstd is None else rstd.reshape(rows), self.eps,
            )  # fmt: skip
            return
        name, threads = skip_ln_kernel(
            F.storage_key(dt), cols, (x, skip, gamma, beta, bias, y, total)
        )
        fn = SKIP_LN_ROWS.function(xp, name)
        fn(
            (rows,),
            (threads,),
            (
                x, skip, gamma,
                _NULL if beta is None else beta, _NULL if bias is None else bias,
                y, _NULL if total is None else total,
                _NULL if mean is None else mean, _NULL if rstd is None else rstd,
                np.int64(cols), np.int64(skip_rows), np.float64(self.eps),
            ),
        )  # fmt: skip

    def prepare(self, ctx: KernelContext) -> Any:
        xp = self.xp
        x, skip, gamma, beta, bias = (self.arg(ctx, i) for i in range(5))
        dt = self.dtype_of(ctx)
        key = (x.shape, skip.shape, bias is not None)
        shape, make_dense, skip_rows = self._plans.get(key) or self._plan(*key)
        cols = shape[-1]
        if make_dense or any(v is not None and v.shape != (cols,) for v in (gamma, beta, bias)):
            return None  # a broadcast copy made now would be stale later; errors: compute
        y = self.alloc(ctx, 0, shape, dt)
        stats = shape[:-1] + (1,)
        mean = self.alloc(ctx, 1, stats, F32) if ctx.has_output(1) else None
        rstd = self.alloc(ctx, 2, stats, F32) if ctx.has_output(2) else None
        total = self.alloc(ctx, 3, shape, dt) if ctx.has_output(3) else None
        if y.size == 0:
            return bound_calls([])
        rows = y.size // cols
        if xp is np:
            args = (
                x.reshape(rows, cols), skip.reshape(skip_rows, cols), gamma, beta, bias,
                y.reshape(rows, cols), None if total is None else total.reshape(rows, cols),
                None if mean is None else mean.reshape(rows),
                None if rstd is None else rstd.reshape(rows), self.eps,
            )  # fmt: skip
            return lambda: _skip_ln_np(*args)
        name, threads = skip_ln_kernel(
            F.storage_key(dt), cols, (x, skip, gamma, beta, bias, y, total)
        )
        fn = SKIP_LN_ROWS.function(xp, name)
        return function_launch(
            fn,
            (rows,),
            (threads,),
            (
                x, skip, gamma, beta, bias, y, total, mean, rstd,
                np.int64(cols), np.int64(skip_rows), np.float64(self.eps),
            ),
            self.stream_handle(ctx),
        )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# BiasSoftmax: the sum in the compute type, then ``_fused``'s softmax row kernel


def _add_wide_np(x: np.ndarray, b: np.ndarray, s: np.ndarray) -> None:
    np.copyto(s, F.widen(x) + F.widen(b), casting="unsafe")


# s = x + b in the compute type (float32; float64 for float64), broadcast by the kernel
ADD_WIDE = F.Elementwise("T x, T b", "W s", "s = W(x) + W(b);", "oxc_add_wide", _add_wide_np)
ADD_WIDE_BF16 = F.Elementwise(
    "uint16 x, uint16 b",
    "float32 s",
    "s = ox_bf16_ld(x) + ox_bf16_ld(b);",
    "oxc_add_wide_bf16",
    _add_wide_np,
    F.BF16_PRE,
)


class BiasSoftmax(_Typed, CallListKernel):
    """Softmax of ``data + bias`` (broadcast) over all the dims from ``axis`` on, as the CPU
    provider computes it: the sum and the softmax in float32 (float64 for float64) and one
    rounding at the end. float32/float64 sum into the output and normalize it in place;
    float16/bfloat16 go through a float32 buffer and a conversion: three launches."""

    @classmethod
    def claims(cls, node: Any, graph: Any) -> bool:
        a, b = graph.input_dtypes(node)[:2]
        return a is None or b is None or a == b

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.axis = int(info.attr("axis", 1))

    def calls(self, ctx: KernelContext, stream: int | None) -> list[Any]:
        x, b = self.arg(ctx, 0), self.arg(ctx, 1)
        dt = self.dtype_of(ctx)
        shape = shapes.broadcast_shapes(x.shape, b.shape)
        rank = len(shape)
        if not -rank <= self.axis < rank:
            raise ValueError(
                f"BiasSoftmax node '{self.info.name}': axis {self.axis} is out of range for "
                f"rank {rank}"
            )
        axis = self.axis + rank if self.axis < 0 else self.axis
        y = self.alloc(ctx, 0, shape, dt)
        if y.size == 0:
            return []
        bf16 = self.is_bf16(ctx)
        wide = np.dtype(np.float64 if dt == np.float64 else np.float32)
        s = y if wide == dt else self.buffer(ctx, shape, wide, stream)
        outer, n = shapes.size_of(shape[:axis]), shapes.size_of(shape[axis:])
        calls = [
            self.elementwise(ADD_WIDE_BF16 if bf16 else ADD_WIDE, (x, b, s), stream),
            F.softmax_call(self.xp, s, s, outer, n, 1, F.storage_key(wide), False, stream),
        ]
        if s is not y:
            calls.append(self.elementwise(F.F32_TO_BF16 if bf16 else F.CAST, (s, y), stream))
        return calls


# ---------------------------------------------------------------------------------------------
# EmbedLayerNormalization: a gather-sum row kernel, then LayerNormalization's row kernel

_EMBED_SRC = r"""
// One block per token t = b * seq + j: s[t] = word[ids[t]] + pos[p] (+ seg[seg_ids[t]]) in W,
// p = pos_ids[t] (batched position ids), pos_ids[j], or j. A token with an index out of range
// gets a NaN row (the CPU provider raises for word and segment ids; nothing is read out of
// bounds here, and checking on the host would synchronise every run).
template <class Tr>
__device__ void oxc_embed_sum(const int* __restrict__ ids, const int* __restrict__ seg_ids,
                              const int* __restrict__ pos_ids, int pos_batched,
                              const typename Tr::S* __restrict__ word,
                              const typename Tr::S* __restrict__ pos,
                              const typename Tr::S* __restrict__ seg, typename Tr::W* __restrict__ s,
                              long long seq, long long hidden, long long vocab, long long npos,
                              long long nseg) {
  typedef typename Tr::W W;
  const long long t = blockIdx.x;
  const long long j = t % seq;
  const long long id = ids[t];
  const long long p = pos_ids ? (long long)pos_ids[pos_batched ? t : j] : j;
  const bool with_seg = seg != 0 && seg_ids != 0;
  const long long g = with_seg ? (long long)seg_ids[t] : 0;
  const bool bad = id < 0 || id >= vocab || p < 0 || p >= npos || g < 0 || (with_seg && g >= nseg);
  W* sr = s + t * hidden;
  for (long long c = threadIdx.x; c < hidden; c += blockDim.x) {
    if (bad) {
      sr[c] = W(nan(""));
      continue;
    }
    W v = Tr::ld(word[id * hidden + c]) + Tr::ld(pos[p * hidden + c]);
    if (with_seg) v += Tr::ld(seg[g * hidden + c]);
    sr[c] = v;
  }
}

// mask_index: each batch row's count of mask values (their sum), 0 without a mask
extern "C" __global__ void oxc_mask_count(const int* __restrict__ mask, int* __restrict__ out,
                                          long long seq) {
  __shared__ int sh[32];
  const long long b = blockIdx.x;
  int acc = 0;
  if (mask)
    for (long long c = threadIdx.x; c < seq; c += blockDim.x) acc += mask[b * seq + c];
  acc = ox_block_sum(acc, sh);
  if (threadIdx.x == 0) out[b] = acc;
}
"""

_EMBED_ENTRY = r"""
extern "C" __global__ void oxc_embed_sum_{k}(const int* ids, const int* seg_ids, const int* pos_ids,
    int pos_batched, const {S}* word, const {S}* pos, const {S}* seg, {W}* s, long long seq,
    long long hidden, long long vocab, long long npos, long long nseg) {{
  oxc_embed_sum<{Tr}>(ids, seg_ids, pos_ids, pos_batched, word, pos, seg, s, seq, hidden, vocab,
                      npos, nseg);
}}
"""
EMBED_ROWS = F.row_module(_EMBED_SRC, _EMBED_ENTRY)
ship(EMBED_ROWS.kernels)


def _embed_sum_np(ids, seg_ids, pos_ids, pos_batched, word, pos, seg, s, *sizes: Any) -> None:
    """The gather-sum kernel's twin (``sizes``: seq, hidden, vocab, npos, nseg as int64)."""
    seq, hidden, vocab, npos, nseg = (int(v) for v in sizes)
    tokens = ids.size
    j = np.arange(tokens) % seq
    idx = ids.reshape(-1).astype(np.int64)
    if pos_ids is None:
        p = j
    else:
        p = pos_ids.reshape(-1).astype(np.int64)[np.arange(tokens) if pos_batched else j]
    with_seg = seg is not None and seg_ids is not None
    g = seg_ids.reshape(-1).astype(np.int64) if with_seg else np.zeros(tokens, np.int64)
    bad = (idx < 0) | (idx >= vocab) | (p < 0) | (p >= npos) | (g < 0)
    if with_seg:
        bad |= g >= nseg
    ok = ~bad
    out = s.reshape(tokens, hidden)
    v = F.widen(word)[np.where(ok, idx, 0)] + F.widen(pos)[np.where(ok, p, 0)]
    if with_seg:
        v += F.widen(seg)[np.where(ok, g, 0)]
    v[bad] = np.nan
    np.copyto(out, v, casting="unsafe")


def _mask_count_np(mask: Any, out: np.ndarray, seq: Any) -> None:
    if mask is None:
        out[...] = 0
    else:
        np.sum(mask.astype(np.int32), axis=1, dtype=np.int32, out=out)


def _affine_np(s: np.ndarray, g: np.ndarray, b: np.ndarray, y: np.ndarray) -> None:
    z = s * F.widen(g)
    z += F.widen(b)
    np.copyto(y, z, casting="unsafe")


# y = s * gamma + beta from a float32 row-normalized buffer, rounded once to 16 bits (the two
# IEEE steps of the CPU provider, no contraction into an FMA)
AFFINE_16 = F.Elementwise(
    "float32 s, T g, T b",
    "T y",
    "y = T(__fadd_rn(__fmul_rn(s, float(g)), float(b)));",
    "oxc_affine16",
    _affine_np,
)
AFFINE_BF16 = F.Elementwise(
    "float32 s, uint16 g, uint16 b",
    "uint16 y",
    "y = ox_bf16_st(__fadd_rn(__fmul_rn(s, ox_bf16_ld(g)), ox_bf16_ld(b)));",
    "oxc_affine_bf16",
    _affine_np,
    F.BF16_PRE,
)


class EmbedLayerNormalization(CallListKernel):
    """com.microsoft EmbedLayerNormalization (int32 ids, segment ids, mask and position ids):
    inputs input_ids, segment_ids?, word_embedding, position_embedding, segment_embedding?,
    gamma, beta, mask?, position_ids?; outputs output, mask_index?, embedding_sum?.

    The sum in float32 (float64 for float64) like the CPU provider, then LayerNormalization
    over the hidden axis: float32/float64 sum into the output (or ``embedding_sum``) and
    normalize with gamma and beta; float16/bfloat16 sum into a float32 buffer, normalize it in
    place and apply gamma and beta while rounding once. ``mask_index`` is one more launch."""

    @classmethod
    def claims(cls, node: Any, graph: Any) -> bool:
        ins = node.inputs
        return len(ins) > 6 and bool(ins[6])  # beta given (the affine kernels take one)

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.eps = float(info.attr("epsilon", 1e-12))
        self.where = f"EmbedLayerNormalization node '{info.name}'"
        self._checked: set[tuple] = set()

    def _check(self, ids, seg_ids, word, pos, seg, gamma, beta, mask, pos_ids) -> None:
        key = tuple(None if v is None else v.shape for v in (ids, seg_ids, word, pos, seg))
        key += tuple(None if v is None else v.shape for v in (gamma, beta, mask, pos_ids))
        if key in self._checked:
            return
        if ids.ndim != 2:
            raise ValueError(
                f"{self.where}: input_ids must be [batch, sequence], got {list(ids.shape)}"
            )
        hidden = word.shape[-1] if word.ndim == 2 else -1
        tables = (("word_embedding", word), ("position_embedding", pos), ("segment_embedding", seg))
        for name, t in tables:
            if t is not None and (t.ndim != 2 or t.shape[1] != hidden):
                raise ValueError(
                    f"{self.where}: {name} must be [rows, {hidden}], got {list(t.shape)}"
                )
        for name, v in (("gamma", gamma), ("beta", beta)):
            if v.shape != (hidden,):
                raise ValueError(
                    f"{self.where}: {name} must have shape ({hidden},), got {list(v.shape)}"
                )
        for name, v in (("segment_ids", seg_ids), ("mask", mask)):
            if v is not None and v.shape != ids.shape:
                raise ValueError(
                    f"{self.where}: {name} must have input_ids' shape {list(ids.shape)}"
                )
        batch, seq = ids.shape
        if pos_ids is not None and pos_ids.shape not in ((seq,), (1, seq), (batch, seq)):
            raise ValueError(
                f"{self.where}: position_ids must be [{seq}], [1, {seq}] or [{batch}, {seq}], got "
                f"{list(pos_ids.shape)}"
            )
        self._checked.add(key)

    def calls(self, ctx: KernelContext, stream: int | None) -> list[Any]:
        xp = self.xp
        ids, seg_ids, word, pos, seg, gamma, beta, mask, pos_ids = (
            self.arg(ctx, i) for i in range(9)
        )
        self._check(ids, seg_ids, word, pos, seg, gamma, beta, mask, pos_ids)
        batch, seq = ids.shape
        hidden = word.shape[1]
        dt = self.info.input_dtype(2)
        if dt is None:
            dt = ctx.input(2).dtype
        y = self.alloc(ctx, 0, (batch, seq, hidden), dt)
        counts = self.alloc(ctx, 1, (batch,), np.int32) if ctx.has_output(1) else None
        total = self.alloc(ctx, 2, (batch, seq, hidden), dt) if ctx.has_output(2) else None
        calls: list[Any] = []
        if counts is not None and batch:
            calls.append(
                self.module_call(
                    EMBED_ROWS,
                    "oxc_mask_count",
                    (batch,),
                    (F.block_size(seq),),
                    (mask, counts, np.int64(seq)),
                    stream,
                    _mask_count_np,
                )
            )
        tokens = batch * seq
        if tokens == 0 or hidden == 0:
            return calls
        wide = np.dtype(np.float64 if dt == np.float64 else np.float32)
        if wide == dt:
            s = total if total is not None else y
        else:
            s = self.buffer(ctx, y.shape, wide, stream)
        key = F.storage_key(dt)
        pos_batched = pos_ids is not None and pos_ids.ndim == 2 and pos_ids.shape[0] != 1
        args = (
            ids, seg_ids, pos_ids, np.int32(pos_batched), word, pos, seg, s,
            np.int64(seq), np.int64(hidden), np.int64(word.shape[0]), np.int64(pos.shape[0]),
            np.int64(0 if seg is None else seg.shape[0]),
        )  # fmt: skip
        calls.append(
            self.module_call(
                EMBED_ROWS,
                "oxc_embed_sum_" + key,
                (tokens,),
                (F.block_size(hidden),),
                args,
                stream,
                _embed_sum_np,
            )
        )
        s2 = s.reshape(tokens, hidden)
        if wide == dt:
            y2 = y.reshape(tokens, hidden)
            calls.append(
                F.rownorm(
                    xp, s2, y2, tokens, hidden, self.eps, key, gamma, beta, mode=1, stream=stream
                )
            )
            return calls
        bf16 = dt.name == "bfloat16"
        if total is not None:
            back = F.F32_TO_BF16 if bf16 else F.CAST
            calls.append(self.elementwise(back, (s, total), stream))
        calls.append(F.rownorm(xp, s2, s2, tokens, hidden, self.eps, "f32", stream=stream))
        affine = AFFINE_BF16 if bf16 else AFFINE_16
        calls.append(self.elementwise(affine, (s, gamma, beta, y), stream))
        return calls


# ---------------------------------------------------------------------------------------------
# MatMulNBits: the blocks dequantized into a scratch weight, then one GEMM

_NBITS_SRC = r"""
// W[n, k] = (q - zp) * scale, one thread per element (grid-stride): q is value k of row n's
// bit stream (``bits`` bits per value, low bits first; a value may span two bytes), its block
// g_idx[k] (act-order) or k / block. Zero points: packed like q, one per block (zp_u8), in the
// scales' type (zp_f), or the middle of the range.
template <class Tr>
__device__ void oxc_nbits_dequant(const unsigned char* __restrict__ b,
                                  const typename Tr::S* __restrict__ scales,
                                  const unsigned char* __restrict__ zp_u8,
                                  const typename Tr::S* __restrict__ zp_f,
                                  const int* __restrict__ g_idx, typename Tr::S* __restrict__ w,
                                  long long n_rows, long long k_cols, long long blocks,
                                  long long block, int bits, long long zp_row_bytes) {
  typedef typename Tr::W W;
  const long long total = n_rows * k_cols;
  const long long row_bytes = blocks * block * bits / 8;
  const unsigned int mask = (1u << bits) - 1u;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += (long long)gridDim.x * blockDim.x) {
    const long long n = i / k_cols, k = i - n * k_cols;
    const long long bit = k * bits;
    const unsigned char* r = b + n * row_bytes + (bit >> 3);
    unsigned int v = r[0];
    if ((bit & 7) + bits > 8) v |= ((unsigned int)r[1]) << 8;
    const W q = W((v >> (bit & 7)) & mask);
    const long long blk = g_idx ? (long long)g_idx[k] : k / block;
    W zp;
    if (zp_u8) {
      const long long zbit = blk * bits;
      const unsigned char* zr = zp_u8 + n * zp_row_bytes + (zbit >> 3);
      unsigned int z = zr[0];
      if ((zbit & 7) + bits > 8) z |= ((unsigned int)zr[1]) << 8;
      zp = W((z >> (zbit & 7)) & mask);
    } else if (zp_f) {
      zp = Tr::ld(zp_f[n * blocks + blk]);
    } else {
      zp = W(1 << (bits - 1));
    }
    w[i] = Tr::st((q - zp) * Tr::ld(scales[n * blocks + blk]));
  }
}
"""

_NBITS_ENTRY = r"""
extern "C" __global__ void oxc_nbits_dequant_{k}(const unsigned char* b, const {S}* scales,
    const unsigned char* zp_u8, const {S}* zp_f, const int* g_idx, {S}* w, long long n_rows,
    long long k_cols, long long blocks, long long block, int bits, long long zp_row_bytes) {{
  oxc_nbits_dequant<{Tr}>(b, scales, zp_u8, zp_f, g_idx, w, n_rows, k_cols, blocks, block, bits,
                          zp_row_bytes);
}}
"""
NBITS_ROWS = F.row_module(_NBITS_SRC, _NBITS_ENTRY)
ship(NBITS_ROWS.kernels)


def _bits_at(data: np.ndarray, base: np.ndarray, bit: np.ndarray, bits: int) -> np.ndarray:
    """The ``bits``-bit values starting at bit ``bit`` of the bytes from ``base``: the kernel's
    arithmetic (a second byte read only when the value spans it)."""
    byte = base + (bit >> 3)
    v = data[byte].astype(np.uint32)
    spans = (bit & 7) + bits > 8
    v[spans] |= data[byte[spans] + 1].astype(np.uint32) << 8
    return (v >> (bit & 7).astype(np.uint32)) & np.uint32((1 << bits) - 1)


def _nbits_dequant_np(b, scales, zp_u8, zp_f, g_idx, w, n, k, blocks, block, bits, zrow) -> None:
    """The dequantization kernel's twin, element by element as the kernel indexes (the sizes as
    numpy integers)."""
    n, k, blocks, block, bits, zrow = (int(v) for v in (n, k, blocks, block, bits, zrow))
    rows, cols = np.divmod(np.arange(n * k, dtype=np.int64), k)
    q = _bits_at(b.reshape(-1), rows * (blocks * block * bits // 8), cols * bits, bits)
    blk = cols // block if g_idx is None else g_idx.reshape(-1).astype(np.int64)[cols]
    sc = F.widen(scales.reshape(-1))[rows * blocks + blk]
    if zp_u8 is not None:
        zp = _bits_at(zp_u8.reshape(-1), rows * zrow, blk * bits, bits).astype(sc.dtype)
    elif zp_f is not None:
        zp = F.widen(zp_f.reshape(-1))[rows * blocks + blk]
    else:
        zp = np.full(n * k, 1 << (bits - 1), sc.dtype)
    np.copyto(w.reshape(-1), (q.astype(sc.dtype) - zp) * sc, casting="unsafe")


class MatMulNBits(_Typed, CallListKernel):
    """com.microsoft MatMulNBits(A, B, scales, zero_points?, g_idx?, bias?) (``K``, ``N``,
    ``bits`` 2..8, ``block_size`` a power of 2 >= 16): W [N, K] dequantized into the frame's
    workspace (a temporary when not prepared) in A's type, then ``A @ W^T (+ bias)`` as one
    GEMM (the bias as its epilogue). The weight is dequantized on every run."""

    @classmethod
    def claims(cls, node: Any, graph: Any) -> bool:
        bits, block = int(node.attrs.get("bits", 4)), int(node.attrs.get("block_size", 0))
        # the CPU provider refuses other values with its error
        return 2 <= bits <= 8 and block >= 16 and not block & (block - 1)

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.k, self.n = int(info.attr("K")), int(info.attr("N"))
        self.bits, self.block = int(info.attr("bits", 4)), int(info.attr("block_size"))
        self.blocks = -(-self.k // self.block)
        self.where = f"MatMulNBits node '{info.name}'"
        self.gemm = blas.engine_for(self.ep)
        self.path = self.gemm.kind

    def warm_up(self) -> None:
        self.gemm.warm_up(self.dtype)

    def calls(self, ctx: KernelContext, stream: int | None) -> list[Any]:
        a, b, scales, zp, g_idx, bias = (self.arg(ctx, i) for i in range(6))
        n, k, blocks, bits = self.n, self.k, self.blocks, self.bits
        if a.ndim == 0 or a.shape[-1] != k:
            raise ValueError(f"{self.where}: A's last dim is {a.shape[-1:]}, K is {k}")
        row_bytes = blocks * self.block * bits // 8
        if b.size != n * row_bytes or scales.size != n * blocks:
            raise ValueError(
                f"{self.where}: B has {b.size} bytes and scales {scales.size} values; N={n}, "
                f"K={k}, bits={bits} and block_size={self.block} need {n * row_bytes} and "
                f"{n * blocks}"
            )
        packed_zp = zp is not None and np.dtype(zp.dtype) == np.uint8
        zrow = -(-blocks * bits // 8)
        if zp is not None and zp.size != (n * zrow if packed_zp else n * blocks):
            raise ValueError(f"{self.where}: zero_points has {zp.size} values")
        if bias is not None and bias.shape != (n,):
            raise ValueError(f"{self.where}: bias must have shape ({n},), got {list(bias.shape)}")
        dt = self.dtype_of(ctx)
        y = self.alloc(ctx, 0, (*a.shape[:-1], n), dt)
        if y.size == 0:
            return []
        w = self.buffer(ctx, (n, k), a.dtype, stream)  # a's storage (bfloat16: uint16)
        args = (
            b, scales, zp if packed_zp else None, None if packed_zp else zp, g_idx, w,
            np.int64(n), np.int64(k), np.int64(blocks), np.int64(self.block), np.int32(bits),
            np.int64(zrow),
        )  # fmt: skip
        grid = (min(-(-(n * k) // 256), 65535 * 8),)
        name = "oxc_nbits_dequant_" + F.storage_key(dt)
        calls = [self.module_call(NBITS_ROWS, name, grid, (256,), args, stream, _nbits_dequant_np)]
        rows = shapes.size_of(a.shape[:-1])
        a2, y2 = a.reshape(rows, k), y.reshape(rows, n)
        kw = dict(trans_b=True, bias=bias, dtype=dt)
        if stream is None:
            calls.append(lambda: self.gemm(ctx, a2, w, y2, **kw))
        else:
            calls.append(self.gemm.prepare(ctx, a2, w, y2, **kw))
        return calls


# ---------------------------------------------------------------------------------------------
# MatMulBias: one GEMM with an epilogue

# activation -> (cuBLASLt epilogue with the bias, whether the erf Gelu kernel follows)
_EPILOGUES: dict[str, tuple[str | None, bool]] = {
    "": (None, False),
    "Relu": ("RELU", False),
    "FastGelu": ("GELU", False),
    "Gelu": (None, True),
}


class MatMulBias(_Typed):
    """``act(A @ B [+ bias])`` (ai.onnxplug): A's leading dims are folded into the GEMM's rows;
    without a bias, the activation alone is the epilogue."""

    @classmethod
    def claims(cls, node: Any, graph: Any) -> bool:
        return node.attrs.get("activation", "") in _EPILOGUES

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.epilogue, self.then_gelu = _EPILOGUES[info.attr("activation", "")]
        self.gemm = blas.engine_for(self.ep)
        self.path = self.gemm.kind  # which engine runs the product (for tests)

    def warm_up(self) -> None:
        """The erf Gelu that follows the GEMM, over the output the graph's shapes fix, compiled
        in the background (BERT-base's first run compiled it after waiting for the attention
        kernel's compile); and cuBLASLt's set-up for the GEMM's type."""
        self.gemm.warm_up(self.dtype)
        a, w = self.info.input_shape(0), self.info.input_shape(1)
        if not self.then_gelu or self.bf16 or self.dtype is None or a is None or w is None:
            return
        if len(a) == 0 or len(w) != 2 or not all(type(d) is int for d in (*a, *w)):
            return
        y2 = ShapeOnly((shapes.size_of(a[:-1]), w[1]), self.dtype)  # type: ignore[arg-type]
        with dry_compiles(self):
            GELU.bind(self.xp, y2, None, y2, False, 0)

    def compute(self, ctx: KernelContext) -> None:
        a, w, bias = self.arg(ctx, 0), self.arg(ctx, 1), self.arg(ctx, 2)
        if a.ndim == 0 or w.ndim != 2 or a.shape[-1] != w.shape[0]:
            raise ValueError(f"MatMulBias: shapes {list(a.shape)} and {list(w.shape)} do not align")
        k, n = w.shape
        if bias is not None and bias.shape != (n,):
            raise ValueError(f"MatMulBias: bias {bias.shape} must have shape ({n},)")
        dt = self.dtype_of(ctx)
        y = self.alloc(ctx, 0, (*a.shape[:-1], n), dt)
        rows = shapes.size_of(a.shape[:-1])
        y2 = y.reshape(rows, n)
        self.gemm(ctx, a.reshape(rows, k), w, y2, bias=bias, epilogue=self.epilogue, dtype=dt)
        if self.then_gelu and y.size:
            GELU(self.xp, y2, None, y2, self.is_bf16(ctx))  # in place

    def prepare(self, ctx: KernelContext) -> Any:
        a, w, bias = self.arg(ctx, 0), self.arg(ctx, 1), self.arg(ctx, 2)
        if a.ndim == 0 or w.ndim != 2 or a.shape[-1] != w.shape[0]:
            return None  # compute raises the error
        if bias is not None and bias.shape != w.shape[1:]:
            return None
        k, n = w.shape
        dt = self.dtype_of(ctx)
        y = self.alloc(ctx, 0, (*a.shape[:-1], n), dt)
        rows = shapes.size_of(a.shape[:-1])
        y2 = y.reshape(rows, n)
        gemm = self.gemm.prepare(
            ctx, a.reshape(rows, k), w, y2, bias=bias, epilogue=self.epilogue, dtype=dt
        )
        if gemm is None or not self.then_gelu:
            return gemm
        gelu = GELU.bind(self.xp, y2, None, y2, self.is_bf16(ctx), self.stream_handle(ctx))
        return None if gelu is None else bound_calls([gemm, gelu])


def register(reg: KernelRegistry, enable_cudnn: bool) -> None:
    # The ops have no ONNX schemas: type constraints are given by input index.
    def by_index(types: tuple, count: int) -> dict[int, tuple]:
        return dict.fromkeys(range(count), types)

    reg.kernel("Gelu", domain=MS, since=1, types=by_index(GELU_TYPES, 1))(Gelu)
    reg.kernel("BiasGelu", domain=MS, since=1, types=by_index(GELU_TYPES, 2))(BiasGelu)
    reg.kernel("FastGelu", domain=MS, since=1, types=by_index(FAST_GELU_TYPES, 2))(FastGelu)
    reg.kernel("SkipLayerNormalization", domain=MS, since=1, types=by_index(GELU_TYPES, 5))(
        SkipLayerNormalization
    )
    reg.kernel("MatMulBias", domain=PLUG, since=1, types=by_index(GELU_TYPES, 3))(MatMulBias)
    reg.kernel("QuickGelu", domain=MS, since=1, types=by_index(GELU_TYPES, 1))(QuickGelu)
    reg.kernel("BiasSoftmax", domain=MS, since=1, types=by_index(GELU_TYPES, 2))(BiasSoftmax)
    i32 = dtypes("int32")
    embed_types = {0: i32, 1: i32, 7: i32, 8: i32, **{i: GELU_TYPES for i in range(2, 7)}}
    reg.kernel("EmbedLayerNormalization", domain=MS, since=1, types=embed_types)(
        EmbedLayerNormalization
    )
    u8 = dtypes("uint8")
    nbits_types = {0: GELU_TYPES, 1: u8, 2: GELU_TYPES, 3: u8 + GELU_TYPES, 4: i32, 5: GELU_TYPES}
    reg.kernel("MatMulNBits", domain=MS, since=1, types=nbits_types)(MatMulNBits)
