"""The virtual device's streams, notifications and data transfer.

A ``VirtStream`` really queues work: kernels enqueue closures and nothing runs until the
stream is flushed or another stream (or the host) waits on one of its notifications. So a
missing wait, flush or copy leaves the consumer reading memory that was never written (the
allocator poisons fresh blocks), and the test comparing against the CPU provider fails.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

import numpy as np

from onnxplug.ep import (
    DataTransfer,
    Device,
    DeviceTensor,
    DeviceTimer,
    GraphCaptureViolation,
    SyncNotification,
    SyncStream,
)


class Stats:
    """Thread-safe event counters shared by a factory's EPs, streams and transfers."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def add(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._counts[key] += n

    def snapshot(self) -> Counter[str]:
        with self._lock:
            return Counter(self._counts)

    def reset(self) -> None:
        with self._lock:
            self._counts.clear()


# Streams by handle: what a raw handle (DLPack's stream argument) names.
_BY_HANDLE: weakref.WeakValueDictionary[int, VirtStream] = weakref.WeakValueDictionary()


def stream_of(handle: int) -> VirtStream | None:
    return _BY_HANDLE.get(handle)


def submit(stream: Any, fn: Callable[[], None]) -> None:
    """Queue ``fn`` on ``stream``; without a stream of ours the work is synchronous."""
    if isinstance(stream, VirtStream):
        stream.enqueue(fn)
    else:
        fn()


class VirtStream(SyncStream):
    """A deferred, in-order queue of work: it runs on ``flush`` or when waited on."""

    def __init__(self, device: Device, stats: Stats):
        super().__init__(device)
        self.stats = stats
        self._queue: deque[tuple[int, Callable[[], None]]] = deque()
        self._enqueued = 0  # sequence number of the last queued item
        # Reentrant: running a wait item makes another stream run, whose waits may ask this
        # stream for work it has already done.
        self._run_lock = threading.RLock()
        self.closed = False
        self._recording: list[Callable[[], None]] | None = None  # a graph being captured
        _BY_HANDLE[id(self)] = self
        stats.add("streams")

    @property
    def handle(self) -> int:
        """The raw handle other libraries pass around (``stream_of`` finds the stream)."""
        return id(self)

    @property
    def enqueued(self) -> int:
        return self._enqueued

    @property
    def pending(self) -> int:
        return len(self._queue)

    def enqueue(self, fn: Callable[[], None]) -> int:
        if self.closed:
            raise RuntimeError("work queued on a closed stream")
        if self._recording is not None:  # captured, not run (like a CUDA graph capture)
            self._recording.append(fn)
            self.stats.add("captured_ops")
            return self._enqueued
        with self._run_lock:
            self._enqueued += 1
            self._queue.append((self._enqueued, fn))
            self.stats.add("stream_ops")
            return self._enqueued

    def run_until(self, seq: int) -> None:
        """Run queued work up to and including item ``seq``."""
        with self._run_lock:
            while self._queue and self._queue[0][0] <= seq:
                _, fn = self._queue.popleft()
                try:
                    fn()
                except BaseException:
                    # like a failed device: drop the rest, it would write into memory the
                    # host is about to reuse
                    self._queue.clear()
                    raise

    def flush(self) -> None:
        if self._recording is not None:
            raise GraphCaptureViolation("a host synchronisation on a stream capturing a graph")
        self.stats.add("flushes")
        self.run_until(self._enqueued)

    # graph capture: what is queued while recording becomes a replayable list ----------------
    def begin_recording(self) -> None:
        if self._recording is not None:
            raise RuntimeError("the stream is already capturing a graph")
        self._recording = []
        self.capturing = True

    def end_recording(self) -> list[Callable[[], None]]:
        recorded, self._recording = self._recording or [], None
        self.capturing = False
        return recorded

    def graph_of(self, work: Callable[[], None]) -> Callable[[], None] | None:
        """``work``'s queued work recorded as a graph: a call that queues it again; None
        where ``work`` fails while recording (a synchronisation, say)."""
        self.begin_recording()
        try:
            work()
        except Exception:
            self.end_recording()
            self.stats.add("segments_refused")
            return None
        recorded = self.end_recording()
        self.stats.add("segments_captured")

        def launch() -> None:
            self.stats.add("segment_launches")
            for fn in recorded:
                self.enqueue(fn)

        return launch

    def close(self) -> None:
        if not self.closed:
            self.flush()
            self.closed = True
            self.stats.add("streams_closed")
            super().close()

    def create_notification(self) -> VirtNotification:
        self.stats.add("notifications")
        return VirtNotification(self)


class VirtNotification(SyncNotification):
    """A point in a ``VirtStream``'s queue that other streams or the host wait for."""

    def __init__(self, stream: VirtStream):
        self.stream = stream
        self.seq = 0
        self.sync_id = 0

    def activate(self) -> None:
        if self.stream.capturing:
            raise GraphCaptureViolation("a notification recorded while capturing a graph")
        self.seq = self.stream.enqueued
        self.sync_id = self.stream.next_sync_id()
        self.stream.stats.add("activations")

    def wait_on_device(self, consumer: SyncStream) -> None:
        producer, seq = self.stream, self.seq
        if not isinstance(consumer, VirtStream):  # a stream we cannot queue on: block
            self.wait_on_host()
            return
        consumer.enqueue(lambda: producer.run_until(seq))
        consumer.record_wait(producer, self.sync_id)
        producer.stats.add("device_waits")

    def wait_on_host(self) -> None:
        self.stream.stats.add("host_waits")
        self.stream.run_until(self.seq)

    def wait_on_handle(self, handle: int) -> None:
        consumer = stream_of(handle)
        if consumer is None:  # not one of ours (a legacy default stream, say): the host waits
            self.wait_on_host()
        else:
            self.wait_on_device(consumer)


class VirtMark:
    """A timestamp queued on a ``VirtStream``: the host clock when the stream runs it."""

    __slots__ = ("ns",)

    def __init__(self) -> None:
        self.ns: int | None = None

    def reach(self) -> None:
        self.ns = time.perf_counter_ns()


class VirtTimer(DeviceTimer):
    """The virtual device's node timer: its device time is when its stream runs the queued
    work (on a flush or a wait), so a mark read before the run's synchronisation has not been
    reached, and reading it is an error: the executor must read after the run's own sync."""

    def __init__(self, stats: Stats):
        self.stats = stats
        self._free: list[VirtMark] = []
        self.closed = False
        stats.add("timers")

    def mark(self, stream: SyncStream) -> VirtMark:
        if not isinstance(stream, VirtStream):
            raise TypeError(f"a virtual-device timer cannot mark {type(stream).__name__}")
        m = self._free.pop() if self._free else VirtMark()
        m.ns = None
        stream.enqueue(m.reach)
        self.stats.add("timer_marks")
        return m

    def elapsed_us(self, start: VirtMark, end: VirtMark) -> float:
        if start.ns is None or end.ns is None:
            raise RuntimeError("a device-timer mark was read before its stream reached it")
        self.stats.add("timer_reads")
        return (end.ns - start.ns) / 1000.0

    def release(self, marks: list[VirtMark]) -> None:
        self._free.extend(marks)
        self.stats.add("timer_marks_released", len(marks))

    def close(self) -> None:
        self.closed = True
        self.stats.add("timers_closed")


def _is_virt(d: Device) -> bool:
    return d.type == "virt"


class VirtDataTransfer(DataTransfer):
    """Copies host <-> virtual device and between virtual devices."""

    def __init__(self, devices: list[Device], stats: Stats):
        self.devices = [(d.type, d.id) for d in devices]
        self.stats = stats

    def can_copy(self, src: Device, dst: Device) -> bool:
        ours = (src.type, src.id) in self.devices or (dst.type, dst.id) in self.devices
        return ours and (_is_virt(src) or src.is_cpu) and (_is_virt(dst) or dst.is_cpu)

    def copy_tensors(self, pairs: list[tuple[Any, Any]], stream: SyncStream | None) -> None:
        for src, dst in pairs:
            if tuple(src.shape) != tuple(dst.shape) or np.dtype(src.dtype) != np.dtype(dst.dtype):
                raise ValueError(
                    f"copy between different tensors: {src.dtype}{tuple(src.shape)} -> "
                    f"{dst.dtype}{tuple(dst.shape)}"
                )
            to_dev = isinstance(dst, DeviceTensor) and not dst.device.is_cpu
            if isinstance(src, DeviceTensor):
                # a device or pinned host buffer: read when the copy runs on the stream
                data = src.host_array()
                if src.device.is_cpu:
                    self.stats.add("copies_h2d")
                else:
                    self.stats.add("copies_d2d" if to_dev else "copies_d2h")
            else:
                # a host source is read now, like a pageable cudaMemcpyAsync: the caller may
                # reuse its buffer as soon as we return
                data = np.array(src, copy=True)
                self.stats.add("copies_h2d")
            target = dst.host_array() if isinstance(dst, DeviceTensor) else dst
            submit(stream, lambda t=target, d=data: np.copyto(t, d))
