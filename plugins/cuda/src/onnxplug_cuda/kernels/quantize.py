"""CUDA kernels of QuantizeLinear and DequantizeLinear: the ONNX ops (opsets 10 to 28: per
tensor, per axis and, from 21, blocked) and the ``com.microsoft`` forms (per tensor or axis).

One elementwise kernel per operand part (``onnxplug.ep.quantize.operand_parts``: the scale and
zero point broadcast against views of x; a blocked layout whose axis is not a multiple of the
block is two parts, the whole blocks and the partial last one), computing the formulas shared
with the CPU provider (``onnxplug.ep.quantize``; the numpy twins are those functions):

* quantize: ``fminf(fmaxf(rintf(float(x) / float(scale)) + zero_point, lo), hi)``: the quotient
  in float32 (IEEE division; CuPy compiles without fast math), ``rintf`` rounding half to even,
  the clamp in float (fmaxf gives the low end for NaN, as onnxruntime's clamp does), then the
  exact conversion of an integral value in range;
* dequantize: ``(float(x) - float(zero_point)) * float(scale)`` rounded once to the output type.

Types: float32/float16/bfloat16 (bfloat16 as uint16 storage, converted with ``_fused``'s helpers)
quantized to int8/uint8/int16/uint16; those (and int32 for DequantizeLinear) dequantized. The
4-bit, 2-bit and float8/float4 types, integer inputs of QuantizeLinear, and from opset 23 a
``precision``, a scale of another type than x, or an ``output_dtype`` of DequantizeLinear
other than the scale's type stay with the CPU provider.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from onnxplug.ep import KernelContext, KernelInfo, KernelRegistry, dtypes, np_dtype, quantize

from . import _fused as F
from ._base import BF16, CallListKernel

MS = "com.microsoft"
QUANT_TYPES = dtypes("int8", "uint8", "int16", "uint16")  # what QuantizeLinear produces here
DEQUANT_INPUTS = QUANT_TYPES + dtypes("int32")
FLOAT_TYPES = dtypes("float32", "float16") + BF16
F32 = np.float32


def _quantize_twin(x: Any, s: Any, z: Any, lo: Any, hi: Any, y: np.ndarray) -> None:
    quantize.quantize_into(x, s, z, y)  # lo/hi are y's range, which it looks up itself


def _dequantize_twin(x: Any, z: Any, s: Any, y: np.ndarray) -> None:
    quantize.dequantize_into(x, s, z, y)


def _pair(name: str, params: str, out: str, expr: str, twin: Any) -> tuple[Any, Any]:
    """The kernel of ``expr`` for float16/float32 (``F`` the float type, its values loaded with
    ``float()``) and for bfloat16 storage (uint16, loaded with ``ox_bf16_ld``, and ``ox_bf16_st``
    storing a float output)."""
    plain = F.Elementwise(
        params.replace("F ", "T "),
        out.replace("F ", "T "),
        expr.format(ld="float", st="T"),
        name,
        twin,
    )
    bf16 = F.Elementwise(
        params.replace("F ", "uint16 "),
        out.replace("F ", "uint16 "),
        expr.format(ld="ox_bf16_ld", st="ox_bf16_st"),
        name + "_bf16",
        twin,
        F.BF16_PRE,
    )
    return plain, bf16


QUANTIZE, QUANTIZE_BF16 = _pair(
    "oxq_quantize",
    "F x, F s, Q z, float32 lo, float32 hi",
    "Q y",
    "y = Q(fminf(fmaxf(rintf({ld}(x) / {ld}(s)) + float(z), lo), hi));",
    _quantize_twin,
)
DEQUANTIZE, DEQUANTIZE_BF16 = _pair(
    "oxq_dequantize",
    "X x, X z, F s",
    "F y",
    "y = {st}((float(x) - float(z)) * {ld}(s));",
    _dequantize_twin,
)


def _is_bf16(dtype: Any) -> bool:
    return dtype is not None and np.dtype(dtype).name == "bfloat16"


class _Linear(CallListKernel):
    """The layout of scale and zero point over the input, checked once per shape signature."""

    float_input = 0  # the input whose type is the float side (bfloat16 or not)

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.axis = int(info.attr("axis", 1))
        self.block = int(info.attr("block_size", 0) or 0)
        self.where = f"{info.op_type} node '{info.name}'"
        self._layouts: dict[tuple, tuple[int | None, int]] = {}

    def _layout(self, x: Any, s: Any, z: Any) -> tuple[int | None, int]:
        key = (x.shape, s.shape, None if z is None else z.shape)
        layout = self._layouts.get(key)
        if layout is None:
            layout = quantize.param_layout(x.shape, s.shape, self.axis, self.block, self.where)
            if z is not None and z.size != s.size:
                raise ValueError(
                    f"{self.where}: the zero point of shape {list(z.shape)} differs from the "
                    f"scale's {list(s.shape)}"
                )
            self._layouts[key] = layout
        return layout

    def _bf16(self, ctx: KernelContext) -> bool:
        dt = self.info.input_dtype(self.float_input)
        return _is_bf16(dt if dt is not None else ctx.input(self.float_input).dtype)

    def launches(self, ctx: KernelContext) -> list[tuple[Any, tuple]]:
        """Allocate the output; (kernel, arguments) of each part's launch."""
        raise NotImplementedError

    def calls(self, ctx: KernelContext, stream: int | None) -> list[Any]:
        return [self.elementwise(k, args, stream) for k, args in self.launches(ctx)]


class QuantizeLinear(_Linear):
    """QuantizeLinear-10..22 and com.microsoft QuantizeLinear, to an 8- or 16-bit integer."""

    @classmethod
    def claims(cls, node: Any, graph: Any) -> bool:
        out = int(node.attrs.get("output_dtype", 0) or 0)
        if out and np_dtype(out) not in QUANT_TYPES or node.attrs.get("precision"):
            return False
        dts = graph.input_dtypes(node)
        return dts[0] is None or dts[0] == dts[1]  # opset 23 lets them differ: not here

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        out = int(info.attr("output_dtype", 0) or 0)
        zt = info.input_dtype(2) if info.has_input(2) else None
        self.dtype: np.dtype | None = None  # the output type, when the graph says it
        if zt is not None or not info.has_input(2):
            self.dtype = quantize.quantized_dtype(zt, np_dtype(out) if out else None, self.where)
        self.output_dtype = np_dtype(out) if out else None

    def launches(self, ctx: KernelContext) -> list[tuple[Any, tuple]]:
        x, s, z = self.arg(ctx, 0), self.arg(ctx, 1), self.arg(ctx, 2)
        dt = self.dtype
        if dt is None:
            dt = quantize.quantized_dtype(ctx.input(2).dtype, self.output_dtype, self.where)
        layout = self._layout(x, s, z)
        y = self.alloc(ctx, 0, x.shape, dt)
        if y.size == 0:
            return []
        lo, hi = (F32(v) for v in quantize.INT_RANGES[dt.name])
        kernel = QUANTIZE_BF16 if self._bf16(ctx) else QUANTIZE
        zero = dt.type(0)
        return [
            (kernel, (xs, ss, zero if zs is None else zs, lo, hi, ys))
            for xs, ys, ss, zs in quantize.operand_parts(x, y, (s, z), *layout)
        ]


class DequantizeLinear(_Linear):
    """DequantizeLinear-10..22 and com.microsoft DequantizeLinear, to the scale's type."""

    float_input = 1

    @classmethod
    def claims(cls, node: Any, graph: Any) -> bool:
        out = int(node.attrs.get("output_dtype", 0) or 0)  # opset 23
        return not out or np_dtype(out) == graph.input_dtypes(node)[1]

    def launches(self, ctx: KernelContext) -> list[tuple[Any, tuple]]:
        x, s, z = self.arg(ctx, 0), self.arg(ctx, 1), self.arg(ctx, 2)
        dt = self.info.input_dtype(1)
        if dt is None:
            dt = ctx.input(1).dtype
        if z is not None and z.dtype != x.dtype:
            raise ValueError(
                f"{self.where}: the zero point's type {z.dtype} differs from the input's {x.dtype}"
            )
        layout = self._layout(x, s, z)
        y = self.alloc(ctx, 0, x.shape, dt)
        if y.size == 0:
            return []
        kernel = DEQUANTIZE_BF16 if self._bf16(ctx) else DEQUANTIZE
        zero = np.dtype(x.dtype).type(0)
        return [
            (kernel, (xs, zero if zs is None else zs, ss, ys))
            for xs, ys, ss, zs in quantize.operand_parts(x, y, (s, z), *layout)
        ]


class ContribQuantizeLinear(QuantizeLinear):
    """com.microsoft QuantizeLinear: ``axis`` only (no blocks), uint8 without a zero point."""

    @classmethod
    def claims(cls, node: Any, graph: Any) -> bool:
        return not node.attrs.get("block_size")


class ContribDequantizeLinear(DequantizeLinear):
    """com.microsoft DequantizeLinear: ``axis`` only (no blocks)."""

    @classmethod
    def claims(cls, node: Any, graph: Any) -> bool:
        return not node.attrs.get("block_size")


def register(reg: KernelRegistry, enable_cudnn: bool) -> None:
    q, dq = QuantizeLinear, DequantizeLinear
    reg.kernel("QuantizeLinear", since=10, until=22, types={"T1": FLOAT_TYPES, "T2": QUANT_TYPES})(
        q
    )
    # opset 23 names the scale's type T2 and the output's T3 (its attributes: ``claims``)
    qtypes = {"T1": FLOAT_TYPES, "T2": FLOAT_TYPES, "T3": QUANT_TYPES}
    reg.kernel("QuantizeLinear", since=23, until=28, types=qtypes)(q)
    reg.kernel("DequantizeLinear", since=10, until=18, types={"T": DEQUANT_INPUTS})(dq)
    dqtypes = {"T1": DEQUANT_INPUTS, "T2": FLOAT_TYPES}
    reg.kernel("DequantizeLinear", since=19, until=22, types=dqtypes)(dq)
    reg.kernel("DequantizeLinear", since=23, until=28, types={**dqtypes, "T3": FLOAT_TYPES})(dq)
    # the com.microsoft forms have no ONNX schemas: types by input index
    contrib_q = {0: FLOAT_TYPES, 1: FLOAT_TYPES, 2: QUANT_TYPES}
    reg.kernel("QuantizeLinear", domain=MS, since=1, types=contrib_q)(ContribQuantizeLinear)
    contrib_dq = {0: DEQUANT_INPUTS, 1: FLOAT_TYPES}
    reg.kernel("DequantizeLinear", domain=MS, since=1, types=contrib_dq)(ContribDequantizeLinear)
