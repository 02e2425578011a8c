"""Multi-device execution through the virtual-device plugin: partitioning, copy nodes, the
static memory plan, views, data-dependent shapes, concurrent runs and cross-stream waits.

Every test compares against the CPU provider: the virtual device queues its work and poisons
fresh memory, so a missing copy, wait or flush, or memory reused too early, gives wrong numbers.
"""

from __future__ import annotations

import numpy as np
import pytest

import onnxplug as ox
from tests.conftest import run_in_threads
from tests.plugins import graphs
from tests.plugins import virtual_device as vd
from tests.plugins.graphs import make_model, node, tensor
from tests.plugins.virtual_device.stream import Stats, VirtStream

CPU = "CPUExecutionProvider"


def cpu_outputs(model: bytes, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    return ox.InferenceSession(model, providers=[CPU]).run(None, feeds)


def assert_same(got: list, want: list) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def rand(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def assignment(sess: ox.InferenceSession) -> list[tuple[str, str, str]]:
    return [
        (r["node_name"], r["op_type"], r["ep"]) for r in sess.get_provider_graph_assignment_info()
    ]


def allocs_of(factory: vd.VirtualDeviceFactory, fn) -> int:
    before = factory.allocator.get_stats()["NumAllocs"]
    fn()
    return factory.allocator.get_stats()["NumAllocs"] - before


# ---------------------------------------------------------------------------------------------
# the plugin itself: what makes the other tests able to fail


def test_virtual_stream_runs_work_only_when_flushed_or_waited_on():
    stats = Stats()
    dev = ox.ep.Device("virt", 0, host_accessible=True)
    producer, consumer = VirtStream(dev, stats), VirtStream(dev, stats)
    log: list[str] = []
    producer.enqueue(lambda: log.append("p1"))
    note = producer.create_notification()
    note.activate()
    producer.enqueue(lambda: log.append("p2"))
    note.wait_on_device(consumer)
    consumer.enqueue(lambda: log.append("c1"))
    assert log == []  # nothing runs at enqueue time
    consumer.flush()
    assert log == ["p1", "c1"]  # the wait ran the producer up to the notification only
    assert consumer.last_wait_on(producer) == note.sync_id > 0
    note.wait_on_host()
    assert log == ["p1", "c1"]
    producer.flush()
    assert log == ["p1", "c1", "p2"]
    assert stats.snapshot()["device_waits"] == 1


def test_virtual_allocator_poisons_fresh_memory_and_tracks_live_blocks(virt):
    alloc = virt.allocator
    t = ox.ep.allocate_tensor(alloc, (4,), np.float32)
    assert np.isnan(t.host_array()).all()
    assert vd.allocator.is_live(t.ptr, t.nbytes)
    assert not vd.allocator.is_live(t.ptr, t.nbytes + 64)
    ptr, nbytes = t.ptr, t.nbytes
    del t
    assert not vd.allocator.is_live(ptr, nbytes)


def test_kernel_refuses_host_input_so_missing_copies_fail(virt):
    # Relu's kernel fed a host array directly (as if the copy node were missing)
    from onnxplug.ep import KernelContext

    sess = ox.InferenceSession(graphs.chain("Relu", 1), providers=[vd.NAME, CPU])
    step = sess._runner.plan.steps[0]
    ctx = KernelContext(
        [np.ones(3, np.float32), None], (0,), (1,), (), step.info, (None,), None, None
    )
    with pytest.raises(TypeError, match="copy node is missing"):
        step.kernel.compute(ctx)


# ---------------------------------------------------------------------------------------------
# partitioning and copies


def test_nodes_split_across_devices_with_copies_at_the_boundaries(virt):
    model = graphs.mlp()
    sess = ox.InferenceSession(model, providers=[vd.NAME, CPU])
    got = {name: ep for name, _, ep in assignment(sess)}
    for n in (
        "MatMul_h1",
        "Add_h2",
        "Relu_h3",
        "MatMul_h5",
        "Reshape_h6",
        "Softmax_y",
        "Transpose_t",
    ):
        assert got[n] == vd.NAME, n
    for n in ("Tanh_h4", "Shape_sx", "Gather_n", "Unsqueeze_n1", "Concat_shp"):
        assert got[n] == CPU, n
    # Relu (device) -> Tanh (host) -> MatMul (device): one copy each way, run by the device EP
    copies = [(op, ep) for name, op, ep in assignment(sess) if op.startswith("Memcpy")]
    assert sorted(copies) == [("MemcpyFromHost", vd.NAME), ("MemcpyToHost", vd.NAME)]
    order = [name for name, _, _ in assignment(sess)]
    to_host = next(n for n in order if n.startswith("MemcpyToHost"))
    from_host = next(n for n in order if n.startswith("MemcpyFromHost"))
    assert order.index("Relu_h3") < order.index(to_host) < order.index("Tanh_h4")
    assert order.index("Tanh_h4") < order.index(from_host) < order.index("MatMul_h5")
    assert sess.get_ep_graph_assignment_summary()[vd.NAME] == 9

    for n in (1, 5, 2, 5):
        x = rand(n, 4, seed=n)
        assert_same(sess.run(None, {"x": x}), cpu_outputs(model, {"x": x}))
    stats = virt.stats.snapshot()
    assert stats["copies_d2h"] > 0 and stats["copies_h2d"] > 0 and stats["op:Softmax"] == 4


def test_outputs_live_on_the_device_until_fetched(virt):
    model = graphs.mlp()
    sess = ox.InferenceSession(model, providers=[vd.NAME, CPU])
    x = rand(3, 4)
    y, t = sess.run_with_ort_values(None, {"x": ox.OrtValue.ortvalue_from_numpy(x)})
    assert y.device_name() == "virt" and t.device_name() == "virt"
    assert_same([y.numpy(), t.numpy()], cpu_outputs(model, {"x": x}))


def test_device_resident_input(virt):
    model = graphs.chain("Relu", 3)
    sess = ox.InferenceSession(model, providers=[vd.NAME, CPU])
    x = rand(4, 5)
    xv = ox.OrtValue.ortvalue_from_numpy(x, "virt", 0)
    copies_before = virt.stats.snapshot()["copies_h2d"]
    (y,) = sess.run(None, {"x": xv})
    assert virt.stats.snapshot()["copies_h2d"] == copies_before  # used where it was
    np.testing.assert_array_equal(y, np.maximum(x, 0))


# ---------------------------------------------------------------------------------------------
# the static memory plan


def test_memory_plan_makes_allocations_per_run_constant(virt):
    model = graphs.mlp()
    sess = ox.InferenceSession(model, providers=[vd.NAME, CPU])
    x = rand(64, 4)
    want = cpu_outputs(model, {"x": x})
    counts = []
    for _ in range(5):
        out: list = []
        counts.append(allocs_of(virt, lambda out=out: out.extend(sess.run(None, {"x": x}))))
        assert_same(out, want)
    first, planned, *steady = counts
    # first run: every tensor on its own; second: one block per frame for all
    # intermediates, the feed's buffer and the outputs, and the frame's workspace (Softmax's);
    # then the pooled frame's block and workspace are reused and nothing allocates
    assert first > planned > steady[0]
    assert planned == 2
    assert steady == [0, 0, 0]


def test_each_shape_signature_gets_its_own_plan(virt):
    model = graphs.mlp()
    sess = ox.InferenceSession(model, providers=[vd.NAME, CPU])
    xs = {n: rand(n, 4, seed=n) for n in (3, 17, 40)}
    want = {n: cpu_outputs(model, {"x": x}) for n, x in xs.items()}
    runs: dict[int, list[int]] = {n: [] for n in xs}
    for _ in range(4):
        for n, x in xs.items():
            out: list = []
            runs[n].append(
                allocs_of(virt, lambda x=x, out=out: out.extend(sess.run(None, {"x": x})))
            )
            assert_same(out, want[n])
    for n, counts in runs.items():
        # each signature records once, plans once, then stays at its steady count even though
        # the other signatures ran in between
        assert counts[0] > counts[1] > counts[2] == counts[3], (n, counts)


def test_views_survive_the_memory_plan(virt):
    # r dies as a slot right after the Reshape, but its memory lives on as v, which is read
    # after a and b were allocated: a plan that ignored the alias would hand r's block to them
    nodes = [
        node("Relu", ["x"], ["r"]),
        node("Reshape", ["r", "shape"], ["v"]),
        node("Mul", ["v", "v"], ["a"]),
        node("Relu", ["a"], ["b"]),
        node("Sub", ["b", "v"], ["c"]),
        node("Add", ["c", "v"], ["y"]),
    ]
    model = make_model(
        nodes,
        [tensor("x", ["N", 6])],
        [tensor("y", ["N", 3, 2])],
        {"shape": np.array([-1, 3, 2], np.int64)},
    )
    sess = ox.InferenceSession(model, providers=[vd.NAME, CPU])
    assert all(ep == vd.NAME for _, _, ep in assignment(sess))
    for n in (4, 4, 4, 7, 7, 7, 4):
        x = rand(n, 6, seed=n)
        assert_same(sess.run(None, {"x": x}), cpu_outputs(model, {"x": x}))


def test_data_dependent_shapes_fall_back_to_dynamic_allocation(virt):
    model = graphs.nonzero()
    sess = ox.InferenceSession(model, providers=[vd.NAME, CPU])
    eps = {name: ep for name, _, ep in assignment(sess)}
    assert eps["NonZero_nz"] == vd.NAME and eps["Shape_s"] == CPU
    rng = np.random.default_rng(0)
    # one signature, different numbers of non-zeros: the plan recorded on the first run must
    # not pin NonZero's output size, nor the Shape computed from it
    for k in (3, 9, 0, 9, 1, 12, 3):
        x = np.zeros(12, np.float32)
        x[rng.choice(12, size=k, replace=False)] = 1.0
        idx, s = sess.run(None, {"x": x})
        assert_same([idx, s], cpu_outputs(model, {"x": x}))
        assert s.tolist() == [k, 1]


def test_concurrent_runs_use_separate_frames(virt):
    model = graphs.mlp()
    sess = ox.InferenceSession(model, providers=[vd.NAME, CPU])
    xs = [rand(n, 4, seed=i) for i, n in enumerate((2, 9, 2, 9, 5, 2))]
    want = [cpu_outputs(model, {"x": x}) for x in xs]

    def worker(k: int) -> None:
        for i in range(15):
            j = (k + i) % len(xs)
            assert_same(sess.run(None, {"x": xs[j]}), want[j])

    run_in_threads(worker, 6)


def test_feed_consumed_on_two_devices_and_the_host(virt, virt1):
    nodes = [
        node("Relu", ["x"], ["a"]),  # virt:0
        node("Mul", ["x", "x"], ["b"]),  # virt:1
        node("Tanh", ["x"], ["c"]),  # host
        node("Sub", ["a", "c"], ["y0"]),
        node("Add", ["b", "c"], ["y1"]),
    ]
    model = make_model(
        nodes, [tensor("x", ["N", 3])], [tensor("y0", ["N", 3]), tensor("y1", ["N", 3])]
    )
    sess = ox.InferenceSession(
        model,
        providers=[(vd.NAME, {"ops": "Relu,Sub"}), (vd.SECOND_NAME, {"ops": "Mul,Add"}), CPU],
    )
    eps = {name: ep for name, _, ep in assignment(sess)}
    assert eps["Relu_a"] == eps["Sub_y0"] == vd.NAME
    assert eps["Mul_b"] == eps["Add_y1"] == vd.SECOND_NAME
    for n in (2, 2, 3, 2):
        x = rand(n, 3, seed=n)
        assert_same(sess.run(None, {"x": x}), cpu_outputs(model, {"x": x}))
        xv = ox.OrtValue.ortvalue_from_numpy(x, "virt", 1)  # resident on one of the two
        assert_same(sess.run(None, {"x": xv}), cpu_outputs(model, {"x": x}))


# ---------------------------------------------------------------------------------------------
# streams


def test_two_devices_exchange_values_through_the_host_with_waits(virt, virt1):
    model = graphs.exchange()
    sess = ox.InferenceSession(
        model,
        providers=[(vd.NAME, {"ops": "Relu,MatMul"}), (vd.SECOND_NAME, {"ops": "Add,Mul"}), CPU],
    )
    ops = [(op, ep) for _, op, ep in assignment(sess)]
    assert ("MatMul", vd.NAME) in ops and ("Add", vd.SECOND_NAME) in ops
    # virt:0 -> host -> virt:1 -> host -> virt:0: each crossing is a pair of copies, the
    # first of each pair run by the source device, the second by the destination
    assert ops.count(("MemcpyToHost", vd.NAME)) == 1
    assert ops.count(("MemcpyFromHost", vd.SECOND_NAME)) == 1
    assert ops.count(("MemcpyToHost", vd.SECOND_NAME)) == 1
    assert ops.count(("MemcpyFromHost", vd.NAME)) == 1
    for n in (3, 3, 3, 8):
        x = rand(n, 6, seed=n)
        assert_same(sess.run(None, {"x": x}), cpu_outputs(model, {"x": x}))
    # the consumer's stream waited for the producer's notification, both ways
    assert virt.stats.snapshot()["device_waits"] >= 4
    assert virt1.stats.snapshot()["device_waits"] >= 4


@pytest.mark.parametrize("first", [vd.NAME, vd.SHARED_DEVICE_NAME])
def test_providers_sharing_a_device_wait_for_each_other(virt, virt_b, first):
    # Two providers on virt:0 hand values over without copies, so only stream waits order
    # the work. y is written by the first provider and read by the second after the host has
    # moved on: the first provider's z must not reuse y's memory (z's stream would overwrite
    # y before the other stream reads it), and the second must wait for both.
    nodes = [
        node("Relu", ["x"], ["y"]),  # first
        node("Mul", ["y", "y"], ["p"]),  # second
        node("Softmax", ["x"], ["z"]),  # first
        node("Add", ["p", "z"], ["out"]),  # second
    ]
    model = make_model(nodes, [tensor("x", ["N", 6])], [tensor("out", ["N", 6])])
    second = vd.SHARED_DEVICE_NAME if first == vd.NAME else vd.NAME
    sess = ox.InferenceSession(
        model, providers=[(first, {"ops": "Relu,Softmax"}), (second, {"ops": "Mul,Add"}), CPU]
    )
    ops = [(op, ep) for _, op, ep in assignment(sess)]
    assert ops == [("Relu", first), ("Mul", second), ("Softmax", first), ("Add", second)]
    for n in (5, 5, 5, 5, 2, 2, 2):
        x = rand(n, 6, seed=n)
        assert_same(sess.run(None, {"x": x}), cpu_outputs(model, {"x": x}))
    waits = virt.stats.snapshot()["device_waits"] + virt_b.stats.snapshot()["device_waits"]
    assert waits == 2 * 7  # the second provider's stream waits for y and for z, every run


@pytest.mark.parametrize("streamless", [vd.NAME, vd.SECOND_NAME, "both"])
def test_providers_without_streams(virt, virt1, streamless):
    # create_sync_stream() returning None means synchronous kernels: values they produce
    # need no wait, values they consume from a stream need a host wait
    model = graphs.exchange()

    def opts(name: str, ops: str) -> tuple[str, dict[str, str]]:
        mode = "none" if streamless in (name, "both") else "deferred"
        return name, {"ops": ops, "streams": mode}

    sess = ox.InferenceSession(
        model, providers=[opts(vd.NAME, "Relu,MatMul"), opts(vd.SECOND_NAME, "Add,Mul"), CPU]
    )
    for n in (3, 3, 3):
        x = rand(n, 6, seed=n)
        assert_same(sess.run(None, {"x": x}), cpu_outputs(model, {"x": x}))


# ---------------------------------------------------------------------------------------------
# control flow: subgraphs run on their own frames (and streams) but read outer device values


@pytest.mark.parametrize("if_on", [vd.NAME, CPU])
def test_if_reads_outer_device_values(virt, if_on):
    model = graphs.if_model()
    ops = "Relu,Mul,Add" + (",If" if if_on == vd.NAME else "")
    sess = ox.InferenceSession(model, providers=[(vd.NAME, {"ops": ops}), CPU])
    eps = {(r["graph"], r["op_type"]): r["ep"] for r in sess.get_provider_graph_assignment_info()}
    assert eps[("g", "If")] == if_on
    assert eps[("then", "Mul")] == eps[("else", "Add")] == eps[("g", "Relu")] == vd.NAME
    x = np.linspace(-2, 2, 6, dtype=np.float32)
    for s in (1, -1, -1, 1, 1, -1):
        feeds = {"x": x, "s": np.float32(s)}
        assert_same(sess.run(None, feeds), cpu_outputs(model, feeds))


@pytest.mark.parametrize("loop_on", [vd.NAME, CPU])
def test_loop_carries_device_values(virt, loop_on):
    model = graphs.loop_model()
    ops = "Relu,Mul,Add" + (",Loop" if loop_on == vd.NAME else "")
    sess = ox.InferenceSession(model, providers=[(vd.NAME, {"ops": ops}), CPU])
    eps = {(r["graph"], r["op_type"]): r["ep"] for r in sess.get_provider_graph_assignment_info()}
    assert eps[("g", "Loop")] == loop_on and eps[("body", "Add")] == vd.NAME
    for n, m in ((5, 3), (5, 3), (5, 0), (2, 4), (5, 3)):
        feeds = {"x": rand(n, seed=m), "m": np.array(m, np.int64)}
        assert_same(sess.run(None, feeds), cpu_outputs(model, feeds))


def test_if_branch_passing_an_outer_value_through(virt):
    # The then-branch returns the outer r itself (Identity is an alias on the device), the
    # else-branch a new tensor. Recorded with the else-branch, the plan must still not let
    # q take r's memory when a later run takes the then-branch and y *is* r.
    then = graphs.helper.make_graph(
        [node("Identity", ["r"], ["t"])], "then", [], [tensor("t", None)]
    )
    other = graphs.helper.make_graph(
        [node("Add", ["r", "r"], ["e"])], "else", [], [tensor("e", None)]
    )
    nodes = [
        node("Relu", ["x"], ["r"]),
        node("Greater", ["s", "zero"], ["c"]),
        node("If", ["c"], ["y"], then_branch=then, else_branch=other),
        node("Mul", ["x", "x"], ["q"]),
        node("Add", ["y", "q"], ["z"]),
    ]
    model = make_model(
        nodes,
        [tensor("x", ["N"]), tensor("s", [])],
        [tensor("z", ["N"])],
        {"zero": np.array(0, np.float32)},
    )
    sess = ox.InferenceSession(model, providers=[vd.NAME, CPU])
    assert {
        r["ep"] for r in sess.get_provider_graph_assignment_info() if r["op_type"] != "Greater"
    } == {vd.NAME}
    x = np.linspace(-2, 2, 6, dtype=np.float32)
    for s in (-1, 1, 1, -1, 1):
        feeds = {"x": x, "s": np.float32(s)}
        assert_same(sess.run(None, feeds), cpu_outputs(model, feeds))


def test_streams_of_frames_no_run_reuses_are_closed(virt):
    sess = ox.InferenceSession(graphs.chain("Relu", 3), providers=[vd.NAME, CPU])
    for _ in range(3):
        for n in (1, 2, 3):
            sess.run(None, {"x": rand(n, 2)})
    stats = virt.stats.snapshot()
    # one stream per frame: three recording frames, closed after their run, and the
    # pooled frame of each of the three signatures, still open
    assert stats["streams"] == 6 and stats["streams_closed"] == 3
