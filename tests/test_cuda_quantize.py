"""QuantizeLinear/DequantizeLinear: the CUDA kernels on the simulated device against the CPU
provider (every case of tests/quant_cases.py: float32/float16/bfloat16 to and from
int8/uint8/int16/uint16 (int32 dequantized), per tensor, per axis and blocked, the old opsets
and the com.microsoft forms), and the CPU provider against onnxruntime where it is installed
(rounding half to even, saturation, infinities and NaN as onnxruntime computes them).
"""

from __future__ import annotations

import numpy as np
import pytest

import onnxplug as ox
from onnxplug.ep import quantize
from tests.quant_cases import all_cases, model, quantize_case
from tests.test_fusions_transformer import CPU, SIM, sim  # noqa: F401 (sim: a fixture)

CASES = all_cases()


def _bits(a: np.ndarray) -> np.ndarray:
    """An array's values as comparable numbers (bfloat16 as float32; NaN stays NaN)."""
    return a.astype(np.float32) if a.dtype.kind == "V" else a


def _other(feeds: dict) -> dict:
    """The same feeds with x's values in reverse order: what a prepared run sees next."""
    x = feeds["x"]
    return {**feeds, "x": np.ascontiguousarray(x.reshape(-1)[::-1].reshape(x.shape))}


@pytest.mark.usefixtures("sim")
@pytest.mark.parametrize("case", sorted(CASES))
def test_sim_matches_cpu(case):
    """The CUDA kernel (its layout logic and numpy twin) runs the node and agrees exactly with
    the CPU provider, through the recording, binding and prepared runs."""
    m, feeds = CASES[case]
    on_sim = ox.InferenceSession(m, providers=[SIM, CPU])
    on_cpu = ox.InferenceSession(m, providers=[CPU])
    assert {r["node_name"]: r["ep"] for r in on_sim.get_provider_graph_assignment_info()} == {
        "n": SIM
    }
    for f in (feeds, _other(feeds), feeds, _other(feeds)):
        (got,), (want,) = on_sim.run(None, f), on_cpu.run(None, f)
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(_bits(got), _bits(want))


@pytest.mark.usefixtures("sim")
@pytest.mark.parametrize(
    "op, feeds, attrs",
    [
        ("QuantizeLinear", {"x": "float32", "s": "float32", "z": "int4"}, {}),
        ("QuantizeLinear", {"x": "float32", "s": "float32", "z": "float8_e4m3fn"}, {}),
        ("QuantizeLinear", {"x": "int32", "s": "int32", "z": "int8"}, {}),
        ("DequantizeLinear", {"x": "int4", "s": "float32", "z": "int4"}, {}),
        ("DequantizeLinear", {"x": "uint8", "s": "float32", "z": "uint8"}, {"output_dtype": 10}),
        ("QuantizeLinear", {"x": "float16", "s": "float32", "z": "int8"}, {}),
        ("QuantizeLinear", {"x": "float32", "s": "float32", "z": "int8"}, {"precision": 10}),
    ],
    ids=["int4", "float8", "int32_input", "dq_int4", "dq_output_dtype", "mixed_scale", "precision"],
)
def test_what_the_cuda_kernels_leave_to_the_cpu(op, feeds, attrs):
    """4-bit and float8 types, integer inputs of QuantizeLinear and opset 23's attributes and
    mixed types run on the CPU provider (and still compute there)."""
    import ml_dtypes

    arrays = {}
    for k, name in feeds.items():
        dt = np.dtype(getattr(ml_dtypes, name, None) or name)
        shape = (4, 3) if k == "x" else ()
        v = np.arange(12).reshape(4, 3) - 5 if k == "x" else np.array(0 if k == "z" else 2)
        arrays[k] = np.asarray(v, dtype=np.float32).astype(dt).reshape(shape)
    m = model(op, arrays, 25, **attrs)
    sess = ox.InferenceSession(m, providers=[SIM, CPU])
    assert {r["ep"] for r in sess.get_provider_graph_assignment_info()} == {CPU}
    got = sess.run(None, arrays)[0]
    want = ox.InferenceSession(m, providers=[CPU]).run(None, arrays)[0]
    np.testing.assert_array_equal(_bits(got), _bits(want))


@pytest.mark.usefixtures("sim")
def test_bad_shapes_name_the_node():
    x = np.zeros((2, 4), np.float32)
    cases = [
        ({"x": x, "s": np.ones((3,), np.float32)}, {"axis": 1}, "size of axis 1"),
        (
            {"x": x, "s": np.ones((2, 3), np.float32)},
            {"axis": 1, "block_size": 2},
            "must have shape",
        ),
        ({"x": x, "s": np.ones((4,), np.float32)}, {"axis": 2}, "axis 2 is out of range"),
    ]
    for feeds, attrs, msg in cases:
        m = model("QuantizeLinear", feeds, 21, **attrs)
        for providers in ([SIM, CPU], [CPU]):
            sess = ox.InferenceSession(m, providers=providers)
            with pytest.raises(Exception, match=msg) as e:
                sess.run(None, feeds)
            assert "QuantizeLinear node 'n'" in str(e.value)


def test_saturation_and_rounding_of_the_shared_formula():
    """``quantize_into`` rounds half to even and saturates in float: beyond the range and
    beyond int32 (which the reference implementation wrapped), infinities, and NaN to the low
    end."""
    x = np.array(
        [2.5, 3.5, -2.5, -0.5, 0.5, 1e10, -1e10, np.inf, -np.inf, np.nan, -0.0], np.float32
    )
    want = {
        "int8": [2, 4, -2, 0, 0, 127, -128, 127, -128, -128, 0],
        "uint8": [2, 4, 0, 0, 0, 255, 0, 255, 0, 0, 0],
        "int16": [2, 4, -2, 0, 0, 32767, -32768, 32767, -32768, -32768, 0],
        "uint16": [2, 4, 0, 0, 0, 65535, 0, 65535, 0, 0, 0],
    }
    for name, values in want.items():
        y = np.empty(x.shape, name)
        quantize.quantize_into(x, np.float32(1), None, y)
        np.testing.assert_array_equal(y, values, err_msg=name)
    y = np.empty(x.shape, np.int8)
    quantize.quantize_into(x, np.float32(1), np.int8(-3), y)  # the zero point before the clamp
    np.testing.assert_array_equal(y, [-1, 1, -5, -3, -3, 127, -128, 127, -128, -128, -3])


def _ort_cases() -> dict[str, tuple[bytes, dict]]:
    """Cases onnxruntime computes (no bfloat16), including blocks and the edges."""
    cases = {}
    for qdt in (np.int8, np.uint8, np.int16, np.uint16):
        for xdt in (np.float32, np.float16):
            for layout in ("tensor", "axis", "block4"):
                name = f"{np.dtype(xdt).name}_{np.dtype(qdt).name}_{layout}"
                cases[name] = quantize_case(xdt, qdt, layout)
    return cases


ORT_CASES = _ort_cases()


@pytest.mark.parametrize("case", sorted(ORT_CASES))
def test_cpu_quantize_matches_onnxruntime(case):
    ort = pytest.importorskip("onnxruntime")
    m, feeds = ORT_CASES[case]
    try:
        ref = ort.InferenceSession(m, providers=["CPUExecutionProvider"])
    except Exception as e:  # a type or layout this onnxruntime has no kernel for
        pytest.skip(f"onnxruntime: {e}")
    got = ox.InferenceSession(m, providers=[CPU]).run(None, feeds)[0]
    np.testing.assert_array_equal(got, ref.run(None, feeds)[0])


@pytest.mark.usefixtures("sim")
def test_contrib_quantize_without_zero_point_is_uint8():
    x = np.array([[-3.0, 0.4, 2.5, 700.0]], np.float32)
    feeds = {"x": x, "s": np.array(0.5, np.float32)}
    m = model("QuantizeLinear", feeds, 19, domain="com.microsoft")
    for providers in ([SIM, CPU], [CPU]):
        y = ox.InferenceSession(m, providers=providers).run(None, feeds)[0]
        assert y.dtype == np.uint8
        np.testing.assert_array_equal(y, [[0, 1, 5, 255]])
