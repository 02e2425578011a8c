"""Host <-> device <-> device copies on a stream, staged through pinned memory.

Host-to-device copies go through a reusable pinned staging buffer, so ``cudaMemcpyAsync`` is
truly asynchronous; the buffer is reused only after the event of its previous copy has
completed. Device-to-host copies land in the pinned buffer and are copied out after the stream
has reached them. Without a stream, copies complete before returning.

Every copy runs with the device it works on current (the device side of a host copy, the
stream's device, else the destination, of a device copy). A copy between two GPUs is a
``cudaMemcpyPeerAsync``: peer-to-peer where the devices can reach each other's memory (peer
access is enabled the first time), else staged through host memory by the driver
(``runtime.peer_route``); ``CudaDataTransfer.routes`` counts the copies by route.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import numpy as np

from onnxplug.ep import DataTransfer, Device, DeviceTensor, SyncStream, counters

from .runtime import DeviceGuard, call, cuda_error, cudart, peer_route

SAME = "same"  # a copy within one device (the other routes: runtime.PEER, runtime.HOST)

_STAGING_MIN = 1 << 20
_DIRECT_BELOW = 1 << 16  # small host copies skip the staging buffer


class _Staging:
    """One growable pinned buffer with the event of its last use (an event of the device the
    buffer's copies go to or come from: one buffer per thread and device)."""

    def __init__(self) -> None:
        self.ptr = 0
        self.size = 0
        self.event: Any = None
        self.lock = threading.Lock()

    def ensure(self, nbytes: int) -> None:
        rt = cudart()
        if self.event is not None:
            counters.bump(counters.HOST_SYNCS)
            call("cudaEventSynchronize", rt.eventSynchronize, self.event)
        if nbytes <= self.size:
            return
        if self.ptr:
            rt.freeHost(self.ptr)
        size = max(_STAGING_MIN, 1 << (nbytes - 1).bit_length())
        self.ptr = int(call("cudaHostAlloc", rt.hostAlloc, size, rt.hostAllocDefault))
        self.size = size
        if self.event is None:
            self.event = call(
                "cudaEventCreateWithFlags", rt.eventCreateWithFlags, rt.eventDisableTiming
            )

    def view(self, nbytes: int) -> np.ndarray:
        from onnxplug.ep import host_view

        return host_view(self.ptr, (nbytes,), np.uint8, self)


def _host_ptr(a: np.ndarray) -> int:
    return int(a.ctypes.data)


class CudaDataTransfer(DataTransfer):
    def __init__(self, device_type: str = "cuda"):
        self.device_type = device_type
        self._staging = threading.local()
        # copies between GPU memory by route (SAME, runtime.PEER, runtime.HOST), outside the
        # bound copies of a run's feeds and outputs within one device: what tests read
        self.routes: Counter[str] = Counter()

    def can_copy(self, src: Device, dst: Device) -> bool:
        t = self.device_type
        return (src.type == t and dst.type in (t, "cpu")) or (src.type == "cpu" and dst.type == t)

    def _gpu(self, value: Any) -> int | None:
        """The ordinal of a GPU tensor; None for host memory (numpy, or a pinned tensor)."""
        if isinstance(value, DeviceTensor) and value.device.type == self.device_type:
            return value.device.id
        return None

    def _ordinal(self, stream: SyncStream | None, *values: Any) -> int:
        """The device a copy works on: its stream's, else the first GPU tensor's."""
        if stream is not None:
            ordinal = getattr(stream, "ordinal", None)
            if ordinal is not None:
                return int(ordinal)
            if stream.device.type == self.device_type:
                return stream.device.id
        for v in values:
            o = self._gpu(v)
            if o is not None:
                return o
        return 0

    def _stage(self, ordinal: int) -> _Staging:
        bufs = getattr(self._staging, "bufs", None)
        if bufs is None:
            bufs = self._staging.bufs = {}
        s = bufs.get(ordinal)
        if s is None:
            s = bufs[ordinal] = _Staging()
        return s

    def copy_tensors(self, pairs: list[tuple[Any, Any]], stream: SyncStream | None) -> None:
        rt = cudart()
        h = stream.handle if stream is not None else 0
        for src, dst in pairs:
            if isinstance(src, DeviceTensor) and isinstance(dst, DeviceTensor):
                with DeviceGuard(self._ordinal(stream, dst, src)):
                    self._d2d(src, dst, h)
                    if stream is None:
                        counters.bump(counters.HOST_SYNCS)
                        call("cudaStreamSynchronize", rt.streamSynchronize, 0)
            elif isinstance(dst, DeviceTensor):
                ordinal = self._ordinal(stream, dst)
                with DeviceGuard(ordinal):
                    self._h2d(np.ascontiguousarray(src), dst, h, ordinal)
            else:
                ordinal = self._ordinal(stream, src)
                with DeviceGuard(ordinal):
                    self._d2h(src, dst, h, ordinal)

    def _d2d(self, src: DeviceTensor, dst: DeviceTensor, h: int) -> None:
        n = src.nbytes
        if not n:
            return
        rt = cudart()
        a, b = self._gpu(src), self._gpu(dst)
        if a is not None and b is not None and a != b:
            self.routes[peer_route(a, b)] += 1
            call("cudaMemcpyPeerAsync", rt.memcpyPeerAsync, dst.ptr, b, src.ptr, a, n, h)
            return
        if a is not None and b is not None:
            self.routes[SAME] += 1
        if src.ptr != dst.ptr:
            kind = rt.memcpyDefault
            call("cudaMemcpyAsync(D2D)", rt.memcpyAsync, dst.ptr, src.ptr, n, kind, h)

    def bind_copy(self, src: Any, dst: Any, stream: SyncStream) -> Any:
        """Between two tensors with fixed memory (device or pinned host), on a stream: one
        ``cudaMemcpyAsync`` (``cudaMemcpyPeerAsync`` between two GPUs) with its arguments
        resolved once. It is called inside a run, whose device the run made current."""
        if not (isinstance(src, DeviceTensor) and isinstance(dst, DeviceTensor)):
            return None
        n = src.nbytes
        if n != dst.nbytes:
            return None
        if n == 0:
            return lambda: None
        rt = cudart()
        a, b = self._gpu(src), self._gpu(dst)
        if a is not None and b is not None and a != b:
            return self._bind_peer(src, dst, a, b, stream)
        memcpy, d, s_, kind, h = rt.memcpyAsync, dst.ptr, src.ptr, rt.memcpyDefault, stream.handle

        def copy() -> None:  # a replayed run makes two of these: ~1 µs each
            try:
                memcpy(d, s_, n, kind, h)
            except Exception as e:
                raise cuda_error("cudaMemcpyAsync", e) from e

        return copy

    def _bind_peer(
        self, src: DeviceTensor, dst: DeviceTensor, a: int, b: int, stream: SyncStream
    ) -> Any:
        rt = cudart()
        with DeviceGuard(self._ordinal(stream, dst)):
            route = peer_route(a, b)
        memcpy = rt.memcpyPeerAsync
        args = (dst.ptr, b, src.ptr, a, src.nbytes, stream.handle)
        routes = self.routes

        def copy() -> None:
            call("cudaMemcpyPeerAsync", memcpy, *args)
            routes[route] += 1

        return copy

    def _h2d(self, src: np.ndarray, dst: DeviceTensor, h: int, ordinal: int) -> None:
        rt = cudart()
        n = src.nbytes
        if n == 0:
            return
        kind = rt.memcpyHostToDevice
        if n < _DIRECT_BELOW or h == 0:
            # pageable source: the call returns once the source has been consumed
            call("cudaMemcpyAsync(H2D)", rt.memcpyAsync, dst.ptr, _host_ptr(src), n, kind, h)
            if h == 0:
                counters.bump(counters.HOST_SYNCS)
                call("cudaStreamSynchronize", rt.streamSynchronize, 0)
            return
        st = self._stage(ordinal)
        with st.lock:
            st.ensure(n)
            np.copyto(st.view(n), src.reshape(-1).view(np.uint8))
            call("cudaMemcpyAsync(H2D)", rt.memcpyAsync, dst.ptr, st.ptr, n, kind, h)
            call("cudaEventRecord", rt.eventRecord, st.event, h)

    def _d2h(self, src: DeviceTensor, dst: np.ndarray, h: int, ordinal: int) -> None:
        rt = cudart()
        n = src.nbytes
        if n == 0:
            return
        kind = rt.memcpyDeviceToHost
        if dst.flags.c_contiguous and (n < _DIRECT_BELOW or h == 0):
            call("cudaMemcpyAsync(D2H)", rt.memcpyAsync, _host_ptr(dst), src.ptr, n, kind, h)
            counters.bump(counters.HOST_SYNCS)
            call("cudaStreamSynchronize", rt.streamSynchronize, h)
            return
        st = self._stage(ordinal)
        with st.lock:
            st.ensure(n)
            call("cudaMemcpyAsync(D2H)", rt.memcpyAsync, st.ptr, src.ptr, n, kind, h)
            counters.bump(counters.HOST_SYNCS)
            call("cudaStreamSynchronize", rt.streamSynchronize, h)
            np.copyto(dst, st.view(n).view(src.dtype).reshape(src.shape))
