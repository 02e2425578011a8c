"""The CUDA plugin's capture gate (onnxplug_cuda.runtime): a device-wide synchronisation never
runs while a stream of the process captures a graph (it would fail and invalidate the
capture), a capture never begins while one runs, and a block freed on a capturing stream is
freed when that stream, not another, stops capturing. The CUDA runtime is replaced by a
recorder, so this runs without a GPU."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

PLUGIN_SRC = Path(__file__).resolve().parents[1] / "plugins" / "cuda" / "src"
if str(PLUGIN_SRC) not in sys.path:  # CI installs the core only
    sys.path.insert(0, str(PLUGIN_SRC))

from onnxplug_cuda import runtime  # noqa: E402
from tests.plugins.fake_cudart import CUDARuntimeError  # noqa: E402


class _Runtime:
    def __init__(self) -> None:
        self.calls: list[tuple[str, frozenset[int]]] = []

    def deviceSynchronize(self) -> None:
        # what was capturing when the synchronisation ran (it must be nothing)
        self.calls.append(("sync", frozenset(runtime.CAPTURING)))


@pytest.fixture
def fake_runtime(monkeypatch: pytest.MonkeyPatch) -> _Runtime:
    rt = _Runtime()
    monkeypatch.setattr(runtime, "cudart", lambda: rt)
    monkeypatch.setattr(runtime, "DeviceGuard", lambda ordinal: contextlib.nullcontext())
    yield rt
    assert not runtime.CAPTURING and not runtime._DEFERRED and not runtime._device_syncs


def _started(fn: Any) -> threading.Thread:
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


def test_a_device_sync_waits_for_the_capture_to_end(fake_runtime: _Runtime) -> None:
    runtime.capture_started(11)
    t = _started(lambda: runtime.device_synchronize(0))
    time.sleep(0.05)
    assert fake_runtime.calls == [] and t.is_alive()  # held back while stream 11 captures
    runtime.capture_stopped(11)
    t.join(5)
    assert not t.is_alive()
    assert fake_runtime.calls == [("sync", frozenset())]


def test_a_capture_waits_for_a_running_device_sync(
    fake_runtime: _Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    entered, release = threading.Event(), threading.Event()

    def slow_sync() -> None:
        entered.set()
        release.wait(5)

    monkeypatch.setattr(fake_runtime, "deviceSynchronize", slow_sync)
    sync = _started(lambda: runtime.device_synchronize(0))
    assert entered.wait(5)
    capture = _started(lambda: runtime.capture_started(7))
    time.sleep(0.05)
    assert 7 not in runtime.CAPTURING and capture.is_alive()
    release.set()
    sync.join(5)
    capture.join(5)
    assert runtime.CAPTURING == {7}
    runtime.capture_stopped(7)


def test_a_failed_device_sync_lets_captures_begin_again(
    fake_runtime: _Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing_sync() -> None:
        raise CUDARuntimeError(999)

    monkeypatch.setattr(fake_runtime, "deviceSynchronize", failing_sync)
    with pytest.raises(runtime.CudaError, match="cudaDeviceSynchronize failed: cudaError 999"):
        runtime.device_synchronize(0)
    runtime.capture_started(3)  # would block forever if the failed sync were still counted
    runtime.capture_stopped(3)


def test_deferred_frees_wait_for_their_own_stream(fake_runtime: _Runtime) -> None:
    freed: list[int] = []

    class Allocator:
        def free(self, ptr: int) -> None:
            freed.append(ptr)

    a = Allocator()
    runtime.capture_started(1)
    runtime.capture_started(2)
    assert runtime.defer_free(a, 100, 1) and runtime.defer_free(a, 200, 2)
    assert not runtime.defer_free(a, 300, 3)  # stream 3 does not capture: free it now
    runtime.capture_stopped(1)
    assert freed == [100]  # stream 2 still captures: its block waits
    runtime.capture_stopped(2)
    assert freed == [100, 200]


class _CaptureRuntime:
    """A runtime whose capture calls record whether the gate still held the stream."""

    streamCaptureModeThreadLocal = 1

    def __init__(self, stream: int, fail_end: bool = False) -> None:
        self.stream = stream
        self.fail_end = fail_end
        self.ended_while_gated: list[bool] = []

    def streamBeginCapture(self, stream: int, mode: int) -> None:
        assert stream in runtime.CAPTURING  # the gate closed first

    def streamEndCapture(self, stream: int) -> int:
        self.ended_while_gated.append(stream in runtime.CAPTURING)
        if self.fail_end:
            raise CUDARuntimeError(901)  # cudaErrorStreamCaptureInvalidated
        return 0x6A

    def graphInstantiate(self, graph: int) -> int:
        return 0xE0

    def graphUpload(self, exe: int, stream: int) -> None:
        pass

    def graphDestroy(self, graph: int) -> None:
        pass


@pytest.mark.parametrize("abort", [False, True], ids=["end", "abort"])
def test_a_capture_ends_before_the_gate_opens(fake_runtime, monkeypatch, abort):
    """The stream's capture is ended (``cudaStreamEndCapture``) before it leaves CAPTURING:
    a device synchronisation waiting for the gate would otherwise run while the stream still
    captures (and fail: cudaErrorStreamCaptureUnsupported, seen on an H100 with four threads),
    and a free deferred to the capture's end would be recorded into the graph."""
    from onnxplug.ep import Device
    from onnxplug_cuda import stream as cuda_stream

    rt = _CaptureRuntime(11, fail_end=abort)
    monkeypatch.setattr(cuda_stream, "cudart", lambda: rt)
    monkeypatch.setattr(cuda_stream, "DeviceGuard", lambda ordinal: contextlib.nullcontext())
    s = cuda_stream.CudaSyncStream(Device("cuda", 0), 0, user_handle=11, enable_cudnn=False)
    freed: list[int] = []

    class Allocator:
        def free(self, ptr: int) -> None:
            freed.append(ptr)
            assert 11 not in runtime.CAPTURING  # after the capture's end

    s.begin_capture()
    assert runtime.defer_free(Allocator(), 500, 11)
    if abort:
        s.abort_capture()
    else:
        assert s.end_capture() == 0xE0
    assert rt.ended_while_gated == [True] and freed == [500] and not s.capturing
    assert 11 not in runtime.CAPTURING
