"""Where the host time of a replayed run of a tiny model goes (Relu on 1x16, CUDA graphs):
µs per run for plain ``run()`` and IOBinding (each on a session of its own, bound once), then
cProfile's top functions of the IOBinding replays. On a GPU:
``python scripts/debug/tiny_replay.py [--top 25]``; without one, ``--virtual`` runs it on the
test suite's virtual device with pinned staging (its streams queue and replay Python closures:
the figures are the host's Python, not CUDA's)."""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

import numpy as np

import onnxplug as ox

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks")
)
from models import tiny_model

CUDA = "CUDAExecutionProvider"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3000)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--virtual", action="store_true", help="the virtual test device, no GPU")
    ap.add_argument("--eager", action="store_true", help="without graphs: the eager runs")
    args = ap.parse_args()
    provider, options, device = CUDA, {"enable_cuda_graph": "1"}, ("cuda", 0)
    if args.virtual:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
        from tests.plugins import virtual_device as vd

        ox.register_execution_provider_library(
            vd.PINNED_NAME, "tests.plugins.virtual_device:create_pinned_factory"
        )
        provider, options, device = vd.PINNED_NAME, {"enable_graph": "1"}, ("virt", 5)
    if args.eager:
        options = {}
    m = tiny_model()
    x = np.ones((1, 16), np.float32)
    s = ox.InferenceSession(m, providers=[(provider, options)])
    # IOBinding on a session of its own, bound once: a graph captured for run() and then fed
    # bound values is captured again without the copies it held
    sb = ox.InferenceSession(m, providers=[(provider, options)])
    io = sb.io_binding()
    io.bind_ortvalue_input("x", ox.OrtValue.ortvalue_from_numpy(x, *device))
    io.bind_ortvalue_output(
        "y", ox.OrtValue.ortvalue_from_shape_and_type([1, 16], np.float32, *device)
    )
    for _ in range(50):
        s.run(None, {"x": x})
        sb.run_with_iobinding(io)
    for name, fn in (
        ("run()", lambda: s.run(None, {"x": x})),
        ("IOBinding", lambda: sb.run_with_iobinding(io)),
    ):
        t0 = time.perf_counter()
        for _ in range(args.runs):
            fn()
        io.synchronize_outputs()
        print(f"{name}: {(time.perf_counter() - t0) / args.runs * 1e6:.1f} µs per replayed run")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.runs):
        sb.run_with_iobinding(io)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
