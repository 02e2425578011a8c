"""Conv and ConvTranspose (1-D/2-D/3-D, groups, dilations, strides, asymmetric pads, auto_pad,
output_padding/output_shape) on cuDNN, with an im2col/col2im + GEMM fallback.

The cuDNN path (``onnxplug_cuda.dnn``) builds one frontend graph per shape: conv_fprop for Conv,
conv_dgrad for ConvTranspose. What follows the convolution (bias, FusedConv's residual Z and
activation):
* ``fuse_conv_bias=0`` (onnxruntime's default: no engine compiled at run time): a convolution
  without a residual gets its bias and ReLU inside the cuDNN graph where cuDNN ships a compiled
  engine for that fusion (the H100 has them at ResNet-50's shapes, float16 and float32); else,
  and always for a residual or another activation, one elementwise kernel (``epilogue``) follows
  the plain graph.
* ``fuse_conv_bias=1``: bias, Z and ReLU go into the cuDNN graph, which cuDNN compiles at run
  time where no shipped engine has them (slower to build; docs/providers/cuda.md has measured
  times), falling back as above where cuDNN has no engine for the fused graph.

The fallback runs when cuDNN is off (``enable_cudnn=0``), missing, or cannot build a graph for the case. It also
runs under the host simulation. It lowers the convolution to the provider's GEMM engine:
* Conv: the padded input's windows are gathered into columns (one copy through a strided view),
  then one GEMM per group.
* ConvTranspose: a GEMM to columns, then each kernel tap's columns are added into the strided
  output positions they came from.

``com.microsoft`` FusedConv (onnxruntime's contrib op: Conv + bias + optional Z + activation) is
also registered.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from onnxplug.ep import (
    NHWC_DOMAIN,
    KernelContext,
    KernelInfo,
    KernelRegistry,
    dtypes,
    shapes,
)

from .. import blas, dnn
from ..compiler import ship
from ._base import CudaKernel, node_graph
from ._fused import MATH_PRE, UNARY_FLOAT, WIDE_PRE, _RowModule, widen

CONV_TYPES = dtypes("float16", "float32", "float64")
# Column buffers of the fallback are built a few images at a time, up to this many elements.
_COLUMN_BUDGET = 1 << 26


def _as_strided(xp: Any, x: Any, shape: tuple[int, ...], strides: tuple[int, ...]) -> Any:
    return xp.lib.stride_tricks.as_strided(x, shape=shape, strides=strides)


def pad_spatial(xp: Any, x: Any, pads: list[int], value: float = 0) -> Any:
    """``x`` (N, C, *spatial) with ONNX pads [begins..., ends...] of ``value`` around the spatial
    dims (``x`` itself when there are none)."""
    n = x.ndim - 2
    if not any(pads):
        return x
    out = xp.full(
        x.shape[:2] + tuple(d + pads[i] + pads[n + i] for i, d in enumerate(x.shape[2:])),
        value,
        dtype=x.dtype,
    )
    inner = tuple(slice(pads[i], pads[i] + d) for i, d in enumerate(x.shape[2:]))
    out[(slice(None), slice(None), *inner)] = x
    return out


class _Geometry:
    """Shapes and pads of one node for one input shape (computed once per shape)."""

    __slots__ = ("cols_per_image", "dilations", "kernel", "out", "pads", "spec", "strides", "y")

    def __init__(self, y, kernel, strides, dilations, out, pads, spec, cols_per_image):
        self.y = y
        self.kernel = kernel
        self.strides = strides
        self.dilations = dilations
        self.out = out
        self.pads = pads
        self.spec = spec
        self.cols_per_image = cols_per_image


_ACTIVATIONS = ("Relu", "Tanh", "Sigmoid", "LeakyRelu", "Clip", "HardSigmoid")
# FusedConv's activation_params, with onnxruntime's defaults (MLAS activation parameters)
_ACT_DEFAULTS = {"LeakyRelu": [0.01], "Clip": [-np.inf, np.inf], "HardSigmoid": [0.2, 0.5]}


def activation_step(name: str | None, params: list[float]) -> tuple[str, Any]:
    """FusedConv's activation as (CUDA statement on ``W v``, numpy function of v)."""
    if name is None:
        return "", lambda v: v
    p = (params + _ACT_DEFAULTS.get(name, [])[len(params) :])[: len(_ACT_DEFAULTS.get(name, []))]
    if name == "Clip":
        lo, hi = p
        parts = ([f"v = v < W({lo!r}) ? W({lo!r}) : v;"] if lo > -np.inf else []) + (
            [f"v = v > W({hi!r}) ? W({hi!r}) : v;"] if hi < np.inf else []
        )
        return " ".join(parts), lambda v: np.minimum(np.maximum(v, lo), hi)
    expr, twin, names = UNARY_FLOAT[name]
    for n, value in zip(names, p):
        expr = expr.replace(f"W({n})", f"W({value!r})")
    return f"v = {expr};", lambda v: twin(v, *p)


_EPILOGUE_SRC = r"""
typedef @T@ T;
typedef ox_wide_t<T>::type W;
typedef @I@ I;
struct __align__(@ALIGN@) OxVec { T v[@V@]; };
extern "C" __global__ void ox_conv_epilogue(T* __restrict__ y, const T* __restrict__ b,
                                            const T* __restrict__ z, const I nvec,
                                            const I inner, const I channels) {
  for (I u = (I)blockIdx.x * blockDim.x + threadIdx.x; u < nvec;
       u += (I)gridDim.x * blockDim.x) {
    OxVec yv = reinterpret_cast<const OxVec*>(y)[u];
    OxVec zv;
    if (@HAS_Z@) zv = reinterpret_cast<const OxVec*>(z)[u];
    // the channel of the vector's first element: a vector never straddles a channel in
    // NCHW (inner % V == 0) and spans V consecutive channels in NHWC (channels % V == 0)
    const I c0 = (u * @V@ / inner) % channels;
    #pragma unroll
    for (int k = 0; k < @V@; ++k) {
      W v = W(yv.v[k]);
      if (@HAS_B@) v += W(b[@CL@ ? c0 + k : c0]);
      if (@HAS_Z@) v += W(zv.v[k]);
      @STEP@
      yv.v[k] = T(v);
    }
    reinterpret_cast<OxVec*>(y)[u] = yv;
  }
}
"""
_EPILOGUE_C = {"float16": "__half", "float32": "float", "float64": "double"}
_EPILOGUE_THREADS = 256


class ConvEpilogue:
    """What follows a convolution, one kernel in place on its output ``y``:
    ``y = act(y + b + z)`` computed in float32 (float64 for double) and rounded once; ``b`` is
    per channel, ``z`` (FusedConv's residual) has y's shape. ``y`` is dense NCHW (channels at
    dim 1) or, ``channels_last``, dense NHWC. Each thread moves 16 bytes of y (and z) where the
    channel planes (NCHW) or channel rows (NHWC) divide into 16-byte vectors, one element
    otherwise; the channel index is computed once per vector, not per element and dim as in a
    broadcasting elementwise kernel. Compiled on first use per (activation, dtype, operands,
    vector width, index width, device)."""

    def __init__(self, bias: bool, residual: bool, act: str | None, params: list[float]):
        self.bias, self.residual = bias, residual
        self.step, self._act = activation_step(act, params)
        self._modules: dict[tuple, _RowModule] = {}

    def twin(self, b: Any, z: Any, y: np.ndarray, channels_last: bool) -> None:
        v = widen(y)
        if b is not None:
            shape = (-1,) if channels_last else (-1,) + (1,) * (y.ndim - 2)
            v = v + widen(b).reshape(shape)
        if z is not None:
            v = v + widen(z)
        with np.errstate(all="ignore"):
            np.copyto(y, self._act(v), casting="unsafe")

    def __call__(self, xp: Any, b: Any, z: Any, y: Any, channels_last: bool = False) -> None:
        if xp is np:
            self.twin(b, z, y, channels_last)
            return
        if z is not None and not z.flags.c_contiguous:
            z = xp.ascontiguousarray(z)
        if b is not None and not b.flags.c_contiguous:
            b = xp.ascontiguousarray(b)
        aligned = not any(a is not None and a.data.ptr % 16 for a in (y, z))
        channels, inner, vec, wide = _epilogue_layout(y.shape, y.itemsize, channels_last, aligned)
        nvec = y.size // vec
        fn = self._function(xp, y.dtype.name, vec, channels_last, wide)
        idx = np.int64 if wide else np.int32
        blocks = min((nvec + _EPILOGUE_THREADS - 1) // _EPILOGUE_THREADS, 65535 * 8)
        fn(
            (blocks,),
            (_EPILOGUE_THREADS,),
            (y, b if b is not None else y, z if z is not None else y, idx(nvec), idx(inner),
             idx(channels)),
        )  # fmt: skip

    def source(self, dtype: str, vec: int, channels_last: bool, wide: bool) -> str:
        subs = {
            "@T@": _EPILOGUE_C[dtype],
            "@I@": "long long" if wide else "int",
            "@ALIGN@": str(vec * np.dtype(dtype).itemsize),
            "@V@": str(vec),
            "@HAS_B@": "true" if self.bias else "false",
            "@HAS_Z@": "true" if self.residual else "false",
            "@CL@": "true" if channels_last else "false",
            "@STEP@": self.step,
        }
        src = _EPILOGUE_SRC
        for k, v in subs.items():
            src = src.replace(k, v)
        return "#include <cuda_fp16.h>\n" + WIDE_PRE + MATH_PRE + src

    def _module(self, dtype: str, vec: int, channels_last: bool, wide: bool) -> _RowModule:
        key = (dtype, vec, channels_last, wide)
        mod = self._modules.get(key)
        if mod is None:
            src = self.source(dtype, vec, channels_last, wide)
            mod = self._modules.setdefault(key, _RowModule(src))
        return mod

    def _function(self, xp: Any, dtype: str, vec: int, channels_last: bool, wide: bool) -> Any:
        return self._module(dtype, vec, channels_last, wide).function(xp, "ox_conv_epilogue")

    def precompile(
        self, kernel: Any, dtype: str, shape: tuple[int, ...], channels_last: bool
    ) -> None:
        """Queue the compile a call on an output of ``shape`` will ask for (tensors from the
        provider's allocator are 16-byte aligned), for ``kernel``'s ``warm_up``."""
        itemsize = np.dtype(dtype).itemsize
        _, _, vec, wide = _epilogue_layout(shape, itemsize, channels_last, True)
        self._module(dtype, vec, channels_last, wide).precompile(kernel, "ox_conv_epilogue")


def _epilogue_layout(
    shape: tuple[int, ...], itemsize: int, channels_last: bool, aligned: bool
) -> tuple[int, int, int, bool]:
    """(channels, elements per channel run, vector width, 64-bit indices) of an epilogue over
    an output of ``shape``: 16-byte vectors where the channel runs and the pointers allow."""
    size = int(np.prod(shape))
    channels = shape[-1] if channels_last else shape[1]
    inner = 1 if channels_last else size // (shape[0] * channels)
    vec = 16 // itemsize
    if (channels if channels_last else inner) % vec or not aligned:
        vec = 1
    return channels, inner, vec, size >= 2**31


_EPILOGUES: dict[tuple, ConvEpilogue] = {}


def epilogue(bias: bool, residual: bool, act: str | None, params: list[float]) -> ConvEpilogue:
    """The shared ``ConvEpilogue`` for these operands and activation."""
    key = (bias, residual, act, tuple(params))
    k = _EPILOGUES.get(key)
    if k is None:
        k = _EPILOGUES[key] = ConvEpilogue(bias, residual, act, params)
    return k


def _shipped_epilogues() -> list[tuple[str, Callable[[], str]]]:
    """The epilogues of a convolution with bias, with or without a residual and ReLU (the
    fusions of CNNs), in float32 and float16, both layouts, 16-byte vectors or none."""
    out = []
    for residual, act in itertools.product((False, True), (None, "Relu")):
        k = epilogue(True, residual, act, [])
        for dtype, channels_last in itertools.product(("float32", "float16"), (False, True)):
            for vec in (1, 16 // np.dtype(dtype).itemsize):
                module = k._module(dtype, vec, channels_last, False)
                out.append(module.kernel("ox_conv_epilogue"))
    return out


ship(_shipped_epilogues)


class _ConvBase(CudaKernel):
    transpose = False
    channels_last = False  # X, Z and Y are NHWC (the com.ms.internal.nhwc ops)

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.group = int(info.attr("group", 1))
        self.auto_pad = info.attr("auto_pad", "NOTSET")
        if isinstance(self.auto_pad, bytes):
            self.auto_pad = self.auto_pad.decode()
        self.kernel_shape = info.attr("kernel_shape")
        self.strides = info.attr("strides")
        self.dilations = info.attr("dilations")
        self.pads = info.attr("pads")
        self.dtype = info.input_dtype(0)
        self.gemm = blas.engine_for(self.ep)
        self.dnn = dnn.engine_for(self.ep)
        act = info.attr("activation")
        if isinstance(act, bytes):
            act = act.decode()
        self.activation = act or None
        self.activation_params = [float(v) for v in (info.attr("activation_params") or [])]
        # onnxruntime's fuse_conv_bias: bias, Z and ReLU in cuDNN's (run-time compiled) graph
        self.fuse = bool(self.ep.options.fuse_conv_bias)
        self._geo: dict[tuple, _Geometry] = {}
        self.last_path = ""  # "cudnn" or "fallback": the path the last call took (for tests)

    def warm_up(self) -> None:
        if self.dnn is None:
            return
        self.dnn.warm_up(self)
        info = self.info
        residual = self.activation is not None and info.input_count > 3 and info.has_input(3)
        if self.fuse or not residual or self.xp is np or self.dtype.name not in _EPILOGUE_C:
            return
        # the epilogue after the plain graph (bias, residual, activation: one kernel), where
        # the graph's types fix the shapes (ResNet-50's first run compiled it, 87 ms on an
        # H100 host, between two cuDNN builds)
        xs, ws = info.input_shape(0), info.input_shape(1)
        if xs is None or ws is None or not all(type(d) is int for d in (*xs, *ws)):
            return
        bias = info.input_count > 2 and info.has_input(2)
        shapes = (tuple(xs), tuple(ws))
        geo = self._geo[shapes] = self.geometry(*shapes)  # type: ignore[arg-type]  # (the run's)
        if geo.spec is not None and 0 not in geo.y:
            self._epilogue(bias, True).precompile(self, self.dtype.name, geo.y, self.channels_last)

    @classmethod
    def claims(cls, node: Any, graph: Any) -> bool:
        act = node.attrs.get("activation")
        if isinstance(act, bytes):
            act = act.decode()
        return node.op_type != "FusedConv" or act in _ACTIVATIONS

    def geometry(self, xs: tuple[int, ...], ws: tuple[int, ...]) -> _Geometry:
        raise NotImplementedError

    def window(self, xs: tuple[int, ...], ws: tuple[int, ...]) -> tuple[list[int], ...]:
        """kernel, strides and dilations with their defaults, for input/weight shapes."""
        n = len(xs) - 2
        if n < 1 or len(ws) != len(xs):
            raise ValueError(
                f"{self.info.op_type}: input {xs} and weights {ws} have unsupported ranks"
            )
        kernel = list(self.kernel_shape or ws[2:])
        return kernel, list(self.strides or [1] * n), list(self.dilations or [1] * n)

    def compute(self, ctx: KernelContext) -> None:
        x, w, b = self.arg(ctx, 0), self.arg(ctx, 1), self.arg(ctx, 2)
        z = self.arg(ctx, 3) if self.activation is not None else None
        if b is not None and b.size == 0:
            b = None
        geo = self._geo.get((x.shape, w.shape))
        if geo is None:
            geo = self._geo[(x.shape, w.shape)] = self.geometry(x.shape, w.shape)
        y = self.alloc(ctx, 0, geo.y, self.dtype)
        if y.size == 0:
            return
        if self.dnn is not None and geo.spec is not None and x.size and w.size:
            if self.fuse:
                fused = dataclasses.replace(
                    geo.spec,
                    bias=b is not None,
                    residual=z is not None,
                    relu=self.activation == "Relu",
                )
                if self.dnn.run(ctx, fused, x, w, b, y, z):
                    self.last_path = "cudnn"
                    if self.activation not in (None, "Relu"):
                        self._epilogue(False, False)(self.xp, None, None, y, self.channels_last)
                    return
            elif (
                z is None
                and self.activation in (None, "Relu")
                and (b is not None or self.activation)
            ):
                # bias and ReLU where cuDNN has an engine for them that needs no compiling,
                # and it is not slower than the plain graph and the epilogue
                fused = dataclasses.replace(
                    geo.spec, bias=b is not None, relu=self.activation == "Relu", precompiled=True
                )
                if self.dnn.run(ctx, fused, x, w, b, y, None, plain=geo.spec):
                    self.last_path = "cudnn"
                    return
            if self.dnn.run(ctx, geo.spec, x, w, None, y, None):
                self.last_path = "cudnn"
                self._finish(b, z, y)
                return
        dnn.stats["fallback"] += 1
        self.last_path = "fallback"
        self.fallback(ctx, x, w, b, y, geo)  # adds the bias
        self._finish(None, z, y)

    def _epilogue(self, bias: bool, residual: bool) -> ConvEpilogue:
        return epilogue(bias, residual, self.activation, self.activation_params)

    def _finish(self, b: Any, z: Any, y: Any) -> None:
        """The bias, residual and activation on the convolution's output, one kernel."""
        if b is None and z is None and self.activation is None:
            return
        self._epilogue(b is not None, z is not None)(self.xp, b, z, y, self.channels_last)

    def fallback(self, ctx: Any, x: Any, w: Any, b: Any, y: Any, geo: _Geometry) -> None:
        raise NotImplementedError

    def prepare(self, ctx: KernelContext) -> Any:
        """The node's work (cuDNN's execute, whose Python call costs 30-80 µs, with its
        bias/residual/activation steps) captured once as a CUDA graph of its own: a later
        run is one graph launch."""
        stream = ctx.stream
        if self.xp is np or stream is None or not hasattr(stream, "capture_call"):
            return None
        if stream.capturing:
            return None  # inside a whole-run capture: the plain calls are recorded there
        self.compute(ctx)  # builds (and autotunes) the cuDNN graph, fills the frame's scratch
        if self.last_path != "cudnn":
            # the GEMM fallback's temporaries are values a node graph would keep for itself,
            # so a whole-run capture, which runs this node's calls again, could not have them
            return None
        return node_graph(self, ctx, lambda: self.compute(ctx))


class Conv(_ConvBase):
    def geometry(self, xs: tuple[int, ...], ws: tuple[int, ...]) -> _Geometry:
        n = len(xs) - 2
        kernel, strides, dilations = self.window(xs, ws)
        out, pads = shapes.window_geometry(
            xs[2:], kernel, strides, dilations, self.pads, self.auto_pad
        )
        N, C = xs[:2]
        M, G = ws[0], self.group
        if C != ws[1] * G or M % G:
            raise ValueError(f"Conv: input {xs}, weights {ws} and group {G} disagree")
        y = (N, M, *out)
        spec = dnn.ConvSpec(
            "fprop",
            np.dtype(self.dtype),
            tuple(xs),
            tuple(ws),
            y,
            tuple(pads[:n]),
            tuple(pads[n:]),
            tuple(strides),
            tuple(dilations),
        )
        return _Geometry(
            y, kernel, strides, dilations, out, pads, spec, C * math.prod(kernel) * math.prod(out)
        )

    def fallback(self, ctx: Any, x: Any, w: Any, b: Any, y: Any, geo: _Geometry) -> None:
        xp = self.xp
        N, C = x.shape[:2]
        M, G = w.shape[0], self.group
        n = len(geo.kernel)
        P = math.prod(geo.out)
        K = C // G * math.prod(geo.kernel)
        wg = w.reshape(G, M // G, K)
        y3 = y.reshape(N, G, M // G, P)
        pointwise = all(k == 1 for k in geo.kernel) and not any(geo.pads)
        step = max(1, _COLUMN_BUDGET // max(geo.cols_per_image, 1))
        for s in range(0, N, step):
            xs = x[s : s + step]
            m = xs.shape[0]
            if pointwise and all(v == 1 for v in geo.strides):
                cols = xs.reshape(m, G, K, P)
            elif pointwise:
                sub = xs[(slice(None), slice(None), *(slice(None, None, v) for v in geo.strides))]
                cols = xp.ascontiguousarray(sub).reshape(m, G, K, P)
            else:
                xpad = pad_spatial(xp, xs, geo.pads)
                st = xpad.strides
                view = _as_strided(
                    xp,
                    xpad,
                    xpad.shape[:2] + tuple(geo.kernel) + tuple(geo.out),
                    st[:2]
                    + tuple(st[2 + i] * geo.dilations[i] for i in range(n))
                    + tuple(st[2 + i] * geo.strides[i] for i in range(n)),
                )
                cols = xp.ascontiguousarray(view).reshape(m, G, K, P)
            self.gemm(ctx, wg, cols, y3[s : s + m], dtype=self.dtype)
        if b is not None:
            y += b.reshape((1, M) + (1,) * n)


def nchw_dims(shape: tuple[int, ...]) -> tuple[int, ...]:
    """(N, *spatial, C) -> (N, C, *spatial): an NHWC shape's NCHW dims (also OHWI -> OIHW)."""
    return (shape[0], shape[-1], *shape[1:-1])


def nhwc_dims(shape: tuple[int, ...]) -> tuple[int, ...]:
    """(N, C, *spatial) -> (N, *spatial, C)."""
    return (shape[0], *shape[2:], shape[1])


class NhwcConv(Conv):
    """``com.ms.internal.nhwc`` Conv and FusedConv: X, Z and Y are NHWC and W is
    (M, kH, kW, C/group), as the layout pass rewrites a 2-D convolution when the provider
    prefers NHWC (``prefer_nhwc``). cuDNN then runs its channels-last engines on the tensors as
    they are, with none of the NCHW<->NHWC transposes it adds around NCHW convolutions."""

    channels_last = True

    def geometry(self, xs: tuple[int, ...], ws: tuple[int, ...]) -> _Geometry:
        if len(xs) != 4 or len(ws) != 4:
            raise ValueError(
                f"{self.info.op_type} node '{self.info.name}' ({self.info.domain}): input "
                f"{list(xs)} and weights {list(ws)} must be 4-D (N, H, W, C) and (M, kH, kW, C)"
            )
        geo = super().geometry(nchw_dims(xs), nchw_dims(ws))
        if geo.spec is not None:
            geo.spec = dataclasses.replace(geo.spec, channels_last=True)
        geo.y = nhwc_dims(geo.y)
        return geo

    def fallback(self, ctx: Any, x: Any, w: Any, b: Any, y: Any, geo: _Geometry) -> None:
        """The NCHW fallback on channels-first views, through an NCHW buffer."""
        xp = self.xp
        first = (0, 3, 1, 2)
        tmp = xp.empty(nchw_dims(tuple(y.shape)), dtype=y.dtype)
        super().fallback(ctx, x.transpose(first), w.transpose(first), b, tmp, geo)
        y[...] = tmp.transpose(0, 2, 3, 1)


class ConvTranspose(_ConvBase):
    transpose = True

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.output_padding = info.attr("output_padding")
        self.output_shape = info.attr("output_shape")

    def geometry(self, xs: tuple[int, ...], ws: tuple[int, ...]) -> _Geometry:
        n = len(xs) - 2
        kernel, strides, dilations = self.window(xs, ws)
        out, pads = shapes.conv_transpose_geometry(
            xs[2:],
            kernel,
            strides,
            dilations,
            self.pads,
            self.auto_pad,
            self.output_padding,
            self.output_shape,
        )
        N, C = xs[:2]
        G = self.group
        if C != ws[0] or C % G:
            raise ValueError(f"ConvTranspose: input {xs}, weights {ws} and group {G} disagree")
        y = (N, ws[1] * G, *out)
        spec = None
        if list(kernel) == list(ws[2:]) and min(pads) >= 0:
            spec = dnn.ConvSpec(
                "dgrad",
                np.dtype(self.dtype),
                tuple(xs),
                tuple(ws),
                y,
                tuple(pads[:n]),
                tuple(pads[n:]),
                tuple(strides),
                tuple(dilations),
            )
        cols = ws[1] * G * math.prod(kernel) * math.prod(xs[2:])
        return _Geometry(y, kernel, strides, dilations, out, pads, spec, cols)

    def fallback(self, ctx: Any, x: Any, w: Any, b: Any, y: Any, geo: _Geometry) -> None:
        xp = self.xp
        N, C = x.shape[:2]
        G = self.group
        Mg = w.shape[1]
        n = len(geo.kernel)
        in_sp = x.shape[2:]
        S = math.prod(in_sp)
        kernel, strides, dilations, pads, out_sp = (
            geo.kernel,
            geo.strides,
            geo.dilations,
            geo.pads,
            geo.out,
        )
        # columns[n, g, (m, k), i] = sum_c w[g, c, (m, k)] * x[n, g, c, i]
        wg = w.reshape(G, C // G, Mg * math.prod(kernel))
        full = [
            s * (i - 1) + (k - 1) * d + 1 for s, i, k, d in zip(strides, in_sp, kernel, dilations)
        ]
        lo = [min(0, pads[i]) for i in range(n)]
        size = [max(full[i], pads[i] + out_sp[i]) - lo[i] for i in range(n)]
        wide = blas.is_half(self.dtype)
        acc_dtype = xp.float32 if wide else y.dtype
        crop = tuple(slice(pads[i] - lo[i], pads[i] - lo[i] + out_sp[i]) for i in range(n))
        step = max(1, _COLUMN_BUDGET // max(geo.cols_per_image, 1))
        for s in range(0, N, step):
            xs = x[s : s + step]
            m = xs.shape[0]
            cols = xp.empty((m, G, Mg * math.prod(kernel), S), dtype=acc_dtype)
            x4 = xs.reshape(m, G, C // G, S)
            if wide:
                # float16 columns are accumulated in float32: the GEMM runs on widened operands
                x4, wf = blas.widen(xp, x4, self.dtype), blas.widen(xp, wg, self.dtype)
                self.gemm(ctx, wf, x4, cols, trans_a=True, dtype=np.float32)
            else:
                self.gemm(ctx, wg, x4, cols, trans_a=True, dtype=self.dtype)
            cols = cols.reshape(m, G * Mg, *kernel, *in_sp)
            acc = xp.zeros((m, G * Mg, *size), dtype=acc_dtype)
            for tap in itertools.product(*(range(k) for k in kernel)):
                dst = tuple(
                    slice(t * d - l, t * d - l + (i - 1) * st + 1, st)
                    for t, d, l, i, st in zip(tap, dilations, lo, in_sp, strides)
                )
                acc[(slice(None), slice(None), *dst)] += cols[(slice(None), slice(None), *tap)]
            res = acc[(slice(None), slice(None), *crop)]
            if b is not None:
                res = res + blas.widen(xp, b, self.dtype).reshape((1, -1) + (1,) * n)
            blas.store(xp, res, y[s : s + m], self.dtype)


def register(reg: KernelRegistry, enable_cudnn: bool) -> None:
    # Registered with enable_cudnn=0 too: the GEMM fallback then does the work.
    reg.kernel("Conv", since=1, types={"T": CONV_TYPES})(Conv)
    reg.kernel("ConvTranspose", since=1, types={"T": CONV_TYPES})(ConvTranspose)
    reg.kernel("FusedConv", domain="com.microsoft", since=1, types={0: CONV_TYPES})(Conv)
    nhwc = dtypes("float16", "float32")
    reg.kernel("Conv", domain=NHWC_DOMAIN, since=1, types={"T": nhwc})(NhwcConv)
    reg.kernel("FusedConv", domain=NHWC_DOMAIN, since=1, types={0: nhwc})(NhwcConv)
