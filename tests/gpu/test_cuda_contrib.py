"""The fused transformer ops on the CUDA provider (com.microsoft Gelu, BiasGelu, FastGelu,
QuickGelu, BiasSoftmax, EmbedLayerNormalization, MatMulNBits, SkipLayerNormalization;
ai.onnxplug MatMulBias), compared with the CPU provider's kernels, and fused BERT/GPT-2-like graphs on
[CUDA, CPU] compared with the unfused graph on the CPU.

Every one-op test builds a model with one node named "n", runs it with providers [CUDA, CPU]
and with CPU alone, and checks that "n" ran on CUDAExecutionProvider. Tolerances (``atol``
is relative to the largest reference value, ``scale``):
* Gelu/BiasGelu/FastGelu/QuickGelu float32: rtol 1e-5, atol 1e-6 * scale. Both sides compute
  the formula in float32 (erff/tanhf against numpy's tanh and a float32 erf with relative error
  ~4e-7);
  1 + erf(x) cancels for negative x on both sides alike.
* float16: rtol 2e-3, atol 1e-3 * scale (both compute in float32 and round once: at most one
  float16 ulp apart, 2**-10 relative). bfloat16: rtol 1.6e-2, atol 8e-3 * scale (one ulp,
  2**-7). float64: rtol 1e-12, atol 1e-13 * scale.
* SkipLayerNormalization: the input_skip_bias_sum output is bit-exact (the same float
  additions in the same order on both sides); the statistics differ only by the summation
  order of the row reductions: float32 output rtol 1e-5, atol 1e-5 * scale; float16 and
  bfloat16 outputs as above (one ulp); mean / inv_std_var (float32) rtol 1e-5, atol 1e-6
  (for float64 inputs: statistics in float64 rounded to float32, rtol 2e-7: one float32 ulp).
* MatMulBias: the GEMM tolerances of test_cuda_matmul_conv.py (float32 without TF32 1e-4,
  with TF32 1e-2, float16 1e-2, bfloat16 3e-2, float64 1e-10). With activation "FastGelu" the
  GELU is cuBLASLt's epilogue, whose tanh approximation's accuracy NVIDIA does not document
  (CUTLASS epilogues use the hardware tanh.approx, relative error ~2**-11): float32 without
  TF32 and float64 get 2e-3 there.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from onnx import TensorProto, helper
from tests.gpu._cuda import CPU, CUDA, assignment, cuda_marks, run_cuda_and_cpu
from tests.test_fusions_transformer import EMBED_CASES, NBITS_CASES, embed_model, nbits_model

import onnxplug as ox

pytestmark = cuda_marks

try:
    import ml_dtypes

    BF16: Any = ml_dtypes.bfloat16
except ImportError:  # pragma: no cover - ml_dtypes comes with the test extra
    BF16 = None

_ELEM = {
    np.dtype(np.float32): TensorProto.FLOAT,
    np.dtype(np.float16): TensorProto.FLOAT16,
    np.dtype(np.float64): TensorProto.DOUBLE,
}
if BF16 is not None:
    _ELEM[np.dtype(BF16)] = TensorProto.BFLOAT16

MS = "com.microsoft"
PLUG = "ai.onnxplug"
EXACT32 = {"use_tf32": "0"}
DTYPES = [np.float32, np.float16, np.float64] + ([BF16] if BF16 is not None else [])
HALF_TYPES = [np.float32, np.float16] + ([BF16] if BF16 is not None else [])


def _model(op: str, domain: str, feeds: dict, outputs=("y",), **attrs) -> bytes:
    """A one-node model named "n" whose inputs are ``feeds`` ("" skips an optional input)."""
    node = helper.make_node(op, list(feeds), list(outputs), name="n", domain=domain, **attrs)
    inputs = [
        helper.make_tensor_value_info(k, _ELEM[np.dtype(v.dtype)], list(v.shape))
        for k, v in feeds.items()
        if k
    ]
    outs = [helper.make_empty_tensor_value_info(o) for o in outputs if o]
    imports = [helper.make_opsetid("", 17), helper.make_opsetid(domain, 1)]
    g = helper.make_graph([node], "g", inputs, outs)
    return helper.make_model(g, opset_imports=imports).SerializeToString()


def _elementwise_tol(dtype: Any) -> tuple[float, float]:
    """(rtol, atol relative to the reference's scale) of a result rounded once."""
    dt = np.dtype(dtype)
    if dt == np.float64:
        return 1e-12, 1e-13
    if dt == np.float16:
        return 2e-3, 1e-3
    if BF16 is not None and dt == np.dtype(BF16):
        return 1.6e-2, 8e-3
    return 1e-5, 1e-6


def _close(got: np.ndarray, ref: np.ndarray, rtol: float, atol: float) -> None:
    assert got.shape == ref.shape and got.dtype == ref.dtype, (got.shape, ref.shape, got.dtype)
    g64, r64 = got.astype(np.float64), ref.astype(np.float64)
    scale = max(1.0, float(np.abs(r64).max(initial=0.0)))
    np.testing.assert_allclose(g64, r64, rtol=rtol, atol=atol * scale)


def _run(model: bytes, feeds: dict, options: dict | None = None):
    got, ref, eps = run_cuda_and_cpu(model, {k: v for k, v in feeds.items() if k}, options)
    assert eps["n"] == CUDA, eps
    return got, ref


def _rand(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


# ---------------------------------------------------------------------------------------------
# Gelu, BiasGelu, FastGelu


GELU_CASES = [
    (op, bias, dtype)
    for op, bias in [("Gelu", False), ("BiasGelu", True), ("FastGelu", False), ("FastGelu", True)]
    for dtype in (HALF_TYPES if op == "FastGelu" else DTYPES)  # FastGelu: no float64
]


@pytest.mark.parametrize(
    "op,bias,dtype",
    GELU_CASES,
    ids=[f"{op}{'-bias' if b else ''}-{np.dtype(d).name}" for op, b, d in GELU_CASES],
)
def test_gelu_family(op, bias, dtype):
    rng = np.random.default_rng(0)
    feeds = {"x": _rand(rng, (2, 33, 64), dtype, 3.0)}
    if bias:
        feeds["b"] = _rand(rng, (64,), dtype)
    got, ref = _run(_model(op, MS, feeds), feeds)
    _close(got[0], ref[0], *_elementwise_tol(dtype))


def test_fast_gelu_float64_stays_on_cpu():
    rng = np.random.default_rng(1)
    feeds = {"x": _rand(rng, (4, 8), np.float64)}
    got, ref, eps = run_cuda_and_cpu(_model("FastGelu", MS, feeds), feeds)
    assert eps["n"] == CPU
    np.testing.assert_array_equal(got[0], ref[0])


@pytest.mark.parametrize("alpha", [None, 1.0, -0.5], ids=["default", "1", "neg"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_quick_gelu(dtype, alpha):
    """x / (1 + exp(-alpha x)) in float32 (float64) on both sides, rounded once: expf's 2 ulp
    against numpy's exp is inside the elementwise tolerance; the edges (+-inf, NaN, values
    whose exp overflows to give -0) agree exactly."""
    rng = np.random.default_rng(3)
    x = _rand(rng, (3, 17, 40), dtype, 4.0)
    edges = [np.inf, -np.inf, np.nan, -100.0, 100.0, 0.0, -0.0]
    x.reshape(-1)[: len(edges)] = np.array(edges, np.float64).astype(dtype)
    feeds = {"x": x}
    attrs = {} if alpha is None else {"alpha": alpha}
    got, ref = _run(_model("QuickGelu", MS, feeds, **attrs), feeds)
    g64, r64 = got[0].astype(np.float64), ref[0].astype(np.float64)
    np.testing.assert_array_equal(g64.reshape(-1)[: len(edges)], r64.reshape(-1)[: len(edges)])
    _close(got[0], ref[0], *_elementwise_tol(dtype))


BIAS_SOFTMAX_CASES = {
    # name: (data shape, bias shape, axis)
    "bert_mask": ((2, 12, 33, 33), (2, 1, 33, 33), 3),
    "last_neg": ((2, 4, 7, 300), (7, 300), -1),
    "from_axis1": ((3, 5, 2, 40), (5, 2, 40), 1),  # softmax over 5 * 2 * 40 values
    "wide_row": ((2, 5000), (2, 5000), 1),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("case", sorted(BIAS_SOFTMAX_CASES))
def test_bias_softmax(case, dtype):
    """Both sides add in float32 (float64) and run the softmax there, rounding once; the sums
    differ in order (block reduction against numpy's pairwise sum): float32 rtol 1e-5 and atol
    1e-6, 16-bit types one ulp. Part of the bias is -inf (a mask), one row entirely."""
    xs, bs, axis = BIAS_SOFTMAX_CASES[case]
    rng = np.random.default_rng(5)
    bias = _rand(rng, bs, np.float64, 2.0)
    bias.reshape(-1)[::7] = -np.inf
    bias.reshape(-1)[: bs[-1]] = -np.inf  # a whole masked row: NaN on both sides
    feeds = {"x": _rand(rng, xs, dtype, 3.0), "b": bias.astype(dtype)}
    got, ref = _run(_model("BiasSoftmax", MS, feeds, axis=axis), feeds)
    rtol, atol = (1e-5, 1e-6) if np.dtype(dtype) == np.float32 else _elementwise_tol(dtype)
    assert np.array_equal(np.isnan(got[0].astype(np.float64)), np.isnan(ref[0].astype(np.float64)))
    _close(got[0], ref[0], rtol, atol)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("case", sorted(EMBED_CASES))
def test_embed_layer_norm(case, dtype):
    """The embedding sum (output embedding_sum) is exact: the same float32 (float64) additions
    in the same order, rounded once; mask_index exact; the normalized output as
    SkipLayerNormalization's (statistics summed in another order)."""
    model, feeds = embed_model(dtype, *EMBED_CASES[case])
    outputs = [o for o in EMBED_CASES[case][3] if o]
    got, ref = _run(model, feeds)
    for name, g, r in zip(outputs, got, ref):
        if name == "y":
            tol = (1e-5, 1e-5) if np.dtype(dtype) == np.float32 else _elementwise_tol(dtype)
            _close(g, r, *tol)
        else:
            np.testing.assert_array_equal(g, r)


@pytest.mark.parametrize(
    "dtype,options",
    [(np.float32, EXACT32), (np.float16, {}), (np.float64, {})]
    + ([(BF16, {})] if BF16 is not None else []),
    ids=["f32-notf32", "f16", "f64"] + (["bf16"] if BF16 is not None else []),
)
@pytest.mark.parametrize("case", sorted(NBITS_CASES))
def test_matmul_nbits(case, dtype, options):
    """The dequantization kernel (bit streams, partial blocks, act-order g_idx, packed and float
    zero points) and the GEMM against the CPU kernel. The weight is rounded to A's type before
    the GEMM (the CPU keeps it in float32), so 16-bit types get the GEMM tolerances of
    test_cuda_matmul_conv.py (float16 1e-2, bfloat16 3e-2); float32 without TF32 1e-4."""
    model, feeds = nbits_model(dtype, *NBITS_CASES[case])
    got, ref = _run(model, feeds, options)
    _close(got[0], ref[0], *(2 * (_gemm_tol(dtype, options, ""),)))


# ---------------------------------------------------------------------------------------------
# SkipLayerNormalization

SKIP_CASES = {
    # name: (input shape, skip shape, beta, bias, outputs)
    "bert": ((2, 16, 768), (2, 16, 768), True, True, ("y", "", "", "s")),
    "all_outputs": ((3, 5, 33), (3, 5, 33), True, True, ("y", "mean", "inv", "s")),
    "no_beta_no_bias": ((4, 64), (4, 64), False, False, ("y",)),
    "skip_2d": ((2, 7, 96), (7, 96), True, False, ("y", "", "", "s")),
    "skip_leading_1": ((2, 7, 96), (1, 7, 96), False, True, ("y",)),
    "skip_dense_broadcast": ((2, 7, 96), (2, 1, 96), True, True, ("y", "", "", "s")),
    "wide_row": ((3, 4096), (3, 4096), True, True, ("y", "mean", "inv")),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("case", sorted(SKIP_CASES))
def test_skip_layer_norm(case, dtype):
    xs, ss, beta, bias, outputs = SKIP_CASES[case]
    rng = np.random.default_rng(2)
    h = xs[-1]
    feeds = {
        "x": _rand(rng, xs, dtype),
        "skip": _rand(rng, ss, dtype),
        "gamma": (rng.uniform(0.5, 1.5, h)).astype(dtype),
        "beta": _rand(rng, (h,), dtype) if beta else None,
        "bias": _rand(rng, (h,), dtype) if bias else None,
    }
    names = ["x", "skip", "gamma", "beta" if beta else "", "bias" if bias else ""]
    while not names[-1]:
        names.pop()
    ordered = {n: feeds[n] if n else None for n in names}
    model = _model("SkipLayerNormalization", MS, ordered, outputs, epsilon=1e-5)
    got, ref = _run(model, ordered)
    present = [o for o in outputs if o]
    dt = np.dtype(dtype)
    for name, g, r in zip(present, got, ref):
        if name == "s":
            np.testing.assert_array_equal(g, r)  # the same additions in the same order
        elif name in ("mean", "inv"):
            assert g.dtype == np.float32
            rtol = 2e-7 if dt == np.float64 else 1e-5  # float64 statistics, stored in float32
            _close(g, r, rtol, rtol / 10)
        elif dt == np.float32:
            _close(g, r, 1e-5, 1e-5)
        else:
            _close(g, r, *_elementwise_tol(dt))


# ---------------------------------------------------------------------------------------------
# MatMulBias


def _gemm_tol(dtype: Any, options: dict | None, activation: str) -> float:
    dt = np.dtype(dtype)
    exact32 = dt == np.float32 and (options or {}).get("use_tf32") == "0"
    if activation == "FastGelu" and (exact32 or dt == np.float64):
        return 2e-3  # cuBLASLt's GELU epilogue (see the module docstring)
    if dt == np.float64:
        return 1e-10
    if dt == np.float16:
        return 1e-2
    if BF16 is not None and dt == np.dtype(BF16):
        return 3e-2
    return 1e-4 if exact32 else 1e-2


MATMUL_BIAS_DTYPES = [
    (np.float32, EXACT32),
    (np.float32, {}),
    (np.float16, {}),
    (np.float64, {}),
] + ([(BF16, {})] if BF16 is not None else [])


@pytest.mark.parametrize(
    "dtype,options",
    MATMUL_BIAS_DTYPES,
    ids=[f"{np.dtype(d).name}{'-notf32' if o else ''}" for d, o in MATMUL_BIAS_DTYPES],
)
@pytest.mark.parametrize("activation", ["", "Relu", "Gelu", "FastGelu"])
@pytest.mark.parametrize("a_shape", [(2, 9, 64), (17, 64), (64,)], ids=str)
def test_matmul_bias(a_shape, activation, dtype, options):
    rng = np.random.default_rng(3)
    feeds = {
        "a": _rand(rng, a_shape, dtype),
        "w": _rand(rng, (64, 48), dtype, 0.2),
        "bias": _rand(rng, (48,), dtype),
    }
    attrs = {"activation": activation} if activation else {}
    got, ref = _run(_model("MatMulBias", PLUG, feeds, **attrs), feeds, options)
    tol = _gemm_tol(dtype, options, activation)
    _close(got[0], ref[0], tol, tol)


def test_matmul_bias_runs_on_cublaslt():
    pytest.importorskip("nvmath.bindings.cublasLt")
    from onnxplug_cuda import blas

    rng = np.random.default_rng(4)
    feeds = {
        "a": _rand(rng, (4, 8, 32), np.float32),
        "w": _rand(rng, (32, 16), np.float32),
        "bias": _rand(rng, (16,), np.float32),
    }
    before = dict(blas.stats)
    got, ref = _run(_model("MatMulBias", PLUG, feeds, activation="Relu"), feeds, EXACT32)
    _close(got[0], ref[0], 1e-4, 1e-4)
    assert blas.stats["cublaslt"] > before["cublaslt"]
    assert blas.stats["xp"] == before["xp"]


# ---------------------------------------------------------------------------------------------
# Fused graphs


@pytest.mark.parametrize("which", ["bert", "gpt2"])
def test_fused_transformer_graph(which):
    """The fused graph on [CUDA, CPU] (float32, no TF32) against the unfused graph on the CPU:
    the fused ops run on CUDA. Two layers of GEMMs and normalizations in other summation
    orders: rtol 1e-4, atol 1e-4 * scale."""
    from tests.test_fusions_transformer import _feeds, bert_model, gpt2_model

    model = bert_model() if which == "bert" else gpt2_model()
    feeds = _feeds(model)
    cuda = ox.InferenceSession(model, providers=[(CUDA, EXACT32), CPU])
    so = ox.SessionOptions()
    so.graph_optimization_level = ox.GraphOptimizationLevel.ORT_DISABLE_ALL
    plain = ox.InferenceSession(model, so, providers=[CPU])
    fused_ops = {"SkipLayerNormalization", "MatMulBias"}  # GPT-2: Gemm + gelu_new
    info = cuda.get_provider_graph_assignment_info()
    for op in fused_ops:
        eps = {r["ep"] for r in info if r["op_type"] == op}
        assert eps == {CUDA}, (op, eps, assignment(cuda))
    _close(cuda.run(None, feeds)[0], plain.run(None, feeds)[0], 1e-4, 1e-4)
