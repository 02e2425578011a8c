"""How the kernels of k concurrent replays share the GPU: each thread captures its own CUDA
graph of one session (as ``benchmarks/threads.py --gpu-bound`` does), then this thread replays
them round-robin on their k streams, timed and traced (CUPTI through PyTorch's profiler).
Prints inferences/s per k and, per kernel, its µs per inference alone (k=1) and among k
streams, so that the kernels that do not overlap stand out.

``--sm-target N`` asks cuBLASLt (``CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET``) to choose and size
its kernels for N SMs, as for a device shared with concurrent streams: an experiment, patched
in here, not a provider option (docs/providers/cuda.md, session 23: it lowers throughput).

    python scripts/debug/overlap.py --model bert_base [--sm-target 33] [--fp16]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from typing import Any

import onnxplug as ox

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import models
import threads

CUDA = "CUDAExecutionProvider"


def patch_sm_target(n: int) -> None:
    import numpy as np

    from onnxplug_cuda.blas import NVMATH

    NVMATH.start()
    lt, _ = NVMATH.modules()
    create = lt.matmul_desc_create
    attr = lt.MatmulDescAttribute.SM_COUNT_TARGET

    def desc_create(*a: Any) -> int:
        desc = create(*a)
        v = np.array(n, dtype=lt.get_matmul_desc_attribute_dtype(attr))
        lt.matmul_desc_set_attribute(desc, int(attr), v.ctypes.data, v.itemsize)
        return desc

    lt.matmul_desc_create = desc_create


def traced(ep: Any, chosen: list, rounds: int) -> tuple[dict[str, float], float, float]:
    """µs per inference per kernel name, the GPU's busy fraction and mean concurrency."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        threads.replay_rate(ep, chosen, rounds)
        torch.cuda.synchronize()
    per: dict[str, float] = collections.defaultdict(float)
    spans = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0:
            per[e.name] += e.device_time / (rounds * len(chosen))
            spans.append((e.time_range.start, e.time_range.end))
    return per, *threads.gpu_occupancy(spans)


def kind(name: str) -> str:
    n = name.lower()
    if any(s in n for s in ("sdpa", "flash", "oxa_")):
        return "attention"
    if any(s in n for s in ("gemm", "xmma", "cutlass", "sm90_", "matmul", "splitk", "nvjet")):
        return "gemm"  # cuDNN's implicit-GEMM convolutions too
    if any(s in n for s in ("conv", "fprop", "cudnn", "winograd")):
        return "conv/cudnn"
    return "other"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bert_base")
    ap.add_argument("--sm-target", type=int, default=-1)
    ap.add_argument("--fp16", action="store_true")
    ap.add_argument("--k", default="1,2,4")
    ap.add_argument("--out", default="/tmp/onnxplug_models")
    args = ap.parse_args()
    ks = [int(x) for x in args.k.split(",")]
    models.export_all(args.out, [args.model], batches=(1,))
    path, feeds = models.model_path(args.out, args.model, 1), models.feeds_for(args.model, 1)
    if args.fp16:
        path = models.to_fp16(path)
    if args.sm_target > 0:
        patch_sm_target(args.sm_target)
    sess = ox.InferenceSession(path, providers=[(CUDA, {"enable_cuda_graph": "1"})])
    label = f"{args.model}{' fp16' if args.fp16 else ''} sm_target={args.sm_target}"
    with threads.held_graphs(sess, feeds, max(ks)) as (ep, graphs), ep.device_guard():
        rates = {}
        for k in ks:
            threads.replay_rate(ep, graphs[:k], 20)
            rates[k] = max(threads.replay_rate(ep, graphs[:k], max(50, 300 // k)) for _ in range(3))
        print(f"{label}: inferences/s " + ", ".join(f"k={k} {r:.1f}" for k, r in rates.items())
              + f"; {max(ks)}/1 {rates[max(ks)] / rates[min(ks)]:.2f}x", flush=True)  # fmt: skip
        one, busy1, conc1 = traced(ep, graphs[:1], 20)
        many, busyk, conck = traced(ep, graphs[: max(ks)], 20)
    k = max(ks)
    print(f"  k=1: busy {busy1:.0%}, concurrency {conc1:.2f}; k={k}: busy {busyk:.0%}, "
          f"concurrency {conck:.2f}")  # fmt: skip
    by_kind: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for name in set(one) | set(many):
        by_kind[kind(name)][0] += one.get(name, 0.0)
        by_kind[kind(name)][1] += many.get(name, 0.0)
    for kd, (a, b) in sorted(by_kind.items()):
        print(
            f"  {kd:12s} µs/inference alone {a:8.1f}  among {k} {b:8.1f}  ({b / max(a, 1e-9):.2f}x)"
        )
    print(f"  top kernels (µs per inference alone / among {k}):")
    for name, a in sorted(one.items(), key=lambda kv: -kv[1])[:15]:
        b = many.get(name, 0.0)
        print(f"    {a:7.1f} {b:7.1f} {b / max(a, 1e-9):5.2f}x  {name[:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
