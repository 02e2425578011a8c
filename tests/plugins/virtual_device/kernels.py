"""Kernels of the virtual device: numpy on ``DeviceTensor.host_array()`` views, queued on the
provider's stream.

Shapes are worked out on the host when ``compute`` is called (that is when the executor
allocates outputs); the arithmetic runs later, in stream order. Every kernel checks that its
device inputs are on its device and in live memory, so a missing copy node or a block freed
too early fails loudly at the kernel that receives it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from onnxplug.ep import (
    DeviceTensor,
    IfKernel,
    Kernel,
    KernelContext,
    KernelRegistry,
    LoopKernel,
    MemType,
    bound_launcher,
    dtypes,
    host_view,
    shapes,
)

from .allocator import is_live
from .stream import VirtStream, submit

REGISTRY = KernelRegistry("VirtualDeviceExecutionProvider")
FLOATS = dtypes("float32", "float64")


class VirtKernel(Kernel):
    """Base of the virtual device's kernels: input checks and queued execution."""

    def device_input(self, ctx: KernelContext, index: int) -> DeviceTensor:
        x = ctx.input(index)
        info = self.info
        dev = info.ep.device
        if not isinstance(x, DeviceTensor) or x.device != dev:
            where = x.device if isinstance(x, DeviceTensor) else type(x).__name__
            raise TypeError(
                f"{info.op_type} node '{info.name}': input {index} is {where}, not on {dev} "
                "(a copy node is missing)"
            )
        if not is_live(x.ptr, x.nbytes):
            raise RuntimeError(
                f"{info.op_type} node '{info.name}': input {index} points into freed memory"
            )
        return x

    _bound: list[Callable[[], Any]] | None = None  # the work queued while binding

    def bind(self, ctx: KernelContext) -> Callable[[KernelContext], None] | None:
        """With the ``segments`` option: a launcher that re-queues the work ``compute`` queued
        (its views stay valid: the frame's memory is fixed), capturable with its neighbours
        (``segment``); else ``compute`` on every run."""
        stream = ctx.stream
        if not self.info.ep.segments or not isinstance(stream, VirtStream):
            return super().bind(ctx)
        self._bound = works = []
        try:
            self.compute(ctx)
        finally:
            self._bound = None

        def run() -> None:
            for w in works:
                stream.enqueue(w)

        return bound_launcher(ctx, run, self.compute, stream.graph_of)

    def launch(self, ctx: KernelContext, work: Callable[[], Any]) -> None:
        if self._bound is not None:
            self._bound.append(work)
        factory = self.info.ep.factory
        factory.stats.add(f"op:{self.info.op_type}")
        rendezvous = factory.rendezvous
        if rendezvous is not None:  # a test watches the device work (see the factory)
            inner = work

            def work() -> None:
                rendezvous()
                inner()

        submit(ctx.stream, work)


class _Binary(VirtKernel):
    ufunc: Any = None

    def compute(self, ctx: KernelContext) -> None:
        a, b = self.device_input(ctx, 0), self.device_input(ctx, 1)
        out = ctx.output(0, shapes.broadcast_shapes(a.shape, b.shape), a.dtype)
        av, bv, ov = a.host_array(), b.host_array(), out.host_array()
        ufunc = self.ufunc
        self.launch(ctx, lambda: ufunc(av, bv, out=ov))


for _op, _ufunc in (("Add", np.add), ("Sub", np.subtract), ("Mul", np.multiply)):
    REGISTRY.kernel(_op, since=7, types={"T": FLOATS})(
        type(_op, (_Binary,), {"ufunc": staticmethod(_ufunc)})
    )


@REGISTRY.kernel("Relu", since=6, types={"T": FLOATS})
class Relu(VirtKernel):
    def compute(self, ctx: KernelContext) -> None:
        x = self.device_input(ctx, 0)
        out = ctx.output(0, x.shape, x.dtype)
        xv, ov = x.host_array(), out.host_array()
        self.launch(ctx, lambda: np.maximum(xv, 0, out=ov))


def matmul_shape(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    if not a or not b:
        raise ValueError(f"MatMul needs inputs of rank >= 1, got {a} and {b}")
    a2 = (1, *a) if len(a) == 1 else a
    b2 = (*b, 1) if len(b) == 1 else b
    if a2[-1] != b2[-2]:
        raise ValueError(f"MatMul inner dimensions differ: {a} x {b}")
    out = (*shapes.broadcast_shapes(a2[:-2], b2[:-2]), a2[-2], b2[-1])
    if len(a) == 1:
        out = out[:-2] + out[-1:]
    if len(b) == 1:
        out = out[:-1]
    return out


@REGISTRY.kernel("MatMul", since=1, types={"T": FLOATS})
class MatMul(VirtKernel):
    def compute(self, ctx: KernelContext) -> None:
        a, b = self.device_input(ctx, 0), self.device_input(ctx, 1)
        out = ctx.output(0, matmul_shape(a.shape, b.shape), a.dtype)
        av, bv, ov = a.host_array(), b.host_array(), out.host_array()
        self.launch(ctx, lambda: np.matmul(av, bv, out=ov))


@REGISTRY.kernel("Transpose", since=1)
class Transpose(VirtKernel):
    def compute(self, ctx: KernelContext) -> None:
        x = self.device_input(ctx, 0)
        perm = self.info.attr("perm") or list(range(x.ndim))[::-1]
        out = ctx.output(0, tuple(x.shape[p] for p in perm), x.dtype)
        xv, ov = x.host_array(), out.host_array()
        self.launch(ctx, lambda: np.copyto(ov, xv.transpose(perm)))


@REGISTRY.kernel("Reshape", since=5, input_memory={1: MemType.CPU_INPUT})
class Reshape(VirtKernel):
    """A view of the input: the output aliases the input's memory."""

    def compute(self, ctx: KernelContext) -> None:
        x = self.device_input(ctx, 0)
        spec = ctx.input(1)
        if not isinstance(spec, np.ndarray):
            raise TypeError(
                f"Reshape node '{self.info.name}': the shape must arrive in host memory, got "
                f"{type(spec).__name__}"
            )
        allow_zero = bool(self.info.attr("allowzero", 0))
        dims = shapes.reshape_shape(x.shape, spec.reshape(-1).tolist(), allow_zero)
        self.info.ep.factory.stats.add("op:Reshape")
        ctx.set_output(0, x.view(dims))


@REGISTRY.kernel("Identity", since=1)
class Identity(VirtKernel):
    """The input itself, as device plugins do (onnxplug-cuda's Identity): an alias."""

    def compute(self, ctx: KernelContext) -> None:
        ctx.set_output(0, self.device_input(ctx, 0))


@REGISTRY.kernel("Softmax", since=13, types={"T": FLOATS})
class Softmax(VirtKernel):
    """The exponentials go to a workspace (``ctx.scratch``), which the queued work writes
    later: memory handed to another stream too early shows up as a wrong result."""

    def compute(self, ctx: KernelContext) -> None:
        x = self.device_input(ctx, 0)
        axis = shapes.normalize_axis(int(self.info.attr("axis", -1)), x.ndim)
        out = ctx.output(0, x.shape, x.dtype)
        xv, ov = x.host_array(), out.host_array()
        tmp = ctx.scratch(x.nbytes)
        e = host_view(tmp.ptr, x.shape, x.dtype, tmp)  # keeps the workspace until the work ran

        def work() -> None:
            np.exp(xv - xv.max(axis=axis, keepdims=True), out=e)
            np.divide(e, e.sum(axis=axis, keepdims=True), out=ov)

        self.launch(ctx, work)


@REGISTRY.kernel("NonZero", since=9)
class NonZero(VirtKernel):
    """Data-dependent output shape: the host must see the input, so the stream is drained."""

    def compute(self, ctx: KernelContext) -> None:
        x = self.device_input(ctx, 0)
        if ctx.stream is not None:
            ctx.stream.flush()
        nz = np.array(np.nonzero(x.host_array()), dtype=np.int64).reshape(x.ndim, -1)
        out = ctx.output(0, nz.shape, np.int64)
        ov = out.host_array()
        self.launch(ctx, lambda: np.copyto(ov, nz))


# Control flow: the host's kernels, with the condition and trip count read on the host (as
# onnxruntime's CUDA EP declares them); the host runs the subgraphs with the session's providers.
REGISTRY.kernel("If", since=1, input_memory={0: MemType.CPU_INPUT})(IfKernel)
REGISTRY.kernel("Loop", since=1, input_memory={0: MemType.CPU_INPUT, 1: MemType.CPU_INPUT})(
    LoopKernel
)
