"""Throughput of one session run from 1, 2, 4 and 8 threads, with and without CUDA graphs.

Each thread calls ``run()`` on the same session (numpy in, numpy out) in a loop for
``--seconds`` after a warm-up (in which each thread, with CUDA graphs, captures its own
graphs); the table gives inferences per second over all threads, and the speed-up over one
thread. Every thread's last outputs are compared with a sequential run's, bit for bit.

On CUDA the models are BERT-base and ResNet-50 at batch 1, exported as benchmarks/models.py
exports them (needs torch, torchvision and transformers)::

    python benchmarks/threads.py                                 # CUDA, both models
    python benchmarks/threads.py --models bert_base --threads 1,4 --seconds 10
    python benchmarks/threads.py --graphs on --fp16 --threads 1,4 --repeats 5  # medians of 5
    python benchmarks/threads.py --iobinding --graphs on       # device inputs and outputs
    python benchmarks/threads.py --graphs on --gpu-bound       # and the GPU's own bound
    python benchmarks/threads.py --graphs on --fp16            # the float16 conversions
    python benchmarks/threads.py --cuda-options cudnn_conv_algo_search=HEURISTIC

``--gpu-bound`` (CUDA graphs on) adds what the GPU does alone: with k threads holding their
captured graphs, one thread replays the k graphs round-robin on their k streams with no other
host work, so the inferences/s are those of k concurrent streams on this GPU, the most that k
threads could reach. Where NVML has GPM metrics (Hopper and later, ``pynvml``), rows under it
give what the GPU's SMs and memory did in each window: the share of time SMs were busy, their
warp occupancy, DRAM bandwidth and tensor pipes in use.

Any model on any provider (inputs are random, unfixed dims 1 unless ``--dim`` sets them)::

    python benchmarks/threads.py --provider CPU                  # the demo model
    python benchmarks/threads.py --provider CPU --model model.onnx --dim batch=1
    python benchmarks/threads.py --provider CPU --session-config session.serialize_cpu_runs=0
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import platform
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

import onnxplug as ox
from onnxplug.cli.main import demo_model_path, make_feeds

CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"
PROVIDERS = {"CUDA": CUDA, "CPU": CPU}


def _models() -> Any:
    """benchmarks/models.py (imported when the CUDA models or their options are needed)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import models

    return models


def cuda_models(
    names: list[str], out: str, fp16: bool = False
) -> list[tuple[str, str, dict[str, np.ndarray]]]:
    """(label, path, feeds) of the CUDA models at batch 1, exported like benchmarks/models.py
    (``fp16``: their float16 conversions, as models.py makes them, float32 inputs and outputs)."""
    models = _models()
    models.export_all(out, names, batches=(1,))
    cases = []
    for n in names:
        path = models.model_path(out, n, 1)
        if fp16:
            path = models.to_fp16(path)
        cases.append((f"{n} b1{' fp16' if fp16 else ''}", path, models.feeds_for(n, 1)))
    return cases


def session(
    path: str, provider: str, graphs: bool, config: list[str], options: dict[str, str]
) -> Any:
    so = ox.SessionOptions()
    for item in config:
        key, _, value = item.partition("=")
        so.add_session_config_entry(key, value)
    options = {**options, "enable_cuda_graph": "1"} if graphs else dict(options)
    providers: list[Any] = [(provider, options)]
    if provider != CPU:
        providers.append(CPU)
    return ox.InferenceSession(path, sess_options=so, providers=providers)


def run_step(sess: Any, feeds: dict[str, Any], iobinding: bool) -> Any:
    """One thread's inference as a call returning the outputs as numpy arrays: ``run()``, or
    with ``iobinding`` a binding of the thread's own with inputs and outputs on the device
    (``run_with_iobinding`` and a wait for the outputs; copied to the host only when read)."""
    if not iobinding:
        return lambda: sess.run(None, feeds)
    io = sess.io_binding()
    for k, v in feeds.items():
        io.bind_ortvalue_input(k, ox.OrtValue.ortvalue_from_numpy(v, "cuda", 0))
    for o in sess.get_outputs():
        io.bind_output(o.name, "cuda")

    def step() -> Any:
        sess.run_with_iobinding(io)
        io.synchronize_outputs()
        return io

    return step


def throughput(
    sess: Any,
    feeds: dict[str, Any],
    threads: int,
    seconds: float,
    warmup: int,
    want: list[Any],
    iobinding: bool = False,
) -> tuple[float, bool]:
    """Inferences per second of ``threads`` threads running ``sess`` for ``seconds``, and
    whether every thread's last outputs equal ``want`` exactly."""
    counts = [0] * threads
    same = [False] * threads
    errors: list[BaseException] = []
    ready = threading.Barrier(threads + 1)
    go = threading.Event()
    deadline = [0.0]

    def worker(k: int) -> None:
        try:
            step = run_step(sess, feeds, iobinding)
            for _ in range(warmup):
                step()
            ready.wait()
            go.wait()
            n, out = 0, None
            while time.perf_counter() < deadline[0]:
                out = step()
                n += 1
            counts[k] = n
            if iobinding and out is not None:
                out = out.copy_outputs_to_cpu()
            # a thread that ran no inference in the time (starved) does not count as a mismatch
            same[k] = out is None or all(np.array_equal(a, b) for a, b in zip(out, want))
        except BaseException as e:  # reported by the main thread
            errors.append(e)
            try:
                ready.abort()
            except threading.BrokenBarrierError:
                pass

    ts = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(threads)]
    for t in ts:
        t.start()
    try:
        ready.wait()
    except threading.BrokenBarrierError:
        pass
    if errors:
        raise errors[0]
    start = time.perf_counter()
    deadline[0] = start + seconds
    go.set()
    for t in ts:
        t.join()
    elapsed = time.perf_counter() - start
    if errors:
        raise errors[0]
    if not all(counts):
        print(f"# {threads} threads: {counts.count(0)} ran no inference in the time", flush=True)
    return sum(counts) / elapsed, all(same)


@contextlib.contextmanager
def held_graphs(
    sess: Any, feeds: dict[str, Any], k: int
) -> Iterator[tuple[Any, list[tuple[int, int]]]]:
    """k threads capture their own CUDA graphs of ``sess`` and hold them (a thread's graphs go
    with it) until the block ends; yields the CUDA provider and the (graph exec, stream
    handle) of each thread. Reads the provider's captured graphs: a measurement tool."""
    hold, ready = threading.Event(), threading.Barrier(k + 1)
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            for _ in range(3):
                sess.run(None, feeds)
        except BaseException as e:  # reported below
            errors.append(e)
        ready.wait()
        hold.wait()

    ts = [threading.Thread(target=worker, daemon=True) for _ in range(k)]
    for t in ts:
        t.start()
    ready.wait()
    try:
        if errors:
            raise errors[0]
        ep = next(e for e in sess._eps if e.name == CUDA)
        graphs = [(exe, stream.handle) for exe, stream in ep._graphs.values()]
        if len({handle for _, handle in graphs}) < k:
            raise RuntimeError(f"{len(graphs)} graphs captured for {k} threads")
        yield ep, graphs
    finally:
        hold.set()
        for t in ts:
            t.join()


def replay_rate(ep: Any, chosen: list[tuple[int, int]], rounds: int) -> float:
    """Inferences per second of ``rounds`` rounds of the ``chosen`` graphs launched
    round-robin, each on its own stream, the device synchronised before and after."""
    import cupy

    cupy.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for _ in range(rounds):
        for exe, handle in chosen:
            err = ep.backend.launch_graph(exe, handle)
            if err:
                raise RuntimeError(err)
    cupy.cuda.Device().synchronize()
    return rounds * len(chosen) / (time.perf_counter() - t0)


def gpu_occupancy(spans: list[tuple[float, float]]) -> tuple[float, float]:
    """Of traced kernels' (start, end) times: the fraction of the traced time the GPU ran at
    least one, and how many it ran at once on average while it ran any."""
    spans = sorted(spans)
    union, (cs, ce) = 0.0, spans[0]
    for s, e in spans[1:]:
        if s > ce:
            union += ce - cs
            cs, ce = s, e
        else:
            ce = max(ce, e)
    union += ce - cs
    total = sum(e - s for s, e in spans)
    return union / (max(e for _, e in spans) - spans[0][0]), total / union


class GpmWindow:
    """NVML's GPU performance metrics (GPM: Hopper and later) over a window of work on one
    CUDA device: the share of time its SMs were busy, their warp occupancy, DRAM bandwidth and
    tensor pipes in use, which say what four streams run out of. Needs ``pynvml``
    (nvidia-ml-py); the constructor raises where it or GPM is not there."""

    METRICS = (
        ("SM busy %", "NVML_GPM_METRIC_SM_UTIL"),
        ("warp occupancy %", "NVML_GPM_METRIC_SM_OCCUPANCY"),
        ("DRAM bandwidth %", "NVML_GPM_METRIC_DRAM_BW_UTIL"),
        ("tensor pipes %", "NVML_GPM_METRIC_ANY_TENSOR_UTIL"),
    )
    SECONDS = 1.0  # a window's least length: over 0.1-0.2 s windows the metrics were erratic

    def __init__(self, ordinal: int) -> None:
        import cupy
        import pynvml

        self.nvml = pynvml
        pynvml.nvmlInit()
        bus_id = cupy.cuda.Device(ordinal).pci_bus_id  # NVML's index may differ from CUDA's
        self.device = pynvml.nvmlDeviceGetHandleByPciBusId(bus_id.encode())
        if not pynvml.nvmlGpmQueryDeviceSupport(self.device).isSupportedDevice:
            raise RuntimeError(f"GPU {ordinal} has no GPM metrics (Hopper or later has)")
        self.samples = (pynvml.nvmlGpmSampleAlloc(), pynvml.nvmlGpmSampleAlloc())

    def measure(self, work: Any) -> dict[str, float]:
        """The metrics over the time ``work()`` took."""
        N = self.nvml
        N.nvmlGpmSampleGet(self.device, self.samples[0])
        work()
        N.nvmlGpmSampleGet(self.device, self.samples[1])
        get = N.c_nvmlGpmMetricsGet_t()
        get.version = N.NVML_GPM_METRICS_GET_VERSION
        get.numMetrics = len(self.METRICS)
        get.sample1, get.sample2 = self.samples
        for i, (_, metric) in enumerate(self.METRICS):
            get.metrics[i].metricId = getattr(N, metric)
        N.nvmlGpmMetricsGet(get)
        return {name: get.metrics[i].value for i, (name, _) in enumerate(self.METRICS)}


def gpu_bound(
    sess: Any, feeds: dict[str, Any], streams: list[int], runs: int = 300, gpm: Any = None
) -> tuple[dict[int, float], dict[int, dict[str, float]]]:
    """Inferences per second of k graphs replayed concurrently (k in ``streams``): k threads
    capture their own graphs of ``sess`` and hold them while this thread launches them
    round-robin, each on its own stream, and waits once at the end: a measurement of the
    GPU, not an API. With ``gpm`` (a ``GpmWindow``), also its metrics for each k, over a
    second window of replays."""
    rates: dict[int, float] = {}
    metrics: dict[int, dict[str, float]] = {}
    with held_graphs(sess, feeds, max(streams)) as (ep, graphs), ep.device_guard():
        for k in streams:
            replay_rate(ep, graphs[:k], 1)  # a first round untimed
            rates[k] = replay_rate(ep, graphs[:k], max(50, runs // k))
            if gpm is not None:  # a window of its own, of a second at least (GPM's samples)
                rounds = max(50, math.ceil(rates[k] * gpm.SECONDS / k))
                metrics[k] = gpm.measure(functools.partial(replay_rate, ep, graphs[:k], rounds))
    return rates, metrics


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--provider", choices=sorted(PROVIDERS), default="CUDA")
    ap.add_argument("--models", default="bert_base,resnet50", help="CUDA: models.py's models")
    ap.add_argument("--model", action="append", help="an .onnx file (repeatable)")
    ap.add_argument("--dim", action="append", help="name=value for an unfixed input dim")
    ap.add_argument("--threads", default="1,2,4,8")
    ap.add_argument("--seconds", type=float, default=5.0, help="timed seconds per cell")
    ap.add_argument("--warmup", type=int, default=5, help="runs per thread before timing")
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="timed windows per cell, the thread counts taking turns; a cell is their median",
    )
    ap.add_argument(
        "--graphs", choices=("both", "off", "on"), default=None, help="CUDA graphs (CUDA: both)"
    )
    ap.add_argument(
        "--iobinding",
        action="store_true",
        help="CUDA: each thread runs an IOBinding with inputs and outputs on the device",
    )
    ap.add_argument(
        "--gpu-bound",
        action="store_true",
        help="CUDA graphs on: also the GPU's own inferences/s with k concurrent streams",
    )
    ap.add_argument("--session-config", action="append", default=[], help="key=value")
    ap.add_argument("--cuda-options", default="", help="CUDA: k=v,... provider options")
    ap.add_argument("--fp16", action="store_true", help="CUDA: the models' float16 conversions")
    ap.add_argument("--out", default="/tmp/onnxplug_models", help="where CUDA models go")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    provider = PROVIDERS[args.provider]
    cuda_options = _models().parse_options(args.cuda_options)
    if cuda_options and provider != CUDA:
        ap.error("--cuda-options are the CUDA provider's")
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    threads = [int(t) for t in args.threads.split(",")]
    graphs = args.graphs or ("both" if provider == CUDA else "off")
    modes = {"both": [False, True], "off": [False], "on": [True]}[graphs]
    if provider != CUDA and True in modes:
        ap.error("--graphs on needs --provider CUDA")
    if args.fp16 and (provider != CUDA or args.model):
        ap.error("--fp16 converts the CUDA models of --models (not --model files)")
    if args.gpu_bound and True not in modes:
        ap.error("--gpu-bound needs CUDA graphs (--graphs on or both)")

    if args.model:
        cases = []
        for path in args.model:
            probe = ox.InferenceSession(path, providers=[CPU])
            feeds, _ = make_feeds(probe, None, args.dim, 0)
            cases.append((os.path.basename(path), path, feeds))
    elif provider == CUDA:
        cases = cuda_models(args.models.split(","), args.out, args.fp16)
    else:
        path = str(demo_model_path())
        probe = ox.InferenceSession(path, providers=[CPU])
        feeds, _ = make_feeds(probe, None, args.dim, 0)
        cases = [("demo CNN", path, feeds)]

    gpm = None
    if args.gpu_bound:
        try:
            gpm = GpmWindow(0)
        except Exception as e:  # the bound is measured without them
            print(f"# GPU bound without GPM metrics: {type(e).__name__}: {e}", flush=True)
    print(
        f"# {args.provider} | {platform.node()} | {os.cpu_count()} CPUs | load "
        f"{os.getloadavg()[0]:.2f} | {args.seconds:g} s per cell | inferences/s (all threads)"
        f"{' | IOBinding, device inputs and outputs' if args.iobinding else ''}",
        flush=True,
    )
    head = ["model", "CUDA graphs"] + [f"{t} thr" for t in threads]
    if 1 in threads and len(threads) > 1:
        head += [f"{t}/1" for t in threads if t != 1]
    head.append("bit-identical")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    rows = []
    for label, path, feeds in cases:
        for graph in modes:
            sess = session(path, provider, graph, args.session_config, cuda_options)
            want = sess.run(None, feeds)  # sequential reference (captures, with graphs)
            samples: dict[int, list[float]] = {t: [] for t in threads}
            identical = True
            for r in range(args.repeats):
                # the thread counts take turns, so that a slow spell of the host falls on all
                for t in threads[r % len(threads) :] + threads[: r % len(threads)]:
                    ips, same = throughput(
                        sess, feeds, t, args.seconds, args.warmup, want, args.iobinding
                    )
                    samples[t].append(ips)
                    identical = identical and same
            cells = {t: float(np.median(v)) for t, v in samples.items()}
            row = [label, "on" if graph else "off"] + [f"{cells[t]:.1f}" for t in threads]
            if 1 in threads and len(threads) > 1:
                row += [f"{cells[t] / cells[1]:.2f}x" for t in threads if t != 1]
            row.append("yes" if identical else "NO")
            print("| " + " | ".join(row) + " |", flush=True)
            rows.append(
                {
                    "model": label,
                    "graphs": graph,
                    "inferences_per_s": {str(t): cells[t] for t in threads},
                    "samples": {str(t): samples[t] for t in threads},
                    "bit_identical": identical,
                }
            )
            if graph and args.gpu_bound:
                bound, metrics = gpu_bound(sess, feeds, threads, gpm=gpm)
                row = [label, "GPU bound"] + [f"{bound[t]:.1f}" for t in threads]
                if 1 in threads and len(threads) > 1:
                    row += [f"{bound[t] / bound[1]:.2f}x" for t in threads if t != 1]
                print("| " + " | ".join(row) + " | - |", flush=True)
                rows[-1]["gpu_bound_inferences_per_s"] = {str(t): bound[t] for t in threads}
                for name, _ in GpmWindow.METRICS if metrics else ():
                    row = [label, f"GPU bound: {name}"] + [
                        f"{metrics[t][name]:.1f}" for t in threads
                    ]
                    print("| " + " | ".join(row + ["-"] * (len(head) - len(row))) + " |")
                rows[-1]["gpu_bound_gpm"] = {str(t): m for t, m in metrics.items()}
            del sess
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"provider": provider, "seconds": args.seconds, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
