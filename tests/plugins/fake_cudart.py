"""A stand-in for CuPy's CUDA runtime module (``cupy.cuda.runtime``, what the CUDA provider
calls) with several devices, for testing the CUDA provider's device discipline on machines
without a GPU.

It keeps what CUDA keeps per thread and per object: the current device of each thread, the
device each stream, event and allocation was made on, and which devices have peer access to
which. It refuses what CUDA refuses (an event recorded on a stream of another device, an
unknown device) as CuPy does, raising ``CUDARuntimeError`` with the ``cudaError_t`` as its
``status``, and records every call (by its CUDA name) with the device current at the time, so
a test sees where the provider's code did its work. Device memory is host memory, so copies
really copy. Install it with ``install(monkeypatch, fake)`` (it replaces ``cudart()`` in the
plugin's modules).
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from enum import IntEnum
from typing import Any

import numpy as np


class cudaError_t(IntEnum):
    cudaSuccess = 0
    cudaErrorInvalidValue = 1
    cudaErrorMemoryAllocation = 2
    cudaErrorInvalidDevice = 101
    cudaErrorInvalidResourceHandle = 400
    cudaErrorPeerAccessAlreadyEnabled = 704


class cudaMemcpyKind(IntEnum):
    cudaMemcpyHostToHost = 0
    cudaMemcpyHostToDevice = 1
    cudaMemcpyDeviceToHost = 2
    cudaMemcpyDeviceToDevice = 3
    cudaMemcpyDefault = 4


class CUDARuntimeError(RuntimeError):
    """CuPy's runtime error: ``status`` is the ``cudaError_t``; the text is CuPy's
    ("name: description"), or ``text``, or the number where the status is not one above."""

    def __init__(self, status: int, text: str | None = None):
        self.status = int(status)
        if text is None:
            name = cudaError_t(status).name if status in cudaError_t._value2member_map_ else ""
            text = f"{name}: {name}" if name else f"cudaError {self.status}"
        super().__init__(text)


class FakeCudart:
    CUDARuntimeError = CUDARuntimeError
    eventDefault = 0
    eventDisableTiming = 2
    streamNonBlocking = 1
    hostAllocDefault = 0
    memcpyHostToDevice = cudaMemcpyKind.cudaMemcpyHostToDevice
    memcpyDeviceToHost = cudaMemcpyKind.cudaMemcpyDeviceToHost
    memcpyDefault = cudaMemcpyKind.cudaMemcpyDefault

    def __init__(self, devices: int = 2, peer: bool = True):
        self.devices = devices
        self.peer = peer  # whether cudaDeviceCanAccessPeer says yes for distinct devices
        self.peer_enabled: set[tuple[int, int]] = set()  # (device, peer it can access)
        self.calls: list[tuple[str, int]] = []  # (function, current device)
        self.streams: dict[int, int] = {}  # handle -> device
        self.events: dict[int, int] = {}
        self.memory: dict[int, tuple[int, np.ndarray]] = {}  # ptr -> (device or -1, buffer)
        self._ids = itertools.count(0x1000)
        self._tls = threading.local()
        self._lock = threading.Lock()

    # bookkeeping ------------------------------------------------------------------------------
    @property
    def current(self) -> int:
        return getattr(self._tls, "device", 0)

    def _call(self, name: str) -> None:
        with self._lock:
            self.calls.append((name, self.current))

    def called(self, name: str) -> list[int]:
        """The current device at each call of ``name``."""
        return [d for n, d in self.calls if n == name]

    def device_of_stream(self, handle: int) -> int:
        return self.current if handle in (0, 1, 2) else self.streams[handle]

    def device_of_ptr(self, ptr: int) -> int:
        return self.memory[ptr][0]

    def _alloc(self, size: int, device: int) -> int:
        buf = np.zeros(max(size, 1), np.uint8)
        ptr = int(buf.ctypes.data)
        self.memory[ptr] = (device, buf)
        return ptr

    # devices ----------------------------------------------------------------------------------
    def getDevice(self) -> int:
        return self.current

    def setDevice(self, device: int) -> None:
        self._call("cudaSetDevice")
        if not 0 <= device < self.devices:
            raise CUDARuntimeError(cudaError_t.cudaErrorInvalidDevice)
        self._tls.device = device

    def getDeviceCount(self) -> int:
        return self.devices

    def deviceSynchronize(self) -> None:
        self._call("cudaDeviceSynchronize")

    def deviceCanAccessPeer(self, device: int, peer: int) -> int:
        return int(self.peer and device != peer)

    def deviceEnablePeerAccess(self, peer: int) -> None:
        self._call("cudaDeviceEnablePeerAccess")
        key = (self.current, peer)
        if key in self.peer_enabled:
            raise CUDARuntimeError(cudaError_t.cudaErrorPeerAccessAlreadyEnabled)
        self.peer_enabled.add(key)

    # streams and events -----------------------------------------------------------------------
    def streamCreateWithFlags(self, flags: int) -> int:
        self._call("cudaStreamCreateWithFlags")
        h = next(self._ids)
        self.streams[h] = self.current
        return h

    def streamDestroy(self, handle: int) -> None:
        self.streams.pop(handle, None)

    def streamSynchronize(self, handle: int) -> None:
        self._call("cudaStreamSynchronize")

    def streamIsCapturing(self, handle: int) -> bool:
        return False

    def eventCreateWithFlags(self, flags: int) -> int:
        self._call("cudaEventCreateWithFlags")
        h = next(self._ids)
        self.events[h] = self.current
        return h

    def eventRecord(self, event: int, stream: int) -> None:
        self._call("cudaEventRecord")
        # CUDA: "event and stream must be on the same device"
        if self.events[event] != self.device_of_stream(stream):
            raise CUDARuntimeError(cudaError_t.cudaErrorInvalidResourceHandle)

    def streamWaitEvent(self, stream: int, event: int, flags: int = 0) -> None:
        pass  # waiting on another device's event is allowed

    def eventSynchronize(self, event: int) -> None:
        pass

    def eventDestroy(self, event: int) -> None:
        self.events.pop(event, None)

    # memory -----------------------------------------------------------------------------------
    def malloc(self, size: int) -> int:
        self._call("cudaMalloc")
        return self._alloc(size, self.current)

    def free(self, ptr: int) -> None:
        self._call("cudaFree")
        self.memory.pop(ptr, None)

    def hostAlloc(self, size: int, flags: int) -> int:
        return self._alloc(size, -1)

    def freeHost(self, ptr: int) -> None:
        self.memory.pop(ptr, None)

    def memcpyAsync(self, dst: int, src: int, n: int, kind: int, stream: int) -> None:
        self._call("cudaMemcpyAsync")
        ctypes.memmove(dst, src, n)

    def memcpyPeerAsync(
        self, dst: int, dst_device: int, src: int, src_device: int, n: int, stream: int
    ) -> None:
        self._call("cudaMemcpyPeerAsync")
        if self.device_of_ptr(dst) != dst_device or self.device_of_ptr(src) != src_device:
            raise CUDARuntimeError(cudaError_t.cudaErrorInvalidValue)
        ctypes.memmove(dst, src, n)


def install(monkeypatch: Any, fake: FakeCudart) -> None:
    """Make the CUDA plugin's modules call ``fake`` (and forget the peer routes decided so
    far: they belong to the runtime that decided them)."""
    from onnxplug_cuda import memory, runtime, stream, transfer

    for mod in (runtime, memory, stream, transfer):
        monkeypatch.setattr(mod, "cudart", lambda: fake)
    monkeypatch.setattr(runtime, "_peer_routes", {})
