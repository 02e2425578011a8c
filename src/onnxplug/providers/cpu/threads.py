"""Bounding the threads the CPU kernels use: numpy's BLAS (OpenBLAS, MKL, BLIS) and OpenMP
pools through threadpoolctl, for ``SessionOptions.intra_op_num_threads``.

The libraries' thread counts are process-wide, so the bound holds while at least one bounded
run is in progress (the first such run sets it, the last one to finish restores the libraries'
own counts); concurrent sessions with different bounds share the first one's.
"""

from __future__ import annotations

import threading
from typing import Any


class BlasThreads:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._controller: Any = None
        self._active: Any = None
        self._depth = 0

    def enter(self, threads: int) -> None:
        with self._lock:
            if self._depth == 0:
                if self._controller is None:
                    from threadpoolctl import ThreadpoolController

                    self._controller = ThreadpoolController()  # finds the loaded libraries once
                self._active = self._controller.limit(limits=threads)
            self._depth += 1

    def exit(self) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth == 0 and self._active is not None:
                self._active.restore_original_limits()
                self._active = None

    def current(self) -> list[dict[str, Any]]:
        """The libraries and their thread counts now (threadpoolctl's info)."""
        from threadpoolctl import threadpool_info

        return threadpool_info()


BLAS_THREADS = BlasThreads()
