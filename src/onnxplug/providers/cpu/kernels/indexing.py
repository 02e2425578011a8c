"""Native CPU indexing kernels.

GatherElements: onnx.reference's implementation goes through ``np.choose`` (at most 32
choices), and its fallback mis-shapes results such as BERT's token-type lookup (data [1,512],
indices [1,128], axis 1), so it is done here with ``take_along_axis``.
"""

from __future__ import annotations

import numpy as np

from onnxplug.ep import Kernel, KernelContext, KernelInfo, KernelRegistry, shapes


class GatherElements(Kernel):
    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.axis = int(info.attr("axis", 0))

    def compute(self, ctx: KernelContext) -> None:
        data, idx = ctx.input(0), ctx.input(1)
        if data.ndim != idx.ndim or data.ndim == 0:
            raise ValueError(
                f"GatherElements: data {list(data.shape)} and indices {list(idx.shape)} must "
                "have the same rank (at least 1)"
            )
        axis = shapes.normalize_axis(self.axis, data.ndim)
        n = data.shape[axis]
        idx = idx.astype(np.int64, copy=False)
        if idx.size and (idx.min() < -n or idx.max() >= n):
            raise IndexError(f"GatherElements: an index is outside [{-n}, {n - 1}] on axis {axis}")
        idx = np.where(idx < 0, idx + n, idx)
        # dims of the indices smaller than the data's (outside the axis) read a corner of the
        # data, as onnxruntime does (take_along_axis would broadcast them instead)
        corner = tuple(slice(None) if d == axis else slice(0, k) for d, k in enumerate(idx.shape))
        ctx.set_output(0, np.take_along_axis(data[corner], idx, axis))


def register(registry: KernelRegistry) -> None:
    registry.kernel("GatherElements", since=11)(GatherElements)
