"""Finding, loading and registering provider plugins.

Plugins come from the entry-point group ``onnxplug.execution_providers`` (``name =
"package.module:factory"``) or from ``register_execution_provider_library(name, target)``.
A target resolves to an ``EpFactory`` instance, an ``EpFactory`` subclass or a callable that
returns one. A plugin that fails to import, has the wrong shape or needs a newer host API is
recorded with a clear message naming it; every other provider keeps working.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from ..errors import Fail, InvalidArgument
from .api import API_VERSION, CPU_HARDWARE, EpDevice, EpFactory

ENTRY_POINT_GROUP = "onnxplug.execution_providers"
# The CPU provider ships in the core distribution; it is found by name like any other plugin,
# so that running from a source tree without installed entry points still has it.
_BUILTIN = {"CPUExecutionProvider": "onnxplug.providers.cpu:create_factory"}

# onnxruntime's provider names (``onnxruntime.get_all_providers()``), CPU last: every name a
# script written for onnxruntime may ask for, whether or not a plugin here provides it.
ONNXRUNTIME_PROVIDERS = (
    "TensorrtExecutionProvider",
    "CUDAExecutionProvider",
    "MIGraphXExecutionProvider",
    "OpenVINOExecutionProvider",
    "DnnlExecutionProvider",
    "VitisAIExecutionProvider",
    "QNNExecutionProvider",
    "NnapiExecutionProvider",
    "VSINPUExecutionProvider",
    "JsExecutionProvider",
    "CoreMLExecutionProvider",
    "DmlExecutionProvider",
    "RknpuExecutionProvider",
    "WebNNExecutionProvider",
    "WebGpuExecutionProvider",
    "XnnpackExecutionProvider",
    "CANNExecutionProvider",
    "AzureExecutionProvider",
    "CPUExecutionProvider",
)
# How to get a provider that is not installed.
_INSTALL_HINTS = {
    "CUDAExecutionProvider": (
        "install the CUDA plugin (`pip install onnxplug-cuda`, or `pip install -e plugins/cuda` "
        "in a source checkout) on a machine with an NVIDIA GPU and driver"
    ),
}


@dataclass
class RegisteredLibrary:
    name: str
    target: str
    factory: EpFactory | None = None
    error: str | None = None
    devices: list[EpDevice] = field(default_factory=list)
    source: str = "registered"  # "entry_point" | "builtin" | "registered"


class PluginRegistry:
    def __init__(self) -> None:
        self._libs: dict[str, RegisteredLibrary] = {}
        self._lock = threading.RLock()
        self._discovered = False
        self._unload_listeners: list[Callable[[EpFactory], None]] = []

    def add_unload_listener(self, fn: Callable[[EpFactory], None]) -> None:
        """Call ``fn(factory)`` when a loaded factory is unregistered or replaced, so that
        whoever holds its allocators and data transfer lets go of them."""
        with self._lock:
            self._unload_listeners.append(fn)

    def _unloaded(self, lib: RegisteredLibrary | None) -> None:
        if lib is not None and lib.factory is not None:
            for fn in list(self._unload_listeners):
                fn(lib.factory)

    # discovery ------------------------------------------------------------------------------
    def _discover(self) -> None:
        if self._discovered:
            return
        with self._lock:
            if self._discovered:
                return
            self._discovered = True
            try:
                eps = metadata.entry_points(group=ENTRY_POINT_GROUP)
            except Exception:  # broken metadata must not break the runtime
                eps = ()  # type: ignore[assignment]
            for ep in eps:
                if ep.name not in self._libs:
                    self._load(ep.name, ep.value, "entry_point")
            for name, target in _BUILTIN.items():
                if name not in self._libs or self._libs[name].factory is None:
                    self._load(name, target, "builtin")

    def _load(self, name: str, target: str, source: str) -> RegisteredLibrary:
        lib = RegisteredLibrary(name, target, source=source)
        try:
            factory = _resolve_factory(name, target)
            _check_factory(name, factory)
            lib.factory = factory
            lib.devices = list(factory.get_supported_devices([CPU_HARDWARE]))
            for d in lib.devices:
                d.factory = factory
        except Exception as e:  # record, never propagate: other providers keep working
            lib.error = f"execution provider plugin '{name}' ({target}) failed to load: {e}"
        self._libs[name] = lib
        return lib

    # public -----------------------------------------------------------------------------------
    def register(self, name: str, target: str) -> None:
        self._discover()
        with self._lock:
            existing = self._libs.get(name)
            if (
                existing is not None
                and existing.factory is not None
                and existing.source != "builtin"
            ):
                raise InvalidArgument(
                    f"an execution provider library is already registered as '{name}'"
                )
            lib = self._load(name, target, "registered")
            if lib.error:
                # keep what was there (the builtin CPU provider, say) working
                if existing is not None:
                    self._libs[name] = existing
                else:
                    del self._libs[name]
                raise Fail(lib.error)
            self._unloaded(existing)

    def unregister(self, name: str) -> None:
        self._discover()
        with self._lock:
            if name not in self._libs:
                raise InvalidArgument(f"no execution provider library is registered as '{name}'")
            self._unloaded(self._libs.pop(name))

    def libraries(self) -> list[RegisteredLibrary]:
        self._discover()
        with self._lock:
            return list(self._libs.values())

    def ep_devices(self) -> list[EpDevice]:
        return [d for lib in self.libraries() if lib.factory for d in lib.devices]

    def available_providers(self) -> list[str]:
        """Names of loaded providers that have at least one device, CPU last."""
        names = [lib.factory.name for lib in self.libraries() if lib.factory and lib.devices]
        names = list(dict.fromkeys(names))
        if "CPUExecutionProvider" in names:
            names.remove("CPUExecutionProvider")
            names.append("CPUExecutionProvider")
        return names

    def find_factory(self, provider_name: str) -> tuple[EpFactory | None, str]:
        """(factory, "") or (None, why it cannot be used and how to get it)."""
        for lib in self.libraries():
            if lib.factory is not None and lib.factory.name == provider_name:
                if not lib.devices:
                    reason = lib.factory.unavailable_reason()
                    return None, (
                        f"execution provider '{provider_name}' is installed but found no device "
                        f"it can use on this machine{f': {reason}' if reason else ''}"
                    )
                return lib.factory, ""
        for lib in self.libraries():
            if lib.name == provider_name and lib.error:
                return None, lib.error
        hint = _INSTALL_HINTS.get(provider_name)
        if hint is not None:
            return None, f"'{provider_name}' is not installed: {hint}"
        if provider_name in ONNXRUNTIME_PROVIDERS:
            return None, f"'{provider_name}' is onnxruntime's, and no onnxplug plugin provides it"
        return None, f"Unknown execution provider '{provider_name}'"

    def all_providers(self) -> list[str]:
        """onnxruntime's provider names and every plugin's, CPU last."""
        names = [lib.factory.name if lib.factory else lib.name for lib in self.libraries()]
        out = [n for n in ONNXRUNTIME_PROVIDERS if n != "CPUExecutionProvider"]
        out += [n for n in dict.fromkeys(names) if n not in ONNXRUNTIME_PROVIDERS]
        return [*out, "CPUExecutionProvider"]

    def devices_of(self, factory: EpFactory) -> list[EpDevice]:
        for lib in self.libraries():
            if lib.factory is factory:
                return lib.devices
        return []


def _resolve_factory(name: str, target: str) -> EpFactory:
    if not isinstance(target, str) or not target:
        raise InvalidArgument(f"plugin '{name}': target must be 'package.module:factory'")
    module_name, _, attr = target.partition(":")
    module = importlib.import_module(module_name)
    candidates = [attr] if attr else ["create_factory", "create_ep_factory", "factory"]
    obj: Any = None
    for a in candidates:
        obj = module
        try:
            for part in a.split("."):
                obj = getattr(obj, part)
            break
        except AttributeError:
            obj = None
    if obj is None:
        raise AttributeError(f"module '{module_name}' has no {' or '.join(candidates)}")
    if isinstance(obj, EpFactory):
        return obj
    if callable(obj):
        made = obj()
        if isinstance(made, EpFactory):
            return made
        raise TypeError(f"'{target}' returned {type(made).__name__}, not an EpFactory")
    raise TypeError(f"'{target}' is {type(obj).__name__}, not an EpFactory or a callable")


def _check_factory(name: str, factory: EpFactory) -> None:
    for attr in ("name", "get_supported_devices", "create_ep"):
        if not getattr(factory, attr, None):
            raise TypeError(f"the factory has no '{attr}'")
    need = int(getattr(factory, "min_host_api_version", 1))
    if need > API_VERSION:
        raise RuntimeError(
            f"it needs plugin API version {need} but this onnxplug provides version "
            f"{API_VERSION}; upgrade onnxplug"
        )


REGISTRY = PluginRegistry()
