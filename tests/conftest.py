"""Shared fixtures: the virtual-device test plugin, registered for one test at a time."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# ``tests.plugins.virtual_device`` is imported by its registration target, so the repo root
# must be importable however pytest was started.
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import onnxplug  # noqa: E402
from tests.plugins import virtual_device as vd  # noqa: E402

VIRT = "tests.plugins.virtual_device"


@contextlib.contextmanager
def registered(name: str, target: str) -> Iterator[vd.VirtualDeviceFactory]:
    """Register the plugin ``target`` ("package.module:factory") as ``name`` and yield its
    factory; unregister afterwards."""
    onnxplug.register_execution_provider_library(name, target)
    try:
        yield next(d.factory for d in onnxplug.get_ep_devices() if d.ep_name == name)
    finally:
        onnxplug.unregister_execution_provider_library(name)


@pytest.fixture
def virt() -> Iterator[vd.VirtualDeviceFactory]:
    """The virtual device ``virt:0`` as VirtualDeviceExecutionProvider."""
    with registered(vd.NAME, f"{VIRT}:create_factory") as f:
        yield f


@pytest.fixture
def virt1() -> Iterator[vd.VirtualDeviceFactory]:
    """A second virtual device, ``virt:1``, as VirtualDevice1ExecutionProvider."""
    with registered(vd.SECOND_NAME, f"{VIRT}:create_second_factory") as f:
        yield f


@pytest.fixture
def virt_b() -> Iterator[vd.VirtualDeviceFactory]:
    """A second provider on ``virt:0`` (VirtualDeviceBExecutionProvider)."""
    with registered(vd.SHARED_DEVICE_NAME, f"{VIRT}:create_shared_device_factory") as f:
        yield f


@pytest.fixture
def virt_arena() -> Iterator[vd.VirtualDeviceFactory]:
    """The virtual device ``virt:2`` whose sessions share one BFC arena
    (VirtualDeviceArenaExecutionProvider)."""
    with registered(vd.ARENA_NAME, f"{VIRT}:create_arena_factory") as f:
        yield f
