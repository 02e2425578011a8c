"""The onnx wheel's ``light`` models (AlexNet ... ZFNet) on the CPU provider.

Each model runs on the input onnx's backend runner generates for it and is compared with the
stored ``light_<model>_output_0.pb`` like the runner does (``assert_similar_outputs`` with the
model's rtol/atol from onnx's model test list). Every node must run on the CPU provider, and
every op of these models must have a native kernel: they are the speed gate of the CPU EP.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from benchmarks.cpu_light_models import LIGHT_DIR, MODELS, light_input
from onnx import numpy_helper
from onnx.backend.test.case.model import collect_testcases
from onnx.backend.test.runner import Runner

import onnxplug
from onnxplug.providers.cpu.kernels import cpu_registry
from onnxplug.providers.cpu.kernels.reference import ReferenceKernel

TOLERANCES = {c.model_name: (c.rtol, c.atol) for c in collect_testcases() if c.kind == "real"}


def test_model_list_matches_onnx() -> None:
    assert sorted(TOLERANCES) == sorted(MODELS)


@pytest.mark.parametrize("name", MODELS)
def test_light_model(name: str) -> None:
    path = LIGHT_DIR / f"light_{name}.onnx"
    model = onnx.load(str(path))
    feed_name, x = light_input(model)
    expected = numpy_helper.to_array(onnx.load_tensor(str(LIGHT_DIR / f"light_{name}_output_0.pb")))

    sess = onnxplug.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assignment = sess.get_provider_graph_assignment_info()
    assert assignment
    assert {r["ep"] for r in assignment} == {"CPUExecutionProvider"}
    (got,) = sess.run(None, {feed_name: x})

    rtol, atol = TOLERANCES[name]
    Runner.assert_similar_outputs([expected], [got], rtol=rtol, atol=atol)


def perturbed(model: onnx.ModelProto, seed: int = 0) -> onnx.ModelProto:
    """``model`` with each ConstantOfShape weight turned into a random initializer. The light
    models' weights are all one value, so their stored outputs are uniform (every class 0.001)
    and cannot tell a wrong kernel apart."""
    rng = np.random.default_rng(seed)
    m = onnx.ModelProto()
    m.CopyFrom(model)
    inits = {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}
    keep = []
    for n in m.graph.node:
        if n.op_type == "ConstantOfShape" and n.input[0] in inits:
            value = numpy_helper.to_array(n.attribute[0].t).reshape(-1)[0]
            shape = inits[n.input[0]].tolist()
            if (
                len(shape) >= 2
            ):  # conv/gemm weights: He-scaled, so activations neither vanish nor explode
                w = rng.normal(0, np.sqrt(2 / np.prod(shape[1:])), shape).astype(np.float32)
            else:  # biases, batch-norm statistics (variances stay positive)
                w = (value * rng.uniform(0.5, 1.5, shape)).astype(np.float32)
            m.graph.initializer.append(numpy_helper.from_array(w, n.output[0]))
        else:
            keep.append(n)
    del m.graph.node[:]
    m.graph.node.extend(keep)
    return m


@pytest.mark.parametrize("name", MODELS)
def test_light_model_random_weights_match_onnxruntime(name: str) -> None:
    ort = pytest.importorskip("onnxruntime")
    model = perturbed(onnx.load(str(LIGHT_DIR / f"light_{name}.onnx")))
    feed_name, x = light_input(model)
    data = model.SerializeToString()
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    (want,) = ort.InferenceSession(data, opts, providers=["CPUExecutionProvider"]).run(
        None, {feed_name: x}
    )
    (got,) = onnxplug.InferenceSession(data, providers=["CPUExecutionProvider"]).run(
        None, {feed_name: x}
    )
    assert np.unique(want).size > 100 and want.max() < 0.5  # classes differ, not saturated
    rtol, atol = TOLERANCES[name]
    Runner.assert_similar_outputs([want], [got], rtol=rtol, atol=atol)


@pytest.mark.parametrize("name", MODELS)
def test_light_model_ops_have_native_kernels(name: str) -> None:
    model = onnx.load(str(LIGHT_DIR / f"light_{name}.onnx"), load_external_data=False)
    version = model.opset_import[0].version
    registry = cpu_registry()
    for op in sorted({n.op_type for n in model.graph.node}):
        since = onnx.defs.get_schema(op, version).since_version
        hit = registry.lookup(op, "", since)
        assert hit is not None, op
        assert not issubclass(hit[1], ReferenceKernel), f"{op}-{since} runs onnx.reference"
