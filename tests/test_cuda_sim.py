"""The CUDA provider's kernels and partitioning, run on the host-simulated CUDA device.

``CUDASimExecutionProvider`` is the real CUDA plugin with numpy in place of CuPy and host
memory in place of device memory (plugins/cuda/src/onnxplug_cuda/sim.py), so CI checks every
CUDA kernel's shape, indexing and dtype logic on the ONNX node suite without a GPU.
"""

from __future__ import annotations

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
