"""onnxplug.integrations without Ray: feeding model inputs from columns and JSON values,
provider choice per actor, the Ray Data predictor called on batches directly, and the serving
logic of a Ray Serve replica (request checks, batching, splitting, health). The same code on a
local Ray cluster is in test_ray.py."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

from onnxplug.errors import EngineError, InvalidArgument
from onnxplug.integrations.model_io import TensorInput, tensor_inputs
from onnxplug.integrations.ray import (
    OnnxPredictor,
    ServingModel,
    encode_outputs,
    providers_for_actor,
)
from tests.integration_models import tabular_expected, tabular_model, total_model

CPU, CUDA = "CPUExecutionProvider", "CUDAExecutionProvider"
MODEL = tabular_model().SerializeToString()


def _spec(dtype, shape, type_name="tensor(float)", name="x"):
    return TensorInput(name, type_name, np.dtype(dtype), shape)


# import cost ----------------------------------------------------------------------------------


def test_importing_onnxplug_and_the_ray_module_imports_no_ray():
    code = (
        "import sys, onnxplug, onnxplug.integrations.ray as r; "
        "print(sorted(m for m in ('ray', 'pandas', 'starlette', 'pyarrow') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# model_io ---------------------------------------------------------------------------------------


def test_convert_casts_within_a_kind():
    spec = _spec(np.float32, ("N", 2))
    got = spec.convert(np.array([[1.5, 2.0]], np.float64), "column 'c'")
    assert got.dtype == np.float32 and got.tolist() == [[1.5, 2.0]]
    assert spec.convert([[1, 2]], "v").dtype == np.float32  # integers to a float input
    u8 = _spec(np.uint8, ("N",), "tensor(uint8)")
    assert u8.convert([0, 255], "v").tolist() == [0, 255]
    bf = _spec(ml_dtypes.bfloat16, ("N",), "tensor(bfloat16)")
    assert bf.convert([1.5], "v").dtype == np.dtype(ml_dtypes.bfloat16)
    text = _spec(object, ("N",), "tensor(string)")
    got = text.convert(["a", "bc"], "v")
    assert got.dtype == np.dtype(object) and got.tolist() == ["a", "bc"]


@pytest.mark.parametrize(
    "value, why",
    [
        ([[1.5, 2.0]], "float64 values"),  # floats for an integer input
        ([["a", "b"]], "text values"),
        ([[1, 2], [3]], "not a rectangular array"),
        ([[2**40, 1]], "outside int32's range"),
        ([1, 2], "(rank 1), not rank 2"),
        ([[1, 2, 3]], "dimension 1 is 3, the model's is 2"),
    ],
)
def test_convert_errors_name_the_input_and_the_source(value, why):
    spec = _spec(np.int32, ("N", 2), "tensor(int32)", name="ids")
    with pytest.raises(InvalidArgument) as e:
        spec.convert(value, "column 'tokens'")
    msg = str(e.value)
    assert "model input 'ids' (tensor(int32), shape [N, 2])" in msg
    assert "column 'tokens'" in msg and why in msg


def test_a_fixed_batch_of_one_says_so():
    with pytest.raises(InvalidArgument, match="one row at a time"):
        _spec(np.float32, (1, 2)).convert(np.zeros((4, 2)), "v")


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from([np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32]),
    values=st.lists(st.integers(-(2**40), 2**40), min_size=1, max_size=6),
)
def test_integers_convert_exactly_when_the_type_holds_them(dtype, values):
    spec = _spec(dtype, ("N",), "tensor(int)")
    info = np.iinfo(dtype)
    if info.min <= min(values) and max(values) <= info.max:
        got = spec.convert(values, "v")
        assert got.dtype == np.dtype(dtype) and got.tolist() == values
    else:
        with pytest.raises(InvalidArgument, match="range"):
            spec.convert(values, "v")


def test_non_tensor_inputs_are_refused_by_name():
    from onnxplug.session.inference_session import NodeArg

    with pytest.raises(InvalidArgument, match="model input 'items' is a seq"):
        tensor_inputs([NodeArg("items", "seq(tensor(float))", [])])


# providers per actor ---------------------------------------------------------------------------


def test_default_providers_follow_the_actors_gpus():
    assert providers_for_actor(None, None, []) == [(CPU, {})]
    assert providers_for_actor(None, None, [0]) == [(CUDA, {}), (CPU, {})]
    # outside Ray: what onnxplug has
    assert providers_for_actor(None, None, None) == [(CPU, {})]


def test_given_providers_keep_their_options_and_lose_the_gpu_without_one(caplog):
    given_providers = [(CUDA, {"use_tf32": 0}), CPU]
    assert providers_for_actor(given_providers, None, [1]) == [
        (CUDA, {"use_tf32": 0}),
        (CPU, {}),
    ]
    assert providers_for_actor([CUDA, CPU], [{"device_id": 0}, {}], [0])[0] == (
        CUDA,
        {"device_id": 0},
    )
    with caplog.at_level(logging.WARNING, logger="onnxplug"):
        assert providers_for_actor(given_providers, None, []) == [(CPU, {})]
        assert providers_for_actor([CUDA], None, []) == [(CPU, {})]
    assert "num_gpus" in caplog.text and CUDA in caplog.text


def test_bad_provider_arguments():
    with pytest.raises(InvalidArgument, match="2 entries for 1 providers"):
        providers_for_actor([CPU], [{}, {}], None)
    with pytest.raises(InvalidArgument, match="list of names"):
        providers_for_actor(CPU, None, None)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="without providers"):
        providers_for_actor(None, [{}], None)


# the Ray Data predictor, called directly -------------------------------------------------------


def _rows(n, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, 4)), rng.integers(-50, 50, n)


def test_predictor_on_numpy_batches_maps_columns_both_ways():
    x, k = _rows(7)
    p = OnnxPredictor(
        MODEL,
        input_columns={"x": "features", "k": "count"},
        output_columns={"s": "score", "z": "tripled"},
        keep_columns=["id"],
    )
    out = p({"features": x, "count": k, "id": np.arange(7), "unused": np.zeros(7)})
    want = tabular_expected(x, k)
    assert list(out) == ["score", "tripled", "id"]
    np.testing.assert_array_equal(out["score"], want["s"])
    np.testing.assert_array_equal(out["tripled"], want["z"])
    np.testing.assert_array_equal(out["id"], np.arange(7))
    again = p({"features": x[:2], "count": k[:2], "id": np.arange(2)})  # same session, reused
    np.testing.assert_array_equal(again["score"], want["s"][:2])


def test_predictor_on_pandas_batches_with_tensor_cells_and_stacked_columns():
    pd = pytest.importorskip("pandas")
    x, k = _rows(5, seed=1)
    cells = pd.DataFrame({"x": list(x), "k": k})  # one array per cell, as Ray gives them
    out = OnnxPredictor(MODEL, keep_columns=["x"])(cells)
    want = tabular_expected(x, k)
    assert isinstance(out, pd.DataFrame) and list(out.columns) == ["y", "s", "z", "x"]
    assert out["x"].dtype == object and (np.stack(out["x"].to_numpy()) == x).all()
    np.testing.assert_array_equal(np.stack(out["y"].to_numpy()), want["y"])
    np.testing.assert_array_equal(out["s"].to_numpy(), want["s"])
    tabular = pd.DataFrame({f"f{i}": x[:, i] for i in range(4)} | {"k": k}, index=range(10, 15))
    p = OnnxPredictor(
        MODEL, input_columns={"x": ["f0", "f1", "f2", "f3"], "k": "k"}, output_columns=["z"]
    )
    out = p(tabular)
    assert list(out.index) == list(range(10, 15))
    np.testing.assert_array_equal(out["z"].to_numpy(), want["z"])


def test_predictor_errors_name_the_model_input_and_the_column():
    x, k = _rows(3)
    p = OnnxPredictor(MODEL, input_columns={"x": "features", "k": "count"})
    with pytest.raises(InvalidArgument) as e:
        p({"features": x, "counts": k})
    assert "model input 'k' reads column 'count'" in str(e.value)
    assert "['features', 'counts']" in str(e.value)
    with pytest.raises(InvalidArgument) as e:
        p({"features": x, "count": k + 0.5})
    assert "model input 'k'" in str(e.value) and "column 'count'" in str(e.value)
    with pytest.raises(InvalidArgument) as e:
        p({"features": x[:, :3], "count": k})
    assert "model input 'x'" in str(e.value) and "column 'features'" in str(e.value)
    ragged = np.empty(2, dtype=object)
    ragged[0], ragged[1] = np.zeros(4), np.zeros(3)
    with pytest.raises(InvalidArgument, match="column 'features', whose rows have different"):
        p({"features": ragged, "count": k[:2]})


def test_predictor_argument_errors():
    with pytest.raises(InvalidArgument, match=r"\['nope'\], which are not model inputs"):
        OnnxPredictor(MODEL, input_columns={"x": "a", "k": "b", "nope": "c"})
    with pytest.raises(InvalidArgument, match=r"no column for model input\(s\) \['k'\]"):
        OnnxPredictor(MODEL, input_columns={"x": "a"})
    with pytest.raises(InvalidArgument, match=r"\['w'\], which are not model outputs"):
        OnnxPredictor(MODEL, output_columns=["y", "w"])
    with pytest.raises(InvalidArgument, match="also output columns"):
        OnnxPredictor(MODEL, keep_columns=["y"])
    with pytest.raises(TypeError, match="batch_format"):
        OnnxPredictor(MODEL)([("x", 1)])


def test_predictor_needs_one_output_row_per_input_row():
    p = OnnxPredictor(total_model().SerializeToString(), output_columns={"total": "t"})
    with pytest.raises(InvalidArgument, match="model output 'total' is \\(1,\\) for a batch of 3"):
        p({"x": np.ones((3, 2), np.float32)})


# the serving logic -----------------------------------------------------------------------------


def _json(inputs, outputs=None):
    doc = {"inputs": inputs} | ({"outputs": outputs} if outputs is not None else {})
    return json.dumps(doc).encode()


def test_serving_batches_compatible_requests_into_one_run_and_splits_the_rows():
    model = ServingModel(MODEL)
    parts = [_rows(n, seed=n) for n in (1, 2, 3)]
    reqs = [model.request_from_json(_json({"x": x.tolist(), "k": k.tolist()})) for x, k in parts]
    results = model.infer(reqs)
    for (x, k), got in zip(parts, results):
        assert isinstance(got, dict)
        want = tabular_expected(x, k)
        for name in ("y", "s", "z"):
            np.testing.assert_array_equal(got[name], want[name])
    assert model.stats() == {
        "requests": 3,
        "batches": 1,
        "batch_sizes": {"3": 1},
        "runs": 1,
        "failures_in_a_row": 0,
    }
    # different outputs wanted: two groups, two runs
    x, k = parts[0]
    a = model.request({"x": x, "k": k}, ["s"])
    b = model.request({"x": x, "k": k}, ["z", "y"])
    ra, rb = model.infer([a, b])
    assert list(ra) == ["s"] and list(rb) == ["z", "y"]
    assert model.stats()["runs"] == 3


def test_serving_request_errors():
    model = ServingModel(MODEL)
    x, k = _rows(2)
    good = {"x": x.tolist(), "k": k.tolist()}
    cases = [
        (b"{not json", "not JSON"),
        (json.dumps([1, 2]).encode(), '{"inputs"'),
        (_json({**good, "extra": [1]}), "unknown input(s) ['extra']"),
        (_json({"x": good["x"]}), "missing input(s) ['k']"),
        (_json({**good, "x": [[1.0, 2.0]]}), "dimension 1 is 2, the model's is 4"),
        (_json({**good, "k": [1.5, 2.5]}), "model input 'k' (tensor(int64)"),
        (_json(good, ["nope"]), "unknown output(s) ['nope']"),
        (json.dumps({"inputs": good, "output": ["y"]}).encode(), "unknown request field"),
    ]
    for body, message in cases:
        with pytest.raises(InvalidArgument) as e:
            model.request_from_json(body)
        assert message in str(e.value), (body, str(e.value))


def test_serving_isolates_a_failing_request_and_tracks_health():
    model = ServingModel(MODEL)
    run = model.session.run

    def run_failing_on_999(names, feeds):
        if (feeds["k"] == 999).any():
            raise EngineError("device fault")
        if (feeds["k"] == 555).any():
            raise InvalidArgument("a shape the model rejects")
        return run(names, feeds)

    model.session.run = run_failing_on_999  # type: ignore[method-assign]
    x, k = _rows(2)

    def req(marker=None):
        kk = k.copy() if marker is None else np.full(2, marker)
        return model.request({"x": x, "k": kk})

    results = model.infer([req(), req(999), req(555), req()])
    assert isinstance(results[0], dict) and isinstance(results[3], dict)
    assert isinstance(results[1], EngineError)
    assert isinstance(results[2], InvalidArgument)  # the request's fault: health untouched
    model.check_health()
    for _ in range(3):
        (bad,) = model.infer([req(999)])
        assert isinstance(bad, EngineError)
    with pytest.raises(RuntimeError, match="the last 3 runs failed; the last with EngineError"):
        model.check_health()
    (good,) = model.infer([req()])
    assert isinstance(good, dict)
    model.check_health()


def test_serving_runs_requests_alone_when_outputs_are_not_per_row():
    model = ServingModel(total_model().SerializeToString())
    reqs = [model.request({"x": np.full((n, 2), n, np.float32)}) for n in (1, 2)]
    totals = [r["total"].tolist() for r in model.infer(reqs)]  # type: ignore[index]
    assert totals == [[2.0], [8.0]]
    assert model.stats()["runs"] == 3  # the batched run, then one per request
    model.infer(reqs)
    assert model.stats()["runs"] == 5  # never batched again


def test_serving_does_not_batch_a_model_with_a_fixed_first_dimension():
    model = ServingModel(tabular_model(batch=1).SerializeToString())
    x, k = _rows(1)
    results = model.infer([model.request({"x": x, "k": k}) for _ in range(3)])
    assert all(isinstance(r, dict) for r in results)
    assert model.stats()["runs"] == 3


def test_serving_npz_round_trip_and_json_encoding():
    model = ServingModel(MODEL)
    x, k = _rows(3)
    buf = io.BytesIO()
    np.savez(buf, x=x.astype(np.float32), k=k)
    request = model.request_from_npz(buf.getvalue(), ["y"])
    (result,) = model.infer([request])
    body, media_type = encode_outputs(result, request.binary)  # type: ignore[arg-type]
    assert media_type == "application/x-npz"
    with np.load(io.BytesIO(body)) as archive:
        np.testing.assert_array_equal(archive["y"], tabular_expected(x, k)["y"])
    with pytest.raises(InvalidArgument, match="not an .npz archive"):
        model.request_from_npz(b"plain text", None)
    body, media_type = encode_outputs(
        {"h": np.array([1.5], ml_dtypes.bfloat16), "n": np.array([1, 2])}, binary=False
    )
    assert media_type == "application/json"
    assert json.loads(body) == {"outputs": {"h": [1.5], "n": [1, 2]}}


def test_serving_metadata():
    meta = ServingModel(MODEL).metadata()
    assert meta["inputs"] == [
        {"name": "x", "type": "tensor(float)", "shape": ["N", 4]},
        {"name": "k", "type": "tensor(int64)", "shape": ["N"]},
    ]
    assert [o["name"] for o in meta["outputs"]] == ["y", "s", "z"]
    assert meta["providers"] == [CPU]


def test_models_with_sequence_inputs_are_refused_at_construction():
    graph = helper.make_graph(
        [helper.make_node("SequenceLength", ["items"], ["n"])],
        "seq",
        [helper.make_tensor_sequence_value_info("items", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("n", TensorProto.INT64, [])],
    )
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    with pytest.raises(InvalidArgument, match="model input 'items' is a seq"):
        ServingModel(m.SerializeToString())
