"""Pooling CPU kernels: MaxPool (with Indices), AveragePool, GlobalAveragePool, GlobalMaxPool.

A pooling window has few taps: each tap is one vectorized max/add over a strided view of the
padded input covering every output position. The input is padded with the reduction's
identity (-inf, 0), and on the right also for ceil_mode's last partial window; AveragePool
then divides by a per-position count that is separable per dimension.
"""

from __future__ import annotations

import math

import numpy as np

from onnxplug.ep import Kernel, KernelContext, KernelInfo, KernelRegistry, shapes

from ._util import check_spatial_input, wide
from .conv import pad_spatial, tap_slices


class Pool(Kernel):
    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.kernel = list(info.attr("kernel_shape"))
        n = len(self.kernel)
        self.strides = list(info.attr("strides") or [1] * n)
        self.dilations = list(info.attr("dilations") or [1] * n)
        self.pads = info.attr("pads")
        self.auto_pad = info.attr("auto_pad", "NOTSET")
        self.ceil_mode = bool(info.attr("ceil_mode", 0))

    def geometry(self, x: np.ndarray) -> tuple[list[int], list[int], list[int]]:
        """Output spatial shape, pads, and pads extended at the end so every window fits."""
        check_spatial_input(x, f"{self.info.op_type} node '{self.info.name}'")
        out, pads = shapes.window_geometry(
            x.shape[2:],
            self.kernel,
            self.strides,
            self.dilations,
            self.pads,
            self.auto_pad,
            self.ceil_mode,
        )
        ext = shapes.window_fit_pads(
            x.shape[2:], out, self.kernel, self.strides, self.dilations, pads
        )
        return out, pads, ext

    def reduce(self, xp: np.ndarray, fn: np.ufunc, out: list[int]) -> np.ndarray:
        """``fn`` (maximum, add) over every window of the padded input, one spatial dim at a
        time: sum(k - 1) passes over shrinking arrays instead of prod(k) - 1 full ones."""
        y = xp
        for i, (k, s, d, o) in enumerate(zip(self.kernel, self.strides, self.dilations, out)):
            lead = (slice(None),) * (2 + i)
            taps = [y[(*lead, slice(t * d, t * d + (o - 1) * s + 1, s))] for t in range(k)]
            acc = taps[0].copy()  # never written into the input
            for v in taps[1:]:
                fn(acc, v, out=acc)
            y = acc
        return y


class MaxPool(Pool):
    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.storage_order = int(info.attr("storage_order", 0))

    def compute(self, ctx: KernelContext) -> None:
        x = ctx.input(0)
        out, pads, ext = self.geometry(x)
        low = np.iinfo(x.dtype).min if x.dtype.kind in "iu" else -np.inf
        xp = pad_spatial(x, ext, low)
        if not ctx.has_output(1):
            ctx.set_output(0, self.reduce(xp, np.maximum, out))
            return
        # with Indices: tap by tap, remembering which tap held the (first) maximum
        taps = list(tap_slices(self.kernel, self.strides, self.dilations, out))
        lead = (slice(None), slice(None))
        y = xp[lead + taps[0]].copy()
        best = np.zeros(y.shape, dtype=np.int64)
        for t, sl in enumerate(taps[1:], 1):
            v = xp[lead + sl]
            best[v > y] = t
            np.maximum(y, v, out=y)
        ctx.set_output(0, y)
        ctx.set_output(1, self.indices(x.shape, out, pads, best))

    def indices(self, shape, out, pads, best) -> np.ndarray:
        """Flat input index of each output's max (row-major, or column-major over the spatial
        dims with storage_order=1), counting N and C: [0, N*C*prod(spatial))."""
        sp = shape[2:]
        n = len(sp)
        taps = np.array(list(np.ndindex(*self.kernel)), dtype=np.int64)  # (T, n)
        flat = np.zeros(best.shape, dtype=np.int64)
        order = range(n) if self.storage_order == 0 else reversed(range(n))
        stride = 1
        for i in reversed(list(order)):
            o = np.arange(out[i]).reshape((-1,) + (1,) * (n - 1 - i))
            pos = o * self.strides[i] - pads[i] + taps[best, i] * self.dilations[i]
            flat += pos * stride
            stride *= sp[i]
        nc = np.arange(shape[0] * shape[1]).reshape(shape[0], shape[1], *([1] * n))
        return flat + nc * math.prod(sp)


class AveragePool(Pool):
    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.count_include_pad = bool(info.attr("count_include_pad", 0))

    def counts(self, x_shape, out, pads) -> np.ndarray:
        """How many taps of each output's window count (inside the input, or inside the
        explicitly padded input with count_include_pad), as a broadcastable array."""
        n = len(out)
        total = np.ones((1,) * n)
        for i in range(n):
            start = np.arange(out[i]) * self.strides[i] - pads[i]
            pos = start[:, None] + np.arange(self.kernel[i]) * self.dilations[i]
            lo, hi = (
                (-pads[i], x_shape[2 + i] + pads[n + i])
                if self.count_include_pad
                else (0, x_shape[2 + i])
            )
            c = ((pos >= lo) & (pos < hi)).sum(axis=1)
            total = total * c.reshape([-1 if j == i else 1 for j in range(n)])
        return total

    def no_window(self, x: np.ndarray) -> list[int] | None:
        """The output shape when explicit pads leave no room for one window: onnxruntime then
        returns an empty output (an output dim of 0) where the geometry would refuse it."""
        if self.auto_pad not in ("NOTSET", "VALID"):
            return None  # SAME_* pads always leave room
        n = len(self.kernel)
        pads = list(self.pads) if self.pads and self.auto_pad == "NOTSET" else [0] * (2 * n)
        out = []
        for i in range(n):
            span = (
                x.shape[2 + i]
                + pads[i]
                + pads[n + i]
                - ((self.kernel[i] - 1) * self.dilations[i] + 1)
            )
            out.append(span // self.strides[i] + 1 if span >= 0 else 0)
        return [*x.shape[:2], *out] if 0 in out else None

    def compute(self, ctx: KernelContext) -> None:
        x = ctx.input(0)
        check_spatial_input(x, f"AveragePool node '{self.info.name}'")
        empty = self.no_window(x)
        if empty is not None:
            ctx.set_output(0, np.zeros(empty, dtype=x.dtype))
            return
        out, pads, ext = self.geometry(x)
        y = self.reduce(pad_spatial(wide(x), ext, 0), np.add, out)
        y /= self.counts(x.shape, out, pads).astype(y.dtype)
        ctx.set_output(0, y.astype(x.dtype, copy=False))


class GlobalAveragePool(Kernel):
    def compute(self, ctx: KernelContext) -> None:
        x = ctx.input(0)
        check_spatial_input(x, f"GlobalAveragePool node '{self.info.name}'")
        axes = tuple(range(2, x.ndim))
        ctx.set_output(0, np.mean(wide(x), axis=axes, keepdims=True).astype(x.dtype, copy=False))


class GlobalMaxPool(Kernel):
    def compute(self, ctx: KernelContext) -> None:
        x = ctx.input(0)
        check_spatial_input(x, f"GlobalMaxPool node '{self.info.name}'")
        ctx.set_output(0, np.max(x, axis=tuple(range(2, x.ndim)), keepdims=True))


class GlobalLpPool(Kernel):
    """GlobalLpPool: (sum over the spatial dims of |x|^p)^(1/p), spatial dims kept as 1."""

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.p = float(info.attr("p", 2))

    def compute(self, ctx: KernelContext) -> None:
        x = ctx.input(0)
        check_spatial_input(x, f"GlobalLpPool node '{self.info.name}'")
        axes = tuple(range(2, x.ndim))
        w = wide(x)
        y = np.power(np.sum(np.power(np.abs(w), self.p), axis=axes, keepdims=True), 1.0 / self.p)
        ctx.set_output(0, y.astype(x.dtype, copy=False))


class MaxRoiPool(Kernel):
    """MaxRoiPool (Fast R-CNN's ROI pooling): each ROI ``[batch, x1, y1, x2, y2]`` scaled by
    ``spatial_scale`` and rounded, split into ``pooled_shape`` bins whose maxima are taken
    (an empty bin gives 0), as onnxruntime computes it."""

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.ph, self.pw = (int(v) for v in info.attr("pooled_shape"))
        self.scale = float(info.attr("spatial_scale", 1.0))

    def compute(self, ctx: KernelContext) -> None:
        x, rois = ctx.input(0), ctx.input(1)
        n_rois, (_, c, h, w) = rois.shape[0], x.shape
        y = np.zeros((n_rois, c, self.ph, self.pw), dtype=x.dtype)
        for r in range(n_rois):
            b = int(rois[r, 0])
            # C's roundf (half away from zero), not Python's round (half to even)
            x1, y1, x2, y2 = (
                int(math.copysign(math.floor(abs(float(v) * self.scale) + 0.5), v))
                for v in rois[r, 1:5]
            )
            bin_h = max(y2 - y1 + 1, 1) / self.ph
            bin_w = max(x2 - x1 + 1, 1) / self.pw
            for i in range(self.ph):
                hs = min(max(int(math.floor(i * bin_h)) + y1, 0), h)
                he = min(max(int(math.ceil((i + 1) * bin_h)) + y1, 0), h)
                for j in range(self.pw):
                    ws = min(max(int(math.floor(j * bin_w)) + x1, 0), w)
                    we = min(max(int(math.ceil((j + 1) * bin_w)) + x1, 0), w)
                    if he > hs and we > ws:
                        y[r, :, i, j] = x[b, :, hs:he, ws:we].max(axis=(1, 2))
        ctx.set_output(0, y)


def register(registry: KernelRegistry) -> None:
    registry.kernel("GlobalLpPool", since=1)(GlobalLpPool)
    registry.kernel("MaxRoiPool", since=1)(MaxRoiPool)
    registry.kernel("MaxPool", since=1)(MaxPool)
    registry.kernel("AveragePool", since=1)(AveragePool)
    registry.kernel("GlobalAveragePool", since=1)(GlobalAveragePool)
    registry.kernel("GlobalMaxPool", since=1)(GlobalMaxPool)
