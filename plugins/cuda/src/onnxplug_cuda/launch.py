"""Pre-bound kernel launches: what a prepared node's call does on the GPU.

A node's prepare phase (``CudaKernel.bind``) knows its pointers, shapes and stream for all the
later runs of a frame, so its work can be reduced to calls whose every parameter was packed
once. ``Launch`` is one ``cuLaunchKernel`` with its parameter block built ahead of time (a
few µs from Python, against 10-50 µs for a CuPy call that parses its arguments every time).

``RawElementwise`` turns an elementwise operation, written as for ``cupy.ElementwiseKernel``
(typed parameter lists, an operation over the parameter names, a preamble), into an NVRTC
kernel over broadcast strided operands, compiled once per (operation, concrete types, index
width) and launched through ``Launch``. Operand shapes are collapsed to the fewest dims first,
so same-shape and scalar-broadcast operands take a flat loop with no index arithmetic.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from .compiler import compiled_function, ship
from .runtime import CudaError

MAX_DIMS = 6
_THREADS = 256

# numpy dtype name -> C type for the generated kernels (CuPy's ElementwiseKernel spellings
# are typedef'd to these too)
_CTYPE = {
    "bool": "bool",
    "int8": "signed char",
    "int16": "short",
    "int32": "int",
    "int64": "long long",
    "uint8": "unsigned char",
    "uint16": "unsigned short",
    "uint32": "unsigned int",
    "uint64": "unsigned long long",
    "float16": "__half",
    "float32": "float",
    "float64": "double",
}
_TYPEDEFS = r"""
#include <cuda_fp16.h>
typedef signed char int8; typedef short int16; typedef int int32; typedef long long int64;
typedef unsigned char uint8; typedef unsigned short uint16; typedef unsigned int uint32;
typedef unsigned long long uint64; typedef __half float16; typedef float float32;
typedef double float64;
"""


_SCALAR: dict[str, Any] = {
    "bool": ctypes.c_bool,
    "int8": ctypes.c_int8,
    "int16": ctypes.c_int16,
    "int32": ctypes.c_int32,
    "int64": ctypes.c_int64,
    "uint8": ctypes.c_uint8,
    "uint16": ctypes.c_uint16,
    "uint32": ctypes.c_uint32,
    "uint64": ctypes.c_uint64,
    "float32": ctypes.c_float,
    "float64": ctypes.c_double,
}


class Launch:
    """One kernel launch with its parameters packed once; calling it launches it."""

    __slots__ = ("_args", "_call", "_keep", "name")

    def __init__(
        self,
        function: Any,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        stream: int,
        params: Sequence[Any],
        shared_mem: int = 0,
        name: str = "",
    ):
        from cupy.cuda import driver

        values = [_c_value(p) for p in params]
        arr = (ctypes.c_void_p * max(1, len(values)))(*[ctypes.addressof(v) for v in values])
        self._keep = (values, arr, function)  # the parameter block must outlive the launches
        self._args = (
            _function_handle(function),
            *grid,
            *block,
            shared_mem,
            stream,
            ctypes.addressof(arr),
            0,
        )
        self._call = driver.launchKernel
        self.name = name

    def __call__(self) -> None:
        try:
            self._call(*self._args)
        except Exception as e:  # CuPy's CUDADriverError ("CUDA_ERROR_...: ...")
            raise CudaError(f"cuLaunchKernel({self.name}) failed: {e}") from e


def _is_array(v: Any) -> bool:
    """A CuPy array (passed by pointer): not a numpy scalar, which has ``data`` and
    ``strides`` too but is passed by value."""
    return not isinstance(v, np.generic) and hasattr(getattr(v, "data", None), "ptr")


def _function_handle(function: Any) -> int:
    """The CUfunction of a CuPy ``RawKernel`` (``get_function``'s result: its compiled
    ``kernel`` holds the handle), a ``cupy.cuda.Function``, or an int."""
    f = getattr(function, "kernel", function)  # RawKernel -> its cupy.cuda.Function
    return int(getattr(f, "ptr", f))


def _c_value(p: Any) -> Any:
    """A kernel parameter as a ctypes object: arrays by their pointer, numpy scalars by type,
    ctypes objects (structs) as they are."""
    if isinstance(p, ctypes._SimpleCData) or isinstance(p, ctypes.Structure):
        return p
    data = getattr(p, "data", None)
    if data is not None and hasattr(data, "ptr"):  # a CuPy array
        return ctypes.c_void_p(int(data.ptr))
    if p is None:
        return ctypes.c_void_p(0)
    if isinstance(p, np.generic):
        if p.dtype == np.float16:  # passed as its bits (a __half parameter)
            return ctypes.c_uint16(int(p.view(np.uint16)))
        return _SCALAR[p.dtype.name](p.item())
    if isinstance(p, bool):
        return ctypes.c_bool(p)
    if isinstance(p, int):
        return ctypes.c_int64(p)
    if isinstance(p, float):
        return ctypes.c_double(p)
    raise TypeError(f"cannot pass {type(p).__name__} to a kernel")


def function_launch(
    fn: Any,
    grid: tuple[int, ...],
    block: tuple[int, ...],
    args: Sequence[Any],
    stream: int,
    shared_mem: int = 0,
) -> Launch:
    """A ``Launch`` of a CuPy ``RawModule`` function with the arguments its ``__call__`` takes."""
    g = (tuple(grid) + (1, 1, 1))[:3]
    b = (tuple(block) + (1, 1, 1))[:3]
    return Launch(fn, g, b, stream, args, shared_mem, getattr(fn, "__name__", ""))


# ---------------------------------------------------------------------------------------------
# Elementwise operations as raw kernels


def _collapse(
    shape: tuple[int, ...], strides: list[list[int]]
) -> tuple[list[int], list[list[int]]]:
    """Drop unit dims and merge adjacent dims that every operand walks contiguously."""
    dims = [(n, [s[i] for s in strides]) for i, n in enumerate(shape) if n != 1]
    out: list[tuple[int, list[int]]] = []
    for n, st in dims:
        if out:
            pn, pst = out[-1]
            if all(ps == s * n for ps, s in zip(pst, st)):
                out[-1] = (pn * n, st)
                continue
        out.append((n, st))
    if not out:
        return [1], [[0] for _ in strides]
    return [n for n, _ in out], [[st[k] for _, st in out] for k in range(len(strides))]


def _elem_strides(a: Any, shape: tuple[int, ...]) -> list[int]:
    """Element strides of array ``a`` broadcast to ``shape`` (0 along broadcast dims)."""
    nd = len(shape)
    sh = (1,) * (nd - a.ndim) + tuple(a.shape)
    st = (0,) * (nd - a.ndim) + tuple(s // a.itemsize for s in a.strides)
    return [0 if sh[i] == 1 and shape[i] != 1 else st[i] for i in range(nd)]


class ShapeOnly:
    """A dense array's shape and type without memory (its pointer reads 0, aligned for any
    vector): what a dry bind (``dry_compiles``) reads of an operand."""

    __slots__ = ("data", "dtype", "itemsize", "ndim", "shape", "size", "strides")

    class _Null:
        ptr = 0

    def __init__(self, shape: Sequence[int], dtype: Any):
        self.shape = tuple(int(d) for d in shape)
        self.dtype = np.dtype(dtype)
        self.itemsize = self.dtype.itemsize
        self.ndim = len(self.shape)
        self.size = math.prod(self.shape)
        strides, step = [], self.itemsize
        for d in reversed(self.shape):
            strides.append(step)
            step *= max(d, 1)
        self.strides = tuple(reversed(strides))
        self.data = ShapeOnly._Null


_dry = threading.local()  # .kernel: the kernel whose binds queue their compiles (dry_compiles)


@contextlib.contextmanager
def dry_compiles(kernel: Any) -> Iterator[None]:
    """On this thread, elementwise binds for ``kernel`` (a ``CudaKernel``, on its device)
    queue the compiles they would run (``kernel.precompile``) and bind nothing: a kernel's
    ``warm_up`` binds its prepared form over ``ShapeOnly`` operands this way."""
    outer = getattr(_dry, "kernel", None)
    _dry.kernel = kernel
    try:
        yield
    finally:
        _dry.kernel = outer


class RawElementwise:
    """An elementwise operation (``cupy.ElementwiseKernel``'s notation) compiled as a raw
    kernel over broadcast strided operands, bound into ``Launch``es."""

    def __init__(self, in_params: str, out_params: str, operation: str, name: str, preamble: str):
        self.ins = _parse_params(in_params)
        self.outs = _parse_params(out_params)
        self.operation = operation
        self.name = name
        self.preamble = preamble
        self._functions: dict[tuple, Any] = {}

    def supported(self) -> bool:
        """Raw (un-indexed) parameters and the index ``i`` need CuPy's indexer: not here."""
        return all(not raw for _, _, raw in self.ins + self.outs) and not _uses_index(
            self.operation
        )

    def bind(self, xp: Any, args: Sequence[Any], stream: int) -> Launch | None:
        """A launch computing the operation over ``args`` (inputs, then outputs, as for the
        ElementwiseKernel), or None when the operands do not fit (an output that is not
        the broadcast shape, too many dims, an unsupported type)."""
        n_in = len(self.ins)
        ins, outs = list(args[:n_in]), list(args[n_in:])
        if len(outs) != len(self.outs) or not outs:
            return None
        shape = tuple(outs[0].shape)
        arrays: list[Any] = []
        types: dict[str, str] = {}
        scalars: list[tuple[int, Any]] = []
        for k, ((ptype, _name, _), v) in enumerate(zip(self.ins + self.outs, ins + outs)):
            if _is_array(v):
                if not _fix_type(types, ptype, v.dtype):
                    return None
                if k >= n_in and tuple(v.shape) != shape:
                    return None
                arrays.append(v)
            else:
                if not isinstance(v, np.generic) or not _fix_type(types, ptype, v.dtype):
                    return None
                scalars.append((k, v))
        if any(a.ndim > len(shape) for a in arrays):
            return None
        strides = [_elem_strides(a, shape) for a in arrays]
        dims, st = _collapse(shape, strides)
        if len(dims) > MAX_DIMS:
            return None
        n = 1
        for d in dims:
            n *= d
        if n == 0:
            return _NOOP  # type: ignore[return-value]
        flat = len(dims) == 1
        wide = n >= 2**31 or any(abs(s) * d >= 2**31 for row in st for s, d in zip(row, dims))
        vec = _vector_width(arrays, st, n) if flat else 1
        shared = tuple(row[0] == 0 for row in st) if vec > 1 else ()
        variant = (tuple(sorted(types.items())), len(arrays), flat, wide, vec, shared)
        dry = getattr(_dry, "kernel", None)
        if dry is not None:
            source = self._source_of(variant, types, [k for k, _ in scalars])
            dry.precompile("oxr_" + self.name, source, self._functions, variant)
            return None
        # a compiled function belongs to the device current when it was loaded (the run's)
        key = (*variant, xp.cuda.runtime.getDevice())
        try:
            fn = self._function(xp, key, types, [k for k, _ in scalars])
        except Exception:  # the operation does not compile for these types here
            self._functions[key] = None
            fn = None
        if fn is None:
            return None
        idx = ctypes.c_longlong if wide else ctypes.c_int
        params: list[Any] = list(ins) + list(outs)  # the kernel's parameter order
        params.append(_index_struct(idx, len(arrays), n, dims, st, flat))
        blocks = min((n // vec + _THREADS - 1) // _THREADS, 65535 * 8)
        return Launch(fn, (blocks, 1, 1), (_THREADS, 1, 1), stream, params, 0, self.name)

    def precompile(self, kernel: Any, dtypes: Sequence[Any], flat: bool) -> None:
        """For ``kernel``'s ``warm_up``: start compiling the operation over arrays of
        ``dtypes`` (the parameters' order, no scalars) as ``bind`` compiles it for strided
        operands, or (``flat``) for dense ones it cannot vectorize, with int indices."""
        types = self._array_types(dtypes)
        if types is not None:
            key = (tuple(sorted(types.items())), len(dtypes), flat, False, 1, ())
            source = self._source_of(key, types, [])
            kernel.precompile("oxr_" + self.name, source, self._functions, key)

    def _array_types(self, dtypes: Sequence[Any]) -> dict[str, str] | None:
        """The C type of each placeholder when every parameter is an array of ``dtypes`` (in
        the parameters' order); None where the operation does not take those types."""
        types: dict[str, str] = {}
        params = self.ins + self.outs
        if not self.supported() or len(dtypes) != len(params):
            return None
        for (ptype, _, _), dt in zip(params, dtypes):
            if not _fix_type(types, ptype, dt):
                return None
        return types

    def catalogue(self, dtypes: Sequence[Any]) -> list[tuple[str, Callable[[], str]]]:
        """(name, source) of each variant ``bind`` compiles for arrays of ``dtypes`` (every
        parameter an array, in the parameters' order) that a build ships: dense operands moved
        in the widest vectors (16 bytes of the widest operand), with each input dense or one
        broadcast element; dense or broadcast operands one element at a time; strided operands.
        Empty where the operation does not take those types."""
        types = self._array_types(dtypes)
        if types is None:
            return []
        tkey, n = tuple(sorted(types.items())), len(dtypes)
        keys: list[tuple] = [(tkey, n, True, False, 1, ()), (tkey, n, False, False, 1, ())]
        vec = 16 // max(np.dtype(d).itemsize for d in dtypes)
        if vec > 1:
            outs = (False,) * len(self.outs)
            for shared in itertools.product((False, True), repeat=len(self.ins)):
                if not all(shared):  # (all inputs broadcast: a fill, not worth a variant)
                    keys.append((tkey, n, True, False, vec, shared + outs))
        name = "oxr_" + self.name
        return [(name, self._source_of(key, types, [])) for key in keys]

    def _function(self, xp: Any, key: tuple, types: dict[str, str], scalar_at: list[int]) -> Any:
        source = self._source_of(key, types, scalar_at)
        return compiled_function(xp, "oxr_" + self.name, source, self._functions, key)

    def _source_of(
        self, key: tuple, types: dict[str, str], scalar_at: list[int]
    ) -> Callable[[], str]:
        """The source of the variant ``key`` names (its first six fields)."""
        _, _, flat, wide, vec, shared = key[:6]

        def source() -> str:
            if vec > 1:
                return self._vector_source(types, scalar_at, wide, vec, shared)
            return self._source(types, scalar_at, flat=flat, wide=wide)

        return source

    def _arrays(self, scalar_at: list[int]) -> list[tuple[str, str, bool]]:
        """(type, name, is output) of each array parameter, in the kernel's order."""
        n_in = len(self.ins)
        return [
            (ptype, pname, k >= n_in)
            for k, (ptype, pname, _) in enumerate(self.ins + self.outs)
            if k not in scalar_at
        ]

    def _kernel(self, types: dict[str, str], scalar_at: list[int], wide: bool, body: str) -> str:
        """The module source: typedefs, preamble, the index struct and the entry point (arrays
        as ``_p_<name>`` pointers, scalars by value, then the index struct) around ``body``."""
        idx = "long long" if wide else "int"
        sig = []
        for k, (ptype, pname, _) in enumerate(self.ins + self.outs):
            if k in scalar_at:
                sig.append(f"const {ptype} {pname}")
            elif k >= len(self.ins):
                sig.append(f"{ptype}* __restrict__ _p_{pname}")
            else:
                sig.append(f"const {ptype}* __restrict__ _p_{pname}")
        n_arr = len(self._arrays(scalar_at))
        return (
            _TYPEDEFS
            + "".join(f"typedef {c} {t};\n" for t, c in sorted(types.items()))
            + self.preamble
            + "\n"
            + f"struct OxIdx {{ {idx} n; int ndim; {idx} shape[{MAX_DIMS}]; "
            + f"{idx} st[{n_arr}][{MAX_DIMS}]; }};\n"
            + "template <typename X, int N> struct alignas(sizeof(X) * N) OxVec { X v[N]; };\n"
            + f'extern "C" __global__ void oxr_{self.name}({", ".join(sig)}, const OxIdx p) {{\n'
            + body
            + "}\n"
        )

    def _source(self, types: dict[str, str], scalar_at: list[int], flat: bool, wide: bool) -> str:
        idx = "long long" if wide else "int"
        loads, stores = [], []
        arrays = self._arrays(scalar_at)
        for a, (ptype, pname, is_out) in enumerate(arrays):
            if is_out:
                loads.append(f"{ptype} {pname};")
                stores.append(f"_p_{pname}[o{a}] = {pname};")
            else:
                loads.append(f"const {ptype} {pname} = _p_{pname}[o{a}];")
        offs = range(len(arrays))
        if flat:
            offsets = "".join(f"const {idx} o{k} = i * p.st[{k}][0];\n" for k in offs)
        else:
            offsets = (
                "".join(f"{idx} o{k} = 0;\n" for k in offs)
                + f"{idx} r = i;\n"
                + "for (int d = p.ndim - 1; d >= 0; --d) {\n"
                + f"  const {idx} c = r % p.shape[d]; r /= p.shape[d];\n"
                + "".join(f"  o{k} += c * p.st[{k}][d];\n" for k in offs)
                + "}\n"
            )
        body = (
            f"  for ({idx} i = ({idx})blockIdx.x * blockDim.x + threadIdx.x; i < p.n;"
            + f" i += ({idx})gridDim.x * blockDim.x) {{\n"
            + offsets
            + "\n".join(loads)
            + "\n{\n"
            + self.operation
            + ";\n}\n"
            + "\n".join(stores)
            + "\n  }\n"
        )
        return self._kernel(types, scalar_at, wide, body)

    def _vector_source(
        self,
        types: dict[str, str],
        scalar_at: list[int],
        wide: bool,
        vec: int,
        shared: tuple[bool, ...],
    ) -> str:
        """The flat kernel over dense operands, ``vec`` elements per thread: each dense array
        moves as one aligned vector (16 bytes for the widest type), a broadcast scalar array
        (``shared``) is read once per thread."""
        idx = "long long" if wide else "int"
        loads, elems, puts, stores = [], [], [], []
        for a, (ptype, pname, is_out) in enumerate(self._arrays(scalar_at)):
            vt = f"OxVec<{ptype}, {vec}>"
            if is_out:
                loads.append(f"{vt} _v_{pname};")
                elems.append(f"{ptype} {pname};")
                puts.append(f"_v_{pname}.v[_k] = {pname};")
                stores.append(f"reinterpret_cast<{vt}*>(_p_{pname})[u] = _v_{pname};")
            elif shared[a]:
                loads.append(f"const {ptype} _s_{pname} = _p_{pname}[0];")
                elems.append(f"const {ptype} {pname} = _s_{pname};")
            else:
                loads.append(
                    f"const {vt} _v_{pname} = reinterpret_cast<const {vt}*>(_p_{pname})[u];"
                )
                elems.append(f"const {ptype} {pname} = _v_{pname}.v[_k];")
        body = (
            f"  const {idx} nv = p.n / {vec};\n"
            + f"  for ({idx} u = ({idx})blockIdx.x * blockDim.x + threadIdx.x; u < nv;"
            + f" u += ({idx})gridDim.x * blockDim.x) {{\n"
            + "\n".join(loads)
            + f"\n#pragma unroll\nfor (int _k = 0; _k < {vec}; ++_k) {{\n"
            + "\n".join(elems)
            + "\n{\n"
            + self.operation
            + ";\n}\n"
            + "\n".join(puts)
            + "\n}\n"
            + "\n".join(stores)
            + "\n  }\n"
        )
        return self._kernel(types, scalar_at, wide, body)


def _vector_width(arrays: list[Any], st: list[list[int]], n: int) -> int:
    """Elements per thread for a flat operation whose every array is dense (stride 1) or one
    broadcast element (stride 0): the most, up to 16 bytes of the widest operand, that divide
    ``n`` and keep each dense array aligned to its vector; 1 otherwise."""
    if any(row[0] not in (0, 1) for row in st):
        return 1
    vec = 16 // max(a.itemsize for a in arrays)
    while vec > 1:
        if n % vec == 0 and all(
            row[0] == 0 or int(a.data.ptr) % (vec * a.itemsize) == 0 for a, row in zip(arrays, st)
        ):
            return vec
        vec //= 2
    return 1


# ---------------------------------------------------------------------------------------------
# Copies of views whose innermost dim is contiguous on both sides, moved in wide units

_UNITS = (
    (16, "uint4"),
    (8, "uint2"),
    (4, "unsigned int"),
    (2, "unsigned short"),
    (1, "unsigned char"),
)
_UNIT_COPY_SRC = r"""
template <typename I> struct OxCopyIdx { I n; I row; int ndim; I shape[@ND@]; I ss[@ND@];
                                         I sd[@ND@]; };
template <typename U, typename I>
__device__ void ox_copy_units(const U* __restrict__ src, U* __restrict__ dst,
                              const OxCopyIdx<I>& p) {
  for (I i = (I)blockIdx.x * blockDim.x + threadIdx.x; i < p.n; i += (I)gridDim.x * blockDim.x) {
    I r = i / p.row;
    const I c = i - r * p.row;
    I os = c, od = c;
    for (int d = p.ndim - 1; d >= 0; --d) {
      const I q = r % p.shape[d];
      r /= p.shape[d];
      os += q * p.ss[d];
      od += q * p.sd[d];
    }
    dst[od] = src[os];
  }
}
""".replace("@ND@", str(MAX_DIMS))
_UNIT_COPY_ENTRY = r"""
extern "C" __global__ void ox_copy_units_%(v)d_%(w)s(const %(u)s* src, %(u)s* dst,
                                                     const OxCopyIdx<%(i)s> p) {
  ox_copy_units<%(u)s, %(i)s>(src, dst, p);
}
"""


def _unit_copy_kernel(unit: int, wide: bool) -> tuple[str, Callable[[], str]]:
    """(name, source) of the copy kernel moving ``unit``-byte units, each variant compiled on
    its own on first use (one module of all ten variants took NVRTC about 0.2 s of a fresh
    process's first run)."""
    u = dict(_UNITS)[unit]
    w, i = ("l", "long long") if wide else ("i", "int")
    fields = {"v": unit, "u": u, "w": w, "i": i}
    return f"ox_copy_units_{unit}_{w}", lambda: _UNIT_COPY_SRC + _UNIT_COPY_ENTRY % fields


ship(lambda: [_unit_copy_kernel(unit, wide) for unit, _ in _UNITS for wide in (False, True)])


def _unit_copy_function(xp: Any, unit: int, wide: bool) -> Any:
    return compiled_function(xp, *_unit_copy_kernel(unit, wide))


def bind_unit_copy(xp: Any, src: Any, dst: Any, stream: int) -> Launch | None:
    """``dst[...] = src`` (same shape and dtype) as one launch that moves up to 16 bytes per
    thread, where the innermost (collapsed) dim is contiguous in both: index arithmetic per
    unit instead of per element (a (B, S, N, H) -> (B, N, S, H) head transpose of float16 runs
    8 elements per thread). None where the views do not fit (the generic kernel then copies)."""
    if tuple(src.shape) != tuple(dst.shape) or src.dtype != dst.dtype or 0 in tuple(dst.shape):
        return None
    isz = dst.itemsize
    shape = tuple(dst.shape)
    dims, (ss, sd) = _collapse(shape, [_elem_strides(src, shape), _elem_strides(dst, shape)])
    if ss[-1] != 1 or sd[-1] != 1 or len(dims) > MAX_DIMS + 1 or len(dims) < 2:
        return None  # one contiguous run: the generic kernel's flat loop is as good
    if any(s <= 0 for s in ss[:-1] + sd[:-1]):
        return None
    g = dims[-1] * isz | int(src.data.ptr) | int(dst.data.ptr)
    for s in ss[:-1] + sd[:-1]:
        g |= s * isz
    unit = min(16, g & -g)
    row = dims[-1] * isz // unit
    outer = dims[:-1]
    rows = 1
    for d in outer:
        rows *= d
    n = rows * row
    us = [s * isz // unit for s in ss[:-1]]
    ud = [s * isz // unit for s in sd[:-1]]
    span = max(sum((d - 1) * s for d, s in zip(outer, st)) + row for st in (us, ud))
    wide = n >= 2**31 or span >= 2**31
    try:
        fn = _unit_copy_function(xp, unit, wide)
    except Exception:  # no NVRTC here, or the module does not build: the generic kernel
        return None
    idx = ctypes.c_longlong if wide else ctypes.c_int

    class OxCopyIdx(ctypes.Structure):
        _fields_ = [
            ("n", idx),
            ("row", idx),
            ("ndim", ctypes.c_int),
            ("shape", idx * MAX_DIMS),
            ("ss", idx * MAX_DIMS),
            ("sd", idx * MAX_DIMS),
        ]

    p = OxCopyIdx()
    p.n, p.row, p.ndim = n, row, len(outer)
    for d, (m, a, b) in enumerate(zip(outer, us, ud)):
        p.shape[d], p.ss[d], p.sd[d] = m, a, b
    blocks = min((n + _THREADS - 1) // _THREADS, 65535 * 8)
    return Launch(fn, (blocks, 1, 1), (_THREADS, 1, 1), stream, [src, dst, p], 0, "ox_copy_units")


def _noop() -> None:
    pass


_NOOP = _noop


def _index_struct(
    idx: Any, n_arr: int, n: int, dims: list[int], st: list[list[int]], flat: bool
) -> ctypes.Structure:
    class OxIdx(ctypes.Structure):
        _fields_ = [
            ("n", idx),
            ("ndim", ctypes.c_int),
            ("shape", idx * MAX_DIMS),
            ("st", (idx * MAX_DIMS) * n_arr),
        ]

    s = OxIdx()
    s.n = n
    s.ndim = len(dims)
    for d, v in enumerate(dims):
        s.shape[d] = v
    for k in range(n_arr):
        for d in range(len(dims)):
            s.st[k][d] = st[k][d]
    return s


def _parse_params(decl: str) -> list[tuple[str, str, bool]]:
    """'T x, raw T y, float32 a' -> [(type, name, raw)]."""
    out = []
    for part in decl.split(","):
        words = part.split()
        if not words:
            continue
        raw = words[0] == "raw"
        if raw:
            words = words[1:]
        out.append((words[0], words[1], raw))
    return out


def _uses_index(operation: str) -> bool:
    import re

    return re.search(r"(?<![\w.])i(?!\w)", operation) is not None


def _fix_type(types: dict[str, str], ptype: str, dtype: Any) -> bool:
    """Bind a type placeholder (a capital letter, like T) to ``dtype``; concrete types must
    match. False when the combination cannot be compiled here."""
    name = np.dtype(dtype).name
    c = _CTYPE.get(name)
    if c is None:
        return False
    if ptype in _CTYPE or ptype in ("float16", "float32", "float64"):
        return _CTYPE.get(ptype, ptype) == c or ptype == name
    prev = types.get(ptype)
    if prev is None:
        types[ptype] = c
        return True
    return prev == c


def bound_calls(calls: Sequence[Callable[[], None]]) -> Callable[[], None]:
    """One callable running ``calls`` in order (a single call stays itself)."""
    calls = [c for c in calls if c is not _NOOP]
    if not calls:
        return _NOOP
    if len(calls) == 1:
        return calls[0]
    if len(calls) == 2:
        a, b = calls

        def two() -> None:
            a()
            b()

        return two
    seq = tuple(calls)

    def many() -> None:
        for c in seq:
            c()

    return many


__all__ = ["Launch", "RawElementwise", "bind_unit_copy", "bound_calls", "function_launch"]
