"""Errors are typed (onnxplug.errors, also importable from onnxruntime's path), name what they
are about (input, node, option, provider) and leave the session usable."""

from __future__ import annotations

import importlib

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxplug as ox
from onnxplug import errors

CPU = ["CPUExecutionProvider"]
F = TensorProto.FLOAT


def _tv(name, shape, elem=F):
    return helper.make_tensor_value_info(name, elem, shape)


def _model(nodes, inputs, outputs, inits=(), opset=17, domains=()):
    g = helper.make_graph(list(nodes), "g", list(inputs), list(outputs), list(inits))
    imports = [helper.make_opsetid("", opset)] + [helper.make_opsetid(d, 1) for d in domains]
    m = helper.make_model(g, opset_imports=imports)
    m.ir_version = 8
    return m


def _load(model):
    data = model.SerializeToString() if isinstance(model, onnx.ModelProto) else model
    return ox.InferenceSession(data, providers=CPU)


# the classes --------------------------------------------------------------------------------


def test_error_classes_are_importable_where_onnxruntime_has_them():
    state = importlib.import_module("onnxplug.capi.onnxruntime_pybind11_state")
    ort_state = pytest.importorskip("onnxruntime.capi.onnxruntime_pybind11_state")
    ort_names = {
        n
        for n in dir(ort_state)
        if isinstance(getattr(ort_state, n), type) and issubclass(getattr(ort_state, n), Exception)
    }
    assert "InvalidArgument" in ort_names
    for name in ort_names:
        cls = getattr(state, name)
        assert cls is getattr(errors, name)
        assert issubclass(cls, errors.OnnxPlugError), name
    # status names and codes are onnxruntime's OrtErrorCode values
    classes = [getattr(errors, n) for n in ort_names]
    codes = {c.status: c.code for c in classes}
    assert codes["FAIL"] == 1 and codes["INVALID_ARGUMENT"] == 2 and codes["EP_FAIL"] == 11
    assert codes["NOT_FOUND"] == 14 and len(set(codes.values())) == len(codes)
    # built-in bases so that generic handlers catch them too
    assert issubclass(errors.InvalidArgument, ValueError)
    assert issubclass(errors.NoSuchFile, FileNotFoundError)
    assert issubclass(errors.NotImplemented, NotImplementedError)
    e = errors.InvalidGraph("what went wrong")
    assert str(e) == "[ONNXPlugError] : 10 : INVALID_GRAPH : what went wrong"
    assert e.message == "what went wrong"


# inputs -------------------------------------------------------------------------------------


@pytest.fixture
def relu():
    return _load(
        _model([helper.make_node("Relu", ["X"], ["Y"])], [_tv("X", ["N", 3])], [_tv("Y", ["N", 3])])
    )


def _ort_message(feeds):
    ort = pytest.importorskip("onnxruntime")
    m = _model([helper.make_node("Relu", ["X"], ["Y"])], [_tv("X", ["N", 3])], [_tv("Y", ["N", 3])])
    s = ort.InferenceSession(m.SerializeToString(), providers=CPU)
    with pytest.raises(Exception) as info:
        s.run(None, feeds)
    return str(info.value)


@pytest.mark.parametrize(
    ("feeds", "pattern", "ort_says"),
    [
        ({"Q": np.zeros((1, 3), np.float32)}, "Invalid input name: Q", None),
        ({}, r"Required inputs \(\['X'\]\) are missing", "Required inputs (['X']) are missing"),
        (
            {"X": np.zeros((1, 3), np.float64)},
            r"Unexpected input data type\. Actual: \(tensor\(double\)\) , expected: "
            r"\(tensor\(float\)\) for input 'X'",
            "Unexpected input data type. Actual: (tensor(double)) , expected: (tensor(float))",
        ),
        (
            {"X": np.zeros(3, np.float32)},
            "Invalid rank for input: X Got: 1 Expected: 2",
            "Invalid rank for input: X Got: 1 Expected: 2",
        ),
        (
            {"X": np.zeros((2, 4), np.float32)},
            "(?s)Got invalid dimensions for input: X .*index: 1 Got: 4 Expected: 3",
            "Got invalid dimensions for input: X for the following indices\n index: 1 Got: 4",
        ),
        ({"X": object()}, "input 'X' must be a numpy array", None),
        ({"X": None}, "input 'X' is None", None),
    ],
    ids=["wrong-name", "missing", "wrong-dtype", "wrong-rank", "wrong-dim", "not-array", "none"],
)
def test_input_errors_name_the_input(relu, feeds, pattern, ort_says):
    with pytest.raises(errors.InvalidArgument, match=pattern):
        relu.run(None, feeds)
    if ort_says is not None:  # the same words as onnxruntime, where it says something
        assert ort_says in _ort_message(feeds)
    # and the session still runs
    (y,) = relu.run(None, {"X": np.array([[-1, 0, 2]], np.float32)})
    np.testing.assert_array_equal(y, [[0, 0, 2]])


def test_feed_must_be_a_dict(relu):
    with pytest.raises(errors.InvalidArgument, match="input_feed must be a dict"):
        relu.run(None, [np.zeros((1, 3), np.float32)])


def test_wrong_output_name(relu):
    with pytest.raises(errors.InvalidArgument, match=r"Invalid output name: Q.*\['Y'\]"):
        relu.run(["Q"], {"X": np.zeros((1, 3), np.float32)})


# malformed model files ----------------------------------------------------------------------


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(errors.NoSuchFile, match="nope.onnx.*doesn't exist"):
        ox.InferenceSession(str(tmp_path / "nope.onnx"), providers=CPU)
    with pytest.raises(errors.InvalidArgument, match="is a directory"):
        ox.InferenceSession(str(tmp_path), providers=CPU)
    with pytest.raises(errors.InvalidArgument, match="path, bytes or onnx.ModelProto"):
        ox.InferenceSession(12345, providers=CPU)


def test_garbage_and_empty_bytes(tmp_path):
    garbage = np.random.default_rng(0).integers(0, 256, 500, dtype=np.uint8).tobytes()
    path = tmp_path / "garbage.onnx"
    path.write_bytes(garbage)
    with pytest.raises(errors.InvalidProtobuf, match="garbage.onnx failed"):
        ox.InferenceSession(str(path), providers=CPU)
    with pytest.raises(errors.InvalidProtobuf, match="<bytes>"):
        ox.InferenceSession(garbage, providers=CPU)
    with pytest.raises(errors.InvalidProtobuf, match="not an ONNX model"):
        ox.InferenceSession(b"", providers=CPU)


def test_every_truncation_of_a_model_is_a_typed_error(tmp_path):
    m = _model(
        [helper.make_node("Add", ["X", "W"], ["S"]), helper.make_node("Relu", ["S"], ["Y"])],
        [_tv("X", [2, 3])],
        [_tv("Y", [2, 3])],
        [numpy_helper.from_array(np.ones(3, np.float32), "W")],
    )
    data = m.SerializeToString()
    kinds = set()
    for n in range(len(data)):
        with pytest.raises((errors.InvalidProtobuf, errors.InvalidGraph)) as info:
            ox.InferenceSession(data[:n], providers=CPU)
        kinds.add(type(info.value))
    assert errors.InvalidProtobuf in kinds
    path = tmp_path / "cut.onnx"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(errors.InvalidProtobuf, match="cut.onnx failed: Protobuf parsing failed"):
        ox.InferenceSession(str(path), providers=CPU)


# invalid graphs -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("nodes", "pattern"),
    [
        (
            [helper.make_node("Relu", ["Q"], ["Y"], name="r")],
            "Relu node 'r' input 0 'Q' is not a graph input, an initializer or the output",
        ),
        (
            [
                helper.make_node("Add", ["X", "B"], ["A"], name="a"),
                helper.make_node("Relu", ["A"], ["B"], name="b"),
                helper.make_node("Relu", ["A"], ["Y"], name="c"),
            ],
            "not acyclic: Add node .a. -> Relu node .b. -> Add node .a.",
        ),
        (
            [
                helper.make_node("Relu", ["X"], ["Y"], name="first"),
                helper.make_node("Neg", ["X"], ["Y"], name="second"),
            ],
            "value 'Y' is defined twice.*'first'.*'second'",
        ),
        (
            [
                helper.make_node("Relu", ["X"], ["X"], name="r"),
                helper.make_node("Neg", ["X"], ["Y"]),
            ],
            "value 'X' is defined twice .*graph input",
        ),
        ([helper.make_node("Relu", ["X"], ["Z"])], "output 'Y' is not produced"),
        (
            [helper.make_node("Reluu", ["X"], ["Y"], name="typo")],
            "Reluu node 'typo': no op Reluu is registered in domain 'ai.onnx' at version 17",
        ),
        (
            [helper.make_node("Foo", ["X"], ["Y"], domain="com.example", name="f")],
            "Foo node 'f' uses domain 'com.example', which the model does not import",
        ),
        (
            [helper.make_node("Upsample", ["X", "sc"], ["Y"], name="u")],
            "Upsample node 'u': op Upsample is deprecated",
        ),
    ],
    ids=[
        "undefined-input",
        "cycle",
        "duplicate-output",
        "redefines-input",
        "output-not-produced",
        "unknown-op",
        "unimported-domain",
        "deprecated-op",
    ],
)
def test_invalid_graphs(nodes, pattern):
    inits = [numpy_helper.from_array(np.ones(2, np.float32), "sc")]
    m = _model(nodes, [_tv("X", [2, 3])], [_tv("Y", [2, 3])], inits)
    with pytest.raises(errors.InvalidGraph, match=pattern):
        _load(m)


def test_invalid_subgraph_is_reported():
    bad_branch = helper.make_graph(
        [helper.make_node("Relu", ["nowhere"], ["v"], name="inner")], "b", [], [_tv("v", [3])]
    )
    ok_branch = helper.make_graph([helper.make_node("Neg", ["X"], ["v"])], "o", [], [_tv("v", [3])])
    m = _model(
        [helper.make_node("If", ["c"], ["Y"], then_branch=bad_branch, else_branch=ok_branch)],
        [_tv("c", [], TensorProto.BOOL), _tv("X", [3])],
        [_tv("Y", [3])],
    )
    with pytest.raises(
        errors.InvalidGraph,
        match="'inner' in the attribute 'then_branch' of If node 'If_0': input 0 'nowhere'",
    ):
        _load(m)


def test_no_default_opset():
    g = helper.make_graph(
        [helper.make_node("Relu", ["X"], ["Y"])], "g", [_tv("X", [2])], [_tv("Y", [2])]
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("com.example", 1)])
    with pytest.raises(errors.InvalidGraph, match="imports no default"):
        _load(m)


# providers and kernels ------------------------------------------------------------------------


def test_unknown_provider_is_named():
    m = _model([helper.make_node("Relu", ["X"], ["Y"])], [_tv("X", [2])], [_tv("Y", [2])])
    # as onnxruntime: a warning naming it, and the session runs on the CPU
    with pytest.warns(UserWarning, match="Unknown execution provider 'FooExecutionProvider'"):
        sess = ox.InferenceSession(m.SerializeToString(), providers=["FooExecutionProvider"])
    assert sess.get_providers() == CPU
    # strictly, an error naming it and what is available
    so = ox.SessionOptions()
    so.add_session_config_entry("session.strict_providers", "1")
    with pytest.raises(
        errors.InvalidArgument,
        match="Unknown execution provider 'FooExecutionProvider'.*CPUExecutionProvider",
    ):
        ox.InferenceSession(m.SerializeToString(), so, providers=["FooExecutionProvider"])
    with pytest.raises(errors.InvalidArgument, match="must be a name or"):
        ox.InferenceSession(m.SerializeToString(), providers=[42])


def test_op_no_provider_implements():
    # a custom-domain op the model imports but no provider registers a kernel for
    m = _model(
        [helper.make_node("MyOp", ["X"], ["Y"], domain="com.example", name="mine")],
        [_tv("X", [2])],
        [_tv("Y", [2])],
        domains=["com.example"],
    )
    with pytest.raises(
        errors.NotImplemented,
        match=r"MyOp\(1\) node with name 'mine'.*com\.example.*CPUExecutionProvider",
    ):
        _load(m)
    # a training op of an onnx domain: no kernel, no function body
    g = helper.make_graph(
        [
            helper.make_node(
                "Gradient",
                ["X", "Z"],
                ["dX"],
                xs=["X"],
                y="Z",
                domain="ai.onnx.preview.training",
                name="grad",
            )
        ],
        "g",
        [_tv("X", [2]), _tv("Z", [2])],
        [_tv("dX", [2])],
    )
    m = helper.make_model(
        g,
        opset_imports=[
            helper.make_opsetid("", 17),
            helper.make_opsetid("ai.onnx.preview.training", 1),
        ],
    )
    with pytest.raises(NotImplementedError, match="Gradient.*'grad'"):
        _load(m)


# run errors ---------------------------------------------------------------------------------


def _reshape_session():
    m = _model(
        [helper.make_node("Reshape", ["X", "S"], ["Y"], name="my_reshape")],
        [_tv("X", [None]), _tv("S", [None], TensorProto.INT64)],
        [_tv("Y", None)],
    )
    return _load(m)


def test_kernel_error_names_the_node_and_session_recovers():
    s = _reshape_session()
    x = np.arange(6, dtype=np.float32)
    # the first run of a shape signature (which records the memory plan) and later runs
    for bad in ([4, 4], [5, 5], [4, 4]):
        with pytest.raises(errors.Fail, match="Reshape node. Name:'my_reshape'"):
            s.run(None, {"X": x, "S": np.array(bad)})
        (y,) = s.run(None, {"X": x, "S": np.array([2, 3])})
        np.testing.assert_array_equal(y, x.reshape(2, 3))
    (y,) = s.run(None, {"X": x, "S": np.array([3, 2])})
    assert y.shape == (3, 2)


def test_error_inside_a_loop_body_names_the_inner_node():
    body = helper.make_graph(
        [
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
            helper.make_node("Reshape", ["acc_in", "shape"], ["acc_out"], name="body_reshape"),
        ],
        "body",
        [
            _tv("i", [], TensorProto.INT64),
            _tv("cond_in", [], TensorProto.BOOL),
            _tv("acc_in", None),
        ],
        [_tv("cond_out", [], TensorProto.BOOL), _tv("acc_out", None)],
    )
    m = _model(
        [helper.make_node("Loop", ["n", "", "X"], ["Y"], body=body, name="loop")],
        [
            _tv("n", [], TensorProto.INT64),
            _tv("X", [None]),
            _tv("shape", [None], TensorProto.INT64),
        ],
        [_tv("Y", None)],
    )
    s = _load(m)
    x = np.arange(6, dtype=np.float32)
    with pytest.raises(errors.Fail, match="Name:'body_reshape'"):
        s.run(None, {"n": np.array(2), "X": x, "shape": np.array([4])})
    (y,) = s.run(None, {"n": np.array(2), "X": x, "shape": np.array([3, 2])})
    np.testing.assert_array_equal(y, x.reshape(3, 2))


def test_iobinding_recovers_after_an_error():
    s = _reshape_session()
    b = s.io_binding()
    x = np.arange(6, dtype=np.float32)
    b.bind_cpu_input("X", x)
    b.bind_cpu_input("S", np.array([7]))
    b.bind_output("Y")
    with pytest.raises(errors.Fail, match="my_reshape"):
        s.run_with_iobinding(b)
    b.bind_cpu_input("S", np.array([3, 2]))
    s.run_with_iobinding(b)
    np.testing.assert_array_equal(b.copy_outputs_to_cpu()[0], x.reshape(3, 2))
