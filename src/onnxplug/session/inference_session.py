"""``InferenceSession``: onnxruntime's Python API on top of the plugin providers."""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from onnx import ModelProto

from ..ep.api import Ep, EpDevice, SessionConfig
from ..errors import Fail, InvalidArgument, InvalidGraph, OnnxPlugError
from ..framework.control_flow import place
from ..framework.memory import CPU, Device, DeviceTensor
from ..ir.graph import Graph, graph_from_model
from ..ir.model import load_model_proto
from ..ir.types import ValueType, elem_type_name, elem_type_of, np_dtype
from ..optimizer.passes import optimize
from .build import BuildContext, build_runner, make_constant_folder
from .environment import get_environment
from .options import RunOptions, SessionOptions
from .value import OrtValue, to_numpy, unwrap

CPU_EP = "CPUExecutionProvider"


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
        self._profiling_start_ns = time.time_ns()
        self._lock = threading.Lock()
        proto, _ = load_model_proto(path_or_bytes)
        self._proto_meta = _metadata(proto)
        self._graph: Graph = graph_from_model(proto)
        self._apply_session_initializers()
        self._user_inputs = [
            vi for vi in self._graph.inputs if vi.name not in self._graph.initializers
        ]
        self._overridable = [vi for vi in self._graph.inputs if vi.name in self._graph.initializers]
        self._outputs = list(self._graph.outputs)
        self._eps = self._create_eps(providers, provider_options)
        cpu = next((ep for ep in self._eps if ep.name == CPU_EP), None)
        folder = make_constant_folder(cpu) if cpu is not None else None
        optimize(self._graph, int(self._sess_options.graph_optimization_level), folder)
        self._build()

    # providers ----------------------------------------------------------------------------------
    def _create_eps(
        self, providers: list[Any] | None, provider_options: list[dict[str, Any]] | None
    ) -> list[Ep]:
        opts = self._sess_options
        registry = self._env.registry
        requests: list[tuple[str, dict[str, str], list[EpDevice] | None]] = []
        if providers is not None:
            if provider_options is not None and len(provider_options) != len(providers):
                raise InvalidArgument(
                    f"provider_options has {len(provider_options)} entries for {len(providers)} providers"
                )
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
                requests.append((name, {str(a): _opt_str(b) for a, b in po.items()}, None))
        else:
            requests.extend(opts.get_provider_entries())
        if not requests:
            available = registry.available_providers()
            if len(available) > 1:
                raise ValueError(
                    f"This onnxplug build has {available} enabled. Pass the providers parameter "
                    f"to InferenceSession, e.g. InferenceSession(path, providers={available})"
                )
            requests = [(CPU_EP, {}, None)]
        names = [r[0] for r in requests]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise InvalidArgument(f"execution provider(s) {sorted(dup)} listed more than once")
        fallback_off = opts._config.get("session.disable_cpu_ep_fallback", "0") == "1"
        if CPU_EP not in names and not fallback_off:
            requests.append((CPU_EP, {}, None))
        eps: list[Ep] = []
        config = dict(opts._config)
        for name, po, devices in requests:
            factory, why = registry.find_factory(name)
            if factory is None:
                avail = registry.available_providers()
                raise InvalidArgument(
                    why or f"Unknown execution provider '{name}'. Available providers: {avail}"
                )
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
            for key, value in po.items():
                ep_config[prefix + key] = value
            self._env.ensure_transfer(factory)
            try:
                ep = factory.create_ep(list(devices), SessionConfig(ep_config))
            except OnnxPlugError:
                raise
            except (ValueError, TypeError, KeyError) as e:
                raise InvalidArgument(f"{name}: {e}") from e
            eps.append(ep)
        return eps

    # building -----------------------------------------------------------------------------------
    def _apply_session_initializers(self) -> None:
        for name, value in self._sess_options._initializers.items():
            arr = to_numpy(unwrap(value))
            if name not in self._graph.initializers:
                raise InvalidArgument(f"add_initializer: the model has no initializer '{name}'")
            self._graph.initializers[name] = np.asarray(arr)

    def _build(self) -> None:
        ctx = BuildContext(self._eps, self._env.transfer, self._env.allocator_for)
        self._runner, self._feed_devices = build_runner(self._graph, ctx)
        self._feed_names = [vi.name for vi in self._user_inputs]
        self._feed_index = {n: i for i, n in enumerate(self._feed_names)}
        self._overridable_names = {vi.name for vi in self._overridable}
        self._output_names = [vi.name for vi in self._outputs]
        self._output_index = {n: i for i, n in enumerate(self._output_names)}
        self._assignment = ctx.records
        self._runner.profiling = bool(self._sess_options.enable_profiling)
        self._allocators = self._runner.plan.allocators
        self._input_checks = [self._make_check(vi) for vi in self._user_inputs]

    def _make_check(self, vi: Any) -> tuple[str, np.dtype | None, tuple | None]:
        t = vi.type
        dt: np.dtype | None = None
        shape = None
        if t.kind == "tensor" and t.elem_type:
            try:
                dt = np_dtype(t.elem_type)
            except ValueError:
                dt = None
            shape = t.shape
        return vi.name, dt, shape

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

    def get_provider_graph_assignment_info(self) -> list[dict[str, str]]:
        """Which provider runs each node (copy nodes included), subgraphs flattened.

        onnxruntime requires ``session.record_ep_graph_assignment_info=1``; we always record.
        """
        return [
            {"graph": g, "node_name": n, "op_type": op, "ep": ep}
            for g, n, op, ep in self._assignment
        ]

    def get_ep_graph_assignment_summary(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for _, _, _, ep in self._assignment:
            out[ep] = out.get(ep, 0) + 1
        return out

    def set_providers(
        self,
        providers: list[Any] | None = None,
        provider_options: list[dict[str, Any]] | None = None,
    ) -> None:
        for ep in self._eps:
            ep.release()
        self._eps = self._create_eps(providers, provider_options)
        self._build()

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
        feeds: list[Any] = [None] * len(self._feed_names)
        seen = [False] * len(self._feed_names)
        for name, value in input_feed.items():
            i = self._feed_index.get(name)
            if i is None:
                if name in self._overridable_names:
                    raise InvalidArgument(
                        f"'{name}' is an initializer; overriding initializers at run time is not "
                        "supported, use SessionOptions.add_initializer"
                    )
                raise InvalidArgument(
                    f"Invalid input name: {name}. The model's inputs are {self._feed_names}"
                )
            feeds[i] = self._check_input(i, unwrap(value))
            seen[i] = True
        missing = [n for n, s in zip(self._feed_names, seen) if not s]
        if missing:
            t = self._user_inputs[self._feed_index[missing[0]]].type
            if t.kind != "optional":
                raise InvalidArgument(f"Missing Input: {missing[0]}")
        for i, dev in enumerate(self._feed_devices[: len(feeds)]):
            v = feeds[i]
            if dev is not None and v is not None:
                feeds[i] = place(v, dev, self._env.transfer, self._allocators)
        return feeds

    def _check_input(self, i: int, value: Any) -> Any:
        name, dt, shape = self._input_checks[i]
        vt = self._user_inputs[i].type
        if vt.kind in ("sequence", "optional", "map"):
            if isinstance(value, np.ndarray) and vt.kind == "optional":
                return value
            if value is None or isinstance(value, (list, dict)):
                return value
            raise InvalidArgument(
                f"input '{name}' expects a {vt.type_str()}, got {type(value).__name__}"
            )
        if not isinstance(value, (np.ndarray, DeviceTensor)):
            if isinstance(value, (np.generic, int, float, bool, str, list, tuple)):
                value = np.asarray(
                    value,
                    dtype=dt if dt is not None and not isinstance(value, (list, tuple)) else None,
                )
                if isinstance(value, np.ndarray) and value.dtype.kind in "US":
                    value = value.astype(object)
            else:
                raise InvalidArgument(
                    f"input '{name}' must be a numpy array or OrtValue, got {type(value).__name__}"
                )
        if isinstance(value, np.ndarray) and value.dtype.kind in "US":
            value = value.astype(object)
        if dt is not None and value.dtype != dt:
            got = _type_name(value.dtype)
            raise InvalidArgument(
                f"Unexpected input data type. Actual: (tensor({got})) , expected: "
                f"(tensor({_type_name(dt)})) for input '{name}'"
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

    def _output_indices(self, output_names: list[str] | None) -> list[int]:
        if not output_names:
            return list(range(len(self._output_names)))
        idx = []
        for n in output_names:
            i = self._output_index.get(n)
            if i is None:
                raise InvalidArgument(
                    f"Invalid output name: {n}. The model's outputs are {self._output_names}"
                )
            idx.append(i)
        return idx

    def _run_values(self, feeds: list[Any], run_options: RunOptions | None) -> list[Any]:
        eps = self._eps
        for ep in eps:
            ep.on_run_start(run_options)
        try:
            outs = self._runner.run(feeds, run_options)
        finally:
            for ep in eps:
                ep.on_run_end(run_options, True)
        return outs

    def run(
        self,
        output_names: list[str] | None,
        input_feed: dict[str, Any],
        run_options: RunOptions | None = None,
    ) -> list[Any]:
        """Run the model: numpy (or OrtValue) inputs by name, numpy outputs in order."""
        idx = self._output_indices(output_names)
        feeds = self._prepare_feeds(input_feed)
        outs = self._run_values(feeds, run_options)
        return [to_numpy(outs[i]) for i in idx]

    def run_with_ort_values(
        self,
        output_names: list[str] | None,
        input_dict_ort_values: dict[str, Any],
        run_options: RunOptions | None = None,
    ) -> list[OrtValue]:
        idx = self._output_indices(output_names)
        feeds = self._prepare_feeds(input_dict_ort_values)
        outs = self._run_values(feeds, run_options)
        return [OrtValue(outs[i]) for i in idx]

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

    # profiling ----------------------------------------------------------------------------------
    def end_profiling(self) -> str:
        if not self._sess_options.enable_profiling:
            return ""
        path = f"{self._sess_options.profile_file_prefix}{time.strftime('%Y-%m-%d_%H-%M-%S')}.json"
        with open(path, "w") as f:
            json.dump(self._runner.profile_events, f)
        self._runner.profile_events = []
        return path

    def get_profiling_start_time_ns(self) -> int:
        return self._profiling_start_ns


def _opt_str(v: Any) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    return str(v)


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
