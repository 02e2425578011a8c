"""Ray's overhead on one GPU: ResNet-50 through onnxplug.integrations.ray (Ray Data batch
inference, Ray Serve online serving) next to a plain session loop on the same GPU.

    python benchmarks/ray_scale.py [--out DIR] [--images 4096] [--batch 32]
                                   [--requests 200] [--clients 1,64] [--json FILE]
                                   [--model PATH] [--cpu]

1. Plain loop: one session on [CUDAExecutionProvider, CPUExecutionProvider], ``run()`` over
   ``--images`` random images in batches of ``--batch`` (numpy in, numpy out): images/s.
2. Ray Data: the same images as an in-memory dataset (materialized before the clock starts),
   ``map_batches(OnnxPredictor, batch_size=--batch, num_gpus=1)``, one actor: images/s end
   to end (actor start and session build included) and in steady state (from the first batch
   out to the last), and the steady-state overhead against the plain loop (goal: <= 10 %).
3. Ray Serve: ``onnx_deployment(..., ray_actor_options={"num_gpus": 1})``, one image per
   request, ``--clients`` concurrent clients on localhost (keep-alive connections, bodies encoded
   once beforehand), JSON and .npz bodies: requests/s, p50 and p99 latency, the mean number of
   requests per ``@serve.batch`` call; and a plain session's b1 latency beside it.

The model is exported as benchmarks/models.py exports it (torchvision ResNet-50, random
weights, dynamic batch). Needs torch and torchvision (to export), Ray (``pip install
"onnxplug[ray]"``) and the CUDA plugin; the clients and the server share the machine's cores.
``--model`` takes another model with one input (random data of its shape, symbolic dimensions
after the first set to 1) and ``--cpu`` runs everything on the CPU provider with no GPU asked
for: together they check the script on a machine without a GPU, where the numbers mean little.
"""

from __future__ import annotations

import argparse
import http.client
import io
import json
import os
import sys
import threading
import time
from typing import Any

import numpy as np

import onnxplug as ox

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import export_all, model_path

CUDA, CPU = "CUDAExecutionProvider", "CPUExecutionProvider"
PROVIDERS = [CUDA, CPU]
GPUS = 1  # per Ray Data actor and Serve replica


def plain_loop(path: str, images: np.ndarray, batch: int) -> dict[str, Any]:
    sess = ox.InferenceSession(path, providers=PROVIDERS)
    name = sess.get_inputs()[0].name
    sess.run(None, {name: images[:batch]})  # plan and warm-up
    total = 0.0
    t0 = time.perf_counter()
    for i in range(0, len(images), batch):
        total += float(np.abs(sess.run(None, {name: images[i : i + batch]})[0]).sum())
    seconds = time.perf_counter() - t0
    one = images[:1]
    sess.run(None, {name: one})
    lat = []
    for _ in range(100):
        t = time.perf_counter()
        sess.run(None, {name: one})
        lat.append(time.perf_counter() - t)
    return {
        "images_per_s": len(images) / seconds,
        "abs_sum": total,
        "b1_p50_ms": float(np.percentile(lat, 50) * 1e3),
    }


def ray_data(path: str, images: np.ndarray, batch: int) -> dict[str, Any]:
    import ray

    from onnxplug.integrations.ray import OnnxPredictor

    # in the object store before the clock starts, in blocks of 4 batches: outputs come back
    # block by block, so the time of the first one separates start-up from steady state
    blocks = max(1, len(images) // (4 * batch))
    ds = ray.data.from_numpy(images).repartition(blocks).materialize()
    name = ox.InferenceSession(path, providers=[CPU]).get_inputs()[0].name
    out = ds.map_batches(
        OnnxPredictor,
        fn_constructor_kwargs={
            "model": path,
            "input_columns": {name: "data"},
            "providers": PROVIDERS,
        },
        batch_size=batch,
        batch_format="numpy",
        num_gpus=GPUS,
        compute=ray.data.ActorPoolStrategy(size=1),
    )
    output = ox.InferenceSession(path, providers=[CPU]).get_outputs()[0].name
    t0 = time.perf_counter()
    first_at, first_rows, rows, total = None, 0, 0, 0.0
    for b in out.iter_batches(batch_size=None, batch_format="numpy"):
        n = len(b[output])
        if first_at is None:
            first_at, first_rows = time.perf_counter(), n
        rows += n
        total += float(np.abs(b[output]).sum())
    end = time.perf_counter()
    assert rows == len(images), (rows, len(images))
    assert first_at is not None
    return {
        "images_per_s": rows / (end - t0),
        "steady_images_per_s": (rows - first_rows) / max(end - first_at, 1e-9),
        "abs_sum": total,
    }


def _bodies(image: np.ndarray, name: str) -> dict[str, tuple[bytes, str]]:
    buf = io.BytesIO()
    np.savez(buf, **{name: image})
    return {
        "json": (json.dumps({"inputs": {name: image.tolist()}}).encode(), "application/json"),
        "npz": (buf.getvalue(), "application/x-npz"),
    }


def _client(port: int, body: bytes, ctype: str, n: int, lat: list[float], errors: list[str]):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    for _ in range(n):
        t = time.perf_counter()
        conn.request("POST", "/resnet", body=body, headers={"Content-Type": ctype})
        r = conn.getresponse()
        data = r.read()
        if r.status != 200:
            errors.append(f"{r.status}: {data[:200]!r}")
        lat.append(time.perf_counter() - t)
    conn.close()


def _stats(port: int) -> dict[str, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", "/resnet/stats")
    doc = json.loads(conn.getresponse().read())
    conn.close()
    return doc


def load(port: int, body: bytes, ctype: str, clients: int, requests: int) -> dict[str, Any]:
    per_client = max(1, requests // clients)
    warm: list[float] = []
    _client(port, body, ctype, 3, warm, [])
    before = _stats(port)
    lats: list[list[float]] = [[] for _ in range(clients)]
    errors: list[str] = []
    threads = [
        threading.Thread(target=_client, args=(port, body, ctype, per_client, lats[i], errors))
        for i in range(clients)
    ]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    after = _stats(port)
    all_lat = np.array([x for lat in lats for x in lat])
    batches = after["batches"] - before["batches"]
    return {
        "requests": len(all_lat),
        "errors": len(errors),
        "first_error": errors[0] if errors else "",
        "requests_per_s": len(all_lat) / seconds,
        "p50_ms": float(np.percentile(all_lat, 50) * 1e3),
        "p99_ms": float(np.percentile(all_lat, 99) * 1e3),
        "mean_batch": (after["requests"] - before["requests"]) / max(batches, 1),
    }


def ray_serve(path: str, image: np.ndarray, args: argparse.Namespace) -> list[dict[str, Any]]:
    from ray import serve

    from onnxplug.integrations.ray import onnx_deployment

    port = args.port
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    app = onnx_deployment(
        path,
        providers=PROVIDERS,
        max_batch_size=args.batch,
        batch_wait_timeout_s=args.wait,
        name="resnet50",
        ray_actor_options={"num_gpus": GPUS, "num_cpus": 1},
    )
    serve.run(app, name="resnet", route_prefix="/resnet")
    name = ox.InferenceSession(path, providers=[CPU]).get_inputs()[0].name
    rows = []
    for fmt, (body, ctype) in _bodies(image, name).items():
        for clients in args.clients:
            r = load(port, body, ctype, clients, max(args.requests, clients * 10))
            rows.append({"format": fmt, "clients": clients, **r})
            print(json.dumps(rows[-1]), flush=True)
    serve.shutdown()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/onnxplug_models")
    ap.add_argument("--images", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--requests", type=int, default=200, help="per Serve configuration")
    ap.add_argument("--clients", default="1,64")
    ap.add_argument("--wait", type=float, default=0.005, help="Serve batch_wait_timeout_s")
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--json", default=None)
    ap.add_argument("--model", default=None, help="an ONNX model instead of ResNet-50")
    ap.add_argument("--cpu", action="store_true", help="CPU provider, no GPU (a script check)")
    args = ap.parse_args()
    args.clients = [int(c) for c in args.clients.split(",")]
    global PROVIDERS, GPUS
    if args.cpu:
        PROVIDERS, GPUS = [CPU], 0
    elif CUDA not in ox.get_available_providers():
        print(f"{CUDA} is not available: {ox.get_provider_load_errors()}", file=sys.stderr)
        return 2
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    if args.model is None:
        export_all(args.out, ["resnet50"])
    path = args.model or model_path(args.out, "resnet50", 1)
    (arg,) = ox.InferenceSession(path, providers=[CPU]).get_inputs()
    shape = [args.images] + [d if isinstance(d, int) else 1 for d in arg.shape[1:]]
    images = np.random.default_rng(0).standard_normal(shape, np.float32)

    plain = plain_loop(path, images, args.batch)
    print("plain loop", json.dumps(plain), flush=True)
    ray.init(
        include_dashboard=False,
        object_store_memory=int(images.nbytes * 2) + 2**30,
        log_to_driver=False,
        logging_level="warning",
    )
    ray.data.DataContext.get_current().enable_progress_bars = False
    data = ray_data(path, images, args.batch)
    print("ray data", json.dumps(data), flush=True)
    served = ray_serve(path, images[:1], args)
    ray.shutdown()

    agree = abs(data["abs_sum"] - plain["abs_sum"]) / max(plain["abs_sum"], 1e-30)
    overhead = 1 - data["steady_images_per_s"] / plain["images_per_s"]
    model = os.path.basename(path)
    where = "the CPU" if args.cpu else "one GPU"
    print(f"\n{model} fp32, batch {args.batch}, {args.images} inputs, {where}")
    print("| path | images/s | vs plain loop |")
    print("| --- | --- | --- |")
    print(f"| plain session loop | {plain['images_per_s']:.0f} | 1.00 |")
    print(
        f"| Ray Data, steady state | {data['steady_images_per_s']:.0f} | "
        f"{data['steady_images_per_s'] / plain['images_per_s']:.2f} |"
    )
    print(
        f"| Ray Data, end to end | {data['images_per_s']:.0f} | "
        f"{data['images_per_s'] / plain['images_per_s']:.2f} |"
    )
    print(f"Ray Data overhead (steady state): {overhead * 100:.1f} % (goal <= 10 %)")
    print(f"outputs: |sum| of Ray Data and the plain loop differ by {agree:.1e} (relative)")
    print(f"\nRay Serve, one image per request, max_batch_size {args.batch}, wait {args.wait} s")
    print(f"plain session b1 latency: p50 {plain['b1_p50_ms']:.2f} ms")
    print("| body | clients | requests/s | p50 ms | p99 ms | requests per batch | errors |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in served:
        print(
            f"| {r['format']} | {r['clients']} | {r['requests_per_s']:.1f} | {r['p50_ms']:.1f} | "
            f"{r['p99_ms']:.1f} | {r['mean_batch']:.1f} | {r['errors']} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"plain": plain, "ray_data": data, "serve": served}, f, indent=1)
    return 1 if agree > 1e-3 or any(r["errors"] for r in served) else 0


if __name__ == "__main__":
    raise SystemExit(main())
