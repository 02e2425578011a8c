"""Where multi-thread throughput goes: run() (numpy in and out) against IOBinding with device
inputs and outputs (one binding per thread), 1 and N threads, CUDA graphs on; then a CUPTI
trace of N threads' run() loop, giving the GPU's busy fraction and mean kernel concurrency.

    python scripts/debug/threads_probe.py [--models resnet50,bert_base] [--threads 4]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import threading
import time
from typing import Any

import numpy as np

import onnxplug as ox
from onnxplug.framework import counters

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import models
import threads

CUDA = "CUDAExecutionProvider"


def loop(calls: list[Any], seconds: float) -> float:
    """Inferences/s of one thread per call, each calling its call in a loop."""
    counts = [0] * len(calls)
    go = threading.Event()
    stop = [0.0]

    def worker(k: int) -> None:
        go.wait()
        n = 0
        while time.perf_counter() < stop[0]:
            calls[k]()
            n += 1
        counts[k] = n

    ts = [threading.Thread(target=worker, args=(k,)) for k in range(len(calls))]
    for t in ts:
        t.start()
    t0 = time.perf_counter()
    stop[0] = t0 + seconds
    go.set()
    for t in ts:
        t.join()
    return sum(counts) / (time.perf_counter() - t0)


def iob_call(sess: Any, feeds: dict[str, np.ndarray], want: list[np.ndarray]) -> Any:
    io = sess.io_binding()
    for k, v in feeds.items():
        io.bind_ortvalue_input(k, ox.OrtValue.ortvalue_from_numpy(v, "cuda", 0))
    for o, w in zip(sess.get_outputs(), want):
        io.bind_ortvalue_output(
            o.name, ox.OrtValue.ortvalue_from_shape_and_type(w.shape, w.dtype, "cuda", 0)
        )

    def call() -> None:
        sess.run_with_iobinding(io)
        io.synchronize_outputs()

    return call


def counted(label: str, calls: list[Any], seconds: float) -> float:
    """``loop``, printing what the runs did per inference (captures, replays, host syncs)."""
    before = counters.snapshot()
    t0 = time.perf_counter()
    rate = loop(calls, seconds)
    runs = max(1, round(rate * (time.perf_counter() - t0)))
    did = counters.delta(before)
    print(f"  {label}: {rate:.0f}/s; per run " + ", ".join(
        f"{k} {v / runs:.3f}" for k, v in did.items()))  # fmt: skip
    return rate


def timeline(calls: list[Any], seconds: float) -> str:
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        rate = loop(calls, seconds)
        torch.cuda.synchronize()
    spans = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0:
            spans.append((e.time_range.start, e.time_range.end))
    if not spans:
        return "no kernels traced"
    busy, concurrency = threads.gpu_occupancy(spans)
    traced_ms = (max(e for _, e in spans) - min(s for s, _ in spans)) / 1e3
    return (f"{rate:.0f}/s under the profiler; GPU busy {100 * busy:.0f}% of "
            f"{traced_ms:.0f} ms, mean concurrency when busy {concurrency:.2f}, "
            f"{len(spans)} kernels")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="resnet50,bert_base")
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--out", default="/tmp/onnxplug_models")
    args = ap.parse_args()
    names = args.models.split(",")
    models.export_all(args.out, names, batches=(1,))
    n = args.threads
    for name in names:
        path, feeds = models.model_path(args.out, name, 1), models.feeds_for(name, 1)
        sess = ox.InferenceSession(path, providers=[(CUDA, {"enable_cuda_graph": "1"})])
        want = sess.run(None, feeds)
        run = [functools.partial(sess.run, None, feeds)] * n
        iob = [iob_call(sess, feeds, want) for _ in range(n)]
        for c in run + iob:
            for _ in range(5):
                c()
        rates = {}
        for label, calls in (("run() x1", run[:1]), (f"run() x{n}", run)):
            rates[label] = counted(label, calls, args.seconds)
        for label, calls in (("IOBinding x1", iob[:1]), (f"IOBinding x{n}", iob)):
            rates[label] = counted(label, calls, args.seconds)
        r1, rn = rates["run() x1"], rates[f"run() x{n}"]
        i1, i_n = rates["IOBinding x1"], rates[f"IOBinding x{n}"]
        print(f"{name} b1 run():     1: {r1:7.0f}/s  {n}: {rn:7.0f}/s  {rn / r1:.2f}x")
        print(f"{name} b1 IOBinding: 1: {i1:7.0f}/s  {n}: {i_n:7.0f}/s  {i_n / i1:.2f}x")
        print(f"  run() x1 timeline: {timeline(run[:1], 0.5)}")
        print(f"  run() x{n} timeline: {timeline(run, 0.5)}")
        print(f"  IOBinding x{n} timeline: {timeline(iob, 0.5)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
