"""The CUDA provider's per-session EP: options, capability, streams, runs."""

from __future__ import annotations

import threading
import warnings
from typing import Any

import numpy as np

from onnxplug.ep import (
    NHWC_OPS,
    Allocator,
    Device,
    Ep,
    EpDevice,
    EPFail,
    GraphView,
    InvalidArgument,
    KernelRegistry,
    MemoryInfo,
    SessionConfig,
    supports,
)

from .options import CudaOptions, parse_options

NAME = "CUDAExecutionProvider"

# Ops left to the CPU provider when they only compute shapes: their inputs are small host
# tensors and their consumers read them on the host (Reshape's shape, Expand's shape, ...).
SHAPE_OPS = frozenset({"Shape", "Size"})
_SHAPE_MATH_OPS = frozenset(
    {
        "Gather",
        "Concat",
        "Unsqueeze",
        "Squeeze",
        "Slice",
        "Cast",
        "Add",
        "Sub",
        "Mul",
        "Div",
        "Equal",
        "Where",
        "Range",
        "ConstantOfShape",
        "Reshape",
        "ReduceProd",
        "Max",
        "Min",
        "Identity",
        "Neg",
        "Mod",
        "Floor",
        "Ceil",
        "Sqrt",
        "Expand",
        "Not",
        "Less",
        "Greater",
        "Abs",
        "ScatterND",
        "Tile",
    }
)
_INT_TYPES = (np.dtype(np.int64), np.dtype(np.int32))


class CudaEp(Ep):
    name = NAME

    def __init__(
        self, factory: Any, ep_device: EpDevice, config: SessionConfig, options: CudaOptions
    ):
        super().__init__(factory, ep_device, config)
        self.name = factory.name
        self.options = options
        self.ordinal = int(ep_device.ep_metadata.get("cuda_device_id", options.device_id))
        self.device: Device = ep_device.memory_info.device
        self.backend = factory.backend_for(self.ordinal)
        self._unified: Any = None
        self._lock = threading.RLock()  # create_sync_stream -> factory -> get_allocator
        self._streams: list[Any] = []
        self._external: Allocator | None = None
        self._shared: Allocator | None = None
        self._run_tokens = threading.local()  # per thread: the run's device guard and token
        self._graphs: dict[int, tuple[Any, Any]] = {}  # graph id -> (graph exec, stream)
        self._tuning: Any = None  # its CudaTuningContext, made when asked for
        for w in options.warnings:
            warnings.warn(f"{self.name}: {w}", stacklevel=2)

    # partitioning -------------------------------------------------------------------------------
    def get_kernel_registry(self) -> KernelRegistry:
        return self.factory.kernel_registry(self.options)

    def get_capability(self, graph: GraphView) -> list[Any]:
        reg = self.get_kernel_registry()
        claimed = []
        for n in graph.nodes:
            hit = reg.lookup(
                n.op_type, n.domain, n.since_version, graph.input_dtypes(n), graph.output_dtypes(n)
            )
            # a kernel class may decline a node its types match but its attributes do not
            # (a Resize mode it does not implement, Dropout in training mode)
            if hit is None:
                continue
            claims = getattr(hit[1], "claims", None)
            if claims is None or claims(n, graph):
                claimed.append(n)
        cpu_preferred = self._cpu_preferred(graph)
        return [n for n in claimed if id(n) not in cpu_preferred]

    def get_preferred_data_layout(self) -> str:
        return "NHWC" if self.options.prefer_nhwc else "NCHW"

    def should_convert_data_layout_for_op(
        self, domain: str, op_type: str, target_layout: str
    ) -> int:
        """With ``prefer_nhwc``: 1 for the ops with an NHWC form (``NHWC_OPS``), 0 for the
        others; -1 (the host decides) for any other target layout, as onnxruntime's."""
        if target_layout != "NHWC" or not self.options.prefer_nhwc:
            return -1
        return 1 if (domain, op_type) in NHWC_OPS else 0

    def _cpu_preferred(self, graph: GraphView) -> set[int]:
        """Shape computations stay on the host: Shape/Size, and integer ops whose inputs are
        all shapes or constants (no device round trip for Reshape's shape and the like)."""
        host_values: set[str] = set(graph.graph.initializers)
        preferred: set[int] = set()
        for n in graph.nodes:
            if n.domain != "":
                continue
            if n.op_type in SHAPE_OPS:
                preferred.add(id(n))
                host_values.update(o for o in n.outputs if o)
                continue
            if n.op_type not in _SHAPE_MATH_OPS:
                continue
            ins = [i for i in n.inputs if i]
            if not ins or not all(i in host_values for i in ins):
                continue
            if all(i in graph.graph.initializers for i in ins):
                continue  # constant folding's job, or a real computation on constants
            outs = graph.output_dtypes(n)
            if all(dt in _INT_TYPES or dt == np.dtype(np.bool_) for dt in outs if dt is not None):
                preferred.add(id(n))
                host_values.update(o for o in n.outputs if o)
        return preferred

    # memory and streams -------------------------------------------------------------------------
    def get_allocator(self, mem_info: MemoryInfo) -> Allocator | None:
        """The session's own allocator when it has one: the user's external allocator
        (``gpu_external_alloc/free``), for device memory, scoped to this session only. Other
        sessions on the device keep the shared arena."""
        o = self.options
        if mem_info.device != self.device or not o.uses_external_allocator:
            return None
        with self._lock:
            if self._external is None:
                from .memory import ExternalDeviceAllocator

                self._external = ExternalDeviceAllocator(
                    mem_info, o.gpu_external_alloc, o.gpu_external_free, o.gpu_external_empty_cache
                )
            return self._external

    def allocator_options(self, mem_info: MemoryInfo) -> dict[str, str]:
        """The session's device-arena options (``arena.*``, ``gpu_mem_limit``,
        ``arena_extend_strategy``); the pinned arena keeps its defaults."""
        return self.options.arena_options if mem_info.name == "Cuda" else {}

    def run_allocator(self) -> Allocator:
        """The allocator of this provider's runs (CuPy temporaries, stream bookkeeping): the
        external allocator, or a reference to the device's shared allocator held until
        ``release``."""
        alloc = self._external or self._shared
        if alloc is not None:
            return alloc
        mi = self.ep_device.memory_info
        alloc = self.get_allocator(mi)
        if alloc is not None:
            return alloc
        with self._lock:
            if self._shared is None:
                self._shared = self.factory.create_allocator(mi, None)
            return self._shared

    def create_sync_stream(self) -> Any:
        with self.device_guard():
            return self._create_sync_stream()

    def _create_sync_stream(self) -> Any:
        o = self.options
        if o.unified_stream:
            with self._lock:
                if self._unified is None:
                    user = o.user_compute_stream if o.has_user_compute_stream else None
                    external = self.get_allocator(self.ep_device.memory_info)
                    if user is None and external is not None:
                        user = 0  # onnxruntime: external allocator runs on the default stream
                    # shared by every frame: the frames never close it, the EP does
                    self._unified = self.factory.create_stream(self, user, shared=True)
                    if external is not None:
                        # its blocks' uses ordered with the user's stream, which it joins
                        external.stream = self._unified
                return self._unified
        s = self.factory.create_stream(self, None)
        with self._lock:
            self._streams.append(s)
        return s

    def is_concurrent_run_supported(self) -> bool:
        """Runs may overlap on streams of their own unless one stream serves every run (a
        user's stream, an external allocator, ``use_ep_level_unified_stream``), and only on a
        host with the kernel sync stream (onnxruntime's plugin EP: runtime API >= 28), whose
        workspace tagging keeps overlapping runs apart in the shared arena."""
        if self.options.unified_stream:
            return False
        return supports(self.factory.api_version, "kernel_context_sync_stream")

    def sync(self) -> None:
        self.factory.synchronize(self.ordinal)

    def create_device_timer(self) -> Any:
        """Asked for only while profiling: CUDA events around each node's work."""
        return self.factory.create_device_timer(self)

    # runs ---------------------------------------------------------------------------------------
    def device_guard(self) -> Any:
        """A context manager making this provider's device current (and restoring the
        caller's): every entry into the provider that touches the device runs inside one."""
        return self.factory.device_guard(self.ordinal)

    def on_run_start(self, run_options: Any) -> None:
        """The run's device is made current on the thread that runs it, for the whole run
        (kernels, allocations, copies, graph replay; onnxruntime's plugin EP: "always set CUDA
        device when session::Run() in case it runs in a worker thread"); ``on_run_end``
        gives the thread its device back."""
        tls = self._run_tokens
        guard = getattr(tls, "guard", None)
        if guard is None:
            guard = tls.guard = self.device_guard()
        guard.__enter__()
        tls.token = self.backend.enter_run(self.run_allocator())
        unified = self._unified
        if unified is not None:
            unified.begin_run()  # a joined stream: after the user's stream's work so far

    def on_run_end(self, run_options: Any, sync_stream: bool) -> None:
        tls = self._run_tokens
        token = getattr(tls, "token", None)
        try:
            if token is not None:
                tls.token = None
                self.backend.exit_run(token)
        finally:
            guard = getattr(tls, "guard", None)
            if guard is not None:
                guard.__exit__(None, None, None)

    # graph capture (onnxruntime's CUDA graph protocol; the host's runner drives it) ----------
    def is_graph_capture_enabled(self) -> bool:
        return self.options.enable_cuda_graph and self.backend.can_capture

    def graph_capture_warmup_runs(self) -> int:
        return self.options.min_num_runs_before_cuda_graph_capture

    def graph_capture_node_assignment_policy(self) -> str:
        return "ALLOW_CPU_FOR_SHAPES"

    def begin_graph_capture(self, stream: Any) -> None:
        with self.device_guard():
            stream.begin_capture()

    def end_graph_capture(self, stream: Any, graph_id: int) -> None:
        with self.device_guard():
            exe = stream.end_capture()
        with self._lock:
            if graph_id in self._graphs:
                self._destroy(exe)
                raise ValueError(
                    f"trying to capture a graph with annotation id {graph_id} that is already "
                    "used. Use a different annotation id."
                )
            self._graphs[graph_id] = (exe, stream)

    def abort_graph_capture(self, stream: Any) -> None:
        stream.abort_capture()

    def is_graph_captured(self, graph_annotation_id: int) -> bool:
        return graph_annotation_id in self._graphs

    def replay_graph(self, graph_annotation_id: int) -> None:
        try:
            exe, stream = self._graphs[graph_annotation_id]
        except KeyError:
            raise InvalidArgument(
                f"CUDA graph replay error: graph not found for id {graph_annotation_id}"
            ) from None
        if getattr(self._run_tokens, "token", None) is not None:
            # inside this thread's run, whose start made the device current (on_run_start)
            err = self.backend.launch_graph(exe, stream.handle)
        else:
            with self.device_guard():
                err = self.backend.launch_graph(exe, stream.handle)
        if err:
            raise EPFail(f"CUDA graph launch error: {err}")

    def release_graph(self, graph_annotation_id: int) -> None:
        with self._lock:
            entry = self._graphs.pop(graph_annotation_id, None)
        if entry is not None:
            self._destroy(entry[0])

    def _destroy(self, exe: Any) -> None:
        from .runtime import cudart

        with self.device_guard():
            cudart().graphExecDestroy(exe)

    def device_objects(self) -> list[tuple[str, int, Any]]:
        """Every device-scoped object this provider made or uses so far, as (kind, ordinal,
        object): its array backend, allocators, streams with their cuBLASLt/cuDNN handles,
        captured graphs, GEMM and cuDNN engines (plan caches, tuning cache). Each must be of
        this provider's device (a diagnostic; the multi-device tests read it). Compiled kernel
        functions are the process's, per device: ``kernels._fused.function_devices``."""
        from . import blas, dnn

        out: list[tuple[str, int, Any]] = [("backend", self.backend.ordinal, self.backend)]
        for alloc in (self._external, self._shared):
            if alloc is not None:
                out.append(("allocator", alloc.memory_info.device.id, alloc))
        with self._lock:
            streams = list(self._streams) + ([self._unified] if self._unified else [])
            graphs = list(self._graphs.values())
        # a closed stream's handle is destroyed: only live ones are this provider's now
        streams = [st for st in streams if not getattr(st, "closed", False)]
        for st in streams:
            o = getattr(st, "ordinal", st.device.id)
            out.append(("stream", o, st))
            for kind in ("cublaslt", "cudnn"):
                handle = getattr(st, "_" + kind, None)
                if handle is not None:
                    out.append((kind, o, handle))
        for exe, st in graphs:
            out.append(("cuda graph", getattr(st, "ordinal", st.device.id), exe))
        gemm = blas._engines.get(blas.engine_key(self))
        if gemm is not None:
            out.append(("gemm engine", gemm.ordinal, gemm))
        for key, conv in list(dnn._engines.items()):
            if key[0] == self.ordinal:
                out.append(("cudnn engine", conv.ordinal, conv))
        return out

    def get_tuning_context(self) -> Any:
        with self._lock:
            if self._tuning is None:
                from .tuning import CudaTuningContext

                self._tuning = CudaTuningContext(self)
            return self._tuning

    def get_provider_options(self) -> dict[str, str]:
        out = self.options.as_strings()
        out["device_id"] = str(self.ordinal)
        return out

    def release(self) -> None:
        with self.device_guard():
            self._release()

    def _release(self) -> None:
        with self._lock:
            graphs, self._graphs = list(self._graphs.values()), {}
        for exe, _ in graphs:
            self._destroy(exe)
        with self._lock:
            streams, self._streams = self._streams, []
            if self._unified is not None:
                streams.append(self._unified)
                self._unified = None
        for s in streams:
            s.close()
        with self._lock:
            shared, self._shared = self._shared, None
        if shared is not None:
            self.factory.release_allocator(shared)


def create_ep(factory: Any, devices: list[EpDevice], config: SessionConfig) -> CudaEp:
    from onnxplug.ep import InvalidArgument

    if len(devices) != 1:
        raise InvalidArgument(
            f"{factory.name} supports exactly one device per session provider, got {len(devices)}"
        )
    options = parse_options(dict(config.items()), factory.name, config.objects)
    return CudaEp(factory, devices[0], config, options)
