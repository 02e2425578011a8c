"""Weights lifted from a serialized model (ir.wire, ir.model.load_model): every initializer
reads as protobuf and numpy_helper read it, the rest of the model parses to the same proto,
and models the scan leaves to protobuf (a repeated graph field, a repeated raw_data, types
numpy cannot view) load as they did."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

import onnxplug as ox
from onnxplug import errors
from onnxplug.ir import wire
from onnxplug.ir.model import load_model

CPU = ["CPUExecutionProvider"]

_NUMPY_TYPES = {
    TensorProto.FLOAT: np.float32,
    TensorProto.DOUBLE: np.float64,
    TensorProto.FLOAT16: np.float16,
    TensorProto.INT8: np.int8,
    TensorProto.INT16: np.int16,
    TensorProto.INT32: np.int32,
    TensorProto.INT64: np.int64,
    TensorProto.UINT8: np.uint8,
    TensorProto.UINT16: np.uint16,
    TensorProto.UINT32: np.uint32,
    TensorProto.UINT64: np.uint64,
    TensorProto.BOOL: np.bool_,
}


def _model(inits, nodes=None, out="y"):
    nodes = nodes or [helper.make_node("Identity", [inits[0].name], [out])]
    g = helper.make_graph(nodes, "g", [], [onnx.ValueInfoProto(name=out)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


def _tensor(name, elem, shape, seed):
    rng = np.random.default_rng(seed)
    values = rng.integers(0, 100, size=shape)
    return numpy_helper.from_array(values.astype(_NUMPY_TYPES[elem]), name)


def _expected(model):
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def _restored(loaded):
    """The loaded proto with the lifted weights written back into it."""
    proto = onnx.ModelProto()
    proto.CopyFrom(loaded.proto)
    for t in proto.graph.initializer:
        if t.name in loaded.weights:
            t.raw_data = loaded.weights[t.name].tobytes()
    return proto


@settings(max_examples=60, deadline=None)
@given(
    specs=st.lists(
        st.tuples(
            st.sampled_from(sorted(_NUMPY_TYPES)),
            st.lists(st.integers(0, 5), max_size=3),
            st.integers(0, 2**31),
        ),
        min_size=1,
        max_size=6,
    ),
    doc=st.text(max_size=20),
)
def test_lifted_weights_read_as_protobuf_reads_them(specs, doc):
    """Any mix of types, shapes (empty ones too) and odd offsets: the weights equal
    numpy_helper's arrays, and the proto without them is the model's proto."""
    inits = [_tensor(f"w{k}", e, shape, seed) for k, (e, shape, seed) in enumerate(specs)]
    model = _model(inits)
    model.graph.doc_string = doc  # fields after the initializers move with them
    data = model.SerializeToString()
    loaded = load_model(data)
    assert set(loaded.weights) == {t.name for t in inits}
    for name, want in _expected(model).items():
        got = loaded.weights[name]
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
        assert not got.flags.writeable
        assert got.size == 0 or got.ctypes.data % 64 == 0
    assert _restored(loaded) == model


def test_types_numpy_cannot_view_stay_in_the_proto():
    """bfloat16 and 4-bit weights are not lifted: numpy_helper converts them as before."""
    bf = helper.make_tensor("bf", TensorProto.BFLOAT16, [3], [1.0, 2.0, -3.5])
    i4 = helper.make_tensor("i4", TensorProto.INT4, [3], [1, -2, 7])
    f = numpy_helper.from_array(np.arange(6, dtype=np.float32), "f")
    model = _model([bf, i4, f])
    loaded = load_model(model.SerializeToString())
    assert set(loaded.weights) == {"f"}
    kept = {t.name: t for t in loaded.proto.graph.initializer}
    np.testing.assert_array_equal(numpy_helper.to_array(kept["bf"]), numpy_helper.to_array(bf))
    np.testing.assert_array_equal(numpy_helper.to_array(kept["i4"]), [1, -2, 7])


def test_a_repeated_graph_field_is_merged_by_protobuf():
    """Protobuf merges a message field written twice (the initializers of both copies): the
    scan leaves such a model to protobuf, and the session sees both weights."""
    a = _model([numpy_helper.from_array(np.ones(4, np.float32), "a")], out="y")
    extra = onnx.ModelProto()
    extra.graph.initializer.append(numpy_helper.from_array(np.full(4, 2, np.float32), "b"))
    data = a.SerializeToString() + extra.SerializeToString()
    assert wire.strip_raw_data(memoryview(data)) is None
    loaded = load_model(data)
    assert loaded.weights == {}
    assert [t.name for t in loaded.proto.graph.initializer] == ["a", "b"]


def _field(number, payload):
    return wire._key(number, 2) + wire._varint_bytes(len(payload)) + payload


def test_a_repeated_raw_data_keeps_the_last_as_protobuf_does():
    t = numpy_helper.from_array(np.ones(4, np.float32), "w")
    last = np.full(4, 7, np.float32).tobytes()
    tensor = t.SerializeToString() + _field(wire.TENSOR_RAW_DATA, last)
    model = _model([t])
    del model.graph.initializer[:]
    graph = model.graph.SerializeToString() + _field(wire.GRAPH_INITIALIZER, tensor)
    model.ClearField("graph")
    data = model.SerializeToString() + _field(wire.MODEL_GRAPH, graph)
    assert onnx.load_from_string(data).graph.initializer[0].raw_data == last
    loaded = load_model(data)
    assert loaded.weights == {}
    np.testing.assert_array_equal(numpy_helper.to_array(loaded.proto.graph.initializer[0]), 7)


def test_repeated_initializer_names_are_not_lifted():
    """A name given twice is refused by the session as before (the scan keeps both in the
    proto, so validation sees what protobuf would give it)."""
    w = numpy_helper.from_array(np.ones(4, np.float32), "w")
    loaded = load_model(_model([w, w]).SerializeToString())
    assert loaded.weights == {}
    assert all(len(t.raw_data) == 16 for t in loaded.proto.graph.initializer)


def test_a_lifted_weight_of_the_wrong_size_is_named():
    t = numpy_helper.from_array(np.ones(4, np.float32), "w")
    t.raw_data = t.raw_data[:14]
    with pytest.raises(errors.InvalidGraph, match=r"initializer 'w'.*needs 4 values but holds -1"):
        ox.InferenceSession(_model([t]).SerializeToString(), providers=CPU)
    t.raw_data = b"\0" * 12
    with pytest.raises(errors.InvalidGraph, match=r"initializer 'w'.*needs 4 values but holds 3"):
        ox.InferenceSession(_model([t]).SerializeToString(), providers=CPU)


@pytest.mark.parametrize("cut", [1, 7, 100])
def test_truncated_bytes_fail_as_protobuf_fails(cut):
    model = _model([numpy_helper.from_array(np.ones(64, np.float32), "w")])
    data = model.SerializeToString()[:-cut]
    with pytest.raises(errors.InvalidProtobuf, match="Protobuf parsing failed"):
        ox.InferenceSession(data, providers=CPU)


@pytest.mark.parametrize("kind", ["bytes", "bytearray", "memoryview", "strided", "path"])
def test_a_session_from_any_source_runs_on_the_lifted_weights(tmp_path, kind):
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    x = np.ones((2, 3), np.float32)
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
        [numpy_helper.from_array(w, "w")],
    )
    data = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]).SerializeToString()
    if kind == "path":
        (tmp_path / "m.onnx").write_bytes(data)
        src = str(tmp_path / "m.onnx")
    elif kind == "strided":  # a non-contiguous view of the bytes
        src = memoryview(bytes(b for c in data for b in (c, 0)))[::2]
    else:
        src = {"bytes": data, "bytearray": bytearray(data), "memoryview": memoryview(data)}[kind]
    (y,) = ox.InferenceSession(src, providers=CPU).run(None, {"x": x})
    np.testing.assert_array_equal(y, x @ w)
