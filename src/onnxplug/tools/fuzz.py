"""A model fuzzer: mutated models, each loaded and run in a child process with time and memory
limits, every outcome classified.

Cases are made from the seed models of ``fuzz_corpus`` by one mutation each:

* ``bytes``: bit flips, random bytes, inserted, deleted or repeated ranges of the serialized
  model; ``truncate``: the model cut short;
* structured protobuf mutations: ``dims`` (value infos and tensors), ``types`` (element types,
  Cast targets, tensor vs sequence), ``attributes`` (values, type tags, names, missing and
  unknown attributes), ``edges`` (inputs rewired, outputs renamed, nodes removed, duplicated,
  reordered or changed to another op), ``initializers`` (values, including shape tensors, and
  data sizes), ``external`` (locations, offsets, lengths and keys of external data) and
  ``subgraphs`` (the structured mutations inside If/Loop/Scan bodies, body signatures).

A case is a pure function of ``(seed, index)``, so a campaign and any single case can be
replayed. Each case runs in a child forked from a worker that has imported the runtime once
(a fork costs milliseconds; starting Python costs a second). The child gets an address-space
limit (``--mem-limit-mb`` above what the worker already maps), loads the model, feeds random
inputs of the declared types and runs it with ``RunOptions.terminate`` set after
``--run-seconds``; the worker kills it after ``--time-limit`` seconds. Outcomes:

=================  ==========================================================================
``rejected``       a typed error (onnxruntime's exception classes) when the session is created
``run_error``      a typed error from the run (a bad feed for this model, a kernel refusing)
``terminated``     the run honoured ``RunOptions.terminate`` (a legitimately long model)
``run_oom``        the run needed more memory than the limit and said so with a typed error
``accepted``       loaded and ran; ``accepted_invalid`` when onnxruntime (the oracle, when
                   installed) refuses the same model or run: an invalid model run silently
``unexpected``     a typed error that no check anticipated (``unexpected error while ...``)
``untyped``        an exception that is not one of onnxruntime's classes
``crash``          the child died of a signal or exited without a result
``hang``           the child outlived ``--time-limit`` (terminate was ignored)
``memory``         memory ran out while *creating the session*, or the child was killed for it
=================  ==========================================================================

``crash``, ``hang``, ``memory`` and ``untyped`` fail a campaign. ``--target onnxruntime`` runs
the same cases against onnxruntime (CPU) for comparison. Run as::

    python -m onnxplug.tools.fuzz --cases 10000 --seed 0 [--target onnxruntime] [--json FILE]
    python -m onnxplug.tools.fuzz --seed 0 --case 1234 --save DIR   # replay one case
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

FAILING = ("crash", "hang", "memory", "untyped")
CLASSES = (
    "rejected",
    "run_error",
    "terminated",
    "run_oom",
    "accepted",
    "accepted_invalid",
    "unexpected",
    "untyped",
    "crash",
    "hang",
    "memory",
)
MUTATIONS = (
    "bytes",
    "truncate",
    "dims",
    "types",
    "attributes",
    "edges",
    "initializers",
    "external",
    "subgraphs",
)
_THREAD_ENV = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
_INTERESTING = [
    -(2**63),
    -(2**31),
    -1000,
    -2,
    -1,
    0,
    1,
    2,
    3,
    7,
    64,
    1000,
    2**20,
    2**31 - 1,
    2**31,
    2**40,
    2**63 - 1,
]


@dataclass
class Case:
    index: int
    seed_model: str
    mutation: str
    detail: str


@dataclass
class Result:
    index: int
    seed_model: str
    mutation: str
    detail: str
    cls: str
    stage: str = ""
    error: str = ""
    oracle: str = ""
    seconds: float = 0.0
    max_rss_mb: float = 0.0


# ---------------------------------------------------------------------------------------------
# cases


def _graphs(g: Any) -> list[Any]:
    out = [g]
    for n in g.node:
        for a in n.attribute:
            if a.HasField("g"):
                out.extend(_graphs(a.g))
            for sg in a.graphs:
                out.extend(_graphs(sg))
    return out


def _value_names(g: Any) -> list[str]:
    names = [vi.name for vi in g.input] + [t.name for t in g.initializer]
    names += [o for n in g.node for o in n.output if o]
    return names


def _value_infos(model: Any) -> list[Any]:
    return [vi for g in _graphs(model.graph) for vi in (*g.input, *g.output, *g.value_info)]


def _tensors(model: Any) -> list[Any]:
    out = []
    for g in _graphs(model.graph):
        out.extend(g.initializer)
        for n in g.node:
            for a in n.attribute:
                if a.HasField("t"):
                    out.append(a.t)
    return out


def _nodes(model: Any) -> list[tuple[Any, Any]]:
    return [(g, n) for g in _graphs(model.graph) for n in g.node]


def _pick(rng: random.Random, items: list[Any]) -> Any:
    return items[rng.randrange(len(items))] if items else None


def _int(rng: random.Random) -> int:
    return _pick(rng, _INTERESTING) if rng.random() < 0.7 else rng.randint(-10, 10)


def mutate_bytes(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    buf = bytearray(data)
    ops = []
    for _ in range(rng.randint(1, 8)):
        if not buf:
            break
        op = rng.choice(("flip", "set", "insert", "delete", "repeat"))
        pos = rng.randrange(len(buf))
        if op == "flip":
            buf[pos] ^= 1 << rng.randrange(8)
        elif op == "set":
            buf[pos] = rng.randrange(256)
        elif op == "insert":
            buf[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
        elif op == "delete":
            del buf[pos : pos + rng.randint(1, 16)]
        else:
            chunk = buf[pos : pos + rng.randint(1, 64)]
            buf[pos:pos] = chunk * rng.randint(1, 4)
        ops.append(f"{op}@{pos}")
    return bytes(buf), " ".join(ops)


def mutate_truncate(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    cut = rng.randrange(len(data))
    return data[:cut], f"cut at {cut} of {len(data)}"


def _mutate_dims(model: Any, rng: random.Random) -> str:
    if rng.random() < 0.6:
        vi = _pick(rng, [v for v in _value_infos(model) if v.type.HasField("tensor_type")])
        if vi is None:
            return "no value info"
        shape = vi.type.tensor_type.shape
        if not shape.dim or rng.random() < 0.2:
            shape.dim.add().dim_value = _int(rng)
            return f"{vi.name}: dim added"
        d = _pick(rng, list(shape.dim))
        choice = rng.random()
        if choice < 0.6:
            d.dim_value = _int(rng)
            return f"{vi.name}: dim_value {d.dim_value}"
        if choice < 0.8:
            d.dim_param = rng.choice(("N", "", "batch", "\u00e9"))
            return f"{vi.name}: dim_param {d.dim_param!r}"
        del shape.dim[rng.randrange(len(shape.dim))]
        return f"{vi.name}: dim removed"
    t = _pick(rng, _tensors(model))
    if t is None:
        return "no tensor"
    if t.dims and rng.random() < 0.8:
        k = rng.randrange(len(t.dims))
        t.dims[k] = _int(rng)
        return f"tensor {t.name}: dims[{k}] = {t.dims[k]}"
    t.dims.append(_int(rng))
    return f"tensor {t.name}: dim appended"


def _elem(rng: random.Random) -> int:
    return rng.choice([*range(0, 26), 999, -1, 2**31 - 1])


def _mutate_types(model: Any, rng: random.Random) -> str:
    choice = rng.random()
    if choice < 0.45:
        vi = _pick(rng, [v for v in _value_infos(model) if v.type.HasField("tensor_type")])
        if vi is None:
            return "no value info"
        if rng.random() < 0.15:
            inner = type(vi.type)()
            inner.CopyFrom(vi.type)
            vi.type.sequence_type.elem_type.CopyFrom(inner)
            return f"{vi.name}: tensor -> sequence"
        vi.type.tensor_type.elem_type = _elem(rng)
        return f"{vi.name}: elem_type {vi.type.tensor_type.elem_type}"
    if choice < 0.75:
        t = _pick(rng, _tensors(model))
        if t is None:
            return "no tensor"
        t.data_type = _elem(rng)
        return f"tensor {t.name}: data_type {t.data_type}"
    casts = [
        a
        for _, n in _nodes(model)
        for a in n.attribute
        if a.name in ("to", "dtype") and a.type == a.INT
    ]
    a = _pick(rng, casts)
    if a is None:
        return "no type attribute"
    a.i = _elem(rng)
    return f"attribute {a.name} = {a.i}"


def _mutate_attributes(model: Any, rng: random.Random) -> str:
    import onnx

    nodes = _nodes(model)
    g, n = _pick(rng, nodes)
    A = onnx.AttributeProto
    choice = rng.random()
    attrs = [a for a in n.attribute if not a.HasField("g")]
    if attrs and choice < 0.5:
        a = _pick(rng, attrs)
        if a.type == A.INT:
            a.i = _int(rng)
            return f"{n.op_type}.{a.name} = {a.i}"
        if a.type == A.INTS and len(a.ints):
            k = rng.randrange(len(a.ints))
            a.ints[k] = _int(rng)
            return f"{n.op_type}.{a.name}[{k}] = {a.ints[k]}"
        if a.type == A.FLOAT:
            a.f = rng.choice([float("nan"), float("inf"), -1e30, 0.0, -1.0])
            return f"{n.op_type}.{a.name} = {a.f}"
        if a.type == A.STRING:
            a.s = rng.choice([b"", b"NOTSET", b"SAME_UPPER", b"bogus", b"\xff\xfe"])
            return f"{n.op_type}.{a.name} = {a.s!r}"
        if a.type == A.INTS:
            a.ints.extend([_int(rng)])
            return f"{n.op_type}.{a.name} appended"
    if attrs and choice < 0.65:
        a = _pick(rng, attrs)
        a.type = rng.choice([t for t in range(0, 15) if t != a.type])
        return f"{n.op_type}.{a.name}: type tag {a.type}"
    if attrs and choice < 0.75:
        a = _pick(rng, attrs)
        a.name = a.name[:-1] + "z" if a.name else "z"
        return f"{n.op_type}: attribute renamed to {a.name}"
    if attrs and choice < 0.85:
        a = _pick(rng, attrs)
        n.attribute.remove(a)
        return f"{n.op_type}: attribute {a.name} removed"
    new = n.attribute.add()
    new.name = rng.choice(["padz", "axis", "kernel_shape", "dilations", "to", "perm", "mode"])
    kind = rng.random()
    if kind < 0.4:
        new.type, new.i = A.INT, _int(rng)
    elif kind < 0.8:
        new.type = A.INTS
        new.ints.extend(_int(rng) for _ in range(rng.randint(0, 4)))
    else:
        new.type, new.s = A.STRING, b"bogus"
    return f"{n.op_type}: attribute {new.name} added"


def _mutate_edges(model: Any, rng: random.Random) -> str:
    nodes = _nodes(model)
    g, n = _pick(rng, nodes)
    names = _value_names(g)
    choice = rng.random()
    if choice < 0.3 and len(n.input):
        k = rng.randrange(len(n.input))
        n.input[k] = rng.choice([*names, *n.output, "", "missing", n.input[k]])
        return f"{n.op_type} input {k} -> {n.input[k]!r}"
    if choice < 0.4:
        n.input.append(rng.choice([*names, ""]))
        return f"{n.op_type}: input added"
    if choice < 0.5 and len(n.input):
        del n.input[-1]
        return f"{n.op_type}: last input removed"
    if choice < 0.6 and len(n.output):
        k = rng.randrange(len(n.output))
        n.output[k] = rng.choice([*names, ""])
        return f"{n.op_type} output {k} -> {n.output[k]!r}"
    if choice < 0.65:
        n.output.append("extra_out")
        return f"{n.op_type}: output added"
    if choice < 0.75:
        g.node.remove(n)
        return f"{n.op_type}: node removed"
    if choice < 0.8:
        g.node.add().CopyFrom(n)
        return f"{n.op_type}: node duplicated"
    if choice < 0.85 and len(g.node) > 1:
        i, j = rng.randrange(len(g.node)), rng.randrange(len(g.node))
        a, b = type(n)(), type(n)()
        a.CopyFrom(g.node[i])
        b.CopyFrom(g.node[j])
        g.node[i].CopyFrom(b)
        g.node[j].CopyFrom(a)
        return f"nodes {i} and {j} swapped"
    if choice < 0.95:
        n.op_type = rng.choice(
            ["Relu", "Add", "Conv", "Reshape", "Expand", "Loop", "If", "Concat", "Gather"]
            + ["Slice", "Pad", "Tile", "ConstantOfShape", "Resize", "Split", "TopK", "Bogus"]
        )
        return f"op_type -> {n.op_type}"
    n.domain = rng.choice(["com.microsoft", "ai.onnx.ml", "bogus", "ai.onnx"])
    return f"{n.op_type}: domain -> {n.domain}"


def _mutate_initializers(model: Any, rng: random.Random) -> str:
    import numpy as np
    from onnx import numpy_helper

    t = _pick(rng, _tensors(model))
    if t is None:
        return "no tensor"
    choice = rng.random()
    if choice < 0.5:
        try:
            arr = numpy_helper.to_array(t).copy()
        except Exception:
            return f"tensor {t.name}: unreadable"
        if arr.size == 0:
            return f"tensor {t.name}: empty"
        flat = arr.reshape(-1)
        k = rng.randrange(flat.size)
        if arr.dtype.kind in "iu":
            flat[k] = np.array(_int(rng)).astype(arr.dtype)
        elif arr.dtype.kind == "f":
            flat[k] = rng.choice([np.nan, np.inf, -np.inf, 1e30, -1.0, 0.0])
        t.CopyFrom(numpy_helper.from_array(arr, t.name))
        return f"tensor {t.name}[{k}] = {flat[k]}"
    if choice < 0.75 and t.HasField("raw_data"):
        cut = rng.randrange(len(t.raw_data) + 1)
        t.raw_data = t.raw_data[:cut] + (b"\x07" * rng.randint(0, 9))
        return f"tensor {t.name}: raw_data resized to {len(t.raw_data)}"
    if choice < 0.9:
        t.ClearField("raw_data")
        t.float_data.extend([1.0] * rng.randint(0, 3))
        return f"tensor {t.name}: raw data replaced by float_data"
    t.data_location = 1
    e = t.external_data.add()
    e.key, e.value = "location", rng.choice(["weights.bin", "../x", "/dev/zero", ""])
    return f"tensor {t.name}: made external ({e.value})"


_LOCATIONS = [
    "../weights.bin",
    "/etc/passwd",
    "/dev/zero",
    "weights.bin\0x",
    "",
    ".",
    "missing.bin",
    "sub/../weights.bin",
    "fifo",
    "link_out",
    "\\\\server\\share",
    "C:weights.bin",
    "model.onnx",
]


def _mutate_external(model: Any, rng: random.Random) -> str:
    ext = [t for t in _tensors(model) if t.data_location == 1]
    t = _pick(rng, ext)
    if t is None:
        return "no external tensor"
    entries = {e.key: e for e in t.external_data}
    choice = rng.random()
    if choice < 0.35:
        entries["location"].value = rng.choice(_LOCATIONS)
        return f"{t.name}: location {entries['location'].value!r}"
    if choice < 0.7:
        key = rng.choice(["offset", "length"])
        e = entries.get(key) or t.external_data.add()
        e.key = key
        e.value = rng.choice([str(_int(rng)), "abc", "", "1e3", " 4"])
        return f"{t.name}: {key} {e.value!r}"
    if choice < 0.8:
        e = _pick(rng, list(t.external_data))
        e.key = rng.choice(["offst", "Length", "checksum", "location "])
        return f"{t.name}: key renamed to {e.key!r}"
    if choice < 0.9:
        e = _pick(rng, list(t.external_data))
        t.external_data.add().CopyFrom(e)
        return f"{t.name}: key {e.key} repeated"
    e = _pick(rng, list(t.external_data))
    t.external_data.remove(e)
    return f"{t.name}: key {e.key} removed"


def _mutate_subgraphs(model: Any, rng: random.Random) -> str:
    import onnx

    holders = [(g, n, a) for g, n in _nodes(model) for a in n.attribute if a.HasField("g")]
    if not holders:
        return "no subgraph"
    g, n, a = _pick(rng, holders)
    choice = rng.random()
    if choice < 0.5:
        sub = onnx.ModelProto()
        sub.graph.CopyFrom(a.g)
        what = rng.choice((_mutate_dims, _mutate_types, _mutate_attributes, _mutate_edges))
        detail = what(sub, rng)
        a.g.CopyFrom(sub.graph)
        return f"{n.op_type}.{a.name}: {detail}"
    if choice < 0.65 and len(a.g.output):
        del a.g.output[-1]
        return f"{n.op_type}.{a.name}: last output removed"
    if choice < 0.75:
        a.g.input.add().CopyFrom(a.g.input[0] if len(a.g.input) else g.input[0])
        return f"{n.op_type}.{a.name}: input added"
    if choice < 0.85 and n.output:
        body = a.g
        if body.node:
            body.node[0].input.append(n.output[0])  # the node's own output, from inside
        return f"{n.op_type}.{a.name}: reads the node's own output {n.output[0]}"
    others = [b for _, m in _nodes(model) for b in m.attribute if b.HasField("g") and b is not a]
    if others:
        a.g.CopyFrom(_pick(rng, others).g)
        return f"{n.op_type}.{a.name}: replaced by another subgraph"
    a.ClearField("g")
    return f"{n.op_type}.{a.name}: graph cleared"


_STRUCTURED: dict[str, Callable[[Any, random.Random], str]] = {
    "dims": _mutate_dims,
    "types": _mutate_types,
    "attributes": _mutate_attributes,
    "edges": _mutate_edges,
    "initializers": _mutate_initializers,
    "external": _mutate_external,
    "subgraphs": _mutate_subgraphs,
}


def make_case(seed: int, index: int, seeds: list[Any]) -> tuple[Case, bytes, dict[str, bytes]]:
    """Case ``index`` of campaign ``seed``: (description, model bytes, files beside it)."""
    import onnx

    rng = random.Random(seed * 1_000_003 + index)
    mutation = MUTATIONS[rng.randrange(len(MUTATIONS))]
    pool = seeds
    if mutation == "external":
        pool = [s for s in seeds if s.files]
    elif mutation == "subgraphs":
        pool = [
            s
            for s in seeds
            if any(a.HasField("g") for n in s.model.graph.node for a in n.attribute)
        ]
    s = _pick(rng, pool)
    if mutation in ("bytes", "truncate"):
        data = s.model.SerializeToString()
        fn = mutate_bytes if mutation == "bytes" else mutate_truncate
        data, detail = fn(data, rng)
    else:
        m = onnx.ModelProto()
        m.CopyFrom(s.model)
        detail = _STRUCTURED[mutation](m, rng)
        data = m.SerializeToString()
    return Case(index, s.name, mutation, detail), data, dict(s.files)


def write_case(folder: Path, data: bytes, files: dict[str, bytes]) -> Path:
    """The case's model and external files in ``folder``, with the traps the external-data
    mutations point at (a FIFO, a symlink out of the folder, a subfolder)."""
    path = folder / "model.onnx"
    path.write_bytes(data)
    for name, content in files.items():
        (folder / name).write_bytes(content)
    if files:
        os.mkfifo(folder / "fifo")
        (folder / "link_out").symlink_to("/etc/hostname")
        (folder / "sub").mkdir()
    return path


# ---------------------------------------------------------------------------------------------
# running one case (in the child)


def _chain(e: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    cur: BaseException | None = e
    while cur is not None and len(out) < 20:
        out.append(cur)
        cur = cur.__cause__ or cur.__context__
    return out


def classify_error(target: str, stage: str, e: BaseException) -> str:
    chain = _chain(e)
    text = " ".join(str(x) for x in chain)
    out_of_memory = any(isinstance(x, MemoryError) for x in chain) or (
        "bad_alloc" in text or "Failed to allocate" in text or "Unable to allocate" in text
    )
    if target == "onnxruntime":
        typed = type(e).__module__.startswith("onnxruntime")
    else:
        from onnxplug.errors import OnnxPlugError

        typed = isinstance(e, OnnxPlugError)
    if out_of_memory:
        return "run_oom" if stage == "run" and typed else "memory"
    if not typed:
        return "untyped"
    if "terminate flag" in text:
        return "terminated"
    if target == "onnxplug":
        from onnxplug.session.inference_session import UNEXPECTED

        if UNEXPECTED in str(e):
            return "unexpected"
    return "rejected" if stage == "load" else "run_error"


_NP_TYPES = {
    "tensor(float)": "float32",
    "tensor(double)": "float64",
    "tensor(float16)": "float16",
    "tensor(int64)": "int64",
    "tensor(int32)": "int32",
    "tensor(int16)": "int16",
    "tensor(int8)": "int8",
    "tensor(uint8)": "uint8",
    "tensor(uint16)": "uint16",
    "tensor(uint32)": "uint32",
    "tensor(uint64)": "uint64",
    "tensor(bool)": "bool",
    "tensor(string)": "object",
}


def make_feeds(inputs: list[Any], seed: int) -> dict[str, Any] | None:
    """Random feeds for a session's declared inputs (symbolic or unknown dims are 2); None when
    an input cannot be made (a type we do not feed, or over a million elements)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    feeds: dict[str, Any] = {}
    for i in inputs:
        kind = i.type
        seq = kind.startswith("seq(")
        if seq:
            kind = kind[4:-1]
        dtype = _NP_TYPES.get(kind)
        if dtype is None:
            return None
        shape = [d if isinstance(d, int) and d >= 0 else 2 for d in (i.shape or [])]
        size = 1
        for d in shape:
            size *= d
        if size > 1_000_000:
            return None
        if dtype == "object":
            arr = np.array(["a"] * size, dtype=object).reshape(shape)
        elif dtype == "bool":
            arr = np.asarray(rng.random(shape) < 0.5)
        elif dtype.startswith(("int", "uint")):
            arr = rng.integers(0, 3, size=shape).astype(dtype)
        else:
            arr = rng.standard_normal(shape).astype(dtype)
        feeds[i.name] = [arr] if seq else arr
    return feeds


def _load(target: str, path: Path) -> Any:
    if target == "onnxruntime":
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.log_severity_level = 4
        opts.intra_op_num_threads = 1
        opts.inter_op_num_threads = 1
        return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    import onnxplug

    return onnxplug.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _run(target: str, sess: Any, feeds: dict[str, Any], run_seconds: float) -> None:
    if target == "onnxruntime":
        import onnxruntime as ort

        opts = ort.RunOptions()
    else:
        import onnxplug

        opts = onnxplug.RunOptions()
    timer = threading.Timer(run_seconds, lambda: setattr(opts, "terminate", True))
    timer.daemon = True
    timer.start()
    try:
        sess.run(None, feeds, opts)
    finally:
        timer.cancel()


def _attempt(target: str, path: Path, feed_seed: int, run_seconds: float) -> dict[str, Any]:
    """Load and run once; the outcome as a dict (never raises)."""
    stage = "load"
    try:
        sess = _load(target, path)
        stage = "feeds"
        feeds = make_feeds(sess.get_inputs(), feed_seed)
        if feeds is None:
            return {"cls": "accepted", "stage": "not run (inputs not fed)"}
        stage = "run"
        _run(target, sess, feeds, run_seconds)
        return {"cls": "accepted", "stage": "run"}
    except BaseException as e:  # the child reports everything; the parent classifies
        out = {
            "cls": classify_error(target, stage, e),
            "stage": stage,
            "error": f"{type(e).__name__}: {e}"[:400],
        }
        if os.environ.get("ONNXPLUG_FUZZ_TRACEBACK"):
            import traceback

            out["error"] += " | " + "".join(traceback.format_exception(e))[-1500:]
        return out


def _child_main(
    target: str,
    oracle: bool,
    path: Path,
    feed_seed: int,
    run_seconds: float,
    mem_limit: int,
    fd: int,
) -> None:
    import faulthandler

    faulthandler.disable()  # a crash is the parent's to report, not a traceback on stderr
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    if mem_limit:
        limit = _mapped_bytes() + mem_limit
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    ours = _attempt(target, path, feed_seed, run_seconds)
    os.write(fd, (json.dumps(ours) + "\n").encode())
    if oracle and ours["cls"] == "accepted":
        theirs = _attempt("onnxruntime", path, feed_seed, run_seconds)
        os.write(fd, (json.dumps(theirs) + "\n").encode())
    os._exit(0)


def _mapped_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run_case(
    target: str,
    oracle: bool,
    case: Case,
    data: bytes,
    files: dict[str, bytes],
    workdir: Path,
    time_limit: float,
    run_seconds: float,
    mem_limit: int,
) -> Result:
    folder = Path(tempfile.mkdtemp(prefix=f"case{case.index}_", dir=workdir))
    try:
        path = write_case(folder, data, files)
        rfd, wfd = os.pipe()
        t0 = time.monotonic()
        pid = os.fork()
        if pid == 0:  # pragma: no cover (the child)
            try:
                os.close(rfd)
                _child_main(target, oracle, path, case.index, run_seconds, mem_limit, wfd)
            finally:
                os._exit(70)
        os.close(wfd)
        lines, hung = _read_until(rfd, t0 + time_limit)
        if hung:
            os.kill(pid, signal.SIGKILL)
        _, status, usage = os.wait4(pid, 0)
        os.close(rfd)
        seconds = time.monotonic() - t0
        res = Result(**asdict(case), cls="crash", seconds=round(seconds, 3))
        res.max_rss_mb = round(usage.ru_maxrss / 1024, 1)
        if lines:
            ours = lines[0]
            res.cls, res.stage, res.error = ours["cls"], ours["stage"], ours.get("error", "")
            if len(lines) > 1:
                res.oracle = lines[1]["cls"]
                if res.oracle not in ("accepted", "terminated"):
                    res.cls = "accepted_invalid"
                    res.error = f"onnxruntime: {lines[1].get('error', '')}"[:400]
            elif oracle and res.cls == "accepted":
                res.oracle = "hang" if hung else "crash"
        if hung and not lines:
            res.cls, res.error = "hang", f"no result after {time_limit} s"
        elif not lines:
            if os.WIFSIGNALED(status):
                sig = os.WTERMSIG(status)
                res.cls = "memory" if sig == signal.SIGKILL else "crash"
                res.error = f"killed by {signal.Signals(sig).name}"
            else:
                res.error = f"exited with status {os.waitstatus_to_exitcode(status)}"
        return res
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _read_until(fd: int, deadline: float) -> tuple[list[dict[str, Any]], bool]:
    buf = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return _lines(buf), True
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            return _lines(buf), False
        buf += chunk


def _lines(buf: bytes) -> list[dict[str, Any]]:
    out = []
    for line in buf.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


# ---------------------------------------------------------------------------------------------
# campaigns


def oracle_available() -> bool:
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        return False
    return True


def _worker(args: argparse.Namespace) -> int:
    """One shard of a campaign, in this process (imports once, forks per case)."""
    from .fuzz_corpus import corpus

    seeds = corpus()
    oracle = args.oracle and args.target == "onnxplug" and oracle_available()
    workdir = Path(tempfile.mkdtemp(prefix="onnxplug-fuzz-"))
    try:
        # warm up: import everything a session needs before forking, so children start fast
        for s in seeds:
            path = write_case(
                Path(tempfile.mkdtemp(dir=workdir)), s.model.SerializeToString(), s.files
            )
            _attempt(args.target, path, 0, args.run_seconds)
            if oracle:
                _attempt("onnxruntime", path, 0, args.run_seconds)
        shard, shards = args.shard
        out = open(args.out, "w") if args.out else sys.stdout
        with out:
            for index in range(args.first, args.first + args.cases):
                if index % shards != shard:
                    continue
                case, data, files = make_case(args.seed, index, seeds)
                res = run_case(
                    args.target,
                    oracle,
                    case,
                    data,
                    files,
                    workdir,
                    args.time_limit,
                    args.run_seconds,
                    args.mem_limit_mb * 2**20,
                )
                out.write(json.dumps(asdict(res)) + "\n")
                out.flush()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


def campaign(
    cases: int,
    seed: int = 0,
    workers: int | None = None,
    target: str = "onnxplug",
    oracle: bool = True,
    first: int = 0,
    time_limit: float = 30.0,
    run_seconds: float = 5.0,
    mem_limit_mb: int = 2048,
    progress: bool = False,
) -> list[Result]:
    """Run cases ``first .. first+cases-1`` of campaign ``seed`` over ``workers`` processes."""
    workers = max(1, workers or os.cpu_count() or 1)
    env = dict(os.environ)
    for var in _THREAD_ENV:
        env[var] = "1"
    tmp = Path(tempfile.mkdtemp(prefix="onnxplug-fuzz-out-"))
    procs = []
    try:
        for k in range(workers):
            cmd = [
                sys.executable,
                "-m",
                "onnxplug.tools.fuzz",
                "--worker",
                f"--shard={k}/{workers}",
                f"--out={tmp / f'{k}.jsonl'}",
                f"--cases={cases}",
                f"--first={first}",
                f"--seed={seed}",
                f"--target={target}",
                f"--time-limit={time_limit}",
                f"--run-seconds={run_seconds}",
                f"--mem-limit-mb={mem_limit_mb}",
                "--oracle" if oracle else "--no-oracle",
            ]
            procs.append(subprocess.Popen(cmd, env=env))
        while any(p.poll() is None for p in procs):
            time.sleep(1.0)
            if progress:
                done = sum(_count_lines(tmp / f"{k}.jsonl") for k in range(workers))
                print(f"\r{done}/{cases} cases", end="", file=sys.stderr, flush=True)
        if progress:
            print(file=sys.stderr)
        bad = [p.returncode for p in procs if p.returncode]
        if bad:
            raise RuntimeError(f"fuzz workers failed with status {bad}")
        results: list[Result] = []
        for k in range(workers):
            with open(tmp / f"{k}.jsonl") as f:
                results.extend(Result(**json.loads(line)) for line in f if line.strip())
        return sorted(results, key=lambda r: r.index)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)


def _count_lines(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def summary(results: list[Result], target: str, seconds: float | None = None) -> str:
    counts = Counter(r.cls for r in results)
    lines = [f"{len(results)} cases against {target}" + (f" in {seconds:.0f} s" if seconds else "")]
    for cls in CLASSES:
        if counts.get(cls):
            lines.append(f"  {cls:<17} {counts[cls]:>7}")
    by_mut: dict[str, Counter[str]] = {}
    for r in results:
        by_mut.setdefault(r.mutation, Counter())[r.cls] += 1
    shown = [c for c in CLASSES if counts.get(c)]
    lines.append("")
    lines.append("  " + f"{'mutation':<13}" + "".join(f"{c[:10]:>11}" for c in shown))
    for m in MUTATIONS:
        if m in by_mut:
            lines.append("  " + f"{m:<13}" + "".join(f"{by_mut[m].get(c, 0):>11}" for c in shown))
    bad = [r for r in results if r.cls in (*FAILING, "unexpected", "accepted_invalid")]
    if bad:
        lines.append("")
        lines.append(
            "cases to look at (replay: python -m onnxplug.tools.fuzz --case N --save DIR):"
        )
        for r in bad[:40]:
            lines.append(
                f"  [{r.cls}] case {r.index} {r.seed_model}/{r.mutation} ({r.detail}): "
                f"{r.error[:160]}"
            )
        if len(bad) > 40:
            lines.append(f"  ... and {len(bad) - 40} more")
    return "\n".join(lines)


def failures(results: list[Result]) -> list[Result]:
    return [r for r in results if r.cls in FAILING]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m onnxplug.tools.fuzz", description=__doc__.split("\n")[0]
    )
    p.add_argument("--cases", type=int, default=1000)
    p.add_argument("--first", type=int, default=0, help="index of the first case")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=None, help="default: one per CPU core")
    p.add_argument("--target", choices=("onnxplug", "onnxruntime"), default="onnxplug")
    p.add_argument(
        "--oracle",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="check accepted models against onnxruntime when it is installed",
    )
    p.add_argument("--time-limit", type=float, default=30.0, help="seconds before a case hangs")
    p.add_argument("--run-seconds", type=float, default=5.0, help="terminate a run after this")
    p.add_argument("--mem-limit-mb", type=int, default=2048, help="address space per case")
    p.add_argument("--json", help="write every result to this file")
    p.add_argument("--case", type=int, help="replay one case and print its result")
    p.add_argument("--save", help="with --case: write the case's files to this folder")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument(
        "--shard",
        type=lambda s: tuple(int(x) for x in s.split("/")),
        default=(0, 1),
        help=argparse.SUPPRESS,
    )
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return _worker(args)
    if args.case is not None:
        from .fuzz_corpus import corpus

        case, data, files = make_case(args.seed, args.case, corpus())
        if args.save:
            folder = Path(args.save)
            folder.mkdir(parents=True, exist_ok=True)
            write_case(folder, data, files)
            print(f"wrote {folder / 'model.onnx'}")
        res = campaign(
            1,
            args.seed,
            1,
            args.target,
            args.oracle,
            args.case,
            args.time_limit,
            args.run_seconds,
            args.mem_limit_mb,
        )
        print(json.dumps(asdict(res[0]), indent=1))
        return 1 if failures(res) else 0
    t0 = time.monotonic()
    results = campaign(
        args.cases,
        args.seed,
        args.workers,
        args.target,
        args.oracle,
        args.first,
        args.time_limit,
        args.run_seconds,
        args.mem_limit_mb,
        progress=sys.stderr.isatty(),
    )
    print(summary(results, args.target, time.monotonic() - t0))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in results], f)
    return 1 if failures(results) else 0


if __name__ == "__main__":
    sys.exit(main())
