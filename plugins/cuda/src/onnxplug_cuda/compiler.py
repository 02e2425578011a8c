"""Our CUDA kernels' compiles: each source once per device, and where it can be, in the
background before the run that needs it.

``compiled_function`` is the one cache every kernel family compiles through (NVRTC via CuPy's
``RawModule``, C++17). A compile is single-flight: a thread asking for a kernel another thread
is compiling waits for that compile instead of starting its own.

``precompile`` starts a compile on a few background threads and returns at once. Kernels call
it when the session creates them (``Kernel.warm_up``), for the code their node info says the
first run will need. NVRTC releases the interpreter lock while it compiles, so these compiles
run beside the rest of session creation, and beside each other (an H100 host took 0.1-0.6 s per
kernel; BERT-base's first run compiled eleven of them one after another). A guess that turns
out wrong costs a background compile; a compile that fails in the background is retried by the
run that asks for the kernel, which then reports the error.

A kernel that an earlier process compiled (``onnxplug-compiled.txt`` in CuPy's kernel cache
folder lists them) is not queued: the run loads it from that cache in a few ms, and background
loads slowed a warm process's first run (ResNet-50 b1 on an H100 host: 174-178 ms without them,
274-323 ms with).

Shipped kernels: the kernel families whose sources do not depend on the model (row kernels,
fused attention, pools, gathers, copies, convolution epilogues) list them with ``ship``, and
``python -m onnxplug_cuda.build_kernels`` compiles that catalogue once, when the plugin is
installed, into ``shipped_kernels/sm_<arch>/<digest>.cubin`` beside this module, as
onnxruntime's wheel carries its kernels compiled. A compile whose source is there loads the
cubin instead of running NVRTC (in a machine's first process on an H100 host, the float32
attention kernel's compile took 0.62-0.79 s beside others, and GPT-2's first run waited 0.32 s
for it). ``ONNXPLUG_SHIPPED_KERNELS=0`` ignores them.
"""

from __future__ import annotations

import atexit
import hashlib
import itertools
import math
import os
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

OPTIONS = ("--std=c++17",)
# background compile threads: NVRTC compiles scaled about 2x on 4 threads of an H100 host,
# and no further beyond
PRECOMPILE_THREADS = max(1, min(4, (os.cpu_count() or 1) - 1))
# ONNXPLUG_PRECOMPILE=0: no background compiles (each kernel is compiled by the run that needs it)
ENV_PRECOMPILE = "ONNXPLUG_PRECOMPILE"
# ONNXPLUG_SHIPPED_KERNELS=0: compile every kernel, even one the plugin's install built
ENV_SHIPPED = "ONNXPLUG_SHIPPED_KERNELS"
# the kernels built at install (build_kernels.py), one folder per GPU architecture
SHIPPED_DIR = Path(__file__).resolve().parent / "shipped_kernels"

_lock = threading.Lock()
_functions: dict[tuple, Any] = {}


class _Compiling:
    """A compile queued or under way: threads asking for the kernel wait for it, or compile it
    themselves if no thread has begun it yet (a background queue does not delay a run)."""

    __slots__ = ("done", "error", "function", "started")

    def __init__(self, started: bool) -> None:
        self.started = started
        self.done = threading.Event()
        self.function: Any = None
        self.error: BaseException | None = None


def _cache_and_key(
    functions: dict[tuple, Any] | None, key: tuple | None, name: str, device: Callable[[], int]
) -> tuple[dict[tuple, Any], tuple]:
    """The cache a kernel belongs in and its key there: a family's own, or this module's keyed
    by (name, device)."""
    return (_functions if functions is None else functions), (
        (name, device()) if key is None else key
    )


def compiled_function(
    xp: Any,
    name: str,
    source: Callable[[], str],
    functions: dict[tuple, Any] | None = None,
    key: tuple | None = None,
) -> Any:
    """Kernel ``name`` of the module ``source()`` writes, compiled once per device: a function
    belongs to the device current when its module was loaded (the run's). A kernel family whose
    sources share names keeps its own ``functions``, with ``key`` (ending with the device)
    naming the source; by default the cache is this module's, keyed by (name, device)."""
    cache, key = _cache_and_key(functions, key, name, xp.cuda.runtime.getDevice)
    fn = cache.get(key)
    if fn is not None and type(fn) is not _Compiling:
        return fn
    while True:
        with _lock:
            entry = cache.get(key)
            if entry is not None and type(entry) is not _Compiling:
                return entry
            if entry is None:
                entry = cache[key] = _Compiling(started=True)
                mine = True
            else:
                mine = not entry.started  # a queued guess no thread has begun: compile it here
                entry.started = True
        if mine:
            return _compile(xp, name, source, cache, key, entry)
        entry.done.wait()
        if entry.error is None:
            return entry.function
        # that compile failed (a background guess, perhaps): compile here, and report its error


def _compile(
    xp: Any, name: str, source: Callable[[], str], cache: dict, key: tuple, entry: _Compiling
) -> Any:
    try:
        text = source()
        digest = _digest(text)
        fn = _load_shipped(xp, name, digest)
        if fn is None:
            fn = xp.RawModule(code=text, options=OPTIONS).get_function(name)
            _remember(digest)
    except BaseException as e:
        with _lock:
            if cache.get(key) is entry:
                del cache[key]
        entry.error = e
        entry.done.set()
        raise
    with _lock:
        cache[key] = fn
    entry.function = fn
    entry.done.set()
    return fn


# -- shipped kernels ---------------------------------------------------------------------------

_Kernels = Callable[[], Iterable[tuple[str, Callable[[], str]]]]
_catalogue: list[_Kernels] = []
_shipped: dict[str, frozenset[str]] = {}  # "sm_90" -> digests of the cubins in its folder
_archs: dict[int, str] = {}  # device -> "sm_90"
stats = {"shipped_loads": 0}


def ship(kernels: _Kernels) -> None:
    """Add a kernel family's model-independent kernels to the catalogue the plugin's install
    compiles: ``kernels()`` yields the (name, source) pairs ``compiled_function`` is given."""
    _catalogue.append(kernels)


def shipped_sources() -> Iterator[tuple[str, str, str]]:
    """(digest, kernel name, source) of every kernel in the catalogue, each source once."""
    seen: set[str] = set()
    for kernels in _catalogue:
        for name, source in kernels():
            text = source()
            digest = _digest(text)
            if digest not in seen:
                seen.add(digest)
                yield digest, name, text


def shipped_path(digest: str, arch: str) -> Path:
    return SHIPPED_DIR / arch / f"{digest}.cubin"


def _shipped_here(xp: Any, device: int, digest: str) -> bool:
    """Whether the install built the source of ``digest`` for ``device``'s architecture."""
    if os.environ.get(ENV_SHIPPED, "1").strip() == "0" or not SHIPPED_DIR.is_dir():
        return False
    arch = _archs.get(device)
    if arch is None:
        arch = _archs[device] = "sm_" + str(xp.cuda.Device(device).compute_capability)
    digests = _shipped.get(arch)
    if digests is None:
        try:
            names = os.listdir(SHIPPED_DIR / arch)
        except OSError:
            names = []
        digests = _shipped[arch] = frozenset(n[:-6] for n in names if n.endswith(".cubin"))
    return digest in digests


def _load_shipped(xp: Any, name: str, digest: str) -> Any:
    """Kernel ``name`` of the source of ``digest`` from the cubin the install built, on the current device (a
    ``RawModule`` of the file: the same kind of function as a compile gives); None where there
    is none, or it does not load (a driver older than the compiler that built it): then NVRTC
    compiles it."""
    device = xp.cuda.runtime.getDevice()
    if not _shipped_here(xp, device, digest):
        return None
    try:
        fn = xp.RawModule(path=str(shipped_path(digest, _archs[device]))).get_function(name)
        fn.kernel  # noqa: B018  (loads the module now: a refused cubin falls back here)
    except Exception:
        return None
    stats["shipped_loads"] += 1
    return fn


# -- the index of compiled sources ------------------------------------------------------------

_INDEX = "onnxplug-compiled.txt"
_compiled_before: set[str] | None = None  # digests of the sources in the index


def _digest(text: str) -> str:
    return hashlib.sha1("\0".join((text, *OPTIONS)).encode()).hexdigest()


def _index_path() -> str | None:
    """The index of compiled sources, in CuPy's kernel cache folder (its documented default
    and variable); None where CuPy keeps kernels in memory only."""
    if os.environ.get("CUPY_CACHE_IN_MEMORY", "0").strip() not in ("", "0"):
        return None
    folder = os.environ.get("CUPY_CACHE_DIR") or os.path.expanduser("~/.cupy/kernel_cache")
    return os.path.join(folder, _INDEX)


def _known() -> set[str]:
    global _compiled_before
    if _compiled_before is None:
        found: set[str] = set()
        path = _index_path()
        if path is not None:
            try:
                with open(path) as fh:
                    found = {line.strip() for line in fh if line.strip()}
            except OSError:
                pass
        _compiled_before = found
    return _compiled_before


def _remember(digest: str) -> None:
    """Add a compiled source's digest to the index (one line, appended: processes may share
    it)."""
    known = _known()
    if digest in known:
        return
    known.add(digest)
    path = _index_path()
    if path is None:
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (digest + "\n").encode())
        finally:
            os.close(fd)
    except OSError:
        pass  # an unwritable cache: later processes compile in the background again


_queue: queue.PriorityQueue | None = None
_order = itertools.count()  # ties in the queue: first queued, first compiled
_workers: list[threading.Thread] = []
_closing = False


def precompile(
    xp: Any,
    device: int,
    name: str,
    source: Callable[[], str],
    functions: dict[tuple, Any] | None = None,
    key: tuple | None = None,
) -> None:
    """Queue the compile that ``compiled_function(xp, name, source, functions, key)`` will ask
    for on ``device`` (``key`` ending with it) for a background thread; return at once."""
    global _queue
    if os.environ.get(ENV_PRECOMPILE, "1").strip() == "0":
        return
    cache, key = _cache_and_key(functions, key, name, lambda: device)
    if key in cache:
        return  # compiled, queued or under way
    text = source()
    digest = _digest(text)
    if digest in _known() or _shipped_here(xp, device, digest):
        return  # in the kernel cache, or built at install: the run loads it
    with _lock:
        if _closing or key in cache:
            return  # exiting; or compiled, queued or under way
        entry = cache[key] = _Compiling(started=False)
        if _queue is None:
            _queue = queue.PriorityQueue()
            for i in range(PRECOMPILE_THREADS):
                t = threading.Thread(
                    target=_worker, args=(_queue,), name=f"onnxplug-precompile-{i}", daemon=True
                )
                t.start()
                _workers.append(t)
            atexit.register(_stop)
        jobs = _queue
    # longest source first: the long compiles (fused attention: 0.6-0.8 s on an H100 host)
    # start at once instead of behind short ones queued before them; the worker compiles the
    # text written here (not written again)
    job = (xp, device, name, lambda: text, cache, key, entry)
    jobs.put((-len(text), next(_order), job))


def _worker(jobs: queue.PriorityQueue) -> None:
    while True:
        job = jobs.get()[2]
        if job is None:
            return
        xp, device, name, source, cache, key, entry = job
        with _lock:
            if entry.started or _closing:
                continue  # a run took it over; or the process exits
            entry.started = True
        try:
            with xp.cuda.Device(device):
                _compile(xp, name, source, cache, key, entry)
        except BaseException:
            pass  # the run that needs the kernel compiles it again, and reports the error


def _stop() -> None:
    """At exit: skip the queued compiles and wait for those under way. A compile left running
    in a daemon thread while the process tears its libraries down corrupted the heap (an H100
    host: ``malloc_consolidate(): unaligned fastbin chunk detected``, exit -6)."""
    global _closing
    with _lock:
        _closing = True
        jobs, workers = _queue, list(_workers)
    if jobs is None:
        return
    for _ in workers:
        jobs.put((-math.inf, next(_order), None))
    for t in workers:
        t.join(timeout=60)
