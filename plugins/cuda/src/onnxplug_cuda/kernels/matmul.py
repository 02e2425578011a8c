"""MatMul, Gemm, com.microsoft FusedMatMul and MatMulInteger on the provider's GEMM engine
(cuBLASLt; numpy in simulation).

MatMul follows numpy: 1-D operands are promoted (and the unit dim dropped from the result), batch
dims broadcast. Gemm is ``alpha * A' @ B' + beta * C``. A C of shape (N,) or (1, N) with
``beta == 1`` becomes cuBLASLt's bias epilogue. A full (M, N) C is the library's C. Any other
broadcast C is written into the output first (times beta), and the product accumulates onto it.
The engine API (``onnxplug_cuda.blas.engine_for(ep)``) also takes ReLU/GELU epilogues for fused
MatMul/Gemm + Add (+ Relu/Gelu) patterns; ``Gemm.activation`` ("RELU", "GELU") turns them on.

MatMulInteger is exact: the zero-point-shifted int8/uint8 operands are multiplied in float64. Every
product and partial sum is an integer below 2**53, so no rounding happens. The int32 result wraps
like the reference.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from onnxplug.ep import KernelContext, KernelInfo, KernelRegistry, dtypes, shapes

from .. import blas
from ._base import BF16, CudaKernel

FLOATS = dtypes("float16", "float32", "float64") + BF16


class _Gemm(CudaKernel):
    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.gemm = blas.engine_for(self.ep)
        self.dtype = info.input_dtype(0)
        self.path = self.gemm.kind  # which engine runs the products (for tests)

    def warm_up(self) -> None:
        self.gemm.warm_up(self.dtype)


class MatMul(_Gemm):
    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self._shapes: dict[tuple, tuple] = {}

    def _plan(self, sa: tuple[int, ...], sb: tuple[int, ...]) -> tuple:
        """(output shape, a as (.., M, K), b as (.., K, N), output as (.., M, N))."""
        if not sa or not sb:
            raise ValueError(f"MatMul: scalar operands {sa} x {sb}")
        a2 = (1, *sa) if len(sa) == 1 else sa
        b2 = (*sb, 1) if len(sb) == 1 else sb
        if a2[-1] != b2[-2]:
            raise ValueError(f"MatMul: shapes {list(sa)} and {list(sb)} do not align")
        batch = shapes.broadcast_shapes(a2[:-2], b2[:-2])
        out2 = (*batch, a2[-2], b2[-1])
        out = list(out2)
        if len(sb) == 1:
            out.pop(-1)
        if len(sa) == 1:
            out.pop(-2 if len(sb) != 1 else -1)
        plan = (tuple(out), a2, b2, out2)
        self._shapes[(sa, sb)] = plan
        return plan

    def compute(self, ctx: KernelContext) -> None:
        a, b = self.arg(ctx, 0), self.arg(ctx, 1)
        plan = self._shapes.get((a.shape, b.shape)) or self._plan(a.shape, b.shape)
        y = self.alloc(ctx, 0, plan[0], self.dtype)
        self.gemm(ctx, a.reshape(plan[1]), b.reshape(plan[2]), y.reshape(plan[3]), dtype=self.dtype)

    def prepare(self, ctx: KernelContext) -> Any:
        a, b = self.arg(ctx, 0), self.arg(ctx, 1)
        plan = self._shapes.get((a.shape, b.shape)) or self._plan(a.shape, b.shape)
        y = self.alloc(ctx, 0, plan[0], self.dtype)
        return self.gemm.prepare(
            ctx, a.reshape(plan[1]), b.reshape(plan[2]), y.reshape(plan[3]), dtype=self.dtype
        )


class Gemm(_Gemm):
    """Gemm-1..13: transA/transB, alpha/beta, C unidirectionally broadcast (optional from 11)."""

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.alpha = float(info.attr("alpha", 1.0))
        self.beta = float(info.attr("beta", 1.0))
        self.trans_a = bool(info.attr("transA", 0))
        self.trans_b = bool(info.attr("transB", 0))
        # a fusion pass may set this to "RELU" or "GELU" (tanh) for Gemm + Relu/Gelu
        self.activation: str | None = None

    def _operands(self, ctx: KernelContext) -> tuple:
        """A, B, C, the output Y (M, N) and the GEMM's keyword arguments."""
        a, b, c = self.arg(ctx, 0), self.arg(ctx, 1), self.arg(ctx, 2)
        M = a.shape[1] if self.trans_a else a.shape[0]
        N = b.shape[0] if self.trans_b else b.shape[1]
        y = self.alloc(ctx, 0, (M, N), self.dtype)
        kw: dict[str, Any] = dict(
            trans_a=self.trans_a,
            trans_b=self.trans_b,
            alpha=self.alpha,
            dtype=self.dtype,
            epilogue=self.activation,
        )
        return a, b, c, y, M, N, kw

    def compute(self, ctx: KernelContext) -> None:
        a, b, c, y, M, N, kw = self._operands(ctx)
        if c is None or self.beta == 0 or c.size == 0:
            self.gemm(ctx, a, b, y, **kw)
            return
        if not shapes.unidirectional_broadcastable(c.shape, (M, N)):
            raise ValueError(f"Gemm: C {c.shape} does not broadcast to {(M, N)}")
        if c.shape == (M, N):
            self.gemm(ctx, a, b, y, beta=self.beta, c=c, **kw)
        elif self.beta == 1 and c.ndim >= 1 and c.shape[-1] == N and c.size == N:
            self.gemm(ctx, a, b, y, bias=c.reshape(N), **kw)
        else:
            xp = self.xp
            if self.beta == 1:
                y[...] = c
            elif blas.is_half(self.dtype):
                blas.store(xp, blas.widen(xp, c, self.dtype) * self.beta, y, self.dtype)
            else:
                xp.multiply(c, self.beta, out=y)
            self.gemm(ctx, a, b, y, beta=1.0, c=y, **kw)

    def prepare(self, ctx: KernelContext) -> Any:
        a, b, c, y, M, N, kw = self._operands(ctx)
        if c is None or self.beta == 0 or c.size == 0:
            return self.gemm.prepare(ctx, a, b, y, **kw)
        if c.shape == (M, N):
            return self.gemm.prepare(ctx, a, b, y, beta=self.beta, c=c, **kw)
        if self.beta == 1 and c.ndim >= 1 and c.shape[-1] == N and c.size == N:
            return self.gemm.prepare(ctx, a, b, y, bias=c.reshape(N), **kw)
        return None


class FusedMatMul(MatMul):
    """com.microsoft FusedMatMul: ``alpha * op(A) @ op(B)``, op swapping the last two axes of
    an operand of rank >= 2 (``transA``/``transB``), as the GEMM's own transposes and scale:
    no Transpose is materialised. ``transBatchA``/``transBatchB`` other than 0 are not
    claimed (the CPU provider refuses them with its error)."""

    @classmethod
    def claims(cls, node: Any, graph: Any) -> bool:
        return not node.attrs.get("transBatchA", 0) and not node.attrs.get("transBatchB", 0)

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.alpha = float(info.attr("alpha", 1.0))
        self.trans_a = bool(info.attr("transA", 0))
        self.trans_b = bool(info.attr("transB", 0))
        # (A, B shapes) -> (output shape, A and B as read, output as written); ``_shapes``
        # holds MatMul's plans of the transposed shapes, another key space
        self._calls: dict[tuple, tuple] = {}

    def _call(self, ctx: KernelContext) -> tuple:
        """(a, b, output, GEMM keywords) of one call, the operands as the engine reads them."""
        a, b = self.arg(ctx, 0), self.arg(ctx, 1)
        ta, tb = self.trans_a and a.ndim >= 2, self.trans_b and b.ndim >= 2
        key = (a.shape, b.shape)
        plan = self._calls.get(key)
        if plan is None:
            # the MatMul of the operands as op() makes them, and how their memory is read
            la = (*a.shape[:-2], a.shape[-1], a.shape[-2]) if ta else a.shape
            lb = (*b.shape[:-2], b.shape[-1], b.shape[-2]) if tb else b.shape
            out, a2, b2, out2 = self._plan(la, lb)
            pa = (*a2[:-2], a2[-1], a2[-2]) if ta else a2
            pb = (*b2[:-2], b2[-1], b2[-2]) if tb else b2
            plan = self._calls[key] = (out, pa, pb, out2)
        y = self.alloc(ctx, 0, plan[0], self.dtype)
        kw = dict(trans_a=ta, trans_b=tb, alpha=self.alpha, dtype=self.dtype)
        return a.reshape(plan[1]), b.reshape(plan[2]), y.reshape(plan[3]), kw

    def compute(self, ctx: KernelContext) -> None:
        a, b, y, kw = self._call(ctx)
        self.gemm(ctx, a, b, y, **kw)

    def prepare(self, ctx: KernelContext) -> Any:
        a, b, y, kw = self._call(ctx)
        return self.gemm.prepare(ctx, a, b, y, **kw)


class MatMulInteger(MatMul):
    """int8/uint8 MatMul with zero points to int32, exact (float64 GEMM on integer values)."""

    def prepare(self, ctx: KernelContext) -> Any:
        return None  # temporaries computed from the inputs: compute every run

    def compute(self, ctx: KernelContext) -> None:
        xp = self.xp
        a, b = self.arg(ctx, 0), self.arg(ctx, 1)
        azp, bzp = self.arg(ctx, 2), self.arg(ctx, 3)
        plan = self._shapes.get((a.shape, b.shape)) or self._plan(a.shape, b.shape)
        af = a.astype(xp.float64)
        if azp is not None:
            af -= azp.astype(xp.float64)  # numpy broadcasting, as the reference does
        bf = b.astype(xp.float64)
        if bzp is not None:
            bf -= bzp.astype(xp.float64)
        r = xp.empty(plan[3], dtype=xp.float64)
        self.gemm(ctx, af.reshape(plan[1]), bf.reshape(plan[2]), r, dtype=np.float64)
        y = self.alloc(ctx, 0, plan[0], np.int32)
        # float64 -> int64 is exact here; int64 -> int32 wraps like int32 arithmetic
        y[...] = r.reshape(plan[0]).astype(xp.int64).astype(xp.int32)


def register(reg: KernelRegistry, enable_cudnn: bool) -> None:
    reg.kernel("MatMul", since=1, types={"T": FLOATS})(MatMul)
    reg.kernel("Gemm", since=1, types={"T": FLOATS})(Gemm)
    reg.kernel("FusedMatMul", domain="com.microsoft", since=1, types={0: FLOATS, 1: FLOATS})(
        FusedMatMul
    )
    int8 = dtypes("int8", "uint8")
    reg.kernel("MatMulInteger", since=10, types={"T1": int8, "T2": int8, "T3": dtypes("int32")})(
        MatMulInteger
    )
