"""Small ONNX models for the plugin, partitioning and executor tests.

Each builder returns serialized model bytes. Inputs have a symbolic batch dimension so that
several input shapes (signatures) can run through one session.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

F = TensorProto.FLOAT


def make_model(
    nodes: list[onnx.NodeProto],
    inputs: list[onnx.ValueInfoProto],
    outputs: list[onnx.ValueInfoProto],
    initializers: dict[str, np.ndarray] | None = None,
    opset: int = 17,
) -> bytes:
    graph = helper.make_graph(
        nodes,
        "g",
        inputs,
        outputs,
        [numpy_helper.from_array(v, k) for k, v in (initializers or {}).items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    onnx.checker.check_model(model)
    return model.SerializeToString()


def tensor(name: str, shape: list, elem: int = F) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, shape)


def node(op: str, ins: list[str], outs: list[str], **attrs) -> onnx.NodeProto:
    return helper.make_node(op, ins, outs, name=f"{op}_{outs[0]}", **attrs)


def weights(seed: int, *shapes: tuple[int, ...]) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


def gemm_chain(k: int, h: int, out: str = "y", seed: int = 1) -> tuple[list, dict]:
    """The nodes and initializers of x[N,k] -> MatMul -> Relu -> MatMul -> Add(bias) -> ``out``
    [N,k] (every node on a device that has GEMMs; the hidden width is ``h``)."""
    w1, w2, b = weights(seed, (k, h), (h, k), (k,))
    nodes = [
        node("MatMul", ["x", "w1"], ["h1"]),
        node("Relu", ["h1"], ["h2"]),
        node("MatMul", ["h2", "w2"], ["h3"]),
        node("Add", ["h3", "b"], [out]),
    ]
    return nodes, {"w1": w1, "w2": w2, "b": b}


def mlp() -> bytes:
    """x[N,4] -> MatMul -> Add -> Relu -> Tanh -> MatMul -> Reshape(shape from Shape/Gather/
    Concat of x) -> Softmax -> y[N,3], plus t = Transpose of the reshaped value.

    The virtual device claims all but Tanh (and the shape arithmetic), so values cross the
    device boundary both ways and the Reshape is a view on the device whose shape input is
    computed on the host.
    """
    w1, b1, w2 = weights(0, (4, 8), (8,), (8, 3))
    nodes = [
        node("MatMul", ["x", "w1"], ["h1"]),
        node("Add", ["h1", "b1"], ["h2"]),
        node("Relu", ["h2"], ["h3"]),
        node("Tanh", ["h3"], ["h4"]),
        node("MatMul", ["h4", "w2"], ["h5"]),
        node("Shape", ["x"], ["sx"]),
        node("Gather", ["sx", "i0"], ["n"], axis=0),
        node("Unsqueeze", ["n", "zero"], ["n1"]),
        node("Concat", ["n1", "minus1"], ["shp"], axis=0),
        node("Reshape", ["h5", "shp"], ["h6"]),
        node("Softmax", ["h6"], ["y"], axis=-1),
        node("Transpose", ["h6"], ["t"]),
    ]
    inits = {
        "w1": w1,
        "b1": b1,
        "w2": w2,
        "i0": np.array(0, np.int64),
        "zero": np.array([0], np.int64),
        "minus1": np.array([-1], np.int64),
    }
    return make_model(
        nodes, [tensor("x", ["N", 4])], [tensor("y", ["N", 3]), tensor("t", [3, "N"])], inits
    )


def chain(op: str, n: int) -> bytes:
    """x -> op -> op -> ... (n nodes) -> y, for lifetimes and memory reuse."""
    names = ["x"] + [f"v{i}" for i in range(1, n)] + ["y"]
    nodes = [node(op, [names[i]], [names[i + 1]]) for i in range(n)]
    return make_model(nodes, [tensor("x", ["N", "M"])], [tensor("y", ["N", "M"])])


def nonzero() -> bytes:
    """Data-dependent shapes: NonZero -> Transpose -> idx, and its shape s (on the host)."""
    nodes = [
        node("Relu", ["x"], ["r"]),
        node("NonZero", ["r"], ["nz"]),
        node("Transpose", ["nz"], ["idx"]),
        node("Shape", ["idx"], ["s"]),
    ]
    return make_model(
        nodes,
        [tensor("x", ["N"])],
        [tensor("idx", ["K", 1], TensorProto.INT64), tensor("s", [2], TensorProto.INT64)],
    )


def exchange() -> bytes:
    """x -> Relu -> MatMul(w) -> Add(c) -> Mul(d) -> Relu -> y, for splitting over two
    providers that hand values back and forth."""
    (w,) = weights(1, (6, 6))
    c, d = weights(2, (6,), (6,))
    nodes = [
        node("Relu", ["x"], ["a"]),
        node("MatMul", ["a", "w"], ["m"]),
        node("Add", ["m", "c"], ["p"]),
        node("Mul", ["p", "d"], ["q"]),
        node("Relu", ["q"], ["y"]),
    ]
    return make_model(
        nodes, [tensor("x", ["N", 6])], [tensor("y", ["N", 6])], {"w": w, "c": c, "d": d}
    )


def if_model() -> bytes:
    """z = Relu(If(s > 0, r * r, r + r)) with r = Relu(x): the branches read r from the outer
    graph (an implicit input) and the condition is computed on the host."""
    then = helper.make_graph([node("Mul", ["r", "r"], ["t"])], "then", [], [tensor("t", None)])
    other = helper.make_graph([node("Add", ["r", "r"], ["e"])], "else", [], [tensor("e", None)])
    nodes = [
        node("Relu", ["x"], ["r"]),
        node("Greater", ["s", "zero"], ["c"]),
        node("If", ["c"], ["y"], then_branch=then, else_branch=other),
        node("Relu", ["y"], ["z"]),
    ]
    return make_model(
        nodes,
        [tensor("x", ["N"]), tensor("s", [])],
        [tensor("z", ["N"])],
        {"zero": np.array(0, np.float32)},
    )


def loop_model() -> bytes:
    """acc <- Relu(acc) * 0.5 + r for m iterations (r = Relu(x) from the outer graph), with
    every iteration's acc stacked as a scan output."""
    body = helper.make_graph(
        [
            node("Relu", ["acc"], ["a"]),
            node("Mul", ["a", "half"], ["b"]),
            node("Add", ["b", "r"], ["acc_out"]),
            node("Mul", ["acc_out", "half"], ["scan"]),
            node("Identity", ["cond"], ["cond_out"]),
        ],
        "body",
        [
            tensor("i", [], TensorProto.INT64),
            tensor("cond", [], TensorProto.BOOL),
            tensor("acc", ["N"]),
        ],
        [tensor("cond_out", [], TensorProto.BOOL), tensor("acc_out", ["N"]), tensor("scan", ["N"])],
    )
    nodes = [
        node("Relu", ["x"], ["r"]),
        node("Loop", ["m", "", "x"], ["acc", "scans"], body=body),
    ]
    return make_model(
        nodes,
        [tensor("x", ["N"]), tensor("m", [], TensorProto.INT64)],
        [tensor("acc", ["N"]), tensor("scans", ["M", "N"])],
        {"half": np.array(0.5, np.float32)},
    )
