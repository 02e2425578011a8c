"""Concurrent runs and the kernel sync stream, on the virtual-device plugin.

The virtual device queues each run's device work on its stream and runs it when the run ends,
on the thread of that run. A test sets the factory's ``rendezvous`` hook, which every kernel's
queued work calls first: with a barrier there, N runs of one session must all be inside their
device work at the same moment, which is impossible if any lock were held across it (the
runs would wait for each other and the barrier would time out) or if two runs shared a stream
(a stream runs its queue under its own lock).
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import onnxplug as ox
from onnxplug.ep import api
from tests.conftest import run_in_threads
from tests.plugins import virtual_device as vd
from tests.plugins.graphs import make_model, node, tensor, weights
from tests.plugins.virtual_device.stream import VirtStream

CPU = "CPUExecutionProvider"
THREADS = 4
RUNS = 5


def _model() -> bytes:
    """x[N,8] -> Relu -> MatMul(w) -> Softmax: three kernels that queue device work; Softmax
    takes a workspace."""
    (w,) = weights(3, (8, 5))
    return make_model(
        [
            node("Relu", ["x"], ["r"]),
            node("MatMul", ["r", "w"], ["m"]),
            node("Softmax", ["m"], ["y"], axis=-1),
        ],
        [tensor("x", ["N", 8])],
        [tensor("y", ["N", 5])],
        {"w": w},
    )


def _inputs(n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(11)
    return [rng.standard_normal((3, 8)).astype(np.float32) for _ in range(n)]


class _Overlap:
    """A rendezvous hook that counts how many runs are inside device work at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.now = 0
        self.most = 0

    def __call__(self) -> None:
        with self._lock:
            self.now += 1
            self.most = max(self.most, self.now)
        time.sleep(0.002)  # long enough for unserialised runs to meet here
        with self._lock:
            self.now -= 1


def _run_concurrently(sess: ox.InferenceSession, xs: list[np.ndarray]) -> list[list[np.ndarray]]:
    """THREADS threads, each running RUNS of ``xs`` (thread k starts at input k); the outputs
    by thread and run."""
    got: list[list[np.ndarray]] = [[] for _ in range(THREADS)]

    def work(k: int) -> None:
        for i in range(RUNS):
            got[k].append(sess.run(None, {"x": xs[(k + i) % len(xs)]})[0])

    run_in_threads(work, THREADS)
    return got


def _assert_bit_identical(got, want, xs_count: int) -> None:
    for k, outs in enumerate(got):
        for i, y in enumerate(outs):
            np.testing.assert_array_equal(y, want[(k + i) % xs_count])


def test_runs_of_one_session_overlap_on_streams_of_their_own(virt):
    """N threads on one session: every run's device work is in flight at once (a barrier
    that needs all of them), and the results are bit-identical to sequential runs."""
    model = _model()
    sess = ox.InferenceSession(model, providers=[vd.NAME, CPU])
    assert all(e == vd.NAME for e in sess.get_ep_graph_assignment_summary() if e != CPU)
    xs = _inputs(THREADS)
    want = [sess.run(None, {"x": x})[0] for x in xs]  # sequential, same session
    np.testing.assert_allclose(
        want[0], ox.InferenceSession(model, providers=[CPU]).run(None, {"x": xs[0]})[0], 1e-6
    )
    streams_before = virt.stats.snapshot()["streams"]
    barrier = threading.Barrier(THREADS, timeout=20)
    virt.rendezvous = barrier.wait
    got = _run_concurrently(sess, xs)
    _assert_bit_identical(got, want, len(xs))
    # each concurrent run had a frame, and a stream, of its own
    assert virt.stats.snapshot()["streams"] - streams_before >= THREADS - 1


def test_a_unified_stream_runs_one_run_at_a_time(virt):
    """A provider that does not advertise concurrent runs (one stream for every run) gets
    them one at a time, as onnxruntime serialises them."""
    sess = ox.InferenceSession(_model(), providers=[(vd.NAME, {"streams": "unified"}), CPU])
    assert not sess._eps[0].is_concurrent_run_supported()
    xs = _inputs(THREADS)
    want = [sess.run(None, {"x": x})[0] for x in xs]
    overlap = _Overlap()
    virt.rendezvous = overlap
    got = _run_concurrently(sess, xs)
    _assert_bit_identical(got, want, len(xs))
    assert overlap.most == 1


def _spy_kernel(sess: ox.InferenceSession, op: str) -> list[tuple]:
    """Records (ctx.stream, ctx.get_sync_stream()) of every call of ``op``'s kernel."""
    seen: list[tuple] = []
    (step,) = [s for s in sess._runner.plan.steps if s.info.op_type == op]
    kernel = step.kernel
    compute = kernel.compute

    def spy(ctx):
        seen.append((ctx.stream, ctx.get_sync_stream()))
        compute(ctx)

    kernel.compute = spy
    return seen


def _spy_arena(factory: vd.VirtualDeviceFactory) -> list[tuple[int, object]]:
    """Records (size, stream) of every request to the factory's shared arena (stream None for
    an untagged request)."""
    arena = factory.arena()
    assert arena is not None
    calls: list[tuple[int, object]] = []
    alloc, alloc_on_stream = arena.alloc, arena.alloc_on_stream

    def untagged(size):
        calls.append((size, None))
        return alloc(size)

    def tagged(size, stream):
        calls.append((size, stream))
        return alloc_on_stream(size, stream)

    arena.alloc, arena.alloc_on_stream = untagged, tagged
    return calls


def _softmax_model() -> bytes:
    return make_model(
        [node("Softmax", ["x"], ["y"], axis=-1)], [tensor("x", ["N", 6])], [tensor("y", ["N", 6])]
    )


def test_a_kernels_workspace_is_tagged_with_its_sync_stream(virt_arena):
    sess = ox.InferenceSession(_softmax_model(), providers=[vd.ARENA_NAME, CPU])
    seen = _spy_kernel(sess, "Softmax")
    calls = _spy_arena(virt_arena)
    x = np.random.default_rng(2).standard_normal((5, 6)).astype(np.float32)
    want = ox.InferenceSession(_softmax_model(), providers=[CPU]).run(None, {"x": x})[0]
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], want, rtol=1e-6)
    (stream, sync_stream), *_ = seen
    assert isinstance(stream, VirtStream) and sync_stream is stream
    # the workspace, tagged with the kernel's stream (the output, of the same size, is the
    # host's allocation and tagged whatever the plugin's API)
    assert (x.nbytes, stream) in calls and (x.nbytes, None) not in calls


def test_a_plugin_written_against_api_1_or_2_runs_untagged_and_one_run_at_a_time(virt_old_api):
    """onnxruntime's fallback for a runtime or plugin without KernelContext_GetSyncStream
    (here: a plugin written against API 1, or against API 2, which has device timing but not
    the kernel sync stream of API 3): the plugin still loads and runs; its kernels get no sync
    stream, their workspaces are untagged, and the session runs one run at a time."""
    old = virt_old_api
    assert old.api_version in (1, 2) and api.API_VERSION == 3
    assert not api.supports(old.api_version, "kernel_context_sync_stream")
    model = _softmax_model()
    sess = ox.InferenceSession(model, providers=[old.name, CPU])
    assert sess.get_ep_graph_assignment_summary()[old.name] == 1
    # what API 2 added is still used for a plugin of API 2 (a timer while profiling)
    assert (old.name in sess._runner.plan.timer_factories) == (old.api_version >= 2)
    seen = _spy_kernel(sess, "Softmax")
    calls = _spy_arena(old)
    x = np.random.default_rng(3).standard_normal((4, 6)).astype(np.float32)
    want = ox.InferenceSession(model, providers=[CPU]).run(None, {"x": x})[0]
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], want, rtol=1e-6)
    (stream, sync_stream), *_ = seen
    assert isinstance(stream, VirtStream) and sync_stream is None
    assert (x.nbytes, None) in calls  # the workspace, untagged
    # the plugin says it could run concurrently; the host does not believe an older plugin
    assert sess._eps[0].is_concurrent_run_supported()
    overlap = _Overlap()
    old.rendezvous = overlap
    xs = [np.random.default_rng(k).standard_normal((4, 6)).astype(np.float32) for k in range(3)]
    want_all = [sess.run(None, {"x": v})[0] for v in xs]
    got = _run_concurrently(sess, xs)
    _assert_bit_identical(got, want_all, len(xs))
    assert overlap.most == 1


@pytest.mark.parametrize("host_api", [1, 2, api.API_VERSION])
def test_the_virtual_device_advertises_concurrent_runs_only_on_a_host_with_the_sync_stream(
    virt, monkeypatch, host_api
):
    monkeypatch.setattr(api, "API_VERSION", host_api)
    sess = ox.InferenceSession(_softmax_model(), providers=[vd.NAME, CPU])
    assert sess._eps[0].is_concurrent_run_supported() == (host_api >= 3)
