"""ONNX element types and value types, and their numpy (ml_dtypes) equivalents.

One table maps every ``TensorProto.DataType`` to a numpy dtype, so that bfloat16, the float8
family, int4/uint4, float4 and the rest round-trip through the runtime as ml_dtypes arrays.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np
from onnx import TensorProto, TypeProto

_T = TensorProto

# elem_type -> (onnx type string, numpy dtype or None when numpy has no equivalent)
_ELEM_TYPES: dict[int, tuple[str, Any]] = {
    _T.FLOAT: ("float", np.dtype(np.float32)),
    _T.UINT8: ("uint8", np.dtype(np.uint8)),
    _T.INT8: ("int8", np.dtype(np.int8)),
    _T.UINT16: ("uint16", np.dtype(np.uint16)),
    _T.INT16: ("int16", np.dtype(np.int16)),
    _T.INT32: ("int32", np.dtype(np.int32)),
    _T.INT64: ("int64", np.dtype(np.int64)),
    _T.STRING: ("string", np.dtype(object)),
    _T.BOOL: ("bool", np.dtype(np.bool_)),
    _T.FLOAT16: ("float16", np.dtype(np.float16)),
    _T.DOUBLE: ("double", np.dtype(np.float64)),
    _T.UINT32: ("uint32", np.dtype(np.uint32)),
    _T.UINT64: ("uint64", np.dtype(np.uint64)),
    _T.COMPLEX64: ("complex64", np.dtype(np.complex64)),
    _T.COMPLEX128: ("complex128", np.dtype(np.complex128)),
    _T.BFLOAT16: ("bfloat16", np.dtype(ml_dtypes.bfloat16)),
    _T.FLOAT8E4M3FN: ("float8e4m3fn", np.dtype(ml_dtypes.float8_e4m3fn)),
    _T.FLOAT8E4M3FNUZ: ("float8e4m3fnuz", np.dtype(ml_dtypes.float8_e4m3fnuz)),
    _T.FLOAT8E5M2: ("float8e5m2", np.dtype(ml_dtypes.float8_e5m2)),
    _T.FLOAT8E5M2FNUZ: ("float8e5m2fnuz", np.dtype(ml_dtypes.float8_e5m2fnuz)),
    _T.UINT4: ("uint4", np.dtype(ml_dtypes.uint4)),
    _T.INT4: ("int4", np.dtype(ml_dtypes.int4)),
    _T.FLOAT4E2M1: ("float4e2m1", np.dtype(ml_dtypes.float4_e2m1fn)),
}
for _name, _attr, _ml in (
    ("FLOAT8E8M0", "float8e8m0", "float8_e8m0fnu"),
    ("UINT2", "uint2", "uint2"),
    ("INT2", "int2", "int2"),
    ("FLOAT6E2M3", "float6e2m3", "float6_e2m3fn"),
    ("FLOAT6E3M2", "float6e3m2", "float6_e3m2fn"),
):
    if hasattr(_T, _name):
        _ELEM_TYPES[getattr(_T, _name)] = (
            _attr,
            np.dtype(getattr(ml_dtypes, _ml)) if hasattr(ml_dtypes, _ml) else None,
        )

_NP_TO_ELEM: dict[np.dtype, int] = {}
for _code, (_s, _dt) in _ELEM_TYPES.items():
    if _dt is not None and _dt not in _NP_TO_ELEM:
        _NP_TO_ELEM[_dt] = _code
_NP_TO_ELEM[np.dtype(object)] = _T.STRING
_STR_TO_ELEM = {s: code for code, (s, _) in _ELEM_TYPES.items()}


def np_dtype(elem_type: int) -> np.dtype:
    """numpy dtype of an ONNX element type; raises ValueError for an unknown or unmapped type."""
    entry = _ELEM_TYPES.get(elem_type)
    if entry is None or entry[1] is None:
        raise ValueError(f"unsupported ONNX element type {elem_type}")
    return entry[1]


def elem_type_of(dtype: Any) -> int:
    """ONNX element type of a numpy dtype (accepts ml_dtypes dtypes and numpy string dtypes)."""
    dt = np.dtype(dtype)
    code = _NP_TO_ELEM.get(dt)
    if code is None:
        if dt.kind in ("U", "S"):
            return _T.STRING
        raise ValueError(f"numpy dtype {dt} has no ONNX element type")
    return code


def elem_type_name(elem_type: int) -> str:
    entry = _ELEM_TYPES.get(elem_type)
    return entry[0] if entry else f"undefined({elem_type})"


def elem_type_from_name(name: str) -> int:
    """'float' or 'tensor(float)' -> TensorProto.FLOAT."""
    if name.startswith("tensor(") and name.endswith(")"):
        name = name[7:-1]
    try:
        return _STR_TO_ELEM[name]
    except KeyError:
        raise ValueError(f"unknown element type name {name!r}") from None


def tensor_type_str(dtype: Any) -> str:
    """'tensor(float)' for float32 and so on (onnxruntime's NodeArg.type strings)."""
    return f"tensor({elem_type_name(elem_type_of(dtype))})"


def all_elem_types() -> list[int]:
    return [code for code, (_, dt) in _ELEM_TYPES.items() if dt is not None]


@dataclass(frozen=True)
class ValueType:
    """The ONNX type of a graph value: tensor, sequence, optional, map or sparse tensor.

    ``shape`` holds ints for fixed dims, strings for symbolic dims and None for unknown ones;
    ``shape is None`` means the rank is unknown.
    """

    kind: str  # "tensor" | "sequence" | "optional" | "map" | "sparse_tensor" | "unknown"
    elem_type: int = 0
    shape: tuple[int | str | None, ...] | None = None
    inner: ValueType | None = None  # element type of sequence / optional / map value
    key_type: int = 0

    def type_str(self) -> str:
        if self.kind in ("tensor", "sparse_tensor"):
            return f"{self.kind}({elem_type_name(self.elem_type)})"
        if self.kind in ("sequence", "optional") and self.inner is not None:
            return f"{'seq' if self.kind == 'sequence' else 'optional'}({self.inner.type_str()})"
        if self.kind == "map" and self.inner is not None:
            return f"map({elem_type_name(self.key_type)},{self.inner.type_str()})"
        return self.kind

    @staticmethod
    def from_proto(tp: TypeProto) -> ValueType:
        which = tp.WhichOneof("value")
        if which == "tensor_type" or which == "sparse_tensor_type":
            tt = tp.tensor_type if which == "tensor_type" else tp.sparse_tensor_type
            shape: tuple[int | str | None, ...] | None = None
            if tt.HasField("shape"):
                dims: list[int | str | None] = []
                for d in tt.shape.dim:
                    # a negative dim_value (PaddlePaddle and other exporters write -1) is an
                    # unknown dim, as in onnxruntime
                    if d.HasField("dim_value") and d.dim_value >= 0:
                        dims.append(int(d.dim_value))
                    elif d.HasField("dim_param") and d.dim_param:
                        dims.append(d.dim_param)
                    else:
                        dims.append(None)
                shape = tuple(dims)
            return ValueType(
                "tensor" if which == "tensor_type" else "sparse_tensor", tt.elem_type, shape
            )
        if which == "sequence_type":
            return ValueType("sequence", inner=ValueType.from_proto(tp.sequence_type.elem_type))
        if which == "optional_type":
            return ValueType("optional", inner=ValueType.from_proto(tp.optional_type.elem_type))
        if which == "map_type":
            return ValueType(
                "map",
                key_type=tp.map_type.key_type,
                inner=ValueType.from_proto(tp.map_type.value_type),
            )
        return ValueType("unknown")


def shape_text(shape: Any) -> str:
    """A shape for a message: sizes, names of symbolic dims, '?' for unknown ones."""
    if shape is None:
        return "unknown"
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"
