"""Graph capture and replay through the virtual-device plugin, whose streams really queue work:
capturing records the queued closures without running them and a replay queues them again, as
a CUDA graph does. So a replay that read a stale input buffer, a value the capture did not
export, or memory reused too early gives wrong numbers, and every test compares against the
CPU provider (or the same session without graphs, bit for bit).
"""

from __future__ import annotations

import threading
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import onnxplug as ox
from onnxplug.framework import counters
from tests.plugins import graphs
from tests.plugins import virtual_device as vd
from tests.plugins.graphs import make_model, node, tensor

CPU = "CPUExecutionProvider"


def graph_session(model: bytes, **options: str) -> ox.InferenceSession:
    opts = {"enable_graph": "1", **options}
    return ox.InferenceSession(model, providers=[(vd.NAME, opts), CPU])


def cpu_outputs(model: bytes, feeds: dict) -> list[np.ndarray]:
    return ox.InferenceSession(model, providers=[CPU]).run(None, feeds)


def rand(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def with_id(gid: int) -> ox.RunOptions:
    ro = ox.RunOptions()
    ro.add_run_config_entry("gpu_graph_id", str(gid))
    return ro


def stat(factory: vd.VirtualDeviceFactory, key: str) -> int:
    return factory.stats.snapshot()[key]


def assert_equal(got: list, want: list) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_array_equal(g, w)


def test_replays_equal_eager_runs_bit_for_bit(virt):
    model = graphs.chain("Relu", 4)
    sess = graph_session(model)
    eager = graph_session(model)
    for i in range(8):
        x = rand(6, 5, seed=i)
        got = sess.run(None, {"x": x})
        assert_equal(got, eager.run(None, {"x": x}, with_id(-1)))
        assert_equal(got, cpu_outputs(model, {"x": x}))
    # one capture (in the first run, after its warm-up), a replay in every later run
    assert stat(virt, "captured_graphs") == 1
    assert stat(virt, "replays") == 8


def test_steady_replay_is_one_launch_one_copy_in_one_copy_out_one_sync(virt):
    sess = graph_session(graphs.chain("Relu", 5))
    x = rand(3, 4)
    sess.run(None, {"x": x})
    before = virt.stats.snapshot()
    allocs = virt.allocator.get_stats()["NumAllocs"]
    (y,) = sess.run(None, {"x": x + 1})
    d = {k: v - before.get(k, 0) for k, v in virt.stats.snapshot().items()}
    np.testing.assert_array_equal(y, np.maximum(x + 1, 0))
    assert d["replays"] == 1 and d["flushes"] == 1
    assert d["copies_h2d"] == 1 and d["copies_d2h"] == 1
    assert d.get("op:Relu", 0) == 0  # no kernel ran on the host side
    assert virt.allocator.get_stats()["NumAllocs"] == allocs


@pytest.mark.parametrize("warmup", [0, 1, 2, 3])
def test_warmup_runs_decide_when_capture_happens(virt, warmup):
    sess = graph_session(graphs.chain("Relu", 2), graph_warmup_runs=str(warmup))
    x = rand(2, 3)
    sess.run(None, {"x": x})
    # one run() does the whole warm-up and capture sequence, as in onnxruntime: the regular
    # runs (the first, recording one included; at least one on the graph's own frame), then
    # the capture, replayed once
    regular = max(warmup, 2)
    assert stat(virt, "op:Relu") == 2 * regular + 2  # + the captured pass
    assert stat(virt, "captured_graphs") == 1 and stat(virt, "replays") == 1


def test_id_minus_one_never_captures(virt):
    sess = graph_session(graphs.chain("Relu", 2))
    for i in range(5):
        x = rand(2, 3, seed=i)
        assert_equal(
            sess.run(None, {"x": x}, with_id(-1)), cpu_outputs(graphs.chain("Relu", 2), {"x": x})
        )
    assert stat(virt, "capture_begin") == 0


def test_ids_are_independent_graphs_and_release_frees_one(virt):
    model = graphs.chain("Relu", 3)
    sess = graph_session(model)
    x = rand(4, 4)
    for gid in (0, 1, 0, 1):
        assert_equal(sess.run(None, {"x": x}, with_id(gid)), cpu_outputs(model, {"x": x}))
    assert stat(virt, "captured_graphs") == 2
    sess.release_captured_graph(1)
    assert stat(virt, "graphs_released") == 1
    assert [s[1] for s in sess._runner.capture.states()] == [0]
    with pytest.raises(ox.capi.onnxruntime_pybind11_state.InvalidArgument, match="id 7"):
        sess.release_captured_graph(7)
    # id 1 warms up and captures again; id 0 keeps replaying
    replays = stat(virt, "replays")
    assert_equal(sess.run(None, {"x": x}, with_id(0)), cpu_outputs(model, {"x": x}))
    assert stat(virt, "replays") == replays + 1
    assert_equal(sess.run(None, {"x": x}, with_id(1)), cpu_outputs(model, {"x": x}))
    assert stat(virt, "captured_graphs") == 3


def test_bad_graph_id_is_a_clear_error(virt):
    sess = graph_session(graphs.chain("Relu", 1))
    with pytest.raises(ox.capi.onnxruntime_pybind11_state.InvalidArgument, match="gpu_graph_id"):
        sess.run(None, {"x": rand(1, 2)}, with_id("zero"))  # type: ignore[arg-type]


def test_each_shape_gets_its_own_graph(virt):
    model = graphs.chain("Relu", 3)
    sess = graph_session(model)
    for n in (2, 7, 2, 7, 3, 2):
        x = rand(n, 5, seed=n)
        assert_equal(sess.run(None, {"x": x}), cpu_outputs(model, {"x": x}))
    assert stat(virt, "captured_graphs") == 3


def test_piecewise_capture_around_host_nodes(virt):
    # mlp: Tanh and the shape arithmetic run on the host, splitting the device work in two
    model = graphs.mlp()
    sess = graph_session(model)
    for i in range(5):
        x = rand(6, 4, seed=i)
        got = sess.run(None, {"x": x})
        want = cpu_outputs(model, {"x": x})
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    assert stat(virt, "captured_graphs") == 2
    assert stat(virt, "replays") == 2 * 5
    assert stat(virt, "op:Tanh") == 0  # host op: not a device kernel
    (state,) = sess._runner.capture.states()
    assert state[2] == "captured"


def test_failed_capture_is_abandoned_with_a_warning_and_the_run_is_correct(virt):
    # NonZero reads its input on the host (it drains the stream): a synchronisation on a
    # capturing stream, which the stream refuses
    model = graphs.nonzero()
    sess = graph_session(model)
    x = np.array([0, 1, 0, 2, 3, 0], np.float32)
    with pytest.warns(RuntimeWarning, match="NonZero node 'NonZero_nz'.*synchronisation"):
        got = sess.run(None, {"x": x})
    assert_equal(got, cpu_outputs(model, {"x": x}))
    assert stat(virt, "capture_aborted") == 1
    (state,) = sess._runner.capture.states()
    assert state[2] == "disabled" and "NonZero" in state[3]
    # the session stays usable; this signature no longer tries to capture
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for k in range(3):
            x = np.zeros(6, np.float32)
            x[: k + 1] = 1
            assert_equal(sess.run(None, {"x": x}), cpu_outputs(model, {"x": x}))
    assert stat(virt, "capture_begin") == 1


def test_a_capture_that_cannot_start_leaves_the_runs_eager_with_a_warning(virt):
    # a provider refusing to begin a capture (CUDA's legacy default stream, which an external
    # allocator runs on) abandons the signature's graph; the runs are right and go on
    model = graphs.chain("Relu", 3)
    sess = graph_session(model, capture_refused="1")
    want = cpu_outputs(model, {"x": rand(2, 3)})
    with pytest.warns(RuntimeWarning, match="capture cannot start.*cannot capture a graph"):
        for _ in range(3):  # the warm-up runs, then the capture's
            assert_equal(sess.run(None, {"x": rand(2, 3)}), want)
    (state,) = sess._runner.capture.states()
    assert state[2] == "disabled"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            assert_equal(sess.run(None, {"x": rand(2, 3)}), want)
    assert stat(virt, "capture_refused") == 1 and stat(virt, "capture_begin") == 0


def test_a_stream_the_provider_shares_is_never_closed(virt):
    # streams=unified: the provider's one stream serves every frame, recording ones included
    model = graphs.chain("Relu", 2)
    sessions = []  # alive to the end: a collected session's provider closes its stream
    for enable in ("0", "1"):
        sess = ox.InferenceSession(
            model, providers=[(vd.NAME, {"streams": "unified", "enable_graph": enable}), CPU]
        )
        sessions.append(sess)
        for n in (1, 2, 1, 3, 2):
            x = rand(n, 3, seed=n)
            assert_equal(sess.run(None, {"x": x}), cpu_outputs(model, {"x": x}))
        assert stat(virt, "streams_closed") == 0
        assert stat(virt, "streams") == (1 if enable == "0" else 2)
    del sess, sessions
    assert stat(virt, "streams_closed") == 2  # the sessions are gone: their providers close them


def test_iobinding_with_graphs_as_onnxruntime_documents(virt):
    model = graphs.chain("Relu", 3)
    sess = graph_session(model)
    x = rand(3, 4)
    x_dev = ox.OrtValue.ortvalue_from_numpy(x, "virt", 0)
    y_dev = ox.OrtValue.ortvalue_from_shape_and_type([3, 4], np.float32, "virt", 0)
    io = sess.io_binding()
    io.bind_ortvalue_input("x", x_dev)
    io.bind_ortvalue_output("y", y_dev)
    for i in range(4):
        xi = rand(3, 4, seed=i) - 0.5
        x_dev.update_inplace(xi)  # new values, same buffer
        sess.run_with_iobinding(io)
        np.testing.assert_array_equal(y_dev.numpy(), np.maximum(xi, 0))
    assert stat(virt, "captured_graphs") == 1


def test_two_threads_capture_their_own_graphs(virt):
    model = graphs.chain("Relu", 3)
    sess = graph_session(model)
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def worker(k: int) -> None:
        try:
            start.wait()
            for i in range(6):
                x = rand(4, 3, seed=10 * k + i)
                assert_equal(sess.run(None, {"x": x}), [np.maximum(x, 0)])
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert stat(virt, "captured_graphs") == 2  # one per thread, same signature and id


def test_outputs_of_run_with_ort_values_survive_later_replays(virt):
    model = graphs.chain("Relu", 2)
    sess = graph_session(model)
    a = rand(2, 2, seed=1)
    b = rand(2, 2, seed=2)
    (ya,) = sess.run_with_ort_values(None, {"x": ox.OrtValue.ortvalue_from_numpy(a)})
    (yb,) = sess.run_with_ort_values(None, {"x": ox.OrtValue.ortvalue_from_numpy(b)})
    np.testing.assert_array_equal(ya.numpy(), np.maximum(a, 0))
    np.testing.assert_array_equal(yb.numpy(), np.maximum(b, 0))


def test_graph_cache_is_bounded_per_thread(virt):
    model = graphs.chain("Relu", 1)
    so = ox.SessionOptions()
    so.add_session_config_entry("session.graph_capture_cache_size", "2")
    sess = ox.InferenceSession(model, so, providers=[(vd.NAME, {"enable_graph": "1"}), CPU])
    for n in (1, 2, 3, 1):
        x = rand(n, 2, seed=n)
        assert_equal(sess.run(None, {"x": x}), [np.maximum(x, 0)])
    assert len(sess._runner.capture.states()) == 2
    assert stat(virt, "graphs_released") == 2  # n=1 evicted by n=3, then n=2 by n=1 again
    bad = ox.SessionOptions()
    bad.add_session_config_entry("session.graph_capture_cache_size", "0")
    with pytest.raises(ox.capi.onnxruntime_pybind11_state.InvalidArgument, match="cache_size"):
        ox.InferenceSession(model, bad, providers=[(vd.NAME, {"enable_graph": "1"}), CPU])


def test_replay_counters(virt):
    sess = graph_session(graphs.chain("Relu", 2))
    x = rand(2, 2)
    sess.run(None, {"x": x})
    before = counters.snapshot()
    sess.run(None, {"x": x})
    d = counters.delta(before)
    assert d[counters.GRAPH_REPLAYS] == 1 and d[counters.GRAPH_CAPTURES] == 0


_SHAPES = [(2, 3), (4, 3), (1, 3)]


@settings(max_examples=25, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(range(len(_SHAPES))), st.sampled_from([-1, 0, 1, 2])),
        min_size=1,
        max_size=14,
    ),
    st.integers(0, 3),
)
def test_capture_state_machine(ops, warmup):
    """Any sequence of shapes and annotation ids (and releases) gives the eager results, and
    at most one graph exists per (shape, id)."""
    from tests.conftest import VIRT, registered

    model = make_model(
        [node("Relu", ["x"], ["r"]), node("Neg", ["r"], ["y"])],
        [tensor("x", ["N", 3])],
        [tensor("y", ["N", 3])],
    )
    with registered(vd.NAME, f"{VIRT}:create_factory") as factory:
        sess = graph_session(model, graph_warmup_runs=str(warmup))
        for k, (shape_i, gid) in enumerate(ops):
            x = rand(*_SHAPES[shape_i], seed=k)
            (y,) = sess.run(None, {"x": x}, with_id(gid))
            np.testing.assert_array_equal(y, -np.maximum(x, 0))
            if k % 5 == 4 and gid in sess._runner.capture.captured_annotations():
                sess.release_captured_graph(gid)
        stats = factory.stats.snapshot()
        live = stats["captured_graphs"] - stats["graphs_released"]
        assert 0 <= live <= len(_SHAPES) * 3
        assert stats["capture_aborted"] == 0
