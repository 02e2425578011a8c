"""Which CUDA kernels one onnxplug run launches, and their GPU time: CUPTI through PyTorch's
profiler (it traces every kernel of the process, CuPy's, cuBLASLt's and cuDNN's included).
Replayed CUDA graphs are traced too, so the sum is the GPU busy time of a run without launch gaps.

    python scripts/debug/kernels.py [--models gpt2,resnet50] [--fp16] [--graph] [--top 25]

Models as benchmarks/models.py exports them (batch 1).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import numpy as np

import onnxplug as ox

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from models import export_all, feeds_for, model_path, to_fp16

CUDA = "CUDAExecutionProvider"


def trace(path: str, feeds: dict[str, np.ndarray], graph: bool, runs: int) -> tuple:
    import torch
    from torch.profiler import ProfilerActivity, profile

    opts = {"enable_cuda_graph": "1"} if graph else {}
    s = ox.InferenceSession(path, providers=[(CUDA, opts), "CPUExecutionProvider"])
    for _ in range(5):
        s.run(None, feeds)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            s.run(None, feeds)
        torch.cuda.synchronize()
    per: dict[str, list[float]] = collections.defaultdict(list)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0:
            per[e.name].append(e.device_time)
    return per


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt2,resnet50")
    ap.add_argument("--out", default="/tmp/onnxplug_models")
    ap.add_argument("--fp16", action="store_true")
    ap.add_argument("--graph", action="store_true", help="replayed CUDA graphs")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    names = args.models.split(",")
    export_all(args.out, names)
    for name in names:
        path = model_path(args.out, name, 1)
        if args.fp16:
            path = to_fp16(path, path.replace(".onnx", "_fp16.onnx"))
        per = trace(path, feeds_for(name, 1), args.graph, args.runs)
        total = sum(sum(v) for v in per.values()) / args.runs
        count = sum(len(v) for v in per.values()) / args.runs
        mode = "graph replay" if args.graph else "eager"
        dt = "fp16" if args.fp16 else "fp32"
        print(f"\n{name} b1 {dt} {mode}: {count:.0f} kernels, {total:.1f} µs of GPU time per run")
        print(f"  {'kernel':70s} {'per run':>7s} {'µs/run':>8s} {'µs each':>8s}")
        rows = sorted(per.items(), key=lambda kv: -sum(kv[1]))[: args.top]
        for k, v in rows:
            n = len(v) / args.runs
            print(f"  {k[:70]:70s} {n:7.1f} {sum(v) / args.runs:8.1f} {np.mean(v):8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
