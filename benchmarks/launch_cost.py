"""Host cost of one kernel launch by each path the CUDA provider can take (µs per call).

    python benchmarks/launch_cost.py [--n 20000]

Paths: a CuPy ufunc with ``out=``, a ``cupy.ElementwiseKernel``, the provider's prepared
``launch.Launch`` of the same operation (one ``cuLaunchKernel`` with parameters packed once),
the whole prepared step as the executor calls it (guard + launch), and ``cudaGraphLaunch`` of a
one-kernel graph. Each loop runs N calls and synchronises once; the GPU work is a 1K-element
Relu, so the figures are host-bound.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np


def per_call(fn, n: int, sync) -> float:
    for _ in range(100):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    sync()
    return (time.perf_counter() - t0) / n * 1e6


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=20000)
    args = ap.parse_args()
    import cupy as cp

    from onnxplug_cuda.kernels import _fused as F

    s = cp.cuda.Stream(non_blocking=True)
    s.use()
    x = cp.random.standard_normal(1024, dtype=cp.float32)
    y = cp.empty_like(x)
    sync = s.synchronize
    rows = {}
    rows["cupy ufunc maximum(out=)"] = per_call(lambda: cp.maximum(x, 0, out=y), args.n, sync)
    relu = F.UNARY_KERNELS["Relu"]
    rows["cupy ElementwiseKernel (Relu)"] = per_call(lambda: relu(cp, x, y), args.n, sync)
    launch = relu.bind(cp, x, y, stream=s.ptr)
    rows["prepared Launch (cuLaunchKernel)"] = per_call(launch, args.n, sync)
    values = [x, None]

    def step() -> None:  # what a prepared step costs in the executor loop: guard + launch
        if values[0] is x:
            values[1] = y
            launch()

    rows["prepared step (guard + Launch)"] = per_call(step, args.n, sync)
    g = cp.cuda.Graph
    s.begin_capture()
    launch()
    graph = s.end_capture()
    rows["cudaGraphLaunch (1 kernel, CuPy)"] = per_call(lambda: graph.launch(s), args.n, sync)
    from cuda.bindings import runtime as rt

    rows["cudaStreamQuery (a bare runtime call)"] = per_call(
        lambda: rt.cudaStreamQuery(s.ptr), args.n, sync
    )
    del g
    print("| launch path | µs per call |\n|---|---|")
    for k, v in rows.items():
        print(f"| {k} | {v:.2f} |")
    np.testing.assert_array_equal(cp.asnumpy(y), np.maximum(cp.asnumpy(x), 0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
