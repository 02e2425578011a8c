"""onnxplug: an ONNX inference runtime with plugin execution providers.

The API mirrors ``onnxruntime``'s, so ``import onnxplug as ort`` is a one-line switch::

    import onnxplug as ort
    sess = ort.InferenceSession("model.onnx", providers=["CPUExecutionProvider"])
    outputs = sess.run(None, {"input": x})
"""

from __future__ import annotations

from typing import Any

from . import capi, errors
from ._version import __version__
from .ep.api import API_VERSION
from .ep.loader import REGISTRY as _REGISTRY
from .framework import seed as _seed
from .session import log as _log
from .session.devices import (
    OrtAllocatorType,
    OrtDevice,
    OrtDeviceMemoryType,
    OrtDeviceVendorId,
    OrtEpAssignedNode,
    OrtEpAssignedSubgraph,
    OrtEpDevice,
    OrtExecutionProviderDevicePolicy,
    OrtHardwareDevice,
    OrtHardwareDeviceType,
    OrtMemoryInfo,
    OrtMemoryInfoDeviceType,
    OrtMemType,
    OrtSparseFormat,
    SparseTensor,
)
from .session.environment import get_environment as _get_environment
from .session.inference_session import InferenceSession, ModelMetadata, NodeArg
from .session.io_binding import IOBinding, SessionIOBinding
from .session.memory import (
    OrtArenaCfg,
    create_and_register_allocator,
    create_and_register_allocator_v2,
)
from .session.options import (
    ExecutionMode,
    ExecutionOrder,
    GraphOptimizationLevel,
    RunOptions,
    SessionOptions,
)
from .session.value import OrtValue, Value

version = __version__
package_name = "onnxplug"


def get_available_providers() -> list[str]:
    """Providers that loaded and found a device, in default priority order (CPU last)."""
    return _REGISTRY.available_providers()


def get_all_providers() -> list[str]:
    """onnxruntime's provider names and every plugin's, installed or not, CPU last."""
    return _REGISTRY.all_providers()


def get_ep_devices() -> list[OrtEpDevice]:
    """Every (provider, device) pair the installed plugins offer."""
    return [OrtEpDevice(d) for d in _REGISTRY.ep_devices()]


def register_execution_provider_library(registration_name: str, path_or_target: str) -> None:
    """Register a provider plugin by ``"package.module:factory"`` (or ``"package.module"``)."""
    _REGISTRY.register(registration_name, path_or_target)


def unregister_execution_provider_library(registration_name: str) -> None:
    _REGISTRY.unregister(registration_name)


def get_provider_load_errors() -> dict[str, str]:
    """Why each provider that failed to load did so."""
    return {lib.name: lib.error for lib in _REGISTRY.libraries() if lib.error}


def add_environment_config_entry(key: str, value: str) -> None:
    """Set an environment config entry (onnxruntime's ``OrtEnvCreationOptions``
    ``config_entries``), e.g. ``ep_factory.CUDAExecutionProvider.arena.max_mem``: the
    ``ep_factory.<provider>.arena.*`` entries configure the shared arenas that provider
    creates from now on (an arena that already exists keeps its configuration)."""
    if not isinstance(key, str) or not key:
        from .errors import InvalidArgument

        raise InvalidArgument("an environment config key must be a non-empty string")
    env = _get_environment()
    with env._lock:
        env.config[key] = str(value)


def get_environment_config_entries() -> dict[str, str]:
    env = _get_environment()
    with env._lock:
        return dict(env.config)


def get_device() -> str:
    return "GPU" if any(p != "CPUExecutionProvider" for p in get_available_providers()) else "CPU"


def get_version_string() -> str:
    return __version__


def get_build_info() -> str:
    return f"onnxplug {__version__}, plugin API {API_VERSION}"


def set_default_logger_severity(severity: int) -> None:
    """The severity (0 verbose .. 4 fatal) printed by sessions whose log_severity_level is
    -1 (the default) and by messages of no session."""
    _log.set_default_severity(severity)


def set_default_logger_verbosity(verbosity: int) -> None:
    """The default log verbosity, for sessions whose log_verbosity_level is 0."""
    _log.set_default_verbosity(verbosity)


def set_default_logger_callback(callback: Any, severity: int = 2) -> None:
    """Send log lines to ``callback(severity, category, logid, code_location, message)``
    instead of stderr (None: back to stderr); ``severity`` becomes the default severity."""
    _log.set_callback(callback, severity)


def set_seed(seed: int) -> None:
    """The seed of random ops that have no ``seed`` attribute, read when a session creates
    their kernels (as in onnxruntime)."""
    _seed.set_seed(seed)


def enable_telemetry_events() -> None:
    """Accepted for compatibility: onnxplug sends no telemetry."""


def disable_telemetry_events() -> None:
    """Accepted for compatibility: onnxplug sends no telemetry."""


def preload_dlls(*args: Any, **kwargs: Any) -> None:
    """Accepted for compatibility: provider plugins load their own libraries."""


__all__ = [
    "API_VERSION",
    "ExecutionMode",
    "ExecutionOrder",
    "GraphOptimizationLevel",
    "IOBinding",
    "InferenceSession",
    "ModelMetadata",
    "NodeArg",
    "OrtAllocatorType",
    "OrtArenaCfg",
    "OrtDevice",
    "OrtDeviceMemoryType",
    "OrtDeviceVendorId",
    "OrtEpAssignedNode",
    "OrtEpAssignedSubgraph",
    "OrtEpDevice",
    "OrtExecutionProviderDevicePolicy",
    "OrtHardwareDevice",
    "OrtHardwareDeviceType",
    "OrtMemType",
    "OrtMemoryInfo",
    "OrtMemoryInfoDeviceType",
    "OrtSparseFormat",
    "OrtValue",
    "RunOptions",
    "SessionIOBinding",
    "SessionOptions",
    "SparseTensor",
    "Value",
    "add_environment_config_entry",
    "capi",
    "create_and_register_allocator",
    "create_and_register_allocator_v2",
    "disable_telemetry_events",
    "enable_telemetry_events",
    "errors",
    "get_all_providers",
    "get_available_providers",
    "get_build_info",
    "get_device",
    "get_environment_config_entries",
    "get_ep_devices",
    "get_provider_load_errors",
    "get_version_string",
    "package_name",
    "register_execution_provider_library",
    "set_default_logger_callback",
    "set_default_logger_severity",
    "set_default_logger_verbosity",
    "set_seed",
    "unregister_execution_provider_library",
    "version",
]

# onnxruntime.capi._pybind_state's counterpart re-exports the names above: imported last
from .capi import _pybind_state as _pybind_state  # noqa: E402
