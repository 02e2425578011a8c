"""Shape logic of ONNX ops, shared by every provider's kernels.

Kernels of different providers must agree on output shapes, padding and axis rules; that
logic lives here once (re-exported to plugins as ``onnxplug.ep.shapes``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

# The rules of window attributes and resize scales are checked at load too, by the model
# validator (in ir, which this layer may import but not the other way round).
from ..ir.validate import check_resize_scales as check_resize_scales  # for the kernels
from ..ir.validate import check_window_attrs


def broadcast_shapes(*shapes: Sequence[int]) -> tuple[int, ...]:
    """Numpy-style multidirectional broadcasting; raises ValueError naming the dims."""
    ndim = max((len(s) for s in shapes), default=0)
    out = [1] * ndim
    for s in shapes:
        off = ndim - len(s)
        for i, d in enumerate(s):
            cur = out[off + i]
            if d == cur or d == 1:
                continue
            if cur == 1:
                out[off + i] = d
            else:
                raise ValueError(
                    f"shapes {[tuple(x) for x in shapes]} cannot be broadcast (dim {off + i}: "
                    f"{cur} vs {d})"
                )
    return tuple(out)


def normalize_axis(axis: int, rank: int, what: str = "axis") -> int:
    if not -rank <= axis < max(rank, 1):
        raise ValueError(f"{what} {axis} is out of range for rank {rank}")
    return axis + rank if axis < 0 else axis


def normalize_axes(axes: Sequence[int], rank: int, what: str = "axes") -> list[int]:
    out = [normalize_axis(int(a), rank, what) for a in axes]
    if len(set(out)) != len(out):
        raise ValueError(f"{what} {list(axes)} repeat an axis")
    return out


def size_of(shape: Iterable[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def unidirectional_broadcastable(src: Sequence[int], target: Sequence[int]) -> bool:
    """Whether ``src`` broadcasts to ``target`` without changing it (Gemm's C, PRelu's slope)."""
    try:
        return broadcast_shapes(src, target) == tuple(target)
    except ValueError:
        return False


# ---------------------------------------------------------------------------------------------
# Convolution and pooling geometry. Pads are ONNX-ordered: [begin_0, begin_1, ..., end_0, ...].


def _spatial(values: Sequence[int] | None, n: int, default: int) -> list[int]:
    return [int(v) for v in values] if values else [default] * n


def _window_attrs(n: int, strides, dilations, pads) -> tuple[list[int], list[int], list[int]]:
    """Strides, dilations and pads of ``n`` spatial dims with their defaults filled in."""
    return _spatial(strides, n, 1), _spatial(dilations, n, 1), _spatial(pads, 2 * n, 0)


def _split_pad(total: int, upper: bool) -> tuple[int, int]:
    """(begin, end) of ``total`` padding; the odd pixel goes at the end when ``upper``."""
    small, big = total // 2, total - total // 2
    return (small, big) if upper else (big, small)


def window_geometry(
    in_spatial: Sequence[int],
    kernel: Sequence[int],
    strides: Sequence[int] | None = None,
    dilations: Sequence[int] | None = None,
    pads: Sequence[int] | None = None,
    auto_pad: str = "NOTSET",
    ceil_mode: bool = False,
) -> tuple[list[int], list[int]]:
    """Output spatial shape and the pads actually applied, for Conv and the pooling ops.

    SAME_* pads so that ``out = ceil(in / stride)`` (the odd pad goes at the end for
    SAME_UPPER, at the beginning for SAME_LOWER); VALID pads nothing. With ``ceil_mode`` a last
    window that would start in the end padding is dropped (onnx and PyTorch agree on that).
    """
    n = len(in_spatial)
    check_window_attrs(n, kernel, strides, dilations, None if auto_pad != "NOTSET" else pads)
    strides, dilations, p = _window_attrs(n, strides, dilations, pads)
    out: list[int] = []
    for i in range(n):
        size, k_eff, s = int(in_spatial[i]), (int(kernel[i]) - 1) * dilations[i] + 1, strides[i]
        if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            o = -(-size // s)
            total = max((o - 1) * s + k_eff - size, 0)
            p[i], p[n + i] = _split_pad(total, auto_pad == "SAME_UPPER")
        elif auto_pad == "VALID":
            p[i] = p[n + i] = 0
            o = (size - k_eff) // s + 1
        else:
            span = size + p[i] + p[n + i] - k_eff
            o = (-(-span // s) if ceil_mode else span // s) + 1
            if ceil_mode and (o - 1) * s >= size + p[i]:
                o -= 1
        if o < 1:
            raise ValueError(
                f"window {list(kernel)} (dilations {dilations}) does not fit input "
                f"{list(in_spatial)} with pads {p}"
            )
        out.append(o)
    return out, p


def window_fit_pads(
    in_spatial: Sequence[int],
    out_spatial: Sequence[int],
    kernel: Sequence[int],
    strides: Sequence[int] | None,
    dilations: Sequence[int] | None,
    pads: Sequence[int],
) -> list[int]:
    """``pads`` with the end pads grown so that every output's window lies inside the padded
    input (ceil_mode's last window may reach past the explicit end padding)."""
    n = len(in_spatial)
    strides, dilations, _ = _window_attrs(n, strides, dilations, None)
    ext = [int(p) for p in pads]
    for i in range(n):
        need = (out_spatial[i] - 1) * strides[i] + (int(kernel[i]) - 1) * dilations[i] + 1
        ext[n + i] = max(ext[n + i], need - int(in_spatial[i]) - ext[i])
    return ext


def conv_transpose_geometry(
    in_spatial: Sequence[int],
    kernel: Sequence[int],
    strides: Sequence[int] | None = None,
    dilations: Sequence[int] | None = None,
    pads: Sequence[int] | None = None,
    auto_pad: str = "NOTSET",
    output_padding: Sequence[int] | None = None,
    output_shape: Sequence[int] | None = None,
) -> tuple[list[int], list[int]]:
    """Output spatial shape and pads of ConvTranspose.

    The full (unpadded) output of input size ``i`` is ``s*(i-1) + output_padding + k_eff``;
    pads crop it. When ``output_shape`` is given (or auto_pad is SAME_*, where it is ``i*s``)
    the crop is derived from it, the odd pixel going to the beginning except for SAME_UPPER.
    """
    n = len(in_spatial)
    check_window_attrs(n, kernel, strides, dilations, None if auto_pad != "NOTSET" else pads)
    strides, dilations, p = _window_attrs(n, strides, dilations, pads)
    out_pad = _spatial(output_padding, n, 0)
    if len(out_pad) != n:
        raise ValueError(f"Attribute output_padding has {len(out_pad)} values for {n} spatial dims")
    for i, op in enumerate(out_pad):
        if not 0 <= op < max(strides[i], dilations[i]):
            raise ValueError(
                f"output_padding[{i}] ({op}) must be non-negative and less than "
                f"max(stride, dilation) ({max(strides[i], dilations[i])})"
            )
    if output_shape:
        output_shape = [int(v) for v in output_shape][-n:]
    elif auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        output_shape = [int(in_spatial[i]) * strides[i] for i in range(n)]
    out: list[int] = []
    for i in range(n):
        full = (
            strides[i] * (int(in_spatial[i]) - 1)
            + out_pad[i]
            + (int(kernel[i]) - 1) * dilations[i]
            + 1
        )
        if output_shape:
            p[i], p[n + i] = _split_pad(full - output_shape[i], auto_pad == "SAME_UPPER")
        o = full - p[i] - p[n + i]
        if o < 1:
            raise ValueError(
                f"output spatial dims of input {list(in_spatial)} with kernel {list(kernel)} "
                f"and pads {p} are not positive (dim {i}: {o})"
            )
        out.append(o)
    return out, p


# ---------------------------------------------------------------------------------------------
# Tensor manipulation


def reshape_shape(
    in_shape: Sequence[int], target: Sequence[int], allowzero: bool = False
) -> tuple[int, ...]:
    """Reshape's output shape: 0 copies the input dim (unless ``allowzero``), -1 is inferred."""
    out = [int(d) for d in target]
    if not allowzero:
        for i, d in enumerate(out):
            if d == 0:
                if i >= len(in_shape):
                    raise ValueError(
                        f"Reshape: 0 at index {i} but the input has rank {len(in_shape)}"
                    )
                out[i] = int(in_shape[i])
    unknown = [i for i, d in enumerate(out) if d == -1]
    if len(unknown) > 1:
        raise ValueError(f"Reshape: more than one -1 in {list(target)}")
    total = size_of(in_shape)
    if unknown:
        rest = size_of(d for d in out if d != -1)
        if rest == 0 or total % rest:
            raise ValueError(
                f"Reshape: cannot infer -1 in {list(target)} for input {list(in_shape)}"
            )
        out[unknown[0]] = total // rest
    if size_of(out) != total or any(d < 0 for d in out):
        raise ValueError(f"Reshape: input {list(in_shape)} cannot take shape {list(target)}")
    return tuple(out)


def flatten_shape(in_shape: Sequence[int], axis: int) -> tuple[int, int]:
    """Flatten's 2-D shape: dims before ``axis`` (in [-rank, rank]) and dims from it."""
    rank = len(in_shape)
    if not -rank <= axis <= rank:
        raise ValueError(f"axis {axis} is out of range for rank {rank}")
    axis = axis + rank if axis < 0 else axis
    return size_of(in_shape[:axis]), size_of(in_shape[axis:])


def squeeze_shape(in_shape: Sequence[int], axes: Sequence[int] | None) -> tuple[int, ...]:
    """Drop ``axes`` (all size-1 dims when None); squeezing a dim that is not 1 is an error."""
    if axes is None:
        return tuple(d for d in in_shape if d != 1)
    ax = set(normalize_axes(axes, len(in_shape)))
    for a in ax:
        if in_shape[a] != 1:
            raise ValueError(f"Squeeze: dim {a} of {list(in_shape)} is not 1")
    return tuple(d for i, d in enumerate(in_shape) if i not in ax)


def unsqueeze_shape(in_shape: Sequence[int], axes: Sequence[int]) -> tuple[int, ...]:
    """Insert size-1 dims at ``axes`` (indices into the output rank)."""
    rank = len(in_shape) + len(axes)
    ax = set(normalize_axes(axes, rank))
    it = iter(in_shape)
    return tuple(1 if i in ax else next(it) for i in range(rank))


def split_sizes(
    dim: int, n_outputs: int, split: Sequence[int] | None = None, num_outputs: int | None = None
) -> list[int]:
    """Sizes of Split's ``n_outputs`` outputs along a dim of size ``dim``, with onnxruntime's
    checks: ``split`` as given (one size per output, adding up to ``dim``); else Split-18's
    ``num_outputs`` (the node's output count) equal parts, the last one smaller when ``dim``
    does not divide evenly; else equal parts that must divide ``dim`` evenly."""
    if split is not None and len(split):
        sizes = [int(s) for s in split]
        if len(sizes) != n_outputs or sum(sizes) != dim or any(s < 0 for s in sizes):
            raise ValueError(
                f"Cannot split using values in 'split': {len(sizes)} sizes {sizes} (adding up "
                f"to {sum(sizes)}) for {n_outputs} outputs and a dim of {dim} (one size per "
                "output, adding up to the dim)"
            )
        return sizes
    if num_outputs is not None:
        if num_outputs != n_outputs:
            raise ValueError(
                f"Number of outputs ({n_outputs}) does not match num_outputs ({num_outputs})"
            )
        part = -(-dim // n_outputs)
        sizes = [part] * (n_outputs - 1) + [dim - part * (n_outputs - 1)]
        if sizes[-1] < 0:
            raise ValueError(f"Split: dim {dim} cannot be split into {n_outputs} outputs")
        return sizes
    if dim % n_outputs:
        raise ValueError(
            f"Input cannot be split evenly on selected axis: a dim of {dim} into {n_outputs} "
            "outputs (give 'split' sizes, or Split-18's num_outputs)"
        )
    return [dim // n_outputs] * n_outputs


def slice_ranges(
    shape: Sequence[int],
    starts: Sequence[int],
    ends: Sequence[int],
    axes: Sequence[int] | None = None,
    steps: Sequence[int] | None = None,
) -> list[tuple[int, int, int]]:
    """Slice's normalized (start, stop, step) per dim, clamped like ONNX (and Python) do.

    ``stop`` may be -1 for a negative step that runs to the beginning; the output size of a dim
    is ``max(0, ceil((stop - start) / step))``.
    """
    rank = len(shape)
    out = [(0, int(d), 1) for d in shape]
    axes = list(range(len(starts))) if axes is None or not len(axes) else list(axes)
    steps = [1] * len(starts) if steps is None or not len(steps) else list(steps)
    for a, s, e, st in zip(normalize_axes(axes, rank), starts, ends, steps):
        dim, s, e, st = int(shape[a]), int(s), int(e), int(st)
        if st == 0:
            raise ValueError("Slice: step cannot be 0")
        s = s + dim if s < 0 else s
        e = e + dim if e < 0 else e
        if st > 0:
            s, e = min(max(s, 0), dim), min(max(e, 0), dim)
        else:
            s, e = min(max(s, 0), dim - 1), min(max(e, -1), dim - 1)
        out[a] = (s, e, st)
    return out


def pad_widths(
    rank: int, pads: Sequence[int], axes: Sequence[int] | None = None
) -> list[tuple[int, int]]:
    """Pad's per-dim (begin, end) from ONNX pads (all begins then all ends) over ``axes``."""
    axes = list(range(rank)) if axes is None or not len(axes) else normalize_axes(axes, rank)
    if len(pads) != 2 * len(axes):
        raise ValueError(f"Pad: {len(pads)} pads for {len(axes)} axes")
    out = [(0, 0)] * rank
    for i, a in enumerate(axes):
        out[a] = (int(pads[i]), int(pads[len(axes) + i]))
    return out


def padded_shape(shape: Sequence[int], widths: Sequence[tuple[int, int]]) -> tuple[int, ...]:
    """Pad's output shape for per-dim (begin, end) widths; negative widths crop, but never
    below an empty dim (onnxruntime: "Tensor shape.Size() must be >= 0")."""
    out = tuple(int(d) + b + e for d, (b, e) in zip(shape, widths))
    bad = [k for k, d in enumerate(out) if d < 0]
    if bad:
        k = bad[0]
        raise ValueError(
            f"Pad: pads {[list(w) for w in widths]} crop dim {k} of input {list(shape)} to "
            f"{out[k]} (< 0)"
        )
    return out


def shape_range(rank: int, start: int = 0, end: int | None = None) -> tuple[int, int]:
    """Shape-15's [start, end) over the dims, clamped to [0, rank]."""
    start = min(max(start + rank if start < 0 else start, 0), rank)
    end = rank if end is None else min(max(end + rank if end < 0 else end, 0), rank)
    return start, max(start, end)


def axes_input(axes: Any) -> tuple[int, ...]:
    """An ``axes`` input (Reduce-13/18+) as ints: a 1-D tensor (onnxruntime: "An axes tensor
    must be a vector tensor")."""
    shape = getattr(axes, "shape", None)
    if shape is None or len(shape) != 1:
        raise ValueError(
            f"An axes tensor must be a vector tensor (1-D), got shape {list(shape or ())}"
        )
    return tuple(int(v) for v in axes)


def pad_constant(value: Any) -> Any:
    """Pad's ``constant_value`` input as a scalar: 0 when absent, else its one element
    (onnxruntime: "Value tensor should be a 1D tensor of size 1")."""
    if value is None:
        return 0
    if value.size != 1:
        raise ValueError(
            f"Pad: constant_value must hold exactly one value, got shape {list(value.shape)}"
        )
    return value.reshape(-1)[0]


def reduce_axes(
    axes: Sequence[int] | None, rank: int, noop_with_empty_axes: bool = False
) -> tuple[int, ...] | None:
    """The axes a Reduce op reduces: all when none are given (None when that is a no-op)."""
    if axes is None or not len(axes):
        return None if noop_with_empty_axes else tuple(range(rank))
    return tuple(sorted(normalize_axes(axes, rank)))


def coerced_2d(shape: Sequence[int], axis: int) -> tuple[int, int]:
    """(rows, cols) of the 2-D view opset<13 Softmax/LogSoftmax/Hardmax work on."""
    return flatten_shape(shape, axis)


def range_length(start: float, limit: float, delta: float) -> int:
    """Range's element count: max(ceil((limit - start) / delta), 0)."""
    if delta == 0:
        raise ValueError("Range: delta cannot be 0")
    if isinstance(start, int) and isinstance(limit, int) and isinstance(delta, int):
        return max(-((start - limit) // delta), 0)
    return max(int(math.ceil((limit - start) / delta)), 0)
