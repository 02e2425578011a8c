"""CPU EP speed on the onnx wheel's ``light`` models, side by side with onnxruntime's CPU EP.

Each model runs on the input onnx's backend runner generates for it (``arange / n`` in the
input's shape); the table gives the median of ``--runs`` timed runs after a warm-up run, per
runtime, and the ratio onnxplug / onnxruntime. onnxruntime is optional: without it that
column stays empty.

onnxplug's GEMMs run on numpy's BLAS, whose thread count is set by the environment
(``OPENBLAS_NUM_THREADS``) before numpy loads; ``--ort-threads`` sets onnxruntime's
intra-op threads to compare like with like. A busy machine hurts spinning BLAS threads
badly: the header prints the load average.

    python benchmarks/cpu_light_models.py [--runs 10] [--models resnet50,vgg19]
    OPENBLAS_NUM_THREADS=1 python benchmarks/cpu_light_models.py --ort-threads 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import numpy as np
import onnx

LIGHT_DIR = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"
MODELS = [
    "bvlc_alexnet",
    "densenet121",
    "inception_v1",
    "inception_v2",
    "resnet50",
    "shufflenet",
    "squeezenet",
    "vgg19",
    "zfnet512",
]


def light_input(model: onnx.ModelProto) -> tuple[str, np.ndarray]:
    """The input onnx's runner feeds a light model (Runner.generate_dummy_data, random=False)."""
    inits = {i.name for i in model.graph.initializer}
    vi = next(i for i in model.graph.input if i.name not in inits)
    shape = tuple(
        d.dim_value if d.HasField("dim_value") else 1 for d in vi.type.tensor_type.shape.dim
    )
    n = int(np.prod(shape))
    return vi.name, (np.arange(n).reshape(shape) / n).astype(np.float32)


def median_ms(run, runs: int) -> float:
    run()  # warm-up: plans, caches, BLAS threads
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def bench(name: str, runs: int, ort_threads: int = 0) -> tuple[float, float | None]:
    import onnxplug

    path = str(LIGHT_DIR / f"light_{name}.onnx")
    feed_name, x = light_input(onnx.load(path))
    sess = onnxplug.InferenceSession(path, providers=["CPUExecutionProvider"])
    ours = median_ms(lambda: sess.run(None, {feed_name: x}), runs)
    try:
        import onnxruntime as ort
    except ImportError:
        return ours, None
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.intra_op_num_threads = ort_threads
    ref = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    return ours, median_ms(lambda: ref.run(None, {feed_name: x}), runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--ort-threads", type=int, default=0, help="0: onnxruntime's default")
    args = ap.parse_args()
    blas = os.environ.get("OPENBLAS_NUM_THREADS", "default")
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    print(
        f"# {os.cpu_count()} cpus, load average {load}; OPENBLAS_NUM_THREADS={blas}, "
        f"onnxruntime intra_op_num_threads={args.ort_threads or 'default'}"
    )
    print(f"{'model':<14} {'onnxplug ms':>12} {'onnxruntime ms':>15} {'ratio':>7}")
    for name in args.models.split(","):
        ours, ref = bench(name, args.runs, args.ort_threads)
        ref_s = f"{ref:15.1f}" if ref is not None else f"{'-':>15}"
        ratio = f"{ours / ref:7.2f}" if ref else f"{'-':>7}"
        print(f"{name:<14} {ours:12.1f} {ref_s} {ratio}", flush=True)


if __name__ == "__main__":
    main()
