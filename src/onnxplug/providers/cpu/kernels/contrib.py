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
* ``com.microsoft`` ``QuickGelu(X)`` (``alpha`` 1.702): ``x * sigmoid(alpha * x)``.
* ``LayerNormalization`` below opset 17 and ``SimplifiedLayerNormalization`` (RMS
  normalization), in the default domain at version 1, where onnxruntime registers them and
  its optimizer writes them.
* ``com.microsoft`` ``EmbedLayerNormalization``: word + position (+ segment) embeddings, then
  LayerNormalization; ``mask_index`` is each row's count of mask ones (zeros without a mask).
* ``com.microsoft`` ``BiasSoftmax(data, bias)`` (``axis``): Softmax of ``data + bias``.
* ``com.microsoft`` ``MatMulNBits(A, B, scales, zero_points?, g_idx?, bias?)``: A times the
  block-quantized (2..8-bit) weight, dequantized per block of ``block_size`` along K.
* ``com.microsoft`` ``QuantizeLinear``/``DequantizeLinear``: in ``quantize``, with the ONNX ops.
* ``ai.onnxplug`` ``MatMulBias(A, B[, bias])`` (``activation`` "", "Relu", "Gelu", "FastGelu"):
  ``act(A @ B + bias)`` for an N-D ``A``, a 2-D ``B`` and a bias of B's column count.

Like the other CPU kernels, float16/bfloat16 compute in float32 and round once at the end
(sums that the op outputs, like ``input_skip_bias_sum``, are rounded before they are used).
The ops have no ONNX schemas, so the kernels take every dtype the fusions produce.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from onnxplug.ep import Kernel, KernelContext, KernelInfo, KernelRegistry

from .activation import erf, wide
from .norm import LayerNormalization

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
        if bias is not None and bias.shape != (w.shape[1],):
            raise ValueError(f"MatMulBias: bias {bias.shape} must have shape ({w.shape[1]},)")
        rows = math.prod(a.shape[:-1])
        y = np.matmul(wide(a).reshape(rows, w.shape[0]), w)  # a new array: biased in place
        if bias is not None:
            y += wide(bias)
        if self.act is not None:
            y = self.act(y)
        ctx.set_output(0, y.reshape(*a.shape[:-1], w.shape[1]).astype(a.dtype, copy=False))


class QuickGelu(Kernel):
    def __init__(self, info: KernelInfo):
        super().__init__(info)
        # a float attribute: onnxruntime's default is the float 1.702f, not the double
        self.alpha = float(info.attr("alpha", np.float32(1.702)))

    def compute(self, ctx: KernelContext) -> None:
        x = ctx.input(0)
        w = wide(x)
        with np.errstate(over="ignore"):
            y = w / (1 + np.exp(-(self.alpha * w)))
        ctx.set_output(0, y.astype(x.dtype, copy=False))


def _layer_norm(s: np.ndarray, gamma: Any, beta: Any, eps: float) -> np.ndarray:
    """LayerNormalization over the last axis of a float32/float64 array."""
    mean = s.mean(axis=-1, keepdims=True)
    y = s - mean
    y *= 1 / np.sqrt(np.mean(np.square(y), axis=-1, keepdims=True) + eps)
    y *= wide(gamma)
    if beta is not None:
        y += wide(beta)
    return y


class EmbedLayerNormalization(Kernel):
    """Inputs: input_ids, segment_ids?, word_embedding, position_embedding,
    segment_embedding?, gamma, beta, mask?, position_ids?; outputs: output, mask_index,
    embedding_sum?."""

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.eps = float(info.attr("epsilon", 1e-12))
        self.mask_index_type = int(info.attr("mask_index_type", 1))

    def compute(self, ctx: KernelContext) -> None:
        ids, seg, word, pos_table = (ctx.input(i) for i in range(4))
        seg_table, gamma, beta, mask, pos_ids = (ctx.input(i) for i in range(4, 9))
        if ids.ndim != 2:
            raise ValueError(
                f"EmbedLayerNormalization node '{self.info.name}': input_ids must be "
                f"[batch, sequence], got {list(ids.shape)}"
            )
        batch, seq = ids.shape
        for name, table, index in (("input_ids", word, ids), ("segment_ids", seg_table, seg)):
            if (
                table is not None
                and index is not None
                and (index.size and (index.min() < 0 or index.max() >= table.shape[0]))
            ):
                raise ValueError(
                    f"EmbedLayerNormalization node '{self.info.name}': {name} must be in "
                    f"[0, {table.shape[0]})"
                )
        if pos_ids is None:
            pos_ids = np.arange(seq)
        pos = (
            np.broadcast_to(pos_ids, (batch, seq))
            if pos_ids.ndim < 2 or pos_ids.shape[0] == 1
            else pos_ids
        )
        s = wide(word)[ids] + wide(pos_table)[np.asarray(pos).reshape(batch, seq)]
        if seg is not None and seg_table is not None:
            s = s + wide(seg_table)[seg]
        y = _layer_norm(s, gamma, beta, self.eps)
        ctx.set_output(0, y.astype(word.dtype, copy=False))
        if ctx.has_output(1):
            if mask is None:
                mask_index = np.zeros(batch, dtype=np.int32)
            else:
                mask_index = np.asarray(mask).astype(np.int32).sum(axis=1, dtype=np.int32)
            ctx.set_output(1, mask_index)
        if ctx.has_output(2):
            ctx.set_output(2, s.astype(word.dtype, copy=False))


class SimplifiedLayerNormalization(Kernel):
    """RMS normalization over dims [axis, rank): ``x / sqrt(mean(x^2) + epsilon) * scale``;
    the optional second output is the inverse RMS."""

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.axis = int(info.attr("axis", -1))
        self.eps = float(info.attr("epsilon", 1e-5))

    def compute(self, ctx: KernelContext) -> None:
        x, scale = ctx.input(0), ctx.input(1)
        axis = self.axis if self.axis >= 0 else self.axis + x.ndim
        w = wide(x)
        inv = 1 / np.sqrt(
            np.mean(np.square(w), axis=tuple(range(axis, x.ndim)), keepdims=True) + self.eps
        )
        ctx.set_output(0, (w * inv * wide(scale)).astype(x.dtype, copy=False))
        if ctx.has_output(1):
            ctx.set_output(1, inv.astype(F32, copy=False))


class BiasSoftmax(Kernel):
    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.axis = int(info.attr("axis", 1))

    def compute(self, ctx: KernelContext) -> None:
        x, bias = ctx.input(0), ctx.input(1)
        s = wide(x) + wide(bias)
        axis = self.axis if self.axis >= 0 else self.axis + s.ndim
        # onnxruntime softmaxes over all the dims from axis on, as Softmax-1..12 does
        shape = s.shape
        flat = s.reshape(*shape[:axis], -1)
        flat = flat - flat.max(axis=-1, keepdims=True)
        e = np.exp(flat)
        e /= e.sum(axis=-1, keepdims=True)
        ctx.set_output(0, e.reshape(shape).astype(x.dtype, copy=False))


class MatMulNBits(Kernel):
    """``A @ W.T (+ bias)``, W [N, K] dequantized from ``B`` [N, blocks, block bytes] of
    ``bits``-bit values (low bits first), one scale (and zero point) per block of
    ``block_size`` along K; zero points default to the middle of the range."""

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.k = int(info.attr("K"))
        self.n = int(info.attr("N"))
        self.bits = int(info.attr("bits", 4))
        self.block = int(info.attr("block_size"))
        if not 2 <= self.bits <= 8 or self.block < 16 or self.block & (self.block - 1):
            raise ValueError(
                f"MatMulNBits node '{info.name}': bits must be 2..8 and block_size a power of "
                f"2 >= 16, got bits={self.bits}, block_size={self.block}"
            )
        self.blocks = -(-self.k // self.block)
        self.w: np.ndarray | None = None
        if all(info.constant_input(i) is not None or not info.has_input(i) for i in (1, 2, 3, 4)):
            self.w = self._dequantize(*(info.constant_input(i) for i in (1, 2, 3, 4)))

    def _unpack(self, packed: np.ndarray, count: int) -> np.ndarray:
        """[rows, count] values of ``bits`` bits from [rows, bytes] uint8 (low bits first)."""
        bits = np.unpackbits(packed.astype(np.uint8), axis=-1, bitorder="little")
        bits = bits[..., : count * self.bits].reshape(*packed.shape[:-1], count, self.bits)
        return (bits.astype(np.int32) << np.arange(self.bits)).sum(axis=-1)

    def _dequantize(self, b: Any, scales: Any, zero_points: Any, g_idx: Any) -> np.ndarray:
        n, blocks, block = self.n, self.blocks, self.block
        q = self._unpack(np.asarray(b).reshape(n, blocks, -1), block)  # [n, blocks, block]
        sc = wide(np.asarray(scales)).reshape(n, blocks, 1)
        if zero_points is None:
            zp = np.full((n, blocks, 1), 1 << (self.bits - 1), dtype=np.float32)
        elif np.asarray(zero_points).dtype == np.uint8:
            zp = self._unpack(np.asarray(zero_points).reshape(n, -1), blocks)
            zp = zp.reshape(n, blocks, 1).astype(np.float32)
        else:  # zero points in the scales' type (already dequantized offsets)
            zp = wide(np.asarray(zero_points)).reshape(n, blocks, 1)
        if g_idx is not None:  # act-order: column k uses block g_idx[k]
            g = np.asarray(g_idx).astype(np.int64)[: self.k]
            qk = q.reshape(n, -1)[:, : self.k]
            return (qk - zp[:, g, 0]) * sc[:, g, 0]
        return ((q - zp) * sc).reshape(n, -1)[:, : self.k]

    def compute(self, ctx: KernelContext) -> None:
        a = ctx.input(0)
        w = self.w
        if w is None:
            w = self._dequantize(ctx.input(1), ctx.input(2), ctx.input(3), ctx.input(4))
        if a.shape[-1] != self.k:
            raise ValueError(
                f"MatMulNBits node '{self.info.name}': A's last dim is {a.shape[-1]}, K is {self.k}"
            )
        y = np.matmul(wide(a), w.T.astype(wide(a).dtype, copy=False))
        bias = ctx.input(5)
        if bias is not None:
            y += wide(bias)
        ctx.set_output(0, y.astype(a.dtype, copy=False))


def register(registry: KernelRegistry) -> None:
    registry.kernel("Gelu", domain=MS, since=1)(Gelu)
    registry.kernel("BiasGelu", domain=MS, since=1)(BiasGelu)
    registry.kernel("FastGelu", domain=MS, since=1)(FastGelu)
    registry.kernel("SkipLayerNormalization", domain=MS, since=1)(SkipLayerNormalization)
    registry.kernel("MatMulBias", domain=PLUG, since=1)(MatMulBias)
    registry.kernel("QuickGelu", domain=MS, since=1)(QuickGelu)
    registry.kernel("LayerNormalization", since=1, until=16)(LayerNormalization)
    registry.kernel("SimplifiedLayerNormalization", since=1)(SimplifiedLayerNormalization)
    registry.kernel("EmbedLayerNormalization", domain=MS, since=1)(EmbedLayerNormalization)
    registry.kernel("BiasSoftmax", domain=MS, since=1)(BiasSoftmax)
    registry.kernel("MatMulNBits", domain=MS, since=1)(MatMulNBits)
