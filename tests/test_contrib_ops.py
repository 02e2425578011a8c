"""The ``com.microsoft`` ops onnxruntime's optimizer writes into saved optimized models, one
node each, against onnxruntime; and models onnxruntime optimized and saved
(``optimized_model_filepath``) at every level, loaded and run here.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxplug as ox

ort = pytest.importorskip("onnxruntime")

CPU = ["CPUExecutionProvider"]
MS = "com.microsoft"
F = TensorProto.FLOAT


def _model(nodes, inputs, outputs, inits=()) -> bytes:
    g = helper.make_graph(list(nodes), "g", inputs, outputs, list(inits))
    m = helper.make_model(
        g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)]
    )
    m.ir_version = 10
    return m.SerializeToString()


def _tv(name, shape, elem=F):
    return helper.make_tensor_value_info(name, elem, shape)


def _compare(model: bytes, feeds: dict, rtol=1e-5, atol=1e-5) -> None:
    theirs = ort.InferenceSession(model, providers=CPU).run(None, feeds)
    ours = ox.InferenceSession(model, providers=CPU).run(None, feeds)
    assert len(ours) == len(theirs)
    for i, (a, b) in enumerate(zip(theirs, ours)):
        assert b.shape == a.shape and b.dtype == a.dtype, (i, b.shape, a.shape, b.dtype, a.dtype)
        np.testing.assert_allclose(b, a, rtol=rtol, atol=atol, err_msg=f"output {i}")


RNG = np.random.default_rng(0)


def test_quick_gelu():
    x = RNG.standard_normal((3, 5)).astype(np.float32) * 4
    for alpha in ({}, {"alpha": 1.3}):
        node = helper.make_node("QuickGelu", ["x"], ["y"], domain=MS, **alpha)
        _compare(_model([node], [_tv("x", [3, 5])], [_tv("y", [3, 5])]), {"x": x})


@pytest.mark.parametrize("op", ["LayerNormalization", "SimplifiedLayerNormalization"])
def test_default_domain_normalizations_of_onnxruntime_below_opset_17(op):
    """onnxruntime registers these in the default domain at version 1 and writes them into
    optimized opset-13 models; ONNX has no LayerNormalization before 17."""
    x = RNG.standard_normal((2, 3, 8)).astype(np.float32)
    g, b = RNG.standard_normal(8).astype(np.float32), RNG.standard_normal(8).astype(np.float32)
    ins = ["x", "g", "b"] if op == "LayerNormalization" else ["x", "g"]
    node = helper.make_node(op, ins, ["y"], axis=-1, epsilon=1e-5)
    inits = [numpy_helper.from_array(g, "g"), numpy_helper.from_array(b, "b")]
    graph = helper.make_graph([node], "g", [_tv("x", [2, 3, 8])], [_tv("y", [2, 3, 8])], inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    _compare(m.SerializeToString(), {"x": x})


@pytest.mark.parametrize("with_segments", [True, False])
@pytest.mark.parametrize("with_mask", [True, False])
def test_embed_layer_normalization(with_segments, with_mask):
    batch, seq, hidden, vocab = 2, 5, 8, 11
    ids = RNG.integers(0, vocab, (batch, seq)).astype(np.int32)
    seg = RNG.integers(0, 2, (batch, seq)).astype(np.int32)
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], np.int32)
    tables = {
        "word": RNG.standard_normal((vocab, hidden)),
        "pos": RNG.standard_normal((16, hidden)),
        "segt": RNG.standard_normal((2, hidden)),
        "gamma": RNG.standard_normal(hidden),
        "beta": RNG.standard_normal(hidden),
    }
    inits = [numpy_helper.from_array(v.astype(np.float32), k) for k, v in tables.items()]
    node = helper.make_node(
        "EmbedLayerNormalization",
        [
            "ids",
            "seg" if with_segments else "",
            "word",
            "pos",
            "segt" if with_segments else "",
            "gamma",
            "beta",
            "mask" if with_mask else "",
        ],
        ["y", "mask_index"],
        domain=MS,
        epsilon=1e-12,
    )
    inputs = [_tv("ids", [batch, seq], TensorProto.INT32)]
    feeds = {"ids": ids}
    if with_segments:
        inputs.append(_tv("seg", [batch, seq], TensorProto.INT32))
        feeds["seg"] = seg
    if with_mask:
        inputs.append(_tv("mask", [batch, seq], TensorProto.INT32))
        feeds["mask"] = mask
    outputs = [_tv("y", [batch, seq, hidden]), _tv("mask_index", [batch], TensorProto.INT32)]
    _compare(_model([node], inputs, outputs, inits), feeds)


def test_bias_softmax():
    """(onnxruntime has BiasSoftmax on CUDA only: checked against numpy.)"""
    x = RNG.standard_normal((2, 4, 3, 6)).astype(np.float32)
    bias = RNG.standard_normal((2, 1, 3, 6)).astype(np.float32)
    node = helper.make_node(
        "BiasSoftmax", ["x", "b"], ["y"], domain=MS, axis=-1, is_inner_broadcast=0
    )
    model = _model([node], [_tv("x", [2, 4, 3, 6]), _tv("b", [2, 1, 3, 6])], [_tv("y", None)])
    (y,) = ox.InferenceSession(model, providers=CPU).run(None, {"x": x, "b": bias})
    e = np.exp((x + bias) - (x + bias).max(axis=-1, keepdims=True))
    np.testing.assert_allclose(y, e / e.sum(axis=-1, keepdims=True), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    ("bits", "block_size", "zero_points"),
    [(4, 32, "packed"), (4, 16, None), (8, 32, "packed"), (4, 32, "float")],
)
def test_matmul_nbits(bits, block_size, zero_points):
    k, n, m = 64, 12, 3
    blocks = k // block_size
    levels = 1 << bits
    q = RNG.integers(0, levels, (n, blocks, block_size)).astype(np.uint8)
    # pack low bits first, as onnxruntime's quantizer does
    bit_planes = ((q[..., None] >> np.arange(bits)) & 1).astype(np.uint8)
    packed = np.packbits(bit_planes.reshape(n, blocks, -1), axis=-1, bitorder="little")
    scales = (RNG.random(n * blocks).astype(np.float32) + 0.5) / levels
    inits = [numpy_helper.from_array(packed, "B"), numpy_helper.from_array(scales, "scales")]
    names = ["A", "B", "scales"]
    if zero_points == "packed":
        zp = RNG.integers(0, levels, (n, blocks)).astype(np.uint8)
        zp_planes = ((zp[..., None] >> np.arange(bits)) & 1).astype(np.uint8)
        zbytes = -(-blocks * bits // 8)
        packed_zp = np.packbits(zp_planes.reshape(n, -1), axis=-1, bitorder="little")
        inits.append(numpy_helper.from_array(packed_zp[:, :zbytes].reshape(-1), "zp"))
        names.append("zp")
    elif zero_points == "float":
        inits.append(
            numpy_helper.from_array(RNG.integers(0, levels, n * blocks).astype(np.float32), "zp")
        )
        names.append("zp")
    node = helper.make_node(
        "MatMulNBits", names, ["Y"], domain=MS, K=k, N=n, bits=bits, block_size=block_size
    )
    a = RNG.standard_normal((m, k)).astype(np.float32)
    _compare(_model([node], [_tv("A", [m, k])], [_tv("Y", [m, n])], inits), {"A": a}, 1e-4, 1e-4)


@pytest.mark.parametrize("axis", [None, 1])
@pytest.mark.parametrize("qtype", [TensorProto.UINT8, TensorProto.INT8, TensorProto.INT16])
def test_contrib_quantize_dequantize(axis, qtype):
    x = (RNG.standard_normal((2, 3, 4)) * 20).astype(np.float32)
    if axis is None:
        scale, zp = (
            np.array(0.37, np.float32),
            np.array(3, onnx.helper.tensor_dtype_to_np_dtype(qtype)),
        )
    else:
        scale = np.array([0.2, 0.5, 1.1], np.float32)
        zp = np.array([0, 2, 5], onnx.helper.tensor_dtype_to_np_dtype(qtype))
    kw = {} if axis is None else {"axis": axis}
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], domain=MS, **kw),
        helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"], domain=MS, **kw),
    ]
    inits = [numpy_helper.from_array(scale, "s"), numpy_helper.from_array(zp, "z")]
    outputs = [_tv("q", [2, 3, 4], qtype), _tv("y", [2, 3, 4])]
    _compare(_model(nodes, [_tv("x", [2, 3, 4])], outputs, inits), {"x": x})


# models onnxruntime optimized and saved --------------------------------------------------------


def _bert_like_block(with_scores: bool) -> onnx.ModelProto:
    """Embedding + attention-free transformer MLP: what onnxruntime's optimizer rewrites
    into EmbedLayerNormalization, SkipLayerNormalization, BiasGelu/FastGelu and friends."""
    hidden, vocab, seq = 16, 30, 6
    r = np.random.default_rng(3)

    def w(*shape):
        return r.standard_normal(shape).astype(np.float32) * 0.2

    consts = {
        "word": w(vocab, hidden),
        "pos": w(seq, hidden),
        "g0": w(hidden) + 1,
        "b0": w(hidden),
        "w1": w(hidden, 4 * hidden),
        "bias1": w(4 * hidden),
        "w2": w(4 * hidden, hidden),
        "bias2": w(hidden),
        "g1": w(hidden) + 1,
        "b1": w(hidden),
        "sqrt2": np.array(np.sqrt(2.0), np.float32),
        "one": np.array(1.0, np.float32),
        "half": np.array(0.5, np.float32),
        "pos_ids": np.arange(seq, dtype=np.int64).reshape(1, seq),
        "scale": np.array(0.125, np.float32),
    }
    nodes = [
        helper.make_node("Gather", ["word", "ids"], ["we"]),
        helper.make_node("Gather", ["pos", "pos_ids"], ["pe"]),
        helper.make_node("Add", ["we", "pe"], ["emb"]),
        helper.make_node("LayerNormalization", ["emb", "g0", "b0"], ["h0"], epsilon=1e-12),
        helper.make_node("MatMul", ["h0", "w1"], ["m1"]),
        helper.make_node("Add", ["m1", "bias1"], ["a1"]),
        helper.make_node("Div", ["a1", "sqrt2"], ["d1"]),
        helper.make_node("Erf", ["d1"], ["e1"]),
        helper.make_node("Add", ["e1", "one"], ["e2"]),
        helper.make_node("Mul", ["a1", "e2"], ["e3"]),
        helper.make_node("Mul", ["e3", "half"], ["gelu"]),
        helper.make_node("MatMul", ["gelu", "w2"], ["m2"]),
        helper.make_node("Add", ["m2", "bias2"], ["a2"]),
        helper.make_node("Add", ["a2", "h0"], ["res"]),
        helper.make_node("LayerNormalization", ["res", "g1", "b1"], ["h1"], epsilon=1e-12),
    ]
    outputs = [_tv("h1", [1, seq, hidden])]
    if with_scores:  # onnxruntime fuses this into FusedMatMul
        nodes += [
            helper.make_node("Transpose", ["h1"], ["h1t"], perm=[0, 2, 1]),
            helper.make_node("MatMul", ["h1", "h1t"], ["scores"]),
            helper.make_node("Mul", ["scores", "scale"], ["scaled"]),
            helper.make_node("Softmax", ["scaled"], ["probs"], axis=-1),
        ]
        outputs.append(_tv("probs", [1, seq, seq]))
    else:
        del consts["scale"]
    g = helper.make_graph(
        nodes,
        "bert_like",
        [_tv("ids", [1, seq], TensorProto.INT64)],
        outputs,
        [numpy_helper.from_array(v, k) for k, v in consts.items()],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    onnx.checker.check_model(m)
    return m


# contrib ops another change brings (their CPU kernels: providers/cpu/kernels/attention.py,
# fused.py); a saved model containing one of them runs once those kernels are registered
FUSIONS_HELPER_OPS = {"FusedMatMul", "FusedConv", "Attention", "MultiHeadAttention"}


@pytest.mark.parametrize("with_scores", [False, True], ids=["mlp", "with-scores"])
@pytest.mark.parametrize("level", ["ORT_ENABLE_BASIC", "ORT_ENABLE_EXTENDED", "ORT_ENABLE_ALL"])
def test_models_onnxruntime_optimized_and_saved_load_and_match(tmp_path, level, with_scores):
    model = _bert_like_block(with_scores)
    ids = np.array([[1, 5, 7, 2, 29, 0]], np.int64)
    ref = ort.InferenceSession(model.SerializeToString(), providers=CPU).run(None, {"ids": ids})
    so = ort.SessionOptions()
    so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
    so.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(model.SerializeToString(), so, providers=CPU)
    saved = onnx.load(so.optimized_model_filepath)
    ops = {(n.domain, n.op_type) for n in saved.graph.node}
    if level != "ORT_ENABLE_BASIC":
        assert any(d == MS for d, _ in ops), ops  # onnxruntime did write contrib ops
    from onnxplug.providers.cpu.kernels import cpu_registry

    missing = {op for d, op in ops if d == MS and op in FUSIONS_HELPER_OPS}
    missing = {op for op in missing if not cpu_registry().has_op(op, MS)}
    if missing:
        pytest.xfail(f"needs the fusions helper's kernels: {sorted(missing)}")
    ours = ox.InferenceSession(so.optimized_model_filepath, providers=CPU).run(None, {"ids": ids})
    for a, b in zip(ref, ours, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)
