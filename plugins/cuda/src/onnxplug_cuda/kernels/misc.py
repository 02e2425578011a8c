"""Generators and small math ops on the CUDA device: Range, ConstantOfShape, EyeLike,
Trilu, Einsum and Shrink.

Range and ConstantOfShape take their parameters as host inputs and produce device tensors
(the output is filled on the device, nothing is uploaded). Einsum uses ``xp.einsum``;
bfloat16 operands are widened to float32 and the result rounded back to bfloat16 (round to
nearest even), as onnx.reference does. Shrink is one fused elementwise kernel.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from onnxplug.ep import KernelContext, KernelInfo, KernelRegistry, dtypes, np_dtype, shapes

from ._base import ALL_FIXED_BF16, BF16, FLOATS, FLOATS_BF16, SIGNED_INTS, CudaKernel
from .tensor import CPU, ints, storage_scalar

# ---------------------------------------------------------------------------------------------
# bfloat16 <-> float32 on uint16 bits (the same code on the GPU and under the simulation, where
# bfloat16 arrays are viewed as uint16 first)


def bf16_to_f32(xp: Any, a: Any) -> Any:
    """float32 values of bfloat16 data (an array of bfloat16 or of its uint16 bits)."""
    return xp.left_shift(a.view(np.uint16).astype(np.uint32), 16).view(np.float32)


def f32_to_bf16_bits(xp: Any, f: Any) -> Any:
    """uint16 bits of float32 values rounded to bfloat16, to nearest even; NaNs stay (quiet)
    NaNs."""
    u = f.view(np.uint32)
    high = xp.right_shift(u, 16)
    rounded = xp.right_shift(u + xp.add(xp.bitwise_and(high, 1), 0x7FFF), 16).astype(np.uint16)
    quiet_nan = xp.bitwise_or(high, 0x40).astype(np.uint16)
    return xp.where(f != f, quiet_nan, rounded)


# ---------------------------------------------------------------------------------------------


class Range(CudaKernel):
    """Range-11+: ``start + i * delta`` for i < max(ceil((limit - start) / delta), 0), like the
    CPU provider: integers exactly; floats as ``arange(n) * delta + start`` in the type
    itself, except that float16 computes in Range-27's ``stash_type`` (float32 by default)."""

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        stash = int(info.attr("stash_type", 1)) if info.since_version >= 27 else 0
        stashes: dict[int, np.dtype] = {1: np.dtype(np.float32), 11: np.dtype(np.float64)}
        self.stash = stashes.get(stash)

    def compute(self, ctx: KernelContext) -> None:
        start, limit, delta = [np.asarray(ctx.input(i)).reshape(()) for i in range(3)]
        dtype = start.dtype
        xp = self.xp
        if dtype.kind in "iu":
            s, d = int(start), int(delta)
            n = shapes.range_length(s, int(limit), d)
            if n == 0:
                self.alloc(ctx, 0, (0,), dtype)
                return
            self.put(ctx, 0, xp.arange(s, s + n * d, d, dtype=dtype))
            return
        n = shapes.range_length(float(start), float(limit), float(delta))
        calc = self.stash if self.stash is not None and dtype.itemsize < 4 else dtype
        if n == 0:
            self.alloc(ctx, 0, (0,), dtype)
            return
        steps = xp.arange(n, dtype=calc)
        # numpy scalars (CuPy takes no numpy arrays as operands, not even 0-d ones)
        steps *= calc.type(delta)
        steps += calc.type(start)
        self.put(ctx, 0, steps.astype(dtype, copy=False))


class ConstantOfShape(CudaKernel):
    """ConstantOfShape: the host shape's tensor filled on the device with the ``value``
    attribute (float32 0 by default)."""

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        value = info.attr("value")
        self.value = np.zeros(1, np.float32) if value is None else np.asarray(value).reshape(-1)
        self.dtype = self.value.dtype

    def compute(self, ctx: KernelContext) -> None:
        y = self.alloc(ctx, 0, ints(ctx.input(0)), self.dtype)
        if y.size:
            y.fill(storage_scalar(self.value[0], self.dtype, y.dtype))


class EyeLike(CudaKernel):
    """EyeLike: ones on the k-th diagonal of a 2-D tensor shaped like the input (read for
    its shape only), zeros elsewhere; ``dtype`` attribute or the input's type."""

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        dt = info.attr("dtype")
        self.dtype = np_dtype(int(dt)) if dt is not None else info.input_dtype(0)
        self.k = int(info.attr("k", 0))

    @classmethod
    def claims(cls, node: Any, graph: Any) -> bool:
        dt = node.attrs.get("dtype")
        if dt is None:
            return True
        try:
            return np_dtype(int(dt)) in ALL_FIXED_BF16
        except ValueError:
            return False

    def compute(self, ctx: KernelContext) -> None:
        shape = tuple(ctx.input(0).shape)
        if len(shape) == 1:
            shape = (shape[0], shape[0])
        if len(shape) != 2:
            raise ValueError(f"EyeLike: expected a 2-D input, got shape {list(shape)}")
        rows, cols = shape
        dtype = self.dtype if self.dtype is not None else np.dtype(ctx.input(0).dtype)
        y = self.alloc(ctx, 0, shape, dtype)
        if not y.size:
            return
        y.fill(storage_scalar(0, dtype, y.dtype))
        k = self.k
        first = max(0, -k)
        count = min(rows, cols - k) - first
        if count > 0:
            start = first * (cols + 1) + k
            stop = start + (count - 1) * (cols + 1) + 1
            y.reshape(-1)[start : stop : cols + 1].fill(storage_scalar(1, dtype, y.dtype))


class Trilu(CudaKernel):
    """Trilu-14: the upper (or lower) triangle of the last two dims from diagonal k (a host
    input, 0 when absent); the rest zero."""

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.upper = bool(info.attr("upper", 1))

    def compute(self, ctx: KernelContext) -> None:
        t = ctx.input(0)
        kt = ctx.input(1)
        k = 0 if kt is None or kt.size == 0 else int(np.asarray(kt).reshape(-1)[0])
        # beyond the matrix every k keeps (or drops) everything: clamp, the triangle helpers
        # take k as a 32-bit int
        rows, cols = t.shape[-2:]
        k = min(max(k, -rows - 1), cols + 1)
        x = self.arg(ctx, 0)
        r = self.xp.triu(x, k) if self.upper else self.xp.tril(x, k)
        self.put(ctx, 0, r, dtype=t.dtype)


class Einsum(CudaKernel):
    """Einsum with ``xp.einsum`` (any equation numpy accepts). bfloat16 computes in float32
    and rounds back; the result is always a fresh array (einsum may return a view of an
    operand, which must not become the output's memory)."""

    graph_capturable = False  # CuPy's einsum may call cuBLAS, which refuses stream capture

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.equation = str(info.attr("equation")).replace(" ", "")

    def compute(self, ctx: KernelContext) -> None:
        xp = self.xp
        ts = [ctx.input(i) for i in range(ctx.input_count)]
        xs = [self.arg(ctx, i) for i in range(len(ts))]
        dtype = ts[0].dtype
        if dtype in BF16:
            r = xp.einsum(self.equation, *[bf16_to_f32(xp, x) for x in xs])
            r = f32_to_bf16_bits(xp, xp.asarray(r, dtype=np.float32))
        else:
            r = xp.asarray(xp.einsum(self.equation, *xs))
            if r.dtype != dtype:
                r = r.astype(dtype)
            elif r.base is not None or not r.flags.c_contiguous:
                r = r.copy()
        self.put(ctx, 0, r, dtype=dtype)


_SHRINK = r"""
const double v = static_cast<double>(x);
y = static_cast<T>(v < -lambd ? v + bias : (v > lambd ? v - bias : 0.0));
"""
_shrink_kernel: list[Any] = []


class Shrink(CudaKernel):
    """Shrink-9: ``x + bias`` below ``-lambd``, ``x - bias`` above ``lambd``, 0 between, in
    double precision and rounded to the type once (one kernel)."""

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.lambd = float(info.attr("lambd", 0.5))
        self.bias = float(info.attr("bias", 0.0))

    def compute(self, ctx: KernelContext) -> None:
        t = ctx.input(0)
        y = self.alloc(ctx, 0, t.shape, t.dtype)
        if not y.size:
            return
        x = self.arg(ctx, 0)
        if self.xp is np:
            v = x.astype(np.float64)
            r = np.where(v < -self.lambd, v + self.bias, np.where(v > self.lambd, v - self.bias, 0))
            y[...] = r.astype(t.dtype)
            return
        if not _shrink_kernel:
            _shrink_kernel.append(
                self.xp.ElementwiseKernel(
                    "T x, float64 lambd, float64 bias", "T y", _SHRINK, "onnxplug_shrink"
                )
            )
        _shrink_kernel[0](x, self.lambd, self.bias, y)


def register(reg: KernelRegistry, enable_cudnn: bool) -> None:
    range_types = dtypes("float32", "float64", "float16", "int16", "int32", "int64")
    reg.kernel("Range", since=11, types={"T": range_types}, input_memory={0: CPU, 1: CPU, 2: CPU})(
        Range
    )
    reg.kernel("ConstantOfShape", since=9, types={"T2": ALL_FIXED_BF16}, input_memory={0: CPU})(
        ConstantOfShape
    )
    reg.kernel(
        "EyeLike",
        since=9,
        types={"T1": ALL_FIXED_BF16, "T2": ALL_FIXED_BF16},
        shape_only_inputs=(0,),
    )(EyeLike)
    reg.kernel("Trilu", since=14, types={"T": ALL_FIXED_BF16}, input_memory={1: CPU})(Trilu)
    reg.kernel("Einsum", since=12, types={"T": FLOATS_BF16 + dtypes("int32", "int64")})(Einsum)
    reg.kernel("Shrink", since=9, types={"T": FLOATS + SIGNED_INTS})(Shrink)
