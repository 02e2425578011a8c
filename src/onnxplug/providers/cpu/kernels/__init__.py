"""The CPU kernel registry: native numpy kernels for the ops that matter for speed, the host's
control-flow kernels, and onnx.reference implementations (behind our kernel API) for the long
tail. Native kernels answer first; the reference ones (onnx.reference's import is the slow
part) are registered only when a query finds no native kernel."""

from __future__ import annotations

import functools
import importlib
import pkgutil

from onnxplug.ep import FallbackKernelRegistry, IfKernel, KernelRegistry, LoopKernel, ScanKernel

from .reference import register_reference_kernels

NAME = "CPUExecutionProvider"


def native_modules() -> list[str]:
    """Every module of this package but ``reference`` holds native kernels and defines
    ``register(registry)``; they are registered in name order."""
    names = [m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")]
    return sorted(n for n in names if n != "reference")


def reference_registry() -> KernelRegistry:
    reg = KernelRegistry(NAME)
    register_reference_kernels(reg)
    return reg


@functools.cache
def cpu_registry() -> KernelRegistry:
    """Native kernels, then (built on the first query they do not answer) onnx.reference's,
    with the native modules' checked versions of them (``register_checked``) over them."""
    reg = FallbackKernelRegistry(NAME, reference_registry)
    reg.kernel("If", since=1)(IfKernel)
    reg.kernel("Loop", since=1)(LoopKernel)
    reg.kernel("Scan", since=8)(ScanKernel)
    for mod in native_modules():
        importlib.import_module(f"{__name__}.{mod}").register(reg)
    return reg
