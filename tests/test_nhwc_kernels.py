"""The CUDA provider's channels-last kernels (``com.ms.internal.nhwc`` Conv, FusedConv, MaxPool,
AveragePool, GlobalAveragePool, GlobalMaxPool), given NHWC nodes directly: each runs between
Transposes and must equal the NCHW node on the CPU provider. On the host-simulated device in CI
(``CUDASimExecutionProvider``) and on the GPU (tests/gpu/test_cuda_nhwc.py runs the same cases
on ``CUDAExecutionProvider``)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxplug as ox
from onnxplug.ep import NHWC_DOMAIN
from tests.test_cuda_sim import SIM, sim  # noqa: F401  (the simulated CUDA provider)

CPU = "CPUExecutionProvider"
TO_NHWC, TO_NCHW = [0, 2, 3, 1], [0, 3, 1, 2]


def _elem(dtype: type) -> int:
    return TensorProto.FLOAT16 if dtype == np.float16 else TensorProto.FLOAT


def pair(op: str, x_shape: list[int], dtype: type, attrs: dict, weights: dict, z: bool = False):
    """(NHWC model, NCHW model) of one ``op`` node on input ``x`` (NCHW shape), with initializer
    ``weights`` (NCHW/OIHW): the NHWC model wraps the internal-domain node in Transposes and
    stores W as (M, kH, kW, C/group)."""
    domain = "com.microsoft" if op == "FusedConv" else ""
    names = ["x"] + list(weights) + (["z"] if z else [])
    inputs = [helper.make_tensor_value_info("x", _elem(dtype), x_shape)]
    if z:
        inputs.append(helper.make_tensor_value_info("z", _elem(dtype), None))

    def model(nodes, inits, opsets):
        g = helper.make_graph(
            nodes, op, inputs, [helper.make_tensor_value_info("y", _elem(dtype), None)], inits
        )
        return helper.make_model(g, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets])

    nchw = model(
        [helper.make_node(op, names, ["y"], domain=domain, **attrs)],
        [numpy_helper.from_array(v.astype(dtype), k) for k, v in weights.items()],
        [("", 18), ("com.microsoft", 1)],
    )
    inits = []
    for k, v in weights.items():
        v = np.ascontiguousarray(v.transpose(TO_NHWC)) if v.ndim == 4 else v
        inits.append(numpy_helper.from_array(v.astype(dtype), k))
    ins = ["xt"] + list(weights) + (["zt"] if z else [])
    nodes = [helper.make_node("Transpose", ["x"], ["xt"], perm=TO_NHWC)]
    if z:
        nodes.append(helper.make_node("Transpose", ["z"], ["zt"], perm=TO_NHWC))
    nodes += [
        helper.make_node(op, ins, ["yt"], domain=NHWC_DOMAIN, **attrs),
        helper.make_node("Transpose", ["yt"], ["y"], perm=TO_NCHW),
    ]
    nhwc = model(nodes, inits, [("", 18), (NHWC_DOMAIN, 1)])
    return nhwc.SerializeToString(), nchw.SerializeToString()


def _conv_weights(rng, m: int, c: int, k: int, group: int = 1, bias: bool = True) -> dict:
    w = {"w": rng.standard_normal((m, c // group, k, k)).astype(np.float32) * 0.2}
    if bias:
        w["b"] = rng.standard_normal(m).astype(np.float32)
    return w


def cases() -> list[tuple[str, list[int], dict, int, bool]]:
    """(op, NCHW input shape, attributes, weights seed, z) of each case."""
    return [
        ("Conv", [2, 8, 9, 9], {"pads": [1, 1, 1, 1]}, 3, False),
        ("Conv", [1, 16, 8, 8], {"strides": [2, 2], "group": 4}, 1, False),
        ("Conv", [1, 8, 7, 7], {"group": 8, "pads": [1, 1, 1, 1]}, 3, False),  # depthwise
        ("FusedConv", [2, 8, 6, 6], {"pads": [1, 1, 1, 1], "activation": "Relu"}, 3, True),
        ("FusedConv", [1, 8, 5, 5], {"activation": "LeakyRelu", "activation_params": [0.2]}, 1,
         False),
        ("MaxPool", [2, 8, 9, 9], {"kernel_shape": [3, 3], "strides": [2, 2],
                                   "pads": [1, 1, 1, 1]}, 0, False),
        ("AveragePool", [1, 4, 7, 7], {"kernel_shape": [2, 2], "strides": [2, 2],
                                       "ceil_mode": 1}, 0, False),
        ("GlobalAveragePool", [2, 16, 7, 7], {}, 0, False),
        ("GlobalMaxPool", [2, 8, 5, 5], {}, 0, False),
    ]  # fmt: skip


def build(case, dtype):
    op, shape, attrs, k, z = case
    rng = np.random.default_rng(0)
    weights = {}
    if "Conv" in op:
        c = shape[1]
        weights = _conv_weights(rng, 8 if attrs.get("group", 1) != c else c, c, k,
                                attrs.get("group", 1))  # fmt: skip
    nhwc, nchw = pair(op, shape, dtype, attrs, weights, z)
    feeds = {"x": rng.standard_normal(shape).astype(dtype)}
    if z:  # the z cases keep the spatial size (3x3 kernels, pads 1)
        feeds["z"] = rng.standard_normal([shape[0], 8, *shape[2:]]).astype(dtype)
    return nhwc, nchw, feeds


def check(provider: str, options: dict, case, dtype) -> None:
    nhwc, nchw, feeds = build(case, dtype)
    s = ox.InferenceSession(nhwc, providers=[(provider, options), CPU])
    eps = {r["node_name"]: r["ep"] for r in s.get_provider_graph_assignment_info()}
    internal = [n.name for n in s._graph.nodes if n.domain == NHWC_DOMAIN]
    assert internal and all(eps[n] == provider for n in internal), eps
    got = s.run(None, feeds)[0]
    want = ox.InferenceSession(nchw, providers=[CPU]).run(None, feeds)[0]
    tol = 1e-4 if dtype == np.float32 else 2e-2
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=tol, atol=tol)


IDS = [f"{c[0]}-{i}" for i, c in enumerate(cases())]


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("case", cases(), ids=IDS)
@pytest.mark.usefixtures("sim")
def test_nhwc_kernel_matches_nchw_on_cpu(case, dtype):
    check(SIM, {}, case, dtype)


@pytest.mark.usefixtures("sim")
def test_nhwc_conv_names_the_node_on_bad_channels():
    nhwc, _, _ = build(cases()[0], np.float32)
    m = onnx.load_from_string(nhwc)
    m.graph.input[0].type.tensor_type.ClearField("shape")
    s = ox.InferenceSession(m.SerializeToString(), providers=[SIM, CPU])
    with pytest.raises(Exception, match="disagree"):
        s.run(None, {"x": np.zeros((2, 5, 9, 9), np.float32)})
