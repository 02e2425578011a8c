"""Array backends the CUDA kernels compute with.

Kernels are written against an array namespace ``xp`` plus a few hooks, so that the same
kernel code runs on the GPU (``CupyBackend``: zero-copy CuPy views of the provider's
memory, CuPy running on the provider's stream and allocating through its allocator) and,
for testing kernel logic on machines without a GPU, on host memory (``sim.NumpyBackend``).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from onnxplug.ep import (
    Allocator,
    Device,
    DeviceTensor,
    EPFail,
    alloc_ptr,
    counters,
    current_scratch,
)

from .runtime import DRIVER_INVALID_CONTEXT, driver_error_name, graph_launch_holding_gil

# numpy dtypes CuPy cannot compute with; kernels move them as same-size integers.
_STORAGE_AS = {"bfloat16": np.dtype(np.uint16)}


class CupyBackend:
    """CuPy on one CUDA device."""

    def __init__(self, ordinal: int, device: Device):
        from .blas import NVMATH
        from .runtime import CUPY

        NVMATH.start()  # cuBLASLt's bindings load beside CuPy and the session's set-up
        try:
            (cupy,) = CUPY.modules()  # imported on a helper thread since the device probe
        except Exception as e:
            raise EPFail(
                f"the CUDA provider computes with CuPy, whose import failed "
                f"({type(e).__name__}: {e})"
            ) from e

        self.xp = cupy
        self.ordinal = ordinal
        self.device = device
        self._tls = threading.local()
        self._cupy_device = cupy.cuda.Device(ordinal)
        self._hooks: dict[int, Any] = {}  # id(allocator) -> CuPy allocator routed to it
        self._owner: dict[int, Any] = {}  # ptr -> what it was taken from (scratch, allocator)
        self._runtime_launch = cupy.cuda.runtime.graphLaunch
        self._launch = graph_launch_holding_gil()
        # cuBLASLt's first heuristic query, beside the rest of the session's creation (after
        # CuPy's import, whose library loading it would contend with)
        NVMATH.warm_up(ordinal)

    can_capture = True

    # views -----------------------------------------------------------------------------------
    def view(self, t: DeviceTensor) -> Any:
        """A CuPy array over a tensor's memory (no copy). bfloat16 is viewed as uint16.

        Tensors of a static memory plan come back every run: their view is built once and
        kept on the tensor (holding the plan's block, not the tensor or the tensor it views:
        no reference cycle)."""
        cache = t.stable_view
        if cache is not None:
            v = cache.get(self)
            if v is None:
                v = cache[self] = self._make_view(t, t.memory)
            return v
        return self._make_view(t, t)

    def _make_view(self, t: DeviceTensor, keep: Any) -> Any:
        counters.bump(counters.VIEWS_BUILT)
        cp = self.xp
        dt = _STORAGE_AS.get(t.dtype.name, t.dtype)
        mem = cp.cuda.UnownedMemory(t.ptr, max(t.nbytes, 1), keep, self.ordinal)
        return cp.ndarray(t.shape, dt, cp.cuda.MemoryPointer(mem, 0))

    def array_at(self, ptr: int, shape: tuple[int, ...], dtype: Any, keep: Any) -> Any:
        """A CuPy array over device memory at ``ptr`` (a workspace slice), keeping ``keep``."""
        cp = self.xp
        dt = _STORAGE_AS.get(np.dtype(dtype).name, np.dtype(dtype))
        n = int(np.prod(shape)) * np.dtype(dt).itemsize
        mem = cp.cuda.UnownedMemory(ptr, max(n, 1), keep, self.ordinal)
        return cp.ndarray(shape, dt, cp.cuda.MemoryPointer(mem, 0))

    def wrap(self, arr: Any, dtype: Any = None) -> DeviceTensor:
        """A DeviceTensor over a CuPy array's memory (made C-contiguous first)."""
        cp = self.xp
        if not arr.flags.c_contiguous:
            arr = cp.ascontiguousarray(arr)
        dt = np.dtype(dtype) if dtype is not None else arr.dtype
        return DeviceTensor(self.device, dt, arr.shape, int(arr.data.ptr), arr)

    # per-run state ---------------------------------------------------------------------------
    def activate(self, stream: Any) -> None:
        """Make ``stream`` CuPy's current stream on this thread (cheap when it already is);
        the first activation of a run also routes CuPy's allocations (``enter_run``)."""
        tls = self._tls
        if getattr(tls, "stream", None) is not stream:
            if getattr(tls, "pending", None) is not None:
                self._route(tls)
            tls.stream = stream
            stream.cupy_stream.use()

    def enter_run(self, allocator: Allocator) -> Any:
        """A run starts on this thread: CuPy's allocations will go to the running frame's
        scratch (or, outside one, to ``allocator``). Nothing is touched until a kernel
        activates a stream (a replayed graph never does); returns a restore token."""
        tls = self._tls
        tls.stream = None
        tls.pending = allocator
        tls.restore = None
        return tls

    def _route(self, tls: Any) -> None:
        allocator = tls.pending
        tls.pending = None
        mem = self.xp.cuda.memory
        tls.restore = (mem._get_thread_local_allocator(), self.xp.cuda.get_current_stream())
        hook = self._hooks.get(id(allocator))
        if hook is None:
            hook = self._hooks[id(allocator)] = self._make_hook(allocator)
        mem._set_thread_local_allocator(hook)

    def _make_hook(self, allocator: Allocator) -> Any:
        device = self.device
        tls = self._tls
        owner = self._owner

        def malloc(size: int, device_id: int) -> int:
            src: Any = current_scratch(device) or allocator
            # OutOfMemory instead of a null pointer, which CuPy would take for memory
            ptr = alloc_ptr(src, size, getattr(tls, "stream", None))
            owner[ptr] = src
            return ptr

        def free(ptr: int, device_id: int) -> None:
            owner.pop(ptr, allocator).free(ptr)

        return self.xp.cuda.PythonFunctionAllocator(malloc, free).malloc

    def launch_graph(self, exe: int, stream: int) -> str | None:
        """Launch a whole run's graph exec (a ``cudaGraphExec_t``, a replay) on a stream
        through the runtime, which releases the interpreter lock for the call; the error text,
        or None. A replay's launch of a large graph takes 10-80 µs and, with many threads
        replaying, can wait for room in the stream's launch queue: keeping the lock there
        (and for a replay's copies) stalled the other threads (8 threads replaying BERT-base
        fell to 2039-2305 runs/s in 3 of 4 runs, session 24)."""
        try:
            self._runtime_launch(exe, stream)
        except Exception as e:  # CuPy's CUDARuntimeError ("cudaError...: ...")
            return str(e)
        return None

    def launch_node_graph(self, exe: int, stream: int) -> str | None:
        """Launch one node's graph exec on a stream keeping the interpreter lock
        (``graph_launch_holding_gil``): an eager run makes one such short launch per node.
        The error text, or None. A thread whose first CUDA call this is has no current
        context for the driver: the runtime's launch makes the device's primary context
        current there."""
        err = self._launch(exe, stream)
        if err == 0:
            return None
        if err != DRIVER_INVALID_CONTEXT:
            return driver_error_name(err)
        return self.launch_graph(exe, stream)

    def exit_run(self, token: Any) -> None:
        tls = self._tls
        tls.pending = None
        restore, tls.restore = getattr(tls, "restore", None), None
        tls.stream = None
        if restore is not None:
            prev_alloc, prev_stream = restore
            self.xp.cuda.memory._set_thread_local_allocator(prev_alloc)
            prev_stream.use()

    def synchronize(self) -> None:
        self._cupy_device.synchronize()
