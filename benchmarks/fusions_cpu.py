"""What the convolution and GEMM fusions do on the CPU provider: nodes and median latency of a
ResNet-50-shaped model and a BERT-base-shaped encoder layer (onnx.helper graphs in the shapes
torch.onnx writes, random weights; the builders are the tests' own), per optimizer setting.

* ``none``: graph_optimization_level 0.
* ``without conv/gemm fusions``: the default level with this change's passes switched off
  (``ConvAddFusion``, ``ConvMulFusion``, ``ConvActivationFusion``,
  ``ConvAddActivationFusion``, ``MatmulTransposeFusion``, ``MatMulScaleFusion``), i.e. what
  the optimizer did before them.
* ``default``: everything (ORT_ENABLE_ALL).

BERT's attention is fused into one Attention node whatever the setting, which leaves no
Transpose + MatMul for FusedMatMul; the ``attention unfused`` rows switch AttentionFusion off
to show what FusedMatMul does to the scores' ``Q @ K^T / sqrt(d)``. onnxruntime's default
session of the same model is timed for reference when it is installed.

    python benchmarks/fusions_cpu.py [--runs 50] [--models resnet50,bert]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path

import numpy as np
import onnx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from cpu_light_models import median_ms  # noqa: E402
from tests.test_fusions_conv import resnet50  # noqa: E402
from tests.test_fusions_transformer import bert_model  # noqa: E402

import onnxplug as ox  # noqa: E402

NEW_PASSES = [
    "ConvAddFusion",
    "ConvMulFusion",
    "ConvActivationFusion",
    "ConvAddActivationFusion",
    "MatmulTransposeFusion",
    "MatMulScaleFusion",
]


def models() -> dict[str, tuple[bytes, dict[str, np.ndarray]]]:
    rng = np.random.default_rng(0)
    bert = bert_model(layers=1, shape=(1, 128, 768), heads=12, ffn=3072)
    bert_feeds = {
        "words": rng.standard_normal((1, 128, 768)).astype(np.float32),
        "positions": rng.standard_normal((1, 128, 768)).astype(np.float32),
        "mask": np.where(rng.random((1, 1, 1, 128)) < 0.1, -1e4, 0).astype(np.float32),
    }
    return {
        "resnet50": (resnet50(), {"x": rng.standard_normal((1, 3, 224, 224)).astype(np.float32)}),
        "bert": (bert, bert_feeds),
    }


def typed(model: bytes) -> bytes:
    return onnx.shape_inference.infer_shapes(onnx.load_from_string(model)).SerializeToString()


def row(model: bytes, feeds: dict, runs: int, level: int, disabled: list[str]) -> tuple:
    so = ox.SessionOptions()
    so.graph_optimization_level = ox.GraphOptimizationLevel(level)
    s = ox.InferenceSession(
        model, so, providers=["CPUExecutionProvider"], disabled_optimizers=disabled
    )
    nodes = len(s._graph.nodes)
    fused = sum(1 for n in s._graph.nodes if n.op_type in ("FusedConv", "FusedMatMul"))
    return (
        nodes,
        fused,
        median_ms(functools.partial(s.run, None, feeds), runs),
        s.run(None, feeds)[0],
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=50)
    p.add_argument("--models", default="resnet50,bert")
    args = p.parse_args()
    print(
        f"load average {os.getloadavg()[0]:.2f}, {os.cpu_count()} CPUs, median of {args.runs} runs"
    )
    print("| model | optimizer setting | nodes | FusedConv+FusedMatMul | median ms |")
    print("| --- | --- | ---: | ---: | ---: |")
    all_ = int(ox.GraphOptimizationLevel.ORT_ENABLE_ALL)
    for name, (model, feeds) in models().items():
        if name not in args.models.split(","):
            continue
        model = typed(model)
        settings = [
            ("none", 0, []),
            ("without conv/gemm fusions", all_, NEW_PASSES),
            ("default", all_, []),
        ]
        if name == "bert":
            settings += [
                (
                    "attention unfused, without conv/gemm fusions",
                    all_,
                    [*NEW_PASSES, "AttentionFusion"],
                ),
                ("attention unfused", all_, ["AttentionFusion"]),
            ]
        ref = None
        for label, level, disabled in settings:
            nodes, fused, ms, out = row(model, feeds, args.runs, level, disabled)
            if ref is None:
                ref = out
            err = float(np.abs(out - ref).max() / max(1.0, np.abs(ref).max()))
            assert err < 1e-4, (name, label, err)
            print(f"| {name} | {label} | {nodes} | {fused} | {ms:.1f} |")
        try:
            import onnxruntime
        except ImportError:
            continue
        s = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"])
        ms = median_ms(functools.partial(s.run, None, feeds), args.runs)
        print(f"| {name} | onnxruntime {onnxruntime.__version__}, default | | | {ms:.1f} |")


if __name__ == "__main__":
    main()
