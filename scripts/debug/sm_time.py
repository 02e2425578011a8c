"""Where one replayed run holds the GPU's SMs: a CUPTI trace (PyTorch's profiler) of a
session's captured CUDA graph replayed on one stream, per kernel name its µs per inference,
grid, block, shared memory and registers, and the SM-time it holds (µs × min(CTAs, SMs) / SMs,
a CTA counted as holding its SM): the kernels that keep SMs busy, which is what concurrent
streams run out of (docs/providers/cuda.md, session 28).

    python scripts/debug/sm_time.py [--model bert_base] [--fp16] [--top 30]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import threads


def main() -> int:
    import torch
    from torch.profiler import ProfilerActivity, profile

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bert_base")
    ap.add_argument("--fp16", action="store_true")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--out", default="/tmp/onnxplug_models")
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    [(label, path, feeds)] = threads.cuda_models([args.model], args.out, args.fp16)
    sess = threads.session(path, threads.CUDA, True, [], {})
    with threads.held_graphs(sess, feeds, 1) as (ep, graphs), ep.device_guard():
        threads.replay_rate(ep, graphs, 20)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            threads.replay_rate(ep, graphs, args.rounds)
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        trace = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(trace)
        with open(trace) as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("cat") == "kernel"]
    per: dict[str, list] = collections.defaultdict(lambda: [0.0, 0.0, 0, ()])
    spans = []
    for e in events:
        a = e.get("args", {})
        grid = a.get("grid", [1, 1, 1])
        ctas = grid[0] * grid[1] * grid[2]
        us = e["dur"] / args.rounds
        row = per[e["name"]]
        row[0] += us
        row[1] += us * min(ctas, sms) / sms
        row[2] += 1
        row[3] = (grid, a.get("block"), a.get("shared memory"), a.get("registers per thread"))
        spans.append((e["ts"], e["ts"] + e["dur"]))
    total = sum(r[0] for r in per.values())
    held = sum(r[1] for r in per.values())
    busy, _ = threads.gpu_occupancy(spans)
    print(f"## {label}: {total:.1f} µs of kernels per inference, {held:.1f} µs of SM-time "
          f"({held / total:.0%}); a kernel running {busy:.0%} of the replay")  # fmt: skip
    print("| µs | SM-µs | calls | grid | block | smem | regs | kernel |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (us, sm_us, calls, meta) in sorted(per.items(), key=lambda kv: -kv[1][1])[: args.top]:
        grid, block, smem, regs = meta
        print(f"| {us:.1f} | {sm_us:.1f} | {calls // args.rounds} | {grid} | {block} | {smem} | "
              f"{regs} | {name[:90]} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
