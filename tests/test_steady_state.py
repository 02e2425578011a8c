"""The steady state of a run, counted on the host-simulated CUDA device: after warm-up, a plain
``run()`` makes exactly one host synchronisation (for the outputs), allocates nothing from the
provider's allocator and builds no array views. A regression in the executor, the memory plan,
the frame scratch or a kernel's use of them fails here, without a GPU.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxplug as ox
from onnxplug.framework import counters

PLUGIN_SRC = Path(__file__).resolve().parents[1] / "plugins" / "cuda" / "src"
SIM = "CUDASimExecutionProvider"
CPU = "CPUExecutionProvider"


@pytest.fixture(scope="module")
def sim():
    if str(PLUGIN_SRC) not in sys.path:
        sys.path.insert(0, str(PLUGIN_SRC))
    ox.register_execution_provider_library(SIM, "onnxplug_cuda.sim:create_factory")
    yield SIM
    ox.unregister_execution_provider_library(SIM)


def _model(nodes, inputs, outputs, inits, opset=20) -> bytes:
    g = helper.make_graph(
        nodes, "g", inputs, outputs, [numpy_helper.from_array(v, k) for k, v in inits.items()]
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)]).SerializeToString()


def transformer_block() -> bytes:
    """Projection, head split (Reshape/Transpose), Softmax, merge, LayerNorm, Gelu, and a
    residual Add: the shapes of a BERT layer, small."""
    rng = np.random.default_rng(0)
    d = 8
    inits = {
        "W": rng.standard_normal((d, d)).astype(np.float32),
        "B": rng.standard_normal(d).astype(np.float32),
        "G": np.ones(d, np.float32),
        "split": np.array([2, 4, 2, 4], np.int64),
        "merge": np.array([2, 4, 8], np.int64),
    }
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["m"]),
        helper.make_node("Add", ["m", "B"], ["a"]),
        helper.make_node("Relu", ["a"], ["r"]),
        helper.make_node("Reshape", ["r", "split"], ["rs"]),
        helper.make_node("Transpose", ["rs"], ["t"], perm=[0, 2, 1, 3]),
        helper.make_node("Softmax", ["t"], ["s"], axis=-1),
        helper.make_node("Transpose", ["s"], ["t2"], perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", ["t2", "merge"], ["r2"]),
        helper.make_node("Add", ["r2", "x"], ["res"]),
        helper.make_node("LayerNormalization", ["res", "G", "B"], ["ln"], axis=-1),
        helper.make_node("Gelu", ["ln"], ["y"]),
    ]
    f = TensorProto.FLOAT
    return _model(
        nodes,
        [helper.make_tensor_value_info("x", f, [2, 4, d])],
        [helper.make_tensor_value_info("y", f, [2, 4, d])],
        inits,
    )


def conv_block() -> bytes:
    rng = np.random.default_rng(1)
    inits = {
        "w": rng.standard_normal((4, 3, 3, 3)).astype(np.float32),
        "b": rng.standard_normal(4).astype(np.float32),
        "fc": rng.standard_normal((4, 5)).astype(np.float32),
    }
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("MaxPool", ["r"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("GlobalAveragePool", ["p"], ["g"]),
        helper.make_node("Flatten", ["g"], ["f"]),
        helper.make_node("MatMul", ["f", "fc"], ["y"]),
    ]
    f = TensorProto.FLOAT
    return _model(
        nodes,
        [helper.make_tensor_value_info("x", f, [2, 3, 8, 8])],
        [helper.make_tensor_value_info("y", f, [2, 5])],
        inits,
    )


def qdq_block() -> bytes:
    """A quantized MatMul as onnxruntime's quantization tools write it: x quantized and
    dequantized per block (the last block partial), the weight per axis, the result per
    tensor, then Relu."""
    rng = np.random.default_rng(4)
    inits = {
        "xs": (rng.random((2, 3, 2)) + 0.5).astype(np.float32) / 50,
        "xz": rng.integers(-5, 5, (2, 3, 2)).astype(np.int8),
        "w": rng.standard_normal((6, 5)).astype(np.float32),
        "ws": (rng.random(5) + 0.5).astype(np.float32) / 100,
        "wz": np.zeros(5, np.int8),
        "ys": np.array(0.05, np.float32),
        "yz": np.array(128, np.uint8),
    }
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"], axis=2, block_size=4),
        helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"], axis=2, block_size=4),
        helper.make_node("QuantizeLinear", ["w", "ws", "wz"], ["wq"], axis=1),
        helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["wd"], axis=1),
        helper.make_node("MatMul", ["xd", "wd"], ["m"]),
        helper.make_node("QuantizeLinear", ["m", "ys", "yz"], ["mq"]),
        helper.make_node("DequantizeLinear", ["mq", "ys", "yz"], ["md"]),
        helper.make_node("Relu", ["md"], ["y"]),
    ]
    f = TensorProto.FLOAT
    return _model(
        nodes,
        [helper.make_tensor_value_info("x", f, [2, 3, 6])],
        [helper.make_tensor_value_info("y", f, [2, 3, 5])],
        inits,
        opset=21,
    )


def steady_counts(sess: ox.InferenceSession, feeds: dict, runs: int = 3) -> list[dict[str, int]]:
    allocators = sess._runner.plan.allocators.values()

    def allocs() -> int:
        return sum(a.get_stats().get("NumAllocs", 0) for a in allocators)

    out = []
    for _ in range(runs):
        before, n = counters.snapshot(), allocs()
        sess.run(None, feeds)
        d = counters.delta(before)
        out.append(
            {
                "syncs": d[counters.HOST_SYNCS],
                "views": d[counters.VIEWS_BUILT],
                "allocs": allocs() - n,
            }
        )
    return out


@pytest.mark.parametrize("build", [transformer_block, conv_block, qdq_block])
def test_steady_state_is_one_sync_no_allocation_no_view(sim, build):
    model = build()
    sess = ox.InferenceSession(model, providers=[sim, CPU])
    on_sim = {r["op_type"] for r in sess.get_provider_graph_assignment_info() if r["ep"] == sim}
    assert len(on_sim) >= 4
    shape = [d.dim_value for d in _input_dims(model)]
    x = np.random.default_rng(2).standard_normal(shape).astype(np.float32)
    want = ox.InferenceSession(model, providers=[CPU]).run(None, {"x": x})
    sess.run(None, {"x": x})  # records the signature
    sess.run(None, {"x": x})  # binds the pooled frame
    for counts in steady_counts(sess, {"x": x}):
        assert counts == {"syncs": 1, "views": 0, "allocs": 0}
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], want[0], rtol=1e-5, atol=1e-5)


def test_changing_input_values_keep_the_steady_state(sim):
    model = transformer_block()
    sess = ox.InferenceSession(model, providers=[sim, CPU])
    cpu = ox.InferenceSession(model, providers=[CPU])
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal((2, 4, 8)).astype(np.float32) for _ in range(4)]
    for x in xs[:2]:
        sess.run(None, {"x": x})
    for x in xs:
        before = counters.snapshot()
        (y,) = sess.run(None, {"x": x})
        assert counters.delta(before)[counters.HOST_SYNCS] == 1
        np.testing.assert_allclose(y, cpu.run(None, {"x": x})[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("build", [transformer_block, conv_block])
def test_eager_iobinding_steady_state_builds_no_view(sim, build):
    """Eager IOBinding, bound once: the bound device input is copied into the plan's feed
    buffer, so its readers run their prepared calls (on the bound value itself, a reader
    built its views and parsed its operands in every run), and the output is copied into the
    bound output."""
    model = build()
    sess = ox.InferenceSession(model, providers=[sim, CPU])
    shape = [d.dim_value for d in _input_dims(model)]
    rng = np.random.default_rng(5)
    x = rng.standard_normal(shape).astype(np.float32)
    (want,) = ox.InferenceSession(model, providers=[CPU]).run(None, {"x": x})
    xv = ox.OrtValue.ortvalue_from_numpy(x, "cudasim", 0)
    yv = ox.OrtValue.ortvalue_from_shape_and_type(list(want.shape), np.float32, "cudasim", 0)
    io = sess.io_binding()
    io.bind_ortvalue_input("x", xv)
    io.bind_ortvalue_output("y", yv)
    for _ in range(2):  # records the signature, binds the pooled frame
        sess.run_with_iobinding(io)
    for _ in range(3):
        before = counters.snapshot()
        sess.run_with_iobinding(io)
        d = counters.delta(before)
        assert (d[counters.HOST_SYNCS], d[counters.VIEWS_BUILT]) == (1, 0)
    np.testing.assert_allclose(yv.numpy(), want, rtol=1e-5, atol=1e-5)
    x2 = rng.standard_normal(shape).astype(np.float32)  # new values in the same bound buffer
    xv.update_inplace(x2)
    sess.run_with_iobinding(io)
    (want2,) = ox.InferenceSession(model, providers=[CPU]).run(None, {"x": x2})
    np.testing.assert_allclose(yv.numpy(), want2, rtol=1e-5, atol=1e-5)


def _input_dims(model: bytes):
    import onnx

    return onnx.load_from_string(model).graph.input[0].type.tensor_type.shape.dim


ATTENTION_MODELS = sorted((Path(__file__).parent / "data" / "attention").glob("*.onnx"))


@pytest.mark.parametrize("path", ATTENTION_MODELS, ids=lambda p: p.stem)
def test_prepared_attention_runs_match_the_cpu_as_inputs_change(sim, path):
    """The fused attention's prepared call (GEMMs, head copies, the mask term, softmax) gives
    the unfused CPU graph's results on every run of a frame, whatever the inputs."""
    sess = ox.InferenceSession(str(path), providers=[sim, CPU])
    cpu = ox.InferenceSession(str(path), providers=[CPU])
    rng = np.random.default_rng(0)
    for _ in range(4):
        feeds = {}
        for i in sess.get_inputs():
            shape = [d if isinstance(d, int) else 2 for d in i.shape]
            if "int" in i.type:
                hi = 2 if "mask" in i.name else 16
                v = rng.integers(0, hi, shape).astype(np.int64)
                if "mask" in i.name:
                    v[:, 0] = 1  # every row attends to something
                feeds[i.name] = v
            else:
                feeds[i.name] = rng.standard_normal(shape).astype(np.float32)
        for got, want in zip(sess.run(None, feeds), cpu.run(None, feeds)):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    frame = next(iter(sess._runner._signatures.values())).frames[0]
    calls = {
        getattr(step[0], "__name__", "")
        for step, spec in zip(frame.steps, frame.specs)
        if spec is not None and spec.info.op_type == "Attention"
    }
    assert calls and "compute" not in calls  # every Attention node runs its prepared call


@pytest.mark.parametrize("build", [transformer_block, conv_block])
def test_profiling_adds_no_synchronisation_allocation_or_view(sim, build, tmp_path):
    """With profiling on, a steady run still makes one host synchronisation: the device marks
    around each node are read after it (the simulated provider's timer is the host clock)."""
    model = build()
    so = ox.SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp_path / "prof")
    sess = ox.InferenceSession(model, so, providers=[sim, CPU])
    shape = [d.dim_value for d in _input_dims(model)]
    x = np.random.default_rng(2).standard_normal(shape).astype(np.float32)
    sess.run(None, {"x": x})
    sess.run(None, {"x": x})
    for counts in steady_counts(sess, {"x": x}):
        assert counts == {"syncs": 1, "views": 0, "allocs": 0}
    events = json.loads(Path(sess.end_profiling()).read_text())
    on_sim = [e for e in events if e["cat"] == "Node" and e["args"]["provider"] == sim]
    kernels = [e for e in events if e["cat"] == "Kernel"]
    assert len(on_sim) == len(kernels) > 0
    assert {e["args"]["op_name"] for e in kernels} == {e["args"]["op_name"] for e in on_sim}
