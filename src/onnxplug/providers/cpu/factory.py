"""The CPU provider's factory and EP, written against ``onnxplug.ep`` like any plugin."""

from __future__ import annotations

from typing import Any

from onnxplug.ep import (
    CPU,
    CPU_MEMORY,
    DeferredKernelRegistry,
    Ep,
    EpDevice,
    EpFactory,
    HardwareDevice,
    KernelRegistry,
    SessionConfig,
)

from .kernels import cpu_registry
from .threads import BLAS_THREADS

NAME = "CPUExecutionProvider"
# the session's intra_op_num_threads, as the session hands it to its providers
THREADS_KEY = "session.intra_op_num_threads"
# built on its first query: a session whose nodes all go to another provider never asks
_REGISTRY = DeferredKernelRegistry(NAME, cpu_registry)


class CpuEp(Ep):
    name = NAME
    device = CPU

    def __init__(self, factory: EpFactory, ep_device: EpDevice | None, config: SessionConfig):
        super().__init__(factory, ep_device, config)
        self.threads = int(config.get(THREADS_KEY, "0") or 0)  # 0: the libraries' defaults

    def get_kernel_registry(self) -> KernelRegistry:
        return _REGISTRY

    def on_run_start(self, run_options: Any) -> None:
        if self.threads:
            BLAS_THREADS.enter(self.threads)

    def on_run_end(self, run_options: Any, sync_stream: bool) -> None:
        if self.threads:
            BLAS_THREADS.exit()


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
