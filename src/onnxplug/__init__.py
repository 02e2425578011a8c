"""onnxplug: an ONNX inference runtime with plugin execution providers.

The API mirrors ``onnxruntime``'s, so ``import onnxplug as ort`` is a one-line switch::

    import onnxplug as ort
    sess = ort.InferenceSession("model.onnx", providers=["CPUExecutionProvider"])
    outputs = sess.run(None, {"input": x})
"""

from __future__ import annotations

from typing import Any

from . import capi, errors
from .ep.api import API_VERSION, EpDevice
from .ep.loader import REGISTRY as _REGISTRY
from .session.inference_session import InferenceSession, ModelMetadata, NodeArg
from .session.io_binding import IOBinding, SessionIOBinding
from .session.options import (
    ExecutionMode,
    ExecutionOrder,
    GraphOptimizationLevel,
    RunOptions,
    SessionOptions,
)
from .session.value import OrtValue, Value

__version__ = "0.1.0"

OrtEpDevice = EpDevice


def get_available_providers() -> list[str]:
    """Providers that loaded and found a device, in default priority order (CPU last)."""
    return _REGISTRY.available_providers()


def get_all_providers() -> list[str]:
    """onnxruntime's provider names and every plugin's, installed or not, CPU last."""
    return _REGISTRY.all_providers()


def get_ep_devices() -> list[EpDevice]:
    return _REGISTRY.ep_devices()


def register_execution_provider_library(registration_name: str, path_or_target: str) -> None:
    """Register a provider plugin by ``"package.module:factory"`` (or ``"package.module"``)."""
    _REGISTRY.register(registration_name, path_or_target)


def unregister_execution_provider_library(registration_name: str) -> None:
    _REGISTRY.unregister(registration_name)


def get_provider_load_errors() -> dict[str, str]:
    """Why each provider that failed to load did so."""
    return {lib.name: lib.error for lib in _REGISTRY.libraries() if lib.error}


def get_device() -> str:
    return "GPU" if any(p != "CPUExecutionProvider" for p in get_available_providers()) else "CPU"


def get_version_string() -> str:
    return __version__


def get_build_info() -> str:
    return f"onnxplug {__version__}, plugin API {API_VERSION}"


def set_default_logger_severity(severity: int) -> None:
    """Accepted for compatibility; onnxplug logs through Python's logging module."""
    import logging

    logging.getLogger("onnxplug").setLevel(
        {0: 5, 1: 10, 2: 30, 3: 40, 4: 50}.get(int(severity), 30)
    )


def set_default_logger_verbosity(verbosity: int) -> None:
    """Accepted for compatibility; verbose records go to the 'onnxplug' logger at DEBUG."""


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
    "OrtEpDevice",
    "OrtValue",
    "RunOptions",
    "SessionIOBinding",
    "SessionOptions",
    "Value",
    "capi",
    "disable_telemetry_events",
    "enable_telemetry_events",
    "errors",
    "get_all_providers",
    "get_available_providers",
    "get_build_info",
    "get_device",
    "get_ep_devices",
    "get_provider_load_errors",
    "get_version_string",
    "register_execution_provider_library",
    "set_default_logger_severity",
    "set_default_logger_verbosity",
    "unregister_execution_provider_library",
]
