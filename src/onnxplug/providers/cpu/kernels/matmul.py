"""Matrix product CPU kernels: MatMul and Gemm, on numpy's (multithreaded BLAS) matmul.

float16/bfloat16 products accumulate in float32 (numpy has no BLAS for them, and summing
in half precision loses digits) and are rounded once.
"""

from __future__ import annotations

import numpy as np

from onnxplug.ep import Kernel, KernelContext, KernelInfo, KernelRegistry, shapes

from ._util import wide


def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if a.dtype.kind in "iu" or a.dtype.itemsize >= 4:
        return np.matmul(a, b)
    return np.matmul(wide(a), wide(b)).astype(a.dtype)


class MatMul(Kernel):
    def compute(self, ctx: KernelContext) -> None:
        ctx.set_output(0, np.asarray(matmul(ctx.input(0), ctx.input(1))))


class Gemm(Kernel):
    """Gemm-7+: ``alpha * A' @ B' + beta * C`` with C broadcast to (M, N)."""

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.alpha = float(info.attr("alpha", 1.0))
        self.beta = float(info.attr("beta", 1.0))
        self.trans_a = bool(info.attr("transA", 0))
        self.trans_b = bool(info.attr("transB", 0))

    def compute(self, ctx: KernelContext) -> None:
        a, b, c = ctx.input(0), ctx.input(1), ctx.input(2)
        a = a.T if self.trans_a else a
        b = b.T if self.trans_b else b
        if a.dtype.kind in "iu":
            y = np.matmul(a, b)
            if self.alpha != 1:
                y = (y * self.alpha).astype(a.dtype)
            if c is not None and self.beta != 0:
                y = y + (c if self.beta == 1 else (c * self.beta).astype(a.dtype))
            ctx.set_output(0, y)
            return
        y = np.matmul(wide(a), wide(b))  # a new array: scaled and biased in place
        if self.alpha != 1:
            y *= self.alpha
        if c is not None and self.beta != 0:
            if not shapes.unidirectional_broadcastable(c.shape, y.shape):
                raise ValueError(f"Gemm: C {c.shape} does not broadcast to {y.shape}")
            y += c if self.beta == 1 else c * self.beta
        ctx.set_output(0, y.astype(a.dtype, copy=False))


def register(registry: KernelRegistry) -> None:
    registry.kernel("MatMul", since=1)(MatMul)
    registry.kernel("Gemm", since=7)(Gemm)
