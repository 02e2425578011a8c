"""One model served on every device of a host: a session per device, a thread per session,
one shared input queue.

``SessionPool(model, "CUDAExecutionProvider")`` makes one ``InferenceSession`` for each EP
device the provider offers (``get_ep_devices()``; ``CUDA_VISIBLE_DEVICES`` decides which GPUs
that is), each selected with ``SessionOptions.add_provider_for_devices``, and one worker thread
per session. Requests go into one queue; whichever device is free takes the next one, so a
faster or less loaded device serves more. ``run`` returns a ``concurrent.futures.Future``;
``map`` runs many inputs and returns their outputs in input order.

Each session keeps to its device (its arena, streams, handles and captured graphs are that
device's), and its thread makes the device current for each run, so the threads run at once
without interfering. The GIL is released inside the providers' device calls; a provider
whose kernels hold it (the CPU provider's numpy) gains less.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import Any

import onnxplug as ox

from ..errors import InvalidArgument

_STOP = object()


def devices_of(provider: str) -> list[Any]:
    """The EP devices ``provider`` offers on this host, in its order (one per GPU for CUDA)."""
    return [d for d in ox.get_ep_devices() if d.ep_name == provider]


class SessionPool:
    """Sessions of one model, one per device, fed from one queue by a thread each.

    ``devices``: a provider name (every device it offers) or a list of EP devices from
    ``get_ep_devices()`` (of one provider or several). ``provider_options`` are given to
    every device's provider (``device_id`` comes from the device). ``session_options``, when
    given, is called once per device and returns that session's ``SessionOptions`` (a
    ``SessionOptions`` cannot be shared: each gets its device added).
    """

    def __init__(
        self,
        model: Any,
        devices: str | Sequence[Any],
        provider_options: dict[str, Any] | None = None,
        session_options: Callable[[], ox.SessionOptions] | None = None,
    ):
        chosen = devices_of(devices) if isinstance(devices, str) else list(devices)
        if not chosen:
            known = sorted({d.ep_name for d in ox.get_ep_devices()})
            raise InvalidArgument(
                f"SessionPool: no device to run on (asked for {devices!r}; providers with "
                f"devices here: {known})"
            )
        self.devices = chosen
        self.sessions: list[ox.InferenceSession] = []
        for dev in chosen:
            so = session_options() if session_options is not None else ox.SessionOptions()
            so.add_provider_for_devices([dev], dict(provider_options or {}))
            self.sessions.append(ox.InferenceSession(model, so))
        self.runs = [0] * len(chosen)  # runs each device served
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._closed = False
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._serve, args=(i,), name=f"onnxplug-pool-{i}", daemon=True)
            for i in range(len(chosen))
        ]
        for t in self._threads:
            t.start()

    def __len__(self) -> int:
        return len(self.sessions)

    def _serve(self, i: int) -> None:
        sess = self.sessions[i]
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            future, output_names, feed, run_options = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                out = sess.run(output_names, feed, run_options)
            except BaseException as e:  # handed to the caller through the future
                future.set_exception(e)
            else:
                self.runs[i] += 1
                future.set_result(out)

    def run(
        self, output_names: list[str] | None, feed: dict[str, Any], run_options: Any = None
    ) -> Future:
        """Queue one run (``InferenceSession.run``'s arguments); the future of its outputs."""
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("SessionPool.run after close()")
            self._queue.put((future, output_names, feed, run_options))
        return future

    def map(
        self, output_names: list[str] | None, feeds: Iterable[dict[str, Any]]
    ) -> list[list[Any]]:
        """Run every feed (spread over the devices); their outputs, in the feeds' order."""
        futures = [self.run(output_names, f) for f in feeds]
        return [f.result() for f in futures]

    def close(self) -> None:
        """Finish the queued runs, stop the threads and drop the sessions."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for _ in self._threads:
                self._queue.put(_STOP)
        for t in self._threads:
            t.join()
        self.sessions.clear()

    def __enter__(self) -> SessionPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
