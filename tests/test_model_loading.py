"""Model loading: external data (and its path safety), model-local functions, expansion of
function-bodied ops without a kernel, subgraphs (If/Loop/Scan, nested, outer-scope reads) and
opset/IR version limits."""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.external_data_helper import set_external_data
from onnx.reference import ReferenceEvaluator

import onnxplug as ox
from onnxplug import errors
from onnxplug.framework.kernel import KernelRegistry
from onnxplug.providers.cpu import factory as cpu_factory
from onnxplug.providers.cpu.kernels import cpu_registry

CPU = ["CPUExecutionProvider"]
F = TensorProto.FLOAT
OPSET = 18


def _model(nodes, inputs, outputs, inits=(), opset=OPSET, functions=(), ir_version=None):
    g = helper.make_graph(list(nodes), "g", list(inputs), list(outputs), list(inits))
    imports = [helper.make_opsetid("", opset)]
    for f in functions:
        if f.domain and all(i.domain != f.domain for i in imports):
            imports.append(helper.make_opsetid(f.domain, 1))
    m = helper.make_model(g, opset_imports=imports, functions=list(functions))
    if ir_version is not None:
        m.ir_version = ir_version
    return m


def _tv(name, shape, elem=F):
    return helper.make_tensor_value_info(name, elem, shape)


def _run(model, feeds, **kw):
    src = model if isinstance(model, (str, os.PathLike)) else model.SerializeToString()
    return ox.InferenceSession(src, providers=CPU, **kw).run(None, feeds)


# the model file ---------------------------------------------------------------------------------


@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "read"])
def test_a_model_file_is_parsed_into_a_copy_of_its_bytes(tmp_path, rng, monkeypatch, mapped):
    """The file is parsed from a mapping of its pages (or read, where the file system cannot
    map it): the weights are copied out of it, so rewriting or deleting the file afterwards
    changes nothing."""
    from onnxplug.ir import model as ir_model

    if not mapped:

        def no_mmap(*a, **k):
            raise OSError("this file system cannot map files")

        monkeypatch.setattr(ir_model.mmap, "mmap", no_mmap)
    m, w, b = _affine_model(rng)
    path = tmp_path / "affine.onnx"
    onnx.save(m, str(path))
    loaded = ir_model.load_model(path)
    path.write_bytes(b"\0" * path.stat().st_size)
    path.unlink()
    assert loaded.base_dir == tmp_path.resolve()
    np.testing.assert_array_equal(loaded.weights["W"], w)
    np.testing.assert_array_equal(loaded.weights["B"], b)


def test_an_empty_model_file_is_not_an_onnx_model(tmp_path):
    path = tmp_path / "empty.onnx"
    path.write_bytes(b"")
    with pytest.raises(errors.InvalidProtobuf, match="empty.onnx failed: not an ONNX model"):
        ox.InferenceSession(str(path), providers=CPU)


@pytest.mark.parametrize(
    ("marker", "where"),
    [
        (b"WNAME", "model.graph.initializer[0].name"),
        (b"NDOC", "model.graph.node[0].doc_string"),
        (b"XDIM", "model.graph.input[0].type.tensor_type.shape.dim[0].dim_param"),
    ],
)
def test_non_utf8_text_deep_in_the_model_is_named(rng, marker, where):
    m, _, _ = _affine_model(rng)
    m.graph.initializer[0].name = "WNAME"
    m.graph.node[0].doc_string = "NDOC"
    m.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "XDIM"
    data = m.SerializeToString().replace(marker, marker[:1] + b"\xff\xfe" + marker[3:])
    with pytest.raises(errors.InvalidProtobuf, match=rf"{re.escape(where)} is not valid UTF-8"):
        ox.InferenceSession(data, providers=CPU)


def test_the_text_check_reads_no_tensor_bytes():
    """check_proto's UTF-8 check reads string and message fields by name: never a tensor's
    raw_data, which ``ListFields`` would copy out of the proto (1 s of BERT-base's load)."""
    from onnxplug.ir.validate import _text_fields

    names = {f.name for f in _text_fields(TensorProto.DESCRIPTOR)}
    assert "raw_data" not in names and "string_data" not in names
    assert {"name", "doc_string", "external_data"} <= names


# external data --------------------------------------------------------------------------------


def _affine_model(rng):
    """Y = X @ W + B with initializers big enough to be written as external data."""
    w = rng.standard_normal((16, 8)).astype(np.float32)
    b = rng.standard_normal((8,)).astype(np.float32)
    m = _model(
        [
            helper.make_node("MatMul", ["X", "W"], ["XW"]),
            helper.make_node("Add", ["XW", "B"], ["Y"]),
        ],
        [_tv("X", [2, 16])],
        [_tv("Y", [2, 8])],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(b, "B")],
    )
    return m, w, b


@pytest.fixture
def rng():
    return np.random.default_rng(0)


@pytest.mark.parametrize("one_file", [True, False])
def test_external_data_is_read_from_the_model_folder(tmp_path, rng, one_file):
    m, w, b = _affine_model(rng)
    path = tmp_path / "model.onnx"
    onnx.save(
        m,
        path,
        save_as_external_data=True,
        all_tensors_to_one_file=one_file,
        location="weights.bin" if one_file else None,
        size_threshold=0,
    )
    stored = onnx.load(path, load_external_data=False)
    assert all(t.data_location == TensorProto.EXTERNAL for t in stored.graph.initializer)
    x = rng.standard_normal((2, 16)).astype(np.float32)
    (y,) = _run(path, {"X": x})
    np.testing.assert_allclose(y, x @ w + b, rtol=1e-5, atol=1e-6)
    # a relative path and a pathlib.Path work the same way
    cwd = os.getcwd()
    try:
        os.chdir(tmp_path)
        (y2,) = _run("model.onnx", {"X": x})
    finally:
        os.chdir(cwd)
    np.testing.assert_array_equal(y, y2)


def test_external_data_in_a_subfolder_and_in_subgraph_attributes(tmp_path, rng):
    # a Constant inside an If branch holds a tensor attribute; convert_attribute moves it out
    c = rng.standard_normal((64,)).astype(np.float32)
    then = helper.make_graph(
        [helper.make_node("Constant", [], ["v"], value=numpy_helper.from_array(c, "c"))],
        "then",
        [],
        [_tv("v", [64])],
    )
    other = helper.make_graph([helper.make_node("Neg", ["X"], ["v"])], "else", [], [_tv("v", [64])])
    m = _model(
        [helper.make_node("If", ["cond"], ["Y"], then_branch=then, else_branch=other)],
        [_tv("cond", [], TensorProto.BOOL), _tv("X", [64])],
        [_tv("Y", [64])],
    )
    (tmp_path / "data").mkdir()
    onnx.save(
        m,
        tmp_path / "model.onnx",
        save_as_external_data=True,
        location="data/tensors.bin",
        size_threshold=0,
        convert_attribute=True,
    )
    assert (tmp_path / "data" / "tensors.bin").is_file()
    x = rng.standard_normal(64).astype(np.float32)
    (y,) = _run(tmp_path / "model.onnx", {"cond": np.array(True), "X": x})
    np.testing.assert_array_equal(y, c)


def _external_model(tmp_path: Path, location: str, length: int | None = None) -> Path:
    """A model whose initializer W points at ``location`` (written by hand, so that it can
    point anywhere)."""
    w = numpy_helper.from_array(np.arange(4, dtype=np.float32), "W")
    n = len(w.raw_data)
    set_external_data(w, location=location, offset=0, length=n if length is None else length)
    w.data_location = TensorProto.EXTERNAL
    w.ClearField("raw_data")
    m = _model([helper.make_node("Add", ["X", "W"], ["Y"])], [_tv("X", [4])], [_tv("Y", [4])], [w])
    path = tmp_path / "model" / "model.onnx"
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(m.SerializeToString())
    return path


def _write_weights(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(np.arange(4, dtype=np.float32).tobytes())


def test_external_data_location_with_dotdot_is_refused(tmp_path):
    _write_weights(tmp_path / "outside.bin")
    path = _external_model(tmp_path, "../outside.bin")
    with pytest.raises(errors.InvalidGraph, match=r"initializer 'W'.*'\.\./outside\.bin'.*'\.\.'"):
        ox.InferenceSession(path, providers=CPU)
    # also when the climb is hidden in the middle of the path
    (tmp_path / "model" / "sub").mkdir()
    path = _external_model(tmp_path, "sub/../../outside.bin")
    with pytest.raises(errors.InvalidGraph, match="escapes the model's folder"):
        ox.InferenceSession(path, providers=CPU)


def test_external_data_absolute_location_is_refused(tmp_path):
    target = tmp_path / "abs.bin"
    _write_weights(target)
    path = _external_model(tmp_path, str(target))
    with pytest.raises(errors.InvalidGraph, match="initializer 'W'.*absolute path"):
        ox.InferenceSession(path, providers=CPU)


def test_external_data_symlink_out_of_the_folder_is_refused(tmp_path):
    _write_weights(tmp_path / "secret.bin")
    path = _external_model(tmp_path, "link.bin")
    (path.parent / "link.bin").symlink_to(tmp_path / "secret.bin")
    with pytest.raises(errors.InvalidGraph, match="initializer 'W'.*outside the model's folder"):
        ox.InferenceSession(path, providers=CPU)


def test_external_data_symlink_inside_the_folder_is_allowed(tmp_path):
    path = _external_model(tmp_path, "link.bin")
    _write_weights(path.parent / "real" / "w.bin")
    (path.parent / "link.bin").symlink_to(path.parent / "real" / "w.bin")
    (y,) = _run(path, {"X": np.ones(4, np.float32)})
    np.testing.assert_array_equal(y, np.arange(4, dtype=np.float32) + 1)


def test_external_data_missing_or_short_file(tmp_path):
    path = _external_model(tmp_path, "absent.bin")
    with pytest.raises(errors.NoSuchFile, match="initializer 'W'.*'absent.bin'"):
        ox.InferenceSession(path, providers=CPU)
    path = _external_model(tmp_path, "short.bin", length=64)
    _write_weights(path.parent / "short.bin")
    with pytest.raises(errors.Fail, match="initializer 'W'.*'short.bin' holds 16 bytes"):
        ox.InferenceSession(path, providers=CPU)


def test_external_data_needs_a_folder(tmp_path):
    path = _external_model(tmp_path, "w.bin")
    _write_weights(path.parent / "w.bin")
    with pytest.raises(errors.InvalidArgument, match="initializer 'W' uses external data"):
        ox.InferenceSession(path.read_bytes(), providers=CPU)


# model-local functions ------------------------------------------------------------------------


def _local_functions():
    # scaled_relu(X) = Relu(X) * alpha, alpha an attribute with a default-less reference
    alpha = helper.make_node("Constant", [], ["a"], value_float=0.0)
    alpha.attribute[0].ref_attr_name = "alpha"
    alpha.attribute[0].ClearField("f")
    scaled = helper.make_function(
        "local",
        "ScaledRelu",
        ["X"],
        ["Y"],
        [alpha, helper.make_node("Relu", ["X"], ["r"]), helper.make_node("Mul", ["r", "a"], ["Y"])],
        [helper.make_opsetid("", OPSET)],
        attributes=["alpha"],
    )
    # twice(X) = ScaledRelu(X, alpha=2) + ScaledRelu(X, alpha=3): a function calling another
    twice = helper.make_function(
        "local",
        "Twice",
        ["X"],
        ["Y"],
        [
            helper.make_node("ScaledRelu", ["X"], ["p"], domain="local", alpha=2.0),
            helper.make_node("ScaledRelu", ["X"], ["q"], domain="local", alpha=3.0),
            helper.make_node("Add", ["p", "q"], ["Y"]),
        ],
        [helper.make_opsetid("", OPSET), helper.make_opsetid("local", 1)],
    )
    return [scaled, twice]


def test_model_local_functions_are_inlined(rng):
    m = _model(
        [
            helper.make_node("Twice", ["X"], ["T"], domain="local"),
            helper.make_node("ScaledRelu", ["X"], ["S"], domain="local", alpha=0.5),
        ],
        [_tv("X", [3, 4])],
        [_tv("T", [3, 4]), _tv("S", [3, 4])],
        functions=_local_functions(),
    )
    s = ox.InferenceSession(m.SerializeToString(), providers=CPU)
    x = rng.standard_normal((3, 4)).astype(np.float32)
    t, sr = s.run(None, {"X": x})
    np.testing.assert_allclose(t, 5 * np.maximum(x, 0), rtol=1e-6)
    np.testing.assert_allclose(sr, 0.5 * np.maximum(x, 0), rtol=1e-6)
    ops = {r["op_type"] for r in s.get_provider_graph_assignment_info()}
    assert not ops & {"Twice", "ScaledRelu"}
    assert {"Relu", "Mul", "Add"} <= ops


def test_malformed_local_function_is_a_clear_error():
    bad = helper.make_function(
        "local", "Bad", ["X"], ["Y"], [helper.make_node("Relu", ["Z"], ["Y"])], []
    )
    m = _model(
        [helper.make_node("Bad", ["X"], ["Y"], domain="local")],
        [_tv("X", [2])],
        [_tv("Y", [2])],
        functions=[bad],
    )
    with pytest.raises(errors.OnnxPlugError):
        ox.InferenceSession(m.SerializeToString(), providers=CPU)


# schema functions without a kernel --------------------------------------------------------------


@pytest.fixture
def cpu_without(monkeypatch):
    """Makes the CPU provider lack kernels for some ops, so that they must be expanded."""

    def remove(*ops: str) -> None:
        reg = KernelRegistry(cpu_registry().provider)
        reg.merge(cpu_registry())
        for op in ops:
            reg._by_op.pop(("", op), None)
        assert not any(reg.has_op(op) for op in ops)
        monkeypatch.setattr(cpu_factory.CpuEp, "get_kernel_registry", lambda self: reg)

    return remove


def _reference(model, feeds):
    return ReferenceEvaluator(model).run(None, feeds)


@pytest.mark.parametrize(
    ("op", "opset", "attrs", "shape"),
    [
        ("MeanVarianceNormalization", 13, {}, [2, 3, 4, 5]),  # axes default from the schema
        ("MeanVarianceNormalization", 18, {"axes": [1]}, [2, 3, 4]),
        ("Gelu", 20, {"approximate": "tanh"}, [3, 5]),  # context-dependent body
        ("LayerNormalization", 17, {"axis": -1, "epsilon": 1e-3}, [2, 6]),
        ("Celu", 12, {"alpha": 0.7}, [4, 3]),
        ("HardSwish", 14, {}, [10]),
    ],
)
def test_function_ops_without_kernel_are_expanded(cpu_without, rng, op, opset, attrs, shape):
    cpu_without(op)
    n_in = 3 if op == "LayerNormalization" else 1
    names = ["X", "S", "B"][:n_in]
    inits = []
    if op == "LayerNormalization":
        inits = [
            numpy_helper.from_array(rng.standard_normal(shape[-1:]).astype(np.float32), "S"),
            numpy_helper.from_array(rng.standard_normal(shape[-1:]).astype(np.float32), "B"),
        ]
    m = _model(
        [helper.make_node(op, names, ["Y"], **attrs)],
        [_tv("X", shape)],
        [_tv("Y", shape)],
        inits,
        opset=opset,
    )
    x = rng.standard_normal(shape).astype(np.float32)
    s = ox.InferenceSession(m.SerializeToString(), providers=CPU)
    assert op not in {r["op_type"] for r in s.get_provider_graph_assignment_info()}
    (y,) = s.run(None, {"X": x})
    (ref,) = _reference(m, {"X": x})
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-6)


def test_expanded_body_with_subgraphs(cpu_without, rng):
    # AffineGrid's body has If branches that read the body's values from the outer scope
    cpu_without("AffineGrid")
    m = _model(
        [helper.make_node("AffineGrid", ["theta", "size"], ["grid"], align_corners=1)],
        [_tv("theta", [2, 2, 3]), _tv("size", [4], TensorProto.INT64)],
        [_tv("grid", None)],
        opset=20,
    )
    theta = rng.standard_normal((2, 2, 3)).astype(np.float32)
    size = np.array([2, 3, 4, 5], np.int64)
    s = ox.InferenceSession(m.SerializeToString(), providers=CPU)
    assert "AffineGrid" not in {r["op_type"] for r in s.get_provider_graph_assignment_info()}
    (y,) = s.run(None, {"theta": theta, "size": size})
    (ref,) = _reference(m, {"theta": theta, "size": size})
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-6)
    # two expansions of the same function in one graph must not collide
    m2 = _model(
        [
            helper.make_node("AffineGrid", ["theta", "size"], ["g1"]),
            helper.make_node("AffineGrid", ["theta", "size"], ["g2"], align_corners=1),
        ],
        [_tv("theta", [2, 2, 3]), _tv("size", [4], TensorProto.INT64)],
        [_tv("g1", None), _tv("g2", None)],
        opset=20,
    )
    got = ox.InferenceSession(m2.SerializeToString(), providers=CPU).run(
        None, {"theta": theta, "size": size}
    )
    for a, b in zip(got, _reference(m2, {"theta": theta, "size": size})):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_op_without_kernel_or_body_is_not_implemented(cpu_without):
    cpu_without("Abs")  # Abs has no function body to fall back on
    m = _model(
        [helper.make_node("Abs", ["X"], ["Y"], name="my_abs")], [_tv("X", [2])], [_tv("Y", [2])]
    )
    with pytest.raises(errors.NotImplemented, match="Abs.*'my_abs'"):
        ox.InferenceSession(m.SerializeToString(), providers=CPU)


# subgraphs ------------------------------------------------------------------------------------


def test_if_reads_outer_scope_values(rng):
    then = helper.make_graph(
        [helper.make_node("Add", ["X", "W"], ["v"])], "then", [], [_tv("v", [3])]
    )
    other = helper.make_graph(
        [helper.make_node("Mul", ["X", "W"], ["v"])], "else", [], [_tv("v", [3])]
    )
    m = _model(
        [helper.make_node("If", ["cond"], ["Y"], then_branch=then, else_branch=other)],
        [_tv("cond", [], TensorProto.BOOL), _tv("X", [3])],
        [_tv("Y", [3])],
        # W is read only inside the branches
        [numpy_helper.from_array(np.array([1, 2, 3], np.float32), "W")],
    )
    s = ox.InferenceSession(m.SerializeToString(), providers=CPU)
    x = rng.standard_normal(3).astype(np.float32)
    w = np.array([1, 2, 3], np.float32)
    np.testing.assert_allclose(s.run(None, {"cond": np.array(True), "X": x})[0], x + w)
    np.testing.assert_allclose(s.run(None, {"cond": np.array(False), "X": x})[0], x * w)


def _nested_loop_model():
    """for i in range(n): acc = acc + (If i is even: X * K else: -X); scan out acc.

    The If inside the Loop body reads X and K from the outermost graph (K is a Constant the
    optimizer folds into an initializer) and i from the body."""
    two = numpy_helper.from_array(np.array(2, np.int64), "two")
    zero = numpy_helper.from_array(np.array(0, np.int64), "zero")
    then = helper.make_graph(
        [helper.make_node("Mul", ["X", "K"], ["d"])], "even", [], [_tv("d", [2])]
    )
    other = helper.make_graph([helper.make_node("Neg", ["X"], ["d"])], "odd", [], [_tv("d", [2])])
    body = helper.make_graph(
        [
            helper.make_node("Mod", ["i", "two"], ["r"]),
            helper.make_node("Equal", ["r", "zero"], ["even"]),
            helper.make_node("If", ["even"], ["delta"], then_branch=then, else_branch=other),
            helper.make_node("Add", ["acc_in", "delta"], ["acc_out"]),
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
            helper.make_node("Identity", ["acc_out"], ["scan"]),
        ],
        "body",
        [_tv("i", [], TensorProto.INT64), _tv("cond_in", [], TensorProto.BOOL), _tv("acc_in", [2])],
        [_tv("cond_out", [], TensorProto.BOOL), _tv("acc_out", [2]), _tv("scan", [2])],
        [two, zero],
    )
    return _model(
        [
            helper.make_node(
                "Constant",
                [],
                ["K"],
                value=numpy_helper.from_array(np.array([10, 100], np.float32)),
            ),
            helper.make_node("Loop", ["n", "", "acc0"], ["acc", "steps"], body=body),
        ],
        [_tv("n", [], TensorProto.INT64), _tv("X", [2]), _tv("acc0", [2])],
        [_tv("acc", [2]), _tv("steps", [None, 2])],
    )


@pytest.mark.parametrize("level", [0, 99])
def test_nested_loop_and_if_read_outer_scope(level, rng):
    m = _nested_loop_model()
    so = ox.SessionOptions()
    so.graph_optimization_level = level
    s = ox.InferenceSession(m.SerializeToString(), so, providers=CPU)
    x = rng.standard_normal(2).astype(np.float32)
    acc0 = np.zeros(2, np.float32)
    acc, steps = s.run(None, {"n": np.array(5, np.int64), "X": x, "acc0": acc0})
    expect, rows = acc0.copy(), []
    for i in range(5):
        expect = expect + (x * np.array([10, 100], np.float32) if i % 2 == 0 else -x)
        rows.append(expect)
    np.testing.assert_allclose(acc, expect, rtol=1e-6)
    np.testing.assert_allclose(steps, np.stack(rows), rtol=1e-6)
    # zero iterations: carried value unchanged, empty scan output
    acc, steps = s.run(None, {"n": np.array(0, np.int64), "X": x, "acc0": acc0})
    np.testing.assert_array_equal(acc, acc0)
    assert steps.shape == (0, 2)


def test_scan_with_outer_scope(rng):
    # running sum of rows, each row scaled by an outer-scope value
    body = helper.make_graph(
        [
            helper.make_node("Mul", ["row", "scale"], ["scaled"]),
            helper.make_node("Add", ["state_in", "scaled"], ["state_out"]),
            helper.make_node("Identity", ["state_out"], ["out"]),
        ],
        "body",
        [_tv("state_in", [3]), _tv("row", [3])],
        [_tv("state_out", [3]), _tv("out", [3])],
    )
    m = _model(
        [
            helper.make_node(
                "Scan",
                ["s0", "X"],
                ["final", "partial"],
                body=body,
                num_scan_inputs=1,
                scan_input_directions=[1],
            )
        ],
        [_tv("s0", [3]), _tv("X", [4, 3]), _tv("scale", [3])],
        [_tv("final", [3]), _tv("partial", [4, 3])],
    )
    x = rng.standard_normal((4, 3)).astype(np.float32)
    scale = np.array([1, 2, 3], np.float32)
    final, partial = _run(m, {"s0": np.zeros(3, np.float32), "X": x, "scale": scale})
    expect = np.cumsum((x * scale)[::-1], axis=0)
    np.testing.assert_allclose(partial, expect, rtol=1e-5)
    np.testing.assert_allclose(final, expect[-1], rtol=1e-5)


# opsets and IR versions -------------------------------------------------------------------------


def test_newest_opset_of_installed_onnx_runs(rng):
    newest = onnx.defs.onnx_opset_version()
    m = _model(
        [helper.make_node("Add", ["X", "X"], ["S"]), helper.make_node("Relu", ["S"], ["Y"])],
        [_tv("X", [4])],
        [_tv("Y", [4])],
        opset=newest,
        ir_version=onnx.IR_VERSION,
    )
    x = rng.standard_normal(4).astype(np.float32)
    np.testing.assert_allclose(_run(m, {"X": x})[0], np.maximum(2 * x, 0))


def test_newer_opset_is_a_clear_error():
    newer = onnx.defs.onnx_opset_version() + 1
    m = _model(
        [helper.make_node("Relu", ["X"], ["Y"])], [_tv("X", [4])], [_tv("Y", [4])], opset=newer
    )
    with pytest.raises(
        errors.InvalidGraph, match=rf"needs opset {newer} of domain 'ai.onnx'.*up to {newer - 1}"
    ):
        ox.InferenceSession(m.SerializeToString(), providers=CPU)


def test_newer_ir_version_is_a_clear_error():
    m = _model(
        [helper.make_node("Relu", ["X"], ["Y"])],
        [_tv("X", [4])],
        [_tv("Y", [4])],
        ir_version=onnx.IR_VERSION + 1,
    )
    with pytest.raises(errors.InvalidGraph, match=rf"IR version {onnx.IR_VERSION + 1}"):
        ox.InferenceSession(m.SerializeToString(), providers=CPU)


def test_op_newer_than_the_models_opset_is_rejected():
    # Gelu exists from opset 20; an opset-17 model cannot use it
    m = _model([helper.make_node("Gelu", ["X"], ["Y"])], [_tv("X", [4])], [_tv("Y", [4])], opset=17)
    with pytest.raises(errors.InvalidGraph, match="no op Gelu is registered .* version 17"):
        ox.InferenceSession(m.SerializeToString(), providers=CPU)


# --------------------------------------------------------------------------------------------
# the model loads on a helper thread while a device provider is set up


def _add_model() -> bytes:
    x = helper.make_tensor_value_info("x", F, [2])
    y = helper.make_tensor_value_info("y", F, [2])
    return _model([helper.make_node("Add", ["x", "x"], ["y"])], [x], [y]).SerializeToString()


def _loading_threads(monkeypatch) -> list[str]:
    from onnxplug.session import inference_session as sess_mod

    seen: list[str] = []
    real = sess_mod.load_model

    def load(source):
        seen.append(threading.current_thread().name)
        return real(source)

    monkeypatch.setattr(sess_mod, "load_model", load)
    return seen


def test_model_loads_beside_a_device_provider_set_up(monkeypatch, virt):
    """With a device provider named, the model loads on a helper thread while the providers
    are created (the CUDA provider's set-up waits on the driver); with the CPU alone, or with
    providers chosen by a policy that reads the model, in the caller's thread."""
    import tests.plugins.virtual_device as vd

    seen = _loading_threads(monkeypatch)
    feeds = {"x": np.array([1.0, 2.0], np.float32)}
    for providers in ([vd.NAME, "CPUExecutionProvider"], ["CPUExecutionProvider"]):
        s = ox.InferenceSession(_add_model(), providers=providers)
        np.testing.assert_array_equal(s.run(None, feeds)[0], [2.0, 4.0])
    assert seen[0] == "onnxplug-model-load"
    assert seen[1] == threading.main_thread().name


def test_model_error_comes_before_a_provider_error(monkeypatch):
    """A model that cannot load is reported as before, even where the providers (created
    meanwhile) fail too: the caller sees the model's error, raised in its own thread."""
    seen = _loading_threads(monkeypatch)
    so = ox.SessionOptions()
    so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    with pytest.raises(errors.InvalidProtobuf):
        ox.InferenceSession(b"not a model", so, providers=["NoSuchExecutionProvider"])
    assert seen == ["onnxplug-model-load"]
    with pytest.raises(errors.InvalidArgument, match="NoSuchExecutionProvider"):
        ox.InferenceSession(_add_model(), so, providers=["NoSuchExecutionProvider"])
