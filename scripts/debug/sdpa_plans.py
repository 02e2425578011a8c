"""Every plan cuDNN offers for one float16 fused-attention graph (the provider's ``SdpaSpec``):
its workspace, its GPU time per call, the node types one call records into a CUDA graph (a
memset node takes a graph off the driver's launch fast path), and the host time to launch a
graph of 12 calls (one per BERT-base layer).

    python scripts/debug/sdpa_plans.py [--heads 12] [--seq 128] [--head 64] [--mask bias|none|causal]
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time

import cupy
import numpy as np

from onnxplug_cuda import dnn

NODE_TYPES = {0: "kernel", 1: "memcpy", 2: "memset", 3: "host", 4: "graph", 5: "empty"}


def node_types(graph: int) -> dict[str, int]:
    cuda = ctypes.CDLL("libcuda.so.1")
    count = ctypes.c_size_t()
    assert cuda.cuGraphGetNodes(ctypes.c_void_p(graph), None, ctypes.byref(count)) == 0
    nodes = (ctypes.c_void_p * count.value)()
    assert cuda.cuGraphGetNodes(ctypes.c_void_p(graph), nodes, ctypes.byref(count)) == 0
    out: dict[str, int] = {}
    for node in nodes:
        t = ctypes.c_int()
        assert cuda.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(t)) == 0
        name = NODE_TYPES.get(t.value, str(t.value))
        out[name] = out.get(name, 0) + 1
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--head", type=int, default=64)
    ap.add_argument("--mask", choices=("bias", "none", "causal"), default="bias")
    args = ap.parse_args()
    b, n, s, h = args.batch, args.heads, args.seq, args.head
    rt = cupy.cuda.runtime
    cudnn = dnn.import_cudnn()
    stream = cupy.cuda.Stream(non_blocking=True)
    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=stream.ptr)
    total = 3 * n * h
    bias = (b, 1, s, s) if args.mask == "bias" else None
    spec = dnn.SdpaSpec.packed((b, n, s, h, h), total, bias, args.mask == "causal", h**-0.5)
    qkv = cupy.random.standard_normal((b * s, total), dtype=np.float32).astype(np.float16)
    y = cupy.empty((b, s, n * h), np.float16)
    isz = 2
    ptrs = {
        dnn.UID_Q: int(qkv.data.ptr),
        dnn.UID_K: int(qkv.data.ptr) + n * h * isz,
        dnn.UID_V: int(qkv.data.ptr) + 2 * n * h * isz,
        dnn.UID_O: int(y.data.ptr),
    }
    keep = [qkv, y]
    if bias is not None:
        term = cupy.zeros(bias, np.float16)
        keep.append(term)
        ptrs[dnn.UID_BIAS] = int(term.data.ptr)
    t0 = time.perf_counter()
    g = dnn.sdpa_graph(cudnn, spec, cudnn.data_type.HALF, handle)
    print(f"heuristics' plan built in {(time.perf_counter() - t0) * 1e3:.1f} ms")
    count = g.get_execution_plan_count()
    print(f"B={b} N={n} S={s} H={h} mask={args.mask}: {count} plans", flush=True)
    want = None
    for i in range(count):
        t0 = time.perf_counter()
        try:
            g.build_plan_at_index(i)
            built_ms = (time.perf_counter() - t0) * 1e3
        except Exception as e:
            print(f"  plan {i}: not built ({type(e).__name__}: {str(e)[:80]})")
            continue
        name = g.get_plan_name_at_index(i)
        ws = int(g.get_workspace_size_plan_at_index(i))
        wsbuf = cupy.empty(max(ws, 1), np.uint8)
        ws_ptr = int(wsbuf.data.ptr) if ws else 0
        with stream:
            y.fill(0)
            g._execute_plan_at_index(ptrs, ws_ptr, i, handle)
            stream.synchronize()
            same = want is None or bool(cupy.array_equal(y, want))
            if want is None:
                want = y.copy()
            for _ in range(20):
                g._execute_plan_at_index(ptrs, ws_ptr, i, handle)
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record(stream)
            for _ in range(200):
                g._execute_plan_at_index(ptrs, ws_ptr, i, handle)
            end.record(stream)
            end.synchronize()
            us = cupy.cuda.get_elapsed_time(start, end) * 1e3 / 200
            rt.streamBeginCapture(stream.ptr, 0)
            for _ in range(12):
                g._execute_plan_at_index(ptrs, ws_ptr, i, handle)
            graph = rt.streamEndCapture(stream.ptr)
            types = node_types(graph)
            exe = rt.graphInstantiate(graph)
            for _ in range(10):
                rt.graphLaunch(exe, stream.ptr)
            stream.synchronize()
            launch = []
            for _ in range(200):
                t0 = time.perf_counter()
                rt.graphLaunch(exe, stream.ptr)
                launch.append(time.perf_counter() - t0)
                stream.synchronize()
            start.record(stream)
            for _ in range(100):
                rt.graphLaunch(exe, stream.ptr)
            end.record(stream)
            end.synchronize()
            graph_us = cupy.cuda.get_elapsed_time(start, end) * 1e3 / 100
            rt.graphExecDestroy(exe)
            rt.graphDestroy(graph)
        print(
            f"  plan {i}: {name[:24]:24s} built in {built_ms:7.1f} ms, ws {ws:6d} B, "
            f"{us:5.1f} µs/call; a graph of 12 calls: {types}, {graph_us:6.1f} µs on the GPU, "
            f"launched in {np.median(launch) * 1e6:5.1f} µs; output as plan 0's: {same}",
            flush=True,
        )
    cudnn.destroy_handle(handle)
    return 0


if __name__ == "__main__":
    sys.exit(main())
