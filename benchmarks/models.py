"""Benchmark onnxplug's CUDA provider on ResNet-50, BERT-base and GPT-2 beside PyTorch eager.

Exports the models with random weights exactly as ../shared/anchors/export_models.py does
(torchvision / transformers, opset 17, sequence length 128), checks that every node but shape
computations runs on CUDAExecutionProvider and that outputs match the CPU provider, then prints
median latencies (ms, 100 runs after 10 warm-ups, synchronised after each run):

    python benchmarks/models.py [--models resnet50,bert_base,gpt2] [--out DIR] [--fp16] [--runs N]

Columns: onnxplug plain ``run()`` (numpy in, numpy out), onnxplug IOBinding (inputs and outputs
on the GPU), PyTorch eager on the same GPU. Needs torch, torchvision and transformers (the GPU
machine has them); onnxplug itself never imports torch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import numpy as np

import onnxplug as ox

CUDA = "CUDAExecutionProvider"
SHAPE_OPS = {"Shape", "Size", "MemcpyFromHost", "MemcpyToHost"}


def export_all(out: str, names: list[str]) -> None:
    import torch

    torch.manual_seed(0)
    os.makedirs(out, exist_ok=True)

    def export(
        name: str, model: Any, args: tuple, input_names: list[str], dynamic_axes: Any
    ) -> None:
        path = os.path.join(out, name + ".onnx")
        if os.path.exists(path):
            return
        model.eval()
        kw = dict(
            input_names=input_names, output_names=None, dynamic_axes=dynamic_axes, opset_version=17
        )
        try:
            torch.onnx.export(model, args, path, dynamo=False, **kw)
        except Exception as e:  # the anchors' script falls back the same way
            print(name, "legacy exporter failed:", str(e)[:100], "-> dynamo exporter", flush=True)
            kw.pop("dynamic_axes")
            kw["opset_version"] = 18
            torch.onnx.export(model, args, path, dynamo=True, external_data=False, **kw)
        print("exported", name, os.path.getsize(path) // 1_000_000, "MB", flush=True)

    if "resnet50" in names:
        import torchvision

        export(
            "resnet50",
            torchvision.models.resnet50(weights=None),
            (torch.randn(1, 3, 224, 224),),
            ["input"],
            {"input": {0: "batch"}},
        )
    if "bert_base" in names:
        from transformers import BertConfig, BertModel

        bert = BertModel(BertConfig(), add_pooling_layer=True)
        for b in (1, 8):
            ids = torch.randint(0, 30000, (b, 128))
            mask = torch.ones(b, 128, dtype=torch.int64)
            export(f"bert_base_b{b}", bert, (ids, mask), ["input_ids", "attention_mask"], None)
    if "gpt2" in names:
        from transformers import GPT2Config, GPT2Model

        cfg = GPT2Config(use_cache=False)
        cfg._attn_implementation = "eager"
        gpt2 = GPT2Model(cfg)

        class G(torch.nn.Module):
            def __init__(self, m: Any):
                super().__init__()
                self.m = m

            def forward(self, ids: Any) -> Any:
                return self.m(input_ids=ids, use_cache=False).last_hidden_state

        for b in (1, 8):
            export(f"gpt2_b{b}", G(gpt2), (torch.randint(0, 50000, (b, 128)),), ["input_ids"], None)


def to_fp16(src: str, dst: str) -> str:
    if not os.path.exists(dst):
        import onnx
        from onnxruntime.transformers.float16 import convert_float_to_float16

        m = convert_float_to_float16(onnx.load(src), keep_io_types=True)
        onnx.save(m, dst)
    return dst


def feeds_for(name: str, b: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    if name == "resnet50":
        return {"input": rng.standard_normal((b, 3, 224, 224)).astype(np.float32)}
    if name == "bert_base":
        return {
            "input_ids": rng.integers(0, 30000, (b, 128)).astype(np.int64),
            "attention_mask": np.ones((b, 128), np.int64),
        }
    return {"input_ids": rng.integers(0, 50000, (b, 128)).astype(np.int64)}


def model_path(out: str, name: str, b: int) -> str:
    return os.path.join(out, (name if name == "resnet50" else f"{name}_b{b}") + ".onnx")


def med_ms(fn: Any, sync: Any, n: int, warm: int = 10) -> float:
    for _ in range(warm):
        fn()
    sync()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts) * 1e3)


def off_cuda(sess: Any) -> list[str]:
    return sorted(
        {
            f"{r['op_type']}"
            for r in sess.get_provider_graph_assignment_info()
            if r["ep"] != CUDA and r["op_type"] not in SHAPE_OPS
        }
    )


def check(path: str, feeds: dict[str, np.ndarray], fp16: bool) -> dict[str, Any]:
    """CUDA (use_tf32=0 and =1) against the CPU provider."""
    cpu = ox.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    out: dict[str, Any] = {}
    for tf32 in ("0", "1"):
        s = ox.InferenceSession(
            path, providers=[(CUDA, {"use_tf32": tf32}), "CPUExecutionProvider"]
        )
        got = s.run(None, feeds)[0]
        err = float(np.max(np.abs(got.astype(np.float64) - cpu)))
        rel = float(np.linalg.norm(got.astype(np.float64) - cpu) / max(np.linalg.norm(cpu), 1e-30))
        out[f"max_abs_err_tf32_{tf32}"] = err
        out[f"rel_err_tf32_{tf32}"] = rel
        if tf32 == "0" and not fp16:
            out["allclose_rtol1e-3_atol1e-4"] = bool(np.allclose(got, cpu, rtol=1e-3, atol=1e-4))
        out["off_cuda"] = off_cuda(s)
    return out


def bench_onnxplug(path: str, feeds: dict[str, np.ndarray], runs: int) -> dict[str, float]:
    s = ox.InferenceSession(path, providers=[CUDA, "CPUExecutionProvider"])
    res = {"onnxplug_run": med_ms(lambda: s.run(None, feeds), lambda: None, runs)}
    io = s.io_binding()
    for k, v in feeds.items():
        io.bind_ortvalue_input(k, ox.OrtValue.ortvalue_from_numpy(v, "cuda", 0))
    for o in s.get_outputs():
        io.bind_output(o.name, "cuda", 0)
    res["onnxplug_iobind"] = med_ms(
        lambda: s.run_with_iobinding(io), lambda: io.synchronize_outputs(), runs
    )
    return res


def bench_torch(name: str, feeds: dict[str, np.ndarray], runs: int, fp16: bool) -> float:
    import torch

    torch.manual_seed(0)
    if name == "resnet50":
        import torchvision

        m = torchvision.models.resnet50(weights=None)
    elif name == "bert_base":
        from transformers import BertConfig, BertModel

        m = BertModel(BertConfig())
    else:
        from transformers import GPT2Config, GPT2Model

        m = GPT2Model(GPT2Config(use_cache=False))
    m = m.cuda().eval()
    if fp16:
        m = m.half()
    tf = {k: torch.from_numpy(v).cuda() for k, v in feeds.items()}
    if fp16 and name == "resnet50":
        tf["input"] = tf["input"].half()
    if name == "resnet50":
        call = lambda: m(tf["input"])  # noqa: E731
    elif name == "bert_base":
        call = lambda: m(input_ids=tf["input_ids"], attention_mask=tf["attention_mask"])  # noqa: E731
    else:
        call = lambda: m(input_ids=tf["input_ids"], use_cache=False)  # noqa: E731
    with torch.inference_mode():
        return med_ms(call, torch.cuda.synchronize, runs)


ANCHORS = {
    ("resnet50", 1): 2.06,
    ("resnet50", 32): 7.79,
    ("bert_base", 1): 3.44,
    ("bert_base", 8): 4.10,
    ("gpt2", 1): 2.29,
    ("gpt2", 8): 2.92,
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="resnet50,bert_base,gpt2")
    ap.add_argument("--out", default="/tmp/onnxplug_models")
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--fp16", action="store_true", help="also run fp16 versions")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    names = args.models.split(",")
    if CUDA not in ox.get_available_providers():
        print(f"{CUDA} is not available: {ox.get_provider_load_errors()}", file=sys.stderr)
        return 2
    export_all(args.out, names)
    rows = []
    for name in names:
        for b in [1, 32] if name == "resnet50" else [1, 8]:
            for fp16 in [False, True] if args.fp16 else [False]:
                path = model_path(args.out, name, b)
                if fp16:
                    path = to_fp16(path, path.replace(".onnx", "_fp16.onnx"))
                feeds = feeds_for(name, b)
                row: dict[str, Any] = {
                    "model": name,
                    "batch": b,
                    "dtype": "fp16" if fp16 else "fp32",
                }
                try:
                    row.update(check(path, feeds, fp16))
                    row.update(bench_onnxplug(path, feeds, args.runs))
                    if not args.no_torch:
                        row["torch_eager"] = bench_torch(name, feeds, args.runs, fp16)
                except Exception as e:  # report and go on with the other models
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                row["ort_cuda_anchor"] = ANCHORS.get((name, b)) if not fp16 else None
                print(json.dumps(row), flush=True)
                rows.append(row)
    print()
    print(
        "| model | batch | dtype | onnxplug run() ms | onnxplug IOBinding ms | torch eager ms | ORT CUDA run() anchor ms | max abs err vs CPU (tf32 off / on) | nodes off CUDA |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['model']} | {r['batch']} | {r['dtype']} | ERROR: {r['error'][:80]} |")
            continue

        def f(k: str, r: dict[str, Any] = r) -> str:
            return f"{r[k]:.2f}" if isinstance(r.get(k), float) else "-"

        err = f"{r['max_abs_err_tf32_0']:.2e} / {r['max_abs_err_tf32_1']:.2e}"
        print(
            f"| {r['model']} | {r['batch']} | {r['dtype']} | {f('onnxplug_run')} | {f('onnxplug_iobind')} | "
            f"{f('torch_eager')} | {r['ort_cuda_anchor'] or '-'} | {err} | {','.join(r['off_cuda']) or 'none'} |"
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
