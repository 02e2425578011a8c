"""Every ONNX tensor element type round-trips through ``run()`` and ``OrtValue``; sequences and
optionals go in and out as Python lists and ``None``.

numpy arrays of ml_dtypes types (bfloat16, float8, int4, float4, int2, float6) are accepted as
feeds as they are; onnxruntime's Python binding rejects most of them.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import onnxplug as ox
from onnxplug import errors

CPU = ["CPUExecutionProvider"]
OPSET = onnx.defs.onnx_opset_version()
ALL_TYPES = [code for name, code in TensorProto.DataType.items() if name != "UNDEFINED"]


def _type_name(code: int) -> str:
    return TensorProto.DataType.Name(code).lower()


def _allowed(op: str, input_index: int = 0) -> set[int]:
    """Element types the op's schema allows for one input (at the newest opset)."""
    schema = onnx.defs.get_schema(op, OPSET)
    param = schema.inputs[input_index].type_str
    strs = next(
        tc.allowed_type_strs for tc in schema.type_constraints if tc.type_param_str == param
    )
    return {c for c in ALL_TYPES if f"tensor({_type_name(c)})" in strs}


# ml_dtypes' names for the types numpy lacks; the test fails if onnx adds a type not listed
ML_DTYPES = {
    TensorProto.BFLOAT16: ml_dtypes.bfloat16,
    TensorProto.FLOAT8E4M3FN: ml_dtypes.float8_e4m3fn,
    TensorProto.FLOAT8E4M3FNUZ: ml_dtypes.float8_e4m3fnuz,
    TensorProto.FLOAT8E5M2: ml_dtypes.float8_e5m2,
    TensorProto.FLOAT8E5M2FNUZ: ml_dtypes.float8_e5m2fnuz,
    TensorProto.UINT4: ml_dtypes.uint4,
    TensorProto.INT4: ml_dtypes.int4,
    TensorProto.FLOAT4E2M1: ml_dtypes.float4_e2m1fn,
}
for _name, _ml in [
    ("FLOAT8E8M0", "float8_e8m0fnu"),
    ("UINT2", "uint2"),
    ("INT2", "int2"),
    ("FLOAT6E2M3", "float6_e2m3fn"),
    ("FLOAT6E3M2", "float6_e3m2fn"),
]:
    if hasattr(TensorProto, _name) and hasattr(ml_dtypes, _ml):
        ML_DTYPES[getattr(TensorProto, _name)] = getattr(ml_dtypes, _ml)


def _np_dtype(code: int) -> np.dtype:
    if code in ML_DTYPES:
        return np.dtype(ML_DTYPES[code])
    if code == TensorProto.STRING:
        return np.dtype(object)
    return np.dtype(helper.tensor_dtype_to_np_dtype(code))


def _sample(code: int) -> np.ndarray:
    """A 2x3 array of ``code``'s type whose values the type represents exactly."""
    dt = _np_dtype(code)
    name = _type_name(code)
    if code == TensorProto.STRING:
        return np.array([["a", "bc", ""], ["dé", "e f", "x" * 40]], dtype=object)
    if code == TensorProto.BOOL:
        return np.array([[True, False, True], [False, False, True]])
    if dt.kind == "c":
        return (np.arange(6) + 1j * np.arange(6, 0, -1)).reshape(2, 3).astype(dt)
    if name == "float8e8m0":  # powers of two only, no zero or sign
        values = [1, 2, 4, 0.5, 8, 0.25]
    elif name.startswith("uint") or dt.kind == "u":
        values = [0, 1, 2, 3, 1, 0]
    else:
        values = [0, 1, -2, 3 if name != "int2" else -1, -1, 0.5 if dt.kind in "fV" else 1]
        if name in ("int4", "int2", "uint4", "uint2") or dt.kind in "iu":
            values = [int(v) for v in values]
    return np.array(values, dtype=np.float64).reshape(2, 3).astype(dt)


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Same dtype, shape and bits (NaN-safe; object arrays compared by value)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == object:
        return a.tolist() == b.tolist()
    return np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()


def _session(model: onnx.ModelProto) -> ox.InferenceSession:
    onnx.checker.check_model(model, full_check=True)  # the test models are valid ONNX
    return ox.InferenceSession(model.SerializeToString(), providers=CPU)


def _identity_model(code: int) -> onnx.ModelProto:
    g = helper.make_graph(
        [helper.make_node("Identity", ["X"], ["Y"])],
        "identity",
        [helper.make_tensor_value_info("X", code, [2, 3])],
        [helper.make_tensor_value_info("Y", code, [2, 3])],
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET)])


def test_every_onnx_type_has_a_numpy_dtype():
    from onnxplug.ir.types import elem_type_of, np_dtype

    for code in ALL_TYPES:
        assert np_dtype(code) == _np_dtype(code), _type_name(code)
        assert elem_type_of(_np_dtype(code)) == code, _type_name(code)


@pytest.mark.parametrize("code", sorted(_allowed("Identity")), ids=_type_name)
def test_identity_round_trip(code):
    s = _session(_identity_model(code))
    assert s.get_inputs()[0].type == f"tensor({_type_name(code)})"
    x = _sample(code)
    (y,) = s.run(None, {"X": x})
    assert _same(y, x)
    # the same through OrtValues
    (v,) = s.run_with_ort_values(None, {"X": ox.OrtValue.ortvalue_from_numpy(x)})
    assert v.data_type() == f"tensor({_type_name(code)})"
    assert v.element_type() == code
    assert v.shape() == [2, 3]
    assert _same(v.numpy(), x)


_CAST_TYPES = sorted(_allowed("Cast") & _allowed("Cast", 0) - {TensorProto.STRING})


@pytest.mark.parametrize("code", _CAST_TYPES, ids=_type_name)
def test_cast_from_and_to_float(code):
    g = helper.make_graph(
        [
            helper.make_node("Cast", ["X"], ["Y"], to=code),
            helper.make_node("Cast", ["Y"], ["Z"], to=TensorProto.FLOAT),
        ],
        "cast",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [2, 3])],
        [
            helper.make_tensor_value_info("Y", code, [2, 3]),
            helper.make_tensor_value_info("Z", TensorProto.FLOAT, [2, 3]),
        ],
    )
    s = _session(helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET)]))
    x = _sample(code).astype(np.float32)  # values the target type holds exactly
    y, z = s.run(None, {"X": x})
    assert _same(y, x.astype(_np_dtype(code)))
    assert _same(z, x)


@pytest.mark.parametrize("code", sorted(set(ML_DTYPES) & _allowed("Cast")), ids=_type_name)
def test_ml_dtypes_arrays_are_accepted_as_feeds(code):
    g = helper.make_graph(
        [helper.make_node("Cast", ["X"], ["Y"], to=TensorProto.FLOAT)],
        "cast",
        [helper.make_tensor_value_info("X", code, [2, 3])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [2, 3])],
    )
    s = _session(helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET)]))
    x = _sample(code)
    (y,) = s.run(None, {"X": x})
    assert _same(y, x.astype(np.float32))
    # a feed of another ml_dtypes type is a type error naming the input
    other = np.zeros((2, 3), ml_dtypes.bfloat16 if code != TensorProto.BFLOAT16 else np.float16)
    with pytest.raises(errors.InvalidArgument, match="Unexpected input data type.*input 'X'"):
        s.run(None, {"X": other})


@pytest.mark.parametrize("code", ALL_TYPES, ids=_type_name)
def test_ortvalue_round_trip(code):
    x = _sample(code)
    v = ox.OrtValue.ortvalue_from_numpy(x)
    assert v.is_tensor() and v.has_value() and not v.is_tensor_sequence()
    assert v.element_type() == code
    assert v.data_type() == f"tensor({_type_name(code)})"
    assert v.shape() == [2, 3]
    assert v.device_name() == "cpu"
    assert _same(v.numpy(), x)
    if code != TensorProto.STRING:
        assert v.data_ptr() == x.ctypes.data  # shares the array's memory
        assert v.tensor_size_in_bytes() == x.nbytes
    # allocated from shape and type, by numpy dtype and by ONNX type code
    for et in (_np_dtype(code), code):
        e = ox.OrtValue.ortvalue_from_shape_and_type([2, 3], et)
        assert e.element_type() == code and e.shape() == [2, 3]
        if code != TensorProto.STRING:
            e.update_inplace(x)
            assert _same(e.numpy(), x)


def test_strings_from_numpy_unicode_arrays():
    s = _session(_identity_model(TensorProto.STRING))
    x = np.array([["a", "bb", "ccc"], ["", "é", "z"]])  # dtype '<U3'
    (y,) = s.run(None, {"X": x})
    assert y.dtype == object and y.tolist() == x.tolist()
    (y2,) = s.run(None, {"X": x.tolist()})  # a nested Python list of str
    assert y2.tolist() == x.tolist()
    v = ox.OrtValue.ortvalue_from_numpy(x)
    assert v.data_type() == "tensor(string)" and v.numpy().dtype == object
    with pytest.raises(errors.InvalidArgument, match="input 'X'"):
        s.run(None, {"X": np.zeros((2, 3), np.float32)})


def test_strings_through_cast():
    g = helper.make_graph(
        [
            helper.make_node("Cast", ["S"], ["F"], to=TensorProto.FLOAT),
            helper.make_node("Cast", ["F"], ["T"], to=TensorProto.STRING),
        ],
        "strcast",
        [helper.make_tensor_value_info("S", TensorProto.STRING, [3])],
        [
            helper.make_tensor_value_info("F", TensorProto.FLOAT, [3]),
            helper.make_tensor_value_info("T", TensorProto.STRING, [3]),
        ],
    )
    s = _session(helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET)]))
    f, t = s.run(None, {"S": np.array(["1.5", "-2", "0.25"])})
    np.testing.assert_array_equal(f, np.array([1.5, -2, 0.25], np.float32))
    assert t.dtype == object
    np.testing.assert_array_equal(t.astype(np.float32), f)


def test_scalars_and_python_values_as_feeds():
    g = helper.make_graph(
        [helper.make_node("Add", ["A", "B"], ["C"])],
        "add",
        [
            helper.make_tensor_value_info("A", TensorProto.FLOAT, []),
            helper.make_tensor_value_info("B", TensorProto.FLOAT, [2]),
        ],
        [helper.make_tensor_value_info("C", TensorProto.FLOAT, [2])],
    )
    s = _session(helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET)]))
    expect = np.array([3.5, 4.5], np.float32)
    for a, b in [
        (np.float32(1.5), np.array([2, 3], np.float32)),  # a 0-d numpy scalar
        (1.5, [2.0, 3.0]),  # Python float and list take the model's type
        (np.array(1.5, np.float32), [2, 3]),  # ints widen to float
    ]:
        (c,) = s.run(None, {"A": a, "B": b})
        assert _same(c, expect)
    with pytest.raises(errors.InvalidArgument, match="input 'A'"):
        s.run(None, {"A": np.float64(1.5), "B": [2.0, 3.0]})  # a typed scalar keeps its type
    gi = helper.make_graph(
        [helper.make_node("Neg", ["I"], ["J"])],
        "neg",
        [helper.make_tensor_value_info("I", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("J", TensorProto.INT64, [2])],
    )
    si = _session(helper.make_model(gi, opset_imports=[helper.make_opsetid("", OPSET)]))
    assert _same(si.run(None, {"I": [1, 2]})[0], np.array([-1, -2], np.int64))
    with pytest.raises(errors.InvalidArgument, match="input 'I'"):
        si.run(None, {"I": [1.5, 2.0]})  # a float literal would be truncated: refused


@pytest.mark.parametrize(
    "dtype", [np.float32, np.float64, np.float16, np.int8, np.uint16, np.int32, np.int64, np.bool_]
)
def test_numpy_types_match_onnxruntime(dtype):
    ort = pytest.importorskip("onnxruntime")
    code = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    m = _identity_model(code)
    m.ir_version = 10  # what the installed onnxruntime reads
    m.opset_import[0].version = 21
    x = _sample(code)
    ours = ox.InferenceSession(m.SerializeToString(), providers=CPU).run(None, {"X": x})[0]
    theirs = ort.InferenceSession(m.SerializeToString(), providers=CPU).run(None, {"X": x})[0]
    assert _same(ours, theirs)


# sequences and optionals ----------------------------------------------------------------------


def _sequence_model() -> onnx.ModelProto:
    F = TensorProto.FLOAT
    seq = helper.make_tensor_sequence_value_info
    g = helper.make_graph(
        [
            helper.make_node("SequenceLength", ["S"], ["n"]),
            helper.make_node("SequenceAt", ["S", "i"], ["at"]),
            helper.make_node("SequenceInsert", ["S", "t"], ["appended"]),
            helper.make_node("SequenceErase", ["S", "i"], ["erased"]),
            helper.make_node("SequenceConstruct", ["t", "t"], ["built"]),
            helper.make_node("SequenceEmpty", [], ["empty"], dtype=F),
            helper.make_node("SequenceInsert", ["empty", "t"], ["one"]),
            helper.make_node("ConcatFromSequence", ["S"], ["cat"], axis=0),
        ],
        "seq",
        [
            seq("S", F, None),
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("t", F, [2]),
        ],
        [
            helper.make_tensor_value_info("n", TensorProto.INT64, []),
            helper.make_tensor_value_info("at", F, None),
            seq("appended", F, None),
            seq("erased", F, None),
            seq("built", F, None),
            seq("empty", F, None),
            seq("one", F, None),
            helper.make_tensor_value_info("cat", F, None),
        ],
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET)])


def _assert_seq(got, expect):
    assert isinstance(got, list) and len(got) == len(expect)
    for a, b in zip(got, expect):
        assert _same(a, np.asarray(b, np.float32))


def test_sequences_in_and_out():
    s = ox.InferenceSession(_sequence_model().SerializeToString(), providers=CPU)
    assert s.get_inputs()[0].type == "seq(tensor(float))"
    assert s.get_outputs()[2].type == "seq(tensor(float))"
    a, b, t = [1.0, 2.0], [3.0, 4.0, 5.0], np.array([9.0, 9.0], np.float32)
    feeds = {"S": [np.array(a, np.float32), np.array(b, np.float32)], "i": np.array(-1), "t": t}
    n, at, appended, erased, built, empty, one, cat = s.run(None, feeds)
    assert _same(n, np.array(2, np.int64))
    assert _same(at, np.array(b, np.float32))
    _assert_seq(appended, [a, b, t])
    _assert_seq(erased, [a])
    _assert_seq(built, [t, t])
    assert empty == []
    _assert_seq(one, [t])
    assert _same(cat, np.array(a + b, np.float32))
    # a tuple and Python lists as items work too; an empty sequence is an empty list
    n, *_ = s.run(["n"], {"S": ([1.0], [2.0, 3.0], [4.0]), "i": 0, "t": t})
    assert int(n) == 3
    length = helper.make_graph(
        [helper.make_node("SequenceLength", ["S"], ["n"])],
        "len",
        [helper.make_tensor_sequence_value_info("S", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("n", TensorProto.INT64, [])],
    )
    sl = _session(helper.make_model(length, opset_imports=[helper.make_opsetid("", OPSET)]))
    assert int(sl.run(None, {"S": []})[0]) == 0


def test_sequence_feed_errors_name_the_input():
    s = ox.InferenceSession(_sequence_model().SerializeToString(), providers=CPU)
    t = np.zeros(2, np.float32)
    with pytest.raises(errors.InvalidArgument, match="input 'S' is a seq.*feed a list"):
        s.run(None, {"S": np.zeros(3, np.float32), "i": 0, "t": t})
    with pytest.raises(errors.InvalidArgument, match=r"input 'S\[1\]'"):
        s.run(None, {"S": [np.zeros(1, np.float32), np.zeros(1, np.int64)], "i": 0, "t": t})
    with pytest.raises(errors.InvalidArgument, match="input 'S' is None"):
        s.run(None, {"S": None, "i": 0, "t": t})


def test_sequence_through_ortvalues():
    s = ox.InferenceSession(_sequence_model().SerializeToString(), providers=CPU)
    seq = ox.OrtValue.ortvalue_from_sequence([np.ones(2, np.float32), np.zeros(3, np.float32)])
    assert seq.is_tensor_sequence() and not seq.is_tensor()
    t = ox.OrtValue.ortvalue_from_numpy(np.array([5.0, 6.0], np.float32))
    appended, n = s.run_with_ort_values(
        ["appended", "n"], {"S": seq, "i": ox.OrtValue.ortvalue_from_numpy(np.array(0)), "t": t}
    )
    assert appended.is_tensor_sequence()
    assert appended.data_type() == "seq(tensor(float))"
    _assert_seq(appended.numpy(), [[1, 1], [0, 0, 0], [5, 6]])
    assert int(n.numpy()) == 2


def _optional_model() -> onnx.ModelProto:
    F = TensorProto.FLOAT
    opt = helper.make_optional_type_proto(helper.make_tensor_type_proto(F, [2]))
    opt_seq = helper.make_optional_type_proto(
        helper.make_sequence_type_proto(helper.make_tensor_type_proto(F, None))
    )
    then = helper.make_graph(
        [helper.make_node("OptionalGetElement", ["O"], ["v"])],
        "has",
        [],
        [helper.make_tensor_value_info("v", F, [2])],
    )
    other = helper.make_graph(
        [helper.make_node("Constant", [], ["v"], value=helper.make_tensor("c", F, [2], [-1, -1]))],
        "empty",
        [],
        [helper.make_tensor_value_info("v", F, [2])],
    )
    g = helper.make_graph(
        [
            helper.make_node("OptionalHasElement", ["O"], ["has"]),
            helper.make_node("If", ["has"], ["value"], then_branch=then, else_branch=other),
            helper.make_node("Optional", [], ["none"], type=helper.make_tensor_type_proto(F, [2])),
            helper.make_node("Optional", ["value"], ["some"]),
            helper.make_node("Identity", ["O"], ["same"]),
            helper.make_node("OptionalHasElement", ["OS"], ["has_seq"]),
            helper.make_node("Identity", ["OS"], ["same_seq"]),
        ],
        "opt",
        [helper.make_value_info("O", opt), helper.make_value_info("OS", opt_seq)],
        [
            helper.make_tensor_value_info("has", TensorProto.BOOL, []),
            helper.make_tensor_value_info("value", F, [2]),
            helper.make_value_info("none", opt),
            helper.make_value_info("some", opt),
            helper.make_value_info("same", opt),
            helper.make_tensor_value_info("has_seq", TensorProto.BOOL, []),
            helper.make_value_info("same_seq", opt_seq),
        ],
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET)])


def test_optionals_in_and_out():
    m = _optional_model()
    onnx.checker.check_model(m, full_check=True)
    s = ox.InferenceSession(m.SerializeToString(), providers=CPU)
    assert [i.type for i in s.get_inputs()] == [
        "optional(tensor(float))",
        "optional(seq(tensor(float)))",
    ]
    x = np.array([1.0, 2.0], np.float32)
    has, value, none, some, same, has_seq, same_seq = s.run(None, {"O": x, "OS": [x, x]})
    assert bool(has) and _same(value, x) and none is None and _same(some, x) and _same(same, x)
    assert bool(has_seq)
    _assert_seq(same_seq, [x, x])
    # None is an empty optional; leaving an optional input out means the same
    for feeds in ({"O": None, "OS": None}, {}):
        has, value, none, some, same, has_seq, same_seq = s.run(None, feeds)
        assert not bool(has) and _same(value, np.array([-1, -1], np.float32))
        assert none is None and same is None and same_seq is None and not bool(has_seq)
        assert _same(some, np.array([-1, -1], np.float32))
    # an optional's element is checked like a tensor input
    with pytest.raises(errors.InvalidArgument, match="(?s)input: O .*index: 0 Got: 3 Expected: 2"):
        s.run(None, {"O": np.zeros(3, np.float32)})
    with pytest.raises(errors.InvalidArgument, match="input 'O'"):
        s.run(None, {"O": np.zeros(2, np.int32)})


def test_optional_ortvalue():
    m = _optional_model()
    s = ox.InferenceSession(m.SerializeToString(), providers=CPU)
    outs = s.run_with_ort_values(["none", "some"], {"O": None})
    assert not outs[0].has_value()
    assert outs[1].has_value() and outs[1].is_tensor()
