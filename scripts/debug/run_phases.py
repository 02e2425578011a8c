"""Where a thread's ``run()`` time goes with 1 and k threads on one session (CUDA graphs on):
per run, the µs before the graph's launch (feeds, staging), the launch call, from the launch to
the sync, the sync's wait (the GPU's work, with the other threads' runs beside it), after the
sync (outputs), and between two runs of the thread; medians, 90th percentiles and maxima.
A phase that grows with k where the sync's wait does not is host time the threads lose.

    python scripts/debug/run_phases.py [--model resnet50] [--fp16] [--threads 1,4,8]

Session 30, H100, ResNet-50 b1, one machine: 1 thread 1483 runs/s (before the launch 88 µs,
the launch 23); 8 threads 2949 runs/s with 32 hardware queues (the provider's default; 297 and
236 µs) and 2385 with 8 (``CUDA_DEVICE_MAX_CONNECTIONS=8`` set by hand; 501 and 407), where 8
streams' replays gave 5100-5353/s on the session's other machines. The 8-thread figure moves
between processes on such machines (4008 and 2333 runs/s with 32 queues): docs/providers/cuda.md,
session 30.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import threads

PHASES = ("pre", "launch", "mid", "sync", "post", "gap", "run")
_marks = threading.local()  # the current run's (mark, time) of this thread


def _mark(name: str) -> None:
    marks = getattr(_marks, "run", None)
    if marks is not None:
        marks.append((name, time.perf_counter()))


def instrument() -> None:
    """Mark the graph's launch and the stream's sync in every run (a measurement patch)."""
    from onnxplug_cuda import ep, stream

    replay, flush = ep.CudaEp.replay_graph, stream.CudaSyncStream.flush

    def timed_replay(self: Any, graph_id: int) -> None:
        _mark("launch0")
        replay(self, graph_id)
        _mark("launch1")

    def timed_flush(self: Any) -> None:
        _mark("sync0")
        flush(self)
        _mark("sync1")

    ep.CudaEp.replay_graph = timed_replay
    stream.CudaSyncStream.flush = timed_flush


def measure(sess: Any, feeds: dict[str, np.ndarray], k: int, seconds: float) -> tuple:
    """k threads run for ``seconds``: (runs/s, {phase: µs per run of every run})."""
    runs: list[list[dict[str, float]]] = [[] for _ in range(k)]
    start = threading.Barrier(k)
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            for _ in range(5):
                sess.run(None, feeds)
            start.wait()
            end = time.perf_counter() + seconds
            while True:
                _marks.run = [("run0", time.perf_counter())]
                sess.run(None, feeds)
                _mark("run1")
                runs[i].append(dict(_marks.run))
                _marks.run = None
                if runs[i][-1]["run1"] > end:
                    break
        except threading.BrokenBarrierError:
            pass  # another thread failed: its error is raised
        except BaseException as e:
            errors.append(e)
            start.abort()

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(k)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errors:
        raise errors[0]
    n = sum(len(r) for r in runs)
    span = max(r[-1]["run1"] for r in runs) - min(r[0]["run0"] for r in runs)
    phases: dict[str, list[float]] = {p: [] for p in PHASES}
    for mine in runs:
        for a, b in zip(mine, [*mine[1:], None]):
            phases["pre"].append(a["launch0"] - a["run0"])
            phases["launch"].append(a["launch1"] - a["launch0"])
            phases["mid"].append(a["sync0"] - a["launch1"])
            phases["sync"].append(a["sync1"] - a["sync0"])
            phases["post"].append(a["run1"] - a["sync1"])
            phases["run"].append(a["run1"] - a["run0"])
            if b is not None:
                phases["gap"].append(b["run0"] - a["run1"])
    return n / span, phases


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bert_base")
    ap.add_argument("--fp16", action="store_true")
    ap.add_argument("--threads", default="1,4")
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--out", default="/tmp/onnxplug_models")
    args = ap.parse_args()
    instrument()
    [(label, path, feeds)] = threads.cuda_models([args.model], args.out, args.fp16)
    sess = threads.session(path, threads.CUDA, True, [], {})
    queues = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    print(f"## {label}, CUDA graphs, CUDA_DEVICE_MAX_CONNECTIONS={queues}: µs per run, "
          "median / 90th percentile / max")  # fmt: skip
    print("| threads | runs/s | " + " | ".join(PHASES) + " |")
    print("|---|---|" + "---|" * len(PHASES))
    for k in [int(x) for x in args.threads.split(",")]:
        rate, phases = measure(sess, feeds, k, args.seconds)
        cells = [
            f"{np.median(v) * 1e6:.1f} / {np.percentile(v, 90) * 1e6:.1f} / {np.max(v) * 1e6:.0f}"
            if v
            else "-"
            for v in phases.values()
        ]
        print(f"| {k} | {rate:.1f} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
