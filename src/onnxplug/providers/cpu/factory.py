"""The CPU provider's factory and EP, written against ``onnxplug.ep`` like any plugin."""

from __future__ import annotations

from onnxplug.ep import (
    CPU,
    CPU_MEMORY,
    Ep,
    EpDevice,
    EpFactory,
    HardwareDevice,
    KernelRegistry,
    SessionConfig,
)

from .kernels import cpu_registry

NAME = "CPUExecutionProvider"


class CpuEp(Ep):
    name = NAME
    device = CPU

    def get_kernel_registry(self) -> KernelRegistry:
        return cpu_registry()


class CpuEpFactory(EpFactory):
    name = NAME
    vendor = "onnxplug"
    version = "0.1.0"

    def get_supported_devices(self, hardware: list[HardwareDevice]) -> list[EpDevice]:
        return [
            EpDevice(NAME, self.vendor, hw, {}, {}, CPU_MEMORY, factory=self)
            for hw in hardware
            if hw.type == "CPU"
        ]

    def create_ep(self, devices: list[EpDevice], config: SessionConfig) -> Ep:
        return CpuEp(self, devices[0] if devices else None, config)


def create_factory() -> CpuEpFactory:
    return CpuEpFactory()
