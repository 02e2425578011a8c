"""Every entry point of the CUDA provider's row modules (softmax, the normalizations, fused
attention, SkipLayerNorm, EmbedLayerNorm, MatMulNBits) compiles and loads on its own, with only
the module's shared code: each is compiled on first use, not the whole module
(``_fused._RowModule``)."""

from __future__ import annotations

import pytest
from tests.gpu._cuda import cuda_marks
from tests.test_cuda_launch import _row_modules

pytestmark = cuda_marks


@pytest.mark.parametrize("label", sorted(_row_modules()))
def test_every_entry_point_compiles_alone(label):
    cp = pytest.importorskip("cupy")
    from onnxplug_cuda.kernels import _fused as F
    from onnxplug_cuda.launch import _function_handle

    mod = _row_modules()[label]
    fresh = F._RowModule(mod._shared + "".join(mod._entries.values()))  # nothing loaded yet
    for name in fresh._entries:
        fn = fresh.function(cp, name)
        assert _function_handle(fn) != 0, name  # compiled, and loaded on this device
    assert len(fresh._functions) == len(fresh._entries)  # one module per entry point
