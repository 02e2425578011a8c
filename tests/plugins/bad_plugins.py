"""Provider plugins that are wrong on purpose, for the loader's error handling."""

from __future__ import annotations

from onnxplug.ep import API_VERSION, EpDevice, HardwareDevice

from .virtual_device import VirtualDeviceFactory


def not_a_factory() -> dict[str, str]:
    return {"name": "NotAFactoryExecutionProvider"}


class FutureFactory(VirtualDeviceFactory):
    """Needs a host API this onnxplug does not have."""

    min_host_api_version = API_VERSION + 1

    def __init__(self) -> None:
        super().__init__("FutureExecutionProvider", 7)


class NewerPluginFactory(VirtualDeviceFactory):
    """Written against a newer API than the host's, but able to run on this host."""

    api_version = API_VERSION + 1
    min_host_api_version = API_VERSION

    def __init__(self) -> None:
        super().__init__("NewerPluginExecutionProvider", 3)


class NoDeviceFactory(VirtualDeviceFactory):
    """Loads, but finds nothing to run on (like the CUDA plugin on a machine without GPU)."""

    def __init__(self) -> None:
        super().__init__("NoDeviceExecutionProvider", 4)

    def get_supported_devices(self, hardware: list[HardwareDevice]) -> list[EpDevice]:
        return []


class CrashingFactory(VirtualDeviceFactory):
    def __init__(self) -> None:
        super().__init__("CrashingExecutionProvider", 5)

    def get_supported_devices(self, hardware: list[HardwareDevice]) -> list[EpDevice]:
        raise RuntimeError("driver version 1.0 is too old")
