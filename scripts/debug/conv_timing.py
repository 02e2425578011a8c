"""How EXHAUSTIVE search's timing of cuDNN plans decides, on a real model: for every convolution
graph the search times, the plans' times measured one call at a time on an idle GPU (each call
between two events: the timing before session 9) next to ``dnn._time_plans`` (back-to-back calls
behind a hold of the GPU), the host's time per call, and which plan each way picks. The summary
adds up, by the held timing, the GPU time of each way's picks.

    python scripts/debug/conv_timing.py [--models resnet50] [--batch 1] [--fp16]

Tunes in a fresh cache folder, so that every graph is timed.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from typing import Any

import onnxplug as ox

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from models import export_all, feeds_for, model_path, to_fp16

CUDA = "CUDAExecutionProvider"


def one_call_times(ctx: Any, g: Any, ptrs: dict[int, int], plans: list[int]) -> dict:
    """Per plan: (min of 3 single calls between events on an idle GPU, host ms per call)."""
    import cupy

    ws = ctx.scratch(max(int(g.get_workspace_size_plan_at_index(i)) for i in plans) or 1)
    stream, handle = ctx.stream.cupy_stream, ctx.stream.cudnn
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    out = {}
    for i in plans:
        best, host = math.inf, math.inf
        for _ in range(3):
            stream.synchronize()
            start.record(stream)
            t0 = time.perf_counter()
            g._execute_plan_at_index(ptrs, int(ws.ptr), i, handle)
            host = min(host, (time.perf_counter() - t0) * 1e3)
            end.record(stream)
            end.synchronize()
            best = min(best, cupy.cuda.get_elapsed_time(start, end))
        out[i] = (best, host)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="resnet50")
    ap.add_argument("--out", default="/tmp/onnxplug_models")
    ap.add_argument("--fp16", action="store_true")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--verbose", action="store_true", help="a line per graph")
    args = ap.parse_args()
    os.environ["ONNXPLUG_CACHE_DIR"] = tempfile.mkdtemp(prefix="onnxplug-cache-")
    from onnxplug_cuda import dnn

    rows: list[tuple[dict, dict]] = []
    held = dnn._time_plans

    def both(ctx: Any, g: Any, ptrs: dict[int, int], built: list[int]) -> dict[int, float]:
        times = held(ctx, g, ptrs, built)
        ok = [i for i in times if times[i] < math.inf]
        if len(ok) > 1:
            rows.append((times, one_call_times(ctx, g, ptrs, ok)))
        return times

    dnn._time_plans = both
    names = args.models.split(",")
    export_all(args.out, names)
    for name in names:
        path = model_path(args.out, name, args.batch)
        if args.fp16:
            path = to_fp16(path)
        rows.clear()
        s = ox.InferenceSession(path, providers=[CUDA, "CPUExecutionProvider"])
        s.run(None, feeds_for(name, args.batch))
        title = f"{name} b{args.batch} {'fp16' if args.fp16 else 'fp32'}"
        differ, sum_held, sum_old, hosts, kernels = 0, 0.0, 0.0, [], []
        for times, single in rows:
            pick_held = min(times, key=times.__getitem__)
            pick_old = min(single, key=lambda i: single[i][0])
            differ += pick_held != pick_old
            sum_held += times[pick_held]
            sum_old += times[pick_old]
            hosts += [h for _, h in single.values()]
            kernels.append(times[pick_held])
            if args.verbose:
                cells = " ".join(
                    f"{i}:{times[i] * 1e3:.1f}/{single[i][0] * 1e3:.1f}" for i in sorted(single)
                )
                print(f"  plan:held/one-call µs  {cells}  picks {pick_held} / {pick_old}")
        hosts.sort()
        kernels.sort()
        print(
            f"{title}: {len(rows)} graphs timed, picks differ in {differ}; GPU µs of the picks "
            f"(held timing) {sum_held * 1e3:.1f} held vs {sum_old * 1e3:.1f} one-call; host µs "
            f"per call median {hosts[len(hosts) // 2] * 1e3:.1f}; fastest plan's GPU µs median "
            f"{kernels[len(kernels) // 2] * 1e3:.1f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
