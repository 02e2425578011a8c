"""CUDA kernels of reductions and ops along an axis: ReduceSum/Mean/Max/Min/Prod/L1/L2/
SumSquare/LogSum/LogSumExp, ArgMax/ArgMin, TopK, CumSum, Softmax/LogSoftmax and Hardmax.

Axes are an attribute before ReduceSum-13 / the others' version 18 and a host input after
(``noop_with_empty_axes``); a reduction over an empty set gives the op's identity (0, 1,
-inf, +inf, NaN for a mean) as onnx specifies. Sums keep integer dtypes; float16 accumulates
in float32 (CuPy's float16 reductions do; the simulation asks numpy to). bfloat16 is reduced
in float32 and rounded once.

Softmax/LogSoftmax are one row kernel each (``_fused.softmax``): opset < 13 coerces the input
to 2-D at ``axis``, 13+ normalizes along ``axis`` (a strided kernel when it is not the last).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from onnxplug.ep import KernelContext, KernelInfo, KernelRegistry, MemType, shapes

from . import _fused as F
from ._base import BF16, FLOATS, NUMERIC, dtypes
from .elementwise import TypedKernel

FLOATS_B = FLOATS + BF16
NUMERIC_B = NUMERIC + BF16
SUM_TYPES = FLOATS_B + dtypes("int32", "int64", "uint32", "uint64")
MINMAX_TYPES = SUM_TYPES + dtypes("int8", "uint8", "bool")
F32 = np.dtype(np.float32)
F16 = np.dtype(np.float16)


def _wide(x: Any) -> Any:
    """float16 as float32 (a new array); other dtypes unchanged."""
    return x.astype(F32) if x.dtype == F16 else x


def _store(xp: Any, out: Any, r: Any) -> None:
    if xp is np:
        with np.errstate(all="ignore"):
            np.copyto(out, r, casting="unsafe")
    else:
        xp.copyto(out, r, casting="unsafe")


def _sum(xp: Any, x: Any, axes: tuple[int, ...], keep: bool, out: Any) -> None:
    if x.dtype == F16 and xp is np:  # numpy would accumulate float16 in float16
        _store(xp, out, np.sum(x, axis=axes, dtype=F32, keepdims=keep))
    else:
        xp.sum(x, axis=axes, dtype=x.dtype, keepdims=keep, out=out)


def _mean(xp: Any, x: Any, axes: tuple[int, ...], keep: bool, out: Any) -> None:
    if x.dtype.kind in "iu":  # integer mean: the sum divided with truncation (C semantics)
        xp.sum(x, axis=axes, dtype=x.dtype, keepdims=keep, out=out)
        count = shapes.size_of(x.shape[a] for a in axes)
        F.INT_DIV(xp, out, x.dtype.type(count), out)
    elif x.dtype == F16 and xp is np:  # numpy would divide the float16-rounded sum
        _store(xp, out, np.mean(x, axis=axes, dtype=F32, keepdims=keep))
    else:  # CuPy's float16 mean sums and divides in float32
        xp.mean(x, axis=axes, keepdims=keep, out=out)


def _prod(xp: Any, x: Any, axes: tuple[int, ...], keep: bool, out: Any) -> None:
    if x.dtype == F16 and xp is np:
        _store(xp, out, np.prod(x, axis=axes, dtype=F32, keepdims=keep))
    else:
        xp.prod(x, axis=axes, dtype=x.dtype, keepdims=keep, out=out)


def _l1(xp: Any, x: Any, axes: tuple[int, ...], keep: bool, out: Any) -> None:
    _sum(xp, xp.absolute(x), axes, keep, out)


def _sumsquare_wide(xp: Any, x: Any, axes: tuple[int, ...], keep: bool) -> Any:
    w = _wide(x)
    return xp.sum(xp.multiply(w, w), axis=axes, dtype=w.dtype, keepdims=keep)


def _l2(xp: Any, x: Any, axes: tuple[int, ...], keep: bool, out: Any) -> None:
    _store(xp, out, xp.sqrt(_sumsquare_wide(xp, x, axes, keep)))


def _sumsquare(xp: Any, x: Any, axes: tuple[int, ...], keep: bool, out: Any) -> None:
    if x.dtype.kind in "iu":
        xp.sum(xp.multiply(x, x), axis=axes, dtype=x.dtype, keepdims=keep, out=out)
    else:
        _store(xp, out, _sumsquare_wide(xp, x, axes, keep))


def _logsum(xp: Any, x: Any, axes: tuple[int, ...], keep: bool, out: Any) -> None:
    w = _wide(x)
    _store(xp, out, xp.log(xp.sum(w, axis=axes, dtype=w.dtype, keepdims=keep)))


def _logsumexp(xp: Any, x: Any, axes: tuple[int, ...], keep: bool, out: Any) -> None:
    w = _wide(x)
    m = xp.amax(w, axis=axes, keepdims=True)
    m = xp.where(xp.isfinite(m), m, w.dtype.type(0))  # all -inf (or inf) rows: no inf - inf
    s = xp.log(xp.sum(xp.exp(w - m), axis=axes, dtype=w.dtype, keepdims=True)) + m
    _store(xp, out, s if keep else s.reshape(out.shape))


def _max(xp: Any, x: Any, axes: tuple[int, ...], keep: bool, out: Any) -> None:
    xp.amax(x, axis=axes, keepdims=keep, out=out)


def _min(xp: Any, x: Any, axes: tuple[int, ...], keep: bool, out: Any) -> None:
    # CuPy 14's amin(out=...) raised TypeError on the H100 (an `equal` ufunc between a CuPy
    # and a host array inside ndarray.min); min through an exact order-reversing map and amax
    # instead: -x for floats (NaN propagates the same), ~x for ints and bool (no overflow).
    if x.dtype.kind == "f":
        xp.amax(-x, axis=axes, keepdims=keep, out=out)
        xp.negative(out, out=out)
    else:
        xp.amax(~x, axis=axes, keepdims=keep, out=out)
        xp.invert(out, out=out)


def _lowest(dt: np.dtype) -> Any:
    if dt == np.bool_:
        return False
    return np.iinfo(dt).min if dt.kind in "iu" else -np.inf


def _highest(dt: np.dtype) -> Any:
    if dt == np.bool_:
        return True
    return np.iinfo(dt).max if dt.kind in "iu" else np.inf


# op -> (reducer(xp, x, axes, keepdims, out), identity of an empty reduction for a dtype)
REDUCERS = {
    "ReduceSum": (_sum, lambda dt: 0),
    "ReduceMean": (_mean, lambda dt: 0 if dt.kind in "iu" else np.nan),
    "ReduceMax": (_max, _lowest),
    "ReduceMin": (_min, _highest),
    "ReduceProd": (_prod, lambda dt: 1),
    "ReduceL1": (_l1, lambda dt: 0),
    "ReduceL2": (_l2, lambda dt: 0),
    "ReduceSumSquare": (_sumsquare, lambda dt: 0),
    "ReduceLogSum": (_logsum, lambda dt: -np.inf),
    "ReduceLogSumExp": (_logsumexp, lambda dt: -np.inf),
}
# the version whose axes became an input
AXES_INPUT_SINCE = {op: 13 if op == "ReduceSum" else 18 for op in REDUCERS}
REDUCE_TYPES = {
    "ReduceMax": MINMAX_TYPES,
    "ReduceMin": MINMAX_TYPES,
    "ReduceLogSum": FLOATS_B,
    "ReduceLogSumExp": FLOATS_B,
}


class Reduce(TypedKernel):
    """A reduction with axes as an optional host input (and ``noop_with_empty_axes``)."""

    op = "ReduceSum"

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.keepdims = bool(info.attr("keepdims", 1))
        self.noop = bool(info.attr("noop_with_empty_axes", 0))
        self.fn, self.identity = REDUCERS[self.op]
        self._plan: tuple[Any, Any] = (None, None)
        const = info.constant_input(1) if info.has_input(1) else None
        # axes from an initializer (the usual case) are read once, not on every run
        self.const_axes = None if const is None else shapes.axes_input(const)

    @staticmethod
    def to_axes(a: Any) -> tuple[int, ...]:
        return tuple(int(v) for v in np.asarray(a).reshape(-1))

    def axes(self, ctx: KernelContext) -> tuple[int, ...] | None:
        if self.const_axes is not None:
            return self.const_axes
        a = ctx.input(1)
        return None if a is None else shapes.axes_input(a)

    def plan(self, ctx: KernelContext, shape: tuple[int, ...]) -> Any:
        """(axes, output shape) for an input shape; None when the op is a no-op."""
        requested = self.axes(ctx)
        key = (shape, requested)
        cached = self._plan
        if cached[0] == key:
            return cached[1]
        axes = shapes.reduce_axes(requested, len(shape), self.noop)
        if axes is None:
            plan = None
        elif self.keepdims:
            plan = (axes, tuple(1 if i in axes else d for i, d in enumerate(shape)))
        else:
            plan = (axes, tuple(d for i, d in enumerate(shape) if i not in axes))
        self._plan = (key, plan)
        return plan

    def compute(self, ctx: KernelContext) -> None:
        xp = self.xp
        x = self.arg(ctx, 0)
        plan = self.plan(ctx, x.shape)
        if plan is None:  # noop_with_empty_axes and no axes: the input itself
            xp.copyto(self.like(ctx, x), x)
            return
        axes, out_shape = plan
        y = self.alloc(ctx, 0, out_shape, self.dtype_of(x))
        if self.bf16:
            t = xp.empty(out_shape, F32)
            self.reduce(xp, F.to_f32(xp, x), axes, t)
            F.from_f32(xp, t, y)
        else:
            self.reduce(xp, x, axes, y)

    def reduce(self, xp: Any, x: Any, axes: tuple[int, ...], out: Any) -> None:
        if x.size == 0:
            if out.size:
                out.fill(self.identity(out.dtype))
            return
        self.fn(xp, x, axes, self.keepdims, out)


class ReduceAttr(Reduce):
    """A reduction with axes as an attribute (no ``noop_with_empty_axes``)."""

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        attr = info.attr("axes")
        self.axes_attr = None if attr is None else self.to_axes(attr)
        self.noop = False

    def axes(self, ctx: KernelContext) -> tuple[int, ...] | None:
        return self.axes_attr


class ArgMax(TypedKernel):
    """ArgMax/ArgMin (the first extreme, or the last with ``select_last_index``), int64."""

    fn = "argmax"

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.axis = int(info.attr("axis", 0))
        self.keepdims = bool(info.attr("keepdims", 1))
        self.last = bool(info.attr("select_last_index", 0))
        self.arg_fn = getattr(self.xp, self.fn)

    def compute(self, ctx: KernelContext) -> None:
        xp = self.xp
        x = self.arg(ctx, 0)
        if self.bf16:
            x = F.to_f32(xp, x)
        axis = shapes.normalize_axis(self.axis, x.ndim)
        shape = list(x.shape)
        if self.keepdims:
            shape[axis] = 1
        else:
            del shape[axis]
        y = self.alloc(ctx, 0, tuple(shape), np.int64)
        if self.last:  # the last of equal extremes: search the reversed axis
            idx = self.arg_fn(xp.flip(x, axis), axis=axis, keepdims=self.keepdims)
            xp.subtract(np.int64(x.shape[axis] - 1), idx, out=y)
        else:
            xp.copyto(y, self.arg_fn(x, axis=axis, keepdims=self.keepdims))


class ArgMin(ArgMax):
    fn = "argmin"


class TopK(TypedKernel):
    """TopK-10+ with k as a host input (TopK-1: attribute), sorted outputs.

    Ties go to the lower index and NaN counts as the largest value, like the CPU provider
    (onnx's reference: a lexsort on (value, index)): a stable ascending argsort, read
    backwards on the reversed axis for the largest values.
    """

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.axis = int(info.attr("axis", -1))
        self.largest = bool(info.attr("largest", 1))
        self.k_attr = info.attr("k")

    def k(self, ctx: KernelContext) -> int:
        if self.k_attr is not None:
            return int(self.k_attr)
        return int(np.asarray(ctx.input(1)).reshape(-1)[0])

    def compute(self, ctx: KernelContext) -> None:
        xp = self.xp
        x = self.arg(ctx, 0)
        k = self.k(ctx)
        axis = shapes.normalize_axis(self.axis, x.ndim)
        n = x.shape[axis]
        if not 0 <= k <= n:
            raise ValueError(f"TopK: k={k} is out of range for axis {axis} of size {n}")
        shape = x.shape[:axis] + (k,) + x.shape[axis + 1 :]
        values = self.alloc(ctx, 0, shape, self.dtype_of(x))
        indices = self.alloc(ctx, 1, shape, np.int64)
        if k == 0 or values.size == 0:
            return
        keys = F.to_f32(xp, x) if self.bf16 else x
        head: list[Any] = [slice(None)] * x.ndim
        if self.largest:
            order = xp.argsort(xp.flip(keys, axis), axis=axis, kind="stable")
            head[axis] = slice(n - 1, n - 1 - k if n - 1 - k >= 0 else None, -1)
            # position j of the reversed axis is index n - 1 - j of x
            xp.subtract(np.int64(n - 1), order[tuple(head)], out=indices)
        else:
            order = xp.argsort(keys, axis=axis, kind="stable")
            head[axis] = slice(0, k)
            xp.copyto(indices, order[tuple(head)])
        xp.copyto(values, xp.take_along_axis(x, indices, axis=axis))


class CumSum(TypedKernel):
    """CumSum-11+ with the axis as a host input; ``exclusive`` and ``reverse``."""

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.exclusive = bool(info.attr("exclusive", 0))
        self.reverse = bool(info.attr("reverse", 0))

    def compute(self, ctx: KernelContext) -> None:
        xp = self.xp
        x = self.arg(ctx, 0)
        a = np.asarray(ctx.input(1))
        if a.size != 1:
            raise ValueError(f"CumSum: axis must be a scalar, got shape {a.shape}")
        axis = shapes.normalize_axis(int(a.reshape(-1)[0]), x.ndim)
        y = self.alloc(ctx, 0, x.shape, x.dtype)
        if x.size == 0:
            return
        if not self.exclusive and not self.reverse:
            xp.cumsum(x, axis=axis, dtype=x.dtype, out=y)
            return
        src = xp.flip(x, axis) if self.reverse else x
        dst = xp.flip(y, axis) if self.reverse else y
        if not self.exclusive:
            dst[...] = xp.cumsum(src, axis=axis, dtype=x.dtype)
            return
        n = x.shape[axis]
        first: list[Any] = [slice(None)] * x.ndim
        rest: list[Any] = [slice(None)] * x.ndim
        head: list[Any] = [slice(None)] * x.ndim
        first[axis], rest[axis], head[axis] = slice(0, 1), slice(1, n), slice(0, n - 1)
        dst[tuple(first)] = 0
        if n > 1:
            dst[tuple(rest)] = xp.cumsum(src[tuple(head)], axis=axis, dtype=x.dtype)


class Softmax(TypedKernel):
    """Softmax-13+ (``log``: LogSoftmax) along ``axis``: one row kernel."""

    log = False
    default_axis = -1

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.axis = int(info.attr("axis", self.default_axis))
        dt = self.in_dtype
        self.key = F.storage_key(dt) if dt is not None else None
        self._plan: tuple[Any, Any] = (None, None)

    def geometry(self, shape: tuple[int, ...]) -> tuple[int, int, int]:
        """(outer, n, inner): x viewed as (outer, n, inner), normalized over n."""
        axis = shapes.normalize_axis(self.axis, len(shape))
        return shapes.size_of(shape[:axis]), shape[axis], shapes.size_of(shape[axis + 1 :])

    def compute(self, ctx: KernelContext) -> None:
        x = self.arg(ctx, 0)
        cached = self._plan
        if cached[0] == x.shape:
            geo = cached[1]
        else:
            geo = self.geometry(x.shape) if x.ndim else (1, 1, 1)
            self._plan = (x.shape, geo)
        key = self.key or F.storage_key(x.dtype)
        y = self.like(ctx, x)
        F.softmax(self.xp, x, y, geo[0], geo[1], geo[2], key, self.log)

    def prepare(self, ctx: KernelContext) -> Any:
        x = self.arg(ctx, 0)
        geo = self.geometry(x.shape) if x.ndim else (1, 1, 1)
        y = self.like(ctx, x)
        key = self.key or F.storage_key(x.dtype)
        return F.softmax_call(
            self.xp, x, y, geo[0], geo[1], geo[2], key, self.log, self.stream_handle(ctx)
        )


class Softmax1(Softmax):
    """Softmax-1..12: x coerced to 2-D at ``axis`` (default 1), rows normalized."""

    default_axis = 1

    def geometry(self, shape: tuple[int, ...]) -> tuple[int, int, int]:
        rows, cols = shapes.coerced_2d(shape, self.axis)
        return rows, cols, 1


class LogSoftmax(Softmax):
    log = True


class LogSoftmax1(Softmax1):
    log = True


class Hardmax(TypedKernel):
    """Hardmax-13+ along ``axis``: 1 at the first maximum, 0 elsewhere."""

    coerce = False
    default_axis = -1

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.axis = int(info.attr("axis", self.default_axis))

    def compute(self, ctx: KernelContext) -> None:
        xp = self.xp
        x = self.arg(ctx, 0)
        y = self.like(ctx, x)
        if x.size == 0:
            return
        if self.coerce:
            rows, cols = shapes.coerced_2d(x.shape, self.axis)
            xs, ys, axis = x.reshape(rows, cols), y.reshape(rows, cols), 1
        else:
            axis = shapes.normalize_axis(self.axis, x.ndim)
            xs, ys = x, y
        if self.bf16:  # compare as float32; write bfloat16 bits (1.0 is 0x3F80)
            xs, ys, one = F.to_f32(xp, xs), ys.view(np.uint16), np.uint16(0x3F80)
        else:
            one = ys.dtype.type(1)
        idx = xp.argmax(xs, axis=axis, keepdims=True)
        ys.fill(0)
        xp.put_along_axis(ys, idx, one, axis=axis)


class Hardmax1(Hardmax):
    coerce = True
    default_axis = 1


def register(reg: KernelRegistry, enable_cudnn: bool) -> None:
    for op, since in AXES_INPUT_SINCE.items():
        types = {"T": REDUCE_TYPES.get(op, SUM_TYPES)}
        reg.kernel(op, since=1, until=since - 1, types=types)(
            type(op + "Attr", (ReduceAttr,), {"op": op})
        )
        reg.kernel(op, since=since, types=types, input_memory={1: MemType.CPU_INPUT})(
            type(op, (Reduce,), {"op": op})
        )
    reg.kernel("ArgMax", since=1, types={"T": NUMERIC_B})(ArgMax)
    reg.kernel("ArgMin", since=1, types={"T": NUMERIC_B})(ArgMin)
    reg.kernel("TopK", since=1, until=9, types={"T": NUMERIC_B})(TopK)
    reg.kernel("TopK", since=10, types={"T": NUMERIC_B}, input_memory={1: MemType.CPU_INPUT})(TopK)
    reg.kernel(
        "CumSum",
        since=11,
        types={"T": FLOATS + dtypes("int32", "int64", "uint32", "uint64")},
        input_memory={1: MemType.CPU_INPUT},
    )(CumSum)
    reg.kernel("Softmax", since=1, until=12, types={"T": FLOATS_B})(Softmax1)
    reg.kernel("Softmax", since=13, types={"T": FLOATS_B})(Softmax)
    reg.kernel("LogSoftmax", since=1, until=12, types={"T": FLOATS_B})(LogSoftmax1)
    reg.kernel("LogSoftmax", since=13, types={"T": FLOATS_B})(LogSoftmax)
    reg.kernel("Hardmax", since=1, until=12, types={"T": FLOATS_B})(Hardmax1)
    reg.kernel("Hardmax", since=13, types={"T": FLOATS_B})(Hardmax)
