"""Compatibility: ``onnxplug.capi.onnxruntime_pybind11_state`` holds the error classes where
onnxruntime users import them from."""
