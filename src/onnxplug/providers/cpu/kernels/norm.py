"""Normalization CPU kernels: BatchNormalization, InstanceNormalization, LayerNormalization
and LRN.

Statistics are computed in at least float32; BatchNormalization in inference folds its four
vectors into one scale and one shift per channel, so the tensor is touched twice.
"""

from __future__ import annotations

import numpy as np

from onnxplug.ep import Kernel, KernelContext, KernelInfo, KernelRegistry, shapes

from ._util import wide


def per_channel(v: np.ndarray, ndim: int) -> np.ndarray:
    """A (C,) vector shaped to broadcast over (N, C, *spatial)."""
    return v.reshape((-1,) + (1,) * (ndim - 2))


class BatchNormalization(Kernel):
    """BatchNormalization-9+ (training_mode from 14: batch statistics, running stats out)."""

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.eps = float(info.attr("epsilon", 1e-5))
        self.momentum = float(info.attr("momentum", 0.9))
        self.training = bool(info.attr("training_mode", 0))

    def compute(self, ctx: KernelContext) -> None:
        x, scale, bias, mean, var = (ctx.input(i) for i in range(5))
        xw = wide(x)
        if self.training:
            axes = (0, *range(2, x.ndim))
            batch_mean, batch_var = xw.mean(axis=axes), xw.var(axis=axes)
            m = self.momentum
            if ctx.has_output(1):
                ctx.set_output(1, (wide(mean) * m + batch_mean * (1 - m)).astype(mean.dtype))
            if ctx.has_output(2):
                ctx.set_output(2, (wide(var) * m + batch_var * (1 - m)).astype(var.dtype))
            mean, var = batch_mean, batch_var
        a = wide(scale) / np.sqrt(wide(var) + self.eps)
        shift = wide(bias) - wide(mean) * a
        y = xw * per_channel(a.astype(xw.dtype, copy=False), x.ndim)
        y += per_channel(shift.astype(xw.dtype, copy=False), x.ndim)
        ctx.set_output(0, y.astype(x.dtype, copy=False))


class InstanceNormalization(Kernel):
    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.eps = float(info.attr("epsilon", 1e-5))

    def compute(self, ctx: KernelContext) -> None:
        x, scale, bias = ctx.input(0), ctx.input(1), ctx.input(2)
        xw = wide(x)
        axes = tuple(range(2, x.ndim))
        mean = xw.mean(axis=axes, keepdims=True)
        y = xw - mean
        inv = 1 / np.sqrt(np.mean(np.square(y), axis=axes, keepdims=True) + self.eps)
        y *= inv * per_channel(wide(scale), x.ndim)
        y += per_channel(wide(bias), x.ndim)
        ctx.set_output(0, y.astype(x.dtype, copy=False))


class LayerNormalization(Kernel):
    """LayerNormalization-17: normalize over dims [axis, rank); Mean and InvStdDev outputs
    keep the leading dims with ones after."""

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.axis = int(info.attr("axis", -1))
        self.eps = float(info.attr("epsilon", 1e-5))

    def compute(self, ctx: KernelContext) -> None:
        x, scale, bias = ctx.input(0), ctx.input(1), ctx.input(2)
        axis = shapes.normalize_axis(self.axis, x.ndim)
        axes = tuple(range(axis, x.ndim))
        xw = wide(x)
        mean = xw.mean(axis=axes, keepdims=True)
        y = xw - mean
        inv = 1 / np.sqrt(np.mean(np.square(y), axis=axes, keepdims=True) + self.eps)
        y *= inv
        y *= scale
        if bias is not None:
            y += bias
        ctx.set_output(0, y.astype(x.dtype, copy=False))
        for i, v in ((1, mean), (2, inv)):
            if ctx.has_output(i):
                ctx.set_output(i, v.astype(self.info.output_dtype(i) or x.dtype, copy=False))


class LRN(Kernel):
    """Local response normalization across channels:
    ``y = x / (bias + alpha / size * sum of x^2 over the channel window) ** beta``."""

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.alpha = float(info.attr("alpha", 1e-4))
        self.beta = float(info.attr("beta", 0.75))
        self.bias = float(info.attr("bias", 1.0))
        self.size = int(info.attr("size"))

    def compute(self, ctx: KernelContext) -> None:
        x = ctx.input(0)
        xw = wide(x)
        sq = np.square(xw)
        C = x.shape[1]
        before, after = (self.size - 1) // 2, self.size // 2  # window [c - before, c + after]
        ss = sq.copy()
        for off in range(1, max(before, after) + 1):
            if off <= before and off < C:  # channel c - off
                ss[:, off:] += sq[:, : C - off]
            if off <= after and off < C:  # channel c + off
                ss[:, : C - off] += sq[:, off:]
        ss *= self.alpha / self.size
        ss += self.bias
        y = xw / np.power(ss, self.beta, out=ss)
        ctx.set_output(0, y.astype(x.dtype, copy=False))


def register(registry: KernelRegistry) -> None:
    registry.kernel("BatchNormalization", since=9)(BatchNormalization)
    registry.kernel("InstanceNormalization", since=6)(InstanceNormalization)
    registry.kernel("LayerNormalization", since=17)(LayerNormalization)
    registry.kernel("LRN", since=1)(LRN)
