"""The fuzzer's seed models: small valid models that together use the structures an attacker
or a careless exporter would bend: convolutions and pools, shape arithmetic, broadcasting,
control flow (If, Loop, Scan) with outer-scope reads, sequences, indexing, recurrent ops,
external data and the package's demo CNN.

Every seed is built in code (deterministic, no download) and returns a ``Seed``: the model
and, for external-data seeds, the files that must lie beside it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

F = TensorProto.FLOAT
I64 = TensorProto.INT64
BOOL = TensorProto.BOOL
OPSET = 18


@dataclass
class Seed:
    name: str
    model: onnx.ModelProto
    files: dict[str, bytes] = field(default_factory=dict)  # external data files by name


def _tv(name: str, shape, elem: int = F) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, shape)


def _c(name: str, value, dtype=np.float32) -> TensorProto:
    return numpy_helper.from_array(np.asarray(value, dtype=dtype), name)


def _model(nodes, inputs, outputs, inits=(), opset: int = OPSET) -> onnx.ModelProto:
    g = helper.make_graph(list(nodes), "g", list(inputs), list(outputs), list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=9)


def _rng() -> np.random.Generator:
    return np.random.default_rng(1234)


def cnn() -> Seed:
    r = _rng()
    n = helper.make_node
    return Seed(
        "cnn",
        _model(
            [
                n("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1], strides=[1, 1]),
                n("BatchNormalization", ["c", "s", "bb", "m", "v"], ["bn"]),
                n("Relu", ["bn"], ["r"]),
                n("MaxPool", ["r"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
                n("AveragePool", ["p"], ["ap"], kernel_shape=[2, 2], pads=[0, 0, 1, 1]),
                n("Flatten", ["ap"], ["f"]),
                n("Gemm", ["f", "w2", "b2"], ["g"], transB=1),
                n("Softmax", ["g"], ["y"]),
            ],
            [_tv("x", [1, 3, 8, 8])],
            [_tv("y", [1, 10])],
            [
                _c("w", r.standard_normal((4, 3, 3, 3))),
                _c("b", r.standard_normal(4)),
                _c("s", np.ones(4)),
                _c("bb", np.zeros(4)),
                _c("m", np.zeros(4)),
                _c("v", np.ones(4)),
                _c("w2", r.standard_normal((10, 64))),
                _c("b2", np.zeros(10)),
            ],
        ),
    )


def conv_transpose() -> Seed:
    r = _rng()
    n = helper.make_node
    return Seed(
        "conv_transpose",
        _model(
            [
                n("ConvTranspose", ["x", "w"], ["t"], strides=[2, 2], output_padding=[1, 1]),
                n("InstanceNormalization", ["t", "s", "b"], ["i"]),
                n("Resize", ["i", "", "sc"], ["y"], mode="nearest"),
            ],
            [_tv("x", [1, 2, 4, 4])],
            [_tv("y", None)],
            [
                _c("w", r.standard_normal((2, 3, 3, 3))),
                _c("s", np.ones(3)),
                _c("b", np.zeros(3)),
                _c("sc", [1, 1, 2, 2]),
            ],
        ),
    )


def shapes() -> Seed:
    n = helper.make_node
    return Seed(
        "shapes",
        _model(
            [
                n("Shape", ["x"], ["sh"]),
                n("Gather", ["sh", "i0"], ["d0"], axis=0),
                n("Concat", ["d0", "m1"], ["ns"], axis=0),
                n("Reshape", ["x", "ns"], ["r"]),
                n("Transpose", ["r"], ["t"], perm=[1, 0]),
                n("Slice", ["t", "st", "en", "ax", "sp"], ["sl"]),
                n("Expand", ["sl", "es"], ["e"]),
                n("Tile", ["e", "reps"], ["ti"]),
                n("Pad", ["ti", "pads"], ["pd"], mode="constant"),
                n("Unsqueeze", ["pd", "ax0"], ["u"]),
                n("Squeeze", ["u", "ax0"], ["sq"]),
                n("Split", ["sq", "splits"], ["s1", "s2"], axis=1),
                n("Concat", ["s2", "s1"], ["y"], axis=1),
            ],
            [_tv("x", ["N", 3, 4])],
            [_tv("y", None)],
            [
                _c("i0", [0], np.int64),
                _c("m1", [-1], np.int64),
                _c("st", [0], np.int64),
                _c("en", [6], np.int64),
                _c("ax", [0], np.int64),
                _c("sp", [2], np.int64),
                _c("es", [2, 1, 1], np.int64),
                _c("reps", [1, 2, 1], np.int64),
                _c("pads", [0, 1, 0, 0, 1, 0], np.int64),
                _c("ax0", [0], np.int64),
                _c("splits", [3, 5], np.int64),
            ],
        ),
    )


def elementwise() -> Seed:
    n = helper.make_node
    return Seed(
        "elementwise",
        _model(
            [
                n("Add", ["x", "z"], ["a"]),
                n("Mul", ["a", "k"], ["m"]),
                n("Abs", ["m"], ["ab"]),
                n("Sqrt", ["ab"], ["s"]),
                n("Greater", ["s", "k"], ["g"]),
                n("Where", ["g", "s", "z"], ["w"]),
                n("Clip", ["w", "lo", "hi"], ["c"]),
                n("Cast", ["c"], ["ci"], to=I64),
                n("Cast", ["ci"], ["cf"], to=F),
                n("Div", ["cf", "k"], ["d"]),
                n("Pow", ["d", "k"], ["y"]),
            ],
            [_tv("x", [2, 3]), _tv("z", [3])],
            [_tv("y", [2, 3])],
            [_c("k", 2.0), _c("lo", 0.0), _c("hi", 5.0)],
        ),
    )


def reductions() -> Seed:
    r = _rng()
    n = helper.make_node
    return Seed(
        "reductions",
        _model(
            [
                n("MatMul", ["x", "w"], ["mm"]),
                n("LayerNormalization", ["mm", "g", "b"], ["ln"], axis=-1),
                n("ReduceMean", ["ln", "axes"], ["rm"], keepdims=1),
                n("ReduceMax", ["ln"], ["rx"], keepdims=0),
                n("ArgMax", ["ln"], ["am"], axis=1),
                n("TopK", ["ln", "k"], ["tv", "ti"], axis=-1),
                n("Sub", ["ln", "rm"], ["y"]),
            ],
            [_tv("x", [2, 3, 4])],
            [_tv("y", None), _tv("rx", None), _tv("am", None, I64), _tv("ti", None, I64)],
            [
                _c("w", r.standard_normal((4, 5))),
                _c("g", np.ones(5)),
                _c("b", np.zeros(5)),
                _c("axes", [1], np.int64),
                _c("k", [2], np.int64),
            ],
        ),
    )


def if_branches() -> Seed:
    then = helper.make_graph(
        [helper.make_node("Add", ["x", "w"], ["t"])], "then", [], [_tv("t", [2])]
    )
    other = helper.make_graph(
        [helper.make_node("Mul", ["x", "w"], ["e"])], "else", [], [_tv("e", [2])]
    )
    return Seed(
        "if",
        _model(
            [helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)],
            [_tv("c", [], BOOL), _tv("x", [2])],
            [_tv("y", [2])],
            [_c("w", [1.0, 2.0])],
        ),
    )


def loop() -> Seed:
    body = helper.make_graph(
        [
            helper.make_node("Identity", ["cond"], ["cond_out"]),
            helper.make_node("Add", ["acc", "x"], ["acc_out"]),
            helper.make_node("Cast", ["i"], ["fi"], to=F),
            helper.make_node("Mul", ["acc_out", "fi"], ["scan"]),
        ],
        "body",
        [_tv("i", [], I64), _tv("cond", [], BOOL), _tv("acc", [2])],
        [_tv("cond_out", [], BOOL), _tv("acc_out", [2]), _tv("scan", [2])],
    )
    return Seed(
        "loop",
        _model(
            [helper.make_node("Loop", ["m", "", "a0"], ["y", "ys"], body=body)],
            [_tv("x", [2]), _tv("a0", [2])],
            [_tv("y", [2]), _tv("ys", [None, 2])],
            [_c("m", 3, np.int64)],
        ),
    )


def scan() -> Seed:
    body = helper.make_graph(
        [
            helper.make_node("Add", ["s", "e"], ["so"]),
            helper.make_node("Mul", ["so", "k"], ["eo"]),
        ],
        "body",
        [_tv("s", [2]), _tv("e", [2])],
        [_tv("so", [2]), _tv("eo", [2])],
    )
    return Seed(
        "scan",
        _model(
            [helper.make_node("Scan", ["s0", "xs"], ["s", "ys"], body=body, num_scan_inputs=1)],
            [_tv("s0", [2]), _tv("xs", [3, 2])],
            [_tv("s", [2]), _tv("ys", [3, 2])],
            [_c("k", [2.0, 2.0])],
        ),
    )


def sequences() -> Seed:
    n = helper.make_node
    return Seed(
        "sequences",
        _model(
            [
                n("SequenceConstruct", ["x", "x"], ["s"]),
                n("SequenceInsert", ["s", "x", "p"], ["s2"]),
                n("SequenceAt", ["s2", "p"], ["a"]),
                n("SequenceErase", ["s2", "p"], ["s3"]),
                n("SequenceLength", ["s3"], ["len"]),
                n("ConcatFromSequence", ["s3"], ["cat"], axis=0),
                n("SplitToSequence", ["cat"], ["sp"], axis=0, keepdims=1),
                n("SequenceAt", ["sp", "p"], ["y"]),
            ],
            [_tv("x", [2, 3])],
            [_tv("y", None), _tv("a", None), _tv("len", None, I64)],
            [_c("p", 1, np.int64)],
        ),
    )


def indexing() -> Seed:
    n = helper.make_node
    return Seed(
        "indexing",
        _model(
            [
                n("Gather", ["x", "idx"], ["g"], axis=1),
                n("GatherElements", ["x", "ge"], ["gel"], axis=1),
                n("ScatterND", ["x", "si", "su"], ["sc"]),
                n("NonZero", ["sc"], ["nz"]),
                n("OneHot", ["idx", "depth", "vals"], ["oh"], axis=-1),
                n("Range", ["r0", "r1", "r2"], ["rg"]),
                n("ConstantOfShape", ["cs"], ["co"]),
                n("CumSum", ["x", "ax"], ["cu"]),
                n("Add", ["cu", "co"], ["y"]),
            ],
            [_tv("x", [2, 3])],
            [_tv("y", None), _tv("g", None), _tv("gel", None), _tv("nz", None, I64)]
            + [_tv("oh", None), _tv("rg", None, I64)],
            [
                _c("idx", [0, 2], np.int64),
                _c("ge", [[0, 1, 2], [2, 1, 0]], np.int64),
                _c("si", [[0, 1]], np.int64),
                _c("su", [5.0]),
                _c("depth", 3, np.int64),
                _c("vals", [0.0, 1.0]),
                _c("r0", 0, np.int64),
                _c("r1", 10, np.int64),
                _c("r2", 3, np.int64),
                _c("cs", [2, 3], np.int64),
                _c("ax", 1, np.int64),
            ],
        ),
    )


def recurrent() -> Seed:
    r = _rng()
    return Seed(
        "recurrent",
        _model(
            [
                helper.make_node("LSTM", ["x", "w", "r", "b"], ["y", "yh"], hidden_size=3),
                helper.make_node("GRU", ["x", "gw", "gr"], ["gy"], hidden_size=3),
            ],
            [_tv("x", [4, 2, 5])],
            [_tv("y", None), _tv("yh", None), _tv("gy", None)],
            [
                _c("w", r.standard_normal((1, 12, 5))),
                _c("r", r.standard_normal((1, 12, 3))),
                _c("b", np.zeros((1, 24))),
                _c("gw", r.standard_normal((1, 9, 5))),
                _c("gr", r.standard_normal((1, 9, 3))),
            ],
        ),
    )


def external_data() -> Seed:
    """Y = X @ W + B with W and B in one external file (B by offset, no length)."""
    r = _rng()
    w = r.standard_normal((8, 4)).astype(np.float32)
    b = r.standard_normal(4).astype(np.float32)
    inits = []
    for name, arr, entries in (
        ("W", w, [("location", "weights.bin"), ("offset", "0"), ("length", str(w.nbytes))]),
        ("B", b, [("location", "weights.bin"), ("offset", str(w.nbytes))]),
    ):
        t = TensorProto(name=name, data_type=F, dims=list(arr.shape))
        t.data_location = TensorProto.EXTERNAL
        for k, v in entries:
            e = t.external_data.add()
            e.key, e.value = k, v
        inits.append(t)
    m = _model(
        [
            helper.make_node("MatMul", ["X", "W"], ["xw"]),
            helper.make_node("Add", ["xw", "B"], ["Y"]),
        ],
        [_tv("X", [2, 8])],
        [_tv("Y", [2, 4])],
        inits,
    )
    return Seed("external_data", m, {"weights.bin": w.tobytes() + b.tobytes()})


def demo() -> Seed:
    path = Path(__file__).resolve().parent.parent / "data" / "demo.onnx"
    return Seed("demo", onnx.load(path))


SEEDS: list[Callable[[], Seed]] = [
    cnn,
    conv_transpose,
    shapes,
    elementwise,
    reductions,
    if_branches,
    loop,
    scan,
    sequences,
    indexing,
    recurrent,
    external_data,
    demo,
]


def corpus() -> list[Seed]:
    return [make() for make in SEEDS]
