"""Convolution CPU kernels: Conv (1-D/2-D/3-D, groups, dilations, auto_pad) and ConvTranspose.

Conv is a GEMM per group on BLAS: a 1x1 convolution multiplies the weights with the input
as it lies; a general one first gathers the windows (im2col) through a strided view of the
padded input, one copy. Depthwise convolutions (one input channel per group) are a batch of
tiny GEMMs, one per channel. ConvTranspose is the adjoint: a GEMM to columns, then each tap's columns are added
into the (strided) output positions they came from (col2im).
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from onnxplug.ep import InvalidArgument, Kernel, KernelContext, KernelInfo, KernelRegistry, shapes

from ._util import check_spatial_input, wide


def pad_spatial(x: np.ndarray, pads: list[int], value: float = 0) -> np.ndarray:
    """``x`` (N, C, *spatial) with ONNX pads [begins..., ends...] added around the spatial dims."""
    n = x.ndim - 2
    if not any(pads):
        return x
    out = np.full(
        x.shape[:2] + tuple(d + pads[i] + pads[n + i] for i, d in enumerate(x.shape[2:])),
        value,
        dtype=x.dtype,
    )
    out[
        (
            slice(None),
            slice(None),
            *(slice(pads[i], pads[i] + d) for i, d in enumerate(x.shape[2:])),
        )
    ] = x
    return out


def tap_slices(kernel, strides, dilations, out_spatial):
    """For every kernel tap, the spatial slices of the padded input it reads for all outputs."""
    ranges = [range(k) for k in kernel]
    for tap in itertools.product(*ranges):
        yield tuple(
            slice(t * d, t * d + (o - 1) * s + 1, s)
            for t, d, s, o in zip(tap, dilations, strides, out_spatial)
        )


def windows(xp: np.ndarray, kernel, strides, dilations, out_spatial) -> np.ndarray:
    """A view (N, C, *kernel, *out) of the padded input: element [.., k, o] is the input that
    kernel tap k reads for output o."""
    n = len(kernel)
    st = xp.strides
    return np.lib.stride_tricks.as_strided(
        xp,
        shape=xp.shape[:2] + tuple(kernel) + tuple(out_spatial),
        strides=st[:2]
        + tuple(st[2 + i] * dilations[i] for i in range(n))
        + tuple(st[2 + i] * strides[i] for i in range(n)),
        writeable=False,
    )


class ConvBase(Kernel):
    """The attributes Conv and ConvTranspose share."""

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.group = int(info.attr("group", 1))
        self.auto_pad = info.attr("auto_pad", "NOTSET")
        self.kernel_shape = info.attr("kernel_shape")
        self.strides = info.attr("strides")
        self.dilations = info.attr("dilations")
        self.pads = info.attr("pads")

    def window(self, w: np.ndarray) -> tuple[list[int], list[int], list[int]]:
        """Kernel shape, strides and dilations with defaults (the kernel from the weights)."""
        n = w.ndim - 2
        kernel = list(self.kernel_shape or w.shape[2:])
        return kernel, list(self.strides or [1] * n), list(self.dilations or [1] * n)


class Conv(ConvBase):
    def compute(self, ctx: KernelContext) -> None:
        x = ctx.input(0)
        y = self.convolve(x, ctx.input(1), ctx.input(2))
        ctx.set_output(0, y.astype(x.dtype, copy=False))

    def convolve(self, x: np.ndarray, w: np.ndarray, b: np.ndarray | None) -> np.ndarray:
        """The convolution plus bias in the compute type (float32 for 16-bit floats), as a
        new array the caller may overwrite."""
        check_spatial_input(x, f"Conv node '{self.info.name}'", InvalidArgument)
        x, w = wide(x), wide(w)
        n_sp = x.ndim - 2
        kernel, strides, dilations = self.window(w)
        out_sp, pads = shapes.window_geometry(
            x.shape[2:], kernel, strides, dilations, self.pads, self.auto_pad
        )
        N, C = x.shape[:2]
        M, G = w.shape[0], self.group
        if C != w.shape[1] * G or M % G:
            raise ValueError(f"Conv: input {x.shape}, weights {w.shape} and group {G} disagree")
        if N == 0:  # an empty batch: an empty output (the GEMM paths cannot reshape it)
            return np.zeros((0, M, *out_sp), dtype=x.dtype)
        wg = w.reshape(G, M // G, -1)
        if w.shape[1] == 1 and M == G and G > 1:
            y = self.depthwise(pad_spatial(x, pads), w, kernel, strides, dilations, out_sp)
        elif all(k == 1 for k in kernel) and not any(pads):
            # 1x1: the input (strided if need be) is already the columns
            x = x[(slice(None), slice(None), *(slice(None, None, s) for s in strides))]
            y = np.matmul(wg, x.reshape(N, G, C // G, -1)).reshape(N, M, *out_sp)
        elif G == 1 and 2 * M <= C and all(s == 1 for s in strides):
            y = self.shifted_gemm(x, w, pads, kernel, dilations, out_sp)
        else:
            y = self.im2col_gemm(x, wg, pads, kernel, strides, dilations, out_sp)
        if b is not None:
            y += b.reshape((M,) + (1,) * n_sp)
        return y

    # bytes of columns gathered per GEMM: bounds the scratch and keeps big layers in cache
    COLUMN_BYTES = 1 << 23

    def im2col_gemm(self, x, wg, pads, kernel, strides, dilations, out_sp) -> np.ndarray:
        """Gather the windows of a block of output rows (first spatial dim) into columns and
        multiply, block by block, into the (N, G, M/G, P) output."""
        N = x.shape[0]
        G, Mg, K = wg.shape
        view = windows(pad_spatial(x, pads), kernel, strides, dilations, out_sp)
        view = view.reshape(N, G, -1, *view.shape[2:])  # (N, G, C/G, *kernel, *out)
        row = math.prod(out_sp[1:])  # outputs per step of the first spatial dim
        step = max(1, self.COLUMN_BYTES // (G * K * row * x.itemsize))
        y = np.empty((N, G, Mg, math.prod(out_sp)), dtype=x.dtype)
        lead = (slice(None),) * (2 + len(kernel))
        for n in range(N):
            for r in range(0, out_sp[0], step):
                r1 = min(out_sp[0], r + step)
                cols = view[n][(*lead, slice(r, r1))].reshape(G, K, -1)
                np.matmul(wg, cols, out=y[n, :, :, r * row : r1 * row])
        return y.reshape(N, G * Mg, *out_sp)

    @staticmethod
    def shifted_gemm(x, w, pads, kernel, dilations, out_sp) -> np.ndarray:
        """Stride-1 convolution with few output channels: no im2col. In a channels-last padded
        copy of the input, the inputs of kernel tap t for a run of outputs are one contiguous
        block of rows shifted by t's offset, so the output is a sum of one (L, C) @ (C, M)
        GEMM per tap. Inner spatial dims are computed at their padded extent and cropped."""
        N, C = x.shape[:2]
        M, n = w.shape[0], len(kernel)
        sp = [x.shape[2 + i] + pads[i] + pads[n + i] for i in range(n)]
        # one spare slice at the end of the first dim: the last taps' runs reach into it
        xp = np.zeros((N, sp[0] + 1, *sp[1:], C), dtype=x.dtype)
        inner = tuple(slice(pads[i], pads[i] + x.shape[2 + i]) for i in range(n))
        xp[(slice(None), *inner)] = np.moveaxis(x, 1, -1)
        flat = xp.reshape(N, -1, C)
        row = [math.prod(sp[i + 1 :]) for i in range(n)]  # flat stride of each spatial dim
        L = out_sp[0] * row[0]
        wt = np.moveaxis(w, (0, 1), (-1, -2)).reshape(-1, C, M)  # (taps, C, M)
        offsets = [
            sum(k * d * r for k, d, r in zip(tap, dilations, row))
            for tap in itertools.product(*(range(k) for k in kernel))
        ]
        y = np.matmul(flat[:, :L], wt[0])  # tap 0 has offset 0
        tmp = np.empty_like(y)
        for t, off in enumerate(offsets[1:], 1):
            np.matmul(flat[:, off : off + L], wt[t], out=tmp)
            y += tmp
        y = y.reshape(N, out_sp[0], *sp[1:], M)[
            (slice(None), slice(None), *(slice(o) for o in out_sp[1:]))
        ]
        return np.ascontiguousarray(np.moveaxis(y, -1, 1))

    @staticmethod
    def depthwise(xp, w, kernel, strides, dilations, out_sp) -> np.ndarray:
        """One input channel per output channel: a batch of (1, k) @ (k, P) products over the
        channels, one small BLAS call each (faster than a numpy pass per kernel tap)."""
        N, C = xp.shape[:2]
        cols = windows(xp, kernel, strides, dilations, out_sp).reshape(N, C, math.prod(kernel), -1)
        return np.matmul(w.reshape(C, 1, -1), cols).reshape(N, C, *out_sp)


class ConvTranspose(ConvBase):
    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.output_padding = info.attr("output_padding")
        self.output_shape = info.attr("output_shape")

    def compute(self, ctx: KernelContext) -> None:
        x, w, b = ctx.input(0), ctx.input(1), ctx.input(2)
        dtype = x.dtype
        x, w = wide(x), wide(w)
        n_sp = x.ndim - 2
        kernel, strides, dilations = self.window(w)
        out_sp, pads = shapes.conv_transpose_geometry(
            x.shape[2:],
            kernel,
            strides,
            dilations,
            self.pads,
            self.auto_pad,
            self.output_padding,
            self.output_shape,
        )
        N, C = x.shape[:2]
        G = self.group
        Mg = w.shape[1]
        in_sp = x.shape[2:]
        # columns[n, g, m, k, i] = sum_c w[g, c, m, k] * x[n, g, c, i]
        wg = w.reshape(G, C // G, Mg * math.prod(kernel)).transpose(0, 2, 1)
        cols = np.matmul(wg, x.reshape(N, G, C // G, -1))
        cols = cols.reshape(N, G * Mg, *kernel, *in_sp)
        # the full output before cropping, extended where output_shape asks for more
        full = [
            s * (i - 1) + (k - 1) * d + 1 for s, i, k, d in zip(strides, in_sp, kernel, dilations)
        ]
        lo = [min(0, pads[i]) for i in range(n_sp)]
        size = [max(full[i], pads[i] + out_sp[i]) - lo[i] for i in range(n_sp)]
        y = np.zeros((N, G * Mg, *size), dtype=x.dtype)
        for tap in itertools.product(*(range(k) for k in kernel)):
            dst = tuple(
                slice(t * d - l, t * d - l + (i - 1) * s + 1, s)
                for t, d, l, i, s in zip(tap, dilations, lo, in_sp, strides)
            )
            y[(slice(None), slice(None), *dst)] += cols[(slice(None), slice(None), *tap)]
        crop = tuple(slice(pads[i] - lo[i], pads[i] - lo[i] + out_sp[i]) for i in range(n_sp))
        y = y[(slice(None), slice(None), *crop)]
        if b is not None:
            y = y + b.reshape((-1,) + (1,) * n_sp)
        ctx.set_output(0, np.ascontiguousarray(y).astype(dtype, copy=False))


def register(registry: KernelRegistry) -> None:
    registry.kernel("Conv", since=1)(Conv)
    registry.kernel("ConvTranspose", since=1)(ConvTranspose)
