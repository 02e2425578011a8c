"""The replay fast path, counted: what a steady replayed run does on the host (launches, copies,
synchronisations, allocations, views), and the safety of the copies a graph holds (a graph that
copies from a bound value never replays for another one, and never writes memory the user no
longer binds). Run on the virtual device, whose streams really queue and record work, so a
replay that read a stale buffer gives a wrong number; with ``virt_pinned`` feeds and outputs
go through pinned staging buffers, as with CUDA.
"""

from __future__ import annotations

import numpy as np
import pytest

import onnxplug as ox
from onnxplug.framework import counters
from tests.conftest import run_in_threads
from tests.plugins import graphs
from tests.plugins import virtual_device as vd

CPU = "CPUExecutionProvider"


def graph_session(name: str, model: bytes, **options: str) -> ox.InferenceSession:
    return ox.InferenceSession(model, providers=[(name, {"enable_graph": "1", **options}), CPU])


def rand(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def allocs(factory: vd.VirtualDeviceFactory) -> int:
    n = factory.allocator.get_stats()["NumAllocs"]
    if factory.pinned_allocator is not None:
        n += factory.pinned_allocator.get_stats()["NumAllocs"]
    return n


class Counted:
    """What one block of runs did: the device's events and the process's counters."""

    def __init__(self, factory: vd.VirtualDeviceFactory):
        self.factory = factory

    def __enter__(self) -> Counted:
        self._stats = self.factory.stats.snapshot()
        self._counters = counters.snapshot()
        self._allocs = allocs(self.factory)
        return self

    def __exit__(self, *exc: object) -> None:
        now = self.factory.stats.snapshot()
        self.stats = {k: now[k] - self._stats.get(k, 0) for k in now}
        self.counters = counters.delta(self._counters)
        self.allocs = allocs(self.factory) - self._allocs

    def __getitem__(self, key: str) -> int:
        return self.stats.get(key, 0)


def bound_session(factory: vd.VirtualDeviceFactory, model: bytes, shape: tuple[int, ...]):
    sess = graph_session(factory.name, model)
    dev = factory.device.id
    x = ox.OrtValue.ortvalue_from_numpy(np.zeros(shape, np.float32), "virt", dev)
    y = ox.OrtValue.ortvalue_from_shape_and_type(list(shape), np.float32, "virt", dev)
    io = sess.io_binding()
    io.bind_ortvalue_input("x", x)
    io.bind_ortvalue_output("y", y)
    return sess, io, x, y


@pytest.mark.parametrize("fixture", ["virt", "virt_pinned"])
def test_steady_iobinding_replay_is_one_launch_no_copy_one_sync(fixture, request):
    factory = request.getfixturevalue(fixture)
    sess, io, x, y = bound_session(factory, graphs.chain("Relu", 3), (3, 4))
    sess.run_with_iobinding(io)  # records, warms up, captures (the graph holds both copies)
    for i in range(5):
        xi = rand(3, 4, seed=i)
        x.update_inplace(xi)  # new values, same buffer: what onnxruntime documents
        with Counted(factory) as c:
            sess.run_with_iobinding(io)
        np.testing.assert_array_equal(y.numpy(), np.maximum(xi, 0))
        assert c["replays"] == 1 and c["flushes"] == 1
        # the copies into the feed buffer and out of the planned output are in the graph
        assert c["copies_h2d"] == c["copies_d2d"] == c["copies_d2h"] == 0
        # what the graph queues: the copy in, the three Relus, the copy out
        assert c["stream_ops"] == 5 and c["captured_ops"] == 0
        assert c["op:Relu"] == 0 and c["capture_begin"] == 0
        assert c.allocs == 0
        assert c.counters[counters.GRAPH_REPLAYS] == 1
        assert c.counters[counters.GRAPH_CAPTURES] == 0
        assert c.counters[counters.VIEWS_BUILT] == 0
    assert io.get_outputs()[0] is y


def test_steady_run_replay_through_pinned_staging_issues_no_copy(virt_pinned):
    model = graphs.chain("Relu", 2)
    sess = graph_session(vd.PINNED_NAME, model)
    sess.run(None, {"x": rand(2, 5)})
    for i in range(5):
        xi = rand(2, 5, seed=i)
        with Counted(virt_pinned) as c:
            (y,) = sess.run(None, {"x": xi})
        np.testing.assert_array_equal(y, np.maximum(xi, 0))
        assert c["replays"] == 1 and c["flushes"] == 1
        assert c["copies_h2d"] == c["copies_d2d"] == c["copies_d2h"] == 0
        assert c.allocs == 0 and c.counters[counters.VIEWS_BUILT] == 0
        assert c.counters[counters.GRAPH_REPLAYS] == 1


def test_without_pinned_staging_the_host_copies_each_array(virt):
    sess = graph_session(vd.NAME, graphs.chain("Relu", 2))
    sess.run(None, {"x": rand(2, 5)})
    with Counted(virt) as c:
        (y,) = sess.run(None, {"x": rand(2, 5, seed=3)})
    np.testing.assert_array_equal(y, np.maximum(rand(2, 5, seed=3), 0))
    assert c["copies_h2d"] == 1 and c["copies_d2h"] == 1 and c["replays"] == 1
    assert c.allocs == 0


def test_binding_another_input_never_replays_the_graph_that_copies_the_old_one(virt):
    sess, io, x, y = bound_session(virt, graphs.chain("Relu", 2), (2, 3))
    x.update_inplace(rand(2, 3, seed=1))
    sess.run_with_iobinding(io)
    assert virt.stats.snapshot()["captured_graphs"] == 1
    other = ox.OrtValue.ortvalue_from_numpy(rand(2, 3, seed=2), "virt", 0)
    io.bind_ortvalue_input("x", other)
    sess.run_with_iobinding(io)
    np.testing.assert_array_equal(y.numpy(), np.maximum(rand(2, 3, seed=2), 0))
    # captured again, now without the copy from a bound value: the host makes it
    assert virt.stats.snapshot()["captured_graphs"] == 2
    for k, value in enumerate((x, other, x)):
        io.bind_ortvalue_input("x", value)
        value.update_inplace(rand(2, 3, seed=10 + k))
        with Counted(virt) as c:
            sess.run_with_iobinding(io)
        np.testing.assert_array_equal(y.numpy(), np.maximum(rand(2, 3, seed=10 + k), 0))
        assert c["replays"] == 1 and c["capture_begin"] == 0
        assert c["copies_d2d"] == 2  # into the feed buffer, out of the planned output


def test_an_output_no_longer_bound_is_never_written(virt):
    sess, io, x, y = bound_session(virt, graphs.chain("Relu", 1), (2, 2))
    sess.run_with_iobinding(io)
    y2 = ox.OrtValue.ortvalue_from_shape_and_type([2, 2], np.float32, "virt", 0)
    io.bind_ortvalue_output("y", y2)
    y.update_inplace(np.full((2, 2), 7, np.float32))  # the user's memory now
    for i in range(3):
        x.update_inplace(rand(2, 2, seed=i))
        sess.run_with_iobinding(io)
        np.testing.assert_array_equal(y2.numpy(), np.maximum(rand(2, 2, seed=i), 0))
        np.testing.assert_array_equal(y.numpy(), np.full((2, 2), 7, np.float32))


def test_run_and_iobinding_on_one_session_stay_correct(virt_pinned):
    model = graphs.chain("Relu", 2)
    sess, io, x, y = bound_session(virt_pinned, model, (3, 3))
    for i in range(6):
        xi = rand(3, 3, seed=i)
        if i % 2:
            (got,) = sess.run(None, {"x": xi})
        else:
            x.update_inplace(xi)
            sess.run_with_iobinding(io)
            got = y.numpy()
        np.testing.assert_array_equal(got, np.maximum(xi, 0))
    # one capture holding the bound copies, then one holding none, for both ways
    assert virt_pinned.stats.snapshot()["captured_graphs"] == 2
    assert virt_pinned.stats.snapshot()["graphs_released"] == 1


def test_graph_id_minus_one_and_terminate_still_apply_after_capture(virt):
    model = graphs.chain("Relu", 2)
    sess = graph_session(vd.NAME, model)
    x = rand(2, 2)
    sess.run(None, {"x": x})
    skip = ox.RunOptions()
    skip.add_run_config_entry("gpu_graph_id", "-1")
    with Counted(virt) as c:
        (y,) = sess.run(None, {"x": x + 1}, skip)
    np.testing.assert_array_equal(y, np.maximum(x + 1, 0))
    assert c["replays"] == 0 and c["op:Relu"] == 2
    stop = ox.RunOptions()
    stop.terminate = True
    with pytest.raises(ox.capi.onnxruntime_pybind11_state.Fail, match="terminate"):
        sess.run(None, {"x": x}, stop)
    stop.terminate = False
    with Counted(virt) as c:
        (y,) = sess.run(None, {"x": x}, stop)
    np.testing.assert_array_equal(y, np.maximum(x, 0))
    assert c["replays"] == 1


def test_a_released_graph_is_never_replayed(virt):
    sess, io, x, y = bound_session(virt, graphs.chain("Relu", 1), (1, 4))
    sess.run_with_iobinding(io)
    sess.release_captured_graph(0)
    x.update_inplace(rand(1, 4, seed=5))
    with Counted(virt) as c:
        sess.run_with_iobinding(io)
    np.testing.assert_array_equal(y.numpy(), np.maximum(rand(1, 4, seed=5), 0))
    assert c["capture_begin"] == 1 and c["graphs_released"] == 0


def test_threads_replay_their_own_bound_graphs(virt):
    sess = graph_session(vd.NAME, graphs.chain("Relu", 2))

    def work(k: int) -> None:
        x = ox.OrtValue.ortvalue_from_numpy(np.zeros((4, 3), np.float32), "virt", 0)
        y = ox.OrtValue.ortvalue_from_shape_and_type([4, 3], np.float32, "virt", 0)
        io = sess.io_binding()
        io.bind_ortvalue_input("x", x)
        io.bind_ortvalue_output("y", y)
        for i in range(8):
            xi = rand(4, 3, seed=10 * k + i)
            x.update_inplace(xi)
            sess.run_with_iobinding(io)
            np.testing.assert_array_equal(y.numpy(), np.maximum(xi, 0))

    run_in_threads(work, 2)
    assert virt.stats.snapshot()["captured_graphs"] == 2


def test_an_evicted_signature_releases_its_graphs(virt):
    from onnxplug.framework import executor

    so = ox.SessionOptions()
    so.add_session_config_entry("session.graph_capture_cache_size", "64")
    model = graphs.chain("Relu", 1)
    sess = ox.InferenceSession(model, so, providers=[(vd.NAME, {"enable_graph": "1"}), CPU])
    for n in range(1, executor._MAX_SIGNATURES + 2):
        x = rand(n, 2, seed=n)
        (y,) = sess.run(None, {"x": x})
        np.testing.assert_array_equal(y, np.maximum(x, 0))
    stats = virt.stats.snapshot()
    assert stats["captured_graphs"] == executor._MAX_SIGNATURES + 1
    assert stats["graphs_released"] == 1  # the first signature's, with its plan
    assert len(sess._runner.capture.states()) == executor._MAX_SIGNATURES


def test_steady_replays_take_the_bound_path(virt_pinned, monkeypatch):
    """Neither the executor's run nor its feed staging runs for a steady replay, by run() or
    by IOBinding: a bypassed fast path fails here, not only in a benchmark."""
    from onnxplug.framework.executor import GraphRunner

    sess, io, x, y = bound_session(virt_pinned, graphs.chain("Relu", 1), (2, 2))
    plain = graph_session(vd.PINNED_NAME, graphs.chain("Relu", 1))
    sess.run_with_iobinding(io)
    plain.run(None, {"x": rand(2, 2)})

    def general(*args: object, **kwargs: object) -> None:
        raise AssertionError("a steady replay went through the executor's general path")

    monkeypatch.setattr(GraphRunner, "_execute", general)
    monkeypatch.setattr(GraphRunner, "_stage_feeds", general)
    x.update_inplace(rand(2, 2, seed=1))
    sess.run_with_iobinding(io)
    np.testing.assert_array_equal(y.numpy(), np.maximum(rand(2, 2, seed=1), 0))
    (got,) = plain.run(None, {"x": rand(2, 2, seed=2)})
    np.testing.assert_array_equal(got, np.maximum(rand(2, 2, seed=2), 0))


def test_warm_up_runs_stage_feeds_as_the_capture_does(virt, monkeypatch):
    """A bound device input is copied into the frame's feed buffer in the warm-up runs too: a
    kernel prepared in a warm-up binds the buffer the captured graph reads (bound to the
    user's value instead, the capture found other pointers, fell back to the unprepared
    call, whose scratch request the warm-up never made, and abandoned the graph on CUDA)."""
    from onnxplug.framework.executor import GraphRunner

    modes: list[bool] = []
    execute = GraphRunner._execute

    def spy(self, frame, feeds, run_options, recorder, fetch, body=None, graph_mode=False, *a, **k):
        modes.append(graph_mode)
        return execute(self, frame, feeds, run_options, recorder, fetch, body, graph_mode, *a, **k)

    monkeypatch.setattr(GraphRunner, "_execute", spy)
    sess, io, x, y = bound_session(virt, graphs.chain("Relu", 3), (3, 4))
    x.update_inplace(rand(3, 4))
    sess.run_with_iobinding(io)  # the recording run, warm-up runs and the capture
    # the recording run's frame is never reused; every run of the capturing context's frame
    # (warm-ups, then the capture) stages its feeds as the graph will read them
    assert len(modes) >= 3 and all(modes[1:]), modes
    np.testing.assert_array_equal(y.numpy(), np.maximum(x.numpy(), 0))
