"""The plugin's on-disk caches and their folder: the ``tuning_cache_dir`` option, else
``$ONNXPLUG_CACHE_DIR``, else ``~/.cache/onnxplug`` (``$XDG_CACHE_HOME``); ``off`` (or an empty
``$ONNXPLUG_CACHE_DIR``) turns them off.

* ``TuningCache``: autotune results (cuDNN's winning plan per graph and its time, cuBLASLt's
  winning candidate per GEMM signature with ``tunable_op_enable``), one JSON file per device,
  driver and library versions.
* ``PlanCache``: cuDNN execution plans as the frontend serializes them (``Graph::serialize``: the
  plan's engine configuration and, for a runtime-compiled engine, its compiled kernel), one file
  per graph, so that a later process deserializes the plan it runs instead of building the
  graph, querying the heuristics and compiling.
* Compiled kernels: CuPy compiles ours (NVRTC) and keeps them in its kernel cache, keyed by
  source, options, architecture and compiler version. That cache is CuPy's, one per process:
  ``use_cache_folder_for_kernels`` points it at ``$ONNXPLUG_CACHE_DIR/kernels`` (or keeps it in
  memory, for ``off``) when that variable is set and CuPy's own variables are not; it runs when
  the plugin is imported, before CuPy compiles anything.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import tempfile
import threading
import warnings
from typing import Any

_OFF = ("", "0", "off", "none", "false")


def cache_folder(option: str) -> str | None:
    """The tuning cache's folder: the provider option, else $ONNXPLUG_CACHE_DIR, else the user's
    cache folder; None when turned off."""
    value = option or os.environ.get("ONNXPLUG_CACHE_DIR")
    if value is None:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return os.path.join(base, "onnxplug")
    if value.strip().lower() in _OFF:
        return None
    return os.path.expanduser(value)


def device_fingerprint(ordinal: int) -> str:
    """The device and driver a tuning result holds for (the name, compute capability and
    driver version of device ``ordinal``); each cache adds its library's versions."""
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(ordinal)
    name = props["name"]
    name = name.decode() if isinstance(name, bytes) else str(name)
    return (
        f"{name} sm{props['major']}{props['minor']} driver {cupy.cuda.runtime.driverGetVersion()}"
    )


class TuningCache:
    """Autotune results of one device and library set, on disk between processes: a JSON object
    of key -> result, read once and written back (merged with what other processes wrote, by an
    atomic rename) at exit."""

    def __init__(self, folder: str | None, fingerprint: str, prefix: str = "cudnn-conv"):
        digest = hashlib.sha1(fingerprint.encode()).hexdigest()[:16]
        self.path = os.path.join(folder, f"{prefix}-{digest}.json") if folder else None
        self.fingerprint = fingerprint
        self.entries: dict[str, Any] = self._read() if self.path else {}
        self.new: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._registered = False

    def _read(self) -> dict[str, Any]:
        try:
            with open(self.path) as fh:  # type: ignore[arg-type]
                data = json.load(fh)
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict) or data.get("fingerprint") != self.fingerprint:
            return {}
        entries = data.get("entries")
        return entries if isinstance(entries, dict) else {}

    def get(self, key: str) -> Any:
        return self.entries.get(key)

    def put(self, key: str, value: Any) -> None:
        if self.path is None:
            return
        with self._lock:
            self.entries[key] = self.new[key] = value
            if not self._registered:
                self._registered = True
                atexit.register(self.flush)

    def flush(self) -> None:
        """Write the new entries (best effort: a cache that cannot be written is no cache)."""
        with self._lock:
            if self.path is None or not self.new:
                return
            try:
                os.makedirs(os.path.dirname(self.path), exist_ok=True)
                entries = {**self._read(), **self.new}
                fd, tmp = tempfile.mkstemp(dir=os.path.dirname(self.path), suffix=".tmp")
                with os.fdopen(fd, "w") as fh:
                    json.dump({"fingerprint": self.fingerprint, "entries": entries}, fh)
                os.replace(tmp, self.path)
                self.new.clear()
            except OSError as e:
                warnings.warn(
                    f"onnxplug-cuda: cannot write the tuning cache {self.path}: {e}",
                    RuntimeWarning,
                    stacklevel=2,
                )


class PlanCache:
    """Serialized cuDNN plans of one device and library set, one file per graph key in
    ``<folder>/cudnn-plans-<fingerprint digest>/``: a line of JSON (the key, the plan's time
    where it was timed), then the frontend's bytes. Files are written when the plan is chosen
    (atomically, so concurrent processes never read half a file) and read back by key; a file
    of another key (a digest collision), or one that cannot be read, is no entry."""

    def __init__(self, folder: str | None, fingerprint: str):
        digest = hashlib.sha1(fingerprint.encode()).hexdigest()[:16]
        self.folder = os.path.join(folder, f"cudnn-plans-{digest}") if folder else None
        self._warned = False

    def _path(self, key: str) -> str:
        return os.path.join(self.folder, hashlib.sha1(key.encode()).hexdigest()[:32] + ".plan")  # type: ignore[arg-type]

    def get(self, key: str) -> tuple[bytes, float | None] | None:
        """The plan's bytes and its time per call in ms (None where it was not timed)."""
        if self.folder is None:
            return None
        try:
            with open(self._path(key), "rb") as fh:
                head = json.loads(fh.readline())
                blob = fh.read()
        except (OSError, ValueError):
            return None
        if not isinstance(head, dict) or head.get("key") != key or not blob:
            return None
        ms = head.get("ms")
        return blob, (float(ms) if isinstance(ms, (int, float)) else None)

    def put(self, key: str, blob: bytes, ms: float | None) -> None:
        if self.folder is None:
            return
        try:
            os.makedirs(self.folder, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.folder, suffix=".tmp")
            with os.fdopen(fd, "wb") as fh:
                fh.write(json.dumps({"key": key, "ms": ms}).encode() + b"\n")
                fh.write(blob)
            os.replace(tmp, self._path(key))
        except OSError as e:
            if not self._warned:  # a cache that cannot be written is no cache
                self._warned = True
                warnings.warn(
                    f"onnxplug-cuda: cannot write cuDNN plans in {self.folder}: {e}",
                    RuntimeWarning,
                    stacklevel=2,
                )


def use_cache_folder_for_kernels(environ: Any = os.environ) -> None:
    """Point CuPy's kernel cache at ``$ONNXPLUG_CACHE_DIR/kernels``, or keep it in memory where
    that variable turns the caches off, unless ``CUPY_CACHE_DIR`` or ``CUPY_CACHE_IN_MEMORY``
    is set (CuPy's own setting wins). Without ``$ONNXPLUG_CACHE_DIR``, CuPy's default stays
    (``~/.cupy/kernel_cache``): importing the plugin does not move a user's CuPy cache."""
    value = environ.get("ONNXPLUG_CACHE_DIR")
    if value is None or "CUPY_CACHE_DIR" in environ or "CUPY_CACHE_IN_MEMORY" in environ:
        return
    if value.strip().lower() in _OFF:
        environ["CUPY_CACHE_IN_MEMORY"] = "1"
    else:
        environ["CUPY_CACHE_DIR"] = os.path.join(os.path.expanduser(value), "kernels")
