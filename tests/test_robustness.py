"""Bad models and bad inputs, tried as an attacker or a careless user would: nothing may crash
the process, hang, return garbage, alias the caller's memory or hold memory after a failure.
One test (or one parametrized family) per item of the robustness issue; where onnxruntime is
installed, the invalid-model catalogue is checked to be refused by it too. External-data
attacks are in ``test_external_data.py``, the fuzzer's CI sample in ``test_fuzz.py``."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import threading
import time
import tracemalloc

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxplug as ox
from onnxplug import errors
from onnxplug.framework import shapes
from onnxplug.session.value import fresh_outputs
from tests.conftest import assert_refused_at_load

CPU = ["CPUExecutionProvider"]
F = TensorProto.FLOAT
I64 = TensorProto.INT64

try:
    import onnxruntime as ort
except ImportError:  # the comparisons are skipped without it
    ort = None


def _tv(name, shape, elem=F):
    return helper.make_tensor_value_info(name, elem, shape)


def _model(nodes, inputs, outputs, inits=(), opset=18):
    g = helper.make_graph(list(nodes), "g", list(inputs), list(outputs), list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def _init(name, value):
    return numpy_helper.from_array(np.asarray(value), name)


def _session(model, **kw):
    return ox.InferenceSession(model.SerializeToString(), providers=CPU, **kw)


# ---------------------------------------------------------------------------------------------
# 1. nothing a model holds may abort the process (onnx's C++ shape inference asserts on
#    negative dims: std::clamp in Slice's inference), whether the model declares the negative
#    dim or a node's inference computes it (Pad with negative pads)

_ABORTERS = {
    "input_dims": """
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, -1])
        nodes = [helper.make_node("Slice", ["x", "st", "en", "ax"], ["y"])]
        inputs = [x]
    """,
    "constant_dims": """
        c = helper.make_tensor("c", TensorProto.FLOAT, [2, 1], [1.0, 2.0])
        c.dims[1] = -1
        nodes = [helper.make_node("Constant", [], ["x"], value=c),
                 helper.make_node("Slice", ["x", "st", "en", "ax"], ["y"])]
        inputs = []
    """,
    "computed_dims": """
        pads = numpy_helper.from_array(np.array([0, -5, 0, 0], np.int64), "pads")
        nodes = [helper.make_node("Pad", ["x", "pads"], ["p"]),
                 helper.make_node("Slice", ["p", "st", "en", "ax"], ["y"])]
        inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])]
        extra = [pads]
    """,
    "loop_body_dims": """
        body = helper.make_graph(
            [helper.make_node("Slice", ["bx", "st", "en", "ax"], ["by"]),
             helper.make_node("Identity", ["c"], ["co"])],
            "body",
            [helper.make_tensor_value_info("i", TensorProto.INT64, []),
             helper.make_tensor_value_info("c", TensorProto.BOOL, []),
             helper.make_tensor_value_info("bx", TensorProto.FLOAT, [2, -1])],
            [helper.make_tensor_value_info("co", TensorProto.BOOL, []),
             helper.make_tensor_value_info("by", TensorProto.FLOAT, None)])
        nodes = [helper.make_node("Loop", ["n", "", "x"], ["y"], body=body)]
        inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])]
    """,
}


@pytest.mark.parametrize("case", sorted(_ABORTERS))
def test_negative_dims_never_abort_the_process(case):
    script = textwrap.dedent(
        """
        import numpy as np, onnxplug
        from onnx import helper, TensorProto, numpy_helper
        CASE
        inits = [numpy_helper.from_array(np.array(v, np.int64), k)
                 for k, v in (("st", [0]), ("en", [1]), ("ax", [1]), ("n", 1))]
        inits += globals().get("extra", [])
        g = helper.make_graph(nodes, "g", inputs,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
        try:
            onnxplug.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
            print("loaded")
        except onnxplug.errors.OnnxPlugError as e:
            print("typed error", type(e).__name__)
        """
    ).replace("CASE", textwrap.dedent(_ABORTERS[case]).strip().replace("\n", "\n"))
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"process died ({r.returncode}): {r.stderr[-500:]}"
    assert r.stdout.strip() in ("loaded", "typed error InvalidGraph", "typed error Fail")


# ---------------------------------------------------------------------------------------------
# 2. cycles are found at load; terminate stops Loop and Scan


def _loop_body(reads_outer: str | None = None):
    nodes = [helper.make_node("Identity", ["c"], ["co"])]
    if reads_outer:
        nodes.append(helper.make_node("Add", ["v", reads_outer], ["vo"]))
    else:
        nodes.append(helper.make_node("Identity", ["v"], ["vo"]))
    return helper.make_graph(
        nodes,
        "body",
        [_tv("i", [], I64), _tv("c", [], TensorProto.BOOL), _tv("v", [2])],
        [_tv("co", [], TensorProto.BOOL), _tv("vo", [2])],
    )


@pytest.mark.parametrize(
    ("nodes", "pattern"),
    [
        (
            [helper.make_node("Add", ["x", "y"], ["y"], name="a")],
            "not acyclic: Add node 'a' reads its own output 'y'",
        ),
        (
            [
                helper.make_node("Loop", ["n", "", "x"], ["y"], name="loop", body=_loop_body("y")),
            ],
            "not acyclic: Loop node 'loop' reads its own output 'y' \\(through a subgraph\\)",
        ),
        (
            [
                helper.make_node(
                    "If",
                    ["c"],
                    ["y"],
                    name="if",
                    then_branch=helper.make_graph(
                        [helper.make_node("Identity", ["y"], ["t"])], "then", [], [_tv("t", [2])]
                    ),
                    else_branch=helper.make_graph(
                        [helper.make_node("Identity", ["x"], ["e"])], "else", [], [_tv("e", [2])]
                    ),
                )
            ],
            "not acyclic: If node 'if' reads its own output 'y'",
        ),
        (
            [
                helper.make_node("Add", ["x", "b"], ["a"], name="n1"),
                helper.make_node("Neg", ["a"], ["b"], name="n2"),
                helper.make_node("Identity", ["a"], ["y"], name="n3"),
            ],
            "not acyclic: (Add node 'n1' -> Neg node 'n2' -> Add node 'n1'"
            "|Neg node 'n2' -> Add node 'n1' -> Neg node 'n2')",
        ),
    ],
    ids=["self", "loop_reads_own_output", "if_reads_own_output", "two_nodes"],
)
def test_cycles_are_found_at_load(nodes, pattern):
    m = _model(
        nodes,
        [_tv("x", [2]), _tv("c", [], TensorProto.BOOL)],
        [_tv("y", [2])],
        [_init("n", np.int64(3))],
    )
    with pytest.raises(errors.InvalidGraph, match=pattern):
        _session(m)
    if ort is not None:
        with pytest.raises(Exception, match="acyclic|cycle|not (found|defined)|invalid"):
            ort.InferenceSession(m.SerializeToString(), providers=CPU)


def _terminate_soon(opts: ox.RunOptions, delay: float = 0.3) -> threading.Timer:
    def stop() -> None:
        opts.terminate = True

    t = threading.Timer(delay, stop)
    t.start()
    return t


def test_terminate_stops_a_loop_with_a_huge_trip_count():
    m = _model(
        [helper.make_node("Loop", ["n", "", "x"], ["y"], body=_loop_body())],
        [_tv("x", [2])],
        [_tv("y", [2])],
        [_init("n", np.int64(10**12))],
    )
    s = _session(m)
    opts = ox.RunOptions()
    t0 = time.monotonic()
    timer = _terminate_soon(opts)
    with pytest.raises(errors.Fail, match="terminate flag"):
        s.run(None, {"x": np.zeros(2, np.float32)}, opts)
    timer.join()
    assert time.monotonic() - t0 < 10


def test_terminate_stops_a_scan():
    body = helper.make_graph(
        [helper.make_node("Add", ["s", "e"], ["so"]), helper.make_node("Identity", ["e"], ["eo"])],
        "body",
        [_tv("s", [1]), _tv("e", [1])],
        [_tv("so", [1]), _tv("eo", [1])],
    )
    m = _model(
        [helper.make_node("Scan", ["s0", "xs"], ["s", "ys"], body=body, num_scan_inputs=1)],
        [_tv("s0", [1]), _tv("xs", [None, 1])],
        [_tv("s", [1]), _tv("ys", [None, 1])],
    )
    s = _session(m)
    feeds = {"s0": np.zeros(1, np.float32), "xs": np.ones((2_000_000, 1), np.float32)}
    opts = ox.RunOptions()
    t0 = time.monotonic()
    timer = _terminate_soon(opts)
    with pytest.raises(errors.Fail, match="terminate flag"):
        s.run(None, feeds, opts)
    timer.join()
    assert time.monotonic() - t0 < 10


# ---------------------------------------------------------------------------------------------
# 3. window attributes: checked at load and by the shared geometry every provider uses


@pytest.mark.parametrize(
    ("op", "attrs", "pattern"),
    [
        ("Conv", {"dilations": [-1, -1]}, "dilations must only contain positive values"),
        ("Conv", {"strides": [0, 1]}, "strides must only contain positive values"),
        ("Conv", {"pads": [-1, -1, 0, 0]}, "pads must not contain negative values"),
        ("Conv", {"strides": [1, 1, 1]}, "strides has incorrect size"),
        ("Conv", {"kernel_shape": [3, 0]}, "kernel_shape must only contain positive"),
        ("ConvTranspose", {"dilations": [0, 1]}, "dilations must only contain positive values"),
        ("ConvTranspose", {"pads": [0, 0, -2, 0]}, "pads must not contain negative values"),
        ("MaxPool", {"kernel_shape": [0, 2]}, "kernel_shape must only contain positive values"),
        ("MaxPool", {"kernel_shape": [2, 2], "strides": [-1, 1]}, "strides must only contain"),
        ("AveragePool", {"kernel_shape": [2, 2], "pads": [-1, 0, 0, 0]}, "pads must not contain"),
        ("MaxPool", {"kernel_shape": [2, 2], "pads": [2, 0, 0, 0]}, "smaller than kernel_shape"),
        ("LpPool", {"kernel_shape": [2, 2], "dilations": [1, -2]}, "dilations must only"),
    ],
)
def test_window_attributes_are_validated_at_load(op, attrs, pattern):
    ins = ["x", "w"] if op.startswith("Conv") else ["x"]
    m = _model(
        [helper.make_node(op, ins, ["y"], **attrs)],
        [_tv("x", [1, 1, 5, 5])],
        [_tv("y", None)],
        [_init("w", np.ones((1, 1, 3, 3), np.float32))] if op.startswith("Conv") else [],
        opset=19,
    )
    with pytest.raises(errors.Fail, match=f"{op} node .*{pattern}"):
        _session(m)
    if ort is not None:
        with pytest.raises(Exception):  # onnxruntime refuses it as well
            s = ort.InferenceSession(m.SerializeToString(), providers=CPU)
            s.run(None, {"x": np.ones((1, 1, 5, 5), np.float32)})


@pytest.mark.parametrize(
    "kw",
    [
        {"dilations": [-1, 1]},
        {"dilations": [0, 1]},
        {"strides": [1, -2]},
        {"pads": [0, -1, 0, 0]},
        {"strides": [1]},
    ],
)
def test_shared_geometry_refuses_bad_windows_for_every_provider(kw):
    with pytest.raises(ValueError, match="Attribute"):
        shapes.window_geometry([5, 5], [3, 3], **kw)
    with pytest.raises(ValueError, match="Attribute"):
        shapes.conv_transpose_geometry([5, 5], [3, 3], **kw)


def test_geometry_never_yields_an_empty_or_negative_output():
    with pytest.raises(ValueError, match="does not fit"):
        shapes.window_geometry([5, 5], [3, 3], dilations=[4, 4])
    with pytest.raises(ValueError, match="not positive"):
        shapes.conv_transpose_geometry([1, 1], [1, 1], pads=[1, 1, 1, 1])
    with pytest.raises(ValueError, match="output_padding"):
        shapes.conv_transpose_geometry([5, 5], [3, 3], output_padding=[3, 3])


# ---------------------------------------------------------------------------------------------
# 4. invalid models are refused at load, as onnxruntime refuses them


def _relu_with(mutate):
    node = helper.make_node("Relu", ["x"], ["y"], name="r")
    mutate(node)
    return _model([node], [_tv("x", [2])], [_tv("y", [2])])


def _attr(name, **fields):
    a = onnx.AttributeProto(name=name)
    for k, v in fields.items():
        setattr(a, k, v)
    return a


def _leaky_alpha_as_int(node):
    node.op_type = "LeakyRelu"
    node.attribute.append(_attr("alpha", type=onnx.AttributeProto.INT, i=1))


def _negative_init_dims():
    t = numpy_helper.from_array(np.ones(4, np.float32), "w")
    t.dims[:] = [2, -1]
    return _model(
        [helper.make_node("Add", ["x", "w"], ["y"])], [_tv("x", [2, 2])], [_tv("y", [2, 2])], [t]
    )


def _short_init():
    t = helper.make_tensor("w", F, [2], [1.0, 2.0])
    t.dims[0] = 4
    return _model(
        [helper.make_node("Add", ["x", "w"], ["y"])], [_tv("x", [4])], [_tv("y", [4])], [t]
    )


def _declared(value_type):
    m = _model(
        [helper.make_node("Relu", ["x"], ["t"], name="r"), helper.make_node("Neg", ["t"], ["y"])],
        [_tv("x", [2])],
        [_tv("y", [2])],
    )
    m.graph.value_info.append(_tv("t", [2], value_type))
    return m


def _sparse(indices, dims=(4,)):
    values = numpy_helper.from_array(np.ones(len(indices), np.float32), "w")
    idx = numpy_helper.from_array(np.asarray(indices, np.int64), "w_idx")
    sp = helper.make_sparse_tensor(values, idx, list(dims))
    g = helper.make_graph(
        [helper.make_node("Add", ["x", "w"], ["y"])],
        "g",
        [_tv("x", list(dims))],
        [_tv("y", list(dims))],
        sparse_initializer=[sp],
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


def _if(then_outputs=1, then_inputs=0, cond="c"):
    then = helper.make_graph(
        [helper.make_node("Identity", ["x"], [f"t{k}"]) for k in range(then_outputs)],
        "then",
        [_tv(f"i{k}", [2]) for k in range(then_inputs)],
        [_tv(f"t{k}", [2]) for k in range(then_outputs)],
    )
    other = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["e"])], "else", [], [_tv("e", [2])]
    )
    return _model(
        [helper.make_node("If", [cond], ["y"], name="if", then_branch=then, else_branch=other)],
        [_tv("c", [], TensorProto.BOOL), _tv("x", [2])],
        [_tv("y", [2])],
    )


def _loop(carried_type=F, drop_body_output=False):
    body = _loop_body()
    if drop_body_output:
        del body.output[-1]
    return _model(
        [helper.make_node("Loop", ["n", "", "x"], ["y"], name="loop", body=body)],
        [_tv("x", [2], carried_type)],
        [onnx.ValueInfoProto(name="y")],
        [_init("n", np.int64(2))],
    )


def _scan(num_scan_inputs):
    body = helper.make_graph(
        [helper.make_node("Add", ["s", "e"], ["so"]), helper.make_node("Identity", ["e"], ["eo"])],
        "body",
        [_tv("s", [1]), _tv("e", [1])],
        [_tv("so", [1]), _tv("eo", [1])],
    )
    node = helper.make_node(
        "Scan", ["s0", "xs"], ["s", "ys"], name="scan", body=body, num_scan_inputs=num_scan_inputs
    )
    return _model([node], [_tv("s0", [1]), _tv("xs", [3, 1])], [_tv("s", [1]), _tv("ys", None)])


_INVALID = {
    "if_branch_output_count": (
        lambda: _if(then_outputs=2),
        errors.InvalidGraph,
        "If node 'if': then_branch gives 2 outputs for the node's 1",
    ),
    "if_branch_with_inputs": (
        lambda: _if(then_inputs=1),
        errors.InvalidGraph,
        "then_branch must take no inputs",
    ),
    "required_input_missing": (
        lambda: _if(cond=""),
        errors.InvalidGraph,
        "If node 'if': required input 0 \\('cond'\\) is missing",
    ),
    "loop_body_arity": (
        lambda: _loop(drop_body_output=True),
        errors.InvalidGraph,
        "Loop node 'loop': its body takes 3 inputs and gives 1 outputs",
    ),
    "loop_carried_type": (
        lambda: _loop(carried_type=TensorProto.DOUBLE),
        errors.Fail,
        "Loop node 'loop' passes 'x' of type tensor\\(double\\) to body input 'v'",
    ),
    "scan_num_scan_inputs": (
        lambda: _scan(-1),
        errors.InvalidGraph,
        "Scan node 'scan': num_scan_inputs -1 must be in \\[1, 2\\]",
    ),
    "inference_refuses_the_node": (
        # Cast-13 (opset 18) has no float8e8m0 target: onnx's inference of the node says so
        lambda: _model(
            [
                helper.make_node("Cast", ["x"], ["c"], to=TensorProto.FLOAT8E8M0, name="c"),
                helper.make_node("Cast", ["c"], ["y"], to=F),
            ],
            [_tv("x", [2])],
            [_tv("y", [2])],
        ),
        errors.Fail,
        "Cast node 'c': output has unsupported type tensor\\(float8e8m0\\)",
    ),
    "conv_ranks_disagree": (
        lambda: _model(
            [helper.make_node("Conv", ["x", "w"], ["y"], name="c")],
            [_tv("x", [1, 1, 5, 5, 5])],
            [_tv("y", None)],
            [_init("w", np.ones((1, 1, 3, 3), np.float32))],
        ),
        errors.Fail,
        "Conv node 'c': input X has rank 5 but the weights W have rank 4",
    ),
    "unknown_attribute": (
        lambda: _relu_with(lambda n: n.attribute.append(_attr("padz", type=2, i=1))),
        errors.InvalidGraph,
        "Relu node 'r': unrecognized attribute 'padz'",
    ),
    "attribute_type_tag": (
        lambda: _relu_with(_leaky_alpha_as_int),
        errors.InvalidGraph,
        "attribute 'alpha' has type INT, the schema of LeakyRelu-16 wants FLOAT",
    ),
    "untyped_attribute": (
        lambda: _relu_with(lambda n: n.attribute.append(_attr("foo", i=1))),
        errors.InvalidGraph,
        "unrecognized attribute 'foo'",
    ),
    "missing_required_attribute": (
        lambda: _model([helper.make_node("Cast", ["x"], ["y"], name="c")], [_tv("x", [2])], []),
        errors.InvalidGraph,
        "Cast node 'c': required attribute 'to' is missing",
    ),
    "extra_input": (
        lambda: _relu_with(lambda n: n.input.append("x")),
        errors.InvalidGraph,
        "Relu node 'r': has 2 inputs; Relu-14 takes exactly 1",
    ),
    "extra_output": (
        lambda: _relu_with(lambda n: n.output.append("z")),
        errors.InvalidGraph,
        "has 2 outputs; Relu-14 gives exactly 1",
    ),
    "input_elem_type_999": (
        lambda: _model([helper.make_node("Relu", ["x"], ["y"])], [_tv("x", [2], 999)], []),
        errors.InvalidArgument,
        "input 'x' of graph: invalid tensor element type 999",
    ),
    "output_elem_type_999": (
        lambda: _model(
            [helper.make_node("Relu", ["x"], ["y"])], [_tv("x", [2])], [_tv("y", [2], 999)]
        ),
        errors.InvalidArgument,
        "output 'y' of graph: invalid tensor element type 999",
    ),
    "initializer_elem_type_999": (
        lambda: _model(
            [helper.make_node("Identity", ["w"], ["y"])],
            [],
            [_tv("y", None)],
            [onnx.TensorProto(name="w", data_type=999, dims=[1], raw_data=b"\0" * 4)],
        ),
        errors.InvalidGraph,
        "initializer 'w' of graph: tensor does not have a valid data type",
    ),
    "cast_to_999": (
        lambda: _model(
            [helper.make_node("Cast", ["x"], ["y"], to=999, name="c")], [_tv("x", [2])], []
        ),
        errors.Fail,
        "Cast node 'c': attribute 'to' \\(999\\) does not specify a valid type",
    ),
    "declared_output_type": (
        lambda: _model(
            [helper.make_node("Relu", ["x"], ["y"], name="r")],
            [_tv("x", [2])],
            [_tv("y", [2], I64)],
        ),
        errors.Fail,
        "Type \\(tensor\\(int64\\)\\) of output arg \\(y\\) of Relu node 'r' does not match "
        "expected type \\(tensor\\(float\\)\\)",
    ),
    "declared_value_info_type": (
        lambda: _declared(I64),
        errors.Fail,
        "output arg \\(t\\) of Relu node 'r'",
    ),
    "type_constraint_binding": (
        lambda: _model(
            [helper.make_node("Add", ["x", "w"], ["y"], name="a")],
            [_tv("x", [2])],
            [_tv("y", [2])],
            [_init("w", np.ones(2))],
        ),
        errors.Fail,
        "Type parameter \\(T\\) of Optype \\(Add\\) bound to different types \\(tensor\\(float\\)"
        " for 'x' and tensor\\(double\\) for 'w'\\) in Add node 'a'",
    ),
    "type_not_allowed": (
        lambda: _model(
            [helper.make_node("Relu", ["x"], ["y"], name="r")],
            [_tv("x", [2], TensorProto.BOOL)],
            [],
        ),
        errors.Fail,
        "Type 'tensor\\(bool\\)' of input 0 'x' of Relu node 'r' is invalid",
    ),
    "negative_initializer_dims": (
        _negative_init_dims,
        errors.InvalidGraph,
        "initializer 'w' of graph: tensor dims \\[2, -1\\] contain a negative dimension",
    ),
    "initializer_data_short": (
        _short_init,
        errors.InvalidGraph,
        "initializer 'w' of graph: tensor of dims \\[4\\] needs 4 values but holds 2",
    ),
    "input_shadows_initializer_type": (
        lambda: _model(
            [helper.make_node("Add", ["x", "w"], ["y"])],
            [_tv("x", [2]), _tv("w", [2], I64)],
            [_tv("y", [2])],
            [_init("w", np.ones(2, np.float32))],
        ),
        errors.Fail,
        "initializer 'w' has element type tensor\\(float\\) but the graph input",
    ),
    "input_shadows_initializer_shape": (
        lambda: _model(
            [helper.make_node("Add", ["x", "w"], ["y"])],
            [_tv("x", [2]), _tv("w", [3])],
            [_tv("y", [2])],
            [_init("w", np.ones(2, np.float32))],
        ),
        errors.Fail,
        "Shape of initializer 'w' \\[2\\] does not match the graph input",
    ),
    "sparse_index_out_of_range": (
        lambda: _sparse([1, 9]),
        errors.InvalidGraph,
        "sparse initializer 'w' of graph: sparse indices out of range for dims \\[4\\]",
    ),
    "sparse_indices_shape": (
        lambda: _sparse([[0, 1]]),
        errors.InvalidGraph,
        "sparse indices have dims",
    ),
}


@pytest.mark.parametrize("case", sorted(_INVALID))
def test_invalid_models_are_refused_at_load(case):
    build, error, pattern = _INVALID[case]
    assert_refused_at_load(build(), error, pattern)


def test_non_utf8_names_are_a_typed_error():
    m = _model([helper.make_node("Relu", ["x"], ["y"])], [_tv("x", [2])], [_tv("y", [2])])
    m.graph.name = "GNAME"
    data = m.SerializeToString().replace(b"GNAME", b"G\xff\xfeME")
    with pytest.raises(errors.InvalidProtobuf, match="model.graph.name is not valid UTF-8"):
        ox.InferenceSession(data, providers=CPU)


def _seq_model(op, position, extra=()):
    nodes = [helper.make_node("SequenceConstruct", ["x", "x"], ["s"])]
    if op == "SequenceAt":
        nodes.append(helper.make_node(op, ["s", "p"], ["y"]))
    else:
        nodes += [
            helper.make_node(op, ["s", *extra, "p"], ["s2"]),
            helper.make_node("SequenceLength", ["s2"], ["y"]),
        ]
    return _model(
        nodes, [_tv("x", [2])], [onnx.ValueInfoProto(name="y")], [_init("p", np.int64(position))]
    )


@pytest.mark.parametrize(
    ("op", "position", "extra"),
    [
        ("SequenceAt", 2, ()),
        ("SequenceAt", -3, ()),
        ("SequenceErase", 2, ()),
        ("SequenceErase", -3, ()),
        ("SequenceInsert", 3, ("x",)),
        ("SequenceInsert", -3, ("x",)),
    ],
)
def test_sequence_positions_out_of_range(op, position, extra):
    s = _session(_seq_model(op, position, extra))
    feeds = {"x": np.ones(2, np.float32)}
    with pytest.raises(errors.InvalidArgument, match=f"Invalid sequence index \\({position}\\)"):
        s.run(None, feeds)
    if ort is not None:
        o = ort.InferenceSession(_seq_model(op, position, extra).SerializeToString(), providers=CPU)
        with pytest.raises(Exception, match="Invalid sequence index"):
            o.run(None, feeds)


@pytest.mark.parametrize(
    ("op", "position", "extra", "want"),
    [
        ("SequenceAt", -2, (), None),
        ("SequenceErase", -2, (), 1),
        ("SequenceInsert", 2, ("x",), 3),
        ("SequenceInsert", -2, ("x",), 3),
    ],
)
def test_sequence_positions_in_range(op, position, extra, want):
    out = _session(_seq_model(op, position, extra)).run(None, {"x": np.ones(2, np.float32)})[0]
    if want is not None:
        assert int(out) == want


def test_negative_pads_never_crop_below_empty():
    m = _model(
        [helper.make_node("Pad", ["x", "p"], ["y"])],
        [_tv("x", [2, 2])],
        [_tv("y", None)],
        [_init("p", np.array([-3, 0, 0, 0], np.int64))],
    )
    with pytest.raises(errors.Fail, match="Pad: pads .* crop dim 0 of input \\[2, 2\\] to -1"):
        _session(m).run(None, {"x": np.ones((2, 2), np.float32)})
    cropped = _model(
        [helper.make_node("Pad", ["x", "p"], ["y"])],
        [_tv("x", [2, 2])],
        [_tv("y", None)],
        [_init("p", np.array([-2, 0, 0, 0], np.int64))],
    )
    assert _session(cropped).run(None, {"x": np.ones((2, 2), np.float32)})[0].shape == (0, 2)


# ---------------------------------------------------------------------------------------------
# 6. outputs never alias the caller's inputs, each other or the session's constants

_SHAPE = helper.make_tensor("shape", I64, [2], [3, 2])
_AXES = helper.make_tensor("axes", I64, [1], [0])


@pytest.mark.parametrize(
    ("nodes", "outputs"),
    [
        ([helper.make_node("Identity", ["x"], ["y"])], ["y"]),
        ([helper.make_node("Reshape", ["x", "shape"], ["y"])], ["y"]),
        ([helper.make_node("Flatten", ["x"], ["y"])], ["y"]),
        ([helper.make_node("Unsqueeze", ["x", "axes"], ["y"])], ["y"]),
        (
            [
                helper.make_node("Unsqueeze", ["x", "axes"], ["u"]),
                helper.make_node("Squeeze", ["u", "axes"], ["y"]),
            ],
            ["y"],
        ),
        (
            [
                helper.make_node("Identity", ["x"], ["y"]),
                helper.make_node("Identity", ["x"], ["z"]),
            ],
            ["y", "z"],
        ),
    ],
    ids=["Identity", "Reshape", "Flatten", "Unsqueeze", "Squeeze", "two_outputs"],
)
@pytest.mark.parametrize("level", [0, 99])
def test_outputs_do_not_alias_inputs(nodes, outputs, level):
    m = _model(nodes, [_tv("x", [2, 3])], [_tv(o, None) for o in outputs], [_SHAPE, _AXES])
    opts = ox.SessionOptions()
    opts.graph_optimization_level = ox.GraphOptimizationLevel(level)
    s = _session(m, sess_options=opts)
    x = np.zeros((2, 3), np.float32)
    outs = s.run(None, {"x": x})
    outs[0][...] = 7
    assert not x.any(), "writing an output changed the caller's input"
    for other in outs[1:]:
        assert not other.any(), "two outputs share memory"
    assert not s.run(None, {"x": np.zeros((2, 3), np.float32)})[0].any()


@pytest.mark.parametrize("level", [0, 99])
def test_outputs_do_not_alias_initializers(level):
    m = _model(
        [helper.make_node("Reshape", ["w", "shape"], ["y"])],
        [],
        [_tv("y", None)],
        [_init("w", np.zeros((2, 3), np.float32)), _SHAPE],
    )
    opts = ox.SessionOptions()
    opts.graph_optimization_level = ox.GraphOptimizationLevel(level)
    s = _session(m, sess_options=opts)
    s.run(None, {})[0][...] = 7
    assert not s.run(None, {})[0].any(), "writing an output changed the model's weights"


def test_fresh_outputs_copy_only_what_is_shared():
    x = np.zeros(4)
    fresh = np.ones(4)
    view_of_fresh = fresh[:2]
    constant = np.ones(2)
    constant.flags.writeable = False
    outs = fresh_outputs([fresh, x.reshape(2, 2), view_of_fresh, constant, [x[:1]]], [x])
    assert outs[0] is fresh  # already fresh: no copy
    assert not np.shares_memory(outs[1], x)
    assert not np.shares_memory(outs[2], fresh)
    assert outs[3].flags.writeable and outs[3] is not constant
    assert not np.shares_memory(outs[4][0], x)


# ---------------------------------------------------------------------------------------------
# 7. a failed run releases its memory at once (no exception -> traceback -> frame cycle)


def test_failed_runs_release_their_intermediates_without_gc():
    m = _model(
        [
            helper.make_node("Tile", ["x", "r"], ["big"]),  # 64 MB
            helper.make_node("Relu", ["big"], ["b2"]),
            helper.make_node("Reshape", ["b2", "s"], ["y"]),  # fails: bad shape
        ],
        [_tv("x", [1024]), _tv("s", [1], I64)],
        [_tv("y", None)],
        [_init("r", np.array([16384], np.int64))],
    )
    s = _session(m)
    feeds = {"x": np.ones(1024, np.float32), "s": np.array([7], np.int64)}
    for _ in range(2):  # warm up (the first run records the plan)
        with pytest.raises(errors.Fail, match="Reshape"):
            s.run(None, feeds)
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    tracemalloc.start()
    try:
        for _ in range(8):
            with pytest.raises(errors.Fail):
                s.run(None, feeds)
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
        if enabled:
            gc.enable()
    assert held < 16 * 2**20, f"{held / 2**20:.0f} MB still held after 8 failed runs"


# ---------------------------------------------------------------------------------------------
# 8. constant folding has a size budget, checked before computing


def test_constant_folding_leaves_huge_results_to_run_time():
    m = _model(
        [
            helper.make_node("Expand", ["c", "shape"], ["big"]),  # 8 GB of float32
            helper.make_node("ReduceSum", ["big"], ["y"], keepdims=0),
        ],
        [],
        [_tv("y", None)],
        [_init("c", np.ones(1, np.float32)), _init("shape", np.array([2, 2**30], np.int64))],
    )
    tracemalloc.start()
    try:
        t0 = time.monotonic()
        s = _session(m)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.monotonic() - t0 < 10
    assert peak < 256 * 2**20, f"session creation peaked at {peak / 2**20:.0f} MB"
    assert any(op == "Expand" for _, _, op, _ in s._assignment)  # left to run time


def test_constant_folding_still_folds_small_results():
    m = _model(
        [
            helper.make_node("Expand", ["c", "shape"], ["e"]),
            helper.make_node("Add", ["x", "e"], ["y"]),
        ],
        [_tv("x", [2, 3])],
        [_tv("y", [2, 3])],
        [_init("c", np.ones(1, np.float32)), _init("shape", np.array([2, 3], np.int64))],
    )
    s = _session(m)
    assert [op for _, _, op, _ in s._assignment] == ["Add"]
    np.testing.assert_array_equal(s.run(None, {"x": np.zeros((2, 3), np.float32)})[0], 1)


# ---------------------------------------------------------------------------------------------
# 9. session creation raises typed errors only


def test_unexpected_errors_during_load_are_typed(monkeypatch):
    import onnxplug.session.inference_session as isess

    def broken(*a, **k):
        raise IndexError("list index out of range")

    monkeypatch.setattr(isess, "optimize", broken)
    m = _model([helper.make_node("Relu", ["x"], ["y"])], [_tv("x", [2])], [_tv("y", [2])])
    with pytest.raises(
        errors.Fail, match="unexpected error while optimizing the graph: IndexError"
    ):
        _session(m)


@pytest.mark.parametrize("level", [0, 99])
def test_kernels_do_not_precompute_huge_constants(level):
    """A ConstantOfShape of a constant 24 GiB shape is the run's to allocate (or to refuse),
    not the session's: the kernel caches only small constant results (found by the fuzzer)."""
    m = _model(
        [helper.make_node("ConstantOfShape", ["shape"], ["y"])],
        [],
        [_tv("y", None)],
        [_init("shape", np.array([2**31 - 1, 3], np.int64))],
    )
    opts = ox.SessionOptions()
    opts.graph_optimization_level = ox.GraphOptimizationLevel(level)
    tracemalloc.start()
    try:
        _session(m, sess_options=opts)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 256 * 2**20, f"session creation peaked at {peak / 2**20:.0f} MB"


# ---------------------------------------------------------------------------------------------
# 10. concurrent runs of one CPU session: identical results, and they take turns (run at once,
#     threads handing the interpreter lock around at every numpy call cost 4x the CPU per run)


def _demo_session(**config):
    from pathlib import Path

    opts = ox.SessionOptions()
    for k, v in config.items():
        opts.add_session_config_entry(k, v)
    path = Path(ox.__file__).parent / "data" / "demo.onnx"
    return ox.InferenceSession(str(path), opts, providers=CPU)


def _max_overlap(sess, threads=6, runs=20) -> tuple[int, bool]:
    inp = sess.get_inputs()[0]
    x = np.random.default_rng(0).standard_normal((8, 1, 8, 8)).astype(np.float32)
    ref = sess.run(None, {inp.name: x})[0]
    inner = sess._runner.run
    active, peak, lock = [0], [0], threading.Lock()

    def watched(*a, **k):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        try:
            time.sleep(0.002)  # room for another thread to come in
            return inner(*a, **k)
        finally:
            with lock:
                active[0] -= 1

    sess._runner.run = watched
    same = [True]

    def work():
        for _ in range(runs):
            if not np.array_equal(sess.run(None, {inp.name: x})[0], ref):
                same[0] = False

    ts = [threading.Thread(target=work) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return peak[0], same[0]


def test_concurrent_runs_of_a_cpu_session_take_turns_and_agree():
    peak, same = _max_overlap(_demo_session())
    assert same, "a concurrent run returned a different result"
    assert peak == 1


def test_taking_turns_can_be_turned_off():
    peak, same = _max_overlap(_demo_session(**{"session.serialize_cpu_runs": "0"}))
    assert same
    assert peak > 1


def test_sessions_with_a_device_provider_still_run_concurrently(virt):
    from pathlib import Path

    from tests.plugins import virtual_device as vd

    path = Path(ox.__file__).parent / "data" / "demo.onnx"
    sess = ox.InferenceSession(str(path), providers=[vd.NAME, "CPUExecutionProvider"])
    peak, same = _max_overlap(sess)
    assert same
    assert peak > 1


@pytest.mark.parametrize("shape", [[2], [1, 2], [0]])
def test_if_condition_must_have_one_element(shape):
    """Found by the fuzzer: the first of several condition values chose the branch."""
    m = _if()
    m.graph.input[0].CopyFrom(_tv("c", shape, TensorProto.BOOL))
    s = _session(m)
    feeds = {"c": np.ones(shape, bool), "x": np.ones(2, np.float32)}
    with pytest.raises(errors.InvalidArgument, match="condition must have exactly one element"):
        s.run(None, feeds)
    if ort is not None:
        with pytest.raises(Exception, match="one element|condition"):
            ort.InferenceSession(m.SerializeToString(), providers=CPU).run(None, feeds)
