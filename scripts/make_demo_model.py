"""Build the demo model shipped in the package (``src/onnxplug/data/demo.onnx``).

A tiny CNN classifier for 8x8 single-channel images with fixed random weights:

    image [N,1,8,8] -> Conv(4 filters, 3x3, pad 1) + bias -> Relu -> MaxPool(2x2)
                   -> Flatten -> Gemm(64 -> 10) -> Softmax -> probabilities [N,10]

The batch dimension is symbolic ("N") so the demo also shows per-shape-signature planning.
The weights come from a fixed seed, so re-running this script reproduces the committed file
byte for byte; the model is a few KB. Run it from the repository root:

    python scripts/make_demo_model.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OUT = Path(__file__).resolve().parents[1] / "src" / "onnxplug" / "data" / "demo.onnx"
# Opset 17 and IR 8 are old enough for every ONNX runtime still in use and new enough for
# every op here to be at its current semantics.
OPSET = 17
IR_VERSION = 8
SEED = 20240611


def build() -> onnx.ModelProto:
    rng = np.random.default_rng(SEED)
    # He-style scaling keeps activations in a readable range for the printed probabilities.
    conv_w = (rng.standard_normal((4, 1, 3, 3)) * np.sqrt(2 / 9)).astype(np.float32)
    conv_b = (rng.standard_normal(4) * 0.1).astype(np.float32)
    fc_w = (rng.standard_normal((64, 10)) * np.sqrt(2 / 64)).astype(np.float32)
    fc_b = (rng.standard_normal(10) * 0.1).astype(np.float32)

    nodes = [
        helper.make_node(
            "Conv", ["image", "conv_w", "conv_b"], ["conv"], name="conv", pads=[1, 1, 1, 1]
        ),
        helper.make_node("Relu", ["conv"], ["relu"], name="relu"),
        helper.make_node(
            "MaxPool", ["relu"], ["pool"], name="pool", kernel_shape=[2, 2], strides=[2, 2]
        ),
        helper.make_node("Flatten", ["pool"], ["flat"], name="flatten", axis=1),
        helper.make_node("Gemm", ["flat", "fc_w", "fc_b"], ["logits"], name="fc"),
        helper.make_node("Softmax", ["logits"], ["probabilities"], name="softmax", axis=1),
    ]
    graph = helper.make_graph(
        nodes,
        "onnxplug_demo_cnn",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["N", 1, 8, 8])],
        [helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["N", 10])],
        initializer=[
            numpy_helper.from_array(conv_w, "conv_w"),
            numpy_helper.from_array(conv_b, "conv_b"),
            numpy_helper.from_array(fc_w, "fc_w"),
            numpy_helper.from_array(fc_b, "fc_b"),
        ],
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET)],
        producer_name="onnxplug/scripts/make_demo_model.py",
        doc_string="onnxplug demo: tiny CNN over 8x8 images, fixed random weights",
    )
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model, full_check=True)
    return model


def main() -> int:
    model = build()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_bytes(model.SerializeToString())
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
