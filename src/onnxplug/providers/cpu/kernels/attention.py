"""CPU kernels of the fused attention ops: the reference the CUDA kernels are compared with.

* ``com.microsoft`` ``MultiHeadAttention(query, key, value, bias?, key_padding_mask?,
  attention_bias?, past_key?, past_value?)`` -> ``output (B, S, Dv), present_key?,
  present_value?`` (``num_heads``, ``scale``, ``mask_filter_value``, ``unidirectional``): query
  (B, S, D), key (B, L, D) and value (B, L, Dv) are split into heads of D / num_heads; past and
  present keys/values are (B, N, P, H).
* ``com.microsoft`` ``Attention(input, weights, bias?, mask_index?, past?, attention_bias?)`` ->
  ``output, present?`` (``num_heads``, ``qkv_hidden_sizes``, ``scale``, ``unidirectional``,
  ``mask_filter_value``): the same after one projection ``input @ weights + bias`` into
  [Q | K | V]; past and present are (2, B, N, P, H).
* ``ai.onnxplug`` ``MultiHeadAttention`` and ``Attention``: the same ops with one more
  attribute, ``zero_nan_probabilities`` (int, default 0): attention probabilities that are NaN
  become 0 before they weight the values. It is the ``Where(IsNaN(p), 0, p)`` guard that
  PyTorch's scaled_dot_product_attention export puts after the Softmax (a row whose keys are
  all masked with -inf then yields zeros instead of NaN); the com.microsoft ops have no such
  attribute, so the optimizer writes these ops only for guarded patterns.

Per head: ``softmax(scale * Q @ K^T + attention_bias + masks) @ V``, with ``scale`` defaulting to
1/sqrt(head size). ``attention_bias`` may have any shape that broadcasts to (B, N, S, T) (a
superset of onnxruntime's (B or 1, N or 1, S, T)); masks (key padding, ``mask_index``,
``unidirectional``) add ``mask_filter_value`` (default -10000) at masked positions, as
onnxruntime does. float16/bfloat16 compute in float32 and round once at the end.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from onnxplug.ep import Kernel, KernelContext, KernelInfo, KernelRegistry, attention

from ._util import wide

MS = "com.microsoft"
PLUG = "ai.onnxplug"
_error = attention.node_error


def split_heads(x: np.ndarray, heads: int) -> np.ndarray:
    """(B, S, N*H) -> (B, N, S, H)."""
    b, s, d = x.shape
    return x.reshape(b, s, heads, d // heads).transpose(0, 2, 1, 3)


def attention_scores_bias(
    shape: tuple[int, int, int, int],
    bias: np.ndarray | None,
    masked: np.ndarray | None,
    mask_filter: float,
) -> np.ndarray | None:
    """The additive term of the scores (B, N, S, T) as a float array broadcastable to them:
    ``bias`` plus ``mask_filter`` where ``masked`` (boolean, broadcastable) is set."""
    out = None
    if bias is not None:
        try:
            fits = np.broadcast_shapes(bias.shape, shape) == shape
        except ValueError:
            fits = False
        if not fits:
            raise ValueError(f"attention_bias of shape {list(bias.shape)} does not broadcast to "
                             f"the scores' shape {list(shape)}")  # fmt: skip
        out = wide(bias)
    if masked is not None:
        add = np.where(masked, np.float32(mask_filter), np.float32(0))
        out = add if out is None else out + add
    return out


def attend(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    scale: float,
    additive: np.ndarray | None,
    zero_nan: bool,
) -> np.ndarray:
    """softmax(scale * q @ k^T + additive) @ v for (B, N, S, H) heads, in the compute type."""
    w = np.matmul(q, k.swapaxes(-1, -2))
    w *= w.dtype.type(scale)
    if additive is not None:
        w += additive.astype(w.dtype, copy=False)
    with np.errstate(all="ignore"):
        w -= w.max(axis=-1, keepdims=True)
        np.exp(w, out=w)
        w /= w.sum(axis=-1, keepdims=True)
    if zero_nan:
        w[np.isnan(w)] = 0
    return np.matmul(w, v)


class _AttentionBase(Kernel):
    def __init__(self, info: KernelInfo):
        super().__init__(info)
        a = attention.AttentionAttrs.of(info)
        self.heads, self.scale, self.causal = a.heads, a.scale, a.causal
        self.mask_filter, self.zero_nan = a.mask_filter, a.zero_nan

    def attend_masked(
        self, q4: np.ndarray, k4: np.ndarray, v4: np.ndarray, bias: Any, mask: Any
    ) -> np.ndarray:
        """``run_heads`` with a padding mask (key_padding_mask / mask_index) or None; errors
        name the node."""
        b, _, s, _ = q4.shape
        masked = None if mask is None else _padding_mask(self.info, mask, b, s, k4.shape[2])
        try:
            return self.run_heads(q4, k4, v4, bias, masked)
        except ValueError as e:
            raise _error(self.info, str(e)) from None

    def run_heads(
        self,
        q: np.ndarray,
        k: np.ndarray,
        v: np.ndarray,
        bias: np.ndarray | None,
        masked: np.ndarray | None,
    ) -> np.ndarray:
        """Attention of (B, N, S, H) heads; returns (B, S, N*Hv) in the compute type."""
        b, n, s, h = q.shape
        t = k.shape[2]
        if self.causal:
            cm = attention.causal_mask(s, t)
            masked = cm if masked is None else masked | cm
        additive = attention_scores_bias((b, n, s, t), bias, masked, self.mask_filter)
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(h)
        out = attend(q, k, v, scale, additive, self.zero_nan)
        return out.transpose(0, 2, 1, 3).reshape(b, s, n * v.shape[-1])


def _padding_mask(info: KernelInfo, mask: np.ndarray, b: int, s: int, t: int) -> np.ndarray:
    """A key padding mask (or Attention's mask_index) as booleans broadcastable to (B, 1|N, S, T),
    True where masked: (B) lengths of right-padded sequences, (B, T) 0/1, (B, S, T) 0/1."""
    if mask.ndim == 1 and mask.shape[0] == b:
        return (np.arange(t)[None, :] >= mask.astype(np.int64)[:, None])[:, None, None, :]
    if mask.ndim == 2 and mask.shape == (b, t):
        return (mask == 0)[:, None, None, :]
    if mask.ndim == 3 and mask.shape == (b, s, t):
        return (mask == 0)[:, None, :, :]
    raise _error(
        info,
        f"mask of shape {list(mask.shape)} is not supported (expected ({b}), ({b}, {t}) or "
        f"({b}, {s}, {t}))",
    )


class MultiHeadAttention(_AttentionBase):
    def compute(self, ctx: KernelContext) -> None:
        info = self.info
        query, key, value = ctx.input(0), ctx.input(1), ctx.input(2)
        bias, kpm, attn_bias = ctx.input(3), ctx.input(4), ctx.input(5)
        past_k, past_v = ctx.input(6), ctx.input(7)
        if key is None or value is None or query.ndim != 3 or key.ndim != 3 or value.ndim != 3:
            raise _error(info, "query, key and value must be 3-D (B, S, D); packed QKV/KV and "
                               "BNSH key/value inputs are not supported")  # fmt: skip
        dt = query.dtype
        b, s, d = query.shape
        n = self.heads
        if key.shape[0] != b or value.shape[0] != b or key.shape[1] != value.shape[1]:
            raise _error(info, f"query {list(query.shape)}, key {list(key.shape)} and value "
                               f"{list(value.shape)} disagree")  # fmt: skip
        if d % n or key.shape[2] != d or value.shape[2] % n:
            raise _error(info, f"hidden sizes {d}/{key.shape[2]}/{value.shape[2]} are not "
                               f"divisible into {n} heads")  # fmt: skip
        q, k, v = wide(query), wide(key), wide(value)
        if bias is not None:
            dv = value.shape[2]
            if bias.shape != (2 * d + dv,):
                raise _error(info, f"bias must have shape ({2 * d + dv},), got {bias.shape}")
            wb = wide(bias)
            q, k, v = q + wb[:d], k + wb[d : 2 * d], v + wb[2 * d :]
        q4, k4, v4 = split_heads(q, n), split_heads(k, n), split_heads(v, n)
        if past_k is not None and past_v is not None:
            k4 = np.concatenate([wide(past_k), k4], axis=2)
            v4 = np.concatenate([wide(past_v), v4], axis=2)
        out = self.attend_masked(q4, k4, v4, attn_bias, kpm)
        ctx.set_output(0, out.astype(dt, copy=False))
        if ctx.has_output(1):
            ctx.set_output(1, np.ascontiguousarray(k4).astype(dt, copy=False))
        if ctx.has_output(2):
            ctx.set_output(2, np.ascontiguousarray(v4).astype(dt, copy=False))


class Attention(_AttentionBase):
    def __init__(self, info: KernelInfo):
        super().__init__(info)
        sizes = info.attr("qkv_hidden_sizes")
        self.sizes = [int(x) for x in sizes] if sizes else None
        if info.attr("do_rotary", 0):
            raise _error(info, "do_rotary=1 is not supported")
        w = info.constant_input(1)
        self.w = wide(w) if w is not None else None  # half weights widened once

    def compute(self, ctx: KernelContext) -> None:
        info = self.info
        x, weights, bias, mask, past = (ctx.input(i) for i in range(5))
        attn_bias = ctx.input(5)
        if x.ndim != 3 or weights.ndim != 2 or weights.shape[0] != x.shape[2]:
            raise _error(info, f"input {list(x.shape)} and weights {list(weights.shape)} do not "
                               "align (expected (B, S, D_in) and (D_in, D + D + D_v))")  # fmt: skip
        dt = x.dtype
        b, s, _ = x.shape
        n = self.heads
        total = weights.shape[1]
        dq, dk, dv = self.sizes or [total // 3] * 3
        if dq + dk + dv != total or dq != dk or dq % n or dv % n:
            raise _error(info, f"weights' {total} columns do not split into Q/K/V sizes "
                               f"{[dq, dk, dv]} of {n} heads")  # fmt: skip
        w = self.w if self.w is not None else wide(weights)
        qkv = np.matmul(wide(x), w)
        if bias is not None:
            if bias.shape != (total,):
                raise _error(info, f"bias must have shape ({total},), got {bias.shape}")
            qkv += wide(bias)
        q4 = split_heads(qkv[..., :dq], n)
        k4 = split_heads(qkv[..., dq : dq + dk], n)
        v4 = split_heads(qkv[..., dq + dk :], n)
        if past is not None:
            if past.ndim != 5 or past.shape[:3] != (2, b, n):
                raise _error(info, f"past must be (2, {b}, {n}, P, H), got {list(past.shape)}")
            k4 = np.concatenate([wide(past[0]), k4], axis=2)
            v4 = np.concatenate([wide(past[1]), v4], axis=2)
        out = self.attend_masked(q4, k4, v4, attn_bias, mask)
        ctx.set_output(0, out.astype(dt, copy=False))
        if ctx.has_output(1):
            ctx.set_output(1, np.stack([k4, v4]).astype(dt, copy=False))


def register(registry: KernelRegistry) -> None:
    for domain in (MS, PLUG):
        registry.kernel("MultiHeadAttention", domain=domain, since=1)(MultiHeadAttention)
        registry.kernel("Attention", domain=domain, since=1)(Attention)
