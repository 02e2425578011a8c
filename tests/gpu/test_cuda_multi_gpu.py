"""Several GPUs in one process: device-scoped objects, the current device at every entry,
copies between GPUs, device selection on the command line and CUDA_VISIBLE_DEVICES.

On one GPU: every device-scoped object a session makes records ordinal 0 and CUDA agrees
(streams' devices, arena blocks' devices), a run leaves the thread's current device as it found
it, the command line runs on ``--device-id 0``. The tests that need two GPUs skip with the
reason on a machine with one. The same checks run in CI on two simulated devices
(``tests/test_multi_device.py``).
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tests.conftest import run_in_threads
from tests.gpu._cuda import CPU, CUDA, cuda_marks
from tests.plugins.graphs import gemm_chain, make_model, node, tensor, weights

import onnxplug as ox

pytestmark = cuda_marks

ROOT = Path(__file__).resolve().parents[2]
K, H = 256, 1024


def gpu_count() -> int:
    return len([d for d in ox.get_ep_devices() if d.ep_name == CUDA])


two_gpus = pytest.mark.skipif(
    CUDA in ox.get_available_providers() and gpu_count() < 2,
    reason=f"needs 2 GPUs; {gpu_count()} visible (CUDA_VISIBLE_DEVICES="
    f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})",
)


def model() -> bytes:
    """GEMMs (cuBLASLt), a Conv (cuDNN), elementwise and a Softmax (compiled kernels)."""
    nodes, inits = gemm_chain(K, H, out="h4", seed=7)
    nodes += [
        node("Softmax", ["h4"], ["y"], axis=-1),
        node("Reshape", ["h4", "shape"], ["img"]),
        node("Conv", ["img", "cw"], ["z"], pads=[1, 1, 1, 1]),
    ]
    inits["cw"] = weights(8, (4, 1, 3, 3))[0]
    inits["shape"] = np.array([-1, 1, 16, 16], np.int64)
    return make_model(
        nodes,
        [tensor("x", ["N", K])],
        [tensor("y", ["N", K]), tensor("z", ["N", 4, 16, 16])],
        inits,
    )


MODEL = model()


def rand(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, K)).astype(np.float32)


def cpu_outputs(x: np.ndarray) -> list[np.ndarray]:
    return ox.InferenceSession(MODEL, providers=[CPU]).run(None, {"x": x})


def on_gpu(ordinal: int, **options: str) -> ox.InferenceSession:
    opts = {"device_id": str(ordinal), "use_tf32": "0", **options}
    return ox.InferenceSession(MODEL, providers=[(CUDA, opts), CPU])


def cuda_ep(sess: ox.InferenceSession):
    return next(ep for ep in sess._eps if ep.name == CUDA)


def close(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    """float32 results of four chained GEMMs (K up to 1024) and a Conv: absolute errors scale
    with the output's magnitude (the GPU tests' convention, tests/gpu/test_cuda_matmul_conv.py
    ``_check``); a run on the wrong device or a stale buffer is off by far more."""
    for g, w in zip(got, want):
        scale = max(1.0, float(np.abs(w).max()))
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4 * scale)


def current_device() -> int:
    from onnxplug_cuda.runtime import cudart

    return int(cudart().getDevice())


def stream_device(handle: int) -> int | None:
    """The device CUDA says a stream belongs to (None where the runtime cannot say; CuPy's
    runtime does not bind cudaStreamGetDevice, cuda.bindings' does)."""
    from cuda.bindings import runtime as rt

    fn = getattr(rt, "cudaStreamGetDevice", None)
    if fn is None:
        return None
    err, dev = fn(handle)
    return int(dev) if int(err) == 0 else None


def pointer_device(ptr: int) -> int:
    from onnxplug_cuda.runtime import cudart

    return int(cudart().pointerGetAttributes(ptr).device)


def check_device_objects(sess: ox.InferenceSession, ordinal: int) -> dict[str, int]:
    """Every device-scoped object of the session's provider records ``ordinal``, and CUDA
    agrees where it can tell; the count of objects by kind."""
    ep = cuda_ep(sess)
    kinds: dict[str, int] = {}
    for kind, o, obj in ep.device_objects():
        assert o == ordinal, (kind, o, obj)
        kinds[kind] = kinds.get(kind, 0) + 1
        if kind == "stream":
            dev = stream_device(obj.handle)
            assert dev in (None, ordinal), (kind, dev)
        if kind == "allocator":
            ptr = obj.alloc(256)
            try:
                assert pointer_device(ptr) == ordinal
            finally:
                obj.free(ptr)
    return kinds


# ---------------------------------------------------------------------------------------------
# one GPU


def test_every_device_scoped_object_records_its_ordinal():
    """The single-GPU run of the issue: a session's arena, streams, cuBLASLt/cuDNN handles,
    GEMM and cuDNN engines, captured graphs and compiled kernels all belong to device 0."""
    from onnxplug_cuda.kernels._fused import function_devices

    x = rand(4)
    want = cpu_outputs(x)
    plain = on_gpu(0)
    graphs = on_gpu(0, enable_cuda_graph="1")
    for _ in range(4):
        close(plain.run(None, {"x": x}), want)
        close(graphs.run(None, {"x": x}), want)
    kinds = check_device_objects(plain, 0)
    assert {"backend", "allocator", "stream", "cublaslt", "gemm engine"} <= set(kinds), kinds
    assert "cudnn" in kinds and "cudnn engine" in kinds, kinds
    gkinds = check_device_objects(graphs, 0)
    assert gkinds.get("cuda graph", 0) >= 1, gkinds
    assert function_devices() and set(function_devices()) == {0}


def test_a_run_leaves_the_threads_device_as_it_found_it():
    sess = on_gpu(0)
    x = rand(2)
    sess.run(None, {"x": x})
    assert current_device() == 0
    if gpu_count() > 1:
        from onnxplug_cuda.runtime import DeviceGuard

        with DeviceGuard(1):
            close(sess.run(None, {"x": x}), cpu_outputs(x))
            assert current_device() == 1  # the run made 0 current and gave 1 back


def test_cli_device_id_and_providers_list_every_gpu(tmp_path):
    path = tmp_path / "model.onnx"
    path.write_bytes(MODEL)
    cli = [sys.executable, "-m", "onnxplug.cli.main"]
    out = subprocess.run([*cli, "providers"], capture_output=True, text=True, check=True).stdout
    assert out.count(f"{CUDA} (NVIDIA) on GPU:") == gpu_count()
    last = gpu_count() - 1
    res = subprocess.run(
        [*cli, "run", str(path), "--provider", CUDA, "--provider", CPU, "--device-id", str(last)],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr
    assert f"device: {CUDA} on device {last}" in res.stdout


def test_cuda_visible_devices_is_respected():
    """The provider offers the GPUs CUDA_VISIBLE_DEVICES leaves, renumbered from 0; with none
    visible it offers none and says why."""
    code = (
        "import onnxplug as ox; ds = [d for d in ox.get_ep_devices() if d.ep_name == "
        f"'{CUDA}']; print(len(ds), [d.ep_options['device_id'] for d in ds])"
    )
    for visible, want in (("0", "1 ['0']"), ("", "0 []")):
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": visible}
        res = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT
        )
        assert res.returncode == 0, res.stderr
        assert res.stdout.strip().splitlines()[-1] == want
    if gpu_count() > 1:
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "1"}
        res = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT
        )
        assert res.stdout.strip().splitlines()[-1] == "1 ['0']"


# ---------------------------------------------------------------------------------------------
# two GPUs


def used_bytes(ordinal: int) -> int:
    """Device memory in use on ``ordinal`` (total - free, cudaMemGetInfo: what NVML reports
    for the device, every process included)."""
    from onnxplug_cuda.runtime import DeviceGuard, cudart

    with DeviceGuard(ordinal):
        free, total = cudart().memGetInfo()
    return int(total) - int(free)


@two_gpus
def test_sessions_on_two_gpus_from_two_threads_keep_to_their_gpu():
    """Issue 14, item 1: two sessions on GPU 0 and GPU 1 run from two threads at once; the
    session on GPU 1 allocates nothing on GPU 0 (and the other way round), each one's objects
    are its GPU's, results equal the single-GPU results."""
    xs = [rand(64, seed=i) for i in range(4)]
    wants = [cpu_outputs(x) for x in xs]
    single = [on_gpu(0).run(None, {"x": x}) for x in xs]
    gc.collect()
    s1 = on_gpu(1)  # created first, alone: GPU 0 must not move
    before0 = used_bytes(0)
    for x in xs:
        s1.run(None, {"x": x})
    assert used_bytes(0) == before0, "a session on GPU 1 allocated on GPU 0"
    s0 = on_gpu(0)
    before1 = used_bytes(1)
    for x in xs:
        s0.run(None, {"x": x})
    assert used_bytes(1) == before1, "a session on GPU 0 allocated on GPU 1"
    sessions = [s0, s1]
    results: list[list] = [[], []]

    def work(i: int) -> None:
        for _ in range(25):
            for x in xs:
                results[i].append(sessions[i].run(None, {"x": x}))

    run_in_threads(work, 2)
    for i in (0, 1):
        for k, got in enumerate(results[i]):
            close(got, wants[k % len(xs)])
            for g, s in zip(got, single[k % len(xs)]):
                np.testing.assert_allclose(g, s, rtol=1e-5, atol=1e-6)
        check_device_objects(sessions[i], i)
    assert s0.get_provider_options()[CUDA]["device_id"] == "0"
    assert s1.get_provider_options()[CUDA]["device_id"] == "1"


@two_gpus
def test_graphs_on_two_gpus_from_two_threads():
    sessions = [on_gpu(i, enable_cuda_graph="1") for i in (0, 1)]
    x = rand(8)
    want = cpu_outputs(x)

    def work(i: int) -> None:
        for _ in range(50):
            close(sessions[i].run(None, {"x": x}), want)

    run_in_threads(work, 2)
    for i, sess in enumerate(sessions):
        kinds = check_device_objects(sess, i)
        assert kinds.get("cuda graph", 0) >= 1


@two_gpus
def test_a_value_on_gpu_1_feeds_a_session_on_gpu_0_peer_to_peer():
    from onnxplug_cuda.runtime import HOST, PEER, cudart

    can = cudart().deviceCanAccessPeer(0, 1)
    route = PEER if can else HOST
    x = rand(16)
    v1 = ox.OrtValue.ortvalue_from_numpy(x, "cuda", 1)
    s0 = on_gpu(0)
    from onnxplug.session.environment import get_environment

    transfer = get_environment().transfer.find(v1.device(), cuda_ep(s0).device)
    before = transfer.routes[route]
    b = s0.io_binding()
    b.bind_ortvalue_input("x", v1)
    out1 = ox.OrtValue.ortvalue_from_shape_and_type([16, K], np.float32, "cuda", 1)
    b.bind_ortvalue_output("y", out1)  # an output bound to a value on the other GPU
    b.bind_output("z", "cuda", 0)
    s0.run_with_iobinding(b)
    want = cpu_outputs(x)
    np.testing.assert_allclose(out1.numpy(), want[0], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(b.get_outputs()[1].numpy(), want[1], rtol=1e-4, atol=1e-5)
    assert transfer.routes[route] >= before + 2, dict(transfer.routes)
    print(f"GPU 1 -> GPU 0 route: {route}")
