"""The CUDA provider's shipped kernels (``compiler.ship``, ``build_kernels``), checked without a
GPU: the catalogue holds the very sources the run compiles (a shipped cubin is found by its
source's digest, so a text that differs by one byte would never be used), and the build writes
one cubin per kernel and architecture, removes what the catalogue dropped and reports a kernel
that does not compile."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

PLUGIN_SRC = Path(__file__).resolve().parents[1] / "plugins" / "cuda" / "src"
if str(PLUGIN_SRC) not in sys.path:
    sys.path.insert(0, str(PLUGIN_SRC))

from onnxplug_cuda import build_kernels, compiler, dnn, launch  # noqa: E402
from onnxplug_cuda.kernels import _fused as F  # noqa: E402
from onnxplug_cuda.kernels import attention, contrib, conv, indexing, pool  # noqa: E402

build_kernels._import_families()
CATALOGUE = {digest: (name, text) for digest, name, text in compiler.shipped_sources()}


class _Queued:
    """A kernel's ``precompile`` as ``warm_up`` calls it: records (name, source)."""

    def __init__(self) -> None:
        self.queued: list[tuple[str, str]] = []

    def precompile(self, name, source, functions=None, key=None) -> None:
        self.queued.append((name, source()))


def _shipped(name: str, text: str) -> bool:
    return CATALOGUE.get(compiler._digest(text)) == (name, text)


@pytest.mark.parametrize("entry", ["oxa_mma_f32_1x4", "oxa_mma_f32_2x2"])
def test_the_float32_attention_kernels_are_shipped(entry):
    k = _Queued()
    attention.FUSED_ATTENTION_MMA.precompile(k, entry)
    assert _shipped(*k.queued[0])


def test_every_row_kernel_is_shipped():
    for module in (
        F.ROWS,
        attention.FUSED_ATTENTION,
        attention.SOFTMAX_ROWS,
        contrib.SKIP_LN_ROWS,
        contrib.EMBED_ROWS,
        contrib.NBITS_ROWS,
    ):
        for name in module._entries:
            k = _Queued()
            module.precompile(k, name)
            assert _shipped(*k.queued[0]), name


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("shape", [(1, 64, 56, 56), (1, 3, 5, 7)])  # 16-byte vectors; none
@pytest.mark.parametrize("residual", [False, True])
def test_convolution_epilogues_are_shipped(dtype, channels_last, shape, residual):
    """The epilogue a CNN's convolution with bias (and a residual, and ReLU) compiles, as its
    ``warm_up`` queues it."""
    if channels_last:
        shape = (shape[0], *shape[2:], shape[1])
    k = _Queued()
    conv.epilogue(True, residual, "Relu", []).precompile(k, dtype, shape, channels_last)
    assert _shipped(*k.queued[0])


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int64])
def test_the_transpose_copy_is_shipped(dtype):
    k = _Queued()
    F.COPY.raw().precompile(k, (np.dtype(dtype), np.dtype(dtype)), flat=False)
    assert _shipped(*k.queued[0])


def _bound(op: F.Elementwise, *operands: tuple[tuple[int, ...], str]) -> list[tuple[str, str]]:
    """(name, source) of what binding ``op`` over dense operands of these (shape, dtype)
    compiles (a dry bind, as a kernel's ``warm_up`` makes it)."""
    k = _Queued()
    arrays = [launch.ShapeOnly(shape, np.dtype(dt)) for shape, dt in operands]
    with launch.dry_compiles(k):
        assert op.raw().bind(None, arrays, 0) is None
    return k.queued


# The elementwise variants BERT-base's and GPT-2's first runs compiled on an H100 host before
# they were shipped (transformers' exports, b1 and b8, float32 and their float16 conversions):
# the attention mask's Cast, And and Where, the Add beside it, the erf Gelu after the FFN's
# first MatMul, the pooler's Tanh, and float16's Casts and Copy.
_S = (1, 128)
_ADD, _AND = F.UFUNC_BINARY["add"], F.UFUNC_BINARY["logical_and"]
_GELU, _TANH = F.UNARY_KERNELS["Gelu"].plain, F.UNARY_KERNELS["Tanh"].plain
_TRANSFORMER_BINDS = [
    (F.CAST, ((_S, "int64"), (_S, "bool"))),
    (
        F.WHERE,
        (
            ((1, 1, 128, 128), "bool"),
            ((), "float32"),
            ((), "float32"),
            ((1, 1, 128, 128), "float32"),
        ),
    ),
    (
        F.WHERE,
        (((8, 1, 1, 128), "bool"), ((), "float16"), ((), "float16"), ((8, 1, 1, 128), "float16")),
    ),
    (_AND, (((1, 1, 1, 128), "bool"), ((1, 1, 128, 1), "bool"), ((1, 1, 128, 128), "bool"))),
    (_ADD, ((_S, "float32"), (_S, "float32"), (_S, "float32"))),
    (_ADD, ((_S, "float16"), (_S, "float16"), (_S, "float16"))),
    (_GELU, (((128, 3072), "float32"), ((128, 3072), "float32"))),
    (_GELU, (((1024, 3072), "float16"), ((1024, 3072), "float16"))),
    (_TANH, (((1, 768), "float32"), ((1, 768), "float32"))),
    (_TANH, (((8, 768), "float16"), ((8, 768), "float16"))),
    (F.CAST, (((1, 768), "float16"), ((1, 768), "float32"))),
    (F.COPY, (((1, 128, 768), "float16"), ((1, 128, 768), "float16"))),
]


@pytest.mark.parametrize("op, operands", _TRANSFORMER_BINDS)
def test_the_elementwise_kernels_of_transformer_exports_are_shipped(op, operands):
    (queued,) = _bound(op, *operands)
    assert _shipped(*queued), queued[0]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("n", [4096, 1001])  # whole vectors; one element at a time
def test_every_float_operation_is_shipped_dense_and_broadcast(dtype, n):
    """Each operation of one placeholder type whose parameters are all arrays: dense, with a
    broadcast operand, and strided (a broadcast along an inner axis)."""
    checked = 0
    for op in F.Elementwise.registry:
        params = launch._parse_params(op.in_params) + launch._parse_params(op.out_params)
        if {t for t, _, _ in params} != {"T"} or op.name in F._SHIPPED_TYPES:
            continue
        n_in = len(launch._parse_params(op.in_params))
        dense = [((n,), dtype)] * (n_in + 1)
        scalar_first = [((), dtype)] + [((n,), dtype)] * n_in
        strided = [((4, 1), dtype)] + [((4, n), dtype)] * n_in
        for operands in (
            dense,
            scalar_first if n_in > 1 else dense,
            strided if n_in > 1 else dense,
        ):
            (queued,) = _bound(op, *operands)
            assert _shipped(*queued), (op.name, operands)
        checked += 1
    assert checked >= 30


def test_operations_with_attributes_are_not_in_the_catalogue():
    """An attribute passed by value (LeakyRelu's alpha) changes the source: the catalogue
    lists only operations whose every parameter is an array."""
    names = {name for name, _ in CATALOGUE.values()}
    assert "oxr_ox_leakyrelu" not in names and "oxr_ox_isinf" not in names
    assert {"oxr_ox_gelu", "oxr_ox_where", "oxr_ox_cast", "oxr_ox_bf16_add"} <= names


def test_gathers_copies_pools_and_the_hold_kernel_are_shipped():
    kernels = [indexing._gather_kernel(u, np.dtype(i)) for u, _ in launch._UNITS for i in "iq"]
    kernels += [launch._unit_copy_kernel(u, w) for u, _ in launch._UNITS for w in (False, True)]
    for dtype in (np.float16, np.float32, np.float64):
        kernels += [pool._raw_pool_kernel(m, np.dtype(dtype)) for m in pool._MODES]
        kernels += [pool._global_pool_kernel(m, np.dtype(dtype)) for m in ("avg", "max")]
    kernels.append(dnn.HOLD_KERNEL)
    for name, source in kernels:
        assert _shipped(name, source()), name


def test_each_shipped_source_defines_its_kernel():
    for name, text in CATALOGUE.values():
        assert f" {name}(" in text, name


def test_the_build_writes_the_catalogue_and_nothing_else(tmp_path):
    compiled: list[tuple[str, str]] = []

    def fake_nvrtc(text: str, name: str, arch: str) -> bytes:
        compiled.append((name, arch))
        if arch == "sm_75" and name.startswith("oxa_mma"):
            raise RuntimeError("ptxas: Feature 'cp.async' requires .target sm_80 or higher\nmore")
        return f"{arch}:{name}".encode()

    stale = tmp_path / "sm_90" / ("0" * 40 + ".cubin")
    stale.parent.mkdir()
    stale.write_bytes(b"a kernel the catalogue dropped")
    left_out = build_kernels.build(["sm_90", "sm_75"], tmp_path, 2, fake_nvrtc)
    assert left_out["sm_90"] == []
    assert sorted(left_out["sm_75"]) == [
        ("oxa_mma_f32_1x4", "ptxas: Feature 'cp.async' requires .target sm_80 or higher"),
        ("oxa_mma_f32_2x2", "ptxas: Feature 'cp.async' requires .target sm_80 or higher"),
    ]
    assert not stale.exists()
    built = {p.name for p in (tmp_path / "sm_90").iterdir()}
    assert built == {f"{d}.cubin" for d in CATALOGUE}
    assert len(list((tmp_path / "sm_75").iterdir())) == len(CATALOGUE) - 2
    for digest, (name, _) in CATALOGUE.items():
        assert (tmp_path / "sm_90" / f"{digest}.cubin").read_bytes() == f"sm_90:{name}".encode()
    # built again: only what is missing is compiled (the kernels sm_75 could not take)
    compiled.clear()
    build_kernels.build(["sm_90", "sm_75"], tmp_path, 2, fake_nvrtc)
    assert sorted(compiled) == [("oxa_mma_f32_1x4", "sm_75"), ("oxa_mma_f32_2x2", "sm_75")]


def _main_with(monkeypatch, devices: dict[str, int], argv: list[str], cudnn=lambda: None) -> list:
    """``build_kernels.main(argv)`` with these native GPUs, a build that compiles nothing, the
    cuDNN frontend's import ``cudnn``, workers on threads, and the attention graphs built
    recorded: (ordinal, kind); the (bias, 128, 77) kind fails."""
    from concurrent.futures import ThreadPoolExecutor

    built: list = []

    def build_kind(ordinal: int, mask: str, head: int, seq: int) -> None:
        if (mask, head, seq) == ("bias", 128, 77):
            raise RuntimeError("CUDNN_STATUS_NOT_SUPPORTED\nmore")
        built.append((ordinal, (mask, head, seq)))

    monkeypatch.setattr(build_kernels, "native_devices", lambda: devices)
    monkeypatch.setattr(build_kernels, "build", lambda archs, out, jobs: {a: [] for a in archs})
    monkeypatch.setattr(build_kernels, "_pool", lambda nvrtc, jobs: ThreadPoolExecutor(jobs))
    monkeypatch.setattr(dnn, "import_cudnn", cudnn)
    monkeypatch.setattr(dnn, "build_attention_kind", build_kind)
    assert build_kernels.main(argv) == 0
    return sorted(built)


def test_the_install_warms_cudnn_attention_once_per_native_architecture(monkeypatch, capsys):
    """``--arch native`` (the default) builds a fused-attention graph of every kind on the first
    GPU of each architecture, so that the driver compiles its kernels, and reports the kinds
    that failed; explicit architectures (a build for other machines) and a turned-off JIT
    cache build none."""
    from onnxplug_cuda import dnn

    monkeypatch.delenv("CUDA_CACHE_DISABLE", raising=False)
    kinds = [k for k in dnn.ATTENTION_KINDS if k != ("bias", 128, 77)]
    assert len(dnn.ATTENTION_KINDS) == 18
    want = sorted((d, k) for d in (0, 2) for k in kinds)
    assert _main_with(monkeypatch, {"sm_90": 0, "sm_80": 2}, []) == want
    out = capsys.readouterr().out
    for arch in ("sm_90", "sm_80"):
        assert f"{arch}: 17 of 18 kinds of cuDNN fused attention in the driver's JIT cache" in out
    assert out.count("left out ('bias', 128, 77): CUDNN_STATUS_NOT_SUPPORTED\n") == 2
    assert _main_with(monkeypatch, {"sm_90": 0}, ["--arch", "90"]) == []
    monkeypatch.setenv("CUDA_CACHE_DISABLE", "1")
    assert _main_with(monkeypatch, {"sm_90": 0}, []) == []
    assert "CUDA_CACHE_DISABLE is set" in capsys.readouterr().out


def test_the_install_reports_a_missing_cudnn_frontend_and_goes_on(monkeypatch, capsys):
    def missing() -> None:
        raise ImportError("No module named 'cudnn'")

    monkeypatch.delenv("CUDA_CACHE_DISABLE", raising=False)
    assert _main_with(monkeypatch, {"sm_90": 0}, [], missing) == []
    out = capsys.readouterr().out
    assert "cuDNN frontend not importable (No module named 'cudnn'): attention kernels" in out


@pytest.mark.parametrize("dims", [(1, 2, 5, 4, 4), (3, 2, 7, 8, 6), (2, 12, 3, 64, 64)])
def test_the_packed_attention_spec_views_the_heads_of_the_projection(dims):
    """``SdpaSpec.packed``'s strides, read from the Q, K and V columns of a packed (B * S,
    total) projection, give each head's (S, H) block; its output strides write (B, S, N * Hv)."""
    b, n, s, h, hv = dims
    dq, dv = n * h, n * hv
    total = 2 * dq + dv
    qkv = np.arange(b * s * total, dtype=np.float16).reshape(b * s, total)
    spec = dnn.SdpaSpec.packed(dims, total, None, True, 0.5)
    assert (spec.q, spec.k, spec.v, spec.causal, spec.scale) == (
        (b, n, s, h), (b, n, s, h), (b, n, s, hv), True, 0.5,
    )  # fmt: skip
    flat = qkv.reshape(-1)

    def view(offset, shape, strides):
        return np.lib.stride_tricks.as_strided(
            flat[offset:], shape, tuple(x * flat.itemsize for x in strides)
        )

    heads = qkv.reshape(b, s, total)
    q = view(0, spec.q, spec.q_stride)
    k = view(dq, spec.k, spec.k_stride)
    v = view(2 * dq, spec.v, spec.v_stride)
    for i in range(n):
        np.testing.assert_array_equal(q[:, i], heads[:, :, i * h : (i + 1) * h])
        np.testing.assert_array_equal(k[:, i], heads[:, :, dq + i * h : dq + (i + 1) * h])
        np.testing.assert_array_equal(v[:, i], heads[:, :, 2 * dq + i * hv : 2 * dq + (i + 1) * hv])
    out = np.arange(b * s * dv, dtype=np.float16)
    o = np.lib.stride_tricks.as_strided(out, spec.v, tuple(x * 2 for x in spec.o_stride))
    np.testing.assert_array_equal(o, out.reshape(b, s, n, hv).transpose(0, 2, 1, 3))
