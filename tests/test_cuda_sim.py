"""The CUDA provider's kernels and partitioning, run on the host-simulated CUDA device.

``CUDASimExecutionProvider`` is the real CUDA plugin with numpy in place of CuPy and host
memory in place of device memory (plugins/cuda/src/onnxplug_cuda/sim.py), so CI checks every
CUDA kernel's shape, indexing and dtype logic on the ONNX node suite without a GPU.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import numpy as np
import pytest

import onnxplug as ox

PLUGIN_SRC = Path(__file__).resolve().parents[1] / "plugins" / "cuda" / "src"
SIM = "CUDASimExecutionProvider"


@pytest.fixture(scope="module")
def sim():
    if str(PLUGIN_SRC) not in sys.path:
        sys.path.insert(0, str(PLUGIN_SRC))
    ox.register_execution_provider_library(SIM, "onnxplug_cuda.sim:create_factory")
    yield SIM
    ox.unregister_execution_provider_library(SIM)


def test_sim_provider_is_listed(sim):
    assert sim in ox.get_available_providers()
    devs = [d for d in ox.get_ep_devices() if d.ep_name == sim]
    assert devs and devs[0].ep_metadata["cuda_device_id"] == "0"
    assert devs[0].ep_options == {"device_id": "0"}


@pytest.fixture(scope="module")
def suite(sim):
    from onnxplug.tools.conformance import run_suite

    cpu = {r.name: r for r in run_suite(["CPUExecutionProvider"])}
    # three runs per case: the recording run, the run that binds the prepared calls, and a
    # steady-state run through them
    both = {r.name: r for r in run_suite([sim, "CPUExecutionProvider"], repeats=3)}
    return cpu, both


def test_node_suite_matches_cpu(suite):
    """Every case the CPU provider passes also passes with the CUDA kernels in front."""
    cpu, both = suite
    regressions = {
        n: both[n].message
        for n, r in cpu.items()
        if r.status == "pass" and both[n].status != "pass"
    }
    assert not regressions, "\n".join(f"{n}: {m}" for n, m in sorted(regressions.items()))


def test_node_suite_uses_cuda_kernels(suite):
    _, both = suite
    on_cuda = sum(1 for r in both.values() if r.on_provider)
    assert on_cuda > 0


def test_relu_runs_on_the_cuda_provider(sim):
    from onnx import TensorProto, helper

    g = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    s = ox.InferenceSession(m.SerializeToString(), providers=[sim, "CPUExecutionProvider"])
    x = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    np.testing.assert_array_equal(s.run(None, {"x": x})[0], np.maximum(x, 0))
    eps = {r["node_name"]: r["ep"] for r in s.get_provider_graph_assignment_info()}
    assert eps["Relu_0"] == sim


@pytest.mark.parametrize(
    "options",
    [
        {"use_ep_level_unified_stream": "1"},
        {"gpu_mem_limit": str(1 << 30)},
        {"enable_cuda_graph": "1"},
    ],
)
def test_stream_and_allocator_options_run(sim, options):
    """Unified-stream and per-session-allocator paths (the unified stream once deadlocked:
    creating it under the EP's lock asked the EP for its allocator, which takes that lock)."""
    from onnx import TensorProto, helper

    g = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    s = ox.InferenceSession(
        m.SerializeToString(), providers=[(sim, options), "CPUExecutionProvider"]
    )
    x = np.random.default_rng(1).standard_normal((2, 3)).astype(np.float32)
    for _ in range(3):
        np.testing.assert_array_equal(s.run(None, {"x": x})[0], np.maximum(x, 0))


def _relu_model() -> bytes:
    from onnx import TensorProto, helper

    g = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Sigmoid", ["r"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3])],
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


class _UserStream:
    """A stream of another library (torch.cuda.Stream, a CuPy stream): the CUDA stream
    protocol."""

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


def _frame_streams(sess) -> set:
    """The streams of the kernels of every pooled frame of the session."""
    return {
        ctx.stream
        for sig in sess._runner._signatures.values()
        for f in sig.frames
        for ctx in f.ctxs
        if ctx is not None and ctx.stream is not None
    }


@pytest.mark.parametrize("how", ["providers", "add_provider_for_devices"])
def test_a_user_stream_object_carries_every_run(sim, how):
    from tests.conftest import run_in_threads

    stream = _UserStream(0xABC0)
    if how == "providers":
        s = ox.InferenceSession(
            _relu_model(),
            providers=[(sim, {"user_compute_stream": stream}), "CPUExecutionProvider"],
        )
    else:
        so = ox.SessionOptions()
        dev = next(d for d in ox.get_ep_devices() if d.ep_name == sim)
        so.add_provider_for_devices([dev], {"user_compute_stream": stream})
        s = ox.InferenceSession(_relu_model(), sess_options=so)
    ep = s._eps[0]
    assert ep.options.user_stream_object is stream
    opts = s.get_provider_options()[sim]
    assert opts["user_compute_stream"] == str(0xABC0) and opts["has_user_compute_stream"] == "1"
    # one stream for every run: no concurrent runs advertised, the session takes turns
    assert not ep.is_concurrent_run_supported() and s._run_lock is not None
    xs = [np.random.default_rng(k).standard_normal((k + 1, 3)).astype(np.float32) for k in range(3)]

    def work(k: int) -> None:
        for _ in range(4):
            y = s.run(None, {"x": xs[k]})[0]
            np.testing.assert_allclose(y, 1 / (1 + np.exp(-np.maximum(xs[k], 0))), rtol=1e-6)

    run_in_threads(work, 3)
    streams = _frame_streams(s)
    assert {st.handle for st in streams} == {0xABC0} and len(streams) == 1
    (user,) = streams
    assert not user.frame_owned  # shared by the frames, which never close it


@pytest.mark.parametrize("handle", [0, 1])
def test_a_users_legacy_default_stream_is_joined_by_a_stream_of_the_sessions(sim, handle):
    # PyTorch's default current stream is the legacy default stream (0; 1 is
    # cudaStreamLegacy), which cannot capture a graph: the work goes on a stream of the
    # session's, which every run joins to the user's stream at its start (and end)
    s = ox.InferenceSession(
        _relu_model(),
        providers=[(sim, {"user_compute_stream": _UserStream(handle)}), "CPUExecutionProvider"],
    )
    x = np.random.default_rng(2).standard_normal((4, 3)).astype(np.float32)
    for _ in range(5):
        y = s.run(None, {"x": x})[0]
        np.testing.assert_allclose(y, 1 / (1 + np.exp(-np.maximum(x, 0))), rtol=1e-6)
    (stream,) = _frame_streams(s)
    assert stream.joined == handle and stream.handle not in (0, 1)
    # every run started after the work on the user's stream, which waited for the run at its end
    assert stream.joins == {"waits_for_user": 5, "user_waits": 5}
    assert s.get_provider_options()[sim]["user_compute_stream"] == str(handle)


def test_an_external_allocator_joins_its_blocks_to_the_legacy_default_stream(sim):
    # onnxruntime runs an external allocator's session on the legacy default stream; ours
    # runs on a stream joined to it, and the allocator joins each block too
    blocks: dict[int, np.ndarray] = {}  # the simulated device's memory is the host's

    def alloc(n: int) -> int:
        b = np.empty(max(n, 1), np.uint8)
        blocks[b.ctypes.data] = b
        return b.ctypes.data

    opts = {"gpu_external_alloc": alloc, "gpu_external_free": lambda p: blocks.pop(p)}
    s = ox.InferenceSession(_relu_model(), providers=[(sim, opts), "CPUExecutionProvider"])
    x = np.random.default_rng(3).standard_normal((4, 3)).astype(np.float32)
    for _ in range(3):
        y = s.run(None, {"x": x})[0]
        np.testing.assert_allclose(y, 1 / (1 + np.exp(-np.maximum(x, 0))), rtol=1e-6)
    (stream,) = _frame_streams(s)
    assert stream.joined == 0 and stream.handle != 0
    assert s._eps[0]._external.stream is stream
    assert stream.joins["user_waits"] >= 3 and stream.joins["waits_for_user"] >= 3
    del s, stream
    gc.collect()
    assert not blocks  # every block went back to the user's allocator, the frames' too


class _JoinedStream:
    """What ExternalDeviceAllocator asks of the stream it joins, recording the order."""

    handle = 0xE0
    capturing = False

    def __init__(self, log: list) -> None:
        self.log = log

    def wait_for_user(self) -> None:
        self.log.append("stream waits for user")

    def user_waits(self) -> None:
        self.log.append("user waits for stream")


def test_external_blocks_are_ordered_with_the_users_stream_and_frees_wait_for_a_capture(sim):
    from onnxplug.ep import Device, MemoryInfo
    from onnxplug_cuda import runtime
    from onnxplug_cuda.memory import ExternalDeviceAllocator

    log: list = []

    def alloc(n: int) -> int:
        log.append("user alloc")
        return 0x1000

    info = MemoryInfo("Cuda", Device("cuda", 0))
    a = ExternalDeviceAllocator(info, alloc, lambda p: log.append("user free"))
    a.stream = _JoinedStream(log)
    p = a.alloc(64)
    a.free(p)
    assert log == ["user alloc", "stream waits for user", "user waits for stream", "user free"]
    log.clear()
    p = a.alloc(64)
    runtime.capture_started(a.stream.handle)  # a free while the stream records a graph...
    try:
        a.free(p)
        assert log == ["user alloc", "stream waits for user"]
        assert a.get_stats()["InUse"] == 64
    finally:
        runtime.capture_stopped(a.stream.handle)  # ...happens at the capture's end
    assert log[2:] == ["user waits for stream", "user free"]
    assert a.get_stats()["InUse"] == 0


def test_user_stream_and_external_allocator_fail_at_session_creation(sim):
    from onnxplug.errors import InvalidArgument

    opts = {
        "user_compute_stream": _UserStream(7),
        "gpu_external_alloc": lambda n: 0,
        "gpu_external_free": lambda p: None,
    }
    with pytest.raises(InvalidArgument) as e:
        ox.InferenceSession(_relu_model(), providers=[(sim, opts), "CPUExecutionProvider"])
    assert "'user_compute_stream'" in str(e.value) and "'gpu_external_alloc'" in str(e.value)


@pytest.mark.parametrize("host_api", [2, 3])
def test_concurrent_runs_need_a_host_with_the_kernel_sync_stream(sim, monkeypatch, host_api):
    """The CUDA plugin is written against API 3 and runs on a host of API 2 (its oldest, for
    the device timer), where it does not advertise concurrent runs."""
    from onnxplug.ep import api

    monkeypatch.setattr(api, "API_VERSION", host_api)
    s = ox.InferenceSession(_relu_model(), providers=[sim, "CPUExecutionProvider"])
    factory = s._eps[0].factory
    assert (factory.api_version, factory.min_host_api_version) == (3, 2)
    assert s._eps[0].is_concurrent_run_supported() == (host_api >= 3)
    assert (s._run_lock is None) == (host_api >= 3)


@pytest.mark.parametrize("plugin_api", [1, 2, 3])
def test_a_cuda_plugin_of_an_older_api_runs_with_the_fallback(sim, monkeypatch, plugin_api):
    """The CUDA plugin built for API 1 or 2 (before the kernel sync stream) still loads and
    runs: its kernels see no sync stream, their workspaces are untagged, and its sessions run
    one run at a time (onnxruntime's fallback); built for API 3 it has all three."""
    from tests.conftest import run_in_threads

    factory = next(d.factory for d in ox.get_ep_devices() if d.ep_name == sim)
    monkeypatch.setattr(factory, "api_version", plugin_api)
    s = ox.InferenceSession(_relu_model(), providers=[sim, "CPUExecutionProvider"])
    assert s.get_ep_graph_assignment_summary()[sim] == 2
    new = plugin_api >= 3
    steps = [st for st in s._runner.plan.steps if st.ep_key == sim]
    assert steps and all(st.sync_stream == new for st in steps)
    assert (s._run_lock is None) == new
    kernel = steps[0].kernel
    compute, prepare, seen = kernel.compute, kernel.prepare, []

    def spy(ctx):
        seen.append((ctx.stream, ctx.get_sync_stream()))
        compute(ctx)

    def spy_prepare(ctx):  # a signature's first run and a frame's run the prepared form
        seen.append((ctx.stream, ctx.get_sync_stream()))
        return prepare(ctx)

    monkeypatch.setattr(kernel, "compute", spy)
    monkeypatch.setattr(kernel, "prepare", spy_prepare)
    xs = [np.random.default_rng(k).standard_normal((4, 3)).astype(np.float32) for k in range(4)]
    want = [1 / (1 + np.exp(-np.maximum(x, 0))) for x in xs]
    got: list = [None] * len(xs)

    def work(i: int) -> None:
        got[i] = s.run(None, {"x": xs[i]})[0]

    run_in_threads(work, len(xs))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6)
    assert seen and all(st is not None for st, _ in seen)
    assert all((sync is st) if new else (sync is None) for st, sync in seen)


def test_kernels_warm_up_before_the_initializers_are_uploaded(sim, monkeypatch):
    """Session creation makes the kernels (whose ``warm_up`` starts background compiles)
    before it copies the initializers to the device: a model's weights (BERT-base: 440 MB)
    no longer delay those compiles."""
    from onnx import TensorProto, helper, numpy_helper

    from onnxplug.session import build
    from onnxplug_cuda.kernels.elementwise import Binary

    events: list[str] = []
    real_place = build.place_in_one_block

    def place(*args, **kwargs):
        events.append("upload")
        return real_place(*args, **kwargs)

    monkeypatch.setattr(build, "place_in_one_block", place)
    monkeypatch.setattr(Binary, "warm_up", lambda self: events.append("warm_up"))
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    g = helper.make_graph(
        [helper.make_node("Add", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
        [numpy_helper.from_array(w, "w")],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    s = ox.InferenceSession(m.SerializeToString(), providers=[sim, "CPUExecutionProvider"])
    assert events == ["warm_up", "upload"]
    x = np.ones((2, 3), np.float32)
    np.testing.assert_array_equal(s.run(None, {"x": x})[0], x + w)
