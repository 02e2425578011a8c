"""A host-simulated CUDA device, for testing the CUDA kernels' logic where there is no GPU.

``CUDASimExecutionProvider`` is the CUDA provider with its GPU parts swapped for host ones:
memory is host memory behind the same BFC arena, ``xp`` is numpy instead of CuPy, streams
run work immediately, and GEMM/convolution use the backends' numpy paths. Partitioning,
placement, copies, kernel registration and each kernel's shape and indexing logic are the
real ones. It proves nothing about CUDA itself: the GPU tests do that.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from onnxplug.ep import (
    Allocator,
    BFCArena,
    DataTransfer,
    Device,
    DeviceTensor,
    HostAllocator,
    HostTimer,
    ImmediateStream,
    MemoryInfo,
    SyncStream,
    counters,
    host_view,
)

from .factory import CudaEpFactory
from .runtime import LEGACY_DEFAULT_STREAMS, CudaDeviceInfo

SIM_NAME = "CUDASimExecutionProvider"
SIM_TYPE = "cudasim"

_current = threading.local()


def current_device() -> int:
    """This thread's simulated current device (0 until a guard moves it, as in CUDA)."""
    return getattr(_current, "ordinal", 0)


class SimDeviceGuard:
    """``runtime.DeviceGuard`` for the simulated devices: it moves this thread's simulated
    current device, which the simulated kernels and streams check, so that a provider entry
    that forgets to make its device current fails on two simulated devices as it would
    misbehave on two GPUs."""

    __slots__ = ("ordinal", "prev")

    def __init__(self, ordinal: int):
        self.ordinal = ordinal
        self.prev = 0

    def __enter__(self) -> None:
        self.prev = current_device()
        _current.ordinal = self.ordinal

    def __exit__(self, *exc: Any) -> None:
        _current.ordinal = self.prev


class WrongDevice(RuntimeError):
    """Simulated device work done while another device was current."""


def check_current(ordinal: int, what: str) -> None:
    if current_device() != ordinal:
        raise WrongDevice(
            f"{what} of simulated device {ordinal} while device {current_device()} is current"
        )


class SimStream(ImmediateStream):
    """Work runs at once on the host, so there is nothing to wait for. Its ``handle`` is the
    user's stream handle for a user's stream (``user_compute_stream``), else a number of its
    own, so that tests can see which stream a run used; a user's legacy default stream is
    ``joined`` (``CudaSyncStream``): the work goes on a stream of its own, and ``joins``
    counts the times it waited for the user's stream and the user's stream for it."""

    def __init__(self, device: Device, user_handle: int | None = None):
        super().__init__(device)
        user = None if user_handle is None else int(user_handle)
        self.joined = user if user in LEGACY_DEFAULT_STREAMS else None
        self.joins = {"waits_for_user": 0, "user_waits": 0}
        self._handle = user if user is not None and self.joined is None else id(self)
        if self.joined is not None:
            self.wait_for_user()  # created within a run: that run's start

    def begin_run(self) -> None:
        if self.joined is not None:
            self.wait_for_user()

    def wait_for_user(self) -> None:
        check_current(self.device.id, "a stream's join")
        self.joins["waits_for_user"] += 1

    def user_waits(self) -> None:
        self.joins["user_waits"] += 1

    def on_session_run_end(self) -> None:
        if self.joined is not None:
            self.user_waits()
        super().on_session_run_end()

    @property
    def handle(self) -> int:
        return self._handle

    def flush(self) -> None:
        counters.bump(counters.HOST_SYNCS)  # what the real stream's synchronise would be


class NumpyBackend:
    def __init__(self, ordinal: int, device: Device):
        self.xp = np
        self.ordinal = ordinal
        self.device = device

    can_capture = False  # kernels run at once on the host: nothing to record

    def view(self, t: DeviceTensor) -> np.ndarray:
        """Like the CuPy backend: a planned tensor's view is built once and kept on it."""
        cache = t.stable_view
        if cache is not None:
            v = cache.get(self)
            if v is None:
                counters.bump(counters.VIEWS_BUILT)
                v = cache[self] = host_view(t.ptr, t.shape, t.dtype, t.memory)
            return v
        counters.bump(counters.VIEWS_BUILT)
        return t.host_array()

    def array_at(self, ptr: int, shape: tuple[int, ...], dtype: Any, keep: Any) -> np.ndarray:
        return host_view(ptr, shape, dtype, keep)

    def wrap(self, arr: Any, dtype: Any = None) -> DeviceTensor:
        arr = np.asarray(arr)
        if not arr.flags.c_contiguous:  # (np.ascontiguousarray would make a 0-d array 1-d)
            arr = np.ascontiguousarray(arr)
        if dtype is not None and np.dtype(dtype) != arr.dtype:
            arr = arr.view(dtype)
        return DeviceTensor(
            self.device, arr.dtype, arr.shape, int(arr.ctypes.data) if arr.size else 0, arr
        )

    def activate(self, stream: Any) -> None:
        check_current(self.ordinal, "a kernel")

    def enter_run(self, allocator: Allocator) -> Any:
        return None

    def exit_run(self, token: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


class SimTransfer(DataTransfer):
    def can_copy(self, src: Device, dst: Device) -> bool:
        types = {src.type, dst.type}
        return types <= {"cpu", SIM_TYPE} and SIM_TYPE in types

    def copy_tensors(self, pairs: list[tuple[Any, Any]], stream: SyncStream | None) -> None:
        for src, dst in pairs:
            s = src.host_array() if isinstance(src, DeviceTensor) else np.asarray(src)
            d = dst.host_array() if isinstance(dst, DeviceTensor) else dst
            np.copyto(d, s.reshape(d.shape))


class CudaSimEpFactory(CudaEpFactory):
    name = SIM_NAME
    vendor = "onnxplug"
    device_type = SIM_TYPE
    dlpack_device_type = None  # host memory: exchanged through DLPack as host memory
    backend_class: type[NumpyBackend] = NumpyBackend  # tests model CuPy's dispatch with theirs

    def dlpack_import_stream(self, device: Device) -> Any:
        return None

    def device_id_of(self, ptr: int) -> int | None:
        return None

    def probe(self) -> tuple[list[CudaDeviceInfo], str | None]:
        return [CudaDeviceInfo(0, "host-simulated CUDA device", 9, 0, 1 << 34, 1)], None

    def backend_for(self, ordinal: int) -> Any:
        with self._lock:
            b = self._backends.get(ordinal)
            if b is None:
                b = self._backends[ordinal] = self.backend_class(ordinal, self._device(ordinal))
            return b

    def _device(self, ordinal: int) -> Device:
        return Device(SIM_TYPE, ordinal, host_accessible=True)

    def get_supported_devices(self, hardware: list[Any]) -> list[Any]:
        devs = super().get_supported_devices(hardware)
        for d in devs:
            d.memory_info = MemoryInfo("Cuda", self._device(d.device.device_id))
        return devs

    def _new_stream(
        self, ep: Any, user_handle: int | None, on_close: Any, shared: bool
    ) -> SimStream:
        check_current(ep.ordinal, "a stream")
        s = SimStream(ep.device, user_handle)
        s.frame_owned = not shared
        return s

    def _device_arena(self, memory_info: MemoryInfo, settings: Any) -> BFCArena:
        return BFCArena(HostAllocator(memory_info), settings.arena, stream_aware=True)

    def _raw_pinned(self, memory_info: MemoryInfo) -> Allocator:
        return HostAllocator(memory_info)

    def _mempool_unsupported(self, ordinal: int) -> str | None:
        return "the host-simulated device has no CUDA memory pools"

    def create_data_transfer(self) -> SimTransfer:
        return SimTransfer()

    def create_device_timer(self, ep: Any) -> HostTimer:
        # the simulated streams run work when it is queued: the host clock is its time
        return HostTimer()

    def device_guard(self, ordinal: int) -> SimDeviceGuard:
        return SimDeviceGuard(ordinal)

    def synchronize(self, ordinal: int) -> None:
        pass


def create_factory() -> CudaSimEpFactory:
    return CudaSimEpFactory()
