"""onnxplug-cuda: the CUDA execution provider plugin for onnxplug.

Installed, it registers ``CUDAExecutionProvider`` through the ``onnxplug.execution_providers``
entry point; ``onnxplug.get_available_providers()`` lists it when a CUDA device is usable.
"""

from .factory import CudaEpFactory, create_factory

__all__ = ["CudaEpFactory", "create_factory"]
