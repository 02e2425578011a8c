"""MatMul/Gemm/FusedMatMul/MatMulInteger (cuBLASLt), Conv/ConvTranspose/FusedConv (cuDNN, and the GEMM
fallback) and pooling on the CUDA provider, compared with the CPU provider.

Every test builds a one-node model, runs it with providers [CUDA, CPU] and with CPU alone, and
checks that the node ran on CUDAExecutionProvider. Tolerances (``atol`` scales with the largest
reference value):
* float32 with ``use_tf32=0``: rtol 1e-4, atol 1e-4 (true float32 arithmetic, summed in another
  order than numpy).
* float32 with TF32 allowed (the default): rtol 1e-2, atol 1e-2. TF32 keeps 10 mantissa bits.
* float16: rtol 1e-2, atol 1e-2, i.e. one or two float16 ulps. Both sides accumulate in float32
  and round once.
* bfloat16: rtol 3e-2, atol 3e-2, i.e. one or two bfloat16 ulps.
* float64: rtol 1e-10, atol 1e-10.
* integer outputs (MatMulInteger, MaxPool indices): exact.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import numpy as np
import pytest
from onnx import TensorProto, helper
from tests.gpu._cuda import CPU, CUDA, assignment, cuda_marks, run_cuda_and_cpu

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
    np.dtype(np.uint8): TensorProto.UINT8,
    np.dtype(np.int8): TensorProto.INT8,
}
if BF16 is not None:
    _ELEM[np.dtype(BF16)] = TensorProto.BFLOAT16

EXACT32 = {"use_tf32": "0"}
ALGOS = ["EXHAUSTIVE", "HEURISTIC", "DEFAULT"]


def _model(op, feeds, outputs=("y",), opset=17, domain="", **attrs) -> bytes:
    """A one-node model named "n" whose inputs are ``feeds`` ("" skips an optional input)."""
    node = helper.make_node(op, list(feeds), list(outputs), name="n", domain=domain, **attrs)
    inputs = [
        helper.make_tensor_value_info(k, _ELEM[np.dtype(v.dtype)], None)
        for k, v in feeds.items()
        if k
    ]
    outs = [helper.make_empty_tensor_value_info(o) for o in outputs]
    imports = [helper.make_opsetid("", opset)]
    if domain:
        imports.append(helper.make_opsetid(domain, 1))
    g = helper.make_graph([node], "g", inputs, outs)
    return helper.make_model(g, opset_imports=imports).SerializeToString()


def _tol(dtype: Any, options: dict[str, str] | None) -> float:
    dt = np.dtype(dtype)
    if dt == np.float64:
        return 1e-10
    if dt == np.float16:
        return 1e-2
    if BF16 is not None and dt == np.dtype(BF16):
        return 3e-2
    return 1e-4 if (options or {}).get("use_tf32") == "0" else 1e-2


def _check(model, feeds, dtype, options=None):
    """Run on CUDA and CPU; the node must be on CUDA and the outputs must agree."""
    got, ref, eps = run_cuda_and_cpu(model, {k: v for k, v in feeds.items() if k}, options)
    assert eps["n"] == CUDA, eps
    tol = _tol(dtype, options)
    for g, r in zip(got, ref):
        assert g.shape == r.shape and g.dtype == r.dtype, (g.shape, r.shape, g.dtype, r.dtype)
        if r.dtype.kind in "iub":
            np.testing.assert_array_equal(g, r)
            continue
        r64, g64 = r.astype(np.float64), g.astype(np.float64)
        scale = max(1.0, float(np.abs(r64).max(initial=0.0)))
        np.testing.assert_allclose(g64, r64, rtol=tol, atol=tol * scale)
    return got


def _rand(rng, shape, dtype):
    return rng.standard_normal(shape).astype(dtype)


# ---------------------------------------------------------------------------------------------
# MatMul

MATMUL_SHAPES = [
    ((5, 7), (7, 3)),
    ((2, 5, 7), (7, 3)),  # batched A, shared B: one tall GEMM
    ((7,), (2, 7, 3)),  # 1-D A, batched B
    ((2, 5, 7), (2, 7, 3)),
    ((2, 3, 5, 7), (7, 3)),
    ((2, 1, 5, 7), (1, 4, 7, 3)),  # both broadcast: loop x strided batch
    ((3, 1, 5, 7), (4, 7, 3)),
    ((2, 5, 7), (7,)),
    ((7,), (7,)),
    ((3, 33, 64), (64, 17)),
]


@pytest.mark.parametrize("sa,sb", MATMUL_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize(
    "dtype,options",
    [
        (np.float32, EXACT32),
        (np.float32, {}),
        (np.float16, {}),
        (np.float64, {}),
    ],
    ids=["f32-notf32", "f32-tf32", "f16", "f64"],
)
def test_matmul(sa, sb, dtype, options):
    rng = np.random.default_rng(0)
    feeds = {"a": _rand(rng, sa, dtype), "b": _rand(rng, sb, dtype)}
    _check(_model("MatMul", feeds, opset=13), feeds, dtype, options)


@pytest.mark.skipif(BF16 is None, reason="ml_dtypes is not installed")
@pytest.mark.parametrize("sa,sb", [((5, 7), (7, 3)), ((2, 1, 5, 7), (1, 4, 7, 3))])
def test_matmul_bfloat16(sa, sb):
    rng = np.random.default_rng(1)
    feeds = {"a": _rand(rng, sa, BF16), "b": _rand(rng, sb, BF16)}
    _check(_model("MatMul", feeds, opset=13), feeds, BF16)


def test_matmul_runs_on_cublaslt():
    pytest.importorskip("nvmath.bindings.cublasLt")
    from onnxplug_cuda import blas

    rng = np.random.default_rng(2)
    feeds = {"a": _rand(rng, (4, 8, 16), np.float32), "b": _rand(rng, (16, 8), np.float32)}
    before = dict(blas.stats)
    _check(_model("MatMul", feeds, opset=13), feeds, np.float32, EXACT32)
    assert blas.stats["cublaslt"] > before["cublaslt"]
    assert blas.stats["xp"] == before["xp"]


# ---------------------------------------------------------------------------------------------
# com.microsoft FusedMatMul: the GEMM's transposes and alpha

FUSED_SHAPES = [MATMUL_SHAPES[i] for i in (0, 2, 3, 5, 7)] + [((16, 16), (16, 16))]


def _stored(shape: tuple, trans: int) -> tuple:
    """The stored shape of an operand that op() transposes (rank >= 2) into ``shape``."""
    return (*shape[:-2], shape[-1], shape[-2]) if trans and len(shape) >= 2 else shape


@pytest.mark.parametrize("sa,sb", FUSED_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("ta,tb,alpha", [(0, 0, 0.5), (1, 0, 1.0), (0, 1, -2.0), (1, 1, 0.125)])
@pytest.mark.parametrize(
    "dtype,options",
    [(np.float32, EXACT32), (np.float16, {}), (np.float64, {})]
    + ([(BF16, {})] if BF16 is not None else []),
    ids=["f32-notf32", "f16", "f64"] + (["bf16"] if BF16 is not None else []),
)
def test_fused_matmul(sa, sb, ta, tb, alpha, dtype, options):
    rng = np.random.default_rng(9)
    feeds = {"a": _rand(rng, _stored(sa, ta), dtype), "b": _rand(rng, _stored(sb, tb), dtype)}
    model = _model("FusedMatMul", feeds, domain="com.microsoft", alpha=alpha, transA=ta, transB=tb)
    _check(model, feeds, dtype, options)


# ---------------------------------------------------------------------------------------------
# Gemm

GEMM_C = [None, (5, 3), (3,), (1, 3), (5, 1), (1, 1), ()]


@pytest.mark.parametrize("trans_a,trans_b", list(itertools.product([0, 1], [0, 1])))
@pytest.mark.parametrize("c_shape", GEMM_C, ids=lambda s: "noC" if s is None else f"C{s}")
@pytest.mark.parametrize("alpha,beta", [(1.0, 1.0), (0.5, 2.0)])
def test_gemm(trans_a, trans_b, c_shape, alpha, beta):
    rng = np.random.default_rng(3)
    M, K, N = 5, 6, 3
    feeds = {
        "a": _rand(rng, (K, M) if trans_a else (M, K), np.float32),
        "b": _rand(rng, (N, K) if trans_b else (K, N), np.float32),
    }
    if c_shape is not None:
        feeds["c"] = np.asarray(rng.standard_normal(c_shape), dtype=np.float32)
    m = _model("Gemm", feeds, opset=13, transA=trans_a, transB=trans_b, alpha=alpha, beta=beta)
    _check(m, feeds, np.float32, EXACT32)


@pytest.mark.parametrize("trans_a,trans_b", list(itertools.product([0, 1], [0, 1])))
@pytest.mark.parametrize("c_shape", [(3,), (5, 3), (5, 1)], ids=str)
def test_gemm_float16(trans_a, trans_b, c_shape):
    rng = np.random.default_rng(4)
    M, K, N = 5, 6, 3
    feeds = {
        "a": _rand(rng, (K, M) if trans_a else (M, K), np.float16),
        "b": _rand(rng, (N, K) if trans_b else (K, N), np.float16),
        "c": _rand(rng, c_shape, np.float16),
    }
    _check(_model("Gemm", feeds, opset=13, transA=trans_a, transB=trans_b), feeds, np.float16)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("c_shape", [None, (768,)], ids=["MatMul", "Gemm+bias"])
def test_tunable_op_tunes_each_gemm_once_and_keeps_its_choice(
    monkeypatch, tmp_path, dtype, c_shape
):
    """``tunable_op_enable`` + ``tunable_op_tuning_enable``: a GEMM's cuBLASLt candidates are
    timed on its first call, the fastest runs from then on (the first run, the prepared run
    and the replay agree bit for bit, and match the CPU), and the choice is kept in the tuning
    cache: a new engine (a new process) runs it without timing, with the same bits."""
    from onnxplug_cuda import blas, tuning

    rng = np.random.default_rng(9)
    feeds = {"a": _rand(rng, (128, 3072), dtype), "b": _rand(rng, (3072, 768), dtype)}
    if c_shape is None:
        model = _model("MatMul", feeds)
    else:
        feeds["c"] = _rand(rng, c_shape, dtype)
        model = _model("Gemm", feeds, opset=13)
    opts = {
        "tunable_op_enable": "1",
        "tunable_op_tuning_enable": "1",
        "tuning_cache_dir": str(tmp_path),
        "enable_cuda_graph": "1",
    }
    want = ox.InferenceSession(model, providers=[CPU]).run(None, feeds)[0].astype(np.float64)

    def run() -> tuple[list[np.ndarray], int, int]:
        monkeypatch.setattr(blas, "_engines", {})  # a new engine, as in a new process
        monkeypatch.setattr(tuning, "_results", {})
        before = dict(blas.stats)
        sess = ox.InferenceSession(model, providers=[(CUDA, opts), CPU])
        ys = [sess.run(None, feeds)[0] for _ in range(3)]  # first run, capture, replay
        for eng in blas._engines.values():
            eng.tuning.cache.flush()
        tuned = blas.stats["tuned"] - before["tuned"]
        return ys, tuned, blas.stats["tuning_cache_hits"] - before["tuning_cache_hits"]

    ys, tuned, hits = run()
    assert tuned == 1 and hits == 0
    np.testing.assert_array_equal(ys[0], ys[1])
    np.testing.assert_array_equal(ys[1], ys[2])
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(ys[0].astype(np.float64), want, rtol=1e-2, atol=1e-2 * scale)
    again, tuned, hits = run()
    assert tuned == 0 and hits == 1
    np.testing.assert_array_equal(again[0], ys[0])


def test_tuning_results_move_a_gemms_choice_between_processes(monkeypatch, tmp_path):
    """``get_tuning_results`` reports what a GEMM tuned (its signature, the candidate's index,
    this device's validators); in a new process (new engines and results, no cache), those
    results given by ``set_tuning_results``, or embedded in the model, make the GEMM run that
    candidate without timing, with the same bits."""
    import onnx

    from onnxplug_cuda import blas, tuning

    rng = np.random.default_rng(11)
    feeds = {"a": _rand(rng, (128, 3072), np.float16), "b": _rand(rng, (3072, 768), np.float16)}
    model = _model("MatMul", feeds)
    use = {"tunable_op_enable": "1", "tuning_cache_dir": "off"}

    def new_process() -> dict[str, int]:
        monkeypatch.setattr(blas, "_engines", {})
        monkeypatch.setattr(tuning, "_results", {})
        return dict(blas.stats)

    new_process()
    tuner = ox.InferenceSession(
        model, providers=[(CUDA, {**use, "tunable_op_tuning_enable": "1"}), CPU]
    )
    want = tuner.run(None, feeds)[0]
    (tr,) = tuner.get_tuning_results()
    assert tr["ep"] == CUDA
    assert set(tr["validators"]) == {
        "ORT_VERSION",
        "CUDA_VERSION",
        "DEVICE_MODEL",
        "CUBLASLT_VERSION",
    }
    assert tr["validators"]["DEVICE_MODEL"].startswith("NVIDIA")
    ((op, kernels),) = tr["results"].items()
    assert op == "LtGemm<float16,COMPUTE_32F>" and len(kernels) == 1

    before = new_process()
    sess = ox.InferenceSession(model, providers=[(CUDA, use), CPU])
    sess.set_tuning_results([tr], error_on_invalid=True)
    got = sess.run(None, feeds)[0]
    assert blas.stats["tuned"] == before["tuned"]
    assert blas.stats["tuning_results_hits"] == before["tuning_results_hits"] + 1
    np.testing.assert_array_equal(got, want)

    before = new_process()
    proto = onnx.load_from_string(model)
    proto.metadata_props.add(key="tuning_results", value=json.dumps([tr]))
    embedded = ox.InferenceSession(
        proto.SerializeToString(), providers=[(CUDA, {"tuning_cache_dir": "off"}), CPU]
    )
    assert embedded.get_provider_options()[CUDA]["tunable_op_enable"] == "1"
    np.testing.assert_array_equal(embedded.run(None, feeds)[0], want)
    assert blas.stats["tuning_results_hits"] == before["tuning_results_hits"] + 1
    assert embedded.get_tuning_results()[0]["results"] == tr["results"]


def test_gemm_opset7_requires_c():
    rng = np.random.default_rng(5)
    feeds = {
        "a": _rand(rng, (4, 6), np.float32),
        "b": _rand(rng, (6, 2), np.float32),
        "c": _rand(rng, (2,), np.float32),
    }
    _check(_model("Gemm", feeds, opset=7, beta=0.5), feeds, np.float32, EXACT32)


# ---------------------------------------------------------------------------------------------
# MatMulInteger


@pytest.mark.parametrize(
    "ta,tb,sa,sb",
    [
        (np.uint8, np.uint8, (4, 9), (9, 5)),
        (np.int8, np.int8, (2, 4, 9), (9, 5)),
        (np.uint8, np.int8, (2, 4, 9), (2, 9, 5)),
    ],
)
def test_matmul_integer_is_exact(ta, tb, sa, sb):
    rng = np.random.default_rng(6)

    def ints(t, shape):
        info = np.iinfo(t)
        return np.asarray(rng.integers(info.min, info.max + 1, size=shape), dtype=t)

    feeds = {"a": ints(ta, sa), "b": ints(tb, sb), "azp": ints(ta, ()), "bzp": ints(tb, ())}
    _check(_model("MatMulInteger", feeds, opset=10), feeds, np.int32)


# ---------------------------------------------------------------------------------------------
# Conv

CONV_CASES = {
    # name: (x shape, w shape, attributes)
    "2d-pad1-bias": ((2, 4, 9, 9), (6, 4, 3, 3), dict(pads=[1, 1, 1, 1]), True),
    "2d-groups-dilation-stride-asym": (
        (2, 4, 9, 10),
        (6, 2, 3, 3),
        dict(group=2, dilations=[2, 1], strides=[2, 1], pads=[0, 1, 2, 1]),
        True,
    ),
    "2d-depthwise-same-upper": (
        (2, 4, 8, 7),
        (4, 1, 3, 3),
        dict(group=4, auto_pad="SAME_UPPER", strides=[2, 2]),
        False,
    ),
    "2d-1x1-stride2": ((2, 4, 9, 9), (5, 4, 1, 1), dict(strides=[2, 2]), True),
    "1d-dilation-asym": (
        (2, 4, 11),
        (6, 4, 3),
        dict(strides=[2], dilations=[2], pads=[1, 2]),
        True,
    ),
    "3d-groups": (
        (1, 2, 5, 6, 7),
        (4, 1, 2, 3, 2),
        dict(group=2, strides=[1, 2, 1], pads=[1, 0, 1, 0, 1, 1]),
        True,
    ),
}


def _conv_feeds(rng, xs, ws, bias, dtype):
    feeds = {"x": _rand(rng, xs, dtype), "w": _rand(rng, ws, dtype)}
    if bias:
        feeds["b"] = _rand(rng, (ws[0],), dtype)
    return feeds


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("case", list(CONV_CASES))
def test_conv_float32_exact(case, algo):
    xs, ws, attrs, bias = CONV_CASES[case]
    feeds = _conv_feeds(np.random.default_rng(7), xs, ws, bias, np.float32)
    options = {**EXACT32, "cudnn_conv_algo_search": algo}
    _check(_model("Conv", feeds, **attrs), feeds, np.float32, options)


@pytest.mark.parametrize("case", list(CONV_CASES))
def test_conv_float16(case):
    xs, ws, attrs, bias = CONV_CASES[case]
    feeds = _conv_feeds(np.random.default_rng(8), xs, ws, bias, np.float16)
    _check(
        _model("Conv", feeds, **attrs), feeds, np.float16, {"cudnn_conv_algo_search": "HEURISTIC"}
    )


@pytest.mark.parametrize("case", list(CONV_CASES))
def test_conv_tf32_allowed(case):
    xs, ws, attrs, bias = CONV_CASES[case]
    feeds = _conv_feeds(np.random.default_rng(9), xs, ws, bias, np.float32)
    _check(_model("Conv", feeds, **attrs), feeds, np.float32, {})


@pytest.mark.parametrize("case", list(CONV_CASES))
def test_conv_without_cudnn_uses_the_gemm_fallback(case):
    from onnxplug_cuda import dnn

    xs, ws, attrs, bias = CONV_CASES[case]
    feeds = _conv_feeds(np.random.default_rng(10), xs, ws, bias, np.float32)
    before = dict(dnn.stats)
    _check(_model("Conv", feeds, **attrs), feeds, np.float32, {**EXACT32, "enable_cudnn": "0"})
    assert dnn.stats["cudnn"] == before["cudnn"]
    assert dnn.stats["fallback"] > before["fallback"]


@pytest.mark.parametrize(
    "options",
    [
        {**EXACT32, "cudnn_conv1d_pad_to_nc1d": "1"},
        {**EXACT32, "cudnn_conv_use_max_workspace": "0"},
    ],
    ids=["pad_to_nc1d", "limited_workspace"],
)
@pytest.mark.parametrize("case", ["1d-dilation-asym", "2d-pad1-bias"])
def test_conv_options(case, options):
    xs, ws, attrs, bias = CONV_CASES[case]
    feeds = _conv_feeds(np.random.default_rng(11), xs, ws, bias, np.float32)
    _check(_model("Conv", feeds, **attrs), feeds, np.float32, options)


def test_conv_float64():
    xs, ws, attrs, bias = CONV_CASES["2d-groups-dilation-stride-asym"]
    feeds = _conv_feeds(np.random.default_rng(12), xs, ws, bias, np.float64)
    _check(_model("Conv", feeds, **attrs), feeds, np.float64)


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_conv_runs_on_cudnn(algo, dtype, bias):
    """A plain NCHW 3x3 convolution goes through a cuDNN graph, not the GEMM fallback."""
    pytest.importorskip("cudnn")
    from onnxplug_cuda import dnn

    feeds = _conv_feeds(np.random.default_rng(13), (2, 8, 12, 12), (16, 8, 3, 3), bias, dtype)
    options = {"cudnn_conv_algo_search": algo}
    if dtype == np.float32:
        options.update(EXACT32)
    before = dict(dnn.stats)
    _check(_model("Conv", feeds, pads=[1, 1, 1, 1]), feeds, dtype, options)
    assert dnn.stats["cudnn"] > before["cudnn"], "the cuDNN graph did not run"
    assert dnn.stats["fallback"] == before["fallback"], "the GEMM fallback ran"


def test_fused_conv_relu_matches_conv_then_relu():
    """com.microsoft FusedConv (Conv + bias + Relu; ReLU fused into the cuDNN graph when an
    engine supports it) against the CPU provider's Conv followed by max(0, .)."""
    feeds = _conv_feeds(np.random.default_rng(14), (2, 4, 9, 9), (6, 4, 3, 3), True, np.float32)
    fused = _model("FusedConv", feeds, domain="com.microsoft", activation="Relu", pads=[1, 1, 1, 1])
    s = ox.InferenceSession(fused, providers=[(CUDA, EXACT32), CPU])
    assert assignment(s)["n"] == CUDA
    conv = _model("Conv", feeds, pads=[1, 1, 1, 1])
    ref = np.maximum(ox.InferenceSession(conv, providers=[CPU]).run(None, feeds)[0], 0)
    y = s.run(None, feeds)[0]
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4 * max(1.0, float(np.abs(ref).max())))


# ---------------------------------------------------------------------------------------------
# ConvTranspose

CONVT_CASES = {
    "2d-stride2-outpad-bias": (
        (2, 4, 5, 6),
        (4, 3, 3, 3),
        dict(strides=[2, 2], pads=[1, 1, 1, 1], output_padding=[1, 1]),
        True,
    ),
    "2d-groups-dilation": ((2, 4, 5, 6), (4, 2, 3, 3), dict(group=2, dilations=[2, 2]), True),
    "2d-output-shape": (
        (1, 3, 4, 5),
        (3, 2, 3, 3),
        dict(strides=[2, 2], output_shape=[8, 10]),
        False,
    ),
    "2d-same-upper": (
        (1, 3, 4, 5),
        (3, 2, 3, 3),
        dict(strides=[2, 2], auto_pad="SAME_UPPER"),
        False,
    ),
    "2d-asym-pads": ((2, 3, 5, 5), (3, 4, 3, 3), dict(strides=[2, 1], pads=[0, 1, 2, 0]), True),
    "1d-outpad": ((2, 3, 7), (3, 5, 3), dict(strides=[3], pads=[1, 1], output_padding=[2]), True),
    "3d": ((1, 2, 3, 4, 3), (2, 3, 2, 2, 2), dict(strides=[2, 1, 2]), True),
}


def _convt_feeds(rng, xs, ws, bias, group, dtype):
    feeds = {"x": _rand(rng, xs, dtype), "w": _rand(rng, ws, dtype)}
    if bias:
        feeds["b"] = _rand(rng, (ws[1] * group,), dtype)
    return feeds


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("case", list(CONVT_CASES))
def test_conv_transpose_float32_exact(case, algo):
    xs, ws, attrs, bias = CONVT_CASES[case]
    feeds = _convt_feeds(np.random.default_rng(15), xs, ws, bias, attrs.get("group", 1), np.float32)
    options = {**EXACT32, "cudnn_conv_algo_search": algo}
    _check(_model("ConvTranspose", feeds, **attrs), feeds, np.float32, options)


@pytest.mark.parametrize("case", list(CONVT_CASES))
def test_conv_transpose_float16(case):
    xs, ws, attrs, bias = CONVT_CASES[case]
    feeds = _convt_feeds(np.random.default_rng(16), xs, ws, bias, attrs.get("group", 1), np.float16)
    _check(_model("ConvTranspose", feeds, **attrs), feeds, np.float16)


@pytest.mark.parametrize("case", list(CONVT_CASES))
def test_conv_transpose_without_cudnn(case):
    xs, ws, attrs, bias = CONVT_CASES[case]
    feeds = _convt_feeds(np.random.default_rng(17), xs, ws, bias, attrs.get("group", 1), np.float32)
    options = {**EXACT32, "enable_cudnn": "0"}
    _check(_model("ConvTranspose", feeds, **attrs), feeds, np.float32, options)


def test_conv_transpose_runs_on_cudnn():
    pytest.importorskip("cudnn")
    from onnxplug_cuda import dnn

    xs, ws, attrs, bias = CONVT_CASES["2d-stride2-outpad-bias"]
    feeds = _convt_feeds(np.random.default_rng(18), xs, ws, bias, 1, np.float32)
    before = dict(dnn.stats)
    _check(_model("ConvTranspose", feeds, **attrs), feeds, np.float32, EXACT32)
    assert dnn.stats["cudnn"] > before["cudnn"], "the cuDNN graph did not run"
    assert dnn.stats["fallback"] == before["fallback"], "the GEMM fallback ran"


# ---------------------------------------------------------------------------------------------
# pooling

POOL_CASES = [
    ("MaxPool", (2, 3, 9, 8), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),
    (
        "MaxPool",
        (2, 3, 9, 8),
        dict(kernel_shape=[3, 2], dilations=[2, 1], ceil_mode=1, strides=[2, 2]),
    ),
    ("MaxPool", (2, 3, 11), dict(kernel_shape=[3], strides=[2], auto_pad="SAME_UPPER")),
    (
        "MaxPool",
        (1, 2, 5, 6, 7),
        dict(kernel_shape=[2, 3, 2], strides=[2, 1, 2], pads=[0, 1, 1, 1, 1, 0]),
    ),
    ("AveragePool", (2, 3, 9, 8), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 0, 1, 2])),
    (
        "AveragePool",
        (2, 3, 9, 8),
        dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], count_include_pad=1),
    ),
    ("AveragePool", (2, 3, 9, 8), dict(kernel_shape=[2, 3], strides=[2, 2], ceil_mode=1)),
    ("AveragePool", (2, 3, 10), dict(kernel_shape=[4], strides=[3], auto_pad="SAME_LOWER")),
    ("AveragePool", (1, 2, 5, 6, 7), dict(kernel_shape=[2, 2, 3], dilations=[1, 2, 1])),
    ("LpPool", (2, 3, 9, 8), dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1], p=2)),
    ("LpPool", (2, 3, 9, 8), dict(kernel_shape=[2, 2], strides=[2, 2], p=3)),
]


@pytest.mark.parametrize("op,shape,attrs", POOL_CASES, ids=lambda v: str(v)[:40])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_pool(op, shape, attrs, dtype):
    if op == "LpPool" and dtype == np.float16:
        pytest.skip("the CPU provider's LpPool (onnx.reference) has no float16")
    feeds = {"x": _rand(np.random.default_rng(19), shape, dtype)}
    _check(_model(op, feeds, opset=19, **attrs), feeds, dtype, EXACT32)


@pytest.mark.parametrize("storage_order", [0, 1])
@pytest.mark.parametrize(
    "shape,attrs",
    [
        ((2, 3, 9, 8), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),
        ((2, 3, 9, 8), dict(kernel_shape=[2, 3], dilations=[2, 1], ceil_mode=1)),
        ((1, 2, 5, 6, 7), dict(kernel_shape=[2, 2, 2], strides=[2, 2, 2])),
    ],
)
def test_maxpool_indices(shape, attrs, storage_order):
    feeds = {"x": _rand(np.random.default_rng(20), shape, np.float32)}
    m = _model("MaxPool", feeds, outputs=("y", "i"), opset=12, storage_order=storage_order, **attrs)
    _check(m, feeds, np.float32, EXACT32)


@pytest.mark.parametrize("op", ["GlobalAveragePool", "GlobalMaxPool"])
@pytest.mark.parametrize("shape", [(2, 3, 7, 5), (2, 3, 9), (1, 2, 3, 4, 5)])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_global_pool(op, shape, dtype):
    feeds = {"x": _rand(np.random.default_rng(21), shape, dtype)}
    _check(_model(op, feeds), feeds, dtype, EXACT32)
