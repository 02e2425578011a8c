"""External data under attack: paths that escape the model's folder or are not regular files,
offsets and lengths that lie, unknown keys, and model paths that are devices or FIFOs. Every
case must fail at once with a typed error naming the tensor (or load correctly, for the valid
ones), never read outside the folder, block, or read more than the tensor's bytes."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import onnxplug as ox
from onnxplug import errors

CPU = ["CPUExecutionProvider"]
W = np.arange(6, dtype=np.float32).reshape(2, 3)


def _ext(name: str, dims, entries, data_type=TensorProto.FLOAT) -> TensorProto:
    t = TensorProto(name=name, data_type=data_type, dims=list(dims))
    t.data_location = TensorProto.EXTERNAL
    for k, v in entries:
        e = t.external_data.add()
        e.key, e.value = k, str(v)
    return t


def _save(folder: Path, inits, n_add: int = 1) -> Path:
    """model.onnx in ``folder``: Y = X + W (+ V when two initializers are given)."""
    names = [t.name for t in inits]
    nodes = [helper.make_node("Add", ["X", names[0]], ["Y0"])]
    if len(names) > 1:
        nodes.append(helper.make_node("Add", ["Y0", names[1]], ["Y1"]))
    out = "Y1" if len(names) > 1 else "Y0"
    g = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info(out, TensorProto.FLOAT, [2, 3])],
        list(inits),
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    path = folder / "model.onnx"
    path.write_bytes(m.SerializeToString())
    return path


def _load(path):
    return ox.InferenceSession(path, providers=CPU)


def _run(path) -> np.ndarray:
    return _load(path).run(None, {"X": np.zeros((2, 3), np.float32)})[0]


def _weights(folder: Path, name: str = "w.bin", extra: bytes = b"") -> Path:
    p = folder / name
    p.write_bytes(W.tobytes() + extra)
    return p


# ---------------------------------------------------------------------------------------------
# paths


@pytest.mark.parametrize(
    ("location", "pattern"),
    [
        ("/etc/passwd", "is an absolute path"),
        ("\\\\server\\share\\w.bin", "is an absolute path"),
        ("C:w.bin", "is an absolute path"),
        ("../w.bin", "escapes the model's folder"),
        ("sub/../../w.bin", "escapes the model's folder"),
        ("", "has no location"),
        ("w\0.bin", "has a NUL byte"),
    ],
)
def test_location_outside_the_folder_or_malformed(tmp_path, location, pattern):
    _weights(tmp_path.parent, "w.bin")
    path = _save(tmp_path, [_ext("W", [2, 3], [("location", location)])])
    with pytest.raises(errors.InvalidGraph, match=f"initializer 'W'.*{pattern}"):
        _load(path)


def test_missing_location_key(tmp_path):
    path = _save(tmp_path, [_ext("W", [2, 3], [("offset", 0)])])
    with pytest.raises(errors.InvalidGraph, match="initializer 'W': external data has no location"):
        _load(path)


def test_symlink_out_of_the_folder(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    _weights(outside)
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "w.bin").symlink_to(outside / "w.bin")
    path = _save(model_dir, [_ext("W", [2, 3], [("location", "w.bin")])])
    with pytest.raises(errors.InvalidGraph, match="outside the model's folder"):
        _load(path)


def test_symlink_to_dev_zero(tmp_path):
    (tmp_path / "w.bin").symlink_to("/dev/zero")
    path = _save(tmp_path, [_ext("W", [2, 3], [("location", "w.bin")])])
    with pytest.raises(errors.InvalidGraph, match="outside the model's folder"):
        _load(path)


@pytest.mark.parametrize("location", [".", "sub", "sub/"])
def test_location_is_a_directory(tmp_path, location):
    (tmp_path / "sub").mkdir()
    path = _save(tmp_path, [_ext("W", [2, 3], [("location", location)])])
    with pytest.raises(errors.InvalidGraph, match="initializer 'W'.*not a regular file"):
        _load(path)


def test_location_is_a_fifo_and_nothing_blocks(tmp_path):
    os.mkfifo(tmp_path / "w.bin")
    path = _save(tmp_path, [_ext("W", [2, 3], [("location", "w.bin")])])
    t0 = time.monotonic()
    with pytest.raises(errors.InvalidGraph, match="initializer 'W'.*not a regular file"):
        _load(path)
    assert time.monotonic() - t0 < 5


def test_missing_file(tmp_path):
    path = _save(tmp_path, [_ext("W", [2, 3], [("location", "absent.bin")])])
    with pytest.raises(errors.NoSuchFile, match="initializer 'W'.*'absent.bin' not found"):
        _load(path)


# ---------------------------------------------------------------------------------------------
# keys, offsets and lengths


@pytest.mark.parametrize(
    ("entries", "error", "pattern"),
    [
        ([("offst", 24)], errors.InvalidGraph, "unknown external data key 'offst'"),
        ([("Length", 24)], errors.InvalidGraph, "unknown external data key 'Length'"),
        ([("location", "w.bin")], errors.InvalidGraph, "key 'location' is given twice"),
        ([("offset", -1)], errors.InvalidGraph, "offset '-1' is not a byte count"),
        ([("offset", "abc")], errors.InvalidGraph, "offset 'abc' is not a byte count"),
        ([("offset", " 4")], errors.InvalidGraph, "offset ' 4' is not a byte count"),
        ([("offset", "+4")], errors.InvalidGraph, "offset '\\+4' is not a byte count"),
        ([("length", "")], errors.InvalidGraph, "length '' is not a byte count"),
        ([("length", "24.0")], errors.InvalidGraph, "length '24.0' is not a byte count"),
        ([("length", -24)], errors.InvalidGraph, "length '-24' is not a byte count"),
        ([("length", 12)], errors.InvalidGraph, "length 12 does not match the 24 bytes"),
        ([("length", 28)], errors.InvalidGraph, "length 28 does not match the 24 bytes"),
        ([("length", 10**12)], errors.Fail, "holds 32 bytes; offset 0 \\+ length 1000000000000"),
        ([("offset", 100)], errors.Fail, "holds 32 bytes; offset 100"),
        ([("offset", 12)], errors.Fail, "holds 32 bytes; offset 12 \\+ length 24 runs past"),
        ([("offset", 2**62), ("length", 24)], errors.Fail, "runs past its end"),
    ],
)
def test_lying_keys_offsets_and_lengths(tmp_path, entries, error, pattern):
    _weights(tmp_path, extra=b"\0" * 8)  # 32 bytes: the tensor's 24 and 8 spare
    path = _save(tmp_path, [_ext("W", [2, 3], [("location", "w.bin"), *entries])])
    with pytest.raises(error, match=f"initializer 'W'.*{pattern}"):
        _load(path)


try:
    import onnxruntime as ort
except ImportError:  # the comparisons are skipped without it
    ort = None


@pytest.mark.parametrize(
    "entries",
    [
        [("location", "sub/../w.bin")],  # '..' that stays inside the folder
        [("location", "./sub/../w.bin"), ("offset", 24)],
        [("location", "w.bin"), ("offset", 0), ("offset", 24)],  # a repeated key: its last value
        [("location", "w.bin"), ("offset", 24), ("length", 12), ("length", 24)],
        [("location", "w.bin"), ("length", 0)],  # a length of 0 reads as no length
        [("location", "w.bin"), ("offset", 24), ("length", 0)],
    ],
)
def test_entries_onnxruntime_reads_are_read_the_same_way(tmp_path, entries):
    (tmp_path / "sub").mkdir()
    (tmp_path / "w.bin").write_bytes(W.tobytes() + (10 * W).tobytes())
    path = _save(tmp_path, [_ext("W", [2, 3], entries)])
    offset = int(dict(entries).get("offset", 0))
    want = W if offset == 0 else 10 * W
    np.testing.assert_array_equal(_run(path), want)
    if ort is not None:
        sess = ort.InferenceSession(str(path), providers=CPU)
        np.testing.assert_array_equal(sess.run(None, {"X": np.zeros((2, 3), np.float32)})[0], want)


def test_dot_dot_through_a_folder_that_does_not_exist(tmp_path):
    """'nosub/../w.bin' names w.bin only lexically: the OS (and onnxruntime) cannot open it."""
    _weights(tmp_path)
    path = _save(tmp_path, [_ext("W", [2, 3], [("location", "nosub/../w.bin")])])
    with pytest.raises(errors.NoSuchFile, match="initializer 'W'.*'nosub/../w.bin' not found"):
        _load(path)
    if ort is not None:
        with pytest.raises(Exception):
            ort.InferenceSession(str(path), providers=CPU)


def test_dot_dot_through_a_symlink_resolves_where_the_os_does(tmp_path):
    """'link/../w.bin' with link -> outside/deep: the OS reads outside/w.bin, not w.bin here."""
    outside = tmp_path / "outside"
    (outside / "deep").mkdir(parents=True)
    _weights(outside)
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    _weights(model_dir)
    (model_dir / "link").symlink_to(outside / "deep")
    path = _save(model_dir, [_ext("W", [2, 3], [("location", "link/../w.bin")])])
    with pytest.raises(errors.InvalidGraph, match="escapes the model's folder with '..'"):
        _load(path)


def test_checksum_key_is_allowed(tmp_path):
    _weights(tmp_path)
    path = _save(tmp_path, [_ext("W", [2, 3], [("location", "w.bin"), ("checksum", "abc")])])
    np.testing.assert_array_equal(_run(path), W)


def test_without_length_only_the_tensor_is_read_from_a_huge_file(tmp_path):
    """No ``length``: the tensor's own 24 bytes are read, not the file's 2 GB to its end."""
    with open(tmp_path / "w.bin", "wb") as f:
        f.write(W.tobytes())
        f.truncate(2 * 1024**3)  # sparse: no disk, but 2 GB to read if we read to the end
    path = _save(tmp_path, [_ext("W", [2, 3], [("location", "w.bin")])])
    t0 = time.monotonic()
    np.testing.assert_array_equal(_run(path), W)
    assert time.monotonic() - t0 < 10


def test_two_tensors_share_a_file_by_offsets_without_lengths(tmp_path):
    v = -W
    (tmp_path / "w.bin").write_bytes(W.tobytes() + v.tobytes())
    path = _save(
        tmp_path,
        [
            _ext("W", [2, 3], [("location", "w.bin"), ("offset", 0)]),
            _ext("V", [2, 3], [("location", "w.bin"), ("offset", 24)]),
        ],
    )
    np.testing.assert_array_equal(_run(path), W + v)


def test_two_tensors_may_read_the_same_bytes(tmp_path):
    _weights(tmp_path)
    path = _save(
        tmp_path,
        [
            _ext("W", [2, 3], [("location", "w.bin"), ("offset", 0), ("length", 24)]),
            _ext("V", [2, 3], [("location", "w.bin"), ("offset", 0)]),
        ],
    )
    np.testing.assert_array_equal(_run(path), 2 * W)


def test_huge_dims_do_not_allocate(tmp_path):
    _weights(tmp_path)
    path = _save(tmp_path, [_ext("W", [10**6, 10**6], [("location", "w.bin")])])
    with pytest.raises(errors.Fail, match="initializer 'W'.*runs past its end"):
        _load(path)


def test_negative_dims(tmp_path):
    _weights(tmp_path)
    path = _save(tmp_path, [_ext("W", [2, -3], [("location", "w.bin")])])
    with pytest.raises(errors.InvalidGraph, match="initializer 'W'.*negative dimension"):
        _load(path)


def test_string_tensor_cannot_be_external(tmp_path):
    _weights(tmp_path)
    path = _save(tmp_path, [_ext("W", [2, 3], [("location", "w.bin")], TensorProto.STRING)])
    with pytest.raises(errors.InvalidGraph, match="initializer 'W'.*string tensors"):
        _load(path)


def test_invalid_data_type(tmp_path):
    _weights(tmp_path)
    path = _save(tmp_path, [_ext("W", [2, 3], [("location", "w.bin")], 999)])
    with pytest.raises(errors.InvalidGraph, match="initializer 'W'.*valid data type"):
        _load(path)


def test_external_tensor_in_a_subgraph_is_checked_too(tmp_path):
    then = helper.make_graph(
        [helper.make_node("Identity", ["T"], ["o"])],
        "then",
        [],
        [helper.make_tensor_value_info("o", TensorProto.FLOAT, [2, 3])],
        [_ext("T", [2, 3], [("location", "../w.bin")])],
    )
    other = helper.make_graph(
        [helper.make_node("Identity", ["X"], ["o2"])],
        "else",
        [],
        [helper.make_tensor_value_info("o2", TensorProto.FLOAT, [2, 3])],
    )
    g = helper.make_graph(
        [helper.make_node("If", ["C"], ["Y"], then_branch=then, else_branch=other)],
        "g",
        [
            helper.make_tensor_value_info("C", TensorProto.BOOL, []),
            helper.make_tensor_value_info("X", TensorProto.FLOAT, [2, 3]),
        ],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [2, 3])],
    )
    path = tmp_path / "model.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]), path)
    with pytest.raises(errors.InvalidGraph, match="initializer 'T'.*escapes"):
        _load(path)


def test_external_data_needs_a_model_path(tmp_path):
    _weights(tmp_path)
    path = _save(tmp_path, [_ext("W", [2, 3], [("location", "w.bin")])])
    with pytest.raises(errors.InvalidArgument, match="initializer 'W' uses external data"):
        ox.InferenceSession(path.read_bytes(), providers=CPU)


# ---------------------------------------------------------------------------------------------
# the model path itself


@pytest.mark.parametrize("kind", ["dev_zero", "fifo", "symlink_to_dev_zero", "directory"])
def test_model_path_that_is_not_a_regular_file(tmp_path, kind):
    path: Path
    if kind == "dev_zero":
        path = Path("/dev/zero")
    elif kind == "fifo":
        path = tmp_path / "model.onnx"
        os.mkfifo(path)
    elif kind == "symlink_to_dev_zero":
        path = tmp_path / "model.onnx"
        path.symlink_to("/dev/zero")
    else:
        path = tmp_path
    t0 = time.monotonic()
    with pytest.raises(errors.InvalidArgument, match="not a regular file|is a directory"):
        _load(path)
    assert time.monotonic() - t0 < 5


def test_model_file_over_two_gigabytes_is_refused_before_reading(tmp_path):
    path = tmp_path / "model.onnx"
    with open(path, "wb") as f:
        f.truncate(2**31 + 10)
    t0 = time.monotonic()
    with pytest.raises(errors.InvalidProtobuf, match="at most 2 GiB"):
        _load(path)
    assert time.monotonic() - t0 < 5


def test_model_path_with_a_nul_byte():
    with pytest.raises(errors.InvalidArgument, match="NUL byte"):
        _load("model\0.onnx")
