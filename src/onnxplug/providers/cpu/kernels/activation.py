"""Activation CPU kernels: Relu and friends, Gelu/Erf, PRelu, Softmax and LogSoftmax.

float16 and bfloat16 inputs are computed in float32 and rounded once at the end (as
onnxruntime's MLAS does): more accurate than stepping in half precision, and immune to
bfloat16's promotion with Python floats.
"""

from __future__ import annotations

import math

import numpy as np

from onnxplug.ep import Kernel, KernelContext, KernelInfo, KernelRegistry, shapes

from ._util import quiet, wide

# float32 erf as in XLA/Eigen: x * P(x^2) / Q(x^2) on [-4, 4] (erf is +-1 in float32 beyond),
# max relative error ~4e-7. numpy has no erf; float64 goes through math.erf.
_ERF_P = (
    -2.72614225801306e-10,
    2.77068142495902e-08,
    -2.10102402082508e-06,
    -5.69250639462346e-05,
    -7.34990630326855e-04,
    -2.95459980854025e-03,
    -1.60960333262415e-02,
)
_ERF_Q = (
    -1.45660718464996e-05,
    -2.13374055278905e-04,
    -1.68282697438203e-03,
    -7.37332916720468e-03,
    -1.42647390514189e-02,
)
_erf64 = np.frompyfunc(math.erf, 1, 1)


def erf(x: np.ndarray) -> np.ndarray:
    if x.dtype == np.float64:
        return _erf64(x).astype(np.float64)
    x = np.clip(x.astype(np.float32), -4.0, 4.0)
    x2 = x * x
    p = np.full_like(x, _ERF_P[0])
    for c in _ERF_P[1:]:
        p *= x2
        p += np.float32(c)
    q = np.full_like(x, _ERF_Q[0])
    for c in _ERF_Q[1:]:
        q *= x2
        q += np.float32(c)
    p *= x
    p /= q
    return p


class Activation(Kernel):
    """``y = f(x)`` computed in at least float32 and cast back to x's dtype."""

    def f(self, x: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def compute(self, ctx: KernelContext) -> None:
        x = ctx.input(0)
        with quiet():
            ctx.set_output(0, np.asarray(self.f(wide(x))).astype(x.dtype, copy=False))


class Relu(Kernel):
    def compute(self, ctx: KernelContext) -> None:
        x = ctx.input(0)
        ctx.set_output(0, np.asarray(np.maximum(x, x.dtype.type(0))))


class LeakyRelu(Activation):
    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.alpha = float(info.attr("alpha", 0.01))

    def f(self, x: np.ndarray) -> np.ndarray:
        return np.where(x < 0, x * self.alpha, x)


def sigmoid(x: np.ndarray) -> np.ndarray:
    e = np.exp(-np.abs(x))  # in (0, 1]: never overflows
    return np.where(x >= 0, 1, e) / (1 + e)


class Sigmoid(Activation):
    def f(self, x: np.ndarray) -> np.ndarray:
        return sigmoid(x)


class Elu(Activation):
    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.alpha = float(info.attr("alpha", 1.0))

    def f(self, x: np.ndarray) -> np.ndarray:
        return np.where(x > 0, x, self.alpha * np.expm1(np.minimum(x, 0)))


class Selu(Activation):
    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.alpha = float(info.attr("alpha", 1.67326319217681884765625))
        self.gamma = float(info.attr("gamma", 1.05070102214813232421875))

    def f(self, x: np.ndarray) -> np.ndarray:
        return self.gamma * np.where(x > 0, x, self.alpha * np.expm1(np.minimum(x, 0)))


class Softplus(Activation):
    def f(self, x: np.ndarray) -> np.ndarray:
        return np.logaddexp(0, x)


class HardSigmoid(Activation):
    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.alpha = float(info.attr("alpha", 0.2))
        self.beta = float(info.attr("beta", 0.5))

    def f(self, x: np.ndarray) -> np.ndarray:
        return np.clip(x * self.alpha + self.beta, 0, 1)


class HardSwish(Activation):
    def f(self, x: np.ndarray) -> np.ndarray:
        return x * np.clip(x * (1 / 6) + 0.5, 0, 1)


class Gelu(Activation):
    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.tanh = info.attr("approximate", "none") == "tanh"

    def f(self, x: np.ndarray) -> np.ndarray:
        if self.tanh:
            inner = math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)
            return 0.5 * x * (1 + np.tanh(inner))
        return 0.5 * x * (1 + erf(x * (1 / math.sqrt(2))).astype(x.dtype, copy=False))


class Erf(Activation):
    def f(self, x: np.ndarray) -> np.ndarray:
        return erf(x)


class PRelu(Kernel):
    """PRelu-7+: the slope broadcasts to X (unidirectionally)."""

    def compute(self, ctx: KernelContext) -> None:
        x, slope = ctx.input(0), ctx.input(1)
        if not shapes.unidirectional_broadcastable(slope.shape, x.shape):
            raise ValueError(f"PRelu: slope {slope.shape} does not broadcast to X {x.shape}")
        ctx.set_output(0, np.where(x < 0, x * slope, x).astype(x.dtype, copy=False))


class Softmax(Kernel):
    """Softmax-13+ over one axis; ``log`` makes it LogSoftmax."""

    log = False

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.axis = int(info.attr("axis", -1))

    def softmax(self, x: np.ndarray, axis: int) -> np.ndarray:
        # float16 steps in float16 like onnx's expected outputs (the fp16 attention tests
        # tell the difference); bfloat16 has no native numpy loops worth using
        w = x if x.dtype == np.float16 else wide(x)
        z = w - w.max(axis=axis, keepdims=True)
        if self.log:
            z -= np.log(np.exp(z).sum(axis=axis, keepdims=True))
            return z.astype(x.dtype, copy=False)
        np.exp(z, out=z)
        z /= z.sum(axis=axis, keepdims=True)
        return z.astype(x.dtype, copy=False)

    def compute(self, ctx: KernelContext) -> None:
        x = ctx.input(0)
        ctx.set_output(0, self.softmax(x, shapes.normalize_axis(self.axis, x.ndim)))


class Softmax1(Softmax):
    """Softmax-1..12: the input is coerced to 2-D at ``axis`` (default 1) and normalized
    over the flattened trailing dims."""

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.axis = int(info.attr("axis", 1))

    def compute(self, ctx: KernelContext) -> None:
        x = ctx.input(0)
        rows, cols = shapes.coerced_2d(x.shape, self.axis)
        ctx.set_output(0, self.softmax(x.reshape(rows, cols), 1).reshape(x.shape))


class LogSoftmax(Softmax):
    log = True


class LogSoftmax1(Softmax1):
    log = True


def register(registry: KernelRegistry) -> None:
    registry.kernel("Relu", since=6)(Relu)
    registry.kernel("LeakyRelu", since=6)(LeakyRelu)
    registry.kernel("Sigmoid", since=6)(Sigmoid)
    registry.kernel("Elu", since=6)(Elu)
    registry.kernel("Selu", since=6)(Selu)
    registry.kernel("Softplus", since=1)(Softplus)
    registry.kernel("HardSigmoid", since=6)(HardSigmoid)
    registry.kernel("HardSwish", since=14)(HardSwish)
    registry.kernel("Gelu", since=20)(Gelu)
    registry.kernel("Erf", since=9)(Erf)
    registry.kernel("PRelu", since=7)(PRelu)
    registry.kernel("Softmax", since=1, until=12)(Softmax1)
    registry.kernel("Softmax", since=13)(Softmax)
    registry.kernel("LogSoftmax", since=1, until=12)(LogSoftmax1)
    registry.kernel("LogSoftmax", since=13)(LogSoftmax)
