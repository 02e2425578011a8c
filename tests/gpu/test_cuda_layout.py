"""The layout transformation on the GPU: with ``prefer_nhwc=1`` the CUDA provider runs every
convolution and pool of a ResNet-like block, a ResNet-50-shaped model and a SiLU trunk as
``com.ms.internal.nhwc`` nodes between the input's and the outputs' Transposes (cuDNN's
channels-last engines, no GEMM fallback), matching the CPU provider (the cases of
tests/test_layout_nhwc.py)."""

from __future__ import annotations

import numpy as np
import pytest
from tests.gpu._cuda import CUDA, cuda_marks
from tests.test_layout_nhwc import E2E, check_channels_last

pytestmark = cuda_marks


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("case", sorted(E2E))
def test_channels_last_on_cuda(case, dtype):
    from onnxplug_cuda import dnn

    before = dnn.stats["fallback"]
    check_channels_last(CUDA, {"use_tf32": "0"}, case, dtype)
    assert dnn.stats["fallback"] == before  # cuDNN ran every convolution
