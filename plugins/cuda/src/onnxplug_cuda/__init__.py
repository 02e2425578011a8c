"""onnxplug-cuda: the CUDA execution provider plugin for onnxplug.

Installed, it registers ``CUDAExecutionProvider`` through the ``onnxplug.execution_providers``
entry point; ``onnxplug.get_available_providers()`` lists it when a CUDA device is usable.
"""

from .cache import use_cache_folder_for_kernels

use_cache_folder_for_kernels()  # before CuPy compiles anything in this process

from .factory import CudaEpFactory, create_factory  # noqa: E402

__all__ = ["CudaEpFactory", "create_factory"]
