"""Which CUDA kernels one onnxplug run launches, and their GPU time: CUPTI through PyTorch's
profiler (it traces every kernel of the process, CuPy's, cuBLASLt's and cuDNN's included).
Replayed CUDA graphs are traced too, so the sum is the GPU busy time of a run without launch gaps.

    python scripts/debug/kernels.py [--models gpt2,resnet50] [--batch 1] [--fp16] [--graph]
                                    [--top 25] [--torch]

Models as benchmarks/models.py exports them: ResNet-50 at any ``--batch``, BERT and GPT-2 at 1
or 8.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import Any

import numpy as np

import onnxplug as ox

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from models import export_all, feeds_for, gpu_trace, model_path, to_fp16, torch_graph, torch_model

CUDA = "CUDAExecutionProvider"


def trace_torch(name: str, feeds: dict[str, np.ndarray], args: Any) -> dict[str, list[float]]:
    """The same trace of the PyTorch model (eager, or one captured CUDA graph replayed)."""
    import torch

    with torch.inference_mode():
        call = torch_model(name, feeds, args.fp16)
        return gpu_trace(torch_graph(call) if args.graph else call, args.runs)


def report(title: str, per: dict[str, list[float]], args: Any) -> None:
    total = sum(sum(v) for v in per.values()) / args.runs
    count = sum(len(v) for v in per.values()) / args.runs
    print(f"\n{title}: {count:.0f} kernels, {total:.1f} µs of GPU time per run")
    print(f"  {'kernel':70s} {'per run':>7s} {'µs/run':>8s} {'µs each':>8s}")
    rows = sorted(per.items(), key=lambda kv: -sum(kv[1]))[: args.top]
    for k, v in rows:
        n = len(v) / args.runs
        print(f"  {k[:70]:70s} {n:7.1f} {sum(v) / args.runs:8.1f} {np.mean(v):8.2f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt2,resnet50")
    ap.add_argument("--out", default="/tmp/onnxplug_models")
    ap.add_argument("--fp16", action="store_true")
    ap.add_argument("--graph", action="store_true", help="replayed CUDA graphs")
    ap.add_argument("--batch", type=int, default=1, help="1, or 8 (BERT, GPT-2)")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--torch", action="store_true", help="also the PyTorch model's kernels")
    args = ap.parse_args()
    names = args.models.split(",")
    export_all(args.out, names)
    mode = "graph replay" if args.graph else "eager"
    dt = "fp16" if args.fp16 else "fp32"
    for name in names:
        b = args.batch
        path = model_path(args.out, name, b)
        if args.fp16:
            path = to_fp16(path)
        feeds = feeds_for(name, b)
        opts = {"enable_cuda_graph": "1"} if args.graph else {}
        s = ox.InferenceSession(path, providers=[(CUDA, opts), "CPUExecutionProvider"])
        report(
            f"{name} b{b} {dt} {mode}",
            gpu_trace(functools.partial(s.run, None, feeds), args.runs),
            args,
        )
        if args.torch:
            report(f"PyTorch {name} b{b} {dt} {mode}", trace_torch(name, feeds, args), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
