"""The copy kernels the host inserts at device boundaries (onnxruntime's Memcpy nodes).

``MemcpyFromHost`` runs on the destination provider's stream, ``MemcpyToHost`` on the source
provider's stream and waits for the copy before host kernels read the result.
"""

from __future__ import annotations

from typing import Any

from .kernel import Kernel, KernelContext, KernelInfo
from .memory import DeviceTensor
from .stream import DataTransferManager

MEMCPY_FROM_HOST = "MemcpyFromHost"
MEMCPY_TO_HOST = "MemcpyToHost"


class CopyKernel(Kernel):
    def __init__(self, info: KernelInfo, transfer: DataTransferManager):
        super().__init__(info)
        self.transfer = transfer
        self.to_host = info.op_type == MEMCPY_TO_HOST

    def compute(self, ctx: KernelContext) -> None:
        src: Any = ctx.input(0)
        if isinstance(src, list):  # a sequence crosses element by element
            from .control_flow import place
            from .memory import CPU, MemType

            alloc = self.info.get_allocator(MemType.DEFAULT)
            dev = CPU if self.to_host or alloc is None else alloc.memory_info.device
            ctx.set_output(0, [place(t, dev, self.transfer, {dev: alloc}, ctx.stream) for t in src])
            return
        if self.to_host:
            if not isinstance(src, DeviceTensor):  # already on the host
                ctx.set_output(0, src)
                return
            dst = ctx.output(0, src.shape, src.dtype)
            self.transfer.copy(src, dst, ctx.stream)
            if ctx.stream is not None:
                ctx.stream.flush()
            return
        dst = ctx.output(0, src.shape, src.dtype)
        if getattr(src, "size", 1) == 0:
            return
        if not src.flags.c_contiguous if hasattr(src, "flags") else False:
            import numpy as np

            src = np.ascontiguousarray(src)
        self.transfer.copy(src, dst, ctx.stream)
