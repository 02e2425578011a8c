"""The fused attention ops on the GPU: the exporter-shaped BERT/GPT-2 graphs of
tests/data/attention fused on [CUDA, CPU] (the Attention node must run on CUDA) against the
unfused graph on the CPU provider, in float32 (use_tf32=0) with right and left padding."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tests.gpu._cuda import CPU, CUDA, cuda_marks

import onnxplug as ox

pytestmark = cuda_marks
DATA = Path(__file__).resolve().parents[1] / "data" / "attention"
MODELS = sorted(p.name for p in DATA.glob("*.onnx"))


def _feeds(left_pad: bool) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    ids = rng.integers(0, 32, (3, 9))
    mask = np.ones((3, 9), np.int64)
    if left_pad:
        mask[1, :4] = 0
    else:
        mask[1, 6:] = 0
    return {"input_ids": ids, "attention_mask": mask}


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("left_pad", [False, True])
def test_fused_attention_on_cuda_matches_unfused_cpu(name, left_pad):
    path = str(DATA / name)
    cuda = ox.InferenceSession(path, providers=[(CUDA, {"use_tf32": "0"}), CPU])
    ops = {r["node_name"]: r["ep"] for r in cuda.get_provider_graph_assignment_info()}
    attention = [n for n in cuda._graph.nodes if n.op_type == "Attention"]
    assert len(attention) == 1 and ops[attention[0].name] == CUDA
    so = ox.SessionOptions()
    so.graph_optimization_level = ox.GraphOptimizationLevel.ORT_DISABLE_ALL
    cpu = ox.InferenceSession(path, so, providers=[CPU])
    feeds = _feeds(left_pad)
    np.testing.assert_allclose(
        cuda.run(None, feeds)[0], cpu.run(None, feeds)[0], rtol=1e-3, atol=1e-4
    )
