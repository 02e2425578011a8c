"""CUDA streams with their own cuBLASLt and cuDNN handles, event-based notifications, and the
event-based timer of nodes while a session or run is profiled."""

from __future__ import annotations

from typing import Any

from onnxplug.ep import (
    Device,
    DeviceTimer,
    GraphCaptureViolation,
    SyncNotification,
    SyncStream,
    counters,
)

from .runtime import (
    LEGACY_DEFAULT_STREAMS,
    CudaError,
    DeviceGuard,
    call,
    capture_started,
    capture_stopped,
    cuda_error,
    cuda_status,
    cudart,
)

# cudaStreamCaptureStatus
_CAPTURE_NONE, _CAPTURE_INVALIDATED = 0, 2


class CudaNotification(SyncNotification):
    __slots__ = ("event", "producer", "sync_id")

    def __init__(self, producer: CudaSyncStream):
        rt = cudart()
        self.producer = producer
        with DeviceGuard(producer.ordinal):
            self.event = call(
                "cudaEventCreateWithFlags", rt.eventCreateWithFlags, rt.eventDisableTiming
            )
        self.sync_id = 0

    def activate(self) -> None:
        self.sync_id = self.producer.next_sync_id()
        call("cudaEventRecord", cudart().eventRecord, self.event, self.producer.handle)

    def wait_on_device(self, consumer: SyncStream) -> None:
        call("cudaStreamWaitEvent", cudart().streamWaitEvent, consumer.handle, self.event)
        consumer.record_wait(self.producer, self.sync_id)

    def wait_on_handle(self, handle: int) -> None:
        """Make another library's stream (a DLPack consumer's; 1 and 2 are the legacy and
        per-thread default streams, which the runtime API takes as handles) wait for it. On the
        event's device: the default-stream handles name the current device's stream."""
        with DeviceGuard(self.producer.ordinal):
            call("cudaStreamWaitEvent", cudart().streamWaitEvent, handle, self.event)

    def wait_on_host(self) -> None:
        if self.producer.capturing:
            raise GraphCaptureViolation("a host wait on a stream capturing a graph")
        counters.bump(counters.HOST_SYNCS)
        call("cudaEventSynchronize", cudart().eventSynchronize, self.event)

    def __del__(self) -> None:
        try:
            cudart().eventDestroy(self.event)
        except Exception:
            pass


class CudaEventTimer(DeviceTimer):
    """Device time of nodes while profiling: a mark is a timing CUDA event recorded on the
    node's stream (around the launch of its one-node CUDA graph, or its eager launches); the
    host reads ``cudaEventElapsedTime`` only after the run's own synchronisation, so nothing
    waits. Events are pooled per execution frame and destroyed with it. Only profiled runs
    create one: the fast path never records an event."""

    def __init__(self, ordinal: int):
        self.ordinal = ordinal
        self._free: list[Any] = []
        self._all: list[Any] = []

    def mark(self, stream: SyncStream) -> Any:
        rt = cudart()
        if self._free:
            event = self._free.pop()
        else:
            with DeviceGuard(self.ordinal):
                event = call("cudaEventCreateWithFlags", rt.eventCreateWithFlags, rt.eventDefault)
            self._all.append(event)
        call("cudaEventRecord", rt.eventRecord, event, stream.handle)
        return event

    def elapsed_us(self, start: Any, end: Any) -> float:
        # cudaErrorNotReady: read before the run's synchronisation (a bug), never waited on
        return float(call("cudaEventElapsedTime", cudart().eventElapsedTime, start, end)) * 1e3

    def release(self, marks: list[Any]) -> None:
        self._free.extend(marks)

    def close(self) -> None:
        events, self._all, self._free = self._all, [], []
        for event in events:
            try:
                cudart().eventDestroy(event)
            except Exception:
                pass

    def __del__(self) -> None:  # a frame collected without being closed
        self.close()


class CudaSyncStream(SyncStream):
    """A CUDA stream (owned, or the user's) and the library handles bound to it.

    A user's legacy default stream (``user_compute_stream=0``, PyTorch's default current
    stream) cannot capture a CUDA graph, which node graphs, eager segments and
    ``enable_cuda_graph`` all need. The session's work then goes on a non-blocking stream of
    its own, ``joined`` to the user's: each run starts after the work queued on the user's
    stream so far (``begin_run``) and the user's stream waits for the run's work at its end,
    through events, without a host wait. An external allocator, which runs the session on the
    legacy default stream as in onnxruntime, joins at each allocation and free too
    (``ExternalDeviceAllocator``), so the user's pool sees its blocks used in the user's
    stream's order."""

    def __init__(
        self,
        device: Device,
        ordinal: int,
        user_handle: int | None = None,
        enable_cudnn: bool = True,
        on_close: Any = None,
        shared: bool = False,
    ):
        super().__init__(device)
        self.ordinal = ordinal
        self.owned = user_handle is None
        self.frame_owned = self.owned and not shared
        self.enable_cudnn = enable_cudnn
        self._on_close = on_close
        user = None if user_handle is None else int(user_handle or 0)
        self.joined = user if user in LEGACY_DEFAULT_STREAMS else None
        self._joins: tuple[Any, Any] | None = None  # (run start's event, run end's event)
        self._ours = user is None or self.joined is not None  # created here, destroyed here
        if self._ours:
            rt = cudart()
            with DeviceGuard(ordinal):
                s = call(
                    "cudaStreamCreateWithFlags", rt.streamCreateWithFlags, rt.streamNonBlocking
                )
                self._handle = int(s)
                if self.joined is not None:
                    self._joins = tuple(  # type: ignore[assignment]
                        call(
                            "cudaEventCreateWithFlags",
                            rt.eventCreateWithFlags,
                            rt.eventDisableTiming,
                        )
                        for _ in range(2)
                    )
                    self.wait_for_user()  # created within a run: that run's start
        else:
            self._handle = int(user_handle or 0)
        self._cublaslt: Any = None
        self._cudnn: Any = None
        self._cupy: Any = None
        self.closed = False

    @property
    def handle(self) -> int:
        return self._handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self._handle)

    # library handles, created on first use ------------------------------------------------------
    @property
    def cublaslt(self) -> Any:
        if self._cublaslt is None:
            from .blas import cublaslt

            with DeviceGuard(self.ordinal):
                self._cublaslt = cublaslt().create()
        return self._cublaslt

    @property
    def cudnn(self) -> Any:
        if self._cudnn is None:
            if not self.enable_cudnn:
                raise RuntimeError("cuDNN is disabled (enable_cudnn=0)")
            from .dnn import import_cudnn

            cudnn = import_cudnn()

            with DeviceGuard(self.ordinal):
                h = cudnn.create_handle()
                cudnn.set_stream(handle=h, stream=self._handle)
            self._cudnn = h
        return self._cudnn

    @property
    def cupy_stream(self) -> Any:
        if self._cupy is None:
            import cupy

            # CuPy takes a foreign stream to be of the device current when it wraps it
            with DeviceGuard(self.ordinal):
                self._cupy = cupy.cuda.Stream.from_external(self)
        return self._cupy

    # protocol -------------------------------------------------------------------------------------
    def create_notification(self) -> CudaNotification:
        return CudaNotification(self)

    def wait_for_handle(self, handle: int) -> None:
        """Order this stream after the work queued so far on another library's stream (a
        ``__cuda_array_interface__`` producer's): an event recorded there, waited for here."""
        rt = cudart()
        with DeviceGuard(self.ordinal):
            event = call("cudaEventCreateWithFlags", rt.eventCreateWithFlags, rt.eventDisableTiming)
            try:
                self._order(event, handle, self._handle)
            finally:
                rt.eventDestroy(event)  # released once the wait is satisfied

    def _order(self, event: Any, first: int, then: int) -> None:
        """Stream ``then``'s later work waits for the work queued on stream ``first`` so far
        (``event`` recorded there). On this stream's device throughout: an event is recorded
        on a stream of its own device, and the default-stream handles (0, 1, 2) name the
        current device's stream."""
        rt = cudart()
        with DeviceGuard(self.ordinal):
            call("cudaEventRecord", rt.eventRecord, event, first)
            call("cudaStreamWaitEvent", rt.streamWaitEvent, then, event)

    def wait_for_user(self) -> None:
        """This (joined) stream's later work waits for the work queued on the user's stream so
        far: at a run's start (``begin_run``), and when an external allocator hands out a
        block."""
        joins = self._joins
        if joins is not None:  # (None: closed, drained: nothing of this stream's to order)
            self._order(joins[0], self.joined, self._handle)  # type: ignore[arg-type]

    def user_waits(self) -> None:
        """The user's stream's later work (a PyTorch op reading an output, a block's reuse)
        waits for the work queued on this (joined) stream so far."""
        joins = self._joins
        # (closed, drained; or capturing: nothing queued runs before the graph's launch)
        if joins is not None and not self.capturing:
            self._order(joins[1], self._handle, self.joined)  # type: ignore[arg-type]

    begin_run = wait_for_user  # a run starts (nothing to do for a stream that is not joined)

    def is_capturing(self) -> bool:
        """Whether this stream is in a capture, an active or an invalidated one."""
        return self._capture_status() != _CAPTURE_NONE

    def capture_invalidated(self) -> bool:
        """Whether this stream is in a capture that an error has invalidated: every later call
        in it fails, whatever the call, until the capture ends."""
        return self._capture_status() == _CAPTURE_INVALIDATED

    def _capture_status(self) -> int:
        try:
            return int(cudart().streamIsCapturing(self._handle))  # 0 or 1 (active)
        except RuntimeError as e:
            if cuda_status(e) is not None:
                raise cuda_error("cudaStreamIsCapturing", e) from e
            return _CAPTURE_INVALIDATED  # CuPy raises a plain RuntimeError for this status

    def flush(self) -> None:
        if self.capturing:
            raise GraphCaptureViolation("a host synchronisation on a stream capturing a graph")
        if not self._ours and self.is_capturing():
            return  # never synchronise a user's stream while its owner captures a graph
        counters.bump(counters.HOST_SYNCS)
        call("cudaStreamSynchronize", cudart().streamSynchronize, self._handle)

    def on_session_run_end(self) -> None:
        self.user_waits()  # a joined stream: the user's stream's later work after the run's
        self.flush()
        # a user's stream its owner is capturing has not run the work yet: its blocks stay
        # tagged (the arena keeps them from other streams)
        if self._ours or not self.is_capturing():
            self.notify_released()

    # graph capture ----------------------------------------------------------------------------
    def begin_capture(self) -> None:
        rt = cudart()
        capture_started(self._handle)
        try:
            with DeviceGuard(self.ordinal):
                call(
                    "cudaStreamBeginCapture",
                    rt.streamBeginCapture,
                    self._handle,
                    rt.streamCaptureModeThreadLocal,
                )
        except BaseException:
            capture_stopped(self._handle)
            raise
        self.capturing = True

    def end_capture(self) -> Any:
        """Stop capturing; the instantiated (and uploaded) graph."""
        rt = cudart()
        # the capture ends before the gate opens: a device-wide synchronisation waiting on it
        # would fail while the stream still captures, and a free deferred until the capture's
        # end would be recorded into the graph
        try:
            graph = call("cudaStreamEndCapture", rt.streamEndCapture, self._handle)
        finally:
            self._stop_capture()
        try:
            with DeviceGuard(self.ordinal):
                exe = call("cudaGraphInstantiate", rt.graphInstantiate, graph)
                call("cudaGraphUpload", rt.graphUpload, exe, self._handle)
        finally:
            rt.graphDestroy(graph)
        return exe

    def abort_capture(self) -> None:
        rt = cudart()
        try:
            graph = rt.streamEndCapture(self._handle)
        except Exception as e:  # an invalidated capture: nothing to destroy
            if cuda_status(e) is None:
                raise
            return
        finally:
            self._stop_capture()
        if graph:
            rt.graphDestroy(graph)

    def capture_call(self, fn: Any) -> Any:
        """``fn``'s work on this stream as an instantiated graph (not run), or None when it
        cannot be captured (the stream is usable again either way)."""
        try:
            self.begin_capture()
        except CudaError:  # the legacy default stream (a user's stream 0) cannot capture
            return None
        try:
            fn()
        except Exception:
            self.abort_capture()
            return None
        try:
            return self.end_capture()
        except Exception:
            return None

    def _stop_capture(self) -> None:
        self.capturing = False
        capture_stopped(self._handle)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._ours:  # a user's stream is theirs: never touched after the session is done
            try:
                cudart().streamSynchronize(self._handle)
            except Exception:
                pass
        if self._on_close is not None:
            self._on_close(self._handle)
        super().close()  # drained: arenas untag the blocks they tagged with this stream
        with DeviceGuard(self.ordinal):  # the handles go on the device they were made on
            self._destroy_handles()

    def _destroy_handles(self) -> None:
        if self._cublaslt is not None:
            from .blas import cublaslt

            cublaslt().destroy(self._cublaslt)
            self._cublaslt = None
        if self._cudnn is not None:
            try:
                import cudnn

                cudnn.destroy_handle(self._cudnn)
            except Exception:
                pass
            self._cudnn = None
        if self._ours and self._handle:
            cudart().streamDestroy(self._handle)
        for event in self._joins or ():
            cudart().eventDestroy(event)
        self._joins = None
