"""Shape logic of ONNX ops, shared by every provider's kernels.

Kernels of different providers must agree on output shapes, padding and axis rules; that
logic lives here once (re-exported to plugins as ``onnxplug.ep.shapes``).
"""

from __future__ import annotations

from collections.abc import Sequence


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


def size_of(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
