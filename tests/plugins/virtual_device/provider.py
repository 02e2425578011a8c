"""The virtual device's factory and EP (the plugin's object model)."""

from __future__ import annotations

from collections.abc import Mapping

from onnxplug.ep import (
    Allocator,
    Device,
    Ep,
    EpDevice,
    EpFactory,
    GraphView,
    HardwareDevice,
    KernelRegistry,
    MemoryInfo,
    SessionConfig,
)

from .allocator import VirtAllocator
from .kernels import REGISTRY
from .stream import Stats, VirtDataTransfer, VirtStream

NAME = "VirtualDeviceExecutionProvider"
VENDOR = "onnxplug-tests"
VENDOR_ID = 0xF0F0
STREAM_MODES = ("deferred", "none")


class VirtualDeviceEp(Ep):
    """One session's virtual-device provider.

    Provider options: ``ops`` (comma-separated op types it may claim; default: every op it
    has a kernel for) and ``streams`` (``deferred``: queued streams, the default; ``none``:
    no stream, kernels run synchronously).
    """

    def __init__(self, factory: VirtualDeviceFactory, ep_device: EpDevice, config: SessionConfig):
        super().__init__(factory, ep_device, config)
        self.name = factory.name
        self.device = factory.device
        self.stats = factory.stats
        self.options = config.with_prefix(f"ep.{self.name.lower()}.")
        ops = self.options.get("ops")
        self.ops = {o.strip() for o in ops.split(",") if o.strip()} if ops is not None else None
        self.stream_mode = self.options.get("streams", "deferred")
        if self.stream_mode not in STREAM_MODES:
            raise ValueError(f"streams must be one of {STREAM_MODES}, got '{self.stream_mode}'")
        factory.eps_created += 1
        factory.last_config = config

    def get_kernel_registry(self) -> KernelRegistry:
        return REGISTRY

    def get_capability(self, graph: GraphView) -> list:
        claimed = super().get_capability(graph)
        if self.ops is None:
            return claimed
        return [n for n in claimed if n.op_type in self.ops]

    def create_sync_stream(self) -> VirtStream | None:
        if self.stream_mode == "none":
            return None
        return VirtStream(self.device, self.stats)

    def get_provider_options(self) -> dict[str, str]:
        return {"device_id": str(self.device.id), "streams": self.stream_mode, **self.options}


class VirtualDeviceFactory(EpFactory):
    """Offers one virtual device whose memory is host memory behind a counting allocator."""

    vendor = VENDOR
    vendor_id = VENDOR_ID
    version = "1.0.0"

    def __init__(self, name: str = NAME, device_id: int = 0):
        self.name = name
        self.device = Device("virt", device_id, VENDOR_ID, host_accessible=True)
        self.memory_info = MemoryInfo("Virt", self.device)
        self.allocator = VirtAllocator(self.memory_info)
        self.stats = Stats()
        self.eps_created = 0
        self.last_config: SessionConfig | None = None  # what the last EP was created with

    def get_supported_devices(self, hardware: list[HardwareDevice]) -> list[EpDevice]:
        # the host only discovers the CPU: the plugin enumerates its own device
        dev_id = self.device.id
        hw = HardwareDevice("NPU", VENDOR, VENDOR_ID, dev_id, {"virtual": "1"})
        return [
            EpDevice(
                self.name,
                VENDOR,
                hw,
                ep_metadata={"virt_device_id": str(dev_id)},
                ep_options={"device_id": str(dev_id)},
                memory_info=self.memory_info,
                factory=self,
            )
        ]

    def create_ep(self, devices: list[EpDevice], config: SessionConfig) -> Ep:
        if len(devices) != 1 or devices[0].memory_info != self.memory_info:
            raise ValueError(f"{self.name} needs exactly one of its own devices, got {devices}")
        return VirtualDeviceEp(self, devices[0], config)

    def create_allocator(
        self, memory_info: MemoryInfo, options: Mapping[str, str] | None
    ) -> Allocator | None:
        return self.allocator if memory_info.device == self.device else None

    def create_data_transfer(self) -> VirtDataTransfer:
        return VirtDataTransfer([self.device], self.stats)

    def is_stream_aware(self) -> bool:
        return True

    def create_sync_stream(self, memory_info: MemoryInfo) -> VirtStream:
        return VirtStream(self.device, self.stats)
