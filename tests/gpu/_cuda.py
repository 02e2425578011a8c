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
    """Outputs on [CUDA, CPU] (with CUDA ``options``) and on CPU alone, and the assignment.

    The CUDA session runs four times, alternating ``feeds`` and a permutation of their float
    values: the recording run, the run that binds the prepared calls, and runs through them.
    The last two runs of the permuted feeds must agree exactly; the outputs returned are the
    third run's (through the prepared calls)."""
    cuda = ox.InferenceSession(model, providers=[(CUDA, dict(options or {})), CPU])
    cpu = ox.InferenceSession(model, providers=[CPU])
    other = {k: _permuted(v) for k, v in feeds.items()}
    runs = [cuda.run(None, f) for f in (feeds, other, feeds, other)]
    for a, b in zip(runs[1], runs[3]):
        np.testing.assert_array_equal(
            _comparable(b), _comparable(a), err_msg="a prepared run differs from the binding run"
        )
    return runs[2], cpu.run(None, feeds), assignment(cuda)


def _permuted(v: Any) -> Any:
    """Float arrays with their values in reverse order (same values, other places)."""
    if isinstance(v, np.ndarray) and v.dtype.kind == "f" and v.size > 1:
        return np.ascontiguousarray(v.reshape(-1)[::-1].reshape(v.shape))
    return v


def _comparable(v: Any) -> Any:
    """ml_dtypes arrays (bfloat16, float8) as float32, where NaN compares equal to NaN."""
    a = np.asarray(v)
    return a.astype(np.float32) if a.dtype.kind == "V" else a


def assert_plans_reload(
    monkeypatch: Any, model: bytes, feeds: dict[str, np.ndarray], options: dict, calls: str
) -> None:
    """Two new cuDNN engines (as in two processes) on one cache folder (``options`` names it):
    the first builds its graphs (no plan-cache hit), the second deserializes them; both make
    cuDNN calls (``calls``: a ``dnn.stats`` key), and their outputs of a warm-up, a capture and
    a replay agree bit for bit."""
    from onnxplug_cuda import dnn

    def outputs() -> tuple[list[np.ndarray], int, int]:
        monkeypatch.setattr(dnn, "_engines", {})  # a new engine, its graphs not built
        before = dict(dnn.stats)
        sess = ox.InferenceSession(
            model, providers=[(CUDA, {**options, "enable_cuda_graph": "1"}), CPU]
        )
        ys = [sess.run(None, feeds)[0] for _ in range(3)]  # warm-up, capture, replay
        hits = dnn.stats["plan_cache_hits"] - before["plan_cache_hits"]
        return ys, hits, dnn.stats[calls] - before[calls]

    built, hits, made = outputs()
    assert hits == 0 and made > 0
    loaded, hits, made = outputs()
    assert hits > 0 and made > 0
    for x, y in zip(built, loaded, strict=True):
        np.testing.assert_array_equal(x, y)
