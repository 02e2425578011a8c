"""QuantizeLinear/DequantizeLinear on the CUDA provider against the CPU provider: every case of
tests/quant_cases.py (float32/float16/bfloat16 to and from int8/uint8/int16/uint16, int32
dequantized; per tensor, per axis, blocked with whole and partial blocks; opsets 10 to 25; the
com.microsoft forms), with ties, saturation, infinities, NaN and negative zero points.

Exact equality: both sides divide in float32 (IEEE; CuPy compiles without fast math), round
half to even (rintf, np.rint), add the zero point and clamp in float (fmaxf/fminf, np.fmax/
np.fmin: NaN to the low end); dequantization multiplies in float32 and rounds once (bfloat16
by round-to-nearest-even on both sides).
"""

from __future__ import annotations

import numpy as np
import pytest
from tests.gpu._cuda import CUDA, cuda_marks, run_cuda_and_cpu
from tests.quant_cases import all_cases

pytestmark = cuda_marks
CASES = all_cases()


def _bits(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float32) if a.dtype.kind == "V" else a


@pytest.mark.parametrize("case", sorted(CASES))
def test_quantize_linear_cuda_matches_cpu(case):
    model, feeds = CASES[case]
    got, ref, where = run_cuda_and_cpu(model, feeds)
    assert where["n"] == CUDA, where
    for g, r in zip(got, ref, strict=True):
        assert g.dtype == r.dtype and g.shape == r.shape
        np.testing.assert_array_equal(_bits(g), _bits(r))
