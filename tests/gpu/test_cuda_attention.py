"""The fused attention ops on the GPU: the exporter-shaped BERT/GPT-2 graphs of
tests/data/attention fused on [CUDA, CPU] (the Attention node must run on CUDA) against the
unfused graph on the CPU provider, in float32 (use_tf32=0) with right and left padding."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tests.attention_models import attention_node_model as _attention_model
from tests.gpu._cuda import CPU, CUDA, assert_plans_reload, cuda_marks

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


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize(
    "b,s,mask,causal",
    [
        (1, 9, "2d", False),
        (3, 9, "2d", False),
        (2, 128, "2d", False),
        (2, 200, "none", True),  # the warp-per-row softmax with 32 keys per lane
        (1, 1100, "3d", False),  # beyond 1024 keys: the block-per-row softmax
        (2, 1100, "none", True),
        (2, 128, "bias", False),
        (3, 64, "bias_zero_nan", True),  # with fully masked rows (-inf bias)
    ],
)
@pytest.mark.parametrize("graph", [False, True])
def test_attention_node_matches_cpu(dtype, b, s, mask, causal, graph):
    """The Attention kernel's prepared paths against the CPU provider, eager and replayed:
    float32 through the fused float32 kernel (beyond batch 1) or the GEMMs reading the heads
    in place (batch 1), float16 through cuDNN's fused attention."""
    d, heads = 64, 4
    model = _attention_model(b, s, d, heads, mask, causal, dtype)
    rng = np.random.default_rng(b * 1000 + s)
    feeds = {"x": rng.standard_normal((b, s, d)).astype(dtype)}
    if mask == "2d":
        m = np.ones((b, s), np.int32)
        m[-1, s // 2 :] = 0
        feeds["mask"] = m
    elif mask == "3d":
        feeds["mask"] = (rng.random((b, s, s)) > 0.3).astype(np.int32)
    elif mask.startswith("bias"):
        ab = rng.standard_normal((b, 1, s, s)).astype(dtype)
        ab[rng.random((b, 1, s, s)) < 0.2] = -np.inf
        if mask == "bias_zero_nan":
            ab[0, 0, :3] = -np.inf  # rows masked everywhere: NaN probabilities become 0
        feeds["attn_bias"] = ab
    from onnxplug_cuda import dnn

    opts = {"use_tf32": "0", "enable_cuda_graph": "1" if graph else "0"}
    cudnn_calls = dnn.stats["attention"]
    cuda = ox.InferenceSession(model, providers=[(CUDA, opts), CPU])
    ops = {r["node_name"]: r["ep"] for r in cuda.get_provider_graph_assignment_info()}
    assert set(ops.values()) == {CUDA}
    cpu = ox.InferenceSession(model, providers=[CPU])
    want = cpu.run(None, feeds)[0].astype(np.float32)
    tol = (2e-3, 2e-3) if dtype == np.float16 else (1e-4, 1e-5)
    for _ in range(3):  # first run, prepared runs (and a capture, then a replay)
        got = cuda.run(None, feeds)[0].astype(np.float32)
        np.testing.assert_allclose(got, want, rtol=tol[0], atol=tol[1])
    # float16 runs cuDNN's fused attention (flash attention), float32 the GEMM path
    assert (dnn.stats["attention"] > cudnn_calls) == (dtype == np.float16)


@pytest.mark.parametrize("bits,fused", [("0", True), ("8", True), ("1", True), ("16", False)])
def test_sdpa_kernel_selects_the_fused_attention(bits, fused):
    """onnxruntime's ``sdpa_kernel`` bits: 0 (auto), FLASH_ATTENTION (1) or
    CUDNN_FLASH_ATTENTION (8) let float16 Attention run cuDNN's fused attention; MATH alone
    (16) keeps the GEMM path. Both match the CPU provider."""
    from onnxplug_cuda import dnn

    model = _attention_model(2, 32, 64, 4, "2d", False, np.float16)
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((2, 32, 64)).astype(np.float16)}
    feeds["mask"] = np.ones((2, 32), np.int32)
    before = dnn.stats["attention"]
    cuda = ox.InferenceSession(model, providers=[(CUDA, {"sdpa_kernel": bits}), CPU])
    want = ox.InferenceSession(model, providers=[CPU]).run(None, feeds)[0].astype(np.float32)
    for _ in range(2):
        got = cuda.run(None, feeds)[0].astype(np.float32)
        np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3)
    assert (dnn.stats["attention"] > before) == fused


def _float32_feeds(b: int, s: int, d: int, heads: int, mask: str, filter_value) -> dict:
    """Inputs of the float32 Attention tests: x, and a 2-D padding mask (batch 0 wholly
    masked with a -inf filter), a 3-D mask or an attention bias."""
    rng = np.random.default_rng(heads * 100 + s)
    feeds = {"x": rng.standard_normal((b, s, d)).astype(np.float32)}
    if mask == "2d":
        m = np.ones((b, s), np.int32)
        m[-1, s // 3 :] = 0
        if filter_value == float("-inf"):
            m[0, :] = 0  # every key of batch 0 masked: undefined rows
        feeds["mask"] = m
    elif mask == "3d":
        feeds["mask"] = (rng.random((b, s, s)) > 0.3).astype(np.int32)
    else:
        feeds["attn_bias"] = rng.standard_normal((b, 1, s, s)).astype(np.float32)
    return feeds


@pytest.mark.parametrize(
    "heads,d,b,s,mask,causal,filter_value",
    [
        (1, 64, 3, 37, "2d", True, None),  # heads of 64: the fused kernel's widest
        (2, 64, 1, 37, "2d", True, None),  # batch 1: the GEMMs read the heads in place
        (2, 40, 3, 37, "2d", False, None),  # heads of 20 (not a multiple of 8)
        (6, 48, 2, 33, "3d", True, -1.0),  # a small filter: masked keys keep some weight
        (4, 64, 2, 45, "2d", False, float("-inf")),  # fully masked rows: NaN, as on the CPU
        (4, 64, 24, 100, "bias", True, None),  # a grid of 32-query tiles
        (1, 128, 2, 37, "2d", True, None),  # heads of 128: the GEMM path
    ],
)
def test_fused_float32_attention_matches_cpu(heads, d, b, s, mask, causal, filter_value):
    """float32 Attention through the fused kernel (heads up to 64, beyond batch 1), reading
    the heads in place, against the CPU provider; batch 1 and wider heads take the GEMMs."""
    from onnxplug_cuda.kernels import attention

    model = _attention_model(b, s, d, heads, mask, causal, np.float32, filter_value)
    feeds = _float32_feeds(b, s, d, heads, mask, filter_value)
    before = dict(attention.stats)
    cuda = ox.InferenceSession(model, providers=[(CUDA, {"use_tf32": "0"}), CPU])
    cpu = ox.InferenceSession(model, providers=[CPU])
    want = cpu.run(None, feeds)[0]
    for _ in range(2):
        got = cuda.run(None, feeds)[0]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert (attention.stats["fused_f32"] > before["fused_f32"]) == (d // heads <= 64 and b > 1)
    assert attention.stats["fused_f32_mma"] == before["fused_f32_mma"]  # no TF32 asked for


@pytest.mark.parametrize(
    "heads,b,s,mask,causal,filter_value",
    [
        (1, 3, 37, "2d", True, None),
        (2, 1, 37, "2d", True, None),  # batch 1
        (2, 2, 33, "3d", True, -1.0),  # a small filter: masked keys keep some weight
        (4, 2, 45, "2d", False, float("-inf")),  # fully masked rows: NaN, as on the CPU
        (4, 2, 45, "2d", False, None),
        (4, 24, 100, "bias", True, None),  # a grid of 2496 blocks
        (4, 3, 200, "bias", False, None),  # 7 tiles of keys, the last one partial
        (12, 2, 128, "2d", True, None),  # GPT-2's heads
    ],
)
def test_tensor_core_attention_matches_cpu(heads, b, s, mask, causal, filter_value):
    """float32 Attention with heads of 64 and TF32 allowed (the default) runs the tensor-core
    kernel, at any batch, and matches the CPU provider within TF32's error (as the TF32 GEMMs
    of the unfused path)."""
    from onnxplug_cuda.kernels import attention

    d = 64 * heads
    model = _attention_model(b, s, d, heads, mask, causal, np.float32, filter_value)
    feeds = _float32_feeds(b, s, d, heads, mask, filter_value)
    before = attention.stats["fused_f32_mma"]
    cuda = ox.InferenceSession(model, providers=[CUDA, CPU])
    want = ox.InferenceSession(model, providers=[CPU]).run(None, feeds)[0]
    for _ in range(2):
        got = cuda.run(None, feeds)[0]
        np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2)
        assert np.array_equal(np.isnan(got), np.isnan(want))
    assert attention.stats["fused_f32_mma"] > before


@pytest.mark.parametrize("shape", [(1, 4), (2, 2)])
def test_every_tensor_core_block_shape_matches_cpu(monkeypatch, shape):
    """Each block shape of the tensor-core kernel (query groups x key parts), forced, on
    queries and keys that fill no tile exactly, with fully masked rows."""
    from onnxplug_cuda.kernels import attention

    assert shape in attention.MMA_SHAPES
    monkeypatch.setattr(attention, "mma_shape", lambda s, heads, sms: shape)
    heads, b, s = 2, 3, 75
    model = _attention_model(b, s, 64 * heads, heads, "2d", True, np.float32, float("-inf"))
    rng = np.random.default_rng(7)
    m = np.ones((b, s), np.int32)
    m[0, :] = 0
    m[-1, s // 3 :] = 0
    feeds = {"x": rng.standard_normal((b, s, 64 * heads)).astype(np.float32), "mask": m}
    before = attention.stats["fused_f32_mma"]
    cuda = ox.InferenceSession(model, providers=[CUDA, CPU])
    want = ox.InferenceSession(model, providers=[CPU]).run(None, feeds)[0]
    for _ in range(2):  # the second run is the prepared one
        got = cuda.run(None, feeds)[0]
        np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2)
        assert np.array_equal(np.isnan(got), np.isnan(want))
    assert attention.stats["fused_f32_mma"] > before


@pytest.mark.parametrize(
    "b,dtype,options",
    [
        (1, np.float32, {}),
        (3, np.float32, {}),
        (3, np.float32, {"use_tf32": "0"}),
        (1, np.float16, {}),
        (3, np.float16, {"enable_cuda_graph": "1"}),
    ],
    ids=["mma-b1", "mma-b3", "fma-b3", "sdpa-b1", "sdpa-b3-graph"],
)
def test_a_first_run_gives_what_prepared_runs_give(b, dtype, options):
    """The first run of a signature (not prepared) runs the fused kernel the prepared runs
    use (float32: ours; float16: cuDNN's fused attention): every run gives the same bits
    (8 threads x 200 runs of BERT found the first run's result 1e-3 away when only the
    prepared form used it)."""
    from onnxplug_cuda import dnn

    model = _attention_model(b, 40, 128, 2, "2d", True, dtype)
    rng = np.random.default_rng(3)
    feeds = {"x": rng.standard_normal((b, 40, 128)).astype(dtype)}
    feeds["mask"] = np.ones((b, 40), np.int32)
    feeds["mask"][-1, 30:] = 0
    cuda = ox.InferenceSession(model, providers=[(CUDA, options), CPU])
    before = dnn.stats["attention"]
    first = cuda.run(None, feeds)[0]
    assert (dnn.stats["attention"] > before) == (dtype == np.float16)  # the first run's too
    for _ in range(3):
        np.testing.assert_array_equal(cuda.run(None, feeds)[0], first)


@pytest.mark.parametrize("mask,causal", [("2d", False), ("none", True)])
def test_deserialized_attention_plans_compute_what_built_plans_do(
    monkeypatch, tmp_path, mask, causal
):
    """float16 attention's cuDNN graph is kept in the plan cache: a new engine (as in a new
    process) deserializes it and gives bit-identical outputs, eager and replayed."""
    b, s = 2, 64
    model = _attention_model(b, s, 64, 4, mask, causal, np.float16)
    rng = np.random.default_rng(7)
    feeds = {"x": rng.standard_normal((b, s, 64)).astype(np.float16)}
    if mask == "2d":
        m = np.ones((b, s), np.int32)
        m[-1, s // 2 :] = 0
        feeds["mask"] = m
    assert_plans_reload(monkeypatch, model, feeds, {"tuning_cache_dir": str(tmp_path)}, "attention")


@pytest.mark.parametrize("search", ["EXHAUSTIVE", "HEURISTIC"])
def test_attention_plans_are_searched_as_convolutions_are(monkeypatch, tmp_path, search):
    """``cudnn_conv_algo_search`` chooses float16 fused attention's cuDNN plan too: EXHAUSTIVE
    (the default) times the first candidates, runs the fastest and keeps it in the tuning
    cache, so that a new engine builds that plan only; HEURISTIC runs the heuristics' first
    plan. Either way the outputs match the CPU provider's and replay bit for bit."""
    pytest.importorskip("cudnn")
    from onnxplug_cuda import dnn

    b, s, d, heads = 1, 128, 128, 2
    model = _attention_model(b, s, d, heads, "2d", False, np.float16)
    rng = np.random.default_rng(11)
    feeds = {"x": rng.standard_normal((b, s, d)).astype(np.float16)}
    m = np.ones((b, s), np.int32)
    m[0, 100:] = 0
    feeds["mask"] = m
    opts = {
        "tuning_cache_dir": str(tmp_path),
        "cudnn_conv_algo_search": search,
        "enable_cuda_graph": "1",
    }
    want = ox.InferenceSession(model, providers=[CPU]).run(None, feeds)[0].astype(np.float32)

    def run() -> tuple[list[np.ndarray], list]:
        monkeypatch.setattr(dnn, "_engines", {})  # a new engine, as in a new process
        before = dict(dnn.stats)
        sess = ox.InferenceSession(model, providers=[(CUDA, opts), CPU])
        ys = [sess.run(None, feeds)[0] for _ in range(3)]  # warm-up, capture, replay
        (eng,) = dnn._engines.values()
        graphs = [g for (_, spec), g in eng._graphs.items() if isinstance(spec, dnn.SdpaSpec)]
        hits = dnn.stats["tuning_cache_hits"] - before["tuning_cache_hits"]
        return ys, [(g.best, g.ms, hits) for g in graphs]

    ys, chosen = run()
    assert len(chosen) == 1
    best, ms, hits = chosen[0]
    if search == "EXHAUSTIVE":
        assert best is not None and ms is not None and ms > 0 and hits == 0
    else:
        assert best is None and ms is None
    for y in ys:
        np.testing.assert_allclose(y.astype(np.float32), want, rtol=2e-3, atol=2e-3)
    np.testing.assert_array_equal(ys[1], ys[2])
    # a second engine on the same cache folders: the plan cache has the chosen plan
    again, _ = run()
    for x, y in zip(ys, again, strict=True):
        np.testing.assert_array_equal(x, y)
