"""Access to the CUDA runtime through ``cuda.bindings`` (imported lazily, so the plugin can be
imported, and report "no device", on machines without CUDA)."""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from dataclasses import dataclass
from typing import Any

from onnxplug.ep import EPFail

# Streams capturing a graph right now (handles). A block freed on such a stream is freed after
# the capture ends, so that its free is not recorded into the graph.
CAPTURING: set[int] = set()
_DEFERRED: list[tuple[Any, int, int]] = []  # (allocator, ptr, stream) freed while it captured
# Guards CAPTURING and _DEFERRED; device-wide synchronisations wait on it until no stream
# captures (``device_synchronize``).
_CAPTURE_STATE = threading.Condition()
_device_syncs = 0  # device-wide synchronisations waiting or running (captures wait for them)


def defer_free(allocator: Any, ptr: int, stream: int) -> bool:
    """Hold the free of ``ptr`` until ``stream`` stops capturing (False: it does not capture
    now; free it at once)."""
    with _CAPTURE_STATE:
        if stream not in CAPTURING:
            return False
        _DEFERRED.append((allocator, ptr, stream))
        return True


def capture_started(stream: int) -> None:
    """Called before ``stream`` begins capturing: waits while a device-wide synchronisation
    runs (it would invalidate the capture)."""
    with _CAPTURE_STATE:
        _CAPTURE_STATE.wait_for(lambda: not _device_syncs)
        CAPTURING.add(stream)


def capture_stopped(stream: int) -> None:
    """``stream`` no longer captures: free what was deferred on it, and let waiting device
    synchronisations run once no stream captures."""
    with _CAPTURE_STATE:
        CAPTURING.discard(stream)
        ready = [d for d in _DEFERRED if d[2] not in CAPTURING]
        _DEFERRED[:] = [d for d in _DEFERRED if d[2] in CAPTURING]
        if not CAPTURING:
            _CAPTURE_STATE.notify_all()
    for allocator, ptr, _ in ready:
        allocator.free(ptr)


def device_synchronize(ordinal: int) -> None:
    """``cudaDeviceSynchronize`` on device ``ordinal``, once no stream of this process captures
    a graph: during a capture it fails and invalidates that capture, whatever the capture
    mode, so that one thread's IOBinding synchronisation or arena shrinkage would break another
    thread's graph capture. Captures about to begin wait for it."""
    global _device_syncs
    with _CAPTURE_STATE:
        _device_syncs += 1
        try:
            _CAPTURE_STATE.wait_for(lambda: not CAPTURING)
        except BaseException:
            _device_syncs -= 1
            raise
    try:
        with DeviceGuard(ordinal):
            check(cudart().cudaDeviceSynchronize(), "cudaDeviceSynchronize")
    finally:
        with _CAPTURE_STATE:
            _device_syncs -= 1
            _CAPTURE_STATE.notify_all()


@functools.cache
def cudart() -> Any:
    from cuda.bindings import runtime

    return runtime


@functools.cache
def cupy_runtime() -> Any:
    """CuPy's CUDA runtime module, or None without CuPy. Its Cython calls cost a fraction of
    cuda.bindings' (no result tuple, no enum object): the per-run calls use it."""
    try:
        from cupy.cuda import runtime
    except ImportError:
        return None
    return runtime


class CudaError(EPFail):
    pass


def check(result: Any, what: str) -> Any:
    """Unpack a cuda.bindings result tuple, raising CudaError with the call named."""
    err = result[0]
    if int(err) != 0:
        rt = cudart()
        try:
            _, name = rt.cudaGetErrorName(err)
            _, text = rt.cudaGetErrorString(err)
            msg = f"{name.decode()}: {text.decode()}"
        except Exception:
            msg = str(err)
        raise CudaError(f"{what} failed: {msg}")
    if len(result) == 1:
        return None
    return result[1] if len(result) == 2 else result[1:]


@dataclass(frozen=True)
class CudaDeviceInfo:
    ordinal: int
    name: str
    major: int
    minor: int
    total_memory: int
    multiprocessors: int


_probe_lock = threading.Lock()
_probe: tuple[list[CudaDeviceInfo], str | None] | None = None


def probe_devices() -> tuple[list[CudaDeviceInfo], str | None]:
    """The visible CUDA devices (CUDA_VISIBLE_DEVICES is honoured by the driver), or
    ([], reason) when there is no usable driver/runtime."""
    global _probe
    with _probe_lock:
        if _probe is not None:
            return _probe
        try:
            rt = cudart()
        except Exception as e:
            _probe = ([], f"cuda.bindings is not importable ({type(e).__name__}: {e})")
            return _probe
        err, count = rt.cudaGetDeviceCount()
        if int(err) != 0:
            _, name = rt.cudaGetErrorName(err)
            _probe = ([], f"cudaGetDeviceCount failed: {name.decode()} (no GPU or no driver)")
            return _probe
        devices = []
        for i in range(count):
            props = check(rt.cudaGetDeviceProperties(i), "cudaGetDeviceProperties")
            name = props.name
            name = name.decode(errors="replace") if isinstance(name, bytes) else str(name)
            devices.append(
                CudaDeviceInfo(
                    i,
                    name.rstrip("\x00"),
                    props.major,
                    props.minor,
                    props.totalGlobalMem,
                    props.multiProcessorCount,
                )
            )
        reason = None if devices else "no CUDA device is visible"
        if not devices and os.environ.get("CUDA_VISIBLE_DEVICES") is not None:
            reason += f" (CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r})"
        _probe = (devices, reason)
        return _probe


_driver_thread: threading.Thread | None = None


def _libcuda() -> Any:
    return ctypes.CDLL("libcuda.so.1")


def init_driver_in_background() -> None:
    """Start the driver's initialisation (``cuInit``: 0.1-0.25 s measured on H100 hosts) on a
    helper thread, through ctypes, which releases the GIL and imports nothing, so that
    importing cuda.bindings overlaps it. The probe's first runtime call then finds the driver
    initialised or waits for it (the driver serialises its initialisation). A failure (no
    driver) is left to the probe, which reports it. Once per process."""
    global _driver_thread
    with _probe_lock:
        if _driver_thread is not None or _probe is not None:
            return
        _driver_thread = threading.Thread(target=_init_driver, name="onnxplug-cuda-init")
        _driver_thread.daemon = True
    _driver_thread.start()


def _init_driver() -> None:
    try:
        _libcuda().cuInit(0)
    except Exception:  # no driver here: the probe says so
        pass


_context_threads: dict[int, threading.Thread] = {}


def create_context_in_background(ordinal: int) -> None:
    """Start creating device ``ordinal``'s primary CUDA context on a helper thread (driver
    calls through ctypes: ``cuDevicePrimaryCtxRetain``, about 0.1 s of driver work with the
    GIL released), so that what a session does next on the host (importing CuPy, optimising
    the graph) overlaps it. Only the driver API is called there: the runtime of cuda.bindings
    called from a helper thread left process exit crashing now and then ("double free",
    in 4 of 8 runs of benchmarks/models.py on an H100, 0 of 10 without that thread). The retain is
    kept for the process's life, as the runtime keeps its own. Nothing waits for the thread:
    the driver makes a call that needs the context wait until it exists, and a failure here is
    met again, and reported, by that call. Once per device and process."""
    with _probe_lock:
        if ordinal in _context_threads:
            return
        t = _context_threads[ordinal] = threading.Thread(
            target=_retain_primary_context, args=(ordinal,), name=f"onnxplug-cuda-ctx-{ordinal}"
        )
        t.daemon = True
    t.start()


def _retain_primary_context(ordinal: int) -> ctypes.c_void_p | None:
    """Device ``ordinal``'s primary context, retained (kept for the process's life); None
    where the driver refuses (the session's own first CUDA call reports it)."""
    try:
        cuda = _libcuda()
        device, context = ctypes.c_int(), ctypes.c_void_p()
        if cuda.cuInit(0) == 0 and cuda.cuDeviceGet(ctypes.byref(device), ordinal) == 0:
            if cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device) == 0:
                return context
    except Exception:
        pass
    return None


def make_primary_context_current(ordinal: int) -> bool:
    """Make device ``ordinal``'s primary context current on this (helper) thread through the
    driver API, retaining it as ``create_context_in_background`` does; False where it fails."""
    context = _retain_primary_context(ordinal)
    return context is not None and _libcuda().cuCtxSetCurrent(context) == 0


class DeviceGuard:
    """Switch the current device for a block and restore the caller's afterwards (what
    onnxruntime's CUDA plugin EP does at every entry point that touches CUDA). Reusable:
    each ``__enter__`` remembers the device it found."""

    __slots__ = ("ordinal", "prev")

    def __init__(self, ordinal: int):
        self.ordinal = ordinal
        self.prev = -1

    def __enter__(self) -> None:
        fast = cupy_runtime()
        if fast is not None:
            try:
                self.prev = fast.getDevice()
                if self.prev != self.ordinal:
                    fast.setDevice(self.ordinal)
            except Exception as e:  # CuPy's CUDARuntimeError
                raise CudaError(f"selecting CUDA device {self.ordinal} failed: {e}") from e
            return
        rt = cudart()
        self.prev = check(rt.cudaGetDevice(), "cudaGetDevice")
        if self.prev != self.ordinal:
            check(rt.cudaSetDevice(self.ordinal), "cudaSetDevice")

    def __exit__(self, *exc: Any) -> None:
        if self.prev != self.ordinal and self.prev >= 0:
            cudart().cudaSetDevice(self.prev)


# How copies between two devices go, per (source, destination) ordinal: PEER when either
# device could be given access to the other's memory (cudaDeviceCanAccessPeer), HOST when
# neither can (cudaMemcpyPeerAsync then stages the copy through host memory in the driver).
PEER = "peer"
HOST = "host"
_peer_lock = threading.Lock()
_peer_routes: dict[tuple[int, int], str] = {}


def peer_route(src: int, dst: int) -> str:
    """How a copy from device ``src`` to device ``dst`` goes (``PEER`` or ``HOST``). The first
    time a pair is asked for, peer access is enabled in each direction the hardware allows
    (once per process, as it stays enabled); a driver that says "already enabled" (someone
    else, PyTorch say, enabled it) counts as enabled."""
    key = (src, dst) if src <= dst else (dst, src)
    route = _peer_routes.get(key)
    if route is not None:
        return route
    with _peer_lock:
        route = _peer_routes.get(key)
        if route is None:
            a, b = key
            enabled = [_enable_peer(a, b), _enable_peer(b, a)]
            route = _peer_routes[key] = PEER if any(enabled) else HOST
    return route


def _enable_peer(device: int, peer: int) -> bool:
    """Give ``device`` access to ``peer``'s memory if the hardware allows it."""
    rt = cudart()
    can = check(rt.cudaDeviceCanAccessPeer(device, peer), "cudaDeviceCanAccessPeer")
    if not can:
        return False
    with DeviceGuard(device):
        err = rt.cudaDeviceEnablePeerAccess(peer, 0)[0]
    if err == rt.cudaError_t.cudaErrorPeerAccessAlreadyEnabled:
        rt.cudaGetLastError()  # not an error for us: clear it so later calls do not see it
        return True
    check((err,), f"cudaDeviceEnablePeerAccess({device} -> {peer})")
    return True
