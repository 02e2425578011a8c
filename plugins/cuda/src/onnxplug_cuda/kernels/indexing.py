"""Gathers, scatters and data-dependent selections on the CUDA device: Gather,
GatherElements, GatherND, ScatterND, ScatterElements (and the deprecated Scatter), NonZero,
Compress, OneHot and ReverseSequence.

ONNX allows negative indices (counted from the end of the axis): they are wrapped here with
``% dim`` (or ``+ dim`` in the custom kernels) before use; CuPy's ``take`` wraps them too.
Out-of-range indices are an error in ONNX and are not checked on the device (that would
need a host synchronisation per call).

Gather and GatherND are prepared as one raw gather kernel of ours (``_bind_gather``: the
data rows that index tuples name, moved in units of up to 16 bytes), so their steady state
and first run launch it instead of CuPy's ``take`` and ufuncs.

Two small CUDA kernels (CuPy ElementwiseKernels) cover what array calls do badly:

* ``GatherElements``/``ScatterElements``: one thread per index element computes the data
  offset from its own coordinates (``_ind.get()``) with the indexed axis replaced, instead of
  building and broadcasting one coordinate grid per dimension;
* scatter reductions (add/mul/max/min, opsets 16/18): an atomic read-modify-write per update,
  a compare-and-swap loop on the aligned 32- or 64-bit word holding the element, so every
  fixed-size type works (CUDA has native atomics for a few types only), and duplicates in
  the indices combine like ``numpy.ufunc.at``.

Under the host simulation (``xp`` is numpy) the same ops use numpy equivalents
(``take_along_axis``, ``ufunc.at`` on offsets computed the same way).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import numpy as np

from onnxplug.ep import KernelContext, KernelInfo, KernelRegistry, dtypes, shapes

from ..compiler import compiled_function, ship
from ..launch import _NOOP, _UNITS, function_launch
from ._base import ALL_FIXED, ALL_FIXED_BF16, BF16, NUMERIC, CudaKernel
from .tensor import CPU, INDEX

REDUCTIONS = ("none", "add", "mul", "max", "min")
_UFUNCS = {"add": np.add, "mul": np.multiply, "max": np.maximum, "min": np.minimum}

# ---------------------------------------------------------------------------------------------
# CUDA sources

_ATOMIC = r"""
template <typename T> struct onnxplug_op_add {
  __device__ static T f(const T& a, const T& b) { return a + b; }
};
template <typename T> struct onnxplug_op_mul {
  __device__ static T f(const T& a, const T& b) { return a * b; }
};
// max/min propagate a NaN update like numpy.maximum/minimum (b != b only for NaN)
template <typename T> struct onnxplug_op_max {
  __device__ static T f(const T& a, const T& b) { return (b > a || b != b) ? b : a; }
};
template <typename T> struct onnxplug_op_min {
  __device__ static T f(const T& a, const T& b) { return (b < a || b != b) ? b : a; }
};

template <bool B> struct onnxplug_wide {};

// *p = Op::f(*p, v) atomically: compare-and-swap on the 64-bit word of an 8-byte element.
template <typename Op, typename T>
__device__ void onnxplug_atomic_impl(T* p, T v, onnxplug_wide<true>) {
  unsigned long long* w = reinterpret_cast<unsigned long long*>(p);
  unsigned long long old = *w, assumed;
  do {
    assumed = old;
    T cur;
    memcpy(&cur, &assumed, sizeof(T));
    T nv = Op::f(cur, v);
    unsigned long long bits;
    memcpy(&bits, &nv, sizeof(T));
    old = atomicCAS(w, assumed, bits);
  } while (assumed != old);
}

// Elements of 1, 2 or 4 bytes: compare-and-swap on the aligned 32-bit word holding them
// (little endian: the element is the word's bits [shift, shift + 8 * sizeof(T))).
template <typename Op, typename T>
__device__ void onnxplug_atomic_impl(T* p, T v, onnxplug_wide<false>) {
  const size_t addr = reinterpret_cast<size_t>(p);
  unsigned int* w = reinterpret_cast<unsigned int*>(addr & ~static_cast<size_t>(3));
  const unsigned int shift = static_cast<unsigned int>(addr & 3) * 8u;
  const unsigned int mask = sizeof(T) == 4
      ? 0xffffffffu : ((1u << (8u * (sizeof(T) & 3u))) - 1u) << shift;
  unsigned int old = *w, assumed;
  do {
    assumed = old;
    unsigned int bits = (assumed & mask) >> shift;
    T cur;
    memcpy(&cur, &bits, sizeof(T));
    T nv = Op::f(cur, v);
    unsigned int nb = 0;
    memcpy(&nb, &nv, sizeof(T));
    old = atomicCAS(w, assumed, (assumed & ~mask) | ((nb << shift) & mask));
  } while (assumed != old);
}

template <typename Op, typename T>
__device__ void onnxplug_atomic(T* p, T v) {
  onnxplug_atomic_impl<Op>(p, v, onnxplug_wide<(sizeof(T) == 8)>());
}
"""

# Offset (in bytes) of the data element an index element addresses: its own coordinates
# (reduce_dims=False keeps them N-D) with the indexed axis replaced by the wrapped index.
_ELEMENT_OFFSET = r"""
const ptrdiff_t* pos = _ind.get();
const ptrdiff_t* st = DATA.strides();
ptrdiff_t v = static_cast<ptrdiff_t>(idx);
if (v < 0) v += dim;
ptrdiff_t off = 0;
for (int d = 0; d < decltype(_ind)::ndim; ++d) off += (d == axis ? v : pos[d]) * st[d];
"""

_UPDATE = {
    "none": "*p = u;",
    "add": "onnxplug_atomic<onnxplug_op_add<T> >(p, u);",
    "mul": "onnxplug_atomic<onnxplug_op_mul<T> >(p, u);",
    "max": "onnxplug_atomic<onnxplug_op_max<T> >(p, u);",
    "min": "onnxplug_atomic<onnxplug_op_min<T> >(p, u);",
}

_kernels: dict[str, Any] = {}


def _cupy_kernel(key: str, make: Any) -> Any:
    k = _kernels.get(key)
    if k is None:
        import cupy

        k = _kernels[key] = make(cupy)
    return k


def _gather_elements_kernel() -> Any:
    body = _ELEMENT_OFFSET.replace("DATA", "x") + (
        "y = *reinterpret_cast<const T*>(reinterpret_cast<const char*>(&x[0]) + off);"
    )
    return _cupy_kernel(
        "gather_elements",
        lambda cp: cp.ElementwiseKernel(
            "S idx, raw T x, int64 axis, int64 dim",
            "T y",
            body,
            "onnxplug_gather_elements",
            reduce_dims=False,
        ),
    )


def _scatter_elements_kernel(reduction: str) -> Any:
    body = _ELEMENT_OFFSET.replace("DATA", "y") + (
        "T* p = reinterpret_cast<T*>(reinterpret_cast<char*>(&y[0]) + off);\n" + _UPDATE[reduction]
    )
    return _cupy_kernel(
        f"scatter_elements_{reduction}",
        lambda cp: cp.ElementwiseKernel(
            "S idx, T u, int64 axis, int64 dim",
            "raw T y",
            body,
            f"onnxplug_scatter_elements_{reduction}",
            preamble=_ATOMIC,
            reduce_dims=False,
        ),
    )


def _scatter_flat_kernel(reduction: str) -> Any:
    body = "T* p = &y[off];\n" + _UPDATE[reduction]
    return _cupy_kernel(
        f"scatter_flat_{reduction}",
        lambda cp: cp.ElementwiseKernel(
            "int64 off, T u",
            "raw T y",
            body,
            f"onnxplug_scatter_flat_{reduction}",
            preamble=_ATOMIC,
        ),
    )


# ---------------------------------------------------------------------------------------------
# numpy equivalents (host simulation)


def _np_element_offsets(idx: np.ndarray, axis: int, data_shape: tuple[int, ...]) -> np.ndarray:
    """Flat offsets into a C-contiguous ``data_shape`` array of GatherElements' or
    ScatterElements' index elements (what ``_ELEMENT_OFFSET`` computes per thread)."""
    strides = [1] * len(data_shape)
    for d in range(len(data_shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * data_shape[d + 1]
    grids: list[np.ndarray] = list(np.indices(idx.shape, sparse=True))
    dim = data_shape[axis]
    grids[axis] = np.where(idx < 0, idx.astype(np.int64) + dim, idx)
    off = np.zeros(idx.shape, dtype=np.int64)
    for g, s in zip(grids, strides):
        off = off + g.astype(np.int64) * s
    return off


def _np_scatter(flat: np.ndarray, off: np.ndarray, upd: np.ndarray, reduction: str) -> None:
    if reduction == "none":
        flat[off.reshape(-1)] = upd.reshape(-1)
    else:
        _UFUNCS[reduction].at(flat, off.reshape(-1), upd.reshape(-1))


# ---------------------------------------------------------------------------------------------
# Gathers


class Gather(CudaKernel):
    """Gather along ``axis`` into the planned output (int32 or int64 indices, negative ones
    wrapped): prepared as one gather kernel (``_bind_gather``), else ``xp.take``."""

    first_run_prepared = True  # compute runs CuPy's kernels (see CudaKernel)

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.axis = int(info.attr("axis", 0))

    def warm_up(self) -> None:
        data = self.info.input_shape(0)
        if data is not None and -len(data) <= self.axis < len(data):
            _warm_gather(self, data[self.axis % len(data) + 1 :])

    def _shapes(self, ctx: KernelContext) -> tuple[int, tuple[int, ...]]:
        t, it = ctx.input(0), ctx.input(1)
        axis = shapes.normalize_axis(self.axis, t.ndim)
        return axis, t.shape[:axis] + it.shape + t.shape[axis + 1 :]

    def compute(self, ctx: KernelContext) -> None:
        t = ctx.input(0)
        axis, out_shape = self._shapes(ctx)
        y = self.alloc(ctx, 0, out_shape, t.dtype)
        if not y.size:
            return
        if not t.shape[axis]:
            raise IndexError(f"Gather: indices into an empty axis {axis} of {list(t.shape)}")
        self.xp.take(self.arg(ctx, 0), self.arg(ctx, 1), axis=axis, out=y)

    def prepare(self, ctx: KernelContext) -> Any:
        t, it = ctx.input(0), ctx.input(1)
        axis, out_shape = self._shapes(ctx)
        if self.xp is np or not t.shape[axis] or it.dtype not in _GATHER_INDEX:
            return None  # compute: numpy, or the error for an empty axis
        y = self.alloc(ctx, 0, out_shape, t.dtype)
        if not y.size:
            return _NOOP
        rows = shapes.size_of(it.shape)
        return _bind_gather(
            self,
            ctx,
            y,
            rows,
            0,
            t.shape[axis],
            (t.shape[axis],),
            shapes.size_of(t.shape[axis + 1 :]),
        )


class GatherElements(CudaKernel):
    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.axis = int(info.attr("axis", 0))

    def compute(self, ctx: KernelContext) -> None:
        t, it = ctx.input(0), ctx.input(1)
        if t.ndim != it.ndim or t.ndim == 0:
            raise ValueError(
                f"GatherElements: data {list(t.shape)} and indices {list(it.shape)} must have "
                "the same rank (at least 1)"
            )
        axis = shapes.normalize_axis(self.axis, t.ndim)
        y = self.alloc(ctx, 0, it.shape, t.dtype)
        if not y.size:
            return
        x, idx = self.arg(ctx, 0), self.arg(ctx, 1)
        if self.xp is np:
            # index dims smaller than the data's (outside the axis) read a corner of the data
            # (take_along_axis would broadcast them instead)
            corner = tuple(
                slice(None) if d == axis else slice(0, n) for d, n in enumerate(it.shape)
            )
            y[...] = np.take_along_axis(x[corner], idx, axis)
            return
        _gather_elements_kernel()(idx, x, axis, t.shape[axis], y)


class GatherND(CudaKernel):
    """GatherND (batch_dims from opset 12): each index tuple picks a row of the data viewed as
    (batch, rows of the indexed dims, inner); prepared as one gather kernel
    (``_bind_gather``), else the tuples become flat row indices and one ``take``."""

    first_run_prepared = True  # compute runs CuPy's kernels (see CudaKernel)

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.b = int(info.attr("batch_dims", 0))

    def warm_up(self) -> None:
        data, idx = self.info.input_shape(0), self.info.input_shape(1)
        if data is not None and idx and isinstance(idx[-1], int):
            if self.b + idx[-1] <= len(data) and idx[-1] <= _GATHER_MAX_K:
                _warm_gather(self, data[self.b + idx[-1] :])

    def _geometry(self, ctx: KernelContext) -> tuple[int, int, int, tuple[int, ...], int, tuple]:
        """(k, batch, rows, indexed dims, inner, output shape)."""
        t, it = ctx.input(0), ctx.input(1)
        b = self.b
        k = it.shape[-1] if it.ndim else 0
        if it.ndim < 1 or k > t.ndim - b or it.shape[:b] != t.shape[:b]:
            raise ValueError(
                f"GatherND: indices {list(it.shape)} do not fit data {list(t.shape)} with "
                f"batch_dims {b}"
            )
        inner_shape = t.shape[b + k :]
        out_shape = t.shape[:b] + it.shape[b:-1] + inner_shape
        batch = shapes.size_of(t.shape[:b])
        rows = shapes.size_of(it.shape[b:-1])
        return k, batch, rows, t.shape[b : b + k], shapes.size_of(inner_shape), out_shape

    def compute(self, ctx: KernelContext) -> None:
        t = ctx.input(0)
        k, batch, rows, dims, inner, out_shape = self._geometry(ctx)
        y = self.alloc(ctx, 0, out_shape, t.dtype)
        if not y.size:
            return
        xp = self.xp
        block = shapes.size_of(dims)
        lin = flat_rows(xp, self.arg(ctx, 1).reshape(batch * rows, k), dims)
        if batch > 1:
            starts = xp.multiply(xp.arange(batch, dtype=np.int64)[:, None], block)
            lin = lin.reshape(batch, rows) + starts
        x2 = self.arg(ctx, 0).reshape(batch * block, inner)
        xp.take(x2, lin.reshape(-1), axis=0, out=y.reshape(batch * rows, inner))

    def prepare(self, ctx: KernelContext) -> Any:
        t, it = ctx.input(0), ctx.input(1)
        k, batch, rows, dims, inner, out_shape = self._geometry(ctx)
        if self.xp is np or k > _GATHER_MAX_K or 0 in dims or it.dtype not in _GATHER_INDEX:
            return None  # compute: numpy, many indexed dims, or the error for an empty one
        y = self.alloc(ctx, 0, out_shape, t.dtype)
        if not y.size:
            return _NOOP
        return _bind_gather(self, ctx, y, rows, rows, shapes.size_of(dims), dims, inner)


# One kernel behind the prepared Gather and GatherND: output element i = (outer o, row j, inner
# unit c) reads the data row that index tuple (o * idx_outer + j) names, each index wrapped
# into its dim (as CuPy's take wraps), in units of up to 16 bytes where the rows allow.
_GATHER_MAX_K = 8
_GATHER_INDEX = (np.dtype(np.int32), np.dtype(np.int64))
_GATHER_SRC = r"""
struct OxGatherP {
  long long n, inner, rows, idx_outer, src_outer;
  int k;
  long long dims[@K@];
};
template <typename U, typename I>
__device__ void ox_gather(const U* __restrict__ x, const I* __restrict__ idx, U* __restrict__ y,
                          const OxGatherP& p) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < p.n;
       i += (long long)gridDim.x * blockDim.x) {
    const long long r = i / p.inner, c = i - r * p.inner;
    const long long o = r / p.rows, j = r - o * p.rows;
    const I* t = idx + (o * p.idx_outer + j) * p.k;
    long long lin = 0;
    for (int d = 0; d < p.k; ++d) {
      const long long dim = p.dims[d];
      long long v = (long long)t[d] % dim;
      if (v < 0) v += dim;
      lin = lin * dim + v;
    }
    y[i] = x[(o * p.src_outer + lin) * p.inner + c];
  }
}
""".replace("@K@", str(_GATHER_MAX_K))
_GATHER_ENTRY = r"""
extern "C" __global__ void %(name)s(const %(u)s* x, const %(i)s* idx, %(u)s* y,
                                    const OxGatherP p) {
  ox_gather<%(u)s, %(i)s>(x, idx, y, p);
}
"""


class _GatherParams(ctypes.Structure):
    _fields_ = [
        ("n", ctypes.c_longlong),
        ("inner", ctypes.c_longlong),
        ("rows", ctypes.c_longlong),
        ("idx_outer", ctypes.c_longlong),
        ("src_outer", ctypes.c_longlong),
        ("k", ctypes.c_int),
        ("dims", ctypes.c_longlong * _GATHER_MAX_K),
    ]


def _gather_kernel(unit: int, index_dtype: np.dtype) -> tuple[str, Callable[[], str]]:
    """(name, source) of the gather kernel moving ``unit``-byte units by indices of
    ``index_dtype`` (int32 or int64)."""
    i32 = index_dtype == np.int32
    name = f"ox_gather_{unit}_{'i32' if i32 else 'i64'}"
    fields = {"name": name, "u": dict(_UNITS)[unit], "i": "int" if i32 else "long long"}
    return name, lambda: _GATHER_SRC + _GATHER_ENTRY % fields


ship(lambda: [_gather_kernel(unit, it) for unit, _ in _UNITS for it in _GATHER_INDEX])


def _gather_unit(row_bytes: int, *ptrs: int) -> int:
    """The widest unit (up to 16 bytes) dividing a row of ``row_bytes`` and every pointer."""
    g = row_bytes
    for p in ptrs:
        g |= p
    return min(16, g & -g)


def _warm_gather(kernel: CudaKernel, inner_shape: Any) -> None:
    """``warm_up`` of Gather/GatherND: the gather kernel for rows of ``inner_shape`` (the
    data's dims each index picks rows of) where those dims are fixed; planned memory is
    aligned beyond 16 bytes."""
    info = kernel.info
    dt, it = info.input_dtype(0), info.input_dtype(1)
    if dt is None or it not in _GATHER_INDEX or inner_shape is None:
        return
    if not all(isinstance(d, int) for d in inner_shape):
        return
    inner = shapes.size_of(tuple(inner_shape))
    if inner:
        kernel.precompile(*_gather_kernel(_gather_unit(inner * dt.itemsize), it))


def _bind_gather(
    kernel: CudaKernel,
    ctx: KernelContext,
    y: Any,
    rows: int,
    idx_outer: int,
    src_outer: int,
    dims: tuple[int, ...],
    inner: int,
) -> Any:
    """The launch gathering into ``y`` (allocated) from input 0 by the index tuples of input 1:
    ``rows`` tuples per outer slice, read from tuple ``o * idx_outer + j``, each naming a row
    of ``inner`` elements within the ``src_outer`` rows of outer slice ``o``."""
    x, idx = kernel.arg(ctx, 0), kernel.arg(ctx, 1)
    isz = y.itemsize
    unit = _gather_unit(inner * isz, int(x.data.ptr), int(y.data.ptr))
    p = _GatherParams()
    p.inner = inner * isz // unit
    p.n = y.size * isz // unit
    p.rows, p.idx_outer, p.src_outer, p.k = rows, idx_outer, src_outer, len(dims)
    for d, n in enumerate(dims):
        p.dims[d] = n
    fn = compiled_function(kernel.xp, *_gather_kernel(unit, idx.dtype))
    blocks = min(-(-p.n // 256), 65535 * 8)
    return function_launch(fn, (blocks,), (256,), (x, idx, y, p), kernel.stream_handle(ctx))


def flat_rows(xp: Any, idx2: Any, dims: tuple[int, ...]) -> Any:
    """Row-major flat positions (int64) of the index tuples ``idx2`` (n, k) in an array of
    shape ``dims``; negative indices wrap (``%``, Python's sign convention in both numpy and
    CuPy)."""
    n, k = idx2.shape
    if k == 0:
        return xp.zeros(n, dtype=np.int64)
    if any(d == 0 for d in dims):
        raise IndexError(f"indices into an empty dimension of {list(dims)}")
    lin = xp.remainder(idx2[:, 0].astype(np.int64, copy=False), dims[0])
    for j in range(1, k):
        lin *= dims[j]
        lin += xp.remainder(idx2[:, j].astype(np.int64, copy=False), dims[j])
    return lin


# ---------------------------------------------------------------------------------------------
# Scatters


class _Scatter(CudaKernel):
    """The output starts as a copy of the data; subclasses write or combine the updates."""

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.axis = int(info.attr("axis", 0))
        self.reduction = str(info.attr("reduction", "none"))

    @classmethod
    def claims(cls, node: Any, graph: Any) -> bool:
        red = str(node.attrs.get("reduction", "none"))
        if red not in REDUCTIONS:
            return False
        # bfloat16 is moved as uint16 bits here: reductions would combine bits, not numbers
        dt = graph.input_dtypes(node)[0]
        return red == "none" or dt is None or dt not in BF16

    def start(self, ctx: KernelContext, fits: bool) -> Any:
        """The output, a copy of the data (None when it is empty)."""
        t, it, ut = ctx.input(0), ctx.input(1), ctx.input(2)
        if not fits:
            raise ValueError(
                f"{self.info.op_type}: indices {list(it.shape)} and updates {list(ut.shape)} "
                f"do not fit data {list(t.shape)}"
            )
        y = self.alloc(ctx, 0, t.shape, t.dtype)
        if not y.size:
            return None
        self.xp.copyto(y, self.arg(ctx, 0))
        return y


class ScatterND(_Scatter):
    """ScatterND (reduction: none from 11, add/mul from 16, max/min from 18): updates are
    written with a fancy assignment or combined atomically."""

    def compute(self, ctx: KernelContext) -> None:
        t, it, ut = ctx.input(0), ctx.input(1), ctx.input(2)
        k = it.shape[-1] if it.ndim else -1
        y = self.start(ctx, 0 <= k <= t.ndim and ut.shape == it.shape[:-1] + t.shape[k:])
        if y is None:
            return
        xp = self.xp
        n = shapes.size_of(it.shape[:-1])
        if not n:
            return
        dims = t.shape[:k]
        inner = shapes.size_of(t.shape[k:])
        lin = flat_rows(xp, self.arg(ctx, 1).reshape(n, k), dims)
        upd = self.arg(ctx, 2).reshape(n, inner)
        if self.reduction == "none":
            y.reshape(shapes.size_of(dims), inner)[lin] = upd
            return
        off = xp.multiply(lin[:, None], inner) + xp.arange(inner, dtype=np.int64)
        if xp is np:
            _np_scatter(y.reshape(-1), off, upd, self.reduction)
        else:
            _scatter_flat_kernel(self.reduction)(off, upd, y.reshape(-1))


class ScatterElements(_Scatter):
    """ScatterElements (reduction: none from 11, add/mul from 16, max/min from 18) and the
    deprecated Scatter-9/10 (no reduction): one thread per update writes or atomically
    combines it at its element."""

    def compute(self, ctx: KernelContext) -> None:
        t, it, ut = ctx.input(0), ctx.input(1), ctx.input(2)
        y = self.start(ctx, it.shape == ut.shape and it.ndim == t.ndim > 0)
        if y is None:
            return
        axis = shapes.normalize_axis(self.axis, t.ndim)
        xp = self.xp
        if not it.size:
            return
        idx, upd = self.arg(ctx, 1), self.arg(ctx, 2)
        if xp is np:
            off = _np_element_offsets(idx, axis, t.shape)
            _np_scatter(y.reshape(-1), off, upd, self.reduction)
            return
        _scatter_elements_kernel(self.reduction)(idx, upd, axis, t.shape[axis], y)


# ---------------------------------------------------------------------------------------------
# Data-dependent selections and encodings


class NonZero(CudaKernel):
    """NonZero: (rank, count) int64 coordinates, row-major order. The count is data
    dependent: ``argwhere`` reads it back to the host (one synchronisation)."""

    graph_capturable = False

    def compute(self, ctx: KernelContext) -> None:
        t = ctx.input(0)
        x = self.arg(ctx, 0)
        xp = self.xp
        if t.ndim == 0:  # onnx.reference: a (0, count) tensor
            self.alloc(ctx, 0, (0, int(xp.count_nonzero(x))), np.int64)
            return
        w = xp.argwhere(x)
        y = self.alloc(ctx, 0, (t.ndim, w.shape[0]), np.int64)
        if y.size:
            xp.copyto(y, w.T)


class Compress(CudaKernel):
    """Compress: the slices along ``axis`` (the flattened input without one) where the bool
    condition is true; a condition shorter than the axis selects from its prefix."""

    graph_capturable = False  # the output size is read back to the host

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        axis = info.attr("axis")
        self.axis = None if axis is None else int(axis)

    def compute(self, ctx: KernelContext) -> None:
        t = ctx.input(0)
        x, cond = self.arg(ctx, 0), self.arg(ctx, 1)
        if self.axis is None:
            x, axis = x.reshape(-1), 0
        else:
            axis = shapes.normalize_axis(self.axis, t.ndim)
        cond = cond.reshape(-1)
        if cond.shape[0] > x.shape[axis]:
            raise ValueError(
                f"Compress: condition of length {cond.shape[0]} is longer than axis {axis} "
                f"({x.shape[axis]})"
            )
        self.put(ctx, 0, self.xp.compress(cond, x, axis=axis), dtype=t.dtype)


class OneHot(CudaKernel):
    """OneHot: ``values[1]`` where the (wrapped) index equals the position along the new
    axis, ``values[0]`` elsewhere; out-of-range indices give a row of ``values[0]``. depth is
    a host input; indices and values stay on the device."""

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.axis = int(info.attr("axis", -1))

    def compute(self, ctx: KernelContext) -> None:
        t = ctx.input(0)
        depth = np.asarray(ctx.input(1)).reshape(-1)[0]
        n = int(np.arange(depth).size)  # onnx.reference: np.arange(depth)
        axis = shapes.normalize_axis(self.axis, t.ndim + 1)
        vt = ctx.input(2)
        if vt.size != 2:
            raise ValueError(f"OneHot: values must hold 2 elements, got {list(vt.shape)}")
        y = self.alloc(ctx, 0, t.shape[:axis] + (n,) + t.shape[axis:], vt.dtype)
        if not y.size:
            return
        xp = self.xp
        idx = self.arg(ctx, 0)
        if idx.dtype.kind != "u":
            idx = xp.where(xp.less(idx, 0), xp.add(idx, depth), idx)
        idx = idx.reshape(t.shape[:axis] + (1,) + t.shape[axis:])
        targets = xp.arange(n, dtype=np.int64).reshape((1,) * axis + (n,) + (1,) * (t.ndim - axis))
        values = self.arg(ctx, 2).reshape(2)
        xp.copyto(y, values[0])
        xp.copyto(y, values[1], where=idx == targets)


class ReverseSequence(CudaKernel):
    """ReverseSequence: row (t, b) of the output is row (len[b] - 1 - t, b) of the input for
    t < len[b], itself after; one ``take`` of rows with a (time, batch) source table built on
    the device from the lengths."""

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.batch_axis = int(info.attr("batch_axis", 1))
        self.time_axis = int(info.attr("time_axis", 0))

    def compute(self, ctx: KernelContext) -> None:
        t = ctx.input(0)
        ta, ba = self.time_axis, self.batch_axis
        if t.ndim < 2 or {ta, ba} != {0, 1}:
            raise ValueError(
                f"ReverseSequence: time_axis {ta} and batch_axis {ba} must be 0 and 1 (input "
                f"{list(t.shape)})"
            )
        y = self.alloc(ctx, 0, t.shape, t.dtype)
        if not y.size:
            return
        xp = self.xp
        steps, batch = t.shape[ta], t.shape[ba]
        inner = shapes.size_of(t.shape[2:])
        lens = self.arg(ctx, 1).astype(np.int64).reshape(1, batch)
        tt = xp.arange(steps, dtype=np.int64)[:, None]
        src = xp.where(tt < lens, xp.subtract(lens, 1) - tt, tt)  # (time, batch)
        bb = xp.arange(batch, dtype=np.int64)
        if ta == 0:
            rows = xp.multiply(src, batch) + bb[None, :]
        else:
            rows = xp.multiply(bb[:, None], steps) + src.T
        x2 = self.arg(ctx, 0).reshape(steps * batch, inner)
        xp.take(x2, rows.reshape(-1), axis=0, out=y.reshape(steps * batch, inner))


def register(reg: KernelRegistry, enable_cudnn: bool) -> None:
    T = ALL_FIXED_BF16
    reg.kernel("Gather", since=1, types={"T": T, "Tind": INDEX})(Gather)
    reg.kernel("GatherElements", since=11, types={"T": T, "Tind": INDEX})(GatherElements)
    reg.kernel("GatherND", since=11, types={"T": T})(GatherND)
    reg.kernel("ScatterND", since=11, types={"T": T})(ScatterND)
    reg.kernel("ScatterElements", since=11, types={"T": T, "Tind": INDEX})(ScatterElements)
    reg.kernel("Scatter", since=9, types={"T": T, "Tind": INDEX})(ScatterElements)
    # bfloat16 -0.0 has nonzero bits: NonZero compares values, so it is not claimed for bf16
    reg.kernel("NonZero", since=9, types={"T": ALL_FIXED})(NonZero)
    reg.kernel("Compress", since=9, types={"T": T, "T1": dtypes("bool")})(Compress)
    reg.kernel(
        "OneHot", since=9, types={"T1": NUMERIC, "T2": NUMERIC, "T3": T}, input_memory={1: CPU}
    )(OneHot)
    reg.kernel("ReverseSequence", since=10, types={"T": T})(ReverseSequence)
