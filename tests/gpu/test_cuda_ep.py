"""The CUDA provider on a real GPU: devices, options, placement, copies, values, streams.

Marked ``cuda``; skipped where CUDAExecutionProvider is not available. Run with
scripts/gpu-test.sh.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper
from tests.conftest import run_in_threads

import onnxplug as ox
from onnxplug.errors import InvalidArgument

CUDA = "CUDAExecutionProvider"
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(CUDA not in ox.get_available_providers(), reason="no usable CUDA device"),
]


def _model(nodes, inputs, outputs, opset=17) -> bytes:
    g = helper.make_graph(nodes, "g", inputs, outputs)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)]).SerializeToString()


def _f(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


MLP = _model(
    [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("Add", ["h", "b"], ["hb"]),
        helper.make_node("Relu", ["hb"], ["y"]),
    ],
    [_f("x", ["n", 16]), _f("w", [16, 8]), _f("b", [8])],
    [_f("y", ["n", 8])],
)


def _feeds(n=4, seed=0):
    rng = np.random.default_rng(seed)
    return {
        "x": rng.standard_normal((n, 16)).astype(np.float32),
        "w": rng.standard_normal((16, 8)).astype(np.float32),
        "b": rng.standard_normal(8).astype(np.float32),
    }


def _ref(f):
    return np.maximum(f["x"].astype(np.float64) @ f["w"] + f["b"], 0)


def _eps(sess):
    return {r["node_name"]: r["ep"] for r in sess.get_provider_graph_assignment_info()}


def test_devices_have_metadata_and_options():
    devs = [d for d in ox.get_ep_devices() if d.ep_name == CUDA]
    assert devs
    for d in devs:
        assert set(d.ep_metadata) >= {
            "cuda_device_id",
            "cuda_device_name",
            "cuda_compute_capability",
        }
        assert d.ep_options["device_id"] == d.ep_metadata["cuda_device_id"]
        major, minor = d.ep_metadata["cuda_compute_capability"].split(".")
        assert int(major) >= 5 and int(minor) >= 0


def test_all_nodes_on_cuda_and_results_match():
    s = ox.InferenceSession(MLP, providers=[(CUDA, {"use_tf32": "0"}), "CPUExecutionProvider"])
    eps = _eps(s)
    assert all(eps[n] == CUDA for n in ("MatMul_0", "Add_1", "Relu_2")), eps
    f = _feeds()
    np.testing.assert_allclose(s.run(None, f)[0], _ref(f), rtol=1e-4, atol=1e-5)
    assert s.get_providers() == [CUDA, "CPUExecutionProvider"]


def test_provider_options_round_trip_and_errors():
    s = ox.InferenceSession(
        MLP, providers=[(CUDA, {"use_tf32": "0", "cudnn_conv_algo_search": "HEURISTIC"})]
    )
    o = s.get_provider_options()[CUDA]
    assert (
        o["use_tf32"] == "0"
        and o["cudnn_conv_algo_search"] == "HEURISTIC"
        and o["device_id"] == "0"
    )
    with pytest.raises(InvalidArgument, match="use_tf32"):
        ox.InferenceSession(MLP, providers=[(CUDA, {"use_tf32": "sometimes"})])
    with pytest.raises(InvalidArgument, match="device_id"):
        ox.InferenceSession(MLP, providers=[(CUDA, {"device_id": "99"})])


def test_add_provider_for_devices():
    dev = next(d for d in ox.get_ep_devices() if d.ep_name == CUDA)
    so = ox.SessionOptions()
    so.add_provider_for_devices([dev], {"use_tf32": "0"})
    s = ox.InferenceSession(MLP, so)
    assert s.get_providers()[0] == CUDA
    assert s.get_provider_options()[CUDA]["use_tf32"] == "0"
    f = _feeds()
    np.testing.assert_allclose(s.run(None, f)[0], _ref(f), rtol=1e-4, atol=1e-5)


def test_copies_at_the_cpu_cuda_boundary():
    m = _model(
        [
            helper.make_node("Relu", ["x"], ["r"]),
            helper.make_node("Shape", ["r"], ["s"]),
            helper.make_node("Reshape", ["r", "s"], ["y"]),
            helper.make_node("Cos", ["y"], ["z"]),
        ],
        [_f("x", [2, 3])],
        [_f("z", [2, 3])],
    )
    s = ox.InferenceSession(m, providers=[CUDA, "CPUExecutionProvider"])
    eps = _eps(s)
    assert eps["Relu_0"] == CUDA and eps["Shape_1"] == "CPUExecutionProvider"
    x = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    np.testing.assert_allclose(s.run(None, {"x": x})[0], np.cos(np.maximum(x, 0)), rtol=1e-6)


def test_ortvalue_on_cuda_and_iobinding():
    s = ox.InferenceSession(MLP, providers=[(CUDA, {"use_tf32": "0"}), "CPUExecutionProvider"])
    f = _feeds(n=3)
    io = s.io_binding()
    for k, v in f.items():
        io.bind_ortvalue_input(k, ox.OrtValue.ortvalue_from_numpy(v, "cuda", 0))
    io.bind_output("y", "cuda", 0)
    s.run_with_iobinding(io)
    y = io.get_outputs()[0]
    assert y.device_name() == "cuda" and y.shape() == [3, 8]
    np.testing.assert_allclose(y.numpy(), _ref(f), rtol=1e-3, atol=1e-4)
    out = ox.OrtValue.ortvalue_from_shape_and_type([3, 8], np.float32, "cuda", 0)
    io.bind_ortvalue_output("y", out)
    s.run_with_iobinding(io)
    np.testing.assert_allclose(out.numpy(), _ref(f), rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(io.copy_outputs_to_cpu()[0], _ref(f), rtol=1e-3, atol=1e-4)


def test_dlpack_with_cupy():
    cp = pytest.importorskip("cupy")
    a = cp.arange(12, dtype=cp.float32).reshape(3, 4)
    v = ox.OrtValue.from_dlpack(a)
    assert v.device_name() == "cuda" and v.data_ptr() == a.data.ptr
    b = cp.from_dlpack(v)
    assert b.data.ptr == a.data.ptr
    np.testing.assert_array_equal(cp.asnumpy(b), np.arange(12, dtype=np.float32).reshape(3, 4))


def test_concurrent_runs_on_separate_streams():
    s = ox.InferenceSession(MLP, providers=[(CUDA, {"use_tf32": "0"})])

    def work(seed: int) -> None:
        for k in range(20):
            f = _feeds(n=8 + seed, seed=seed * 100 + k)
            np.testing.assert_allclose(s.run(None, f)[0], _ref(f), rtol=1e-4, atol=1e-5)

    run_in_threads(work, 4)


def test_user_compute_stream_from_torch():
    torch = pytest.importorskip("torch")
    stream = torch.cuda.Stream()
    s = ox.InferenceSession(
        MLP, providers=[(CUDA, {"user_compute_stream": str(stream.cuda_stream), "use_tf32": "0"})]
    )
    assert s.get_provider_options()[CUDA]["user_compute_stream"] == str(stream.cuda_stream)
    f = _feeds()
    np.testing.assert_allclose(s.run(None, f)[0], _ref(f), rtol=1e-4, atol=1e-5)


def test_memory_stats_and_limit():
    s = ox.InferenceSession(MLP, providers=[(CUDA, {"gpu_mem_limit": str(1 << 30)})])
    f = _feeds()
    s.run(None, f)
    alloc = next(iter(s._runner.plan.allocators.values()))
    stats = alloc.get_stats()
    assert stats["NumAllocs"] > 0 and stats["MaxInUse"] > 0
