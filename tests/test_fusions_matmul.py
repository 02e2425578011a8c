"""Transposes and scalar scales folded into com.microsoft FusedMatMul (optimizer/matmul.py).

Each pattern as torch.onnx (``q @ k.transpose(-2, -1) / sqrt(d)``) or tf2onnx
(``tf.matmul(a, b, transpose_a=True)``) writes it must become the FusedMatMul onnxruntime's
MatmulTransposeFusion / MatMulScaleFusion make of it (same transA, transB and alpha), match the
unfused session and onnxruntime's, and not fuse where those rules do not. The CUDA plugin's
FusedMatMul kernel takes the fused node on its (simulated) provider too.
"""

from __future__ import annotations

import math
import os
import tempfile

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import helper

import onnxplug as ox
from tests.test_fusions_attention import DATA, MODELS
from tests.test_fusions_attention import _feeds as attention_feeds
from tests.test_fusions_conv import _ort, check, ops, session, typed
from tests.test_fusions_transformer import (  # noqa: F401 (sim: a fixture)
    CPU,
    MS,
    SIM,
    G,
    op_types,
    providers_of,
    sim,
)

RNG = np.random.default_rng(5)
L = ox.GraphOptimizationLevel


def _x(shape, dtype=np.float32) -> np.ndarray:
    return RNG.standard_normal(shape).astype(dtype)


def swap(g: G, v: str, rank: int) -> str:
    """x.transpose(-2, -1) as torch exports it."""
    return g.op("Transpose", v, perm=[*range(rank - 2), rank - 1, rank - 2])


def fused(sess) -> dict:
    (n,) = [n for n in sess._graph.nodes if n.op_type == "FusedMatMul"]
    return {k: n.attrs[k] for k in ("alpha", "transA", "transB")} | {"inputs": n.inputs}


A4, B4 = [2, 3, 5, 8], [2, 3, 5, 8]


def _scores(g: G) -> str:
    q, k = g.input("a", A4), g.input("b", B4)
    return g.op("Div", g.op("MatMul", q, swap(g, k, 4)), g.const(math.sqrt(8)))


# name: (build(g) -> output, feeds shapes, the FusedMatMul's (alpha, transA, transB, inputs))
CASES = {
    "torch_scores": (_scores, {"a": A4, "b": B4}, (1 / math.sqrt(8), 0, 1, ["a", "b"])),
    "tf_transpose_a_2d": (
        lambda g: g.op(
            "MatMul", g.op("Transpose", g.input("a", [4, 5]), perm=[1, 0]), g.input("b", [4, 6])
        ),
        {"a": [4, 5], "b": [4, 6]},
        (1.0, 1, 0, ["a", "b"]),
    ),
    "default_perm_2d": (
        lambda g: g.op("MatMul", g.input("a", [3, 5]), g.op("Transpose", g.input("b", [4, 5]))),
        {"a": [3, 5], "b": [4, 5]},
        (1.0, 0, 1, ["a", "b"]),
    ),
    "both_rank3": (
        lambda g: g.op(
            "MatMul", swap(g, g.input("a", [2, 4, 3]), 3), swap(g, g.input("b", [2, 5, 4]), 3)
        ),
        {"a": [2, 4, 3], "b": [2, 5, 4]},
        (1.0, 1, 1, ["a", "b"]),
    ),
    "mul_before_a": (
        lambda g: g.op(
            "MatMul", g.op("Mul", g.input("a", [3, 4]), g.const(0.5)), g.input("b", [4, 2])
        ),
        {"a": [3, 4], "b": [4, 2]},
        (0.5, 0, 0, ["a", "b"]),
    ),
    "constant_first_mul_before_b": (
        lambda g: g.op(
            "MatMul", g.input("a", [3, 4]), g.op("Mul", g.const([[3.0]]), g.input("b", [4, 2]))
        ),
        {"a": [3, 4], "b": [4, 2]},
        (3.0, 0, 0, ["a", "b"]),
    ),
    "div_after": (
        lambda g: g.op(
            "Div", g.op("MatMul", g.input("a", [3, 4]), g.input("b", [4, 2])), g.const(4.0)
        ),
        {"a": [3, 4], "b": [4, 2]},
        (0.25, 0, 0, ["a", "b"]),
    ),
    "scales_everywhere": (
        lambda g: g.op(
            "Mul",
            g.const(2.0),
            g.op(
                "MatMul",
                g.op("Div", g.input("a", [2, 3, 4]), g.const(8.0)),
                g.op("Mul", swap(g, g.input("b", [2, 5, 4]), 3), g.const(0.5)),
            ),
        ),
        {"a": [2, 3, 4], "b": [2, 5, 4]},
        (0.125, 0, 1, ["a", "b"]),
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_matmul(case):
    build, shapes, (alpha, ta, tb, ins) = CASES[case]
    g = G()
    model = g.model([build(g)])
    feeds = {k: _x(v) for k, v in shapes.items()}
    s = check(model, feeds, ["FusedMatMul"], L.ORT_ENABLE_EXTENDED)
    assert fused(s) == {"alpha": pytest.approx(alpha), "transA": ta, "transB": tb, "inputs": ins}
    assert "FusedMatMul" not in op_types(session(model, L.ORT_ENABLE_BASIC))


def _ort_fused(model: bytes) -> list[dict]:
    """onnxruntime's FusedMatMul nodes (alpha, transA, transB) at the extended level."""
    onnxruntime = _ort()
    so = onnxruntime.SessionOptions()
    so.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    with tempfile.TemporaryDirectory() as d:
        so.optimized_model_filepath = os.path.join(d, "m.onnx")
        onnxruntime.InferenceSession(typed(model), so, providers=[CPU])
        out = onnx.load(so.optimized_model_filepath)
    return [
        {
            a.name: helper.get_attribute_value(a)
            for a in n.attribute
            if a.name in ("alpha", "transA", "transB")
        }
        for n in out.graph.node
        if n.op_type == "FusedMatMul"
    ]


@pytest.mark.parametrize("case", sorted(CASES))
def test_same_fused_node_as_onnxruntime(case):
    if _ort() is None:
        pytest.skip("onnxruntime is not installed")
    build, _, _ = CASES[case]
    g = G()
    model = g.model([build(g)])
    ours = fused(session(model))
    (theirs,) = _ort_fused(model)
    assert theirs["alpha"] == pytest.approx(ours["alpha"], rel=1e-7)
    assert (theirs["transA"], theirs["transB"]) == (ours["transA"], ours["transB"])


def test_existing_fused_matmul_takes_more():
    """A FusedMatMul (from onnxruntime's tools) with a Transpose before B and a Div after."""
    g = G()
    mm = g.op(
        "FusedMatMul",
        g.input("a", [4, 3]),
        swap(g, g.input("b", [5, 4]), 2),
        domain=MS,
        transA=1,
        alpha=2.0,
    )
    m = onnx.load_from_string(g.model([g.op("Div", mm, g.const(8.0))]))
    m.opset_import.append(helper.make_opsetid(MS, 1))
    m.graph.output[0].type.tensor_type.elem_type = onnx.TensorProto.FLOAT  # onnx cannot infer it
    model = m.SerializeToString()
    s = check(model, {"a": _x([4, 3]), "b": _x([5, 4])}, ["FusedMatMul"])
    assert fused(s) == {"alpha": 0.25, "transA": 1, "transB": 1, "inputs": ["a", "b"]}


def test_shared_transpose_goes_when_all_its_readers_fuse():
    g = G()
    kt = swap(g, g.input("b", [2, 5, 4]), 3)
    y1 = g.op("MatMul", g.input("a", [2, 3, 4]), kt)
    y2 = g.op("MatMul", g.input("c", [2, 6, 4]), kt)
    feeds = {"a": _x([2, 3, 4]), "b": _x([2, 5, 4]), "c": _x([2, 6, 4])}
    check(g.model([y1, y2]), feeds, ["FusedMatMul", "FusedMatMul"])


def test_shared_transpose_and_scale_stay_for_their_other_readers():
    g = G()
    kt = swap(g, g.input("b", [2, 5, 4]), 3)
    qs = g.op("Mul", g.input("a", [2, 3, 4]), g.const(0.5))
    y = g.op("MatMul", qs, kt)
    model = g.model([y, g.op("Relu", kt), g.op("Neg", qs)])
    feeds = {"a": _x([2, 3, 4]), "b": _x([2, 5, 4])}
    s = check(model, feeds, ["FusedMatMul", "Transpose", "Relu", "Mul", "Neg"])
    assert fused(s) == {"alpha": 0.5, "transA": 0, "transB": 1, "inputs": ["a", "b"]}


NOT_FUSED = {
    # onnxruntime 1.32 fuses this too, and its FusedMatMul kernel then gets it wrong
    "vector_b": (
        lambda g: g.op("MatMul", swap(g, g.input("a", [3, 4, 5]), 3), g.input("b", [4])),
        {"a": [3, 4, 5], "b": [4]},
        ["Transpose", "MatMul"],
    ),
    # batch axes permuted (onnxruntime's transBatch, which FusedMatMul kernels here refuse)
    "batch_perm": (
        lambda g: g.op(
            "MatMul",
            g.op("Transpose", g.input("a", [3, 2, 5, 4]), perm=[1, 0, 3, 2]),
            g.input("b", [2, 3, 5, 6]),
        ),
        {"a": [3, 2, 5, 4], "b": [2, 3, 5, 6]},
        ["Transpose", "MatMul"],
    ),
    "heads_perm": (
        lambda g: g.op(
            "MatMul",
            g.op("Transpose", g.input("a", [2, 5, 3, 4]), perm=[0, 2, 1, 3]),
            g.input("b", [2, 3, 4, 6]),
        ),
        {"a": [2, 5, 3, 4], "b": [2, 3, 4, 6]},
        ["Transpose", "MatMul"],
    ),
    "default_perm_rank3": (
        lambda g: g.op("MatMul", g.op("Transpose", g.input("a", [2, 3, 4])), g.input("b", [2, 3])),
        {"a": [2, 3, 4], "b": [2, 3]},
        ["Transpose", "MatMul"],
    ),
    "vector_scale": (
        lambda g: g.op(
            "Div", g.op("MatMul", g.input("a", [3, 4]), g.input("b", [4, 2])), g.const([1.0, 2.0])
        ),
        {"a": [3, 4], "b": [4, 2]},
        ["MatMul", "Div"],
    ),
    "scale_of_higher_rank": (
        lambda g: g.op(
            "Mul", g.op("MatMul", g.input("a", [3, 4]), g.input("b", [4, 2])), g.const([[[2.0]]])
        ),
        {"a": [3, 4], "b": [4, 2]},
        ["MatMul", "Mul"],
    ),
    "reciprocal": (
        lambda g: g.op(
            "MatMul", g.op("Div", g.const(2.0), g.input("a", [3, 4])), g.input("b", [4, 2])
        ),
        {"a": [3, 4], "b": [4, 2]},
        ["Div", "MatMul"],
    ),
    "input_scale": (
        lambda g: g.op(
            "Mul", g.op("MatMul", g.input("a", [3, 4]), g.input("b", [4, 2])), g.input("s", [])
        ),
        {"a": [3, 4], "b": [4, 2], "s": []},
        ["MatMul", "Mul"],
    ),
}


@pytest.mark.parametrize("case", sorted(NOT_FUSED))
def test_not_fused(case):
    build, shapes, expect = NOT_FUSED[case]
    g = G()
    ort_level = L.ORT_DISABLE_ALL if case == "vector_b" else None  # onnxruntime's fusion is wrong
    check(g.model([build(g)]), {k: _x(v) for k, v in shapes.items()}, expect, ort_level=ort_level)


def test_transpose_that_is_a_graph_output_is_not_folded():
    g = G()
    at = swap(g, g.input("a", [4, 3]), 2)
    y = g.op("MatMul", at, g.input("b", [4, 2]))
    check(g.model([y, at]), {"a": _x([4, 3]), "b": _x([4, 2])}, ["Transpose", "MatMul"])


def test_output_read_twice_keeps_the_scale_after_it():
    g = G()
    mm = g.op("MatMul", swap(g, g.input("a", [4, 3]), 2), g.input("b", [4, 2]))
    y = g.op("Add", g.op("Mul", mm, g.const(3.0)), mm)
    s = check(g.model([y]), {"a": _x([4, 3]), "b": _x([4, 2])}, ["FusedMatMul", "Mul", "Add"])
    assert fused(s)["alpha"] == 1.0


def test_float64_scale_that_is_not_a_float32_is_not_merged():
    """alpha is a float attribute: x / 3 in float64 would be rounded, so it stays a Div."""
    g = G(np.float64)
    mm = g.op("MatMul", swap(g, g.input("a", [4, 3]), 2), g.input("b", [4, 2]))
    feeds = {"a": _x([4, 3], np.float64), "b": _x([4, 2], np.float64)}
    check(g.model([g.op("Div", mm, g.const(3.0))]), feeds, ["FusedMatMul", "Div"], tol=1e-12)
    g = G(np.float64)
    mm = g.op("MatMul", g.input("a", [3, 4]), g.input("b", [4, 2]))
    s = check(
        g.model([g.op("Div", mm, g.const(4.0))]),
        feeds | {"a": _x([3, 4], np.float64)},
        ["FusedMatMul"],
        tol=1e-12,
    )
    assert fused(s)["alpha"] == 0.25


def test_integer_matmul_is_not_fused():
    i64 = onnx.TensorProto.INT64
    graph = helper.make_graph(
        [
            helper.make_node("Transpose", ["a"], ["at"], perm=[1, 0]),
            helper.make_node("MatMul", ["at", "b"], ["y"]),
        ],
        "g",
        [
            helper.make_tensor_value_info("a", i64, [4, 3]),
            helper.make_tensor_value_info("b", i64, [4, 2]),
        ],
        [helper.make_tensor_value_info("y", i64, None)],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17)]
    ).SerializeToString()
    feeds = {"a": RNG.integers(-5, 5, (4, 3)), "b": RNG.integers(-5, 5, (4, 2))}
    s = session(model)
    assert ops(s) == ["MatMul", "Transpose"]
    want = session(model, L.ORT_DISABLE_ALL).run(None, feeds)[0]
    np.testing.assert_array_equal(s.run(None, feeds)[0], want)


@pytest.mark.parametrize("dtype", [np.float16, "bfloat16"])
def test_16_bit_types(dtype):
    import ml_dtypes

    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    g = G(dt)
    model = g.model([_scores(g)])
    feeds = {"a": _x(A4, dt), "b": _x(B4, dt)}
    s = session(model)
    assert ops(s) == ["FusedMatMul"]
    got = s.run(None, feeds)[0].astype(np.float64)
    exact = np.matmul(feeds["a"].astype(np.float64), feeds["b"].astype(np.float64).swapaxes(-1, -2))
    eps = 2.0**-10 if dt == np.float16 else 2.0**-7
    np.testing.assert_allclose(
        got, exact / math.sqrt(8), rtol=2 * eps, atol=2 * eps * np.abs(exact).max()
    )


@pytest.mark.usefixtures("sim")
def test_fused_on_the_cuda_provider():
    """The CUDA plugin has a FusedMatMul kernel: the scores' Transpose and scale fold into one
    FusedMatMul there too, which runs on it and matches the unfused graph and onnxruntime."""
    g = G()
    model = g.model([_scores(g)])
    s = check(model, {"a": _x(A4), "b": _x(B4)}, ["FusedMatMul"], None, [SIM, CPU])
    assert {
        r["ep"]
        for r in s.get_provider_graph_assignment_info()
        if not r["op_type"].startswith("Memcpy")
    } == {SIM}
    got = fused(s)
    assert (got["transA"], got["transB"]) == (0, 1)
    assert got["alpha"] == pytest.approx(1 / math.sqrt(8))


# (A shape, B shape) of FusedMatMul as stored (before op() swaps the last two axes)
SIM_SHAPES = [
    ((4, 6), (6, 5)),
    ((2, 3, 4, 6), (2, 3, 6, 5)),
    ((2, 3, 4, 6), (6, 5)),  # B broadcast over A's batch
    ((3, 1, 4, 6), (1, 2, 6, 5)),  # both batches broadcast
    ((6,), (3, 6, 5)),  # 1-D A: op() leaves it alone
    ((2, 4, 6), (6,)),  # 1-D B
    ((4, 4), (4, 4)),  # square: the transposes are not the identity
]


@pytest.mark.usefixtures("sim")
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64, "bfloat16"])
@pytest.mark.parametrize("ta, tb, alpha", [(0, 0, 1.0), (1, 0, 0.5), (0, 1, -2.0), (1, 1, 0.125)])
@pytest.mark.parametrize("shapes", SIM_SHAPES, ids=str)
def test_fused_matmul_kernel_on_sim_matches_cpu(shapes, ta, tb, alpha, dtype):
    """The CUDA kernel's shape plan (operands as the GEMM reads them) and the GEMM engine's
    numpy path against the CPU kernel, one node, for every float type."""
    import ml_dtypes

    dt = np.dtype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
    sa, sb = shapes

    def stored(shape, t):
        return (*shape[:-2], shape[-1], shape[-2]) if t and len(shape) >= 2 else shape

    a, b = _x(stored(sa, ta)).astype(dt), _x(stored(sb, tb)).astype(dt)
    node = helper.make_node(
        "FusedMatMul", ["a", "b"], ["y"], name="n", domain=MS, alpha=alpha, transA=ta, transB=tb
    )
    elem = helper.np_dtype_to_tensor_dtype(dt)
    graph = helper.make_graph(
        [node],
        "g",
        [
            helper.make_tensor_value_info("a", elem, a.shape),
            helper.make_tensor_value_info("b", elem, b.shape),
        ],
        [helper.make_empty_tensor_value_info("y")],
    )
    imports = [helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)]
    model = helper.make_model(graph, opset_imports=imports).SerializeToString()
    on_sim = ox.InferenceSession(model, providers=[SIM, CPU])
    assert providers_of(on_sim, "FusedMatMul") == {SIM}
    for feeds in ({"a": a, "b": b}, {"a": a[..., ::-1].copy(), "b": b}, {"a": a, "b": b}):
        got = on_sim.run(None, feeds)[0]
        want = ox.InferenceSession(model, providers=[CPU]).run(None, feeds)[0]
        assert got.dtype == want.dtype and got.shape == want.shape
        # both multiply in float32 (float64) and round once; the sums' order may differ
        ulp = {np.dtype(np.float16): 2**-10, np.dtype(ml_dtypes.bfloat16): 2**-7}.get(dt, 1e-6)
        w64 = want.astype(np.float64)
        np.testing.assert_allclose(
            got.astype(np.float64), w64, rtol=2 * ulp, atol=2 * ulp * np.abs(w64).max()
        )


@pytest.mark.usefixtures("sim")
def test_fused_matmul_batch_transposes_are_refused_on_both_providers():
    node = helper.make_node("FusedMatMul", ["a", "b"], ["y"], name="n", domain=MS, transBatchA=1)
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info(n, 1, [2, 3, 4]) for n in "ab"],
        [helper.make_empty_tensor_value_info("y")],
    )
    imports = [helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)]
    model = helper.make_model(graph, opset_imports=imports).SerializeToString()
    with pytest.raises(Exception, match="transBatchA=1 is not supported"):
        ox.InferenceSession(model, providers=[SIM, CPU])


@pytest.mark.parametrize("name", ["MatmulTransposeFusion", "MatMulScaleFusion"])
def test_disabled(name):
    g = G()
    model = g.model([_scores(g)])
    s = session(model, disabled_optimizers=[name])
    expect = {
        "MatmulTransposeFusion": ["FusedMatMul", "Transpose"],
        "MatMulScaleFusion": ["Div", "FusedMatMul"],
    }
    assert ops(s) == expect[name]
    assert ops(
        session(model, disabled_optimizers=["MatmulTransposeFusion", "MatMulScaleFusion"])
    ) == ["Div", "MatMul", "Transpose"]


@pytest.mark.parametrize("name", MODELS)
def test_exported_attention_scores_without_the_attention_fusion(name):
    """The exporters' BERT/GPT-2 attention with AttentionFusion switched off: the scores'
    Transpose of K and the scale fold into FusedMatMul, and the model still matches."""
    model = (DATA / name).read_bytes()
    feeds = attention_feeds(left_pad=False)
    s = session(model, disabled_optimizers=["AttentionFusion"])
    assert "FusedMatMul" in op_types(s) and "Attention" not in op_types(s)
    want = session(model, L.ORT_DISABLE_ALL).run(None, feeds)
    for a, b in zip(s.run(None, feeds), want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ta=st.booleans(),
    tb=st.booleans(),
    before=st.lists(
        st.sampled_from(["mul_a", "mul_a_first", "div_a", "mul_b", "div_b"]),
        max_size=2,
        unique=True,
    ),
    after=st.sampled_from([None, "mul", "mul_first", "div"]),
    rank=st.integers(2, 4),
    scale=st.sampled_from([0.125, 0.5, 3.0, -2.0, 1 / math.sqrt(64)]),
)
def test_fused_equals_unfused(ta, tb, before, after, rank, scale):
    """Any mix of last-axes Transposes and scalar scales around a MatMul: one FusedMatMul
    whose result equals the unfused graph's."""
    batch = [2, 3][: rank - 2]
    a_shape, b_shape = [*batch, 4, 5], [*batch, 5, 3]
    g = G()
    a = g.input("a", [*batch, 5, 4] if ta else a_shape)
    b = g.input("b", [*batch, 3, 5] if tb else b_shape)
    for op in before:
        kind, side = op.split("_")[:2]
        v = a if side == "a" else b
        c = g.const(scale)
        v = g.op("Mul" if kind == "mul" else "Div", *((c, v) if op.endswith("first") else (v, c)))
        a, b = (v, b) if side == "a" else (a, v)
    a = swap(g, a, rank) if ta else a
    b = swap(g, b, rank) if tb else b
    y = g.op("MatMul", a, b)
    if after:
        c = g.const(scale)
        y = g.op(
            "Div" if after == "div" else "Mul", *((c, y) if after.endswith("first") else (y, c))
        )
    model = g.model([y])
    feeds = {"a": _x([*batch, 5, 4] if ta else a_shape), "b": _x([*batch, 3, 5] if tb else b_shape)}
    expect = ["FusedMatMul"] if ta or tb or before or after else ["MatMul"]
    check(model, feeds, expect)
