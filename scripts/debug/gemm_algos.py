"""cuBLASLt's heuristic candidates for the GEMMs of BERT-base and GPT-2 (row-major
(M, K) @ (K, N), as the provider calls them), each timed as a replayed CUDA graph of 12 calls:
whether the heuristics' first choice, which the provider runs, is the fastest.

    python scripts/debug/gemm_algos.py [--m 128] [--dtype float32|float16] [--results 16]
"""

from __future__ import annotations

import argparse
import sys

import cupy
import numpy as np

from onnxplug_cuda.blas import MAX_WORKSPACE, NVMATH

SHAPES = [(768, 2304), (768, 768), (768, 3072), (3072, 768)]  # (K, N): QKV, out, FF1, FF2
CUDA_R_32F, CUDA_R_16F = 0, 2


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, default=128)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--results", type=int, default=16)
    args = ap.parse_args()
    L, cublas = NVMATH.modules()
    dt = np.dtype(args.dtype)
    cdt = CUDA_R_32F if dt == np.float32 else CUDA_R_16F
    ct = cublas.ComputeType
    compute = int(ct.COMPUTE_32F_FAST_TF32 if dt == np.float32 else ct.COMPUTE_32F)
    rt = cupy.cuda.runtime
    stream = cupy.cuda.Stream(non_blocking=True)
    handle = L.create()
    alpha, beta = np.ones(1, np.float32), np.zeros(1, np.float32)
    ws = cupy.empty(MAX_WORKSPACE, np.uint8)
    m = args.m
    for k, n in SHAPES:
        a = cupy.random.standard_normal((m, k), dtype=np.float32).astype(dt)
        b = cupy.random.standard_normal((k, n), dtype=np.float32).astype(dt)
        c = cupy.empty((m, n), dt)
        desc = L.matmul_desc_create(compute, CUDA_R_32F)
        la = L.matrix_layout_create(cdt, n, k, n)  # the library's A: our B, column-major
        lb = L.matrix_layout_create(cdt, k, m, k)  # the library's B: our A
        lc = L.matrix_layout_create(cdt, n, m, n)
        pref = L.matmul_preference_create()
        size = np.array(MAX_WORKSPACE, np.uint64)
        L.matmul_preference_set_attribute(
            pref, int(L.MatmulPreferenceAttribute.MAX_WORKSPACE_BYTES), size.ctypes.data, 8
        )
        results = np.zeros(args.results, dtype=L.matmul_heuristic_result_dtype)
        found = np.zeros(1, np.int32)
        L.matmul_algo_get_heuristic(
            handle, desc, la, lb, lc, lc, pref, len(results), results.ctypes.data,
            found.ctypes.data,
        )  # fmt: skip
        print(f"M={m} K={k} N={n} {dt}: {found[0]} candidates", flush=True)
        times = []
        for i in range(int(found[0])):
            algo = results.ctypes.data + i * results.itemsize
            need = int(results["workspace_size"][i])

            call_args = (
                handle, desc, alpha.ctypes.data, b.data.ptr, la, a.data.ptr, lb,
                beta.ctypes.data, c.data.ptr, lc, c.data.ptr, lc, algo, ws.data.ptr, need,
                stream.ptr,
            )  # fmt: skip

            def call(call_args: tuple = call_args) -> None:
                L.matmul(*call_args)

            try:
                with stream:
                    call()
                    stream.synchronize()
                    rt.streamBeginCapture(stream.ptr, 0)
                    for _ in range(12):
                        call()
                    graph = rt.streamEndCapture(stream.ptr)
                    exe = rt.graphInstantiate(graph)
                    for _ in range(5):
                        rt.graphLaunch(exe, stream.ptr)
                    start, end = cupy.cuda.Event(), cupy.cuda.Event()
                    start.record(stream)
                    for _ in range(50):
                        rt.graphLaunch(exe, stream.ptr)
                    end.record(stream)
                    end.synchronize()
                    us = cupy.cuda.get_elapsed_time(start, end) * 1e3 / 50 / 12
                    rt.graphExecDestroy(exe)
                    rt.graphDestroy(graph)
            except Exception as e:
                print(f"  {i}: failed ({e})")
                continue
            times.append((us, i))
            print(f"  {i:2d}: {us:7.2f} µs per call, workspace {need}", flush=True)
        best = min(times)
        print(f"  fastest: candidate {best[1]}, {best[0]:.2f} µs against {times[0][0]:.2f} "
              f"for the first ({100 * (1 - best[0] / times[0][0]):.0f}% less)")  # fmt: skip
        for h in (pref,):
            L.matmul_preference_destroy(h)
        for lay in (la, lb, lc):
            L.matrix_layout_destroy(lay)
        L.matmul_desc_destroy(desc)
    L.destroy(handle)
    return 0


if __name__ == "__main__":
    sys.exit(main())
