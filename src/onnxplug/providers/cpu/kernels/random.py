"""Random sampling kernels (native: onnx.reference has no Multinomial)."""

from __future__ import annotations

import numpy as np

from onnxplug.ep import Kernel, KernelContext, KernelInfo, KernelRegistry, node_seed, np_dtype


class Multinomial(Kernel):
    """Multinomial: ``sample_size`` class indices per batch row, drawn from the categorical
    distribution whose unnormalized log-probabilities are the input row. A ``seed`` attribute
    (or ``onnxplug.set_seed``) makes the node's draws reproducible from session to session."""

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.sample_size = int(info.attr("sample_size", 1))
        self.dtype = np_dtype(int(info.attr("dtype", 6)))  # int32 by default
        self.rng = np.random.default_rng(node_seed(info.attr("seed")))

    def compute(self, ctx: KernelContext) -> None:
        logits = ctx.input(0).astype(np.float64)
        z = logits - logits.max(axis=1, keepdims=True)
        p = np.exp(z)
        cdf = np.cumsum(p / p.sum(axis=1, keepdims=True), axis=1)
        u = self.rng.random((logits.shape[0], self.sample_size))
        idx = np.empty(u.shape, dtype=np.int64)
        for b in range(logits.shape[0]):
            idx[b] = np.minimum(np.searchsorted(cdf[b], u[b], side="right"), logits.shape[1] - 1)
        ctx.set_output(0, idx.astype(self.dtype))


def register(registry: KernelRegistry) -> None:
    registry.kernel("Multinomial", since=7)(Multinomial)
