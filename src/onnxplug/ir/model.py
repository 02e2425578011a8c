"""Loading a model: from a path, bytes or a ModelProto, with external data read safely.

External data (tensors stored beside the model) is read only from inside the model's folder:
a location that is absolute, or that resolves (through ``..`` or symlinks) to a file outside
the folder is refused. Model-local functions are inlined here; schema-defined function
ops are expanded later, by the partitioner, only where no provider has a kernel for them.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from google.protobuf.message import DecodeError
from onnx import ModelProto, TensorProto

from ..errors import Fail, InvalidArgument, InvalidGraph, InvalidProtobuf, NoSuchFile
from .validate import SUB_BYTE_BITS, check_proto
from .wire import RawData, WireError, strip_raw_data


@dataclass
class LoadedModel:
    """A loaded model: its proto (external data read, local functions inlined), its folder
    (None unless loaded from a file) and the weights lifted out of the proto."""

    proto: ModelProto
    base_dir: Path | None
    # main-graph initializers read straight from the model's bytes, by name: their tensors in
    # ``proto`` keep name, type and dims but no data
    weights: dict[str, np.ndarray]


def load_model(model: str | os.PathLike | bytes | ModelProto) -> LoadedModel:
    """Load a model from a path, bytes or a ModelProto (which is copied, not changed)."""
    base_dir: Path | None = None
    weights: dict[str, np.ndarray] = {}
    if isinstance(model, ModelProto):
        proto = ModelProto()
        proto.CopyFrom(model)
        _check_loaded(proto, base_dir, {})
    elif isinstance(model, (bytes, bytearray, memoryview)):
        with memoryview(model) as view:
            flat = view if view.c_contiguous else memoryview(view.tobytes())
            with flat.cast("B") as data:
                proto, weights = _load_serialized(data, "<bytes>", base_dir)
    elif isinstance(model, (str, os.PathLike)):
        path = Path(model)
        with _model_file_bytes(path) as data:
            base_dir = path.resolve().parent
            proto, weights = _load_serialized(data, str(path), base_dir)
    else:
        raise InvalidArgument(
            f"a model must be a path, bytes or onnx.ModelProto, not {type(model).__name__}"
        )
    if len(proto.functions):
        try:
            from onnx import inliner

            proto = inliner.inline_local_functions(proto)
        except Exception as e:  # the inliner rejects malformed functions
            raise InvalidGraph(f"could not inline the model's local functions: {e}") from e
    return LoadedModel(proto, base_dir, weights)


def _load_serialized(
    data: memoryview, where: str, base_dir: Path | None
) -> tuple[ModelProto, dict[str, np.ndarray]]:
    """Parse a serialized model, its main graph's weights lifted out of the proto (ir.wire),
    then copied once from ``data`` into one host block."""
    try:
        stripped = strip_raw_data(data)
    except WireError:
        stripped = None  # protobuf's parse below names what is wrong
    if stripped is None:
        proto = _parse(data, where)
        _check_loaded(proto, base_dir, {})
        return proto, {}
    proto = _parse(stripped[0], where)
    inits = proto.graph.initializer
    names = [t.name for t in inits]
    unique = len(set(names)) == len(names)
    lifted: dict[str, tuple[RawData, np.dtype]] = {}
    for raw in stripped[1]:
        t = inits[raw.index]
        dtype = _RAW_DTYPES.get(t.data_type)
        if unique and dtype is not None and t.data_location != TensorProto.EXTERNAL:
            lifted[t.name] = (raw, dtype)
        else:  # read as protobuf reads it (a type numpy_helper converts, a repeated name)
            t.raw_data = bytes(data[raw.offset : raw.offset + raw.nbytes])
    _check_loaded(proto, base_dir, {name: raw.nbytes for name, (raw, _) in lifted.items()})
    return proto, _copy_weights(data, proto, lifted)


def _check_loaded(proto: ModelProto, base_dir: Path | None, lifted: dict[str, int]) -> None:
    if not proto.HasField("graph"):
        raise InvalidGraph("the model has no graph")
    load_external_data(proto, base_dir)
    check_proto(proto, lifted)  # before any native code (the inliner, shape inference) reads it


# element types whose raw data numpy reads as it is (little-endian, one element per item)
_RAW_DTYPES: dict[int, np.dtype] = {
    TensorProto.FLOAT: np.dtype("<f4"),
    TensorProto.DOUBLE: np.dtype("<f8"),
    TensorProto.FLOAT16: np.dtype("<f2"),
    TensorProto.INT8: np.dtype("i1"),
    TensorProto.INT16: np.dtype("<i2"),
    TensorProto.INT32: np.dtype("<i4"),
    TensorProto.INT64: np.dtype("<i8"),
    TensorProto.UINT8: np.dtype("u1"),
    TensorProto.UINT16: np.dtype("<u2"),
    TensorProto.UINT32: np.dtype("<u4"),
    TensorProto.UINT64: np.dtype("<u8"),
    TensorProto.BOOL: np.dtype("?"),
}

# each weight starts on a 64-byte boundary of the block (vector loads, BLAS)
_WEIGHT_ALIGN = 64


def _copy_weights(
    data: memoryview, proto: ModelProto, lifted: dict[str, tuple[RawData, np.dtype]]
) -> dict[str, np.ndarray]:
    """Each lifted weight copied out of ``data`` into one block, as a read-only array."""
    dims = {t.name: tuple(int(d) for d in t.dims) for t in proto.graph.initializer}
    starts: dict[str, int] = {}
    size = 0
    for name, (raw, _) in lifted.items():
        starts[name] = size
        size += -(-raw.nbytes // _WEIGHT_ALIGN) * _WEIGHT_ALIGN
    block = np.empty(size + _WEIGHT_ALIGN, np.uint8)
    base = -block.ctypes.data % _WEIGHT_ALIGN
    weights: dict[str, np.ndarray] = {}
    for name, (raw, dtype) in lifted.items():
        at = base + starts[name]
        dest = block[at : at + raw.nbytes]
        dest[:] = np.frombuffer(data, np.uint8, raw.nbytes, raw.offset)
        weight = dest.view(dtype).reshape(dims[name])
        weight.flags.writeable = False  # shared by every run (ir.graph.read_only)
        weights[name] = weight
    return weights


# protobuf cannot parse a message of 2 GiB or more: bigger models keep weights as external data
_MAX_PROTO_BYTES = 2**31 - 1


@contextlib.contextmanager
def _model_file_bytes(path: Path) -> Iterator[memoryview]:
    """A model file's bytes: its pages mapped (a 400 MB model spent as long in ``read`` as in
    parsing), or read where the file system cannot map files. Nothing keeps the mapping once
    the model is loaded: rewriting the file afterwards changes no session."""
    size = _model_file_size(path)
    with open(path, "rb") as f:
        try:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        except (OSError, ValueError):  # a file system that cannot map files
            mapped = None
        if mapped is None:
            # the size stat saw, not the 2 GiB bound: read(n) reserves n bytes up front
            with memoryview(f.read(size)) as view:
                yield view
            return
    with mapped, memoryview(mapped) as view:
        yield view


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
