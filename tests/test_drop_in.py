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
