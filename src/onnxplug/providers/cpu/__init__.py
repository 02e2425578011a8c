"""The CPU execution provider: numpy kernels behind the plugin API."""

from .factory import CpuEp, CpuEpFactory, create_factory

__all__ = ["CpuEp", "CpuEpFactory", "create_factory"]
