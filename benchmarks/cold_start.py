"""Cold start of onnxplug's CUDA provider: session creation, first and second run, each model in
a fresh Python process (so creation includes the CUDA context, library loading and every
per-process cache), twice in a row (the second process finds what the first left on disk).

    python benchmarks/cold_start.py [--models resnet50,bert_base,gpt2] [--out DIR]
                                    [--cprofile N] [--trace-imports torch,scipy]
                                    [--cuda-options k=v,...] [--processes N] [--phases]
                                    [--fp16]

Models come from benchmarks/models.py's export (batch 1, fp32; ``--fp16``: their float16
conversion, as models.py makes it, and there is no onnxruntime figure for it). Each model starts from empty
caches (cuDNN tuning and plans, compiled kernels: a new folder for ``ONNXPLUG_CACHE_DIR`` and
``CUPY_CACHE_DIR``), so its first process is a machine's first after the install (whose
``build_kernels`` left cuDNN's attention kernels in the driver's JIT cache); ``--cache-dir DIR`` uses DIR
instead (for all models). ``--cprofile N`` also prints the
N most expensive functions (cumulative) of creation and first run, from a third process.
``--phases`` prints, from such a process, when each phase of creation and first run began and
ended, on which thread (``PHASES``: the functions timed; the helper threads' driver work
included), which Python 3.12's cProfile cannot show: it mixes every thread's calls.
onnxruntime's figures (ORT 1.31.1 CUDA EP, same H100, ../shared/anchors/ort_gpu_more.md §1) are
printed beside ours.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

# onnxruntime CUDA EP, default options: (create s, first run ms), from ../shared/anchors.
ANCHORS = {"resnet50": (0.450, 601.9), "bert_base": (1.092, 130.6), "gpt2": (1.195, 119.9)}

# (module, qualified name) of the functions ``--phases`` times: session creation's steps, the
# CUDA provider's set-up and its helper threads, the first run's cuDNN and cuBLASLt planning
PHASES = (
    ("onnxplug.session.inference_session", "InferenceSession._create_eps"),
    ("onnxplug.session.inference_session", "load_model"),
    ("onnxplug.session.inference_session", "graph_from_model"),
    ("onnxplug.session.inference_session", "optimize"),
    ("onnxplug.session.inference_session", "InferenceSession._build"),
    ("onnxplug.ep.loader", "PluginRegistry._discover"),
    ("onnxplug.ep.loader", "_resolve_factory"),
    ("onnxplug_cuda.factory", "CudaEpFactory.get_supported_devices"),
    ("onnxplug_cuda.factory", "probe_devices"),
    ("onnxplug_cuda.factory", "create_ep"),
    ("onnxplug_cuda.backend", "CupyBackend.__init__"),
    ("onnxplug_cuda.runtime", "BackgroundImport._run"),
    ("onnxplug_cuda.runtime", "_retain_primary_context"),
    ("onnxplug_cuda.blas", "warm_cublaslt"),
    ("onnxplug.optimizer.passes", "fold_constants"),
    ("onnxplug.optimizer.passes", "convert_to_nhwc"),
    ("onnxplug.session.build", "FusionTarget.__init__"),
    ("onnxplug_cuda.dnn", "CudnnConv._build"),
    ("onnxplug_cuda.blas", "LtGemm._build"),
)

_CHILD = r"""
import json, os, sys, time, traceback
if os.environ.get("ONNXPLUG_TRACE_IMPORTS"):
    class _Trace:  # where the heavy packages get imported from
        watch = set(os.environ["ONNXPLUG_TRACE_IMPORTS"].split(","))
        def find_spec(self, name, path=None, target=None):
            if name in self.watch:
                self.watch.discard(name)
                frames = [f for f in traceback.extract_stack()[:-1] if "importlib" not in f.filename]
                stack = "".join(traceback.format_list(frames[-8:]))
                sys.stderr.write(f"--- first import of {name}:\n{stack}")
            return None
    sys.meta_path.insert(0, _Trace())
t0 = time.perf_counter()
import numpy as np
import onnxplug as ox
sys.path.insert(0, "benchmarks")
from models import feeds_for, fp16_path, model_path
t_import = time.perf_counter() - t0
name, out, prof, dtype = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[5]
phases = json.loads(os.environ.get("ONNXPLUG_PHASES", "[]"))
events = []
if phases:
    import functools, importlib, threading
    import onnxplug_cuda  # its modules imported now (about 15 ms less creation) to be wrapped
    def timed(fn, label):
        @functools.wraps(fn)
        def call(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                events.append((label, threading.current_thread().name, t, time.perf_counter()))
        return call
    for mod, qual in phases:
        try:
            owner = importlib.import_module(mod)
            *path, attr = qual.split(".")
            for p in path:
                owner = getattr(owner, p)
            setattr(owner, attr, timed(getattr(owner, attr), qual))
        except (ImportError, AttributeError) as e:
            sys.stderr.write(f"phases: {mod}.{qual} not found ({e})\n")
cuda = dict(kv.split("=", 1) for kv in sys.argv[4].split(",") if kv)
feeds = feeds_for(name, 1)
path = model_path(out, name, 1)
if dtype == "fp16":
    path = fp16_path(path)
if prof:
    import cProfile, pstats
    pr, pr_run = cProfile.Profile(), cProfile.Profile()
    pr.enable()
t1 = time.perf_counter()
s = ox.InferenceSession(path, providers=[("CUDAExecutionProvider", cuda), "CPUExecutionProvider"])
t2 = time.perf_counter()
if prof:
    pr.disable()
    pr_run.enable()
s.run(None, feeds)
t3 = time.perf_counter()
if prof:
    pr_run.disable()
    for what, p in (("session creation", pr), ("first run", pr_run)):
        sys.stderr.write(f"\n### {what}: by cumulative time\n")
        pstats.Stats(p, stream=sys.stderr).sort_stats("cumulative").print_stats(prof)
        sys.stderr.write(f"\n### {what}: by own time\n")
        pstats.Stats(p, stream=sys.stderr).sort_stats("tottime").print_stats(prof // 2)
s.run(None, feeds)
t4 = time.perf_counter()
if phases:
    sys.stderr.write(f"\n### phases (ms from the session's creation; creation ends at "
                     f"{(t2 - t1) * 1e3:.1f}, the first run at {(t3 - t1) * 1e3:.1f})\n")
    spans = {}
    for label, thread, a, b in events:
        if a >= t1 and b <= t3:
            spans.setdefault((label, thread), []).append((a, b))
    for (label, thread), ab in sorted(spans.items(), key=lambda kv: kv[1][0][0]):
        a, b = ab[0][0], ab[-1][1]
        busy = sum(y - x for x, y in ab)
        sys.stderr.write(f"{(a - t1) * 1e3:8.1f} {(b - t1) * 1e3:8.1f} {busy * 1e3:8.1f} ms "
                         f"x{len(ab):<4d} {thread:30s} {label}\n")
print(json.dumps({"import_s": t_import, "create_s": t2 - t1, "first_ms": (t3 - t2) * 1e3,
                  "second_ms": (t4 - t3) * 1e3}))
"""


def child(
    name: str,
    out: str,
    prof: int = 0,
    trace: str = "",
    options: str = "",
    phases: bool = False,
    dtype: str = "fp32",
) -> dict:
    env = {**os.environ, "ONNXPLUG_TRACE_IMPORTS": trace} if trace else None
    if phases:
        env = {**(env or os.environ), "ONNXPLUG_PHASES": json.dumps(PHASES)}
    t0 = time.perf_counter()
    p = subprocess.run(
        [sys.executable, "-c", _CHILD, name, out, str(prof), options, dtype],
        capture_output=True,
        text=True,
        check=False,
        env=env,
    )
    wall = time.perf_counter() - t0
    if prof or trace or phases:
        print(p.stderr[-60000:])
    if p.returncode:
        raise RuntimeError(f"{name}: exit {p.returncode}: {p.stderr[-2000:]}")
    r = json.loads(p.stdout.strip().splitlines()[-1])
    r["process_s"] = wall
    return r


def _use_cache_dir(folder: str) -> None:
    """The children's cache folder: onnxplug's caches and CuPy's kernel cache."""
    os.environ["ONNXPLUG_CACHE_DIR"] = folder
    os.environ["CUPY_CACHE_DIR"] = os.path.join(folder, "kernels")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="resnet50,bert_base,gpt2")
    ap.add_argument("--out", default="/tmp/onnxplug_models")
    ap.add_argument("--cprofile", type=int, default=0, help="print the N top functions")
    ap.add_argument("--trace-imports", default="", help="packages (a,b): where first imported")
    ap.add_argument("--cuda-options", default="", help="k=v,... CUDA provider options")
    ap.add_argument("--processes", type=int, default=2, help="fresh processes per model")
    ap.add_argument("--cache-dir", default=None, help="cache folder (default: new, per model)")
    ap.add_argument("--phases", action="store_true", help="print creation's phases by thread")
    ap.add_argument("--fp16", action="store_true", help="the models' float16 conversions")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    names = args.models.split(",")
    if args.cache_dir:
        _use_cache_dir(args.cache_dir)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from models import export_all, model_path, to_fp16

    export_all(args.out, names)
    dtype = "fp16" if args.fp16 else "fp32"
    if args.fp16:
        for name in names:
            to_fp16(model_path(args.out, name, 1))
    rows = []
    for name in names:
        if not args.cache_dir:
            _use_cache_dir(tempfile.mkdtemp(prefix=f"onnxplug-cold-{name}-"))
        for k in range(args.processes):
            proc = (
                ("first process (empty caches)", "second process")[k]
                if k < 2
                else f"process {k + 1}"
            )
            r = child(name, args.out, options=args.cuda_options, dtype=dtype)
            r.update(model=name if dtype == "fp32" else f"{name} fp16", process=proc)
            print(json.dumps(r), flush=True)
            rows.append(r)
        if args.cprofile or args.trace_imports or args.phases:
            r = child(
                name,
                args.out,
                args.cprofile,
                args.trace_imports,
                args.cuda_options,
                args.phases,
                dtype,
            )
            print(f"profiled process (not in the table): {json.dumps(r)}", flush=True)
    print(
        "\n| model | process | import (s) | create (s) | first run (ms) | second run (ms) "
        "| create + first run (s) | whole process (s) | ORT create (s) | ORT first run (ms) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        oc, of = ANCHORS.get(r["model"], (None, None))
        print(
            f"| {r['model']} | {r['process']} | {r['import_s']:.2f} | {r['create_s']:.2f} "
            f"| {r['first_ms']:.0f} | {r['second_ms']:.1f} "
            f"| {r['create_s'] + r['first_ms'] / 1e3:.2f} | {r['process_s']:.2f} "
            f"| {oc if oc is not None else '-'} | {of if of is not None else '-'} |"
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
