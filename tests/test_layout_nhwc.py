"""The NHWC layout transformation and the transpose optimizer (optimizer/layout.py).

Structure, on exporter-shaped graphs with a fake provider that prefers NHWC and has the
``com.ms.internal.nhwc`` kernels: a ResNet-like block runs channels-last between one Transpose at
its input and one at its end, with its weights repacked to OHWI; nodes that have no NHWC form
(1-D and 3-D convolutions, MaxPool with Indices, float64) and providers that do not prefer NHWC
(or refuse an op, or come first without the NHWC kernels) keep NCHW.

Numbers, on the CPU provider: the transformed graph, with each NHWC node emulated by its ONNX op
between Transposes as the contract defines the layouts (X, Z, Y NHWC; W OHWI), matches the
original; the transpose optimizer never changes what a graph computes (hypothesis: random chains
of elementwise ops between channels-last segments). End to end on the simulated CUDA device
with ``prefer_nhwc=1`` where the CUDA plugin has the NHWC kernels.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import onnxplug as ox
from onnxplug.ep import NHWC_DOMAIN, NHWC_OPS, Ep, KernelRegistry, SessionConfig
from onnxplug.ir.export import model_to_proto
from onnxplug.ir.graph import Graph, Node, graph_from_model
from onnxplug.optimizer.layout import TO_NCHW, TO_NHWC, optimize_transposes
from onnxplug.optimizer.passes import optimize
from onnxplug.session.build import FusionTarget
from tests.test_fusions_conv import batch_norm, conv, resnet50, typed, weights
from tests.test_fusions_transformer import (  # noqa: F401 (sim: a fixture)
    CPU,
    MS,
    SIM,
    G,
    sim,
)

RNG = np.random.default_rng(5)
FLOATS = ("float16", "float32")
NCHW_OPS = (
    "Conv",
    "MaxPool",
    "AveragePool",
    "GlobalAveragePool",
    "GlobalMaxPool",
    "Relu",
    "Add",
    "Mul",
    "Sigmoid",
    "Transpose",
    "Flatten",
    "Gemm",
)


class _Kernel:
    """Never run: the structural tests only optimize."""


class NhwcEp(Ep):
    """A provider with NCHW and NHWC kernels for float16/float32 that prefers ``layout``;
    ``refuse``: ops its should_convert_data_layout_for_op answers 0 for; ``declines``: NHWC ops
    its get_capability does not claim."""

    name = "FakeNhwcExecutionProvider"

    def __init__(self, layout="NHWC", nhwc_kernels=True, refuse=(), declines=()):
        super().__init__(None, None, SessionConfig({}))
        self.layout, self.refuse, self.declines = layout, set(refuse), set(declines)
        self.registry = KernelRegistry(self.name)
        for op in NCHW_OPS:
            self.registry.kernel(op, types={0: FLOATS})(_Kernel)
        self.registry.kernel("FusedConv", domain=MS, types={0: FLOATS})(_Kernel)
        for _, op in NHWC_OPS if nhwc_kernels else ():
            self.registry.kernel(op, domain=NHWC_DOMAIN, types={0: FLOATS})(_Kernel)

    def get_kernel_registry(self) -> KernelRegistry:
        return self.registry

    def get_capability(self, graph):
        claimed = super().get_capability(graph)
        return [n for n in claimed if not (n.domain == NHWC_DOMAIN and n.op_type in self.declines)]

    def get_preferred_data_layout(self) -> str:
        return self.layout

    def should_convert_data_layout_for_op(self, domain, op_type, target_layout) -> int:
        return (
            0
            if op_type in self.refuse
            else super().should_convert_data_layout_for_op(domain, op_type, target_layout)
        )


class NchwEp(NhwcEp):
    name = "FakeNchwExecutionProvider"

    def __init__(self):
        super().__init__(layout="NCHW", nhwc_kernels=False)


def optimized(model: bytes, *eps: Ep, level: int = 99, disabled=frozenset()) -> Graph:
    graph = graph_from_model(onnx.load_from_string(typed(model)))
    optimize(graph, level, None, [FusionTarget(ep) for ep in eps], frozenset(disabled))
    return graph


def nhwc_nodes(graph: Graph) -> list[str]:
    return sorted(n.op_type for n in graph.nodes if n.domain == NHWC_DOMAIN)


def transposes(graph: Graph) -> list[Node]:
    return [n for n in graph.nodes if n.op_type == "Transpose"]


def resnet_block(g: G, shape=(2, 3, 16, 16)) -> str:
    """A ResNet stem and basic block as torch exports them (BatchNormalization after each
    Conv, folded by the optimizer), pooled and classified."""
    x = g.input("x", list(shape))
    c = g.op("Relu", conv(g, x, shape[1], 8))
    p = g.op("MaxPool", c, kernel_shape=[2, 2], strides=[2, 2])
    h = g.op("Relu", batch_norm(g, conv(g, p, 8, 8), 8))
    h = batch_norm(g, conv(g, h, 8, 8), 8)
    r = g.op("Relu", g.op("Add", h, p))
    flat = g.op("Flatten", g.op("GlobalAveragePool", r), axis=1)
    return g.op(
        "Gemm", flat, g.const(RNG.standard_normal((10, 8))), g.const(np.zeros(10)), transB=1
    )


def _x(shape, dtype=np.float32) -> np.ndarray:
    return RNG.standard_normal(shape).astype(dtype)


# ---------------------------------------------------------------------------------------------
# Structure


def test_resnet_block_runs_channels_last_between_two_transposes():
    g = G()
    model = g.model([resnet_block(g)])
    graph = optimized(model, NhwcEp())
    assert nhwc_nodes(graph) == sorted(
        ["FusedConv", "FusedConv", "FusedConv", "MaxPool", "GlobalAveragePool"]
    )
    first, last = transposes(graph)
    assert first.inputs == ["x"] and first.attrs["perm"] == list(TO_NHWC)
    producers = graph.producers()
    assert producers[last.inputs[0]].op_type == "GlobalAveragePool"
    assert last.attrs["perm"] == list(TO_NCHW)
    assert {n.op_type for n in graph.nodes if n.domain == ""} == {"Transpose", "Flatten", "Gemm"}
    # the block's residual is the MaxPool's NHWC output
    (with_z,) = [n for n in graph.nodes if len(n.inputs) == 4]
    assert producers[with_z.inputs[3]].op_type == "MaxPool"
    assert producers[with_z.inputs[3]].domain == NHWC_DOMAIN
    # every value the NHWC nodes read or write is typed, NHWC shaped
    assert graph.type_of(first.outputs[0]).shape == (2, 16, 16, 3)
    for n in graph.nodes:
        for v in n.inputs + n.outputs:
            if v:
                assert graph.type_of(v) is not None and graph.type_of(v).elem_type, v


def test_weights_repacked_to_ohwi():
    """W of each NHWC convolution is a new initializer, W of the NCHW one transposed to (M, kH,
    kW, C/group), as a view (the build copies it out for the device, off the main thread); the
    OIHW originals are gone (nothing else reads them)."""
    g = G()
    model = g.model([resnet_block(g)])
    nchw = optimized(model, NchwEp())
    nhwc = optimized(model, NhwcEp())
    want = [nchw.initializers[n.inputs[1]] for n in nchw.nodes if n.op_type == "FusedConv"]
    got = [nhwc.initializers[n.inputs[1]] for n in nhwc.nodes if n.op_type == "FusedConv"]
    assert len(got) == len(want) == 3
    for w, ohwi in zip(want, got):
        np.testing.assert_array_equal(ohwi, np.transpose(w, TO_NHWC))
        assert not ohwi.flags.owndata and not ohwi.flags.writeable
    assert not set(nhwc.initializers) & {
        n.inputs[1] for n in nchw.nodes if n.op_type == "FusedConv"
    }


@pytest.mark.parametrize("threaded", [True, False])
def test_the_build_copies_out_only_the_views(monkeypatch, threaded):
    """``contiguous_copies`` (the build, for the weights it uploads): a non-contiguous array
    is replaced by its C-contiguous copy, on a helper thread above
    ``CONTIGUOUS_THREAD_ABOVE`` bytes, at once below; contiguous arrays, 0-d ones included,
    are passed on as they are."""
    from onnxplug.framework import control_flow

    monkeypatch.setattr(control_flow, "CONTIGUOUS_THREAD_ABOVE", 0 if threaded else 1 << 40)
    base = np.arange(2 * 3 * 4 * 5, dtype=np.float32).reshape(2, 3, 4, 5)
    view, plain = np.transpose(base, TO_NHWC), np.ones(3, np.float32)
    scalar = np.asarray(np.float32(2))
    copies = control_flow.contiguous_copies([view, plain, scalar])
    assert (copies._thread is not None) == threaded
    out = copies.result()
    assert out[1] is plain and out[2] is scalar and out[2].shape == ()
    assert out[0].flags.c_contiguous and not np.shares_memory(out[0], base)
    np.testing.assert_array_equal(out[0], view)


@pytest.mark.parametrize("threaded", [True, False])
def test_a_failed_copy_is_raised_in_the_caller(monkeypatch, threaded):
    from onnxplug.framework import control_flow

    def no_memory(a):
        raise MemoryError("no room for the copy")

    monkeypatch.setattr(control_flow, "CONTIGUOUS_THREAD_ABOVE", 0 if threaded else 1 << 40)
    monkeypatch.setattr(control_flow.np, "ascontiguousarray", no_memory)
    copies = control_flow.contiguous_copies([np.zeros((4, 4), np.float32).T])
    with pytest.raises(MemoryError, match="no room"):
        copies.result()


def test_prefer_nhwc_off_changes_nothing():
    g = G()
    model = g.model([resnet_block(g)])
    for ep in (NhwcEp(layout="NCHW"), NchwEp()):
        graph = optimized(model, ep)
        assert not nhwc_nodes(graph) and not transposes(graph)
        assert NHWC_DOMAIN not in graph.opsets
        plain = optimized(model)
        assert [(n.domain, n.op_type) for n in graph.nodes] == [
            (n.domain, n.op_type) for n in plain.nodes
        ]


def test_below_layout_level_nothing_changes():
    g = G()
    graph = optimized(g.model([resnet_block(g)]), NhwcEp(), level=2)
    assert not nhwc_nodes(graph) and not transposes(graph)


def test_resnet50_trunk_has_two_transposes():
    """ResNet-50's shape (53 convolutions, projections included): every convolution and pool
    NHWC, one Transpose in, one out."""
    graph = optimized(resnet50(width=8, size=32), NhwcEp())
    ops = nhwc_nodes(graph)
    assert ops.count("FusedConv") + ops.count("Conv") == 53
    assert "MaxPool" in ops and "GlobalAveragePool" in ops
    assert len(transposes(graph)) == 2


def test_independent_cancellations_share_a_round(monkeypatch):
    """The transpose optimizer cancels every independent pair of a round at once: ResNet-50's
    ~70 cancellations take a few rounds (each round rebuilds the graph's edges), not one
    round each."""
    from onnxplug.optimizer import layout

    rounds = []
    real = layout._Edges
    monkeypatch.setattr(layout, "_Edges", lambda g: rounds.append(1) or real(g))
    graph = optimized(resnet50(width=8, size=32), NhwcEp())
    assert len(transposes(graph)) == 2
    assert len(rounds) <= 8


@pytest.mark.parametrize("group", [2, 8], ids=["grouped", "depthwise"])
def test_grouped_and_depthwise_convs_convert(group):
    g = G()
    x = g.input("x", [1, 8, 6, 6])
    w = g.const(weights(8, 8 // group, 3, 3))
    y = g.op("Relu", g.op("Conv", x, w, kernel_shape=[3, 3], pads=[1, 1, 1, 1], group=group))
    graph = optimized(g.model([y]), NhwcEp())
    (n,) = [n for n in graph.nodes if n.domain == NHWC_DOMAIN]
    assert n.attrs["group"] == group
    assert graph.initializers[n.inputs[1]].shape == (8, 3, 3, 8 // group)
    assert len(transposes(graph)) == 2


def _conv_1d(g: G) -> str:
    x = g.input("x", [1, 4, 10])
    return g.op("Conv", x, g.const(weights(4, 4, 3)), kernel_shape=[3], pads=[1, 1])


def _conv_3d(g: G) -> str:
    x = g.input("x", [1, 4, 5, 5, 5])
    return g.op("Conv", x, g.const(weights(4, 4, 3, 3, 3)), kernel_shape=[3, 3, 3])


def _maxpool_indices(g: G) -> str:
    x = g.input("x", [1, 4, 6, 6])
    y, _ = g.op("MaxPool", x, n_out=2, kernel_shape=[2, 2])
    return y


def _conv_fp64(g: G) -> str:
    g64 = G(np.float64)
    x = g.input("x", [1, 4, 6, 6], dtype=np.float64)
    return g.op("Conv", x, g.const(weights(4, 4, 3, 3, dtype=np.float64), dtype=g64.dtype))


def _conv_unknown_rank(g: G) -> str:
    x = g.input("x", None)
    return g.op("Conv", x, g.const(weights(4, 4, 3, 3)), kernel_shape=[3, 3])


NOT_CONVERTED = {
    "conv_1d": _conv_1d,
    "conv_3d": _conv_3d,
    "maxpool_with_indices": _maxpool_indices,
    "conv_float64": _conv_fp64,
    "conv_unknown_rank": _conv_unknown_rank,
}


@pytest.mark.parametrize("case", sorted(NOT_CONVERTED))
def test_nodes_without_an_nhwc_form_stay(case):
    g = G()
    y = NOT_CONVERTED[case](g)
    graph = optimized(g.model([y]), NhwcEp())
    assert not nhwc_nodes(graph) and not transposes(graph)


def test_graph_output_in_the_trunk_keeps_nchw():
    """A value of the trunk that is also a graph output keeps its name and NCHW layout (one
    Transpose back for it); the next convolution still reads the NHWC value."""
    g = G()
    x = g.input("x", [1, 4, 8, 8])
    mid = g.op("Relu", conv(g, x, 4, 4))
    y = g.op("Relu", conv(g, mid, 4, 4))
    graph = optimized(g.model([mid, y]), NhwcEp())
    assert nhwc_nodes(graph) == ["FusedConv", "FusedConv"]
    assert [o.name for o in graph.outputs] == [mid, y]
    producers = graph.producers()
    for out in (mid, y):
        assert producers[out].op_type == "Transpose"
        assert producers[out].attrs["perm"] == list(TO_NCHW)
    second = [n for n in graph.nodes if n.domain == NHWC_DOMAIN][1]
    assert producers[second.inputs[0]].domain == NHWC_DOMAIN
    assert len(transposes(graph)) == 3


def test_provider_refusing_an_op_keeps_it_nchw():
    """should_convert_data_layout_for_op 0 for MaxPool: it stays between Transposes back and
    forth; the convolutions around it convert."""
    g = G()
    x = g.input("x", [1, 4, 8, 8])
    p = g.op("MaxPool", g.op("Relu", conv(g, x, 4, 4)), kernel_shape=[2, 2], strides=[2, 2])
    y = g.op("Relu", conv(g, p, 4, 4))
    graph = optimized(g.model([y]), NhwcEp(refuse={"MaxPool"}))
    assert nhwc_nodes(graph) == ["FusedConv", "FusedConv"]
    assert [n.domain for n in graph.nodes if n.op_type == "MaxPool"] == [""]
    assert len(transposes(graph)) == 4


@pytest.mark.parametrize(
    "eps",
    [
        pytest.param(lambda: [NchwEp(), NhwcEp()], id="nchw_provider_first"),
        pytest.param(lambda: [NhwcEp(nhwc_kernels=False)], id="no_nhwc_kernels"),
        pytest.param(lambda: [NhwcEp(declines={"FusedConv", "MaxPool"})], id="declined"),
    ],
)
def test_nodes_stay_with_a_provider_that_runs_them_nchw(eps):
    g = G()
    x = g.input("x", [1, 4, 8, 8])
    y = g.op("MaxPool", g.op("Relu", conv(g, x, 4, 4)), kernel_shape=[2, 2])
    graph = optimized(g.model([y]), *eps())
    assert not nhwc_nodes(graph) and not transposes(graph)


def test_first_provider_with_the_op_decides():
    """A provider without Conv before the NHWC one does not stop it."""

    class PoolsOnly(NchwEp):
        def __init__(self):
            super().__init__()
            self.registry = KernelRegistry("pools")
            self.registry.kernel("Gemm")(_Kernel)

    g = G()
    y = g.op("Relu", conv(g, g.input("x", [1, 4, 8, 8]), 4, 4))
    graph = optimized(g.model([y]), PoolsOnly(), NhwcEp())
    assert nhwc_nodes(graph) == ["FusedConv"]


def test_weights_from_a_graph_input_and_shared_weights():
    """W that is not a constant is transposed in the graph; a constant W read by another node
    too is kept for it beside its OHWI copy, which two convolutions share."""
    g = G()
    x = g.input("x", [1, 4, 8, 8])
    w_in = g.input("w", [4, 4, 3, 3])
    a = g.op("Relu", g.op("Conv", x, w_in, kernel_shape=[3, 3], pads=[1, 1, 1, 1]))
    w = g.const(weights(4, 4, 3, 3))
    b = g.op("Relu", g.op("Conv", a, w, kernel_shape=[3, 3], pads=[1, 1, 1, 1]))
    c = g.op("Relu", g.op("Conv", b, w, kernel_shape=[3, 3], pads=[1, 1, 1, 1]))
    graph = optimized(g.model([c, g.op("Sigmoid", w)]), NhwcEp())
    convs = [n for n in graph.nodes if n.domain == NHWC_DOMAIN]
    assert len(convs) == 3
    producers = graph.producers()
    assert producers[convs[0].inputs[1]].op_type == "Transpose"
    assert producers[convs[0].inputs[1]].inputs == ["w"]
    assert convs[1].inputs[1] == convs[2].inputs[1] != w
    assert w in graph.initializers


def test_transpose_optimizer_can_be_disabled():
    g = G()
    model = g.model([resnet_block(g)])
    graph = optimized(model, NhwcEp(), disabled={"TransposeOptimizer"})
    assert len(nhwc_nodes(graph)) == 5
    assert len(transposes(graph)) == 2 * 5 + 1  # X and Y of each, and FusedConv's Z


def test_silu_between_convolutions_runs_channels_last():
    """x * sigmoid(x) after a Conv (EfficientNet's SiLU: no FusedConv activation): the Transpose
    goes down through the Sigmoid and the Mul and cancels with the next one."""
    g = G()
    x = g.input("x", [1, 4, 8, 8])
    c = conv(g, x, 4, 4)
    s = g.op("Mul", c, g.op("Sigmoid", c))
    y = g.op("Relu", conv(g, s, 4, 4))
    graph = optimized(g.model([y]), NhwcEp())
    assert nhwc_nodes(graph) == ["Conv", "FusedConv"]
    assert len(transposes(graph)) == 2


# ---------------------------------------------------------------------------------------------
# Numbers on the CPU provider


def emulated(graph: Graph) -> Graph:
    """``graph`` with every NHWC node replaced by its ONNX op between Transposes, reading X and
    Z as NHWC and W as OHWI and writing NHWC Y, as the contract defines them: the CPU provider
    runs it."""
    nodes: list[Node] = []
    opset = graph.opsets[""]

    def transpose(src: str, perm, at: Node) -> str:
        out = graph.unique_name(f"{src}_emulated")
        nodes.append(
            Node(at.name + out, "Transpose", "", [src], [out], {"perm": list(perm)}, 1, opset)
        )
        return out

    for n in graph.nodes:
        if n.domain != NHWC_DOMAIN:
            nodes.append(n)
            continue
        ins = list(n.inputs)
        ins[0] = transpose(ins[0], TO_NCHW, n)
        if n.op_type in ("Conv", "FusedConv"):
            ins[1] = transpose(ins[1], TO_NCHW, n)  # OHWI -> OIHW
            if len(ins) > 3 and ins[3]:
                ins[3] = transpose(ins[3], TO_NCHW, n)
        y = graph.unique_name(f"{n.outputs[0]}_nchw")
        domain = MS if n.op_type == "FusedConv" else ""
        since = 1 if domain else onnx.defs.get_schema(n.op_type, opset, "").since_version
        nodes.append(Node(n.name, n.op_type, domain, ins, [y], dict(n.attrs), since, opset))
        nodes.append(
            Node(n.name + "_back", "Transpose", "", [y], n.outputs, {"perm": list(TO_NHWC)}, 1, 1)
        )
    graph.nodes = nodes
    return graph


def run_graph(graph: Graph, like: bytes, feeds: dict) -> list[np.ndarray]:
    model = model_to_proto(graph, onnx.load_from_string(typed(like)))
    so = ox.SessionOptions()
    so.graph_optimization_level = ox.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ox.InferenceSession(model.SerializeToString(), so, providers=[CPU]).run(None, feeds)


def run_model(model: bytes, feeds: dict) -> list[np.ndarray]:
    so = ox.SessionOptions()
    so.graph_optimization_level = ox.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ox.InferenceSession(typed(model), so, providers=[CPU]).run(None, feeds)


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=lambda d: np.dtype(d).name)
def test_resnet_block_numbers_with_emulated_nhwc_ops(dtype):
    g = G(dtype)
    model = g.model([resnet_block(g)])
    graph = optimized(model, NhwcEp())
    feeds = {"x": _x([2, 3, 16, 16], dtype)}
    (got,) = run_graph(emulated(graph), model, feeds)
    (want,) = run_model(model, feeds)
    tol = 1e-4 if dtype == np.float32 else 2e-2
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=tol, atol=tol)


def test_pools_and_grouped_conv_numbers_with_emulated_nhwc_ops():
    g = G()
    x = g.input("x", [2, 8, 9, 9])
    w = g.const(weights(8, 2, 3, 3))
    c = g.op("Conv", x, w, kernel_shape=[3, 3], strides=[2, 2], pads=[1, 0, 1, 0], group=4)
    a = g.op("AveragePool", c, kernel_shape=[2, 2], pads=[1, 1, 0, 0], count_include_pad=0)
    m = g.op("MaxPool", g.op("Sigmoid", a), kernel_shape=[3, 2], dilations=[1, 2])
    mid = g.op("GlobalMaxPool", c)
    model = g.model([m, mid])
    graph = optimized(model, NhwcEp())
    assert nhwc_nodes(graph) == ["AveragePool", "Conv", "GlobalMaxPool", "MaxPool"]
    feeds = {"x": _x([2, 8, 9, 9])}
    for got, want in zip(run_graph(emulated(graph), model, feeds), run_model(model, feeds)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


UNARY = {
    "Relu": {},
    "Sigmoid": {},
    "Tanh": {},
    "Abs": {},
    "Neg": {},
    "LeakyRelu": {"alpha": 0.1},
    "HardSigmoid": {"alpha": 0.3, "beta": 0.4},
    "Identity": {},
}
BINARY = ["Add", "Sub", "Mul", "Max", "Min"]
C, HW = 3, 4


@st.composite
def chains(draw):
    """(model, number of Transposes in it): segments of elementwise ops, each NCHW or between
    Transposes to NHWC and back; binary ops take a constant (a scalar, per channel in the
    segment's layout, or full) or the segment's first value; sometimes a value of the middle
    is a graph output too."""
    g = G()
    cur = g.input("x", [2, C, HW, HW])
    outputs: list[str] = []
    count = 0
    for _ in range(draw(st.integers(1, 3))):
        nhwc = draw(st.booleans())
        if nhwc:
            cur = g.op("Transpose", cur, perm=list(TO_NHWC))
            count += 1
        shape = [2, HW, HW, C] if nhwc else [2, C, HW, HW]
        start = cur
        for _ in range(draw(st.integers(1, 4))):
            if draw(st.booleans()):
                op = draw(st.sampled_from(sorted(UNARY)))
                cur = g.op(op, cur, **UNARY[op])
                continue
            op = draw(st.sampled_from(BINARY))
            kind = draw(st.sampled_from(["scalar", "channel", "full", "start"]))
            if kind == "start":
                other = start
            else:
                cshape = {
                    "scalar": [],
                    "channel": [C] if nhwc else [C, 1, 1],
                    "full": shape[1:],
                }[kind]
                other = g.const(RNG.uniform(-2, 2, cshape))
            cur = g.op(op, *((other, cur) if draw(st.booleans()) else (cur, other)))
            if draw(st.integers(0, 5)) == 0:
                outputs.append(cur)
        if nhwc:
            cur = g.op("Transpose", cur, perm=list(TO_NCHW))
            count += 1
    return g.model([*outputs, cur]), count


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chains())
def test_transpose_optimizer_keeps_the_numbers(case):
    model, count = case
    graph = graph_from_model(onnx.load_from_string(typed(model)))
    optimize_transposes(graph)
    assert len(transposes(graph)) <= count
    feeds = {"x": _x([2, C, HW, HW])}
    for got, want in zip(run_graph(graph, model, feeds), run_model(model, feeds)):
        np.testing.assert_array_equal(got, want)


def test_transposes_of_a_chain_without_outputs_all_cancel():
    g = G()
    t = g.op("Transpose", g.input("x", [2, C, HW, HW]), perm=list(TO_NHWC))
    r = g.op("Relu", t)
    s = g.op("Add", g.op("Mul", r, g.const(RNG.uniform(-1, 1, [C]))), t)
    c = g.op("Clip", g.op("Sigmoid", s), g.const(0.1), g.const(0.9))
    y = g.op("Transpose", c, perm=list(TO_NCHW))
    model = g.model([y])
    graph = graph_from_model(onnx.load_from_string(typed(model)))
    optimize_transposes(graph)
    assert not transposes(graph)
    feeds = {"x": _x([2, C, HW, HW])}
    np.testing.assert_array_equal(run_graph(graph, model, feeds)[0], run_model(model, feeds)[0])


def test_no_transpose_is_added_for_graph_outputs_in_a_chain():
    """A channels-last chain whose every value is a graph output too (found by the property
    test above): each needs its NCHW value, so the push stops where it would add a Transpose
    that stays (it ended with 3 Transposes where the model had 2)."""
    g = G()
    cur = g.op("Transpose", g.input("x", [2, C, HW, HW]), perm=list(TO_NHWC))
    outputs = []
    for k in range(3):
        cur = g.op("Add", cur, g.const(np.float32(0.5 + k)))
        outputs.append(cur)
    cur = g.op("Transpose", cur, perm=list(TO_NCHW))
    model = g.model([*outputs, cur])
    graph = graph_from_model(onnx.load_from_string(typed(model)))
    optimize_transposes(graph)
    assert len(transposes(graph)) <= 2
    feeds = {"x": _x([2, C, HW, HW])}
    for got, want in zip(run_graph(graph, model, feeds), run_model(model, feeds)):
        np.testing.assert_array_equal(got, want)


def test_transposes_that_do_not_cancel_merge():
    g = G()
    t = g.op("Transpose", g.input("x", [2, 3, 4, 5]), perm=[0, 2, 3, 1])
    y = g.op("Transpose", t, perm=[1, 0, 2, 3])
    model = g.model([y])
    graph = graph_from_model(onnx.load_from_string(typed(model)))
    optimize_transposes(graph)
    (only,) = transposes(graph)
    assert only.inputs == ["x"] and only.attrs["perm"] == [2, 0, 3, 1]
    feeds = {"x": _x([2, 3, 4, 5])}
    np.testing.assert_array_equal(run_graph(graph, model, feeds)[0], run_model(model, feeds)[0])


def test_transposes_read_by_a_subgraph_stay():
    """A Transpose back whose value an If branch reads (an outer-scope reference) is not
    renamed away; the other reader gets the cancelled value."""
    g = G()
    t = g.op("Transpose", g.input("x", [1, 2, 3, 4]), perm=list(TO_NHWC))
    back = g.op("Transpose", t, perm=list(TO_NCHW))
    branch = onnx.helper.make_graph(
        [onnx.helper.make_node("Relu", [back], ["r"])],
        "branch",
        [],
        [onnx.helper.make_tensor_value_info("r", onnx.TensorProto.FLOAT, None)],
    )
    g.inputs.append(onnx.helper.make_tensor_value_info("c", onnx.TensorProto.BOOL, []))
    y = g.op("If", "c", then_branch=branch, else_branch=branch)
    z = g.op("Sigmoid", back)
    model = g.model([y, z])
    graph = graph_from_model(onnx.load_from_string(typed(model)))
    optimize_transposes(graph)
    assert [n.outputs[0] for n in transposes(graph)] == [t, back]
    (sigmoid,) = [n for n in graph.nodes if n.op_type == "Sigmoid"]
    assert sigmoid.inputs == ["x"]
    feeds = {"x": _x([1, 2, 3, 4]), "c": np.array(True)}
    for got, want in zip(run_graph(graph, model, feeds), run_model(model, feeds)):
        np.testing.assert_array_equal(got, want)


# ---------------------------------------------------------------------------------------------
# The CUDA provider's hooks and the simulated device end to end


@pytest.mark.usefixtures("sim")
def test_cuda_provider_layout_hooks():
    g = G()
    model = typed(g.model([g.op("Relu", g.input("x", [1, 2, 3, 3]))]))
    on, off = (
        ox.InferenceSession(model, providers=[(SIM, {"prefer_nhwc": p}), CPU])._eps[0]
        for p in ("1", "0")
    )
    assert on.get_preferred_data_layout() == "NHWC"
    assert off.get_preferred_data_layout() == "NCHW"
    for domain, op in NHWC_OPS:
        assert on.should_convert_data_layout_for_op(domain, op, "NHWC") == 1
        assert off.should_convert_data_layout_for_op(domain, op, "NHWC") == -1
    assert on.should_convert_data_layout_for_op("", "Resize", "NHWC") == 0
    assert on.should_convert_data_layout_for_op("", "Conv", "NCHW") == -1


def silu_trunk(g: G) -> list[str]:
    """Two convolutions with SiLU (x * sigmoid(x), EfficientNet's activation) between, the
    first one's result also a graph output."""
    x = g.input("x", [2, 4, 10, 10])
    c = conv(g, x, 4, 8, stride=2)
    s = g.op("Mul", c, g.op("Sigmoid", c))
    return [c, g.op("GlobalAveragePool", g.op("Relu", conv(g, s, 8, 8)))]


E2E = {
    "resnet_block": (lambda g: [resnet_block(g)], [2, 3, 16, 16], 2),
    "resnet50": (None, [1, 3, 32, 32], 2),
    "silu_trunk": (silu_trunk, [2, 4, 10, 10], 3),
}


def check_channels_last(provider: str, options: dict, case: str, dtype) -> None:
    """With prefer_nhwc=1 ``provider`` runs every convolution and pool of ``case`` as an NHWC
    node, the Transposes left are the input's and the outputs', and the results match the
    CPU provider's; with prefer_nhwc=0 nothing is NHWC (and the results match too)."""
    build, shape, n_transposes = E2E[case]
    if build is None:
        model = resnet50(width=8, size=32, dtype=dtype)
    else:
        g = G(dtype)
        model = g.model(build(g))
    feeds = {"x": _x(shape, dtype)}
    sessions = {
        prefer: ox.InferenceSession(
            typed(model), providers=[(provider, {**options, "prefer_nhwc": prefer}), CPU]
        )
        for prefer in ("0", "1")
    }
    off, on = sessions["0"], sessions["1"]
    assert not nhwc_nodes(off._graph)
    sensitive = [n for n in off._graph.nodes if (n.domain, n.op_type) in NHWC_OPS]
    assert len(nhwc_nodes(on._graph)) == len(sensitive) > 0
    eps = {r["node_name"]: r["ep"] for r in on.get_provider_graph_assignment_info()}
    assert {eps[n.name] for n in on._graph.nodes if n.domain == NHWC_DOMAIN} == {provider}
    assert len(transposes(on._graph)) == n_transposes
    tol = 1e-4 if dtype == np.float32 else 2e-2
    want = run_model(model, feeds)
    for sess in (on, off):
        for got, ref in zip(sess.run(None, feeds), want):
            assert got.dtype == ref.dtype and got.shape == ref.shape
            scale = max(1.0, float(np.abs(ref.astype(np.float64)).max()))
            np.testing.assert_allclose(
                got.astype(np.float64), ref.astype(np.float64), rtol=tol, atol=tol * scale
            )


@pytest.mark.usefixtures("sim")
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("case", sorted(E2E))
def test_channels_last_on_the_simulated_cuda_device(case, dtype):
    check_channels_last(SIM, {}, case, dtype)


@pytest.mark.usefixtures("sim")
def test_channels_last_keeps_the_steady_state_on_the_simulated_device():
    """After warm-up a run of the channels-last ResNet-like block on the simulated device is one
    host synchronisation, no allocation from the provider's allocator, no view built."""
    from tests.test_steady_state import steady_counts

    g = G()
    model = typed(g.model([resnet_block(g)]))
    s = ox.InferenceSession(model, providers=[(SIM, {"prefer_nhwc": "1"}), CPU])
    assert len(nhwc_nodes(s._graph)) == 5
    feeds = {"x": _x([2, 3, 16, 16])}
    s.run(None, feeds)  # records the signature
    s.run(None, feeds)  # binds the pooled frame
    for counts in steady_counts(s, feeds):
        assert counts == {"syncs": 1, "views": 0, "allocs": 0}
