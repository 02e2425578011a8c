"""The model tests shipped in the onnx wheel (``simple``, ``pytorch-converted`` and
``pytorch-operator``) on the CPU provider, against their stored outputs.

Each test folder holds ``model.onnx`` and ``test_data_set_*/{input,output}_*.pb``. Inputs are
read as the model's input types say (tensor, sequence or optional), like onnx's backend
runner does, and outputs are compared with the test's rtol/atol (onnx's loader: 1e-3/1e-7
unless the folder's data.json says otherwise).
"""

from __future__ import annotations

import glob
import os
from typing import Any

import onnx
import pytest
from onnx import numpy_helper
from onnx.backend.test.loader import load_model_tests

import onnxplug as ox
from onnxplug.tools.conformance import compare_outputs

CPU = ["CPUExecutionProvider"]
KINDS = ("simple", "pytorch-converted", "pytorch-operator")

# Known failures that are not ours to fix, with the reason (strict: a pass fails the test).
XFAIL = {
    "test_gradient_of_add": "Gradient (ai.onnx.preview.training) differentiates the graph: a "
    "training feature no inference runtime implements (onnxruntime fails it too)",
    "test_gradient_of_add_and_mul": "Gradient (ai.onnx.preview.training) differentiates the "
    "graph: a training feature no inference runtime implements (onnxruntime fails it too)",
}


def _cases() -> list[Any]:
    params = []
    for kind in KINDS:
        for tc in sorted(load_model_tests(kind=kind), key=lambda t: t.name):
            marks = []
            if tc.name in XFAIL:
                marks.append(pytest.mark.xfail(strict=True, reason=XFAIL[tc.name]))
            params.append(pytest.param(tc, id=f"{kind}/{tc.name}", marks=marks))
    return params


CASES = _cases()


def test_the_wheel_ships_the_expected_model_tests():
    counts = {k: sum(1 for p in CASES if p.id.startswith(k + "/")) for k in KINDS}
    # onnx 1.23: 23 simple, 82 pytorch-converted, 35 pytorch-operator
    assert counts["simple"] >= 23 and counts["pytorch-converted"] >= 82
    assert counts["pytorch-operator"] >= 35


def _load(path: str, type_proto: onnx.TypeProto) -> Any:
    with open(path, "rb") as f:
        data = f.read()
    if type_proto.HasField("sequence_type"):
        seq = onnx.SequenceProto()
        seq.ParseFromString(data)
        return numpy_helper.to_list(seq)
    if type_proto.HasField("optional_type"):
        opt = onnx.OptionalProto()
        opt.ParseFromString(data)
        return numpy_helper.to_optional(opt)
    t = onnx.TensorProto()
    t.ParseFromString(data)
    return numpy_helper.to_array(t)


@pytest.mark.parametrize("case", CASES)
def test_model(case) -> None:
    path = os.path.join(case.model_dir, "model.onnx")
    model = onnx.load(path)
    sess = ox.InferenceSession(path, providers=CPU)
    assert {r["ep"] for r in sess.get_provider_graph_assignment_info()} == set(CPU)
    types = {vi.name: vi.type for vi in model.graph.input}
    types.update({vi.name: vi.type for vi in model.graph.output})
    inputs = [i.name for i in sess.get_inputs()]
    outputs = [o.name for o in sess.get_outputs()]
    data_sets = sorted(glob.glob(os.path.join(case.model_dir, "test_data_set_*")))
    assert data_sets, "no test data"
    for ds in data_sets:
        n_in = len(glob.glob(os.path.join(ds, "input_*.pb")))
        n_out = len(glob.glob(os.path.join(ds, "output_*.pb")))
        assert n_in <= len(inputs) and n_out == len(outputs)
        feeds = {
            inputs[i]: _load(os.path.join(ds, f"input_{i}.pb"), types[inputs[i]])
            for i in range(n_in)
        }
        expect = [
            _load(os.path.join(ds, f"output_{i}.pb"), types[outputs[i]]) for i in range(n_out)
        ]
        got = sess.run(None, feeds)
        compare_outputs(expect, got, rtol=case.rtol, atol=case.atol)
