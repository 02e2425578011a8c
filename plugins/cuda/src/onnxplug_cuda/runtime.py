"""Access to the CUDA runtime and driver: CuPy's runtime bindings for the runtime calls, the
driver API through ctypes for the device probe and the work done on helper threads (``cuInit``,
the primary context). cuda.bindings is not imported: its runtime module took 103-125 ms of
interpreter-locked import on the lent H100 hosts, a quarter of a ResNet-50 session's creation,
and CuPy, which the provider computes with, binds the same calls. CuPy is imported lazily, on
a helper thread started by the probe (``CUPY``), so the plugin can be imported, and report "no
device", on machines without CUDA."""

from __future__ import annotations

import ctypes
import functools
import importlib
import importlib.util
import os
import sys
import threading
from collections.abc import Callable
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


def defer_free(
    allocator: Any, ptr: int, stream: int, otherwise: Callable[[], None] | None = None
) -> bool:
    """Hold the free of ``ptr`` until ``stream`` stops capturing (False: it does not capture
    now; free it at once, after ``otherwise``, which runs before any capture of ``stream`` can
    begin)."""
    with _CAPTURE_STATE:
        if stream not in CAPTURING:
            if otherwise is not None:
                otherwise()
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
            call("cudaDeviceSynchronize", cudart().deviceSynchronize)
    finally:
        with _CAPTURE_STATE:
            _device_syncs -= 1
            _CAPTURE_STATE.notify_all()


class CudaError(EPFail):
    pass


class BackgroundImport:
    """Modules imported on a thread of their own, started early and joined where first used.

    An import holds the interpreter lock, but the driver's waits beside it (``cuInit``, a
    context's creation) do not, so an import started before them overlaps them. Packages
    whose ``__init__`` imports far more than the modules needed (nvmath's) are skipped
    (``import_skipping_package_inits``). ``modules`` re-raises what the import raised, so that
    the caller sees the error it would have seen importing the modules itself."""

    def __init__(
        self,
        *modules: str,
        skip_package_inits: bool = False,
        warm: Callable[[tuple[Any, ...], int], None] | None = None,
    ):
        self.names = modules
        self._skip = skip_package_inits
        self._warm = warm  # ``warm_up``'s work, with the modules and a device
        self._warmed: set[int] = set()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._modules: tuple[Any, ...] = ()

    def start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"onnxplug-import-{self.names[0]}", daemon=True
                )
                self._thread.start()

    def _run(self) -> None:
        load = import_skipping_package_inits if self._skip else importlib.import_module
        try:
            self._modules = tuple(load(n) for n in self.names)
        except BaseException as e:  # re-raised by modules(), in the thread that needs them
            self._error = e

    def warm_up(self, ordinal: int) -> None:
        """Run the warm-up for device ``ordinal`` on a thread of its own once the import is
        done (once per device; nothing when the import failed or there is no warm-up)."""
        with self._lock:
            if self._warm is None or ordinal in self._warmed:
                return
            self._warmed.add(ordinal)
        self.start()
        thread, warm = self._thread, self._warm

        def run() -> None:
            assert thread is not None
            thread.join()
            if self._error is None:
                try:
                    warm(self._modules, ordinal)
                except Exception:  # a warm-up only: the first real use meets any error again
                    pass

        threading.Thread(target=run, name=f"onnxplug-warm-{ordinal}", daemon=True).start()

    def modules(self) -> tuple[Any, ...]:
        """The imported modules, in the order named (imported now if the background import
        never started); re-raises the import's error."""
        self.start()
        assert self._thread is not None
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._modules


def import_skipping_package_inits(name: str) -> Any:
    """Import module ``name`` without running the ``__init__`` of the packages above it that
    are not imported yet: they stand in ``sys.modules`` as bare package objects (their
    ``__path__`` only) while the module imports, and are removed afterwards, so that a later
    ``import`` of a package runs its ``__init__`` as usual (and finds the module imported).
    Use the returned module (or ``importlib.import_module(name)``), not ``from package import
    module``, which would import the package."""
    parts = name.split(".")
    stubs: list[tuple[str, Any]] = []
    try:
        for i in range(1, len(parts)):
            package = ".".join(parts[:i])
            if package in sys.modules:
                continue
            spec = importlib.util.find_spec(package)
            if spec is None or spec.submodule_search_locations is None:
                raise ModuleNotFoundError(f"No module named {package!r}", name=package)
            stub = importlib.util.module_from_spec(spec)
            sys.modules[package] = stub
            stubs.append((package, stub))
        return importlib.import_module(name)
    finally:
        for package, stub in reversed(stubs):
            if sys.modules.get(package) is stub:
                del sys.modules[package]


# CuPy (170-200 ms of import on the lent H100 hosts, most of it holding the interpreter lock):
# started by the device probe, beside the driver's initialisation
CUPY = BackgroundImport("cupy")


@functools.cache
def cudart() -> Any:
    """CuPy's CUDA runtime module (``cupy.cuda.runtime``): a call returns its result and raises
    ``CUDARuntimeError`` (``status``: the ``cudaError_t``) on an error, having cleared it."""
    CUPY.modules()  # the probe's import, finished (or its error)
    from cupy.cuda import runtime

    return runtime


def cuda_status(error: BaseException) -> int | None:
    """The ``cudaError_t`` of a CUDA runtime error (None: not one)."""
    status = getattr(error, "status", None)
    return status if isinstance(status, int) else None


def cuda_error(what: str, error: Exception) -> Exception:
    """What to raise for ``error`` from the call ``what``: a CudaError naming the call for a
    CUDA runtime error ("cudaMalloc(64) failed: cudaErrorMemoryAllocation: out of memory"),
    any other exception as it is."""
    if cuda_status(error) is None:
        return error
    return CudaError(f"{what} failed: {error}")


def call(what: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, a CUDA runtime call, with its error raised as a CudaError that names
    ``what``."""
    try:
        return fn(*args)
    except Exception as e:
        raise cuda_error(what, e) from e


#: The legacy default stream's handles (0, and ``cudaStreamLegacy``): it cannot capture a graph.
LEGACY_DEFAULT_STREAMS = (0, 1)

# cudaError_t values the provider tells apart
ERROR_MEMORY_ALLOCATION = 2
ERROR_NOT_READY = 600
ERROR_PEER_ACCESS_ALREADY_ENABLED = 704


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

# CUdevice_attribute values
_CC_MAJOR, _CC_MINOR, _MULTIPROCESSORS = 75, 76, 16


# CUDA gives a context 8 hardware work queues unless CUDA_DEVICE_MAX_CONNECTIONS says
# otherwise, and streams beyond 8 share them: work on a shared queue starts in queue order,
# whatever its stream, so concurrent runs (a stream per thread, besides the import stream)
# wait on each other's kernels. H100, ResNet-50 b1 with CUDA graphs, 8 threads, each pair on
# one machine: 3167 and 2385 runs/s with 8 queues against 3925 and 2948 with 32; where 8
# threads lost nothing, the same within noise (docs/providers/cuda.md, session 30). The driver
# reads the variable when it creates a context; a value the user set is kept.
HARDWARE_QUEUES_ENV = "CUDA_DEVICE_MAX_CONNECTIONS"
HARDWARE_QUEUES = "32"  # the driver's maximum


def probe_devices() -> tuple[list[CudaDeviceInfo], str | None]:
    """The visible CUDA devices (CUDA_VISIBLE_DEVICES is honoured by the driver), or
    ([], reason) when there is no usable driver or no CuPy. Through the driver API with ctypes
    (the interpreter lock is released while ``cuInit`` works), beside CuPy's import, which it
    starts and does not wait for: the provider's creation joins it (``CUPY.modules()``), after
    starting the device's context on a helper thread, so that the driver's work there overlaps
    the rest of the import."""
    global _probe
    with _probe_lock:
        if _probe is not None:
            return _probe
        try:
            cuda = _libcuda()
        except OSError as e:
            _probe = ([], f"the CUDA driver cannot be loaded ({e}): no GPU or no driver")
            return _probe
        os.environ.setdefault(HARDWARE_QUEUES_ENV, HARDWARE_QUEUES)  # before any context
        CUPY.start()
        err = cuda.cuInit(0)
        if err:
            _probe = ([], f"cuInit failed: {_driver_error(cuda, err)} (no GPU or no driver)")
            return _probe
        devices, reason = _driver_devices(cuda)
        if reason is None and not devices:
            reason = "no CUDA device is visible"
            if os.environ.get("CUDA_VISIBLE_DEVICES") is not None:
                reason += f" (CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r})"
        if devices and importlib.util.find_spec(CUPY.names[0]) is None:
            devices, reason = [], "CuPy is not installed (pip install cupy-cuda13x)"
        _probe = (devices, reason)
        return _probe


def _driver_devices(cuda: Any) -> tuple[list[CudaDeviceInfo], str | None]:
    count = ctypes.c_int()
    err = cuda.cuDeviceGetCount(ctypes.byref(count))
    if err:
        return [], f"cuDeviceGetCount failed: {_driver_error(cuda, err)}"
    devices = []
    for i in range(count.value):
        device, value, memory = ctypes.c_int(), ctypes.c_int(), ctypes.c_size_t()
        name = ctypes.create_string_buffer(256)
        attrs = []
        err = cuda.cuDeviceGet(ctypes.byref(device), i) or cuda.cuDeviceGetName(name, 256, device)
        for attr in (_CC_MAJOR, _CC_MINOR, _MULTIPROCESSORS):
            err = err or cuda.cuDeviceGetAttribute(ctypes.byref(value), attr, device)
            attrs.append(value.value)
        err = err or cuda.cuDeviceTotalMem_v2(ctypes.byref(memory), device)
        if err:
            return [], f"querying CUDA device {i} failed: {_driver_error(cuda, err)}"
        label = name.value.decode(errors="replace")
        devices.append(CudaDeviceInfo(i, label, attrs[0], attrs[1], memory.value, attrs[2]))
    return devices, None


def _driver_error(cuda: Any, err: int) -> str:
    """A CUresult's name (``CUDA_ERROR_NO_DEVICE``), or its number."""
    name = ctypes.c_char_p()
    if cuda.cuGetErrorName(err, ctypes.byref(name)) == 0 and name.value:
        return name.value.decode()
    return f"CUresult {err}"


def _libcuda() -> Any:
    return ctypes.CDLL("libcuda.so.1")


# CUresult of a driver call made on a thread with no current context
DRIVER_INVALID_CONTEXT = 201


@functools.cache
def graph_launch_holding_gil() -> Callable[[int, int], int]:
    """``cuGraphLaunch(exec, stream)`` (a CUresult back) through ``ctypes.PyDLL``, which keeps
    the interpreter lock across the call, for the launches of one-node graphs (an eager run
    makes one per node: short, non-blocking calls). A launch that released the lock (CuPy's
    ``graphLaunch``, any ``ctypes.CDLL`` call) handed it to another run's thread and then
    waited to take it back, and with 4 or 8 threads running eagerly those hand-overs cost more
    than the threads gained. (A whole run's replay still releases it:
    ``CupyBackend.launch_graph``.)
    Same-host A/B (H100, session 24, eager runs of one session, 2 rounds), BERT-base b1 with 4
    threads 1527 and 1471 runs/s against 1054 and 1174, ResNet-50 b1 1853 and 1889 against
    1621 and 1556; one thread within the noise. PyTorch keeps the lock across its launches. The
    driver call needs this thread's current context: ``DRIVER_INVALID_CONTEXT`` where there
    is none yet."""
    fn = ctypes.PyDLL("libcuda.so.1").cuGraphLaunch
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


def driver_error_name(err: int) -> str:
    """A CUresult's name (``CUDA_ERROR_LAUNCH_FAILED``), or its number."""
    return _driver_error(_libcuda(), err)


_context_threads: dict[int, threading.Thread] = {}


def create_context_in_background(ordinal: int) -> None:
    """Start creating device ``ordinal``'s primary CUDA context on a helper thread (driver
    calls through ctypes: ``cuDevicePrimaryCtxRetain``, about 0.1 s of driver work with the
    GIL released), so that what a session does next on the host (importing CuPy, optimising
    the graph) overlaps it. Only the driver API is called there (cuda.bindings' runtime called
    from a helper thread left process exit crashing now and then, "double free", in 4 of 8
    runs of benchmarks/models.py on an H100, 0 of 10 without that thread). The retain is
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
        rt = cudart()
        try:
            self.prev = rt.getDevice()
            if self.prev != self.ordinal:
                rt.setDevice(self.ordinal)
        except Exception as e:
            raise cuda_error(f"selecting CUDA device {self.ordinal}", e) from e

    def __exit__(self, *exc: Any) -> None:
        if self.prev != self.ordinal and self.prev >= 0:
            cudart().setDevice(self.prev)


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
    if not call("cudaDeviceCanAccessPeer", rt.deviceCanAccessPeer, device, peer):
        return False
    with DeviceGuard(device):
        try:
            rt.deviceEnablePeerAccess(peer)
        except Exception as e:
            # "already enabled" (someone else, PyTorch say, did it) is not an error for us;
            # the runtime call has cleared it
            if cuda_status(e) != ERROR_PEER_ACCESS_ALREADY_ENABLED:
                raise cuda_error(f"cudaDeviceEnablePeerAccess({device} -> {peer})", e) from e
    return True
