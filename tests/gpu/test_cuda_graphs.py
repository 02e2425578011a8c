"""CUDA graphs on a real GPU: capture and replay from plain run() and IOBinding, per shape and
annotation id, per thread, piecewise around host nodes, abandoned captures, user streams, and
the steady state's counts (one host synchronisation, no allocation, no view built).

Replays are compared bit for bit with eager runs of the same session (``gpu_graph_id=-1``).
"""

from __future__ import annotations

import gc
import threading
import warnings

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from tests.conftest import run_in_threads
from tests.gpu._cuda import CPU, CUDA, cuda_marks

import onnxplug as ox
from onnxplug.framework import counters

pytestmark = cuda_marks


def _model(nodes, inputs, outputs, inits=None, opset=17) -> bytes:
    g = helper.make_graph(
        nodes,
        "g",
        inputs,
        outputs,
        [numpy_helper.from_array(v, k) for k, v in (inits or {}).items()],
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)]).SerializeToString()


def _f(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def block() -> bytes:
    """MatMul+bias, Relu, a head split (Reshape/Transpose), Softmax, merge, LayerNorm, Gelu."""
    rng = np.random.default_rng(0)
    d = 32
    inits = {
        "W": rng.standard_normal((d, d)).astype(np.float32) / 6,
        "B": rng.standard_normal(d).astype(np.float32),
        "G": np.ones(d, np.float32),
        "split": np.array([0, 0, 4, 8], np.int64),
        "merge": np.array([0, 0, 32], np.int64),
    }
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["m"]),
        helper.make_node("Add", ["m", "B"], ["a"]),
        helper.make_node("Relu", ["a"], ["r"]),
        helper.make_node("Reshape", ["r", "split"], ["rs"]),
        helper.make_node("Transpose", ["rs"], ["t"], perm=[0, 2, 1, 3]),
        helper.make_node("Softmax", ["t"], ["s"], axis=-1),
        helper.make_node("Transpose", ["s"], ["t2"], perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", ["t2", "merge"], ["r2"]),
        helper.make_node("Add", ["r2", "x"], ["res"]),
        helper.make_node("LayerNormalization", ["res", "G", "B"], ["ln"], axis=-1),
        helper.make_node("Gelu", ["ln"], ["y"]),
    ]
    return _model(nodes, [_f("x", ["N", "S", d])], [_f("y", ["N", "S", d])], inits, opset=20)


def conv() -> bytes:
    rng = np.random.default_rng(1)
    inits = {
        "w": rng.standard_normal((8, 3, 3, 3)).astype(np.float32),
        "b": rng.standard_normal(8).astype(np.float32),
    }
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("MaxPool", ["r"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("GlobalAveragePool", ["p"], ["y"]),
    ]
    return _model(nodes, [_f("x", ["N", 3, 16, 16])], [_f("y", ["N", 8, 1, 1])], inits)


def graph_session(model: bytes, **options: str) -> ox.InferenceSession:
    return ox.InferenceSession(
        model, providers=[(CUDA, {"enable_cuda_graph": "1", **options}), CPU]
    )


def with_id(gid: int) -> ox.RunOptions:
    ro = ox.RunOptions()
    ro.add_run_config_entry("gpu_graph_id", str(gid))
    return ro


def rand(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def states(sess: ox.InferenceSession) -> list[str]:
    return [s[2] for s in sess._runner.capture.states()]


@pytest.mark.parametrize(
    "build,shape,options",
    [
        (block, (2, 8, 32), {}),
        (conv, (2, 3, 16, 16), {}),
        # the GEMM fallback of convolutions (its temporaries once made the capture fail)
        (conv, (2, 3, 16, 16), {"enable_cudnn": "0"}),
        (conv, (2, 3, 16, 16), {"enable_cudnn": "0", "prefer_nhwc": "1"}),
    ],
)
def test_replay_equals_eager_bit_for_bit_for_changing_inputs(build, shape, options):
    model = build()
    sess = graph_session(model, **options)
    for i in range(6):
        x = rand(*shape, seed=i)
        got = sess.run(None, {"x": x})
        want = sess.run(None, {"x": x}, with_id(-1))
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)
    assert states(sess) == ["captured"]
    cpu = ox.InferenceSession(model, providers=[CPU]).run(None, {"x": x})
    np.testing.assert_allclose(got[0], cpu[0], rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("build,shape", [(block, (2, 8, 32)), (conv, (2, 3, 16, 16))])
def test_eager_runs_launch_consecutive_node_graphs_as_one_graph(build, shape, monkeypatch):
    """Without enable_cuda_graph a frame's third run captures its consecutive node graphs as
    one graph (executor.segment_program), later runs launch it: the outputs are those of the
    node-by-node launches, bit for bit, for changing inputs."""
    from onnxplug.framework import executor

    model = build()
    sess = ox.InferenceSession(model, providers=[CUDA, CPU])
    xs = [rand(*shape, seed=i) for i in range(6)]
    got = [sess.run(None, {"x": x})[0] for x in xs]
    frame = next(iter(sess._runner._signatures.values())).frames[0]
    assert frame.program is not None and len(frame.program) < len(frame.steps)
    assert any(step[1] is None for step in frame.program)  # a captured group

    def one_by_one(steps, values, where, run_options):
        executor._run_steps(steps, values, where, run_options)
        return list(steps)

    monkeypatch.setattr(executor, "segment_program", one_by_one)
    plain = ox.InferenceSession(model, providers=[CUDA, CPU])
    for g, x in zip(got, xs):
        np.testing.assert_array_equal(g, plain.run(None, {"x": x})[0])


def test_a_stream_tells_an_invalidated_capture_from_an_active_one():
    """``capture_invalidated``: what the cuDNN engine checks before it records a plan as one
    cuDNN cannot run (in an invalidated capture every call fails, whatever it is)."""
    import cupy

    sess = ox.InferenceSession(block(), providers=[CUDA, CPU])
    ep = next(e for e in sess._eps if e.name == CUDA)
    stream = ep.create_sync_stream()
    assert not stream.capture_invalidated()
    stream.begin_capture()
    try:
        assert stream.is_capturing() and not stream.capture_invalidated()
        with pytest.raises(cupy.cuda.runtime.CUDARuntimeError):
            cupy.cuda.runtime.streamSynchronize(stream.handle)  # not allowed: invalidates
        assert stream.is_capturing() and stream.capture_invalidated()
    finally:
        stream.abort_capture()
    assert not stream.is_capturing() and not stream.capture_invalidated()
    stream.close()


def test_a_node_graph_launch_keeps_the_interpreter_lock_and_works_on_a_fresh_thread():
    """Eager runs launch their nodes' graphs through the driver keeping the interpreter lock
    (``runtime.graph_launch_holding_gil``). On a thread that has made no CUDA call, the driver
    may have no current context: ``launch_node_graph`` then launches through the runtime,
    which makes the device's primary context current there, and the driver's launch works
    after."""
    import cupy

    from onnxplug_cuda import runtime

    sess = ox.InferenceSession(block(), providers=[CUDA, CPU])
    ep = next(e for e in sess._eps if e.name == CUDA)
    stream = ep.create_sync_stream()
    x = cupy.zeros(4, cupy.float32)

    def add_one() -> None:
        with cupy.cuda.ExternalStream(stream.handle):
            x[...] += 1

    exe = stream.capture_call(add_one)
    assert exe is not None
    launch = runtime.graph_launch_holding_gil()
    results: list = []

    def fresh_thread() -> None:
        results.append(launch(exe, stream.handle))  # no CUDA call on this thread yet
        results.append(ep.backend.launch_node_graph(exe, stream.handle))
        results.append(launch(exe, stream.handle))

    t = threading.Thread(target=fresh_thread)
    t.start()
    t.join()
    cupy.cuda.runtime.streamSynchronize(stream.handle)
    assert results[0] in (0, runtime.DRIVER_INVALID_CONTEXT) and results[1:] == [None, 0]
    launched = 2 + (results[0] == 0)
    assert x.get().tolist() == [float(launched)] * 4
    assert ep.backend.launch_node_graph(0, stream.handle).startswith("CUDA_ERROR_INVALID")
    stream.close()


def test_steady_replay_counts():
    sess = graph_session(block())
    x = rand(1, 8, 32)
    sess.run(None, {"x": x})
    alloc = sess._runner.plan.allocators
    for _ in range(3):
        before = counters.snapshot()
        n = {d: a.get_stats()["NumAllocs"] for d, a in alloc.items()}
        sess.run(None, {"x": x})
        d = counters.delta(before)
        assert d[counters.HOST_SYNCS] == 1
        assert d[counters.GRAPH_REPLAYS] == 1
        assert d[counters.VIEWS_BUILT] == 0
        assert {k: a.get_stats()["NumAllocs"] - n[k] for k, a in alloc.items()} == dict.fromkeys(
            alloc, 0
        )


def test_eager_steady_state_counts():
    sess = ox.InferenceSession(block(), providers=[CUDA, CPU])
    x = rand(1, 8, 32)
    for _ in range(2):
        sess.run(None, {"x": x})
    alloc = sess._runner.plan.allocators
    for _ in range(3):
        before = counters.snapshot()
        n = {d: a.get_stats()["NumAllocs"] for d, a in alloc.items()}
        sess.run(None, {"x": x})
        d = counters.delta(before)
        assert (d[counters.HOST_SYNCS], d[counters.VIEWS_BUILT]) == (1, 0)
        assert all(a.get_stats()["NumAllocs"] == n[k] for k, a in alloc.items())


def test_shapes_and_ids_get_their_own_graphs_and_minus_one_never_captures():
    model = block()
    sess = graph_session(model)
    for n in (1, 3, 1, 3):
        for gid in (0, 5):
            x = rand(n, 8, 32, seed=n + gid)
            (y,) = sess.run(None, {"x": x}, with_id(gid))
            (e,) = sess.run(None, {"x": x}, with_id(-1))
            np.testing.assert_array_equal(y, e)
    assert sorted(states(sess)) == ["captured"] * 4
    sess.release_captured_graph(5)
    assert len(states(sess)) == 2
    with pytest.raises(ox.capi.onnxruntime_pybind11_state.InvalidArgument):
        sess.release_captured_graph(99)


def test_iobinding_replay_with_inputs_updated_in_place():
    model = block()
    sess = graph_session(model)
    x = rand(2, 8, 32)
    xv = ox.OrtValue.ortvalue_from_numpy(x, "cuda", 0)
    yv = ox.OrtValue.ortvalue_from_shape_and_type([2, 8, 32], np.float32, "cuda", 0)
    io = sess.io_binding()
    io.bind_ortvalue_input("x", xv)
    io.bind_ortvalue_output("y", yv)
    for i in range(4):
        xi = rand(2, 8, 32, seed=i)
        xv.update_inplace(xi)
        sess.run_with_iobinding(io)
        (want,) = sess.run(None, {"x": xi}, with_id(-1))
        np.testing.assert_array_equal(yv.numpy(), want)


def test_two_threads_capture_their_own_graphs():
    model = block()
    sess = graph_session(model)
    eager = ox.InferenceSession(model, providers=[CUDA, CPU])

    def worker(k: int) -> None:  # (run_in_threads starts the threads together)
        for i in range(8):
            x = rand(2, 8, 32, seed=100 * k + i)
            (y,) = sess.run(None, {"x": x})
            np.testing.assert_array_equal(y, eager.run(None, {"x": x})[0])

    run_in_threads(worker, 2)  # re-raises a thread's failure


def test_threads_with_their_own_iobindings_synchronise_without_breaking_captures():
    # Each thread binds device values and calls synchronize_inputs/outputs around its runs
    # while other threads capture their graphs: a device-wide synchronisation during a capture
    # fails and invalidates it, so the synchronisations wait for captures to end (inputs) or
    # have nothing to wait for (outputs: a run ends synchronised); every thread captures.
    model = conv()
    sess = graph_session(model)
    eager = ox.InferenceSession(model, providers=[CUDA, CPU])
    barrier = threading.Barrier(4)

    def worker(k: int) -> None:
        x = rand(2, 3, 16, 16, seed=k)
        (want,) = eager.run(None, {"x": x})
        xv = ox.OrtValue.ortvalue_from_numpy(x, "cuda", 0)
        yv = ox.OrtValue.ortvalue_from_shape_and_type([2, 8, 1, 1], np.float32, "cuda", 0)
        io = sess.io_binding()
        io.bind_ortvalue_input("x", xv)
        io.bind_ortvalue_output("y", yv)
        barrier.wait()
        for _ in range(30):
            io.synchronize_inputs()
            sess.run_with_iobinding(io)
            io.synchronize_outputs()
            np.testing.assert_array_equal(yv.numpy(), want)
        assert states(sess) == ["captured"]

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an abandoned capture warns
        run_in_threads(worker, 4)  # re-raises a thread's failure


def test_piecewise_capture_around_a_host_node():
    # NonZero reads its input's count on the host: the device work before and after it are
    # captured as two graphs, NonZero runs eagerly between them
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("Mul", ["r", "r"], ["m"]),
        helper.make_node("NonZero", ["m"], ["nz"]),
        helper.make_node("Relu", ["x"], ["q"]),
        helper.make_node("Add", ["q", "q"], ["y"]),
    ]
    model = _model(
        nodes,
        [_f("x", [16])],
        [helper.make_tensor_value_info("nz", TensorProto.INT64, [1, "K"]), _f("y", [16])],
    )
    sess = graph_session(model)
    for k in range(5):
        x = rand(16, seed=k)
        got = sess.run(None, {"x": x})
        want = ox.InferenceSession(model, providers=[CPU]).run(None, {"x": x})
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_allclose(got[1], want[1])
    assert states(sess) == ["captured"]


def test_user_stream_with_graphs_is_never_destroyed():
    import cupy

    s = cupy.cuda.Stream(non_blocking=True)
    model = block()
    sess = graph_session(model, user_compute_stream=str(s.ptr))
    for i in range(5):
        x = rand(1, 8, 32, seed=i)
        (y,) = sess.run(None, {"x": x})
        (e,) = sess.run(None, {"x": x}, with_id(-1))
        np.testing.assert_array_equal(y, e)
    s.synchronize()  # still a live stream
    assert states(sess) == ["captured"]
    del sess  # a user's stream must outlive the sessions that run on it
    gc.collect()


def test_failed_capture_warns_names_the_node_and_keeps_the_session_usable():
    # Einsum goes through CuPy's einsum (cuBLAS), which refuses capture: it is marked
    # uncapturable, so it runs eagerly between segments. A kernel that synchronises
    # unexpectedly is simulated by a NonZero whose capturability is forced on.
    from onnxplug_cuda.kernels import indexing

    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("NonZero", ["r"], ["nz"])]
    model = _model(
        nodes, [_f("x", [8])], [helper.make_tensor_value_info("nz", TensorProto.INT64, [1, "K"])]
    )
    old = indexing.NonZero.graph_capturable
    indexing.NonZero.graph_capturable = True
    try:
        sess = graph_session(model)
        x = np.array([0, 1, 0, 2, 0, 3, 4, 0], np.float32)
        with pytest.warns(RuntimeWarning, match="NonZero"):
            (nz,) = sess.run(None, {"x": x})
        np.testing.assert_array_equal(nz, np.nonzero(np.maximum(x, 0))[0][None])
        assert states(sess) == ["disabled"]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            (nz,) = sess.run(None, {"x": x})
        np.testing.assert_array_equal(nz, np.nonzero(x)[0][None])
    finally:
        indexing.NonZero.graph_capturable = old


def test_the_steady_state_runs_prepared_calls():
    """After the binding run every node of the block runs its prepared call (a launcher),
    not its compute: the fast path is really taken on the GPU."""
    sess = ox.InferenceSession(block(), providers=[CUDA, CPU])
    x = rand(2, 8, 32)
    for _ in range(3):
        sess.run(None, {"x": x})
    frame = next(iter(sess._runner._signatures.values())).frames[0]
    calls = {
        spec.info.op_type: getattr(step[0], "__name__", "")
        for step, spec in zip(frame.steps, frame.specs)
        if spec is not None
    }
    assert "compute" not in calls.values(), calls


@pytest.mark.parametrize("opts", [{}, {"prefer_nhwc": "1"}], ids=["nchw", "nhwc"])
def test_pools_run_prepared_and_agree_with_replayed_graphs(opts):
    """MaxPool and GlobalAveragePool (NCHW, and NHWC through prefer_nhwc) run prepared calls in
    the steady state, match the CPU, and a replayed graph gives the eager session's bits from
    its first run on (the first, unprepared run launches the same kernels)."""
    model = conv()
    x = rand(2, 3, 16, 16, seed=5)
    eager = ox.InferenceSession(model, providers=[(CUDA, opts), CPU])
    graph = graph_session(model, **opts)
    want = ox.InferenceSession(model, providers=[CPU]).run(None, {"x": x})[0]
    for _ in range(3):
        got = eager.run(None, {"x": x})[0]
        np.testing.assert_array_equal(graph.run(None, {"x": x})[0], got)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    frame = next(iter(eager._runner._signatures.values())).frames[0]
    calls = {
        spec.info.op_type: getattr(step[0], "__name__", "")
        for step, spec in zip(frame.steps, frame.specs)
        if spec is not None
    }
    pools = {k: v for k, v in calls.items() if "Pool" in k}
    assert len(pools) == 2 and "compute" not in pools.values(), calls


def test_steady_iobinding_replay_holds_its_copies_and_takes_the_bound_path(monkeypatch):
    """IOBinding bound once: the graph holds the copies from the bound input and to the bound
    output, a steady replay is one launch and one synchronisation through the bound path (the
    executor's general path is never entered), bit for bit equal to eager runs."""
    from onnxplug.framework.executor import GraphRunner

    model = block()
    sess = graph_session(model)
    eager = ox.InferenceSession(model, providers=[CUDA, CPU])
    xv = ox.OrtValue.ortvalue_from_numpy(rand(2, 8, 32), "cuda", 0)
    yv = ox.OrtValue.ortvalue_from_shape_and_type([2, 8, 32], np.float32, "cuda", 0)
    io = sess.io_binding()
    io.bind_ortvalue_input("x", xv)
    io.bind_ortvalue_output("y", yv)
    sess.run_with_iobinding(io)
    (ctx,) = sess._runner.capture._contexts().values()
    assert set(ctx.held_feeds) == {0} and set(ctx.held_outputs) == {0}

    def general(*args, **kwargs):
        raise AssertionError("a steady replay went through the executor's general path")

    alloc = sess._runner.plan.allocators
    inputs = [rand(2, 8, 32, seed=i) for i in range(4)]
    # the eager session's runs take the general path: computed before it is made to fail
    wants = [eager.run(None, {"x": xi})[0] for xi in inputs]
    with monkeypatch.context() as m:
        m.setattr(GraphRunner, "_execute", general)
        for xi, want in zip(inputs, wants):
            xv.update_inplace(xi)
            before = counters.snapshot()
            n = {d: a.get_stats()["NumAllocs"] for d, a in alloc.items()}
            sess.run_with_iobinding(io)
            d = counters.delta(before)
            assert (d[counters.HOST_SYNCS], d[counters.GRAPH_REPLAYS]) == (1, 1)
            assert d[counters.VIEWS_BUILT] == 0
            assert all(a.get_stats()["NumAllocs"] == n[k] for k, a in alloc.items())
            np.testing.assert_array_equal(yv.numpy(), want)


def test_plain_run_replay_holds_its_staging_copies():
    sess = graph_session(block())
    eager = ox.InferenceSession(block(), providers=[CUDA, CPU])
    sess.run(None, {"x": rand(1, 8, 32)})
    (ctx,) = sess._runner.capture._contexts().values()
    assert ctx.held_feeds == {0: None} and ctx.held_outputs == {0: None}
    for i in range(4):
        x = rand(1, 8, 32, seed=i)
        np.testing.assert_array_equal(sess.run(None, {"x": x})[0], eager.run(None, {"x": x})[0])


def test_rebinding_another_input_captures_again_without_held_copies():
    model = block()
    sess = graph_session(model)
    eager = ox.InferenceSession(model, providers=[CUDA, CPU])
    yv = ox.OrtValue.ortvalue_from_shape_and_type([2, 8, 32], np.float32, "cuda", 0)
    io = sess.io_binding()
    io.bind_ortvalue_output("y", yv)
    for i in range(5):
        x = rand(2, 8, 32, seed=i)
        io.bind_ortvalue_input("x", ox.OrtValue.ortvalue_from_numpy(x, "cuda", 0))
        sess.run_with_iobinding(io)
        np.testing.assert_array_equal(yv.numpy(), eager.run(None, {"x": x})[0])
    (ctx,) = sess._runner.capture._contexts().values()
    assert ctx.state == "captured" and not ctx.hold_copies and not ctx.held_feeds
