"""PyTorch measured as ``benchmarks/threads.py`` measures onnxplug: k threads, each on a stream
of its own with its own captured CUDA graph (or eager), copy the pinned input in, replay, copy
the output out to pinned memory and synchronise their stream, in a loop; inferences per second
of all threads for k = 1, 2, 4, 8. The models are benchmarks/models.py's (batch 1); float32
matmuls use TF32, as onnxruntime's and onnxplug's float32 do.

    python scripts/debug/torch_threads.py [--models bert_base,resnet50] [--seconds 2] [--fp16]
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from typing import Any

import torch

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks")
)
from models import feeds_for, torch_forward, torch_inputs, torch_module


def rate(model: Any, name: str, k: int, graphs: bool, fp16: bool, seconds: float) -> float:
    """Inferences per second of k threads, each with its stream, inputs and (with ``graphs``)
    its CUDA graph, captured here one after another before the threads start."""
    feeds = feeds_for(name, 1)
    workers = []
    with torch.inference_mode():
        for _ in range(k):
            stream = torch.cuda.Stream()
            host = {n: torch.from_numpy(v).pin_memory() for n, v in feeds.items()}
            with torch.cuda.stream(stream):
                dev = torch_inputs(name, feeds, fp16)
                graph, out = None, None
                if graphs:
                    for _ in range(3):
                        torch_forward(name, model, dev)
                    stream.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, stream=stream):
                        out = torch_forward(name, model, dev)
            workers.append((stream, host, dev, graph, out))
    torch.cuda.synchronize()
    counts = [0] * k
    stop = threading.Event()
    start = threading.Barrier(k + 1)

    def work(i: int) -> None:
        stream, host, dev, graph, out = workers[i]
        pinned = None
        with torch.inference_mode(), torch.cuda.stream(stream):
            start.wait()
            while not stop.is_set():
                for n, v in host.items():
                    dev[n].copy_(v, non_blocking=True)
                if graph is not None:
                    graph.replay()
                    result = out
                else:
                    result = torch_forward(name, model, dev)
                if pinned is None:
                    pinned = torch.empty(result.shape, dtype=result.dtype, pin_memory=True)
                pinned.copy_(result, non_blocking=True)
                stream.synchronize()
                counts[i] += 1

    threads = [threading.Thread(target=work, args=(i,)) for i in range(k)]
    for t in threads:
        t.start()
    start.wait()
    time.sleep(0.5)  # warm-up
    c0, t0 = sum(counts), time.perf_counter()
    time.sleep(seconds)
    c1, t1 = sum(counts), time.perf_counter()
    stop.set()
    for t in threads:
        t.join()
    return (c1 - c0) / (t1 - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="bert_base,resnet50")
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--fp16", action="store_true")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    ks = [1, 2, 4, 8]
    print("| model | mode | " + " | ".join(f"{k} thr" for k in ks) + " | 4/1 |")
    print("|---|---|" + "---|" * (len(ks) + 1))
    for name in args.models.split(","):
        model = torch_module(name, args.fp16)
        for graphs in (True, False):
            rates = {k: rate(model, name, k, graphs, args.fp16, args.seconds) for k in ks}
            label = f"torch {name} b1 {'fp16' if args.fp16 else 'fp32'}"
            cells = " | ".join(f"{rates[k]:.1f}" for k in ks)
            print(
                f"| {label} | {'graph' if graphs else 'eager'} | {cells} | {rates[4] / rates[1]:.2f}x |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
