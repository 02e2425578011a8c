"""Loading a model: from a path, bytes or a ModelProto, with external data read safely.

External data (tensors stored beside the model) is read only from inside the model's folder:
a location that is absolute, or that resolves (through ``..`` or symlinks) to a file outside
the folder is refused. Model-local functions are inlined here; schema-defined function
ops are expanded later, by the partitioner, only where no provider has a kernel for them.
"""

from __future__ import annotations

import itertools
import mmap
import os
import stat
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError
from onnx import ModelProto, TensorProto

from ..errors import Fail, InvalidArgument, InvalidGraph, InvalidProtobuf, NoSuchFile
from .validate import SUB_BYTE_BITS, check_proto


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
        proto = _parse_model_file(path)
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


# protobuf cannot parse a message of 2 GiB or more: bigger models keep weights as external data
_MAX_PROTO_BYTES = 2**31 - 1


def _parse_model_file(path: Path) -> ModelProto:
    """A model file parsed straight from its pages (mapped, not read into a copy first: a
    400 MB model spent as long in ``read`` as in parsing)."""
    size = _model_file_size(path)
    with open(path, "rb") as f:
        try:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        except (OSError, ValueError):  # a file system that cannot map files
            mapped = None
        if mapped is None:
            # the size stat saw, not the 2 GiB bound: read(n) reserves n bytes up front
            return _parse(f.read(size), str(path))
    # protobuf copies what it keeps out of the buffer: the mapping can go once it has parsed
    with mapped, memoryview(mapped) as view:
        return _parse(view, str(path))


def _model_file_size(path: Path) -> int:
    """The size of a model file; anything but a regular file (a directory, a FIFO, /dev/zero)
    and files protobuf cannot parse are refused before a byte is read."""
    if "\0" in str(path):
        raise InvalidArgument(f"Load model from {str(path)!r} failed: the path has a NUL byte")
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise NoSuchFile(f"Load model from {path} failed: File doesn't exist") from None
    except OSError as e:
        raise InvalidArgument(f"Load model from {path} failed: {e.strerror or e}") from None
    if stat.S_ISDIR(st.st_mode):
        raise InvalidArgument(f"Load model from {path} failed: it is a directory, not a file")
    if not stat.S_ISREG(st.st_mode):
        raise InvalidArgument(
            f"Load model from {path} failed: it is not a regular file (a device, FIFO or socket)"
        )
    if st.st_size > _MAX_PROTO_BYTES:
        raise InvalidProtobuf(
            f"Load model from {path} failed: the file has {st.st_size} bytes; a protobuf "
            "message holds at most 2 GiB (larger models keep their weights as external data)"
        )
    return st.st_size


def _parse(data: bytes | memoryview, where: str) -> ModelProto:
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
    """Resolve an external-data location, refusing anything outside ``base_dir`` and anything
    but a regular file."""
    if not location:
        raise InvalidGraph(f"initializer '{tensor_name}': external data has no location")
    if "\0" in location:
        raise InvalidGraph(
            f"initializer '{tensor_name}': external data location {location!r} has a NUL byte"
        )
    if os.path.isabs(location) or location.startswith(("/", "\\")) or ":" in location[:3]:
        raise InvalidGraph(
            f"initializer '{tensor_name}': external data location '{location}' is an absolute "
            "path; only files inside the model's folder may be read"
        )
    # '..' may step into a subfolder and back ('sub/../w.bin', as onnxruntime reads it): what
    # counts is where the path resolves, the way the OS resolves it (symlinks first).
    root = base_dir.resolve()
    target = (root / location).resolve()
    if root != target and root not in target.parents:
        how = "with '..'" if ".." in Path(location.replace("\\", "/")).parts else "(symlink?)"
        raise InvalidGraph(
            f"initializer '{tensor_name}': external data location '{location}' escapes the "
            f"model's folder {how}: it resolves to '{target}', outside the model's folder "
            f"'{root}'"
        )
    if not target.exists() or not os.path.exists(root / location):
        raise NoSuchFile(
            f"initializer '{tensor_name}': external data file '{location}' not found in '{root}'"
        )
    if not target.is_file():
        raise InvalidGraph(
            f"initializer '{tensor_name}': external data location '{location}' is not a "
            "regular file (a directory, device or FIFO)"
        )
    return target


# The keys of TensorProto.external_data the ONNX spec defines; any other (a misspelt
# 'offst', say) would silently give wrong weights, so it is an error.
EXTERNAL_DATA_KEYS = frozenset({"location", "offset", "length", "checksum"})


def _int_field(info: dict[str, str], key: str, tensor_name: str) -> int | None:
    raw = info.get(key)
    if raw is None:
        return None
    # decimal digits only, as onnxruntime parses them ('', ' 4', '1e3', '+4' are errors)
    value = int(raw) if raw.isascii() and raw.isdigit() else -1
    if value < 0:
        raise InvalidGraph(
            f"initializer '{tensor_name}': external data {key} '{raw}' is not a byte count"
        )
    return value


def tensor_nbytes(tensor: TensorProto) -> int:
    """Bytes of a tensor's raw data from its dims and element type (sub-byte types packed)."""
    name = tensor.name
    dims = [int(d) for d in tensor.dims]
    if any(d < 0 for d in dims):
        raise InvalidGraph(f"initializer '{name}': dims {dims} contain a negative dimension")
    if tensor.data_type == TensorProto.STRING:
        raise InvalidGraph(f"initializer '{name}': string tensors cannot be stored externally")
    try:
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)
    except Exception:
        raise InvalidGraph(
            f"initializer '{name}': tensor does not have a valid data type ({tensor.data_type})"
        ) from None
    numel = 1
    for d in dims:
        numel *= d
    bits = SUB_BYTE_BITS.get(tensor.data_type)
    if bits is not None:
        return (numel * bits + 7) // 8
    return numel * dtype.itemsize


def load_external_data(proto: ModelProto, base_dir: Path | None) -> None:
    """Read every externally stored tensor: only its own bytes (its ``length``, or its size
    from dims and type when no length is given), from a regular file inside ``base_dir``."""
    tensors = itertools.chain(
        _iter_tensors(proto.graph), *(_iter_node_tensors(f.node) for f in proto.functions)
    )
    for tensor in tensors:
        if tensor.data_location != TensorProto.EXTERNAL:
            continue
        info: dict[str, str] = {}
        for e in tensor.external_data:
            if e.key not in EXTERNAL_DATA_KEYS:
                raise InvalidGraph(
                    f"initializer '{tensor.name}': unknown external data key '{e.key}' (the "
                    f"keys are {sorted(EXTERNAL_DATA_KEYS)})"
                )
            # A repeated key takes its last value, as in onnxruntime and onnx, except the
            # location, which onnxruntime refuses twice
            if e.key == "location" and e.key in info:
                raise InvalidGraph(
                    f"initializer '{tensor.name}': external data key 'location' is given twice"
                )
            info[e.key] = e.value
        if base_dir is None:
            raise InvalidArgument(
                f"initializer '{tensor.name}' uses external data but the model was not loaded "
                "from a file, so there is no folder to read it from; load the model by path"
            )
        path = safe_external_path(base_dir, info.get("location", ""), tensor.name)
        offset = _int_field(info, "offset", tensor.name) or 0
        # a length of 0 reads as no length, as in onnxruntime: the tensor's own bytes
        length = _int_field(info, "length", tensor.name) or None
        nbytes = tensor_nbytes(tensor)
        size = path.stat().st_size
        if offset + (nbytes if length is None else length) > size:
            raise Fail(
                f"initializer '{tensor.name}': external data file '{path.name}' holds "
                f"{size} bytes; offset {offset} + length {nbytes if length is None else length}"
                " runs past its end"
            )
        if length is not None and length != nbytes:
            raise InvalidGraph(
                f"initializer '{tensor.name}': external data length {length} does not match "
                f"the {nbytes} bytes of its dims {list(tensor.dims)} and type"
            )
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read(nbytes)
        if len(data) != nbytes:  # the file shrank while we read it
            raise Fail(
                f"initializer '{tensor.name}': external data file '{path.name}' ended after "
                f"{len(data)} of {nbytes} bytes"
            )
        tensor.raw_data = data
        del tensor.external_data[:]
        tensor.data_location = TensorProto.DEFAULT
