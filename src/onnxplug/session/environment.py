"""The process-wide environment: plugins, shared allocators, environment config entries and
the data-transfer manager (onnxruntime's OrtEnv). Sessions and Values share it.

Environment config entries are onnxruntime's ``OrtEnvCreationOptions::config_entries``:
``ep_factory.<factory name>.arena.*`` configures the shared arenas a provider factory creates
(``onnxplug.add_environment_config_entry``)."""

from __future__ import annotations

import threading
from collections.abc import Mapping

from ..ep.api import EpDevice, EpFactory, supports
from ..ep.loader import REGISTRY, PluginRegistry
from ..errors import InvalidArgument
from ..framework.memory import Allocator, Device, MemoryInfo
from ..framework.stream import DataTransfer, DataTransferManager


class Environment:
    def __init__(self, registry: PluginRegistry):
        self.registry = registry
        self.transfer = DataTransferManager()
        # keyed by id(factory): entries are dropped when the factory is unloaded, so an id
        # is never that of a dead factory
        self._allocators: dict[tuple[int, MemoryInfo], Allocator] = {}
        self._transfers: dict[int, DataTransfer | None] = {}
        self._lock = threading.RLock()
        self.config: dict[str, str] = {}
        registry.add_unload_listener(self._forget)

    def factory_arena_options(self, factory: EpFactory) -> dict[str, str]:
        """The ``ep_factory.<factory name>.arena.*`` entries, as bare ``arena.*`` keys (the
        factory's name as-is, case-sensitive, like onnxruntime)."""
        prefix = f"ep_factory.{factory.name}."
        with self._lock:
            return {
                k[len(prefix) :]: v
                for k, v in self.config.items()
                if k.startswith(prefix + "arena.")
            }

    def ensure_transfer(self, factory: EpFactory) -> None:
        with self._lock:
            if id(factory) in self._transfers:
                return
            dt = None
            if supports(getattr(factory, "api_version", 1), "data_transfer"):
                dt = factory.create_data_transfer()
                if dt is not None:
                    self.transfer.register(dt)
            self._transfers[id(factory)] = dt

    def _forget(self, factory: EpFactory) -> None:
        """Release what the environment holds of an unloaded factory."""
        with self._lock:
            dt = self._transfers.pop(id(factory), None)
            if dt is not None:
                self.transfer.unregister(dt)
            for key in [k for k in self._allocators if k[0] == id(factory)]:
                factory.release_allocator(self._allocators.pop(key))

    def create_allocator(
        self, factory: EpFactory, memory_info: MemoryInfo, options: Mapping[str, str] | None
    ) -> Allocator:
        """A reference to ``factory``'s shared allocator of ``memory_info``, configured (if it
        is created now) by the environment's ``ep_factory.<name>.arena.*`` entries overlaid
        with ``options``. Release it with ``factory.release_allocator``."""
        merged = {**self.factory_arena_options(factory), **(options or {})}
        alloc = factory.create_allocator(memory_info, merged or None)
        if alloc is None:
            raise InvalidArgument(
                f"execution provider '{factory.name}' has no allocator for memory "
                f"'{memory_info.name}' on {memory_info.device}"
            )
        return alloc

    def shared_allocator(self, factory: EpFactory, memory_info: MemoryInfo) -> Allocator:
        """The allocator the environment holds for ``memory_info`` (OrtValues, IOBinding and
        sessions with ``session.use_env_allocators=1`` use it)."""
        key = (id(factory), memory_info)
        with self._lock:
            alloc = self._allocators.get(key)
            if alloc is None:
                alloc = self._allocators[key] = self.create_allocator(factory, memory_info, None)
            return alloc

    def registered_allocator(self, factory: EpFactory, memory_info: MemoryInfo) -> Allocator | None:
        with self._lock:
            return self._allocators.get((id(factory), memory_info))

    def register_allocator(
        self, factory: EpFactory, memory_info: MemoryInfo, options: Mapping[str, str]
    ) -> Allocator:
        """onnxruntime's ``CreateSharedAllocator(..., replace_existing=true)``: let go of the
        environment's allocator for ``memory_info`` and ask the factory for one configured
        by ``options``. The factory makes a new one only when nothing else still holds the
        old one; otherwise it warns that the options were ignored."""
        key = (id(factory), memory_info)
        with self._lock:
            old = self._allocators.pop(key, None)
            if old is not None:
                factory.release_allocator(old)
            alloc = self._allocators[key] = self.create_allocator(factory, memory_info, options)
            return alloc

    @staticmethod
    def memory_info_for(ep_device: EpDevice | None, device: Device) -> MemoryInfo:
        if ep_device is not None:
            if ep_device.memory_info.device == device:
                return ep_device.memory_info
            hm = ep_device.host_accessible_memory_info
            if hm is not None and hm.device == device:
                return hm
        return MemoryInfo(device.type.capitalize(), device)

    def find_device(self, device_type: str, device_id: int) -> EpDevice:
        """The EP device whose memory is ``device_type:device_id`` (for Values and IOBinding)."""
        want = device_type.lower()
        for d in self.registry.ep_devices():
            dev = d.memory_info.device
            if dev.type == want and dev.id == int(device_id):
                return d
        known = sorted({f"{d.memory_info.device}" for d in self.registry.ep_devices()})
        raise InvalidArgument(
            f"no execution provider offers device '{device_type}:{device_id}'; devices: {known}"
        )

    def allocator_for_device(self, device_type: str, device_id: int) -> tuple[Allocator, EpDevice]:
        d = self.find_device(device_type, device_id)
        self.ensure_transfer(d.factory)
        return self.shared_allocator(d.factory, d.memory_info), d

    def transfer_for(self, device: Device) -> DataTransferManager:
        if not device.is_cpu:
            d = self.find_device(device.type, device.id)
            self.ensure_transfer(d.factory)
        return self.transfer


_ENV: Environment | None = None
_ENV_LOCK = threading.Lock()


def get_environment() -> Environment:
    global _ENV
    if _ENV is None:
        with _ENV_LOCK:
            if _ENV is None:
                _ENV = Environment(REGISTRY)
    return _ENV
