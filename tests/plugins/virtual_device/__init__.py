"""A provider plugin whose "device" is host memory: multi-device paths without a GPU.

It is a real plugin (it imports only ``onnxplug.ep``): a factory offering device ``virt:N``,
an EP claiming Add, Sub, Mul, Relu, MatMul, Transpose, Reshape and Identity (views of their
input; Reshape's shape in host memory), Softmax, NonZero, If and Loop (the host's kernels),
a counting allocator over host memory, queued streams with notifications, a data transfer
for host <-> virt, and a device timer for profiling (marks the queued streams reach).
Register it with::

    onnxplug.register_execution_provider_library(
        "VirtualDeviceExecutionProvider", "tests.plugins.virtual_device:create_factory")

``create_second_factory`` offers ``virt:1`` as "VirtualDevice1ExecutionProvider";
``create_arena_factory`` offers ``virt:2`` as "VirtualDeviceArenaExecutionProvider", whose
sessions share one BFC arena over the device's memory;
``create_pinned_factory`` offers ``virt:5`` as "VirtualDevicePinnedExecutionProvider", which also
offers pinned host memory (sessions stage feeds and outputs through it, as with CUDA);
``create_shared_device_factory`` offers ``virt:0`` again as "VirtualDeviceBExecutionProvider"
(two providers on one device, so values cross streams without copies);
``create_api1_factory`` and ``create_api2_factory`` offer ``virt:3`` and ``virt:4`` as
"VirtualDeviceApi1ExecutionProvider" and "VirtualDeviceApi2ExecutionProvider", the plugin
written against plugin API 1 and 2 (no kernel sync stream; API 2 has device timing), whose
sessions share a BFC arena.
"""

from .allocator import VirtAllocator
from .provider import NAME, VirtualDeviceEp, VirtualDeviceFactory
from .stream import Stats, VirtDataTransfer, VirtNotification, VirtStream, VirtTimer

SECOND_NAME = "VirtualDevice1ExecutionProvider"
PINNED_NAME = "VirtualDevicePinnedExecutionProvider"
SHARED_DEVICE_NAME = "VirtualDeviceBExecutionProvider"
ARENA_NAME = "VirtualDeviceArenaExecutionProvider"
API1_NAME = "VirtualDeviceApi1ExecutionProvider"
API2_NAME = "VirtualDeviceApi2ExecutionProvider"


def create_factory() -> VirtualDeviceFactory:
    return VirtualDeviceFactory(NAME, 0)


def create_second_factory() -> VirtualDeviceFactory:
    return VirtualDeviceFactory(SECOND_NAME, 1)


def create_shared_device_factory() -> VirtualDeviceFactory:
    return VirtualDeviceFactory(SHARED_DEVICE_NAME, 0)


def create_arena_factory() -> VirtualDeviceFactory:
    return VirtualDeviceFactory(ARENA_NAME, 2, arena=True)


def create_pinned_factory() -> VirtualDeviceFactory:
    return VirtualDeviceFactory(PINNED_NAME, 5, pinned=True)


def create_api1_factory() -> VirtualDeviceFactory:
    return VirtualDeviceFactory(API1_NAME, 3, arena=True, api_version=1)


def create_api2_factory() -> VirtualDeviceFactory:
    return VirtualDeviceFactory(API2_NAME, 4, arena=True, api_version=2)


__all__ = [
    "API1_NAME",
    "API2_NAME",
    "ARENA_NAME",
    "NAME",
    "PINNED_NAME",
    "SECOND_NAME",
    "SHARED_DEVICE_NAME",
    "Stats",
    "VirtAllocator",
    "VirtDataTransfer",
    "VirtNotification",
    "VirtStream",
    "VirtTimer",
    "VirtualDeviceEp",
    "VirtualDeviceFactory",
    "create_api1_factory",
    "create_api2_factory",
    "create_arena_factory",
    "create_factory",
    "create_pinned_factory",
    "create_second_factory",
    "create_shared_device_factory",
]
