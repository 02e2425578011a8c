"""Kernels' ``warm_up`` on the CUDA provider: session creation queues, in the background, the
compiles its first run needs (embedding Gather, a transposing copy, pooling, SkipLayerNorm,
float32 fused attention), so that the first run compiles none of them; results as on the CPU
provider. Kernels built at install (``build_kernels``) are loaded instead, with the bits of
the compiled ones."""

from __future__ import annotations

import threading
import time

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from tests.attention_models import attention_node_model
from tests.gpu._cuda import CPU, CUDA, cuda_marks

import onnxplug as ox

pytestmark = cuda_marks


@pytest.fixture
def compiles(monkeypatch):
    """Empty compile caches for the kernel families the models use, and the compiles made:
    (kernel name, thread name)."""
    from onnxplug_cuda import compiler
    from onnxplug_cuda.kernels import _fused as F
    from onnxplug_cuda.kernels import attention, contrib

    caches = [{} for _ in range(3)]
    monkeypatch.setattr(compiler, "_functions", caches[0])
    monkeypatch.setattr(contrib.SKIP_LN_ROWS, "_functions", caches[1])
    monkeypatch.setattr(attention.FUSED_ATTENTION_MMA, "_functions", caches[2])
    for op in F.Elementwise.registry:  # every elementwise kernel's variants (copies too)
        cache: dict = {}
        monkeypatch.setattr(op.raw(), "_functions", cache)
        caches.append(cache)
    made: list[tuple[str, str]] = []
    real = compiler._compile

    def spy(xp, name, source, cache, key, entry):
        made.append((name, threading.current_thread().name))
        return real(xp, name, source, cache, key, entry)

    monkeypatch.setattr(compiler, "_compile", spy)
    # as a process whose kernel cache is empty (not the sources earlier tests compiled)
    monkeypatch.setattr(compiler, "_compiled_before", set())
    # and no kernels built at install (these tests check the compiles that replace them)
    monkeypatch.setenv(compiler.ENV_SHIPPED, "0")

    def settled() -> None:
        """Wait for the background compiles."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if not any(type(v) is compiler._Compiling for c in caches for v in c.values()):
                return
            time.sleep(0.01)
        raise AssertionError("background compiles did not finish")

    return made, settled


def _ops_model() -> bytes:
    """ids -> embedding Gather (rows of 32 float32) -> Transpose (0, 2, 1) -> as an image:
    MaxPool, GlobalAveragePool; and the embeddings through SkipLayerNormalization."""
    rng = np.random.default_rng(0)
    table = rng.standard_normal((50, 32)).astype(np.float32)
    gamma, beta = np.ones(32, np.float32), np.zeros(32, np.float32)
    nodes = [
        helper.make_node("Gather", ["table", "ids"], ["emb"]),
        helper.make_node("Transpose", ["emb"], ["t"], perm=[0, 2, 1]),
        helper.make_node("Unsqueeze", ["t", "axis"], ["img"]),
        helper.make_node("MaxPool", ["img"], ["pooled"], kernel_shape=[2, 2]),
        helper.make_node("GlobalAveragePool", ["pooled"], ["avg"]),
        helper.make_node(
            "SkipLayerNormalization",
            ["emb", "skip", "gamma", "beta"],
            ["ln"],
            domain="com.microsoft",
        ),  # fmt: skip
    ]
    g = helper.make_graph(
        nodes,
        "ops",
        [
            helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "seq"]),
            helper.make_tensor_value_info("skip", TensorProto.FLOAT, ["batch", "seq", 32]),
        ],
        [
            helper.make_tensor_value_info("avg", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("ln", TensorProto.FLOAT, None),
        ],
        [
            numpy_helper.from_array(table, "table"),
            numpy_helper.from_array(gamma, "gamma"),
            numpy_helper.from_array(beta, "beta"),
            numpy_helper.from_array(np.array([1], np.int64), "axis"),
        ],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(g, opset_imports=opsets).SerializeToString()


def _check(
    model: bytes,
    feeds: dict,
    compiles,
    expected: set[str],
    rtol: float,
    all_queued: bool = False,
    options: dict | None = None,
    settled_too=None,
) -> None:
    """``expected``: kernels queued at creation; ``all_queued``: the first run compiles none;
    ``options``: the CUDA provider's; ``settled_too``: waits for other background compiles."""
    made, settled = compiles
    cuda = ox.InferenceSession(model, providers=[(CUDA, options or {}), CPU])
    settled()
    if settled_too is not None:
        settled_too()
    background = {name for name, thread in made if thread.startswith("onnxplug-precompile-")}
    assert expected <= background, f"queued at creation: {sorted(background)}"
    made.clear()
    want = ox.InferenceSession(model, providers=[CPU]).run(None, feeds)
    for k in range(3):
        got = cuda.run(None, feeds)
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol)
        ran = {name for name, _ in made}
        assert not ran & background, f"compiled again in run {k}: {sorted(ran & background)}"
        if k or all_queued:
            # the first run compiled the kernels the prepared runs launch
            assert not ran, f"run {k} compiled {sorted(ran)}"
        made.clear()


def test_creation_compiles_what_the_first_run_of_the_ops_needs(compiles):
    rng = np.random.default_rng(1)
    feeds = {
        "ids": rng.integers(-50, 50, (2, 6)).astype(np.int64),
        "skip": rng.standard_normal((2, 6, 32)).astype(np.float32),
    }
    from onnxplug_cuda.kernels.contrib import skip_ln_kernel

    expected = {
        "ox_gather_16_i64",  # rows of 128 bytes
        "oxr_ox_copy",  # the transpose
        "oxp_max_valuespool_float32",
        "oxp_global_avgpool_float32",
        skip_ln_kernel("f32", 32, ())[0],
    }
    _check(_ops_model(), feeds, compiles, expected, 1e-5)


def test_kernels_built_at_install_are_loaded_with_the_bits_of_compiled_ones(
    compiles, monkeypatch, tmp_path
):
    """With the catalogue built for this GPU by ``build_kernels`` (NVRTC, CuPy's options),
    creation queues none of the ops' kernels and the first run loads them: no NVRTC compile.
    Their outputs equal, bit for bit, those of the kernels CuPy compiles, also where inputs
    are subnormal (``-ftz=true`` in both: without it, SkipLayerNorm's output for those rows
    would be a normal number, not 0)."""
    import cupy

    from onnxplug_cuda import build_kernels, compiler
    from onnxplug_cuda.kernels import _fused as F
    from onnxplug_cuda.kernels.contrib import SKIP_LN_ROWS, skip_ln_kernel

    arch = "sm_" + str(cupy.cuda.Device().compute_capability)
    assert build_kernels.build([arch], tmp_path, 8) == {arch: []}
    rng = np.random.default_rng(1)
    feeds = {
        "ids": rng.integers(-50, 50, (2, 6)).astype(np.int64),
        "skip": rng.standard_normal((2, 6, 32)).astype(np.float32),
    }
    model = onnx.load_from_string(_ops_model())
    table = next(t for t in model.graph.initializer if t.name == "table")
    rows = numpy_helper.to_array(table).copy()
    rows[0] = np.float32(1e-40) * np.arange(1, 33, dtype=np.float32)  # subnormal
    table.CopyFrom(numpy_helper.from_array(rows, "table"))
    feeds["ids"][1, :] = 0
    feeds["skip"][1] = rows[0]
    model_bytes = model.SerializeToString()
    kernels = {"ox_gather_16_i64", "oxr_ox_copy", "oxp_max_valuespool_float32"}
    kernels |= {"oxp_global_avgpool_float32", skip_ln_kernel("f32", 32, ())[0]}

    made, settled = compiles
    loads: list[str] = []
    real = compiler._load_shipped

    def spy(xp, name, digest):
        fn = real(xp, name, digest)
        if fn is not None:
            loads.append(name)
        return fn

    monkeypatch.setattr(compiler, "_load_shipped", spy)
    monkeypatch.setenv(compiler.ENV_SHIPPED, "1")
    monkeypatch.setattr(compiler, "SHIPPED_DIR", tmp_path)
    monkeypatch.setattr(compiler, "_shipped", {})
    shipped = ox.InferenceSession(model_bytes, providers=[CUDA, CPU])
    settled()
    assert not kernels & {name for name, _ in made}  # none queued: the run loads them
    got = shipped.run(None, feeds)
    assert kernels <= set(loads), sorted(loads)
    assert np.all(got[1][1] == 0)  # the subnormal rows, flushed
    # the same kernels compiled by CuPy: empty caches again, nothing shipped
    monkeypatch.setenv(compiler.ENV_SHIPPED, "0")
    compiler._functions.clear()
    SKIP_LN_ROWS._functions.clear()
    for op in F.Elementwise.registry:
        op.raw()._functions.clear()
    made.clear()
    loads.clear()
    compiled = ox.InferenceSession(model_bytes, providers=[CUDA, CPU])
    settled()
    want = compiled.run(None, feeds)
    assert loads == [] and kernels <= {name for name, _ in made}
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed-shape", "dynamic-shape"])
def test_creation_compiles_the_float32_attention_kernels(compiles, fixed):
    """Heads of 64 with TF32 allowed, in the background: the tensor-core block shape the
    input's fixed batch and length take (alone: a second compile beside it slowed it), or
    both shapes where the graph leaves them open."""
    model = attention_node_model(1, 40, 128, 2, "2d", False, np.float32)
    if not fixed:
        m = onnx.load_from_string(model)
        for vi in m.graph.input:
            for k, name in enumerate(("batch", "seq")):
                vi.type.tensor_type.shape.dim[k].dim_param = name
        model = m.SerializeToString()
    rng = np.random.default_rng(2)
    feeds = {"x": rng.standard_normal((1, 40, 128)).astype(np.float32)}
    feeds["mask"] = np.ones((1, 40), np.int32)
    expected = {"oxa_mma_f32_1x4"} if fixed else {"oxa_mma_f32_1x4", "oxa_mma_f32_2x2"}
    _check(model, feeds, compiles, expected, 1e-2)
    made, _ = compiles
    if fixed:
        assert "oxa_mma_f32_2x2" not in {name for name, _ in made}


@pytest.mark.parametrize("fixed", [False, True], ids=["dynamic-shape", "fixed-shape"])
def test_an_activation_after_a_gemm_compiles_one_kernel_for_every_run(compiles, fixed):
    """MatMulBias with the erf Gelu (cuBLASLt's bias epilogue, then the Gelu kernel in place):
    the first run (``compute``) launches the raw kernel the prepared runs launch. It ran
    CuPy's ElementwiseKernel, and BERT-base's second run compiled the raw one (52 ms)."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((64, 96)).astype(np.float32)
    bias = rng.standard_normal(96).astype(np.float32)
    node = helper.make_node(
        "MatMulBias", ["a", "w", "bias"], ["y"], domain="ai.onnxplug", activation="Gelu"
    )
    g = helper.make_graph(
        [node],
        "mmb",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [2 if fixed else "batch", 7, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(bias, "bias")],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("ai.onnxplug", 1)]
    model = helper.make_model(g, opset_imports=opsets).SerializeToString()
    feeds = {"a": rng.standard_normal((2, 7, 64)).astype(np.float32)}
    # fixed shapes: the Gelu is compiled at creation (a dry bind over the output's shape)
    _check(model, feeds, compiles, {"oxr_ox_gelu"} if fixed else set(), 1e-2, all_queued=fixed)


def _mask_model(seq: int = 16, hidden: int = 32) -> bytes:
    """A BERT-like mask path and elementwise ops on shapes the graph fixes: Cast, Sub and Mul
    with scalars, a comparison, Where, Tanh and a broadcast Add."""
    nodes = [
        helper.make_node("Cast", ["mask"], ["m"], to=TensorProto.FLOAT),
        helper.make_node("Sub", ["one", "m"], ["inv"]),
        helper.make_node("Mul", ["inv", "neg"], ["bias"]),
        helper.make_node("Greater", ["x", "zero"], ["cond"]),
        helper.make_node("Where", ["cond", "x", "zero"], ["w"]),
        helper.make_node("Tanh", ["w"], ["t"]),
        helper.make_node("Add", ["t", "addend"], ["s"]),
    ]
    rng = np.random.default_rng(4)
    g = helper.make_graph(
        nodes,
        "mask",
        [
            helper.make_tensor_value_info("mask", TensorProto.INT64, [1, seq]),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, seq, hidden]),
        ],
        [
            helper.make_tensor_value_info("bias", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("s", TensorProto.FLOAT, None),
        ],
        [
            numpy_helper.from_array(np.array(1, np.float32), "one"),
            numpy_helper.from_array(np.array(-10000, np.float32), "neg"),
            numpy_helper.from_array(np.array(0, np.float32), "zero"),
            numpy_helper.from_array(rng.standard_normal(hidden).astype(np.float32), "addend"),
        ],
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def test_creation_compiles_the_elementwise_kernels_of_fixed_shapes(compiles):
    """Elementwise kernels bind their prepared form over the graph's shapes at creation (a dry
    bind), so the first run of a model with fixed shapes compiles none of them (BERT-base's
    mask path compiled five, 56-128 ms each, in its first run)."""
    rng = np.random.default_rng(5)
    feeds = {
        "mask": (rng.random((1, 16)) > 0.3).astype(np.int64),
        "x": rng.standard_normal((1, 16, 32)).astype(np.float32),
    }
    expected = {
        "oxr_ox_cast",
        "oxr_ox_u_subtract",
        "oxr_ox_u_multiply",
        "oxr_ox_u_greater",
        "oxr_ox_where",
        "oxr_ox_tanh",
        "oxr_ox_u_add",
    }
    _check(_mask_model(), feeds, compiles, expected, 1e-6, all_queued=True)


def _residual_block(c: int = 16, hw: int = 8) -> bytes:
    """x -> Conv 3x3 + bias -> Relu -> Conv 3x3 + bias -> + x -> Relu, fixed shapes: the
    optimizer makes the second convolution a FusedConv with a residual (Z)."""
    rng = np.random.default_rng(3)
    w1, w2 = (rng.standard_normal((c, c, 3, 3)).astype(np.float32) * 0.1 for _ in range(2))
    b1, b2 = (rng.standard_normal(c).astype(np.float32) for _ in range(2))
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c2", "x"], ["s"]),
        helper.make_node("Relu", ["s"], ["y"]),
    ]
    g = helper.make_graph(
        nodes,
        "block",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, hw, hw])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, c, hw, hw])],
        [
            numpy_helper.from_array(a, n)
            for a, n in ((w1, "w1"), (b1, "b1"), (w2, "w2"), (b2, "b2"))
        ],
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def test_creation_compiles_the_epilogue_of_a_residual_convolution(compiles, monkeypatch):
    """The bias + residual + ReLU kernel after a residual convolution's plain cuDNN graph is
    queued at creation (ResNet-50's first run compiled it between two cuDNN builds)."""
    from onnxplug_cuda import compiler
    from onnxplug_cuda.kernels import conv

    monkeypatch.setattr(conv, "_EPILOGUES", {})  # new epilogue objects: empty caches

    def epilogues_settled() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            pending = [
                v
                for e in conv._EPILOGUES.values()
                for m in e._modules.values()
                for v in m._functions.values()
                if type(v) is compiler._Compiling
            ]
            if not pending:
                return
            time.sleep(0.01)
        raise AssertionError("background compiles did not finish")

    feeds = {"x": np.random.default_rng(4).standard_normal((1, 16, 8, 8)).astype(np.float32)}
    _check(
        _residual_block(),
        feeds,
        compiles,
        {"ox_conv_epilogue"},
        1e-4,
        options={"use_tf32": "0"},
        settled_too=epilogues_settled,
    )


def test_the_install_builds_every_kind_of_cudnn_attention():
    """``build_kernels``' attention warm-up builds a float16 fused-attention graph of every
    kind it lists (mask, head size, sequence length) on this GPU."""
    pytest.importorskip("cudnn")
    from onnxplug_cuda import dnn

    for kind in dnn.ATTENTION_KINDS:
        dnn.build_attention_kind(0, *kind)
