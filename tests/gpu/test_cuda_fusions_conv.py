"""The optimizer's convolution and GEMM fusions on the GPU: Conv + activation and Conv +
residual Add + activation become com.microsoft FusedConv nodes that the CUDA provider runs
(cuDNN's plain convolution and one epilogue kernel for bias, Z and activation; with
``fuse_conv_bias=1`` the bias, Z and ReLU in cuDNN's graph), matching the unfused graph on the CPU
provider; the on-disk tuning cache serves a second process; Transposes and scales around a
MatMul become a FusedMatMul that the CUDA provider runs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any

import numpy as np
import pytest
from tests.gpu._cuda import CPU, CUDA, assert_plans_reload, cuda_marks, run_cuda_and_cpu
from tests.test_fusions_conv import ACTIVATIONS, G, residual_block, resnet50, typed

import onnxplug as ox

pytestmark = cuda_marks
EXACT32 = {"use_tf32": "0"}


def _fused_on_cuda(model: bytes) -> list[str]:
    s = ox.InferenceSession(model, providers=[(CUDA, EXACT32), CPU])
    eps = {r["node_name"]: r["ep"] for r in s.get_provider_graph_assignment_info()}
    fused = [n for n in s._graph.nodes if n.op_type == "FusedConv"]
    assert fused and all(eps[n.name] == CUDA for n in fused), eps
    return [n.attrs.get("activation", "") for n in fused]


@pytest.mark.parametrize("fuse", ["0", "1"], ids=["epilogue", "fuse_conv_bias"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("act", ["Relu", "Clip_relu6", "Sigmoid", "LeakyRelu"])
@pytest.mark.parametrize("size", [12, 7], ids=["vectors", "elements"])
def test_residual_block_fused_on_cuda(size, act, dtype, fuse):
    """12x12 planes take the epilogue's 16-byte vectors, 7x7 planes its element loop."""
    from onnxplug_cuda import dnn

    g = G(dtype)
    x = g.input("x", [2, 16, size, size])
    y = ACTIVATIONS[act][0](g, residual_block(g, x, 16, act=None))
    model = typed(g.model([y]))
    assert sorted(_fused_on_cuda(model)) == sorted(["Relu", act.split("_")[0]])
    feeds = {"x": np.random.default_rng(1).standard_normal((2, 16, size, size)).astype(dtype)}
    before = dict(dnn.stats)
    got, want, _ = run_cuda_and_cpu(model, feeds, {**EXACT32, "fuse_conv_bias": fuse})
    assert dnn.stats["fallback"] == before["fallback"]
    if fuse == "0":  # no graph that cuDNN may compile at run time
        jit = dnn.stats["fused"] - dnn.stats["fused_precompiled"]
        assert jit == before["fused"] - before["fused_precompiled"]
    tol = 1e-4 if dtype == np.float32 else 2e-2
    np.testing.assert_allclose(
        got[0].astype(np.float32), want[0].astype(np.float32), rtol=tol, atol=tol
    )


@pytest.mark.parametrize("fuse", ["0", "1"], ids=["epilogue", "fuse_conv_bias"])
def test_resnet50_shaped_model_on_cuda(fuse):
    """49 FusedConv (33 with Relu, 16 with the residual and Relu) and 4 projection Convs, all on
    CUDA, against the unfused CPU graph."""
    model = typed(resnet50(width=16, size=64, batch=2, classes=10))
    acts = _fused_on_cuda(model)
    assert len(acts) == 49 and set(acts) == {"Relu"}
    feeds = {"x": np.random.default_rng(2).standard_normal((2, 3, 64, 64)).astype(np.float32)}
    so = ox.SessionOptions()
    so.graph_optimization_level = ox.GraphOptimizationLevel.ORT_DISABLE_ALL
    want = ox.InferenceSession(model, so, providers=[CPU]).run(None, feeds)[0]
    from onnxplug_cuda import dnn

    before = dict(dnn.stats)
    got, _, _ = run_cuda_and_cpu(model, feeds, {**EXACT32, "fuse_conv_bias": fuse})
    np.testing.assert_allclose(got[0], want, rtol=1e-3, atol=1e-3 * float(np.abs(want).max()))
    precompiled = dnn.stats["fused_precompiled"] - before["fused_precompiled"]
    if fuse == "1":
        assert precompiled == 0
    else:
        assert dnn.stats["fused"] - before["fused"] == precompiled  # nothing compiled at run time
        if _sm() >= 90:  # an H100 has shipped engines for Conv + bias + ReLU (NHWC, float32)
            assert precompiled > 0


def _sm() -> int:
    from onnxplug_cuda.runtime import probe_devices

    info = probe_devices()[0][0]
    return info.major * 10 + info.minor


_TUNED_PROCESS = """
import json, sys
import numpy as np
import onnxplug as ox
from onnxplug_cuda import dnn
model, x = open(sys.argv[1], "rb").read(), np.load(sys.argv[2])
s = ox.InferenceSession(model, providers=[("CUDAExecutionProvider", {"use_tf32": "0"})])
y = s.run(None, {"x": x})[0]
np.save(sys.argv[3], y)
print(json.dumps(dnn.stats))
"""


def test_tuning_and_plan_caches_serve_a_second_process(tmp_path):
    """EXHAUSTIVE search in a first process leaves its winners on disk, as autotune results
    and as serialized plans; a second process deserializes every plan (no graph built, none
    timed) and computes the same outputs bit for bit. Without the plans, the tuning cache
    still spares the search: a third process builds only the winners."""
    model = typed(resnet50(width=16, size=32, batch=1, classes=10))
    (tmp_path / "m.onnx").write_bytes(model)
    np.save(
        tmp_path / "x.npy", np.random.default_rng(3).standard_normal((1, 3, 32, 32), np.float32)
    )
    env = {**os.environ, "ONNXPLUG_CACHE_DIR": str(tmp_path / "cache")}

    def process(n: int) -> dict:
        args = [str(tmp_path / f) for f in ("m.onnx", "x.npy", f"y{n}.npy")]
        p = subprocess.run(
            [sys.executable, "-c", _TUNED_PROCESS, *args],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        assert p.returncode == 0, p.stderr[-3000:]
        return json.loads(p.stdout.strip().splitlines()[-1])

    first = process(1)
    assert first["tuning_cache_hits"] == first["plan_cache_hits"] == 0 and first["cudnn"] > 0
    files = sorted(os.listdir(tmp_path / "cache"))
    assert len(files) == 2 and files[0].startswith("cudnn-conv-"), files
    plans = tmp_path / "cache" / files[1]
    assert files[1].startswith("cudnn-plans-") and len(os.listdir(plans)) > 0
    second = process(2)
    assert second["plan_cache_hits"] == len(os.listdir(plans))
    assert second["tuning_cache_hits"] == 0
    np.testing.assert_array_equal(np.load(tmp_path / "y2.npy"), np.load(tmp_path / "y1.npy"))
    shutil.rmtree(plans)
    third = process(3)
    assert third["tuning_cache_hits"] > 0 and third["plan_cache_hits"] == 0
    np.testing.assert_array_equal(np.load(tmp_path / "y3.npy"), np.load(tmp_path / "y1.npy"))


@pytest.mark.parametrize("fuse", ["0", "1"], ids=["epilogue", "fuse_conv_bias"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=lambda d: np.dtype(d).name)
def test_deserialized_plans_compute_what_built_plans_do(monkeypatch, tmp_path, fuse, dtype):
    """A new engine (as in a new process) on the same cache folder deserializes every plan the
    first one built, including cuDNN's runtime-compiled fused graphs (``fuse_conv_bias=1``),
    and its outputs are bit-identical, eager and replayed."""
    g = G(dtype)
    x = g.input("x", [2, 16, 12, 12])
    y = g.op("Relu", residual_block(g, x, 16, act=None))
    model = typed(g.model([y]))
    feeds = {"x": np.random.default_rng(5).standard_normal((2, 16, 12, 12)).astype(dtype)}
    opts = {"fuse_conv_bias": fuse, "tuning_cache_dir": str(tmp_path)}
    assert_plans_reload(monkeypatch, model, feeds, opts, "cudnn")


_KERNEL_PROCESS = """
import os, sys
import numpy as np
import onnx
from onnx import TensorProto, helper
import onnxplug as ox
x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 1000])
y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 1000])
# LeakyRelu: its alpha is passed by value, so no install ships its kernel (a Relu's is shipped)
nodes = [
    helper.make_node("Softmax", ["x"], ["s"], axis=1),
    helper.make_node("LeakyRelu", ["s"], ["y"], alpha=0.1),
]
model = helper.make_model(helper.make_graph(nodes, "g", [x], [y]), opset_imports=[helper.make_opsetid("", 17)])
s = ox.InferenceSession(model.SerializeToString(), providers=["CUDAExecutionProvider"])
feed = np.random.default_rng(0).standard_normal((4, 1000)).astype(np.float32)
out = s.run(None, {"x": feed})[0]
np.testing.assert_allclose(out, np.exp(feed) / np.exp(feed).sum(1, keepdims=True), rtol=1e-5)
print(os.environ.get("CUPY_CACHE_DIR"), os.environ.get("CUPY_CACHE_IN_MEMORY"))
"""


def test_compiled_kernels_kept_in_the_cache_folder(tmp_path):
    """With $ONNXPLUG_CACHE_DIR set (CuPy's variables not), the kernels a run compiles are kept
    in its kernels/ folder and a second process compiles none; "off" keeps them in memory."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUPY_CACHE")}

    def process(folder: str) -> str:
        p = subprocess.run(
            [sys.executable, "-c", _KERNEL_PROCESS],
            env={**env, "ONNXPLUG_CACHE_DIR": folder},
            capture_output=True,
            text=True,
            check=False,
        )
        assert p.returncode == 0, p.stderr[-3000:]
        return p.stdout.strip().splitlines()[-1]

    kernels = tmp_path / "kernels"
    assert process(str(tmp_path)) == f"{kernels} None"
    first = sorted(os.listdir(kernels))
    assert first
    process(str(tmp_path))
    assert sorted(os.listdir(kernels)) == first
    assert process("off") == "None 1"


class _TimedPlans:
    """A frontend graph's plan interface for ``dnn._time_plans``: plan i spends ``host_s[i]``
    seconds on the host and then ``gpu_ns[i]`` nanoseconds on the GPU per call."""

    def __init__(self, host_s: list[float], gpu_ns: list[int], stream: int):
        self.host_s, self.gpu_ns, self.stream = host_s, gpu_ns, stream

    def get_workspace_size_plan_at_index(self, i: int) -> int:
        return 0

    def _execute_plan_at_index(self, ptrs, ws, i, handle) -> None:
        from onnxplug_cuda import dnn

        time.sleep(self.host_s[i])
        dnn._hold_gpu(self.stream, self.gpu_ns[i])


@pytest.mark.parametrize("cap_ns", [None, 200_000])
def test_exhaustive_search_times_gpu_work_not_host_launches(monkeypatch, cap_ns):
    """Plan 0 costs the host 0.5 ms per call and the GPU 5 us; plan 1 the host nothing and the
    GPU 100 us. Timed one call at a time on an idle GPU, plan 0 looked slower (its host time
    was inside the events); the search must pick plan 0, at about its GPU time, with the hold
    the host releases, and also when the host's enqueueing outlasts the hold's cap (200 us)."""
    import cupy

    from onnxplug_cuda import dnn

    if cap_ns is not None:
        monkeypatch.setattr(dnn, "_HOLD_CAP_NS", cap_ns)
    stream = cupy.cuda.Stream(non_blocking=True)

    class Stream:
        cupy_stream, handle, cudnn = stream, stream.ptr, None

    class Ctx:
        stream = Stream()

        def scratch(self, n: int):
            return cupy.empty(n, cupy.uint8).data

    plans = _TimedPlans([5e-4, 0.0], [5_000, 100_000], stream.ptr)
    times = dnn._time_plans(Ctx(), plans, {}, [0, 1])
    assert times[0] < 0.05 and times[1] > 0.09, times


def test_gpu_hold_lasts_its_time_or_until_the_host_releases_it():
    """The search's hold: without a release flag it lasts its time; with one, it ends when
    the host sets the flag, well before its cap."""
    import cupy

    from onnxplug_cuda import dnn

    stream = cupy.cuda.Stream(non_blocking=True)

    def held_ms(ns: int, release: int = 0, set_flag: Any = None) -> float:
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        dnn._hold_gpu(stream.ptr, ns, release)
        end.record(stream)
        if set_flag is not None:
            time.sleep(0.02)
            set_flag()
        end.synchronize()
        return cupy.cuda.get_elapsed_time(start, end)

    assert held_ms(1_000_000) >= 0.95
    mem = cupy.cuda.alloc_pinned_memory(4)
    flag = np.frombuffer(mem, np.uint32, 1)
    flag[0] = 0
    ms = held_ms(2_000_000_000, mem.ptr, lambda: flag.__setitem__(0, 1))
    assert 15 <= ms < 500, ms  # released after the host's 20 ms, not at the 2 s cap
    flag[0] = 1
    assert held_ms(2_000_000_000, mem.ptr) < 100  # released before it started


def test_transpose_matmul_fuses_on_cuda():
    """The scores' Transpose and scale fold into one FusedMatMul that the CUDA provider runs
    (the GEMM's own transpose and alpha), matching the unfused graph on the CPU provider."""
    g = G()
    a, b = g.input("a", [2, 3, 5, 8]), g.input("b", [2, 3, 5, 8])
    y = g.op("Div", g.op("MatMul", a, g.op("Transpose", b, perm=[0, 1, 3, 2])), g.const(8.0))
    model = typed(g.model([y]))
    s = ox.InferenceSession(model, providers=[(CUDA, EXACT32), CPU])
    rows = [
        r for r in s.get_provider_graph_assignment_info() if not r["op_type"].startswith("Memcpy")
    ]
    assert [r["op_type"] for r in rows] == ["FusedMatMul"]
    assert {r["ep"] for r in rows} == {CUDA}
    rng = np.random.default_rng(4)
    feeds = {k: rng.standard_normal((2, 3, 5, 8)).astype(np.float32) for k in "ab"}
    so = ox.SessionOptions()
    so.graph_optimization_level = ox.GraphOptimizationLevel.ORT_DISABLE_ALL
    want = ox.InferenceSession(model, so, providers=[CPU]).run(None, feeds)[0]
    np.testing.assert_allclose(s.run(None, feeds)[0], want, rtol=1e-4, atol=1e-4)
