"""Native CPU kernels for deprecated ONNX ops that onnx.reference does not implement.

``Scatter`` (opsets 9-10) was renamed ``ScatterElements`` in opset 11 and the old name was
deprecated there; models exported for opset 9/10 still use it. Its semantics are
ScatterElements without a reduction: ``out = data`` then, for every position ``p`` of
``indices``, ``out[p with p[axis] replaced by indices[p]] = updates[p]``.
"""

from __future__ import annotations

import numpy as np

from onnxplug.ep import InvalidArgument, Kernel, KernelContext, KernelInfo, KernelRegistry


def scatter_elements(
    data: np.ndarray, indices: np.ndarray, updates: np.ndarray, axis: int, where: str
) -> np.ndarray:
    """ScatterElements without reduction (duplicate indices: the last update wins)."""
    rank = data.ndim
    if not -rank <= axis < max(rank, 1):
        raise InvalidArgument(f"{where}: axis {axis} is out of range for rank {rank}")
    axis %= max(rank, 1)
    if indices.shape != updates.shape:
        raise InvalidArgument(
            f"{where}: indices {list(indices.shape)} and updates {list(updates.shape)} must "
            "have the same shape"
        )
    if indices.ndim != rank:
        raise InvalidArgument(
            f"{where}: indices have rank {indices.ndim}, data has rank {rank}; they must match"
        )
    for d in range(rank):
        if d != axis and indices.shape[d] > data.shape[d]:
            raise InvalidArgument(
                f"{where}: indices dimension {d} is {indices.shape[d]}, larger than data's "
                f"{data.shape[d]}"
            )
    size = data.shape[axis] if rank else 1
    idx = indices.astype(np.int64, copy=False)
    if idx.size and (idx.min() < -size or idx.max() >= size):
        bad = idx[(idx < -size) | (idx >= size)].reshape(-1)[0]
        raise InvalidArgument(
            f"{where}: index {int(bad)} is out of bounds for axis {axis} of size {size}"
        )
    idx = np.where(idx < 0, idx + size, idx)
    out = data.copy()
    # Other axes are addressed by their own position, broadcast against the indices' shape.
    pos = [
        idx
        if d == axis
        else np.arange(indices.shape[d]).reshape([-1 if k == d else 1 for k in range(rank)])
        for d in range(rank)
    ]
    out[tuple(pos)] = updates
    return out


class Scatter(Kernel):
    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.axis = int(info.attr("axis", 0))
        self.where = f"Scatter node '{info.name}'"

    def compute(self, ctx: KernelContext) -> None:
        data, indices, updates = ctx.input(0), ctx.input(1), ctx.input(2)
        ctx.set_output(0, scatter_elements(data, indices, updates, self.axis, self.where))


def register(registry: KernelRegistry) -> None:
    registry.kernel("Scatter", since=9, until=10)(Scatter)
