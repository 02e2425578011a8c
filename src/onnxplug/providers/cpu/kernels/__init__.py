"""The CPU kernel registry: native numpy kernels for the ops that matter for speed, the host's
control-flow kernels, and onnx.reference implementations (behind our kernel API) for the long
tail. Later registrations win, so native kernels override the reference ones."""

from __future__ import annotations

import functools
import importlib

from onnxplug.ep import IfKernel, KernelRegistry, LoopKernel, ScanKernel

from .reference import register_reference_kernels

NAME = "CPUExecutionProvider"
# Modules of native kernels; each defines ``register(registry)``.
NATIVE_MODULES: tuple[str, ...] = ()


@functools.cache
def cpu_registry() -> KernelRegistry:
    reg = KernelRegistry(NAME)
    register_reference_kernels(reg)
    reg.kernel("If", since=1)(IfKernel)
    reg.kernel("Loop", since=1)(LoopKernel)
    reg.kernel("Scan", since=8)(ScanKernel)
    for mod in NATIVE_MODULES:
        importlib.import_module(f"{__name__}.{mod}").register(reg)
    return reg
