"""Reduction CPU kernels: ReduceSum/Mean/Max/Min/Prod (and the L1, L2, SumSquare, LogSum,
LogSumExp family), ArgMax and ArgMin.

Axes are an attribute before ReduceSum-13 / the others' version 18, an optional input after
(with ``noop_with_empty_axes``). Reducing an empty set gives the reduction's identity
(0, 1, -inf, +inf) as onnx specifies. Sums never change an integer dtype (numpy widens int32
sums to int64 by default) and half-precision floats accumulate in float32.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from onnxplug.ep import Kernel, KernelContext, KernelInfo, KernelRegistry, shapes

from ._util import quiet, wide


def _lowest(dtype: np.dtype):
    if dtype == np.bool_:
        return False
    return np.iinfo(dtype).min if dtype.kind in "iu" else -np.inf


def _highest(dtype: np.dtype):
    if dtype == np.bool_:
        return True
    return np.iinfo(dtype).max if dtype.kind in "iu" else np.inf


def _sum(x: np.ndarray, axes: tuple[int, ...], keep: bool) -> np.ndarray:
    if x.dtype.kind in "iub":
        return np.sum(x, axis=axes, keepdims=keep, dtype=x.dtype)
    return np.sum(wide(x), axis=axes, keepdims=keep)


def _count(x: np.ndarray, axes: tuple[int, ...]) -> int:
    return shapes.size_of(x.shape[a] for a in axes)


# op -> f(x, axes, keepdims); results are cast back to x's dtype by the kernel
REDUCERS = {
    "ReduceSum": _sum,
    "ReduceMean": lambda x, a, k: (
        np.mean(x, axis=a, keepdims=k, dtype=x.dtype)
        if x.dtype.kind in "iu"
        else np.divide(_sum(x, a, k), _count(x, a))
    ),
    "ReduceMax": lambda x, a, k: np.max(x, axis=a, keepdims=k, initial=_lowest(x.dtype)),
    "ReduceMin": lambda x, a, k: np.min(x, axis=a, keepdims=k, initial=_highest(x.dtype)),
    "ReduceProd": lambda x, a, k: np.prod(
        x if x.dtype.kind in "iu" else wide(x),
        axis=a,
        keepdims=k,
        dtype=x.dtype if x.dtype.kind in "iu" else None,
    ),
    "ReduceL1": lambda x, a, k: _sum(np.abs(x), a, k),
    "ReduceL2": lambda x, a, k: np.sqrt(_sum(np.square(wide(x)), a, k)),
    "ReduceSumSquare": lambda x, a, k: _sum(
        np.square(wide(x)) if x.dtype.kind == "f" else x * x, a, k
    ),
    "ReduceLogSum": lambda x, a, k: np.log(_sum(x, a, k)),
    "ReduceLogSumExp": lambda x, a, k: _logsumexp(wide(x), a, k),
}
# the version whose axes became an input
AXES_INPUT_SINCE = {op: 13 if op == "ReduceSum" else 18 for op in REDUCERS}


def _logsumexp(x: np.ndarray, axes: tuple[int, ...], keep: bool) -> np.ndarray:
    m = np.max(x, axis=axes, keepdims=True, initial=-np.inf)
    m = np.where(np.isfinite(m), m, 0)
    s = np.log(np.sum(np.exp(x - m), axis=axes, keepdims=True)) + m
    return s if keep else np.squeeze(s, axis=axes)


class Reduce(Kernel):
    """A reduction with axes as an optional input (and ``noop_with_empty_axes``)."""

    op = "ReduceSum"

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.keepdims = bool(info.attr("keepdims", 1))
        self.noop = bool(info.attr("noop_with_empty_axes", 0))
        self.fn = REDUCERS[self.op]

    def axes(self, ctx: KernelContext) -> list[int] | None:
        a = ctx.input(1)
        return None if a is None else list(shapes.axes_input(a))

    def compute(self, ctx: KernelContext) -> None:
        x = ctx.input(0)
        axes = shapes.reduce_axes(self.axes(ctx), x.ndim, self.noop)
        if axes is None:
            ctx.set_output(0, x)
            return
        with quiet():
            y = self.fn(x, axes, self.keepdims)
        ctx.set_output(0, np.asarray(y).astype(x.dtype, copy=False))


class ReduceAttr(Reduce):
    """A reduction with axes as an attribute (no ``noop_with_empty_axes``)."""

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.axes_attr = info.attr("axes")
        self.noop = False

    def axes(self, ctx: KernelContext) -> list[int] | None:
        return self.axes_attr


class ArgMax(Kernel):
    fn: Callable[..., Any] = staticmethod(np.argmax)

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.axis = int(info.attr("axis", 0))
        self.keepdims = bool(info.attr("keepdims", 1))
        self.last = bool(info.attr("select_last_index", 0))

    def compute(self, ctx: KernelContext) -> None:
        x = ctx.input(0)
        axis = shapes.normalize_axis(self.axis, x.ndim)
        if self.last:  # the last of equal extremes: search the reversed axis
            idx = x.shape[axis] - 1 - self.fn(np.flip(x, axis), axis=axis, keepdims=self.keepdims)
        else:
            idx = self.fn(x, axis=axis, keepdims=self.keepdims)
        ctx.set_output(0, np.asarray(idx, dtype=np.int64))


class ArgMin(ArgMax):
    fn = staticmethod(np.argmin)


def register(registry: KernelRegistry) -> None:
    for op, since in AXES_INPUT_SINCE.items():
        registry.kernel(op, since=1, until=since - 1)(type(op + "Attr", (ReduceAttr,), {"op": op}))
        registry.kernel(op, since=since)(type(op, (Reduce,), {"op": op}))
    registry.kernel("ArgMax", since=1)(ArgMax)
    registry.kernel("ArgMin", since=1)(ArgMin)
