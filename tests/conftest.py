"""Shared fixtures: the virtual-device test plugin, registered for one test at a time."""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import onnx
import pytest

# ``tests.plugins.virtual_device`` is imported by its registration target, so the repo root
# must be importable however pytest was started.
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import onnxplug  # noqa: E402
from tests.plugins import virtual_device as vd  # noqa: E402

VIRT = "tests.plugins.virtual_device"


@pytest.fixture(autouse=True, scope="session")
def _private_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The CUDA provider's autotune results go to a folder of the tests' own: tests tuned while
    other test processes share the GPU must not leave their timings in the user's cache, where
    a later benchmark would reuse them. Compiled kernels stay in CuPy's cache (child processes
    would compile every kernel again in a new folder)."""
    saved = {k: os.environ.get(k) for k in ("ONNXPLUG_CACHE_DIR", "CUPY_CACHE_DIR")}
    os.environ["ONNXPLUG_CACHE_DIR"] = str(tmp_path_factory.mktemp("onnxplug-cache"))
    if "CUPY_CACHE_IN_MEMORY" not in os.environ:
        os.environ.setdefault("CUPY_CACHE_DIR", os.path.expanduser("~/.cupy/kernel_cache"))
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def doc_recipe(doc: str, name: str) -> str:
    """The Python block of a documentation page marked ``<!-- recipe: name -->`` ...
    ``<!-- end recipe -->`` (``doc`` relative to the repository root), for tests that run it
    as it stands."""
    text = (Path(_ROOT) / doc).read_text()
    m = re.search(
        rf"<!-- recipe: {re.escape(name)} -->\s*```python\n(.*?)```\s*<!-- end recipe -->",
        text,
        re.S,
    )
    if m is None:
        raise AssertionError(f"recipe '{name}' is missing from {doc}")
    return m.group(1)


def assert_refused_at_load(model: onnx.ModelProto, error: type, pattern: str) -> None:
    """Creating a CPU session of ``model`` raises ``error`` matching ``pattern``; where
    onnxruntime is installed, it refuses the session too."""
    with pytest.raises(error, match=pattern):
        onnxplug.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    try:
        import onnxruntime as ort
    except ImportError:
        return
    with pytest.raises(Exception):  # onnxruntime has its own exception classes
        ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def run_in_threads(work: Callable[[int], None], n: int) -> None:
    """Run ``work(0)`` .. ``work(n - 1)`` on ``n`` threads started together and re-raise the
    first error one of them hit, so that a failed assert in a thread fails the test."""
    errors: list[BaseException] = []
    start = threading.Barrier(n)

    def target(i: int) -> None:
        try:
            start.wait()
            work(i)
        except BaseException as e:  # re-raised by the calling thread
            errors.append(e)

    threads = [threading.Thread(target=target, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


@contextlib.contextmanager
def registered(name: str, target: str) -> Iterator[vd.VirtualDeviceFactory]:
    """Register the plugin ``target`` ("package.module:factory") as ``name`` and yield its
    factory; unregister afterwards."""
    onnxplug.register_execution_provider_library(name, target)
    try:
        yield next(d.factory for d in onnxplug.get_ep_devices() if d.ep_name == name)
    finally:
        onnxplug.unregister_execution_provider_library(name)


@pytest.fixture
def virt() -> Iterator[vd.VirtualDeviceFactory]:
    """The virtual device ``virt:0`` as VirtualDeviceExecutionProvider."""
    with registered(vd.NAME, f"{VIRT}:create_factory") as f:
        yield f


@pytest.fixture
def virt1() -> Iterator[vd.VirtualDeviceFactory]:
    """A second virtual device, ``virt:1``, as VirtualDevice1ExecutionProvider."""
    with registered(vd.SECOND_NAME, f"{VIRT}:create_second_factory") as f:
        yield f


@pytest.fixture
def virt_b() -> Iterator[vd.VirtualDeviceFactory]:
    """A second provider on ``virt:0`` (VirtualDeviceBExecutionProvider)."""
    with registered(vd.SHARED_DEVICE_NAME, f"{VIRT}:create_shared_device_factory") as f:
        yield f


@pytest.fixture(params=[1, 2], ids=["api1", "api2"])
def virt_old_api(request: pytest.FixtureRequest) -> Iterator[vd.VirtualDeviceFactory]:
    """The virtual device of a plugin written against plugin API 1 (``virt:3``,
    VirtualDeviceApi1ExecutionProvider) or 2 (``virt:4``, VirtualDeviceApi2ExecutionProvider):
    no kernel sync stream; shared BFC arena. The factory's ``name`` is the provider's."""
    name, target = {1: (vd.API1_NAME, "api1"), 2: (vd.API2_NAME, "api2")}[request.param]
    with registered(name, f"{VIRT}:create_{target}_factory") as f:
        yield f


@pytest.fixture
def virt_pinned() -> Iterator[vd.VirtualDeviceFactory]:
    """The virtual device ``virt:5`` with pinned host memory, through which sessions stage
    feeds and outputs (VirtualDevicePinnedExecutionProvider)."""
    with registered(vd.PINNED_NAME, f"{VIRT}:create_pinned_factory") as f:
        yield f


@pytest.fixture
def virt_arena() -> Iterator[vd.VirtualDeviceFactory]:
    """The virtual device ``virt:2`` whose sessions share one BFC arena
    (VirtualDeviceArenaExecutionProvider)."""
    with registered(vd.ARENA_NAME, f"{VIRT}:create_arena_factory") as f:
        yield f
