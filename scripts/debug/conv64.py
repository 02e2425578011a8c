"""Conv on cuDNN against the CPU provider, float64 and float32, per option set (with and without
bias, symmetric and asymmetric pads): the measurement behind float64 convolutions taking the GEMM
path (onnxplug_cuda.dnn.CudnnConv.run). On a GPU: ``python scripts/debug/conv64.py``."""

from __future__ import annotations

import warnings

import numpy as np
from onnx import TensorProto, helper, numpy_helper

import onnxplug as ox

OPTION_SETS = [
    {},
    {"fuse_conv_bias": "1"},
    {"cudnn_conv_algo_search": "HEURISTIC"},
    {"cudnn_conv_algo_search": "DEFAULT"},
    {"enable_cudnn": "0"},
]


def conv_model(bias: bool, pads: list[int], dtype: type) -> tuple[bytes, dict[str, np.ndarray]]:
    rng = np.random.default_rng(12)
    x = rng.standard_normal((2, 4, 9, 10)).astype(dtype)
    inits = [numpy_helper.from_array(rng.standard_normal((6, 2, 3, 3)).astype(dtype), "w")]
    if bias:
        inits.append(numpy_helper.from_array(rng.standard_normal(6).astype(dtype), "b"))
    elem = TensorProto.DOUBLE if dtype == np.float64 else TensorProto.FLOAT
    node = helper.make_node(
        "Conv",
        ["x", "w"] + (["b"] if bias else []),
        ["y"],
        group=2,
        dilations=[2, 1],
        strides=[2, 1],
        pads=pads,
    )
    g = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", elem, None)],
        [helper.make_tensor_value_info("y", elem, None)],
        inits,
    )
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    return model.SerializeToString(), {"x": x}


def main() -> None:
    from onnxplug_cuda import dnn

    warnings.simplefilter("ignore")
    for dtype in (np.float64, np.float32):
        for bias in (True, False):
            for pads in ([0, 1, 2, 1], [1, 1, 1, 1]):
                for opts in OPTION_SETS:
                    model, feeds = conv_model(bias, pads, dtype)
                    cpu = ox.InferenceSession(model, providers=["CPUExecutionProvider"])
                    ref = cpu.run(None, feeds)[0]
                    cuda = ox.InferenceSession(
                        model, providers=[("CUDAExecutionProvider", {**opts, "use_tf32": "0"})]
                    )
                    before = dict(dnn.stats)
                    err = max(float(np.abs(cuda.run(None, feeds)[0] - ref).max()) for _ in range(4))
                    calls = {k: dnn.stats[k] - before[k] for k in dnn.stats}
                    name = np.dtype(dtype).name
                    print(name, "bias" if bias else "-", pads, opts, f"max err {err:.3g}", calls)


if __name__ == "__main__":
    main()
