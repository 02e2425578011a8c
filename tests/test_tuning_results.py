"""Tuning results (onnxruntime's TunableOp results): ``InferenceSession.get_tuning_results`` and
``set_tuning_results``, their validation, and results embedded in a model's metadata.

The CPU provider does not tune, in onnxplug as in onnxruntime: the same script runs on both.
The CUDA provider's context is exercised on the host-simulated device (its validators, loading
and refusing results, TunableOp turned on by a model's results); that its GEMMs run what the
results say is a GPU test (tests/gpu/test_cuda_matmul_conv.py).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
import warnings

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from onnx import helper

import onnxplug as ox
from onnxplug.ep import TuningResultsManager
from onnxplug.errors import Fail, InvalidArgument

SIM = "CUDASimExecutionProvider"
CPU = "CPUExecutionProvider"
PROBE_OP, PROBE_PARAMS, PROBE_ID = "probe_but_not_an_op_signature", "probe_params", 10000000


def _model(metadata: str | None = None):
    g = helper.make_graph(
        [helper.make_node("MatMul", ["a", "b"], ["c"])],
        "g",
        [helper.make_tensor_value_info(n, 1, [2, 2]) for n in "ab"],
        [helper.make_tensor_value_info("c", 1, [2, 2])],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    if metadata is not None:
        m.metadata_props.add(key="tuning_results", value=metadata)
    return m


def _offline_tuning():
    """onnxruntime's ``tools/offline_tuning.py``, loaded from its file: importing it as
    ``onnxruntime.tools`` would add ``tools`` to onnxruntime's public names, which
    test_api_surface compares."""
    spec = importlib.util.find_spec("onnxruntime")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("onnxruntime is not installed")
    path = os.path.join(spec.submodule_search_locations[0], "tools", "offline_tuning.py")
    if not os.path.exists(path):
        pytest.skip("this onnxruntime has no tools/offline_tuning.py")
    module_spec = importlib.util.spec_from_file_location("ort_offline_tuning", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def sim():
    ox.register_execution_provider_library(SIM, "onnxplug_cuda.sim:create_factory")
    yield SIM
    ox.unregister_execution_provider_library(SIM)


def _results_of(sess, ep: str) -> dict:
    found = [tr for tr in sess.get_tuning_results() if tr["ep"] == ep]
    assert len(found) == 1
    return found[0]


def _with_probe(tr: dict) -> dict:
    tr = copy.deepcopy(tr)
    tr["results"][PROBE_OP] = {PROBE_PARAMS: PROBE_ID}
    return tr


@pytest.mark.parametrize("runtime", ["onnxplug", "onnxruntime"])
def test_a_provider_without_tuning_has_no_results_and_refuses_results(runtime):
    """The same script on onnxplug and onnxruntime (CPU provider only): no results; results
    for a provider the session lacks, or for one that does not tune, are skipped, or raise
    with ``error_on_invalid``."""
    rt = pytest.importorskip("onnxruntime") if runtime == "onnxruntime" else ox
    sess = rt.InferenceSession(_model().SerializeToString(), providers=[CPU])
    assert sess.get_tuning_results() == []
    assert sess.set_tuning_results([]) is None
    for ep, says in [
        ("CUDAExecutionProvider", "Cannot find execution provider CUDAExecutionProvider"),
        (CPU, "Invalid TuningResults (index=0). CPUExecutionProvider does not support TunableOp"),
    ]:
        tr = {"ep": ep, "results": {}, "validators": {}}
        sess.set_tuning_results([tr])
        with pytest.raises(RuntimeError, match=re.escape(says)):
            sess.set_tuning_results([tr], error_on_invalid=True)


def test_the_cuda_providers_results_load_only_where_their_validators_hold(sim):
    """onnxruntime's own test of the API (onnxruntime_test_python.py), on the CUDA provider:
    its results name it and carry validators; an unknown provider, a missing validator, an
    extra one and a mismatching value are refused (a warning, or an error with
    ``error_on_invalid``) and load nothing; matching results load."""
    sess = ox.InferenceSession(_model().SerializeToString(), providers=[sim, CPU])
    tr = _results_of(sess, sim)
    assert set(tr) == {"ep", "results", "validators"} and tr["results"] == {}
    assert set(tr["validators"]) == {
        "ORT_VERSION",
        "CUDA_VERSION",
        "DEVICE_MODEL",
        "CUBLASLT_VERSION",
    }
    assert tr["validators"]["ORT_VERSION"] == ox.__version__
    assert tr["validators"]["DEVICE_MODEL"] == "host-simulated CUDA device"

    def refused(edit, says: str) -> None:
        bad = _with_probe(tr)
        edit(bad)
        sess.set_tuning_results([bad])
        with pytest.raises(Fail, match=says):
            sess.set_tuning_results([bad], error_on_invalid=True)
        assert PROBE_OP not in _results_of(sess, sim)["results"]

    refused(lambda t: t.update(ep="UnknownEP"), "Cannot find execution provider UnknownEP")
    refused(
        lambda t: t["validators"].pop("ORT_VERSION"),
        'ORT_VERSION" is not provided for validation',
    )
    refused(
        lambda t: t["validators"].update(NOT_A_VALIDATOR_KEY="NOT_USED"),
        'NOT_A_VALIDATOR_KEY" is provided, but onnxplug is unable to consume it',
    )
    refused(
        lambda t: t["validators"].update(ORT_VERSION="This is not a proper ORT_VERSION value!"),
        "Failed to load TuningResults .*version mismatch",
    )
    refused(lambda t: t["validators"].update(DEVICE_MODEL="NVIDIA A100"), "Device model mismatch")
    sess.set_tuning_results([_with_probe(tr)], error_on_invalid=True)
    assert _results_of(sess, sim)["results"][PROBE_OP][PROBE_PARAMS] == PROBE_ID


def test_results_that_are_not_tuning_results_are_an_invalid_argument(sim):
    sess = ox.InferenceSession(_model().SerializeToString(), providers=[sim, CPU])
    tr = _results_of(sess, sim)
    for bad, says in [
        ("nope", "must be a list of dicts"),
        ([{"ep": sim, "results": {}}], r"\(index=0\) have no 'validators'"),
        ([tr, {**tr, "results": {"op": {"p": "3"}}}], r"\(index=1\): 'results' must map"),
        ([{**tr, "results": {"op": {"p": True}}}], "params signature -> kernel id"),
    ]:
        with pytest.raises(InvalidArgument, match=says):
            sess.set_tuning_results(bad)


def test_results_embedded_in_the_model_are_loaded_and_turn_tunable_op_on(sim):
    """A model's ``tuning_results`` metadata (what onnxruntime.tools.offline_tuning embeds)
    loads at creation and turns the provider's TunableOp on before its kernels are made;
    results it cannot use are skipped with a warning, and malformed metadata is an error."""
    plain = ox.InferenceSession(_model().SerializeToString(), providers=[sim, CPU])
    assert plain.get_provider_options()[sim]["tunable_op_enable"] == "0"
    tr = _results_of(plain, sim)
    tr["results"][PROBE_OP] = {"embedded": 3}
    model = _model(json.dumps([tr]))
    sess = ox.InferenceSession(model.SerializeToString(), providers=[sim, CPU])
    assert sess.get_provider_options()[sim]["tunable_op_enable"] == "1"
    assert _results_of(sess, sim)["results"][PROBE_OP]["embedded"] == 3
    np.testing.assert_array_equal(
        sess.run(None, {"a": np.eye(2, dtype=np.float32), "b": np.ones((2, 2), np.float32)})[0],
        np.ones((2, 2), np.float32),
    )
    stale = copy.deepcopy(tr)
    stale["validators"]["CUBLASLT_VERSION"] = "1"
    off = ox.InferenceSession(_model(json.dumps([stale])).SerializeToString(), providers=[sim])
    assert off.get_provider_options()[sim]["tunable_op_enable"] == "0"
    with pytest.raises(InvalidArgument, match="'tuning_results' metadata is not JSON"):
        ox.InferenceSession(_model("{not json").SerializeToString(), providers=[sim])
    with pytest.raises(InvalidArgument, match="'tuning_results' metadata: .*list of dicts"):
        ox.InferenceSession(_model("3").SerializeToString(), providers=[sim])


def test_results_round_trip_through_onnxruntimes_offline_tuning_tool(sim, tmp_path):
    """Results taken from a session, embedded by onnxruntime's own tool, extracted again, load
    into a new session."""
    offline_tuning = _offline_tuning()
    sess = ox.InferenceSession(_model().SerializeToString(), providers=[sim, CPU])
    tr = _with_probe(_results_of(sess, sim))
    model = _model()
    offline_tuning.embed(model, [tr])
    assert offline_tuning.extract(model) == [tr]
    again = ox.InferenceSession(model.SerializeToString(), providers=[sim, CPU])
    assert _results_of(again, sim)["results"][PROBE_OP][PROBE_PARAMS] == PROBE_ID


@given(
    st.lists(
        st.tuples(st.sampled_from("ab"), st.sampled_from("xyz"), st.integers(0, 5)), max_size=30
    )
)
def test_a_signature_keeps_the_first_kernel_id_it_was_given(entries):
    """The manager's invariant (onnxruntime's ``TuningResultsManager``): each (op, params)
    pair keeps the first id it got, whether added or loaded, and a different id later warns."""
    manager = TuningResultsManager()
    first: dict[tuple[str, str], int] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, (op, params, kernel) in enumerate(entries):
            if i % 2:
                manager.load({op: {params: kernel}})
            else:
                assert manager.add(op, params, kernel) == first.get((op, params), kernel)
            first.setdefault((op, params), kernel)
    conflicts = sum(1 for op, params, kernel in entries if first[(op, params)] != kernel)
    assert len([w for w in caught if "already has kernel" in str(w.message)]) == conflicts
    for (op, params), kernel in first.items():
        assert manager.lookup(op, params) == kernel
    assert manager.lookup("c", "x") == -1
    assert sum(len(k) for k in manager.dump().values()) == len(first)
