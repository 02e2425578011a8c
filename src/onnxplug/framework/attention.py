"""What the attention ops' kernels share between providers (``com.microsoft``/``ai.onnxplug``
``Attention`` and ``MultiHeadAttention``): their attributes, read and checked once, the causal
mask, and the errors that name the node."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

DEFAULT_MASK_FILTER = -10000.0  # onnxruntime's mask_filter_value


def node_error(info: Any, msg: str) -> ValueError:
    """A ValueError naming the op and node of ``info`` (a KernelInfo)."""
    return ValueError(f"{info.op_type} node '{info.name}': {msg}")


def causal_mask(s: int, t: int) -> np.ndarray:
    """(S, T) True where query i (at position T - S + i) must not see key j."""
    return np.arange(t)[None, :] > np.arange(s)[:, None] + (t - s)


@dataclass(frozen=True)
class AttentionAttrs:
    """``num_heads`` (> 0), ``scale`` (None: 1 / sqrt(head size)), ``unidirectional``,
    ``mask_filter_value`` and ``zero_nan_probabilities``."""

    heads: int
    scale: float | None
    causal: bool
    mask_filter: float
    zero_nan: bool

    @staticmethod
    def of(info: Any) -> AttentionAttrs:
        heads = int(info.attr("num_heads", 0))
        if heads <= 0:
            raise node_error(info, f"num_heads must be positive, got {heads}")
        scale = info.attr("scale", 0.0)
        return AttentionAttrs(
            heads=heads,
            scale=float(scale) if scale else None,
            causal=bool(info.attr("unidirectional", 0)),
            mask_filter=float(info.attr("mask_filter_value", DEFAULT_MASK_FILTER)),
            zero_nan=bool(info.attr("zero_nan_probabilities", 0)),
        )
