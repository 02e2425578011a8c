"""QuantizeLinear and DequantizeLinear on the CPU: the ONNX ops and the ``com.microsoft`` forms
that onnxruntime's quantization tools write, computed with the formulas shared with the other
providers (``onnxplug.ep.quantize``: onnxruntime's float32 quotient, rounding half to even and
saturation, NaN to the range's low end).

The ONNX ops quantize to the integer types natively; float8/float4 targets, integer inputs
and ``precision`` (opset 23) stay with onnx.reference's implementation. onnx.reference casts
``rint(x / scale)`` through int32 before it clamps, which wraps values beyond int32's range
and NaN on x86 (``-1e10`` quantized to int8 with a negative zero point gave 127): the native
path clamps in float instead. DequantizeLinear of the ONNX domain is onnx.reference's, which
computes the same float32 formula.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from onnxplug.ep import Kernel, KernelContext, KernelInfo, KernelRegistry, np_dtype, quantize

from .reference import ReferenceKernel, register_checked

MS = "com.microsoft"


def _where(info: KernelInfo) -> str:
    return f"{info.op_type} node '{info.name}'"


def _parts(info: KernelInfo, x: Any, y: Any, scale: Any, zp: Any, axis: int, block: int) -> list:
    """The shared layout of scale and zero point over x and y (checked, errors name the node)."""
    where = _where(info)
    layout = quantize.param_layout(x.shape, scale.shape, axis, block, where)
    if zp is not None and np.shape(zp) != np.shape(scale) and np.size(zp) != np.size(scale):
        raise ValueError(
            f"{where}: the zero point of shape {list(np.shape(zp))} differs from the scale's "
            f"{list(np.shape(scale))}"
        )
    return quantize.operand_parts(x, y, (scale, zp), *layout)


def linear(
    info: KernelInfo, formula: Any, x: Any, scale: Any, zp: Any, dtype: Any, axis: int, block: int
) -> np.ndarray:
    """``formula`` (``quantize.quantize_into`` or ``dequantize_into``) over x into a new array
    of ``dtype``, part by part of the scale's layout."""
    y = np.empty(x.shape, dtype)
    for xs, ys, ss, zs in _parts(info, x, y, scale, zp, axis, block):
        formula(xs, ss, zs, ys)
    return y


class QuantizeLinear(ReferenceKernel):
    """QuantizeLinear-10..25: the integer targets of float inputs natively, the rest by the
    reference."""

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.axis = int(info.attr("axis", 1))
        self.block = int(info.attr("block_size", 0) or 0)
        out = int(info.attr("output_dtype", 0) or 0)
        self.output_dtype = np_dtype(out) if out else None
        self.native = not info.attr("precision")

    def compute(self, ctx: KernelContext) -> None:
        x, scale, zp = ctx.input(0), ctx.input(1), ctx.input(2)
        zt = None if zp is None else zp.dtype
        dtype = quantize.quantized_dtype(zt, self.output_dtype, _where(self.info))
        if not (self.native and quantize.is_int_quant(dtype) and x.dtype.kind != "i"):
            super().compute(ctx)
            return
        q = quantize.quantize_into
        ctx.set_output(0, linear(self.info, q, x, scale, zp, dtype, self.axis, self.block))


class ContribQuantizeLinear(Kernel):
    """com.microsoft QuantizeLinear (``axis``): per tensor or per axis; uint8 without a zero
    point."""

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.axis = int(info.attr("axis", 1))

    def compute(self, ctx: KernelContext) -> None:
        x, scale, zp = ctx.input(0), ctx.input(1), ctx.input(2)
        dtype = quantize.quantized_dtype(None if zp is None else zp.dtype, None, "")
        ctx.set_output(
            0, linear(self.info, quantize.quantize_into, x, scale, zp, dtype, self.axis, 0)
        )


class ContribDequantizeLinear(Kernel):
    """com.microsoft DequantizeLinear (``axis``): per tensor or per axis, to the scale's type."""

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.axis = int(info.attr("axis", 1))

    def compute(self, ctx: KernelContext) -> None:
        x, scale, zp = ctx.input(0), ctx.input(1), ctx.input(2)
        dq = quantize.dequantize_into
        ctx.set_output(0, linear(self.info, dq, x, scale, zp, scale.dtype, self.axis, 0))


def register(registry: KernelRegistry) -> None:
    register_checked(registry, "QuantizeLinear", QuantizeLinear)
    registry.kernel("QuantizeLinear", domain=MS, since=1)(ContribQuantizeLinear)
    registry.kernel("DequantizeLinear", domain=MS, since=1)(ContribDequantizeLinear)
