"""Helpers the native CPU kernel modules share (not a kernel module: nothing to register)."""

from __future__ import annotations

from typing import Any

import numpy as np

from onnxplug.ep import Fail


def wide(x: np.ndarray) -> np.ndarray:
    """``x`` in a dtype that is at least float32 (float16/bfloat16 are widened): half-precision
    math is done in float32 and rounded once, as onnxruntime's MLAS does."""
    return x.astype(np.float32) if x.dtype.itemsize < 4 and x.dtype.kind not in "iub" else x


def quiet() -> np.errstate:
    """IEEE results (nan, inf, wrap-around) are the answer, as in onnxruntime: no numpy
    warnings. (An errstate cannot be entered twice: a fresh one per use.)"""
    return np.errstate(all="ignore")


def ints(v: Any) -> list[int]:
    """An int64 tensor input (or an attribute list) as Python ints."""
    return [int(x) for x in np.asarray(v).reshape(-1)]


def frozen(a: np.ndarray) -> np.ndarray:
    """``a`` made read-only: a value a kernel hands out on every run must not be modified."""
    a.flags.writeable = False
    return a


def check_spatial_input(x: np.ndarray, op: str, error: type[Exception] = Fail) -> None:
    """Pooling and convolution need data: only the batch may be empty (onnxruntime's
    "Invalid input shape", a Fail from its pools and an InvalidArgument from its Conv)."""
    if x.ndim < 3 or (x.size == 0 and x.shape[0] != 0):
        raise error(f"{op}: Invalid input shape. Only N can be zero. Got: {list(x.shape)}")
