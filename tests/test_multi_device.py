"""Several devices in one process, without a GPU: the CUDA provider on two simulated devices
(``cudasim:0`` and ``cudasim:1``), its runtime pieces against a stand-in CUDA runtime with two
devices (``tests/plugins/fake_cudart.py``), and one model on every device through
``SessionPool`` on two virtual devices.

The simulated devices keep a current device per thread (``sim.current_device``), and their
kernels and streams refuse to work while another device is current: a provider entry that
does not make its device current fails here as it would misbehave on two GPUs. The GPU side
of the same checks is ``tests/gpu/test_cuda_multi_gpu.py``.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import onnxplug as ox
from onnxplug.ep import Device, DeviceTensor, MemoryInfo, host_view
from onnxplug.errors import InvalidArgument
from onnxplug.integrations.multi_device import SessionPool, devices_of
from tests.conftest import doc_recipe, run_in_threads
from tests.plugins.graphs import make_model, node, tensor, weights
from tests.test_memory import CHAIN, K, rand, reference  # the GEMM chain model and its feeds

PLUGIN_SRC = Path(__file__).resolve().parents[1] / "plugins" / "cuda" / "src"
if str(PLUGIN_SRC) not in sys.path:
    sys.path.insert(0, str(PLUGIN_SRC))

from onnxplug_cuda import runtime, sim  # noqa: E402
from onnxplug_cuda.memory import CudaDeviceAllocator  # noqa: E402
from onnxplug_cuda.stream import CudaSyncStream  # noqa: E402
from onnxplug_cuda.transfer import SAME, CudaDataTransfer  # noqa: E402
from tests.plugins.fake_cudart import FakeCudart, install  # noqa: E402

CPU = "CPUExecutionProvider"
SIM = "CUDASimExecutionProvider"


@pytest.fixture
def two_sims() -> Iterator[object]:
    """The simulated CUDA provider with two devices; its factory."""
    ox.register_execution_provider_library(SIM, "tests.plugins.cuda_sim_devices:create_factory")
    try:
        yield next(d.ep_device.factory for d in ox.get_ep_devices() if d.ep_name == SIM)
    finally:
        ox.unregister_execution_provider_library(SIM)


def on_device(ordinal: int, **options: str) -> ox.InferenceSession:
    return ox.InferenceSession(
        CHAIN, providers=[(SIM, {"device_id": str(ordinal), **options}), CPU]
    )


def sim_ep(sess: ox.InferenceSession):
    return next(ep for ep in sess._eps if ep.name == SIM)


# ---------------------------------------------------------------------------------------------
# two simulated devices


def test_the_simulation_refuses_work_for_a_device_that_is_not_current(two_sims):
    """What makes the tests below able to fail: a kernel of device 1 run while device 0 is
    current is an error (as CuPy refuses an array of another device)."""
    sess = on_device(1)
    backend = sim_ep(sess).backend
    with pytest.raises(sim.WrongDevice, match="simulated device 1 while device 0"):
        backend.activate(None)
    with sim.SimDeviceGuard(1):
        backend.activate(None)
        assert sim.current_device() == 1
    assert sim.current_device() == 0


def test_each_device_runs_its_own_session_with_another_device_current(two_sims):
    x = rand(4)
    want = reference(x)
    s0, s1 = on_device(0), on_device(1)
    for current in (0, 1):
        with sim.SimDeviceGuard(current):  # a thread that last worked on the other device
            for sess in (s0, s1):
                for _ in range(3):  # recording, binding and steady-state runs
                    np.testing.assert_allclose(sess.run(None, {"x": x})[0], want, rtol=1e-5)
            assert sim.current_device() == current  # the run gave the thread its device back
    assert s0.get_provider_options()[SIM]["device_id"] == "0"
    assert s1.get_provider_options()[SIM]["device_id"] == "1"


def test_sessions_on_two_devices_run_at_once_and_keep_to_their_device(two_sims):
    """Two sessions on devices 0 and 1, run from two threads at once: each allocates only on
    its device, every device-scoped object it made is of its device, results equal the
    CPU's."""
    sessions = [on_device(0), on_device(1)]
    xs = [rand(8, seed=i) for i in range(6)]
    wants = [reference(x) for x in xs]
    seen: list[list[bool]] = [[], []]

    def work(i: int) -> None:
        for _ in range(3):
            for x, want in zip(xs, wants):
                got = sessions[i].run(None, {"x": x})[0]
                seen[i].append(bool(np.allclose(got, want, rtol=1e-5, atol=1e-6)))

    run_in_threads(work, 2)
    assert all(seen[0]) and all(seen[1]) and len(seen[0]) == len(seen[1]) == 18
    for i, sess in enumerate(sessions):
        stats = sess.get_allocator_stats()
        assert f"cudasim:{i}" in stats and f"cudasim:{1 - i}" not in stats
        objects = sim_ep(sess).device_objects()
        kinds = {kind for kind, _, _ in objects}
        assert {"backend", "allocator", "stream"} <= kinds
        assert {o for _, o, _ in objects} == {i}, objects
    a0, a1 = (two_sims.shared_allocator(MemoryInfo("Cuda", Device("cudasim", i))) for i in (0, 1))
    assert a0 is not None and a1 is not None and a0 is not a1


def test_add_provider_for_devices_picks_the_second_device(two_sims):
    devices = [d for d in ox.get_ep_devices() if d.ep_name == SIM]
    assert [d.ep_options["device_id"] for d in devices] == ["0", "1"]
    assert [d.ep_metadata["cuda_device_id"] for d in devices] == ["0", "1"]
    so = ox.SessionOptions()
    so.add_provider_for_devices([devices[1]], {})
    sess = ox.InferenceSession(CHAIN, so)
    x = rand(2)
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], reference(x), rtol=1e-5)
    assert sess.get_provider_options()[SIM]["device_id"] == "1"
    stats = sess.get_allocator_stats()
    assert "cudasim:1" in stats and "cudasim:0" not in stats
    with pytest.raises(InvalidArgument, match="device_id '2' is not one of the devices"):
        on_device(2)


def test_a_value_on_one_device_feeds_a_session_on_the_other(two_sims):
    x = rand(4)
    v1 = ox.OrtValue.ortvalue_from_numpy(x, "cudasim", 1)
    assert v1.device_name() == "cudasim" and v1.device().id == 1
    s0 = on_device(0)
    binding = s0.io_binding()
    binding.bind_ortvalue_input("x", v1)
    binding.bind_output("y", "cudasim", 0)
    s0.run_with_iobinding(binding)
    out = binding.get_outputs()[0]
    assert out.device().id == 0
    np.testing.assert_allclose(out.numpy(), reference(x), rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# the CUDA runtime pieces against a runtime with two devices


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeCudart:
    f = FakeCudart(devices=2, peer=True)
    install(monkeypatch, f)
    return f


def gpu_tensor(fake: FakeCudart, ordinal: int, values: np.ndarray) -> DeviceTensor:
    with runtime.DeviceGuard(ordinal):
        ptr = fake.malloc(values.nbytes)
    t = DeviceTensor(Device("cuda", ordinal), values.dtype, values.shape, ptr, None)
    np.copyto(contents(t), values)
    return t


def contents(t: DeviceTensor) -> np.ndarray:
    """The stand-in runtime's device memory is host memory: a view of it."""
    return host_view(t.ptr, t.shape, t.dtype, None)


def test_streams_and_their_events_are_made_on_their_device(fake):
    with runtime.DeviceGuard(0):
        s1 = CudaSyncStream(Device("cuda", 1), 1, enable_cudnn=False)
        note = s1.create_notification()
        note.activate()  # the event is recorded on the stream: both must be device 1's
        assert fake.current == 0  # the caller keeps its device
    assert fake.streams[s1.handle] == 1 and fake.events[note.event] == 1
    s1.close()


def test_raw_device_memory_comes_from_its_device(fake):
    alloc = CudaDeviceAllocator(MemoryInfo("Cuda", Device("cuda", 1)), 1)
    ptr = alloc.alloc(1024)
    assert fake.device_of_ptr(ptr) == 1 and fake.current == 0
    alloc.free(ptr)
    assert fake.called("cudaFree") == [1]


def test_copy_between_two_devices_goes_peer_to_peer(fake):
    t = CudaDataTransfer()
    x = np.arange(256, dtype=np.float32)
    src, dst = gpu_tensor(fake, 1, x), gpu_tensor(fake, 0, np.zeros_like(x))
    stream = CudaSyncStream(Device("cuda", 0), 0, enable_cudnn=False)
    for _ in range(2):
        t.copy_tensors([(src, dst)], stream)
    np.testing.assert_array_equal(contents(dst), x)
    assert fake.peer_enabled == {(0, 1), (1, 0)}  # once per direction, not per copy
    assert len(fake.called("cudaDeviceEnablePeerAccess")) == 2
    assert fake.called("cudaMemcpyPeerAsync") == [0, 0]  # on the stream's device
    assert t.routes == {runtime.PEER: 2}
    # a run's bound copy takes the same route
    bound = t.bind_copy(dst, src, stream)
    bound()
    assert t.routes == {runtime.PEER: 3}
    stream.close()


def test_copy_between_devices_without_peer_access_goes_through_the_host(monkeypatch):
    fake = FakeCudart(devices=2, peer=False)
    install(monkeypatch, fake)
    t = CudaDataTransfer()
    x = np.arange(64, dtype=np.float32)
    src, dst = gpu_tensor(fake, 0, x), gpu_tensor(fake, 1, np.zeros_like(x))
    t.copy_tensors([(src, dst)], None)
    np.testing.assert_array_equal(contents(dst), x)
    assert fake.peer_enabled == set() and not fake.called("cudaDeviceEnablePeerAccess")
    assert fake.called("cudaMemcpyPeerAsync") == [1]  # no stream: the destination's device
    assert t.routes == {runtime.HOST: 1}


def test_peer_access_enabled_by_someone_else_counts(fake):
    with runtime.DeviceGuard(0):
        fake.deviceEnablePeerAccess(1)  # PyTorch, say, enabled it already
    assert runtime.peer_route(0, 1) == runtime.PEER
    assert fake.peer_enabled == {(0, 1), (1, 0)}


def test_copy_within_a_device_is_a_plain_copy(fake):
    t = CudaDataTransfer()
    x = np.arange(32, dtype=np.float32)
    src, dst = gpu_tensor(fake, 1, x), gpu_tensor(fake, 1, np.zeros_like(x))
    t.copy_tensors([(src, dst)], None)
    np.testing.assert_array_equal(contents(dst), x)
    assert fake.called("cudaMemcpyAsync") == [1] and not fake.called("cudaMemcpyPeerAsync")
    assert t.routes == {SAME: 1}


def test_host_copies_stage_per_device(fake):
    """One thread copying to device 1 then device 0 through pinned staging: each device's
    staging buffer records its own event (one event for both would be recorded on a stream of
    another device, which CUDA refuses)."""
    t = CudaDataTransfer()
    big = np.arange(1 << 15, dtype=np.float32)  # above the direct-copy size: staged
    streams = [CudaSyncStream(Device("cuda", i), i, enable_cudnn=False) for i in (0, 1)]
    for ordinal in (1, 0, 1):
        dst = gpu_tensor(fake, ordinal, np.zeros_like(big))
        t.copy_tensors([(big, dst)], streams[ordinal])
        np.testing.assert_array_equal(contents(dst), big)
        back = np.zeros_like(big)
        t.copy_tensors([(dst, back)], streams[ordinal])
        np.testing.assert_array_equal(back, big)
    assert fake.current == 0
    for s in streams:
        s.close()


# ---------------------------------------------------------------------------------------------
# one model on every device


@pytest.fixture
def two_virt(virt, virt1) -> list:
    """The virtual devices ``virt:0`` and ``virt:1`` (two providers, a device each)."""
    return [d for d in ox.get_ep_devices() if d.ep_name in (virt.name, virt1.name)]


def relu_model() -> bytes:
    w = weights(5, (K, K))[0]
    nodes = [node("MatMul", ["x", "w"], ["h"]), node("Relu", ["h"], ["y"])]
    return make_model(nodes, [tensor("x", ["N", K])], [tensor("y", ["N", K])], {"w": w})


def test_session_pool_serves_one_model_on_two_devices(two_virt, virt, virt1):
    model = relu_model()
    cpu = ox.InferenceSession(model, providers=[CPU])
    xs = [rand(3, seed=i) for i in range(24)]
    gate = threading.Barrier(2)
    arrived: list[str] = []

    def both_devices_busy() -> None:
        # the first kernel of each device's first run waits for the other device's: the
        # runs overlap, one on each device
        if len(arrived) < 2:
            arrived.append(threading.current_thread().name)
            gate.wait(timeout=30)

    virt.rendezvous = virt1.rendezvous = both_devices_busy
    with SessionPool(model, two_virt) as pool:
        assert len(pool) == 2
        outs = pool.map(None, [{"x": x} for x in xs])
        assert sorted(arrived) == ["onnxplug-pool-0", "onnxplug-pool-1"]
        assert sum(pool.runs) == 24 and min(pool.runs) >= 1
        placed = [s.get_ep_graph_assignment_summary() for s in pool.sessions]
    for x, out in zip(xs, outs):
        np.testing.assert_allclose(out[0], cpu.run(None, {"x": x})[0], rtol=1e-5, atol=1e-6)
    assert placed == [{virt.name: 2}, {virt1.name: 2}]


def test_session_pool_errors(two_virt, virt):
    with pytest.raises(InvalidArgument, match="no device to run on.*'NoSuchExecutionProvider'"):
        SessionPool(relu_model(), "NoSuchExecutionProvider")
    pool = SessionPool(relu_model(), virt.name)  # a provider name: every device it offers
    assert (
        [d.ep_name for d in pool.devices]
        == [virt.name]
        == [d.ep_name for d in devices_of(virt.name)]
    )
    bad = pool.run(None, {"x": np.zeros((2, K + 1), np.float32)})
    with pytest.raises(InvalidArgument, match="x"):
        bad.result(timeout=30)  # the session's error reaches the caller
    pool.close()
    with pytest.raises(RuntimeError, match="after close"):
        pool.run(None, {"x": rand(1)})


def test_multi_gpu_recipe_runs_on_two_virtual_devices(two_virt, virt, virt1, tmp_path):
    """docs/providers/cuda.md's one-model-on-every-GPU recipe, as it stands, with the virtual
    devices' providers in place of CUDAExecutionProvider."""
    path = tmp_path / "model.onnx"
    path.write_bytes(relu_model())
    code = doc_recipe("docs/providers/cuda.md", "every-gpu")
    code = code.replace('"model.onnx"', repr(str(path)))
    code = code.replace("(8, 3, 224, 224)", f"(8, {K})")
    providers = (virt.name, virt1.name)
    code = code.replace('d.ep_name == "CUDAExecutionProvider"', f"d.ep_name in {providers!r}")
    scope: dict = {}
    exec(compile(code, "every-gpu recipe", "exec"), scope)
    assert scope["outputs"] and len(scope["outputs"]) == 64
    assert sum(scope["pool_runs"]) == 64


# ---------------------------------------------------------------------------------------------
# the command line


def test_cli_runs_on_the_second_device_and_lists_both(two_sims, capsys, tmp_path):
    from onnxplug.cli.main import main

    path = tmp_path / "chain.onnx"
    path.write_bytes(CHAIN)
    rc = main(["run", str(path), "--provider", SIM, "--provider", CPU, "--device-id", "1"])
    out = capsys.readouterr().out
    assert rc == 0
    assert f"device: {SIM} on device 1" in out
    rc = main(["providers"])
    out = capsys.readouterr().out
    assert rc == 0
    assert f"{SIM} (onnxplug) on GPU:0" in out and f"{SIM} (onnxplug) on GPU:1" in out
    rc = main(["run", str(path), "--provider", SIM, "--device-id", "2"])
    err = capsys.readouterr().err
    assert rc != 0 and "device_id '2' is not one of the devices" in err
    rc = main(["run", str(path), "--provider", CPU, "--device-id", "1"])
    err = capsys.readouterr().err
    assert rc != 0 and "--device-id 1 needs a provider with devices" in err
    rc = main(
        ["run", str(path), "--provider", SIM, "--provider-option", f"{SIM}:device_id=0",
         "--device-id", "1"]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert rc != 0 and "disagree" in err
