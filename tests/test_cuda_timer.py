"""The CUDA provider's node timer (``CudaEventTimer``) against a stand-in CUDA runtime: events
are created once and reused, recorded on the node's stream, read only once the stream has
reached them (reading earlier is an error, never a wait), and destroyed with the timer. The
real runtime is exercised by tests/gpu/test_cuda_profiler.py."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest

from tests.plugins.fake_cudart import CUDARuntimeError

PLUGIN_SRC = Path(__file__).resolve().parents[1] / "plugins" / "cuda" / "src"
NOT_READY = 600  # cudaErrorNotReady


class FakeRuntime:
    """Events on a fake device clock: a recorded event completes when its stream is
    synchronised (``sync``). Calls as CuPy's runtime module makes them."""

    eventDefault = 0

    def __init__(self) -> None:
        self.clock = 0.0  # ms
        self.created: list[int] = []
        self.destroyed: list[int] = []
        self.records: list[tuple[int, int]] = []  # (event, stream)
        self.time: dict[int, float] = {}
        self.done: set[int] = set()
        self.syncs = 0

    def eventCreateWithFlags(self, flags: int) -> int:
        assert flags == self.eventDefault  # timing events
        ev = 1000 + len(self.created)
        self.created.append(ev)
        return ev

    def eventRecord(self, ev: int, stream: int) -> None:
        self.records.append((ev, stream))
        self.time[ev] = self.clock
        self.done.discard(ev)

    def eventElapsedTime(self, a: int, b: int) -> float:
        if a not in self.done or b not in self.done:
            raise CUDARuntimeError(NOT_READY, "cudaErrorNotReady: device not ready")
        return self.time[b] - self.time[a]

    def eventDestroy(self, ev: int) -> None:
        self.destroyed.append(ev)

    def sync(self) -> None:
        self.syncs += 1
        self.done.update(self.time)


@pytest.fixture
def timer_and_rt(monkeypatch):
    if str(PLUGIN_SRC) not in sys.path:
        sys.path.insert(0, str(PLUGIN_SRC))
    from onnxplug_cuda import stream as cuda_stream

    rt = FakeRuntime()
    monkeypatch.setattr(cuda_stream, "cudart", lambda: rt)
    monkeypatch.setattr(cuda_stream, "DeviceGuard", lambda ordinal: contextlib.nullcontext())
    return cuda_stream.CudaEventTimer(0), rt


class Stream:
    handle = 0x5EED


def test_marks_are_events_on_the_nodes_stream_reused_across_runs(timer_and_rt):
    timer, rt = timer_and_rt
    for _ in range(3):
        anchor = timer.mark(Stream())
        rt.clock += 1.0
        start = timer.mark(Stream())
        rt.clock += 0.25
        end = timer.mark(Stream())
        rt.sync()  # the run's own synchronisation
        assert timer.elapsed_us(start, end) == pytest.approx(250.0)
        assert timer.elapsed_us(anchor, start) == pytest.approx(1000.0)
        timer.release([anchor, start, end])
    assert len(rt.created) == 3  # made on the first run, reused after
    assert {s for _, s in rt.records} == {Stream.handle} and len(rt.records) == 9
    assert rt.syncs == 3  # the timer never synchronised anything itself


def test_reading_a_mark_before_the_stream_reached_it_is_an_error(timer_and_rt):
    from onnxplug_cuda.runtime import CudaError

    timer, rt = timer_and_rt
    a, b = timer.mark(Stream()), timer.mark(Stream())
    with pytest.raises(CudaError, match="cudaErrorNotReady"):
        timer.elapsed_us(a, b)
    assert rt.syncs == 0


def test_close_destroys_every_event(timer_and_rt):
    timer, rt = timer_and_rt
    marks = [timer.mark(Stream()) for _ in range(4)]
    timer.release(marks[:2])  # some still out: destroyed too
    timer.close()
    assert sorted(rt.destroyed) == sorted(rt.created) and len(rt.created) == 4
    timer.close()
    assert len(rt.destroyed) == 4
