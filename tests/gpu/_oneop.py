"""One-node models run on the CUDA provider and on the CPU provider, for the GPU tests of the
elementwise, reduction and normalization kernels (test_cuda_elementwise.py,
test_cuda_reduce_norm.py)."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from tests.gpu._cuda import CUDA, run_cuda_and_cpu

BF16: Any = np.dtype(ml_dtypes.bfloat16)

ELEM = {
    np.dtype(np.float32): TensorProto.FLOAT,
    np.dtype(np.float16): TensorProto.FLOAT16,
    np.dtype(np.float64): TensorProto.DOUBLE,
    BF16: TensorProto.BFLOAT16,
    np.dtype(np.int8): TensorProto.INT8,
    np.dtype(np.int16): TensorProto.INT16,
    np.dtype(np.int32): TensorProto.INT32,
    np.dtype(np.int64): TensorProto.INT64,
    np.dtype(np.uint8): TensorProto.UINT8,
    np.dtype(np.uint16): TensorProto.UINT16,
    np.dtype(np.uint32): TensorProto.UINT32,
    np.dtype(np.uint64): TensorProto.UINT64,
    np.dtype(np.bool_): TensorProto.BOOL,
}
FLOATS = [np.float32, np.float16, np.float64, BF16]


def ids(v: Any) -> str:
    return np.dtype(v).name if isinstance(v, (type, np.dtype)) else str(v)


def model(
    op: str,
    feeds: dict[str, np.ndarray],
    inits: dict[str, np.ndarray] | None = None,
    outputs: tuple[str, ...] = ("y",),
    opset: int = 22,
    order: list[str] | None = None,
    out_types: tuple[int, ...] = (),
    **attrs: Any,
) -> bytes:
    """A one-node model (node "n"): ``feeds`` are graph inputs, ``inits`` initializers, and
    the node's inputs are ``order`` (default: the feeds then the initializers); outputs have
    the element types ``out_types`` (default: left to inference)."""
    inits = inits or {}
    names = order if order is not None else [*feeds, *inits]
    node = helper.make_node(op, names, list(outputs), name="n", **attrs)
    inputs = [helper.make_tensor_value_info(k, ELEM[v.dtype], v.shape) for k, v in feeds.items()]
    types = list(out_types) + [None] * (len(outputs) - len(out_types))
    outs = [
        helper.make_tensor_value_info(o, t, None) if t else helper.make_empty_tensor_value_info(o)
        for o, t in zip(outputs, types, strict=True)
    ]
    g = helper.make_graph(
        [node], "g", inputs, outs, [numpy_helper.from_array(v, k) for k, v in inits.items()]
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)]).SerializeToString()


def check(
    op: str,
    feeds: dict[str, np.ndarray],
    tols: dict[str, tuple[float, float]],
    on: str = "",
    tol: str = "",
    **kw: Any,
) -> list[np.ndarray]:
    """Run ``op`` (``model(op, feeds, **kw)``) on [CUDA, CPU] and on CPU alone: the node must
    run on ``on`` (default CUDA) and the outputs agree: exactly for dtypes not in ``tols``
    (dtype name -> (rtol, atol)), else within the tolerance of their dtype (or of ``tol``)."""
    refused = _not_admitted(op, feeds, kw.get("opset", 22))
    if refused:
        # the op's schema at this opset refuses the type: the model is invalid (onnxruntime
        # refuses it too), so there is nothing to compare; a test made only of such checks
        # is skipped
        if not CHECKS_RUN:
            pytest.skip(refused)
        return []
    CHECKS_RUN.append(op)
    got, ref, where = run_cuda_and_cpu(model(op, feeds, **kw), feeds)
    assert where["n"] == (on or CUDA), where
    assert len(got) == len(ref)
    for g, r in zip(got, ref, strict=True):
        assert g.shape == r.shape and g.dtype == r.dtype, (g.shape, r.shape, g.dtype, r.dtype)
        if r.dtype.name not in tols:
            np.testing.assert_array_equal(g, r)
            continue
        rtol, atol = tols[tol or r.dtype.name]
        np.testing.assert_allclose(
            g.astype(np.float64), r.astype(np.float64), rtol=rtol, atol=atol, equal_nan=True
        )
    return got


CHECKS_RUN: list[str] = []  # the checks of the running test that ran (reset per test)


def _not_admitted(op: str, feeds: Any, opset: int) -> str:
    """Why ``op`` at ``opset`` refuses the element type of one of its inputs (feeds in node
    input order; '' if it admits them all)."""
    import onnx

    items = feeds.items() if isinstance(feeds, dict) else [(f[0], f[1]) for f in feeds]
    try:
        schema = onnx.defs.get_schema(op, opset, "")
    except Exception:
        return ""
    allowed = {c.type_param_str: c.allowed_type_strs for c in schema.type_constraints}
    formal = schema.inputs
    for k, (name, value) in enumerate(items):
        if not formal or not hasattr(value, "dtype") or value.dtype not in ELEM:
            continue
        param = formal[min(k, len(formal) - 1)].type_str
        types = allowed.get(param)
        if types is None:
            continue
        elem = helper.tensor_dtype_to_string(ELEM[value.dtype]).split(".")[-1].lower()
        if f"tensor({elem})" not in types:
            return (
                f"{op}-{schema.since_version} does not admit tensor({elem}) for input {k} "
                f"'{name}' (the model is invalid)"
            )
    return ""


def rand(shape: tuple[int, ...], dtype: Any, lo: float = -3.0, hi: float = 3.0, seed: int = 0):
    """Uniform values in [lo, hi) (integers: whole numbers in that range) of ``dtype``."""
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    if dt == np.bool_:
        return rng.random(shape) < 0.5
    v = rng.uniform(lo, hi, shape)
    if dt.kind in "iu":
        return np.floor(v).astype(dt)
    return v.astype(np.float32).astype(dt) if dt == BF16 else v.astype(dt)
