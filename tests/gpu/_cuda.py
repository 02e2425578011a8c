"""Shared helpers of the GPU tests: the skip marks, and running one model on the CUDA provider
and on the CPU provider for comparison."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import onnxplug as ox

CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"

# ``pytestmark = cuda_marks`` in a test module: marked ``cuda``, skipped without a usable GPU.
cuda_marks = [
    pytest.mark.cuda,
    pytest.mark.skipif(CUDA not in ox.get_available_providers(), reason="no usable CUDA device"),
]


def assignment(sess: Any) -> dict[str, str]:
    """node name -> provider that runs it."""
    return {r["node_name"]: r["ep"] for r in sess.get_provider_graph_assignment_info()}


def run_cuda_and_cpu(
    model: bytes, feeds: dict[str, np.ndarray], options: dict[str, str] | None = None
) -> tuple[list[np.ndarray], list[np.ndarray], dict[str, str]]:
    """Outputs on [CUDA, CPU] (with CUDA ``options``) and on CPU alone, and the assignment."""
    cuda = ox.InferenceSession(model, providers=[(CUDA, dict(options or {})), CPU])
    cpu = ox.InferenceSession(model, providers=[CPU])
    return cuda.run(None, feeds), cpu.run(None, feeds), assignment(cuda)
