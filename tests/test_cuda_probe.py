"""The CUDA provider's device probe (``onnxplug_cuda.runtime.probe_devices``) against a stand-in
driver library: it asks the driver API through ctypes (no cuda.bindings import), starts CuPy's
import beside ``cuInit`` without waiting for it, and says why there is no device (no driver, a
failed ``cuInit``, none visible, CuPy missing) in words a user can act on. The real driver is
exercised by every GPU test."""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import types
from pathlib import Path
from typing import Any

import pytest

PLUGIN_SRC = Path(__file__).resolve().parents[1] / "plugins" / "cuda" / "src"
if str(PLUGIN_SRC) not in sys.path:  # CI installs the core only
    sys.path.insert(0, str(PLUGIN_SRC))

from onnxplug_cuda import runtime  # noqa: E402

NO_DEVICE = 100  # CUDA_ERROR_NO_DEVICE


def _out(arg: Any) -> Any:
    """The ctypes object behind ``ctypes.byref(x)``."""
    return arg._obj


class FakeDriver:
    """libcuda.so.1: ``devices`` is a list of (name, major, minor, SMs, bytes)."""

    def __init__(self, devices: list[tuple[str, int, int, int, int]], init_error: int = 0):
        self.devices = devices
        self.init_error = init_error
        self.init_threads: list[str] = []
        self.queues_at_init: list[str | None] = []  # CUDA_DEVICE_MAX_CONNECTIONS then

    def cuInit(self, flags: int) -> int:
        self.init_threads.append(threading.current_thread().name)
        self.queues_at_init.append(os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"))
        return self.init_error

    def cuGetErrorName(self, err: int, name: Any) -> int:
        _out(name).value = b"CUDA_ERROR_NO_DEVICE" if err == NO_DEVICE else None
        return 0 if err == NO_DEVICE else 1

    def cuDeviceGetCount(self, count: Any) -> int:
        _out(count).value = len(self.devices)
        return 0

    def cuDeviceGet(self, device: Any, ordinal: int) -> int:
        _out(device).value = ordinal
        return 0

    def cuDeviceGetName(self, buf: Any, size: int, device: ctypes.c_int) -> int:
        buf.value = self.devices[device.value][0].encode()
        return 0

    def cuDeviceGetAttribute(self, value: Any, attr: int, device: ctypes.c_int) -> int:
        _, major, minor, sms, _ = self.devices[device.value]
        _out(value).value = {75: major, 76: minor, 16: sms}[attr]
        return 0

    def cuDeviceTotalMem_v2(self, size: Any, device: ctypes.c_int) -> int:
        _out(size).value = self.devices[device.value][4]
        return 0


@pytest.fixture
def probe(monkeypatch: pytest.MonkeyPatch):
    """``probe(driver, cupy_module)``: a fresh probe with that driver (an exception: the
    library does not load) and CuPy standing for the module named."""

    def run(driver: Any, cupy_module: str = "json") -> tuple[list, str | None]:
        def load() -> Any:
            if isinstance(driver, Exception):
                raise driver
            return driver

        monkeypatch.setattr(runtime, "_libcuda", load)
        monkeypatch.setattr(runtime, "_probe", None)
        monkeypatch.setattr(runtime, "CUPY", runtime.BackgroundImport(cupy_module))
        return runtime.probe_devices()

    return run


def test_devices_come_from_the_driver_api(probe):
    h100 = ("NVIDIA H100 80GB HBM3", 9, 0, 132, 85 << 30)
    driver = FakeDriver([h100, ("NVIDIA A100-SXM4-40GB", 8, 0, 108, 40 << 30)])
    devices, reason = probe(driver)
    assert reason is None
    assert devices == [
        runtime.CudaDeviceInfo(0, "NVIDIA H100 80GB HBM3", 9, 0, 85 << 30, 132),
        runtime.CudaDeviceInfo(1, "NVIDIA A100-SXM4-40GB", 8, 0, 40 << 30, 108),
    ]
    assert driver.init_threads == [threading.current_thread().name]
    assert runtime.CUPY.modules() == (sys.modules["json"],)  # started beside cuInit
    assert runtime.probe_devices() is runtime.probe_devices()  # once per process


def test_contexts_get_32_hardware_queues_unless_the_user_says(probe, monkeypatch):
    """8 queues (CUDA's default) let concurrent runs' streams share one and wait on each other's
    kernels; the variable is set before the driver starts, and a value of the user's is kept."""
    h100 = ("NVIDIA H100 80GB HBM3", 9, 0, 132, 85 << 30)
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    driver = FakeDriver([h100])
    probe(driver)
    assert driver.queues_at_init == ["32"]
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    driver = FakeDriver([h100])
    probe(driver)
    assert driver.queues_at_init == ["1"] and os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"


def test_no_driver_library(probe):
    devices, reason = probe(OSError("libcuda.so.1: cannot open shared object file"))
    assert devices == []
    assert "the CUDA driver cannot be loaded" in reason and "libcuda.so.1" in reason
    assert runtime.CUPY._thread is None  # CuPy's import is not started for nothing


def test_a_failed_cuinit_is_named(probe):
    devices, reason = probe(FakeDriver([], init_error=NO_DEVICE))
    assert devices == [] and reason == "cuInit failed: CUDA_ERROR_NO_DEVICE (no GPU or no driver)"


def test_no_visible_device_names_cuda_visible_devices(probe, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    devices, reason = probe(FakeDriver([]))
    assert devices == [] and reason == "no CUDA device is visible (CUDA_VISIBLE_DEVICES='')"


def test_cupy_missing_is_the_reason(probe):
    h100 = ("NVIDIA H100 80GB HBM3", 9, 0, 132, 85 << 30)
    devices, reason = probe(FakeDriver([h100]), cupy_module="no_such_module_onnxplug_cupy")
    assert devices == [] and reason == "CuPy is not installed (pip install cupy-cuda13x)"


def test_the_probe_does_not_wait_for_cupy(probe, tmp_path, monkeypatch):
    """CuPy's import goes on after the probe (the provider's creation joins it, having started
    the device's context beside it); an import that fails is the provider's error there."""
    gate = types.ModuleType("probe_gate_for_test")
    gate.RELEASE = threading.Event()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "probe_gate_for_test", gate)
    (tmp_path / "slow_cupy_for_probe.py").write_text(
        "from probe_gate_for_test import RELEASE\nRELEASE.wait(10)\n"
        "raise ImportError('libcublas.so.13: cannot open shared object file')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    h100 = ("NVIDIA H100 80GB HBM3", 9, 0, 132, 85 << 30)
    devices, reason = probe(FakeDriver([h100]), cupy_module="slow_cupy_for_probe")
    assert reason is None and len(devices) == 1
    assert runtime.CUPY._thread.is_alive()  # still importing
    gate.RELEASE.set()
    from onnxplug.ep import Device, EPFail
    from onnxplug_cuda.backend import CupyBackend

    with pytest.raises(EPFail, match="computes with CuPy, whose import failed.*libcublas"):
        CupyBackend(0, Device("cuda", 0))
