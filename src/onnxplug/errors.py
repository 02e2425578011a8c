"""Typed exceptions mirroring onnxruntime's (``onnxruntime.capi.onnxruntime_pybind11_state``).

Every error names what it is about (the input, node, option or provider) so a user can act on it.
The classes, their status names and codes are onnxruntime's (``OrtErrorCode``), so that
``except onnxruntime.capi.onnxruntime_pybind11_state.X`` handlers carry over unchanged.
The classes derive from the matching Python built-ins where onnxruntime users might catch those
(``InvalidArgument`` is a ``ValueError``, ``NoSuchFile`` a ``FileNotFoundError``, ...).
"""

from __future__ import annotations


class OnnxPlugError(RuntimeError):
    """Base of every onnxplug error (onnxruntime's ``Fail`` family)."""

    status = "FAIL"

    def __init__(self, message: str):
        super().__init__(f"[ONNXPlugError] : {self.code} : {self.status} : {message}")
        self.message = message

    code = 1


class Fail(OnnxPlugError):
    status = "FAIL"
    code = 1


class InvalidArgument(OnnxPlugError, ValueError):
    status = "INVALID_ARGUMENT"
    code = 2


class NoSuchFile(OnnxPlugError, FileNotFoundError):
    status = "NO_SUCHFILE"
    code = 3


class NoModel(OnnxPlugError):
    status = "NO_MODEL"
    code = 4


class EngineError(OnnxPlugError):
    status = "ENGINE_ERROR"
    code = 5


class RuntimeException(OnnxPlugError):
    status = "RUNTIME_EXCEPTION"
    code = 6


class OutOfMemory(RuntimeException, MemoryError):
    """An allocator could not serve a request (onnxruntime reports it as RUNTIME_EXCEPTION,
    "Failed to allocate memory for requested buffer of size ..."); also a ``MemoryError``."""


class InvalidProtobuf(OnnxPlugError):
    status = "INVALID_PROTOBUF"
    code = 7


class ModelLoaded(OnnxPlugError):
    status = "MODEL_LOADED"
    code = 8


class NotImplemented(OnnxPlugError, NotImplementedError):
    status = "NOT_IMPLEMENTED"
    code = 9


class InvalidGraph(OnnxPlugError):
    status = "INVALID_GRAPH"
    code = 10


class EPFail(OnnxPlugError):
    status = "EP_FAIL"
    code = 11


class GraphCaptureViolation(EPFail):
    """Work that a captured graph cannot hold (a device allocation, a host synchronisation)
    was attempted on a stream that is capturing one. The capture is abandoned."""


class ModelLoadCanceled(OnnxPlugError):
    status = "MODEL_LOAD_CANCELED"
    code = 12


class ModelRequiresCompilation(OnnxPlugError):
    status = "MODEL_REQUIRES_COMPILATION"
    code = 13


class NotFound(OnnxPlugError, LookupError):
    status = "NOT_FOUND"
    code = 14


class DeviceReset(OnnxPlugError):
    status = "DEVICE_RESET"
    code = 15


__all__ = [
    "DeviceReset",
    "EPFail",
    "EngineError",
    "Fail",
    "GraphCaptureViolation",
    "InvalidArgument",
    "InvalidGraph",
    "InvalidProtobuf",
    "ModelLoadCanceled",
    "ModelLoaded",
    "ModelRequiresCompilation",
    "NoModel",
    "NoSuchFile",
    "NotFound",
    "NotImplemented",
    "OnnxPlugError",
    "OutOfMemory",
    "RuntimeException",
]
