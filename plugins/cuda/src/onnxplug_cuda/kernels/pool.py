"""Pooling: MaxPool (with Indices), AveragePool, LpPool, GlobalAveragePool, GlobalMaxPool,
GlobalLpPool.

On the GPU, each windowed pool is one NVRTC kernel launched with its parameters bound once
(``launch.Launch``): a thread per output element walks its window with bounds checks. 1-D and
2-D pools run as 3-D pools with unit leading dims. There is no padded copy, no temporaries, and
float16 is accumulated in float32. Global average and max pools are one kernel too (a thread per
output walking its spatial positions; beyond 4096 positions per output, CuPy's reduction). The
prepared and the unprepared run launch the same kernel, so eager runs and replayed CUDA graphs
agree bit for bit. Under the host simulation
the numpy twin pads the input with the reduction's identity and reduces one kernel tap at a time
over strided views. It is the same algorithm as the CPU provider.

Semantics, as in ONNX:
* Windows follow ``shapes.window_geometry`` (auto_pad, ceil_mode, dilations). With ceil_mode, a
  window is dropped when it would start in the end padding.
* AveragePool divides by the number of taps inside the input, or inside the explicitly padded
  input with ``count_include_pad``. Taps in the ceil_mode overhang never count.
* MaxPool's Indices are flat indices over the whole input, N and C included. Over the spatial
  dims they are row-major, or column-major with ``storage_order=1``. Ties go to the first tap in
  row-major window order.
* LpPool is ``(sum |x|^p)^(1/p)`` over the taps inside the input.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from onnxplug.ep import NHWC_DOMAIN, KernelContext, KernelInfo, KernelRegistry, dtypes, shapes

from ..compiler import compiled_function, ship
from ..launch import function_launch
from ._base import CudaKernel
from .conv import nchw_dims, nhwc_dims, pad_spatial

POOL_TYPES = dtypes("float16", "float32", "float64")

# ---------------------------------------------------------------------------------------------
# the CUDA kernel's loop, one per mode and accumulator type

_LOOP = r"""
long long t = i;
// CH > 1: channels-last (N, D, H, W, CH) tensors; CH == 1: (N*C, D, H, W)
const int ch = (int)(t % CH); t /= CH;
const int ow = (int)(t % OW); t /= OW;
const int oh = (int)(t % OH); t /= OH;
const int od = (int)(t % OD); t /= OD;
const long long base = t * ((long long)D * H * W * CH) + ch;
ACC acc = 0;
ACC best = 0;
long long where = -1;
int count = 0;
for (int a = 0; a < KD; ++a) {
  const int id = od * SD - PD0 + a * DD;
  const bool d_in = id >= 0 && id < D;
  const bool d_pad = id >= -PD0 && id < D + PD1;
  for (int b = 0; b < KH; ++b) {
    const int ih = oh * SH - PH0 + b * DH;
    const bool h_in = ih >= 0 && ih < H;
    const bool h_pad = ih >= -PH0 && ih < H + PH1;
    for (int c = 0; c < KW; ++c) {
      const int iw = ow * SW - PW0 + c * DW;
      const bool inside = d_in && h_in && iw >= 0 && iw < W;
      BODY
    }
  }
}
TAIL
"""

_MODES = {
    # FLAG = storage_order (column-major indices over the spatial dims)
    "max": (
        "T y, int64 idx",
        r"""
      if (inside) {
        const long long off = ((long long)id * H + ih) * W + iw;
        const ACC v = (ACC)x[base + off * CH];
        if (where < 0 || v > best || (v != v && best == best)) {
          best = v;
          where = FLAG ? (id + (long long)D * (ih + (long long)H * iw)) : off;
        }
      }""",
        "y = (T)(where < 0 ? (ACC)(-CUDART_INF) : best);\nidx = base + where;",
    ),
    "max_values": (
        "T y",
        r"""
      if (inside) {
        const ACC v = (ACC)x[base + (((long long)id * H + ih) * W + iw) * CH];
        if (where < 0 || v > best || (v != v && best == best)) {
          best = v;
          where = 0;
        }
      }""",
        "y = (T)(where < 0 ? (ACC)(-CUDART_INF) : best);",
    ),
    # FLAG = count_include_pad
    "avg": (
        "T y",
        r"""
      if (inside) {
        acc += (ACC)x[base + (((long long)id * H + ih) * W + iw) * CH];
        if (!FLAG) ++count;
      }
      if (FLAG && d_pad && h_pad && iw >= -PW0 && iw < W + PW1) ++count;""",
        "y = (T)(acc / (ACC)count);",
    ),
    "lp": (
        "T y",
        r"""
      if (inside) {
        const ACC v = (ACC)x[base + (((long long)id * H + ih) * W + iw) * CH];
        acc += pow(v < 0 ? -v : v, (ACC)P);
      }""",
        "y = (T)pow(acc, (ACC)1 / (ACC)P);",
    ),
}

# The loop as a raw kernel (``_Pool.prepare``): its launch is bound once (``launch.Launch``);
# the CuPy ElementwiseKernel it replaced parsed its 26 arguments on every call (MaxPool took
# 80-110 us of host time per eager ResNet-50 run on an H100 host).
_RAW_POOL = r"""
#include <cuda_fp16.h>
typedef ELEM T;
extern "C" __global__ void NAME(const T* __restrict__ x, int D, int H, int W, int OD, int OH,
    int OW, int KD, int KH, int KW, int SD, int SH, int SW, int DD, int DH, int DW, int PD0,
    int PH0, int PW0, int PD1, int PH1, int PW1, int FLAG, double P, int CH,
    T* __restrict__ _y, long long* __restrict__ _idx, long long n) {
  const ACC OX_INF = (ACC)__int_as_float(0x7f800000);
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x) {
    T& y = _y[i];
    long long dummy;
    long long& idx = _idx ? _idx[i] : dummy;
    LOOP
  }
}
"""
_RAW_TYPES = {np.dtype(np.float16): "__half", np.dtype(np.float32): "float",
              np.dtype(np.float64): "double"}  # fmt: skip


def _raw_pool_kernel(mode: str, dtype: np.dtype) -> tuple[str, Callable[[], str]]:
    """(name, source) of the pooling kernel for ``mode`` and ``dtype``."""
    name = f"oxp_{mode}pool_{dtype.name}"

    def source() -> str:
        outs, body, tail = _MODES[mode]
        loop = _LOOP.replace("BODY", body).replace("TAIL", tail)
        src = _RAW_POOL.replace("LOOP", loop).replace("ELEM", _RAW_TYPES[dtype])
        acc = "double" if dtype == np.float64 else "float"
        return src.replace("ACC", acc).replace("NAME", name).replace("CUDART_INF", "OX_INF")

    return name, source


def _taps(kernel, strides, dilations, out_spatial):
    """For every kernel tap (row-major), the spatial slices it reads for all outputs."""
    for tap in itertools.product(*(range(k) for k in kernel)):
        yield tuple(
            slice(t * d, t * d + (o - 1) * s + 1, s)
            for t, d, s, o in zip(tap, dilations, strides, out_spatial)
        )


# ---------------------------------------------------------------------------------------------


class _Pool(CudaKernel):
    mode = ""
    channels_last = False  # X and Y are NHWC (the com.ms.internal.nhwc ops)

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.kernel = [int(k) for k in info.attr("kernel_shape")]
        n = len(self.kernel)
        self.strides = [int(s) for s in (info.attr("strides") or [1] * n)]
        self.dilations = [int(d) for d in (info.attr("dilations") or [1] * n)]
        self.pads = info.attr("pads")
        ap = info.attr("auto_pad", "NOTSET")
        self.auto_pad = ap.decode() if isinstance(ap, bytes) else ap
        self.ceil_mode = bool(info.attr("ceil_mode", 0))
        self.dtype = np.dtype(info.input_dtype(0))
        self.flag = 0
        self.p = 2.0
        self._geo: dict[tuple, tuple] = {}
        # more than 3 spatial dims take a path that uploads host tables per call
        self.graph_capturable = n <= 3

    def warm_up(self) -> None:
        if self.dtype in _RAW_TYPES and len(self.kernel) <= 3:
            mode = "max_values" if self.mode == "max" and not self.info.has_output(1) else self.mode
            self.precompile(*_raw_pool_kernel(mode, self.dtype))

    def geometry(self, shape: tuple[int, ...]) -> tuple:
        """(output shape, pads, pads extended at the end so every window fits, kernel args)."""
        geo = self._geo.get(shape)
        if geo is not None:
            return geo
        out, pads = shapes.window_geometry(
            shape[2:],
            self.kernel,
            self.strides,
            self.dilations,
            self.pads,
            self.auto_pad,
            self.ceil_mode,
        )
        n = len(out)
        ext = list(pads)
        for i in range(n):
            need = (out[i] - 1) * self.strides[i] + (self.kernel[i] - 1) * self.dilations[i] + 1
            ext[n + i] = max(pads[n + i], need - shape[2 + i] - pads[i])
        lead = 3 - n
        if lead < 0:
            args = None  # more than 3 spatial dims: the tap loop runs on the GPU too
        else:

            def three(v: list[int], fill: int) -> list[int]:
                return [fill] * lead + list(v)

            args = (
                *three(list(shape[2:]), 1),
                *three(out, 1),
                *three(self.kernel, 1),
                *three(self.strides, 1),
                *three(self.dilations, 1),
                *three(pads[:n], 0),
                *three(pads[n:], 0),
            )
        geo = self._geo[shape] = ((*shape[:2], *out), out, pads, ext, args)
        return geo

    def compute(self, ctx: KernelContext) -> None:
        run = self.prepare(ctx)  # the GPU kernel, the same whether prepared or not
        if run is not None:
            run()
            return
        x = self.arg(ctx, 0)
        cl = self.channels_last
        if cl and x.ndim != 4:
            raise ValueError(
                f"{self.info.op_type} node '{self.info.name}' ({self.info.domain}): input "
                f"{list(x.shape)} must be 4-D (N, H, W, C)"
            )
        yshape, out, pads, ext, args = self.geometry(nchw_dims(x.shape) if cl else x.shape)
        y = self.alloc(ctx, 0, nhwc_dims(yshape) if cl else yshape, self.dtype)
        want_idx = self.mode == "max" and ctx.has_output(1)
        idx = self.alloc(ctx, 1, yshape, np.int64) if want_idx else None
        if y.size == 0:
            return
        if cl:  # the NCHW algorithm on channels-first views
            x, y = x.transpose(0, 3, 1, 2), y.transpose(0, 3, 1, 2)
        self.host(x, y, idx, out, pads, ext)

    def prepare(self, ctx: KernelContext) -> Any:
        """The GPU loop as one bound launch; None under the simulation, beyond 3 spatial dims,
        for a non-contiguous input or a channels-last input that is not 4-D (``compute``
        takes those: numpy's or CuPy's tap-by-tap algorithm, or the error)."""
        if self.xp is np:
            return None
        x = self.arg(ctx, 0)
        cl = self.channels_last
        if (cl and x.ndim != 4) or not x.flags.c_contiguous:
            return None
        yshape, out, pads, ext, args = self.geometry(nchw_dims(x.shape) if cl else x.shape)
        if args is None:
            return None
        y = self.alloc(ctx, 0, nhwc_dims(yshape) if cl else yshape, self.dtype)
        want_idx = self.mode == "max" and ctx.has_output(1)
        idx = self.alloc(ctx, 1, yshape, np.int64) if want_idx else None
        if y.size == 0:
            return lambda: None
        mode = "max_values" if self.mode == "max" and idx is None else self.mode
        fn = compiled_function(self.xp, *_raw_pool_kernel(mode, self.dtype))
        i32 = [np.int32(a) for a in args]
        ch = np.int32(x.shape[-1] if cl else 1)
        params = (x, *i32, np.int32(self.flag), np.float64(self.p), ch, y, idx, np.int64(y.size))
        blocks = min((y.size + 255) // 256, 65535 * 8)
        return function_launch(fn, (blocks,), (256,), params, self.stream_handle(ctx))

    def host(self, x: Any, y: Any, idx: Any, out: list[int], pads: list[int], ext: list[int]):
        raise NotImplementedError


class MaxPool(_Pool):
    mode = "max"

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.flag = int(info.attr("storage_order", 0))

    def host(self, x, y, idx, out, pads, ext):
        xp = self.xp
        low = -np.inf
        xpad = pad_spatial(xp, x, ext, low)
        taps = list(_taps(self.kernel, self.strides, self.dilations, out))
        lead = (slice(None), slice(None))
        y[...] = xpad[lead + taps[0]]
        best = xp.zeros(y.shape, dtype=xp.int64) if idx is not None else None
        for t, sl in enumerate(taps[1:], 1):
            v = xpad[lead + sl]
            if best is not None:
                best[v > y] = t
            xp.maximum(y, v, out=y)
        if idx is not None:
            idx[...] = self.indices(xp, x.shape, out, pads, best)

    def indices(self, xp, shape, out, pads, best):
        """Flat input index of each output's max (row-major, or column-major over the spatial
        dims with storage_order=1), counting N and C."""
        sp = shape[2:]
        n = len(sp)
        taps = xp.asarray(np.array(list(np.ndindex(*self.kernel)), dtype=np.int64))  # (T, n)
        flat = xp.zeros(best.shape, dtype=xp.int64)
        order = list(range(n)) if self.flag == 0 else list(reversed(range(n)))
        stride = 1
        for i in reversed(order):
            o = xp.arange(out[i], dtype=xp.int64).reshape((-1,) + (1,) * (n - 1 - i))
            start = xp.subtract(xp.multiply(o, self.strides[i]), pads[i])
            flat += xp.multiply(start + xp.multiply(taps[best, i], self.dilations[i]), stride)
            stride *= sp[i]
        nc = xp.arange(shape[0] * shape[1], dtype=xp.int64).reshape(shape[0], shape[1], *([1] * n))
        return flat + xp.multiply(nc, math.prod(sp))


class AveragePool(_Pool):
    mode = "avg"

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.flag = int(info.attr("count_include_pad", 0))

    def host(self, x, y, idx, out, pads, ext):
        xp = self.xp
        xpad = pad_spatial(xp, _wide(xp, x), ext, 0)
        acc = _tap_sum(xp, xpad, self.kernel, self.strides, self.dilations, out)
        acc /= xp.asarray(self.counts(x.shape, out, pads), dtype=acc.dtype)
        y[...] = acc

    def counts(self, x_shape, out, pads) -> np.ndarray:
        """Taps of each output's window inside the input (or inside the explicitly padded input
        with count_include_pad), as a broadcastable array; separable per dim."""
        n = len(out)
        total = np.ones((1,) * n)
        for i in range(n):
            start = np.arange(out[i]) * self.strides[i] - pads[i]
            pos = start[:, None] + np.arange(self.kernel[i]) * self.dilations[i]
            if self.flag:
                lo, hi = -pads[i], x_shape[2 + i] + pads[n + i]
            else:
                lo, hi = 0, x_shape[2 + i]
            c = ((pos >= lo) & (pos < hi)).sum(axis=1)
            total = total * c.reshape([-1 if j == i else 1 for j in range(n)])
        return total


class LpPool(_Pool):
    mode = "lp"

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.p = float(info.attr("p", 2))

    def host(self, x, y, idx, out, pads, ext):
        xp = self.xp
        xpad = pad_spatial(xp, _power(xp, xp.abs(_wide(xp, x)), self.p), ext, 0)
        acc = _tap_sum(xp, xpad, self.kernel, self.strides, self.dilations, out)
        y[...] = _power(xp, acc, 1.0 / self.p)


def _power(xp: Any, a: Any, p: float) -> Any:
    """``a ** p`` as CuPy's operator computes it (its square and sqrt fast paths), through
    its ufuncs: the operator with a Python float goes through numpy's dispatch, which makes
    CuPy import cupyx (see kernels/__init__.py)."""
    if p == 2.0:
        return xp.square(a)
    if p == 0.5:
        return xp.sqrt(a)
    return xp.power(a, p)


def _wide(xp: Any, x: Any) -> Any:
    return x.astype(xp.float32) if x.dtype == np.float16 else x


def _tap_sum(xp, xpad, kernel, strides, dilations, out):
    lead = (slice(None), slice(None))
    taps = _taps(kernel, strides, dilations, out)
    acc = xpad[lead + next(taps)].copy()
    for sl in taps:
        acc += xpad[lead + sl]
    return acc


# ---------------------------------------------------------------------------------------------
# global pools


class _GlobalPool(CudaKernel):
    channels_last = False  # X and Y are NHWC (the com.ms.internal.nhwc ops)

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.dtype = np.dtype(info.input_dtype(0))
        self.p = float(info.attr("p", 2))

    def compute(self, ctx: KernelContext) -> None:
        run = self.prepare(ctx)  # one summation order, prepared or not (graphs == eager)
        if run is not None:
            run()
            return
        x = self.arg(ctx, 0)
        ones = (1,) * (x.ndim - 2)
        if self.channels_last:  # (N, *spatial, C): reduce (N, S, C) over S
            N, C = x.shape[0], x.shape[-1]
            y = self.alloc(ctx, 0, (N, *ones, C), self.dtype)
            if y.size:
                self.reduce(x.reshape(N, -1, C), y.reshape(N, C))
            return
        N, C = x.shape[:2]
        y = self.alloc(ctx, 0, (N, C) + ones, self.dtype)
        if y.size == 0:
            return
        self.reduce(x.reshape(N * C, -1), y.reshape(N * C))

    def reduce(self, xr: Any, yr: Any) -> None:
        """``yr`` = the reduction of ``xr`` over its axis 1."""
        raise NotImplementedError

    raw_mode = ""  # the prepared form's reduction ("avg", "max"; "" none)

    def warm_up(self) -> None:
        if self.raw_mode and self.dtype in _RAW_TYPES:
            self.precompile(*_global_pool_kernel(self.raw_mode, self.dtype))

    def prepare(self, ctx: KernelContext) -> Any:
        """One bound launch of ``_GLOBAL_POOL`` (a thread per output, walking its S inputs),
        where CuPy's mean/max parsed arguments and chose a reduction on every call (200 us of
        host time per eager ResNet-50 run on an H100 host, for a 3 us kernel). None for the
        simulation, bfloat16, an empty spatial extent, or more than 4096 inputs per output
        (a thread per output would be slow there: CuPy's reduction takes it)."""
        if self.xp is np or not self.raw_mode or self.dtype not in _RAW_TYPES:
            return None
        x = self.arg(ctx, 0)
        if not x.flags.c_contiguous:
            return None
        ones = (1,) * (x.ndim - 2)
        N, C = (x.shape[0], x.shape[-1]) if self.channels_last else x.shape[:2]
        S = x.size // (N * C) if N * C else 0
        if S == 0 or S > 4096:  # (and empty outputs) before any allocation: compute takes it
            return None
        if self.channels_last:  # (N, *spatial, C)
            y = self.alloc(ctx, 0, (N, *ones, C), self.dtype)
            steps = (S * C, C, 1)  # element strides of n, s, c
        else:
            y = self.alloc(ctx, 0, (N, C) + ones, self.dtype)
            steps = (C * S, 1, S)
        fn = compiled_function(self.xp, *_global_pool_kernel(self.raw_mode, self.dtype))
        params = (x, y, np.int64(C), np.int64(S), *(np.int64(v) for v in steps), np.int64(y.size))
        blocks = min((y.size + 255) // 256, 65535 * 8)
        return function_launch(fn, (blocks,), (256,), params, self.stream_handle(ctx))


class GlobalAveragePool(_GlobalPool):
    raw_mode = "avg"

    def reduce(self, x2, y1):
        xp = self.xp
        if self.dtype == np.float16:
            y1[...] = xp.mean(x2, axis=1, dtype=xp.float32)
        else:
            xp.mean(x2, axis=1, out=y1)


class GlobalMaxPool(_GlobalPool):
    raw_mode = "max"

    def reduce(self, x2, y1):
        self.xp.max(x2, axis=1, out=y1)


class GlobalLpPool(_GlobalPool):
    def reduce(self, x2, y1):
        xp = self.xp
        s = xp.sum(xp.abs(_wide(xp, x2)) ** self.p, axis=1)
        y1[...] = s ** (1.0 / self.p)


_GLOBAL_POOL = r"""
#include <cuda_fp16.h>
typedef ELEM T;
extern "C" __global__ void NAME(const T* __restrict__ x, T* __restrict__ y, long long C,
    long long S, long long sn, long long ss, long long sc, long long n) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x) {
    const T* p = x + (i / C) * sn + (i % C) * sc;
    ACC acc = (ACC)p[0];
    for (long long s = 1; s < S; ++s) {
      const ACC v = (ACC)p[s * ss];
      STEP
    }
    y[i] = (T)(FINAL);
  }
}
"""
# max: NaN wins (as CuPy's max and numpy's)
_GLOBAL_STEPS = {
    "avg": ("acc += v;", "acc / (ACC)S"),
    "max": ("if (v > acc || v != v) acc = (acc != acc) ? acc : v;", "acc"),
}


def _global_pool_kernel(mode: str, dtype: np.dtype) -> tuple[str, Callable[[], str]]:
    """(name, source) of the global pooling kernel for ``mode`` and ``dtype``."""
    name = f"oxp_global_{mode}pool_{dtype.name}"

    def source() -> str:
        step, final = _GLOBAL_STEPS[mode]
        src = _GLOBAL_POOL.replace("STEP", step).replace("FINAL", final)
        src = src.replace("ELEM", _RAW_TYPES[dtype]).replace("NAME", name)
        return src.replace("ACC", "double" if dtype == np.float64 else "float")

    return name, source


# every pooling kernel, windowed and global, for each float type
ship(lambda: [_raw_pool_kernel(m, dt) for m in _MODES for dt in _RAW_TYPES])
ship(lambda: [_global_pool_kernel(m, dt) for m in _GLOBAL_STEPS for dt in _RAW_TYPES])


# ``com.ms.internal.nhwc`` pools (the layout pass's channels-last rewrites of 2-D pools)


class NhwcMaxPool(MaxPool):
    channels_last = True

    @classmethod
    def claims(cls, node: Any, graph: Any) -> bool:
        return sum(1 for o in node.outputs if o) == 1  # no Indices: they are NCHW offsets


class NhwcAveragePool(AveragePool):
    channels_last = True


class NhwcGlobalAveragePool(GlobalAveragePool):
    channels_last = True


class NhwcGlobalMaxPool(GlobalMaxPool):
    channels_last = True


def register(reg: KernelRegistry, enable_cudnn: bool) -> None:
    t = {"T": POOL_TYPES}
    # MaxPool-8+ has the optional int64 Indices output (type I)
    reg.kernel("MaxPool", since=1, types=t)(MaxPool)
    reg.kernel("AveragePool", since=1, types=t)(AveragePool)
    reg.kernel("LpPool", since=1, types=t)(LpPool)
    reg.kernel("GlobalAveragePool", since=1, types=t)(GlobalAveragePool)
    reg.kernel("GlobalMaxPool", since=1, types=t)(GlobalMaxPool)
    reg.kernel("GlobalLpPool", since=1, types=t)(GlobalLpPool)
    nhwc = {"T": dtypes("float16", "float32")}
    reg.kernel("MaxPool", domain=NHWC_DOMAIN, since=1, types=nhwc)(NhwcMaxPool)
    reg.kernel("AveragePool", domain=NHWC_DOMAIN, since=1, types=nhwc)(NhwcAveragePool)
    reg.kernel("GlobalAveragePool", domain=NHWC_DOMAIN, since=1, types=nhwc)(NhwcGlobalAveragePool)
    reg.kernel("GlobalMaxPool", domain=NHWC_DOMAIN, since=1, types=nhwc)(NhwcGlobalMaxPool)
