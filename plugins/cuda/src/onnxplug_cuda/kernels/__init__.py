"""CUDA kernels, one module per op family. Every module here not starting with ``_`` defines
``register(registry, enable_cudnn)``; they are registered in name order.

Kernels combine a device array with a Python or numpy scalar through ``xp``'s ufuncs
(``xp.multiply(a, 2)``, ``xp.less(a, 0)``), not through operators (``a * 2``, ``a < 0``): CuPy
sends those operators through numpy's dispatch, whose first step imports cupyx and SciPy
(0.4-0.7 s) in the middle of a model's first run. Operators between two device arrays, in-place
operators and a Python scalar on the left (``1 - a``) are CuPy's own and fine.
tests/test_cuda_imports.py checks every kernel the node suite reaches."""

from __future__ import annotations

import importlib
import pkgutil

from onnxplug.ep import IfKernel, KernelRegistry, LoopKernel, MemType, ScanKernel


def kernel_modules() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


def build_registry(provider: str, enable_cudnn: bool = True) -> KernelRegistry:
    reg = KernelRegistry(provider)
    # Control flow: the host runs the subgraphs; conditions and trip counts are read on the host.
    reg.kernel("If", since=1, input_memory={0: MemType.CPU_INPUT})(IfKernel)
    reg.kernel("Loop", since=1, input_memory={0: MemType.CPU_INPUT, 1: MemType.CPU_INPUT})(
        LoopKernel
    )
    reg.kernel("Scan", since=9)(ScanKernel)
    for name in kernel_modules():
        importlib.import_module(f"{__name__}.{name}").register(reg, enable_cudnn)
    return reg
