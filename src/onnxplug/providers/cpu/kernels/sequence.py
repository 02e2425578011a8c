"""Sequence position ops (SequenceAt, SequenceErase, SequenceInsert), native so that a position
out of range is an error as in onnxruntime: onnx.reference's versions index Python lists,
where an insert past the end silently appends and a negative index wraps around twice.

A sequence is a Python list of tensors; the ops return new lists and never modify their input.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from onnxplug.ep import InvalidArgument, Kernel, KernelContext, KernelRegistry


def _position(ctx: KernelContext, index: int, size: int, default: int, upper: int) -> int:
    """The position input ``index`` normalized to [0, upper], ``default`` when absent; a
    position outside [-size, upper] is an InvalidArgument naming it and the size."""
    p = ctx.input(index) if index < ctx.input_count else None
    if p is None:
        return default
    arr = np.asarray(p)
    if arr.size != 1 or arr.dtype.kind not in "iu":
        raise InvalidArgument(f"the position must be an integer scalar, got {arr.dtype}{arr.shape}")
    pos = int(arr.reshape(-1)[0])
    if not -size <= pos <= upper:
        raise InvalidArgument(
            f"Invalid sequence index ({pos}) specified for sequence of size ({size})"
        )
    return pos + size if pos < 0 else pos


def _sequence(ctx: KernelContext) -> list[Any]:
    s = ctx.input(0)
    if not isinstance(s, list):
        raise InvalidArgument(f"input 0 must be a sequence, got {type(s).__name__}")
    return s


class SequenceAt(Kernel):
    def compute(self, ctx: KernelContext) -> None:
        s = _sequence(ctx)
        ctx.set_output(0, s[_position(ctx, 1, len(s), 0, len(s) - 1)])


class SequenceErase(Kernel):
    def compute(self, ctx: KernelContext) -> None:
        s = _sequence(ctx)
        if not s:
            raise InvalidArgument("cannot erase from an empty sequence")
        pos = _position(ctx, 1, len(s), len(s) - 1, len(s) - 1)
        ctx.set_output(0, s[:pos] + s[pos + 1 :])


class SequenceInsert(Kernel):
    def compute(self, ctx: KernelContext) -> None:
        s = _sequence(ctx)
        t = ctx.input(1)
        if s and getattr(s[0], "dtype", None) != getattr(t, "dtype", None):
            raise InvalidArgument(
                f"the tensor to insert is {getattr(t, 'dtype', type(t).__name__)}, the "
                f"sequence holds {s[0].dtype}"
            )
        pos = _position(ctx, 2, len(s), len(s), len(s))
        ctx.set_output(0, [*s[:pos], t, *s[pos:]])


def register(registry: KernelRegistry) -> None:
    registry.kernel("SequenceAt", since=11)(SequenceAt)
    registry.kernel("SequenceErase", since=11)(SequenceErase)
    registry.kernel("SequenceInsert", since=11)(SequenceInsert)
