"""A stand-in for ``cuda.bindings.runtime`` with several devices, for testing the CUDA
provider's device discipline on machines without a GPU.

It keeps what CUDA keeps per thread and per object: the current device of each thread, the
device each stream, event and allocation was made on, and which devices have peer access to
which. It refuses what CUDA refuses (an event recorded on a stream of another device, an
unknown device) and records every call with the device current at the time, so a test sees
where the provider's code did its work. Device memory is host memory, so copies really copy.
Install it with ``install(monkeypatch, fake)`` (it replaces ``cudart()`` in the plugin's
modules, and hides CuPy's runtime from them).
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


OK = cudaError_t.cudaSuccess


class FakeCudart:
    cudaError_t = cudaError_t
    cudaMemcpyKind = cudaMemcpyKind
    cudaEventDefault = 0
    cudaEventDisableTiming = 2
    cudaStreamNonBlocking = 1
    cudaHostAllocDefault = 0

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
    def cudaGetDevice(self) -> tuple:
        return OK, self.current

    def cudaSetDevice(self, device: int) -> tuple:
        self._call("cudaSetDevice")
        if not 0 <= device < self.devices:
            return (cudaError_t.cudaErrorInvalidDevice,)
        self._tls.device = device
        return (OK,)

    def cudaGetDeviceCount(self) -> tuple:
        return OK, self.devices

    def cudaDeviceSynchronize(self) -> tuple:
        self._call("cudaDeviceSynchronize")
        return (OK,)

    def cudaDeviceCanAccessPeer(self, device: int, peer: int) -> tuple:
        return OK, int(self.peer and device != peer)

    def cudaDeviceEnablePeerAccess(self, peer: int, flags: int) -> tuple:
        self._call("cudaDeviceEnablePeerAccess")
        key = (self.current, peer)
        if key in self.peer_enabled:
            return (cudaError_t.cudaErrorPeerAccessAlreadyEnabled,)
        self.peer_enabled.add(key)
        return (OK,)

    def cudaGetLastError(self) -> tuple:
        return (OK,)

    def cudaGetErrorName(self, err: Any) -> tuple:
        return OK, cudaError_t(int(err)).name.encode()

    def cudaGetErrorString(self, err: Any) -> tuple:
        return OK, cudaError_t(int(err)).name.encode()

    # streams and events -----------------------------------------------------------------------
    def cudaStreamCreateWithFlags(self, flags: int) -> tuple:
        self._call("cudaStreamCreateWithFlags")
        h = next(self._ids)
        self.streams[h] = self.current
        return OK, h

    def cudaStreamDestroy(self, handle: int) -> tuple:
        self.streams.pop(handle, None)
        return (OK,)

    def cudaStreamSynchronize(self, handle: int) -> tuple:
        self._call("cudaStreamSynchronize")
        return (OK,)

    def cudaStreamIsCapturing(self, handle: int) -> tuple:
        return OK, 0

    def cudaEventCreateWithFlags(self, flags: int) -> tuple:
        self._call("cudaEventCreateWithFlags")
        h = next(self._ids)
        self.events[h] = self.current
        return OK, h

    def cudaEventRecord(self, event: int, stream: int) -> tuple:
        self._call("cudaEventRecord")
        # CUDA: "event and stream must be on the same device"
        if self.events[event] != self.device_of_stream(stream):
            return (cudaError_t.cudaErrorInvalidResourceHandle,)
        return (OK,)

    def cudaStreamWaitEvent(self, stream: int, event: int, flags: int) -> tuple:
        return (OK,)  # waiting on another device's event is allowed

    def cudaEventSynchronize(self, event: int) -> tuple:
        return (OK,)

    def cudaEventDestroy(self, event: int) -> tuple:
        self.events.pop(event, None)
        return (OK,)

    # memory -----------------------------------------------------------------------------------
    def cudaMalloc(self, size: int) -> tuple:
        self._call("cudaMalloc")
        return OK, self._alloc(size, self.current)

    def cudaFree(self, ptr: int) -> tuple:
        self._call("cudaFree")
        self.memory.pop(ptr, None)
        return (OK,)

    def cudaHostAlloc(self, size: int, flags: int) -> tuple:
        return OK, self._alloc(size, -1)

    def cudaFreeHost(self, ptr: int) -> tuple:
        self.memory.pop(ptr, None)
        return (OK,)

    def cudaMemcpyAsync(self, dst: int, src: int, n: int, kind: Any, stream: int) -> tuple:
        self._call("cudaMemcpyAsync")
        ctypes.memmove(dst, src, n)
        return (OK,)

    def cudaMemcpyPeerAsync(
        self, dst: int, dst_device: int, src: int, src_device: int, n: int, stream: int
    ) -> tuple:
        self._call("cudaMemcpyPeerAsync")
        if self.device_of_ptr(dst) != dst_device or self.device_of_ptr(src) != src_device:
            return (cudaError_t.cudaErrorInvalidValue,)
        ctypes.memmove(dst, src, n)
        return (OK,)


def install(monkeypatch: Any, fake: FakeCudart) -> None:
    """Make the CUDA plugin's modules call ``fake`` (and forget the peer routes decided so
    far: they belong to the runtime that decided them)."""
    from onnxplug_cuda import memory, runtime, stream, transfer

    for mod in (runtime, memory, stream, transfer):
        monkeypatch.setattr(mod, "cudart", lambda: fake)
    # the per-run calls go through CuPy's runtime where CuPy is installed: not here
    for mod in (runtime, stream):
        monkeypatch.setattr(mod, "cupy_runtime", lambda: None)
    monkeypatch.setattr(runtime, "_peer_routes", {})
