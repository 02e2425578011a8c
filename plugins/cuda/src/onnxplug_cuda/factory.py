"""The CUDA provider's factory: devices, shared allocators, data transfer, streams."""

from __future__ import annotations

import functools
import threading
from collections.abc import Mapping
from typing import Any

from onnxplug.ep import (
    Allocator,
    Device,
    EpDevice,
    EpFactory,
    HardwareDevice,
    KernelRegistry,
    MemoryInfo,
    MemType,
    SessionConfig,
)

from .ep import NAME, CudaEp, create_ep
from .options import CudaOptions
from .runtime import CudaDeviceInfo, probe_devices

NVIDIA = 0x10DE


class CudaEpFactory(EpFactory):
    name = NAME
    vendor = "NVIDIA"
    vendor_id = NVIDIA
    version = "0.1.0"
    device_type = "cuda"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._allocators: dict[tuple[str, int], Allocator] = {}
        self._refs: dict[int, int] = {}
        self._backends: dict[int, Any] = {}
        self._reason: str | None = None

    # devices ------------------------------------------------------------------------------------
    def probe(self) -> tuple[list[CudaDeviceInfo], str | None]:
        return probe_devices()

    def get_supported_devices(self, hardware: list[HardwareDevice]) -> list[EpDevice]:
        infos, reason = self.probe()
        # no warning here: a session that asks for this provider warns (or, with the CPU
        # fallback off, fails) with the reason from unavailable_reason()
        self._reason = reason
        if not infos:
            return []
        out = []
        for info in infos:
            hw = HardwareDevice("GPU", "NVIDIA", NVIDIA, info.ordinal, {"name": info.name})
            dev = Device(self.device_type, info.ordinal, NVIDIA)
            pinned = Device("cpu", 0, NVIDIA, host_accessible=True)
            out.append(
                EpDevice(
                    self.name,
                    self.vendor,
                    hw,
                    ep_metadata={
                        "cuda_device_id": str(info.ordinal),
                        "cuda_device_name": info.name,
                        "cuda_compute_capability": f"{info.major}.{info.minor}",
                    },
                    ep_options={"device_id": str(info.ordinal)},
                    memory_info=MemoryInfo("Cuda", dev),
                    host_accessible_memory_info=MemoryInfo(
                        "CudaPinned", pinned, MemType.CPU_OUTPUT
                    ),
                    factory=self,
                )
            )
        return out

    def unavailable_reason(self) -> str | None:
        return self._reason

    def create_ep(self, devices: list[EpDevice], config: SessionConfig) -> CudaEp:
        return create_ep(self, devices, config)

    # pieces the EP uses -----------------------------------------------------------------------
    def backend_for(self, ordinal: int) -> Any:
        with self._lock:
            b = self._backends.get(ordinal)
            if b is None:
                from .backend import CupyBackend

                b = self._backends[ordinal] = CupyBackend(
                    ordinal, Device(self.device_type, ordinal, NVIDIA)
                )
            return b

    def kernel_registry(self, options: CudaOptions) -> KernelRegistry:
        return _registry(options.enable_cudnn)

    def create_stream(self, ep: CudaEp, user_handle: int | None, shared: bool = False) -> Any:
        # blocks allocated on the stream are freed on stream 0 once it is destroyed
        on_close = getattr(ep.run_allocator(), "retire_stream", None)
        return self._new_stream(ep, user_handle, on_close, shared)

    def _new_stream(self, ep: CudaEp, user_handle: int | None, on_close: Any, shared: bool) -> Any:
        from .stream import CudaSyncStream

        return CudaSyncStream(
            ep.device, ep.ordinal, user_handle, ep.options.enable_cudnn, on_close, shared
        )

    def run_allocator(self, ep: CudaEp) -> Allocator:
        mi = ep.ep_device.memory_info
        return ep.get_allocator(mi) or self.create_allocator(mi, None)

    def synchronize(self, ordinal: int) -> None:
        from .runtime import DeviceGuard, check, cudart

        with DeviceGuard(ordinal):
            check(cudart().cudaDeviceSynchronize(), "cudaDeviceSynchronize")

    # allocators and transfers -------------------------------------------------------------------
    def create_allocator(
        self, memory_info: MemoryInfo, options: Mapping[str, str] | None
    ) -> Allocator | None:
        key = (memory_info.name, memory_info.device.id)
        with self._lock:
            alloc = self._allocators.get(key)
            if alloc is None:
                alloc = self._make_allocator(memory_info)
                if alloc is None:
                    return None
                self._allocators[key] = alloc
            self._refs[id(alloc)] = self._refs.get(id(alloc), 0) + 1
            return alloc

    def _make_allocator(self, memory_info: MemoryInfo) -> Allocator | None:
        from .memory import CudaDeviceAllocator, CudaPinnedAllocator

        if memory_info.name == "Cuda":
            return CudaDeviceAllocator(memory_info, memory_info.device.id)
        if memory_info.name == "CudaPinned":
            return CudaPinnedAllocator(memory_info)
        return None

    def limited_allocator(self, memory_info: MemoryInfo, limit: int) -> Allocator:
        """A session's own device pool capped at ``limit`` bytes in use (``gpu_mem_limit``)."""
        from .memory import CudaDeviceAllocator

        return CudaDeviceAllocator(memory_info, memory_info.device.id, limit)

    def release_allocator(self, allocator: Allocator) -> None:
        with self._lock:
            n = self._refs.get(id(allocator), 0) - 1
            if n < 0:
                return  # onnxruntime: "Refcount underflow ... Ignoring release."
            self._refs[id(allocator)] = n

    def create_data_transfer(self) -> Any:
        from .transfer import CudaDataTransfer

        return CudaDataTransfer(self.device_type)

    def is_stream_aware(self) -> bool:
        return True

    # DLPack -------------------------------------------------------------------------------------
    def tensor_to_dlpack(self, t: Any) -> Any:
        return self.backend_for(t.device.id).view(t).toDlpack()

    def tensor_from_dlpack(self, obj: Any) -> Any:
        dev = obj.__dlpack_device__()
        if dev[0] != 2:  # kDLCUDA
            return None
        b = self.backend_for(int(dev[1]))
        arr = b.xp.from_dlpack(obj)
        return b.wrap(arr)


@functools.cache
def _registry(enable_cudnn: bool) -> KernelRegistry:
    from .kernels import build_registry

    return build_registry(NAME, enable_cudnn)


def create_factory() -> CudaEpFactory:
    return CudaEpFactory()
