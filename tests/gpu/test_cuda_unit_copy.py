"""The wide-unit copy kernel (``launch.bind_unit_copy``) behind prepared copies of views whose
innermost dim is contiguous on both sides (attention head transposes, Transpose/Slice/Split
outputs): exact against numpy for every unit width (16/8/4/2/1 bytes, chosen from the row
size, the pointers' and the strides' alignment), offsets into a packed projection, and the
views it must refuse (the generic kernel copies those)."""

from __future__ import annotations

import numpy as np
import pytest
from tests.gpu._cuda import cuda_marks

pytestmark = cuda_marks


@pytest.fixture(scope="module")
def cp():
    return pytest.importorskip("cupy")


def _copy(cp, src, dst):
    from onnxplug_cuda.launch import bind_unit_copy

    launch = bind_unit_copy(cp, src, dst, cp.cuda.get_current_stream().ptr)
    assert launch is not None
    launch()
    cp.cuda.get_current_stream().synchronize()


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.int8, np.float64])
@pytest.mark.parametrize("b", [1, 3, 8])
def test_head_transposes_of_a_packed_projection(cp, dtype, b):
    s, n, h = 37, 12, 64
    rng = np.random.default_rng(b)
    qkv_h = (rng.standard_normal((b, s, 3 * n * h)) * 50).astype(dtype)
    qkv = cp.asarray(qkv_h)
    for lo in (0, n * h, 2 * n * h):
        src = qkv[..., lo : lo + n * h].reshape(b, s, n, h).transpose(0, 2, 1, 3)
        dst = cp.empty((b, n, s, h), dtype)
        _copy(cp, src, dst)
        want = qkv_h[..., lo : lo + n * h].reshape(b, s, n, h).transpose(0, 2, 1, 3)
        np.testing.assert_array_equal(cp.asnumpy(dst), want)
        back = cp.zeros((b, s, n, h), dtype)  # the context written back as (B, S, N*H)
        _copy(cp, dst, back.transpose(0, 2, 1, 3))
        np.testing.assert_array_equal(cp.asnumpy(back), want.transpose(0, 2, 1, 3))


@pytest.mark.parametrize("row", [2, 3, 4, 8, 12, 16, 33])
@pytest.mark.parametrize("offset", [0, 1, 2, 5])
def test_every_unit_width(cp, row, offset):
    """Row sizes and starting offsets that force each unit width down to single bytes."""
    base_h = np.arange(7 * 5 * (row + 9), dtype=np.uint8).reshape(7, 5, row + 9)
    base = cp.asarray(base_h)
    src = base[:, :, offset : offset + row].transpose(1, 0, 2)  # (5, 7, row), rows strided
    dst = cp.empty((5, 7, row), np.uint8)
    _copy(cp, src, dst)
    np.testing.assert_array_equal(
        cp.asnumpy(dst), base_h[:, :, offset : offset + row].transpose(1, 0, 2)
    )


def test_refuses_what_it_cannot_copy(cp):
    from onnxplug_cuda.launch import bind_unit_copy

    x = cp.zeros((4, 6, 8), np.float32)
    sh = cp.cuda.get_current_stream().ptr
    assert bind_unit_copy(cp, x.transpose(0, 2, 1), cp.empty((4, 8, 6), np.float32), sh) is None
    assert bind_unit_copy(cp, x, cp.empty((4, 6, 8), np.float16), sh) is None  # a cast
    assert bind_unit_copy(cp, x, cp.empty((4, 6, 8), np.float32), sh) is None  # one run: flat
    assert bind_unit_copy(cp, x[:, ::-1], cp.empty((4, 6, 8), np.float32), sh) is None
