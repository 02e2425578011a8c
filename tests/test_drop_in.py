"""``import onnxplug as ort`` as a one-line switch: each test runs the same script with
onnxruntime and with onnxplug and compares what a user sees (providers chosen, warnings,
errors, reported shapes, results).

Deliberate differences are asserted as such, with the reason next to them.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxplug as ox
from onnxplug import errors

ort = pytest.importorskip("onnxruntime")

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"
F = TensorProto.FLOAT
IR_VERSION, OPSET = 10, 21  # what the installed onnxruntime reads
CUDA_PLUGIN_SRC = Path(__file__).resolve().parents[1] / "plugins" / "cuda" / "src"


def _model(nodes, inputs, outputs, inits=(), opset=OPSET) -> bytes:
    g = helper.make_graph(list(nodes), "g", list(inputs), list(outputs), list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = IR_VERSION
    return m.SerializeToString()


def _tv(name: str, shape: Any, elem: int = F) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, shape)


def both(script: Callable[[Any], Any]) -> tuple[Any, Any]:
    """``script(module)`` with onnxruntime and with onnxplug: (theirs, ours)."""
    return script(ort), script(ox)


def _warnings_of(fn: Callable[[], Any]) -> tuple[Any, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    return out, [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


@pytest.fixture(scope="module")
def relu() -> bytes:
    return _model(
        [helper.make_node("Relu", ["x"], ["y"])], [_tv("x", ["n", 3])], [_tv("y", ["n", 3])]
    )


@pytest.fixture(autouse=True)
def no_installed_cuda_plugin(monkeypatch):
    """These scripts compare with onnxruntime on a machine without a usable GPU, as CI is: an
    onnxplug-cuda installed here anyway (a developer's venv) is hidden from the registry for
    the test, so that "not installed" is what both runtimes see. A usable one is left alone
    (the tests that need its absence skip)."""
    from onnxplug.ep.loader import REGISTRY

    if CUDA not in ox.get_available_providers():
        REGISTRY.libraries()  # entry points discovered first, so that the removal sticks
        monkeypatch.delitem(REGISTRY._libs, CUDA, raising=False)


@pytest.fixture
def cuda_without_gpu():
    """The real CUDA plugin, registered from the source tree on this GPU-less machine."""
    if str(CUDA_PLUGIN_SRC) not in sys.path:
        sys.path.insert(0, str(CUDA_PLUGIN_SRC))
    if CUDA in ox.get_available_providers():
        pytest.skip("this machine has a usable CUDA provider")
    ox.register_execution_provider_library(CUDA, "onnxplug_cuda:create_factory")
    yield
    ox.unregister_execution_provider_library(CUDA)


# 1. providers ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "providers",
    [[CUDA, CPU], [CUDA], ["TensorrtExecutionProvider", CUDA, CPU], CPU, (CPU,), [(CPU, {})]],
    ids=["cuda-cpu", "cuda", "trt-cuda-cpu", "bare-string", "tuple", "with-options"],
)
def test_providers_fall_back_to_cpu_as_in_onnxruntime(relu, providers):
    if CUDA in ort.get_available_providers() or CUDA in ox.get_available_providers():
        pytest.skip("this machine has CUDA")
    x = np.arange(-3, 3, dtype=np.float32).reshape(2, 3)

    def script(rt):
        sess, said = _warnings_of(lambda: rt.InferenceSession(relu, providers=providers))
        return sess.get_providers(), sess.run(None, {"x": x})[0], said

    (their_eps, theirs, their_said), (our_eps, ours, our_said) = both(script)
    assert our_eps == their_eps == [CPU]
    np.testing.assert_array_equal(ours, theirs)
    unavailable = [p for p in ([providers] if isinstance(providers, str) else providers)]
    if all(p == CPU or p == (CPU, {}) for p in unavailable):
        assert our_said == []  # a bare "CPUExecutionProvider" is one provider, not letters
        return
    # one warning (onnxruntime gives one per provider) naming each and how to get CUDA
    assert len(our_said) == 1, our_said
    assert CUDA in our_said[0] and "pip install onnxplug-cuda" in our_said[0]
    assert "Running on ['CPUExecutionProvider']" in our_said[0]
    assert their_said  # onnxruntime warns too


def test_cuda_plugin_without_a_device_says_why(relu, cuda_without_gpu):
    sess, said = _warnings_of(lambda: ox.InferenceSession(relu, providers=[CUDA, CPU]))
    assert sess.get_providers() == [CPU]
    assert len(said) == 1
    # the plugin's own reason (no cuda.bindings, no driver or no device)
    assert "installed but found no device" in said[0] and "cuda" in said[0].lower()
    assert sess.run(None, {"x": np.ones((1, 3), np.float32)})[0].shape == (1, 3)


def test_a_plugin_that_failed_to_load_says_why(relu, monkeypatch):
    from onnxplug.ep.loader import REGISTRY, RegisteredLibrary

    broken = RegisteredLibrary(CUDA, "onnxplug_cuda:create_factory", error="boom: no libcudart")
    monkeypatch.setattr(REGISTRY, "libraries", lambda: [*REGISTRY._libs.values(), broken])
    sess, said = _warnings_of(lambda: ox.InferenceSession(relu, providers=[CUDA, CPU]))
    assert sess.get_providers() == [CPU] and len(said) == 1 and "boom: no libcudart" in said[0]


@pytest.mark.parametrize("key", ["session.disable_cpu_ep_fallback", "session.strict_providers"])
def test_strictness_makes_an_unavailable_provider_an_error(relu, key):
    if CUDA in ox.get_available_providers():
        pytest.skip("this machine has CUDA")
    so = ox.SessionOptions()
    so.add_session_config_entry(key, "1")
    with pytest.raises(errors.InvalidArgument, match=f"'{CUDA}' is not installed.*{key}=1"):
        ox.InferenceSession(relu, so, providers=[CUDA])
    # onnxruntime refuses to run without the CPU fallback too (it fails later, as Fail)
    if key == "session.disable_cpu_ep_fallback":
        rso = ort.SessionOptions()
        rso.add_session_config_entry(key, "1")
        with pytest.raises(Exception, match="fallback to CPU EP has been explicitly disabled"):
            _warnings_of(lambda: ort.InferenceSession(relu, rso, providers=[CUDA]))


def test_set_providers_falls_back_the_same_way(relu):
    if CUDA in ox.get_available_providers():
        pytest.skip("this machine has CUDA")

    def script(rt):
        sess = rt.InferenceSession(relu, providers=[CPU])
        _, said = _warnings_of(lambda: sess.set_providers([CUDA, CPU]))
        return sess.get_providers(), len(said)

    theirs, ours = both(script)
    assert ours == ([CPU], 1) and theirs[0] == [CPU]


def test_duplicate_providers_are_ignored_with_a_warning(relu):
    def script(rt):
        sess, said = _warnings_of(lambda: rt.InferenceSession(relu, providers=[CPU, CPU]))
        return sess.get_providers(), said

    theirs, ours = both(script)
    assert ours == theirs


def test_get_all_providers_lists_onnxruntimes_names():
    ours, theirs = ox.get_all_providers(), ort.get_all_providers()
    assert set(theirs) <= set(ours), set(theirs) - set(ours)
    assert ours[-1] == CPU
    assert [p for p in ours if p in theirs] == theirs  # the same order


# 2. dimensions --------------------------------------------------------------------------------


def test_minus_one_dims_are_dynamic(relu):
    m = _model(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        [_tv("x", [-1, 4])],
        [_tv("y", [-1, -1])],
        [numpy_helper.from_array(np.ones((4, 2), np.float32), "w")],
    )
    x = np.arange(20, dtype=np.float32).reshape(5, 4)

    def script(rt):
        s = rt.InferenceSession(m, providers=[CPU])
        shapes = [list(a.shape) for a in (*s.get_inputs(), *s.get_outputs())]
        return shapes, s.run(None, {"x": x})[0], s.run(None, {"x": x[:1]})[0]

    theirs, ours = both(script)
    # unknown output dims take the sizes shape inference finds, as in onnxruntime
    assert ours[0] == theirs[0] == [[None, 4], [None, 2]]
    np.testing.assert_array_equal(ours[1], theirs[1])
    np.testing.assert_array_equal(ours[2], theirs[2])


def test_free_dimension_override_changes_reported_shapes(relu):
    def script(rt):
        so = rt.SessionOptions()
        so.add_free_dimension_override_by_name("n", 4)
        s = rt.InferenceSession(relu, so, providers=[CPU])
        try:
            s.run(None, {"x": np.ones((5, 3), np.float32)})
            err = None
        except Exception as e:
            err = str(e).split(" : ", 3)[-1]
        return s.get_inputs()[0].shape, s.get_outputs()[0].shape, err

    theirs, ours = both(script)
    assert ours == theirs
    assert ours[0] == [4, 3] and "Expected: 4" in ours[2]


# 4. options that must not be silently ignored -------------------------------------------------


def _gelu_block() -> tuple[bytes, np.ndarray]:
    """MatMul + bias + erf-Gelu + residual + LayerNormalization: fused at level >= 2."""
    rng = np.random.default_rng(0)
    h = 8
    consts = {
        "w": rng.standard_normal((h, h)),
        "b": rng.standard_normal(h),
        "sqrt2": np.sqrt(2.0),
        "one": 1.0,
        "half": 0.5,
        "gamma": rng.standard_normal(h),
        "beta": rng.standard_normal(h),
    }
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["mm"]),
        helper.make_node("Add", ["mm", "b"], ["a"]),
        helper.make_node("Div", ["a", "sqrt2"], ["d"]),
        helper.make_node("Erf", ["d"], ["e"]),
        helper.make_node("Add", ["e", "one"], ["e1"]),
        helper.make_node("Mul", ["a", "e1"], ["m"]),
        helper.make_node("Mul", ["m", "half"], ["g"]),
        helper.make_node("Add", ["g", "x"], ["r"]),
        helper.make_node("LayerNormalization", ["r", "gamma", "beta"], ["y"], epsilon=1e-5),
    ]
    inits = [numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in consts.items()]
    model = _model(nodes, [_tv("x", ["b", 4, h])], [_tv("y", ["b", 4, h])], inits)
    return model, rng.standard_normal((2, 4, h)).astype(np.float32)


@pytest.mark.parametrize("level", ["ORT_ENABLE_BASIC", "ORT_ENABLE_EXTENDED", "ORT_ENABLE_ALL"])
def test_optimized_model_filepath_writes_the_optimized_model(tmp_path, level):
    model, x = _gelu_block()
    ref = ort.InferenceSession(model, providers=[CPU]).run(None, {"x": x})[0]
    so = ox.SessionOptions()
    so.graph_optimization_level = getattr(ox.GraphOptimizationLevel, level)
    so.optimized_model_filepath = str(tmp_path / "opt.onnx")
    ox.InferenceSession(model, so, providers=[CPU])
    saved = onnx.load(so.optimized_model_filepath)
    ops = [n.op_type for n in saved.graph.node]
    if level == "ORT_ENABLE_BASIC":
        assert "Erf" in ops
    else:
        assert "Erf" not in ops and "SkipLayerNormalization" in ops, ops
    got = ox.InferenceSession(so.optimized_model_filepath, providers=[CPU]).run(None, {"x": x})
    np.testing.assert_allclose(got[0], ref, rtol=1e-4, atol=1e-5)
    if all(n.domain in ("", "com.microsoft") for n in saved.graph.node):
        # only onnxruntime's own ops: onnxruntime loads it too
        theirs = ort.InferenceSession(so.optimized_model_filepath, providers=[CPU])
        np.testing.assert_allclose(theirs.run(None, {"x": x})[0], ref, rtol=1e-4, atol=1e-5)


def test_optimized_model_with_external_initializers(tmp_path):
    model, x = _gelu_block()
    so = ox.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / "opt.onnx")
    so.add_session_config_entry(
        "session.optimized_model_external_initializers_file_name", "opt.data"
    )
    so.add_session_config_entry(
        "session.optimized_model_external_initializers_min_size_in_bytes", "16"
    )
    ox.InferenceSession(model, so, providers=[CPU])
    assert (tmp_path / "opt.data").stat().st_size > 0
    a = ox.InferenceSession(model, providers=[CPU]).run(None, {"x": x})[0]
    b = ox.InferenceSession(so.optimized_model_filepath, providers=[CPU]).run(None, {"x": x})[0]
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    so.optimized_model_filepath = str(tmp_path / "opt.ort")
    with pytest.raises(errors.InvalidArgument, match="ONNX models only"):
        ox.InferenceSession(model, so, providers=[CPU])


def test_intra_op_num_threads_bounds_blas_threads(monkeypatch):
    """While a run of a session with intra_op_num_threads=1 is in progress, numpy's BLAS
    uses one thread; afterwards it has its own count back."""
    from threadpoolctl import threadpool_info

    from onnxplug.providers.cpu.kernels import cpu_registry

    blas = [i for i in threadpool_info() if i["user_api"] == "blas"]
    if not blas or blas[0]["num_threads"] < 2:
        pytest.skip("numpy's BLAS runs one thread here anyway")
    before = blas[0]["num_threads"]
    _, matmul = cpu_registry().lookup("MatMul", "", 13)
    seen: list[int] = []
    compute = matmul.compute

    def observed(self, ctx):
        seen.append(next(i for i in threadpool_info() if i["user_api"] == "blas")["num_threads"])
        compute(self, ctx)

    monkeypatch.setattr(matmul, "compute", observed)
    m = _model(
        [helper.make_node("MatMul", ["x", "x"], ["y"])], [_tv("x", [4, 4])], [_tv("y", [4, 4])]
    )
    x = np.eye(4, dtype=np.float32)
    so = ox.SessionOptions()
    so.intra_op_num_threads = 1
    ox.InferenceSession(m, so, providers=[CPU]).run(None, {"x": x})
    ox.InferenceSession(m, providers=[CPU]).run(None, {"x": x})
    assert seen == [1, before]
    assert next(i for i in threadpool_info() if i["user_api"] == "blas")["num_threads"] == before


def test_parallel_execution_mode_says_it_runs_sequentially(relu, capsys):
    so = ox.SessionOptions()
    so.execution_mode = ox.ExecutionMode.ORT_PARALLEL
    so.inter_op_num_threads = 2
    s = ox.InferenceSession(relu, so, providers=[CPU])
    assert s.run(None, {"x": np.ones((1, 3), np.float32)})[0].shape == (1, 3)
    err = capsys.readouterr().err
    assert "[W:onnxplug:" in err and "ORT_PARALLEL" in err


def test_log_lines_as_onnxruntime_prints_them(relu, capfd):
    """Both print '<time> [<severity letter>:<runtime>:<logid>, <where>] <message>' lines on
    stderr at verbose severity."""
    for rt in (ort, ox):
        so = rt.SessionOptions()
        so.log_severity_level = 0
        so.logid = "mine"
        rt.InferenceSession(relu, so, providers=[CPU])
    err = capfd.readouterr().err
    assert "[V:onnxruntime:mine, " in err or "[I:onnxruntime:mine, " in err
    assert "[V:onnxplug:mine, " in err and "[I:onnxplug:mine, " in err
    so = ox.SessionOptions()
    so.log_severity_level = 0
    so.log_verbosity_level = 1
    ox.InferenceSession(relu, so, providers=[CPU])
    assert "graph optimization" in capfd.readouterr().err


# 6. kernel validation as strict as onnxruntime's ----------------------------------------------


def _outcome(rt, model: bytes, feeds: dict) -> tuple[str, Any]:
    """('ok', output shapes) or (error class name, message) of one run."""
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = rt.InferenceSession(model, providers=[CPU]).run(None, feeds)
        noise = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        return "ok", ([o.shape for o in out], noise)
    except Exception as e:
        return type(e).__name__, str(e)


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
@pytest.mark.parametrize("state_batch", [1, 3])
def test_recurrent_initial_state_batch_must_match(op, state_batch):
    gates, hidden, batch = {"RNN": 1, "GRU": 3, "LSTM": 4}[op], 3, 2
    names = ["X", "W", "R", "", "", "h0"] + (["c0"] if op == "LSTM" else [])
    feeds = {
        "X": np.ones((4, batch, 2), np.float32),
        "W": np.ones((1, gates * hidden, 2), np.float32),
        "R": np.ones((1, gates * hidden, hidden), np.float32),
        "h0": np.zeros((1, state_batch, hidden), np.float32),
    }
    if op == "LSTM":
        feeds["c0"] = np.zeros((1, state_batch, hidden), np.float32)
    node = helper.make_node(op, names, ["Y", "Yh"], hidden_size=hidden)
    model = _model([node], [_tv(k, None) for k in feeds], [_tv("Y", None), _tv("Yh", None)])
    theirs, ours = both(lambda rt: _outcome(rt, model, feeds))
    assert theirs[0] == ours[0] == "Fail", (theirs, ours)
    expect = f"Input initial_h must have shape {{1,{batch},{hidden}}}"
    assert expect in theirs[1] and expect in ours[1]


def test_average_pool_window_larger_than_the_padded_input():
    node = helper.make_node("AveragePool", ["x"], ["y"], kernel_shape=[5, 5], pads=[1, 1, 1, 1])
    model = _model([node], [_tv("x", None)], [_tv("y", None)])
    feeds = {"x": np.ones((1, 1, 2, 2), np.float32)}
    theirs, ours = both(lambda rt: _outcome(rt, model, feeds))
    assert ours == theirs == ("ok", ([(1, 1, 0, 0)], []))


def test_reflect_pad_larger_than_the_input():
    node = helper.make_node("Pad", ["x", "p"], ["y"], mode="reflect")
    model = _model([node], [_tv("x", None), _tv("p", None, TensorProto.INT64)], [_tv("y", None)])
    too_far = {"x": np.ones((2, 3), np.float32), "p": np.array([0, 4, 0, 0], np.int64)}
    theirs, ours = both(lambda rt: _outcome(rt, model, too_far))
    assert theirs[0] == ours[0] == "InvalidArgument"
    assert "pre-pad (4) exceeds maximum allowed (2) for axis 1" in ours[1]
    fits = {"x": np.ones((2, 3), np.float32), "p": np.array([1, 2, 1, 2], np.int64)}
    theirs, ours = both(lambda rt: _outcome(rt, model, fits))
    assert ours == theirs == ("ok", ([(4, 7)], []))


@pytest.mark.parametrize(
    ("op", "attrs", "error"),
    [
        ("MaxPool", {"kernel_shape": [2, 2]}, "Fail"),
        ("AveragePool", {"kernel_shape": [1, 1]}, "Fail"),
        ("GlobalAveragePool", {}, "Fail"),
        ("GlobalMaxPool", {}, "Fail"),
        ("Conv", {}, "InvalidArgument"),
    ],
)
def test_empty_spatial_inputs_are_invalid(op, attrs, error):
    ins = ["x", "w"] if op == "Conv" else ["x"]
    node = helper.make_node(op, ins, ["y"], **attrs)
    feeds = {"x": np.ones((1, 1, 0, 3), np.float32)}
    if op == "Conv":
        feeds["w"] = np.ones((1, 1, 1, 1), np.float32)
    model = _model([node], [_tv(k, None) for k in feeds], [_tv("y", None)])
    theirs, ours = both(lambda rt: _outcome(rt, model, feeds))
    assert theirs[0] == ours[0] == error, (theirs, ours)
    assert "Invalid input shape" in theirs[1] and "Invalid input shape" in ours[1]
    # an empty batch is fine
    feeds["x"] = np.ones((0, 1, 4, 4), np.float32)
    assert _outcome(ox, model, feeds)[0] == _outcome(ort, model, feeds)[0] == "ok"


@pytest.mark.parametrize(
    ("op", "x", "opset"),
    [
        ("Softplus", [1000.0, -1000.0], OPSET),
        ("Mish", [1000.0, -1000.0], 18),
        ("LpNormalization", [[1e30, 1e30]], OPSET),
        ("Selu", [-1000.0, 1e30], OPSET),
        ("Hardmax", [[np.inf, 1.0]], OPSET),
    ],
)
def test_reference_warnings_never_reach_the_user(op, x, opset):
    model = _model(
        [helper.make_node(op, ["x"], ["y"])], [_tv("x", None)], [_tv("y", None)], opset=opset
    )
    feeds = {"x": np.array(x, np.float32)}
    status, (_, noise) = _outcome(ox, model, feeds)
    assert status == "ok" and noise == []
