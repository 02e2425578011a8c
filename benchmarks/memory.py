"""Device memory of onnxplug's CUDA provider: allocator throughput and peak memory per model.

Two parts (both by default; ``--part alloc`` or ``--part peak`` for one):

* **alloc**: microseconds per allocate+free pair, per block size, of raw ``cudaMalloc`` /
  ``cudaFree``, the provider's BFC device arena (``alloc`` without a stream and
  ``alloc_on_stream``) and its memory-pool mode (``arena.use_cuda_mempool=1``), plus a mixed
  pattern (64 live blocks of random sizes, freed in random order).
* **peak**: peak device memory of ResNet-50, BERT-base and GPT-2 at batch 1 and 8 (models
  exported with random weights as ../shared/anchors/export_models.py does, through
  benchmarks/models.py), measured as ../shared/anchors/ort_gpu_more.md section 1 does: each
  row in a fresh Python process without torch, NVML device memory used (the counter
  nvidia-smi reads) minus the value just before ``InferenceSession(...)``, the peak being the
  highest of a separate poller process sampling every 1 ms and in-process samples after
  creation and after each of 20 runs. Rows also show the memory after ``shrink`` and the
  arena's own figures. onnxruntime's figures are the anchors' (batch 1); ``--with-ort``
  measures onnxruntime-gpu in the same way where it is installed (batch 8 too).

    python benchmarks/memory.py [--part alloc|peak] [--models resnet50,bert_base,gpt2]
        [--batches 1,8] [--configs default,mempool] [--with-ort] [--out DIR] [--json FILE]

Needs a GPU, ``libnvidia-ml`` (NVML) and, to export the models, torch, torchvision and
transformers.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import signal
import subprocess
import sys
import time
from typing import Any

HERE = os.path.abspath(__file__)
sys.path.insert(0, os.path.dirname(HERE))

CUDA = "CUDAExecutionProvider"
MiB = 1 << 20
# onnxruntime-gpu 1.31.1 CUDA EP, default options, peak NVML MiB (ort_gpu_more.md section 1)
ORT_PEAK_MIB = {("resnet50", 1): 933, ("bert_base", 1): 1195, ("gpt2", 1): 1699}
CONFIGS: dict[str, dict[str, str]] = {
    "default": {},
    "mempool": {"arena.use_cuda_mempool": "1"},
    "same_as_requested": {"arena_extend_strategy": "kSameAsRequested"},
}


# ---------------------------------------------------------------------------------------------
# NVML


def nvml_used(index: int = 0) -> Any:
    lib = ctypes.CDLL("libnvidia-ml.so.1")
    assert lib.nvmlInit_v2() == 0, "nvmlInit failed"
    h = ctypes.c_void_p()
    assert lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(h)) == 0

    class Mem(ctypes.Structure):
        _fields_ = [
            ("total", ctypes.c_ulonglong),
            ("free", ctypes.c_ulonglong),
            ("used", ctypes.c_ulonglong),
        ]

    m = Mem()

    def used() -> int:
        lib.nvmlDeviceGetMemoryInfo(h, ctypes.byref(m))
        return int(m.used)

    return used


def cmd_poll() -> None:
    used = nvml_used()
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
    mx, n = 0, 0
    print("ready", flush=True)
    while not stop:
        mx = max(mx, used())
        n += 1
        time.sleep(0.001)
    print(json.dumps({"max_used": mx, "samples": n}), flush=True)


# ---------------------------------------------------------------------------------------------
# allocation throughput


def _pairs_us(alloc: Any, free: Any, size: int, n: int) -> float:
    for _ in range(min(n, 20)):  # warm-up: the arena's first extension, driver caches
        free(alloc(size))
    t0 = time.perf_counter()
    for _ in range(n):
        free(alloc(size))
    return (time.perf_counter() - t0) / n * 1e6


def _mixed_us(alloc: Any, free: Any, rounds: int) -> float:
    rng = random.Random(0)
    sizes = [rng.choice([256, 4096, 65536, 1 << 20, 4 << 20]) for _ in range(64)]
    for _ in range(2):
        for p in [alloc(s) for s in sizes]:
            free(p)
    t0 = time.perf_counter()
    for r in range(rounds):
        live = [alloc(s) for s in sizes]
        random.Random(r).shuffle(live)
        for p in live:
            free(p)
    return (time.perf_counter() - t0) / (rounds * len(sizes)) * 1e6


def part_alloc(args: argparse.Namespace) -> list[dict[str, Any]]:
    from cuda.bindings import runtime as rt

    import onnxplug as ox
    from onnxplug.ep import ArenaConfig
    from onnxplug_cuda.memory import CudaDeviceAllocator, CudaDeviceArena, CudaMempoolAllocator
    from onnxplug_cuda.stream import CudaSyncStream

    dev = next(d for d in ox.get_ep_devices() if d.ep_name == CUDA)
    mi = dev.ep_device.memory_info  # the provider-level device (a MemoryInfo, not the method)
    stream = CudaSyncStream(mi.device, 0)
    arena = CudaDeviceArena(CudaDeviceAllocator(mi, 0), ArenaConfig())
    pool = CudaMempoolAllocator(mi, 0, release_threshold=1 << 62)

    def raw_alloc(n: int) -> int:
        err, p = rt.cudaMalloc(n)
        assert int(err) == 0, err
        return int(p)

    def raw_free(p: int) -> None:
        rt.cudaFree(p)

    candidates = {
        "cudaMalloc/cudaFree": (raw_alloc, raw_free),
        "arena alloc (no stream)": (arena.alloc, arena.free),
        "arena alloc_on_stream": (lambda n: arena.alloc_on_stream(n, stream), arena.free),
        "mempool alloc_on_stream": (lambda n: pool.alloc_on_stream(n, stream), pool.free),
    }
    rows = []
    for size in (256, 64 << 10, 1 << 20, 16 << 20, 256 << 20):
        n = 2000 if size <= 1 << 20 else 200
        row: dict[str, Any] = {"size": size}
        for name, (a, f) in candidates.items():
            row[name] = round(_pairs_us(a, f, size, n), 2)
            stream.flush()
        rows.append(row)
        print(json.dumps(row), flush=True)
    row = {"size": "mixed (64 live, 256 B..4 MiB)"}
    for name, (a, f) in candidates.items():
        row[name] = round(_mixed_us(a, f, 30), 2)
        stream.flush()
    rows.append(row)
    print(json.dumps(row), flush=True)
    stream.close()
    pool.close()
    print("\n| block size | " + " | ".join(f"{k} (us/pair)" for k in candidates) + " |")
    print("|---" * (len(candidates) + 1) + "|")
    for r in rows:
        size = r["size"]
        label = size if isinstance(size, str) else _size_str(size)
        print(f"| {label} | " + " | ".join(f"{r[k]:.2f}" for k in candidates) + " |")
    return rows


def _size_str(n: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n >> shift} {unit}"
    return f"{n} B"


# ---------------------------------------------------------------------------------------------
# peak memory, one row per fresh process


def cmd_peak_row(engine: str, name: str, path: str, batch: int, config: str) -> None:
    from models import feeds_for

    feeds = feeds_for(name, batch)
    if engine == "ort":
        import onnxruntime as ort

        ort.preload_dlls()
    else:
        import onnxplug as ort  # type: ignore[no-redef]
    used = nvml_used()
    poller = subprocess.Popen([sys.executable, HERE, "_poll"], stdout=subprocess.PIPE, text=True)
    assert poller.stdout is not None
    poller.stdout.readline()
    time.sleep(0.1)
    base = used()
    opts = dict(CONFIGS[config]) if engine == "onnxplug" else {}
    t0 = time.perf_counter()
    s = ort.InferenceSession(path, providers=[(CUDA, opts), "CPUExecutionProvider"])
    create_s = time.perf_counter() - t0
    u_create = used()
    mx = u_create
    for _ in range(20):
        s.run(None, feeds)
        mx = max(mx, used())
    u_end = used()
    row: dict[str, Any] = {
        "engine": engine,
        "model": name,
        "batch": batch,
        "config": config,
        "create_s": round(create_s, 3),
        "after_create_MiB": round((u_create - base) / MiB),
        "after_20_runs_MiB": round((u_end - base) / MiB),
    }
    if engine == "onnxplug":
        st = s.get_allocator_stats().get("cuda:0", {})
        row["arena_max_in_use_MiB"] = round(st.get("MaxInUse", 0) / MiB)
        row["arena_held_MiB"] = round(st.get("TotalAllocated", 0) / MiB)
        row["arena_regions"] = st.get("NumArenaExtensions")
        s.shrink_memory_arenas()
        time.sleep(0.05)
        row["after_shrink_MiB"] = round((used() - base) / MiB)
    time.sleep(0.05)
    poller.send_signal(signal.SIGTERM)
    out = poller.communicate(timeout=10)[0].strip().splitlines()[-1]
    poll = json.loads(out)
    row["peak_MiB"] = round((max(mx, poll["max_used"]) - base) / MiB)
    row["poll_samples"] = poll["samples"]
    print(json.dumps(row), flush=True)


def part_peak(args: argparse.Namespace) -> list[dict[str, Any]]:
    from models import export_all, model_path

    names = args.models.split(",")
    export_all(args.out, names)
    engines = ["onnxplug"] + (["ort"] if args.with_ort else [])
    rows = []
    for name in names:
        for b in (int(x) for x in args.batches.split(",")):
            path = model_path(args.out, name, b)
            for engine in engines:
                for config in args.configs.split(",") if engine == "onnxplug" else ["default"]:
                    cmd = [sys.executable, HERE, "_peak", engine, name, path, str(b), config]
                    try:
                        p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
                        lines = [x for x in p.stdout.splitlines() if x.startswith("{")]
                        row = (
                            json.loads(lines[-1])
                            if lines
                            else {"error": (p.stderr or "")[-400:].replace("\n", " ")}
                        )
                    except Exception as e:  # report and go on with the other rows
                        row = {"error": f"{type(e).__name__}: {e}"[:300]}
                    row.update(engine=engine, model=name, batch=b, config=config)
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    ort_measured = {
        (r["model"], r["batch"]): r.get("peak_MiB") for r in rows if r["engine"] == "ort"
    }
    print(
        "\n| model | batch | config | onnxplug peak MiB | after create | after 20 runs | "
        "after shrink | arena max in use / held MiB | ORT peak MiB | onnxplug / ORT |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["engine"] != "onnxplug":
            continue
        key = (r["model"], r["batch"])
        ort_peak = ort_measured.get(key) or ORT_PEAK_MIB.get(key)
        src = "" if ort_measured.get(key) else " (anchor)" if ort_peak else ""
        if "error" in r:
            print(f"| {r['model']} | {r['batch']} | {r['config']} | ERROR: {r['error'][:100]} |")
            continue
        ratio = f"{r['peak_MiB'] / ort_peak:.2f}" if ort_peak else "-"
        print(
            f"| {r['model']} | {r['batch']} | {r['config']} | {r['peak_MiB']} | "
            f"{r['after_create_MiB']} | {r['after_20_runs_MiB']} | {r['after_shrink_MiB']} | "
            f"{r['arena_max_in_use_MiB']} / {r['arena_held_MiB']} | "
            f"{ort_peak or '-'}{src} | {ratio} |"
        )
    return rows


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "_poll":
        cmd_poll()
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "_peak":
        engine, name, path, b, config = sys.argv[2:7]
        cmd_peak_row(engine, name, path, int(b), config)
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=["alloc", "peak", "all"], default="all")
    ap.add_argument("--models", default="resnet50,bert_base,gpt2")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--configs", default="default", help=f"of {', '.join(CONFIGS)}")
    ap.add_argument("--with-ort", action="store_true", help="measure onnxruntime-gpu too")
    ap.add_argument("--out", default="/tmp/onnxplug_models")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    unknown = set(args.configs.split(",")) - set(CONFIGS)
    if unknown:
        ap.error(f"unknown config(s) {sorted(unknown)}; known: {', '.join(CONFIGS)}")
    import onnxplug as ox

    if CUDA not in ox.get_available_providers():
        print(f"{CUDA} is not available: {ox.get_provider_load_errors()}", file=sys.stderr)
        return 2
    result: dict[str, Any] = {}
    if args.part in ("peak", "all"):  # first: the rows' processes see an idle device
        result["peak"] = part_peak(args)
    if args.part in ("alloc", "all"):
        result["alloc"] = part_alloc(args)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
