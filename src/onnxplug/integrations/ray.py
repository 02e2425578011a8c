"""onnxplug on Ray: batch inference with Ray Data and online serving with Ray Serve.

- ``OnnxPredictor``: a callable class for ``Dataset.map_batches``. Each actor builds one
  session and reuses it for every batch; dataset columns feed model inputs and model outputs
  become columns, in numpy (dict of arrays) or pandas batches.
- ``onnx_deployment(model, ...)``: a Ray Serve application that answers JSON (or ``.npz``)
  over HTTP, batching concurrent requests into one session run with ``@serve.batch``.
- ``ServingModel``: what one Serve replica does (parse, check, batch, run, answer), usable and
  testable without Ray.

Providers: on an actor that Ray gave a GPU (``num_gpus``) the session runs on
CUDAExecutionProvider (then the CPU), otherwise on the CPU; a ``providers`` list (names or
``(name, options)`` tuples, as for ``InferenceSession``) is used as given, less the GPU providers
on an actor without a GPU. Ray sets ``CUDA_VISIBLE_DEVICES`` for each actor, so its GPU is
device 0 and ``device_id`` needs no setting.

Importing this module does not import Ray: only asking an actor's GPUs and building the Serve
application do (``pip install "onnxplug[ray]"``).
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import get_available_providers
from ..errors import InvalidArgument
from ..session.inference_session import InferenceSession
from ..session.options import SessionOptions
from .model_io import TensorInput, tensor_inputs

__all__ = [
    "GPU_PROVIDERS",
    "InferenceRequest",
    "OnnxPredictor",
    "ServingModel",
    "actor_gpu_ids",
    "onnx_deployment",
    "providers_for_actor",
]

CPU_EP = "CPUExecutionProvider"
# Providers that need a GPU of the actor's own: dropped where Ray gave the actor none.
GPU_PROVIDERS = frozenset({"CUDAExecutionProvider"})

_LOG = logging.getLogger("onnxplug")

ProviderEntry = str | tuple[str, Mapping[str, Any]]


def actor_gpu_ids() -> list[Any] | None:
    """The GPUs Ray gave this process (``ray.get_gpu_ids()``); None when it is not a Ray worker
    or driver (then there is no assignment to follow)."""
    try:
        import ray
    except ImportError:
        return None
    if not ray.is_initialized():
        return None
    return list(ray.get_gpu_ids())


def providers_for_actor(
    providers: Sequence[ProviderEntry] | None,
    provider_options: Sequence[Mapping[str, Any] | None] | None,
    gpu_ids: Sequence[Any] | None,
) -> list[tuple[str, dict[str, Any]]]:
    """The ``(name, options)`` list a session on this actor uses.

    ``providers`` and ``provider_options`` mean what they mean for ``InferenceSession``.
    Without ``providers``: CUDA then CPU when ``gpu_ids`` is not empty, the CPU when it is, and
    onnxplug's available providers outside Ray (``gpu_ids`` None). With ``providers`` and no GPU
    (``gpu_ids == []``) the GPU providers are dropped with a warning.
    """
    if providers is None:
        if provider_options is not None:
            raise InvalidArgument("provider_options was given without providers")
        if gpu_ids is None:
            return [(p, {}) for p in get_available_providers()]
        if gpu_ids:
            return [("CUDAExecutionProvider", {}), (CPU_EP, {})]
        return [(CPU_EP, {})]
    if isinstance(providers, str):
        raise InvalidArgument(f"providers must be a list of names, not the string {providers!r}")
    if provider_options is not None and len(provider_options) != len(providers):
        raise InvalidArgument(
            f"provider_options has {len(provider_options)} entries for {len(providers)} providers"
        )
    entries: list[tuple[str, dict[str, Any]]] = []
    for k, p in enumerate(providers):
        if isinstance(p, str):
            name, opts = p, {}
        elif isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str):
            name, opts = p[0], dict(p[1] or {})
        else:
            raise InvalidArgument(f"provider entry {p!r} must be a name or (name, options)")
        if provider_options is not None:
            opts.update(provider_options[k] or {})
        entries.append((name, opts))
    if gpu_ids is not None and not gpu_ids:
        dropped = [n for n, _ in entries if n in GPU_PROVIDERS]
        if dropped:
            _LOG.warning(
                "this Ray actor has no GPU (ray.get_gpu_ids() is empty): %s not used; give the "
                "actor a GPU with num_gpus=1 (map_batches) or ray_actor_options={'num_gpus': 1} "
                "(Serve)",
                dropped,
            )
            entries = [(n, o) for n, o in entries if n not in GPU_PROVIDERS] or [(CPU_EP, {})]
    return entries


def _actor_session(
    model: Any,
    providers: Sequence[ProviderEntry] | None,
    provider_options: Sequence[Mapping[str, Any] | None] | None,
    sess_options: SessionOptions | None,
) -> InferenceSession:
    chosen = providers_for_actor(providers, provider_options, actor_gpu_ids())
    return InferenceSession(model, sess_options, providers=list(chosen))


# Ray Data -----------------------------------------------------------------------------------


class OnnxPredictor:
    """A callable class for ``Dataset.map_batches``: one session per actor, reused for every
    batch::

        ds.map_batches(
            OnnxPredictor,
            fn_constructor_kwargs={"model": "model.onnx", "input_columns": {"input": "image"}},
            batch_size=32, compute=ray.data.ActorPoolStrategy(size=2), num_gpus=1,  # one GPU per actor: CUDA
        )

    ``model`` is what ``InferenceSession`` takes (a path every node can read, the model's bytes
    or an ``onnx.ModelProto``). ``input_columns`` maps each model input to a column, or to a
    list of columns stacked along a new last axis (tabular features); by default each input
    reads the column of its own name. ``output_columns`` maps model outputs to the columns they
    become (a list keeps the names); by default every output, under its own name.
    ``keep_columns`` are copied from the input batch (ids, labels). Batches are dicts of numpy
    arrays or pandas DataFrames (``batch_format``) and the result has the same format; every
    output must have one row per input row.
    """

    def __init__(
        self,
        model: Any,
        *,
        input_columns: Mapping[str, str | Sequence[str]] | None = None,
        output_columns: Mapping[str, str] | Sequence[str] | None = None,
        keep_columns: Sequence[str] = (),
        providers: Sequence[ProviderEntry] | None = None,
        provider_options: Sequence[Mapping[str, Any] | None] | None = None,
        sess_options: SessionOptions | None = None,
    ):
        self.session = _actor_session(model, providers, provider_options, sess_options)
        self._inputs = tensor_inputs(self.session.get_inputs())
        self._input_columns = _input_columns(input_columns, self._inputs)
        self._output_columns = _output_columns(
            output_columns, [o.name for o in self.session.get_outputs()]
        )
        self._keep = tuple(keep_columns)
        clash = sorted(set(self._keep) & set(self._output_columns.values()))
        if clash:
            raise InvalidArgument(f"keep_columns {clash} are also output columns")

    def __call__(self, batch: Any) -> Any:
        pandas = not isinstance(batch, Mapping)
        if pandas and not (hasattr(batch, "columns") and hasattr(batch, "index")):
            raise TypeError(
                f"OnnxPredictor takes numpy (dict of arrays) or pandas batches, not "
                f"{type(batch).__name__}: pass batch_format='numpy' or 'pandas' to map_batches"
            )
        rows = len(batch.index) if pandas else _rows(batch)
        feeds = {
            name: self._feed(batch, name, columns) for name, columns in self._input_columns.items()
        }
        try:
            outs = self.session.run(list(self._output_columns), feeds)
        except Exception as e:
            shapes = {n: (f.shape, str(f.dtype)) for n, f in feeds.items()}
            e.add_note(f"OnnxPredictor: batch of {rows} rows; inputs fed {shapes}")
            raise
        result: dict[str, Any] = {}
        for (name, column), value in zip(self._output_columns.items(), outs):
            if not isinstance(value, np.ndarray) or value.ndim == 0 or value.shape[0] != rows:
                shape = getattr(value, "shape", type(value).__name__)
                raise InvalidArgument(
                    f"model output '{name}' is {shape} for a batch of {rows} rows: column "
                    f"'{column}' needs one row per input row (leave the output out with "
                    "output_columns)"
                )
            result[column] = list(value) if pandas and value.ndim > 1 else value
        for column in self._keep:  # as they are: a pandas column keeps its dtype and index
            result[column] = _lookup(batch, column, f"keep_columns names column '{column}'")
        if pandas:
            import pandas as pd

            return pd.DataFrame(result, index=batch.index)
        return result

    def _feed(self, batch: Any, name: str, columns: str | tuple[str, ...]) -> np.ndarray:
        spec = self._inputs[name]
        if isinstance(columns, str):
            value = _column(batch, columns, f"model input '{name}' reads column '{columns}'")
            return spec.convert(value, f"column '{columns}'")
        parts = [_column(batch, c, f"model input '{name}' reads column '{c}'") for c in columns]
        return spec.convert(np.stack(parts, axis=-1), f"columns {list(columns)}")


def _rows(batch: Mapping[str, Any]) -> int:
    for value in batch.values():
        return len(value)
    return 0


def _lookup(batch: Any, column: str, what: str) -> Any:
    try:
        return batch[column]
    except KeyError:
        raise InvalidArgument(
            f"{what}, which the batch does not have (its columns: {list(batch.keys())}); map "
            "model inputs to columns with input_columns"
        ) from None


def _column(batch: Any, column: str, what: str) -> np.ndarray:
    """One column of a numpy or pandas batch as an array; rows that are arrays themselves
    (pandas cells, ragged numpy batches) are stacked."""
    value = _lookup(batch, column, what)
    arr = value.to_numpy() if hasattr(value, "to_numpy") else np.asarray(value)
    if arr.dtype == np.dtype(object) and arr.size and isinstance(arr.flat[0], (np.ndarray, list)):
        try:
            arr = np.stack([np.asarray(v) for v in arr])
        except ValueError:
            raise InvalidArgument(
                f"{what}, whose rows have different shapes: a batch needs arrays of one shape"
            ) from None
    return arr


def _input_columns(
    mapping: Mapping[str, str | Sequence[str]] | None, inputs: Mapping[str, TensorInput]
) -> dict[str, str | tuple[str, ...]]:
    if mapping is None:
        return {name: name for name in inputs}
    unknown = [n for n in mapping if n not in inputs]
    if unknown:
        raise InvalidArgument(
            f"input_columns names {unknown}, which are not model inputs: {list(inputs)}"
        )
    missing = [n for n in inputs if n not in mapping]
    if missing:
        raise InvalidArgument(
            f"input_columns gives no column for model input(s) {missing}; it maps {dict(mapping)}"
        )
    return {n: c if isinstance(c, str) else tuple(c) for n, c in mapping.items()}


def _output_columns(
    mapping: Mapping[str, str] | Sequence[str] | None, outputs: list[str]
) -> dict[str, str]:
    if mapping is None:
        return {name: name for name in outputs}
    if isinstance(mapping, str):
        raise InvalidArgument(f"output_columns must be a list or a dict, not {mapping!r}")
    pairs = dict(mapping) if isinstance(mapping, Mapping) else {n: n for n in mapping}
    unknown = [n for n in pairs if n not in outputs]
    if unknown:
        raise InvalidArgument(
            f"output_columns names {unknown}, which are not model outputs: {outputs}"
        )
    if not pairs:
        raise InvalidArgument("output_columns is empty: name at least one model output")
    return pairs


# Ray Serve ----------------------------------------------------------------------------------


@dataclass
class InferenceRequest:
    """One checked request: its feeds, the outputs it wants, its number of rows (the common
    first dimension of its feeds; None where it has none) and whether it answers in .npz."""

    feeds: dict[str, np.ndarray]
    outputs: tuple[str, ...]
    rows: int | None
    binary: bool = False

    def batch_key(self) -> tuple[Any, ...]:
        """Requests with equal keys can be stacked along their first axis into one run."""
        shapes = tuple((n, a.shape[1:], a.dtype.str) for n, a in sorted(self.feeds.items()))
        return (self.outputs, shapes)


_REQUEST_FORMAT = (
    'a JSON object {"inputs": {"<input name>": <nested list>, ...}, "outputs": '
    '["<output name>", ...] (optional)}'
)


class ServingModel:
    """The work of one Serve replica, without Ray: turn request bodies into checked requests
    (``InvalidArgument`` for a bad one, which the HTTP layer answers with 400), run a batch of
    requests as few session runs as possible, and keep the statistics and the health state.

    Requests whose inputs agree on everything but the first dimension are concatenated into
    one run and the outputs split back by rows, when every model input has a free first
    dimension. If a batched run fails, its requests run one by one, so that only the bad one
    fails; if its outputs do not have one row per input row, the model is never batched again.
    The replica reports itself unhealthy after ``failures_before_unhealthy`` runs in a row
    failed with a server error (a broken device, say), so that Serve replaces it; bad requests
    never count.
    """

    def __init__(
        self,
        model: Any,
        providers: Sequence[ProviderEntry] | None = None,
        provider_options: Sequence[Mapping[str, Any] | None] | None = None,
        sess_options: SessionOptions | None = None,
        failures_before_unhealthy: int = 3,
    ):
        self.session = _actor_session(model, providers, provider_options, sess_options)
        self._inputs = tensor_inputs(self.session.get_inputs())
        self._output_names = [o.name for o in self.session.get_outputs()]
        self._batchable = all(spec.batched for spec in self._inputs.values())
        self._failures_before_unhealthy = failures_before_unhealthy
        self._lock = threading.Lock()
        self._batch_sizes: Counter[int] = Counter()
        self._runs = 0
        self._failures_in_a_row = 0
        self._last_failure = ""

    # requests ---------------------------------------------------------------------------------
    def request(
        self, inputs: Any, outputs: Sequence[str] | None = None, binary: bool = False
    ) -> InferenceRequest:
        """Check ``inputs`` (input name -> array or nested list) and ``outputs`` (None: all)."""
        if not isinstance(inputs, Mapping):
            raise InvalidArgument(f"the request must be {_REQUEST_FORMAT}")
        unknown = [n for n in inputs if n not in self._inputs]
        if unknown:
            raise InvalidArgument(
                f"unknown input(s) {unknown}: the model's inputs are {list(self._inputs)}"
            )
        missing = [n for n in self._inputs if n not in inputs]
        if missing:
            raise InvalidArgument(
                f"missing input(s) {missing}: the model's inputs are {list(self._inputs)}"
            )
        feeds = {n: self._inputs[n].convert(inputs[n], "the request's value") for n in inputs}
        if outputs is None:
            wanted = tuple(self._output_names)
        else:
            if isinstance(outputs, str) or not all(isinstance(o, str) for o in outputs):
                raise InvalidArgument(f'"outputs" must be a list of output names, not {outputs!r}')
            bad = [o for o in outputs if o not in self._output_names]
            if bad:
                raise InvalidArgument(
                    f"unknown output(s) {bad}: the model's outputs are {self._output_names}"
                )
            wanted = tuple(outputs) or tuple(self._output_names)
        firsts = {a.shape[0] if a.ndim else None for a in feeds.values()}
        rows = firsts.pop() if len(firsts) == 1 else None
        return InferenceRequest(feeds, wanted, rows, binary)

    def request_from_json(self, body: bytes) -> InferenceRequest:
        try:
            doc = json.loads(body)
        except (ValueError, UnicodeDecodeError) as e:
            raise InvalidArgument(
                f"the request body is not JSON ({e}): send {_REQUEST_FORMAT}"
            ) from None
        if not isinstance(doc, dict) or "inputs" not in doc:
            raise InvalidArgument(f"the request must be {_REQUEST_FORMAT}")
        extra = sorted(set(doc) - {"inputs", "outputs"})
        if extra:
            raise InvalidArgument(f"unknown request field(s) {extra}: send {_REQUEST_FORMAT}")
        return self.request(doc["inputs"], doc.get("outputs"))

    def request_from_npz(self, body: bytes, outputs: Sequence[str] | None) -> InferenceRequest:
        """A request whose body is ``numpy.savez`` output, one array per input name."""
        try:
            with np.load(io.BytesIO(body), allow_pickle=False) as archive:
                inputs = {name: archive[name] for name in archive.files}
        except Exception as e:
            raise InvalidArgument(
                f"the request body is not an .npz archive of arrays ({e})"
            ) from None
        return self.request(inputs, outputs, binary=True)

    # running ----------------------------------------------------------------------------------
    def infer(self, requests: Sequence[InferenceRequest]) -> list[dict[str, Any] | Exception]:
        """Each request's outputs (name -> value), or the exception it failed with:
        ``InvalidArgument`` for a bad request, anything else for a server error."""
        with self._lock:
            self._batch_sizes[len(requests)] += 1
        groups: dict[tuple[Any, ...], list[int]] = {}
        for i, r in enumerate(requests):
            key = r.batch_key() if self._batchable and r.rows is not None else ("alone", i)
            groups.setdefault(key, []).append(i)
        results: dict[int, dict[str, Any] | Exception] = {}
        for members in groups.values():
            answers = self._run_group([requests[i] for i in members])
            results.update(zip(members, answers))
        return [results[i] for i in range(len(requests))]

    def _run_group(self, group: list[InferenceRequest]) -> list[dict[str, Any] | Exception]:
        if len(group) == 1:
            return [self._run_one(group[0])]
        names = list(group[0].outputs)
        feeds = {n: np.concatenate([r.feeds[n] for r in group]) for n in group[0].feeds}
        try:
            outs = self._run(names, feeds)
        except Exception:
            return [self._run_one(r) for r in group]
        rows = [r.rows or 0 for r in group]
        if any(not isinstance(o, np.ndarray) or o.ndim == 0 or len(o) != sum(rows) for o in outs):
            _LOG.warning("model outputs are not one row per input row: requests run one by one")
            self._batchable = False
            return [self._run_one(r) for r in group]
        self._succeeded()
        bounds = np.cumsum(rows)[:-1]
        split = [np.split(o, bounds) for o in outs]
        return [dict(zip(names, parts)) for parts in zip(*split)]

    def _run_one(self, request: InferenceRequest) -> dict[str, Any] | Exception:
        try:
            outs = self._run(list(request.outputs), request.feeds)
        except InvalidArgument as e:
            return e  # the request's fault (a shape the model's arithmetic rejects, say)
        except Exception as e:
            _LOG.exception("onnxplug serving: a run failed")
            with self._lock:
                self._failures_in_a_row += 1
                self._last_failure = f"{type(e).__name__}: {e}"
            return e
        self._succeeded()
        return dict(zip(request.outputs, outs))

    def _run(self, names: list[str], feeds: dict[str, np.ndarray]) -> list[Any]:
        with self._lock:
            self._runs += 1
        return self.session.run(names, feeds)

    def _succeeded(self) -> None:
        with self._lock:
            self._failures_in_a_row = 0

    # state ------------------------------------------------------------------------------------
    def check_health(self) -> None:
        """Raises when the last runs all failed with server errors (Serve then replaces the
        replica)."""
        with self._lock:
            n, why = self._failures_in_a_row, self._last_failure
        if n >= self._failures_before_unhealthy:
            raise RuntimeError(f"the last {n} runs failed; the last with {why}")

    def metadata(self) -> dict[str, Any]:
        def args(items: Sequence[Any]) -> list[dict[str, Any]]:
            return [{"name": a.name, "type": a.type, "shape": list(a.shape)} for a in items]

        return {
            "inputs": args(self.session.get_inputs()),
            "outputs": args(self.session.get_outputs()),
            "providers": self.session.get_providers(),
        }

    def stats(self) -> dict[str, Any]:
        """Counts since the replica started: requests per ``@serve.batch`` call (size ->
        calls), session runs, and server failures in a row."""
        with self._lock:
            sizes = dict(sorted(self._batch_sizes.items()))
            return {
                "requests": sum(k * v for k, v in sizes.items()),
                "batches": sum(sizes.values()),
                "batch_sizes": {str(k): v for k, v in sizes.items()},
                "runs": self._runs,
                "failures_in_a_row": self._failures_in_a_row,
            }


def encode_outputs(outputs: Mapping[str, Any], binary: bool) -> tuple[bytes, str]:
    """A response body and its media type: ``{"outputs": {name: nested list}}`` as JSON, or
    the arrays as an .npz archive."""
    if binary:
        arrays: dict[str, Any] = {}
        for name, value in outputs.items():
            if not isinstance(value, np.ndarray) or value.dtype == np.dtype(object):
                raise InvalidArgument(
                    f"output '{name}' is not a numeric array, which .npz cannot carry: ask in JSON"
                )
            arrays[name] = value
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        return buf.getvalue(), NPZ_MEDIA_TYPE
    doc = {"outputs": {name: _jsonable(v) for name, v in outputs.items()}}
    return json.dumps(doc).encode(), "application/json"


NPZ_MEDIA_TYPE = "application/x-npz"


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        if value.dtype.kind == "V":  # ml_dtypes types have no Python scalar of their own
            value = value.astype(np.float32)
        return value.tolist()
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k if isinstance(k, str) else str(k): _jsonable(v) for k, v in value.items()}
    return value


def onnx_deployment(
    model: Any,
    *,
    providers: Sequence[ProviderEntry] | None = None,
    provider_options: Sequence[Mapping[str, Any] | None] | None = None,
    sess_options: SessionOptions | None = None,
    max_batch_size: int = 16,
    batch_wait_timeout_s: float = 0.005,
    name: str = "onnxplug",
    **deployment_options: Any,
) -> Any:
    """A Ray Serve application serving ``model``; run it with ``serve.run(app,
    route_prefix="/model")``.

    HTTP, relative to the route prefix: ``POST /`` with ``{"inputs": {...}, "outputs": [...]}``
    (JSON; values are nested lists, converted to the inputs' types) answers
    ``{"outputs": {...}}``; a body of ``Content-Type: application/x-npz`` (``numpy.savez``) is
    answered in .npz (``?outputs=a,b`` selects outputs). A bad request (unknown input, shape,
    type) gets 400 with ``{"error": "..."}`` and leaves the replica healthy; a failed run 500.
    ``GET /`` describes the model, ``GET /health`` answers 200 or 503, ``GET /stats`` shows
    the replica's batching. A ``DeploymentHandle`` call takes a dict of arrays and returns one.

    Up to ``max_batch_size`` requests (not rows) that arrive within ``batch_wait_timeout_s``
    of the first are batched (``@serve.batch``). ``deployment_options`` go to
    ``serve.deployment`` (``num_replicas``, ``ray_actor_options={"num_gpus": 1}`` for a GPU per
    replica, ``autoscaling_config``, ...); ``max_ongoing_requests`` defaults to twice
    ``max_batch_size``, so that a full batch can form while the previous one runs.
    """
    from ray import serve
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response

    deployment_options.setdefault("max_ongoing_requests", 2 * max_batch_size)
    batching = {"max_batch_size": max_batch_size, "batch_wait_timeout_s": batch_wait_timeout_s}

    def error(status: int, message: str) -> Response:
        return JSONResponse({"error": message}, status_code=status)

    class OnnxModel:
        def __init__(self, model: Any, providers: Any, provider_options: Any, options: Any):
            self.model = ServingModel(model, providers, provider_options, options)

        async def __call__(self, request: Any, outputs: Sequence[str] | None = None) -> Any:
            if not isinstance(request, Request):  # a DeploymentHandle call
                result = await self.infer(self.model.request(request, outputs))
                if isinstance(result, Exception):
                    raise result
                return result
            path = request.url.path[len(request.scope.get("root_path", "")) :].strip("/")
            if request.method == "GET":
                return self._get(path)
            if request.method != "POST":
                return error(405, f"{request.method} is not supported: POST a request, GET info")
            if path:
                return error(404, f"no such endpoint '{path}': POST to the route itself")
            body = await request.body()
            try:
                if request.headers.get("content-type", "").startswith(NPZ_MEDIA_TYPE):
                    names = request.query_params.get("outputs")
                    checked = self.model.request_from_npz(body, names.split(",") if names else None)
                else:
                    checked = self.model.request_from_json(body)
            except InvalidArgument as e:
                return error(400, e.message)
            result = await self.infer(checked)
            if isinstance(result, InvalidArgument):
                return error(400, result.message)
            if isinstance(result, Exception):
                return error(500, f"the run failed: {type(result).__name__}: {result}")
            try:
                content, media_type = encode_outputs(result, checked.binary)
            except InvalidArgument as e:
                return error(400, e.message)
            return Response(content, media_type=media_type)

        def _get(self, path: str) -> Any:
            if path == "":
                return JSONResponse({**self.model.metadata(), **batching})
            if path == "stats":
                return JSONResponse(self.model.stats())
            if path == "health":
                try:
                    self.model.check_health()
                except RuntimeError as e:
                    return error(503, str(e))
                return JSONResponse({"status": "ok"})
            return error(404, f"no such endpoint '{path}': GET '', 'health' or 'stats'")

        @serve.batch(max_batch_size=max_batch_size, batch_wait_timeout_s=batch_wait_timeout_s)
        async def infer(self, requests: list[InferenceRequest]) -> list[Any]:
            # in a thread: the replica's event loop keeps taking requests for the next batch
            return await asyncio.to_thread(self.model.infer, requests)

        def check_health(self) -> None:
            self.model.check_health()

    deployment = serve.deployment(name=name, **deployment_options)(OnnxModel)
    return deployment.bind(model, providers, provider_options, sess_options)
