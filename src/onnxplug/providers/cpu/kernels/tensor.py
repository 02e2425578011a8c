"""Tensor manipulation CPU kernels: reshapes, transposes, joins and splits, slicing and
indexing, shape queries, broadcasting, padding, constants, Identity and Dropout.

Shape arithmetic comes from ``onnxplug.ep.shapes`` (shared with other providers). Reshape-like
kernels return numpy views: no kernel writes into its inputs, so aliasing is safe and saves
a copy per node.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np

from onnxplug.ep import (
    InvalidArgument,
    Kernel,
    KernelContext,
    KernelInfo,
    KernelRegistry,
    node_seed,
    shapes,
)

from ._util import frozen, ints


def optional_ints(ctx: KernelContext, index: int) -> list[int] | None:
    v = ctx.input(index)
    return None if v is None else ints(v)


class Identity(Kernel):
    def compute(self, ctx: KernelContext) -> None:
        ctx.set_output(0, ctx.input(0))


class Reshape(Kernel):
    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.allowzero = bool(info.attr("allowzero", 0))

    def compute(self, ctx: KernelContext) -> None:
        x = ctx.input(0)
        ctx.set_output(
            0, x.reshape(shapes.reshape_shape(x.shape, ints(ctx.input(1)), self.allowzero))
        )


class Flatten(Kernel):
    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.axis = int(info.attr("axis", 1))

    def compute(self, ctx: KernelContext) -> None:
        x = ctx.input(0)
        ctx.set_output(0, x.reshape(shapes.flatten_shape(x.shape, self.axis)))


class Transpose(Kernel):
    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.perm = info.attr("perm")

    def compute(self, ctx: KernelContext) -> None:
        ctx.set_output(0, np.transpose(ctx.input(0), self.perm))


class Squeeze(Kernel):
    """Squeeze-13+: axes is an optional input (all size-1 dims when absent)."""

    def axes(self, ctx: KernelContext) -> list[int] | None:
        return optional_ints(ctx, 1)

    def compute(self, ctx: KernelContext) -> None:
        x = ctx.input(0)
        ctx.set_output(0, x.reshape(shapes.squeeze_shape(x.shape, self.axes(ctx))))


class Squeeze1(Squeeze):
    """Squeeze-1..12: axes is an attribute."""

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.axes_attr = info.attr("axes")

    def axes(self, ctx: KernelContext) -> list[int] | None:
        return self.axes_attr


class Unsqueeze(Kernel):
    """Unsqueeze-13+: axes is a required input."""

    def axes(self, ctx: KernelContext) -> list[int]:
        return ints(ctx.input(1))

    def compute(self, ctx: KernelContext) -> None:
        x = ctx.input(0)
        ctx.set_output(0, x.reshape(shapes.unsqueeze_shape(x.shape, self.axes(ctx))))


class Unsqueeze1(Unsqueeze):
    """Unsqueeze-1..12: axes is an attribute."""

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.axes_attr = ints(info.attr("axes", []))

    def axes(self, ctx: KernelContext) -> list[int]:
        return self.axes_attr


class Concat(Kernel):
    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.axis = int(info.attr("axis", 1))

    def compute(self, ctx: KernelContext) -> None:
        xs = ctx.inputs
        ctx.set_output(0, np.concatenate(xs, axis=shapes.normalize_axis(self.axis, xs[0].ndim)))


class Split(Kernel):
    """Split-13+: sizes from the optional ``split`` input, else equal parts (as many as
    Split-18's ``num_outputs``, which must be the node's output count)."""

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.axis = int(info.attr("axis", 0))
        self.n = info.output_count
        num_outputs = info.attr("num_outputs")
        self.num_outputs = None if num_outputs is None else int(num_outputs)

    def sizes(self, ctx: KernelContext) -> list[int] | None:
        return optional_ints(ctx, 1)

    def compute(self, ctx: KernelContext) -> None:
        x = ctx.input(0)
        axis = shapes.normalize_axis(self.axis, x.ndim)
        sizes = shapes.split_sizes(x.shape[axis], self.n, self.sizes(ctx), self.num_outputs)
        index: list[Any] = [slice(None)] * x.ndim
        pos = 0
        for i, s in enumerate(sizes):
            index[axis] = slice(pos, pos + s)
            ctx.set_output(i, x[tuple(index)])
            pos += s


class Split2(Split):
    """Split-2..12: sizes are the ``split`` attribute."""

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.split_attr = info.attr("split")

    def sizes(self, ctx: KernelContext) -> list[int] | None:
        return self.split_attr


class Slice(Kernel):
    """Slice-10+: starts, ends and optional axes and steps are inputs."""

    def compute(self, ctx: KernelContext) -> None:
        x = ctx.input(0)
        ranges = shapes.slice_ranges(
            x.shape,
            ints(ctx.input(1)),
            ints(ctx.input(2)),
            optional_ints(ctx, 3),
            optional_ints(ctx, 4),
        )
        # a negative-step range that runs to the beginning has stop -1, which Python reads as
        # "the last element": spell it None
        index = tuple(slice(s, None if e < 0 else e, st) for s, e, st in ranges)
        ctx.set_output(0, x[index])


class Gather(Kernel):
    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.axis = int(info.attr("axis", 0))

    def compute(self, ctx: KernelContext) -> None:
        x, idx = ctx.input(0), ctx.input(1)
        ctx.set_output(
            0, np.asarray(np.take(x, idx, axis=shapes.normalize_axis(self.axis, x.ndim)))
        )


class Shape(Kernel):
    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.start = int(info.attr("start", 0))
        end = info.attr("end")
        self.end = None if end is None else int(end)

    def compute(self, ctx: KernelContext) -> None:
        shape = ctx.input(0).shape
        a, b = shapes.shape_range(len(shape), self.start, self.end)
        ctx.set_output(0, np.array(shape[a:b], dtype=np.int64))


class Size(Kernel):
    def compute(self, ctx: KernelContext) -> None:
        ctx.set_output(0, np.array(shapes.size_of(ctx.input(0).shape), dtype=np.int64))


class Expand(Kernel):
    def compute(self, ctx: KernelContext) -> None:
        x = ctx.input(0)
        shape = shapes.broadcast_shapes(x.shape, ints(ctx.input(1)))
        # materialized: a broadcast view is read-only with zero strides, a poor value to hand on
        ctx.set_output(0, np.array(np.broadcast_to(x, shape)))


class Tile(Kernel):
    def compute(self, ctx: KernelContext) -> None:
        x = ctx.input(0)
        reps = ints(ctx.input(1))
        if len(reps) != x.ndim:
            raise ValueError(f"Tile: {len(reps)} repeats for an input of rank {x.ndim}")
        ctx.set_output(0, np.tile(x, reps))


class Pad(Kernel):
    """Pad-11+: pads, constant_value and (18+) axes are inputs. Negative pads crop."""

    MODES: dict[str, Literal["constant", "reflect", "edge", "wrap"]] = {
        "constant": "constant",
        "reflect": "reflect",
        "edge": "edge",
        "wrap": "wrap",
    }

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.mode = self.MODES[info.attr("mode", "constant")]

    def params(self, ctx: KernelContext, rank: int) -> tuple[list[tuple[int, int]], Any]:
        value = shapes.pad_constant(ctx.input(2))
        return shapes.pad_widths(rank, ints(ctx.input(1)), optional_ints(ctx, 3)), value

    def compute(self, ctx: KernelContext) -> None:
        x = ctx.input(0)
        widths, value = self.params(ctx, x.ndim)
        shapes.padded_shape(x.shape, widths)
        if any(b < 0 or e < 0 for b, e in widths):
            x = x[tuple(slice(max(-b, 0), d - max(-e, 0)) for (b, e), d in zip(widths, x.shape))]
            widths = [(max(b, 0), max(e, 0)) for b, e in widths]
        if self.mode == "constant":
            y = np.pad(x, widths, mode="constant", constant_values=np.asarray(value, x.dtype))
        else:
            self.check_widths(x.shape, widths)
            y = np.pad(x, widths, mode=self.mode)
        ctx.set_output(0, y)

    def check_widths(self, shape: tuple[int, ...], widths: list[tuple[int, int]]) -> None:
        """onnxruntime's limits: reflect pads at most dim - 1 per side (numpy would reflect
        again), and edge/reflect need data on an axis they pad."""
        for axis, ((b, e), d) in enumerate(zip(widths, shape)):
            if (b or e) and d == 0:
                raise InvalidArgument(
                    f"Pad {self.mode}: axis {axis} has no data to pad from. Input shape: "
                    f"{list(shape)}"
                )
            if self.mode == "reflect" and max(b, e) > d - 1:
                side, pad = ("pre", b) if b > d - 1 else ("post", e)
                raise InvalidArgument(
                    f"Pad reflect: {side}-pad ({pad}) exceeds maximum allowed ({d - 1}) for "
                    f"axis {axis}. Input shape: {list(shape)}"
                )


class Pad2(Pad):
    """Pad-2..10: pads and value are attributes."""

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.pads = ints(info.attr("pads"))
        self.value = float(info.attr("value", 0.0))

    def params(self, ctx: KernelContext, rank: int) -> tuple[list[tuple[int, int]], Any]:
        return shapes.pad_widths(rank, self.pads), self.value


class ConstantOfShape(Kernel):
    def __init__(self, info: KernelInfo):
        super().__init__(info)
        value = info.attr("value")
        self.value = np.zeros(1, np.float32) if value is None else np.asarray(value).reshape(-1)
        shape = info.constant_input(0)
        # a constant shape (model weights in "light" models) gives a constant value: made once,
        # when small (a huge one is the run's to allocate, or to fail to, not the session's)
        small = shape is not None and shapes.size_of(max(d, 0) for d in ints(shape)) <= 1 << 20
        self.cached = frozen(self.fill(shape)) if small else None

    def fill(self, shape: Any) -> np.ndarray:
        return np.full(ints(shape), self.value[0], dtype=self.value.dtype)

    def compute(self, ctx: KernelContext) -> None:
        ctx.set_output(0, self.cached if self.cached is not None else self.fill(ctx.input(0)))


class Constant(Kernel):
    ATTRS = {
        "value_float": np.float32,
        "value_floats": np.float32,
        "value_int": np.int64,
        "value_ints": np.int64,
        "value_string": object,
        "value_strings": object,
    }

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        for name in ("value", "sparse_value"):
            if info.attr(name) is not None:
                self.value = frozen(np.array(info.attr(name)))
                return
        for name, dtype in self.ATTRS.items():
            if info.attr(name) is not None:
                self.value = frozen(np.array(info.attr(name), dtype=dtype))
                return
        raise ValueError(f"Constant node '{info.name}' has no value attribute")

    def compute(self, ctx: KernelContext) -> None:
        ctx.set_output(0, self.value)


class Range(Kernel):
    """Range: ``start + i * delta`` for i < max(ceil((limit - start) / delta), 0). Range-27
    computes float16/bfloat16 in ``stash_type`` (float32 by default)."""

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        stash = int(info.attr("stash_type", 1)) if info.since_version >= 27 else 0
        stash_types: dict[int, np.dtype] = {1: np.dtype(np.float32), 11: np.dtype(np.float64)}
        self.stash = stash_types.get(stash)

    def compute(self, ctx: KernelContext) -> None:
        start, limit, delta = (ctx.input(i).reshape(()) for i in range(3))
        dtype = start.dtype
        if dtype.kind in "iu":
            ctx.set_output(0, np.arange(int(start), int(limit), int(delta), dtype=dtype))
            return
        n = shapes.range_length(float(start), float(limit), float(delta))
        calc = self.stash if self.stash is not None and dtype.itemsize < 4 else dtype
        steps = np.arange(n, dtype=calc)
        steps *= delta.astype(calc)
        steps += start.astype(calc)
        ctx.set_output(0, steps.astype(dtype, copy=False))


class Dropout(Kernel):
    """Dropout-12+: identity unless the training_mode input is true, then a mask drawn
    like onnx.reference does (numpy RandomState(seed), keep where u >= ratio)."""

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.seed = node_seed(info.attr("seed"))

    def compute(self, ctx: KernelContext) -> None:
        x, ratio, training = ctx.input(0), ctx.input(1), ctx.input(2)
        ratio = 0.5 if ratio is None else float(ratio)
        if training is None or not bool(training) or ratio == 0:
            ctx.set_output(0, x)
            if ctx.has_output(1):
                ctx.set_output(1, np.ones(x.shape, dtype=np.bool_))
            return
        mask = np.random.RandomState(self.seed).uniform(0, 1.0, x.shape) >= ratio
        ctx.set_output(0, (mask * x * (1.0 / (1.0 - ratio))).astype(x.dtype, copy=False))
        if ctx.has_output(1):
            ctx.set_output(1, mask)


class Dropout7(Kernel):
    """Dropout-7..11: inference only, the identity (mask all ones: T before 10, bool after)."""

    def compute(self, ctx: KernelContext) -> None:
        x = ctx.input(0)
        ctx.set_output(0, x)
        if ctx.has_output(1):
            dtype = np.bool_ if self.info.since_version >= 10 else x.dtype
            ctx.set_output(1, np.ones(x.shape, dtype=dtype))


def register(registry: KernelRegistry) -> None:
    registry.kernel("Identity", since=1)(Identity)
    registry.kernel("Reshape", since=5)(Reshape)
    registry.kernel("Flatten", since=1)(Flatten)
    registry.kernel("Transpose", since=1)(Transpose)
    registry.kernel("Squeeze", since=1, until=12)(Squeeze1)
    registry.kernel("Squeeze", since=13)(Squeeze)
    registry.kernel("Unsqueeze", since=1, until=12)(Unsqueeze1)
    registry.kernel("Unsqueeze", since=13)(Unsqueeze)
    registry.kernel("Concat", since=4)(Concat)
    registry.kernel("Split", since=2, until=12)(Split2)
    registry.kernel("Split", since=13)(Split)
    registry.kernel("Slice", since=10)(Slice)
    registry.kernel("Gather", since=1)(Gather)
    registry.kernel("Shape", since=1, shape_only_inputs=(0,))(Shape)
    registry.kernel("Size", since=1, shape_only_inputs=(0,))(Size)
    registry.kernel("Expand", since=8)(Expand)
    registry.kernel("Tile", since=6)(Tile)
    registry.kernel("Pad", since=2, until=10)(Pad2)
    registry.kernel("Pad", since=11)(Pad)
    registry.kernel("ConstantOfShape", since=9)(ConstantOfShape)
    registry.kernel("Constant", since=1)(Constant)
    registry.kernel("Range", since=11)(Range)
    registry.kernel("Dropout", since=7, until=11)(Dropout7)
    registry.kernel("Dropout", since=12)(Dropout)
