"""One-node QuantizeLinear/DequantizeLinear models (ONNX and com.microsoft forms) with their
feeds, for the tests that compare providers (tests/test_cuda_quantize.py on the simulated CUDA
device and against onnxruntime, tests/gpu/test_cuda_quantize.py on a GPU).

Every input is a graph input (nothing is folded at load, and the prepared runs see new values).
The x values are multiples of 1/4 quantized with power-of-two scales, so that many quotients
are exact ties (rounded half to even), plus the edge values: beyond the integer range, beyond
int32's range, infinities, NaN and negative zero. Zero points include negative ones.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
from onnx import helper

MS = "com.microsoft"
BF16 = np.dtype(ml_dtypes.bfloat16)
EDGES = [2.5, -2.5, 3.5, -3.5, 0.5, -0.5, 1e10, -1e10, np.inf, -np.inf, np.nan, -0.0, 300.0]
RNG = np.random.default_rng(11)


def _x(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    x = RNG.integers(-1200, 1200, shape).astype(np.float64) / 4
    flat = x.reshape(-1)
    flat[: min(len(EDGES), flat.size)] = EDGES[: flat.size]
    with np.errstate(over="ignore"):  # 1e10 is inf in float16, as intended
        return x.astype(dtype)


def _scales(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    return np.asarray(2.0 ** RNG.integers(-3, 3, shape)).astype(dtype)


def _zero_points(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    lo, hi = (0, 40) if np.dtype(dtype).kind == "u" else (-40, 40)
    return np.asarray(RNG.integers(lo, hi, shape)).astype(dtype)


def model(
    op: str, feeds: dict[str, np.ndarray], opset: int, domain: str = "", **attrs: Any
) -> bytes:
    """A one-node model (node "n") whose inputs are ``feeds`` in order ("" skips one)."""
    node = helper.make_node(op, list(feeds), ["y"], name="n", domain=domain, **attrs)
    inputs = [
        helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
        for k, v in feeds.items()
        if k
    ]
    graph = helper.make_graph([node], "g", inputs, [helper.make_empty_tensor_value_info("y")])
    imports = [helper.make_opsetid("", opset)] + (
        [helper.make_opsetid(domain, 1)] if domain else []
    )
    return helper.make_model(graph, opset_imports=imports).SerializeToString()


def _layout_shapes(x_shape: tuple, layout: str) -> tuple[tuple, dict]:
    """(scale shape, attributes) of a layout: tensor, axis (1), last (axis -1), block2 (a
    partial last block along the last axis), block4 (whole blocks along axis 1)."""
    if layout == "tensor":
        return (), {}
    if layout == "axis":
        return (x_shape[1],), {"axis": 1}
    if layout == "last":
        return (x_shape[-1],), {"axis": -1}
    if layout == "block2":
        return (*x_shape[:-1], -(-x_shape[-1] // 2)), {"axis": -1, "block_size": 2}
    assert layout == "block4"
    return (x_shape[0], x_shape[1] // 4, *x_shape[2:]), {"axis": 1, "block_size": 4}


Case = tuple[bytes, dict[str, np.ndarray]]


def quantize_case(xdt: Any, qdt: Any, layout: str, zp: bool = True, opset: int = 21) -> Case:
    shape = (3, 8, 5)
    s_shape, attrs = _layout_shapes(shape, layout)
    feeds = {"x": _x(shape, xdt), "s": _scales(s_shape, xdt)}
    if zp:
        feeds["z"] = _zero_points(s_shape, qdt)
    elif np.dtype(qdt) != np.uint8:
        attrs["output_dtype"] = helper.np_dtype_to_tensor_dtype(np.dtype(qdt))
    return model("QuantizeLinear", feeds, opset, **attrs), feeds


def dequantize_case(xdt: Any, sdt: Any, layout: str, zp: bool = True, opset: int = 21) -> Case:
    shape = (3, 8, 5)
    s_shape, attrs = _layout_shapes(shape, layout)
    info = np.iinfo(xdt)
    lo, hi = max(info.min, -(2**20)), min(info.max, 2**20)
    feeds = {"x": RNG.integers(lo, hi, shape, endpoint=True).astype(xdt)}
    feeds["x"].reshape(-1)[:2] = (info.min, info.max)
    feeds["s"] = (_scales(s_shape, np.float32) * 1.37).astype(sdt)
    if zp:
        feeds["z"] = (
            _zero_points(s_shape, xdt) if np.dtype(xdt) != np.int32 else np.zeros(s_shape, xdt)
        )
    return model("DequantizeLinear", feeds, opset, **attrs), feeds


def contrib_case(op: str, xdt: Any, other: Any, per_axis: bool) -> Case:
    """com.microsoft QuantizeLinear (x xdt, zero point ``other``) or DequantizeLinear (x xdt,
    scale ``other``), per tensor or along axis 1."""
    shape = (2, 6, 4)
    s_shape = (6,) if per_axis else ()
    attrs = {"axis": 1} if per_axis else {}
    if op == "QuantizeLinear":
        feeds = {"x": _x(shape, xdt), "s": _scales(s_shape, xdt), "z": _zero_points(s_shape, other)}
    else:
        info = np.iinfo(xdt)
        feeds = {
            "x": RNG.integers(info.min, info.max, shape, endpoint=True).astype(xdt),
            "s": (_scales(s_shape, np.float32) * 0.7).astype(other),
            "z": _zero_points(s_shape, xdt),
        }
    return model(op, feeds, 19, domain=MS, **attrs), feeds


QUANT_OUT = [np.int8, np.uint8, np.int16, np.uint16]
LAYOUTS = ["tensor", "axis", "last", "block2", "block4"]
BLOCKED = {"block2", "block4"}


def all_cases() -> dict[str, Case]:
    """Every case by id: each float type to each integer type per layout, without a zero
    point, the old opsets, each integer type to each float type, and the contrib forms."""
    cases: dict[str, Case] = {}
    for xdt in (np.float32, np.float16, BF16):
        for qdt in QUANT_OUT:
            for layout in LAYOUTS:
                name = f"q_{np.dtype(xdt).name}_{np.dtype(qdt).name}_{layout}"
                cases[name] = quantize_case(xdt, qdt, layout)
    for qdt in (np.uint8, np.int16):
        cases[f"q_nozp_{np.dtype(qdt).name}"] = quantize_case(np.float32, qdt, "axis", zp=False)
    cases["q_opset10"] = quantize_case(np.float32, np.uint8, "tensor", opset=10)
    cases["q_opset13_axis"] = quantize_case(np.float32, np.int8, "axis", opset=13)
    cases["q_opset19_f16"] = quantize_case(np.float16, np.int8, "last", opset=19)
    cases["q_opset25_block"] = quantize_case(np.float16, np.int8, "block2", opset=25)
    for xdt in (np.int8, np.uint8, np.int16, np.uint16, np.int32):
        for sdt in (np.float32, np.float16, BF16):
            for layout in LAYOUTS:
                name = f"dq_{np.dtype(xdt).name}_{np.dtype(sdt).name}_{layout}"
                cases[name] = dequantize_case(xdt, sdt, layout)
    cases["dq_nozp_int8"] = dequantize_case(np.int8, np.float32, "axis", zp=False)
    cases["dq_opset10"] = dequantize_case(np.uint8, np.float32, "tensor", opset=10)
    cases["dq_opset13_axis"] = dequantize_case(np.int8, np.float32, "axis", opset=13)
    cases["dq_opset25_block"] = dequantize_case(np.int8, np.float16, "block2", opset=25)
    for xdt in (np.float32, np.float16):
        for qdt in QUANT_OUT:
            for per_axis in (False, True):
                name = f"ms_q_{np.dtype(xdt).name}_{np.dtype(qdt).name}_{'axis' if per_axis else 'tensor'}"
                cases[name] = contrib_case("QuantizeLinear", xdt, qdt, per_axis)
    for xdt in QUANT_OUT:
        for sdt in (np.float32, np.float16):
            for per_axis in (False, True):
                name = f"ms_dq_{np.dtype(xdt).name}_{np.dtype(sdt).name}_{'axis' if per_axis else 'tensor'}"
                cases[name] = contrib_case("DequantizeLinear", xdt, sdt, per_axis)
    return cases
