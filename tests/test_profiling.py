"""The profiler: onnxruntime's trace format (the same script against onnxruntime), its files,
run-level profiling, and the device time of nodes: on the virtual device (whose queued
streams run only when synchronised, so a mark read early is an error) and the simulated CUDA
device (tests/test_steady_state.py counts its synchronisations with profiling on).
"""

from __future__ import annotations

import gc
import json
import re
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxplug as ox
import onnxplug.framework.profiler as profiler_module
from tests.conftest import registered
from tests.plugins import graphs
from tests.plugins import virtual_device as vd

CPU = "CPUExecutionProvider"
EVENT_KEYS = ["cat", "pid", "tid", "dur", "ts", "ph", "name", "args"]
NODE_ARGS = {
    "op_name",
    "provider",
    "node_index",
    "activation_size",
    "parameter_size",
    "output_size",
    "input_type_shape",
    "output_type_shape",
    "thread_scheduling_stats",
}
MEM_ARGS = {
    "mem_bytes_in_use",
    "mem_bytes_requested_in_use",
    "mem_in_use_peak",
    "mem_arena_held",
    "mem_in_use_delta",
    "mem_requested_in_use_delta",
    "mem_arena_held_delta",
}
KERNEL_ARGS = {"op_name", "stream", "node_index", "provider"}
NAME = re.compile(r"_\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d_\d{3}(_\d+)?\.json$")


def chain() -> bytes:
    """MatMul -> Add -> Relu -> Reshape -> Softmax -> Cast, named nodes, batch dim 'N'."""
    rng = np.random.default_rng(0)
    inits = {
        "W": rng.standard_normal((4, 8)).astype(np.float32),
        "b": rng.standard_normal(8).astype(np.float32),
        "shape": np.array([-1, 2, 4], np.int64),
    }
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["m"], name="matmul"),
        helper.make_node("Add", ["m", "b"], ["a"], name="add"),
        helper.make_node("Relu", ["a"], ["r"], name="relu"),
        helper.make_node("Reshape", ["r", "shape"], ["rs"], name="reshape"),
        helper.make_node("Softmax", ["rs"], ["s"], axis=-1, name="softmax"),
        helper.make_node("Cast", ["s"], ["y"], to=TensorProto.FLOAT16, name="cast"),
    ]
    g = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, ["N", 2, 4])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    return m.SerializeToString()


def profiled(rt, model: bytes, folder: Path, name: str = "prof", providers=None, **extra):
    so = rt.SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = str(folder / name)
    so.graph_optimization_level = rt.GraphOptimizationLevel.ORT_DISABLE_ALL  # nodes as written
    for k, v in extra.items():
        setattr(so, k, v)
    return rt.InferenceSession(model, so, providers=providers or [CPU])


def trace(sess) -> list[dict]:
    return json.loads(Path(sess.end_profiling()).read_text())


def nodes_of(events: list[dict]) -> list[dict]:
    return [e for e in events if e["cat"] == "Node"]


X = np.random.default_rng(1).standard_normal((3, 4)).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# the format, against onnxruntime


@pytest.fixture
def ort():
    return pytest.importorskip("onnxruntime")


def ort_trace(ort, model: bytes, folder: Path, runs: int, arena: bool = False) -> list[dict]:
    """onnxruntime's trace of ``runs`` runs: as onnxplug runs a CPU node, with no intra-op
    thread pool, no prepacked weights and, unless ``arena``, no host arena."""
    so = ort.SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = str(folder / "ort")
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.intra_op_num_threads = 1
    so.enable_cpu_mem_arena = arena
    so.add_session_config_entry("session.disable_prepacking", "1")
    s = ort.InferenceSession(model, so, providers=[CPU])
    for _ in range(runs):
        s.run(None, {"x": X})
    return trace(s)


def test_trace_matches_onnxruntime_categories_names_keys_and_node_args(ort, tmp_path):
    model = chain()
    theirs = ort_trace(ort, model, tmp_path, runs=2)
    sess = profiled(ox, model, tmp_path)
    for _ in range(2):
        sess.run(None, {"x": X})
    ours = trace(sess)
    assert {e["cat"] for e in ours} == {e["cat"] for e in theirs} == {"Session", "Node"}
    session = [e["name"] for e in ours if e["cat"] == "Session"]
    assert sorted(set(session)) == sorted({e["name"] for e in theirs if e["cat"] == "Session"})
    assert session.count("model_run") == 2 and session[:2] == [
        "model_loading_array",
        "session_initialization",
    ]
    for e in ours:
        assert list(e) == EVENT_KEYS and e["ph"] == "X"
    assert [list(e) for e in theirs] == [EVENT_KEYS] * len(theirs)  # the same layout there
    # the same node events, args and values (onnxruntime counts a string element as 32 bytes;
    # this model has none)
    mine = {e["name"]: e["args"] for e in nodes_of(ours)}
    want = {e["name"]: e["args"] for e in nodes_of(theirs)}
    assert (
        set(mine)
        == set(want)
        == {f"{n}_kernel_time" for n in ("matmul", "add", "relu", "reshape", "softmax", "cast")}
    )
    for name, args in want.items():
        assert set(mine[name]) == set(args) == NODE_ARGS, name
        for key in (
            "op_name",
            "provider",
            "input_type_shape",
            "output_type_shape",
            "output_size",
            "activation_size",
            "parameter_size",
            "thread_scheduling_stats",
        ):
            assert mine[name][key] == args[key], (name, key)
    assert len(nodes_of(ours)) == len(nodes_of(theirs)) == 12
    assert [e["ts"] for e in ours] == sorted(e["ts"] for e in ours)  # by start, as there


def test_device_nodes_in_an_arena_report_onnxruntimes_memory_args(ort, tmp_path, virt_arena):
    theirs = ort_trace(ort, chain(), tmp_path, runs=1, arena=True)
    their_keys = {k for e in nodes_of(theirs) for k in e["args"]}
    sess = profiled(ox, graphs.mlp(), tmp_path, providers=[vd.ARENA_NAME, CPU])
    x = np.ones((2, 4), np.float32)
    for _ in range(3):
        sess.run(None, {"x": x})
    events = nodes_of(trace(sess))
    on_device = [e for e in events if e["args"]["provider"] == vd.ARENA_NAME]
    on_host = [e for e in events if e["args"]["provider"] == CPU]
    assert on_device and on_host
    assert {k for e in on_device for k in e["args"]} == their_keys == NODE_ARGS | MEM_ARGS
    # numpy arrays have no arena: host nodes, and the copy to the host
    assert all(set(e["args"]) == NODE_ARGS for e in on_host)
    copies = [e for e in on_device if e["args"]["op_name"] == "MemcpyToHost"]
    assert copies and all(set(e["args"]) == NODE_ARGS for e in copies)
    for e in on_device:
        if e in copies:
            continue
        assert set(e["args"]) == NODE_ARGS | MEM_ARGS
        a = {k: int(v) for k, v in e["args"].items() if k in MEM_ARGS}
        assert a["mem_bytes_requested_in_use"] <= a["mem_bytes_in_use"] <= a["mem_arena_held"]
        assert a["mem_bytes_in_use"] <= a["mem_in_use_peak"]
    # the first run allocates as it goes; the planned runs take the plan's block
    first = [e for e in on_device if e["name"] == "MatMul_h1_kernel_time"]
    assert int(first[0]["args"]["mem_requested_in_use_delta"]) > 0
    assert all(int(e["args"]["mem_requested_in_use_delta"]) == 0 for e in first[1:])


def test_ts_counts_microseconds_from_the_profiling_start(tmp_path):
    import time

    sess = profiled(ox, chain(), tmp_path)
    start = sess.get_profiling_start_time_ns()
    sess.run(None, {"x": X})
    before = time.time_ns()
    sess.run(None, {"x": X})
    after = time.time_ns()
    events = trace(sess)
    last = [e for e in events if e["name"] == "model_run"][-1]
    assert before - 2_000_000 <= start + last["ts"] * 1000 <= after
    assert min(e["ts"] for e in events) >= 0
    loading = next(e for e in events if e["name"] == "model_loading_array")
    assert loading["ts"] <= 1000  # the profiler starts with the session


# ---------------------------------------------------------------------------------------------
# files


def test_files_are_unique_per_session_even_within_one_millisecond(tmp_path, monkeypatch):
    monkeypatch.setattr(profiler_module.time, "time", lambda: 1_700_000_000.123)
    sessions = [profiled(ox, chain(), tmp_path) for _ in range(3)]
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) == 3 and all(NAME.search(f) and f.startswith("prof_") for f in files)
    assert all((tmp_path / f).stat().st_size == 0 for f in files)  # named at creation
    paths = [s.end_profiling() for s in sessions]
    assert sorted(Path(p).name for p in paths) == files
    assert all(json.loads(Path(p).read_text()) for p in paths)


def test_a_second_end_profiling_returns_nothing_and_recording_stops(tmp_path):
    sess = profiled(ox, chain(), tmp_path)
    sess.run(None, {"x": X})
    path = sess.end_profiling()
    assert sess.end_profiling() == ""
    written = Path(path).read_text()
    sess.run(None, {"x": X})
    assert sess.end_profiling() == "" and Path(path).read_text() == written
    assert sess._runner.profiler is None  # the fast path again


def test_a_session_collected_without_end_profiling_writes_its_trace(tmp_path):
    sess = profiled(ox, chain(), tmp_path)
    sess.run(None, {"x": X})
    (path,) = tmp_path.iterdir()
    del sess
    gc.collect()
    names = {e["name"] for e in json.loads(path.read_text())}
    assert {"model_loading_array", "model_run", "relu_kernel_time"} <= names


def test_a_missing_folder_is_an_error_naming_the_option(tmp_path):
    with pytest.raises(ox.errors.InvalidArgument, match="profile_file_prefix"):
        profiled(ox, chain(), tmp_path / "missing")


def test_without_profiling_nothing_is_written_and_the_start_is_zero(ort, tmp_path):
    for rt in (ort, ox):
        sess = rt.InferenceSession(chain(), providers=[CPU])
        sess.run(None, {"x": X})
        assert sess.end_profiling() == "" and sess.get_profiling_start_time_ns() == 0
    assert ox.SessionOptions().enable_profiling is False


def test_subgraph_nodes_are_recorded(tmp_path):
    sess = profiled(ox, graphs.if_model(), tmp_path)
    x = np.array([1.0, -2.0], np.float32)
    sess.run(None, {"x": x, "s": np.array(1.0, np.float32)})
    sess.run(None, {"x": x, "s": np.array(-1.0, np.float32)})
    names = [e["name"] for e in nodes_of(trace(sess))]
    assert "Mul_t_kernel_time" in names and "Add_e_kernel_time" in names  # both branches
    assert names.count("If_y_kernel_time") == 2


# ---------------------------------------------------------------------------------------------
# run-level profiling (onnxruntime's RunOptions::EnableProfiling)


def test_run_level_profiling_writes_one_trace_per_run(tmp_path):
    sess = ox.InferenceSession(chain(), providers=[CPU])
    sess.run(None, {"x": X})  # not profiled
    ro = ox.RunOptions()
    ro.enable_profiling = True
    ro.profile_file_prefix = str(tmp_path / "run")
    for _ in range(2):
        sess.run(None, {"x": X}, ro)
    files = sorted(tmp_path.iterdir())
    assert len(files) == 2 and all(NAME.search(f.name) for f in files)
    for f in files:
        events = json.loads(f.read_text())
        names = [e["name"] for e in events]
        assert names.count("model_run") == 1 and names.count("cast_kernel_time") == 1
        assert "model_loading_array" not in names
    sess.run(None, {"x": X})
    assert len(list(tmp_path.iterdir())) == 2  # the options' run only


def test_run_level_profiling_is_ignored_when_the_session_profiles(tmp_path, capfd):
    sess = profiled(ox, chain(), tmp_path)
    ro = ox.RunOptions()
    ro.enable_profiling = True
    ro.profile_file_prefix = str(tmp_path / "run")
    sess.run(None, {"x": X}, ro)
    assert "Ignoring run-level profiling request" in capfd.readouterr().err
    assert not list(tmp_path.glob("run*"))
    assert [e["name"] for e in trace(sess)].count("model_run") == 1


# ---------------------------------------------------------------------------------------------
# device time


def _virt_runs(sess, runs: int = 4) -> None:
    x = np.random.default_rng(2).standard_normal((2, 4)).astype(np.float32)
    for _ in range(runs):
        sess.run(None, {"x": x})


def test_device_time_of_each_node_read_after_the_runs_synchronisation(virt, tmp_path):
    virt.stats.reset()
    sess = profiled(ox, graphs.mlp(), tmp_path, providers=[vd.NAME, CPU])
    plain = ox.InferenceSession(graphs.mlp(), providers=[vd.NAME, CPU])
    _virt_runs(sess, 2)
    _virt_runs(plain, 2)

    def steady(s) -> dict[str, int]:
        before = virt.stats.snapshot()
        _virt_runs(s, 1)
        after = virt.stats.snapshot()
        return {k: after[k] - before[k] for k in ("flushes", "host_waits", "device_waits")}

    # the same synchronisations with and without profiling (the virtual timer raises on a
    # mark its stream has not reached: every read came after the run's own flush)
    assert steady(sess) == steady(plain)
    events = trace(sess)
    kernels = [e for e in events if e["cat"] == "Kernel"]
    nodes = nodes_of(events)
    device_nodes = [e for e in nodes if e["args"]["provider"] == vd.NAME]
    assert len(kernels) == len(device_nodes) > 0
    assert {e["args"]["node_index"] for e in kernels} == {
        e["args"]["node_index"] for e in device_nodes
    }
    assert all(e["pid"] == -1 and e["tid"] == -1 for e in kernels)
    assert all(set(e["args"]) == KERNEL_ARGS and e["args"]["provider"] == vd.NAME for e in kernels)
    assert all(e["dur"] >= 0 for e in kernels)
    # on one stream, a node's device work starts when the one before it ended
    stream = sorted(kernels, key=lambda e: (e["ts"], int(e["args"]["node_index"])))
    for a, b in zip(stream, stream[1:]):
        assert b["ts"] >= a["ts"] + a["dur"] - 1
    stats = virt.stats.snapshot()
    assert stats["timer_reads"] > 0
    assert stats["timer_marks_released"] == stats["timer_marks"]
    assert stats["timers"] == 2  # one per execution frame (recording, planned), marks reused
    assert stats["timers_closed"] == 1  # the recording frame's
    sess._runner.close()
    assert virt.stats.snapshot()["timers_closed"] == 2


def test_profiling_off_asks_for_no_timer(virt):
    virt.stats.reset()
    _virt_runs(ox.InferenceSession(graphs.mlp(), providers=[vd.NAME, CPU]))
    stats = virt.stats.snapshot()
    assert stats["timers"] == 0 and stats["timer_marks"] == 0


def test_a_plugin_older_than_device_timing_is_not_asked(tmp_path):
    with registered(vd.NAME, "tests.plugins.virtual_device:create_factory") as factory:
        factory.api_version = 1
        factory.stats.reset()
        sess = profiled(ox, graphs.mlp(), tmp_path, providers=[vd.NAME, CPU])
        _virt_runs(sess)
        events = trace(sess)
    assert factory.stats.snapshot()["timers"] == 0
    assert not [e for e in events if e["cat"] == "Kernel"]
    assert any(e["args"]["provider"] == vd.NAME for e in nodes_of(events))


def test_a_failed_run_gives_its_marks_back(virt, tmp_path):
    nodes = [graphs.node("Relu", ["x"], ["r"]), graphs.node("MatMul", ["r", "w"], ["y"])]
    model = graphs.make_model(
        nodes,
        [graphs.tensor("x", ["N", "K"]), graphs.tensor("w", ["K2", 3])],
        [graphs.tensor("y", ["N", 3])],
    )
    virt.stats.reset()
    sess = profiled(ox, model, tmp_path, providers=[vd.NAME, CPU])
    x, w = np.ones((4, 5), np.float32), np.ones((5, 3), np.float32)
    sess.run(None, {"x": x, "w": w})
    with pytest.raises(ox.errors.Fail, match="MatMul_y"):
        sess.run(None, {"x": x, "w": np.ones((4, 3), np.float32)})
    (y,) = sess.run(None, {"x": x, "w": w})
    np.testing.assert_array_equal(y, np.full((4, 3), 5, np.float32))
    stats = virt.stats.snapshot()
    assert stats["timer_marks_released"] == stats["timer_marks"]
    runs = [e for e in trace(sess) if e["name"] == "model_run"]
    assert len(runs) == 2  # the failed run has none, as in onnxruntime


def test_captured_and_replayed_runs_queue_no_marks(virt, tmp_path):
    sess = profiled(ox, graphs.mlp(), tmp_path, providers=[(vd.NAME, {"enable_graph": "1"}), CPU])
    _virt_runs(sess, 3)  # records, warms up, captures
    marks = virt.stats.snapshot()["timer_marks"]
    replays = virt.stats.snapshot()["replays"]
    _virt_runs(sess, 3)
    assert virt.stats.snapshot()["replays"] > replays
    assert virt.stats.snapshot()["timer_marks"] == marks
    events = trace(sess)
    assert [e["name"] for e in events].count("model_run") == 6
