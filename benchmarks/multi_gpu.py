"""Throughput of one model served on every GPU of the host: ResNet-50 at batch 32, inferences/s
on 1 GPU and on N GPUs through ``onnxplug.integrations.multi_device.SessionPool`` (a session
and a thread per GPU, one shared queue of batches).

    python benchmarks/multi_gpu.py [--out DIR] [--model PATH] [--batch 32] [--seconds 20]
                                   [--cuda-options key=value,...] [--gpus N]

The model is exported as benchmarks/models.py exports it (torchvision ResNet-50, random
weights, dynamic batch; needs torch and torchvision), or given with ``--model``. Inputs are
numpy batches (host in, host out: each run copies its batch to the GPU and its output back,
as a server does). Each configuration warms up (the recording and binding runs, the cuDNN
autotune) and then runs batches for ``--seconds``; the table gives inferences/s (images/s),
the runs each GPU served and the speed-up over one GPU. With one visible GPU only N=1 is
reported. The goal of the multi-GPU issue is a speed-up of 1.9 or more on 2 GPUs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import numpy as np

import onnxplug as ox
from onnxplug.integrations.multi_device import SessionPool, devices_of

CUDA = "CUDAExecutionProvider"


def parse_options(text: str) -> dict[str, str]:
    out = {}
    for part in filter(None, text.split(",")):
        key, sep, value = part.partition("=")
        if not sep:
            raise SystemExit(f"--cuda-options: '{part}' must look like key=value")
        out[key] = value
    return out


def throughput(
    model: str, gpus: list[Any], batch: int, seconds: float, options: dict[str, str]
) -> tuple[float, list[int]]:
    """Images/s of ``SessionPool(model, gpus)`` kept busy for ``seconds``, and the runs each
    GPU served in that time."""
    with SessionPool(model, gpus, options) as pool:
        name = pool.sessions[0].get_inputs()[0].name
        rng = np.random.default_rng(0)
        xs = [rng.standard_normal((batch, 3, 224, 224), dtype=np.float32) for _ in range(4)]
        # warm-up: every session records, binds and autotunes before the clock starts
        for sess in pool.sessions:
            for x in xs[:3]:
                sess.run(None, {name: x})
        depth = 2 * len(gpus)  # batches in flight: each GPU always has the next one queued
        base = list(pool.runs)
        done = 0
        start = time.perf_counter()
        inflight = [pool.run(None, {name: xs[i % len(xs)]}) for i in range(depth)]
        i = depth
        while time.perf_counter() - start < seconds:
            inflight.pop(0).result()
            done += 1
            inflight.append(pool.run(None, {name: xs[i % len(xs)]}))
            i += 1
        for f in inflight:
            f.result()
            done += 1
        elapsed = time.perf_counter() - start
        runs = [r - b for r, b in zip(pool.runs, base)]
    return done * batch / elapsed, runs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "out"))
    ap.add_argument("--model", help="an ONNX model with one image input (default: ResNet-50)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--gpus", type=int, help="use at most N GPUs (default: every visible GPU)")
    ap.add_argument("--cuda-options", default="", help="provider options, key=value,...")
    args = ap.parse_args()
    gpus = devices_of(CUDA)
    if not gpus:
        print(f"no {CUDA} device: {ox.get_available_providers()}", file=sys.stderr)
        return 1
    if args.gpus:
        gpus = gpus[: args.gpus]
    model = args.model
    if model is None:
        sys.path.insert(0, os.path.dirname(__file__))
        from models import export_all, model_path

        model = model_path(args.out, "resnet50", 1)
        if not os.path.exists(model):
            export_all(args.out, ["resnet50"])
    options = parse_options(args.cuda_options)
    names = [d.ep_metadata.get("cuda_device_name", "?") for d in gpus]
    print(f"model {os.path.basename(model)}, batch {args.batch}, {args.seconds:g} s per row")
    print(f"visible GPUs: {len(gpus)} ({', '.join(names)}); options {options or 'none'}")
    counts = [1] if len(gpus) == 1 else [1, len(gpus)]
    rows = []
    for n in counts:
        ips, runs = throughput(model, gpus[:n], args.batch, args.seconds, options)
        rows.append((n, ips, runs))
    one = rows[0][1]
    print(f"{'GPUs':>4}  {'inferences/s':>12}  {'speed-up':>8}  runs per GPU")
    for n, ips, runs in rows:
        print(f"{n:>4}  {ips:>12.1f}  {ips / one:>7.2f}x  {runs}")
    if len(gpus) == 1:
        print("one GPU visible: N=1 only (run on a host with several GPUs for the speed-up)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
