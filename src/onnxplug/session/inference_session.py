"""``InferenceSession``: onnxruntime's Python API on top of the plugin providers.

Feeds are checked against the model before a run: names, element types (numpy arrays of
ml_dtypes types such as bfloat16, float8 and int4 are accepted as they are), ranks and fixed
dimensions, each error naming the input. Sequences are fed as Python lists, an empty
optional as ``None``; strings as object or ``str`` ('U') arrays. Initializers that the model
also lists as graph inputs (IR version 4 and later) are *overridable*: a run may feed them,
otherwise their stored value is used.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import threading
import time
import warnings
import weakref
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import ModelProto

from ..ep.api import Ep, EpDevice, SessionConfig, has_kernel_sync_stream, supports
from ..errors import Fail, InvalidArgument, InvalidGraph, OnnxPlugError
from ..framework import dlpack
from ..framework.background import BackgroundCall
from ..framework.control_flow import place
from ..framework.executor import FETCH_DEVICE, FETCH_HOST
from ..framework.graph_capture import DEFAULT_CACHE_SIZE, GraphCapture
from ..framework.memory import CPU, CPU_MEMORY, Device, DeviceTensor
from ..framework.profiler import SESSION, Profiler, reserve_trace_file, write_trace
from ..framework.tuning import check_tuning_results
from ..ir.export import model_to_proto
from ..ir.graph import Graph, graph_from_model, read_only
from ..ir.model import load_model
from ..ir.types import ValueType, elem_type_name, elem_type_of, np_dtype
from ..optimizer.passes import disabled_optimizers, optimize
from . import log
from .build import BuildContext, FusionTarget, build_runner, make_constant_folder
from .devices import (
    OrtEpAssignedNode,
    OrtEpAssignedSubgraph,
    OrtEpDevice,
    OrtExecutionProviderDevicePolicy,
    OrtMemoryInfo,
)
from .environment import Environment, get_environment
from .memory import SHRINK_RUN_KEY, USE_ENV_ALLOCATORS_KEY, SessionAllocators
from .options import (
    ExecutionMode,
    RunOptions,
    SessionOptions,
    describe_object_option,
    is_object_option,
    option_value,
)
from .value import (
    OrtValue,
    fresh_outputs,
    import_cuda_array,
    import_dlpack,
    to_numpy,
    unwrap,
)

CPU_EP = "CPUExecutionProvider"
# session config key: a requested provider that cannot be used is an error, not a warning
STRICT_PROVIDERS_KEY = "session.strict_providers"
# session config key: onnxruntime's optimizer names to skip, separated by ';'
DISABLE_OPTIMIZERS_KEY = "optimization.disable_specified_optimizers"


@dataclass(frozen=True)
class NodeArg:
    """A graph input or output as onnxruntime describes it."""

    name: str
    type: str
    shape: list[int | str | None]

    def __str__(self) -> str:
        return f"NodeArg(name='{self.name}', type='{self.type}', shape={self.shape})"


@dataclass(frozen=True)
class ModelMetadata:
    producer_name: str
    graph_name: str
    domain: str
    description: str
    graph_description: str
    version: int
    custom_metadata_map: dict[str, str]


def _node_arg(name: str, t: ValueType) -> NodeArg:
    shape: list[int | str | None] = []
    if t.kind == "tensor" and t.shape is not None:
        shape = list(t.shape)
    elif t.kind == "tensor":
        shape = []
    return NodeArg(name, t.type_str() if t.kind != "unknown" else "unknown", shape)


class InferenceSession:
    """Loads a model, partitions it over execution providers and runs it.

    ``providers`` lists provider names or ``(name, options)`` tuples in priority order;
    ``provider_options`` may give the options as a parallel list of dicts.
    """

    def __init__(
        self,
        path_or_bytes: str | bytes | os.PathLike | ModelProto,
        sess_options: SessionOptions | None = None,
        providers: list[Any] | None = None,
        provider_options: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ):
        self._sess_options = sess_options if sess_options is not None else SessionOptions()
        self._model_path = (
            str(path_or_bytes) if isinstance(path_or_bytes, (str, os.PathLike)) else None
        )
        self._env = get_environment()
        self._start_profiling()
        t_begin = time.perf_counter_ns()
        # A device provider's first session in a process spends 0.3-0.35 s initialising it
        # (plugin import, device probe, CuPy, the CUDA driver and context; H100 hosts), much of
        # it waiting on the driver: the model loads on a helper thread meanwhile. The policy's
        # choice of providers reads the model's metadata, so it waits for the model.
        eager = providers is not None or bool(self._sess_options.get_provider_entries())
        loading = _start_model_load(path_or_bytes, background=eager and _names_a_device(providers))
        # what the session holds of the environment, given back when the session goes
        self._resources = _SessionResources()
        weakref.finalize(self, self._resources.release).atexit = False
        self._eps: list[Ep] = []
        if eager:
            try:
                self._eps = self._resources.eps = self._create_eps(providers, provider_options)
            except BaseException:
                loading.result()  # a model that cannot load is reported first, as before
                raise
        proto, self._proto_meta, graph, t_loaded = loading.result()
        self._graph = graph
        if self._profiler is not None:
            how = "uri" if self._model_path is not None else "array"
            self._profiler.add(SESSION, f"model_loading_{how}", t_begin, t_loaded)
        self._apply_free_dimension_overrides(proto)
        self._apply_session_initializers()
        self._user_inputs = [vi for vi in graph.inputs if vi.name not in graph.initializers]
        # Before IR version 4 every initializer had to be listed as a graph input, so being
        # one means nothing: those stay constants (as in onnxruntime).
        overridable = proto.ir_version >= 4
        self._overridable = [
            vi for vi in graph.inputs if overridable and vi.name in graph.initializers
        ]
        # Overridable initializers become feeds with a default value: they cannot be folded
        # into constants, since a run may replace them.
        self._defaults = {vi.name: graph.initializers.pop(vi.name) for vi in self._overridable}
        if self._overridable:
            self._log(
                logging.WARNING,
                f"initializers {[vi.name for vi in self._overridable]} are also graph inputs: "
                "a run may override them, so they are not treated as constants",
            )
        self._outputs = list(graph.outputs)
        if self._sess_options.execution_mode == ExecutionMode.ORT_PARALLEL:
            self._log(
                logging.WARNING,
                "execution_mode ORT_PARALLEL: onnxplug runs nodes one after another "
                "(ORT_SEQUENTIAL); inter_op_num_threads has no threads to bound",
            )
        if not eager:
            self._eps = self._resources.eps = self._create_eps(providers, provider_options)
        self._load_embedded_tuning_results()
        cpu = next((ep for ep in self._eps if ep.name == CPU_EP), None)
        folder = make_constant_folder(cpu) if cpu is not None else None
        targets = [FusionTarget(ep) for ep in self._eps]
        disabled = _disabled_optimizers(kwargs.get("disabled_optimizers"))
        disabled |= disabled_optimizers(self._sess_options._config.get(DISABLE_OPTIMIZERS_KEY))
        before = _op_counts(graph)
        with unexpected_errors_typed("optimizing the graph"):
            level = int(self._sess_options.graph_optimization_level)
            optimize(graph, level, folder, targets, disabled)
        if max(self._sess_options.log_verbosity_level, log.default_verbosity()) >= 1:
            after = _op_counts(graph)
            self._log(
                logging.DEBUG,
                f"graph optimization (level {int(self._sess_options.graph_optimization_level)}):"
                f" {sum(before.values())} -> {sum(after.values())} nodes; removed "
                f"{dict(before - after)}, added {dict(after - before)}",
            )
        self._save_optimized_model(proto)
        with unexpected_errors_typed("building the execution plan"):
            self._build()
        self._log(
            logging.INFO,
            f"session for '{self._model_path or proto.graph.name}': providers "
            f"{self.get_providers()}, nodes per provider {self.get_ep_graph_assignment_summary()}",
        )
        for g, node, op, ep in self._assignment:
            self._log(logging.DEBUG, f"graph '{g}': {op} node '{node}' runs on {ep}")
        if self._profiler is not None:
            self._profiler.add(SESSION, "session_initialization", t_loaded, time.perf_counter_ns())

    def _start_profiling(self) -> None:
        """With ``enable_profiling``, the session's profiler and its trace file, named and
        created now (as onnxruntime does) and written by ``end_profiling()`` or, failing
        that, when the session is collected."""
        self._profiler: Profiler | None = None
        self._profile_end: weakref.finalize | None = None
        opts = self._sess_options
        if not opts.enable_profiling:
            return
        self._profiler = Profiler()
        try:
            path = reserve_trace_file(str(opts.profile_file_prefix))
        except OSError as e:
            raise InvalidArgument(
                f"profile_file_prefix '{opts.profile_file_prefix}': the profile file cannot "
                f"be created: {e}"
            ) from e
        self._profile_end = weakref.finalize(self, _write_profile_at_exit, self._profiler, path)

    def _log(self, level: int, message: str) -> None:
        """Prints ``message`` (at a logging level) if the session's log_severity_level lets
        it, tagged with the session's logid (session/log.py)."""
        opts = self._sess_options
        log.log(log.severity_of(level), message, opts.logid, opts.log_severity_level)

    # providers ----------------------------------------------------------------------------------
    def _create_eps(
        self, providers: Any, provider_options: list[dict[str, Any]] | None
    ) -> list[Ep]:
        """The requested providers, in priority order, CPU appended unless its fallback is off.

        A requested provider that cannot be used here (not installed, failed to load, no
        device) is left out with one warning saying why, as onnxruntime does; with
        ``session.disable_cpu_ep_fallback=1`` or ``session.strict_providers=1`` that is an
        error instead.
        """
        opts = self._sess_options
        registry = self._env.registry
        requests: list[tuple[str, dict[str, Any], Any]]
        if providers is not None:
            requests = list(_provider_requests(providers, provider_options))
        else:
            requests = opts.get_provider_entries() or self._policy_requests()
        first: dict[str, Any] = {}
        for r in requests:
            if r[0] in first:  # onnxruntime's warning, word for word
                warnings.warn(
                    f"Duplicate provider '{r[0]}' encountered, ignoring.", UserWarning, stacklevel=3
                )
            else:
                first[r[0]] = r
        requests = list(first.values())
        if not requests:
            available = registry.available_providers()
            if len(available) > 1:
                raise ValueError(
                    f"This onnxplug build has {available} enabled. Pass the providers parameter "
                    f"to InferenceSession, e.g. InferenceSession(path, providers={available})"
                )
            requests = [(CPU_EP, {}, None)]
        config = dict(opts._config)
        if opts.intra_op_num_threads:  # providers bound their threads (the CPU's BLAS)
            config.setdefault("session.intra_op_num_threads", str(opts.intra_op_num_threads))
        fallback_off = config.get("session.disable_cpu_ep_fallback", "0") == "1"
        strict = fallback_off or config.get(STRICT_PROVIDERS_KEY, "0") == "1"
        usable: list[tuple[str, dict[str, str], list[EpDevice] | None, Any]] = []
        unusable: list[str] = []
        for name, po, devices in requests:
            factory, why = registry.find_factory(name)
            if factory is None:
                unusable.append(why)
            else:
                usable.append((name, po, devices, factory))
        if unusable:
            why = f"{'; '.join(unusable)}. Available providers: {registry.available_providers()}"
            if strict:
                key = "session.disable_cpu_ep_fallback" if fallback_off else STRICT_PROVIDERS_KEY
                raise InvalidArgument(f"{why} (no fallback: {key}=1)")
        if not fallback_off and all(r[0] != CPU_EP for r in usable):
            usable.append((CPU_EP, {}, None, registry.find_factory(CPU_EP)[0]))
        if unusable:
            warnings.warn(
                f"{why}. Running on {[r[0] for r in usable]} instead (session config "
                f"'{STRICT_PROVIDERS_KEY}' = '1' makes this an error).",
                UserWarning,
                stacklevel=3,
            )
        eps: list[Ep] = []
        for name, po, devices, factory in usable:
            if devices is None:
                all_devs = registry.devices_of(factory)
                wanted = po.get("device_id")
                if wanted is not None:
                    devices = [d for d in all_devs if d.ep_options.get("device_id") == str(wanted)]
                    if not devices:
                        ids = [d.ep_options.get("device_id") for d in all_devs]
                        raise InvalidArgument(
                            f"{name}: device_id '{wanted}' is not one of the devices it found: {ids}"
                        )
                else:
                    devices = all_devs[:1]
            prefix = f"ep.{name.lower()}."
            ep_config = dict(config)
            objects: dict[str, Any] = {}
            for key, value in po.items():
                if is_object_option(value):  # an external allocator's callback, a stream
                    objects[prefix + key] = value
                    value = describe_object_option(value)
                ep_config[prefix + key] = option_value(value)
            self._env.ensure_transfer(factory)
            try:
                ep = factory.create_ep(list(devices), SessionConfig(ep_config, objects))
            except OnnxPlugError:
                raise
            except (ValueError, TypeError, KeyError) as e:
                raise InvalidArgument(f"{name}: {e}") from e
            eps.append(ep)
        return eps

    def _policy_requests(self) -> list[tuple[str, dict[str, str], list[EpDevice] | None]]:
        """Providers chosen by SessionOptions.set_provider_selection_policy(_delegate): the
        EP devices the delegate returns, or by policy GPU devices (PREFER_GPU,
        MAX_PERFORMANCE) or NPU devices (PREFER_NPU, MAX_EFFICIENCY, MIN_OVERALL_POWER)
        before the CPU; DEFAULT and PREFER_CPU choose the CPU, as in onnxruntime."""
        opts = self._sess_options
        if opts._policy_delegate is None and opts._policy is None:
            return []
        devices = [OrtEpDevice(d) for d in self._env.registry.ep_devices()]
        if opts._policy_delegate is not None:
            chosen = list(
                opts._policy_delegate(
                    devices, dict(self._proto_meta.custom_metadata_map), {}, len(devices)
                )
                or []
            )
            if not all(isinstance(d, OrtEpDevice) for d in chosen):
                raise InvalidArgument(
                    "the provider selection delegate must return OrtEpDevices from the list "
                    "it was given"
                )
        else:
            P = OrtExecutionProviderDevicePolicy
            kind = {P.PREFER_GPU: "GPU", P.MAX_PERFORMANCE: "GPU", P.PREFER_NPU: "NPU"}.get(
                opts._policy,
                "NPU" if opts._policy in (P.MAX_EFFICIENCY, P.MIN_OVERALL_POWER) else "",
            )
            chosen = [d for d in devices if kind and d.device.type.name == kind]
            chosen += [d for d in devices if d.ep_name == CPU_EP]
        by_ep: dict[str, list[EpDevice]] = {}
        for d in chosen:
            by_ep.setdefault(d.ep_name, []).append(d.ep_device)
        return [(name, {}, devs) for name, devs in by_ep.items()]

    # building -----------------------------------------------------------------------------------
    def _save_optimized_model(self, proto: ModelProto) -> None:
        """Writes the optimized graph to ``optimized_model_filepath`` (ONNX), its initializers
        to an external file where ``session.optimized_model_external_initializers_file_name``
        names one, as onnxruntime does."""
        path = self._sess_options.optimized_model_filepath
        if not path:
            return
        config = self._sess_options._config
        fmt = config.get("session.save_model_format", "ONNX").upper()
        if fmt != "ONNX" or str(path).lower().endswith(".ort"):
            raise InvalidArgument(
                f"optimized_model_filepath '{path}': onnxplug writes ONNX models only (not "
                "onnxruntime's .ort format); use a .onnx path"
            )
        model = model_to_proto(self._graph, proto, self._defaults)
        external = config.get("session.optimized_model_external_initializers_file_name")
        try:
            if external:
                threshold = config.get(
                    "session.optimized_model_external_initializers_min_size_in_bytes", "1024"
                )
                onnx.save(
                    model,
                    str(path),
                    save_as_external_data=True,
                    all_tensors_to_one_file=True,
                    location=external,
                    size_threshold=int(threshold),
                )
            else:
                onnx.save(model, str(path))
        except (OSError, ValueError) as e:
            raise InvalidArgument(
                f"optimized_model_filepath '{path}': the optimized model cannot be written: {e}"
            ) from e
        self._log(logging.INFO, f"optimized model written to '{path}'")

    def _apply_session_initializers(self) -> None:
        """SessionOptions.add_initializer values replace the model's initializers."""
        for name, value in self._sess_options._initializers.items():
            old = self._graph.initializers.get(name)
            if old is None:
                raise InvalidArgument(
                    f"add_initializer('{name}'): the model has no initializer of that name"
                )
            arr = np.asarray(to_numpy(unwrap(value)))
            if arr.dtype.kind in "US":
                arr = arr.astype(object)
            if arr.dtype != old.dtype or arr.shape != old.shape:
                raise InvalidArgument(
                    f"add_initializer('{name}'): the value is {_type_name(arr.dtype)}"
                    f"{list(arr.shape)}, the model's initializer is {_type_name(old.dtype)}"
                    f"{list(old.shape)}"
                )
            self._graph.initializers[name] = read_only(arr)

    def _apply_free_dimension_overrides(self, proto: ModelProto) -> None:
        """SessionOptions.add_free_dimension_override_by_name/_by_denotation fix symbolic
        dimensions of the graph inputs and outputs; feeds must then match them, and
        get_inputs()/get_outputs() report them, as in onnxruntime."""
        opts = self._sess_options
        by_name, by_den = opts._free_dims_by_name, opts._free_dims_by_denotation
        if not by_name and not by_den:
            return
        denotations = {
            vi.name: [d.denotation for d in vi.type.tensor_type.shape.dim]
            for vi in (*proto.graph.input, *proto.graph.output)
            if vi.type.HasField("tensor_type")
        }
        g = self._graph
        for values in (g.inputs, g.outputs):
            for k, vi in enumerate(values):
                t = vi.type
                if t.kind != "tensor" or t.shape is None:
                    continue
                dens = denotations.get(vi.name, [])
                dims = list(t.shape)
                for j, d in enumerate(dims):
                    if isinstance(d, int):
                        continue
                    den = dens[j] if j < len(dens) else ""
                    if den and den in by_den:
                        dims[j] = by_den[den]
                    elif isinstance(d, str) and d in by_name:
                        dims[j] = by_name[d]
                if dims != list(t.shape):
                    nt = dataclasses.replace(t, shape=tuple(dims))
                    values[k] = type(vi)(vi.name, nt)
                    g.value_types[vi.name] = nt

    def _build(self) -> None:
        # Runs of a session whose every provider is the CPU take turns. Run concurrently they
        # only share one interpreter lock, handed over at every numpy call: with 4 threads on
        # 2 cores a small CNN made 1,238 runs/s instead of 4,084 with one, spending 1,011 us
        # of CPU per run instead of 245 (43 % of it in the kernel, switching threads). Taking
        # turns keeps 3,400-3,900 runs/s at any thread count; large kernels still use every
        # core through BLAS. ``session.serialize_cpu_runs=0`` turns it off.
        serialize = self._sess_options._config.get("session.serialize_cpu_runs", "1") != "0"
        cpu_only = all(ep.device.is_cpu for ep in self._eps)
        self._run_slot: Any = (
            threading.Lock() if serialize and cpu_only else contextlib.nullcontext()
        )
        use_env = self._sess_options._config.get(USE_ENV_ALLOCATORS_KEY, "0") == "1"
        self._memory = self._resources.memory = SessionAllocators(self._env, use_env)
        ctx = BuildContext(self._eps, self._env.transfer, self._memory.allocator_for)
        self._runner, self._feed_devices = build_runner(self._graph, ctx)
        self._resources.runner = self._runner
        # the runner's feeds: graph inputs that are not (constant) initializers, in order
        self._feed_vis = [
            vi for vi in self._graph.inputs if vi.name not in self._graph.initializers
        ]
        self._feed_names = [vi.name for vi in self._feed_vis]
        self._feed_index = {n: i for i, n in enumerate(self._feed_names)}
        self._required = [
            i
            for i, vi in enumerate(self._feed_vis)
            if vi.type.kind != "optional" and vi.name not in self._defaults
        ]
        self._output_names = [vi.name for vi in self._outputs]
        self._output_index = {n: i for i, n in enumerate(self._output_names)}
        self._all_outputs = list(range(len(self._output_names)))
        self._fetch_all = {m: [m] * len(self._output_names) for m in (FETCH_HOST, FETCH_DEVICE)}
        # (graph, node, op, ep) of every step, and each node's domain
        self._assignment = [r[:4] for r in ctx.records]
        self._assignment_domains = [r[4] for r in ctx.records]
        runner = self._runner
        runner.plan.plan_outputs = True  # run() copies the outputs out: they live in the plan
        runner.profiler = self._profiler if self._profiling() else None
        self._allocators = runner.plan.allocators
        capturing = {
            ep.name: ep
            for ep in self._eps
            if supports(getattr(ep.factory, "api_version", 1), "graph_capture")
            and ep.is_graph_capture_enabled()
        }
        if capturing:
            runner.capture = GraphCapture(runner, capturing, self._graph_cache_size())
        # onnxruntime serialises the runs of a session whose providers cannot run
        # concurrently (a unified stream, a user's stream), and of a device provider written
        # against a plugin API without the kernel sync stream (its workspaces are untagged)
        serial = not all(
            ep.is_concurrent_run_supported() and (ep.device.is_cpu or has_kernel_sync_stream(ep))
            for ep in self._eps
        )
        self._run_lock: threading.Lock | None = threading.Lock() if serial else None
        self._input_checks = [_TensorCheck.of(vi.name, vi.type) for vi in self._feed_vis]
        # (dtype, shape) of the tensor feeds whose every dim is a number: a numpy array of
        # exactly that needs none of _coerce's conversions and checks
        self._static_feeds = [
            (c.dtype, c.shape)
            if vi.type.kind == "tensor"
            and c.dtype is not None
            and c.dtype.kind not in "USO"
            and c.shape is not None
            and all(type(d) is int for d in c.shape)
            else None
            for vi, c in zip(self._feed_vis, self._input_checks)
        ]
        # overridable initializers' stored values, placed once where the runner wants them
        self._default_feeds: dict[int, Any] = {}
        for name, value in self._defaults.items():
            i = self._feed_index[name]
            dev = self._feed_devices[i] if i < len(self._feed_devices) else None
            self._default_feeds[i] = place(
                value, dev, self._env.transfer, self._allocators, reserve=True
            )

    def _graph_cache_size(self) -> int:
        key = "session.graph_capture_cache_size"
        raw = self._sess_options._config.get(key, str(DEFAULT_CACHE_SIZE))
        try:
            n = int(raw)
        except ValueError:
            n = 0
        if n < 1:
            raise InvalidArgument(
                f"session config entry '{key}' must be a positive integer (captured graphs "
                f"kept per thread), not {raw!r}"
            )
        return n

    # introspection ------------------------------------------------------------------------------
    def get_inputs(self) -> list[NodeArg]:
        return [_node_arg(vi.name, vi.type) for vi in self._user_inputs]

    def get_outputs(self) -> list[NodeArg]:
        return [_node_arg(vi.name, vi.type) for vi in self._outputs]

    def get_overridable_initializers(self) -> list[NodeArg]:
        return [_node_arg(vi.name, vi.type) for vi in self._overridable]

    def get_modelmeta(self) -> ModelMetadata:
        return self._proto_meta

    def get_providers(self) -> list[str]:
        return [ep.name for ep in self._eps]

    def get_provider_options(self) -> dict[str, dict[str, str]]:
        return {ep.name: dict(ep.get_provider_options()) for ep in self._eps}

    def get_session_options(self) -> SessionOptions:
        return self._sess_options

    # tuning results (onnxruntime's TunableOp) --------------------------------------------------
    def get_tuning_results(self) -> list[dict[str, Any]]:
        """The tuning results of each provider that tunes (``{"ep", "results",
        "validators"}``), for ``set_tuning_results`` in another session or process, or for
        ``onnxruntime.tools.offline_tuning embed`` into a model."""
        return [
            ctx.get_tuning_results()
            for ep in self._eps
            if (ctx := ep.get_tuning_context()) is not None
        ]

    def set_tuning_results(self, results: Any, *, error_on_invalid: bool = False) -> None:
        """Give providers tuning results (a list of what ``get_tuning_results`` returns).
        Results for a provider the session does not have, one that does not tune, or whose
        validators do not match are skipped with a warning, or raise with
        ``error_on_invalid``. They are used where the provider's TunableOp is enabled."""
        self._set_tuning_results(results, error_on_invalid, auto_enable=False)

    def _set_tuning_results(self, results: Any, error_on_invalid: bool, auto_enable: bool) -> None:
        try:
            checked = check_tuning_results(results)
        except ValueError as e:
            raise InvalidArgument(str(e)) from None
        for i, tr in enumerate(checked):
            ep = next((e for e in self._eps if e.name == tr["ep"]), None)
            ctx = ep.get_tuning_context() if ep is not None else None
            msg: str | None = None
            if ep is None:
                msg = f"Cannot find execution provider {tr['ep']}"
            elif ctx is None:
                msg = f"Invalid TuningResults (index={i}). {tr['ep']} does not support TunableOp."
            elif (reason := ctx.load_tuning_results(tr)) is not None:
                msg = f"Failed to load TuningResults (index={i}). Reason: {reason}"
            if msg is not None:
                if error_on_invalid:
                    raise Fail(msg)
                self._log(logging.WARNING, msg)
            elif auto_enable and ctx is not None:
                self._log(logging.INFO, f"tuning results set for {tr['ep']}: TunableOp enabled")
                ctx.enable_tunable_op()

    def _load_embedded_tuning_results(self) -> None:
        """Tuning results a model carries in its ``tuning_results`` metadata (what
        ``onnxruntime.tools.offline_tuning embed`` writes) are given to the providers before
        their kernels are made, and turn their TunableOp on, as in onnxruntime."""
        raw = self._proto_meta.custom_metadata_map.get("tuning_results")
        if raw is None:
            return
        try:
            results = json.loads(raw)
        except ValueError as e:
            raise InvalidArgument(
                f"the model's 'tuning_results' metadata is not JSON: {e}"
            ) from None
        try:
            self._set_tuning_results(results, error_on_invalid=False, auto_enable=True)
        except InvalidArgument as e:
            raise InvalidArgument(f"the model's 'tuning_results' metadata: {e.message}") from None

    def get_provider_graph_assignment_info(self) -> list[OrtEpAssignedSubgraph]:
        """Which provider runs each node (copy nodes included, subgraphs flattened): one
        ``OrtEpAssignedSubgraph`` (``ep_name``, ``get_nodes()``) per node, as onnxruntime
        reports its kernel-based providers.

        onnxruntime requires ``session.record_ep_graph_assignment_info=1``; we always record.
        """
        return [
            OrtEpAssignedSubgraph(ep, [OrtEpAssignedNode(n, op, dom, g)])
            for (g, n, op, ep), dom in zip(self._assignment, self._assignment_domains)
        ]

    def get_ep_graph_assignment_summary(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for _, _, _, ep in self._assignment:
            out[ep] = out.get(ep, 0) + 1
        return out

    def _memory_info_of(self, device: Device | None) -> OrtMemoryInfo:
        if device is None or device.is_cpu and not device.vendor_id:
            return OrtMemoryInfo.of(CPU_MEMORY)
        for d in self._env.registry.ep_devices():
            for mi in (d.memory_info, d.host_accessible_memory_info):
                if mi is not None and mi.device == device:
                    return OrtMemoryInfo.of(mi)
        return OrtMemoryInfo.of(Environment.memory_info_for(None, device))

    def _output_devices(self) -> list[Device | None]:
        plan = self._runner.plan
        where: dict[int, Device | None] = dict(zip(plan.feed_slots, plan.feed_devices))
        for step in plan.steps:
            where.update(zip(step.out_slots, step.out_devices))
        return [where.get(s) for s in plan.output_slots]

    def get_input_memory_infos(self) -> list[OrtMemoryInfo]:
        """Where each input (``get_inputs()`` order) is wanted by the nodes that read it."""
        return [self._memory_info_of(self._input_device(vi.name)) for vi in self._user_inputs]

    def get_output_memory_infos(self) -> list[OrtMemoryInfo]:
        """Where each output is produced."""
        return [self._memory_info_of(d) for d in self._output_devices()]

    def get_input_epdevices(self) -> list[OrtEpDevice | None]:
        """The EP device whose memory each input is wanted in (None: any)."""
        out: list[OrtEpDevice | None] = []
        for vi in self._user_inputs:
            dev = self._input_device(vi.name) or CPU
            match = [
                ep.ep_device
                for ep in self._eps
                if ep.ep_device is not None and ep.ep_device.memory_info.device == dev
            ]
            out.append(OrtEpDevice(match[0]) if match else None)
        return out

    def _input_device(self, name: str) -> Device | None:
        i = self._feed_index.get(name)
        return self._feed_devices[i] if i is not None and i < len(self._feed_devices) else None

    def set_providers(
        self,
        providers: list[Any] | None = None,
        provider_options: list[dict[str, Any]] | None = None,
    ) -> None:
        self._runner.close()
        old = self._resources.memory
        for ep in self._eps:
            ep.release()
        self._eps = self._resources.eps = self._create_eps(providers, provider_options)
        self._load_embedded_tuning_results()
        self._build()
        if old is not None:
            old.release()

    def disable_fallback(self) -> None:
        """Kept for API compatibility: onnxplug never silently switches providers."""

    def enable_fallback(self) -> None:
        """Kept for API compatibility: onnxplug never silently switches providers."""

    # running ------------------------------------------------------------------------------------
    def _prepare_feeds(self, input_feed: dict[str, Any]) -> list[Any]:
        if not isinstance(input_feed, dict):
            raise InvalidArgument(
                f"input_feed must be a dict of name -> array, not {type(input_feed).__name__}"
            )
        n = len(self._feed_names)
        feeds: list[Any] = [None] * n
        seen = [False] * n
        for name, value in input_feed.items():
            i = self._feed_index.get(name)
            if i is None:
                raise InvalidArgument(
                    f"Invalid input name: {name}. The model's inputs are "
                    f"{[vi.name for vi in self._user_inputs]}"
                )
            static = self._static_feeds[i]
            if (
                static is not None
                and type(value) is np.ndarray
                and value.dtype == static[0]
                and value.shape == static[1]
            ):
                feeds[i] = value  # what _coerce would return, without its checks
            else:
                feeds[i] = _coerce(name, self._feed_vis[i].type, value, self._input_checks[i])
            seen[i] = True
        missing = [self._feed_names[i] for i in self._required if not seen[i]]
        if missing:
            raise InvalidArgument(
                f"Required inputs ({missing}) are missing from input feed ({list(input_feed)})"
            )
        for i in self._default_feeds:
            if not seen[i]:
                feeds[i] = self._default_feeds[i]
        # the runner places each feed where its readers want it (staged into the plan's
        # buffers, asynchronously)
        return feeds

    def _output_indices(self, output_names: list[str] | None) -> list[int]:
        if not output_names:
            return self._all_outputs
        idx = []
        for n in output_names:
            i = self._output_index.get(n)
            if i is None:
                raise InvalidArgument(
                    f"Invalid output name: {n}. The model's outputs are {self._output_names}"
                )
            idx.append(i)
        return idx

    def _run_values(
        self, feeds: list[Any], run_options: RunOptions | None, fetch: list[Any]
    ) -> list[Any]:
        """One run; ``fetch`` says per graph output what to deliver (see the executor)."""
        if run_options is not None and run_options.terminate:
            raise Fail("Exiting due to terminate flag being set to true.")
        lock = self._run_lock
        if lock is not None:
            with lock:
                return self._run_locked(feeds, run_options, fetch)
        return self._run_locked(feeds, run_options, fetch)

    def _run_locked(
        self, feeds: list[Any], run_options: RunOptions | None, fetch: list[Any]
    ) -> list[Any]:
        eps = self._eps
        profiler = self._profiler if self._profiling() else None
        run_profile = None
        if run_options is not None and run_options.enable_profiling:
            if profiler is not None:  # onnxruntime's warning, word for word
                self._log(
                    logging.WARNING,
                    "RunOptions requests profiling but session-level profiling is already "
                    "enabled. Ignoring run-level profiling request.",
                )
            else:
                profiler, run_profile = self._start_run_profile(run_options)
        t0 = time.perf_counter_ns()
        for ep in eps:
            ep.on_run_start(run_options)
        try:
            with self._run_slot:
                outs = self._runner.run(feeds, run_options, fetch, profiler)
            if profiler is not None:
                profiler.add(SESSION, "model_run", t0, time.perf_counter_ns())
            return outs
        finally:
            for ep in eps:
                ep.on_run_end(run_options, True)
            self._after_run(run_options)
            if run_profile is not None:
                self._log(logging.INFO, f"run profile written to '{run_profile()}'")

    def _start_run_profile(self, run_options: RunOptions) -> tuple[Profiler, Any]:
        """A profiler for one run (``RunOptions.enable_profiling``), and the call that
        writes its trace to a new file named after ``RunOptions.profile_file_prefix``."""
        profiler = Profiler()
        prefix = str(run_options.profile_file_prefix)
        try:
            path = reserve_trace_file(prefix)
        except OSError as e:
            raise InvalidArgument(
                f"RunOptions.profile_file_prefix '{prefix}': the profile file cannot be "
                f"created: {e}"
            ) from e
        return profiler, lambda: _write_profile(profiler, path)

    def _fetch(self, idx: list[int], mode: Any) -> list[Any]:
        if idx is self._all_outputs:
            return self._fetch_all[mode]
        fetch: list[Any] = [None] * len(self._output_names)
        for i in idx:
            fetch[i] = mode
        return fetch

    def run(
        self,
        output_names: list[str] | None,
        input_feed: dict[str, Any],
        run_options: RunOptions | None = None,
    ) -> list[Any]:
        """Run the model: numpy (or OrtValue) inputs by name, numpy outputs in order."""
        idx = self._output_indices(output_names)
        feeds = self._prepare_feeds(input_feed)
        outs = self._run_values(feeds, run_options, self._fetch(idx, FETCH_HOST))
        return fresh_outputs([to_numpy(outs[i]) for i in idx], feeds)

    def run_with_ort_values(
        self,
        output_names: list[str] | None,
        input_dict_ort_values: dict[str, Any],
        run_options: RunOptions | None = None,
    ) -> list[OrtValue]:
        idx = self._output_indices(output_names)
        feeds = self._prepare_feeds(input_dict_ort_values)
        outs = self._run_values(feeds, run_options, self._fetch(idx, FETCH_DEVICE))
        return [OrtValue(v) for v in fresh_outputs([outs[i] for i in idx], feeds)]

    def run_with_ortvaluevector(
        self,
        run_options: RunOptions | None,
        feed_names: list[str],
        feeds: list[Any],
        fetch_names: list[str],
        fetches: list[Any],
        fetch_devices: list[Any] | None = None,
    ) -> None:
        """onnxruntime's low-level form: ``fetches`` (a list) receives the output OrtValues."""
        if len(feed_names) != len(feeds):
            raise InvalidArgument(
                f"{len(feed_names)} feed names for {len(feeds)} feeds; they must pair up"
            )
        outs = self.run_with_ort_values(fetch_names, dict(zip(feed_names, feeds)), run_options)
        fetches[:] = outs

    def run_async(self, output_names, input_feed, callback, user_data, run_options=None) -> None:
        def work() -> None:
            try:
                res = self.run(output_names, input_feed, run_options)
                callback(res, user_data, "")
            except Exception as e:  # the callback gets the error text, like onnxruntime
                callback(None, user_data, str(e))

        threading.Thread(target=work, daemon=True).start()

    def io_binding(self) -> Any:
        from .io_binding import IOBinding

        return IOBinding(self)

    def _allocators_for(self, device: Device) -> dict[Device, Any]:
        if device.is_cpu:
            return {}
        alloc, _ = self._env.allocator_for_device(device.type, device.id)
        return {device: alloc}

    def run_with_iobinding(self, iobinding: Any, run_options: RunOptions | None = None) -> None:
        iobinding._run(run_options)

    # graph capture --------------------------------------------------------------------------
    def release_captured_graph(self, graph_annotation_id: int) -> None:
        """Release the captured graphs of an annotation id (``gpu_graph_id``), on every
        thread; the next run with that id warms up and captures again."""
        capture = self._runner.capture
        if capture is None:
            raise InvalidArgument(
                "release_captured_graph: no provider of this session captures graphs "
                "(enable it with the provider option enable_cuda_graph=1)"
            )
        if capture.release(int(graph_annotation_id)) == 0:
            raise InvalidArgument(
                f"release_captured_graph: no captured graph has annotation id {graph_annotation_id}"
            )

    # memory -------------------------------------------------------------------------------------
    def get_allocator_stats(self) -> dict[str, dict[str, int]]:
        """Statistics of the allocators this session runs with, by device (``"cuda:0"``):
        onnxruntime's keys (``InUse``, ``MaxInUse``, ``TotalAllocated``, ``Limit``,
        ``NumAllocs``, ``NumReserves``, ``NumArenaExtensions``, ``NumArenaShrinkages``,
        ``MaxAllocSize``). A device's arena is shared by the sessions using that device, so
        the figures include theirs. Host tensors are numpy arrays and have no allocator."""
        return self._memory.stats()

    def shrink_memory_arenas(self, devices: str | None = None) -> None:
        """Give the unused regions of this session's arenas back to their devices: all of
        them, or those ``devices`` lists (``"gpu:0"``, ``"cpu:0;gpu:0"``, ``"cuda:1"``), like
        the run option ``memory.enable_memory_arena_shrinkage``. The session first lets go
        of the memory-plan blocks of its idle execution frames (the next run of a shape
        makes a new frame), so the memory of an earlier large input comes back too."""
        targets = self._memory.shrink_targets(devices)
        self._runner.release_frames()
        for allocator in targets:
            allocator.shrink()

    def record_memory_usage(self) -> Any:
        """A context manager: while its block runs, the bytes in use of this session's arenas
        are recorded after every allocation and free, and when it ends the dict it yields
        holds ``{device: [(seconds since the start, bytes in use), ...]}``. A device's arena
        is shared, so other sessions' activity on it shows too. ``onnxplug run --memory-plot``
        draws it."""
        return self._memory.record_usage()

    def _after_run(self, run_options: RunOptions | None) -> None:
        """Memory work at the end of every run: the run option
        ``memory.enable_memory_arena_shrinkage`` shrinks the devices it lists."""
        if run_options is not None:
            spec = run_options.get(SHRINK_RUN_KEY)
            if spec:
                self.shrink_memory_arenas(spec)

    # profiling ----------------------------------------------------------------------------------
    def _profiling(self) -> bool:
        return self._profile_end is not None and self._profile_end.alive

    def end_profiling(self) -> str:
        """Stop profiling and write the trace (onnxruntime's format, see
        ``framework/profiler.py``); its path. "" when the session does not profile, or no
        longer: profiling ends with the first call, as in onnxruntime."""
        end = self._profile_end.detach() if self._profile_end is not None else None
        if end is None:
            return ""
        self._runner.profiler = None
        _, _, (profiler, path), _ = end
        return _write_profile(profiler, path)

    def get_profiling_start_time_ns(self) -> int:
        """When profiling started (epoch nanoseconds; a trace's ``ts`` counts microseconds
        from it); 0 for a session that does not profile, as in onnxruntime."""
        return self._profiler.start_ns if self._profiler is not None else 0


def _write_profile(profiler: Profiler, path: str) -> str:
    """Stop ``profiler`` and write its events to ``path``; the path."""
    write_trace(path, profiler.end())
    return path


def _write_profile_at_exit(profiler: Profiler, path: str) -> None:
    """The trace of a session collected (or alive at exit) without ``end_profiling()``, as
    onnxruntime writes it when a session is destroyed; a failure is a warning."""
    try:
        _write_profile(profiler, path)
    except OSError as e:
        log.log(log.severity_of(logging.WARNING), f"the profile '{path}' was not written: {e}")


# What a session-creation error that no check anticipated says first (tools.fuzz counts these
# as bugs to fix: every malformed model should meet a check that names the problem).
UNEXPECTED = "unexpected error while"


# (proto, metadata, graph, the perf_counter_ns when loaded)
_Loaded = tuple[ModelProto, ModelMetadata, Graph, int]


def _start_model_load(path_or_bytes: Any, background: bool) -> BackgroundCall[_Loaded]:
    """The model loaded and made our graph, on a helper thread (``background``) or at once:
    the call's ``result()`` is (proto, metadata, graph, the perf_counter_ns when loaded), or
    the loading error, raised in the caller's thread."""

    def load() -> _Loaded:
        with unexpected_errors_typed("loading the model"):
            loaded = load_model(path_or_bytes)
            proto = loaded.proto
            graph = graph_from_model(proto, loaded.weights)
            del loaded
            return proto, _metadata(proto), graph, time.perf_counter_ns()

    return BackgroundCall(load, "onnxplug-model-load", background)


def _names_a_device(providers: Any) -> bool:
    """Whether a providers argument asks for a provider other than the CPU (whose set-up is
    worth overlapping with loading the model); None (session options' entries) counts."""
    if providers is None:
        return True
    for p in providers:
        name = p[0] if isinstance(p, (tuple, list)) and p else p
        if name != CPU_EP:
            return True
    return False


@contextlib.contextmanager
def unexpected_errors_typed(stage: str) -> Iterator[None]:
    """Session creation raises onnxruntime's exception classes only: an exception of any other
    type (a malformed model reaching code that trusted it) becomes ``Fail`` naming the stage
    and the original error, which stays chained as the cause."""
    try:
        yield
    except OnnxPlugError:
        raise
    except Exception as e:
        raise Fail(f"{UNEXPECTED} {stage}: {type(e).__name__}: {e}") from e


class _SessionResources:
    """The runner, providers and allocator references of a session, released when it is
    collected: the runner's frames first (their scratch caches give their free blocks back to
    the allocators, a user's external one included), then the providers."""

    def __init__(self) -> None:
        self.runner: Any = None
        self.eps: list[Ep] = []
        self.memory: SessionAllocators | None = None

    def release(self) -> None:
        runner, self.runner = self.runner, None
        if runner is not None:
            try:
                runner.close()
            except Exception as e:  # the providers' resources go all the same
                log.log(log.severity_of(logging.WARNING), f"closing the session's runs failed: {e}")
        eps, self.eps = self.eps, []
        for ep in eps:
            try:
                ep.release()
            except Exception as e:  # a failing provider must not keep the others' resources
                log.log(log.severity_of(logging.WARNING), f"releasing {ep.name} failed: {e}")
        if self.memory is not None:
            self.memory.release()
            self.memory = None


@dataclasses.dataclass(frozen=True)
class _TensorCheck:
    """What a tensor feed must be: element type (None: any) and shape (None: any rank)."""

    name: str
    dtype: np.dtype | None
    shape: tuple[int | str | None, ...] | None

    @staticmethod
    def of(name: str, t: ValueType) -> _TensorCheck:
        while t.kind in ("optional", "sequence") and t.inner is not None:
            t = t.inner  # a sequence's or optional's items are checked like tensors
        if t.kind != "tensor" or not t.elem_type:
            return _TensorCheck(name, None, None)
        try:
            dt = np_dtype(t.elem_type)
        except ValueError:
            dt = None
        return _TensorCheck(name, dt, t.shape)


_ANY = ValueType("unknown")
_PY_LITERALS = (bool, int, float, complex, str, bytes, list, tuple)


def _coerce(name: str, vt: ValueType, value: Any, check: _TensorCheck) -> Any:
    """A feed as the runtime holds it (arrays, lists, None), or InvalidArgument naming it."""
    value = unwrap(value)
    kind = vt.kind
    if kind == "optional":
        if value is None:
            return None
        return _coerce(name, vt.inner or _ANY, value, check)
    if value is None:
        raise InvalidArgument(
            f"input '{name}' is None, but only an optional input may be empty "
            f"(its type is {vt.type_str()})"
        )
    if kind == "sequence":
        if not isinstance(value, (list, tuple)):
            raise InvalidArgument(
                f"input '{name}' is a {vt.type_str()}: feed a list of arrays, not "
                f"{type(value).__name__}"
            )
        inner = vt.inner or _ANY
        return [_coerce(f"{name}[{k}]", inner, v, check) for k, v in enumerate(value)]
    if kind == "map":
        if not isinstance(value, dict):
            raise InvalidArgument(
                f"input '{name}' is a {vt.type_str()}: feed a dict, not {type(value).__name__}"
            )
        return value
    return _coerce_tensor(name, value, check)


def _coerce_tensor(name: str, value: Any, check: _TensorCheck) -> Any:
    dt, shape = check.dtype, check.shape
    if not isinstance(value, (np.ndarray, DeviceTensor)):
        if isinstance(value, np.generic):
            value = np.asarray(value)  # a numpy scalar keeps its dtype
        elif isinstance(value, _PY_LITERALS):
            value = _from_python(name, value, dt)
        elif hasattr(value, "__dlpack__") or dlpack.is_capsule(value):
            try:  # a PyTorch/CuPy/JAX tensor: used in place, where it is
                value = import_dlpack(value)
            except (InvalidArgument, TypeError, BufferError) as e:
                raise InvalidArgument(f"input '{name}': {e}") from e
        elif hasattr(value, "__cuda_array_interface__"):
            try:
                value = import_cuda_array(value)
            except (InvalidArgument, TypeError, KeyError, ValueError) as e:
                raise InvalidArgument(f"input '{name}': {e}") from e
        else:
            raise InvalidArgument(
                f"input '{name}' must be a numpy array, an OrtValue, an object with __dlpack__ "
                f"or a Python number or list, not {type(value).__name__}"
            )
    if isinstance(value, np.ndarray) and value.dtype.kind in "US":
        value = value.astype(object)  # string tensors are object arrays
    if dt is not None and value.dtype != dt:
        raise InvalidArgument(
            f"Unexpected input data type. Actual: (tensor({_type_name(value.dtype)})) , "
            f"expected: (tensor({_type_name(dt)})) for input '{name}'"
        )
    if shape is not None:
        if len(value.shape) != len(shape):
            raise InvalidArgument(
                f"Invalid rank for input: {name} Got: {len(value.shape)} Expected: "
                f"{len(shape)} Please fix either the inputs/outputs or the model."
            )
        bad = [
            (k, got, want)
            for k, (got, want) in enumerate(zip(value.shape, shape))
            if isinstance(want, int) and got != want
        ]
        if bad:
            lines = "".join(f" index: {k} Got: {g} Expected: {w}\n" for k, g, w in bad)
            raise InvalidArgument(
                f"Got invalid dimensions for input: {name} for the following indices\n"
                f"{lines} Please fix either the inputs/outputs or the model."
            )
    return value


def _from_python(name: str, value: Any, dt: np.dtype | None) -> np.ndarray:
    """Python numbers and lists carry no element type: they take the model's, unless that
    would lose information (a float literal for an integer input)."""
    arr = np.asarray(value)
    if arr.dtype.kind in "US":
        return arr.astype(object)
    if dt is None or arr.dtype == dt:
        return arr
    if dt == np.dtype(object):
        raise InvalidArgument(f"input '{name}' is a string tensor; got {arr.dtype} values")
    kinds = "biufc"
    same_kind = (
        arr.dtype.kind in kinds
        and (dt.kind in kinds or dt.kind == "V")  # "V": ml_dtypes types (bfloat16, float8...)
        and kinds.index(arr.dtype.kind) <= kinds.index(dt.kind if dt.kind in kinds else "f")
    )
    if not same_kind:
        raise InvalidArgument(
            f"Unexpected input data type. Actual: (tensor({_type_name(arr.dtype)})) , "
            f"expected: (tensor({_type_name(dt)})) for input '{name}'"
        )
    return arr.astype(dt)


def _disabled_optimizers(names: Any) -> frozenset[str]:
    """InferenceSession's ``disabled_optimizers`` argument: optimizer names (a list, set or
    tuple of strings, or one name)."""
    if names is None or isinstance(names, str):
        return disabled_optimizers([names] if names else None)
    try:
        items = list(names)
    except TypeError:
        items = [names]
    bad = [n for n in items if not isinstance(n, str)]
    if bad:
        raise InvalidArgument(
            f"disabled_optimizers must be optimizer names (strings), got {bad[0]!r} "
            f"({type(bad[0]).__name__})"
        )
    return disabled_optimizers(items)


def _op_counts(graph: Graph) -> Counter[str]:
    """Nodes per op type (domain-qualified outside the default domain)."""
    return Counter(f"{n.domain}.{n.op_type}" if n.domain else n.op_type for n in graph.nodes)


def _provider_requests(
    providers: Any, provider_options: list[dict[str, Any]] | None
) -> list[tuple[str, dict[str, str], None]]:
    """``providers`` (names or (name, options) tuples; a bare name is one provider) as
    (name, options, devices) requests."""
    if isinstance(providers, str):
        providers = [providers]
    providers = list(providers)
    if provider_options is not None and len(provider_options) != len(providers):
        raise InvalidArgument(
            f"provider_options has {len(provider_options)} entries for {len(providers)} providers"
        )
    requests: list[tuple[str, dict[str, str], None]] = []
    for k, p in enumerate(providers):
        if isinstance(p, tuple):
            if len(p) != 2 or not isinstance(p[0], str):
                raise InvalidArgument(f"provider entry {p!r} must be (name, options dict)")
            name, po = p[0], dict(p[1] or {})
        elif isinstance(p, str):
            name, po = p, {}
        else:
            raise InvalidArgument(f"provider entry {p!r} must be a name or (name, options)")
        if provider_options is not None:
            po.update(provider_options[k] or {})
        requests.append((name, {str(a): option_value(b) for a, b in po.items()}, None))
    return requests


def _type_name(dt: np.dtype) -> str:
    try:
        return elem_type_name(elem_type_of(dt))
    except ValueError:
        return str(dt)


def _metadata(proto: ModelProto) -> ModelMetadata:
    return ModelMetadata(
        producer_name=proto.producer_name,
        graph_name=proto.graph.name,
        domain=proto.domain,
        description=proto.doc_string,
        graph_description=proto.graph.doc_string,
        version=int(proto.model_version),
        custom_metadata_map={p.key: p.value for p in proto.metadata_props},
    )


__all__ = ["CPU", "Device", "Fail", "InferenceSession", "InvalidGraph", "ModelMetadata", "NodeArg"]
