"""The virtual device's factory and EP (the plugin's object model)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from onnxplug.ep import (
    Allocator,
    ArenaConfig,
    BFCArena,
    Device,
    Ep,
    EpDevice,
    EpFactory,
    GraphView,
    HardwareDevice,
    InvalidArgument,
    KernelRegistry,
    MemoryInfo,
    MemType,
    SessionConfig,
    SharedArenas,
    SyncStream,
    dlpack,
    supports,
)

from .allocator import VirtAllocator
from .kernels import REGISTRY
from .stream import Stats, VirtDataTransfer, VirtStream, VirtTimer

NAME = "VirtualDeviceExecutionProvider"
VENDOR = "onnxplug-tests"
VENDOR_ID = 0xF0F0
STREAM_MODES = ("deferred", "none", "unified")


class VirtualDeviceEp(Ep):
    """One session's virtual-device provider.

    Provider options: ``ops`` (comma-separated op types it may claim; default: every op it
    has a kernel for), ``streams`` (``deferred``: a queued stream per frame, the default;
    ``none``: no stream, kernels run synchronously; ``unified``: one queued stream for every
    run, which the provider owns), ``enable_graph`` (``1``: capture and replay graphs of the
    queued work, like CUDA graphs), ``graph_warmup_runs`` (default 2) and ``segments`` (``1``:
    kernels bind launchers that re-queue their work and that the executor may capture with
    their neighbours as one graph, as the CUDA provider's node graphs are), ``capture_refused``
    (``1``: a graph capture cannot start, as on CUDA's legacy default stream).
    """

    def __init__(self, factory: VirtualDeviceFactory, ep_device: EpDevice, config: SessionConfig):
        super().__init__(factory, ep_device, config)
        self.name = factory.name
        self.device = factory.device
        self.stats = factory.stats
        self.options = config.with_prefix(f"ep.{self.name.lower()}.")
        ops = self.options.get("ops")
        self.ops = {o.strip() for o in ops.split(",") if o.strip()} if ops is not None else None
        self.stream_mode = self.options.get("streams", "deferred")
        if self.stream_mode not in STREAM_MODES:
            raise ValueError(f"streams must be one of {STREAM_MODES}, got '{self.stream_mode}'")
        self.enable_graph = self.options.get("enable_graph", "0") == "1"
        self.warmup_runs = int(self.options.get("graph_warmup_runs", "2"))
        self.segments = self.options.get("segments", "0") == "1"
        self.capture_refused = self.options.get("capture_refused", "0") == "1"
        self._graphs: dict[int, tuple[VirtStream, list]] = {}
        self._unified: VirtStream | None = None
        factory.eps_created += 1
        factory.last_config = config

    def get_kernel_registry(self) -> KernelRegistry:
        return REGISTRY

    def get_capability(self, graph: GraphView) -> list:
        claimed = super().get_capability(graph)
        if self.ops is None:
            return claimed
        return [n for n in claimed if n.op_type in self.ops]

    def create_sync_stream(self) -> VirtStream | None:
        if self.stream_mode == "none":
            return None
        if self.stream_mode == "unified":
            if self._unified is None:
                self._unified = VirtStream(self.device, self.stats)
                self._unified.frame_owned = False
            return self._unified
        return VirtStream(self.device, self.stats)

    def is_concurrent_run_supported(self) -> bool:
        if self.stream_mode == "unified":
            return False
        # Written against API 3, the plugin needs the host's kernel sync stream for runs to
        # overlap (as onnxruntime's CUDA plugin checks the runtime's API version); a plugin
        # written against API 1 or 2 knows nothing of it and says yes (the host serialises it).
        version = self.factory.api_version
        return version < 3 or supports(version, "kernel_context_sync_stream")

    def create_device_timer(self) -> VirtTimer | None:
        # asked for only while profiling; without streams the work is the host's
        return None if self.stream_mode == "none" else VirtTimer(self.stats)

    # graph capture --------------------------------------------------------------------------
    def is_graph_capture_enabled(self) -> bool:
        return self.enable_graph and self.stream_mode != "none"

    def graph_capture_warmup_runs(self) -> int:
        return self.warmup_runs

    def begin_graph_capture(self, stream: VirtStream) -> None:
        if self.capture_refused:
            self.stats.add("capture_refused")
            raise RuntimeError("this stream cannot capture a graph")
        self.stats.add("capture_begin")
        stream.begin_recording()

    def end_graph_capture(self, stream: VirtStream, graph_id: int) -> None:
        recorded = stream.end_recording()
        if graph_id in self._graphs:
            raise ValueError(f"graph annotation id {graph_id} is already in use")
        self._graphs[graph_id] = (stream, recorded)
        self.stats.add("captured_graphs")

    def abort_graph_capture(self, stream: VirtStream) -> None:
        stream.end_recording()
        self.stats.add("capture_aborted")

    def is_graph_captured(self, graph_annotation_id: int) -> bool:
        return graph_annotation_id in self._graphs

    def replay_graph(self, graph_annotation_id: int) -> None:
        try:
            stream, recorded = self._graphs[graph_annotation_id]
        except KeyError:
            raise InvalidArgument(
                f"graph replay error: graph not found for id {graph_annotation_id}"
            ) from None
        self.stats.add("replays")
        for fn in recorded:
            stream.enqueue(fn)

    def release_graph(self, graph_annotation_id: int) -> None:
        if self._graphs.pop(graph_annotation_id, None) is not None:
            self.stats.add("graphs_released")

    def release(self) -> None:
        self._graphs.clear()
        if self._unified is not None:
            self._unified.close()
            self._unified = None

    def get_provider_options(self) -> dict[str, str]:
        return {"device_id": str(self.device.id), "streams": self.stream_mode, **self.options}


class VirtualDeviceFactory(EpFactory):
    """Offers one virtual device whose memory is host memory behind a counting allocator.

    With ``arena=True`` sessions get the shared, reference-counted BFC arena of the device over
    that allocator (configured by the ``arena.*`` options), as a GPU provider does; ``allocator``
    is then the arena's raw allocator, whose counts are its extensions."""

    vendor = VENDOR
    vendor_id = VENDOR_ID
    version = "1.0.0"
    # DLPack's test device type: virtual-device tensors go to and from other libraries (the
    # test stand-in ``foreign.VirtArray``) as device memory, never as host memory
    dlpack_device_type = dlpack.EXT_DEV

    def __init__(
        self,
        name: str = NAME,
        device_id: int = 0,
        arena: bool = False,
        api_version: int | None = None,
        pinned: bool = False,
    ):
        if api_version is not None:  # a plugin written against an older API
            self.api_version = api_version
        self.name = name
        self.device = Device("virt", device_id, VENDOR_ID, host_accessible=True)
        self.memory_info = MemoryInfo("Virt", self.device)
        self.allocator = VirtAllocator(self.memory_info)
        # ``pinned``: the device also offers host memory it copies to and from asynchronously
        # (like CUDA's pinned memory), which sessions use to stage feeds and outputs
        self.pinned_info: MemoryInfo | None = None
        self.pinned_allocator: VirtAllocator | None = None
        if pinned:
            host = Device("cpu", 0, VENDOR_ID, host_accessible=True)
            self.pinned_info = MemoryInfo("VirtPinned", host, MemType.CPU_OUTPUT)
            self.pinned_allocator = VirtAllocator(self.pinned_info)
        self.arenas = SharedArenas(name) if arena else None
        self.stats = Stats()
        self.eps_created = 0
        self.last_config: SessionConfig | None = None  # what the last EP was created with
        # Set by a test: called at the start of every kernel's queued work, on the thread
        # that runs it (to see which device work overlaps, or make concurrent runs meet).
        self.rendezvous: Callable[[], None] | None = None
        self._import_stream: VirtStream | None = None

    def get_supported_devices(self, hardware: list[HardwareDevice]) -> list[EpDevice]:
        # the host only discovers the CPU: the plugin enumerates its own device
        dev_id = self.device.id
        hw = HardwareDevice("NPU", VENDOR, VENDOR_ID, dev_id, {"virtual": "1"})
        return [
            EpDevice(
                self.name,
                VENDOR,
                hw,
                ep_metadata={"virt_device_id": str(dev_id)},
                ep_options={"device_id": str(dev_id)},
                memory_info=self.memory_info,
                host_accessible_memory_info=self.pinned_info,
                factory=self,
            )
        ]

    def create_ep(self, devices: list[EpDevice], config: SessionConfig) -> Ep:
        if len(devices) != 1 or devices[0].memory_info != self.memory_info:
            raise ValueError(f"{self.name} needs exactly one of its own devices, got {devices}")
        return VirtualDeviceEp(self, devices[0], config)

    def create_allocator(
        self, memory_info: MemoryInfo, options: Mapping[str, str] | None
    ) -> Allocator | None:
        if self.pinned_info is not None and memory_info == self.pinned_info:
            return self.pinned_allocator
        if memory_info.device != self.device:
            return None
        if self.arenas is None:
            return self.allocator
        config = ArenaConfig.from_options(options or {}, self.name)
        return self.arenas.acquire(
            (memory_info.name, self.device.id),
            config,
            lambda: BFCArena(self.allocator, config),
            explicit=bool(options),
        )

    def release_allocator(self, allocator: Allocator) -> None:
        if self.arenas is not None:
            self.arenas.release(allocator)

    def arena(self) -> BFCArena | None:
        """The device's shared arena while someone holds it."""
        if self.arenas is None:
            return None
        a = self.arenas.get((self.memory_info.name, self.device.id))
        return a if isinstance(a, BFCArena) else None

    def create_data_transfer(self) -> VirtDataTransfer:
        return VirtDataTransfer([self.device], self.stats)

    def is_stream_aware(self) -> bool:
        return True

    def create_sync_stream(self, memory_info: MemoryInfo) -> VirtStream:
        return VirtStream(self.device, self.stats)

    def dlpack_import_stream(self, device: Device) -> SyncStream | None:
        if device != self.device:
            return None
        if self._import_stream is None:
            self._import_stream = VirtStream(self.device, self.stats)
        return self._import_stream
