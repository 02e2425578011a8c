"""Dry binds of the CUDA provider's elementwise kernels (``launch.dry_compiles``), checked
without a GPU: a kernel's ``warm_up`` binds its prepared form over shape-only operands and
queues, for the background, exactly the compile (kernel name, variant key, source) that the
run's bind of dense operands of those shapes asks for."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

PLUGIN_SRC = Path(__file__).resolve().parents[1] / "plugins" / "cuda" / "src"
if str(PLUGIN_SRC) not in sys.path:
    sys.path.insert(0, str(PLUGIN_SRC))

from onnxplug_cuda import launch  # noqa: E402
from onnxplug_cuda.kernels import _fused as F  # noqa: E402


class _Aligned:
    ptr = 1 << 20  # an arena block: aligned for any vector


def _array(shape: tuple[int, ...], dtype: type) -> launch.ShapeOnly:
    """A dense device array as bind reads it (shape, strides, type, pointer)."""
    a = launch.ShapeOnly(shape, dtype)
    a.data = _Aligned  # type: ignore[assignment]
    return a


class _Kernel:
    """What a dry bind uses of a ``CudaKernel``: ``precompile``."""

    def __init__(self) -> None:
        self.queued: list[tuple[str, tuple, str]] = []

    def precompile(self, name, source, functions, key) -> None:
        self.queued.append((name, key, source()))


class _Xp:
    class cuda:
        class runtime:
            @staticmethod
            def getDevice() -> int:
                return 3


class _Stop(Exception):
    pass


def _compiled_by_the_run(monkeypatch, op, args) -> tuple[str, tuple, str]:
    """(name, key, source) a real bind asks ``compiled_function`` for (then stopped)."""
    asked = []

    def ask(xp, name, source, functions, key):
        asked.append((name, key, source()))
        raise _Stop

    monkeypatch.setattr(launch, "compiled_function", ask)
    raw = op.raw()
    raw._functions.clear()
    assert raw.bind(_Xp, args, 0) is None  # the stop reads as "does not compile here"
    raw._functions.clear()  # (that failure is not remembered past this test)
    (got,) = asked
    return got


CASES = {
    "broadcast add": (F.UFUNC_BINARY["add"], [((1, 16, 32), np.float32), ((32,), np.float32)]),
    "vectorized add": (F.UFUNC_BINARY["add"], [((4, 64), np.float32), ((4, 64), np.float32)]),
    "scalar multiply": (F.UFUNC_BINARY["multiply"], [((1, 16), np.float32), ((), np.float32)]),
    "comparison": (F.UFUNC_BINARY["greater"], [((1, 16, 32), np.float32), ((), np.float32)]),
    "where": (F.WHERE, [((1, 16, 32), np.bool_), ((1, 16, 32), np.float16), ((), np.float16)]),
    "cast": (F.CAST, [((1, 16), np.int64)]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_dry_bind_queues_the_compile_the_run_asks_for(case, monkeypatch):
    op, ins = CASES[case]
    shape = np.broadcast_shapes(*(s for s, _ in ins))
    out = (
        (bool if op.out_params.startswith("bool") else ins[-1][1])
        if op is not F.CAST
        else np.float32
    )
    dry = [launch.ShapeOnly(s, t) for s, t in ins] + [launch.ShapeOnly(shape, out)]
    real = [_array(s, t) for s, t in ins] + [_array(shape, out)]
    kernel = _Kernel()
    with launch.dry_compiles(kernel):
        assert op.raw().bind(None, dry, 0) is None  # nothing bound, nothing compiled
    (queued,) = kernel.queued
    name, key, source = _compiled_by_the_run(monkeypatch, op, real)
    assert queued == (name, key[:-1], source)  # the key less its device (precompile adds it)
    assert key[-1] == 3


def test_dry_compiles_end_with_their_block():
    outer, inner = _Kernel(), _Kernel()
    with launch.dry_compiles(outer):
        with pytest.raises(RuntimeError), launch.dry_compiles(inner):
            assert launch._dry.kernel is inner
            raise RuntimeError
        assert launch._dry.kernel is outer  # a nested block gives the outer one back
    assert getattr(launch._dry, "kernel", None) is None


def test_a_shape_only_array_is_dense():
    a = launch.ShapeOnly((2, 0, 3), np.float16)
    assert a.strides == (6, 6, 2) and a.size == 0 and a.ndim == 3 and a.itemsize == 2
    assert launch._is_array(a) and a.data.ptr == 0


class _Dense:
    """A C-contiguous, aligned device array as the conv epilogue reads it."""

    def __init__(self, shape: tuple[int, ...], dtype: type) -> None:
        self.shape, self.dtype = shape, np.dtype(dtype)
        self.size, self.itemsize = int(np.prod(shape)), self.dtype.itemsize
        self.flags = type("F", (), {"c_contiguous": True})
        self.data = _Aligned


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize(
    "shape, dtype",
    [((1, 256, 56, 56), np.float32), ((1, 2048, 7, 7), np.float16), ((1, 3, 5, 5), np.float32)],
)
def test_conv_epilogue_precompile_queues_what_the_call_compiles(
    monkeypatch, shape, dtype, channels_last
):
    """A residual convolution's ``warm_up`` queues the epilogue variant (vector width, index
    width, layout) that the call after the plain cuDNN graph compiles."""
    from onnxplug_cuda.kernels import conv

    ep = conv.epilogue(True, True, "Relu", [])
    k = _Kernel()
    ep.precompile(k, np.dtype(dtype).name, shape, channels_last)
    asked = []

    def function(self, xp, name):
        asked.append((name, (name,), self.source(name)))
        raise _Stop

    monkeypatch.setattr(F._RowModule, "function", function)
    y = _Dense(shape, dtype)
    c = shape[-1] if channels_last else shape[1]
    with pytest.raises(_Stop):
        ep(_Xp, _Dense((c,), dtype), _Dense(shape, dtype), y, channels_last)
    assert k.queued == asked
