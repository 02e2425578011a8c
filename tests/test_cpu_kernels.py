"""The CPU provider's native numpy kernels, one node at a time.

Each case builds a one-node model, runs it through an InferenceSession on the CPU provider
and compares values and the exact dtype with ``onnx.reference`` (or with a direct numpy
definition where the reference is too slow or differs from the spec). Property tests cover
broadcasting and the convolution/pooling geometry in ``onnxplug.ep.shapes``.
"""

from __future__ import annotations

import itertools
import math

import ml_dtypes
import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import mutually_broadcastable_shapes
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

import onnxplug
from onnxplug.ep import elem_type_of, shapes
from onnxplug.providers.cpu.kernels import cpu_registry
from onnxplug.providers.cpu.kernels.activation import erf
from onnxplug.providers.cpu.kernels.reference import ReferenceKernel

OPSET = onnx.defs.onnx_opset_version()
PROPS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def model_of(op, inputs, attrs=None, opset=OPSET, n_out=1, consts=None):
    """A one-node model: ``inputs`` (name -> array) are graph inputs, ``consts`` initializers."""
    consts = consts or {}
    names = list(inputs) + list(consts)
    node = helper.make_node(op, names, [f"y{i}" for i in range(n_out)], **(attrs or {}))
    graph = helper.make_graph(
        [node],
        "g",
        [
            helper.make_tensor_value_info(k, elem_type_of(v.dtype), v.shape)
            for k, v in inputs.items()
        ],
        [helper.make_empty_tensor_value_info(f"y{i}") for i in range(n_out)],
        [onnx.numpy_helper.from_array(v, k) for k, v in consts.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def run(op, inputs, attrs=None, opset=OPSET, n_out=1, consts=None):
    m = model_of(op, inputs, attrs, opset, n_out, consts)
    sess = onnxplug.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, inputs)


def reference(op, inputs, attrs=None, opset=OPSET, n_out=1, consts=None):
    m = model_of(op, inputs, attrs, opset, n_out, consts)
    return ReferenceEvaluator(m).run(None, inputs)


def check(op, inputs, attrs=None, opset=OPSET, n_out=1, consts=None, rtol=1e-5, atol=1e-6):
    """Run on the CPU provider and compare values and dtypes with onnx.reference."""
    got = run(op, inputs, attrs, opset, n_out, consts)
    want = reference(op, inputs, attrs, opset, n_out, consts)
    for g, w in zip(got, want):
        w = np.asarray(w)
        assert g.dtype == w.dtype, (op, g.dtype, w.dtype)
        assert g.shape == w.shape, (op, g.shape, w.shape)
        np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64), rtol=rtol, atol=atol)
    return got


def rand(shape, dtype=np.float32, seed=0, lo=-3, hi=3):
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind in "iu":
        return rng.integers(lo, hi, shape).astype(dtype)
    if np.dtype(dtype) == np.bool_:
        return rng.random(shape) > 0.5
    return rng.uniform(lo, hi, shape).astype(dtype)


# ---------------------------------------------------------------------------------------------
# the kernels are native


NATIVE_OPS = """Add Sub Mul Div Pow Mod Max Min Sum Mean Neg Abs Sqrt Exp Log Reciprocal Floor Ceil
Equal Greater Less GreaterOrEqual LessOrEqual And Or Xor Where Not Clip Relu LeakyRelu Sigmoid Tanh
Elu Selu Softplus HardSigmoid HardSwish Gelu Erf PRelu Cast MatMul Gemm Conv ConvTranspose MaxPool
AveragePool GlobalAveragePool GlobalMaxPool BatchNormalization LRN InstanceNormalization
LayerNormalization Softmax LogSoftmax Dropout Flatten Reshape Transpose Squeeze Unsqueeze Concat
Split Slice Gather Shape Size Expand Tile Identity ReduceSum ReduceMean ReduceMax ReduceMin
ReduceProd ArgMax ArgMin Pad ConstantOfShape Range Constant""".split()


@pytest.mark.parametrize("op", NATIVE_OPS)
def test_op_has_native_kernel_at_current_opset(op):
    since = onnx.defs.get_schema(op, OPSET).since_version
    hit = cpu_registry().lookup(op, "", since)
    assert hit is not None and not issubclass(hit[1], ReferenceKernel)


# ---------------------------------------------------------------------------------------------
# elementwise


@PROPS
@given(
    mutually_broadcastable_shapes(num_shapes=2, max_dims=4, max_side=4),
    st.sampled_from(["Add", "Sub", "Mul", "Div", "Max", "Min", "Equal", "Less", "GreaterOrEqual"]),
    st.sampled_from([np.float32, np.float16, np.int32, np.int64, np.uint8]),
)
def test_binary_broadcasting(bs, op, dtype):
    a = rand(bs.input_shapes[0], dtype, 1, 1, 9)
    b = rand(bs.input_shapes[1], dtype, 2, 1, 9)
    (y,) = check(op, {"a": a, "b": b}, rtol=1e-3)
    assert y.shape == shapes.broadcast_shapes(*bs.input_shapes) == bs.result_shape


@PROPS
@given(mutually_broadcastable_shapes(num_shapes=3, max_dims=3, max_side=3))
def test_variadic_and_where_broadcasting(bs):
    # against numpy: onnx.reference's Mean accumulates in place and cannot broadcast
    xs = {f"x{i}": rand(s, np.float32, i) for i, s in enumerate(bs.input_shapes)}
    a, b, c = xs.values()
    for op, want in [
        ("Sum", a + b + c),
        ("Max", np.maximum(np.maximum(a, b), c)),
        ("Min", np.minimum(np.minimum(a, b), c)),
        ("Mean", (a + b + c) / np.float32(3)),
    ]:
        (y,) = run(op, xs)
        assert y.dtype == np.float32
        np.testing.assert_allclose(y, want, rtol=1e-6)
    check("Where", {"c": rand(bs.input_shapes[0], np.bool_), "x": b, "y": c})


@pytest.mark.parametrize(
    "op,inputs",
    [
        ("Add", {"a": np.array(1.0, np.float32), "b": np.array(2.0, np.float32)}),
        ("Div", {"a": np.array(7, np.int32), "b": np.array(2, np.int32)}),
        ("Sigmoid", {"a": np.array(1.0, np.float32)}),
        ("Relu", {"a": np.array(-1.0, np.float32)}),
        ("MatMul", {"a": np.ones(3, np.float32), "b": np.ones(3, np.float32)}),
        ("Gather", {"a": np.arange(3, dtype=np.int64), "i": np.array(1, np.int64)}),
        ("Sum", {"a": np.array(1.0, np.float32), "b": np.array(2.0, np.float32)}),
    ],
)
def test_scalar_results_are_arrays(op, inputs):
    # numpy ufuncs return scalars for 0-d operands; onnxruntime returns 0-d arrays
    (y,) = run(op, inputs)
    assert isinstance(y, np.ndarray) and y.shape == ()


def test_broadcast_shapes_rejects_mismatch():
    with pytest.raises(ValueError, match="cannot be broadcast"):
        shapes.broadcast_shapes((2, 3), (4, 3))


def test_integer_div_truncates_and_mod_follows_fmod():
    a = np.array([7, -7, 7, -7, 0], np.int32)
    b = np.array([2, 2, -2, -2, 3], np.int32)
    (q,) = run("Div", {"a": a, "b": b})
    np.testing.assert_array_equal(q, [3, -3, -3, 3, 0])
    assert q.dtype == np.int32
    np.testing.assert_array_equal(run("Mod", {"a": a, "b": b})[0], np.mod(a, b))
    np.testing.assert_array_equal(run("Mod", {"a": a, "b": b}, {"fmod": 1})[0], np.fmod(a, b))


def test_pow_keeps_base_dtype():
    x = rand((3, 4), np.float32, lo=0.5, hi=2)
    check("Pow", {"x": x, "e": np.array(3, np.int64)})
    check("Pow", {"x": x.astype(np.float16), "e": np.array([2.0], np.float32)}, rtol=1e-3)
    check("Pow", {"x": np.array([2, 3], np.int32), "e": np.array([3.0, 2.0], np.float32)})


@pytest.mark.parametrize(
    "op", ["Abs", "Neg", "Sqrt", "Exp", "Log", "Reciprocal", "Floor", "Ceil", "Tanh"]
)
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_unary(op, dtype):
    lo = 0.1 if op in ("Sqrt", "Log") else -3
    check(op, {"x": rand((2, 3, 4), dtype, lo=lo)}, rtol=1e-3)


ACTIVATIONS = [
    ("Relu", {}),
    ("LeakyRelu", {"alpha": 0.2}),
    ("Sigmoid", {}),
    ("Elu", {"alpha": 0.5}),
    ("Selu", {}),
    ("Softplus", {}),
    ("HardSigmoid", {"alpha": 0.3, "beta": 0.4}),
    ("HardSwish", {}),
    ("Gelu", {}),
    ("Gelu", {"approximate": "tanh"}),
    ("Erf", {}),
]


@pytest.mark.parametrize("op,attrs", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_activation(op, attrs, dtype):
    x = rand((3, 5, 7), dtype, lo=-8, hi=8)
    if dtype != np.float16:
        check(op, {"x": x}, attrs)
        return
    # float16 is computed in float32 and rounded once (the reference steps in float16, which
    # is further from the exact value): compare with the float32 result
    (y,) = run(op, {"x": x}, attrs)
    (want,) = reference(op, {"x": x.astype(np.float32)}, attrs)
    assert y.dtype == np.float16
    np.testing.assert_allclose(y, want, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("op,attrs", ACTIVATIONS)
def test_activation_keeps_bfloat16(op, attrs):
    x = rand((4, 6), np.float32).astype(ml_dtypes.bfloat16)
    (y,) = run(op, {"x": x}, attrs)
    assert y.dtype == ml_dtypes.bfloat16
    (want,) = run(op, {"x": x.astype(np.float32)}, attrs)
    np.testing.assert_allclose(y.astype(np.float32), want, rtol=2**-7, atol=1e-2)


def test_sigmoid_is_stable_for_large_inputs():
    x = np.array([-100.0, -20.0, 0.0, 20.0, 100.0], np.float32)
    (y,) = run("Sigmoid", {"x": x})
    # float32 denormals near 1e-44 are spaced 1.4e-45 apart
    np.testing.assert_allclose(y, 1 / (1 + np.exp(-x.astype(np.float64))), rtol=1e-6, atol=2e-45)


def test_erf_accuracy():
    x = np.concatenate([np.linspace(-6, 6, 20001), np.geomspace(1e-20, 1, 300)]).astype(np.float32)
    want = np.array([math.erf(float(v)) for v in x])
    np.testing.assert_allclose(erf(x), want, rtol=1e-6, atol=1e-30)
    np.testing.assert_allclose(erf(x.astype(np.float64)), want, rtol=1e-15)


def test_prelu_broadcasts_slope():
    x = rand((2, 3, 4, 5))
    check("PRelu", {"x": x, "s": rand((3, 1, 1), seed=3, lo=0, hi=1)})
    check("PRelu", {"x": x, "s": rand((5,), seed=3, lo=0, hi=1)})


def test_clip_forms():
    x = rand((4, 5), np.float32)
    check("Clip", {"x": x}, {"min": -1.0, "max": 0.5}, opset=6)
    check("Clip", {"x": x, "lo": np.array(-1, np.float32), "hi": np.array(2, np.float32)})
    check("Clip", {"x": x})
    check("Clip", {"x": rand((5,), np.int32), "lo": np.array(-1, np.int32)})


CAST_TYPES = [
    np.bool_,
    np.int8,
    np.uint8,
    np.int32,
    np.int64,
    np.uint64,
    np.float16,
    np.float32,
    np.float64,
]


@pytest.mark.parametrize("src,dst", list(itertools.product(CAST_TYPES, CAST_TYPES)))
def test_cast(src, dst):
    x = rand((3, 7), np.float32, lo=-100, hi=100)
    x = (
        (x > 0)
        if src == np.bool_
        else np.abs(x).astype(src)
        if np.dtype(src).kind == "u"
        else x.astype(src)
    )
    check("Cast", {"x": x}, {"to": elem_type_of(np.dtype(dst))})


@pytest.mark.parametrize("other", [np.float32, np.float16, np.int32, np.bool_])
def test_cast_bfloat16(other):
    x = rand((3, 7), np.float32, lo=-100, hi=100).astype(other)
    (b,) = run("Cast", {"x": x}, {"to": TensorProto.BFLOAT16})
    assert b.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(b, x.astype(ml_dtypes.bfloat16))
    (back,) = run("Cast", {"b": b}, {"to": elem_type_of(np.dtype(other))})
    np.testing.assert_array_equal(back, b.astype(other))


# ---------------------------------------------------------------------------------------------
# matrix products


@pytest.mark.parametrize(
    "sa,sb", [((3, 4), (4, 5)), ((2, 3, 4), (4, 5)), ((4,), (2, 4, 3)), ((2, 1, 3, 4), (5, 4, 2))]
)
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int32])
def test_matmul(sa, sb, dtype):
    check(
        "MatMul",
        {"a": rand(sa, dtype, 1), "b": rand(sb, dtype, 2)},
        rtol=1e-2 if dtype == np.float16 else 1e-5,
    )


@pytest.mark.parametrize("ta,tb", list(itertools.product([0, 1], repeat=2)))
@pytest.mark.parametrize("c_shape", [None, (5,), (1, 5), (3, 1), (3, 5)])
def test_gemm(ta, tb, c_shape):
    a = rand((4, 3) if ta else (3, 4), seed=1)
    b = rand((5, 4) if tb else (4, 5), seed=2)
    ins = {"a": a, "b": b} | ({} if c_shape is None else {"c": rand(c_shape, seed=3)})
    check("Gemm", ins, {"transA": ta, "transB": tb, "alpha": 0.5, "beta": 2.0})


# ---------------------------------------------------------------------------------------------
# convolution and pooling


@st.composite
def conv_case(draw):
    n = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 2]))
    cin = group * draw(st.integers(1, 2))
    kernel = [draw(st.integers(1, 3)) for _ in range(n)]
    dil = [draw(st.integers(1, 2)) for _ in range(n)]
    strides = [draw(st.integers(1, 3)) for _ in range(n)]
    size = [draw(st.integers((k - 1) * d + 1, 7 if n < 3 else 5)) for k, d in zip(kernel, dil)]
    auto_pad = draw(st.sampled_from(["NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID"]))
    attrs = {"kernel_shape": kernel, "dilations": dil, "strides": strides, "group": group}
    if auto_pad == "NOTSET":
        attrs["pads"] = [draw(st.integers(0, k - 1)) for k in kernel * 2]
    else:
        attrs["auto_pad"] = auto_pad
    x = rand((draw(st.integers(1, 2)), cin, *size), seed=draw(st.integers(0, 9)))
    w = rand((group * draw(st.integers(1, 2)), cin // group, *kernel), seed=7)
    return x, w, attrs


def conv_direct(x, w, attrs):
    """Convolution straight from its definition (loops over output positions)."""
    n = x.ndim - 2
    out_sp, pads = shapes.window_geometry(
        x.shape[2:],
        attrs["kernel_shape"],
        attrs["strides"],
        attrs["dilations"],
        attrs.get("pads"),
        attrs.get("auto_pad", "NOTSET"),
    )
    g = attrs["group"]
    M, cg = w.shape[0], w.shape[1]
    xp = np.pad(x, [(0, 0), (0, 0)] + [(pads[i], pads[n + i]) for i in range(n)]).astype(np.float64)
    y = np.zeros((x.shape[0], M, *out_sp))
    for o in itertools.product(*(range(s) for s in out_sp)):
        for k in itertools.product(*(range(s) for s in attrs["kernel_shape"])):
            pos = tuple(
                oi * s + ki * d for oi, ki, s, d in zip(o, k, attrs["strides"], attrs["dilations"])
            )
            for m in range(M):
                c0 = (m // (M // g)) * cg
                y[(slice(None), m, *o)] += (
                    xp[(slice(None), slice(c0, c0 + cg), *pos)] @ w[(m, slice(None), *k)]
                )
    return y


@PROPS
@given(conv_case())
def test_conv_matches_definition(case):
    x, w, attrs = case
    (y,) = run("Conv", {"x": x, "w": w}, attrs)
    assert y.dtype == np.float32
    np.testing.assert_allclose(y, conv_direct(x, w, attrs), rtol=1e-4, atol=1e-4)


@PROPS
@given(conv_case())
def test_window_geometry_matches_reference_conv(case):
    x, w, attrs = case
    (want,) = reference("Conv", {"x": x, "w": w}, attrs)
    out_sp, _ = shapes.window_geometry(
        x.shape[2:],
        attrs["kernel_shape"],
        attrs["strides"],
        attrs["dilations"],
        attrs.get("pads"),
        attrs.get("auto_pad", "NOTSET"),
    )
    assert tuple(out_sp) == want.shape[2:]


@pytest.mark.parametrize("channels,group", [(4, 4), (4, 2), (3, 1)])
@pytest.mark.parametrize("stride", [1, 2])
def test_conv_groups_depthwise_bias(channels, group, stride):
    x = rand((2, channels, 9, 8))
    w = rand((channels * 2 if group == 2 else channels, channels // group, 3, 3), seed=1)
    b = rand((w.shape[0],), seed=2)
    attrs = {"group": group, "strides": [stride, stride], "pads": [1, 0, 1, 2]}
    (y,) = run("Conv", {"x": x, "w": w, "b": b}, attrs)
    want = conv_direct(
        x, w, attrs | {"kernel_shape": [3, 3], "dilations": [1, 1], "strides": [stride] * 2}
    )
    np.testing.assert_allclose(y, want + b.reshape(-1, 1, 1), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "spatial,kernel,dil,pads",
    [
        ((9,), (3,), (2,), (1, 2)),
        ((7, 6), (3, 2), (1, 2), (1, 0, 2, 1)),
        ((4, 5, 3), (2, 3, 1), (1, 1, 2), (0, 1, 0, 1, 0, 1)),
    ],
)
def test_conv_few_output_channels(spatial, kernel, dil, pads):
    # stride 1 and M <= C/2: the shifted-GEMM path (no im2col)
    x, w = rand((2, 8, *spatial)), rand((3, 8, *kernel), seed=1)
    attrs = {"kernel_shape": list(kernel), "dilations": list(dil), "pads": list(pads), "group": 1}
    (y,) = run("Conv", {"x": x, "w": w}, attrs)
    want = conv_direct(x, w, attrs | {"strides": [1] * len(spatial)})
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4)


def test_conv_float16_stays_float16():
    (y,) = check(
        "Conv",
        {"x": rand((1, 2, 5, 5), np.float16), "w": rand((3, 2, 3, 3), np.float16)},
        rtol=1e-2,
        atol=1e-2,
    )
    assert y.dtype == np.float16


CONV_TRANSPOSE = [
    {},
    {"strides": [2, 2]},
    {"strides": [3, 2], "output_padding": [1, 1]},
    {"strides": [2, 2], "pads": [1, 0, 1, 2]},
    {"dilations": [2, 1]},
    {"strides": [2, 2], "auto_pad": "SAME_UPPER"},
    {"strides": [2, 2], "auto_pad": "SAME_LOWER"},
]


@pytest.mark.parametrize("attrs", CONV_TRANSPOSE)
def test_conv_transpose(attrs):
    x = rand((2, 2, 4, 3))
    w = rand((2, 3, 3, 3), seed=1)
    check(
        "ConvTranspose",
        {"x": x, "w": w, "b": rand((3 * attrs.get("group", 1),), seed=2)},
        attrs,
        rtol=1e-5,
        atol=1e-5,
    )


def test_conv_transpose_groups_are_independent():
    # onnx.reference's grouped ConvTranspose is broken: check against one call per group
    x, w, b = rand((2, 4, 4, 3)), rand((4, 3, 3, 3), seed=1), rand((6,), seed=2)
    attrs = {"strides": [2, 1], "pads": [1, 0, 0, 1]}
    (y,) = run("ConvTranspose", {"x": x, "w": w, "b": b}, attrs | {"group": 2})
    parts = [
        run("ConvTranspose", {"x": x[:, k : k + 2], "w": w[k : k + 2], "b": b[j : j + 3]}, attrs)[0]
        for k, j in ((0, 0), (2, 3))
    ]
    np.testing.assert_allclose(y, np.concatenate(parts, axis=1), rtol=1e-6, atol=1e-6)


def test_conv_transpose_output_shape_sets_pads():
    # full output 9x7; output_shape 8x6 crops one pixel, at the beginning (auto_pad NOTSET)
    x, w = rand((1, 2, 4, 3)), rand((2, 3, 3, 3), seed=1)
    (y,) = run("ConvTranspose", {"x": x, "w": w}, {"strides": [2, 2], "output_shape": [8, 6]})
    (want,) = reference(
        "ConvTranspose", {"x": x, "w": w}, {"strides": [2, 2], "pads": [1, 1, 0, 0]}
    )
    np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-6)
    got = shapes.conv_transpose_geometry([4, 3], [3, 3], [2, 2], output_shape=[8, 6])
    assert got == ([8, 6], [1, 1, 0, 0])


def test_conv_transpose_1d_and_3d():
    check("ConvTranspose", {"x": rand((1, 2, 5)), "w": rand((2, 3, 3), seed=1)}, {"strides": [2]})
    check(
        "ConvTranspose",
        {"x": rand((1, 2, 3, 3, 2)), "w": rand((2, 1, 2, 2, 2), seed=1)},
        {"strides": [2, 1, 2]},
    )


@st.composite
def pool_case(draw):
    n = draw(st.integers(1, 3))
    kernel = [draw(st.integers(1, 3)) for _ in range(n)]
    dil = [draw(st.integers(1, 2)) for _ in range(n)]
    strides = [draw(st.integers(1, 3)) for _ in range(n)]
    size = [draw(st.integers((k - 1) * d + 1, 8 if n < 3 else 5)) for k, d in zip(kernel, dil)]
    attrs = {
        "kernel_shape": kernel,
        "dilations": dil,
        "strides": strides,
        "pads": [draw(st.integers(0, k - 1)) for k in kernel * 2],
        "ceil_mode": draw(st.integers(0, 1)),
    }
    x = rand((2, 3, *size), seed=draw(st.integers(0, 9)))
    return x, attrs, draw(st.integers(0, 1))


def pool_direct(x, attrs, kind, count_include_pad=0):
    """Pooling from its definition: window taps o*s - pad + k*d inside the input count;
    with count_include_pad the divisor counts taps inside the explicitly padded input."""
    n = x.ndim - 2
    out_sp, pads = shapes.window_geometry(
        x.shape[2:],
        attrs["kernel_shape"],
        attrs["strides"],
        attrs["dilations"],
        attrs["pads"],
        ceil_mode=attrs["ceil_mode"],
    )
    y = np.zeros(x.shape[:2] + tuple(out_sp))
    for o in itertools.product(*(range(s) for s in out_sp)):
        vals, padded = [], 0
        for k in itertools.product(*(range(s) for s in attrs["kernel_shape"])):
            pos = [
                oi * s - p + ki * d
                for oi, s, p, ki, d in zip(o, attrs["strides"], pads, k, attrs["dilations"])
            ]
            if all(0 <= q < size for q, size in zip(pos, x.shape[2:])):
                vals.append(x[(slice(None), slice(None), *pos)])
            elif all(-pads[i] <= q < x.shape[2 + i] + pads[n + i] for i, q in enumerate(pos)):
                padded += 1
        v = np.stack(vals)
        y[(slice(None), slice(None), *o)] = (
            v.max(axis=0)
            if kind == "max"
            else v.sum(axis=0) / (len(vals) + (padded if count_include_pad else 0))
        )
    return y


@PROPS
@given(pool_case())
def test_max_pool_matches_definition(case):
    x, attrs, _ = case
    (y,) = run("MaxPool", {"x": x}, attrs)
    np.testing.assert_array_equal(y, pool_direct(x, attrs, "max").astype(np.float32))


@PROPS
@given(pool_case())
def test_average_pool_matches_definition(case):
    x, attrs, cip = case
    (y,) = run("AveragePool", {"x": x}, attrs | {"count_include_pad": cip})
    np.testing.assert_allclose(y, pool_direct(x, attrs, "avg", cip), rtol=1e-5, atol=1e-6)


@PROPS
@given(pool_case())
def test_window_geometry_invariants(case):
    x, attrs, _ = case
    k, s, d, p = attrs["kernel_shape"], attrs["strides"], attrs["dilations"], attrs["pads"]
    size, n = x.shape[2:], len(k)
    out, pads = shapes.window_geometry(size, k, s, d, p, ceil_mode=attrs["ceil_mode"])
    ext = shapes.window_fit_pads(size, out, k, s, d, pads)
    for i in range(n):
        k_eff = (k[i] - 1) * d[i] + 1
        assert out[i] >= 1
        assert (out[i] - 1) * s[i] + k_eff <= size[i] + ext[i] + ext[n + i]  # every window fits
        assert (out[i] - 1) * s[i] < size[i] + pads[i]  # the last one starts before the end pad
        assert out[i] * s[i] + k_eff > size[i] + pads[i] + pads[n + i]  # and no further one fits
    if not attrs["ceil_mode"]:
        assert ext == pads


@pytest.mark.parametrize("storage_order", [0, 1])
def test_max_pool_indices(storage_order):
    x = rand((2, 3, 6, 5))
    attrs = {
        "kernel_shape": [3, 2],
        "strides": [2, 1],
        "pads": [1, 0, 1, 1],
        "storage_order": storage_order,
    }
    y, idx = run("MaxPool", {"x": x}, attrs, n_out=2)
    assert idx.dtype == np.int64
    # flat over (n, c, h, w); with storage_order=1 column-major within each (n, c) image
    images = x.transpose(0, 1, 3, 2) if storage_order else x
    np.testing.assert_array_equal(images.reshape(-1)[idx], y)


def test_global_pools():
    x = rand((2, 3, 4, 5), np.float16)
    check("GlobalAveragePool", {"x": x}, rtol=1e-3)
    check("GlobalMaxPool", {"x": x})


# ---------------------------------------------------------------------------------------------
# normalization


def test_batch_normalization_inference_and_training():
    x = rand((2, 3, 4, 5))
    stats = {
        "s": rand((3,), seed=1),
        "b": rand((3,), seed=2),
        "m": rand((3,), seed=3),
        "v": rand((3,), seed=4, lo=0.5, hi=2),
    }
    check("BatchNormalization", {"x": x} | stats, {"epsilon": 1e-3})
    check("BatchNormalization", {"x": x} | stats, {"training_mode": 1, "momentum": 0.8}, n_out=3)


def test_instance_and_layer_normalization():
    x = rand((2, 3, 4, 5))
    check("InstanceNormalization", {"x": x, "s": rand((3,), seed=1), "b": rand((3,), seed=2)})
    for axis in (-1, -2, 1):
        shape = x.shape[axis:]
        check(
            "LayerNormalization",
            {"x": x, "s": rand(shape, seed=1), "b": rand(shape, seed=2)},
            {"axis": axis},
            n_out=3,
        )


@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_lrn(size):
    # onnx.reference's LRN walks the batch dim instead of the channels: check the definition
    x = rand((2, 6, 3, 3))
    (y,) = run("LRN", {"x": x}, {"size": size, "alpha": 0.01, "beta": 0.6, "bias": 2.0})
    lo, hi = (size - 1) // 2, size // 2
    ss = [np.square(x[:, max(0, c - lo) : c + hi + 1]).sum(axis=1) for c in range(6)]
    np.testing.assert_allclose(y, x / (2.0 + 0.01 / size * np.stack(ss, 1)) ** 0.6, rtol=1e-5)


@pytest.mark.parametrize("axis", [0, 1, 2, -1])
@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
def test_softmax_semantics_change_at_13(op, axis):
    x = rand((2, 3, 4))

    def softmax(v, ax):
        e = np.exp(v - v.max(axis=ax, keepdims=True))
        p = e / e.sum(axis=ax, keepdims=True)
        return np.log(p) if op == "LogSoftmax" else p

    # opset 11: coerced to 2-D at axis (onnx.reference applies the opset-13 rule everywhere)
    (old,) = run(op, {"x": x}, {"axis": axis}, opset=11)
    rows = math.prod(x.shape[: axis % 3])
    want = softmax(x.reshape(rows, -1), 1).reshape(x.shape)
    np.testing.assert_allclose(old, want, rtol=1e-5, atol=1e-6)
    (new,) = check(op, {"x": x}, {"axis": axis}, opset=13)  # one axis
    np.testing.assert_allclose(new, softmax(x, axis), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# tensor manipulation


def test_reshape_allowzero_and_flatten():
    x = rand((2, 3, 4))
    check("Reshape", {"x": x}, consts={"s": np.array([0, -1], np.int64)})
    check(
        "Reshape",
        {"x": np.zeros((0, 4), np.float32)},
        {"allowzero": 1},
        consts={"s": np.array([4, 0], np.int64)},
    )
    for axis in range(-3, 4):
        check("Flatten", {"x": x}, {"axis": axis})


@pytest.mark.parametrize("opset", [11, 13])
def test_squeeze_unsqueeze_attr_and_input_forms(opset):
    x = rand((1, 3, 1, 2))
    if opset < 13:
        check("Squeeze", {"x": x}, {"axes": [0, -2]}, opset=opset)
        check("Unsqueeze", {"x": x}, {"axes": [0, 5]}, opset=opset)
    else:
        check("Squeeze", {"x": x}, opset=opset, consts={"a": np.array([0, -2], np.int64)})
        check("Unsqueeze", {"x": x}, opset=opset, consts={"a": np.array([0, 5], np.int64)})
    check("Squeeze", {"x": x}, opset=opset)


@pytest.mark.parametrize(
    "opset,attrs,consts,n",
    [
        (11, {"axis": 1, "split": [1, 4]}, None, 2),
        (13, {"axis": -1}, {"s": np.array([2, 1, 3], np.int64)}, 3),
        (13, {"axis": 1}, None, 5),
        (18, {"axis": 1, "num_outputs": 3}, None, 3),  # 5 = 2 + 2 + 1
    ],
)
def test_split(opset, attrs, consts, n):
    x = rand((2, 5, 6))
    outs = check("Split", {"x": x}, attrs, opset=opset, n_out=n, consts=consts)
    np.testing.assert_array_equal(np.concatenate(outs, axis=attrs["axis"]), x)


@PROPS
@given(
    st.lists(
        st.tuples(st.integers(-9, 9), st.integers(-9, 9), st.sampled_from([-3, -2, -1, 1, 2, 3])),
        min_size=1,
        max_size=3,
    )
)
def test_slice(ranges):
    x = rand((5, 6, 7)[: len(ranges)] if len(ranges) > 1 else (8,))
    axes = list(range(x.ndim))[::-1]  # axes given in reverse order
    starts, ends, steps = (np.array(v, np.int64) for v in zip(*ranges))
    (y,) = run("Slice", {"x": x, "s": starts, "e": ends, "a": np.array(axes), "t": steps})
    # the spec's clamping: start in [0, dim] ([0, dim-1] stepping back), end in [0, dim]
    # ([-1, dim-1] stepping back, -1 meaning "through index 0", unlike Python's x[s:-1:-1])
    want = x
    for a, (s_, e, step) in zip(axes, ranges):
        dim = x.shape[a]
        s_, e = s_ + dim if s_ < 0 else s_, e + dim if e < 0 else e
        hi = dim if step > 0 else dim - 1
        lo = 0 if step > 0 else -1
        idx = list(range(min(max(s_, 0), hi), min(max(e, lo), hi), step))
        want = np.take(want, np.array(idx, dtype=np.int64), axis=a)
    np.testing.assert_array_equal(y, want)


def test_gather_concat_transpose_tile_expand():
    x = rand((3, 4, 5))
    for axis in (0, 1, -1):
        check("Gather", {"x": x, "i": np.array([[0, -1], [1, 2]], np.int64)}, {"axis": axis})
        check("Concat", {"a": x, "b": x * 2}, {"axis": axis})
    check("Transpose", {"x": x}, {"perm": [1, 2, 0]})
    check("Transpose", {"x": x})
    check("Tile", {"x": x, "r": np.array([2, 1, 3], np.int64)})
    check("Expand", {"x": rand((3, 1)), "s": np.array([2, 1, 4], np.int64)})
    check("Expand", {"x": x, "s": np.array([1], np.int64)})


def test_shape_with_start_end_and_size():
    x = rand((2, 3, 4, 5))
    for start, end in [(0, None), (1, None), (-3, -1), (2, 100), (-100, 1), (3, 1)]:
        attrs = {"start": start} | ({} if end is None else {"end": end})
        (y,) = check("Shape", {"x": x}, attrs)
        np.testing.assert_array_equal(y, list(x.shape)[slice(*shapes.shape_range(4, start, end))])
    check("Size", {"x": x})


@pytest.mark.parametrize("mode", ["constant", "reflect", "edge", "wrap"])
def test_pad(mode):
    x = rand((3, 4, 5))
    pads = np.array([1, 0, 2, 2, 1, 0], np.int64)
    check(
        "Pad",
        {"x": x, "p": pads, "v": np.array(1.5, np.float32)}
        if mode == "constant"
        else {"x": x, "p": pads},
        {"mode": mode},
    )
    # inputs are positional: data, pads, constant_value, axes
    zero = np.array(0, np.float32)
    axes = {"x": x, "p": np.array([1, 0, 0, 2], np.int64), "v": zero, "a": np.array([0, -1])}
    check("Pad", axes, {"mode": mode})
    # negative pads crop (onnx.reference cannot): axis 2 loses its first column
    crop = {"x": x, "p": np.array([1, -1, 0, 2], np.int64), "v": zero, "a": np.array([0, 2])}
    (y,) = run("Pad", crop, {"mode": mode})
    np.testing.assert_array_equal(y, np.pad(x[:, :, 1:], [(1, 0), (0, 0), (0, 2)], mode=mode))
    check(
        "Pad",
        {"x": x},
        {"pads": [0, 1, 0, 1, 0, 2], "mode": mode if mode != "wrap" else "edge", "value": 2.0},
        opset=10,
    )


def test_constants_and_range():
    check(
        "ConstantOfShape",
        {"s": np.array([2, 3], np.int64)},
        {"value": onnx.numpy_helper.from_array(np.array([7], np.int32))},
    )
    check("ConstantOfShape", {"s": np.array([], np.int64)})
    (y,) = run("Constant", {}, {"value_ints": [1, 2, 3]})
    np.testing.assert_array_equal(y, [1, 2, 3])
    for start, limit, delta, dt in [
        (0, 10, 3, np.int32),
        (10, 4, -2, np.int64),
        (0.5, 2.0, 0.25, np.float32),
        (1, 1, 1, np.float64),
    ]:
        check(
            "Range", {"a": np.array(start, dt), "b": np.array(limit, dt), "c": np.array(delta, dt)}
        )


def test_dropout_is_identity_in_inference():
    x = rand((3, 4))
    y, mask = run("Dropout", {"x": x}, n_out=2)
    np.testing.assert_array_equal(y, x)
    assert mask.dtype == np.bool_ and mask.all()
    (y,) = run("Dropout", {"x": x}, {"ratio": 0.3}, opset=7)
    np.testing.assert_array_equal(y, x)
    check(
        "Dropout",
        {"x": x, "r": np.array(0.5, np.float32), "t": np.array(True)},
        {"seed": 3},
        n_out=2,
    )


# ---------------------------------------------------------------------------------------------
# reductions

REDUCE_OPS = [
    "ReduceSum",
    "ReduceMean",
    "ReduceMax",
    "ReduceMin",
    "ReduceProd",
    "ReduceL1",
    "ReduceL2",
    "ReduceSumSquare",
    "ReduceLogSumExp",
]


@pytest.mark.parametrize("op", REDUCE_OPS)
@pytest.mark.parametrize("axes", [None, [1], [0, -1]])
@pytest.mark.parametrize("keepdims", [0, 1])
def test_reduce_attr_and_input_forms(op, axes, keepdims):
    x = rand((2, 3, 4), lo=0.1, hi=2)
    attrs = {"keepdims": keepdims}
    old = 12 if op == "ReduceSum" else 17
    check(op, {"x": x}, attrs | ({} if axes is None else {"axes": axes}), opset=old)
    consts = None if axes is None else {"a": np.array(axes, np.int64)}
    check(op, {"x": x}, attrs, consts=consts, rtol=1e-5)


@pytest.mark.parametrize("op", ["ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceMean"])
def test_reduce_keeps_integer_dtype_and_noop(op):
    x = rand((3, 4), np.int32, lo=-5, hi=5)
    (y,) = check(op, {"x": x}, consts={"a": np.array([1], np.int64)})
    assert y.dtype == np.int32
    (same,) = run(op, {"x": x}, {"noop_with_empty_axes": 1})
    np.testing.assert_array_equal(same, x)


def test_reduce_empty_set():
    x = np.zeros((2, 0, 3), np.float32)
    for op, value in [
        ("ReduceSum", 0),
        ("ReduceProd", 1),
        ("ReduceMax", -np.inf),
        ("ReduceMin", np.inf),
    ]:
        (y,) = run(op, {"x": x}, {"keepdims": 0}, consts={"a": np.array([1], np.int64)})
        np.testing.assert_array_equal(y, np.full((2, 3), value, np.float32))


@pytest.mark.parametrize("op", ["ArgMax", "ArgMin"])
@pytest.mark.parametrize("last", [0, 1])
def test_arg_reductions(op, last):
    x = rand((3, 4, 5), np.int32, lo=0, hi=3)  # many ties
    for axis in (0, 1, -1):
        (y,) = check(op, {"x": x}, {"axis": axis, "keepdims": axis % 2, "select_last_index": last})
        assert y.dtype == np.int64
