"""The transformer fusions (graph_optimization_level >= 2) on small graphs with the exact patterns
torch.onnx.export (opset 17, dynamo=False) writes for BERT and GPT-2.

Each fused session (default level) must hold the fused node and match the unfused session
(ORT_DISABLE_ALL) on the CPU provider, and on the host-simulated CUDA provider (whose kernels
must then run the fused nodes). float32 tolerances are 1e-5; float16/bfloat16 results are
compared with a float64 reference within one or two units of their last place. A pattern with
a wrong constant, or whose intermediate values are read elsewhere, must not be fused.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxplug as ox
from onnxplug.ir.graph import graph_from_model
from onnxplug.optimizer.fusions import fuse_transformer
from onnxplug.optimizer.passes import optimize

PLUGIN_SRC = Path(__file__).resolve().parents[1] / "plugins" / "cuda" / "src"
SIM = "CUDASimExecutionProvider"
CPU = "CPUExecutionProvider"
MS, PLUG = "com.microsoft", "ai.onnxplug"
BF16 = np.dtype(ml_dtypes.bfloat16)
_ELEM = {
    np.dtype(np.float32): TensorProto.FLOAT,
    np.dtype(np.float16): TensorProto.FLOAT16,
    np.dtype(np.float64): TensorProto.DOUBLE,
    BF16: TensorProto.BFLOAT16,
}
SQRT2 = math.sqrt(2.0)
K = math.sqrt(2.0 / math.pi)
RNG = np.random.default_rng(7)


@pytest.fixture(scope="module")
def sim():
    if str(PLUGIN_SRC) not in sys.path:
        sys.path.insert(0, str(PLUGIN_SRC))
    ox.register_execution_provider_library(SIM, "onnxplug_cuda.sim:create_factory")
    yield SIM
    ox.unregister_execution_provider_library(SIM)


class G:
    """A small graph under construction: ``op`` adds a node and returns its output name,
    ``const`` an initializer (or a Constant node) and returns its name."""

    def __init__(self, dtype=np.float32):
        self.dtype = np.dtype(dtype)
        self.nodes: list = []
        self.inits: list = []
        self.inputs: list = []
        self.count = 0

    def name(self, base: str) -> str:
        self.count += 1
        return f"{base}_{self.count}"

    def input(self, name: str, shape, dtype=None) -> str:
        elem = _ELEM[np.dtype(dtype or self.dtype)]
        self.inputs.append(helper.make_tensor_value_info(name, elem, shape))
        return name

    def const(self, value, dtype=None, node: bool = False) -> str:
        arr = np.asarray(value, dtype=dtype or self.dtype)
        name = self.name("c")
        if node:  # a Constant node, as torch writes when constant folding is off
            self.nodes.append(
                helper.make_node("Constant", [], [name], value=numpy_helper.from_array(arr, name))
            )
        else:
            self.inits.append(numpy_helper.from_array(arr, name))
        return name

    def op(self, op_type: str, *inputs: str, domain: str = "", n_out: int = 1, **attrs):
        outs = [self.name(op_type) for _ in range(n_out)]
        self.nodes.append(
            helper.make_node(op_type, list(inputs), outs, name=outs[0], domain=domain, **attrs)
        )
        return outs[0] if n_out == 1 else outs

    def model(self, outputs: list[str], opset: int = 17) -> bytes:
        outs = [helper.make_empty_tensor_value_info(o) for o in outputs]
        g = helper.make_graph(self.nodes, "g", self.inputs, outs, self.inits)
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
        m.ir_version = 8
        return m.SerializeToString()


# ---------------------------------------------------------------------------------------------
# The exporters' GELU patterns


def gelu_torch(g: G, x: str, node_consts: bool = False) -> str:
    """torch F.gelu (approximate='none') at opset < 20: x * (erf(x / sqrt2) + 1) * 0.5."""
    d = g.op("Div", x, g.const(SQRT2, node=node_consts))
    e = g.op("Erf", d)
    a = g.op("Add", e, g.const(1.0, node=node_consts))
    m = g.op("Mul", x, a)
    return g.op("Mul", m, g.const(0.5, node=node_consts))


def gelu_bert_legacy(g: G, x: str) -> str:
    """transformers' original gelu: x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))."""
    h = g.op("Mul", x, g.const(0.5))
    e = g.op("Erf", g.op("Div", x, g.const(SQRT2)))
    return g.op("Mul", h, g.op("Add", g.const(1.0), e))


def gelu_mul_form(g: G, x: str) -> str:
    """The erf argument as a product with 1/sqrt2 (constants as first operands)."""
    e = g.op("Erf", g.op("Mul", g.const(1 / SQRT2), x))
    return g.op("Mul", g.const(0.5), g.op("Mul", g.op("Add", e, g.const(1.0)), x))


def gelu_new(g: G, x: str) -> str:
    """transformers' gelu_new (GPT-2): 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))."""
    h = g.op("Mul", x, g.const(0.5))
    p = g.op("Pow", x, g.const(3.0))
    inner = g.op("Mul", g.op("Add", x, g.op("Mul", p, g.const(0.044715))), g.const(K))
    t = g.op("Tanh", inner)
    return g.op("Mul", h, g.op("Add", t, g.const(1.0)))


def gelu_torch_tanh(g: G, x: str) -> str:
    """torch F.gelu(approximate='tanh') at opset < 20 (x^3 as x * (x * x), constants first)."""
    cube = g.op("Mul", x, g.op("Mul", x, x))
    inner = g.op("Mul", g.const(K), g.op("Add", x, g.op("Mul", g.const(0.044715), cube)))
    t = g.op("Tanh", inner)
    return g.op("Mul", g.const(0.5), g.op("Mul", x, g.op("Add", g.const(1.0), t)))


def gelu_megatron(g: G, x: str) -> str:
    """Megatron/OpenAI: x * 0.5 * (1.0 + tanh(0.79788456 * x * (1.0 + 0.044715 * x * x)))."""
    h = g.op("Mul", x, g.const(0.5))
    k = g.op("Mul", x, g.const(0.79788456))
    poly = g.op("Add", g.const(1.0), g.op("Mul", g.op("Mul", x, g.const(0.044715)), x))
    t = g.op("Tanh", g.op("Mul", k, poly))
    return g.op("Mul", h, g.op("Add", t, g.const(1.0)))


ERF_FORMS = {
    "torch": gelu_torch,
    "torch_constant_nodes": lambda g, x: gelu_torch(g, x, node_consts=True),
    "bert_legacy": gelu_bert_legacy,
    "mul_form": gelu_mul_form,
}
TANH_FORMS = {"gelu_new": gelu_new, "torch_tanh": gelu_torch_tanh, "megatron": gelu_megatron}


def gelu_ref(x: np.ndarray) -> np.ndarray:
    v = x.astype(np.float64)
    return 0.5 * v * (1 + np.vectorize(math.erf)(v / SQRT2))


def fast_gelu_ref(x: np.ndarray) -> np.ndarray:
    v = x.astype(np.float64)
    return 0.5 * v * (1 + np.tanh(K * (v + 0.044715 * v**3)))


# ---------------------------------------------------------------------------------------------
# Sessions


def _options(level: ox.GraphOptimizationLevel | None) -> ox.SessionOptions:
    so = ox.SessionOptions()
    if level is not None:
        so.graph_optimization_level = level
    return so


def sessions(model: bytes, providers: list[str]):
    """(fused session on ``providers``, unfused session on the CPU provider)."""
    fused = ox.InferenceSession(model, _options(None), providers=providers)
    plain = ox.InferenceSession(
        model, _options(ox.GraphOptimizationLevel.ORT_DISABLE_ALL), providers=[CPU]
    )
    return fused, plain


def op_types(sess) -> list[str]:
    return [r["op_type"] for r in sess.get_provider_graph_assignment_info()]


def providers_of(sess, op: str) -> set[str]:
    return {r["ep"] for r in sess.get_provider_graph_assignment_info() if r["op_type"] == op}


def check(model: bytes, feeds: dict, fused_ops: list[str], providers: list[str], rtol=1e-5):
    """The fused session has exactly ``fused_ops`` (as a multiset, copies aside), runs them on
    the first provider, and matches the unfused CPU session."""
    fused, plain = sessions(model, providers)
    ops = [o for o in op_types(fused) if not o.startswith("Memcpy")]
    assert sorted(ops) == sorted(fused_ops), ops
    for op in set(fused_ops):
        assert providers_of(fused, op) == {providers[0]}, (op, providers_of(fused, op))
    got, want = fused.run(None, feeds), plain.run(None, feeds)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_allclose(a.astype(np.float64), b.astype(np.float64), rtol=rtol, atol=rtol)
    return fused, got


PROVIDERS = {"cpu": [CPU], "sim": [SIM, CPU]}


@pytest.fixture(params=["cpu", "sim"])
def providers(request):
    if request.param == "sim":
        request.getfixturevalue("sim")
    return PROVIDERS[request.param]


def _x(shape, dtype=np.float32, scale=3.0) -> np.ndarray:
    return (RNG.standard_normal(shape) * scale).astype(dtype)


# ---------------------------------------------------------------------------------------------
# Gelu / FastGelu


FORMS = {
    **{f"erf_{k}": (f, "Gelu") for k, f in ERF_FORMS.items()},
    **{f"tanh_{k}": (f, "FastGelu") for k, f in TANH_FORMS.items()},
}


@pytest.mark.parametrize("form", sorted(FORMS))
def test_gelu_patterns_are_fused(form, providers):
    build, op = FORMS[form]
    g = G()
    x = g.input("x", [2, 5, 16])
    check(g.model([build(g, x)]), {"x": _x((2, 5, 16))}, [op], providers)


@pytest.mark.parametrize(
    "form,dtype",
    [("erf", np.float16), ("erf", BF16), ("erf", np.float64), ("tanh", np.float16), ("tanh", BF16)],
)
def test_gelu_other_float_types(form, dtype, providers):
    """16-bit types are computed in float32 and rounded once: within one ulp of the exact
    value (the unfused graph rounds at every step, so it is compared with the exact value)."""
    dt = np.dtype(dtype)
    g = G(dt)
    x = g.input("x", [3, 40])
    model = g.model([(gelu_torch if form == "erf" else gelu_new)(g, x)])
    op = "Gelu" if form == "erf" else "FastGelu"
    fused, _ = sessions(model, providers)
    assert [o for o in op_types(fused) if not o.startswith("Memcpy")] == [op]
    assert providers_of(fused, op) == {providers[0]}
    xv = _x((3, 40), dt)
    y = fused.run(None, {"x": xv})[0]
    assert y.dtype == dt
    ref = (gelu_ref if form == "erf" else fast_gelu_ref)(xv)
    ulp = {np.dtype(np.float16): 2**-10, BF16: 2**-7, np.dtype(np.float64): 2**-50}[dt]
    np.testing.assert_allclose(y.astype(np.float64), ref, rtol=ulp, atol=ulp)


def test_tanh_gelu_float64_stays_unfused():
    g = G(np.float64)
    x = g.input("x", [4])
    fused, _ = sessions(g.model([gelu_new(g, x)]), [CPU])
    assert "FastGelu" not in op_types(fused) and "Tanh" in op_types(fused)


def test_cpu_gelu_matches_math_erf():
    """The CPU Gelu kernels against math.erf in float64, over the whole useful range."""
    x = np.concatenate(
        [np.linspace(-12, 12, 4001), [0.0, -0.0, 1e-30, -1e-30, 30.0, -30.0]]
    ).astype(np.float32)
    for op, ref in (("Gelu", gelu_ref), ("FastGelu", fast_gelu_ref)):
        node = helper.make_node(op, ["x"], ["y"], domain="com.microsoft")
        graph = helper.make_graph(
            [node],
            "g",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [x.size])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        )
        model = helper.make_model(
            graph,
            opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
        )
        s = ox.InferenceSession(model.SerializeToString(), providers=[CPU])
        y = s.run(None, {"x": x})[0].astype(np.float64)
        # relative 1e-6, plus the float32 cancellation in 1 + erf (1 + tanh) for negative x,
        # which every float32 implementation of the formula has: a few ulps of 1, times x
        err = np.abs(y - ref(x))
        bound = 1e-6 * np.abs(ref(x)) + 2.0**-22 * np.abs(x)
        assert np.all(err <= bound), (op, float(np.max(err / bound)))


ERF_CONSTS = {"sqrt2": SQRT2, "one": 1.0, "half": 0.5}
TANH_CONSTS = {"kappa": 0.044715, "beta": K, "pow": 3.0}
WRONG = {"sqrt2": 1.5, "one": 1.01, "half": 0.6, "kappa": 0.045, "beta": 0.79, "pow": 2.0}


@pytest.mark.parametrize("bad", sorted(WRONG))
def test_wrong_constants_are_not_fused(bad):
    c = {**ERF_CONSTS, **TANH_CONSTS, bad: WRONG[bad]}
    g = G()
    x = g.input("x", [2, 8])
    if bad in ERF_CONSTS:
        a = g.op("Add", g.op("Erf", g.op("Div", x, g.const(c["sqrt2"]))), g.const(c["one"]))
        y, kept = g.op("Mul", g.op("Mul", x, a), g.const(c["half"])), "Erf"
    else:
        p = g.op("Pow", x, g.const(c["pow"]))
        inner = g.op("Mul", g.op("Add", x, g.op("Mul", p, g.const(c["kappa"]))), g.const(c["beta"]))
        t = g.op("Tanh", inner)
        y = g.op("Mul", g.op("Mul", x, g.const(0.5)), g.op("Add", t, g.const(1.0)))
        kept = "Tanh"
    fused, plain = sessions(g.model([y]), [CPU])
    ops = op_types(fused)
    assert kept in ops and "Gelu" not in ops and "FastGelu" not in ops, ops
    xv = _x((2, 8))
    np.testing.assert_allclose(fused.run(None, {"x": xv})[0], plain.run(None, {"x": xv})[0])


@pytest.mark.parametrize("shape,fused_op", [([2, 8], "Gelu"), (None, "Erf")])
def test_rank1_constants_need_a_known_rank(shape, fused_op):
    """A constant of shape (1,) broadcasts an input of rank 0 to rank 1: the pattern is only
    elementwise when the input's rank is known to be at least 1."""
    g = G()
    x = g.input("x", shape)
    d = g.op("Div", x, g.const([SQRT2]))
    a = g.op("Add", g.op("Erf", d), g.const([1.0]))
    y = g.op("Mul", g.op("Mul", x, a), g.const([0.5]))
    fused, _ = sessions(g.model([y]), [CPU])
    assert fused_op in op_types(fused) and ("Gelu" in op_types(fused)) == (fused_op == "Gelu")


@pytest.mark.parametrize("where", ["erf_output_read", "div_output_read", "add_is_output"])
def test_intermediates_read_elsewhere_are_not_fused(where):
    g = G()
    x = g.input("x", [2, 8])
    d = g.op("Div", x, g.const(SQRT2))
    e = g.op("Erf", d)
    a = g.op("Add", e, g.const(1.0))
    y = g.op("Mul", g.op("Mul", x, a), g.const(0.5))
    extra = {
        "erf_output_read": lambda: g.op("Neg", e),
        "div_output_read": lambda: g.op("Abs", d),
        "add_is_output": lambda: a,
    }[where]()
    model = g.model([y, extra])
    fused, plain = sessions(model, [CPU])
    assert "Gelu" not in op_types(fused) and "Erf" in op_types(fused)
    xv = _x((2, 8))
    for u, v in zip(fused.run(None, {"x": xv}), plain.run(None, {"x": xv})):
        np.testing.assert_allclose(u, v)


def test_basic_level_does_not_fuse():
    g = G()
    x = g.input("x", [2, 8])
    model = g.model([gelu_torch(g, x)])
    s = ox.InferenceSession(
        model, _options(ox.GraphOptimizationLevel.ORT_ENABLE_BASIC), providers=[CPU]
    )
    assert "Gelu" not in op_types(s) and "Erf" in op_types(s)
    s = ox.InferenceSession(
        model, _options(ox.GraphOptimizationLevel.ORT_ENABLE_EXTENDED), providers=[CPU]
    )
    assert op_types(s) == ["Gelu"]


@pytest.mark.parametrize("case", ["test_gelu_default_1_expanded", "test_gelu_tanh_2_expanded"])
def test_onnx_gelu_function_body_is_fused(case, providers):
    """ONNX's Gelu-20 function body (the node suite's expanded cases: CastLike constants, Sum)
    is fused, and still matches ONNX's expected outputs."""
    from onnxplug.tools.conformance import collect_cases, run_suite

    (c,) = collect_cases(f"^{case}$")
    s = ox.InferenceSession(c.model.SerializeToString(), providers=providers)
    assert op_types(s) == ["Gelu" if "default" in case else "FastGelu"]
    (r,) = run_suite(providers, pattern=f"^{case}$")
    assert r.status == "pass", r.message


def test_fusions_leave_a_providers_nodes_alone():
    """With a provider first that runs MatMul/Add but not MatMulBias, nothing is fused (its
    nodes would otherwise move to the CPU); with one that has MatMulBias, or none, it is."""
    from onnxplug.ep import KernelRegistry

    plain, fused_reg, other = KernelRegistry("a"), KernelRegistry("b"), KernelRegistry("c")
    plain.kernel("MatMul")(object)
    fused_reg.kernel("MatMul")(object)
    fused_reg.kernel("MatMulBias", domain="ai.onnxplug")(object)
    other.kernel("Conv")(object)
    cpu = KernelRegistry("cpu")
    cpu.kernel("MatMulBias", domain="ai.onnxplug")(object)
    g = G()
    x = g.input("x", [3, 4])
    h = g.op("Add", g.op("MatMul", x, g.const(RNG.standard_normal((4, 5)))), g.const(np.ones(5)))
    model = g.model([h])
    for regs, expect in (
        ([plain, cpu], 0),
        ([fused_reg, cpu], 1),
        ([other, cpu], 1),
        (None, 1),
    ):
        graph = graph_from_model(onnx.load_from_string(model))
        assert fuse_transformer(graph, regs)["MatMulBias"] == expect, regs


# ---------------------------------------------------------------------------------------------
# BiasGelu / FastGelu with bias


@pytest.mark.parametrize("form", ["erf", "tanh", "onnx_gelu", "onnx_gelu_tanh"])
def test_bias_gelu(form, providers):
    """Add(x, 1-D bias) + Gelu. The MatMul's weight is an input here, so MatMulBias does not
    apply and the bias is fused into the Gelu."""
    g = G()
    x = g.input("x", [2, 5, 8])
    w = g.input("w", [8, 12])
    b = g.const(RNG.standard_normal(12))
    h = g.op("Add", g.op("MatMul", x, w), b)
    if form == "erf":
        y, op, opset = gelu_torch(g, h), "BiasGelu", 17
    elif form == "tanh":
        y, op, opset = gelu_new(g, h), "FastGelu", 17
    else:
        approx = "none" if form == "onnx_gelu" else "tanh"
        y, opset = g.op("Gelu", h, approximate=approx), 20
        op = "BiasGelu" if form == "onnx_gelu" else "FastGelu"
    feeds = {"x": _x((2, 5, 8)), "w": _x((8, 12), scale=0.3)}
    check(g.model([y], opset), feeds, ["MatMul", op], providers)


def test_bias_gelu_bias_must_be_a_vector():
    g = G()
    x = g.input("x", [2, 8])
    h = g.op("Add", x, g.const(RNG.standard_normal((1, 8))))  # 2-D: not a bias
    fused, _ = sessions(g.model([gelu_torch(g, h)]), [CPU])
    assert sorted(op_types(fused)) == ["Add", "Gelu"]


# ---------------------------------------------------------------------------------------------
# SkipLayerNormalization


def layer_norm(g: G, s: str, hidden: int, beta: bool = True, **attrs) -> str:
    ins = [s, g.const(RNG.uniform(0.5, 1.5, hidden))]
    if beta:
        ins.append(g.const(RNG.standard_normal(hidden)))
    return g.op("LayerNormalization", *ins, epsilon=1e-12, **attrs)


@pytest.mark.parametrize("variant", ["plain", "no_beta", "skip_first", "broadcast_skip"])
def test_skip_layer_norm(variant, providers):
    g = G()
    x = g.input("x", [2, 6, 32])
    skip = g.input("skip", [6, 32] if variant == "broadcast_skip" else [2, 6, 32])
    s = g.op("Add", skip, x) if variant == "skip_first" else g.op("Add", x, skip)
    y = layer_norm(g, s, 32, beta=variant != "no_beta")
    feeds = {
        "x": _x((2, 6, 32)),
        "skip": _x((6, 32) if variant == "broadcast_skip" else (2, 6, 32)),
    }
    check(g.model([y]), feeds, ["SkipLayerNormalization"], providers)


def test_skip_layer_norm_absorbs_bias_and_keeps_the_sum(providers):
    """BERT's dense + bias + residual + LayerNorm (the bias Add is absorbed), and GPT-2's
    pre-LN residual whose sum is read again (input_skip_bias_sum)."""
    g = G()
    x = g.input("x", [2, 6, 32])
    w = g.input("w", [32, 32])
    h = g.op("Add", g.op("MatMul", x, w), g.const(RNG.standard_normal(32)))
    s = g.op("Add", h, x)
    y = layer_norm(g, s, 32)
    again = g.op("Add", s, y)  # the residual sum read after the LayerNorm
    feeds = {"x": _x((2, 6, 32)), "w": _x((32, 32), scale=0.2)}
    check(g.model([again, s]), feeds, ["MatMul", "SkipLayerNormalization", "Add"], providers)


@pytest.mark.parametrize("bad", ["axis", "mean_output", "gamma_shape", "stash_type"])
def test_skip_layer_norm_not_fused(bad):
    g = G()
    x = g.input("x", [2, 6, 8])
    s = g.op("Add", x, g.input("skip", [2, 6, 8]))
    if bad == "axis":
        y = g.op("LayerNormalization", s, g.const(RNG.standard_normal((6, 8))), axis=1)
    elif bad == "mean_output":
        y, _m, _v = g.op("LayerNormalization", s, g.const(RNG.standard_normal(8)), n_out=3)
    elif bad == "gamma_shape":
        y = g.op("LayerNormalization", s, g.const(RNG.standard_normal((1, 8))))
    else:
        y = g.op("LayerNormalization", s, g.const(RNG.standard_normal(8)), stash_type=0)
    fused, plain = sessions(g.model([y]), [CPU])
    assert "SkipLayerNormalization" not in op_types(fused)
    feeds = {"x": _x((2, 6, 8)), "skip": _x((2, 6, 8))}
    np.testing.assert_allclose(fused.run(None, feeds)[0], plain.run(None, feeds)[0])


@pytest.mark.parametrize("dtype", [np.float16, BF16])
def test_skip_layer_norm_16bit(dtype, providers):
    dt = np.dtype(dtype)
    g = G(dt)
    x = g.input("x", [3, 64])
    s = g.op("Add", x, g.input("skip", [3, 64]))
    y = layer_norm(g, s, 64)
    fused, plain = sessions(g.model([y]), providers)
    assert providers_of(fused, "SkipLayerNormalization") == {providers[0]}
    feeds = {"x": _x((3, 64), dt), "skip": _x((3, 64), dt)}
    ulp = 2**-10 if dt == np.float16 else 2**-7
    got = fused.run(None, feeds)[0].astype(np.float64)
    want = plain.run(None, feeds)[0].astype(np.float64)
    # both round the sum to the type and normalize in float32: a few ulps of the output scale
    np.testing.assert_allclose(got, want, rtol=4 * ulp, atol=4 * ulp * np.abs(want).max())


# ---------------------------------------------------------------------------------------------
# MatMulBias


@pytest.mark.parametrize("act", ["", "Relu", "Gelu", "FastGelu", "onnx_gelu"])
def test_matmul_bias(act, providers):
    g = G()
    x = g.input("x", [2, 5, 16])
    w = g.const(RNG.standard_normal((16, 24)) * 0.3)
    b = g.const(RNG.standard_normal(24))
    h = g.op("Add", g.op("MatMul", x, w), b)
    opset = 17
    if act == "Relu":
        h = g.op("Relu", h)
    elif act == "Gelu":
        h = gelu_torch(g, h)
    elif act == "FastGelu":
        h = gelu_new(g, h)
    elif act == "onnx_gelu":
        h, opset = g.op("Gelu", h), 20
    check(g.model([h], opset), {"x": _x((2, 5, 16))}, ["MatMulBias"], providers)


def test_matmul_bias_bias_first_and_2d_activation(providers):
    g = G()
    x = g.input("x", [7, 16])
    w = g.const(RNG.standard_normal((16, 4)))
    h = g.op("Add", g.const(RNG.standard_normal(4)), g.op("MatMul", x, w))
    check(g.model([h]), {"x": _x((7, 16))}, ["MatMulBias"], providers)


@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_gemm_reshape_activation(trans_b, bias, providers):
    """GPT-2's Conv1D (Gemm on the 2-D view, viewed back) + gelu_new -> MatMulBias with the
    FastGelu activation, then the Reshape; a Linear exported as Gemm(transB=1) + Relu too;
    with or without C (an exporter drops an all-zero bias)."""
    g = G()
    x = g.input("x", [2, 5, 16])
    flat = g.op("Reshape", x, g.const(np.array([-1, 16]), dtype=np.int64))
    w = RNG.standard_normal((16, 24)) * 0.3
    wc = g.const(w.T if trans_b else w)
    c = [g.const(RNG.standard_normal(24))] if bias else []
    h = g.op("Gemm", flat, wc, *c, transB=int(trans_b), beta=1.0 if bias else 0.5)
    if trans_b:
        h, fused = g.op("Relu", h), ["Reshape", "MatMulBias"]
    else:
        h = g.op("Reshape", h, g.const(np.array([2, 5, 24]), dtype=np.int64))
        h, fused = gelu_new(g, h), ["Reshape", "MatMulBias", "Reshape"]
    sess, _ = check(g.model([h]), {"x": _x((2, 5, 16))}, fused, providers)
    graph = sess._graph
    (mm,) = [n for n in graph.nodes if n.op_type == "MatMulBias"]
    assert mm.attrs["activation"] == ("Relu" if trans_b else "FastGelu")
    assert graph.initializers[mm.inputs[1]].shape == (16, 24)
    assert len(mm.inputs) == (3 if bias else 2)


def test_matmul_bias_reshape_activation(providers):
    """addmm exported as MatMul + Add on the 2-D view, viewed back, then gelu_new."""
    g = G()
    x = g.input("x", [10, 16])
    h = g.op("Add", g.op("MatMul", x, g.const(RNG.standard_normal((16, 24)) * 0.3)),
             g.const(RNG.standard_normal(24)))  # fmt: skip
    h = gelu_new(g, g.op("Reshape", h, g.const(np.array([2, 5, 24]), dtype=np.int64)))
    sess, _ = check(g.model([h]), {"x": _x((10, 16))}, ["MatMulBias", "Reshape"], providers)
    (mm,) = [n for n in sess._graph.nodes if n.op_type == "MatMulBias"]
    assert mm.attrs["activation"] == "FastGelu"


@pytest.mark.parametrize(
    "bad", ["alpha", "bias_2d", "trans_a", "shared_weight", "reshape_read", "no_activation"]
)
def test_gemm_activation_not_fused(bad):
    g = G()
    x = g.input("x", [10, 16] if bad != "trans_a" else [16, 10])
    w = g.const(RNG.standard_normal((24, 16) if bad == "shared_weight" else (16, 24)))
    bias = RNG.standard_normal((1, 24) if bad == "bias_2d" else 24)
    attrs = {"alpha": 0.5} if bad == "alpha" else {}
    attrs = {"transA": 1} if bad == "trans_a" else attrs
    attrs = {"transB": 1} if bad == "shared_weight" else attrs
    h = g.op("Gemm", x, w, g.const(bias), **attrs)
    outs = []
    if bad == "shared_weight":  # W read by another node: it cannot be stored transposed
        outs.append(g.op("MatMul", g.input("z", [3, 24]), w))
    r = g.op("Reshape", h, g.const(np.array([2, 5, 24]), dtype=np.int64))
    if bad == "reshape_read":
        outs.append(r)
    outs.insert(0, r if bad == "no_activation" else g.op("Relu", r))
    fused, plain = sessions(g.model(outs), [CPU])
    assert "MatMulBias" not in op_types(fused) and "Gemm" in op_types(fused)
    feeds = {"x": _x((10, 16) if bad != "trans_a" else (16, 10))}
    if bad == "shared_weight":
        feeds["z"] = _x((3, 24))
    for u, v in zip(fused.run(None, feeds), plain.run(None, feeds)):
        np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bad", ["bias_2d", "bias_length", "matmul_read", "weight_input"])
def test_matmul_bias_not_fused(bad):
    g = G()
    x = g.input("x", [2, 3, 8])
    w = g.input("w", [8, 4]) if bad == "weight_input" else g.const(RNG.standard_normal((8, 4)))
    m = g.op("MatMul", x, w)
    bias = {
        "bias_2d": RNG.standard_normal((1, 4)),
        "bias_length": RNG.standard_normal(1),
    }.get(bad, RNG.standard_normal(4))
    y = g.op("Add", m, g.const(bias))
    outs = [y, m] if bad == "matmul_read" else [y]
    fused, plain = sessions(g.model(outs), [CPU])
    assert "MatMulBias" not in op_types(fused)
    feeds = {"x": _x((2, 3, 8))}
    if bad == "weight_input":
        feeds["w"] = _x((8, 4))
    for u, v in zip(fused.run(None, feeds), plain.run(None, feeds)):
        np.testing.assert_allclose(u, v)


# ---------------------------------------------------------------------------------------------
# Whole layers


def linear(g: G, v: str, n_in: int, n_out: int) -> str:
    """nn.Linear on a 3-D activation: MatMul by the (constant-folded) transposed weight + Add."""
    w = g.const(RNG.standard_normal((n_in, n_out)) / math.sqrt(n_in))
    return g.op("Add", g.op("MatMul", v, w), g.const(RNG.standard_normal(n_out) * 0.1))


def attention(g: G, q: str, k: str, v: str, mask: str, shape: list[int], heads: int) -> str:
    """Heads split, softmax(Q K^T / sqrt(d) + mask) V, heads merged (left unfused)."""
    b, s, hidden = shape
    d = hidden // heads
    split = g.const(np.array([b, s, heads, d]), dtype=np.int64)
    q, k, v = (g.op("Transpose", g.op("Reshape", t, split), perm=[0, 2, 1, 3]) for t in (q, k, v))
    scores = g.op("MatMul", q, g.op("Transpose", k, perm=[0, 1, 3, 2]))
    scores = g.op("Add", g.op("Div", scores, g.const(math.sqrt(d))), mask)
    ctx = g.op("MatMul", g.op("Softmax", scores, axis=-1), v)
    merged = g.const(np.array(shape), dtype=np.int64)
    return g.op("Reshape", g.op("Transpose", ctx, perm=[0, 2, 1, 3]), merged)


def bert_layer(g: G, x: str, mask: str, shape: list[int], heads: int, ffn: int) -> str:
    """One BERT encoder layer as torch exports it (eval mode: no Dropout; post-LN)."""
    hidden = shape[-1]
    q, k, v = (linear(g, x, hidden, hidden) for _ in range(3))
    ctx = attention(g, q, k, v, mask, shape, heads)
    h1 = layer_norm(g, g.op("Add", linear(g, ctx, hidden, hidden), x), hidden)
    inter = gelu_torch(g, linear(g, h1, hidden, ffn))
    return layer_norm(g, g.op("Add", linear(g, inter, ffn, hidden), h1), hidden)


def bert_model(layers: int = 2, shape=(2, 8, 32), heads: int = 4, ffn: int = 64) -> bytes:
    g = G()
    shape = list(shape)
    words, positions = g.input("words", shape), g.input("positions", shape)
    mask = g.input("mask", [shape[0], 1, 1, shape[1]])
    h = layer_norm(g, g.op("Add", words, positions), shape[-1])  # embeddings
    for _ in range(layers):
        h = bert_layer(g, h, mask, shape, heads, ffn)
    return g.model([h])


def conv1d(g: G, v: str, shape: list[int], n_out: int) -> str:
    """transformers' GPT-2 Conv1D: addmm on the 2-D view (Gemm), then viewed back."""
    n_in = shape[-1]
    flat = g.op("Reshape", v, g.const(np.array([-1, n_in]), dtype=np.int64))
    w = g.const(RNG.standard_normal((n_in, n_out)) / math.sqrt(n_in))
    out = g.op("Gemm", flat, w, g.const(RNG.standard_normal(n_out) * 0.1))
    return g.op("Reshape", out, g.const(np.array([*shape[:-1], n_out]), dtype=np.int64))


def gpt2_block(g: G, x: str, mask: str, shape: list[int], heads: int) -> str:
    """One GPT-2 block: pre-LN residuals (the sums are read twice), Gemm linears, gelu_new."""
    hidden = shape[-1]
    qkv = conv1d(g, layer_norm(g, x, hidden), shape, 3 * hidden)
    sizes = g.const(np.array([hidden] * 3), dtype=np.int64)
    q, k, v = g.op("Split", qkv, sizes, axis=2, n_out=3)
    r1 = g.op("Add", conv1d(g, attention(g, q, k, v, mask, shape, heads), shape, hidden), x)
    inner = gelu_new(g, conv1d(g, layer_norm(g, r1, hidden), shape, 4 * hidden))
    return g.op("Add", conv1d(g, inner, [*shape[:-1], 4 * hidden], hidden), r1)


def gpt2_model(layers: int = 2, shape=(2, 8, 32), heads: int = 4) -> bytes:
    g = G()
    shape = list(shape)
    tokens, positions = g.input("tokens", shape), g.input("positions", shape)
    mask = g.input("mask", [1, 1, shape[1], shape[1]])
    h = g.op("Add", tokens, positions)
    for _ in range(layers):
        h = gpt2_block(g, h, mask, shape, heads)
    return g.model([layer_norm(g, h, shape[-1])])  # ln_f


def _feeds(model: bytes) -> dict[str, np.ndarray]:
    m = onnx.load_from_string(model)
    out = {}
    for vi in m.graph.input:
        shape = [d.dim_value for d in vi.type.tensor_type.shape.dim]
        if vi.name == "mask":
            causal = shape[-1] == shape[-2]
            out[vi.name] = (
                np.triu(np.full(shape, -1e4, np.float32), 1)
                if causal
                else np.where(RNG.random(shape) < 0.2, -1e4, 0).astype(np.float32)
            )
        else:
            out[vi.name] = _x(shape, scale=1.0)
    return out


def _count(model: bytes) -> tuple[int, dict[str, int]]:
    """Nodes before the transformer fusions, and op counts after them (graph level)."""
    graph = graph_from_model(onnx.load_from_string(model))
    optimize(graph, 1)
    before = len(graph.nodes)
    fuse_transformer(graph)
    after: dict[str, int] = {}
    for n in graph.nodes:
        after[n.op_type] = after.get(n.op_type, 0) + 1
    return before, after


def _check_model(model: bytes, providers: list[str], fused_ops: list[str]) -> None:
    """The fused session on ``providers`` runs ``fused_ops`` on the first provider and matches
    the unfused CPU session."""
    fused, plain = sessions(model, providers)
    for op in fused_ops:
        assert providers_of(fused, op) == {providers[0]}, op
    feeds = _feeds(model)
    got, want = fused.run(None, feeds)[0], plain.run(None, feeds)[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_bert_like_model(providers):
    """2 layers: the self-attention (Q/K/V MatMulBias, heads, scores, mask, softmax, context)
    is one Attention, the FFN's first Linear a MatMulBias with the Gelu, the output denses keep
    their MatMul with the bias absorbed into SkipLayerNormalization."""
    model = bert_model()
    before, after = _count(model)
    assert after["Attention"] == 2 and after["MatMulBias"] == 2
    assert after["SkipLayerNormalization"] == 1 + 2 * 2
    assert not {"Erf", "LayerNormalization", "Softmax", "Transpose"} & set(after)
    assert (before, sum(after.values())) == (2 + 2 * 35, 1 + 2 * 6)
    _check_model(model, providers, ["Attention", "MatMulBias", "SkipLayerNormalization"])


def test_gpt2_like_model(providers):
    """2 blocks: every residual Add + LayerNorm is a SkipLayerNormalization (the sums that are
    read again are its input_skip_bias_sum output), gelu_new a FastGelu."""
    model = gpt2_model()
    before, after = _count(model)
    assert after["SkipLayerNormalization"] == 2 * 2 + 1
    assert after["Attention"] == 2  # c_attn's GEMM, its Split and the attention
    # c_fc's Gemm, its Reshape and gelu_new: one MatMulBias with the FastGelu epilogue
    assert after["MatMulBias"] == 2 and "FastGelu" not in after
    assert not {"Tanh", "Pow", "LayerNormalization", "Softmax", "Transpose"} & set(after)
    assert (before, sum(after.values())) == (2 + 2 * 39, 1 + 2 * 12)
    _check_model(model, providers, ["Attention", "MatMulBias", "SkipLayerNormalization"])


# ---------------------------------------------------------------------------------------------
# The fused ops' CUDA kernels (host simulation) against the CPU kernels, per float type

# name: (op, domain, input shapes ("" skips an optional input), outputs, attributes)
CONTRIB_CASES = {
    "gelu": ("Gelu", MS, {"x": (2, 3, 16)}, ["y"], {}),
    "bias_gelu": ("BiasGelu", MS, {"x": (2, 3, 16), "b": (16,)}, ["y"], {}),
    "fast_gelu": ("FastGelu", MS, {"x": (2, 3, 16)}, ["y"], {}),
    "fast_gelu_bias": ("FastGelu", MS, {"x": (2, 3, 16), "b": (16,)}, ["y"], {}),
    "quick_gelu": ("QuickGelu", MS, {"x": (2, 3, 16)}, ["y"], {}),
    "quick_gelu_alpha": ("QuickGelu", MS, {"x": (4, 16)}, ["y"], {"alpha": -0.75}),
    "bias_softmax": ("BiasSoftmax", MS, {"x": (2, 3, 4, 5), "b": (2, 1, 4, 5)}, ["y"], {}),
    "bias_softmax_last": (
        "BiasSoftmax",
        MS,
        {"x": (2, 3, 4, 8), "b": (4, 8)},
        ["y"],
        {"axis": -1},
    ),
    "bias_softmax_axis2": ("BiasSoftmax", MS, {"x": (2, 3, 4, 5), "b": (5,)}, ["y"], {"axis": 2}),
    "skip_ln": (
        "SkipLayerNormalization",
        MS,
        {"x": (2, 5, 16), "skip": (5, 16), "gamma": (16,), "beta": (16,), "bias": (16,)},
        ["y", "mean", "inv", "sum"],
        {"epsilon": 1e-5},
    ),
    "skip_ln_dense_broadcast": (
        "SkipLayerNormalization",
        MS,
        {"x": (2, 5, 16), "skip": (2, 1, 16), "gamma": (16,), "": (), "bias": (16,)},
        ["y", "", "", "sum"],
        {},
    ),
    **{
        f"matmul_bias_{act or 'none'}": (
            "MatMulBias",
            PLUG,
            {"a": (2, 3, 16), "w": (16, 8), "bias": (8,)},
            ["y"],
            {"activation": act} if act else {},
        )
        for act in ("", "Relu", "Gelu", "FastGelu")
    },
}


@pytest.mark.parametrize(
    "dtype", [np.float32, np.float16, BF16, np.float64], ids=lambda d: np.dtype(d).name
)
@pytest.mark.parametrize("case", sorted(CONTRIB_CASES))
def test_contrib_kernels_on_sim_match_cpu(case, dtype, sim):
    """Each fused op, one node, on [CUDASim, CPU] against CPU alone: the simulation runs the
    CUDA kernels' host code, numpy twins and GEMM engine path for every claimed float type.
    Results rounded once from float32 (float64): one ulp of the type apart at most."""
    op, domain, shapes, outputs, attrs = CONTRIB_CASES[case]
    dt = np.dtype(dtype)
    feeds = {k: _x(v, dt, scale=1.0) for k, v in shapes.items() if k}
    node = helper.make_node(op, list(shapes), outputs, name="n", domain=domain, **attrs)
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info(k, _ELEM[dt], list(v.shape)) for k, v in feeds.items()],
        [helper.make_empty_tensor_value_info(o) for o in outputs if o],
    )
    imports = [helper.make_opsetid("", 17), helper.make_opsetid(domain, 1)]
    model = helper.make_model(graph, opset_imports=imports).SerializeToString()
    on_sim = ox.InferenceSession(model, providers=[SIM, CPU])
    on_cpu = ox.InferenceSession(model, providers=[CPU])
    claimed = not (op == "FastGelu" and dt == np.float64)  # FastGelu has no float64
    assert providers_of(on_sim, op) == {SIM if claimed else CPU}
    ulp = {np.dtype(np.float16): 2**-10, BF16: 2**-7}.get(dt, 1e-5)
    # the recording run, the run that binds the prepared calls, a run through them (new values)
    other = {
        k: np.ascontiguousarray(v.reshape(-1)[::-1].reshape(v.shape)) for k, v in feeds.items()
    }
    for run_feeds in (feeds, other, feeds, other):
        for name, got, want in zip(
            [o for o in outputs if o], on_sim.run(None, run_feeds), on_cpu.run(None, run_feeds)
        ):
            assert got.dtype == want.dtype and got.shape == want.shape, name
            scale = max(1.0, float(np.abs(want.astype(np.float64)).max()))
            np.testing.assert_allclose(
                got.astype(np.float64), want.astype(np.float64), rtol=2 * ulp, atol=ulp * scale
            )


# name: (segments, mask, position ids: None | "seq" | "batch", outputs)
EMBED_CASES = {
    "bert": (True, True, None, ["y", "mask_index", "sum"]),
    "no_segment": (False, True, None, ["y", "mask_index"]),
    "no_mask_pos_ids": (True, False, "seq", ["y", "mask_index", "sum"]),
    "batched_pos_ids": (False, False, "batch", ["y", "", "sum"]),
    "output_only": (True, True, "seq", ["y"]),
}


def embed_model(dtype, segments: bool, mask: bool, pos: str | None, outputs) -> tuple:
    """One EmbedLayerNormalization node "n" (batch 2, sequence 5, hidden 16) and its feeds;
    the tables and gamma/beta are graph inputs too."""
    batch, seq, hidden, vocab = 2, 5, 16, 11
    dt = np.dtype(dtype)
    feeds: dict[str, np.ndarray | None] = {
        "ids": RNG.integers(0, vocab, (batch, seq)).astype(np.int32),
        "seg_ids": RNG.integers(0, 2, (batch, seq)).astype(np.int32) if segments else None,
        "word": _x((vocab, hidden), dt, 1.0),
        "pos": _x((seq + 3, hidden), dt, 1.0),
        "seg": _x((2, hidden), dt, 1.0) if segments else None,
        "gamma": (RNG.random(hidden) + 0.5).astype(dt),
        "beta": _x((hidden,), dt, 1.0),
        "mask": (RNG.random((batch, seq)) > 0.3).astype(np.int32) if mask else None,
        "pos_ids": None,
    }
    if pos == "seq":
        feeds["pos_ids"] = RNG.permutation(seq + 3)[:seq].astype(np.int32)
    elif pos == "batch":
        feeds["pos_ids"] = RNG.integers(0, seq + 3, (batch, seq)).astype(np.int32)
    return one_node_model("EmbedLayerNormalization", feeds, outputs, epsilon=1e-5)


def one_node_model(op: str, feeds: dict, outputs: list[str], **attrs) -> tuple[bytes, dict]:
    """A com.microsoft node "n" whose inputs are ``feeds`` in order (None: an absent optional
    input), each a graph input; returns the model and the feeds that are present."""
    names = [k if v is not None else "" for k, v in feeds.items()]
    while not names[-1]:
        names.pop()
    node = helper.make_node(op, names, outputs, name="n", domain=MS, **attrs)
    present = {k: v for k, v in feeds.items() if v is not None}
    inputs = [
        helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), list(v.shape))
        for k, v in present.items()
    ]
    graph = helper.make_graph(
        [node], "g", inputs, [helper.make_empty_tensor_value_info(o) for o in outputs if o]
    )
    imports = [helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)]
    return helper.make_model(graph, opset_imports=imports).SerializeToString(), present


@pytest.mark.parametrize(
    "dtype", [np.float32, np.float16, BF16, np.float64], ids=lambda d: np.dtype(d).name
)
@pytest.mark.parametrize("case", sorted(EMBED_CASES))
def test_embed_layer_norm_on_sim_matches_cpu(case, dtype, sim):
    """The CUDA kernel's host code, twins and launches (recording, binding and prepared runs,
    with new ids) against the CPU kernel: the sums exactly, the normalized output within one
    ulp of the type (float32: the statistics' summation order), mask_index exactly."""
    model, feeds = embed_model(dtype, *EMBED_CASES[case])
    outputs = [o for o in EMBED_CASES[case][3] if o]
    on_sim = ox.InferenceSession(model, providers=[SIM, CPU])
    on_cpu = ox.InferenceSession(model, providers=[CPU])
    assert providers_of(on_sim, "EmbedLayerNormalization") == {SIM}
    dt = np.dtype(dtype)
    ulp = {np.dtype(np.float16): 2**-10, BF16: 2**-7}.get(dt, 1e-5)
    other = {**feeds, "ids": np.ascontiguousarray(feeds["ids"][:, ::-1])}
    for run_feeds in (feeds, other, feeds, other):
        got, want = on_sim.run(None, run_feeds), on_cpu.run(None, run_feeds)
        for name, g, w in zip(outputs, got, want):
            assert g.dtype == w.dtype and g.shape == w.shape, name
            if name == "y":
                np.testing.assert_allclose(
                    g.astype(np.float64), w.astype(np.float64), rtol=2 * ulp, atol=2 * ulp
                )
            else:
                np.testing.assert_array_equal(g, w)


def test_embed_layer_norm_ids_out_of_range(sim):
    """The CPU provider refuses an id out of range; the CUDA kernel (which cannot check on the
    host without a synchronisation) gives that token a NaN row and leaves the others alone."""
    model, feeds = embed_model(np.float32, True, True, None, ["y"])
    bad = {**feeds, "ids": feeds["ids"].copy()}
    bad["ids"][1, 2] = 11
    with pytest.raises(Exception, match="input_ids must be in"):
        ox.InferenceSession(model, providers=[CPU]).run(None, bad)
    got = ox.InferenceSession(model, providers=[SIM, CPU]).run(None, bad)[0]
    assert np.isnan(got[1, 2]).all()
    ok = ox.InferenceSession(model, providers=[CPU]).run(None, feeds)[0]  # other tokens alike
    keep = np.ones(got.shape[:2], bool)
    keep[1, 2] = False
    np.testing.assert_allclose(got[keep], ok[keep], rtol=1e-5, atol=1e-5)


# name: (bits, block_size, K, zero points: None | "packed" | "float", g_idx, bias)
NBITS_CASES = {
    "int4_packed_zp": (4, 32, 64, "packed", False, False),
    "int4_default_zp_bias": (4, 16, 64, None, False, True),
    "int4_partial_block": (4, 32, 72, "packed", False, True),
    "int8_float_zp": (8, 32, 64, "float", False, False),
    "int3_partial_block": (3, 16, 40, "packed", False, False),
    "int2": (2, 64, 64, None, False, True),
    "int5_act_order": (5, 16, 48, "packed", True, False),
}


def _pack_bits(values: np.ndarray, bits: int, nbytes: int) -> np.ndarray:
    """[rows, count] values as [rows, nbytes] uint8, ``bits`` bits each, low bits first."""
    planes = ((values[..., None] >> np.arange(bits)) & 1).astype(np.uint8)
    packed = np.packbits(planes.reshape(values.shape[0], -1), axis=-1, bitorder="little")
    out = np.zeros((values.shape[0], nbytes), np.uint8)
    out[:, : min(nbytes, packed.shape[1])] = packed[:, :nbytes]
    return out


def nbits_model(dtype, bits, block, k, zero_points, g_idx, bias) -> tuple:
    """One MatMulNBits node "n" (N 12, A [2, 3, K]) and its feeds, every input a graph input."""
    n, dt = 12, np.dtype(dtype)
    blocks, levels = -(-k // block), 1 << bits
    q = RNG.integers(0, levels, (n, blocks * block))
    feeds = {
        "A": _x((2, 3, k), dt, 1.0),
        "B": _pack_bits(q, bits, blocks * block * bits // 8).reshape(n, blocks, -1),
        "scales": ((RNG.random(n * blocks) + 0.5) / levels).astype(dt),
    }
    if zero_points == "packed":
        zp = RNG.integers(0, levels, (n, blocks))
        feeds["zp"] = _pack_bits(zp, bits, -(-blocks * bits // 8)).reshape(-1)
    elif zero_points == "float":
        feeds["zp"] = (RNG.integers(0, levels, n * blocks) + 0.25).astype(dt)
    if g_idx:
        feeds.setdefault("zp", None)
        feeds["g_idx"] = RNG.permutation(np.arange(k) // block).astype(np.int32)
    if bias:
        feeds.setdefault("zp", None)
        feeds.setdefault("g_idx", None)
        feeds["bias"] = _x((n,), dt, 1.0)
    attrs = {"K": k, "N": n, "bits": bits, "block_size": block}
    return one_node_model("MatMulNBits", feeds, ["y"], **attrs)


@pytest.mark.parametrize(
    "dtype", [np.float32, np.float16, BF16, np.float64], ids=lambda d: np.dtype(d).name
)
@pytest.mark.parametrize("case", sorted(NBITS_CASES))
def test_matmul_nbits_on_sim_matches_cpu(case, dtype, sim):
    """The CUDA kernel's host code and dequantization twin, and the GEMM engine's numpy path,
    against the CPU kernel. The weight is rounded to A's type before the GEMM (as onnxruntime's
    CUDA kernel does; the CPU provider keeps it in float32): float16/bfloat16 within four
    ulps of the largest output, float32 within float32 rounding."""
    model, feeds = nbits_model(dtype, *NBITS_CASES[case])
    on_sim = ox.InferenceSession(model, providers=[SIM, CPU])
    on_cpu = ox.InferenceSession(model, providers=[CPU])
    assert providers_of(on_sim, "MatMulNBits") == {SIM}
    dt = np.dtype(dtype)
    ulp = {np.dtype(np.float16): 2**-10, BF16: 2**-7, np.dtype(np.float64): 1e-12}.get(dt, 1e-6)
    other = {**feeds, "A": np.ascontiguousarray(feeds["A"][..., ::-1])}
    for run_feeds in (feeds, other, feeds, other):
        (got,), (want,) = on_sim.run(None, run_feeds), on_cpu.run(None, run_feeds)
        assert got.dtype == want.dtype and got.shape == want.shape
        w64 = want.astype(np.float64)
        scale = float(np.abs(w64).max())
        np.testing.assert_allclose(got.astype(np.float64), w64, rtol=4 * ulp, atol=4 * ulp * scale)
