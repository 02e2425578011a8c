"""cuBLASLt's heuristic candidates for the GEMMs of BERT-base and GPT-2 (row-major
(M, K) @ (K, N), as the provider calls them), each timed as a replayed CUDA graph of 12 calls:
whether the heuristics' first choice, which the provider runs, is the fastest. With
``--streams k``, each candidate is also timed among k streams (k graphs replayed at once, the
weight shared, as k threads' runs share it): which candidates keep their speed when streams
share the GPU. Prints each candidate's configuration (algorithm, tile, stages, split-K).

    python scripts/debug/gemm_algos.py [--m 128] [--dtype float32|float16] [--results 16]
    python scripts/debug/gemm_algos.py --streams 4
    python scripts/debug/gemm_algos.py --reduction-mask 1   # split-K reduced in place only
    python scripts/debug/gemm_algos.py --streams 4 --stages --results 2
    python scripts/debug/gemm_algos.py --streams 4 --search --shapes 3072,768

``--reduction-mask`` restricts the candidates' split-K reduction schemes (cuBLASLt's
``REDUCTION_SCHEME_MASK`` preference: 1 in place, 2 a workspace in the compute type and a
reduction kernel, 4 in the output type; 0 no split-K). Each candidate's captured graph is
listed by node type (a memset node takes a graph off the driver's fast launch path).
``--stages`` also times each candidate with every other stage count (software pipeline depth,
and so shared memory per CTA) its algorithm has: fewer stages leave room for more CTAs of
other streams on an SM. ``--search`` times every tile, stage count and split-K of the first
candidate's algorithm that cuBLASLt accepts, beyond the heuristic's few candidates.
"""

from __future__ import annotations

import argparse
import sys
import time
import types
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


def node_types(graph: int) -> str:
    """A captured graph's nodes counted by type, e.g. ``kernel=12 memset=12``."""
    from cuda.bindings import runtime as cudart

    g = cudart.cudaGraph_t(init_value=graph)
    _, _, n = cudart.cudaGraphGetNodes(g, numNodes=0)
    _, nodes, _ = cudart.cudaGraphGetNodes(g, numNodes=n)
    counts: dict[str, int] = {}
    for node in nodes:
        _, kind = cudart.cudaGraphNodeGetType(node)
        name = kind.name.removeprefix("cudaGraphNodeType").lower()
        counts[name] = counts.get(name, 0) + 1
    return " ".join(f"{k}={v}" for k, v in sorted(counts.items()))


def cap_ids(L: Any, algo: int, cap: str) -> list[int]:
    """An algorithm's capability array ``cap``: ``STAGES_IDS`` (the stage counts, ``MatmulStages``
    values, its kernels come with), ``TILE_IDS``."""
    attr = int(getattr(L.MatmulAlgoCapAttribute, cap))
    written = np.zeros(1, np.uint64)
    L.matmul_algo_cap_get_attribute(algo, attr, 0, 0, written.ctypes.data)
    ids = np.zeros(max(1, int(written[0]) // 4), np.uint32)
    L.matmul_algo_cap_get_attribute(algo, attr, ids.ctypes.data, ids.nbytes, written.ctypes.data)
    return [int(x) for x in ids[: int(written[0]) // 4]]


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


class Problem(types.SimpleNamespace):
    """One GEMM shape's operands, layouts and streams (see main)."""


def timed(p: Problem, algo: int, need: int) -> tuple[float, float | None, str]:
    """(µs per call alone, among the streams, the graph's nodes) of one algorithm."""
    rt = cupy.cuda.runtime
    graphs: list[tuple[int, int]] = []
    try:
        for s, a, c, ws in zip(p.streams, p.a_s, p.c_s, p.workspaces):
            call_args = (
                p.handle, p.desc, p.alpha.ctypes.data, p.b.data.ptr, p.la, a.data.ptr, p.lb,
                p.beta.ctypes.data, c.data.ptr, p.lc, c.data.ptr, p.lc, algo, ws.data.ptr,
                need, s.ptr,
            )  # fmt: skip
            p.L.matmul(*call_args)  # loads the kernel
            s.synchronize()
            rt.streamBeginCapture(s.ptr, 0)
            for _ in range(p.calls):
                p.L.matmul(*call_args)
            graph = rt.streamEndCapture(s.ptr)
            graphs.append((rt.graphInstantiate(graph), graph))
        nodes = node_types(graphs[0][1])
        execs = [exe for exe, _ in graphs]
        us = replay_us(execs[:1], p.streams, p.calls)
        among = replay_us(execs, p.streams, p.calls) if len(p.streams) > 1 else None
        return us, among, nodes
    finally:
        for exe, graph in graphs:
            rt.graphExecDestroy(exe)
            rt.graphDestroy(graph)


def variant(p: Problem, base: Any, **config: int) -> tuple[Any, int] | None:
    """A copy of heuristic result ``base`` (a one-record array) with the algorithm
    configuration attributes ``config`` set (``STAGES_ID=9``), and the workspace it needs;
    None where cuBLASLt's check rejects it for this problem."""
    v = base.copy()
    for name, value in config.items():
        x = np.array(value, np.uint32)
        attr = int(getattr(p.L.MatmulAlgoConfigAttribute, name))
        p.L.matmul_algo_config_set_attribute(v.ctypes.data, attr, x.ctypes.data, 4)
    check = np.zeros(1, dtype=p.L.matmul_heuristic_result_dtype)
    try:
        p.L.matmul_algo_check(p.handle, p.desc, p.la, p.lb, p.lc, p.lc, v.ctypes.data,
                              check.ctypes.data)  # fmt: skip
    except Exception:
        return None
    return v, int(check["workspace_size"][0])


def search(p: Problem, base: Any, seconds: float) -> None:
    """Every tile x stage count x split-K (reduced through a workspace in the compute type)
    of the first candidate's algorithm that cuBLASLt accepts for the problem, timed alone and
    among the streams, for up to ``seconds``; the 12 best among the streams and the 12 best
    alone are printed."""
    deadline = time.monotonic() + seconds
    algo = base.ctypes.data
    tiles, stages = cap_ids(p.L, algo, "TILE_IDS"), cap_ids(p.L, algo, "STAGES_IDS")
    rows = []
    for tile in tiles:
        for stage in stages:
            for split in (1, 2, 3, 4, 6, 8, 11, 12, 16):
                if time.monotonic() > deadline:
                    break
                made = variant(
                    p, base, TILE_ID=tile, STAGES_ID=stage, SPLITK_NUM=split,
                    REDUCTION_SCHEME=2 if split > 1 else 0,
                )  # fmt: skip
                if made is None:
                    continue
                v, need = made
                if need > MAX_WORKSPACE:
                    continue
                try:
                    us, among, _ = timed(p, v.ctypes.data, need)
                except Exception:
                    continue
                rows.append((among or us, us, config(p.L, v.ctypes.data)))
    stopped = " (stopped at the time limit)" if time.monotonic() > deadline else ""
    print(f"  search: {len(rows)} configurations ran{stopped}")
    for label, key in (("among the streams", 0), ("alone", 1)):
        print(f"  best {label}:")
        for among, us, cfg in sorted(rows, key=lambda r: r[key])[:12]:
            print(f"    {us:7.2f} µs alone, {among:6.2f} among {len(p.streams)}: {cfg}")


def report(p: Problem, label: str, algo: int, need: int) -> float | None:
    """Times one algorithm and prints a line; its µs alone (None where it failed)."""
    try:
        us, among, nodes = timed(p, algo, need)
    except Exception as e:
        print(f"  {label}: failed ({e})")
        return None
    k = len(p.streams)
    shared = f", among {k} streams {among:6.2f} µs per call ({us / among:.2f}x)" if among else ""
    print(
        f"  {label}: {us:7.2f} µs per call{shared}, workspace {need}, "
        f"{config(p.L, algo)}, graph {nodes}",
        flush=True,
    )
    return us


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, default=128)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--results", type=int, default=16)
    ap.add_argument("--streams", type=int, default=1, help="also time among this many streams")
    ap.add_argument("--reduction-mask", type=int, default=None, help="REDUCTION_SCHEME_MASK")
    ap.add_argument(
        "--stages", action="store_true", help="also each candidate with every stage count it has"
    )
    ap.add_argument(
        "--search",
        action="store_true",
        help="time every tile x stages x split-K of the first candidate's algorithm",
    )
    ap.add_argument("--search-seconds", type=float, default=150.0)
    ap.add_argument("--shapes", default=None, help="K,N[;K,N...]: these shapes only")
    args = ap.parse_args()
    shapes = (
        [tuple(int(x) for x in kn.split(",")) for kn in args.shapes.split(";")]
        if args.shapes
        else SHAPES
    )
    L, cublas = NVMATH.modules()
    dt = np.dtype(args.dtype)
    cdt = CUDA_R_32F if dt == np.float32 else CUDA_R_16F
    ct = cublas.ComputeType
    compute = int(ct.COMPUTE_32F_FAST_TF32 if dt == np.float32 else ct.COMPUTE_32F)
    k_streams = max(1, args.streams)
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(k_streams)]
    handle = L.create()
    alpha, beta = np.ones(1, np.float32), np.zeros(1, np.float32)
    workspaces = [cupy.empty(MAX_WORKSPACE, np.uint8) for _ in streams]
    m, calls = args.m, 12
    for k, n in shapes:
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
        if args.reduction_mask is not None:
            mask = np.array(args.reduction_mask, np.uint32)
            attr = int(L.MatmulPreferenceAttribute.REDUCTION_SCHEME_MASK)
            L.matmul_preference_set_attribute(pref, attr, mask.ctypes.data, 4)
        results = np.zeros(args.results, dtype=L.matmul_heuristic_result_dtype)
        found = np.zeros(1, np.int32)
        L.matmul_algo_get_heuristic(
            handle, desc, la, lb, lc, lc, pref, len(results), results.ctypes.data,
            found.ctypes.data,
        )  # fmt: skip
        print(f"M={m} K={k} N={n} {dt}: {found[0]} candidates", flush=True)
        p = Problem(
            L=L, handle=handle, desc=desc, la=la, lb=lb, lc=lc, a_s=a_s, c_s=c_s, b=b,
            alpha=alpha, beta=beta, streams=streams, workspaces=workspaces,
            calls=calls,
        )  # fmt: skip
        if args.search and found[0]:
            search(p, results[:1].copy(), args.search_seconds)
            continue
        times = []
        for i in range(int(found[0])):
            algo = results.ctypes.data + i * results.itemsize
            us = report(p, f"{i:2d}", algo, int(results["workspace_size"][i]))
            if us is not None:
                times.append((us, i))
            if args.stages:
                for stage in cap_ids(L, algo, "STAGES_IDS"):
                    made = variant(p, results[i : i + 1], STAGES_ID=stage)
                    if made is None:
                        continue  # this stage count does not run this problem
                    v, need = made
                    known = stage in L.MatmulStages._value2member_map_
                    name = L.MatmulStages(stage).name.removeprefix("STAGES_") if known else stage
                    report(p, f"{i:2d} {name:>6}", v.ctypes.data, need)
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
