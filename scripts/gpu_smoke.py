"""Smoke test of the CUDA provider's foundation on a real GPU (no kernels needed).

Checks device enumeration, the allocators, streams and events, library handles, data
transfer in every direction, OrtValue on the device, the CuPy bridge (views, stream, allocator
routing) and one session that crosses devices. Prints one line per check; exits 1 if any
failed. Also dumps the Python API of cuDNN frontend / nvmath cuBLASLt to $OUT for reference.

    python scripts/gpu_smoke.py
"""

from __future__ import annotations

import os
import sys
import traceback

import numpy as np

results: list[tuple[str, bool, str]] = []


def check(name):
    def deco(fn):
        try:
            detail = fn() or ""
            results.append((name, True, str(detail)))
        except Exception as e:
            results.append((name, False, f"{type(e).__name__}: {e}"))
            traceback.print_exc()
        print(
            ("PASS " if results[-1][1] else "FAIL ") + name + "  " + results[-1][2][:300],
            flush=True,
        )
        return fn

    return deco


import onnxplug as ox  # noqa: E402

CUDA = "CUDAExecutionProvider"


@check("provider listed")
def _():
    assert CUDA in ox.get_available_providers(), (
        ox.get_available_providers(),
        ox.get_provider_load_errors(),
    )
    d = [d for d in ox.get_ep_devices() if d.ep_name == CUDA]
    return [(x.ep_metadata, x.ep_options) for x in d]


from onnxplug.ep import (  # noqa: E402
    ArenaConfig,
    BFCArena,
    Device,
    DeviceTensor,
    MemoryInfo,
    allocate_tensor,
)
from onnxplug_cuda.memory import (  # noqa: E402
    CudaDeviceAllocator,
    CudaDeviceArena,
    CudaMempoolAllocator,
    CudaPinnedAllocator,
)
from onnxplug_cuda.stream import CudaSyncStream  # noqa: E402
from onnxplug_cuda.transfer import CudaDataTransfer  # noqa: E402

DEV = Device("cuda", 0, 0x10DE)
MI = MemoryInfo("Cuda", DEV)
alloc = None
stream = None


@check("device arena over cudaMalloc")
def _():
    global alloc
    alloc = CudaDeviceArena(CudaDeviceAllocator(MI, 0), ArenaConfig())
    p = alloc.alloc(1 << 20)
    assert p
    alloc.free(p)
    st = alloc.get_stats()
    alloc.shrink()
    assert alloc.get_stats()["TotalAllocated"] == 0
    return st


@check("memory pool (arena.use_cuda_mempool=1)")
def _():
    pool = CudaMempoolAllocator(MI, 0, release_threshold=1 << 20)
    p = pool.alloc(1 << 20)
    assert p
    pool.free(p)
    st = pool.get_stats()
    pool.shrink()
    pool.close()
    return st


@check("stream + notification + handles")
def _():
    global stream
    stream = CudaSyncStream(DEV, 0)
    s2 = CudaSyncStream(DEV, 0)
    n = stream.create_notification()
    n.activate()
    n.wait_on_device(s2)
    n.wait_on_host()
    s2.flush()
    h = stream.cublaslt
    c = stream.cudnn
    return f"stream=0x{stream.handle:x} cublasLt={h} cudnn={c}"


@check("alloc_on_stream + transfer H2D/D2H/D2D, small and large")
def _():
    tr = CudaDataTransfer()
    for n in (7, 1 << 20):
        x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
        t = allocate_tensor(alloc, x.shape, x.dtype, stream)
        tr.copy_tensors([(x, t)], stream)
        t2 = allocate_tensor(alloc, x.shape, x.dtype, stream)
        tr.copy_tensors([(t, t2)], stream)
        y = np.empty_like(x)
        tr.copy_tensors([(t2, y)], stream)
        assert np.array_equal(x, y), n
        y2 = np.empty_like(x)
        tr.copy_tensors([(t2, y2)], None)
        assert np.array_equal(x, y2)
    return alloc.get_stats()


@check("pinned arena")
def _():
    raw = CudaPinnedAllocator(MemoryInfo("CudaPinned", Device("cpu", 0, 0x10DE, True)))
    pa = BFCArena(raw, ArenaConfig(), stream_aware=False)
    p = pa.alloc(4096)
    pa.free(p)
    pa.shrink()
    return pa.get_stats()


@check("OrtValue on cuda")
def _():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    v = ox.OrtValue.ortvalue_from_numpy(x, "cuda", 0)
    assert v.device_name() == "cuda"
    assert np.array_equal(v.numpy(), x)
    v.update_inplace(x * 2)
    assert np.array_equal(v.numpy(), x * 2)
    w = ox.OrtValue.ortvalue_from_shape_and_type([2, 2], np.float16, "cuda", 0)
    return f"{v} ptr=0x{v.data_ptr():x} {w}"


@check("CuPy bridge: view, stream, allocator routing, wrap")
def _():
    import cupy as cp

    from onnxplug_cuda.backend import CupyBackend

    be = CupyBackend(0, DEV)
    x = np.random.default_rng(1).standard_normal((64, 64)).astype(np.float32)
    t = allocate_tensor(alloc, x.shape, x.dtype, stream)
    CudaDataTransfer().copy_tensors([(x, t)], stream)
    before = alloc.get_stats()["NumAllocs"]
    token = be.enter_run(alloc)
    be.activate(stream)
    assert cp.cuda.get_current_stream().ptr == stream.handle
    a = be.view(t)
    b = cp.tanh(a) + 1  # temporaries come from our allocator
    out = be.wrap(b)
    be.exit_run(token)
    after = alloc.get_stats()["NumAllocs"]
    assert after > before, (before, after)
    y = np.empty_like(x)
    CudaDataTransfer().copy_tensors([(out, y)], stream)
    assert np.allclose(y, np.tanh(x) + 1, atol=1e-6)
    e = be.view(DeviceTensor(DEV, np.float32, (0,), 0, None))
    return f"allocs {before}->{after}, empty view {e.shape}"


@check("session across devices with a test kernel")
def _():
    from onnx import TensorProto, helper

    from onnxplug_cuda.factory import _registry
    from onnxplug_cuda.kernels._base import FLOATS, CudaKernel

    class SmokeRelu(CudaKernel):
        def compute(self, ctx):
            x = self.arg(ctx, 0)
            y = self.alloc(ctx, 0, x.shape, x.dtype)
            self.xp.maximum(x, 0, out=y)

    reg = _registry(True)
    if reg.lookup("Relu", "", 14, [np.dtype(np.float32)]) is None:
        reg.kernel("Relu", since=14, types={"T": FLOATS})(SmokeRelu)
    g = helper.make_graph(
        [
            helper.make_node("Add", ["x", "y"], ["z"]),
            helper.make_node("Relu", ["z"], ["w"]),
            helper.make_node("Relu", ["w"], ["o"]),
        ],
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3]),
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3]),
        ],
        [helper.make_tensor_value_info("o", TensorProto.FLOAT, ["n", 3])],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    s = ox.InferenceSession(m.SerializeToString(), providers=[CUDA, "CPUExecutionProvider"])
    for n in (2, 5, 2):
        x = np.random.default_rng(n).standard_normal((n, 3)).astype(np.float32)
        y = np.random.default_rng(n + 1).standard_normal((n, 3)).astype(np.float32)
        for _ in range(3):
            got = s.run(None, {"x": x, "y": y})[0]
            assert np.array_equal(got, np.maximum(x + y, 0)), got
    io = s.io_binding()
    io.bind_ortvalue_input("x", ox.OrtValue.ortvalue_from_numpy(x, "cuda", 0))
    io.bind_cpu_input("y", y)
    io.bind_output("o", "cuda", 0)
    s.run_with_iobinding(io)
    o = io.get_outputs()[0]
    assert o.device_name() == "cuda" and np.array_equal(o.numpy(), np.maximum(x + y, 0))
    return [r["ep"] for r in s.get_provider_graph_assignment_info()], s.get_provider_options()[CUDA]


def _tiny() -> bytes:
    from onnx import TensorProto, helper

    g = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


@check("provider option errors")
def _():
    from onnxplug.errors import InvalidArgument

    for opts in ({"use_tf32": "maybe"}, {"cudnn_conv_algo_search": "FAST"}, {"device_id": "7"}):
        try:
            ox.InferenceSession(_tiny(), providers=[(CUDA, opts)])
        except InvalidArgument:
            continue
        raise AssertionError(f"{opts} was accepted")


def dump_apis() -> None:
    out = os.environ.get("OUT")
    if not out:
        return
    lines = []
    try:
        import cudnn

        lines.append(
            f"cudnn {getattr(cudnn, '__version__', '?')} backend {cudnn.backend_version()}"
        )
        lines.append("cudnn: " + " ".join(sorted(x for x in dir(cudnn) if not x.startswith("__"))))
        lines.append(
            "pygraph: " + " ".join(sorted(x for x in dir(cudnn.pygraph) if not x.startswith("__")))
        )
        for name in (
            "numerical_note",
            "behavior_note",
            "heur_mode",
            "build_plan_policy",
            "data_type",
            "tensor",
        ):
            obj = getattr(cudnn, name, None)
            if obj is not None:
                lines.append(
                    f"{name}: " + " ".join(sorted(x for x in dir(obj) if not x.startswith("_")))
                )
        for meth in (
            "conv_fprop",
            "conv_dgrad",
            "build",
            "execute",
            "tensor",
            "pooling",
            "resample",
            "deselect_numeric_notes",
            "build_plans",
            "autotune",
            "matmul",
            "layernorm",
            "sdpa",
        ):
            f = getattr(cudnn.pygraph, meth, None)
            if f is not None:
                lines.append(f"--- pygraph.{meth}\n{f.__doc__}")
        lines.append(f"--- pygraph.__init__\n{cudnn.pygraph.__init__.__doc__}")
    except Exception as e:
        lines.append(f"cudnn import failed: {e}")
    try:
        from nvmath.bindings import cublasLt

        lines.append(
            "cublasLt: " + " ".join(sorted(x for x in dir(cublasLt) if not x.startswith("__")))
        )
        for meth in (
            "matmul",
            "matmul_desc_create",
            "matrix_layout_create",
            "matmul_algo_get_heuristic",
            "matmul_preference_create",
            "matmul_desc_set_attribute",
            "matrix_layout_set_attribute",
            "matmul_preference_set_attribute",
        ):
            f = getattr(cublasLt, meth, None)
            if f is not None:
                lines.append(f"--- cublasLt.{meth}\n{f.__doc__}")
    except Exception as e:
        lines.append(f"nvmath import failed: {e}")
    with open(os.path.join(out, "api_dump.txt"), "w") as fh:
        fh.write("\n".join(lines))


dump_apis()
failed = [r for r in results if not r[1]]
print(f"\n{len(results) - len(failed)}/{len(results)} smoke checks passed")
sys.exit(1 if failed else 0)
