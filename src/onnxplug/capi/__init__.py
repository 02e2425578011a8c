"""Compatibility: ``onnxplug.capi.onnxruntime_pybind11_state`` holds the error classes where
onnxruntime users import them from."""

from . import onnxruntime_pybind11_state

__all__ = ["onnxruntime_pybind11_state"]
