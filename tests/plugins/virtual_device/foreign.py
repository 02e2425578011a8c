"""Another library's tensors on the virtual device: the stand-in for PyTorch or CuPy tensors on
a GPU in the DLPack tests.

A ``VirtArray`` lives in memory of the virtual device (poisoned when fresh) and has a stream of
its own, where its writes are queued, as a CUDA library's kernels are: until that stream runs,
the memory holds NaNs. It speaks DLPack as the protocol asks of a device library: as a
producer it makes the consumer's stream wait for its pending work (``__dlpack__(stream=...)``),
as a consumer it passes its own stream (``from_dlpack``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from onnxplug.ep import Allocation, dlpack, host_view

from .stream import Stats, VirtStream, stream_of


class VirtArray:
    def __init__(self, factory: Any, shape: tuple[int, ...], dtype: Any, memory: Any = None):
        self.factory = factory
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)
        nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        if memory is None:  # our own block of the device's memory
            alloc = factory.allocator
            memory = Allocation(alloc, alloc.alloc(max(nbytes, 1)), nbytes)
        self.memory = memory
        self.ptr = memory.ptr
        self.stream = VirtStream(factory.device, Stats())  # "the current stream"

    @classmethod
    def filled_later(cls, factory: Any, data: np.ndarray) -> VirtArray:
        """A new array whose contents are written by work still queued on its stream."""
        a = cls(factory, data.shape, data.dtype)
        view, src = a._view(), np.array(data)
        a.stream.enqueue(lambda: np.copyto(view, src))
        return a

    def _view(self) -> np.ndarray:
        return host_view(self.ptr, self.shape, self.dtype, self.memory)

    def read(self) -> np.ndarray:
        """The contents once this array's stream ran what is queued on it."""
        self.stream.flush()
        return self._view().copy()

    # DLPack producer --------------------------------------------------------------------------
    def __dlpack_device__(self) -> tuple[int, int]:
        return (dlpack.EXT_DEV, self.factory.device.id)

    def __dlpack__(self, *, stream: Any = None, **kwargs: Any) -> Any:
        if stream != dlpack.NO_SYNC:
            consumer = stream_of(stream) if stream is not None else None
            note = self.stream.create_notification()
            note.activate()
            if consumer is None:
                note.wait_on_host()  # the default stream: everything before is done
            else:
                note.wait_on_device(consumer)
        dev = self.__dlpack_device__()
        return dlpack.to_capsule(self.ptr, self.shape, self.dtype, dev[0], dev[1], self)

    # DLPack consumer --------------------------------------------------------------------------
    @classmethod
    def from_dlpack(cls, factory: Any, producer: Any) -> VirtArray:
        """In place, ordered after the producer's work: our stream is passed to it."""
        out = cls.__new__(cls)
        out.factory = factory
        out.stream = VirtStream(factory.device, Stats())
        imp = dlpack.from_capsule(producer.__dlpack__(stream=out.stream.handle))
        assert (imp.device_type, imp.device_id) == (dlpack.EXT_DEV, factory.device.id)
        out.shape, out.dtype, out.ptr, out.memory = imp.shape, imp.dtype, imp.ptr, imp.owner
        return out
