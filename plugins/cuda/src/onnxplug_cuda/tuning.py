"""The CUDA provider's tuning results (onnxruntime's ``CudaTuningContext``): the GEMM tuning
results of a device (``tunable_op_*``, ``blas.GemmTuning``) as ``get_tuning_results`` and
``set_tuning_results`` exchange them, with the validators they hold for.

Results are a device's, in this process, shared by the sessions on it (as the on-disk tuning
cache is): what its GEMM engines tuned or found in the cache, and what any session was given.
Validators: ``ORT_VERSION`` (onnxplug's version), ``CUDA_VERSION`` (the CUDA runtime's),
``DEVICE_MODEL`` (the device's name), as in onnxruntime, and ``CUBLASLT_VERSION``, since a
result is an index into cuBLASLt's list of candidates for the signature.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import numpy as np

from onnxplug.ep import TuningContext, TuningResultsManager

# (provider name, ordinal) -> the device's results (the simulated devices have their own)
_results: dict[tuple[str, int], TuningResultsManager] = {}
_lock = threading.Lock()
SIMULATED = "host-simulated"


def tuning_results(ep: Any) -> TuningResultsManager:
    """The GEMM tuning results of provider instance ``ep``'s device in this process."""
    key = (ep.name, ep.ordinal)
    with _lock:
        manager = _results.get(key)
        if manager is None:
            manager = _results[key] = TuningResultsManager()
        return manager


def _cuda_version(ep: Any) -> str:
    if ep.backend.xp is np:
        return SIMULATED
    return str(ep.backend.xp.cuda.runtime.runtimeGetVersion())


def _cublaslt_version(ep: Any) -> str:
    if ep.backend.xp is np:
        return SIMULATED
    from .blas import NVMATH

    try:
        L, _ = NVMATH.modules()
    except ImportError:
        return "none"  # no nvmath-python: no cuBLASLt GEMMs, nothing tuned
    return str(L.get_version())


class CudaTuningContext(TuningContext):
    """A CUDA provider instance's view of its device's tuning results."""

    def __init__(self, ep: Any):
        super().__init__(ep.name, tuning_results(ep))
        self._ep = ep
        model = str(ep.ep_device.ep_metadata.get("cuda_device_name", ""))
        self.register_validator(
            "CUDA_VERSION", lambda: _cuda_version(ep), "CUDA runtime version mismatch"
        )
        self.register_validator("DEVICE_MODEL", lambda: model, "Device model mismatch")
        self.register_validator(
            "CUBLASLT_VERSION", lambda: _cublaslt_version(ep), "cuBLASLt version mismatch"
        )

    def enable_tunable_op(self) -> None:
        """Turn ``tunable_op_enable`` on for the kernels the session makes from now on (results
        embedded in a model do this before the session's kernels are made)."""
        ep = self._ep
        if not ep.options.tunable_op_enable:
            ep.options = dataclasses.replace(ep.options, tunable_op_enable=True)
