"""The host-simulated CUDA provider with two devices (``cudasim:0`` and ``cudasim:1``), for
testing per-device isolation of the shared arenas. Needs plugins/cuda/src on ``sys.path``."""

from __future__ import annotations

from onnxplug_cuda.runtime import CudaDeviceInfo
from onnxplug_cuda.sim import CudaSimEpFactory


class TwoDeviceSimFactory(CudaSimEpFactory):
    def probe(self) -> tuple[list[CudaDeviceInfo], str | None]:
        return [
            CudaDeviceInfo(i, f"host-simulated CUDA device {i}", 9, 0, 1 << 34, 1) for i in (0, 1)
        ], None


def create_factory() -> TwoDeviceSimFactory:
    return TwoDeviceSimFactory()
