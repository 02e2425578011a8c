"""CPU kernels of the fused transformer ops (the optimizer's extended-level fusions, and models
optimized by onnxruntime's tools): the reference the CUDA kernels are compared with.

* ``com.microsoft`` ``Gelu(X)``: ``0.5 * x * (1 + erf(x / sqrt(2)))``.
* ``com.microsoft`` ``BiasGelu(A, B)``: Gelu of ``A + B`` (B a bias, broadcast like numpy).
* ``com.microsoft`` ``FastGelu(X, bias?)``: ``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 *
  x^3)))`` of ``X (+ bias)``.
* ``com.microsoft`` ``SkipLayerNormalization(input, skip, gamma, beta?, bias?)`` (``epsilon``):
  LayerNormalization over the last axis of ``s = input + skip (+ bias)``; optional outputs
  ``mean`` and ``inv_std_var`` (float32, the input's shape with a last dim of 1) and
  ``input_skip_bias_sum`` (``s``).
* ``ai.onnxplug`` ``MatMulBias(A, B, bias)`` (``activation`` "", "Relu", "Gelu", "FastGelu"):
  ``act(A @ B + bias)`` for an N-D ``A``, a 2-D ``B`` and a bias of B's column count.

Like the other CPU kernels, float16/bfloat16 compute in float32 and round once at the end
(sums that the op outputs, like ``input_skip_bias_sum``, are rounded before they are used).
The ops have no ONNX schemas, so the kernels take every dtype the fusions produce.
"""

from __future__ import annotations

import math

import numpy as np

from onnxplug.ep import Kernel, KernelContext, KernelInfo, KernelRegistry

from .activation import erf, wide

MS = "com.microsoft"
PLUG = "ai.onnxplug"
_SQRT1_2 = 1.0 / math.sqrt(2.0)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
F32 = np.dtype(np.float32)


def gelu(w: np.ndarray) -> np.ndarray:
    """Gelu of a float32/float64 array, computed in place (w is a temporary of the caller)."""
    e = erf(w * w.dtype.type(_SQRT1_2))
    e += 1
    w *= e
    w *= w.dtype.type(0.5)
    return w


def fast_gelu(w: np.ndarray) -> np.ndarray:
    """Gelu with the tanh approximation, computed in place (w is a temporary of the caller)."""
    t = w * w
    t *= w.dtype.type(0.044715)
    t *= w
    t += w
    t *= w.dtype.type(_SQRT_2_OVER_PI)
    np.tanh(t, out=t)
    t += 1
    w *= t
    w *= w.dtype.type(0.5)
    return w


ACTIVATIONS = {
    "": None,
    "Relu": lambda w: np.maximum(w, 0, out=w),
    "Gelu": gelu,
    "FastGelu": fast_gelu,
}


def _fresh_wide(x: np.ndarray) -> np.ndarray:
    """``x`` in at least float32, as a new array the caller may overwrite."""
    w = wide(x)
    return w.copy() if w is x else w


class Gelu(Kernel):
    def compute(self, ctx: KernelContext) -> None:
        x = ctx.input(0)
        ctx.set_output(0, gelu(_fresh_wide(x)).astype(x.dtype, copy=False))


class BiasGelu(Kernel):
    def compute(self, ctx: KernelContext) -> None:
        a, b = ctx.input(0), ctx.input(1)
        ctx.set_output(0, gelu(wide(a) + wide(b)).astype(a.dtype, copy=False))


class FastGelu(Kernel):
    def compute(self, ctx: KernelContext) -> None:
        x, bias = ctx.input(0), ctx.input(1)
        w = _fresh_wide(x) if bias is None else wide(x) + wide(bias)
        ctx.set_output(0, fast_gelu(w).astype(x.dtype, copy=False))


class SkipLayerNormalization(Kernel):
    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.eps = float(info.attr("epsilon", 1e-12))  # onnxruntime's default

    def compute(self, ctx: KernelContext) -> None:
        x, skip, gamma, beta, bias = (ctx.input(i) for i in range(5))
        dt = x.dtype
        s = wide(x) + wide(skip)
        if bias is not None:
            s += wide(bias)
        s_t = s  # the sum as the op outputs it (rounded to a 16-bit type), then normalized
        if s.dtype != dt:
            s_t = s.astype(dt)
            s = wide(s_t)
        hidden = s.shape[-1]
        if gamma.shape != (hidden,) or (beta is not None and beta.shape != (hidden,)):
            raise ValueError(
                f"SkipLayerNormalization: gamma {gamma.shape} and beta "
                f"{None if beta is None else beta.shape} must have shape ({hidden},)"
            )
        mean = s.mean(axis=-1, keepdims=True)
        y = s - mean
        inv = 1 / np.sqrt(np.mean(np.square(y), axis=-1, keepdims=True) + self.eps)
        y *= inv
        y *= wide(gamma)
        if beta is not None:
            y += wide(beta)
        ctx.set_output(0, y.astype(dt, copy=False))
        if ctx.has_output(1):
            ctx.set_output(1, mean.astype(F32, copy=False))
        if ctx.has_output(2):
            ctx.set_output(2, inv.astype(F32, copy=False))
        if ctx.has_output(3):
            ctx.set_output(3, s_t)  # y was computed in a new array: s is intact


class MatMulBias(Kernel):
    """``act(A @ B + bias)``: A's leading dims are folded into the GEMM's rows."""

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        act = info.attr("activation", "")
        if act not in ACTIVATIONS:
            raise ValueError(
                f"MatMulBias node '{info.name}': activation '{act}' is not one of "
                f"{sorted(ACTIVATIONS)}"
            )
        self.act = ACTIVATIONS[act]
        w = info.constant_input(1)
        self.w = wide(w) if w is not None else None  # half weights widened once

    def compute(self, ctx: KernelContext) -> None:
        a, b, bias = ctx.input(0), ctx.input(1), ctx.input(2)
        w = self.w if self.w is not None else wide(b)
        if a.ndim == 0 or w.ndim != 2 or a.shape[-1] != w.shape[0]:
            raise ValueError(f"MatMulBias: shapes {list(a.shape)} and {list(b.shape)} do not align")
        if bias.shape != (w.shape[1],):
            raise ValueError(f"MatMulBias: bias {bias.shape} must have shape ({w.shape[1]},)")
        rows = math.prod(a.shape[:-1])
        y = np.matmul(wide(a).reshape(rows, w.shape[0]), w)  # a new array: biased in place
        y += wide(bias)
        if self.act is not None:
            y = self.act(y)
        ctx.set_output(0, y.reshape(*a.shape[:-1], w.shape[1]).astype(a.dtype, copy=False))


def register(registry: KernelRegistry) -> None:
    registry.kernel("Gelu", domain=MS, since=1)(Gelu)
    registry.kernel("BiasGelu", domain=MS, since=1)(BiasGelu)
    registry.kernel("FastGelu", domain=MS, since=1)(FastGelu)
    registry.kernel("SkipLayerNormalization", domain=MS, since=1)(SkipLayerNormalization)
    registry.kernel("MatMulBias", domain=PLUG, since=1)(MatMulBias)
