"""Streams, notifications and data transfer: the provider-side protocols the executor drives.

A ``SyncStream`` is an ordered queue of device work (onnxruntime's OrtSyncStreamImpl). When a
value produced on one stream is consumed on another, the executor activates a notification on
the producer and makes the consumer wait on it. Every stream counts notifications (``sync_id``)
so a stream-aware arena can tell when a block freed on one stream is safe on another; the
arena also listens for the end of a stream's run and for its closing (``add_release_listener``)
to make the blocks it tagged with the stream free for every stream again.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import numpy as np

from .memory import CPU, Device, DeviceTensor


class SyncNotification(ABC):
    """A marker recorded on a stream that others can wait for (a CUDA event, say)."""

    @abstractmethod
    def activate(self) -> None:
        """Record the point on the producing stream."""

    @abstractmethod
    def wait_on_device(self, consumer: SyncStream) -> None:
        """Make ``consumer`` wait for the point without blocking the host."""

    @abstractmethod
    def wait_on_host(self) -> None:
        """Block the host until the point is reached."""

    def wait_on_handle(self, handle: int) -> None:
        """Make a raw stream handle of the provider's kind (another library's stream, e.g. a
        DLPack consumer's ``cudaStream_t``) wait for the point. By default the host waits,
        which orders every later stream too."""
        self.wait_on_host()


class SyncStream(ABC):
    """An ordered queue of work on one device."""

    device: Device
    #: False for a stream the provider shares between frames (its unified stream, a user's
    #: stream): the executor never closes it.
    frame_owned: bool = True
    #: True while the stream records a graph (set by the provider's begin/end capture);
    #: providers refuse host synchronisation on such a stream.
    capturing: bool = False

    def __init__(self, device: Device):
        self.device = device
        self._sync_id = 0
        self._last_wait: dict[int, int] = {}  # id(producer stream) -> its sync_id waited on
        self._lock = threading.Lock()
        self.release_listeners: list[Callable[[SyncStream], None]] = []

    @property
    def handle(self) -> int:
        """The raw stream handle (a cudaStream_t as int for CUDA); 0 when there is none."""
        return 0

    @property
    def sync_id(self) -> int:
        return self._sync_id

    def next_sync_id(self) -> int:
        with self._lock:
            self._sync_id += 1
            return self._sync_id

    def record_wait(self, producer: SyncStream, sync_id: int) -> None:
        self._last_wait[id(producer)] = sync_id

    def last_wait_on(self, producer: SyncStream) -> int:
        """The producer's sync id this stream last waited for (0: never)."""
        return self._last_wait.get(id(producer), 0)

    @abstractmethod
    def create_notification(self) -> SyncNotification: ...

    def wait_for_handle(self, handle: int) -> None:
        """Order this stream after the work queued so far on a raw stream handle of the
        provider's kind (another library's stream, e.g. a ``__cuda_array_interface__``
        producer's). Providers whose tensors can be imported that way implement it."""
        raise NotImplementedError(f"{type(self).__name__} cannot wait for a foreign stream")

    @abstractmethod
    def flush(self) -> None:
        """Block until all work queued on the stream has finished."""

    def add_release_listener(self, fn: Callable[[SyncStream], None]) -> None:
        """Call ``fn(stream)`` whenever the stream has no queued work left that a run gave it:
        after ``on_session_run_end`` flushed it, and when it closes."""
        self.release_listeners.append(fn)

    def notify_released(self) -> None:
        """Tell the listeners that the stream's queued work is done (subclasses that override
        ``on_session_run_end`` or ``close`` call this once the stream is drained)."""
        for fn in list(self.release_listeners):
            fn(self)

    def on_session_run_end(self) -> None:
        """Called once per run for each stream the run used: drain it, then release what
        allocators tagged with it."""
        self.flush()
        self.notify_released()

    def close(self) -> None:
        """Release the stream's resources. Subclasses drain the stream first, then call this,
        which tells the release listeners (once)."""
        listeners, self.release_listeners = self.release_listeners, []
        for fn in listeners:
            fn(self)


class ImmediateNotification(SyncNotification):
    """A notification of a stream whose work is done as soon as it is queued: there is
    nothing to wait for, only sync ids to count."""

    def __init__(self, producer: SyncStream):
        self.producer = producer
        self.sync_id = 0

    def activate(self) -> None:
        self.sync_id = self.producer.next_sync_id()

    def wait_on_device(self, consumer: SyncStream) -> None:
        consumer.record_wait(self.producer, self.sync_id)

    def wait_on_host(self) -> None:
        pass


class ImmediateStream(SyncStream):
    """A stream whose work runs when it is queued (host-simulated devices, tests)."""

    def __init__(self, device: Device):
        super().__init__(device)
        self.closed = False

    def create_notification(self) -> ImmediateNotification:
        return ImmediateNotification(self)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True
        super().close()


class DeviceTimer(ABC):
    """Times work on a provider's streams without synchronising the host (CUDA events, say),
    while a session or run is profiled (``Ep.create_device_timer``).

    The executor queues a mark on a node's stream before and after the node's work and one
    when the run starts; it reads elapsed times only after the run's own final
    synchronisation, then gives the marks back (``release``) for later runs to reuse.
    """

    @abstractmethod
    def mark(self, stream: SyncStream) -> Any:
        """Queue a timestamp on ``stream`` (no host synchronisation); returns the mark."""

    @abstractmethod
    def elapsed_us(self, start: Any, end: Any) -> float:
        """Device microseconds from mark ``start`` to mark ``end``. Called only once both
        were reached (after the run's synchronisation); raises if one was not."""

    def release(self, marks: list[Any]) -> None:
        """Marks no longer needed: they may be reused by later ``mark`` calls."""

    def close(self) -> None:
        """No more marks will be made (the execution frame that used the timer is closing)."""


class HostTimer(DeviceTimer):
    """A timer for streams whose work runs when it is queued (``ImmediateStream``): a mark is
    the host clock when it is made."""

    def mark(self, stream: SyncStream) -> int:
        return time.perf_counter_ns()

    def elapsed_us(self, start: int, end: int) -> float:
        return (end - start) / 1000.0


class DataTransfer(ABC):
    """Copies tensors between a provider's memory and the host or another device."""

    @abstractmethod
    def can_copy(self, src: Device, dst: Device) -> bool: ...

    @abstractmethod
    def copy_tensors(self, pairs: list[tuple[Any, Any]], stream: SyncStream | None) -> None:
        """Copy each (src, dst) pair; dst is already allocated with the same shape and dtype.

        Host tensors are numpy arrays, device tensors are ``DeviceTensor``s. With a stream the
        copies may be asynchronous on it; without one they complete before returning.
        """

    def bind_copy(self, src: Any, dst: Any, stream: SyncStream) -> Callable[[], None] | None:
        """The copy of ``src`` into ``dst`` on ``stream`` as a call bound once (both keep their
        memory: a frame's staging buffer and its planned tensor), for a run's feeds and
        outputs; None when this transfer has no such form (``copy_tensors`` is used)."""
        return None


def await_ready(value: Any, stream: SyncStream | None) -> None:
    """Order ``stream`` (the host when None) after the producer's pending work on a tensor
    imported from another library (``DeviceTensor.ready``); nothing for other values."""
    note = getattr(value, "ready", None)
    if note is None:
        return
    if stream is None:
        note.wait_on_host()
    else:
        note.wait_on_device(stream)


def device_of(value: Any) -> Device:
    if isinstance(value, DeviceTensor):
        return value.device
    return CPU


class DataTransferManager:
    """Finds the registered transfer that can copy between two devices."""

    def __init__(self) -> None:
        self._transfers: list[DataTransfer] = []

    def register(self, transfer: DataTransfer) -> None:
        if transfer not in self._transfers:
            self._transfers.append(transfer)

    def unregister(self, transfer: DataTransfer) -> None:
        if transfer in self._transfers:
            self._transfers.remove(transfer)

    def find(self, src: Device, dst: Device) -> DataTransfer:
        for t in self._transfers:
            if t.can_copy(src, dst):
                return t
        raise RuntimeError(f"no registered data transfer can copy from {src} to {dst}")

    def copy(self, src: Any, dst: Any, stream: SyncStream | None = None) -> None:
        sd, dd = device_of(src), device_of(dst)
        if sd.is_cpu and dd.is_cpu:
            np.copyto(dst, src)
            return
        self.find(sd, dd).copy_tensors([(src, dst)], stream)

    def bind_copy(self, src: Any, dst: Any, stream: SyncStream | None) -> Callable[[], None]:
        """A call copying ``src`` into ``dst`` on ``stream``, bound once where the transfer
        can (``DataTransfer.bind_copy``), else a plain ``copy``."""
        if stream is not None:
            sd, dd = device_of(src), device_of(dst)
            if not (sd.is_cpu and dd.is_cpu):
                call = self.find(sd, dd).bind_copy(src, dst, stream)
                if call is not None:
                    return call
        return lambda: self.copy(src, dst, stream)
