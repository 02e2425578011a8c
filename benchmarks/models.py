"""Benchmark onnxplug's CUDA provider on ResNet-50, BERT-base and GPT-2 beside PyTorch eager.

Exports the models with random weights exactly as ../shared/anchors/export_models.py does
(torchvision / transformers, opset 17, sequence length 128), checks that every node but shape
computations runs on CUDAExecutionProvider and that outputs match the CPU provider, then prints
median latencies (ms, 100 runs after 10 warm-ups, synchronised after each run):

    python benchmarks/models.py [--models resnet50,bert_base,gpt2] [--out DIR] [--fp16] [--runs N]

Columns: onnxplug plain ``run()`` eager (numpy in, numpy out), plain ``run()`` with
``enable_cuda_graph=1`` (replayed per shape signature), IOBinding with CUDA graphs (inputs
updated in place, outputs bound: onnxruntime's recipe); PyTorch eager and PyTorch CUDA-graph
replay measured in the same run; onnxruntime's figures from ../shared/anchors; the GPU time
of one replayed IOBinding run (its kernels' µs summed, CUPTI through PyTorch's profiler) beside
issue 8's goal for the row (0.75x the best of onnxruntime's and PyTorch's graph). Also the host
cost of one run of a tiny model, and (``--profile``) host and GPU µs per op. Needs torch,
torchvision and transformers (the GPU machine has them); onnxplug itself never imports torch.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from typing import Any

import numpy as np

import onnxplug as ox

CUDA = "CUDAExecutionProvider"
SHAPE_OPS = {"Shape", "Size", "MemcpyFromHost", "MemcpyToHost"}
# --cuda-options: provider options of every onnxplug CUDA session (default: none, as a user)
OPTIONS: dict[str, str] = {}


def export_all(out: str, names: list[str], batches: tuple[int, ...] = (1, 8)) -> None:
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
        for b in batches:
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

        for b in batches:
            export(f"gpt2_b{b}", G(gpt2), (torch.randint(0, 50000, (b, 128)),), ["input_ids"], None)


def fp16_path(path: str) -> str:
    """Where the float16 conversion of the model at ``path`` is kept (beside it)."""
    return path.replace(".onnx", "_fp16.onnx")


def to_fp16(src: str) -> str:
    """The float16 conversion of the model at ``src`` (onnxruntime's, float32 inputs and
    outputs), made once; its path."""
    dst = fp16_path(src)
    if not os.path.exists(dst):
        import onnx
        from onnxruntime.transformers.float16 import convert_float_to_float16

        m = convert_float_to_float16(onnx.load(src), keep_io_types=True)
        onnx.save(m, dst)
    return dst


def parse_options(text: str) -> dict[str, str]:
    """Provider options written ``k=v,k2=v2`` (``--cuda-options``) as a dict."""
    return dict(kv.split("=", 1) for kv in text.split(",") if kv)


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
            path, providers=[(CUDA, {**OPTIONS, "use_tf32": tf32}), "CPUExecutionProvider"]
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


def gpu_trace(call: Any, runs: int) -> dict[str, list[float]]:
    """GPU µs of each kernel and copy of ``runs`` calls of ``call`` (after 5 warm-up calls):
    CUPTI through PyTorch's profiler, which traces every kernel of the process (CuPy's,
    cuBLASLt's, cuDNN's) and the kernels of replayed CUDA graphs."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(5):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            call()
        torch.cuda.synchronize()
    per: dict[str, list[float]] = collections.defaultdict(list)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0:
            per[e.name].append(e.device_time)
    return per


def gpu_us_per_run(call: Any, runs: int = 20) -> float | None:
    """The GPU time of one call: its kernels' and copies' µs summed (no launch gaps); None
    without PyTorch (the tracer)."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return None
    return sum(sum(v) for v in gpu_trace(call, runs).values()) / runs


def bench_onnxplug(path: str, feeds: dict[str, np.ndarray], runs: int) -> dict[str, Any]:
    """Plain run() eager, plain run() with CUDA graphs, IOBinding with CUDA graphs (onnxruntime's
    documented recipe: inputs updated in place, outputs bound); the graph outputs checked against
    the eager ones (bit for bit)."""
    res: dict[str, Any] = {}
    eager = ox.InferenceSession(path, providers=[(CUDA, OPTIONS), "CPUExecutionProvider"])
    res["run_eager"] = med_ms(lambda: eager.run(None, feeds), lambda: None, runs)
    want = eager.run(None, feeds)
    graph = ox.InferenceSession(
        path, providers=[(CUDA, {**OPTIONS, "enable_cuda_graph": "1"}), "CPUExecutionProvider"]
    )
    got = graph.run(None, feeds)
    res["graph_equals_eager"] = all(np.array_equal(a, b) for a, b in zip(got, want))
    res["run_graph"] = med_ms(lambda: graph.run(None, feeds), lambda: None, runs)
    states = graph._runner.capture.states() if graph._runner.capture else []
    res["graph_state"] = [s[2] + (f" ({s[3][:200]})" if s[3] else "") for s in states]
    io = graph.io_binding()
    ins = {k: ox.OrtValue.ortvalue_from_numpy(v, "cuda", 0) for k, v in feeds.items()}
    for k, v in ins.items():
        io.bind_ortvalue_input(k, v)
    outs = {}
    for o, w in zip(graph.get_outputs(), want):
        outs[o.name] = ox.OrtValue.ortvalue_from_shape_and_type(w.shape, w.dtype, "cuda", 0)
        io.bind_ortvalue_output(o.name, outs[o.name])
    graph.run_with_iobinding(io)
    res["iobind_graph_equals_eager"] = bool(
        np.array_equal(outs[graph.get_outputs()[0].name].numpy(), want[0])
    )
    res["iobind_graph"] = med_ms(
        lambda: graph.run_with_iobinding(io), lambda: io.synchronize_outputs(), runs
    )
    # the replayed graph's GPU time: the IOBinding run moves no data, so this is the model's
    res["iobind_graph_gpu_us"] = gpu_us_per_run(lambda: graph.run_with_iobinding(io))
    return res


def op_profile(path: str, feeds: dict[str, np.ndarray], runs: int = 20) -> list[tuple]:
    """Per op type (onnxplug's profiler, eager plain run(), after 3 warm-up runs): nodes per
    run, host µs per node, host µs per run, GPU µs per run (CUDA events around each node)."""
    import tempfile

    from onnxplug.tools.profile_report import op_table, runs_of

    with tempfile.TemporaryDirectory() as tmp:
        so = ox.SessionOptions()
        so.enable_profiling = True
        so.profile_file_prefix = os.path.join(tmp, "prof")
        s = ox.InferenceSession(path, so, providers=[(CUDA, OPTIONS), "CPUExecutionProvider"])
        for _ in range(3 + runs):
            s.run(None, feeds)
        with open(s.end_profiling()) as fh:
            events = json.load(fh)
    rows = op_table(runs_of(events)[-runs:])
    return [
        (
            r.op,
            round(r.nodes),
            1000 * r.host_ms / max(r.nodes, 1e-9),
            1000 * r.host_ms,
            1000 * r.gpu_ms if r.gpu_ms is not None else float("nan"),
        )
        for r in rows
    ]


def tiny_model() -> bytes:
    """The tiny model whose runs measure host cost: one Relu on a (1, 16) float32 input x."""
    from onnx import TensorProto, helper

    g = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16])],
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def tiny_replay_us(runs: int = 2000) -> dict[str, float]:
    """Host cost of one run of a tiny model (Relu on 1x16): eager and replayed."""
    m = tiny_model()
    x = np.ones((1, 16), np.float32)
    out = {}
    for name, opts in (("eager", {}), ("graph", {"enable_cuda_graph": "1"})):
        s = ox.InferenceSession(m, providers=[(CUDA, opts), "CPUExecutionProvider"])
        for _ in range(20):
            s.run(None, {"x": x})
        t0 = time.perf_counter()
        for _ in range(runs):
            s.run(None, {"x": x})
        out[name] = (time.perf_counter() - t0) / runs * 1e6
        # a session of its own, as a user binding once has: a graph captured for plain run()
        # and then fed bound values is captured again without the copies it held
        s = ox.InferenceSession(m, providers=[(CUDA, opts), "CPUExecutionProvider"])
        io = s.io_binding()
        io.bind_ortvalue_input("x", ox.OrtValue.ortvalue_from_numpy(x, "cuda", 0))
        y = ox.OrtValue.ortvalue_from_shape_and_type([1, 16], np.float32, "cuda", 0)
        io.bind_ortvalue_output("y", y)
        for _ in range(20):
            s.run_with_iobinding(io)
        t0 = time.perf_counter()
        for _ in range(runs):
            s.run_with_iobinding(io)
        io.synchronize_outputs()
        out[name + "_iobind"] = (time.perf_counter() - t0) / runs * 1e6
    return out


def torch_module(name: str, fp16: bool) -> Any:
    """The PyTorch model behind an export, on the GPU, in inference mode (float16 with
    ``fp16``)."""
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
    return m.half() if fp16 else m


def torch_inputs(name: str, feeds: dict[str, np.ndarray], fp16: bool) -> dict[str, Any]:
    """``feeds`` as the module's GPU tensors (ResNet-50's image in float16 with ``fp16``)."""
    import torch

    tf = {k: torch.from_numpy(v).cuda() for k, v in feeds.items()}
    if fp16 and name == "resnet50":
        tf["input"] = tf["input"].half()
    return tf


def torch_forward(name: str, m: Any, tf: dict[str, Any]) -> Any:
    """The module's output tensor for inputs ``tf`` (the transformers' last hidden state)."""
    if name == "resnet50":
        return m(tf["input"])
    if name == "bert_base":
        return m(input_ids=tf["input_ids"], attention_mask=tf["attention_mask"])[0]
    return m(input_ids=tf["input_ids"], use_cache=False)[0]


def torch_model(name: str, feeds: dict[str, np.ndarray], fp16: bool) -> Any:
    """The PyTorch model behind an export, on the GPU, as a call on ``feeds`` (as tensors)."""
    m, tf = torch_module(name, fp16), torch_inputs(name, feeds, fp16)
    return lambda: torch_forward(name, m, tf)


def bench_torch(name: str, feeds: dict[str, np.ndarray], runs: int, fp16: bool) -> dict[str, float]:
    """PyTorch eager and one captured CUDA graph replayed, on the same GPU in the same run."""
    import torch

    call = torch_model(name, feeds, fp16)
    out = {}
    with torch.inference_mode():
        out["torch_eager"] = med_ms(call, torch.cuda.synchronize, runs)
        out["torch_graph"] = med_ms(torch_graph(call), torch.cuda.synchronize, runs)
    return out


def torch_graph(call: Any) -> Any:
    """``call`` captured as one CUDA graph (after 3 warm-up calls on a side stream): its
    replay."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        call()
    return g.replay


# onnxruntime CUDA EP on the same H100 (../shared/anchors): (plain run(), IOBinding + graph)
ANCHORS = {
    ("resnet50", 1, "fp32"): (2.06, 0.93),
    ("resnet50", 32, "fp32"): (7.79, 5.60),
    ("bert_base", 1, "fp32"): (3.44, 1.31),
    ("bert_base", 8, "fp32"): (4.10, 2.84),
    ("gpt2", 1, "fp32"): (2.29, 1.005),
    ("gpt2", 8, "fp32"): (2.92, 2.09),
    ("resnet50", 1, "fp16"): (None, 0.807),
    ("resnet50", 32, "fp16"): (None, 3.875),
    ("bert_base", 1, "fp16"): (None, 0.957),
    ("bert_base", 8, "fp16"): (None, 1.926),
    ("gpt2", 1, "fp16"): (None, 0.736),
    ("gpt2", 8, "fp16"): (None, 1.367),
}


def gpu_goal_us(row: dict[str, Any]) -> float | None:
    """Issue 8's goal for a row: GPU time per run at most 0.75x the best of onnxruntime's and
    PyTorch's CUDA-graph latency (µs); None without either figure."""
    best = [row[k] for k in ("ort_graph", "torch_graph") if isinstance(row.get(k), float)]
    return 750 * min(best) if best else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="resnet50,bert_base,gpt2")
    ap.add_argument("--out", default="/tmp/onnxplug_models")
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--fp16", action="store_true", help="also run fp16 versions")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--check", action="store_true", help="compare with the CPU provider too")
    ap.add_argument("--profile", action="store_true", help="host and GPU µs per op (batch 1, fp32)")
    ap.add_argument("--batches", default=None, help="only these batch sizes (e.g. 1)")
    ap.add_argument("--cuda-options", default="", help="k=v,... for every onnxplug session")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    OPTIONS.update(parse_options(args.cuda_options))
    names = args.models.split(",")
    if CUDA not in ox.get_available_providers():
        print(f"{CUDA} is not available: {ox.get_provider_load_errors()}", file=sys.stderr)
        return 2
    export_all(args.out, names)
    rows: list[dict[str, Any]] = []
    profiles: dict[str, list[tuple]] = {}
    for name in names:
        batches = [1, 32] if name == "resnet50" else [1, 8]
        if args.batches:
            batches = [b for b in batches if str(b) in args.batches.split(",")]
        for b in batches:
            for fp16 in [False, True] if args.fp16 else [False]:
                path = model_path(args.out, name, b)
                if fp16:
                    path = to_fp16(path)
                feeds = feeds_for(name, b)
                dt = "fp16" if fp16 else "fp32"
                row: dict[str, Any] = {"model": name, "batch": b, "dtype": dt}
                try:
                    if args.check:
                        row.update(check(path, feeds, fp16))
                    row.update(bench_onnxplug(path, feeds, args.runs))
                    if args.profile and b == 1 and not fp16:
                        profiles[name] = op_profile(path, feeds)
                    if not args.no_torch:
                        row.update(bench_torch(name, feeds, args.runs, fp16))
                except Exception as e:  # report and go on with the other models
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                row["ort_run"], row["ort_graph"] = ANCHORS.get((name, b, dt), (None, None))
                print(json.dumps(row), flush=True)
                rows.append(row)
    tiny = tiny_replay_us()
    print(json.dumps({"tiny_model_host_us": tiny}), flush=True)
    print()
    print(
        "| model | batch | dtype | run() eager | run() + graph | IOBinding + graph | torch eager "
        "| torch graph | ORT run() | ORT IOBinding + graph | graph == eager | GPU µs per run "
        "| goal µs | met |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['model']} | {r['batch']} | {r['dtype']} | ERROR: {r['error'][:120]} |")
            continue

        def f(k: str, r: dict[str, Any] = r) -> str:
            v = r.get(k)
            return f"{v:.3g}" if isinstance(v, float) else "-"

        same = r.get("graph_equals_eager") and r.get("iobind_graph_equals_eager")
        gpu, goal = r.get("iobind_graph_gpu_us"), gpu_goal_us(r)
        met = "-" if gpu is None or goal is None else ("yes" if gpu <= goal else "no")
        print(
            f"| {r['model']} | {r['batch']} | {r['dtype']} | {f('run_eager')} | {f('run_graph')} "
            f"| {f('iobind_graph')} | {f('torch_eager')} | {f('torch_graph')} | {f('ort_run')} "
            f"| {f('ort_graph')} | {'yes' if same else 'NO'} "
            f"| {'-' if gpu is None else f'{gpu:.1f}'} | {'-' if goal is None else f'{goal:.0f}'} "
            f"| {met} |"
        )
    print()
    print("tiny model (Relu 1x16), host µs per run:", {k: round(v, 1) for k, v in tiny.items()})
    for name, prof in profiles.items():
        print(
            f"\nprofile, {name} b1 fp32 eager (op, nodes, host µs per node, host µs per run, "
            "GPU µs per run):"
        )
        for op, n, per, tot, gpu in prof[:15]:
            print(f"  {op:28s} {n:4d} {per:8.1f} {tot:9.1f} {gpu:9.1f}")
    from onnxplug_cuda import dnn
    from onnxplug_cuda.kernels import _base

    print("\ncuDNN convolution calls (all sessions):", dnn.stats)

    if _base.UNPREPARED:
        print("\nnodes that ran unprepared (op: first reason):")
        for op, why in sorted(_base.UNPREPARED.items()):
            print(f"  {op}: {why[:160]}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"rows": rows, "tiny_us": tiny, "profiles": profiles}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
