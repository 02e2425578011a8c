"""The profiler on a real GPU: a ``Kernel`` event (CUDA events around the node's work on its
stream) for every node of the CUDA provider, read without adding a host synchronisation to
the run; device times that follow the kernels' cost; CUDA-graph replays; ``onnxplug profile``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from tests.gpu._cuda import CPU, CUDA, cuda_marks

import onnxplug as ox
from onnxplug.cli.main import main
from onnxplug.framework import counters

pytestmark = cuda_marks


def _model(n: int = 512) -> bytes:
    """A big MatMul, then cheap elementwise nodes and a Conv block."""
    rng = np.random.default_rng(0)
    inits = {
        "W": rng.standard_normal((n, n)).astype(np.float32),
        "k": rng.standard_normal((8, 1, 3, 3)).astype(np.float32),
        "shape": np.array([1, 1, n, n], np.int64),
    }
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["m"], name="matmul"),
        helper.make_node("Relu", ["m"], ["r"], name="relu"),
        helper.make_node("Reshape", ["r", "shape"], ["img"], name="reshape"),
        helper.make_node("Conv", ["img", "k"], ["c"], pads=[1, 1, 1, 1], name="conv"),
        helper.make_node("Sigmoid", ["c"], ["y"], name="sigmoid"),
    ]
    g = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n, n])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, n, n])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def _session(
    tmp_path: Path | None, options: dict | None = None, n: int = 512
) -> ox.InferenceSession:
    """A session profiling into ``tmp_path`` (None: not profiling), at the basic level: Conv
    and Sigmoid stay two nodes (extended fuses them into one FusedConv). The unprofiled
    sessions that results are compared with are made here as well: a session of the extended
    level runs another graph, whose convolution cuDNN's timed search may give another TF32
    engine (results 1e-3 apart on some machines)."""
    so = ox.SessionOptions()
    if tmp_path is not None:
        so.enable_profiling = True
        so.profile_file_prefix = str(tmp_path / "prof")
    so.graph_optimization_level = ox.GraphOptimizationLevel.ORT_ENABLE_BASIC
    return ox.InferenceSession(_model(n), so, providers=[(CUDA, options or {}), CPU])


X = np.random.default_rng(1).standard_normal((512, 512)).astype(np.float32)


def _events(sess: ox.InferenceSession) -> list[dict]:
    return json.loads(Path(sess.end_profiling()).read_text())


def test_every_cuda_node_gets_a_kernel_event_with_its_device_time(tmp_path):
    # 2048^3 in float32 (no TF32): ~17 GFLOP, hundreds of µs; a Relu of 4M elements costs a
    # few µs, plus the launch gap an eager run leaves between the node's events
    n = 2048
    sess = _session(tmp_path, {"use_tf32": "0"}, n)
    x = np.random.default_rng(1).standard_normal((n, n)).astype(np.float32)
    runs = 4
    for _ in range(runs):
        sess.run(None, {"x": x})
    events = _events(sess)
    on_cuda = [e for e in events if e["cat"] == "Node" and e["args"]["provider"] == CUDA]
    kernels = [e for e in events if e["cat"] == "Kernel"]
    assert on_cuda and len(kernels) == len(on_cuda)  # every run, the first ones included
    by_op: dict[str, list[int]] = {}
    for e in kernels:
        assert e["pid"] == -1 and e["tid"] == -1 and e["args"]["provider"] == CUDA
        by_op.setdefault(e["args"]["op_name"], []).append(e["dur"])
    assert {"MatMul", "Relu", "Conv", "Sigmoid"} <= set(by_op)
    # the GEMM costs far more device time than the Relu
    assert np.median(by_op["MatMul"][1:]) > 3 * max(np.median(by_op["Relu"][1:]), 1)
    # a run's device work lies within the run
    windows = [(e["ts"], e["ts"] + e["dur"]) for e in events if e["name"] == "model_run"]
    for e in kernels:
        assert any(a - 2 <= e["ts"] and e["ts"] + e["dur"] <= b + 2 for a, b in windows), e


def test_profiling_adds_no_host_synchronisation_or_allocation(tmp_path):
    sess = _session(tmp_path)
    plain = _session(None)
    allocators = sess._runner.plan.allocators.values()
    for s in (sess, plain):
        for _ in range(3):
            s.run(None, {"x": X})
    for s in (sess, plain):
        for _ in range(3):
            before = counters.snapshot()
            n = sum(a.get_stats().get("NumAllocs", 0) for a in allocators)
            s.run(None, {"x": X})
            d = counters.delta(before)
            assert d[counters.HOST_SYNCS] == 1 and d[counters.VIEWS_BUILT] == 0
            if s is sess:
                assert sum(a.get_stats().get("NumAllocs", 0) for a in allocators) == n
    np.testing.assert_array_equal(sess.run(None, {"x": X})[0], plain.run(None, {"x": X})[0])
    assert [e for e in _events(sess) if e["cat"] == "Kernel"]


def test_cuda_graph_replays_are_profiled_as_runs(tmp_path):
    sess = _session(tmp_path, {"enable_cuda_graph": "1"})
    eager = _session(None)
    want = eager.run(None, {"x": X})[0]
    for _ in range(6):
        np.testing.assert_allclose(sess.run(None, {"x": X})[0], want, rtol=1e-5, atol=1e-5)
    events = _events(sess)
    assert [e["name"] for e in events].count("model_run") == 6
    kernels = [e for e in events if e["cat"] == "Kernel"]
    windows = sorted(e["ts"] for e in events if e["name"] == "model_run")
    # the warm-up runs are timed node by node; the replays (one graph) are not
    assert kernels and all(e["ts"] < windows[-1] for e in kernels)


def test_onnxplug_profile_on_cuda(tmp_path, capsys):
    path = tmp_path / "m.onnx"
    onnx.save(onnx.load_from_string(_model()), str(path))
    html = tmp_path / "p.html"
    rc = main(["profile", str(path), "--provider", CUDA, "--runs", "3", "--html", str(html)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    row = next(line.split() for line in out.splitlines() if line.split()[:1] == ["MatMul"])
    assert row[4] != "-" and float(row[4]) > 0  # GPU ms
    assert f"measured by {CUDA}" in out
    assert "CUDA device" in html.read_text()
