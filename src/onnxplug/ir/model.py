"""Loading a model: from a path, bytes or a ModelProto, with external data read safely.

External data (tensors stored beside the model) is read only from inside the model's folder:
a location that is absolute, climbs out with ``..`` or resolves (through symlinks) to a file
outside the folder is refused. Model-local functions are inlined here; schema-defined function
ops are expanded later, by the partitioner, only where no provider has a kernel for them.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError
from onnx import ModelProto, TensorProto

from ..errors import Fail, InvalidArgument, InvalidGraph, InvalidProtobuf, NoSuchFile
from .validate import check_proto


def load_model_proto(
    model: str | os.PathLike | bytes | ModelProto,
) -> tuple[ModelProto, Path | None]:
    """Return (ModelProto with external data loaded, the model's folder or None)."""
    base_dir: Path | None = None
    if isinstance(model, ModelProto):
        proto = ModelProto()
        proto.CopyFrom(model)
    elif isinstance(model, (bytes, bytearray, memoryview)):
        proto = _parse(bytes(model), "<bytes>")
    elif isinstance(model, (str, os.PathLike)):
        path = Path(model)
        if not path.exists():
            raise NoSuchFile(f"Load model from {path} failed: File doesn't exist")
        if path.is_dir():
            raise InvalidArgument(f"Load model from {path} failed: it is a directory, not a file")
        proto = _parse(path.read_bytes(), str(path))
        base_dir = path.resolve().parent
    else:
        raise InvalidArgument(
            f"a model must be a path, bytes or onnx.ModelProto, not {type(model).__name__}"
        )
    if not proto.HasField("graph"):
        raise InvalidGraph("the model has no graph")
    load_external_data(proto, base_dir)
    check_proto(proto)  # before any native code (the inliner, shape inference) reads it
    if len(proto.functions):
        try:
            from onnx import inliner

            proto = inliner.inline_local_functions(proto)
        except Exception as e:  # the inliner rejects malformed functions
            raise InvalidGraph(f"could not inline the model's local functions: {e}") from e
    return proto, base_dir


def _parse(data: bytes, where: str) -> ModelProto:
    proto = ModelProto()
    try:
        proto.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError) as e:
        raise InvalidProtobuf(
            f"Load model from {where} failed: Protobuf parsing failed ({e})"
        ) from e
    if not proto.HasField("graph") and not proto.opset_import:
        raise InvalidProtobuf(f"Load model from {where} failed: not an ONNX model")
    return proto


def _iter_tensors(graph: onnx.GraphProto):
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield sparse.values
        yield sparse.indices
    yield from _iter_node_tensors(graph.node)


def _iter_node_tensors(nodes):
    """Tensors held by node attributes, subgraphs included."""
    for node in nodes:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            if attr.HasField("sparse_tensor"):
                yield attr.sparse_tensor.values
                yield attr.sparse_tensor.indices
            for sp in attr.sparse_tensors:
                yield sp.values
                yield sp.indices
            if attr.HasField("g"):
                yield from _iter_tensors(attr.g)
            for g in attr.graphs:
                yield from _iter_tensors(g)


def safe_external_path(base_dir: Path, location: str, tensor_name: str) -> Path:
    """Resolve an external-data location, refusing anything outside ``base_dir``."""
    if not location:
        raise InvalidGraph(f"initializer '{tensor_name}': external data has no location")
    if os.path.isabs(location) or location.startswith(("/", "\\")) or ":" in location[:3]:
        raise InvalidGraph(
            f"initializer '{tensor_name}': external data location '{location}' is an absolute "
            "path; only files inside the model's folder may be read"
        )
    parts = Path(location.replace("\\", "/")).parts
    if ".." in parts:
        raise InvalidGraph(
            f"initializer '{tensor_name}': external data location '{location}' escapes the "
            "model's folder with '..'"
        )
    root = base_dir.resolve()
    target = (root / location).resolve()
    if root != target and root not in target.parents:
        raise InvalidGraph(
            f"initializer '{tensor_name}': external data location '{location}' resolves to "
            f"'{target}', outside the model's folder '{root}' (symlink?)"
        )
    if not target.is_file():
        raise NoSuchFile(
            f"initializer '{tensor_name}': external data file '{location}' not found in '{root}'"
        )
    return target


def _int_field(info: dict[str, str], key: str, tensor_name: str) -> int | None:
    raw = info.get(key)
    if raw is None or raw == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise InvalidGraph(
            f"initializer '{tensor_name}': external data {key} '{raw}' is not a byte count"
        )
    return value


def load_external_data(proto: ModelProto, base_dir: Path | None) -> None:
    tensors = itertools.chain(
        _iter_tensors(proto.graph), *(_iter_node_tensors(f.node) for f in proto.functions)
    )
    for tensor in tensors:
        if tensor.data_location != TensorProto.EXTERNAL:
            continue
        info = {e.key: e.value for e in tensor.external_data}
        if base_dir is None:
            raise InvalidArgument(
                f"initializer '{tensor.name}' uses external data but the model was not loaded "
                "from a file, so there is no folder to read it from; load the model by path"
            )
        path = safe_external_path(base_dir, info.get("location", ""), tensor.name)
        offset = _int_field(info, "offset", tensor.name) or 0
        length = _int_field(info, "length", tensor.name)
        size = path.stat().st_size
        end = size if length is None else offset + length
        if offset > size or end > size:
            raise Fail(
                f"initializer '{tensor.name}': external data file '{path.name}' holds "
                f"{size} bytes; offset {offset} + length {length} runs past its end"
            )
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read(end - offset)
        tensor.raw_data = data
        del tensor.external_data[:]
        tensor.data_location = TensorProto.DEFAULT
