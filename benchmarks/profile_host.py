"""Where the host time of a run goes: cProfile of onnxplug runs on the CUDA provider.

    python benchmarks/profile_host.py [--models resnet50,bert_base,gpt2] [--runs N] [--top K]

Exports the batch-1 models as benchmarks/models.py does, then for each: eager plain run(),
plain run() with CUDA graphs, and the tiny one-node model replayed; prints the functions with the
most own time (tottime) per run. A diagnostic for the fast-path work, not a benchmark: cProfile
inflates Python-heavy code.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from models import CUDA, export_all, feeds_for, model_path, tiny_model

import onnxplug as ox


def profile(label: str, fn, runs: int, top: int) -> None:
    for _ in range(5):
        fn()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(runs):
        fn()
    pr.disable()
    out = io.StringIO()
    st = pstats.Stats(pr, stream=out).sort_stats("tottime")
    st.print_stats(top)
    total = st.total_tt / runs * 1e6
    print(f"\n===== {label}: {total:.0f} µs per run under cProfile")
    lines = out.getvalue().splitlines()
    start = next(i for i, line in enumerate(lines) if "ncalls" in line)
    for line in lines[start : start + top + 1]:
        print(line[:160])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="resnet50,bert_base,gpt2")
    ap.add_argument("--out", default="/tmp/onnxplug_models")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    names = args.models.split(",")
    export_all(args.out, names, batches=(1,))
    for name in names:
        path = model_path(args.out, name, 1)
        feeds = feeds_for(name, 1)
        for graph in ("0", "1"):
            s = ox.InferenceSession(
                path, providers=[(CUDA, {"enable_cuda_graph": graph}), "CPUExecutionProvider"]
            )
            profile(
                f"{name} b1 {'graph' if graph == '1' else 'eager'}",
                lambda s=s, feeds=feeds: s.run(None, feeds),
                args.runs,
                args.top,
            )
    from onnxplug_cuda.kernels import _base

    print("\nnodes that ran unprepared (op: first reason):")
    for op, why in sorted(_base.UNPREPARED.items()):
        print(f"  {op}: {why[:200]}")
    s = ox.InferenceSession(
        tiny_model(), providers=[(CUDA, {"enable_cuda_graph": "1"}), "CPUExecutionProvider"]
    )
    x = np.ones((1, 16), np.float32)
    profile("tiny graph plain run()", lambda: s.run(None, {"x": x}), 2000, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
