"""Linear quantization to integers, shared by every provider's QuantizeLinear/DequantizeLinear
kernels (the ONNX ops and the ``com.microsoft`` forms; re-exported to plugins as
``onnxplug.ep.quantize``): which integer types there are and their ranges, which element of the
scale and zero point applies where (one for the tensor, one per index of an axis, or one per
block of ``block_size`` along an axis), and the numpy formulas (the CPU kernels' computation and
the CUDA kernels' host twins).

* Quantization is ``saturate(rint(x / scale) + zero_point)`` as onnxruntime computes it: the
  quotient in float32 (float16/bfloat16 widened first), rounded half to even, and clamped to the
  type's range in float, so values beyond the range (infinities included) saturate and NaN
  gives the range's low end (onnxruntime's clamp takes the max with the low end first).
* Dequantization is ``(x - zero_point) * scale`` in float32, rounded once to the output type.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

# the integer types a float quantizes to, with their ranges
INT_RANGES: dict[str, tuple[int, int]] = {
    "int8": (-128, 127),
    "uint8": (0, 255),
    "int16": (-32768, 32767),
    "uint16": (0, 65535),
    "int4": (-8, 7),
    "uint4": (0, 15),
    "int2": (-2, 1),
    "uint2": (0, 3),
}


def is_int_quant(dtype: Any) -> bool:
    """Whether ``dtype`` is one of the integer types of ``INT_RANGES``."""
    return dtype is not None and np.dtype(dtype).name in INT_RANGES


def param_layout(
    x_shape: Sequence[int], p_shape: Sequence[int], axis: int, block_size: int, where: str
) -> tuple[int | None, int]:
    """Where a scale (or zero point) of shape ``p_shape`` applies to an ``x`` of ``x_shape``:
    ``(None, 0)`` one value for the tensor, ``(axis, 0)`` one per index of ``axis``,
    ``(axis, block_size)`` one per block along ``axis`` (the other dims as x's). ``where``
    names the node in the ValueError raised for a shape that fits none of these."""
    rank = len(x_shape)
    size = math.prod(p_shape)
    if block_size <= 0 and (len(p_shape) == 0 or (len(p_shape) == 1 and size == 1)):
        return None, 0
    if not -rank <= axis < rank:
        raise ValueError(f"{where}: axis {axis} is out of range for an input of rank {rank}")
    a = axis + rank if axis < 0 else axis
    if block_size <= 0:
        if len(p_shape) != 1 or p_shape[0] != x_shape[a]:
            raise ValueError(
                f"{where}: the scale of shape {list(p_shape)} must be a scalar or a 1-D tensor "
                f"of the size of axis {a} ({x_shape[a]})"
            )
        return a, 0
    want = [*x_shape[:a], -(-x_shape[a] // block_size), *x_shape[a + 1 :]]
    if list(p_shape) != want:
        raise ValueError(
            f"{where}: with block_size {block_size} along axis {a} the scale must have shape "
            f"{want}, not {list(p_shape)}"
        )
    return a, block_size


def operand_parts(x: Any, y: Any, params: Sequence[Any], axis: int | None, block: int) -> list:
    """``[(x, y, *params), ...]``: views (no copies; numpy or CuPy arrays, x and y dense of one
    shape) over which the params broadcast elementwise against x and y, for the layout of
    ``param_layout``. A blocked layout gives the whole blocks as one part (x split into
    (blocks, block) along the axis, each param with a unit dim after its block dim) and a
    partial last block as a second part. A param that is None or a scalar stays as it is."""

    def shaped(p: Any, shape: tuple[int, ...]) -> Any:
        return None if p is None else p.reshape(shape)

    if axis is None:
        return [(x, y, *(shaped(p, ()) for p in params))]
    shape = tuple(x.shape)
    outer, n, inner = math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1 :])
    if not block:
        tail = (1,) * (len(shape) - axis - 1)
        return [(x, y, *(shaped(p, (n, *tail)) for p in params))]
    blocks = -(-n // block)
    x3, y3 = x.reshape(outer, n, inner), y.reshape(outer, n, inner)
    p3 = [shaped(p, (outer, blocks, inner)) for p in params]
    full = n // block
    parts = []
    if full:
        cut = full * block
        split = (outer, full, block, inner)
        parts.append(
            (
                x3[:, :cut].reshape(split),
                y3[:, :cut].reshape(split),
                *(None if p is None else p[:, :full].reshape(outer, full, 1, inner) for p in p3),
            )
        )
    if n % block:
        parts.append(
            (
                x3[:, full * block :],
                y3[:, full * block :],
                *(None if p is None else p[:, full:] for p in p3),
            )
        )
    return parts


def _f32(v: Any) -> np.ndarray:
    return np.asarray(v).astype(np.float32, copy=False)


def quantize_into(x: Any, scale: Any, zero_point: Any, y: np.ndarray) -> None:
    """``y = saturate(rint(x / scale) + zero_point)`` on numpy arrays broadcasting to y's
    shape (``zero_point`` None for none); y's dtype is one of ``INT_RANGES``."""
    lo, hi = INT_RANGES[y.dtype.name]
    with np.errstate(all="ignore"):
        v = np.rint(_f32(x) / _f32(scale))
        if zero_point is not None:
            v += _f32(zero_point)
        np.copyto(y, np.fmin(np.fmax(v, np.float32(lo)), np.float32(hi)), casting="unsafe")


def dequantize_into(x: Any, scale: Any, zero_point: Any, y: np.ndarray) -> None:
    """``y = (x - zero_point) * scale`` in float32 on numpy arrays broadcasting to y's shape,
    rounded once to y's dtype (``zero_point`` None for none)."""
    with np.errstate(all="ignore"):
        v = _f32(x)
        if zero_point is not None:
            v = v - _f32(zero_point)
        np.copyto(y, v * _f32(scale), casting="unsafe")


def quantized_dtype(zero_point_dtype: Any, output_dtype: Any, where: str) -> np.dtype:
    """The type QuantizeLinear produces: the zero point's, else the ``output_dtype``
    attribute's (an element type number resolved by the caller to a numpy dtype), else uint8;
    a zero point and an ``output_dtype`` that disagree are an error naming ``where``."""
    if zero_point_dtype is not None:
        zt = np.dtype(zero_point_dtype)
        if output_dtype is not None and np.dtype(output_dtype) != zt:
            raise ValueError(
                f"{where}: output_dtype {np.dtype(output_dtype).name} differs from the zero "
                f"point's type {zt.name}"
            )
        return zt
    return np.dtype(output_dtype) if output_dtype is not None else np.dtype(np.uint8)
