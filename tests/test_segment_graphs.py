"""Eager runs replay their bound steps as graphs (executor.segment_program), on the
virtual-device plugin with ``segments=1``: its launchers re-queue their work and its streams
record queued work as a graph, as the CUDA provider's node graphs and streams do. A frame's
first run binds, its second captures each maximal group of consecutive capturable steps on one
stream as one graph, and later runs launch one graph per group. A segment that read a stale
input, skipped an output or ran where the values it reads are not the ones it captured would
give wrong numbers: every run is compared with the CPU provider.
"""

from __future__ import annotations

import numpy as np
import pytest

import onnxplug as ox
from tests.plugins import graphs
from tests.plugins import virtual_device as vd

CPU = "CPUExecutionProvider"


def session(model: bytes, **options: str) -> ox.InferenceSession:
    return ox.InferenceSession(model, providers=[(vd.NAME, {"segments": "1", **options}), CPU])


def rand(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def delta(factory: vd.VirtualDeviceFactory, before: dict, key: str) -> int:
    return factory.stats.snapshot()[key] - before.get(key, 0)


def check(sess: ox.InferenceSession, model: bytes, x: np.ndarray) -> None:
    want = ox.InferenceSession(model, providers=[CPU]).run(None, {"x": x})
    for g, w in zip(sess.run(None, {"x": x}), want):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


def test_a_chain_becomes_one_graph_launched_once_per_run(virt):
    model = graphs.chain("Relu", 5)
    sess = session(model)
    check(sess, model, rand(3, 4, seed=0))  # records the signature
    check(sess, model, rand(3, 4, seed=1))  # binds the frame
    before = virt.stats.snapshot()
    check(sess, model, rand(3, 4, seed=2))  # captures the group, then launches it
    assert delta(virt, before, "segments_captured") == 1
    assert delta(virt, before, "segment_launches") == 1
    for i in range(3, 7):
        before = virt.stats.snapshot()
        check(sess, model, rand(3, 4, seed=i))
        assert delta(virt, before, "segment_launches") == 1
        assert delta(virt, before, "segments_captured") == 0
        # the five nodes' work, queued by one launch
        assert delta(virt, before, "stream_ops") >= 5


def test_a_node_on_another_provider_splits_the_segments(virt):
    """Tanh runs on the CPU: the steps before it and after it are two groups, with the copies
    between them outside both."""
    model = graphs.mlp()
    sess = session(model)
    for i in range(3):
        check(sess, model, rand(5, 4, seed=i))
    before = virt.stats.snapshot()
    for i in range(3, 6):
        check(sess, model, rand(5, 4, seed=i))
    assert delta(virt, before, "segment_launches") == 2 * 3


def test_iobinding_runs_launch_the_graph_and_follow_a_rebound_input(virt):
    """A bound device input is copied into the frame's feed buffer, so the graph reads the
    same memory whatever is bound: rebinding gives the new numbers and still one launch."""
    model = graphs.chain("Relu", 4)
    sess = session(model)
    io = sess.io_binding()
    io.bind_output("y")
    xs = [rand(2, 3, seed=i) for i in range(6)]
    for i, x in enumerate(xs):
        io.bind_ortvalue_input("x", ox.OrtValue.ortvalue_from_numpy(x, "virt", 0))
        before = virt.stats.snapshot()
        sess.run_with_iobinding(io)
        np.testing.assert_array_equal(io.copy_outputs_to_cpu()[0], np.maximum(x, 0))
        if i >= 3:
            assert delta(virt, before, "segment_launches") == 1


class _Launcher:
    """A bound step for ``segment_program``: it writes ``out`` from ``src`` (on the "device":
    into ``mem``) when its input is the value it bound, else it "computes" (counted)."""

    def __init__(self, log, mem, stream, src, out, value_in, value_out):
        self.log, self.mem, self.src, self.out = log, mem, src, out
        self.value_in, self.value_out = value_in, value_out
        self.segment = (stream, ((src, value_in),), ((out, value_out),), self.graph_of)
        self.values = None

    def __call__(self, ctx):
        values = ctx
        if values[self.src] is not self.value_in:
            self.log.append(("compute", self.out))
            values[self.out] = object()
            return
        values[self.out] = self.value_out
        self.log.append(("launch", self.out))

    def graph_of(self, work):
        self.log.append(("capture",))
        recorded = []
        self.log, saved = recorded, self.log  # what the steps do while captured
        try:
            work()
        finally:
            self.log = saved
        self.log.append(("captured", len(recorded)))
        return lambda: self.log.append(("graph",))


def test_segment_program_checks_what_a_group_reads_from_outside():
    """Unit test of executor.segment_program with fake launchers: a group of two steps on one
    stream is captured; a step on another stream and a step without a segment stay steps; a
    value the group reads from outside that is not the bound one runs its steps one by one."""
    from onnxplug.framework.executor import _run_steps, segment_program

    log: list = []
    a, other = object(), object()
    feed, h, y, z = object(), object(), object(), object()
    values = [feed, None, None, None, None]
    first = _Launcher(log, None, a, 0, 1, feed, h)
    second = _Launcher(log, None, a, 1, 2, h, y)
    # the group's graph is the first launcher's: both record into its log while captured
    second.log = first.log
    third = _Launcher(log, None, other, 2, 3, y, z)

    def plain(ctx):
        log.append(("plain",))
        values[4] = 1

    steps = [(first, values, ()), (second, values, (1,)), (third, values, ()), (plain, None, ())]
    program = segment_program(steps, values, [None], None)
    assert len(program) == 3  # the group, the step on the other stream, the plain step
    assert values[2] is y and values[1] is None  # released after the group
    log.clear()
    _run_steps(program, values, [None], None)
    assert log[0] == ("graph",) and values[2] is y and values[3] is z
    log.clear()
    values[0] = object()  # the group's outside input is not the bound one
    _run_steps(program, values, [None], None)
    assert log[0] == ("compute", 1)  # its steps one by one: the first computes
    assert ("graph",) not in log


def test_a_group_whose_capture_fails_keeps_its_steps(virt, monkeypatch):
    from tests.plugins.virtual_device.stream import VirtStream

    monkeypatch.setattr(VirtStream, "graph_of", lambda self, work: None)
    model = graphs.chain("Relu", 4)
    sess = session(model)
    for i in range(6):
        check(sess, model, rand(3, 3, seed=i))
    assert virt.stats.snapshot()["segment_launches"] == 0


@pytest.mark.parametrize("options", [{"enable_graph": "1"}, {"streams": "none"}])
def test_no_segments_where_whole_runs_are_captured_or_there_is_no_stream(virt, options):
    model = graphs.chain("Relu", 4)
    sess = session(model, **options)
    for i in range(6):
        check(sess, model, rand(3, 3, seed=i))
    assert virt.stats.snapshot()["segments_captured"] == 0


def test_profiled_runs_time_each_node_and_later_runs_still_launch_the_graph(virt, tmp_path):
    import json

    model = graphs.chain("Relu", 3)
    so = ox.SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp_path / "p")
    sess = ox.InferenceSession(model, so, providers=[(vd.NAME, {"segments": "1"}), CPU])
    for i in range(5):
        check(sess, model, rand(2, 2, seed=i))
    with open(sess.end_profiling()) as f:
        events = json.load(f)
    nodes = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    assert len(nodes) == 3 * 5  # every node of every run
