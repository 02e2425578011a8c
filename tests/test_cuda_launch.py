"""The CUDA provider's prepared launches, checked without a GPU: how ``RawElementwise`` sorts
operands into pointers and by-value scalars, the kernel signature it generates, the index
structure, and the collapsing of dims. (A numpy scalar has ``data`` and ``strides`` too: taken
for an array, it was passed as a pointer and the kernel read an illegal address.)"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

PLUGIN_SRC = Path(__file__).resolve().parents[1] / "plugins" / "cuda" / "src"
if str(PLUGIN_SRC) not in sys.path:
    sys.path.insert(0, str(PLUGIN_SRC))

from onnxplug_cuda import launch as L  # noqa: E402
from onnxplug_cuda.kernels import _fused as F  # noqa: E402


class _Ptr:
    def __init__(self, p: int):
        self.ptr = p


class _Array:
    """What RawElementwise reads of a CuPy array."""

    def __init__(self, a: np.ndarray, ptr: int):
        self.data = _Ptr(ptr)
        self.shape, self.strides, self.dtype = a.shape, a.strides, a.dtype
        self.ndim, self.itemsize = a.ndim, a.itemsize


class _Runtime:
    device = 0  # the current device, as CuPy's runtime reports it

    @staticmethod
    def getDevice() -> int:  # CuPy's name
        return _Runtime.device


class _Xp:
    sources: list[str] = []

    class cuda:  # CuPy's name
        runtime = _Runtime

    class RawModule:
        def __init__(self, code: str, options: tuple):
            _Xp.sources.append(code)
            self.device = _Runtime.device

        def get_function(self, name: str) -> tuple[str, int]:
            return (name, self.device)  # a function of the device current at loading


@pytest.fixture
def launches(monkeypatch):
    made: list[tuple] = []

    class FakeLaunch:
        def __init__(self, fn, grid, block, stream, params, shared_mem=0, name=""):
            made.append((grid, block, stream, list(params), fn))

    monkeypatch.setattr(L, "Launch", FakeLaunch)
    _Xp.sources.clear()
    return made


def test_scalars_are_passed_by_value_and_arrays_by_pointer(launches):
    x = _Array(np.zeros((4, 33), np.float32), 4096)
    y = _Array(np.zeros((4, 33), np.float32), 8192)
    F.UNARY_KERNELS["Celu"].plain.bind(_Xp, x, np.float32(2.0), y, stream=7)
    (grid, block, stream, params, _fn) = launches[-1]
    assert stream == 7
    assert params[0] is x and params[2] is y
    assert isinstance(params[1], np.float32)  # the attribute, by value
    src = _Xp.sources[-1]
    assert "const float32 alpha" in src and "_p_alpha" not in src
    assert "const T* __restrict__ _p_x" in src and "T* __restrict__ _p_y" in src
    assert params[3].n == 4 * 33 and params[3].ndim == 1  # dense: one flat dim


def test_compiled_functions_are_kept_per_device(launches, monkeypatch):
    """A function loaded while device 0 was current cannot launch on device 1: each device
    compiles and loads its own, once."""
    monkeypatch.setattr(_Runtime, "device", 0)
    op = F.UFUNC_BINARY["multiply"]
    shape = (3, 7)

    def bind() -> None:
        a, b, y = (_Array(np.zeros(shape, np.float32), p) for p in (512, 1024, 2048))
        op.bind(_Xp, a, b, y, stream=0)

    bind()
    bind()
    monkeypatch.setattr(_Runtime, "device", 1)
    bind()
    bind()
    assert len(_Xp.sources) == 2  # once per device
    from onnxplug_cuda.kernels._fused import function_devices

    assert {0, 1} <= set(function_devices())


def test_broadcast_operands_get_zero_strides(launches):
    a = _Array(np.zeros((2, 3, 5), np.float32), 1024)
    b = _Array(np.zeros((1, 1, 5), np.float32), 2048)  # a row broadcast over (2, 3)
    y = _Array(np.zeros((2, 3, 5), np.float32), 4096)
    F.UFUNC_BINARY["add"].bind(_Xp, a, b, y, stream=0)
    idx = launches[-1][3][-1]
    assert idx.ndim == 2 and list(idx.shape[:2]) == [6, 5]  # (2, 3) merged
    assert [idx.st[0][d] for d in range(2)] == [5, 1]
    assert [idx.st[1][d] for d in range(2)] == [0, 1]


def test_transposed_copy_keeps_the_source_strides(launches):
    src = np.zeros((2, 3, 4), np.float32).transpose(0, 2, 1)  # (2, 4, 3), not contiguous
    x = _Array(src, 64)
    y = _Array(np.zeros((2, 4, 3), np.float32), 128)
    F.COPY.bind(_Xp, x, y, stream=0)
    idx = launches[-1][3][-1]
    assert idx.ndim == 3
    assert [idx.st[0][d] for d in range(3)] == [12, 1, 4]
    assert [idx.st[1][d] for d in range(3)] == [12, 3, 1]


def test_an_output_of_another_shape_has_no_prepared_form(launches):
    a = _Array(np.zeros((3,), np.float32), 64)
    y = _Array(np.zeros((2, 3), np.float32), 128)
    assert F.UFUNC_BINARY["add"].bind(_Xp, a, a, _Array(np.zeros((3,), np.float32), 1)) is not None
    assert F.COPY.bind(_Xp, y, a) is None  # the output must be the broadcast shape


def test_collapse_merges_only_contiguous_runs():
    dims, st = L._collapse((2, 3, 4), [[12, 4, 1], [0, 4, 1]])
    assert dims == [2, 12] and st == [[12, 1], [0, 1]]
    dims, st = L._collapse((1, 1), [[0, 0]])
    assert dims == [1] and st == [[0]]


def test_head_transpose_copies_move_16_byte_units(launches):
    """A (B, S, N, H) -> (B, N, S, H) float16 head copy out of a packed (B, S, 3*N*H)
    projection: 16-byte units (8 elements), index arithmetic over the outer dims only."""
    b, s, n, h = 2, 5, 3, 64
    qkv = np.zeros((b, s, 3 * n * h), np.float16)
    src = qkv[..., n * h : 2 * n * h].reshape(b, s, n, h).transpose(0, 2, 1, 3)
    x = _Array(src, 4096 + n * h * 2)  # the K columns start 384 bytes in
    y = _Array(np.zeros((b, n, s, h), np.float16), 8192)
    F.COPY.bind(_Xp, x, y, stream=0)
    fn, p = launches[-1][4], launches[-1][3][-1]
    assert fn[0] == "ox_copy_units_16_i"
    assert (p.n, p.row, p.ndim) == (b * n * s * h // 8, h // 8, 3)
    units = 3 * n * h // 8  # a projection row, in units
    assert [p.shape[d] for d in range(3)] == [b, n, s]
    assert [p.ss[d] for d in range(3)] == [s * units, h // 8, units]
    assert [p.sd[d] for d in range(3)] == [n * s * h // 8, s * h // 8, h // 8]


def test_unit_width_follows_the_alignment(launches):
    """A 6-byte row (three float16) takes 2-byte units; 8-byte rows 20 bytes apart 4-byte ones."""
    a = np.zeros((4, 10), np.float16)
    x = _Array(a[:, 2:5], 4096)
    F.COPY.bind(_Xp, x, _Array(np.zeros((4, 3), np.float16), 8192), stream=0)
    assert launches[-1][4][0] == "ox_copy_units_2_i"
    x = _Array(a[:, 2:6], 4096)  # 8-byte rows, 20-byte row stride: 4-byte units
    F.COPY.bind(_Xp, x, _Array(np.zeros((4, 4), np.float16), 8192), stream=0)
    assert launches[-1][4][0] == "ox_copy_units_4_i"


@pytest.mark.parametrize(
    ("n", "ptr", "vec"),
    [(64, 4096, 8), (60, 4096, 4), (63, 4096, 1), (64, 4096 + 8, 4), (64, 4096 + 2, 1)],
    ids=["vectors", "half-vectors", "odd", "8-byte-aligned", "2-byte-aligned"],
)
def test_dense_float16_operations_move_vectors(launches, n, ptr, vec):
    """A flat float16 operation over dense operands moves up to 8 elements (16 bytes) per
    thread: as many as divide the element count and keep every dense pointer aligned; a
    broadcast scalar operand is read once per thread."""
    a = _Array(np.zeros(n, np.float16), ptr)
    b = _Array(np.zeros(1, np.float16), 8192)  # one element broadcast
    y = _Array(np.zeros(n, np.float16), 16384)
    op = F.UFUNC_BINARY["add"]
    op.bind(_Xp, a, b, y, stream=0)
    assert launches, "no prepared launch"
    assert L._vector_width([a, b, y], [[1], [0], [1]], n) == vec
    if vec > 1:
        src = op._raw._vector_source({"T": "__half"}, [], False, vec, (False, True, False))
        assert f"OxVec<T, {vec}>" in src and "const T _s_b = _p_b[0];" in src  # read once


def _row_modules() -> dict[str, F._RowModule]:
    from onnxplug_cuda.kernels import attention as A
    from onnxplug_cuda.kernels import contrib as C

    return {
        "rows": F.ROWS,
        "softmax": A.SOFTMAX_ROWS,
        "fused attention": A.FUSED_ATTENTION,
        "fused attention mma": A.FUSED_ATTENTION_MMA,
        "skip layer norm": C.SKIP_LN_ROWS,
        "embed": C.EMBED_ROWS,
        "nbits": C.NBITS_ROWS,
    }


def test_row_modules_compile_each_entry_point_on_its_own():
    """A row module compiles an entry point with the shared code and that entry alone (the
    whole row module, every entry for four storage types, took NVRTC 2.2 s; a model runs one
    or two of them): every ``extern "C"`` kernel is found, ``__launch_bounds__`` included, and
    its source holds no other entry point."""
    counts = {}
    for label, mod in _row_modules().items():
        assert 'extern "C"' not in mod._shared, label
        for name in mod._entries:
            src = mod.source(name)
            assert src.count('extern "C"') == 1, (label, name)
            assert f" {name}(" in src, (label, name)
        counts[label] = len(mod._entries)
    assert counts == {
        "rows": 12,
        "softmax": 12,
        "fused attention": 2,
        "fused attention mma": 2,
        "skip layer norm": 16,
        "embed": 5,
        "nbits": 4,
    }
    assert {"oxa_fused_f32_q16", "oxa_fused_f32_q32"} == set(
        _row_modules()["fused attention"]._entries
    )
    with pytest.raises(KeyError, match="no kernel 'ox_rownorm_f8'"):
        F.ROWS.source("ox_rownorm_f8")


def test_a_row_module_refuses_a_repeated_or_missing_entry_point():
    entry = 'extern "C" __global__ void k(float* x) { x[0] = 1; }\n'
    with pytest.raises(ValueError, match="repeated"):
        F._RowModule("// shared\n" + entry + entry)
    with pytest.raises(ValueError, match="entry point"):
        F._RowModule("__global__ void k(float* x) {}")


def test_a_row_module_compiles_only_the_entry_points_used(launches):
    """Asking for one function compiles one small module: the shared code and that entry."""
    mod = F._RowModule(
        "// shared\n"
        + 'extern "C" __global__ void a(float* x) { x[0] = 1; }\n'
        + 'extern "C" __global__ void __launch_bounds__(64) b(float* x) { x[0] = 2; }\n'
    )
    mod.function(_Xp, "b")
    mod.function(_Xp, "b")
    assert _Xp.sources[-1] == mod.source("b") and "void a(" not in _Xp.sources[-1]
    n = len(_Xp.sources)
    mod.function(_Xp, "a")
    assert len(_Xp.sources) == n + 1 and "void b(" not in _Xp.sources[-1]


# ---------------------------------------------------------------------------------------------
# graph launches (CupyBackend.launch_graph): the driver's, keeping the interpreter lock


def test_a_node_graph_launch_goes_through_the_driver_and_falls_back_where_it_has_no_context(
    monkeypatch,
):
    """``launch_node_graph`` launches through ``cuGraphLaunch`` (a CUresult back; 0 is None);
    a thread with no current context (CUDA_ERROR_INVALID_CONTEXT) launches through the runtime
    instead (``launch_graph``, a replay's launch), whose error text is returned; any other
    CUresult is returned by name."""
    from types import SimpleNamespace

    from onnxplug_cuda import backend as B
    from onnxplug_cuda import runtime

    calls: list = []

    def runtime_launch(exe: int, stream: int) -> None:
        calls.append(("runtime", exe, stream))
        if exe == 13:
            raise RuntimeError("cudaErrorInvalidResourceHandle: invalid resource handle")

    def fake(result: int) -> SimpleNamespace:
        def driver(exe: int, stream: int) -> int:
            calls.append(("driver", exe, stream))
            return result

        be = SimpleNamespace(_launch=driver, _runtime_launch=runtime_launch)
        be.launch_graph = lambda exe, stream: B.CupyBackend.launch_graph(be, exe, stream)
        return be

    names = {719: "CUDA_ERROR_LAUNCH_FAILED"}
    monkeypatch.setattr(B, "driver_error_name", lambda err: names[err])
    assert B.CupyBackend.launch_node_graph(fake(0), 7, 9) is None
    assert calls == [("driver", 7, 9)]
    calls.clear()
    assert B.CupyBackend.launch_node_graph(fake(runtime.DRIVER_INVALID_CONTEXT), 7, 9) is None
    assert calls == [("driver", 7, 9), ("runtime", 7, 9)]
    calls.clear()
    err = B.CupyBackend.launch_node_graph(fake(runtime.DRIVER_INVALID_CONTEXT), 13, 9)
    assert err == "cudaErrorInvalidResourceHandle: invalid resource handle"
    calls.clear()
    assert B.CupyBackend.launch_node_graph(fake(719), 7, 9) == "CUDA_ERROR_LAUNCH_FAILED"
    assert calls == [("driver", 7, 9)]
    calls.clear()
    assert B.CupyBackend.launch_graph(fake(0), 7, 9) is None  # a replay: the runtime's
    assert calls == [("runtime", 7, 9)]
