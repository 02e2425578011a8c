"""The runtime's log, as onnxruntime prints its own: one line per message on stderr,
``2026-01-02 03:04:05.123456789 [W:onnxplug:logid, file.py:12 function] message``.

A message is printed when its severity (0 verbose, 1 info, 2 warning, 3 error, 4 fatal) reaches
the level of the session (``SessionOptions.log_severity_level``) or, where that is -1 or the
message belongs to no session, the default logger's (``set_default_logger_severity``, 2 at
start). ``set_default_logger_callback`` sends the lines to a Python callable instead.

Messages go through the ``onnxplug`` logging.Logger, which does not propagate to the root
logger (the lines would print twice); a program that wants them in its own logging can add a
handler to it or set its ``propagate``.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from ..errors import InvalidArgument

LOGGER = logging.getLogger("onnxplug")
# onnxruntime severity -> logging level and the letter onnxruntime prints
LEVELS = (logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR, logging.CRITICAL)
_LETTERS = "VIWEF"

_default_severity = 2
_default_verbosity = 0
_callback: Callable[[int, str, str, str, str], Any] | None = None


def severity_of(level: int) -> int:
    """onnxruntime's severity of a logging level."""
    for sev in range(4, -1, -1):
        if level >= LEVELS[sev]:
            return sev
    return 0


def effective_severity(severity: int) -> int:
    """A session's or run's severity, -1 meaning the default logger's."""
    return _default_severity if severity < 0 else severity


def set_default_severity(severity: Any) -> None:
    global _default_severity
    _default_severity = _check_severity(severity)


def default_verbosity() -> int:
    return _default_verbosity


def set_default_verbosity(verbosity: Any) -> None:
    global _default_verbosity
    if isinstance(verbosity, bool) or not isinstance(verbosity, int) or verbosity < 0:
        raise InvalidArgument(f"the logger verbosity must be an int >= 0, not {verbosity!r}")
    _default_verbosity = verbosity


def set_callback(callback: Callable[[int, str, str, str, str], Any] | None, severity: Any) -> None:
    global _callback
    sev = _check_severity(severity)
    if callback is not None and not callable(callback):
        raise InvalidArgument("the logger callback must be callable or None")
    _callback = callback
    if callback is not None:
        set_default_severity(sev)


def _check_severity(severity: Any) -> int:
    if isinstance(severity, bool) or not isinstance(severity, int) or not 0 <= severity <= 4:
        raise InvalidArgument(
            f"severity must be 0 (verbose), 1 (info), 2 (warning), 3 (error) or 4 (fatal), "
            f"not {severity!r}"
        )
    return severity


def log(severity: int, message: str, logid: str = "", at_severity: int = -1) -> None:
    """Print ``message`` if ``severity`` reaches ``at_severity`` (-1: the default's)."""
    if severity >= effective_severity(at_severity):
        LOGGER.log(LEVELS[severity], message, extra={"ort_logid": logid}, stacklevel=3)


class _StderrHandler(logging.Handler):
    """Formats records as onnxruntime's lines; to stderr or the registered callback."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sev = severity_of(record.levelno)
            logid = getattr(record, "ort_logid", "")
            where = f"{os.path.basename(record.pathname)}:{record.lineno} {record.funcName}"
            message = record.getMessage()
            if _callback is not None:
                _callback(sev, "onnxplug", logid, where, message)
                return
            stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.created))
            frac = f"{record.created % 1:.9f}"[2:]
            sys.stderr.write(
                f"{stamp}.{frac} [{_LETTERS[sev]}:onnxplug:{logid}, {where}] {message}\n"
            )
        except Exception:
            self.handleError(record)


if not any(isinstance(h, _StderrHandler) for h in LOGGER.handlers):
    LOGGER.addHandler(_StderrHandler())
LOGGER.setLevel(logging.DEBUG)  # the severity filter is ours (log() above)
LOGGER.propagate = False
