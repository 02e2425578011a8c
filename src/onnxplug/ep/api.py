"""The plugin execution-provider API: what a provider plugin implements.

The object model follows onnxruntime's plugin EP API (``OrtEpFactory``, ``OrtEp``,
``OrtEpDevice``): a process-wide *factory* discovers devices and creates allocators and data
transfers; a per-session *EP* claims nodes, owns kernels and streams, and takes part in runs
(including CUDA-graph style capture/replay through callbacks with safe defaults).

Versioning: ``API_VERSION`` is the host's API. A factory declares the API it was written
against (``api_version``) and the oldest host it can run on (``min_host_api_version``). The
host refuses a plugin that needs a newer host, and uses an optional capability only when both
sides have it (``supports``): older plugins degrade gracefully, they are never broken.

API versions (``CAPABILITIES`` below names the capability each one adds):

* 1: the object model, kernels, allocators, streams, data transfer, graph capture, shrink;
* 2: device timing (``Ep.create_device_timer``): a ``DeviceTimer`` times each node's work on
  its stream while a session or run is profiled; a plugin of API 1 gets host times only;
* 3: the kernel sync stream (onnxruntime's ``KernelContext_GetSyncStream``, its API 28): a
  kernel's ``ctx.get_sync_stream()`` is its run's stream and the workspaces it takes
  (``ctx.scratch``, ``ctx.workspace``) are tagged with that stream in the stream-aware arena, so
  runs on different streams can overlap safely, and the provider's sessions run concurrently
  when it says it can. For a plugin written against API 1 or 2 the host falls back as
  onnxruntime does: ``get_sync_stream()`` is None, the workspaces are untagged and the session
  runs one run at a time; a plugin on a host older than 3 must not advertise concurrent runs
  (``supports(api_version, "kernel_context_sync_stream")``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..framework.kernel import KernelDef, KernelRegistry, types_match
from ..framework.memory import CPU_MEMORY, Allocator, Device, MemoryInfo
from ..framework.stream import DataTransfer, DeviceTimer, SyncStream
from ..framework.tuning import TuningContext

if TYPE_CHECKING:
    from ..ir.graph import Node

API_VERSION = 3

# Optional capabilities and the API version that introduced each. The host uses a capability
# of a plugin only when both API versions are at least this.
CAPABILITIES: dict[str, int] = {
    "data_transfer": 1,
    "sync_streams": 1,
    "graph_capture": 1,
    "ep_sync": 1,
    "allocator_shrink": 1,
    "device_timing": 2,  # Ep.create_device_timer: device time per node while profiling
    "kernel_context_sync_stream": 3,  # KernelContext.get_sync_stream, tagged workspaces
}


def supports(plugin_api_version: int, capability: str) -> bool:
    """Whether both the host and a plugin written against ``plugin_api_version`` have
    ``capability``."""
    needed = CAPABILITIES.get(capability)
    if needed is None:
        return False
    return plugin_api_version >= needed and API_VERSION >= needed


def has_kernel_sync_stream(ep: Ep) -> bool:
    """Whether ``ep``'s plugin and the host both have the kernel sync stream (API 3): its
    kernels' workspaces are tagged with their stream and its runs may overlap."""
    return supports(getattr(ep.factory, "api_version", 1), "kernel_context_sync_stream")


@dataclass(frozen=True)
class HardwareDevice:
    """A physical device the host or a plugin discovered (onnxruntime's OrtHardwareDevice)."""

    type: str  # "CPU" | "GPU" | "NPU"
    vendor: str = ""
    vendor_id: int = 0
    device_id: int = 0
    metadata: Mapping[str, str] = field(default_factory=dict)


CPU_HARDWARE = HardwareDevice("CPU", "generic", 0, 0)


@dataclass(eq=False)
class EpDevice:
    """One (factory, device) pair a plugin offers (onnxruntime's OrtEpDevice)."""

    ep_name: str
    ep_vendor: str
    device: HardwareDevice
    ep_metadata: dict[str, str] = field(default_factory=dict)
    ep_options: dict[str, str] = field(default_factory=dict)
    memory_info: MemoryInfo = CPU_MEMORY
    host_accessible_memory_info: MemoryInfo | None = None
    factory: Any = None

    def __repr__(self) -> str:
        return f"EpDevice({self.ep_name}, {self.device.type}:{self.device.device_id})"


class SessionConfig:
    """The session's configuration entries as a provider sees them (read-only).

    Provider options given as Python objects (callables, e.g. an external allocator's
    callbacks) are in ``objects`` by config key; their entry is a description."""

    def __init__(self, entries: Mapping[str, str], objects: Mapping[str, Any] | None = None):
        self._entries = dict(entries)
        self._objects = dict(objects or {})

    @property
    def objects(self) -> dict[str, Any]:
        return dict(self._objects)

    def get(self, key: str, default: str | None = None) -> str | None:
        return self._entries.get(key, default)

    def items(self):
        return self._entries.items()

    def with_prefix(self, prefix: str) -> dict[str, str]:
        return {k[len(prefix) :]: v for k, v in self._entries.items() if k.startswith(prefix)}


class GraphView:
    """What ``Ep.get_capability`` sees: the nodes still unassigned, with a kernel lookup."""

    def __init__(self, graph: Any, nodes: list[Node], registry: KernelRegistry | None):
        self.graph = graph
        self.nodes = nodes
        self._registry = registry

    def input_dtypes(self, node: Node) -> list[Any]:
        from ..ir.graph import tensor_dtype

        return [tensor_dtype(self.graph, i) if i else None for i in node.inputs]

    def output_dtypes(self, node: Node) -> list[Any]:
        from ..ir.graph import tensor_dtype

        return [tensor_dtype(self.graph, o) if o else None for o in node.outputs]

    def lookup_kernel(self, node: Node) -> KernelDef | None:
        """The kernel this provider would run for ``node`` (version and types checked)."""
        if self._registry is None:
            return None
        hit = self._registry.lookup(
            node.op_type,
            node.domain,
            node.since_version,
            self.input_dtypes(node),
            self.output_dtypes(node),
        )
        return hit[0] if hit else None

    def producer(self, name: str) -> Node | None:
        for n in self.graph.nodes:
            if name in n.outputs:
                return n
        return None


class Ep(ABC):
    """A provider instance for one session (onnxruntime's OrtEp).

    Subclasses set ``name``, ``device`` (where outputs of DEFAULT memory live) and implement
    ``get_kernel_registry``; everything else has a safe default.
    """

    name: str = ""
    device: Device = CPU_MEMORY.device

    def __init__(self, factory: EpFactory, ep_device: EpDevice | None, config: SessionConfig):
        self.factory = factory
        self.ep_device = ep_device
        self.config = config

    # partitioning ---------------------------------------------------------------------------
    @abstractmethod
    def get_kernel_registry(self) -> KernelRegistry: ...

    def get_capability(self, graph: GraphView) -> list[Node]:
        """Nodes this provider claims; the default claims every node it has a kernel for."""
        return [n for n in graph.nodes if graph.lookup_kernel(n) is not None]

    def get_preferred_data_layout(self) -> str:
        """The layout this provider's kernels prefer (onnxruntime's ``GetPreferredDataLayout``):
        ``"NCHW"``, or ``"NHWC"`` to have the optimizer rewrite the nodes it would run that have
        an NHWC form (``NHWC_OPS``) into ``NHWC_DOMAIN`` ops between Transposes (its registry
        must then have those kernels)."""
        return "NCHW"

    def should_convert_data_layout_for_op(
        self, domain: str, op_type: str, target_layout: str
    ) -> int:
        """Whether a node of ``op_type`` in ``domain`` is converted to ``target_layout``
        (onnxruntime's ``ShouldConvertDataLayoutForOp``): 1 convert, 0 keep, -1 let the host
        decide (it converts the ops that have an NHWC form)."""
        return -1

    # memory, streams --------------------------------------------------------------------------
    def get_allocator(self, mem_info: MemoryInfo) -> Allocator | None:
        """A per-session allocator overriding the factory's shared one (None: use shared)."""
        return None

    def allocator_options(self, mem_info: MemoryInfo) -> dict[str, str]:
        """Options the session passes to ``EpFactory.create_allocator`` for ``mem_info``: by
        default the session config's ``ep.<lowercased provider name>.arena.*`` entries as bare
        ``arena.*`` keys (what onnxruntime's PluginExecutionProvider passes)."""
        prefix = f"ep.{self.name.lower()}."
        return {
            k[len(prefix) :]: v for k, v in self.config.items() if k.startswith(prefix + "arena.")
        }

    def create_sync_stream(self) -> SyncStream | None:
        """The stream kernels of this provider run on for one run (None: no stream)."""
        return None

    def is_concurrent_run_supported(self) -> bool:
        return True

    def sync(self) -> None:
        """Wait for all device work of this provider (IOBinding input synchronisation)."""

    def create_device_timer(self) -> DeviceTimer | None:
        """A timer of the device work queued on this provider's streams, asked for only while
        a session or run is profiled (one per execution frame, closed with it): the
        ``Kernel`` events of the trace. None: this provider's nodes get host times only."""
        return None

    # runs ----------------------------------------------------------------------------------
    def on_run_start(self, run_options: Any) -> None:
        """Called before each run's kernels."""

    def on_run_end(self, run_options: Any, sync_stream: bool) -> None:
        """Called after each run's kernels."""

    # graph capture (safe defaults: capture disabled) -----------------------------------------
    # The host's runner drives warm-up, capture and replay (framework/graph_capture.py, as
    # onnxruntime's session does); the provider records and replays work on its streams.
    # Capture is per *segment*: the runner may capture several graphs in one run (the
    # maximal capturable stretches of a model that also has host nodes).
    def is_graph_capture_enabled(self) -> bool:
        return False

    def graph_capture_warmup_runs(self) -> int:
        """Regular runs of an annotation id before it is captured (onnxruntime's
        ``min_num_runs_before_cuda_graph_capture``)."""
        return 2

    def begin_graph_capture(self, stream: SyncStream) -> None:
        """Start recording the work queued on ``stream`` (a stream of this provider)."""
        raise RuntimeError(f"{self.name} does not capture graphs")

    def end_graph_capture(self, stream: SyncStream, graph_id: int) -> None:
        """Stop recording and keep what was recorded as graph ``graph_id`` (which must not be
        in use); the recorded work has not run."""
        raise RuntimeError(f"{self.name} does not capture graphs")

    def abort_graph_capture(self, stream: SyncStream) -> None:
        """Stop recording and discard it (after an error); the stream is usable again."""

    def is_graph_captured(self, graph_annotation_id: int) -> bool:
        return False

    def replay_graph(self, graph_annotation_id: int) -> None:
        """Launch a captured graph on the stream it was captured on."""
        raise RuntimeError(f"{self.name} does not capture graphs")

    def release_graph(self, graph_annotation_id: int) -> None:
        """Free a captured graph."""

    def graph_capture_node_assignment_policy(self) -> str:
        """'ALL_NODES_ON_EP' or 'ALLOW_CPU_FOR_SHAPES' (onnxruntime's policy; onnxplug
        captures piecewise, so host nodes only split the capture)."""
        return "ALL_NODES_ON_EP"

    # tuning results ----------------------------------------------------------------------------
    def get_tuning_context(self) -> TuningContext | None:
        """This provider's TunableOp results and validators (onnxruntime's
        ``GetTuningContext``), what ``InferenceSession.get_tuning_results`` and
        ``set_tuning_results`` exchange; None (the default, so older plugins keep working): it
        does not tune, and results given for it are refused."""
        return None

    # introspection -----------------------------------------------------------------------------
    def get_provider_options(self) -> dict[str, str]:
        return {}

    def release(self) -> None:
        """The session is closing."""


class EpFactory(ABC):
    """A provider plugin's process-wide entry point (onnxruntime's OrtEpFactory)."""

    name: str = ""
    vendor: str = ""
    vendor_id: int = 0
    version: str = "0.0.0"
    api_version: int = API_VERSION  # the API the plugin was written against
    min_host_api_version: int = 1  # the oldest host API the plugin can run on

    @abstractmethod
    def get_supported_devices(self, hardware: list[HardwareDevice]) -> list[EpDevice]:
        """The devices this provider can use. Accelerator plugins may discover their own
        devices in addition to ``hardware`` (the host only discovers the CPU)."""

    @abstractmethod
    def create_ep(self, devices: list[EpDevice], config: SessionConfig) -> Ep: ...

    def unavailable_reason(self) -> str | None:
        """Why ``get_supported_devices`` found no device (no driver, none visible...), for
        the warning a session gives when it runs without this provider; None: no reason."""
        return None

    def release_ep(self, ep: Ep) -> None:
        ep.release()

    def create_allocator(
        self, memory_info: MemoryInfo, options: Mapping[str, str] | None
    ) -> Allocator | None:
        """A reference to the shared allocator for ``memory_info`` (None: the host allocates
        host memory). ``options`` are ``arena.*`` keys (a session's, over the environment's
        ``ep_factory.<name>.arena.*``); they configure the allocator if this call creates it.
        Each call takes a reference that ``release_allocator`` gives back."""
        return None

    def release_allocator(self, allocator: Allocator) -> None:
        """Drop a reference to an allocator made by ``create_allocator`` (the last one lets
        the factory close it)."""

    def create_data_transfer(self) -> DataTransfer | None:
        return None

    def is_stream_aware(self) -> bool:
        return False

    def create_sync_stream(self, memory_info: MemoryInfo) -> SyncStream | None:
        return None

    # DLPack: tensors in this provider's memory exchanged with other libraries ----------------
    #: The DLPack ``DLDeviceType`` of this provider's device memory (``onnxplug.ep.dlpack``:
    #: ``CUDA`` = 2, ...), with the device ordinal as DLPack's device id. None: its tensors are
    #: exported as host memory when the device is host accessible, else not at all, and no
    #: DLPack tensor is imported into it.
    dlpack_device_type: int | None = None

    def dlpack_import_stream(self, device: Device) -> SyncStream | None:
        """The stream a DLPack producer is asked to order its pending work on when a tensor is
        imported into ``device`` (its handle is ``__dlpack__``'s ``stream`` argument). The host
        then activates a notification on it, which every later reader of the tensor waits for.
        None: the producer is asked for nothing (``stream=None``: the legacy default stream on
        CUDA)."""
        return None

    def device_id_of(self, ptr: int) -> int | None:
        """The ordinal of this provider's device whose memory ``ptr`` points into, for tensors
        that come without a device (``__cuda_array_interface__``); None: not this provider's
        memory."""
        return None


__all__ = [
    "API_VERSION",
    "CAPABILITIES",
    "CPU_HARDWARE",
    "Ep",
    "EpDevice",
    "EpFactory",
    "GraphView",
    "HardwareDevice",
    "SessionConfig",
    "has_kernel_sync_stream",
    "supports",
    "types_match",
]
