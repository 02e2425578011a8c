"""SessionOptions and RunOptions, with onnxruntime's names and defaults."""

from __future__ import annotations

from enum import IntEnum
from typing import Any

from ..errors import InvalidArgument


class GraphOptimizationLevel(IntEnum):
    ORT_DISABLE_ALL = 0
    ORT_ENABLE_BASIC = 1
    ORT_ENABLE_EXTENDED = 2
    ORT_ENABLE_LAYOUT = 3
    ORT_ENABLE_ALL = 99

    def __str__(self) -> str:  # onnxruntime prints 'GraphOptimizationLevel.ORT_ENABLE_ALL'
        return f"{type(self).__name__}.{self.name}"


class ExecutionMode(IntEnum):
    ORT_SEQUENTIAL = 0
    ORT_PARALLEL = 1

    def __str__(self) -> str:
        return f"{type(self).__name__}.{self.name}"


class ExecutionOrder(IntEnum):
    DEFAULT = 0
    PRIORITY_BASED = 1
    MEMORY_EFFICIENT = 2


class SessionOptions:
    """Options of an InferenceSession (``onnxruntime.SessionOptions``).

    Accepted for compatibility but without effect here: thread counts, execution mode and
    order, memory-arena/pattern switches (numpy runs the CPU kernels; providers own their
    memory), ``use_deterministic_compute`` and ``optimized_model_filepath``.
    """

    def __init__(self) -> None:
        self.graph_optimization_level = GraphOptimizationLevel.ORT_ENABLE_ALL
        self.execution_mode = ExecutionMode.ORT_SEQUENTIAL
        self.execution_order = ExecutionOrder.DEFAULT
        self.intra_op_num_threads = 0
        self.inter_op_num_threads = 0
        self.enable_profiling = False
        self.profile_file_prefix = "onnxplug_profile_"
        self.log_severity_level = 2
        self.log_verbosity_level = 0
        self.logid = ""
        self.optimized_model_filepath = ""
        self.enable_cpu_mem_arena = True
        self.enable_mem_pattern = True
        self.enable_mem_reuse = True
        self.use_deterministic_compute = False
        self._config: dict[str, str] = {}
        self._providers: list[tuple[str, dict[str, Any], Any]] = []  # (name, options, ep_devices)
        self._initializers: dict[str, Any] = {}
        self._free_dims_by_name: dict[str, int] = {}
        self._free_dims_by_denotation: dict[str, int] = {}

    @property
    def graph_optimization_level(self) -> GraphOptimizationLevel:
        return self._graph_optimization_level

    @graph_optimization_level.setter
    def graph_optimization_level(self, level: Any) -> None:
        try:
            self._graph_optimization_level = GraphOptimizationLevel(int(level))
        except (TypeError, ValueError):
            raise InvalidArgument(
                f"graph_optimization_level must be one of "
                f"{[str(x) for x in GraphOptimizationLevel]}, not {level!r}"
            ) from None

    # config entries ----------------------------------------------------------------------------
    def add_session_config_entry(self, key: str, value: str) -> None:
        if not isinstance(key, str) or not key:
            raise InvalidArgument("a session config key must be a non-empty string")
        self._config[key] = str(value)

    def get_session_config_entry(self, key: str) -> str:
        try:
            return self._config[key]
        except KeyError:
            raise InvalidArgument(
                f"SessionOptions does not have configuration with key: {key}"
            ) from None

    def has_session_config_entry(self, key: str) -> bool:
        return key in self._config

    @property
    def config_entries(self) -> dict[str, str]:
        return dict(self._config)

    # providers ---------------------------------------------------------------------------------
    def add_provider(
        self, provider_name: str, provider_options: dict[str, Any] | None = None
    ) -> None:
        self._providers.append((provider_name, _str_options(provider_name, provider_options), None))

    def add_provider_for_devices(
        self, ep_devices: list[Any], provider_options: dict[str, Any] | None = None
    ) -> None:
        devices = list(ep_devices)
        if not devices:
            raise InvalidArgument("add_provider_for_devices needs at least one EP device")
        names = {d.ep_name for d in devices}
        if len(names) != 1:
            raise InvalidArgument(
                f"all devices must belong to one execution provider, got {sorted(names)}"
            )
        name = devices[0].ep_name
        self._providers.append((name, _str_options(name, provider_options), devices))

    def get_provider_entries(self) -> list[tuple[str, dict[str, Any], Any]]:
        return list(self._providers)

    # initializers and dims ----------------------------------------------------------------------
    def add_initializer(self, name: str, value: Any) -> None:
        self._initializers[name] = value

    def add_free_dimension_override_by_name(self, dim_name: str, value: int) -> None:
        self._free_dims_by_name[dim_name] = int(value)

    def add_free_dimension_override_by_denotation(self, denotation: str, value: int) -> None:
        self._free_dims_by_denotation[denotation] = int(value)

    def register_custom_ops_library(self, library_path: str) -> None:
        raise InvalidArgument(
            f"custom-op libraries ('{library_path}') are native onnxruntime plugins; onnxplug "
            "takes kernels from execution-provider plugins instead (see docs/architecture.md)"
        )


class RunOptions:
    """Options of one run (``onnxruntime.RunOptions``)."""

    def __init__(self) -> None:
        self.log_severity_level = 2
        self.log_verbosity_level = 0
        self.logid = ""
        self.terminate = False
        self.only_execute_path_to_fetches = False
        self.synchronize_execution_providers = True
        self._config: dict[str, str] = {}

    def add_run_config_entry(self, key: str, value: str) -> None:
        self._config[key] = str(value)

    def get_run_config_entry(self, key: str) -> str:
        try:
            return self._config[key]
        except KeyError:
            raise InvalidArgument(
                f"RunOptions does not have configuration with key: {key}"
            ) from None

    def get(self, key: str, default: str | None = None) -> str | None:
        return self._config.get(key, default)


def _str_options(provider: str, options: dict[str, Any] | None) -> dict[str, Any]:
    """Option values as strings; callables (e.g. an external allocator's callbacks) stay
    Python objects."""
    out: dict[str, Any] = {}
    for k, v in (options or {}).items():
        if not isinstance(k, str):
            raise InvalidArgument(f"{provider}: provider option keys must be strings, got {k!r}")
        if isinstance(v, bool):
            v = "1" if v else "0"
        out[k] = v if callable(v) else str(v)
    return out
