"""The base class of CUDA kernels: array views of inputs and outputs on the provider's stream.

A kernel computes with ``self.xp`` (CuPy on the GPU, numpy under the host simulation used
by CI) on views of the provider's memory: ``self.arg(ctx, i)`` is input ``i`` as an array,
``self.alloc(ctx, i, shape, dtype)`` allocates output ``i`` through the provider (static
memory plan, stream-ordered) and returns it as an array to fill, ``self.put(ctx, i, arr)``
publishes an array the kernel computed as output ``i``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from onnxplug.ep import DeviceTensor, Kernel, KernelContext, KernelInfo, dtypes

FLOATS = dtypes("float32", "float16", "float64")
SIGNED_INTS = dtypes("int8", "int16", "int32", "int64")
UNSIGNED_INTS = dtypes("uint8", "uint16", "uint32", "uint64")
INTS = SIGNED_INTS + UNSIGNED_INTS
NUMERIC = FLOATS + INTS
ALL_FIXED = NUMERIC + dtypes("bool")


def _bf16() -> tuple[np.dtype, ...]:
    try:
        import ml_dtypes

        return (np.dtype(ml_dtypes.bfloat16),)
    except ImportError:
        return ()


BF16 = _bf16()
FLOATS_BF16 = FLOATS + BF16
ALL_FIXED_BF16 = ALL_FIXED + BF16


class CudaKernel(Kernel):
    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Every ``compute`` first makes the call's stream CuPy's current stream (and the one
        CuPy allocates on): a kernel may launch or allocate before touching any input, and
        the stream current before it may be a finished subgraph's, already destroyed."""
        super().__init_subclass__(**kwargs)
        fn = cls.__dict__.get("compute")
        if fn is None or getattr(fn, "_activates", False):
            return

        def compute(self: CudaKernel, ctx: KernelContext, _fn: Any = fn) -> None:
            self.be.activate(ctx.stream)
            _fn(self, ctx)

        compute._activates = True  # type: ignore[attr-defined]
        compute.__doc__ = fn.__doc__
        cls.compute = compute  # type: ignore[method-assign]

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.ep = info.ep
        self.be = info.ep.backend
        self.xp = self.be.xp

    @classmethod
    def claims(cls, node: Any, graph: Any) -> bool:
        """Whether this kernel computes ``node`` as written. The registry matched its opset
        and types already; a kernel that implements only some attribute values (or needs a
        constant input, ``graph.graph.initializers``) returns False for the others, and the
        node goes to the next provider."""
        return True

    def arg(self, ctx: KernelContext, i: int) -> Any:
        """Input ``i`` as an array (None when an optional input is absent)."""
        t = ctx.input(i)
        if t is None:
            return None
        if isinstance(t, DeviceTensor):
            self.be.activate(ctx.stream)
            return self.be.view(t)
        return t  # a host input declared CPU_INPUT: a numpy array

    def alloc(self, ctx: KernelContext, i: int, shape: Any, dtype: Any) -> Any:
        """Allocate output ``i`` and return it as an array for the kernel to fill."""
        t = ctx.output(i, shape, dtype)
        if isinstance(t, DeviceTensor):
            self.be.activate(ctx.stream)
            return self.be.view(t)
        return t

    def put(self, ctx: KernelContext, i: int, arr: Any, dtype: Any = None) -> None:
        """Publish an array computed by the kernel as output ``i`` (no copy when it is dense)."""
        if isinstance(arr, np.ndarray) and self.xp is not np:
            ctx.set_output(i, arr)  # a host output (CPU_OUTPUT)
            return
        ctx.set_output(i, self.be.wrap(arr, dtype))
