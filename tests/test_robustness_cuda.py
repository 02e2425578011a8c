"""The robustness checks on the CUDA provider's kernels: window attributes refused at load and,
where only the run can tell (a weight fed at run time), by the shared geometry the CUDA
kernels call; Pad never cropping below an empty dim; fresh outputs. Run on the host-simulated
CUDA device in CI and on a real GPU where there is one (``-m cuda``)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxplug as ox
from onnxplug import errors

PLUGIN_SRC = Path(__file__).resolve().parents[1] / "plugins" / "cuda" / "src"
SIM = "CUDASimExecutionProvider"
CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"
F = TensorProto.FLOAT


@pytest.fixture(
    scope="module",
    params=[
        SIM,
        pytest.param(
            CUDA,
            marks=[
                pytest.mark.cuda,
                pytest.mark.skipif(
                    CUDA not in ox.get_available_providers(), reason="no usable CUDA device"
                ),
            ],
        ),
    ],
)
def provider(request):
    if request.param == SIM:
        if str(PLUGIN_SRC) not in sys.path:
            sys.path.insert(0, str(PLUGIN_SRC))
        ox.register_execution_provider_library(SIM, "onnxplug_cuda.sim:create_factory")
        yield SIM
        ox.unregister_execution_provider_library(SIM)
    else:
        yield CUDA


def _model(nodes, inputs, outputs, inits=()):
    g = helper.make_graph(list(nodes), "g", list(inputs), list(outputs), list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]).SerializeToString()


def _session(model, provider):
    return ox.InferenceSession(model, providers=[provider, CPU])


def _ran_on(sess, node):
    return {r["ep"] for r in sess.get_provider_graph_assignment_info() if r["node_name"] == node}


@pytest.mark.parametrize(
    ("op", "attrs", "pattern"),
    [
        ("Conv", {"dilations": [-1, -1]}, "dilations must only contain positive values"),
        ("ConvTranspose", {"strides": [0, 2]}, "strides must only contain positive values"),
        ("MaxPool", {"kernel_shape": [2, 2], "pads": [0, -1, 0, 0]}, "pads must not contain"),
        ("AveragePool", {"kernel_shape": [2, 0]}, "kernel_shape must only contain positive"),
    ],
)
def test_bad_window_attributes_are_refused_at_load(provider, op, attrs, pattern):
    conv = op.startswith("Conv")
    model = _model(
        [helper.make_node(op, ["x", "w"] if conv else ["x"], ["y"], name="n", **attrs)],
        [helper.make_tensor_value_info("x", F, [1, 1, 6, 6])],
        [helper.make_tensor_value_info("y", F, None)],
        [numpy_helper.from_array(np.ones((1, 1, 3, 3), np.float32), "w")] if conv else [],
    )
    with pytest.raises(errors.Fail, match=f"{op} node 'n': .*{pattern}"):
        _session(model, provider)


def test_bad_windows_only_the_run_can_see_are_refused_by_the_kernel(provider):
    """Ranks unknown at load (x and w are fed): the provider's kernel meets the check in the
    shared geometry when it runs."""
    model = _model(
        [helper.make_node("Conv", ["x", "w"], ["y"], name="n", strides=[1, 1, 1])],
        [helper.make_tensor_value_info("x", F, None), helper.make_tensor_value_info("w", F, None)],
        [helper.make_tensor_value_info("y", F, None)],
    )
    sess = _session(model, provider)
    assert _ran_on(sess, "n") == {provider}
    feeds = {"x": np.ones((1, 1, 6, 6), np.float32), "w": np.ones((1, 1, 3, 3), np.float32)}
    with pytest.raises(errors.Fail, match="Conv node. Name:'n'.*strides has incorrect size"):
        sess.run(None, feeds)


def test_pad_never_crops_below_empty(provider):
    model = _model(
        [helper.make_node("Pad", ["x", "p"], ["y"], name="n")],
        [helper.make_tensor_value_info("x", F, [2, 2])],
        [helper.make_tensor_value_info("y", F, None)],
        [numpy_helper.from_array(np.array([-3, 0, 0, 0], np.int64), "p")],
    )
    sess = _session(model, provider)
    assert _ran_on(sess, "n") == {provider}
    with pytest.raises(errors.Fail, match="crop dim 0 of input \\[2, 2\\] to -1"):
        sess.run(None, {"x": np.ones((2, 2), np.float32)})


def test_outputs_are_fresh(provider):
    model = _model(
        [helper.make_node("Identity", ["x"], ["y"]), helper.make_node("Identity", ["x"], ["z"])],
        [helper.make_tensor_value_info("x", F, [2, 3])],
        [helper.make_tensor_value_info("y", F, None), helper.make_tensor_value_info("z", F, None)],
    )
    x = np.zeros((2, 3), np.float32)
    y, z = _session(model, provider).run(None, {"x": x})
    y[...] = 7
    assert not x.any() and not z.any()
