"""As strict as onnxruntime, and no stricter: one test per class of model the fuzzer found
where the two disagreed (``python -m onnxplug.tools.fuzz`` with onnxruntime as its oracle).

* Models onnxruntime refuses when the session is created are refused then, with one typed
  error naming the node, the attribute or input, and the rule.
* Inputs onnxruntime refuses when it runs are refused by the run, with its error class.
* Models onnxruntime runs are run, with its results.

Where onnxruntime is installed, every case runs against it too."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxplug as ox
from onnxplug import errors
from tests.conftest import assert_refused_at_load

CPU = ["CPUExecutionProvider"]
F = TensorProto.FLOAT
I64 = TensorProto.INT64
BOOL = TensorProto.BOOL

try:
    import onnxruntime as ort

    ort.set_default_logger_severity(3)
except ImportError:  # the comparisons are skipped without it
    ort = None


def _tv(name, shape, elem=F):
    return helper.make_tensor_value_info(name, elem, shape)


def _model(nodes, inputs, outputs, inits=(), opset=18, value_info=()):
    g = helper.make_graph(
        list(nodes), "g", list(inputs), list(outputs), list(inits), value_info=list(value_info)
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def _init(name, value, dtype=None):
    return numpy_helper.from_array(np.asarray(value, dtype=dtype), name)


def _session(model, rt=ox):
    return rt.InferenceSession(model.SerializeToString(), providers=CPU)


# ---------------------------------------------------------------------------------------------
# model builders


def _if(then_nodes, then_output="t", outer_nodes=(), domain=""):
    then = helper.make_graph(list(then_nodes), "then", [], [_tv(then_output, [2])])
    other = helper.make_graph(
        [helper.make_node("Abs", ["x"], ["e"], domain=domain)], "else", [], [_tv("e", [2])]
    )
    node = helper.make_node("If", ["c"], ["y"], name="if", then_branch=then, else_branch=other)
    return _model([*outer_nodes, node], [_tv("c", [], BOOL), _tv("x", [2])], [_tv("y", [2])])


def _loop(iteration=None, cond_body=None, cond_input=None):
    body = helper.make_graph(
        [
            helper.make_node("Identity", ["cond"], ["cond_out"]),
            helper.make_node("Add", ["acc", "x"], ["acc_out"]),
        ],
        "body",
        [iteration or _tv("i", [], I64), cond_body or _tv("cond", [], BOOL), _tv("acc", [2])],
        [_tv("cond_out", [], BOOL), _tv("acc_out", [2])],
    )
    cond = "" if cond_input is None else "c"
    node = helper.make_node("Loop", ["m", cond, "a0"], ["y"], name="loop", body=body)
    inputs = [_tv("x", [2]), _tv("a0", [2])]
    if cond_input is not None:
        inputs.append(_tv("c", cond_input, BOOL))
    return _model([node], inputs, [_tv("y", [2])], [_init("m", 3, np.int64)])


def _scan(s=(2,), e=(2,), so=(2,), eo=(2,), state_node=None, s0=(2,)):
    body = helper.make_graph(
        [
            state_node or helper.make_node("Add", ["s", "e"], ["so"]),
            helper.make_node("Mul", ["e", "k"], ["eo"]),
        ],
        "body",
        [_tv("s", list(s)), _tv("e", list(e))],
        [_tv("so", None if so is None else list(so)), _tv("eo", list(eo))],
    )
    node = helper.make_node(
        "Scan", ["s0", "xs"], ["s", "ys"], name="scan", body=body, num_scan_inputs=1
    )
    return _model(
        [node],
        [_tv("s0", list(s0)), _tv("xs", [3, 2])],
        [_tv("s", None), _tv("ys", None)],
        [_init("k", [2.0, 2.0], np.float32)],
    )


def _recurrent(op, hidden_size=3, w_rows=None, r_cols=None):
    gates = {"RNN": 1, "GRU": 3, "LSTM": 4}[op]
    rng = np.random.default_rng(0)
    rows = gates * (3 if w_rows is None else w_rows)
    attrs = {} if hidden_size is None else {"hidden_size": hidden_size}
    return _model(
        [helper.make_node(op, ["x", "w", "r"], ["y"], name="rnn", **attrs)],
        [_tv("x", [4, 2, 5])],
        [_tv("y", None)],
        [
            _init("w", rng.standard_normal((1, rows, 5)), np.float32),
            _init("r", rng.standard_normal((1, rows, 3 if r_cols is None else r_cols)), np.float32),
        ],
    )


def _one(op, feeds, outputs=("y",), opset=18, inits=(), **attrs):
    """A one-node model reading ``feeds`` (then ``inits``) in order; untyped outputs."""
    names = [*feeds, *(t.name for t in inits)]
    node = helper.make_node(op, names, list(outputs), name="n", **attrs)
    inputs = [_tv(k, None, helper.np_dtype_to_tensor_dtype(v.dtype)) for k, v in feeds.items()]
    outs = [helper.make_empty_tensor_value_info(o) for o in outputs]
    return _model([node], inputs, outs, inits, opset)


def _with_value_info(model, info):
    model.graph.value_info.append(info)
    return model


# ---------------------------------------------------------------------------------------------
# refused when the session is created, by both


def _relu_neg(outputs=None, value_info=()):
    nodes = [
        helper.make_node("Relu", ["x"], ["t"], name="r"),
        helper.make_node("Neg", ["t"], ["y"]),
    ]
    return _model(nodes, [_tv("x", [2])], outputs or [_tv("y", [2])], value_info=value_info)


_AT_LOAD = {
    "subgraph_not_topologically_sorted": (
        lambda: _if([helper.make_node("Neg", ["a"], ["t"]), helper.make_node("Abs", ["x"], ["a"])]),
        errors.InvalidGraph,
        "Neg node 'Neg_0' in the attribute 'then_branch' of If node 'if': input 0 'a' is not "
        "a graph input, an initializer, the output of an earlier node",
    ),
    "subgraph_redefines_an_outer_value": (
        lambda: _if([helper.make_node("Neg", ["c"], ["x"]), helper.make_node("Abs", ["x"], ["t"])]),
        errors.InvalidGraph,
        "Neg node 'Neg_0' in the attribute 'then_branch' of If node 'if': output 'x' is already "
        "defined by an enclosing graph",
    ),
    "subgraph_writes_the_default_domain_as_ai_onnx": (
        lambda: _if([helper.make_node("Neg", ["x"], ["t"], domain="ai.onnx")]),
        errors.InvalidGraph,
        "Neg node 'Neg_0' in the attribute 'then_branch' of If node 'if': no opset import for "
        "domain 'ai.onnx'",
    ),
    "output_of_element_type_0": (
        lambda: _relu_neg(outputs=[_tv("y", [2], TensorProto.UNDEFINED)]),
        errors.InvalidArgument,
        "output 'y' of graph: invalid tensor element type 0",
    ),
    "value_info_of_element_type_0": (
        lambda: _relu_neg(value_info=[_tv("t", None, TensorProto.UNDEFINED)]),
        errors.InvalidArgument,
        "value_info 't' of graph: invalid tensor element type 0",
    ),
    "sequence_of_an_unset_type": (
        lambda: _relu_neg(
            value_info=[
                helper.make_value_info("t", helper.make_sequence_type_proto(onnx.TypeProto()))
            ]
        ),
        errors.InvalidArgument,
        "value_info 't' of graph: the element type of a sequence type is not set",
    ),
    "loop_iteration_number_not_int64": (
        lambda: _loop(iteration=_tv("i", [], TensorProto.INT32)),
        errors.Fail,
        "Loop node 'loop' passes the iteration number of type tensor\\(int64\\) to body input "
        "'i' of type tensor\\(int32\\)",
    ),
    "loop_condition_of_another_shape": (
        lambda: _loop(cond_body=_tv("cond", [2], BOOL), cond_input=[]),
        errors.Fail,
        "Loop node 'loop': body input 'cond' is declared with shape \\[2\\] but the node passes "
        "'c', of shape \\[\\]",
    ),
    "scan_state_of_another_shape": (
        lambda: _scan(s=(1, 2)),
        errors.Fail,
        "Scan node 'scan': body input 's' is declared with shape \\[1, 2\\] but the node passes "
        "'s0', of shape \\[2\\]",
    ),
    "scan_slice_of_another_rank": (
        lambda: _scan(e=()),
        errors.Fail,
        "body input 'e' is declared with shape \\[\\] but the node passes a slice of 'xs', of "
        "shape \\[2\\]",
    ),
    "scan_state_changes_shape": (
        lambda: _scan(so=None, state_node=helper.make_node("Concat", ["s", "e"], ["so"], axis=0)),
        errors.Fail,
        "Scan node 'scan': state 0 enters the body as 's0' of shape \\[2\\] and leaves it as "
        "'so' of shape \\[4\\]",
    ),
    "gru_without_hidden_size": (
        lambda: _recurrent("GRU", None),
        errors.Fail,
        "GRU node 'rnn': attribute 'hidden_size' must be given",
    ),
    "rnn_without_hidden_size": (
        lambda: _recurrent("RNN", None),
        errors.Fail,
        "RNN node 'rnn': attribute 'hidden_size' must be given",
    ),
    "lstm_hidden_size_0": (
        lambda: _recurrent("LSTM", 0),
        errors.Fail,
        "LSTM node 'rnn': attribute 'hidden_size' must be in \\[1, 2\\^31 - 1\\], got 0",
    ),
    "gru_hidden_size_over_32_bits": (
        lambda: _recurrent("GRU", 2**31),
        errors.Fail,
        "attribute 'hidden_size' must be in \\[1, 2\\^31 - 1\\], got 2147483648",
    ),
    "upsample_7_scale_below_1": (
        lambda: _one(
            "Upsample", {"x": np.ones((1, 1, 2, 2), np.float32)}, opset=8, scales=[1, 1, 0.5, 2]
        ),
        errors.Fail,
        "Upsample node 'n': Scale value should be greater than or equal to 1",
    ),
}


@pytest.mark.parametrize("case", sorted(_AT_LOAD))
def test_refused_at_load_as_by_onnxruntime(case):
    build, error, pattern = _AT_LOAD[case]
    assert_refused_at_load(build(), error, pattern)


# refused at load here; onnxruntime creates the session and refuses every run (or, for
# constant scales, refuses at load in some opsets and at run in others)
_AT_LOAD_ORT_AT_RUN = {
    "scan_body_output_of_another_rank": (
        lambda: _scan(eo=()),
        {"s0": np.ones(2, np.float32), "xs": np.ones((3, 2), np.float32)},
        "Scan node 'scan': body output 'eo' is declared with rank 0 but computed with rank 1",
    ),
    "resize_constant_scale_0": (
        lambda: _one(
            "Resize",
            {"x": np.ones((1, 1, 2, 2), np.float32)},
            inits=[_init("roi", np.zeros(0, np.float32)), _init("sc", [1, 1, 0, 2], np.float32)],
        ),
        {"x": np.ones((1, 1, 2, 2), np.float32)},
        "Resize node 'n': Scale value should be greater than 0",
    ),
}


@pytest.mark.parametrize("case", sorted(_AT_LOAD_ORT_AT_RUN))
def test_refused_at_load_where_onnxruntime_refuses_every_run(case):
    build, feeds, pattern = _AT_LOAD_ORT_AT_RUN[case]
    m = build()
    with pytest.raises(errors.Fail, match=pattern):
        _session(m)
    if ort is not None:
        with pytest.raises(Exception):
            _session(m, ort).run(None, feeds)


# ---------------------------------------------------------------------------------------------
# refused by the run, by both

_X = np.arange(6, dtype=np.float32).reshape(2, 3)
_X3 = np.ones((2, 8, 2), np.float32)
_X4 = np.ones((1, 1, 2, 2), np.float32)


def _i64(*v):
    return np.array(v, np.int64)


_ONEHOT = {"i": _i64(0, 2), "d": _i64(3), "v": np.array([0, 1], np.float32)}

_AT_RUN = {
    "topk_negative_k": (
        "TopK", {"x": _X, "k": _i64(-1)}, ("v", "i"), {},
        errors.Fail, "value of k must not be negative",
    ),
    "topk_k_larger_than_the_axis": (
        "TopK", {"x": _X, "k": _i64(5)}, ("v", "i"), {},
        errors.Fail, "k argument \\[5\\] should not be greater than specified axis dim value \\[3\\]",
    ),
    "topk_k_not_one_value": (
        "TopK", {"x": _X, "k": _i64(1, 2)}, ("v", "i"), {},
        errors.Fail, "k tensor should be a 1D tensor of size 1",
    ),
    "onehot_depth_0": (
        "OneHot", {**_ONEHOT, "d": _i64(0)}, ("y",), {},
        errors.InvalidArgument, "Depth is negative \\(or zero\\): 0",
    ),
    "onehot_depth_not_one_value": (
        "OneHot", {**_ONEHOT, "d": _i64(3, 4)}, ("y",), {},
        errors.InvalidArgument, "Invalid argument for depth",
    ),
    "onehot_three_values": (
        "OneHot", {**_ONEHOT, "v": np.array([0, 1, 2], np.float32)}, ("y",), {},
        errors.InvalidArgument, "Invalid argument for values",
    ),
    "onehot_axis_out_of_range": (
        "OneHot", _ONEHOT, ("y",), {"axis": -(2**63)},
        errors.Fail, "axis -9223372036854775808 is not in valid range \\[-2,1\\]",
    ),
    "onehot_output_size_overflows": (
        "OneHot", {**_ONEHOT, "d": _i64(2**62)}, ("y",), {},
        errors.InvalidArgument, "output tensor size would overflow",
    ),
    "split_fewer_sizes_than_outputs": (
        "Split", {"x": _X3, "s": _i64(4, 4)}, ("a", "b", "c"), {"axis": 1},
        errors.Fail, "Cannot split using values in 'split': 2 sizes \\[4, 4\\] .* for 3 outputs",
    ),
    "split_unevenly_without_sizes": (
        "Split", {"x": _X3}, ("a", "b", "c"), {"axis": 1},
        errors.Fail, "Input cannot be split evenly on selected axis: a dim of 8 into 3 outputs",
    ),
    "split_num_outputs_not_the_output_count": (
        "Split", {"x": _X3}, ("a", "b", "c"), {"axis": 1, "num_outputs": 2},
        errors.Fail, "Number of outputs \\(3\\) does not match num_outputs \\(2\\)",
    ),
    "reduce_axes_not_1d": (
        "ReduceMean", {"x": _X, "a": _i64(1).reshape(1, 1)}, ("y",), {},
        errors.Fail, "An axes tensor must be a vector tensor \\(1-D\\), got shape \\[1, 1\\]",
    ),
    "pad_two_constant_values": (
        "Pad", {"x": _X, "p": _i64(0, 1, 0, 1), "v": np.array([1, 2], np.float32)}, ("y",), {},
        errors.Fail, "Pad: constant_value must hold exactly one value, got shape \\[2\\]",
    ),
    "resize_fed_scale_0": (
        "Resize", {"x": _X4, "roi": np.zeros(0, np.float32), "sc": np.array([1, 1, 0, 2], "f")},
        ("y",), {}, errors.Fail, "Scale value should be greater than 0",
    ),
    "resize_crop_roi_of_another_size": (
        "Resize", {"x": _X4, "roi": np.ones(3, np.float32), "sc": np.array([1, 1, 2, 2], "f")},
        ("y",), {"coordinate_transformation_mode": "tf_crop_and_resize"},
        errors.InvalidArgument, "size of roi array should be 2 \\* N",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(_AT_RUN))
def test_refused_by_the_run_as_by_onnxruntime(case):
    op, feeds, outputs, attrs, error, pattern = _AT_RUN[case]
    m = _one(op, feeds, outputs, **attrs)
    sess = _session(m)  # the model is valid: only these inputs are not
    with pytest.raises(error, match=f"running {op} node.*{pattern}"):
        sess.run(None, feeds)
    if ort is not None:
        with pytest.raises(Exception):
            _session(m, ort).run(None, feeds)


@pytest.mark.parametrize("op", ["RNN", "GRU", "LSTM"])
@pytest.mark.parametrize(
    ("kw", "pattern"),
    [
        ({"hidden_size": 4}, "Input W must have shape \\{1,{rows},5\\}. Actual:\\{1,{given},5\\}"),
        ({"r_cols": 4}, "Input R must have shape \\{1,{given},3\\}. Actual:\\{1,{given},4\\}"),
    ],
)
def test_recurrent_weights_must_fit_hidden_size(op, kw, pattern):
    """The weights of another hidden size fail the run with onnxruntime's message."""
    gates = {"RNN": 1, "GRU": 3, "LSTM": 4}[op]
    m = _recurrent(op, **kw)
    feeds = {"x": np.ones((4, 2, 5), np.float32)}
    want = pattern.replace("{rows}", str(gates * 4)).replace("{given}", str(gates * 3))
    with pytest.raises(errors.InvalidArgument, match=want):
        _session(m).run(None, feeds)
    if ort is not None:
        with pytest.raises(Exception, match=want):
            _session(m, ort).run(None, feeds)


# ---------------------------------------------------------------------------------------------
# run, as by onnxruntime


def _same_as_onnxruntime(m, feeds):
    ours = _session(m).run(None, feeds)
    if ort is not None:
        theirs = _session(m, ort).run(None, feeds)
        for a, b in zip(ours, theirs):
            np.testing.assert_allclose(a, b, rtol=1e-6)
    return ours


_SCAN_FEEDS = {"s0": np.ones(2, np.float32), "xs": np.arange(6, dtype=np.float32).reshape(3, 2)}


@pytest.mark.parametrize(
    "build",
    [
        # a declared shape the node contradicts keeps only what both agree on (a later node is
        # not judged by the wrong one)
        pytest.param(lambda: _scan(so=(5,)), id="scan_body_state_declared_too_long"),
        pytest.param(lambda: _scan(s=("n",), so=None), id="scan_symbolic_dims"),
    ],
)
def test_declared_shapes_contradicting_the_nodes_do_not_refuse_the_model(build):
    _same_as_onnxruntime(build(), _SCAN_FEEDS)


def test_declared_value_info_contradicting_inference_in_the_main_graph():
    m = _model(
        [helper.make_node("Relu", ["x"], ["t"]), helper.make_node("Add", ["t", "x"], ["y"])],
        [_tv("x", [2])],
        [_tv("y", [2])],
        value_info=[_tv("t", [7])],
    )
    out = _same_as_onnxruntime(m, {"x": np.array([1.0, -1.0], np.float32)})
    np.testing.assert_array_equal(out[0], [2.0, -1.0])


def test_loop_iteration_number_of_any_declared_shape():
    m = _loop(iteration=_tv("i", [1], I64))
    out = _same_as_onnxruntime(m, {"x": np.ones(2, np.float32), "a0": np.zeros(2, np.float32)})
    np.testing.assert_array_equal(out[0], [3.0, 3.0])


def test_subgraph_output_named_like_the_nodes_own_output():
    """Visible to a subgraph are the values defined before its node: the node's own output is
    not (onnxruntime accepts this), an input of the graph is (see the SSA case above)."""
    m = _if([helper.make_node("Neg", ["x"], ["y"]), helper.make_node("Abs", ["y"], ["t"])])
    feeds = {"c": np.array(True), "x": np.array([1.0, -2.0], np.float32)}
    np.testing.assert_array_equal(_same_as_onnxruntime(m, feeds)[0], [1.0, 2.0])


def test_resize_roi_is_read_only_by_tf_crop_and_resize():
    feeds = {"x": _X4, "roi": np.ones(3, np.float32), "sc": np.array([1, 1, 2, 2], np.float32)}
    out = _same_as_onnxruntime(_one("Resize", feeds), feeds)
    assert out[0].shape == (1, 1, 4, 4)


def test_split_18_num_outputs_may_leave_the_last_part_smaller():
    out = _same_as_onnxruntime(
        _one("Split", {"x": _X3}, ("a", "b", "c"), axis=1, num_outputs=3), {"x": _X3}
    )
    assert [o.shape[1] for o in out] == [3, 3, 2]


def test_untyped_outputs_report_the_inferred_type():
    m = _relu_neg(outputs=[helper.make_empty_tensor_value_info("y")])
    outs = _session(m).get_outputs()
    assert (outs[0].type, outs[0].shape) == ("tensor(float)", [2])
    if ort is not None:
        theirs = _session(m, ort).get_outputs()
        assert (theirs[0].type, theirs[0].shape) == (outs[0].type, outs[0].shape)


# ---------------------------------------------------------------------------------------------
# where onnxruntime runs what is invalid, onnxplug refuses it (docs/onnxruntime-differences.md)


def test_softmax_axis_out_of_range_is_refused():
    """onnxruntime narrows the 64-bit axis to 32 bits (-2^63 becomes 0) and runs."""
    m = _one("Softmax", {"x": _X}, axis=-(2**63))
    with pytest.raises(errors.Fail, match="axis -9223372036854775808 is out of range"):
        _session(m).run(None, {"x": _X})


def test_a_written_model_declares_no_element_type_0():
    """``optimized_model_filepath`` leaves a value whose element type is unknown untyped:
    element type 0 would make the written model one that onnxplug and onnxruntime refuse."""
    from onnxplug.ir.export import type_proto
    from onnxplug.ir.types import ValueType

    assert type_proto(ValueType("tensor", 0, (2,))) is None
    assert type_proto(ValueType("sequence", inner=ValueType("tensor", 0, None))) is None
    assert type_proto(ValueType("tensor", F, (2,))).tensor_type.elem_type == F
