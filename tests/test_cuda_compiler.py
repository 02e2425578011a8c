"""The CUDA provider's kernel compiles (``onnxplug_cuda.compiler``), checked without a GPU on a
stand-in for CuPy: each source compiled once per key even when threads ask together, the
background compiles that ``warm_up`` queues found by the run that needs them, a queued one
taken over by that run, and a background failure compiled again and reported by the run."""

from __future__ import annotations

import queue
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

PLUGIN_SRC = Path(__file__).resolve().parents[1] / "plugins" / "cuda" / "src"
if str(PLUGIN_SRC) not in sys.path:
    sys.path.insert(0, str(PLUGIN_SRC))

from onnxplug_cuda import compiler as C  # noqa: E402


class _Device:
    current = threading.local()

    def __init__(self, ordinal: int):
        self.ordinal = ordinal
        self.compute_capability = "90" if ordinal == 0 else "80"

    def __enter__(self) -> _Device:
        self.prev = getattr(_Device.current, "ordinal", 0)
        _Device.current.ordinal = self.ordinal
        return self

    def __exit__(self, *exc: object) -> None:
        _Device.current.ordinal = self.prev


class _Shipped:
    """A function of a shipped cubin, as CuPy's ``RawKernel``: its module loads on ``kernel``."""

    def __init__(self, name: str, image: bytes):
        self.name, self.image = name, image

    @property
    def kernel(self) -> bytes:
        if _Xp.RawModule.bad:
            raise RuntimeError("CUDA_ERROR_UNSUPPORTED_PTX_VERSION")
        return self.image

    def __eq__(self, other: object) -> bool:
        return other == (self.name, self.image)


class _Xp:
    """What the compiler uses of CuPy: RawModule, the current device, Device()."""

    compiles: list[tuple[str, str, int]] = []  # (kernel, thread, device)
    delay = 0.0
    fail: set[str] = set()
    lock = threading.Lock()

    class cuda:
        Device = _Device

        class runtime:
            @staticmethod
            def getDevice() -> int:
                return getattr(_Device.current, "ordinal", 0)

    class RawModule:
        bad = False  # a cubin the driver refuses

        def __init__(self, code: str | None = None, options: tuple = (), path: str | None = None):
            self.code, self.path = code, path

        def get_function(self, name: str) -> Any:
            if self.path is not None:  # a shipped cubin
                return _Shipped(name, Path(self.path).read_bytes())
            time.sleep(_Xp.delay)
            device = getattr(_Device.current, "ordinal", 0)
            with _Xp.lock:
                _Xp.compiles.append((name, threading.current_thread().name, device))
            if name in _Xp.fail:
                raise RuntimeError(f"nvrtc: error compiling {name}")
            return (name, device)


@pytest.fixture
def xp(monkeypatch, tmp_path):
    monkeypatch.setattr(C, "_functions", {})
    # no shipped kernels unless a test builds some
    monkeypatch.setattr(C, "SHIPPED_DIR", tmp_path / "no-shipped-kernels")
    monkeypatch.setattr(C, "_shipped", {})
    monkeypatch.setattr(C, "_archs", {})
    monkeypatch.delenv(C.ENV_SHIPPED, raising=False)
    _Xp.RawModule.bad = False
    monkeypatch.setenv("CUPY_CACHE_IN_MEMORY", "1")  # no index of compiled sources on disk
    monkeypatch.setattr(C, "_compiled_before", None)
    _Xp.compiles.clear()
    _Xp.delay = 0.0
    _Xp.fail = set()
    return _Xp


def _src(name: str):
    return lambda: f'extern "C" __global__ void {name}() {{}}'


def test_a_kernel_compiles_once_per_device(xp):
    a = C.compiled_function(xp, "k", _src("k"))
    assert C.compiled_function(xp, "k", _src("k")) is a
    with _Device(1):
        b = C.compiled_function(xp, "k", _src("k"))
    assert a == ("k", 0) and b == ("k", 1)
    assert [c[0] for c in xp.compiles] == ["k", "k"]


def test_threads_asking_together_wait_for_one_compile(xp):
    xp.delay = 0.05
    results: list[object] = []
    start = threading.Barrier(6)

    def ask() -> None:
        start.wait()
        results.append(C.compiled_function(xp, "shared", _src("shared")))

    threads = [threading.Thread(target=ask) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(xp.compiles) == 1
    assert len(results) == 6 and all(r is results[0] for r in results)


def test_a_background_compile_is_what_the_run_finds(xp):
    xp.delay = 0.02
    cache: dict = {}
    C.precompile(xp, 1, "bg", _src("bg"), cache, ("bg", "v2", 1))
    C.precompile(xp, 1, "bg", _src("bg"), cache, ("bg", "v2", 1))  # queued once
    with _Device(1):
        fn = C.compiled_function(xp, "bg", _src("bg"), cache, ("bg", "v2", 1))
    assert fn == ("bg", 1)  # loaded on the device it was queued for
    assert len(xp.compiles) == 1
    name, thread, device = xp.compiles[0]
    assert device == 1
    # the run waited for the compile, or found it queued and compiled it itself
    assert thread.startswith("onnxplug-precompile-") or thread == threading.current_thread().name


def test_a_queued_compile_no_thread_began_is_compiled_by_the_run(xp, monkeypatch):
    monkeypatch.setattr(C, "_queue", queue.PriorityQueue())  # a queue no thread serves
    C.precompile(xp, 0, "queued", _src("queued"))
    assert C.compiled_function(xp, "queued", _src("queued")) == ("queued", 0)
    assert xp.compiles == [("queued", threading.current_thread().name, 0)]


def test_a_background_failure_is_compiled_again_and_reported_by_the_run(xp):
    xp.fail = {"bad"}
    C.precompile(xp, 0, "bad", _src("bad"))
    deadline = time.monotonic() + 5
    while not xp.compiles and time.monotonic() < deadline:
        time.sleep(0.005)
    with pytest.raises(RuntimeError, match="error compiling bad"):
        C.compiled_function(xp, "bad", _src("bad"))
    assert [c[0] for c in xp.compiles] == ["bad", "bad"]
    assert ("bad", 0) not in C._functions  # nothing cached: a later call tries again
    xp.fail = set()
    assert C.compiled_function(xp, "bad", _src("bad")) == ("bad", 0)


def test_a_failed_compile_reaches_every_waiting_thread(xp):
    xp.delay = 0.05
    xp.fail = {"broken"}
    errors: list[BaseException] = []
    start = threading.Barrier(3)

    def ask() -> None:
        start.wait()
        try:
            C.compiled_function(xp, "broken", _src("broken"))
        except RuntimeError as e:
            errors.append(e)

    threads = [threading.Thread(target=ask) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(errors) == 3


def test_at_exit_queued_compiles_are_skipped_and_those_under_way_finish(xp, monkeypatch):
    monkeypatch.setattr(C, "_queue", None)
    monkeypatch.setattr(C, "_workers", [])
    monkeypatch.setattr(C, "_closing", False)
    monkeypatch.setattr(C.atexit, "register", lambda fn: fn)
    xp.delay = 0.1
    for i in range(12):
        C.precompile(xp, 0, f"k{i}", _src(f"k{i}"))
    time.sleep(0.03)  # the first ones have begun
    C._stop()
    assert C._workers and not any(t.is_alive() for t in C._workers)
    n = len(xp.compiles)
    assert 1 <= n <= C.PRECOMPILE_THREADS  # those under way finished; the rest never began
    C.precompile(xp, 0, "late", _src("late"))  # exiting: nothing more is queued
    assert ("late", 0) not in C._functions
    # a run at exit still gets its kernel (it compiles a queued one itself)
    assert C.compiled_function(xp, "k11", _src("k11")) == ("k11", 0)


def test_background_compiles_can_be_turned_off(xp, monkeypatch):
    monkeypatch.setenv(C.ENV_PRECOMPILE, "0")
    C.precompile(xp, 0, "off", _src("off"))
    assert ("off", 0) not in C._functions


def test_a_kernel_an_earlier_process_compiled_is_not_queued(xp, monkeypatch, tmp_path):
    """The index beside CuPy's kernel cache: what a process compiled, a later one loads from
    that cache in its run instead of loading it in the background."""

    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("CUPY_CACHE_IN_MEMORY", raising=False)
    monkeypatch.setattr(C, "_compiled_before", None)
    C.compiled_function(xp, "seen", _src("seen"))
    assert (tmp_path / C._INDEX).read_text().split() == [C._digest(_src("seen")())]
    # a later process: empty caches, the index read again
    monkeypatch.setattr(C, "_functions", {})
    monkeypatch.setattr(C, "_compiled_before", None)
    monkeypatch.setattr(C, "_queue", queue.PriorityQueue())  # nothing would serve it
    C.precompile(xp, 0, "seen", _src("seen"))
    C.precompile(xp, 0, "new", _src("new"))
    assert ("seen", 0) not in C._functions  # left to the run
    assert type(C._functions[("new", 0)]) is C._Compiling  # queued
    monkeypatch.setenv("CUPY_CACHE_IN_MEMORY", "1")  # kernels kept in memory: no index
    monkeypatch.setattr(C, "_compiled_before", None)
    C.precompile(xp, 0, "seen", _src("seen"))
    assert ("seen", 0) in C._functions


def test_the_longest_source_is_compiled_first(xp, monkeypatch):
    """The background threads take the longest queued source first (fused attention's
    compile, the longest of a model's, starts at once), equal lengths in the order queued."""
    jobs: queue.PriorityQueue = queue.PriorityQueue()
    monkeypatch.setattr(C, "_queue", jobs)  # a queue no thread serves: read it here
    sources = {"short": "k", "long": "k" * 400, "mid1": "k" * 40, "mid2": "k" * 40}
    for name, text in sources.items():
        C.precompile(xp, 0, name, lambda t=text: t)
    order = [jobs.get()[2][2] for _ in sources]
    assert order == ["long", "mid1", "mid2", "short"]


def _ship(monkeypatch, tmp_path, arch: str, *names: str) -> None:
    """Kernels ``names`` (``_src``'s sources) built at install for ``arch``."""
    folder = tmp_path / "shipped"
    monkeypatch.setattr(C, "SHIPPED_DIR", folder)
    (folder / arch).mkdir(parents=True)
    for name in names:
        C.shipped_path(C._digest(_src(name)()), arch).write_bytes(f"cubin of {name}".encode())


def test_a_shipped_kernel_is_loaded_not_compiled(xp, monkeypatch, tmp_path):
    """The cubin the install built for the device's architecture is loaded in place of an
    NVRTC compile; another architecture, another source, a cubin the driver refuses, or
    ``ONNXPLUG_SHIPPED_KERNELS=0`` compile as before."""
    _ship(monkeypatch, tmp_path, "sm_90", "built", "refused")
    loads = C.stats["shipped_loads"]
    assert C.compiled_function(xp, "built", _src("built")) == _Shipped("built", b"cubin of built")
    assert C.stats["shipped_loads"] == loads + 1 and xp.compiles == []
    with _Device(1):  # an sm_80 device: nothing built for it
        assert C.compiled_function(xp, "built", _src("built")) == ("built", 1)
    assert C.compiled_function(xp, "other", _src("other")) == ("other", 0)
    xp.RawModule.bad = True
    assert C.compiled_function(xp, "refused", _src("refused")) == ("refused", 0)
    xp.RawModule.bad = False
    monkeypatch.setenv(C.ENV_SHIPPED, "0")
    C._functions.clear()
    assert C.compiled_function(xp, "built", _src("built")) == ("built", 0)
    assert [c[0] for c in xp.compiles] == ["built", "other", "refused", "built"]
    assert C.stats["shipped_loads"] == loads + 1


def test_a_shipped_kernel_is_not_queued(xp, monkeypatch, tmp_path):
    """A kernel the install built is left to the run (loading it takes no compile), on the
    architecture it was built for only."""
    _ship(monkeypatch, tmp_path, "sm_90", "built")
    monkeypatch.setattr(C, "_queue", queue.PriorityQueue())  # nothing would serve it
    C.precompile(xp, 0, "built", _src("built"))
    C.precompile(xp, 1, "built", _src("built"))
    assert ("built", 0) not in C._functions
    assert type(C._functions[("built", 1)]) is C._Compiling
