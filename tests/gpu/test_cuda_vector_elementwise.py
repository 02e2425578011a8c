"""Prepared elementwise launches over dense operands move vectors (up to 16 bytes per thread,
``launch._vector_width``): exact against numpy for every width the sizes and alignments give,
with a broadcast scalar operand, a mixed-type operation (float32 in, float16 out) and views
offset into a larger buffer (the narrower widths, or the element loop)."""

from __future__ import annotations

import numpy as np
import pytest
from tests.gpu._cuda import cuda_marks

pytestmark = cuda_marks


@pytest.fixture(scope="module")
def cp():
    return pytest.importorskip("cupy")


def _run(cp, op, *args):
    launch = op.bind(cp, *args, stream=cp.cuda.get_current_stream().ptr)
    assert launch is not None
    launch()
    cp.cuda.get_current_stream().synchronize()


@pytest.mark.parametrize("n", [4096, 4100, 4098, 4097])
@pytest.mark.parametrize("offset", [0, 1, 2, 4])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_binary_with_a_broadcast_scalar(cp, n, offset, dtype):
    from onnxplug_cuda.kernels._fused import UFUNC_BINARY

    rng = np.random.default_rng(n + offset)
    a_h = rng.standard_normal(n + offset).astype(dtype)
    b_h = rng.standard_normal(1).astype(dtype)
    a = cp.asarray(a_h)[offset:]
    y = cp.zeros(n + offset, dtype)[offset:]
    _run(cp, UFUNC_BINARY["multiply"], a, cp.asarray(b_h), y)
    np.testing.assert_array_equal(cp.asnumpy(y), a_h[offset:] * b_h)
    _run(cp, UFUNC_BINARY["add"], a, a, y)
    np.testing.assert_array_equal(cp.asnumpy(y), a_h[offset:] + a_h[offset:])


@pytest.mark.parametrize("n", [768 * 8, 770, 771])
def test_mixed_types_cast(cp, n):
    """float32 -> float16 (Cast's kernel): 4 elements per thread, 16-byte loads, 8-byte stores."""
    from onnxplug_cuda.kernels import _fused as F

    rng = np.random.default_rng(n)
    x_h = (rng.standard_normal(n) * 100).astype(np.float32)
    x = cp.asarray(x_h)
    y = cp.zeros(n, np.float16)
    op = F.Elementwise("float32 x", "float16 y", "y = __float2half_rn(x)", "ox_t_cast", None)
    _run(cp, op, x, y)
    np.testing.assert_array_equal(cp.asnumpy(y), x_h.astype(np.float16))
