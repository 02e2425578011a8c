"""Memory end to end, without a GPU: the shared per-device arena of the virtual device
(VirtualDeviceArenaExecutionProvider) and of the host-simulated CUDA provider; arena options at
session and environment level, ``create_and_register_allocator``, reference counting, shrink
(run option and session method), statistics, out of memory naming the node, per-session
external allocators, the mempool fallback, zero allocations in the steady state, and
concurrent runs on streams sharing the arena."""

from __future__ import annotations

import gc
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import onnxplug as ox
from onnxplug.errors import InvalidArgument, OutOfMemory, RuntimeException
from onnxplug.session.environment import get_environment
from onnxplug.session.memory import parse_shrink_spec
from tests.conftest import run_in_threads
from tests.plugins import virtual_device as vd
from tests.plugins.graphs import gemm_chain, make_model, tensor

CPU = "CPUExecutionProvider"
ARENA = vd.ARENA_NAME
SIM = "CUDASimExecutionProvider"
PLUGIN_SRC = Path(__file__).resolve().parents[1] / "plugins" / "cuda" / "src"
MiB = 1 << 20
K, H = 64, 1024  # input/output width, hidden width of the chain model


def chain_model() -> bytes:
    """x[N,K] -> MatMul -> Relu -> MatMul -> Add -> y[N,K], every node on the device; the
    hidden activations are 16 times the size of the input."""
    nodes, inits = gemm_chain(K, H)
    return make_model(nodes, [tensor("x", ["N", K])], [tensor("y", ["N", K])], inits)


CHAIN = chain_model()


def rand(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, K)).astype(np.float32)


def reference(x: np.ndarray) -> np.ndarray:
    return ox.InferenceSession(CHAIN, providers=[CPU]).run(None, {"x": x})[0]


def session(provider: str = ARENA, **options: str) -> ox.InferenceSession:
    return ox.InferenceSession(CHAIN, providers=[(provider, options), CPU])


def gone(*sessions: ox.InferenceSession) -> None:
    """Drop the caller's sessions (the caller deletes its names) and collect them."""
    del sessions
    gc.collect()


@pytest.fixture
def env_config() -> Iterator[dict[str, str]]:
    """The environment's config entries, restored afterwards."""
    env = get_environment()
    saved = dict(env.config)
    yield env.config
    env.config.clear()
    env.config.update(saved)


@pytest.fixture
def sim() -> Iterator[object]:
    """A fresh host-simulated CUDA provider (its own shared-arena cache) for one test."""
    if str(PLUGIN_SRC) not in sys.path:
        sys.path.insert(0, str(PLUGIN_SRC))
    ox.register_execution_provider_library(SIM, "onnxplug_cuda.sim:create_factory")
    try:
        yield next(d.factory for d in ox.get_ep_devices() if d.ep_name == SIM)
    finally:
        ox.unregister_execution_provider_library(SIM)


# ---------------------------------------------------------------------------------------------
# initializers on a device: one block


def test_a_devices_initializers_share_one_aligned_block(sim):
    """The chain's three initializers are placed in one reserved block, each 256 bytes
    aligned within it and apart from the others; results are the CPU provider's."""
    from onnxplug.framework.memory import BLOCK_ALIGN, DeviceTensor

    s = session(SIM)
    x = rand(8)
    np.testing.assert_allclose(s.run(None, {"x": x})[0], reference(x), rtol=1e-5, atol=1e-5)
    assert s.get_allocator_stats()["cudasim:0"]["NumReserves"] == 1
    consts = [v for v in s._runner.plan.constants.values() if isinstance(v, DeviceTensor)]
    assert len(consts) == 3
    assert len({id(t.memory) for t in consts}) == 1  # one block owns them all
    block = consts[0].memory
    spans = sorted((t.ptr, t.ptr + t.nbytes) for t in consts)
    assert all((p - block.ptr) % BLOCK_ALIGN == 0 for p, _ in spans)
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))  # no overlap
    assert spans[0][0] >= block.ptr and spans[-1][1] <= block.ptr + block.nbytes
    del s


# ---------------------------------------------------------------------------------------------
# one arena per device, shared and reference-counted


def test_sessions_share_the_device_arena_and_release_it(virt_arena):
    s1, s2 = session(), session()
    x = rand(8)
    np.testing.assert_allclose(s1.run(None, {"x": x})[0], reference(x), rtol=1e-5, atol=1e-5)
    s2.run(None, {"x": x})
    arena = virt_arena.arena()
    assert arena is not None and virt_arena.arenas.refs(("Virt", 2)) == 2
    st1, st2 = s1.get_allocator_stats(), s2.get_allocator_stats()
    assert list(st1) == ["virt:2"] and st1 == st2  # one arena: the same figures
    del s1
    gc.collect()
    assert virt_arena.arenas.refs(("Virt", 2)) == 1
    del s2
    gc.collect()
    assert virt_arena.arena() is None  # the last session closed it
    assert virt_arena.allocator.get_stats()["InUse"] == 0  # every region went back


def test_arena_options_at_session_level(virt_arena):
    s = session(**{"arena.max_mem": str(64 * MiB), "arena.initial_chunk_size_bytes": "65536"})
    s.run(None, {"x": rand(4)})
    assert s.get_allocator_stats()["virt:2"]["Limit"] == 64 * MiB
    assert virt_arena.arena().dump()["regions"][0][1] == 65536  # the first extension


def test_options_for_an_existing_shared_arena_are_ignored_with_a_warning(virt_arena):
    s1 = session(**{"arena.max_mem": str(64 * MiB)})
    with pytest.warns(RuntimeWarning, match="already exists; this session's arena options are"):
        s2 = session(**{"arena.max_mem": str(32 * MiB)})
    assert s2.get_allocator_stats()["virt:2"]["Limit"] == 64 * MiB
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s3 = session(**{"arena.max_mem": str(64 * MiB)})  # the same settings: nothing ignored
        s4 = session()
    del s1, s2, s3, s4


def test_invalid_arena_option_names_the_key(virt_arena):
    with pytest.raises(InvalidArgument, match="arena.max_mem") as e:
        session(**{"arena.max_mem": "-1"})
    assert ARENA in str(e.value)
    with pytest.raises(InvalidArgument, match="unknown arena option 'arena.max_memory'"):
        session(**{"arena.max_memory": "1"})


def test_environment_config_configures_the_arena(virt_arena, env_config):
    ox.add_environment_config_entry(f"ep_factory.{ARENA}.arena.max_mem", str(48 * MiB))
    assert ox.get_environment_config_entries()[f"ep_factory.{ARENA}.arena.max_mem"] == str(48 * MiB)
    s = session()
    assert s.get_allocator_stats()["virt:2"]["Limit"] == 48 * MiB
    del s
    gc.collect()
    # the session's own options win over the environment's
    s = session(**{"arena.max_mem": str(40 * MiB)})
    assert s.get_allocator_stats()["virt:2"]["Limit"] == 40 * MiB


def test_create_and_register_allocator(virt_arena):
    mi = ox.OrtMemoryInfo("Virt", ox.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 2, ox.OrtMemType.DEFAULT)
    cfg = ox.OrtArenaCfg(16 * MiB, 1, -1, -1)
    assert (cfg.max_mem, cfg.arena_extend_strategy, cfg.initial_chunk_size_bytes) == (
        16 * MiB,
        1,
        -1,
    )
    ox.create_and_register_allocator(mi, cfg)
    opts = ox.SessionOptions()
    opts.add_session_config_entry("session.use_env_allocators", "1")
    s = ox.InferenceSession(CHAIN, opts, providers=[ARENA, CPU])
    x = rand(4)
    np.testing.assert_allclose(s.run(None, {"x": x})[0], reference(x), rtol=1e-5, atol=1e-5)
    assert s.get_allocator_stats()["virt:2"]["Limit"] == 16 * MiB
    assert session().get_allocator_stats()["virt:2"]["Limit"] == 16 * MiB  # shared either way
    # sessions still hold the arena: a new configuration is ignored, with a warning
    with pytest.warns(RuntimeWarning, match="options are ignored"):
        ox.create_and_register_allocator(mi, ox.OrtArenaCfg({"max_mem": 8 * MiB}))
    del s
    gc.collect()
    # nothing holds the old arena any more: the next configuration takes effect
    ox.create_and_register_allocator(mi, ox.OrtArenaCfg({"max_mem": 8 * MiB}))
    assert session().get_allocator_stats()["virt:2"]["Limit"] == 8 * MiB


def test_create_and_register_allocator_errors_and_cpu(virt_arena):
    cpu = ox.OrtMemoryInfo("Cpu", ox.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ox.OrtMemType.DEFAULT)
    ox.create_and_register_allocator(cpu, ox.OrtArenaCfg(0, -1, -1, -1))  # accepted, no effect
    with pytest.raises(InvalidArgument, match="arena.initial_chunk_size_bytes"):
        ox.create_and_register_allocator(cpu, ox.OrtArenaCfg({"initial_chunk_size_bytes": 0}))
    with pytest.raises(InvalidArgument, match="unknown key 'max_memory'"):
        ox.OrtArenaCfg({"max_memory": 1})
    nowhere = ox.OrtMemoryInfo("Virt", ox.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 7, 0)
    with pytest.raises(InvalidArgument, match="no execution provider offers memory 'Virt'"):
        ox.create_and_register_allocator(nowhere, None)
    mi = ox.OrtMemoryInfo("Virt", ox.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 2, 0)
    with pytest.raises(InvalidArgument, match="belongs to VirtualDeviceArenaExecutionProvider"):
        ox.create_and_register_allocator_v2(SIM, mi, {}, None)


# ---------------------------------------------------------------------------------------------
# shrink and statistics


def test_shrink_after_a_large_input_gives_memory_back(virt_arena):
    s = session()
    s.run(None, {"x": rand(4)})
    small = s.get_allocator_stats()["virt:2"]["TotalAllocated"]
    s.run(None, {"x": rand(4096)})  # 16 MiB hidden activations
    s.run(None, {"x": rand(4096)})  # and the signature's memory plan
    large = s.get_allocator_stats()["virt:2"]
    assert large["TotalAllocated"] > small + 8 * MiB
    raw_before = virt_arena.allocator.get_stats()["InUse"]
    opts = ox.RunOptions()
    opts.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0;virt:2")
    x = rand(4)
    np.testing.assert_allclose(s.run(None, {"x": x}, opts)[0], reference(x), rtol=1e-5, atol=1e-5)
    after = s.get_allocator_stats()["virt:2"]
    assert after["TotalAllocated"] < large["TotalAllocated"] - 8 * MiB
    assert after["NumArenaShrinkages"] > 0
    assert virt_arena.allocator.get_stats()["InUse"] < raw_before - 8 * MiB  # really freed
    # the large signature still runs (a new frame, memory from the arena again)
    big = rand(4096, seed=3)
    np.testing.assert_allclose(s.run(None, {"x": big})[0], reference(big), rtol=1e-4, atol=1e-4)
    s.shrink_memory_arenas()
    assert s.get_allocator_stats()["virt:2"]["TotalAllocated"] < large["TotalAllocated"]


def test_shrink_option_errors_name_the_key(virt_arena):
    s = session()
    for spec in ("gpu", "virt:x", ":0", "virt:-1"):
        opts = ox.RunOptions()
        opts.add_run_config_entry("memory.enable_memory_arena_shrinkage", spec)
        with pytest.raises(InvalidArgument, match="memory.enable_memory_arena_shrinkage"):
            s.run(None, {"x": rand(2)}, opts)
    with pytest.raises(InvalidArgument, match="no allocator on 'virt:3'"):
        s.shrink_memory_arenas("virt:3")
    s.shrink_memory_arenas("cpu:0")  # host memory: nothing to do, not an error
    assert parse_shrink_spec(" cpu:0 ; gpu:1 ;") == [("cpu", 0), ("gpu", 1)]


def test_stats_of_a_host_only_session_are_empty():
    s = ox.InferenceSession(CHAIN, providers=[CPU])
    assert s.get_allocator_stats() == {}
    s.shrink_memory_arenas()


# ---------------------------------------------------------------------------------------------
# out of memory


@pytest.mark.parametrize("provider", [ARENA, SIM])
def test_out_of_memory_names_the_node_and_the_session_recovers(provider, request):
    request.getfixturevalue("virt_arena" if provider == ARENA else "sim")
    limit = "gpu_mem_limit" if provider == SIM else "arena.max_mem"
    s = session(provider, **{limit: str(4 * MiB)})
    x = rand(16)
    for _ in range(2):  # the signature's recording run, then its plan and pooled frame
        np.testing.assert_allclose(s.run(None, {"x": x})[0], reference(x), rtol=1e-5, atol=1e-5)
    dev = next(iter(s.get_allocator_stats()))
    base = s.get_allocator_stats()[dev]["InUse"]
    for _ in range(2):
        with pytest.raises(OutOfMemory) as e:
            s.run(None, {"x": rand(2048)})  # a 512 KiB input, 8 MiB hidden activations
        msg = str(e.value)
        assert "Failed to allocate memory for requested buffer of size" in msg
        assert "running MatMul node. Name:'MatMul_h1'" in msg, msg
        assert isinstance(e.value, RuntimeException) and isinstance(e.value, MemoryError)
        del e
        assert s.get_allocator_stats()[dev]["InUse"] == base  # nothing leaked
        np.testing.assert_allclose(s.run(None, {"x": x})[0], reference(x), rtol=1e-5, atol=1e-5)
        assert s.get_allocator_stats()[dev]["InUse"] == base


# ---------------------------------------------------------------------------------------------
# the steady state and streams


def test_steady_state_makes_no_allocator_calls_with_device_resident_feeds(virt_arena):
    s = session()
    x = rand(64)
    xv = ox.OrtValue.ortvalue_from_numpy(x, "virt", 2)
    for _ in range(3):  # recording run, first planned run, steady state
        out = s.run_with_ort_values(["y"], {"x": xv})
    arena = virt_arena.arena()
    before = arena.get_stats()
    raw_before = virt_arena.allocator.get_stats()["NumAllocs"]
    for _ in range(5):
        out = s.run_with_ort_values(["y"], {"x": xv})
        del out
    after = arena.get_stats()
    # the graph output is the caller's: one allocation per run; the memory plan's block and
    # every intermediate come from the frame's planned block
    assert after["NumAllocs"] - before["NumAllocs"] == 5
    assert virt_arena.allocator.get_stats()["NumAllocs"] == raw_before  # no raw allocation


def test_planned_block_comes_from_the_arena(virt_arena):
    s = session()
    x = rand(64)
    for _ in range(2):
        s.run(None, {"x": x})
    arena = virt_arena.arena()
    extensions = arena.get_stats()["NumArenaExtensions"]
    raw = virt_arena.allocator.get_stats()["NumAllocs"]
    for _ in range(5):
        s.run(None, {"x": x})
    assert arena.get_stats()["NumArenaExtensions"] == extensions
    assert virt_arena.allocator.get_stats()["NumAllocs"] == raw


def test_concurrent_runs_share_the_arena_across_streams(virt_arena):
    s = session()

    def work(seed: int) -> None:
        for k in range(15):
            x = rand(32 + 8 * seed, seed=seed * 100 + k)
            np.testing.assert_allclose(s.run(None, {"x": x})[0], reference(x), 1e-5, 1e-5)

    run_in_threads(work, 4)
    assert virt_arena.arena().dump()["tagged"] == {}  # every run's stream was released


def test_a_block_freed_on_a_queued_stream_is_not_reused_by_another_stream(virt_arena):
    """With streams that really queue work: the second stream must not get (and overwrite)
    memory the first stream's pending work still writes into."""
    s = session()  # holds the arena
    arena = virt_arena.arena()
    a = vd.VirtStream(virt_arena.device, virt_arena.stats)
    b = vd.VirtStream(virt_arena.device, virt_arena.stats)
    pa = arena.alloc_on_stream(4096, a)
    view = ox.ep.host_view(pa, (1024,), np.float32, None)
    a.enqueue(lambda: view.fill(1.0))  # pending on a
    arena.free(pa)
    pb = arena.alloc_on_stream(4096, b)
    assert pb != pa
    note = a.create_notification()
    note.activate()
    note.wait_on_device(b)
    assert arena.alloc_on_stream(4096, b) == pa
    b.flush()  # runs a's work up to the notification first
    assert (view == 1.0).all()
    del s


# ---------------------------------------------------------------------------------------------
# the CUDA provider's allocators on the host-simulated device


def test_cuda_arena_options_and_stats(sim):
    s = session(SIM, **{"gpu_mem_limit": str(256 * MiB), "arena_extend_strategy": "1"})
    s.run(None, {"x": rand(8)})
    st = s.get_allocator_stats()["cudasim:0"]
    assert st["Limit"] == 256 * MiB and st["NumArenaExtensions"] >= 1
    assert st["NumReserves"] == 1  # the initializers, in one block outside the bins
    opts = s.get_provider_options()[SIM]
    assert opts["arena.max_mem"] == str(256 * MiB) and opts["arena.extend_strategy"] == "1"
    # arena.* wins over gpu_mem_limit, and ep.cuda.arena.* is read too
    del s
    gc.collect()
    so = ox.SessionOptions()
    so.add_session_config_entry("ep.cuda.arena.initial_chunk_size_bytes", "4096")
    s = ox.InferenceSession(
        CHAIN,
        so,
        providers=[(SIM, {"gpu_mem_limit": str(256 * MiB), "arena.max_mem": str(128 * MiB)}), CPU],
    )
    assert s.get_allocator_stats()["cudasim:0"]["Limit"] == 128 * MiB
    assert sim.shared_allocator(sim_mi(sim)).config.initial_chunk_size_bytes == 4096


def sim_mi(factory):
    return next(d.memory_info for d in _raw_devices() if d.factory is factory)


@pytest.mark.parametrize(
    "key, value, needle",
    [
        ("arena.max_mem", "-5", "negative"),
        ("arena.extend_strategy", "3", "kSameAsRequested"),
        ("arena.use_cuda_mempool", "yes", "must be 0 or 1"),
        ("arena.cuda_mempool_release_threshold", "-1", "negative"),
        ("arena.cuda_mempool_bytes_to_keep_on_shrink", "many", "not a byte count"),
        ("arena.max_dead_bytes_per_chunk", "0", "> 0"),
        ("arena.bogus", "1", "unknown CUDA arena option 'arena.bogus'"),
        ("gpu_mem_limit", "-1", "cannot be negative"),
        ("arena_extend_strategy", "kDouble", "kNextPowerOfTwo"),
    ],
)
def test_invalid_cuda_arena_options_name_the_key(sim, key, value, needle):
    with pytest.raises(InvalidArgument, match=needle) as e:
        session(SIM, **{key: value})
    assert key.split(".")[-1] in str(e.value)


def test_gpu_shrink_spec_matches_the_cuda_device(sim):
    s = session(SIM)
    s.run(None, {"x": rand(1024)})
    s.run(None, {"x": rand(1024)})
    held = s.get_allocator_stats()["cudasim:0"]["TotalAllocated"]
    opts = ox.RunOptions()
    opts.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0;gpu:0")
    s.run(None, {"x": rand(2)}, opts)
    assert s.get_allocator_stats()["cudasim:0"]["TotalAllocated"] < held
    with pytest.raises(InvalidArgument, match="no allocator on 'gpu:1'"):
        s.shrink_memory_arenas("gpu:1")


def test_mempool_falls_back_to_the_arena_with_a_warning(sim):
    with pytest.warns(RuntimeWarning, match="Falling back to default BFCArena"):
        s = session(SIM, **{"arena.use_cuda_mempool": "1"})
    x = rand(8)
    np.testing.assert_allclose(s.run(None, {"x": x})[0], reference(x), rtol=1e-5, atol=1e-5)
    assert "NumArenaExtensions" in s.get_allocator_stats()["cudasim:0"]


class HostCallbacks:
    """An external allocator for the simulated device: host memory, every call counted."""

    def __init__(self) -> None:
        self.blocks: dict[int, np.ndarray] = {}
        self.allocs = self.frees = self.empties = 0

    def alloc(self, size: int) -> int:
        buf = np.empty(size + 256, np.uint8)
        ptr = (buf.ctypes.data + 255) // 256 * 256
        self.blocks[ptr] = buf
        self.allocs += 1
        return ptr

    def free(self, ptr: int) -> None:
        del self.blocks[ptr]
        self.frees += 1

    def empty_cache(self) -> None:
        self.empties += 1


def external(cb: HostCallbacks) -> dict[str, object]:
    return {
        "gpu_external_alloc": cb.alloc,
        "gpu_external_free": cb.free,
        "gpu_external_empty_cache": cb.empty_cache,
    }


def test_the_external_allocator_recipe_runs_on_the_simulated_device(sim, monkeypatch):
    """docs/providers/cuda.md's PyTorch recipe, run as it stands on the simulated device
    (the provider's name and device key swapped) with a stand-in for PyTorch whose caching
    allocator is host memory; tests/gpu/test_cuda_interop.py runs it with PyTorch on a GPU."""
    import types

    from tests.conftest import doc_recipe

    cb = HostCallbacks()
    cuda = types.SimpleNamespace(
        caching_allocator_alloc=cb.alloc,
        caching_allocator_delete=cb.free,
        empty_cache=cb.empty_cache,
        memory_allocated=lambda: sum(len(b) - 256 for b in cb.blocks.values()),
    )
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    recipe = doc_recipe("docs/providers/cuda.md", "external-allocator")
    recipe = recipe.replace('"CUDAExecutionProvider"', f'"{SIM}"').replace(
        '"cuda:0"', '"cudasim:0"'
    )
    scope: dict = {"__name__": "recipe"}
    exec(compile(recipe, "docs/providers/cuda.md (recipe)", "exec"), scope)
    sess = scope.pop("sess")  # (the recipe's lambda keeps ``scope``, its globals, alive)
    assert scope["grown"] > 0 and cb.allocs > 0 and cb.empties == 1
    np.testing.assert_allclose(scope["probabilities"].sum(axis=1), 1.0, rtol=1e-5)
    assert sess.get_ep_graph_assignment_summary().get(SIM, 0) > 0
    del sess
    gc.collect()
    assert cb.blocks == {}  # everything given back


def test_a_dropped_session_gives_back_its_memory_plan_viewed_by_cached_arrays(sim):
    """A planned tensor's cached array view once kept the tensor it views (a Flatten of a
    planned tensor, in the demo model) through the array's base, which the garbage collector
    cannot see through: the session's memory-plan block was never given back."""
    from importlib.resources import files

    cb = HostCallbacks()
    model = str(files("onnxplug") / "data" / "demo.onnx")
    s = ox.InferenceSession(model, providers=[(SIM, external(cb)), CPU])
    image = np.random.default_rng(0).random((64, 1, 8, 8), dtype=np.float32)
    for _ in range(3):  # the recording run, the planned frame's binding run, a steady run
        s.run(None, {"image": image})
    assert cb.blocks
    del s
    gc.collect()
    assert cb.blocks == {}


def test_external_allocator_callbacks_stay_with_their_session(sim):
    cb_a, cb_b = HostCallbacks(), HostCallbacks()
    a = ox.InferenceSession(CHAIN, providers=[(SIM, external(cb_a)), CPU])
    plain = session(SIM)  # created after a: must not pick up a's callbacks
    b = ox.InferenceSession(CHAIN, providers=[(SIM, external(cb_b)), CPU])
    # each session's initializers (one block), from its own callbacks
    assert (cb_a.allocs, cb_b.allocs) == (1, 1)
    x = rand(16)
    want = reference(x)
    np.testing.assert_allclose(a.run(None, {"x": x})[0], want, rtol=1e-5, atol=1e-5)
    counts = (cb_a.allocs, cb_b.allocs)
    assert cb_a.allocs > 1 and cb_b.allocs == 1
    shared = plain.get_allocator_stats()["cudasim:0"]["NumAllocs"]
    np.testing.assert_allclose(plain.run(None, {"x": x})[0], want, rtol=1e-5, atol=1e-5)
    assert (cb_a.allocs, cb_b.allocs) == counts  # the plain session uses the shared arena
    assert plain.get_allocator_stats()["cudasim:0"]["NumAllocs"] > shared
    np.testing.assert_allclose(b.run(None, {"x": x})[0], want, rtol=1e-5, atol=1e-5)
    assert cb_a.allocs == counts[0] and cb_b.allocs > 1
    assert "NumArenaExtensions" not in a.get_allocator_stats()["cudasim:0"]  # no arena on top
    assert a.get_provider_options()[SIM]["gpu_external_alloc"].startswith("<python callable")
    a.shrink_memory_arenas("gpu:0")
    assert cb_a.empties == 1 and cb_b.empties == 0
    del a, b
    gc.collect()
    assert cb_a.allocs == cb_a.frees and cb_b.allocs == cb_b.frees  # all returned
    later = session(SIM)  # a session after the external ones are gone: the shared arena
    later.run(None, {"x": x})
    assert (
        cb_a.allocs == counts[0]
        and "NumArenaExtensions" in later.get_allocator_stats()["cudasim:0"]
    )


def test_external_allocator_option_errors(sim):
    cb = HostCallbacks()
    with pytest.raises(InvalidArgument, match="must be set together"):
        session(SIM, gpu_external_alloc=cb.alloc)
    with pytest.raises(InvalidArgument, match="'use_tf32'.* must be a string"):
        session(SIM, use_tf32=cb.alloc, **external(cb))


def test_shared_arenas_are_per_device_ordinal():
    if str(PLUGIN_SRC) not in sys.path:
        sys.path.insert(0, str(PLUGIN_SRC))
    ox.register_execution_provider_library(SIM, "tests.plugins.cuda_sim_devices:create_factory")
    try:
        factory = next(d.factory for d in ox.get_ep_devices() if d.ep_name == SIM)
        s0 = session(SIM, device_id="0", gpu_mem_limit=str(64 * MiB))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # device 1 has no arena yet: nothing is ignored
            s1 = session(SIM, device_id="1", gpu_mem_limit=str(32 * MiB))
        x = rand(8)
        for sess in (s0, s1):
            got = sess.run(None, {"x": x})[0]
            np.testing.assert_allclose(got, reference(x), rtol=1e-5, atol=1e-5)
        del sess
        assert s0.get_allocator_stats()["cudasim:0"]["Limit"] == 64 * MiB
        assert s1.get_allocator_stats()["cudasim:1"]["Limit"] == 32 * MiB
        mis = {d.memory_info.device.id: d.memory_info for d in _raw_devices() if d.ep_name == SIM}
        a0, a1 = factory.shared_allocator(mis[0]), factory.shared_allocator(mis[1])
        assert a0 is not a1
        del s1
        gc.collect()
        assert factory.shared_allocator(mis[1]) is None  # device 1's arena went with its session
        assert factory.shared_allocator(mis[0]) is a0
        del s0
    finally:
        ox.unregister_execution_provider_library(SIM)


def test_memory_usage_is_recorded_over_a_run(virt_arena):
    s = session()
    x = rand(512)
    s.run(None, {"x": x})  # the recording run allocates every tensor on its own
    with s.record_memory_usage() as usage:
        s2 = session()  # a second session shares the arena: its initializers show
        del s2
    assert list(usage) == ["virt:2"]
    points = usage["virt:2"]
    times = [t for t, _ in points]
    assert times == sorted(times) and times[0] == 0.0
    assert points[0][1] == points[-1][1] == s.get_allocator_stats()["virt:2"]["InUse"]
    peak = max(n for _, n in points)
    assert peak - points[0][1] >= 2 * K * H * 4  # the two weights of the second session
    assert virt_arena.arena().trace is None  # recording stops with the block


@pytest.mark.parametrize("provider", [ARENA, SIM])
def test_a_dropped_session_frees_its_device_memory_without_the_garbage_collector(provider, request):
    """No reference cycle may hold a session's initializers, memory plans or scratch: device
    memory must not wait for the garbage collector (a recursive closure in the build and a
    frame <-> signature-plan cycle once did)."""
    request.getfixturevalue("virt_arena" if provider == ARENA else "sim")
    keep = session(provider)  # holds the arena, so that it stays to be looked at
    dev = next(iter(keep.get_allocator_stats()))
    base = keep.get_allocator_stats()[dev]["InUse"]
    gc.disable()
    try:
        s = session(provider)
        for n in (4, 512):
            s.run(None, {"x": rand(n)})
            s.run(None, {"x": rand(n)})
        assert keep.get_allocator_stats()[dev]["InUse"] > base
        del s
        assert keep.get_allocator_stats()[dev]["InUse"] == base
    finally:
        gc.enable()


def _raw_devices() -> list:
    """The plugins' EP devices themselves (``get_ep_devices`` returns onnxruntime's views)."""
    from onnxplug.session.environment import get_environment

    return get_environment().registry.ep_devices()
