"""Attention fusion on the graphs PyTorch's exporters write (tests/data/attention: BERT and GPT-2,
TorchScript and dynamo exporters, eager attention and sdpa with its Where(IsNaN) guard), and on
small hand-built graphs that must not fuse.

The fused session (default level) must hold one Attention node per layer and no Softmax, and match
the unfused session (ORT_DISABLE_ALL) on the CPU provider and on the host-simulated CUDA provider
(whose kernels must run the fused node), with right padding and with left padding (fully masked
rows in GPT-2: uniform attention in the eager export, zeros with sdpa's guard).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxplug as ox

HERE = Path(__file__).resolve().parent
DATA = HERE / "data" / "attention"
PLUGIN_SRC = HERE.parents[0] / "plugins" / "cuda" / "src"
SIM = "CUDASimExecutionProvider"
CPU = "CPUExecutionProvider"
MODELS = sorted(p.name for p in DATA.glob("*.onnx"))


@pytest.fixture(scope="module")
def sim():
    if str(PLUGIN_SRC) not in sys.path:
        sys.path.insert(0, str(PLUGIN_SRC))
    ox.register_execution_provider_library(SIM, "onnxplug_cuda.sim:create_factory")
    yield SIM
    ox.unregister_execution_provider_library(SIM)


def _session(model, providers, fuse=True):
    so = ox.SessionOptions()
    if not fuse:
        so.graph_optimization_level = ox.GraphOptimizationLevel.ORT_DISABLE_ALL
    if isinstance(model, onnx.ModelProto):
        model = model.SerializeToString()
    return ox.InferenceSession(model, so, providers=providers)


def _ops(sess):
    return [(n.domain, n.op_type) for n in sess._graph.nodes]


def _feeds(left_pad: bool):
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 32, (2, 7))
    mask = np.ones((2, 7), np.int64)
    if left_pad:
        mask[1, :3] = 0
    else:
        mask[1, 5:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def test_every_exporter_variant_is_there():
    assert MODELS == [
        f"{m}_{a}_{e}.onnx"
        for m in ("bert", "gpt2")
        for a in ("eager", "sdpa")
        for e in ("dynamo", "torchscript")
    ]


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("left_pad", [False, True])
def test_exported_attention_fuses_and_matches(name, left_pad, sim):
    path = str(DATA / name)
    ref = _session(path, [CPU], fuse=False).run(None, _feeds(left_pad))[0]
    guarded = "_sdpa_" in name
    domain = "ai.onnxplug" if guarded else "com.microsoft"
    for providers in ([CPU], [SIM, CPU]):
        sess = _session(path, providers)
        ops = _ops(sess)
        assert ops.count((domain, "Attention")) == 1, ops
        assert ("", "Softmax") not in ops and ("", "Transpose") not in ops
        got = sess.run(None, _feeds(left_pad))[0]
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
        if providers[0] == SIM:
            # the fused node ran on the simulated CUDA provider
            assert {ep for _, _, op, ep in sess._assignment if op == "Attention"} == {SIM}


def test_guard_zeroes_fully_masked_rows():
    """Left-padded GPT-2 with sdpa: the padded queries see no key (NaN before the guard)."""
    sess = _session(str(DATA / "gpt2_sdpa_torchscript.onnx"), [CPU])
    out = sess.run(None, _feeds(left_pad=True))[0]
    assert np.isfinite(out).all()


# ---------------------------------------------------------------------------------------------
# hand-built graphs: the eager BERT pattern, and variants that must not fuse

B, S, D, N = 2, 5, 16, 2
H = D // N


def _attention_model(
    scale_input=False,
    extra_output=None,
    mask_shape=(B, 1, S, S),
    where_fill=None,
    q_len=S,
):
    rng = np.random.default_rng(0)
    inits, nodes = [], []

    def const(name, value, dtype=np.float32):
        inits.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def node(op, ins, out, **attrs):
        nodes.append(helper.make_node(op, ins, [out], **attrs))
        return out

    inputs = [
        helper.make_tensor_value_info("q", TensorProto.FLOAT, [B, q_len, D]),
        helper.make_tensor_value_info("kv", TensorProto.FLOAT, [B, S, D]),
    ]
    split = const("split_shape", [0, 0, N, H], np.int64)
    heads = {}
    for name, src in (("Q", "q"), ("K", "kv"), ("V", "kv")):
        w = const(f"w{name}", rng.standard_normal((D, D)) * 0.3)
        proj = node("MatMul", [src, w], f"{name}3")
        r = node("Reshape", [proj, split], f"{name}r")
        perm = [0, 2, 3, 1] if name == "K" else [0, 2, 1, 3]
        heads[name] = node("Transpose", [r], f"{name}4", perm=perm)
    s = node("MatMul", [heads["Q"], heads["K"]], "qk")
    if scale_input:
        inputs.append(helper.make_tensor_value_info("scale", TensorProto.FLOAT, []))
        s = node("Mul", [s, "scale"], "scaled")
    else:
        s = node("Mul", [s, const("scale_c", 1 / np.sqrt(H))], "scaled")
    if where_fill is not None:
        inputs.append(helper.make_tensor_value_info("keep", TensorProto.BOOL, mask_shape))
        s = node("Where", ["keep", s, const("fill", where_fill)], "masked")
    else:
        inputs.append(helper.make_tensor_value_info("mask", TensorProto.FLOAT, mask_shape))
        s = node("Add", [s, "mask"], "masked")
    p = node("Softmax", [s], "probs", axis=-1)
    c = node("MatMul", [p, heads["V"]], "ctx")
    t = node("Transpose", [c], "ctx_t", perm=[0, 2, 1, 3])
    out = node("Reshape", [t, const("out_shape", [0, -1, D], np.int64)], "out")
    outputs = [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)]
    if extra_output:
        outputs.append(helper.make_tensor_value_info(extra_output, TensorProto.FLOAT, None))
    g = helper.make_graph(nodes, "attention", inputs, outputs, inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _run_both(model, feeds):
    fused = _session(model, [CPU])
    ref = _session(model, [CPU], fuse=False).run(None, feeds)
    got = fused.run(None, feeds)
    for a, b in zip(got, ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    return _ops(fused)


def _base_feeds(q_len=S, mask_shape=(B, 1, S, S), where=False):
    rng = np.random.default_rng(1)
    feeds = {
        "q": rng.standard_normal((B, q_len, D)).astype(np.float32),
        "kv": rng.standard_normal((B, S, D)).astype(np.float32),
    }
    if where:
        feeds["keep"] = rng.random(mask_shape) > 0.3
    else:
        feeds["mask"] = np.where(rng.random(mask_shape) > 0.3, 0, -1e4).astype(np.float32)
    return feeds


def test_hand_built_pattern_fuses_to_multi_head_attention(sim):
    """q and kv differ (cross attention): MultiHeadAttention, not the packed Attention."""
    model = _attention_model()
    assert ("com.microsoft", "MultiHeadAttention") in _run_both(model, _base_feeds())
    sess = _session(model, [SIM, CPU])
    assert ("com.microsoft", "MultiHeadAttention") in _ops(sess)
    ref = _session(model, [CPU], fuse=False).run(None, _base_feeds())[0]
    np.testing.assert_allclose(sess.run(None, _base_feeds())[0], ref, rtol=1e-5, atol=1e-6)


def test_where_mask_with_lowest_fill_fuses():
    model = _attention_model(where_fill=np.finfo(np.float32).min)
    ops = _run_both(model, _base_feeds(where=True))
    assert ("com.microsoft", "MultiHeadAttention") in ops


@pytest.mark.parametrize(
    "case",
    [
        "scale_not_constant",
        "softmax_read_elsewhere",
        "scores_read_elsewhere",
        "mask_enlarges",
        "where_fill_not_lowest",
    ],  # fmt: skip
)
def test_must_not_fuse(case):
    feeds = _base_feeds()
    if case == "scale_not_constant":
        model = _attention_model(scale_input=True)
        feeds["scale"] = np.float32(0.3)
    elif case == "softmax_read_elsewhere":
        model = _attention_model(extra_output="probs")
    elif case == "scores_read_elsewhere":
        model = _attention_model(extra_output="scaled")
    elif case == "mask_enlarges":
        # one query position against a (B, 1, S, S) mask: the Add broadcasts the scores up
        model = _attention_model(q_len=1)
        feeds = _base_feeds(q_len=1)
    else:
        model = _attention_model(where_fill=-1e4)
        feeds = _base_feeds(where=True)
    ops = _run_both(model, feeds)
    assert not any(op in ("MultiHeadAttention", "Attention") for _, op in ops), ops
    assert ("", "Softmax") in ops


def test_attention_kernel_rejects_a_bias_that_does_not_broadcast():
    g = helper.make_graph(
        [
            helper.make_node(
                "MultiHeadAttention",
                ["q", "k", "v", "", "", "bias"],
                ["y"],
                domain="com.microsoft",
                num_heads=N,
            )
        ],  # fmt: skip
        "mha",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [B, S, D]) for n in "qkv"]
        + [helper.make_tensor_value_info("bias", TensorProto.FLOAT, [B, 3, S, S])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    model = helper.make_model(
        g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )
    sess = _session(model, [CPU])
    feeds = {n: np.zeros((B, S, D), np.float32) for n in "qkv"}
    feeds["bias"] = np.zeros((B, 3, S, S), np.float32)
    with pytest.raises(Exception, match="MultiHeadAttention node .*attention_bias"):
        sess.run(None, feeds)


def test_prepared_attention_reads_the_heads_in_place_at_batch_1(sim, monkeypatch):
    """The prepared (steady-state) Attention: at batch 1 the heads are strided views of the
    packed projection and the context is written in place, so the node binds no copy kernel
    (four at batch 2: three head layouts and the context); every run matches the unfused CPU
    graph."""
    from onnxplug_cuda.kernels import _fused

    real = _fused.COPY
    bound: list[int] = []

    class CountedCopy:  # the copy kernel, counting the calls bound to it
        def bind(self, *a, **k):
            bound.append(1)
            return real.bind(*a, **k)

        def __getattr__(self, name):
            return getattr(real, name)

    monkeypatch.setattr(_fused, "COPY", CountedCopy())
    path = str(DATA / "bert_eager_torchscript.onnx")
    copies = {}
    for batch in (1, 2):
        feeds = {k: v[:batch] for k, v in _feeds(left_pad=False).items()}
        ref = _session(path, [CPU], fuse=False).run(None, feeds)[0]
        sess = _session(path, [SIM, CPU])
        np.testing.assert_allclose(sess.run(None, feeds)[0], ref, rtol=1e-5, atol=1e-5)
        bound.clear()  # the recording run runs the prepared form once too
        for _ in range(3):  # binding the prepared calls, prepared runs
            np.testing.assert_allclose(sess.run(None, feeds)[0], ref, rtol=1e-5, atol=1e-5)
        copies[batch] = len(bound)
    assert copies[2] - copies[1] == 4  # the other nodes' copies are the same at both batches


@pytest.mark.parametrize(
    "mask,causal,filter_value",
    [
        ("2d", True, -1.0),  # a small filter: a position masked both ways shows (2 * filter)
        ("3d", True, -1.0),
        ("bias", True, -1.0),
        ("2d", False, -1.0),
        ("2d", True, None),
    ],
)
def test_attention_node_masks_a_position_once(sim, mask, causal, filter_value):
    """``unidirectional`` with a padding mask or an attention bias: a key masked both by the
    causal mask and by the padding mask gets ``mask_filter_value`` once, as on the CPU provider
    (the simulated CUDA kernels' unprepared run, then the prepared runs), at batch 1 and 3."""
    from tests.attention_models import attention_node_model

    for b in (1, 3):
        s, d = 7, 16
        model = attention_node_model(b, s, d, 2, mask, causal, np.float32, filter_value)
        rng = np.random.default_rng(b)
        feeds = {"x": rng.standard_normal((b, s, d)).astype(np.float32)}
        if mask == "2d":
            m = np.ones((b, s), np.int32)
            m[-1, :3] = 0  # left padding: early queries see no unmasked key
            feeds["mask"] = m
        elif mask == "3d":
            feeds["mask"] = (rng.random((b, s, s)) > 0.4).astype(np.int32)
        else:
            feeds["attn_bias"] = rng.standard_normal((b, 1, s, s)).astype(np.float32)
        want = _session(model, [CPU]).run(None, feeds)[0]
        sess = _session(model, [SIM, CPU])
        for _ in range(3):  # the recording run, then the prepared calls
            np.testing.assert_allclose(sess.run(None, feeds)[0], want, rtol=1e-5, atol=1e-6)
