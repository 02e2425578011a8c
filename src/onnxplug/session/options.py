"""SessionOptions and RunOptions, with onnxruntime's names and defaults."""

from __future__ import annotations

from enum import IntEnum
from typing import Any

import numpy as np

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


class _Checked:
    """An option attribute whose value ``check(value, name)`` validates (and normalizes)
    when it is set; kept in the instance's slot ``_<name>``."""

    def __init__(self, check: Any):
        self.check = check
        self.name = self.slot = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name, self.slot = name, f"_{name}"

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self if obj is None else getattr(obj, self.slot)

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(obj, self.slot, self.check(value, self.name))


class SessionOptions:
    """Options of an InferenceSession (``onnxruntime.SessionOptions``).

    What each option does here:

    * ``graph_optimization_level``: the optimizer's level; ``optimized_model_filepath``: the
      optimized model is written there (ONNX, loadable by onnxplug and onnxruntime).
    * ``intra_op_num_threads``: the most threads a kernel uses (numpy's BLAS included); 0
      leaves the libraries' defaults. ``inter_op_num_threads`` and ``execution_mode``: nodes
      run one after another (``ORT_SEQUENTIAL``); ``ORT_PARALLEL`` is accepted with a warning
      that says so.
    * ``log_severity_level`` (-1: the default logger's, see ``set_default_logger_severity``)
      and ``log_verbosity_level``: what the session prints to stderr, tagged ``onnxplug``.
    * ``enable_profiling``/``profile_file_prefix``: profiling to a JSON trace in onnxruntime's
      format, written by ``InferenceSession.end_profiling()`` (README, "Profiling").
    * Accepted without effect, as the runtime has no such choice: the memory-arena/pattern
      switches (providers own their memory; plans are always static), ``execution_order``,
      ``use_deterministic_compute`` (the CPU kernels are deterministic) and
      ``use_per_session_threads``.

    Setting an attribute that onnxruntime's SessionOptions does not have raises
    AttributeError, as there.
    """

    __slots__ = (
        "_config",
        "_execution_mode",
        "_free_dims_by_denotation",
        "_free_dims_by_name",
        "_graph_optimization_level",
        "_initializers",
        "_inter_op_num_threads",
        "_intra_op_num_threads",
        "_log_severity_level",
        "_log_verbosity_level",
        "_policy",
        "_policy_delegate",
        "_providers",
        "enable_cpu_mem_arena",
        "enable_mem_pattern",
        "enable_mem_reuse",
        "enable_profiling",
        "execution_order",
        "logid",
        "optimized_model_filepath",
        "profile_file_prefix",
        "use_deterministic_compute",
        "use_per_session_threads",
    )
    graph_optimization_level = _Checked(lambda v, n: _enum(GraphOptimizationLevel, v, n))
    execution_mode = _Checked(lambda v, n: _enum(ExecutionMode, v, n))
    intra_op_num_threads = _Checked(lambda v, n: _count(v, n))
    inter_op_num_threads = _Checked(lambda v, n: _count(v, n))
    log_severity_level = _Checked(lambda v, n: _severity(v, n))
    log_verbosity_level = _Checked(lambda v, n: _count(v, n))

    def __init__(self) -> None:
        self.graph_optimization_level = GraphOptimizationLevel.ORT_ENABLE_ALL
        self.execution_mode = ExecutionMode.ORT_SEQUENTIAL
        self.execution_order = ExecutionOrder.DEFAULT
        self.intra_op_num_threads = 0
        self.inter_op_num_threads = 0
        self.enable_profiling = False
        self.profile_file_prefix = "onnxplug_profile_"
        self.log_severity_level = -1
        self.log_verbosity_level = 0
        self.logid = ""
        self.optimized_model_filepath = ""
        self.enable_cpu_mem_arena = True
        self.enable_mem_pattern = True
        self.enable_mem_reuse = True
        self.use_deterministic_compute = False
        self.use_per_session_threads = True
        self._config: dict[str, str] = {}
        self._providers: list[tuple[str, dict[str, Any], Any]] = []  # (name, options, ep_devices)
        self._initializers: dict[str, Any] = {}
        self._free_dims_by_name: dict[str, int] = {}
        self._free_dims_by_denotation: dict[str, int] = {}
        self._policy: Any = None
        self._policy_delegate: Any = None

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
        # OrtEpDevice (what get_ep_devices() returns) or the plugin API's EpDevice
        devices = [getattr(d, "ep_device", d) for d in ep_devices]
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

    def set_provider_selection_policy(self, policy: Any) -> None:
        """Providers for a session given none: chosen among the EP devices by ``policy``
        (an ``OrtExecutionProviderDevicePolicy``), CPU last."""
        from .devices import OrtExecutionProviderDevicePolicy

        self._policy = _enum(OrtExecutionProviderDevicePolicy, policy, "provider selection policy")

    def set_provider_selection_policy_delegate(self, delegate: Any) -> None:
        """``delegate(ep_devices, model_metadata, runtime_metadata, max_selections)`` returns
        the OrtEpDevices to use, in priority order, for a session given no providers."""
        if not callable(delegate):
            raise InvalidArgument("the provider selection policy delegate must be callable")
        self._policy_delegate = delegate

    def has_providers(self) -> bool:
        """Whether providers, EP devices or a selection policy were set."""
        return (
            bool(self._providers) or self._policy is not None or (self._policy_delegate is not None)
        )

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
    """Options of one run (``onnxruntime.RunOptions``). A run whose ``terminate`` is set
    fails with onnxruntime's "Exiting due to terminate flag" (the executor decides where it
    checks). ``enable_profiling`` profiles this run alone into a new trace file named after
    ``profile_file_prefix`` (onnxruntime's run-level profiling of its C/C++ API, which its
    Python RunOptions do not expose yet); a session that profiles already ignores it, with a
    warning. Setting an attribute that onnxruntime's RunOptions does not have raises
    AttributeError, as there."""

    __slots__ = (
        "_config",
        "_log_severity_level",
        "_log_verbosity_level",
        "enable_profiling",
        "logid",
        "only_execute_path_to_fetches",
        "profile_file_prefix",
        "synchronize_execution_providers",
        "terminate",
    )
    log_severity_level = _Checked(lambda v, n: _severity(v, n))
    log_verbosity_level = _Checked(lambda v, n: _count(v, n))

    def __init__(self) -> None:
        self.log_severity_level = -1
        self.log_verbosity_level = 0
        self.logid = ""
        self.terminate = False
        self.only_execute_path_to_fetches = False
        self.synchronize_execution_providers = True
        self.enable_profiling = False
        self.profile_file_prefix = "onnxplug_profile_"
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


def _enum(cls: Any, value: Any, what: str) -> Any:
    try:
        return cls(int(value))
    except (TypeError, ValueError):
        raise InvalidArgument(
            f"{what} must be one of {[str(x) for x in cls]}, not {value!r}"
        ) from None


def _count(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise InvalidArgument(f"{what} must be an int >= 0, not {value!r}")
    return int(value)


def _severity(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not -1 <= value <= 4:
        raise InvalidArgument(
            f"{what} must be -1 (the default logger's), 0 (verbose), 1 (info), 2 (warning), "
            f"3 (error) or 4 (fatal), not {value!r}"
        )
    return int(value)


def option_value(v: Any) -> Any:
    """A provider option value as the session stores it: a string, except the values that
    stay Python objects (``is_object_option``)."""
    if isinstance(v, bool):
        return "1" if v else "0"
    return v if is_object_option(v) else str(v)


def is_object_option(v: Any) -> bool:
    """Provider option values kept as Python objects: callables (an external allocator's
    callbacks) and streams (any object with ``__cuda_stream__``: a torch.cuda.Stream, a CuPy
    stream), which the provider keeps alive for the session."""
    return callable(v) or hasattr(v, "__cuda_stream__")


def describe_object_option(v: Any) -> str:
    """The config entry that stands for an object option (the object is passed beside it)."""
    if hasattr(v, "__cuda_stream__"):
        return f"<python stream {type(v).__qualname__}>"
    return f"<python callable {getattr(v, '__qualname__', type(v).__name__)}>"


def _str_options(provider: str, options: dict[str, Any] | None) -> dict[str, Any]:
    """Option values as strings; object options (``is_object_option``) stay objects."""
    out: dict[str, Any] = {}
    for k, v in (options or {}).items():
        if not isinstance(k, str):
            raise InvalidArgument(f"{provider}: provider option keys must be strings, got {k!r}")
        out[k] = option_value(v)
    return out
