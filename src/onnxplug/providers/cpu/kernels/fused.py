"""CPU kernels of onnxruntime's fused GEMM and convolution ops (written by the optimizer's
extended-level fusions, and found in models optimized by onnxruntime's tools).

* ``com.microsoft`` ``FusedMatMul(A, B)`` (``alpha``, ``transA``, ``transB``): ``alpha *
  op(A) @ op(B)`` where op transposes the last two axes (numpy's broadcasting of the batch axes,
  as MatMul). ``transBatchA``/``transBatchB`` other than 0 are rejected with a clear error.
* ``com.microsoft`` ``FusedConv(X, W, B?, Z?)`` (Conv's attributes, ``activation``,
  ``activation_params``): ``activation(Conv(X, W, B) + Z)``; activations are onnxruntime's
  list: Relu, Tanh, Sigmoid, LeakyRelu (alpha), Clip (min, max), HardSigmoid (alpha, beta).

float16/bfloat16 compute in float32 and round once at the end.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from onnxplug.ep import Kernel, KernelContext, KernelInfo, KernelRegistry

from ._util import wide
from .activation import sigmoid
from .conv import Conv

MS = "com.microsoft"


def _leaky_relu(y: np.ndarray, p: list[float]) -> np.ndarray:
    alpha = p[0] if p else 0.01
    return np.where(y >= 0, y, y * y.dtype.type(alpha))


def _clip(y: np.ndarray, p: list[float]) -> np.ndarray:
    lo, hi = (p + [-np.inf, np.inf][len(p) :])[:2]
    return np.clip(y, lo, hi, out=y)


def _hard_sigmoid(y: np.ndarray, p: list[float]) -> np.ndarray:
    alpha, beta = (p + [0.2, 0.5][len(p) :])[:2]
    y *= y.dtype.type(alpha)
    y += y.dtype.type(beta)
    return np.clip(y, 0, 1, out=y)


# FusedConv's activations: (output in the compute type, its parameters) -> activated output
CONV_ACTIVATIONS: dict[str, Callable[[np.ndarray, list[float]], np.ndarray]] = {
    "Relu": lambda y, p: np.maximum(y, 0, out=y),
    "Tanh": lambda y, p: np.tanh(y, out=y),
    "Sigmoid": lambda y, p: sigmoid(y),
    "LeakyRelu": _leaky_relu,
    "Clip": _clip,
    "HardSigmoid": _hard_sigmoid,
}


class FusedConv(Conv):
    def __init__(self, info: KernelInfo):
        super().__init__(info)
        act = info.attr("activation", "")
        if isinstance(act, bytes):
            act = act.decode()
        if act and act not in CONV_ACTIVATIONS:
            raise ValueError(
                f"FusedConv node '{info.name}': activation '{act}' is not one of "
                f"{sorted(CONV_ACTIVATIONS)}"
            )
        self.act = CONV_ACTIVATIONS.get(act)
        self.params = [float(v) for v in (info.attr("activation_params") or [])]

    def compute(self, ctx: KernelContext) -> None:
        x, z = ctx.input(0), ctx.input(3)
        y = self.convolve(x, ctx.input(1), ctx.input(2))
        if z is not None:
            if np.broadcast_shapes(y.shape, z.shape) != y.shape:
                raise ValueError(
                    f"FusedConv node '{self.info.name}': Z of shape {list(z.shape)} does not "
                    f"broadcast to the output's {list(y.shape)}"
                )
            y += wide(z)
        if self.act is not None:
            y = self.act(y, self.params)
        ctx.set_output(0, y.astype(x.dtype, copy=False))


class FusedMatMul(Kernel):
    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.alpha = float(info.attr("alpha", 1.0))
        self.trans_a = bool(info.attr("transA", 0))
        self.trans_b = bool(info.attr("transB", 0))
        for name in ("transBatchA", "transBatchB"):
            if info.attr(name, 0):
                raise ValueError(f"FusedMatMul node '{info.name}': {name}=1 is not supported")

    def compute(self, ctx: KernelContext) -> None:
        a, b = ctx.input(0), ctx.input(1)
        dt = a.dtype
        wa, wb = wide(a), wide(b)
        if self.trans_a and wa.ndim >= 2:
            wa = wa.swapaxes(-1, -2)
        if self.trans_b and wb.ndim >= 2:
            wb = wb.swapaxes(-1, -2)
        y = np.asarray(np.matmul(wa, wb))
        if self.alpha != 1.0:
            y = y * y.dtype.type(self.alpha)
        ctx.set_output(0, y.astype(dt, copy=False))


def register(registry: KernelRegistry) -> None:
    registry.kernel("FusedConv", domain=MS, since=1)(FusedConv)
    registry.kernel("FusedMatMul", domain=MS, since=1)(FusedMatMul)
