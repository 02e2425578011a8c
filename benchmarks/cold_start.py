"""Cold start of onnxplug's CUDA provider: session creation, first and second run, each model in
a fresh Python process (so creation includes the CUDA context, library loading and every
per-process cache), twice in a row (the second process finds what the first left on disk).

    python benchmarks/cold_start.py [--models resnet50,bert_base,gpt2] [--out DIR]
                                    [--cprofile N] [--trace-imports torch,scipy]
                                    [--cuda-options k=v,...] [--processes N]

Models come from benchmarks/models.py's export (batch 1, fp32). Each model starts from empty
caches (cuDNN tuning and plans, compiled kernels: a new folder for ``ONNXPLUG_CACHE_DIR`` and
``CUPY_CACHE_DIR``), so its first process is a machine's first; ``--cache-dir DIR`` uses DIR
instead (for all models). ``--cprofile N`` also prints the
N most expensive functions (cumulative) of creation and first run, from a third process.
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
from models import feeds_for, model_path
t_import = time.perf_counter() - t0
name, out, prof = sys.argv[1], sys.argv[2], int(sys.argv[3])
cuda = dict(kv.split("=", 1) for kv in sys.argv[4].split(",") if kv)
feeds = feeds_for(name, 1)
path = model_path(out, name, 1)
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
print(json.dumps({"import_s": t_import, "create_s": t2 - t1, "first_ms": (t3 - t2) * 1e3,
                  "second_ms": (t4 - t3) * 1e3}))
"""


def child(name: str, out: str, prof: int = 0, trace: str = "", options: str = "") -> dict:
    env = {**os.environ, "ONNXPLUG_TRACE_IMPORTS": trace} if trace else None
    t0 = time.perf_counter()
    p = subprocess.run(
        [sys.executable, "-c", _CHILD, name, out, str(prof), options],
        capture_output=True,
        text=True,
        check=False,
        env=env,
    )
    wall = time.perf_counter() - t0
    if prof or trace:
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
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    names = args.models.split(",")
    if args.cache_dir:
        _use_cache_dir(args.cache_dir)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from models import export_all

    export_all(args.out, names)
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
            r = child(name, args.out, options=args.cuda_options)
            r.update(model=name, process=proc)
            print(json.dumps(r), flush=True)
            rows.append(r)
        if args.cprofile or args.trace_imports:
            r = child(name, args.out, args.cprofile, args.trace_imports, args.cuda_options)
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
