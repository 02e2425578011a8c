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

import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto, helper
from tests.conftest import doc_recipe, run_in_threads
from tests.gpu._cuda import CPU, CUDA, cuda_marks

import onnxplug as ox
from onnxplug.errors import InvalidArgument

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


# torch dtype name -> (the ONNX type an OrtValue reports, numpy dtype of its host copy)
_TORCH_DTYPES = {
    "float32": ("tensor(float)", np.float32),
    "float16": ("tensor(float16)", np.float16),
    "bfloat16": ("tensor(bfloat16)", ml_dtypes.bfloat16),
    "float64": ("tensor(double)", np.float64),
    "int8": ("tensor(int8)", np.int8),
    "uint8": ("tensor(uint8)", np.uint8),
    "int32": ("tensor(int32)", np.int32),
    "int64": ("tensor(int64)", np.int64),
    "bool": ("tensor(bool)", np.bool_),
}


def _bytes(t) -> np.ndarray:
    """A torch tensor's bytes on the host (any dtype, bfloat16 and bool included)."""
    import torch

    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


@pytest.mark.parametrize("dtype", sorted(_TORCH_DTYPES))
def test_dlpack_round_trips_keep_pointer_dtype_and_values(dtype):
    """PyTorch -> OrtValue -> PyTorch in place: the same device pointer (rows of a larger
    tensor: a storage offset), device, shape, dtype and bytes; dropping everything gives
    PyTorch's memory back (the producer's deleter ran, once)."""
    torch = pytest.importorskip("torch")
    onnx_type, np_type = _TORCH_DTYPES[dtype]
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    whole = (torch.arange(5 * 6, device="cuda") % 7 - 3).to(getattr(torch, dtype)).reshape(5, 6)
    t = whole[2:]  # starts 12 elements into its storage
    assert t.storage_offset() == 12 and t.is_contiguous()
    v = ox.OrtValue.from_dlpack(t)
    assert v.device_name() == "cuda" and v.__dlpack_device__() == (2, t.device.index or 0)
    assert v.data_ptr() == t.data_ptr() and v.shape() == [3, 6]
    assert v.data_type() == onnx_type
    host = v.numpy()  # our copy to the host, through the dtype we read
    assert host.dtype == np.dtype(np_type) and host.shape == (3, 6)
    np.testing.assert_array_equal(host.reshape(-1).view(np.uint8), _bytes(t))
    back = torch.from_dlpack(v)
    assert back.data_ptr() == t.data_ptr() and back.dtype == t.dtype
    assert back.device == t.device and tuple(back.shape) == (3, 6)
    assert torch.equal(back, t)
    del whole, t, v, back
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before


def test_strided_pytorch_tensors_are_refused_and_size_one_dims_are_not():
    torch = pytest.importorskip("torch")
    sess = ox.InferenceSession(_mlp(), providers=[(CUDA, {"use_tf32": "0"})])
    strided = [
        torch.randn(16, 5, device="cuda").T,  # (5, 16), strides (1, 5)
        torch.randn(5, 32, device="cuda")[:, ::2],  # strides (32, 2)
        torch.randn(5, 20, device="cuda")[:, :16],  # rows 20 apart
        torch.randn(1, 16, device="cuda").expand(5, 16),  # stride 0
    ]
    for x in strided:
        assert not x.is_contiguous()
        with pytest.raises(InvalidArgument, match="contiguous"):
            sess.run(None, {"x": x})
    col = torch.randn(16, 1, device="cuda")
    row = col.T  # (1, 16) with strides (1, 1): dense, a size-1 dim may have any stride
    assert row.is_contiguous() and row.data_ptr() == col.data_ptr()
    np.testing.assert_allclose(
        sess.run(None, {"x": row})[0], _reference(row.cpu().numpy()), rtol=1e-5, atol=1e-6
    )


def _pending(torch, stream, want):
    """A tensor whose value ``want`` is written on ``stream`` only after a long sleep there:
    until then it holds NaN. Whoever reads it without waiting for ``stream`` sees NaN."""
    x = torch.full(want.shape, float("nan"), device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(100_000_000)  # tens of milliseconds of GPU time
        x.copy_(want)
    return x


def test_an_input_with_work_pending_on_the_producers_stream_is_read_after_it():
    """The import handshake: the session passes its import stream to ``__dlpack__`` and
    PyTorch makes it wait for its current stream; the run waits for the import stream."""
    torch = pytest.importorskip("torch")
    sess = ox.InferenceSession(_mlp(), providers=[(CUDA, {"use_tf32": "0"})])
    want = torch.randn(64, 16, device="cuda")
    side = torch.cuda.Stream()
    x = _pending(torch, side, want)
    with torch.cuda.stream(side):  # PyTorch orders the work of its current stream
        (y,) = sess.run(None, {"x": x})
    assert not np.isnan(y).any()
    np.testing.assert_allclose(y, _reference(want.cpu().numpy()), rtol=1e-5, atol=1e-5)


def test_a_re_exported_tensor_makes_the_consumers_stream_wait_for_the_pending_work():
    """The export handshake: an imported tensor handed to PyTorch on another stream
    (``__dlpack__(stream=...)``) makes that stream wait for the producer's pending work."""
    torch = pytest.importorskip("torch")
    want = torch.randn(32, 16, device="cuda")
    side, other = torch.cuda.Stream(), torch.cuda.Stream()
    x = _pending(torch, side, want)
    with torch.cuda.stream(side):
        v = ox.OrtValue.from_dlpack(x)
    with torch.cuda.stream(other):
        back = torch.from_dlpack(v)  # other waits for the import, which waited for side
        doubled = back * 2
    other.synchronize()
    assert back.data_ptr() == x.data_ptr()
    assert not torch.isnan(doubled).any()
    assert torch.equal(doubled, want * 2)
    side.synchronize()


def test_session_outputs_go_to_pytorch_in_place_and_iobinding_reads_dlpack_inputs():
    torch = pytest.importorskip("torch")
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


def test_cuda_array_interface_inputs_are_read_after_the_producers_stream():
    """``__cuda_array_interface__`` (version 3) names the stream where the producer's work is
    pending: the session's import stream waits for it, and the run for the import stream."""
    cp = pytest.importorskip("cupy")
    torch = pytest.importorskip("torch")

    class OnlyCAI:  # Numba-like: no DLPack
        def __init__(self, a):
            self._a = a
            self.__cuda_array_interface__ = a.__cuda_array_interface__

    sess = ox.InferenceSession(_mlp(), providers=[(CUDA, {"use_tf32": "0"})])
    s = cp.cuda.Stream(non_blocking=True)
    want = cp.random.standard_normal((7, 16), dtype=cp.float32) * 2
    a = cp.full((7, 16), cp.nan, dtype=cp.float32)
    cp.cuda.Device().synchronize()
    with torch.cuda.stream(torch.cuda.ExternalStream(s.ptr)):
        torch.cuda._sleep(100_000_000)  # on s: the write below waits for it
    with s:
        a[...] = want
        x = OnlyCAI(a)
    assert x.__cuda_array_interface__.get("stream") == s.ptr
    (y,) = sess.run_with_ort_values(None, {"x": x})
    got = y.numpy()
    assert not np.isnan(got).any()
    np.testing.assert_allclose(got, _reference(cp.asnumpy(want)), rtol=1e-5, atol=1e-6)


def _convs() -> tuple[bytes, np.ndarray]:
    """Conv -> Relu -> Conv: cuDNN convolutions, whose prepared form is a captured graph."""
    from onnx import numpy_helper

    rng = np.random.default_rng(5)
    w1 = numpy_helper.from_array(rng.standard_normal((8, 3, 3, 3)).astype(np.float32), "w1")
    w2 = numpy_helper.from_array(rng.standard_normal((4, 8, 3, 3)).astype(np.float32), "w2")
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("Conv", ["r", "w2"], ["y"], pads=[1, 1, 1, 1]),
    ]
    g = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [w1, w2],
    )
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    return model, rng.standard_normal((1, 3, 16, 16)).astype(np.float32)


@pytest.mark.parametrize("graphs", ["0", "1"])
def test_a_session_on_pytorchs_legacy_default_stream_captures_on_a_joined_stream(graphs):
    """PyTorch's default current stream is the legacy default stream (handle 0), which
    cannot capture a CUDA graph. The session works on a stream of its own joined to it at
    each run's start and end: node graphs, eager segments and enable_cuda_graph all work
    (the graph case failed the run before), and PyTorch's work before and after a run on its
    stream is ordered with the run's without a synchronisation."""
    torch = pytest.importorskip("torch")
    model, x = _convs()
    want = ox.InferenceSession(model, providers=[CPU]).run(None, {"x": x})[0]
    stream = torch.cuda.current_stream()
    assert stream.cuda_stream == 0
    opts = {"user_compute_stream": stream, "enable_cuda_graph": graphs, "use_tf32": "0"}
    sess = ox.InferenceSession(model, providers=[(CUDA, opts)])
    assert sess.get_provider_options()[CUDA]["user_compute_stream"] == "0"
    xt = torch.from_numpy(x).cuda()
    torch.cuda.synchronize()
    got = []
    for _ in range(6):
        torch.cuda._sleep(20_000_000)  # PyTorch's work still running on the stream...
        xin = xt * 1.0  # ...before the input is written
        (y,) = sess.run_with_ort_values(None, {"x": xin})
        got.append(torch.from_dlpack(y) * 2)  # after the run's work, without a sync
    torch.cuda.synchronize()
    for z in got:
        np.testing.assert_allclose(z.cpu().numpy(), 2 * want, rtol=1e-4, atol=1e-4)
    ep = next(e for e in sess._eps if e.name == CUDA)
    assert ep._unified.joined == 0 and ep._unified.handle not in (0, 1)
    if graphs == "1":
        assert [st[2] for st in sess._runner.capture.states()] == ["captured"]
    else:
        frame = next(iter(sess._runner._signatures.values())).frames[0]
        assert any(step[1] is None for step in frame.program)  # the convs' graphs as one


@pytest.mark.parametrize("graphs", ["0", "1"])
def test_an_external_allocator_session_captures_on_a_stream_joined_to_the_legacy_one(graphs):
    """An external allocator orders its blocks on the legacy default stream, which onnxruntime
    runs the session on; that stream cannot capture. The session works on a stream joined to
    it, node graphs, eager segments and enable_cuda_graph work (the graph case failed the
    run before), and every block goes back to the user's allocator."""
    import warnings

    from cupy.cuda import runtime

    blocks: set[int] = set()  # cudaMalloc's (CuPy's allocator is the session's during a run)

    def alloc(n: int) -> int:
        ptr = runtime.malloc(max(n, 1))
        blocks.add(ptr)
        return ptr

    def free(ptr: int) -> None:
        blocks.remove(ptr)
        runtime.free(ptr)

    model, x = _convs()
    want = ox.InferenceSession(model, providers=[CPU]).run(None, {"x": x})[0]
    opts = {
        "gpu_external_alloc": alloc,
        "gpu_external_free": free,
        "enable_cuda_graph": graphs,
        "use_tf32": "0",
    }
    s = ox.InferenceSession(model, providers=[(CUDA, opts)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no capture abandoned
        for _ in range(5):
            np.testing.assert_allclose(s.run(None, {"x": x})[0], want, rtol=1e-4, atol=1e-4)
    ep = next(e for e in s._eps if e.name == CUDA)
    assert ep._unified.joined == 0 and ep._unified.handle not in (0, 1)
    assert ep._external.stream is ep._unified
    if graphs == "1":
        assert [st[2] for st in s._runner.capture.states()] == ["captured"]
    else:
        program = next(iter(s._runner._signatures.values())).frames[0].program
        assert any(step[1] is None for step in program)  # the convs' graphs as one
        del program  # (what the frame ran: it keeps the frame's graphs)
    del s, ep
    gc.collect()
    assert not blocks  # every block went back to the user's allocator
