"""Convolution rewrites (optimizer/conv.py) on the graphs torch.onnx and tf2onnx write.

Basic level: per-channel Add / Mul / BatchNormalization folded into the Conv. Extended level:
Conv + activation -> com.microsoft FusedConv. Level 3 and above: Conv + same-shape residual Add
[+ activation] -> FusedConv with Z. Each fused session must hold exactly the expected nodes,
match the unfused session (ORT_DISABLE_ALL) on the CPU provider and onnxruntime's own session
of the same model; on the host-simulated CUDA provider the CUDA plugin's FusedConv kernel runs
the fused nodes it takes and the others stay unfused there. Patterns whose intermediate values
are read elsewhere, or whose Add broadcasts, must not fuse.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import onnxplug as ox
from onnxplug.ep import KernelRegistry
from onnxplug.ir.graph import graph_from_model
from onnxplug.optimizer.conv import fuse_conv_activation
from onnxplug.optimizer.fusions import ProviderPolicy
from tests.test_fusions_transformer import (  # noqa: F401 (sim: a fixture)
    CPU,
    MS,
    SIM,
    G,
    op_types,
    providers_of,
    sim,
)

RNG = np.random.default_rng(11)
L = ox.GraphOptimizationLevel
ALL = [L.ORT_ENABLE_BASIC, L.ORT_ENABLE_EXTENDED, L.ORT_ENABLE_LAYOUT, L.ORT_ENABLE_ALL]


def _ort():
    try:
        import onnxruntime
    except ImportError:
        return None
    return onnxruntime


def typed(model: bytes) -> bytes:
    """The model with its outputs' types declared, as exporters write them (G leaves them
    undefined, which onnxruntime refuses)."""
    return onnx.shape_inference.infer_shapes(onnx.load_from_string(model)).SerializeToString()


def session(model: bytes, level=None, providers=(CPU,), **kwargs) -> ox.InferenceSession:
    model = typed(model)
    so = ox.SessionOptions()
    if level is not None:
        so.graph_optimization_level = level
    return ox.InferenceSession(model, so, providers=list(providers), **kwargs)


def ops(sess) -> list[str]:
    return sorted(o for o in op_types(sess) if not o.startswith("Memcpy"))


def fused_node(sess, op: str = "FusedConv"):
    (n,) = [n for n in sess._graph.nodes if n.op_type == op]
    return n


def check(
    model: bytes,
    feeds: dict,
    expect: list[str],
    level=None,
    providers=(CPU,),
    tol=1e-5,
    ort_level=None,
):
    """The session at ``level`` has exactly the ops ``expect`` (any order), runs the fused ones
    on the first provider, and matches the unfused CPU session and onnxruntime's (at
    ``ort_level``, its default when None)."""
    s = session(model, level, providers)
    assert ops(s) == sorted(expect), op_types(s)
    for op in {"FusedConv", "FusedMatMul"} & set(expect):
        assert providers_of(s, op) == {providers[0]}
    got = s.run(None, feeds)
    want = session(model, L.ORT_DISABLE_ALL).run(None, feeds)
    refs = [want]
    onnxruntime = _ort()
    if onnxruntime is not None:
        so = onnxruntime.SessionOptions()
        if ort_level is not None:
            so.graph_optimization_level = onnxruntime.GraphOptimizationLevel(int(ort_level))
        refs.append(onnxruntime.InferenceSession(typed(model), so).run(None, feeds))
    for ref in refs:
        for a, b in zip(got, ref):
            assert a.dtype == b.dtype and a.shape == b.shape
            scale = max(1.0, float(np.abs(b.astype(np.float64)).max()))
            np.testing.assert_allclose(a, b, rtol=tol, atol=tol * scale)
    return s


def weights(c_out: int, c_in: int, *kernel: int, dtype=np.float32) -> np.ndarray:
    fan_in = c_in * math.prod(kernel)
    return (RNG.standard_normal((c_out, c_in, *kernel)) * math.sqrt(2 / fan_in)).astype(dtype)


def _x(shape, dtype=np.float32) -> np.ndarray:
    return RNG.standard_normal(shape).astype(dtype)


def conv(g: G, x: str, c_in: int, c_out: int, k: int = 3, bias=True, stride=1, dims=2) -> str:
    """nn.Conv{dims}d as torch exports it: Conv(X, W[, B]) with kernel_shape, pads, strides."""
    ins = [x, g.const(weights(c_out, c_in, *[k] * dims, dtype=g.dtype))]
    if bias:
        ins.append(g.const(RNG.standard_normal(c_out) * 0.1))
    return g.op(
        "Conv", *ins, kernel_shape=[k] * dims, pads=[k // 2] * 2 * dims, strides=[stride] * dims
    )


def batch_norm(g: G, v: str, c: int) -> str:
    params = [
        RNG.uniform(0.5, 1.5, c),
        RNG.standard_normal(c) * 0.1,
        RNG.standard_normal(c) * 0.1,
        RNG.uniform(0.5, 1.5, c),
    ]
    return g.op("BatchNormalization", v, *(g.const(p) for p in params), epsilon=1e-5)


# ---------------------------------------------------------------------------------------------
# Basic level: per-channel constants folded into the Conv

C = 6
SHAPE = [2, 4, 7, 7]


@pytest.mark.parametrize("shape", [(1, C, 1, 1), (C, 1, 1)], ids=str)
@pytest.mark.parametrize("first", [False, True], ids=["conv_first", "constant_first"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_conv_add_constant_is_the_bias(shape, first, bias):
    g = G()
    c = conv(g, g.input("x", SHAPE), 4, C, bias=bias)
    k = g.const(RNG.standard_normal(shape))
    y = g.op("Add", *((k, c) if first else (c, k)))
    s = check(g.model([y]), {"x": _x(SHAPE)}, ["Conv"], L.ORT_ENABLE_BASIC)
    assert len(fused_node(s, "Conv").inputs) == 3


@pytest.mark.parametrize("shape", [(1, C, 1, 1), (C, 1, 1)], ids=str)
def test_conv_mul_constant_scales_the_weights(shape):
    g = G()
    c = conv(g, g.input("x", SHAPE), 4, C)
    y = g.op("Mul", g.const(RNG.uniform(-2, 2, shape)), c)
    check(g.model([y]), {"x": _x(SHAPE)}, ["Conv"], L.ORT_ENABLE_BASIC)


def test_tf2onnx_frozen_batch_norm_chain_folds_into_one_conv():
    """tf2onnx writes a frozen Keras BatchNormalization as Mul + Add of [C, 1, 1] constants
    (NHWC models between Transposes); ReLU6 as Clip(0, 6) with initializer bounds."""
    g = G()
    x = g.input("x", [2, 7, 7, 4])
    nchw = g.op("Transpose", x, perm=[0, 3, 1, 2])
    c = conv(g, nchw, 4, C)
    c = g.op("Mul", c, g.const(RNG.uniform(0.5, 2, (C, 1, 1))))
    c = g.op("Add", c, g.const(RNG.standard_normal((C, 1, 1))))
    c = g.op("Clip", c, g.const(0.0), g.const(6.0))
    y = g.op("Transpose", c, perm=[0, 2, 3, 1])
    model = g.model([y])
    feeds = {"x": _x([2, 7, 7, 4]) * 3}
    check(model, feeds, ["Transpose", "Conv", "Clip", "Transpose"], L.ORT_ENABLE_BASIC)
    s = check(model, feeds, ["Transpose", "FusedConv", "Transpose"])
    n = fused_node(s)
    assert n.attrs["activation"] == "Clip" and n.attrs["activation_params"] == [0.0, 6.0]


def test_batch_norm_then_add_and_mul_fold_in_turn():
    g = G()
    c = batch_norm(g, conv(g, g.input("x", SHAPE), 4, C, bias=False), C)
    c = g.op("Add", c, g.const(RNG.standard_normal((1, C, 1, 1))))
    c = g.op("Mul", c, g.const(RNG.uniform(0.5, 2, (C, 1, 1))))
    check(g.model([c]), {"x": _x(SHAPE)}, ["Conv"], L.ORT_ENABLE_BASIC)


@pytest.mark.parametrize("dims", [1, 3])
def test_other_ranks(dims):
    shape = [2, 4] + [5] * dims
    g = G()
    c = conv(g, g.input("x", shape), 4, C, dims=dims)
    c = g.op("Add", c, g.const(RNG.standard_normal((C,) + (1,) * dims)))
    check(g.model([g.op("Relu", c)]), {"x": _x(shape)}, ["FusedConv"])


def test_shared_weights_are_not_changed_for_the_other_conv():
    """Two Convs read the same W and B; only one is followed by a Mul: the other keeps them."""
    g = G()
    x = g.input("x", SHAPE)
    w, b = g.const(weights(C, 4, 3, 3)), g.const(RNG.standard_normal(C))
    c1 = g.op("Conv", x, w, b, pads=[1, 1, 1, 1])
    c2 = g.op("Conv", x, w, b, pads=[1, 1, 1, 1])
    y1 = g.op("Mul", c1, g.const(RNG.uniform(0.5, 2, (C, 1, 1))))
    y2 = g.op("Add", c2, g.const(RNG.standard_normal((C, 1, 1))))
    check(g.model([y1, y2]), {"x": _x(SHAPE)}, ["Conv", "Conv"], L.ORT_ENABLE_BASIC)


NOT_FOLDED = {
    # onnxruntime folds per-output-channel constants only
    "scalar": lambda g, c: g.op("Add", c, g.const([1.5])),
    "one_per_tensor": lambda g, c: g.op("Add", c, g.const(np.ones((1, 1, 1, 1)))),
    "full_shape": lambda g, c: g.op("Add", c, g.const(RNG.standard_normal((1, C, 7, 7)))),
    "per_row": lambda g, c: g.op("Add", c, g.const(RNG.standard_normal((1, 1, 7, 1)))),
    "higher_rank": lambda g, c: g.op("Add", c, g.const(RNG.standard_normal((1, 1, C, 1, 1)))),
    "input_addend": lambda g, c: g.op("Add", c, g.input("k", [1, C, 1, 1])),
    "conv_read_twice": lambda g, c: g.op("Sub", g.op("Add", c, g.const(np.ones((C, 1, 1)))), c),
    "self_product": lambda g, c: g.op("Mul", c, c),
}


@pytest.mark.parametrize("case", sorted(NOT_FOLDED))
def test_not_folded(case):
    g = G()
    c = conv(g, g.input("x", SHAPE), 4, C)
    y = NOT_FOLDED[case](g, c)
    feeds = {"x": _x(SHAPE)}
    if case == "input_addend":
        feeds["k"] = _x([1, C, 1, 1])
    s = session(g.model([y]), L.ORT_ENABLE_BASIC)
    assert "Conv" in op_types(s) and len(op_types(s)) >= 2, op_types(s)
    want = session(g.model([y]), L.ORT_DISABLE_ALL).run(None, feeds)[0]
    np.testing.assert_allclose(s.run(None, feeds)[0], want, rtol=1e-6)


def test_conv_output_that_is_a_graph_output_is_kept():
    g = G()
    c = conv(g, g.input("x", SHAPE), 4, C)
    y = g.op("Relu", g.op("Add", c, g.const(np.ones((C, 1, 1)))))
    s = check(g.model([y, c]), {"x": _x(SHAPE)}, ["Conv", "Add", "Relu"])
    assert s is not None


# ---------------------------------------------------------------------------------------------
# Extended level: Conv + activation -> FusedConv

ACTIVATIONS = {
    "Relu": (lambda g, c: g.op("Relu", c), []),
    "Sigmoid": (lambda g, c: g.op("Sigmoid", c), []),
    "Tanh": (lambda g, c: g.op("Tanh", c), []),
    "LeakyRelu": (lambda g, c: g.op("LeakyRelu", c, alpha=0.2), [0.2]),
    "LeakyRelu_default": (lambda g, c: g.op("LeakyRelu", c), [0.01]),
    "HardSigmoid": (lambda g, c: g.op("HardSigmoid", c, alpha=0.3, beta=0.4), [0.3, 0.4]),
    "HardSigmoid_default": (lambda g, c: g.op("HardSigmoid", c), [0.2, 0.5]),
    "Clip_relu6": (lambda g, c: g.op("Clip", c, g.const(0.0), g.const(6.0)), [0.0, 6.0]),
    "Clip_max_only": (lambda g, c: g.op("Clip", c, "", g.const(1.0)), [-math.inf, 1.0]),
    "Clip_min_only": (lambda g, c: g.op("Clip", c, g.const(-1.0)), [-1.0, math.inf]),
}


def _params(n) -> list[float]:
    return [float(np.float32(v)) for v in n.attrs.get("activation_params", [])]


@pytest.mark.parametrize("act", sorted(ACTIVATIONS))
def test_conv_activation(act):
    build, params = ACTIVATIONS[act]
    g = G()
    y = build(g, conv(g, g.input("x", SHAPE), 4, C))
    model = g.model([y])
    feeds = {"x": _x(SHAPE) * 2}
    s = check(model, feeds, ["FusedConv"], L.ORT_ENABLE_EXTENDED)
    n = fused_node(s)
    assert n.domain == MS and n.attrs["activation"] == act.split("_")[0]
    assert _params(n) == [float(np.float32(p)) for p in params]
    check(model, feeds, ["Conv", act.split("_")[0]], L.ORT_ENABLE_BASIC)


def test_clip_opset_6_attributes():
    g = G()
    y = g.op("Clip", conv(g, g.input("x", SHAPE), 4, C), min=-0.5, max=0.5)
    s = session(g.model([y], opset=6), L.ORT_ENABLE_EXTENDED)
    assert _params(fused_node(s)) == [-0.5, 0.5]
    x = _x(SHAPE)
    want = session(g.model([y], opset=6), L.ORT_DISABLE_ALL).run(None, {"x": x})[0]
    np.testing.assert_allclose(s.run(None, {"x": x})[0], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [np.float16, np.float64], ids=lambda d: np.dtype(d).name)
def test_conv_activation_other_float_types(dtype):
    g = G(dtype)
    y = g.op("Relu", conv(g, g.input("x", SHAPE), 4, C))
    model = g.model([y])
    s = session(model)
    assert ops(s) == ["FusedConv"]
    x = _x(SHAPE, dtype)
    got = s.run(None, {"x": x})[0]
    want = session(model, L.ORT_DISABLE_ALL).run(None, {"x": x})[0]
    assert got.dtype == np.dtype(dtype)
    tol = 2e-3 if dtype == np.float16 else 1e-12
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


NOT_FUSED = {
    # SiLU and hard-swish read the Conv's output twice
    "silu": lambda g, c: g.op("Mul", c, g.op("Sigmoid", c)),
    "hard_swish": lambda g, c: g.op("Mul", c, g.op("HardSigmoid", c, alpha=1 / 6, beta=0.5)),
    "elu": lambda g, c: g.op("Elu", c),
    "clip_input_bound": lambda g, c: g.op("Clip", c, g.input("lo", []), g.const(6.0)),
    "relu_of_a_sum": lambda g, c: g.op("Relu", g.op("Add", c, g.input("k", [1]))),
}


@pytest.mark.parametrize("case", sorted(NOT_FUSED))
def test_conv_activation_not_fused(case):
    g = G()
    y = NOT_FUSED[case](g, conv(g, g.input("x", SHAPE), 4, C))
    feeds = {"x": _x(SHAPE), "lo": np.array(-1, np.float32), "k": _x([1])}
    names = {i.name for i in onnx.load_from_string(g.model([y])).graph.input}
    s = check(g.model([y]), {k: v for k, v in feeds.items() if k in names}, _expected(g, y))
    assert "FusedConv" not in op_types(s)


def _expected(g: G, y: str) -> list[str]:
    return sorted(n.op_type for n in g.nodes)


def test_conv_output_read_by_a_graph_output_is_not_fused():
    g = G()
    c = conv(g, g.input("x", SHAPE), 4, C)
    s = check(g.model([g.op("Relu", c), c]), {"x": _x(SHAPE)}, ["Conv", "Relu"])
    assert s is not None


# ---------------------------------------------------------------------------------------------
# Level 3 and above: Conv + residual Add [+ activation] -> FusedConv(X, W, B, Z)


def residual_block(g: G, x: str, c: int, act: str | None = "Relu", bias=True) -> str:
    """A ResNet basic block as torch exports it: conv-relu-conv, + identity, relu."""
    h = g.op("Relu", conv(g, x, c, c))
    s = g.op("Add", conv(g, h, c, c, bias=bias), x)
    return g.op(act, s) if act else s


@pytest.mark.parametrize("level", ALL, ids=lambda v: v.name)
def test_residual_block_levels(level):
    g = G()
    y = residual_block(g, g.input("x", [2, C, 6, 6]), C)
    expect = {
        L.ORT_ENABLE_BASIC: ["Conv", "Relu", "Conv", "Add", "Relu"],
        L.ORT_ENABLE_EXTENDED: ["FusedConv", "Conv", "Add", "Relu"],
    }.get(level, ["FusedConv", "FusedConv"])
    s = check(g.model([y]), {"x": _x([2, C, 6, 6])}, expect, level)
    if level >= L.ORT_ENABLE_LAYOUT:
        with_z = [n for n in s._graph.nodes if len(n.inputs) == 4]
        assert len(with_z) == 1 and with_z[0].attrs["activation"] == "Relu"


@pytest.mark.parametrize("act", ["Relu", "Sigmoid", "LeakyRelu", None])
def test_residual_activations(act):
    g = G()
    x = g.input("x", [2, C, 6, 6])
    s = g.op("Add", x, conv(g, x, C, C))  # the Conv second: Z is the first operand
    y = g.op(act, s) if act else s
    sess = check(g.model([y]), {"x": _x([2, C, 6, 6])}, ["FusedConv"])
    n = fused_node(sess)
    assert n.inputs[3] == "x" and n.attrs.get("activation") == act


def test_residual_without_conv_bias():
    """onnxruntime fuses only Convs with a bias here; FusedConv does not need one (B stays
    empty)."""
    g = G()
    y = residual_block(g, g.input("x", [2, C, 6, 6]), C, bias=False)
    s = check(g.model([y]), {"x": _x([2, C, 6, 6])}, ["FusedConv", "FusedConv"])
    assert any(n.inputs[2] == "" and len(n.inputs) == 4 for n in s._graph.nodes)


def test_downsample_block_keeps_the_projection_conv_as_z():
    """torchvision's first bottleneck block: out += downsample(x): both Add operands are
    Convs; the first one's Conv is fused, the projection is its Z."""
    g = G()
    x = g.input("x", [2, 4, 8, 8])
    main = conv(g, g.op("Relu", conv(g, x, 4, C, k=1)), C, 8, stride=2)
    proj = conv(g, x, 4, 8, k=1, stride=2)
    y = g.op("Relu", g.op("Add", main, proj))
    s = check(g.model([y]), {"x": _x([2, 4, 8, 8])}, ["FusedConv", "FusedConv", "Conv"])
    (n,) = [n for n in s._graph.nodes if len(n.inputs) == 4]
    plain = next(m for m in s._graph.nodes if m.op_type == "Conv")
    assert n.inputs[3] == plain.outputs[0]


def test_symbolic_batch_is_the_same_shape():
    g = G()
    y = residual_block(g, g.input("x", ["N", C, 6, 6]), C)
    check(g.model([y]), {"x": _x([3, C, 6, 6])}, ["FusedConv", "FusedConv"])


RESIDUAL_NOT_FUSED = {
    # the Add broadcasts: not a residual of the Conv's shape
    "broadcast_row": lambda g, c: g.op("Add", c, g.input("z", [2, C, 1, 6])),
    "broadcast_batch": lambda g, c: g.op("Add", c, g.input("z", [1, C, 6, 6])),
    # an unknown shape cannot be proven the same
    "unknown_shape": lambda g, c: g.op("Add", c, g.input("z", None)),
    "other_dim_name": lambda g, c: g.op("Add", c, g.input("z", ["M", C, 6, 6])),
    # the Conv's output is read elsewhere too
    "conv_read_twice": lambda g, c: g.op("Mul", g.op("Add", c, g.input("z", [2, C, 6, 6])), c),
    "sum_of_itself": lambda g, c: g.op("Relu", g.op("Add", c, c)),
}


@pytest.mark.parametrize("case", sorted(RESIDUAL_NOT_FUSED))
def test_residual_not_fused(case):
    g = G()
    batch = "N" if case == "other_dim_name" else 2
    c = conv(g, g.input("x", [batch, C, 6, 6]), C, C)
    y = RESIDUAL_NOT_FUSED[case](g, c)
    model = g.model([y])
    s = session(model)
    assert not any(len(n.inputs) == 4 for n in s._graph.nodes), op_types(s)
    names = {i.name for i in onnx.load_from_string(model).graph.input}
    zshape = {"broadcast_row": [2, C, 1, 6], "broadcast_batch": [1, C, 6, 6]}.get(case)
    feeds = {"x": _x([2, C, 6, 6]), "z": _x(zshape or [2, C, 6, 6])}
    feeds = {k: v for k, v in feeds.items() if k in names}
    want = session(model, L.ORT_DISABLE_ALL).run(None, feeds)[0]
    np.testing.assert_allclose(s.run(None, feeds)[0], want, rtol=1e-5, atol=1e-5)


def test_residual_sum_read_twice_keeps_z_without_activation():
    """The Add's result is read by the Relu and by a later Add: the Relu stays apart."""
    g = G()
    x = g.input("x", [2, C, 6, 6])
    s = g.op("Add", conv(g, x, C, C), x)
    y = g.op("Add", g.op("Relu", s), s)
    check(g.model([y]), {"x": _x([2, C, 6, 6])}, ["FusedConv", "Relu", "Add"])


# ---------------------------------------------------------------------------------------------
# Providers: the fusion follows the provider's FusedConv kernel


def test_policy_leaves_a_provider_without_fused_conv_alone():
    """A provider first that runs Conv but has no FusedConv keeps its Conv + Relu; one that has
    FusedConv (a plain registry: no takes() to ask) gets the fusion."""
    plain, fused_reg, cpu = KernelRegistry("a"), KernelRegistry("b"), KernelRegistry("cpu")
    plain.kernel("Conv")(object)
    fused_reg.kernel("Conv")(object)
    fused_reg.kernel("FusedConv", domain=MS)(object)
    cpu.kernel("FusedConv", domain=MS)(object)
    g = G()
    model = g.model([g.op("Relu", conv(g, g.input("x", SHAPE), 4, C))])
    for regs, expect in (([plain, cpu], 0), ([fused_reg, cpu], 1), (None, 1)):
        graph = graph_from_model(onnx.load_from_string(model))
        assert fuse_conv_activation(graph, ProviderPolicy(regs)) == expect


@pytest.mark.usefixtures("sim")
@pytest.mark.parametrize("act", ["Relu", "Tanh", "Clip_relu6", "HardSigmoid"])
def test_fused_conv_runs_on_the_cuda_provider(act):
    """The CUDA plugin has FusedConv: on the simulated device the fused node runs there (its
    numpy twins and the GEMM fallback) and matches the CPU's unfused graph. The provider
    prefers NHWC (its default): the block runs channels-last between two Transposes."""
    g = G()
    y = ACTIVATIONS[act][0](g, residual_block(g, g.input("x", [2, C, 6, 6]), C, act=None))
    expect = ["Transpose", "FusedConv", "FusedConv", "Transpose"]
    check(g.model([y]), {"x": _x([2, C, 6, 6])}, expect, None, [SIM, CPU])


@pytest.mark.usefixtures("sim")
def test_cuda_provider_declines_fused_conv_without_activation():
    """The CUDA plugin's FusedConv takes only nodes with an activation: a residual Add with
    nothing after it stays a Conv + Add on the simulated device, and nothing moves to the
    CPU; the CPU provider alone fuses it."""
    g = G()
    x = g.input("x", [2, C, 6, 6])
    model = g.model([g.op("Add", conv(g, x, C, C), x)])
    feeds = {"x": _x([2, C, 6, 6])}
    # channels-last Conv (the provider's default), its output transposed back for the Add
    s = check(model, feeds, ["Transpose", "Conv", "Transpose", "Add"], None, [SIM, CPU])
    assert set(providers_of(s, "Conv")) == set(providers_of(s, "Add")) == {SIM}
    check(model, feeds, ["FusedConv"])


@pytest.mark.usefixtures("sim")
@pytest.mark.parametrize("act", ["Relu", "LeakyRelu", "Sigmoid", "Clip_relu6", "residual"])
def test_fused_conv_keeps_the_steady_state_on_the_cuda_provider(act):
    """After warm-up a run of FusedConv nodes on the simulated device is one host
    synchronisation, no allocation from the provider's allocator, no view built (as the
    unfused Conv and activation nodes were)."""
    from tests.test_steady_state import steady_counts

    g = G()
    x = g.input("x", [2, C, 6, 6])
    if act == "residual":
        y = residual_block(g, x, C)
    else:
        y = ACTIVATIONS[act][0](g, conv(g, x, C, C))
    s = session(g.model([y]), providers=[SIM, CPU])
    assert set(providers_of(s, "FusedConv")) == {SIM}
    feeds = {"x": _x([2, C, 6, 6])}
    s.run(None, feeds)  # records the signature
    s.run(None, feeds)  # binds the pooled frame
    for counts in steady_counts(s, feeds):
        assert counts == {"syncs": 1, "views": 0, "allocs": 0}


# ---------------------------------------------------------------------------------------------
# Switches: onnxruntime's optimizer names


@pytest.mark.parametrize(
    "names,expect",
    [
        (["ConvActivationFusion"], ["Conv", "Relu", "FusedConv"]),
        (["ConvAddActivationFusion"], ["FusedConv", "Conv", "Add", "Relu"]),
        (
            ["ConvActivationFusion", "ConvAddActivationFusion"],
            ["Conv", "Relu", "Conv", "Add", "Relu"],
        ),
        (["NchwcTransformer", "NotAnOptimizer"], ["FusedConv", "FusedConv"]),
    ],
)
def test_disabled_optimizers(names, expect):
    g = G()
    model = g.model([residual_block(g, g.input("x", [2, C, 6, 6]), C)])
    feeds = {"x": _x([2, C, 6, 6])}
    s = session(model, disabled_optimizers=names)
    assert ops(s) == sorted(expect)
    so = ox.SessionOptions()
    so.add_session_config_entry("optimization.disable_specified_optimizers", ";".join(names))
    s2 = ox.InferenceSession(typed(model), so, providers=[CPU])
    assert ops(s2) == sorted(expect)
    np.testing.assert_allclose(s.run(None, feeds)[0], s2.run(None, feeds)[0])


def test_disabled_conv_folds():
    g = G()
    c = batch_norm(g, conv(g, g.input("x", SHAPE), 4, C), C)
    y = g.op("Mul", g.op("Add", c, g.const(np.ones((C, 1, 1)))), g.const(np.ones((C, 1, 1))))
    model = g.model([y])
    assert ops(session(model)) == ["Conv"]
    kept = session(model, disabled_optimizers=["ConvBNFusion", "ConvAddFusion", "ConvMulFusion"])
    assert ops(kept) == ["Add", "BatchNormalization", "Conv", "Mul"]
    assert ops(session(model, disabled_optimizers=("ConvAddFusion",))) == ["Add", "Conv", "Mul"]


def test_disabled_optimizers_must_be_names():
    g = G()
    model = g.model([g.op("Relu", g.input("x", [2]))])
    with pytest.raises(ox.capi.onnxruntime_pybind11_state.InvalidArgument, match="names"):
        session(model, disabled_optimizers=[3])


# ---------------------------------------------------------------------------------------------
# An invariant: any per-channel map and activation after a Conv, fused == unfused


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    maps=st.lists(st.sampled_from(["Add", "Mul", "Add_first", "BN"]), max_size=3),
    act=st.sampled_from([None, *sorted(ACTIVATIONS)]),
    residual=st.booleans(),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_fused_equals_unfused(maps, act, residual, bias, seed):
    rng = np.random.default_rng(seed)
    g = G()
    x = g.input("x", [1, 3, 5, 5])
    c = g.op(
        "Conv",
        x,
        g.const(rng.standard_normal((3, 3, 3, 3)) * 0.5),
        *([g.const(rng.standard_normal(3))] if bias else []),
        pads=[1, 1, 1, 1],
    )
    for m in maps:
        if m == "BN":
            c = batch_norm(g, c, 3)
            continue
        k = g.const(rng.uniform(0.5, 1.5, (3, 1, 1)) * rng.choice([-1, 1]))
        c = g.op(m.split("_")[0], *((k, c) if m.endswith("_first") else (c, k)))
    if residual:
        c = g.op("Add", c, x)
    y = ACTIVATIONS[act][0](g, c) if act else c
    model = g.model([y])
    feeds = {"x": rng.standard_normal((1, 3, 5, 5)).astype(np.float32)}
    s = session(model)
    assert "BatchNormalization" not in op_types(s) and "Mul" not in op_types(s)
    want = session(model, L.ORT_DISABLE_ALL).run(None, feeds)[0]
    np.testing.assert_allclose(s.run(None, feeds)[0], want, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# ResNet-50 as torchvision's export writes it (BatchNormalization kept, as the dynamo exporter
# does), random weights


def resnet50(
    width: int = 64, size: int = 224, batch: int | str = 1, classes: int = 1000, dtype=np.float32
) -> bytes:
    """torchvision's resnet50 (v1.5: stride on the 3x3 conv) with ``width`` stem channels."""
    g = G(dtype)
    x = g.input("x", [batch, 3, size, size])

    def conv_bn(v: str, c_in: int, c_out: int, k: int, stride: int, relu: bool) -> str:
        y = batch_norm(g, conv(g, v, c_in, c_out, k=k, bias=False, stride=stride), c_out)
        return g.op("Relu", y) if relu else y

    h = conv_bn(x, 3, width, 7, 2, True)
    h = g.op("MaxPool", h, kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    c_in = width
    for stage, blocks in enumerate([3, 4, 6, 3]):
        planes = width * 2**stage
        for i in range(blocks):
            stride = 2 if i == 0 and stage > 0 else 1
            y = conv_bn(h, c_in, planes, 1, 1, True)
            y = conv_bn(y, planes, planes, 3, stride, True)
            y = conv_bn(y, planes, planes * 4, 1, 1, False)
            idt = conv_bn(h, c_in, planes * 4, 1, stride, False) if i == 0 else h
            h = g.op("Relu", g.op("Add", y, idt))
            c_in = planes * 4
    h = g.op("Flatten", g.op("GlobalAveragePool", h), axis=1)
    fc = g.const(RNG.standard_normal((classes, c_in)) / math.sqrt(c_in))
    return g.model([g.op("Gemm", h, fc, g.const(np.zeros(classes)), transB=1)])


# nodes of resnet50() after each level: BN folded (53), Conv + Relu fused (33), Conv + Add +
# Relu fused (16 blocks)
RESNET50_NODES = {
    L.ORT_DISABLE_ALL: 175,
    L.ORT_ENABLE_BASIC: 122,
    L.ORT_ENABLE_EXTENDED: 89,
    L.ORT_ENABLE_LAYOUT: 57,
    L.ORT_ENABLE_ALL: 57,
}


def test_resnet50_node_counts_and_results():
    model = resnet50(width=8, size=32, classes=10)
    feeds = {"x": _x([1, 3, 32, 32])}
    want = session(model, L.ORT_DISABLE_ALL).run(None, feeds)[0]
    for level, count in RESNET50_NODES.items():
        s = session(model, level)
        assert len(s._graph.nodes) == count, (level, len(s._graph.nodes))
        got = s.run(None, feeds)[0]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))
    after = op_types(s)
    assert after.count("FusedConv") == 49 and after.count("Conv") == 4


def test_optimized_model_runs_in_onnxruntime(tmp_path):
    """The optimized model onnxplug writes (FusedConv with Z and activation_params,
    FusedMatMul) loads in onnxruntime and gives the same results."""
    onnxruntime = _ort()
    if onnxruntime is None:
        pytest.skip("onnxruntime is not installed")
    g = G()
    x = g.input("x", [2, C, 6, 6])
    y = ACTIVATIONS["Clip_max_only"][0](g, residual_block(g, x, C, act=None))
    flat = g.op("Reshape", y, g.const(np.array([2, C, 36]), dtype=np.int64))
    scores = g.op("MatMul", flat, g.op("Transpose", flat, perm=[0, 2, 1]))
    model = g.model([g.op("Div", scores, g.const(6.0))])
    so = ox.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    s = ox.InferenceSession(typed(model), so, providers=[CPU])
    written = onnx.load(so.optimized_model_filepath)
    assert sorted(n.op_type for n in written.graph.node) == [
        "FusedConv",
        "FusedConv",
        "FusedMatMul",
        "Reshape",
    ]
    feeds = {"x": _x([2, C, 6, 6])}
    theirs = onnxruntime.InferenceSession(so.optimized_model_filepath, providers=[CPU])
    np.testing.assert_allclose(
        theirs.run(None, feeds)[0], s.run(None, feeds)[0], rtol=1e-5, atol=1e-4
    )


@settings(max_examples=40, deadline=None)
@given(
    dtype=st.sampled_from([np.float16, np.float32, np.float64]),
    seed=st.integers(0, 2**32 - 1),
    shape=st.sampled_from([(4, 3, 3, 3), (8, 2, 1, 1), (5, 7)]),
)
def test_weights_scaled_per_channel_are_within_an_ulp_of_float64(dtype, seed, shape):
    """The BatchNormalization fold scales W per output channel in W's type (float16 in
    float32), not through a float64 copy of W: each weight is within one unit in the last
    place of the product computed in float64 and rounded once, and float64 is exact."""
    from onnxplug.optimizer.conv import _per_channel_scaled

    rng = np.random.default_rng(seed)
    w = rng.standard_normal(shape).astype(dtype)
    factor = rng.uniform(0.01, 10.0, shape[0])
    got = _per_channel_scaled(w, factor)
    exact = w.astype(np.float64) * factor.reshape(-1, *([1] * (w.ndim - 1)))
    assert got.dtype == w.dtype and got.shape == w.shape
    rounded = exact.astype(dtype)
    if dtype == np.float64:
        np.testing.assert_array_equal(got, rounded)
    else:
        ulp = np.spacing(np.abs(rounded)).astype(np.float64)
        assert np.all(np.abs(got.astype(np.float64) - rounded.astype(np.float64)) <= ulp)
