"""Tensor manipulation on the CUDA device: views, transposes, joins, splits, slices,
broadcasts, tiles, pads and the depth/space rearrangements.

Ops that leave the bytes where they are (Reshape, Flatten, Squeeze, Unsqueeze, Identity,
inference Dropout, and a Transpose that only moves size-1 dims) publish a ``DeviceTensor.view``
of their input: no kernel, no copy; the executor's memory plan follows the alias through the
view's owner. The others write into outputs allocated with ``self.alloc`` (the static memory
plan) with one copy kernel each where possible: a strided or broadcast view of the input
copied with ``xp.copyto``.

Shape-like inputs (Reshape's shape, Slice's starts/ends/axes/steps, Pad's pads, ...) are
declared ``CPU_INPUT`` and read on the host; the shape logic is ``onnxplug.ep.shapes``, shared
with the CPU provider. Everything here is pure data movement, so every fixed-size type is
handled, bfloat16 through its uint16 view (outputs are allocated with the tensor's own dtype).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from onnxplug.ep import (
    KernelContext,
    KernelInfo,
    KernelRegistry,
    MemType,
    dtypes,
    np_dtype,
    shapes,
)

from ..launch import bound_calls
from . import _fused as F
from ._base import ALL_FIXED_BF16, CudaKernel

INDEX = dtypes("int32", "int64")
CPU = MemType.CPU_INPUT


def ints(v: Any) -> list[int]:
    """A shape-like host tensor (or an attribute list) as Python ints."""
    return [int(x) for x in np.asarray(v).reshape(-1)]


def optional_ints(ctx: KernelContext, index: int) -> list[int] | None:
    v = ctx.input(index)
    return None if v is None else ints(v)


def constant_ints(info: KernelInfo, index: int) -> list[int] | None:
    """An initializer input as ints (None when absent or computed at run time)."""
    if not info.has_input(index):
        return None
    c = info.constant_input(index)
    return None if c is None else ints(c)


def storage_scalar(value: Any, dtype: np.dtype, arr_dtype: np.dtype) -> Any:
    """``value`` as a scalar of a kernel array's dtype, for a tensor of ONNX dtype ``dtype``:
    bfloat16 arrays are uint16 views on the GPU, so the value is rounded to bfloat16 and its
    bits are used; elsewhere the two dtypes are equal."""
    v = np.asarray(value).astype(dtype)
    if v.dtype != arr_dtype:
        v = v.view(arr_dtype)
    return v.reshape(())[()]


def initializer(graph: Any, node: Any, index: int) -> np.ndarray | None:
    """The value of a node's input when it is an initializer (at partitioning time)."""
    if index >= len(node.inputs) or not node.inputs[index]:
        return None
    return graph.graph.initializers.get(node.inputs[index])


# ---------------------------------------------------------------------------------------------
# Views: same memory, another shape


class _Views(CudaKernel):
    """Kernels whose outputs are views of their input (no work on the device): the prepared
    call has nothing to do, its launcher hands out the same view objects every run."""

    def prepare(self, ctx: KernelContext) -> Any:
        self.compute(ctx)
        return bound_calls([])


class _Copies(CudaKernel):
    """Kernels whose work is copies of strided or broadcast views into their outputs: each
    copy is one kernel, prepared once (``_fused.COPY``)."""

    first_run_prepared = True  # compute runs CuPy's kernels (see CudaKernel)

    def copies(self, ctx: KernelContext) -> list[tuple[Any, Any]]:
        """Allocate the outputs; the (destination, source view) pairs to copy."""
        raise NotImplementedError

    def compute(self, ctx: KernelContext) -> None:
        copyto = self.xp.copyto
        for dst, src in self.copies(ctx):
            if dst.size:
                copyto(dst, src)

    def prepare(self, ctx: KernelContext) -> Any:
        sh = self.stream_handle(ctx)
        calls = [
            F.COPY.bind(self.xp, src, dst, stream=sh) for dst, src in self.copies(ctx) if dst.size
        ]
        return None if any(c is None for c in calls) else bound_calls(calls)


class Identity(_Views):
    """Tensors, sequences and optionals pass through as the same value (no copy). Claimed
    only when the (element) type is known and of fixed size: strings stay on the host."""

    @classmethod
    def claims(cls, node: Any, graph: Any) -> bool:
        t = graph.graph.type_of(node.inputs[0]) if node.inputs else None
        while t is not None and t.kind in ("sequence", "optional"):
            t = t.inner
        if t is None or t.kind != "tensor" or not t.elem_type:
            return False
        try:
            return np_dtype(t.elem_type) in ALL_FIXED_BF16
        except ValueError:
            return False

    def compute(self, ctx: KernelContext) -> None:
        ctx.set_output(0, ctx.input(0))


class Reshape(_Views):
    """Reshape-5+: the target shape is a host input; 0 copies a dim unless ``allowzero``."""

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.allowzero = bool(info.attr("allowzero", 0))
        self.target = constant_ints(info, 1)
        self._memo: tuple[Any, Any] = (None, None)  # (input shape, output shape)

    def compute(self, ctx: KernelContext) -> None:
        t = ctx.input(0)
        if self.target is not None:
            shape_in, shape_out = self._memo
            if shape_in != t.shape:
                shape_out = shapes.reshape_shape(t.shape, self.target, self.allowzero)
                self._memo = (t.shape, shape_out)
        else:
            shape_out = shapes.reshape_shape(t.shape, ints(ctx.input(1)), self.allowzero)
        ctx.set_output(0, t.view(shape_out))


class Flatten(_Views):
    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.axis = int(info.attr("axis", 1))

    def compute(self, ctx: KernelContext) -> None:
        t = ctx.input(0)
        ctx.set_output(0, t.view(shapes.flatten_shape(t.shape, self.axis)))


class Squeeze(_Views):
    """Squeeze-13+: axes is an optional host input (all size-1 dims when absent)."""

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.axes_const = constant_ints(info, 1)

    def axes(self, ctx: KernelContext) -> list[int] | None:
        return self.axes_const if self.axes_const is not None else optional_ints(ctx, 1)

    def compute(self, ctx: KernelContext) -> None:
        t = ctx.input(0)
        ctx.set_output(0, t.view(shapes.squeeze_shape(t.shape, self.axes(ctx))))


class Squeeze1(Squeeze):
    """Squeeze-1..12: axes is an attribute."""

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        axes = info.attr("axes")
        self.axes_const = None if axes is None else ints(axes)

    def axes(self, ctx: KernelContext) -> list[int] | None:
        return self.axes_const


class Unsqueeze(_Views):
    """Unsqueeze-13+: axes is a required host input."""

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.axes_const = constant_ints(info, 1)

    def axes(self, ctx: KernelContext) -> list[int]:
        return self.axes_const if self.axes_const is not None else ints(ctx.input(1))

    def compute(self, ctx: KernelContext) -> None:
        t = ctx.input(0)
        ctx.set_output(0, t.view(shapes.unsqueeze_shape(t.shape, self.axes(ctx))))


class Unsqueeze1(Unsqueeze):
    """Unsqueeze-1..12: axes is an attribute."""

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.axes_const = ints(info.attr("axes", []))


class Dropout(CudaKernel):
    """Inference Dropout: the output is the input; the optional mask is all ones (of T before
    opset 10, bool since). Dropout-12+ in training mode is left to the CPU provider: the node
    is claimed only when training_mode is absent or a constant false."""

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.mask_dtype = np.dtype(np.bool_) if info.since_version >= 10 else None

    @classmethod
    def claims(cls, node: Any, graph: Any) -> bool:
        if node.since_version < 12 or len(node.inputs) < 3 or not node.inputs[2]:
            return True
        training = initializer(graph, node, 2)
        return training is not None and training.size == 1 and not bool(training.reshape(-1)[0])

    def compute(self, ctx: KernelContext) -> None:
        t = ctx.input(0)
        ctx.set_output(0, t)
        if ctx.has_output(1):
            dt = self.mask_dtype if self.mask_dtype is not None else t.dtype
            m = self.alloc(ctx, 1, t.shape, dt)
            m.fill(storage_scalar(1, dt, m.dtype))


# ---------------------------------------------------------------------------------------------
# Copies


class Transpose(_Copies):
    def __init__(self, info: KernelInfo):
        super().__init__(info)
        perm = info.attr("perm")
        self.perm = None if perm is None else tuple(int(p) for p in perm)
        self._memo: tuple[Any, Any] = (None, None)  # (input shape, (perm, out shape, is view))

    def warm_up(self) -> None:
        """A permutation that moves the last axis copies through the strided copy kernel."""
        dt, perm = self.info.input_dtype(0), self.perm
        if dt is not None and perm and perm[-1] != len(perm) - 1:
            F.COPY.raw().precompile(self, (dt, dt), flat=False)

    def _plan(self, shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...], bool]:
        perm = self.perm if self.perm else tuple(reversed(range(len(shape))))
        out = tuple(shape[p] for p in perm)
        # Moving only size-1 dims leaves the order of the bytes unchanged: a view does.
        moved = [p for p in perm if shape[p] != 1]
        return perm, out, moved == sorted(moved)

    def copies(self, ctx: KernelContext) -> list[tuple[Any, Any]]:
        t = ctx.input(0)
        shape_in, plan = self._memo
        if shape_in != t.shape:
            plan = self._plan(t.shape)
            self._memo = (t.shape, plan)
        perm, out_shape, is_view = plan
        if is_view:
            ctx.set_output(0, t.view(out_shape))
            return []
        x = self.arg(ctx, 0)
        y = self.alloc(ctx, 0, out_shape, t.dtype)
        return [(y, x.transpose(perm))]


class Concat(_Copies):
    """One copy per (non-empty) input into its slice of the output. Done here rather than
    with ``xp.concatenate``, which for more than 8 inputs uploads a pointer table from host
    memory (not replayable in a CUDA graph)."""

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.axis = int(info.attr("axis", 1))

    def copies(self, ctx: KernelContext) -> list[tuple[Any, Any]]:
        n = ctx.input_count
        ts = [ctx.input(i) for i in range(n)]
        t0 = ts[0]
        axis = shapes.normalize_axis(self.axis, t0.ndim)
        out_shape = list(t0.shape)
        out_shape[axis] = sum(t.shape[axis] for t in ts)
        for t in ts[1:]:
            if t.ndim != t0.ndim or any(
                a != b for d, (a, b) in enumerate(zip(t.shape, t0.shape)) if d != axis
            ):
                raise ValueError(
                    f"Concat: input shapes {[list(t.shape) for t in ts]} differ outside axis {axis}"
                )
        y = self.alloc(ctx, 0, out_shape, t0.dtype)
        index: list[Any] = [slice(None)] * t0.ndim
        pos = 0
        pairs = []
        for i, t in enumerate(ts):
            size = t.shape[axis]
            if size and t.size:
                index[axis] = slice(pos, pos + size)
                pairs.append((y[tuple(index)], self.arg(ctx, i)))
            pos += size
        return pairs


class Split(_Copies):
    """Split-13+: sizes from the optional ``split`` host input, else equal parts (as many as
    Split-18's ``num_outputs``, which must be the node's output count)."""

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.axis = int(info.attr("axis", 0))
        self.n = info.output_count
        num_outputs = info.attr("num_outputs")
        self.num_outputs = None if num_outputs is None else int(num_outputs)
        self.split_const = constant_ints(info, 1)

    def sizes(self, ctx: KernelContext) -> list[int] | None:
        return self.split_const if self.split_const is not None else optional_ints(ctx, 1)

    def copies(self, ctx: KernelContext) -> list[tuple[Any, Any]]:
        t = ctx.input(0)
        axis = shapes.normalize_axis(self.axis, t.ndim)
        sizes = shapes.split_sizes(t.shape[axis], self.n, self.sizes(ctx), self.num_outputs)
        x = self.arg(ctx, 0)
        index: list[Any] = [slice(None)] * t.ndim
        shape = list(t.shape)
        pos = 0
        pairs = []
        for i, s in enumerate(sizes):
            if i < ctx.output_count and ctx.has_output(i):
                shape[axis] = s
                y = self.alloc(ctx, i, shape, t.dtype)
                if y.size:
                    index[axis] = slice(pos, pos + s)
                    pairs.append((y, x[tuple(index)]))
            pos += s
        return pairs


class Split2(Split):
    """Split-2..12: sizes are the ``split`` attribute."""

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        split = info.attr("split")
        self.split_const = None if split is None else ints(split)

    def sizes(self, ctx: KernelContext) -> list[int] | None:
        return self.split_const


class Slice(_Copies):
    """Slice-10+: starts, ends and optional axes and steps are host inputs; steps may be
    negative. The strided view is copied into the planned output."""

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        consts = [constant_ints(info, i) for i in range(1, 5)]
        # all parameters constant (the usual case): the index is made once per input shape
        present = [info.has_input(i) for i in range(1, 5)]
        self.params_const = (
            consts if all(c is not None or not p for c, p in zip(consts, present)) else None
        )
        self._memo: tuple[Any, Any] = (None, None)

    def params(self, ctx: KernelContext) -> list[list[int] | None]:
        return [
            ints(ctx.input(1)),
            ints(ctx.input(2)),
            optional_ints(ctx, 3),
            optional_ints(ctx, 4),
        ]

    @staticmethod
    def plan(shape: tuple[int, ...], p: list[Any]) -> tuple[tuple[slice, ...], tuple[int, ...]]:
        ranges = shapes.slice_ranges(shape, p[0], p[1], p[2], p[3])
        # a negative-step range that runs to the beginning has stop -1, which Python reads as
        # "the last element": spell it None. len(range(...)) counts with the literal -1.
        index = tuple(slice(s, None if e < 0 else e, st) for s, e, st in ranges)
        out = tuple(len(range(s, e, st)) for s, e, st in ranges)
        return index, out

    def copies(self, ctx: KernelContext) -> list[tuple[Any, Any]]:
        t = ctx.input(0)
        if self.params_const is not None:
            shape_in, plan = self._memo
            if shape_in != t.shape:
                plan = self.plan(t.shape, self.params_const)
                self._memo = (t.shape, plan)
        else:
            plan = self.plan(t.shape, self.params(ctx))
        index, out_shape = plan
        y = self.alloc(ctx, 0, out_shape, t.dtype)
        return [(y, self.arg(ctx, 0)[index])] if y.size else []


class Slice1(Slice):
    """Slice-1..9: starts, ends and optional axes are attributes; steps are 1."""

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        axes = info.attr("axes")
        self.params_const = [
            ints(info.attr("starts")),
            ints(info.attr("ends")),
            None if axes is None else ints(axes),
            None,
        ]


class Expand(_Copies):
    """Expand-8+: numpy broadcasting of the input to a host shape, one broadcast copy."""

    def copies(self, ctx: KernelContext) -> list[tuple[Any, Any]]:
        t = ctx.input(0)
        shape = shapes.broadcast_shapes(t.shape, ints(ctx.input(1)))
        y = self.alloc(ctx, 0, shape, t.dtype)
        return [(y, self.arg(ctx, 0))] if y.size else []


class Tile(_Copies):
    """Tile-6+: one broadcast copy. The output viewed as (r0, d0, r1, d1, ...) is the input
    viewed as (1, d0, 1, d1, ...) broadcast over the repeats."""

    def copies(self, ctx: KernelContext) -> list[tuple[Any, Any]]:
        t = ctx.input(0)
        reps = ints(ctx.input(1))
        if len(reps) != t.ndim or any(r < 0 for r in reps):
            raise ValueError(f"Tile: repeats {reps} do not fit an input of rank {t.ndim}")
        y = self.alloc(ctx, 0, [d * r for d, r in zip(t.shape, reps)], t.dtype)
        if not y.size:
            return []
        x = self.arg(ctx, 0)
        inter = [v for r, d in zip(reps, t.shape) for v in (r, d)]
        src = [v for d in t.shape for v in (1, d)]
        return [(y.reshape(inter), x.reshape(src))]


class Pad(CudaKernel):
    """Pad-11+: pads, constant_value and (18+) axes are host inputs; modes constant, reflect,
    edge and (19+) wrap. Negative pads crop. Constant mode fills the output and copies the
    input into its interior (two kernels); the others use ``xp.pad``."""

    MODES = ("constant", "reflect", "edge", "wrap")

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.mode = str(info.attr("mode", "constant"))
        if self.mode not in self.MODES:
            raise ValueError(f"Pad: unknown mode '{self.mode}'")

    def params(self, ctx: KernelContext, rank: int) -> tuple[list[tuple[int, int]], Any]:
        value = shapes.pad_constant(ctx.input(2))
        return shapes.pad_widths(rank, ints(ctx.input(1)), optional_ints(ctx, 3)), value

    def compute(self, ctx: KernelContext) -> None:
        t = ctx.input(0)
        widths, value = self.params(ctx, t.ndim)
        shapes.padded_shape(t.shape, widths)
        x = self.arg(ctx, 0)
        if any(b < 0 or e < 0 for b, e in widths):
            x = x[tuple(slice(max(-b, 0), d - max(-e, 0)) for (b, e), d in zip(widths, t.shape))]
            widths = [(max(b, 0), max(e, 0)) for b, e in widths]
        out_shape = [d + b + e for d, (b, e) in zip(x.shape, widths)]
        if self.mode != "constant":
            if x.size == 0 and any(out_shape):
                raise ValueError(f"Pad: mode '{self.mode}' cannot pad an empty tensor")
            if not any(b or e for b, e in widths):
                y = self.alloc(ctx, 0, out_shape, t.dtype)
                if y.size:
                    self.xp.copyto(y, x)
                return
            self.put(ctx, 0, self.xp.pad(x, widths, mode=self.mode), dtype=t.dtype)
            return
        y = self.alloc(ctx, 0, out_shape, t.dtype)
        if not y.size:
            return
        if any(b or e for b, e in widths):
            y.fill(storage_scalar(value, t.dtype, y.dtype))
        if x.size:
            inner = tuple(slice(b, b + d) for (b, _), d in zip(widths, x.shape))
            self.xp.copyto(y[inner], x)


class Pad2(Pad):
    """Pad-2..10: pads and value are attributes."""

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.pads = ints(info.attr("pads"))
        self.value = float(info.attr("value", 0.0))

    def params(self, ctx: KernelContext, rank: int) -> tuple[list[tuple[int, int]], Any]:
        return shapes.pad_widths(rank, self.pads), self.value


class _Blocks(CudaKernel):
    """Depth/space rearrangements of NCHW tensors in blocks of ``blocksize``² pixels."""

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.b = int(info.attr("blocksize"))
        self.crd = str(info.attr("mode", "DCR")) == "CRD"

    def input4d(self, ctx: KernelContext) -> Any:
        t = ctx.input(0)
        if t.ndim != 4:
            raise ValueError(
                f"{self.info.op_type}: expected a 4-D input, got shape {list(t.shape)}"
            )
        return t


class DepthToSpace(_Blocks):
    """DepthToSpace (DCR, and CRD from opset 11): one strided copy of a 6-D view."""

    def compute(self, ctx: KernelContext) -> None:
        t = self.input4d(ctx)
        n, c, h, w = t.shape
        b = self.b
        if c % (b * b):
            raise ValueError(f"DepthToSpace: {c} channels do not divide by blocksize² {b * b}")
        c2 = c // (b * b)
        y = self.alloc(ctx, 0, (n, c2, h * b, w * b), t.dtype)
        if not y.size:
            return
        x = self.arg(ctx, 0)
        if self.crd:
            src = x.reshape(n, c2, b, b, h, w).transpose(0, 1, 4, 2, 5, 3)
        else:
            src = x.reshape(n, b, b, c2, h, w).transpose(0, 3, 4, 1, 5, 2)
        self.xp.copyto(y.reshape(n, c2, h, b, w, b), src)


class SpaceToDepth(_Blocks):
    """SpaceToDepth (DCR; CRD from opset 28): one strided copy of a 6-D view."""

    def compute(self, ctx: KernelContext) -> None:
        t = self.input4d(ctx)
        n, c, h, w = t.shape
        b = self.b
        if h % b or w % b:
            raise ValueError(f"SpaceToDepth: {h}x{w} does not divide by blocksize {b}")
        h2, w2 = h // b, w // b
        y = self.alloc(ctx, 0, (n, c * b * b, h2, w2), t.dtype)
        if not y.size:
            return
        x6 = self.arg(ctx, 0).reshape(n, c, h2, b, w2, b)
        if self.crd:
            self.xp.copyto(y.reshape(n, c, b, b, h2, w2), x6.transpose(0, 1, 3, 5, 2, 4))
        else:
            self.xp.copyto(y.reshape(n, b, b, c, h2, w2), x6.transpose(0, 3, 5, 1, 2, 4))


def register(reg: KernelRegistry, enable_cudnn: bool) -> None:
    T = {"T": ALL_FIXED_BF16}
    reg.kernel("Identity", since=1, types={"T": ALL_FIXED_BF16, "V": ALL_FIXED_BF16})(Identity)
    reg.kernel("Reshape", since=5, types=T, input_memory={1: CPU})(Reshape)
    reg.kernel("Flatten", since=1, types=T)(Flatten)
    reg.kernel("Squeeze", since=1, until=12, types=T)(Squeeze1)
    reg.kernel("Squeeze", since=13, types=T, input_memory={1: CPU})(Squeeze)
    reg.kernel("Unsqueeze", since=1, until=12, types=T)(Unsqueeze1)
    reg.kernel("Unsqueeze", since=13, types=T, input_memory={1: CPU})(Unsqueeze)
    # T1 (ratio) is only read in training mode, which is not claimed; the mask is T or bool
    reg.kernel("Dropout", since=7, types=T, input_memory={1: CPU, 2: CPU})(Dropout)
    reg.kernel("Transpose", since=1, types=T)(Transpose)
    reg.kernel("Concat", since=1, types=T)(Concat)
    reg.kernel("Split", since=2, until=12, types=T)(Split2)
    reg.kernel("Split", since=13, types=T, input_memory={1: CPU})(Split)
    reg.kernel("Slice", since=1, until=9, types=T)(Slice1)
    reg.kernel("Slice", since=10, types=T, input_memory={i: CPU for i in range(1, 5)})(Slice)
    reg.kernel("Expand", since=8, types=T, input_memory={1: CPU})(Expand)
    reg.kernel("Tile", since=6, types=T, input_memory={1: CPU})(Tile)
    reg.kernel("Pad", since=2, until=10, types=T)(Pad2)
    reg.kernel("Pad", since=11, types=T, input_memory={1: CPU, 2: CPU, 3: CPU})(Pad)
    reg.kernel("DepthToSpace", since=1, types=T)(DepthToSpace)
    reg.kernel("SpaceToDepth", since=1, types=T)(SpaceToDepth)
