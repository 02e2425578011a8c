"""The session API against onnxruntime's: InferenceSession, SessionOptions, RunOptions,
IOBinding and OrtValue, compared with the installed onnxruntime wherever both have the call."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxplug as ox
from onnxplug import errors

ort = pytest.importorskip("onnxruntime")

CPU = ["CPUExecutionProvider"]
F = TensorProto.FLOAT
# what the installed onnxruntime reads, so that both runtimes load the same bytes
IR_VERSION, OPSET = 10, 21


def _tv(name, shape, elem=F):
    return helper.make_tensor_value_info(name, elem, shape)


def _model(nodes, inputs, outputs, inits=(), ir_version=IR_VERSION, opset=OPSET, **props):
    g = helper.make_graph(list(nodes), props.pop("graph_name", "g"), inputs, outputs, list(inits))
    g.doc_string = props.pop("graph_doc", "")
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], **props)
    m.ir_version = ir_version
    return m


@pytest.fixture(scope="module")
def affine() -> onnx.ModelProto:
    """Y = relu(X @ W + B); Z = Y * 2 (two outputs, dynamic batch, metadata)."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((4, 3)).astype(np.float32)
    b = rng.standard_normal(3).astype(np.float32)
    m = _model(
        [
            helper.make_node("MatMul", ["X", "W"], ["XW"]),
            helper.make_node("Add", ["XW", "B"], ["S"]),
            helper.make_node("Relu", ["S"], ["Y"]),
            helper.make_node("Mul", ["Y", "two"], ["Z"]),
        ],
        [_tv("X", ["batch", 4])],
        [_tv("Y", ["batch", 3]), _tv("Z", ["batch", 3])],
        [
            numpy_helper.from_array(w, "W"),
            numpy_helper.from_array(b, "B"),
            numpy_helper.from_array(np.array(2, np.float32), "two"),
        ],
        producer_name="unit-test",
        producer_version="1.2",
        domain="ai.test",
        model_version=7,
        doc_string="an affine layer",
        graph_name="affine",
        graph_doc="the graph",
    )
    helper.set_model_props(m, {"author": "me", "license": "MIT"})
    return m


@pytest.fixture
def x() -> np.ndarray:
    return np.random.default_rng(2).standard_normal((5, 4)).astype(np.float32)


def _both(model, **kw):
    data = model.SerializeToString()
    return (
        ox.InferenceSession(data, providers=CPU, **kw),
        ort.InferenceSession(data, providers=CPU, **kw),
    )


def _args(nodeargs):
    return [(a.name, a.type, list(a.shape)) for a in nodeargs]


# construction and introspection -----------------------------------------------------------------


def test_sources_path_bytes_and_modelproto(affine, tmp_path, x):
    path = tmp_path / "m.onnx"
    onnx.save(affine, path)
    ref = ort.InferenceSession(str(path), providers=CPU).run(None, {"X": x})
    for src in (str(path), path, path.read_bytes(), affine):
        got = ox.InferenceSession(src, providers=CPU).run(None, {"X": x})
        for a, b in zip(got, ref):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    # the session keeps no reference to the caller's ModelProto
    proto = onnx.ModelProto()
    proto.CopyFrom(affine)
    s = ox.InferenceSession(proto, providers=CPU)
    proto.graph.ClearField("node")
    assert len(s.run(None, {"X": x})) == 2


def test_introspection_matches_onnxruntime(affine):
    ours, theirs = _both(affine)
    assert _args(ours.get_inputs()) == _args(theirs.get_inputs())
    assert _args(ours.get_outputs()) == _args(theirs.get_outputs())
    assert _args(ours.get_overridable_initializers()) == _args(
        theirs.get_overridable_initializers()
    )
    assert str(ours.get_inputs()[0]) == str(theirs.get_inputs()[0])
    a, b = ours.get_modelmeta(), theirs.get_modelmeta()
    for field in (
        "producer_name",
        "graph_name",
        "domain",
        "description",
        "graph_description",
        "version",
        "custom_metadata_map",
    ):
        assert getattr(a, field) == getattr(b, field), field
    assert ours.get_providers() == theirs.get_providers() == CPU
    assert ours.get_provider_options() == theirs.get_provider_options()
    assert isinstance(ours.get_session_options(), ox.SessionOptions)


def test_run_matches_onnxruntime_with_output_subsets(affine, x):
    ours, theirs = _both(affine)
    for names in (None, [], ["Z"], ["Z", "Y"], ["Y", "Y"]):
        got, ref = ours.run(names, {"X": x}), theirs.run(names, {"X": x})
        assert len(got) == len(ref)
        for a, b in zip(got, ref):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    # another batch size: a new shape signature
    x1 = x[:1]
    np.testing.assert_allclose(ours.run(["Y"], {"X": x1})[0], theirs.run(["Y"], {"X": x1})[0])


def test_run_with_ort_values(affine, x):
    ours, theirs = _both(affine)
    got = ours.run_with_ort_values(["Z"], {"X": ox.OrtValue.ortvalue_from_numpy(x)})
    ref = theirs.run_with_ort_values(["Z"], {"X": ort.OrtValue.ortvalue_from_numpy(x)})
    assert len(got) == 1 and isinstance(got[0], ox.OrtValue)
    assert got[0].shape() == ref[0].shape() and got[0].data_type() == ref[0].data_type()
    np.testing.assert_allclose(got[0].numpy(), ref[0].numpy(), rtol=1e-6, atol=1e-6)
    # plain arrays are accepted as well, and the low-level vector form fills a list
    fetches: list = []
    ours.run_with_ortvaluevector(None, ["X"], [x], ["Y"], fetches)
    np.testing.assert_allclose(fetches[0].numpy(), ours.run(["Y"], {"X": x})[0])


def test_run_async(affine, x):
    s = ox.InferenceSession(affine.SerializeToString(), providers=CPU)
    done = threading.Event()
    box: dict = {}

    def callback(results, user_data, err):
        box.update(results=results, user_data=user_data, err=err)
        done.set()

    s.run_async(["Y"], {"X": x}, callback, "token")
    assert done.wait(30)
    assert box["err"] == "" and box["user_data"] == "token"
    np.testing.assert_array_equal(box["results"][0], s.run(["Y"], {"X": x})[0])
    done.clear()
    s.run_async(["Y"], {"X": x[:, :2]}, callback, None)
    assert done.wait(30)
    assert box["results"] is None and "X" in box["err"]


def test_concurrent_runs_agree(affine):
    s = ox.InferenceSession(affine.SerializeToString(), providers=CPU)
    rng = np.random.default_rng(3)
    inputs = [rng.standard_normal((k % 3 + 1, 4)).astype(np.float32) for k in range(16)]
    expect = [s.run(None, {"X": v}) for v in inputs]
    results: list = [None] * len(inputs)

    def work(k: int) -> None:
        for _ in range(20):
            results[k] = s.run(None, {"X": inputs[k]})

    threads = [threading.Thread(target=work, args=(k,)) for k in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for got, ref in zip(results, expect):
        for a, b in zip(got, ref):
            np.testing.assert_array_equal(a, b)


def test_overridable_initializers(x):
    """From IR 4 an initializer listed as a graph input may be fed; before, it is a constant."""
    w = np.array([1, 2, 3, 4], np.float32)
    for ir in (3, 8):
        m = _model(
            [helper.make_node("Add", ["X", "W"], ["Y"])],
            [_tv("X", [5, 4]), _tv("W", [4])],
            [_tv("Y", [5, 4])],
            [numpy_helper.from_array(w, "W")],
            ir_version=ir,
            opset=8,
        )
        ours, theirs = _both(m)
        assert (
            _args(ours.get_inputs())
            == _args(theirs.get_inputs())
            == [("X", "tensor(float)", [5, 4])]
        )
        assert _args(ours.get_overridable_initializers()) == _args(
            theirs.get_overridable_initializers()
        )
        np.testing.assert_array_equal(ours.run(None, {"X": x})[0], x + w)
        w2 = np.full(4, 10, np.float32)
        if ir >= 4:
            np.testing.assert_array_equal(ours.run(None, {"X": x, "W": w2})[0], x + w2)
            np.testing.assert_array_equal(theirs.run(None, {"X": x, "W": w2})[0], x + w2)
            np.testing.assert_array_equal(ours.run(None, {"X": x})[0], x + w)  # back to stored
            with pytest.raises(errors.InvalidArgument, match="input: W"):
                ours.run(None, {"X": x, "W": np.ones(3, np.float32)})
        else:
            with pytest.raises(errors.InvalidArgument, match="Invalid input name: W"):
                ours.run(None, {"X": x, "W": w2})


# session options ----------------------------------------------------------------------------


def _foldable_model() -> onnx.ModelProto:
    """Shape arithmetic on constants, Constant nodes, an Identity chain and an If whose branch
    reads a folded value: every basic rewrite has something to do."""
    then = helper.make_graph(
        [helper.make_node("Mul", ["R", "k2"], ["o"])], "then", [], [_tv("o", None)]
    )
    other = helper.make_graph([helper.make_node("Neg", ["R"], ["o"])], "else", [], [_tv("o", None)])
    return _model(
        [
            helper.make_node(
                "Constant", [], ["k"], value=numpy_helper.from_array(np.array([2, -1], np.int64))
            ),
            helper.make_node("Constant", [], ["k2"], value_float=3.0),
            helper.make_node("Shape", ["X"], ["s"]),
            helper.make_node("Gather", ["s", "zero"], ["n"], axis=0),
            helper.make_node("Unsqueeze", ["n", "zero1"], ["n1"]),
            helper.make_node("Concat", ["k", "n1"], ["shape3"], axis=0),
            helper.make_node("Reshape", ["X", "shape3"], ["R0"]),
            helper.make_node("Identity", ["R0"], ["R"]),
            helper.make_node("ReduceSum", ["R", "one1"], ["sum"], keepdims=0),
            helper.make_node("Greater", ["sum", "zf"], ["pos"]),
            helper.make_node("ReduceMax", ["pos_f"], ["any"], keepdims=0),
            helper.make_node("Cast", ["pos"], ["pos_f"], to=F),
            helper.make_node("Cast", ["any"], ["cond"], to=TensorProto.BOOL),
            helper.make_node("If", ["cond"], ["Y"], then_branch=then, else_branch=other),
        ],
        [_tv("X", [6, 4])],
        [_tv("Y", None)],
        [
            numpy_helper.from_array(np.array(0, np.int64), "zero"),
            numpy_helper.from_array(np.array([0], np.int64), "zero1"),
            numpy_helper.from_array(np.array([1], np.int64), "one1"),
            numpy_helper.from_array(np.array(0, np.float32), "zf"),
        ],
    )


def test_optimization_levels_give_identical_results(affine, x):
    m = _foldable_model()
    rng = np.random.default_rng(4)
    feeds = [rng.standard_normal((6, 4)).astype(np.float32) for _ in range(3)]
    feeds.append(-np.abs(feeds[0]))  # takes the other If branch
    results = {}
    for level in ox.GraphOptimizationLevel:
        so = ox.SessionOptions()
        so.graph_optimization_level = level
        assert so.graph_optimization_level is level
        s = ox.InferenceSession(m.SerializeToString(), so, providers=CPU)
        assert s.get_session_options().graph_optimization_level is level
        results[level] = [s.run(None, {"X": f})[0] for f in feeds]
    ref_so = ort.SessionOptions()
    ref_so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    ref = ort.InferenceSession(m.SerializeToString(), ref_so, providers=CPU)
    expect = [ref.run(None, {"X": f})[0] for f in feeds]
    for level, outs in results.items():
        for got, want in zip(outs, expect):
            np.testing.assert_array_equal(got, want, err_msg=str(level))
    # and on a model the optimizer leaves alone
    for level in (
        ox.GraphOptimizationLevel.ORT_DISABLE_ALL,
        ox.GraphOptimizationLevel.ORT_ENABLE_ALL,
    ):
        so = ox.SessionOptions()
        so.graph_optimization_level = level
        got = ox.InferenceSession(affine.SerializeToString(), so, providers=CPU).run(None, {"X": x})
        np.testing.assert_allclose(
            got[0],
            ort.InferenceSession(affine.SerializeToString(), providers=CPU).run(None, {"X": x})[0],
            rtol=1e-6,
            atol=1e-6,
        )


def test_optimization_level_values_and_validation():
    assert [int(v) for v in ox.GraphOptimizationLevel] == [
        int(getattr(ort.GraphOptimizationLevel, v.name)) for v in ox.GraphOptimizationLevel
    ]
    assert str(ox.GraphOptimizationLevel.ORT_ENABLE_ALL) == str(
        ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    )
    so = ox.SessionOptions()
    assert so.graph_optimization_level == ort.SessionOptions().graph_optimization_level
    so.graph_optimization_level = 1  # an int is coerced to the enum
    assert so.graph_optimization_level is ox.GraphOptimizationLevel.ORT_ENABLE_BASIC
    with pytest.raises(errors.InvalidArgument, match="graph_optimization_level"):
        so.graph_optimization_level = 5


def test_session_config_entries():
    for lib in (ox, ort):
        so = lib.SessionOptions()
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        so.add_session_config_entry("my.key", "v1")
        so.add_session_config_entry("my.key", "v2")  # the last value wins
        assert so.get_session_config_entry("session.intra_op.allow_spinning") == "0"
        assert so.get_session_config_entry("my.key") == "v2"
        with pytest.raises(RuntimeError, match="does not have configuration with key: nope"):
            so.get_session_config_entry("nope")


def test_add_initializer(affine, x):
    w = np.ones((4, 3), np.float32)
    ref_so = ort.SessionOptions()
    ref_w = ort.OrtValue.ortvalue_from_numpy(w)  # onnxruntime needs it kept alive
    ref_so.add_initializer("W", ref_w)
    so = ox.SessionOptions()
    so.add_initializer("W", ox.OrtValue.ortvalue_from_numpy(w))
    got = ox.InferenceSession(affine.SerializeToString(), so, providers=CPU).run(None, {"X": x})
    ref = ort.InferenceSession(affine.SerializeToString(), ref_so, providers=CPU).run(
        None, {"X": x}
    )
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-6)
    bad = ox.SessionOptions()
    bad.add_initializer("W", ox.OrtValue.ortvalue_from_numpy(np.ones((3, 3), np.float32)))
    with pytest.raises(errors.InvalidArgument, match=r"add_initializer\('W'\).*\[3, 3\].*\[4, 3\]"):
        ox.InferenceSession(affine.SerializeToString(), bad, providers=CPU)
    unknown = ox.SessionOptions()
    unknown.add_initializer("nope", ox.OrtValue.ortvalue_from_numpy(w))
    with pytest.raises(errors.InvalidArgument, match="'nope'"):
        ox.InferenceSession(affine.SerializeToString(), unknown, providers=CPU)


def test_free_dimension_override(affine, x):
    so = ox.SessionOptions()
    so.add_free_dimension_override_by_name("batch", 5)
    s = ox.InferenceSession(affine.SerializeToString(), so, providers=CPU)
    assert s.get_inputs()[0].shape == [5, 4]
    s.run(None, {"X": x})
    with pytest.raises(errors.InvalidArgument, match="(?s)input: X.*index: 0 Got: 2 Expected: 5"):
        s.run(None, {"X": x[:2]})


def test_enable_profiling(affine, x, tmp_path):
    so = ox.SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp_path / "prof")
    # the nodes as written (the default level fuses MatMul + Add + Relu into one MatMulBias)
    so.graph_optimization_level = ox.GraphOptimizationLevel.ORT_ENABLE_BASIC
    s = ox.InferenceSession(affine.SerializeToString(), so, providers=CPU)
    assert s.get_profiling_start_time_ns() > 0
    for _ in range(3):  # first run of a signature and replays
        s.run(None, {"X": x})
    path = Path(s.end_profiling())
    assert path.is_file() and path.name.startswith("prof") and path.suffix == ".json"
    events = json.loads(path.read_text())
    ops = {e["args"]["op_name"] for e in events if e.get("cat") == "Node"}
    assert {"MatMul", "Add", "Relu", "Mul"} <= ops
    nodes = [e for e in events if e["cat"] == "Node"]
    assert all(e["args"]["provider"] == "CPUExecutionProvider" for e in nodes)
    assert all(e["dur"] >= 1 for e in nodes)
    assert len([e for e in nodes if e["args"]["op_name"] == "Relu"]) == 3
    # without profiling there is nothing to write
    assert ox.InferenceSession(affine.SerializeToString(), providers=CPU).end_profiling() == ""


def test_log_severity_level(affine, capsys):
    so = ox.SessionOptions()
    so.log_severity_level = 0  # verbose: where every node runs
    so.logid = "sess-a"
    so.graph_optimization_level = ox.GraphOptimizationLevel.ORT_ENABLE_BASIC  # MatMul unfused
    ox.InferenceSession(affine.SerializeToString(), so, providers=CPU)
    # onnxruntime's lines on stderr: '<time> [V:onnxplug:sess-a, file.py:12 function] message'
    verbose = capsys.readouterr().err.splitlines()
    assert any("MatMul node" in m and "CPUExecutionProvider" in m for m in verbose)
    assert verbose and all(
        re.fullmatch(r"\d{4}-\d\d-\d\d [\d:.]+ \[[VIWEF]:onnxplug:sess-a, \S+:\d+ \w+\] .+", m)
        for m in verbose
    ), verbose
    so = ox.SessionOptions()
    so.log_severity_level = 3  # errors only
    ox.InferenceSession(affine.SerializeToString(), so, providers=CPU)
    assert capsys.readouterr().err == ""


def test_run_options(affine, x):
    s = ox.InferenceSession(affine.SerializeToString(), providers=CPU)
    for lib in (ox, ort):
        ro = lib.RunOptions()
        ro.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
        assert ro.get_run_config_entry("memory.enable_memory_arena_shrinkage") == "cpu:0"
        with pytest.raises(RuntimeError, match="does not have configuration with key: nope"):
            ro.get_run_config_entry("nope")
        assert ro.terminate is False
    ro = ox.RunOptions()
    ro.logid = "run-1"
    ro.log_severity_level = 1
    np.testing.assert_array_equal(s.run(["Y"], {"X": x}, ro)[0], s.run(["Y"], {"X": x})[0])
    ro.terminate = True
    with pytest.raises(errors.Fail, match="terminate flag"):
        s.run(None, {"X": x}, ro)
    ro.terminate = False
    assert len(s.run(None, {"X": x}, ro)) == 2


def test_set_providers_rebuilds(affine, x):
    s = ox.InferenceSession(affine.SerializeToString(), providers=CPU)
    before = s.run(None, {"X": x})
    s.set_providers(["CPUExecutionProvider"])
    assert s.get_providers() == CPU
    for a, b in zip(s.run(None, {"X": x}), before):
        np.testing.assert_array_equal(a, b)


def test_providers_with_options_and_unknown_provider(affine):
    s = ox.InferenceSession(affine.SerializeToString(), providers=[("CPUExecutionProvider", {})])
    assert s.get_providers() == CPU
    with pytest.warns(UserWarning, match="NopeExecutionProvider"):
        ox.InferenceSession(affine.SerializeToString(), providers=["NopeExecutionProvider"])
    with pytest.raises(errors.InvalidArgument, match="provider_options has 2 entries for 1"):
        ox.InferenceSession(affine.SerializeToString(), providers=CPU, provider_options=[{}, {}])
    assert "CPUExecutionProvider" in ox.get_available_providers()
    assert "CPUExecutionProvider" in ox.get_all_providers()


# IOBinding ----------------------------------------------------------------------------------


def test_iobinding_cpu_outputs_with_and_without_buffers(affine, x):
    ours, theirs = _both(affine)
    expect = theirs.run(None, {"X": x})
    for s, lib in ((ours, ox), (theirs, ort)):
        b = s.io_binding()
        b.bind_cpu_input("X", x)
        b.bind_output("Y")  # the runtime allocates
        buf = np.zeros((5, 3), np.float32)
        b.bind_output("Z", "cpu", 0, np.float32, [5, 3], buf.ctypes.data)  # into our buffer
        s.run_with_iobinding(b)
        y, z = b.get_outputs()
        assert isinstance(y, lib.OrtValue) and y.shape() == [5, 3]
        np.testing.assert_allclose(y.numpy(), expect[0], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(buf, expect[1], rtol=1e-6, atol=1e-6)
        assert z.data_ptr() == buf.ctypes.data
        cpu = b.copy_outputs_to_cpu()
        np.testing.assert_allclose(cpu[0], expect[0], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(cpu[1], expect[1], rtol=1e-6, atol=1e-6)
        assert len(b.get_outputs_as_ortvaluevector()) == 2
        b.synchronize_inputs()
        b.synchronize_outputs()


def test_iobinding_ortvalues_and_clearing(affine, x):
    ours, theirs = _both(affine)
    for s, lib in ((ours, ox), (theirs, ort)):
        b = s.io_binding()
        b.bind_ortvalue_input("X", lib.OrtValue.ortvalue_from_numpy(x))
        out = lib.OrtValue.ortvalue_from_shape_and_type([5, 3], np.float32, "cpu", 0)
        b.bind_ortvalue_output("Z", out)
        s.run_with_iobinding(b)
        np.testing.assert_allclose(out.numpy(), s.run(["Z"], {"X": x})[0], rtol=1e-6)
        assert b.get_outputs()[0].data_ptr() == out.data_ptr()
        # rebinding: another input, outputs cleared and bound afresh
        b.clear_binding_inputs()
        b.bind_cpu_input("X", x[:2])
        b.clear_binding_outputs()
        b.bind_output("Y")
        s.run_with_iobinding(b)
        (y,) = b.get_outputs()
        assert y.shape() == [2, 3]
        np.testing.assert_allclose(y.numpy(), s.run(["Y"], {"X": x[:2]})[0], rtol=1e-6)


def test_iobinding_input_from_pointer_and_errors(affine, x):
    s = ox.InferenceSession(affine.SerializeToString(), providers=CPU)
    b = s.io_binding()
    b.bind_input("X", "cpu", 0, np.float32, list(x.shape), x.ctypes.data)
    b.bind_output("Y")
    s.run_with_iobinding(b)
    np.testing.assert_array_equal(b.copy_outputs_to_cpu()[0], s.run(["Y"], {"X": x})[0])
    with pytest.raises(errors.InvalidArgument, match="Invalid output name: Q"):
        b.bind_output("Q")
    buf = np.zeros((4, 3), np.float32)
    b.bind_output("Z", "cpu", 0, np.float32, [4, 3], buf.ctypes.data)
    with pytest.raises(errors.InvalidArgument, match=r"output 'Z' is float32\[5, 3\].*\[4, 3\]"):
        s.run_with_iobinding(b)
    b.clear_binding_inputs()
    b.clear_binding_outputs()
    b.bind_output("Y")
    with pytest.raises(errors.InvalidArgument, match=r"Required inputs \(\['X'\]\)"):
        s.run_with_iobinding(b)


# OrtValue -----------------------------------------------------------------------------------


def test_ortvalue_matches_onnxruntime():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    ours, theirs = ox.OrtValue.ortvalue_from_numpy(a), ort.OrtValue.ortvalue_from_numpy(a)
    for call in ("device_name", "shape", "data_type", "element_type", "is_tensor", "has_value"):
        assert getattr(ours, call)() == getattr(theirs, call)(), call
    assert ours.is_tensor_sequence() == theirs.is_tensor_sequence()
    assert ours.is_sparse_tensor() == theirs.is_sparse_tensor()
    assert ours.tensor_size_in_bytes() == theirs.tensor_size_in_bytes() == a.nbytes
    assert ours.data_ptr() == theirs.data_ptr() == a.ctypes.data  # both share the memory
    np.testing.assert_array_equal(ours.numpy(), theirs.numpy())
    for et in (np.float16, np.int64, np.bool_, np.uint8):
        o = ox.OrtValue.ortvalue_from_shape_and_type([2, 5], et)
        t = ort.OrtValue.ortvalue_from_shape_and_type([2, 5], et)
        assert (o.shape(), o.data_type(), o.element_type()) == (
            t.shape(),
            t.data_type(),
            t.element_type(),
        )


def test_ortvalue_update_inplace():
    a = np.zeros((2, 3), np.float32)
    v = ox.OrtValue.ortvalue_from_numpy(a)
    v.update_inplace(np.ones((2, 3), np.float32))
    np.testing.assert_array_equal(a, 1)  # written through to the shared array
    with pytest.raises(errors.InvalidArgument, match="update_inplace"):
        v.update_inplace(np.ones((3, 3), np.float32))
    with pytest.raises(errors.InvalidArgument, match="update_inplace"):
        v.update_inplace(np.ones((2, 3), np.float64))
    # a 0-d value and a non-contiguous source
    s = ox.OrtValue.ortvalue_from_numpy(np.array(1.0, np.float32))
    s.update_inplace(np.array(2.5, np.float32))
    assert s.shape() == [] and float(s.numpy()) == 2.5
    v.update_inplace(np.arange(6, dtype=np.float32).reshape(3, 2).T)
    np.testing.assert_array_equal(a, np.arange(6, dtype=np.float32).reshape(3, 2).T)


@pytest.mark.parametrize(
    "dtype", [np.float32, np.float16, np.float64, np.int8, np.int64, np.uint32, np.bool_]
)
def test_dlpack_round_trip(dtype):
    a = (np.arange(12).reshape(3, 4) % 3).astype(dtype)
    v = ox.OrtValue.ortvalue_from_numpy(a)
    assert v.__dlpack_device__() == (1, 0)  # kDLCPU
    b = np.from_dlpack(v)
    assert b.dtype == a.dtype and b.shape == a.shape
    np.testing.assert_array_equal(b, a)
    assert b.ctypes.data == a.ctypes.data  # zero copy
    w = ox.OrtValue.from_dlpack(a)
    assert w.data_ptr() == a.ctypes.data and w.shape() == [3, 4]
    np.testing.assert_array_equal(w.numpy(), a)
    # a value made from DLPack feeds a session like any other
    g = helper.make_graph(
        [helper.make_node("Identity", ["X"], ["Y"])],
        "id",
        [helper.make_tensor_value_info("X", helper.np_dtype_to_tensor_dtype(a.dtype), [3, 4])],
        [helper.make_tensor_value_info("Y", helper.np_dtype_to_tensor_dtype(a.dtype), [3, 4])],
    )
    s = ox.InferenceSession(
        _model(g.node, list(g.input), list(g.output)).SerializeToString(), providers=CPU
    )
    (out,) = s.run_with_ort_values(None, {"X": w})
    np.testing.assert_array_equal(np.from_dlpack(out), a)


def test_dlpack_interop_with_onnxruntime():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    theirs = ort.OrtValue.ortvalue_from_numpy(a)
    ours = ox.OrtValue.from_dlpack(theirs)
    assert ours.data_ptr() == theirs.data_ptr()
    back = ort.OrtValue.from_dlpack(ox.OrtValue.ortvalue_from_numpy(a))
    np.testing.assert_array_equal(back.numpy(), a)


# the module -----------------------------------------------------------------------------------

ESSENTIAL_NAMES = [
    "InferenceSession",
    "SessionOptions",
    "RunOptions",
    "OrtValue",
    "IOBinding",
    "SessionIOBinding",
    "NodeArg",
    "ModelMetadata",
    "GraphOptimizationLevel",
    "ExecutionMode",
    "ExecutionOrder",
    "OrtEpDevice",
    "get_available_providers",
    "get_all_providers",
    "get_device",
    "get_version_string",
    "get_build_info",
    "get_ep_devices",
    "register_execution_provider_library",
    "unregister_execution_provider_library",
    "set_default_logger_severity",
    "set_default_logger_verbosity",
    "enable_telemetry_events",
    "disable_telemetry_events",
    "preload_dlls",
    "capi",
]


def test_module_namespace_covers_onnxruntime_essentials():
    for name in ESSENTIAL_NAMES:
        assert hasattr(ort, name), f"onnxruntime has no {name}"
        assert hasattr(ox, name), f"onnxplug has no {name}"
    # the error classes through the attribute path scripts use after `import onnxruntime as ort`
    assert ox.capi.onnxruntime_pybind11_state.InvalidArgument is errors.InvalidArgument
    for enum in ("GraphOptimizationLevel", "ExecutionMode", "ExecutionOrder"):
        ours, theirs = getattr(ox, enum), getattr(ort, enum)
        assert {m.name: int(m) for m in ours} == {
            n: int(v) for n, v in theirs.__members__.items()
        }, enum


def test_outputs_that_are_inputs_or_initializers():
    w = np.array([1, 2], np.float32)
    m = _model(
        [],
        [_tv("X", [2])],
        [_tv("X", [2]), _tv("W", [2])],
        [numpy_helper.from_array(w, "W")],
    )
    ours, theirs = _both(m)
    x = np.array([5, 6], np.float32)
    for s in (ours, theirs):
        xo, wo = s.run(None, {"X": x})
        np.testing.assert_array_equal(xo, x)
        np.testing.assert_array_equal(wo, w)
    # the caller may modify what it gets without changing the session's initializer
    _, wo = ours.run(None, {"X": x})
    wo[:] = 0
    np.testing.assert_array_equal(ours.run(None, {"X": x})[1], w)
