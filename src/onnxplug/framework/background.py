"""Work started on a helper thread and collected, in the caller's thread, where it is needed."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class BackgroundCall(Generic[T]):
    """``fn()`` on a daemon thread named ``name`` (``background``), else at once. ``result()``
    waits for it and returns its value, or re-raises what it raised, in the caller's thread."""

    def __init__(self, fn: Callable[[], T], name: str, background: bool = True) -> None:
        self._fn: Callable[[], T] | None = fn
        self._value: T | None = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._call, name=name, daemon=True)
            self._thread.start()
        else:
            self._call()

    def _call(self) -> None:
        assert self._fn is not None
        try:
            self._value = self._fn()
        except BaseException as e:  # re-raised by result()
            self._error = e
        self._fn = None  # nothing it holds outlives the call

    def result(self) -> T:
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]
