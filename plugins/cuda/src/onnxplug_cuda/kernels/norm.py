"""CUDA kernels of normalizations: BatchNormalization (inference), LayerNormalization,
InstanceNormalization, GroupNormalization, LpNormalization, MeanVarianceNormalization, LRN.

LayerNormalization, InstanceNormalization and GroupNormalization are one row kernel each
(``_fused.rownorm``: statistics of a contiguous row in one block, then the affine step);
BatchNormalization in inference is one broadcasting elementwise kernel; LRN one elementwise
kernel reading its channel window. Statistics are computed in float32 (float64 for float64);
bfloat16 is converted to float32 and rounded once at the end.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from onnxplug.ep import KernelContext, KernelInfo, KernelRegistry, shapes

from . import _fused as F
from ._base import BF16, FLOATS, dtypes
from .elementwise import TypedKernel, is_bf16

FLOATS_B = FLOATS + BF16
F32 = np.dtype(np.float32)


def _dense(xp: Any, v: Any, shape: tuple[int, ...]) -> Any:
    """``v`` broadcast to ``shape`` as a dense array (no copy when it already has it)."""
    if v.shape == shape:
        return v
    return xp.ascontiguousarray(xp.broadcast_to(v, shape))


class BatchNormalization(TypedKernel):
    """BatchNormalization-9+ in inference: ``y = (x - mean) * scale / sqrt(var + eps) + bias``
    per channel (axis 1). Training (``training_mode=1``, or the optional statistics outputs
    before opset 14) is left to the CPU provider."""

    @classmethod
    def claims(cls, node: Any, graph: Any) -> bool:
        if int(node.attrs.get("training_mode", 0)):
            return False
        return sum(1 for o in node.outputs if o) <= 1

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.eps = np.float64(float(info.attr("epsilon", 1e-5)))
        self.bf16_in = [is_bf16(info.input_dtype(i)) for i in range(5)]

    def compute(self, ctx: KernelContext) -> None:
        xp = self.xp
        ins = [self.arg(ctx, i) for i in range(5)]
        x = ins[0]
        y = self.like(ctx, x)
        if x.size == 0:
            return
        ins = [F.to_f32(xp, a) if b else a for a, b in zip(ins, self.bf16_in)]
        per_channel = (-1,) + (1,) * (x.ndim - 2) if x.ndim > 2 else (-1,)
        s, b, m, v = (a.reshape(per_channel) for a in ins[1:])
        if self.bf16:
            t = xp.empty(x.shape, F32)
            F.BATCHNORM(xp, ins[0], s, b, m, v, self.eps, t)
            F.from_f32(xp, t, y)
        else:
            F.BATCHNORM(xp, x, s, b, m, v, self.eps, y)


class LayerNormalization(TypedKernel):
    """LayerNormalization-17: normalize over dims [axis, rank) in one row kernel; Mean and
    InvStdDev (float32) keep the leading dims with ones after."""

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.axis = int(info.attr("axis", -1))
        self.eps = float(info.attr("epsilon", 1e-5))
        self.key = F.storage_key(self.in_dtype) if self.in_dtype is not None else None
        self.stats_dtype = [info.output_dtype(i) or F32 for i in (1, 2)]
        self._geometry: tuple[Any, Any] = (None, None)

    def geometry(self, shape: tuple[int, ...]) -> tuple[int, int, tuple[int, ...], Any]:
        """(rows, cols, normalized shape, statistics shape) of an input shape (cached)."""
        cached = self._geometry
        if cached[0] == shape:
            return cached[1]
        axis = shapes.normalize_axis(self.axis, len(shape))
        geo = (
            shapes.size_of(shape[:axis]),
            shapes.size_of(shape[axis:]),
            shape[axis:],
            shape[:axis] + (1,) * (len(shape) - axis),
        )
        self._geometry = (shape, geo)
        return geo

    def compute(self, ctx: KernelContext) -> None:
        xp = self.xp
        x, scale, bias = self.arg(ctx, 0), self.arg(ctx, 1), self.arg(ctx, 2)
        rows, cols, norm_shape, stats_shape = self.geometry(x.shape)
        y = self.like(ctx, x)
        mean = self.alloc(ctx, 1, stats_shape, self.stats_dtype[0]) if ctx.has_output(1) else None
        rstd = self.alloc(ctx, 2, stats_shape, self.stats_dtype[1]) if ctx.has_output(2) else None
        if rows == 0:
            return
        if cols == 0:  # nothing to normalize: the statistics of an empty row
            for s in (mean, rstd):
                if s is not None:
                    s.fill(np.nan)
            return
        scale = _dense(xp, scale, norm_shape)
        if bias is not None:
            bias = _dense(xp, bias, norm_shape)
        F.rownorm(
            xp, x, y, rows, cols, self.eps, self.key or F.storage_key(x.dtype),
            scale, bias, mean, rstd, mode=1,
        )()  # fmt: skip

    def prepare(self, ctx: KernelContext) -> Any:
        x, scale, bias = self.arg(ctx, 0), self.arg(ctx, 1), self.arg(ctx, 2)
        rows, cols, norm_shape, stats_shape = self.geometry(x.shape)
        if (
            cols == 0
            or scale.shape != norm_shape
            or (bias is not None and bias.shape != norm_shape)
        ):
            return None  # broadcast scale/bias: copies made now would go stale
        y = self.like(ctx, x)
        mean = self.alloc(ctx, 1, stats_shape, self.stats_dtype[0]) if ctx.has_output(1) else None
        rstd = self.alloc(ctx, 2, stats_shape, self.stats_dtype[1]) if ctx.has_output(2) else None
        return F.rownorm(
            self.xp, x, y, rows, cols, self.eps, self.key or F.storage_key(x.dtype),
            scale, bias, mean, rstd, mode=1, stream=self.stream_handle(ctx),
        )  # fmt: skip


class GroupNormalization(TypedKernel):
    """GroupNormalization-21: groups of C/G channels normalized together, then scale and bias
    per channel.

    ``stash_type`` float32 (the default) makes the first stage (the normalization) float32:
    float16/bfloat16/float32 compute in float32 anyway; float64 is normalized in float32 and
    scaled in float64, as the op's function body does.
    """

    stashed = True  # has a stash_type attribute

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.eps = float(info.attr("epsilon", 1e-5))
        self.groups = int(info.attr("num_groups", 0))
        self.stash_f32 = (
            self.stashed
            and self.in_dtype == np.float64
            and int(info.attr("stash_type", 1)) == 1  # TensorProto.FLOAT
        )

    def num_groups(self, channels: int) -> int:
        return self.groups

    def compute(self, ctx: KernelContext) -> None:
        xp = self.xp
        x, scale, bias = self.arg(ctx, 0), self.arg(ctx, 1), self.arg(ctx, 2)
        y = self.like(ctx, x)
        if x.ndim < 2:
            raise ValueError(f"{self.info.op_type}: input rank {x.ndim} is less than 2")
        C = x.shape[1]
        G = self.num_groups(C)
        if G <= 0 or C % G:
            raise ValueError(f"{self.info.op_type}: {C} channels cannot form {G} groups")
        spatial = shapes.size_of(x.shape[2:])
        rows, cols = x.shape[0] * G, (C // G) * spatial
        if rows == 0 or cols == 0:
            return
        if self.stash_f32:
            t = xp.empty(x.shape, F32)
            F.rownorm(xp, x.astype(F32), t, rows, cols, self.eps, "f32")()
            per_channel = (1, C) + (1,) * (x.ndim - 2)
            xp.multiply(t, scale.reshape(per_channel), out=y)
            xp.add(y, bias.reshape(per_channel), out=y)
            return
        # channel of (row, col) = (row % G) * (C // G) + col // spatial
        F.rownorm(
            xp, x, y, rows, cols, self.eps, F.storage_key(self.dtype_of(x)), scale, bias,
            mode=2, groups=G, cpg=C // G, inner=spatial,
        )()  # fmt: skip


class InstanceNormalization(GroupNormalization):
    """InstanceNormalization: each (n, c) plane normalized, then scale[c] and bias[c]: a group
    normalization with one channel per group (in float64 for float64)."""

    stashed = False

    def num_groups(self, channels: int) -> int:
        return channels


class WideKernel(TypedKernel):
    """A kernel computing with xp operations in float32 (float64 for float64)."""

    def wide(self, x: Any) -> Any:
        if self.bf16:
            return F.to_f32(self.xp, x)
        return x.astype(F32) if x.itemsize < 4 else x


class LpNormalization(WideKernel):
    """LpNormalization: x divided by its L1 (sum of |x|) or L2 norm along ``axis``; a zero
    norm gives 0 (onnx's reference)."""

    @classmethod
    def claims(cls, node: Any, graph: Any) -> bool:
        return int(node.attrs.get("p", 2)) in (1, 2)

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.axis = int(info.attr("axis", -1))
        self.p = int(info.attr("p", 2))

    def compute(self, ctx: KernelContext) -> None:
        xp = self.xp
        x = self.arg(ctx, 0)
        y = self.like(ctx, x)
        if x.size == 0:
            return
        axis = shapes.normalize_axis(self.axis, x.ndim)
        w = self.wide(x)
        if self.p == 1:
            n = xp.sum(xp.absolute(w), axis=axis, keepdims=True)
        else:
            n = xp.sqrt(xp.sum(xp.multiply(w, w), axis=axis, keepdims=True))
        zero = xp.equal(n, 0)
        safe = xp.where(zero, w.dtype.type(1), n)
        r = xp.where(zero, w.dtype.type(0), w / safe)
        _finish(xp, r, y, self.bf16)


class MeanVarianceNormalization(WideKernel):
    """MeanVarianceNormalization: ``(x - mean) / (sqrt(var) + 1e-9)`` over ``axes``
    (default [0, 2, 3]), with the variance taken as the mean of squared deviations."""

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.axes = [int(a) for a in info.attr("axes", [0, 2, 3])]

    def compute(self, ctx: KernelContext) -> None:
        xp = self.xp
        x = self.arg(ctx, 0)
        y = self.like(ctx, x)
        if x.size == 0:
            return
        axes = tuple(shapes.normalize_axes(self.axes, x.ndim))
        w = self.wide(x)
        d = w - xp.mean(w, axis=axes, keepdims=True)
        std = xp.sqrt(xp.mean(xp.multiply(d, d), axis=axes, keepdims=True))
        r = d / xp.add(std, w.dtype.type(1e-9))
        _finish(xp, r, y, self.bf16)


def _finish(xp: Any, r: Any, y: Any, bf16: bool) -> None:
    """Store a float32/float64 result ``r`` into ``y`` (rounding to bfloat16 if need be)."""
    if bf16:
        F.from_f32(xp, r.astype(F32, copy=False), y)
    elif r.dtype == y.dtype:
        xp.copyto(y, r)
    else:
        xp.copyto(y, r, casting="unsafe")


class LRN(TypedKernel):
    """Local response normalization across channels (axis 1):
    ``y = x / (bias + alpha / size * sum of x^2 over the channel window) ** beta``."""

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.size = int(info.attr("size"))
        self.alpha = np.float32(float(info.attr("alpha", 1e-4)) / self.size)
        self.beta = np.float32(float(info.attr("beta", 0.75)))
        self.bias = np.float32(float(info.attr("bias", 1.0)))
        # the window of channel c is [c - before, c + after]
        self.before, self.after = np.int64((self.size - 1) // 2), np.int64(self.size // 2)

    def compute(self, ctx: KernelContext) -> None:
        x = self.arg(ctx, 0)
        y = self.alloc(ctx, 0, x.shape, x.dtype)
        if x.size == 0:
            return
        if x.ndim < 2:
            raise ValueError(f"LRN: input rank {x.ndim} is less than 2")
        C, inner = x.shape[1], shapes.size_of(x.shape[2:])
        F.LRN(
            self.xp, x, np.int64(C), np.int64(inner), self.before, self.after,
            self.alpha, self.beta, self.bias, y,
        )  # fmt: skip


def register(reg: KernelRegistry, enable_cudnn: bool) -> None:
    reg.kernel(
        "BatchNormalization", since=9, types={"T": FLOATS_B, "T1": FLOATS_B, "T2": FLOATS_B}
    )(BatchNormalization)
    reg.kernel("LayerNormalization", since=17, types={"T": FLOATS_B, "U": dtypes("float32")})(
        LayerNormalization
    )
    reg.kernel("InstanceNormalization", since=6, types={"T": FLOATS_B})(InstanceNormalization)
    reg.kernel("GroupNormalization", since=21, types={"T": FLOATS_B})(GroupNormalization)
    reg.kernel("LpNormalization", since=1, types={"T": FLOATS_B})(LpNormalization)
    reg.kernel("MeanVarianceNormalization", since=9, types={"T": FLOATS_B})(
        MeanVarianceNormalization
    )
    reg.kernel("LRN", since=1, types={"T": FLOATS})(LRN)
