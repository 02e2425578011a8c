"""The CUDA provider's memory on a real GPU: the shared device arena (no cudaMalloc in the
steady state), mempool mode, an external allocator backed by PyTorch's caching allocator,
shrink visible in cudaMemGetInfo, out-of-memory recovery, two sessions sharing one arena.

Marked ``cuda``; skipped where CUDAExecutionProvider is not available. Run with
scripts/gpu-test.sh (or ``python -m pytest -m cuda tests/gpu/test_cuda_memory.py -v``).

The device arena is shared by every session of the process, so tests that need a particular
configuration install a fresh one with ``create_and_register_allocator_v2`` (which takes effect
only when nothing else holds the old arena: the fixture collects garbage first and checks).
"""

from __future__ import annotations

import ctypes
import gc
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from tests.gpu._cuda import CPU, CUDA, cuda_marks

import onnxplug as ox
from onnxplug.errors import OutOfMemory

pytestmark = cuda_marks
MiB = 1 << 20
K, H = 256, 4096


def _model() -> bytes:
    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((K, H)).astype(np.float32) / 16
    w2 = rng.standard_normal((H, K)).astype(np.float32) / 64
    g = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w1"], ["h1"], name="MatMul_h1"),
            helper.make_node("Relu", ["h1"], ["h2"], name="Relu_h2"),
            helper.make_node("MatMul", ["h2", "w2"], ["y"], name="MatMul_y"),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", K])],
        [
            numpy_helper.from_array(w1, "w1"),
            numpy_helper.from_array(w2, "w2"),
        ],
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


MODEL = _model()


def _x(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, K)).astype(np.float32)


def _ref(x: np.ndarray) -> np.ndarray:
    return ox.InferenceSession(MODEL, providers=[CPU]).run(None, {"x": x})[0]


def _session(**options: Any) -> ox.InferenceSession:
    return ox.InferenceSession(MODEL, providers=[(CUDA, {"use_tf32": "0", **options}), CPU])


def _factory() -> Any:
    return next(d.factory for d in _raw_devices() if d.ep_name == CUDA)


def _device_mi() -> ox.OrtMemoryInfo:
    return ox.OrtMemoryInfo("Cuda", ox.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, 0)


def _shared() -> Any:
    mi = next(d.memory_info for d in _raw_devices() if d.ep_name == CUDA)
    return _factory().shared_allocator(mi)


def _mem_free() -> int:
    from cuda.bindings import runtime as rt

    err, free, _total = rt.cudaMemGetInfo()
    assert int(err) == 0
    return int(free)


@pytest.fixture
def device_allocator() -> Iterator[Any]:
    """``install(options)`` replaces the process's device allocator by one configured with
    ``options``; the default is restored afterwards."""

    def install(options: dict[str, str]) -> Any:
        gc.collect()
        with _no_ignored_warning():
            ox.create_and_register_allocator_v2(CUDA, _device_mi(), options, None)
        return _shared()

    yield install
    gc.collect()
    ox.create_and_register_allocator_v2(CUDA, _device_mi(), {}, None)


class _no_ignored_warning:
    """Fail if the new configuration was ignored (something still held the old arena)."""

    def __enter__(self) -> None:
        import warnings

        self._cm = warnings.catch_warnings(record=True)
        self._log = self._cm.__enter__()
        warnings.simplefilter("always")

    def __exit__(self, *exc: Any) -> None:
        self._cm.__exit__(*exc)
        ignored = [w for w in self._log if "ignored" in str(w.message)]
        assert not ignored, f"the device allocator was still in use: {ignored[0].message}"


def test_default_allocator_is_the_device_arena_without_cudamalloc_in_the_steady_state():
    s = _session()
    x = _x(64)
    for _ in range(3):
        np.testing.assert_allclose(s.run(None, {"x": x})[0], _ref(x), rtol=1e-4, atol=1e-4)
    st = s.get_allocator_stats()["cuda:0"]
    assert {"NumArenaExtensions", "NumArenaShrinkages", "TotalAllocated"} <= set(st)
    raw = _shared().raw.get_stats()["NumAllocs"]
    for _ in range(10):
        s.run(None, {"x": x})
    assert _shared().raw.get_stats()["NumAllocs"] == raw  # no cudaMalloc per run
    assert s.get_allocator_stats()["cuda:0"]["NumArenaExtensions"] == st["NumArenaExtensions"]


def test_two_sessions_share_one_arena():
    s1, s2 = _session(), _session()
    x = _x(32)
    s1.run(None, {"x": x})
    s2.run(None, {"x": x})
    assert s1.get_allocator_stats() == s2.get_allocator_stats()
    arena = _shared()
    del s1
    gc.collect()
    assert _shared() is arena
    np.testing.assert_allclose(s2.run(None, {"x": x})[0], _ref(x), rtol=1e-4, atol=1e-4)


def test_mempool_mode(device_allocator):
    pool = device_allocator(
        {"arena.use_cuda_mempool": "1", "arena.cuda_mempool_release_threshold": str(1 * MiB)}
    )
    from onnxplug_cuda.memory import CudaMempoolAllocator

    assert isinstance(pool, CudaMempoolAllocator)
    s = _session()
    x = _x(256)
    for _ in range(3):
        np.testing.assert_allclose(s.run(None, {"x": x})[0], _ref(x), rtol=1e-4, atol=1e-4)
    st = s.get_allocator_stats()["cuda:0"]
    assert st["NumAllocs"] > 0 and st["TotalAllocated"] > 0
    s.shrink_memory_arenas()
    assert s.get_allocator_stats()["cuda:0"]["NumArenaShrinkages"] == 1
    del s


def test_external_allocator_backed_by_pytorch():
    torch = pytest.importorskip("torch")
    calls = {"alloc": 0, "free": 0}

    def alloc(size: int) -> int:
        calls["alloc"] += 1
        return torch.cuda.caching_allocator_alloc(size)

    def free(ptr: int) -> None:
        calls["free"] += 1
        torch.cuda.caching_allocator_delete(ptr)

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    s = _session(
        gpu_external_alloc=alloc,
        gpu_external_free=free,
        gpu_external_empty_cache=torch.cuda.empty_cache,
    )
    assert torch.cuda.memory_allocated() > base  # the initializers live in torch's pool
    plain = _session()  # a session without callbacks: the shared arena, never torch's
    x = _x(64)
    want = _ref(x)
    np.testing.assert_allclose(s.run(None, {"x": x})[0], want, rtol=1e-4, atol=1e-4)
    n = calls["alloc"]
    np.testing.assert_allclose(plain.run(None, {"x": x})[0], want, rtol=1e-4, atol=1e-4)
    assert calls["alloc"] == n
    s.shrink_memory_arenas()  # empty_cache
    del s
    gc.collect()
    torch.cuda.synchronize()
    assert calls["alloc"] == calls["free"]
    assert torch.cuda.memory_allocated() == base


def test_external_allocator_given_as_c_function_addresses():
    torch = pytest.importorskip("torch")
    alloc_t = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t)
    free_t = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
    c_alloc = alloc_t(lambda size: torch.cuda.caching_allocator_alloc(size))
    c_free = free_t(lambda ptr: torch.cuda.caching_allocator_delete(ptr))
    addr = lambda f: str(ctypes.cast(f, ctypes.c_void_p).value)  # noqa: E731
    s = _session(gpu_external_alloc=addr(c_alloc), gpu_external_free=addr(c_free))
    x = _x(16)
    np.testing.assert_allclose(s.run(None, {"x": x})[0], _ref(x), rtol=1e-4, atol=1e-4)
    assert "NumArenaExtensions" not in s.get_allocator_stats()["cuda:0"]
    del s
    gc.collect()


def test_shrink_gives_memory_back_to_the_device(device_allocator):
    arena = device_allocator({})
    s = _session()
    big = _x(16384)  # 256 MiB hidden activations
    for _ in range(2):
        np.testing.assert_allclose(s.run(None, {"x": big})[0], _ref(big), rtol=1e-3, atol=1e-3)
    held = arena.get_stats()["TotalAllocated"]
    assert held > 256 * MiB
    free_before = _mem_free()
    opts = ox.RunOptions()
    opts.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0;gpu:0")
    x = _x(4)
    np.testing.assert_allclose(s.run(None, {"x": x}, opts)[0], _ref(x), rtol=1e-4, atol=1e-4)
    after = arena.get_stats()
    assert after["TotalAllocated"] < held - 200 * MiB and after["NumArenaShrinkages"] > 0
    assert _mem_free() > free_before + 200 * MiB  # visible to the driver (and NVML)
    del s


def test_out_of_memory_names_the_node_and_the_session_recovers(device_allocator):
    device_allocator({"gpu_mem_limit": str(96 * MiB)})  # room for a 32 MiB GEMM workspace
    s = _session()
    x = _x(64)
    for _ in range(2):
        np.testing.assert_allclose(s.run(None, {"x": x})[0], _ref(x), rtol=1e-4, atol=1e-4)
    base = s.get_allocator_stats()["cuda:0"]["InUse"]
    for _ in range(2):
        with pytest.raises(OutOfMemory) as e:
            s.run(None, {"x": _x(8192)})  # 8 MiB input, 128 MiB hidden activations
        assert "MatMul_h1" in str(e.value)
        assert "Failed to allocate memory for requested buffer of size" in str(e.value)
        del e
        assert s.get_allocator_stats()["cuda:0"]["InUse"] == base
        np.testing.assert_allclose(s.run(None, {"x": x})[0], _ref(x), rtol=1e-4, atol=1e-4)
        assert s.get_allocator_stats()["cuda:0"]["InUse"] == base
    del s


def _raw_devices() -> list:
    """The plugins' EP devices themselves (``get_ep_devices`` returns onnxruntime's views)."""
    from onnxplug.session.environment import get_environment

    return get_environment().registry.ep_devices()
