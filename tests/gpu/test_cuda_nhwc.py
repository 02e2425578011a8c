"""The channels-last kernels (``com.ms.internal.nhwc``) on the GPU: the cases of
tests/test_nhwc_kernels.py on ``CUDAExecutionProvider``, with the convolutions on cuDNN's
channels-last graphs (no GEMM fallback), against the NCHW node on the CPU provider."""

from __future__ import annotations

import numpy as np
import pytest
from tests.gpu._cuda import CUDA, cuda_marks
from tests.test_nhwc_kernels import IDS, cases, check

pytestmark = cuda_marks


@pytest.mark.parametrize("fuse", ["0", "1"], ids=["epilogue", "fuse_conv_bias"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("case", cases(), ids=IDS)
def test_nhwc_kernel_on_cuda_matches_nchw_on_cpu(case, dtype, fuse):
    from onnxplug_cuda import dnn

    before = dnn.stats["fallback"]
    check(CUDA, {"use_tf32": "0", "fuse_conv_bias": fuse}, case, dtype)
    assert dnn.stats["fallback"] == before  # cuDNN ran every channels-last convolution
