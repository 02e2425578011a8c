"""Weights found in a serialized model without parsing them: a scan of protobuf's wire format.

Parsing a 440 MB model with protobuf copies every weight into the proto; ``numpy_helper``
copies it again into an array, and reading ``raw_data`` from Python copies it a third time
(0.8 s of BERT-base's session creation on the H100 machine). The loader instead finds the
``raw_data`` of each initializer of the main graph in the model's bytes, has protobuf parse the
model without those bytes, and copies each weight once, into a host block of its own.

Only what protobuf would read the same way is lifted: a model whose ``graph`` field appears
more than once (protobuf merges the copies) or a tensor with more than one ``raw_data`` (the
last wins) is left whole. Anything the scan cannot read is left to protobuf, which gives the
error.
"""

from __future__ import annotations

from dataclasses import dataclass

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
MODEL_GRAPH = 7  # ModelProto.graph
GRAPH_INITIALIZER = 5  # GraphProto.initializer
TENSOR_RAW_DATA = 9  # TensorProto.raw_data


class WireError(ValueError):
    """The bytes are not protobuf wire format this scan reads (protobuf decides what they are)."""


@dataclass(frozen=True)
class RawData:
    """Where the ``raw_data`` of the main graph's initializer number ``index`` lies."""

    index: int
    offset: int
    nbytes: int


def strip_raw_data(buf: memoryview) -> tuple[bytes, list[RawData]] | None:
    """The model in ``buf`` without the ``raw_data`` of its main graph's initializers, and
    where those bytes lie in ``buf``; None when there is nothing to lift or the model is one
    this scan leaves to protobuf."""
    pieces: list[bytes | memoryview] = []
    lifted: list[RawData] = []
    seen_graph = False
    for number, wire, start, payload, end in _fields(buf, 0, len(buf)):
        if number == MODEL_GRAPH and wire == _LEN:
            if seen_graph:
                return None
            seen_graph = True
            graph = _strip_graph(buf, payload, end, lifted)
            pieces += (_key(MODEL_GRAPH, _LEN), _varint_bytes(len(graph)), graph)
        else:
            pieces.append(buf[start:end])
    if not lifted:
        return None
    return b"".join(pieces), lifted


def _strip_graph(buf: memoryview, begin: int, end: int, lifted: list[RawData]) -> bytes:
    pieces: list[bytes | memoryview] = []
    kept_from = begin  # fields copied as they are, in one slice
    index = 0
    for number, wire, start, payload, stop in _fields(buf, begin, end):
        if number != GRAPH_INITIALIZER or wire != _LEN:
            continue
        stripped = _strip_tensor(buf, payload, stop)
        if stripped is not None:
            tensor, raw = stripped
            pieces += (buf[kept_from:start], _key(GRAPH_INITIALIZER, _LEN))
            pieces += (_varint_bytes(len(tensor)), tensor)
            kept_from = stop
            lifted.append(RawData(index, *raw))
        index += 1
    pieces.append(buf[kept_from:end])
    return b"".join(pieces)


def _strip_tensor(buf: memoryview, begin: int, end: int) -> tuple[bytes, tuple[int, int]] | None:
    raw: tuple[int, int, int] | None = None
    for number, wire, start, payload, stop in _fields(buf, begin, end):
        if number == TENSOR_RAW_DATA:
            if raw is not None or wire != _LEN:
                return None
            raw = (start, payload, stop)
    if raw is None:
        return None
    start, payload, stop = raw
    return b"".join((buf[begin:start], buf[stop:end])), (payload, stop - payload)


def _fields(buf: memoryview, pos: int, end: int):
    """(field number, wire type, field start, payload start, field end) of each field."""
    while pos < end:
        start = pos
        key, pos = _varint(buf, pos, end)
        wire = key & 7
        if wire == _VARINT:
            payload = pos
            _, pos = _varint(buf, pos, end)
        elif wire == _LEN:
            size, payload = _varint(buf, pos, end)
            pos = payload + size
        elif wire == _I64:
            payload, pos = pos, pos + 8
        elif wire == _I32:
            payload, pos = pos, pos + 4
        else:  # groups (deprecated, unused by ONNX) and invalid wire types
            raise WireError(f"wire type {wire} at byte {start}")
        if pos > end:
            raise WireError(f"field at byte {start} runs past its message's end")
        yield key >> 3, wire, start, payload, pos


def _varint(buf: memoryview, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while pos < end:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift >= 64:
            break
    raise WireError(f"bad varint before byte {pos}")


def _varint_bytes(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _key(number: int, wire: int) -> bytes:
    return _varint_bytes(number << 3 | wire)
