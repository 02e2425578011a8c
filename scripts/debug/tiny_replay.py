"""Where the host time of a replayed run of a tiny model goes (Relu on 1x16, CUDA graphs):
µs per run for plain ``run()`` and IOBinding, then cProfile's top functions of the IOBinding
replays. On a GPU: ``python scripts/debug/tiny_replay.py [--top 25]``."""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import numpy as np
from onnx import TensorProto, helper

import onnxplug as ox

CUDA = "CUDAExecutionProvider"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3000)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    g = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16])],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    x = np.ones((1, 16), np.float32)
    s = ox.InferenceSession(m, providers=[(CUDA, {"enable_cuda_graph": "1"})])
    io = s.io_binding()
    io.bind_ortvalue_input("x", ox.OrtValue.ortvalue_from_numpy(x, "cuda", 0))
    io.bind_ortvalue_output(
        "y", ox.OrtValue.ortvalue_from_shape_and_type([1, 16], np.float32, "cuda", 0)
    )
    for _ in range(50):
        s.run(None, {"x": x})
        s.run_with_iobinding(io)
    for name, fn in (
        ("run()", lambda: s.run(None, {"x": x})),
        ("IOBinding", lambda: s.run_with_iobinding(io)),
    ):
        t0 = time.perf_counter()
        for _ in range(args.runs):
            fn()
        io.synchronize_outputs()
        print(f"{name}: {(time.perf_counter() - t0) / args.runs * 1e6:.1f} µs per replayed run")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.runs):
        s.run_with_iobinding(io)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
