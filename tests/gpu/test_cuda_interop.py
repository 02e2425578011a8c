"""Streams, interop and concurrency on a real GPU, with PyTorch (and CuPy): a session on
PyTorch's stream interleaved with PyTorch ops and no synchronisation, the external-allocator
recipe of docs/providers/cuda.md, 8 threads x 200 runs of BERT-base bit-identical to sequential
runs, and DLPack / ``__cuda_array_interface__`` round trips that keep the device pointer.

Marked ``cuda``; skipped where CUDAExecutionProvider is not available. Run with
scripts/gpu-test.sh (or ``python -m pytest -m cuda tests/gpu/test_cuda_interop.py``).
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper
from tests.conftest import doc_recipe, run_in_threads
from tests.gpu._cuda import CPU, CUDA, cuda_marks

import onnxplug as ox

pytestmark = cuda_marks

ROOT = Path(__file__).resolve().parents[2]


def _mlp() -> bytes:
    """y = Relu(x @ w + b), x[n, 16], fixed weights."""
    rng = np.random.default_rng(0)
    w = helper.make_tensor("w", TensorProto.FLOAT, [16, 8], rng.standard_normal(128).tolist())
    b = helper.make_tensor("b", TensorProto.FLOAT, [8], rng.standard_normal(8).tolist())
    g = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["h"]),
            helper.make_node("Add", ["h", "b"], ["hb"]),
            helper.make_node("Relu", ["hb"], ["y"]),
        ],
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 8])],
        [w, b],
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def _reference(x: np.ndarray) -> np.ndarray:
    return ox.InferenceSession(_mlp(), providers=[CPU]).run(None, {"x": x})[0]


@pytest.mark.parametrize("which", ["current", "side"])
def test_session_on_pytorchs_stream_interleaved_with_torch_ops_without_syncs(which):
    torch = pytest.importorskip("torch")
    stream = torch.cuda.current_stream() if which == "current" else torch.cuda.Stream()
    sess = ox.InferenceSession(
        _mlp(), providers=[(CUDA, {"user_compute_stream": stream, "use_tf32": "0"})]
    )
    assert sess.get_provider_options()[CUDA]["user_compute_stream"] == str(stream.cuda_stream)
    got, inputs = [], []
    with torch.cuda.stream(stream):
        for k in range(20):
            # queued on the stream, no synchronisation: the session must read x after it
            x = torch.randn(64 + k, 16, device="cuda") * 3 - 1
            (y,) = sess.run_with_ort_values(None, {"x": x})
            assert y.device_name() == "cuda"
            z = torch.from_dlpack(y) * 2  # PyTorch reads the output in place, on the stream
            got.append(z)
            inputs.append(x)
    torch.cuda.synchronize()
    for x, z in zip(inputs, got):
        np.testing.assert_allclose(
            z.cpu().numpy(), 2 * _reference(x.cpu().numpy()), rtol=1e-5, atol=1e-5
        )
    del sess
    gc.collect()
    stream.synchronize()  # still PyTorch's live stream: the session never destroyed it


def test_a_pytorch_stream_with_cuda_graphs_captures_and_replays_on_it():
    torch = pytest.importorskip("torch")
    stream = torch.cuda.Stream()
    sess = ox.InferenceSession(
        _mlp(),
        providers=[
            (CUDA, {"user_compute_stream": stream, "enable_cuda_graph": "1", "use_tf32": "0"})
        ],
    )
    x = np.random.default_rng(1).standard_normal((4, 16)).astype(np.float32)
    for _ in range(4):
        np.testing.assert_allclose(sess.run(None, {"x": x})[0], _reference(x), rtol=1e-5)
    assert [s[2] for s in sess._runner.capture.states()] == ["captured"]
    del sess
    gc.collect()
    stream.synchronize()


def test_the_external_allocator_recipe_allocates_from_pytorchs_pool_instead_of_ours():
    torch = pytest.importorskip("torch")
    ep_device = next(d for d in ox.get_ep_devices() if d.ep_name == CUDA).ep_device
    factory, memory_info = ep_device.factory, ep_device.memory_info

    def ours() -> int:  # bytes our shared device arena took from the device
        arena = factory.shared_allocator(memory_info)
        return 0 if arena is None else arena.get_stats().get("TotalAllocated", 0)

    ours_before = ours()
    torch.cuda.synchronize()
    torch_before = torch.cuda.memory_allocated()
    scope: dict = {"__name__": "recipe"}
    recipe = doc_recipe("docs/providers/cuda.md", "external-allocator")
    exec(compile(recipe, "docs/providers/cuda.md (recipe)", "exec"), scope)
    sess = scope.pop("sess")  # (the recipe's lambda keeps ``scope``, its globals, alive)
    assert scope["grown"] > 0 and torch.cuda.memory_allocated() > torch_before
    np.testing.assert_allclose(scope["probabilities"].sum(axis=1), 1.0, rtol=1e-5)
    assert "NumArenaExtensions" not in sess.get_allocator_stats()["cuda:0"]  # no arena
    assert ours() == ours_before  # nothing came from our device arena
    del sess
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == torch_before


def _bert(tmp_path_factory) -> tuple[str, dict[str, np.ndarray]]:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import models  # benchmarks/models.py: exported as the benchmarks export it

    out = os.environ.get("ONNXPLUG_MODELS") or str(tmp_path_factory.mktemp("models"))
    models.export_all(out, ["bert_base"], batches=(1,))
    return models.model_path(out, "bert_base", 1), models.feeds_for("bert_base", 1)


@pytest.mark.parametrize("graphs", ["0", "1"])
def test_eight_threads_times_200_runs_of_bert_base_are_bit_identical(tmp_path_factory, graphs):
    path, feeds = _bert(tmp_path_factory)
    sess = ox.InferenceSession(path, providers=[(CUDA, {"enable_cuda_graph": graphs}), CPU])
    rng = np.random.default_rng(5)
    inputs = [
        {**feeds, "input_ids": rng.integers(0, 30000, feeds["input_ids"].shape).astype(np.int64)}
        for _ in range(8)
    ]
    want = [sess.run(None, f) for f in inputs]  # sequential

    def work(k: int) -> None:
        for i in range(200):
            j = (k + i) % len(inputs)
            for a, b in zip(sess.run(None, inputs[j]), want[j]):
                np.testing.assert_array_equal(a, b)

    run_in_threads(work, 8)


def test_dlpack_round_trips_keep_the_device_pointer():
    torch = pytest.importorskip("torch")
    t = torch.arange(24, dtype=torch.float32, device="cuda").reshape(4, 6)
    v = ox.OrtValue.from_dlpack(t)
    assert v.device_name() == "cuda" and v.__dlpack_device__() == (2, t.device.index or 0)
    assert v.data_ptr() == t.data_ptr()
    back = torch.from_dlpack(v)
    assert back.data_ptr() == t.data_ptr()
    np.testing.assert_array_equal(back.cpu().numpy(), t.cpu().numpy())
    # an output handed to PyTorch in place
    sess = ox.InferenceSession(_mlp(), providers=[(CUDA, {"use_tf32": "0"})])
    x = torch.randn(5, 16, device="cuda")
    (y,) = sess.run_with_ort_values(None, {"x": x})
    ty = torch.from_dlpack(y)
    assert ty.data_ptr() == y.data_ptr()
    np.testing.assert_allclose(ty.cpu().numpy(), _reference(x.cpu().numpy()), rtol=1e-5)
    # an input used in place: IOBinding with a DLPack value
    io = sess.io_binding()
    io.bind_ortvalue_input("x", ox.OrtValue.from_dlpack(x))
    io.bind_output("y", "cuda", 0)
    sess.run_with_iobinding(io)
    np.testing.assert_allclose(
        io.copy_outputs_to_cpu()[0], _reference(x.cpu().numpy()), rtol=1e-5, atol=1e-6
    )
    del ty, y
    gc.collect()


def test_cuda_array_interface_inputs_are_used_in_place():
    cp = pytest.importorskip("cupy")

    class OnlyCAI:  # Numba-like: no DLPack
        def __init__(self, a):
            self._a = a
            self.__cuda_array_interface__ = a.__cuda_array_interface__

    sess = ox.InferenceSession(_mlp(), providers=[(CUDA, {"use_tf32": "0"})])
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        a = cp.random.standard_normal((7, 16), dtype=cp.float32) * 2  # pending on s
        (y,) = sess.run_with_ort_values(None, {"x": OnlyCAI(a)})
    np.testing.assert_allclose(y.numpy(), _reference(cp.asnumpy(a)), rtol=1e-5, atol=1e-6)
