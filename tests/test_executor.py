"""The executor: offsets of the static memory plan, shape folding per signature, value
lifetimes, kernel errors and profiling."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import onnxplug as ox
from onnxplug.framework.executor import assign_offsets
from tests.plugins import graphs
from tests.plugins import virtual_device as vd
from tests.plugins.graphs import make_model, node, tensor

CPU = "CPUExecutionProvider"


# ---------------------------------------------------------------------------------------------
# offsets of the static memory plan

_allocations = st.lists(
    st.tuples(st.integers(1, 4096), st.integers(0, 40), st.integers(0, 12)), max_size=40
)


@settings(max_examples=300, deadline=None)
@given(_allocations, st.sampled_from([1, 64, 256]))
def test_offsets_of_live_allocations_never_overlap(raw, align):
    items = [(nbytes, start, start + length) for nbytes, start, length in raw]
    offsets, total = assign_offsets(items, align)
    assert len(offsets) == len(items)
    for k, (nbytes, a, b) in enumerate(items):
        assert offsets[k] % align == 0
        assert 0 <= offsets[k] and offsets[k] + nbytes <= total
        for j in range(k):
            n2, a2, b2 = items[j]
            if a <= b2 and a2 <= b:  # live at a common step
                assert offsets[k] + nbytes <= offsets[j] or offsets[j] + n2 <= offsets[k]
    # the block holds, at every step, everything live at that step
    for t in range(53):
        assert total >= sum(n for n, a, b in items if a <= t <= b)


def test_offsets_reuse_memory_of_dead_allocations():
    # a chain: each tensor is live with its neighbours only, so two slots suffice
    items = [(1000, i, i + 1) for i in range(10)]
    offsets, total = assign_offsets(items, 256)
    assert total == 2 * 1024
    assert set(offsets) == {0, 1024}
    assert assign_offsets([], 256) == ([], 0)


# ---------------------------------------------------------------------------------------------
# shape folding


def shape_chain() -> bytes:
    """y = Reshape(Relu(x), [N, -1]) with N computed by Shape -> Gather -> Unsqueeze -> Concat."""
    nodes = [
        node("Relu", ["x"], ["r"]),
        node("Shape", ["x"], ["s"]),
        node("Gather", ["s", "i0"], ["n"], axis=0),
        node("Unsqueeze", ["n", "zero"], ["n1"]),
        node("Concat", ["n1", "minus1"], ["shp"], axis=0),
        node("Reshape", ["r", "shp"], ["y"]),
    ]
    inits = {
        "i0": np.array(0, np.int64),
        "zero": np.array([0], np.int64),
        "minus1": np.array([-1], np.int64),
    }
    return make_model(nodes, [tensor("x", ["N", 2, "M"])], [tensor("y", ["N", "K"])], inits)


SHAPE_NODES = {"Shape_s", "Gather_n", "Unsqueeze_n1", "Concat_shp"}


def ran_nodes(sess: ox.InferenceSession, feeds: dict) -> tuple[set[str], list[np.ndarray]]:
    """The nodes one run executed, from the profiler."""
    profiler = sess._runner.profiler
    profiler.events = []
    out = sess.run(None, feeds)
    nodes = {e["name"].removesuffix("_kernel_time") for e in profiler.events if e["cat"] == "Node"}
    return nodes, out


def profiled_session(model: bytes, providers: list, folder: Path) -> ox.InferenceSession:
    so = ox.SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = str(folder / "prof")
    return ox.InferenceSession(model, so, providers=providers)


def test_shape_computations_are_folded_per_signature(tmp_path):
    sess = profiled_session(shape_chain(), [CPU], tmp_path)
    a = np.random.default_rng(0).standard_normal((3, 2, 4)).astype(np.float32)
    b = np.random.default_rng(1).standard_normal((5, 2, 2)).astype(np.float32)
    seen = []
    for x in (a, a, a, b, b, a, b):
        ran, (y,) = ran_nodes(sess, {"x": x})
        np.testing.assert_array_equal(y, np.maximum(x, 0).reshape(x.shape[0], -1))
        seen.append(ran & SHAPE_NODES)
        assert "Relu_r" in ran and "Reshape_y" in ran
    # computed on the first run of each signature only; later runs (on pooled frames that
    # are reused) take the folded values
    all_, none = SHAPE_NODES, set()
    assert seen == [all_, none, none, all_, none, none, none]


def test_many_signatures_evict_old_plans_without_breaking_runs(tmp_path):
    sess = profiled_session(shape_chain(), [CPU], tmp_path)
    xs = [np.full((n, 2, 1), n - 20, np.float32) for n in range(1, 45)]  # > the plan cache
    for _ in range(2):
        for x in xs:
            ran, (y,) = ran_nodes(sess, {"x": x})
            np.testing.assert_array_equal(y, np.maximum(x, 0).reshape(len(x), -1))
    # the most recent signatures kept their plans, the evicted ones recorded again
    ran, _ = ran_nodes(sess, {"x": xs[-1]})
    assert not SHAPE_NODES & ran
    assert len(sess._runner._signatures) <= 32


def test_shape_of_a_data_dependent_value_is_not_folded():
    nodes = [
        node("NonZero", ["x"], ["nz"]),
        node("Shape", ["nz"], ["s"]),
        node("Mul", ["s", "two"], ["y"]),
    ]
    model = make_model(
        nodes,
        [tensor("x", ["N"])],
        [tensor("y", [2], graphs.TensorProto.INT64)],
        {"two": np.array([2], np.int64)},
    )
    sess = ox.InferenceSession(model, providers=[CPU])
    for k in (2, 5, 2, 0, 5):
        x = np.zeros(8, np.float32)
        x[:k] = 1
        (y,) = sess.run(None, {"x": x})
        assert y.tolist() == [2, 2 * k]


def test_folded_graph_outputs_are_fresh_writable_arrays():
    nodes = [node("Shape", ["x"], ["s"]), node("Relu", ["x"], ["y"])]
    model = make_model(
        nodes,
        [tensor("x", ["N"])],
        [tensor("s", [1], graphs.TensorProto.INT64), tensor("y", ["N"])],
    )
    sess = ox.InferenceSession(model, providers=[CPU])
    x = np.ones(4, np.float32)
    for _ in range(3):
        s, _y = sess.run(None, {"x": x})
        assert s.flags.writeable
        assert s.tolist() == [4]
        s[0] = 99  # the caller owns what it got


# ---------------------------------------------------------------------------------------------
# lifetimes


MiB = 1 << 20


def test_dead_values_are_released_as_the_run_goes(virt):
    # synchronous kernels (no stream), so memory is freed as soon as a value is released
    sess = ox.InferenceSession(
        graphs.chain("Relu", 8), providers=[(vd.NAME, {"streams": "none"}), CPU]
    )
    x = np.ones((256, 1024), np.float32)  # 1 MiB
    alloc = virt.allocator
    for run in range(3):
        alloc.reset_stats()
        (y,) = sess.run(None, {"x": x})
        np.testing.assert_array_equal(y, x)
        if run == 0:
            # the value being read and the one being written (the feed is freed after its
            # reader, and a freed value's block serves the next one): never all nine
            assert alloc.get_stats()["MaxInUse"] == 2 * MiB
        elif run == 1:
            # one block: two values at a time (a step's input and output, the output
            # written last) and the feed's static buffer
            assert alloc.sizes == [3 * MiB]
        else:
            assert alloc.sizes == []  # the steady state allocates nothing
        del y
        gc.collect()
        # what stays is the block of the pooled frame
        assert alloc.get_stats()["InUse"] == (3 * MiB if run else 0)


# ---------------------------------------------------------------------------------------------
# errors


def reshape_model() -> bytes:
    nodes = [node("Relu", ["x"], ["r"]), node("Reshape", ["r", "shape"], ["y"])]
    return make_model(
        nodes,
        [tensor("x", ["N"]), tensor("shape", [2], graphs.TensorProto.INT64)],
        [tensor("y", ["A", "B"])],
    )


@pytest.mark.parametrize("profiling", [False, True])
def test_kernel_errors_name_the_node_and_leave_the_session_usable(profiling, tmp_path):
    so = ox.SessionOptions()
    so.enable_profiling = profiling
    so.profile_file_prefix = str(tmp_path / "prof")
    sess = ox.InferenceSession(reshape_model(), so, providers=[CPU])
    x = np.arange(6, dtype=np.float32)
    good, bad = np.array([2, 3], np.int64), np.array([4, 4], np.int64)
    y7 = np.arange(7, dtype=np.float32)
    # the first run of a signature fails (recording), then the same signature fails with a
    # plan (the good run in between made it), then a new signature's first run fails
    for feeds in ({"x": x, "shape": bad}, {"x": x, "shape": bad}, {"x": y7, "shape": good}):
        with pytest.raises(ox.errors.Fail) as info:
            sess.run(None, feeds)
        assert "Reshape node" in str(info.value) and "Reshape_y" in str(info.value)
        (y,) = sess.run(None, {"x": x, "shape": good})
        np.testing.assert_array_equal(y, x.reshape(2, 3))


def test_device_kernel_errors_name_the_node_and_free_the_run(virt):
    nodes = [node("Relu", ["x"], ["r"]), node("MatMul", ["r", "w"], ["y"])]
    model = make_model(
        nodes, [tensor("x", ["N", "K"]), tensor("w", ["K2", 3])], [tensor("y", ["N", 3])]
    )
    sess = ox.InferenceSession(model, providers=[vd.NAME, CPU])
    x, w = np.ones((4, 5), np.float32), np.ones((5, 3), np.float32)
    alloc = virt.allocator

    def fails(feeds: dict) -> str:
        try:
            sess.run(None, feeds)
        except ox.errors.Fail as e:
            return str(e)
        raise AssertionError("the run did not fail")

    for _ in range(2):
        assert "MatMul_y" in fails({"x": x, "w": np.ones((4, 3), np.float32)})
        gc.collect()
        assert alloc.get_stats()["InUse"] == 0  # nothing of the failed run is kept
        (y,) = sess.run(None, {"x": x, "w": w})
        np.testing.assert_array_equal(y, np.full((4, 3), 5, np.float32))


# ---------------------------------------------------------------------------------------------
# profiling


def test_profiling_writes_every_run_to_json(tmp_path, virt):
    so = ox.SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp_path / "prof_")
    model = graphs.mlp()
    sess = ox.InferenceSession(model, so, providers=[vd.NAME, CPU])
    x = np.ones((2, 4), np.float32)
    for _ in range(3):
        sess.run(None, {"x": x})
    path = sess.end_profiling()
    assert path.startswith(str(tmp_path))
    with open(path) as f:
        events = json.load(f)
    names = [e["name"] for e in events]
    # every run is profiled, the first (recording) run included; shape nodes only there
    assert names.count("Softmax_y_kernel_time") == 3
    assert names.count("Shape_sx_kernel_time") == 1
    by_name = {e["name"]: e for e in events}
    softmax = by_name["Softmax_y_kernel_time"]["args"]
    assert softmax["op_name"] == "Softmax" and softmax["provider"] == vd.NAME
    assert softmax["input_type_shape"] == softmax["output_type_shape"] == [{"float": [2, 3]}]
    assert softmax["activation_size"] == softmax["output_size"] == str(2 * 3 * 4)
    assert by_name["Tanh_h4_kernel_time"]["args"]["provider"] == CPU
    nodes = [e for e in events if e["cat"] == "Node"]
    assert all(e["ph"] == "X" and e["dur"] >= 1 for e in nodes)
