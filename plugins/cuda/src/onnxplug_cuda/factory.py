"""The CUDA provider's factory: devices, shared allocators, data transfer, streams.

Allocators are shared per device ordinal and reference-counted (onnxruntime's per-device
cache): ``create_allocator(Cuda memory of device N, options)`` returns the device's one arena
(or memory pool with ``arena.use_cuda_mempool=1``), creating it with ``options`` if no one
holds it; options arriving once it exists are ignored with a warning. ``CudaPinned`` memory
gets a pinned-host arena. When the last reference goes the allocator is closed (its free
regions go back to the device at once, the others as their blocks are freed).
"""

from __future__ import annotations

import functools
import threading
import warnings
from collections.abc import Mapping
from typing import Any

from onnxplug.ep import (
    Allocator,
    BFCArena,
    Device,
    EpDevice,
    EpFactory,
    HardwareDevice,
    KernelRegistry,
    MemoryInfo,
    MemType,
    SessionConfig,
    SharedArenas,
    dlpack,
)

from .ep import NAME, CudaEp, create_ep
from .options import ArenaSettings, CudaOptions, arena_settings
from .runtime import (
    CudaDeviceInfo,
    create_context_in_background,
    probe_devices,
)

NVIDIA = 0x10DE


class CudaEpFactory(EpFactory):
    name = NAME
    vendor = "NVIDIA"
    vendor_id = NVIDIA
    version = "0.1.0"
    device_type = "cuda"
    # Written against API 3 (its kernels' workspaces are tagged with their sync stream, so its
    # sessions run concurrently); it needs API 2 (its node timer is a DeviceTimer), and on a
    # host of API 2 it does not advertise concurrent runs (``CudaEp.is_concurrent_run_supported``)
    api_version = 3
    min_host_api_version = 2

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._shared = SharedArenas(self.name)
        self._backends: dict[int, Any] = {}
        self._import_streams: dict[int, Any] = {}  # ordinal -> DLPack import stream
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
                create_context_in_background(ordinal)  # while the session is set up
                from .backend import CupyBackend

                b = self._backends[ordinal] = CupyBackend(
                    ordinal, Device(self.device_type, ordinal, NVIDIA)
                )
            return b

    def kernel_registry(self, options: CudaOptions) -> KernelRegistry:
        return _registry(options.enable_cudnn)

    def create_stream(self, ep: CudaEp, user_handle: int | None, shared: bool = False) -> Any:
        # a memory pool frees a destroyed stream's blocks on stream 0 (an arena needs no help:
        # it listens for the stream's release)
        on_close = getattr(ep.run_allocator(), "retire_stream", None)
        return self._new_stream(ep, user_handle, on_close, shared)

    def _new_stream(self, ep: CudaEp, user_handle: int | None, on_close: Any, shared: bool) -> Any:
        from .stream import CudaSyncStream

        return CudaSyncStream(
            ep.device, ep.ordinal, user_handle, ep.options.enable_cudnn, on_close, shared
        )

    def create_device_timer(self, ep: CudaEp) -> Any:
        """The timer of ``ep``'s nodes while profiling (CUDA events on their streams)."""
        from .stream import CudaEventTimer

        return CudaEventTimer(ep.ordinal)

    def device_guard(self, ordinal: int) -> Any:
        """A context manager making device ``ordinal`` current for a block (the simulation's
        moves a simulated current device)."""
        from .runtime import DeviceGuard

        return DeviceGuard(ordinal)

    def synchronize(self, ordinal: int) -> None:
        from .runtime import device_synchronize

        device_synchronize(ordinal)

    # allocators and transfers -------------------------------------------------------------------
    def create_allocator(
        self, memory_info: MemoryInfo, options: Mapping[str, str] | None
    ) -> Allocator | None:
        """A reference to the shared allocator of ``memory_info``'s device ("Cuda": the
        device arena or memory pool, "CudaPinned": the pinned arena). ``options``: ``arena.*``
        keys (and ``gpu_mem_limit`` / ``arena_extend_strategy``), invalid ones an error naming
        the key; they take effect if this call creates the allocator."""
        if memory_info.name not in ("Cuda", "CudaPinned"):
            return None
        settings = arena_settings(options or {}, f"{self.name} allocator")
        what = "device arena" if memory_info.name == "Cuda" else "pinned arena"
        if memory_info.name == "Cuda" and settings.use_cuda_mempool:
            what = "memory pool"
        return self._shared.acquire(
            (memory_info.name, memory_info.device.id),
            settings,
            lambda: self._make_allocator(memory_info, settings),
            explicit=bool(options),
            what=f"CUDA {what}",
        )

    def _make_allocator(self, memory_info: MemoryInfo, settings: ArenaSettings) -> Allocator:
        ordinal = memory_info.device.id
        if memory_info.name == "CudaPinned":
            return BFCArena(self._raw_pinned(memory_info), settings.arena, stream_aware=False)
        if settings.use_cuda_mempool:
            why = self._mempool_unsupported(ordinal)
            if why is None:
                from .memory import CudaMempoolAllocator

                return CudaMempoolAllocator(
                    memory_info,
                    ordinal,
                    settings.arena.max_mem,
                    settings.cuda_mempool_release_threshold,
                    settings.cuda_mempool_bytes_to_keep_on_shrink,
                )
            warnings.warn(
                f"{self.name}: CUDA mempool requested but not supported on this device/driver "
                f"({why}). Falling back to default BFCArena with CUDA allocator.",
                RuntimeWarning,
                stacklevel=5,
            )
        return self._device_arena(memory_info, settings)

    def _device_arena(self, memory_info: MemoryInfo, settings: ArenaSettings) -> BFCArena:
        from .memory import CudaDeviceAllocator, CudaDeviceArena

        return CudaDeviceArena(
            CudaDeviceAllocator(memory_info, memory_info.device.id), settings.arena
        )

    def _raw_pinned(self, memory_info: MemoryInfo) -> Allocator:
        from .memory import CudaPinnedAllocator

        return CudaPinnedAllocator(memory_info)

    def _mempool_unsupported(self, ordinal: int) -> str | None:
        from .memory import mempool_unsupported

        return mempool_unsupported(ordinal)

    def release_allocator(self, allocator: Allocator) -> None:
        # onnxruntime: "Refcount underflow ... Ignoring release." (not ours: nothing to do)
        self._shared.release(allocator)

    def shared_allocator(self, memory_info: MemoryInfo) -> Allocator | None:
        """The shared allocator of ``memory_info`` while someone holds it (no reference)."""
        return self._shared.get((memory_info.name, memory_info.device.id))

    def create_data_transfer(self) -> Any:
        from .transfer import CudaDataTransfer

        return CudaDataTransfer(self.device_type)

    def is_stream_aware(self) -> bool:
        return True

    # DLPack and the CUDA array interface -----------------------------------------------------
    dlpack_device_type = dlpack.CUDA

    def dlpack_import_stream(self, device: Device) -> Any:
        """One stream per device on which DLPack producers (and ``__cuda_array_interface__``
        streams) order their pending work; the runs that read an imported tensor wait on an
        event recorded on it, so no host synchronisation is needed."""
        if device.type != self.device_type:
            return None
        with self._lock:
            s = self._import_streams.get(device.id)
            if s is None:
                from .stream import CudaSyncStream

                s = self._import_streams[device.id] = CudaSyncStream(
                    device, device.id, None, enable_cudnn=False, shared=True
                )
            return s

    def device_id_of(self, ptr: int) -> int | None:
        """The ordinal of the device whose memory ``ptr`` points into (None: not device
        memory of this process)."""
        from .runtime import cuda_status, cudart

        rt = cudart()
        try:
            attrs = rt.pointerGetAttributes(ptr)
        except Exception as e:  # not a pointer the runtime knows (the call cleared the error)
            if cuda_status(e) is None:
                raise
            return None
        if attrs.type != rt.memoryTypeDevice:
            return None
        return int(attrs.device)


@functools.cache
def _registry(enable_cudnn: bool) -> KernelRegistry:
    from .kernels import build_registry

    return build_registry(NAME, enable_cudnn)


def create_factory() -> CudaEpFactory:
    return CudaEpFactory()
