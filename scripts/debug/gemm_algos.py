"""cuBLASLt's heuristic candidates for the GEMMs of BERT-base and GPT-2 (row-major
(M, K) @ (K, N), as the provider calls them), each timed as a replayed CUDA graph of 12 calls:
whether the heuristics' first choice, which the provider runs, is the fastest. With
``--streams k``, each candidate is also timed among k streams (k graphs replayed at once, the
weight shared, as k threads' runs share it): which candidates keep their speed when streams
share the GPU. Prints each candidate's configuration (algorithm, tile, stages, split-K).

    python scripts/debug/gemm_algos.py [--m 128] [--dtype float32|float16] [--results 16]
    python scripts/debug/gemm_algos.py --streams 4
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import cupy
import numpy as np

from onnxplug_cuda.blas import MAX_WORKSPACE, NVMATH

SHAPES = [(768, 2304), (768, 768), (768, 3072), (3072, 768)]  # (K, N): QKV, out, FF1, FF2
CUDA_R_32F, CUDA_R_16F = 0, 2
CONFIG = ("ID", "TILE_ID", "STAGES_ID", "SPLITK_NUM", "REDUCTION_SCHEME")


def config(L: Any, algo: int) -> str:
    """An algorithm's configuration attributes, as name=value."""
    out = []
    for name in CONFIG:
        buf, written = np.zeros(1, np.uint32), np.zeros(1, np.uint64)
        attr = int(getattr(L.MatmulAlgoConfigAttribute, name))
        L.matmul_algo_config_get_attribute(algo, attr, buf.ctypes.data, 4, written.ctypes.data)
        out.append(f"{name.lower()}={int(buf[0])}")
    return " ".join(out)


def replay_us(execs: list, streams: list, calls: int, rounds: int = 50) -> float:
    """µs per call of the graphs in ``execs`` replayed ``rounds`` times, each on its own
    stream of ``streams``, all at once (best of three windows)."""
    rt = cupy.cuda.runtime
    best = float("inf")
    for _ in range(3):
        for exe, s in zip(execs, streams):
            rt.graphLaunch(exe, s.ptr)
        cupy.cuda.Device().synchronize()
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(streams[0])
        for s in streams[1 : len(execs)]:
            s.wait_event(start)
        for _ in range(rounds):
            for exe, s in zip(execs, streams):
                rt.graphLaunch(exe, s.ptr)
        for s in streams[1 : len(execs)]:
            done = cupy.cuda.Event()
            done.record(s)
            streams[0].wait_event(done)
        end.record(streams[0])
        end.synchronize()
        best = min(best, cupy.cuda.get_elapsed_time(start, end) * 1e3)
    return best / (rounds * calls * len(execs))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, default=128)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--results", type=int, default=16)
    ap.add_argument("--streams", type=int, default=1, help="also time among this many streams")
    args = ap.parse_args()
    L, cublas = NVMATH.modules()
    dt = np.dtype(args.dtype)
    cdt = CUDA_R_32F if dt == np.float32 else CUDA_R_16F
    ct = cublas.ComputeType
    compute = int(ct.COMPUTE_32F_FAST_TF32 if dt == np.float32 else ct.COMPUTE_32F)
    rt = cupy.cuda.runtime
    k_streams = max(1, args.streams)
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(k_streams)]
    handle = L.create()
    alpha, beta = np.ones(1, np.float32), np.zeros(1, np.float32)
    workspaces = [cupy.empty(MAX_WORKSPACE, np.uint8) for _ in streams]
    m, calls = args.m, 12
    for k, n in SHAPES:
        b = cupy.random.standard_normal((k, n), dtype=np.float32).astype(dt)  # the weight
        a_s = [cupy.random.standard_normal((m, k), dtype=np.float32).astype(dt) for _ in streams]
        c_s = [cupy.empty((m, n), dt) for _ in streams]
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
            graphs: list[tuple[int, int]] = []
            try:
                for s, a, c, ws in zip(streams, a_s, c_s, workspaces):
                    call_args = (
                        handle, desc, alpha.ctypes.data, b.data.ptr, la, a.data.ptr, lb,
                        beta.ctypes.data, c.data.ptr, lc, c.data.ptr, lc, algo, ws.data.ptr,
                        need, s.ptr,
                    )  # fmt: skip
                    L.matmul(*call_args)  # loads the kernel
                    s.synchronize()
                    rt.streamBeginCapture(s.ptr, 0)
                    for _ in range(calls):
                        L.matmul(*call_args)
                    graph = rt.streamEndCapture(s.ptr)
                    graphs.append((rt.graphInstantiate(graph), graph))
                execs = [exe for exe, _ in graphs]
                us = replay_us(execs[:1], streams, calls)
                among = replay_us(execs, streams, calls) if k_streams > 1 else None
            except Exception as e:
                print(f"  {i}: failed ({e})")
                continue
            finally:
                for exe, graph in graphs:
                    rt.graphExecDestroy(exe)
                    rt.graphDestroy(graph)
            times.append((us, i))
            shared = (
                f", among {k_streams} streams {among:6.2f} µs per call ({us / among:.2f}x)"
                if among is not None
                else ""
            )
            print(
                f"  {i:2d}: {us:7.2f} µs per call{shared}, workspace {need}, {config(L, algo)}",
                flush=True,
            )
        best = min(times)
        print(f"  fastest: candidate {best[1]}, {best[0]:.2f} µs against {times[0][0]:.2f} "
              f"for the first ({100 * (1 - best[0] / times[0][0]):.0f}% less)")  # fmt: skip
        L.matmul_preference_destroy(pref)
        for lay in (la, lb, lc):
            L.matrix_layout_destroy(lay)
        L.matmul_desc_destroy(desc)
    L.destroy(handle)
    return 0


if __name__ == "__main__":
    sys.exit(main())
