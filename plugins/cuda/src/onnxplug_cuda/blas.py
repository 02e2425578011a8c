"""Row-major GEMM for the CUDA kernels: cuBLASLt on raw device pointers (through
``nvmath.bindings.cublasLt``) with cached plans, CuPy's matmul when nvmath-python is missing, and
numpy under the host simulation.

One entry point, ``engine_for(ep)(ctx, a, b, out, trans_a=, trans_b=, alpha=, beta=, c=, bias=,
epilogue=, dtype=)``, computes ``out = epilogue(alpha * op(a) @ op(b) + beta * c + bias)`` for
row-major arrays with numpy's broadcasting of the batch dims (``a``: (..., M, K), ``b``: (..., K, N),
``out``: (..., M, N) dense). ``bias`` is a length-N vector (one value per output column, ONNX
Gemm's C of shape (N,)); epilogues are ``RELU``, ``GELU`` (the tanh approximation, as cuBLASLt's),
``BIAS``, ``RELU_BIAS``, ``GELU_BIAS``.

The row-major trick: cuBLASLt is column-major, and a row-major (r, c) matrix read column-major is
its transpose. So ``D = op(A) @ op(B)`` (row-major M x N) is computed as ``D^T = op(B)^T @ op(A)^T``:
the library's first operand is our B, its second is our A, and its N x M column-major output
(ld N) is our row-major D. Its bias vector has one value per row of its D, i.e. per column of
ours: length N. This is nvmath's "bias length must be M" rule, seen from the other side.

Batch dims: a batched A times an unbatched B is folded into one GEMM with M' = batch * M. Other
cases use strided batches, where a broadcast operand has batch stride 0. Batch dims whose
strides cannot be collapsed into one stride are looped over in Python.
"""

from __future__ import annotations

import ctypes
import threading
import warnings
from typing import Any

import numpy as np

from .runtime import BackgroundImport, make_primary_context_current

# Calls per path, for tests and diagnostics (which engine really ran); a prepared call counts
# once, when it is prepared.
stats = {
    "cublaslt": 0,
    "xp": 0,
    "warm_queries": 0,
    "tuned": 0,
    "tuning_cache_hits": 0,
    "tuning_results_hits": 0,
}

EPILOGUES = ("RELU", "GELU", "BIAS", "RELU_BIAS", "GELU_BIAS")

# Workspace cap for cuBLASLt's heuristic: NVIDIA recommends 32 MiB on Hopper. It comes from the
# provider's allocator for each call (ctx.scratch), stream ordered.
MAX_WORKSPACE = 32 << 20
_MAX_PLANS = 1024
_MISSING = object()
_SQRT_2_OVER_PI = 0.7978845608028654


def _bf16() -> np.dtype | None:
    try:
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    except ImportError:
        return None


BF16 = _bf16()
_F16 = np.dtype(np.float16)
_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)
_U16 = np.dtype(np.uint16)


def is_half(dtype: Any) -> bool:
    """float16 or bfloat16: computed in float32 by the fallbacks."""
    dt = np.dtype(dtype)
    return dt == _F16 or (BF16 is not None and dt == BF16)


def widen(xp: Any, x: Any, dtype: Any) -> Any:
    """``x`` (holding values of ``dtype``) as float32 when ``dtype`` is a 16-bit float.

    CuPy holds bfloat16 as uint16 bit patterns: those are widened by shifting the bits into
    the high half of a float32 (exact)."""
    dt = np.dtype(dtype)
    if dt == _F16:
        return x.astype(np.float32)
    if BF16 is not None and dt == BF16:
        if x.dtype == _U16:
            return (x.astype(xp.uint32) << 16).view(xp.float32)
        return x.astype(np.float32)
    return x


def store(xp: Any, r: Any, out: Any, dtype: Any) -> None:
    """Write ``r`` (float32 or wider) into ``out`` (holding ``dtype``), rounding to nearest even."""
    dt = np.dtype(dtype)
    if BF16 is not None and dt == BF16 and out.dtype == _U16:
        u = xp.ascontiguousarray(r, dtype=xp.float32).view(xp.uint32)
        rounded = ((u + xp.uint32(0x7FFF) + ((u >> 16) & xp.uint32(1))) >> 16).astype(xp.uint16)
        out[...] = xp.where(xp.isnan(r), xp.uint16(0x7FC0), rounded)
        return
    if xp is np:
        np.copyto(out, r, casting="unsafe")
    else:
        out[...] = r


def gelu_tanh(xp: Any, r: Any) -> Any:
    """GELU with the tanh approximation (cuBLASLt's GELU epilogue), in place where it can."""
    t = r * r
    t *= 0.044715
    t += 1.0
    t *= r
    t *= _SQRT_2_OVER_PI
    xp.tanh(t, out=t)
    t += 1.0
    t *= 0.5
    r *= t
    return r


def _activate(xp: Any, r: Any, epilogue: str | None) -> Any:
    if epilogue in ("RELU", "RELU_BIAS"):
        xp.maximum(r, 0, out=r)
    elif epilogue in ("GELU", "GELU_BIAS"):
        r = gelu_tanh(xp, r)
    return r


def xp_gemm(
    xp: Any,
    a: Any,
    b: Any,
    out: Any,
    trans_a: bool = False,
    trans_b: bool = False,
    alpha: float = 1.0,
    beta: float = 0.0,
    c: Any = None,
    bias: Any = None,
    epilogue: str | None = None,
    dtype: Any = None,
) -> None:
    """The same contract as the cuBLASLt engine, with ``xp.matmul`` (numpy or CuPy).

    16-bit floats are multiplied in float32 and rounded once, as the CPU provider does."""
    dt = np.dtype(dtype) if dtype is not None else out.dtype
    A = a.swapaxes(-1, -2) if trans_a else a
    B = b.swapaxes(-1, -2) if trans_b else b
    plain = alpha == 1 and (c is None or beta == 0) and bias is None and not epilogue
    if plain and not is_half(dt) and c is not out:
        xp.matmul(A, B, out=out)
        return
    r = xp.matmul(widen(xp, A, dt), widen(xp, B, dt))
    if alpha != 1:
        r *= alpha
    if c is not None and beta != 0:
        cw = widen(xp, c, dt)
        r += cw if beta == 1 else cw * beta
    if bias is not None:
        r += widen(xp, bias, dt)
    r = _activate(xp, r, epilogue)
    store(xp, r, out, dt)


class HostGemm:
    """The numpy engine of the host simulation."""

    kind = "numpy"

    def __call__(self, ctx: Any, a: Any, b: Any, out: Any, **kw: Any) -> None:
        xp_gemm(np, a, b, out, **kw)

    def prepare(self, ctx: Any, a: Any, b: Any, out: Any, **kw: Any) -> Any:
        return lambda: xp_gemm(np, a, b, out, **kw)

    def warm_up(self, dtype: Any) -> None:
        """Nothing to load ahead (see ``LtGemm.warm_up``)."""


class XpGemm:
    """CuPy's matmul: used when nvmath-python is not importable (not graph-capturable)."""

    kind = "cupy"

    def __init__(self, xp: Any):
        self.xp = xp

    def __call__(self, ctx: Any, a: Any, b: Any, out: Any, **kw: Any) -> None:
        stats["xp"] += 1
        xp_gemm(self.xp, a, b, out, **kw)

    def prepare(self, ctx: Any, a: Any, b: Any, out: Any, **kw: Any) -> Any:
        return None  # CuPy's matmul: nothing to bind

    def warm_up(self, dtype: Any) -> None:
        """Nothing to load ahead (see ``LtGemm.warm_up``)."""


# ---------------------------------------------------------------------------------------------
# cuBLASLt

# cudaDataType_t values (library_types.h; also nvmath's CudaDataType).
_CUDA_R_32F, _CUDA_R_64F, _CUDA_R_16F, _CUDA_R_16BF = 0, 1, 2, 14


def _align(ptr: int) -> int:
    """The largest power of two (up to 256) that divides ``ptr``."""
    return 256 if ptr == 0 else min(256, ptr & -ptr)


def _batch_strides(shape: tuple[int, ...], batch: tuple[int, ...]) -> list[int]:
    """Element strides of a dense operand of ``shape`` over the output's batch dims ``batch``
    (0 where the operand is broadcast)."""
    nb = len(batch)
    own = shape[:-2]
    pad = nb - len(own)
    out = [0] * nb
    s = shape[-2] * shape[-1]
    for i in range(nb - 1, -1, -1):
        j = i - pad
        d = own[j] if j >= 0 else 1
        out[i] = s if d != 1 else 0
        s *= d
    return out


def _ptr(arr: Any) -> int:
    return int(arr.data.ptr)


def _pointers(a: Any, b: Any, out: Any, c: Any) -> tuple[int, int, int, int]:
    """Device pointers of A, B, C (D's when C is absent or D itself) and D."""
    pd = _ptr(out)
    return _ptr(a), _ptr(b), pd if c is None or c is out else _ptr(c), pd


def _alignments(geo: Any, ptrs: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
    """The pointers' alignments in cuBLASLt's operand order (B, A, C, D), capped by what the
    batch strides allow: the lowest set bit of (ptr | cap)."""
    pa, pb, pc, pd = ptrs
    s0, s1, s2, s3 = geo.sal
    return (
        (pb | s0) & -(pb | s0),
        (pa | s1) & -(pa | s1),
        (pc | s2) & -(pc | s2),
        (pd | s3) & -(pd | s3),
    )


class GemmTuning:
    """onnxruntime's TunableOp for the GEMMs (``tunable_op_enable``, ``tunable_op_tuning_enable``,
    ``tunable_op_max_tuning_duration_ms``): which of cuBLASLt's heuristic candidates a GEMM
    signature runs. Enabled, a signature runs the candidate its tuning result names (the
    device's results in this process, ``results``: tuned, read from the cache or given by
    ``set_tuning_results``; then the tuning cache on disk, per device, driver and cuBLASLt
    version), else the heuristic's first; with tuning enabled too, a signature without a
    result has its candidates timed on its first call (GPU time of back-to-back calls, as
    cuDNN's EXHAUSTIVE search times plans, the host's enqueueing bounded by the duration
    option) and the fastest is kept. Each signature is decided once per process, so every
    call of it (eager, prepared, replayed) runs the same candidate."""

    def __init__(self, tune: bool, budget_ms: float, cache: Any, results: Any) -> None:
        self.tune = tune
        self.budget_ms = budget_ms
        self.cache = cache
        self.results = results  # a TuningResultsManager, the device's
        self._chosen: dict[str, int] = {}
        self._lock = threading.Lock()

    def choose(self, op: str, params: str, count: int, timer: Any, capturing: bool) -> int:
        """The candidate (an index into the heuristic's ``count`` results) signature
        (``op``, ``params``) runs; ``timer()`` gives the candidates' times in ms (None: they
        cannot be timed now)."""
        key = f"{op} {params}"
        with self._lock:
            hit = self._chosen.get(key)
        if hit is not None:
            return hit
        given = index = self.results.lookup(op, params)
        if 0 <= index < count:
            stats["tuning_results_hits"] += 1
        else:
            index = -1
            cached = self.cache.get(key)
            if isinstance(cached, list) and len(cached) == 3 and cached[1] == count:
                index = int(cached[0])
                stats["tuning_cache_hits"] += 1
            elif self.tune and timer is not None and not capturing and count > 1:
                times = {i: t for i, t in timer().items() if t < float("inf")}
                if times:
                    index = min(times, key=times.__getitem__)
                    stats["tuned"] += 1
                    self.cache.put(key, [index, count, times[index]])
            if 0 <= index < count and given < 0:  # an out-of-range given id stays as given
                index = self.results.add(op, params, index)
        if not 0 <= index < count:
            index = 0
        with self._lock:
            return self._chosen.setdefault(key, index)


def _workspace(results: Any, i: int, pad: int) -> int:
    """The workspace bytes heuristic result ``i`` asks for, padded by ``pad`` where it asks for
    any (nvmath-python pads epilogue workspaces the same way: a library issue)."""
    ws = int(results["workspace_size"][i])
    return ws + pad if ws else 0


class _Candidate:
    """A plan run with another of its heuristic results (what ``_call_args`` reads)."""

    __slots__ = ("algo_ptr", "desc", "la", "lb", "lc", "ld", "ws")

    def __init__(self, plan: Any, algo_ptr: int, ws: int) -> None:
        self.desc = plan.desc
        self.la, self.lb, self.lc, self.ld = plan.la, plan.lb, plan.lc, plan.ld
        self.algo_ptr, self.ws = algo_ptr, ws


def _call_args(stream: Any, geo: Any, plan: Any, sc: tuple, ptrs: tuple, ws_ptr: int) -> list:
    """``cublasLtMatmul``'s arguments, one tuple per batch looped over (``geo.offsets``); the
    library's A is our B and its B our A (see the module docstring)."""
    pa, pb, pc, pd = ptrs
    handle, sh = stream.cublaslt, stream.handle
    return [
        (
            handle,
            plan.desc,
            sc[0],
            pb + ob,
            plan.la,
            pa + oa,
            plan.lb,
            sc[1],
            pc + od,
            plan.lc,
            pd + od,
            plan.ld,
            plan.algo_ptr,
            ws_ptr,
            plan.ws,
            sh,
        )
        for oa, ob, od in geo.offsets
    ]


class _Geo:
    """One call signature: the plan key without pointer alignments, the alignment the batch
    strides allow per operand, the byte offsets of the batches looped over in Python, the
    alpha/beta type and the plans built for it (by pointer alignment; False: none exists)."""

    __slots__ = ("key", "offsets", "plans", "sal", "scale")


class _LtPlan:
    """A cuBLASLt matmul descriptor, its four layouts, a preference and the chosen algorithm."""

    __slots__ = (
        "L",
        "algo",
        "algo_ptr",
        "bias",
        "desc",
        "la",
        "lb",
        "lc",
        "ld",
        "lock",
        "pref",
        "ws",
        "__weakref__",
    )

    def __init__(self, L: Any) -> None:
        self.L = L
        self.desc = self.la = self.lb = self.lc = self.ld = self.pref = 0
        self.algo: Any = None
        self.algo_ptr = 0
        self.bias = 0  # the bias pointer the descriptor holds
        self.ws = 0
        self.lock = threading.Lock()  # the bias pointer lives in the (shared) descriptor

    def __del__(self) -> None:
        L = self.L
        try:
            for lay in {self.la, self.lb, self.lc, self.ld} - {0}:
                L.matrix_layout_destroy(lay)
            if self.pref:
                L.matmul_preference_destroy(self.pref)
            if self.desc:
                L.matmul_desc_destroy(self.desc)
        except Exception:
            pass


def _set_attr(setter: Any, dtype_of: Any, handle: int, attr: Any, value: int) -> None:
    """Set one cuBLASLt attribute with the C type the binding reports for it."""
    buf = np.array(value, dtype=dtype_of(attr))
    setter(handle, int(attr), buf.ctypes.data, buf.itemsize)


class LtGemm:
    """GEMM through cuBLASLt with plans cached per shape, strides, dtype, transposes, epilogue,
    pointer alignment and TF32 mode. Handles come from the stream (``ctx.stream.cublaslt``),
    workspaces from the provider's allocator (``ctx.scratch``)."""

    kind = "cublaslt"

    def __init__(self, xp: Any, ordinal: int, use_tf32: bool, tuning: GemmTuning | None = None):
        cublasLt, cublas = NVMATH.modules()

        self.tuning = tuning
        self.xp = xp
        self.L = cublasLt
        self.ordinal = ordinal
        self.use_tf32 = use_tf32
        # each element type's compute type, by name (a tuning result's op signature names it)
        self._compute_name = {
            _F32: "COMPUTE_32F_FAST_TF32" if use_tf32 else "COMPUTE_32F",
            _F16: "COMPUTE_32F",
            _F64: "COMPUTE_64F",
        }
        self._cuda_type = {_F32: _CUDA_R_32F, _F16: _CUDA_R_16F, _F64: _CUDA_R_64F}
        if BF16 is not None:
            self._compute_name[BF16] = "COMPUTE_32F"
            self._cuda_type[BF16] = _CUDA_R_16BF
        ct = cublas.ComputeType
        self._compute = {dt: int(getattr(ct, name)) for dt, name in self._compute_name.items()}
        self._op_t = int(cublas.Operation.T)
        self._op_n = int(cublas.Operation.N)
        E = cublasLt.Epilogue
        self._epilogue = {name: int(getattr(E, name)) for name in EPILOGUES}
        # call signature -> _Geo (None: not for cuBLASLt); each _Geo holds its plans by alignment
        self._geo: dict[tuple, _Geo | None] = {}
        self._lock = threading.Lock()
        self._scalars: dict[tuple, tuple] = {}  # (alpha ptr, beta ptr, arrays kept alive)
        self._bias_attr = int(cublasLt.MatmulDescAttribute.BIAS_POINTER)
        self._failed: set[str] = set()
        self._warmed: set[np.dtype] = set()  # element types whose warm-up was started

    def warm_up(self, dtype: Any) -> None:
        """Start, once per element type, a heuristic query for a small GEMM of that type and
        this engine's compute type on a helper thread (``warm_gemm_type``). cuBLASLt's first
        query for a type does a set-up of that type, and a cached algorithm's check costs
        the same (H100, fresh processes: 99-139 ms for float16, 55-88 ms for TF32 float32):
        float16 BERT-base's first run spent 127-153 ms in its first GEMM plan while the
        backend's warm-up (``warm_cublaslt``) had loaded only float32's. GEMM kernels call
        this from their ``warm_up``, when the session creates them."""
        dt = np.dtype(dtype) if dtype is not None else None
        if dt not in self._cuda_type:
            return
        with self._lock:
            if dt in self._warmed:
                return
            self._warmed.add(dt)
        args = (self.L, self.ordinal, self._cuda_type[dt], self._compute[dt])
        threading.Thread(
            target=warm_gemm_type, args=args, name=f"onnxplug-gemm-warm-{dt}", daemon=True
        ).start()

    # per-call -------------------------------------------------------------------------------
    def __call__(
        self,
        ctx: Any,
        a: Any,
        b: Any,
        out: Any,
        *,
        trans_a: bool = False,
        trans_b: bool = False,
        alpha: float = 1.0,
        beta: float = 0.0,
        c: Any = None,
        bias: Any = None,
        epilogue: str | None = None,
        dtype: Any = None,
    ) -> None:
        dt = out.dtype if dtype is None else dtype
        if not isinstance(dt, np.dtype):
            dt = np.dtype(dt)
        if bias is not None:
            if not (epilogue or "").endswith("BIAS"):
                epilogue = {None: "BIAS", "RELU": "RELU_BIAS", "GELU": "GELU_BIAS"}[epilogue]
        elif epilogue is not None and epilogue.endswith("BIAS"):
            raise ValueError(f"GEMM epilogue {epilogue} needs a bias vector")
        if out.size == 0:
            return
        if c is not None and beta == 0:
            c = None
        full = (a, b, out, trans_a, trans_b, alpha, beta, c, bias, epilogue, dt)
        if bias is not None and _ptr(bias) % 16:
            if c is not None and c is not out:
                return self._fallback(*full)
            # cuBLASLt wants an aligned bias vector: broadcast it into the output and let the
            # GEMM accumulate onto it instead (C = D, beta = 1)
            out[...] = bias
            c, beta, bias = out, 1.0, None
            epilogue = {"BIAS": None, "RELU_BIAS": "RELU", "GELU_BIAS": "GELU"}[epilogue]
        if not a.flags.c_contiguous:
            a = self.xp.ascontiguousarray(a)
        if not b.flags.c_contiguous:
            b = self.xp.ascontiguousarray(b)
        mode = 0 if c is None else (2 if c is out else 1)
        if mode == 1 and (c.shape != out.shape or not c.flags.c_contiguous):
            return self._fallback(*full)
        gkey = (a.shape, b.shape, out.shape, trans_a, trans_b, mode, epilogue, dt)
        geo = self._geo.get(gkey, _MISSING)
        if geo is _MISSING:
            geo = self._geometry(gkey)
        if geo is None:
            return self._fallback(*full)
        try:
            self._run(ctx, geo, a, b, out, alpha, beta, c, bias)
        except Exception as e:  # no plan, or cuBLASLt refused the call: stay correct
            self._warn(f"cuBLASLt GEMM failed ({type(e).__name__}: {e}); using CuPy matmul")
            self._fallback(*full)
            return
        stats["cublaslt"] += 1

    def prepare(
        self,
        ctx: Any,
        a: Any,
        b: Any,
        out: Any,
        *,
        trans_a: bool = False,
        trans_b: bool = False,
        alpha: float = 1.0,
        beta: float = 0.0,
        c: Any = None,
        bias: Any = None,
        epilogue: str | None = None,
        dtype: Any = None,
    ) -> Any:
        """The prepared form of a call: one ``cublasLtMatmul`` per batch with its descriptor
        (of this node: the bias pointer is baked in, nothing is mutated per call), layouts,
        algorithm, scalars and a workspace of the frame's, all bound; None where the call
        would take another path (the caller then computes as usual)."""
        dt = np.dtype(out.dtype if dtype is None else dtype)
        if bias is not None and not (epilogue or "").endswith("BIAS"):
            epilogue = {None: "BIAS", "RELU": "RELU_BIAS", "GELU": "GELU_BIAS"}[epilogue]
        if out.size == 0 or (bias is not None and _ptr(bias) % 16):
            return None
        if c is not None and beta == 0:
            c = None
        if not (a.flags.c_contiguous and b.flags.c_contiguous and out.flags.c_contiguous):
            if c is not None or bias is not None or epilogue is not None:
                return None
            geo = self._strided_geometry(a, b, out, trans_a, trans_b, dt)
        else:
            mode = 0 if c is None else (2 if c is out else 1)
            if mode == 1 and (c.shape != out.shape or not c.flags.c_contiguous):
                return None
            gkey = (a.shape, b.shape, out.shape, trans_a, trans_b, mode, epilogue, dt)
            geo = self._geo.get(gkey, _MISSING)
            if geo is _MISSING:
                geo = self._geometry(gkey)
        if geo is None:
            return None
        ptrs = _pointers(a, b, out, c)
        bias_ptr = _ptr(bias) if bias is not None else 0
        sc = self._scalar_ptrs(geo, alpha, beta if c is not None else 0.0)
        timer = self._timer(ctx, geo, sc, ptrs)
        plan = self._build(ctx, (*geo.key, *_alignments(geo, ptrs)), bias_ptr, timer)  # its own
        ws_ptr = ctx.workspace(plan.ws) if plan.ws else 0  # the frame's, shared by calls
        calls = _call_args(ctx.stream, geo, plan, sc, ptrs, ws_ptr)
        matmul = self.L.matmul
        keep = (plan, sc)
        stats["cublaslt"] += 1
        if len(calls) == 1:
            (args,) = calls

            def one() -> None:
                matmul(*args)

            one.keep = keep  # type: ignore[attr-defined]
            return one

        def batches() -> None:
            for args in calls:
                matmul(*args)

        batches.keep = keep  # type: ignore[attr-defined]
        return batches

    def _scalar_ptrs(self, geo: _Geo, alpha: float, beta: float) -> tuple:
        """Host pointers to alpha and beta in the plan's scale type (kept for the process)."""
        sk = (geo.scale, alpha, beta)
        sc = self._scalars.get(sk)
        if sc is None:
            arrs = (np.array([alpha], geo.scale), np.array([beta], geo.scale))
            sc = self._scalars[sk] = (arrs[0].ctypes.data, arrs[1].ctypes.data, arrs)
        return sc

    def _fallback(self, a, b, out, trans_a, trans_b, alpha, beta, c, bias, epilogue, dt) -> None:
        stats["xp"] += 1
        xp_gemm(self.xp, a, b, out, trans_a, trans_b, alpha, beta, c, bias, epilogue, dt)

    def _warn(self, msg: str) -> None:
        if msg not in self._failed:
            self._failed.add(msg)
            warnings.warn(f"onnxplug-cuda: {msg}", RuntimeWarning, stacklevel=3)

    def _geometry(self, gkey: tuple) -> _Geo | None:
        """The shape-derived part of a call, computed once per signature (None: cuBLASLt does
        not apply, e.g. K == 0 or an unsupported dtype)."""
        sa_shape, sb_shape, out_shape, trans_a, trans_b, mode, epilogue, dt = gkey
        K = sa_shape[-2] if trans_a else sa_shape[-1]
        if K == 0 or dt not in self._cuda_type:
            self._geo[gkey] = None
            return None
        M, N = out_shape[-2], out_shape[-1]
        batch = out_shape[:-2]
        sa = _batch_strides(sa_shape, batch)
        sb = _batch_strides(sb_shape, batch)
        sd = _batch_strides(out_shape, batch)
        dims = [(n, x, y, z) for n, x, y, z in zip(batch, sa, sb, sd) if n != 1]
        # a's stored matrix (rows, cols): (M, K), or (K, M) when transposed
        ra, ca = sa_shape[-2], sa_shape[-1]
        rb, cb = sb_shape[-2], sb_shape[-1]
        count = 1
        stride_a = stride_b = stride_d = 0
        outer: list[tuple[int, int, int, int]] = []
        if (
            dims
            and all(x[2] == 0 for x in dims)
            and not trans_a
            and all(x[1] == x[3] // N * ca for x in dims)
        ):
            # B is shared by every batch and A's batches are contiguous: one tall GEMM
            for n, *_ in dims:
                ra *= n
            M_eff = ra
        else:
            M_eff = M
            j = len(dims)
            while j > 0:
                i = j - 1
                if i < len(dims) - 1:
                    nxt = dims[i + 1]
                    if not all(dims[i][k] == nxt[k] * nxt[0] for k in (1, 2, 3)):
                        break
                j = i
            inner, outer = dims[j:], dims[:j]
            if inner:
                for n, *_ in inner:
                    count *= n
                _, stride_a, stride_b, stride_d = inner[-1]
        isz = dt.itemsize
        geo = _Geo()
        # the alignment the batch strides allow, in cuBLASLt's operand order: B, A, C, D
        sal = [256, 256, 256, 256]
        steps = [(y, x, z, z) for _n, x, y, z in outer]
        if count > 1:
            steps.append((stride_b, stride_a, stride_d, stride_d))
        for step in steps:
            for k, st in enumerate(step):
                if st:
                    sal[k] = min(sal[k], _align(st * isz))
        geo.sal = tuple(sal)
        offsets = [(0, 0, 0)]
        for n, x, y, z in outer:
            offsets = [
                (o[0] + i * x * isz, o[1] + i * y * isz, o[2] + i * z * isz)
                for o in offsets
                for i in range(n)
            ]
        geo.offsets = tuple(offsets)
        geo.key = (
            dt,
            N,
            M_eff,
            ca if not trans_a else ra,
            trans_a,
            trans_b,
            ra,
            ca,
            rb,
            cb,
            count,
            stride_a,
            stride_b,
            stride_d,
            epilogue,
            mode,
            0,  # leading dimensions: dense
            0,
            0,
        )
        scale = np.float64 if dt == _F64 else np.float32
        geo.scale = scale
        geo.plans = {}
        with self._lock:
            if len(self._geo) > _MAX_PLANS:
                self._geo.clear()
            self._geo[gkey] = geo
        return geo

    def _strided_geometry(
        self, a: Any, b: Any, out: Any, trans_a: bool, trans_b: bool, dt: np.dtype
    ) -> _Geo | None:
        """A batch of row-strided matrices (prepared calls only): each operand a rank-3 view
        (batch, rows, cols) with unit column stride and any row and batch strides, as the heads
        of a packed (S, 3 * N * H) projection are; one strided-batched call, no copies. None
        where the views do not fit (another layout, a dtype cuBLASLt does not take here)."""
        isz = dt.itemsize
        ops = (a, b, out)
        if dt not in self._cuda_type or any(
            x.ndim != 3 or x.dtype.itemsize != isz or x.strides[-1] != isz for x in ops
        ):
            return None
        if any(st % isz or st < 0 for x in ops for st in x.strides):
            return None
        count = out.shape[0]
        if a.shape[0] != count or b.shape[0] != count:
            return None
        (s_a, ld_a), (s_b, ld_b), (s_d, ld_d) = (
            (x.strides[0] // isz, x.strides[1] // isz) for x in ops
        )
        ra, ca = a.shape[1:]
        rb, cb = b.shape[1:]
        M, N = out.shape[1:]
        K = ra if trans_a else ca
        if (rb if not trans_b else cb) != K or (ca if trans_a else ra) != M:
            return None
        if (rb if trans_b else cb) != N or ld_a < ca or ld_b < cb or ld_d < N or K == 0:
            return None
        geo = _Geo()
        # alignment the batch strides and leading dimensions allow, in cuBLASLt's order B, A, C, D
        sal = [min(_align(s * isz), _align(ld * isz)) for s, ld in ((s_b, ld_b), (s_a, ld_a))]
        sal += [min(_align(s_d * isz), _align(ld_d * isz))] * 2
        geo.sal = tuple(sal)
        geo.offsets = ((0, 0, 0),)
        geo.key = (dt, N, M, K, trans_a, trans_b, ra, ca, rb, cb, count, s_a, s_b, s_d, None, 0)
        geo.key += (ld_a, ld_b, ld_d)
        geo.scale = np.float64 if dt == _F64 else np.float32
        geo.plans = {}
        return geo

    def _run(
        self,
        ctx: Any,
        geo: _Geo,
        a: Any,
        b: Any,
        out: Any,
        alpha: float,
        beta: float,
        c: Any,
        bias: Any,
    ) -> None:
        ptrs = _pointers(a, b, out, c)
        al = _alignments(geo, ptrs)
        sc = self._scalar_ptrs(geo, alpha, beta if c is not None else 0.0)
        plan = geo.plans.get(al)
        if plan is None:
            timer = self._timer(ctx, geo, sc, ptrs)
            plan = self._plan(ctx, geo, al, _ptr(bias) if bias is not None else 0, timer)
        if plan is False:
            raise RuntimeError("cuBLASLt has no algorithm for this GEMM (cached)")
        L = self.L
        ws = ctx.scratch(plan.ws) if plan.ws else None
        ws_ptr = int(ws.ptr) if ws is not None else 0
        bias_ptr = _ptr(bias) if bias is not None else 0
        for args in _call_args(ctx.stream, geo, plan, sc, ptrs, ws_ptr):
            if bias is None:
                L.matmul(*args)
            else:
                with plan.lock:  # plans are shared by same-shaped nodes with other biases
                    if plan.bias != bias_ptr:
                        buf = ctypes.c_int64(bias_ptr)
                        L.matmul_desc_set_attribute(
                            plan.desc, self._bias_attr, ctypes.addressof(buf), 8
                        )
                        plan.bias = bias_ptr
                    L.matmul(*args)
        del ws  # released after the calls were enqueued: its free is ordered on the stream

    def _timer(self, ctx: Any, geo: _Geo, sc: tuple, ptrs: tuple) -> Any:
        """What times a GEMM's candidates on its real operands, for online tuning: a function
        of (plan, heuristic results, count) giving ms per call by candidate index; None where
        tuning is off or the call cannot be repeated harmlessly (it accumulates into its
        output, or its output is an operand)."""
        tuning = self.tuning
        if tuning is None or not tuning.tune:
            return None
        pa, pb, _, pd = ptrs
        if geo.key[15] == 2 or pd in (pa, pb):  # mode 2: D accumulates onto itself (C is D)
            return None
        L = self.L

        def time_candidates(plan: _LtPlan, results: Any, count: int, pad: int) -> dict:
            from .dnn import time_calls

            sizes = [_workspace(results, i, pad) for i in range(count)]
            ws = ctx.scratch(max(sizes)) if max(sizes) else None
            ws_ptr = int(ws.ptr) if ws is not None else 0
            calls = {}
            for i in range(count):
                cand = _Candidate(plan, results.ctypes.data + i * results.itemsize, sizes[i])
                argsets = _call_args(ctx.stream, geo, cand, sc, ptrs, ws_ptr)

                def call(argsets: list = argsets) -> None:
                    for args in argsets:
                        L.matmul(*args)

                calls[i] = call
            times = time_calls(ctx, calls, tuning.budget_ms)
            del ws  # freed after the timed calls were enqueued, in stream order
            return times

        return time_candidates

    def signature(self, key: tuple) -> tuple[str, str]:
        """A plan key as a tuning result's op and params signatures: the element and compute
        types (``LtGemm<float32,COMPUTE_32F_FAST_TF32>``), then the shape, transposes, batch,
        strides, epilogue, accumulation mode, row strides and pointer alignments."""
        dt = np.dtype(key[0])
        return f"LtGemm<{dt.name},{self._compute_name[dt]}>", "_".join(str(v) for v in key[1:])

    def _plan(
        self, ctx: Any, geo: _Geo, al: tuple, bias_ptr: int, timer: Any = None
    ) -> _LtPlan | bool:
        with self._lock:
            plan = geo.plans.get(al)
            if plan is not None:
                return plan
        try:
            plan = self._build(ctx, (*geo.key, *al), bias_ptr, timer)
        except Exception:
            plan = False  # remembered: later calls go straight to the fallback
            raise
        finally:
            with self._lock:
                geo.plans[al] = plan
        return plan

    def _build(self, ctx: Any, key: tuple, bias_ptr: int, timer: Any = None) -> _LtPlan:
        L = self.L
        (dt, m, n, k, trans_a, trans_b, ra, ca, rb, cb, count, s_a, s_b, s_d, epi, mode) = key[:16]
        ld_a, ld_b, ld_d = key[16:19]  # row strides in elements (0: dense)
        al = key[19:]  # pointer alignments of cuBLASLt's B, A, C, D
        cdt = self._cuda_type[dt]
        scale_type = _CUDA_R_64F if dt == _F64 else _CUDA_R_32F
        plan = _LtPlan(L)
        D = L.MatmulDescAttribute
        Y = L.MatrixLayoutAttribute
        P = L.MatmulPreferenceAttribute
        set_desc = L.matmul_desc_set_attribute
        desc_type = L.get_matmul_desc_attribute_dtype
        set_lay = L.matrix_layout_set_attribute
        lay_type = L.get_matrix_layout_attribute_dtype
        plan.desc = L.matmul_desc_create(self._compute[dt], scale_type)
        # the library's A is our B, its B is our A (see the module docstring)
        _set_attr(set_desc, desc_type, plan.desc, D.TRANSA, self._op_t if trans_b else self._op_n)
        _set_attr(set_desc, desc_type, plan.desc, D.TRANSB, self._op_t if trans_a else self._op_n)
        if epi:
            _set_attr(set_desc, desc_type, plan.desc, D.EPILOGUE, self._epilogue[epi])
            if bias_ptr:
                _set_attr(set_desc, desc_type, plan.desc, D.BIAS_POINTER, bias_ptr)
                plan.bias = bias_ptr

        def layout(rows: int, cols: int, ld: int, stride: int) -> int:
            lay = L.matrix_layout_create(cdt, rows, cols, ld)
            if count > 1:
                _set_attr(set_lay, lay_type, lay, Y.BATCH_COUNT, count)
                _set_attr(set_lay, lay_type, lay, Y.STRIDED_BATCH_OFFSET, stride)
            return lay

        # a stored row-major (r, c) matrix is the column-major (c, r) matrix with ld c
        plan.la = layout(cb, rb, ld_b or cb, s_b)
        plan.lb = layout(ca, ra, ld_a or ca, s_a)
        plan.ld = layout(m, n, ld_d or m, s_d)
        plan.lc = layout(m, n, m, s_d) if mode == 1 else plan.ld
        plan.pref = L.matmul_preference_create()
        set_pref = L.matmul_preference_set_attribute
        pref_type = L.get_matmul_preference_attribute_dtype
        _set_attr(set_pref, pref_type, plan.pref, P.MAX_WORKSPACE_BYTES, MAX_WORKSPACE)
        for attr, v in zip(
            (
                P.MIN_ALIGNMENT_A_BYTES,
                P.MIN_ALIGNMENT_B_BYTES,
                P.MIN_ALIGNMENT_C_BYTES,
                P.MIN_ALIGNMENT_D_BYTES,
            ),
            al,
        ):
            _set_attr(set_pref, pref_type, plan.pref, attr, v)
        results = np.zeros(8, dtype=L.matmul_heuristic_result_dtype)
        found = np.zeros(1, dtype=np.int32)
        L.matmul_algo_get_heuristic(
            ctx.stream.cublaslt,
            plan.desc,
            plan.la,
            plan.lb,
            plan.lc,
            plan.ld,
            plan.pref,
            len(results),
            results.ctypes.data,
            found.ctypes.data,
        )
        count = int(found[0])
        if count == 0:
            raise RuntimeError(f"no cuBLASLt algorithm for {key[1:]}")
        pad = 16 if epi else 0  # see _workspace
        index = 0  # the heuristic's first (best) result
        if self.tuning is not None and count > 1:
            run_timer = None if timer is None else (lambda: timer(plan, results, count, pad))
            op, params = self.signature(key)
            index = self.tuning.choose(op, params, count, run_timer, ctx.stream.is_capturing())
        plan.algo = results  # kept alive: the chosen result's algo struct is read in place
        plan.algo_ptr = results.ctypes.data + index * results.itemsize
        plan.ws = _workspace(results, index, pad)
        return plan


# ---------------------------------------------------------------------------------------------
# engine selection


def warm_cublaslt(modules: tuple[Any, ...], ordinal: int) -> None:
    """One heuristic query for a small float32 GEMM on device ``ordinal``: the process's first
    query loads cuBLASLt's heuristics (BERT-base's first run spent about 0.1 s building its
    first GEMM plans). Run on a helper thread after CuPy's import (``BackgroundImport.warm_up``,
    from the GPU backend), it overlaps the rest of the session's creation. Fresh processes on an
    H100, 6 per side: first run BERT-base 78-119 ms against 162-226, GPT-2 77-105 against
    187-326, ResNet-50 350-446 against 494-619, creation unchanged. Other element types are
    warmed when a session's GEMM kernels are made (``LtGemm.warm_up``)."""
    L, cublas = modules
    warm_gemm_type(L, ordinal, _CUDA_R_32F, int(cublas.ComputeType.COMPUTE_32F))


def warm_gemm_type(L: Any, ordinal: int, cuda_type: int, compute_type: int) -> None:
    """One heuristic query for a 64x64x64 GEMM of ``cuda_type`` computed in ``compute_type``
    on device ``ordinal``, with a handle of its own, on the calling (helper) thread. The
    library releases the interpreter lock while it works. The device's primary context is
    made current on the thread through the driver API (retained, as
    ``runtime.create_context_in_background`` does), not through a runtime binding. A warm-up
    only: errors are left to the first real query."""
    try:
        if not make_primary_context_current(ordinal):
            return
        scale_type = _CUDA_R_64F if cuda_type == _CUDA_R_64F else _CUDA_R_32F
        handle = L.create()
        desc = L.matmul_desc_create(compute_type, scale_type)
        lay = L.matrix_layout_create(cuda_type, 64, 64, 64)
        pref = L.matmul_preference_create()
        try:
            results = np.zeros(1, dtype=L.matmul_heuristic_result_dtype)
            found = np.zeros(1, dtype=np.int32)
            query = (handle, desc, lay, lay, lay, lay, pref, 1)
            L.matmul_algo_get_heuristic(*query, results.ctypes.data, found.ctypes.data)
            stats["warm_queries"] += 1
        finally:
            L.matmul_preference_destroy(pref)
            L.matrix_layout_destroy(lay)
            L.matmul_desc_destroy(desc)
            L.destroy(handle)
    except Exception:
        pass


# cuBLASLt's bindings (and cuBLAS's enums), what LtGemm and the streams' handles need
# ``import nvmath`` runs nvmath's package ``__init__``, which loads cuFFT, cuRAND, cuSOLVER,
# cuSPARSE and cuTENSOR and imports all of nvmath (0.5-0.8 s on an H100 host), and the
# bindings' package ``__init__`` imports every other binding: the modules are imported without
# them, on a thread started when the provider's GPU backend is made
NVMATH = BackgroundImport(
    "nvmath.bindings.cublasLt",
    "nvmath.bindings.cublas",
    skip_package_inits=True,
    warm=warm_cublaslt,
)


def cublaslt() -> Any:
    """nvmath's cuBLASLt bindings module."""
    return NVMATH.modules()[0]


_engines: dict[tuple, Any] = {}
_engines_lock = threading.Lock()
_HOST = HostGemm()
_warned_no_nvmath = False


def _tuning(ep: Any) -> GemmTuning:
    """The GEMM tuning of a provider's options (``tunable_op_enable`` set); its results are
    kept with cuDNN's in the tuning cache folder, per device, driver and cuBLASLt version."""
    from .cache import TuningCache, cache_folder, device_fingerprint
    from .tuning import tuning_results

    o = ep.options
    L, _ = NVMATH.modules()
    fingerprint = f"{device_fingerprint(ep.ordinal)} cublasLt {L.get_version()} timing 1"
    cache = TuningCache(cache_folder(o.tuning_cache_dir), fingerprint, prefix="cublaslt-gemm")
    return GemmTuning(
        bool(o.tunable_op_tuning_enable),
        float(o.tunable_op_max_tuning_duration_ms),
        cache,
        tuning_results(ep),
    )


def engine_key(ep: Any) -> tuple:
    """Which GEMM engine a provider instance shares (``_engines``): its device and the options
    that change how its GEMMs are planned."""
    o = ep.options
    tunable = bool(o.tunable_op_enable)
    key = (ep.ordinal, bool(o.use_tf32), tunable, bool(o.tunable_op_tuning_enable))
    return key + (int(o.tunable_op_max_tuning_duration_ms), o.tuning_cache_dir if tunable else None)


def engine_for(ep: Any) -> Any:
    """The GEMM engine of a provider instance: numpy under the simulation, cuBLASLt on the GPU,
    CuPy's matmul (with a warning, once) when nvmath-python cannot be imported."""
    global _warned_no_nvmath
    xp = ep.backend.xp
    if xp is np:
        return _HOST
    o = ep.options
    key = engine_key(ep)
    with _engines_lock:
        eng = _engines.get(key)
        if eng is None:
            try:
                tuning = _tuning(ep) if o.tunable_op_enable else None
                eng = LtGemm(xp, ep.ordinal, bool(o.use_tf32), tuning)
            except ImportError as e:
                if not _warned_no_nvmath:
                    _warned_no_nvmath = True
                    warnings.warn(
                        f"onnxplug-cuda: nvmath-python is not importable ({e}); MatMul/Gemm/Conv "
                        "fall back to CuPy's matmul, which is slower and cannot be captured in "
                        "CUDA graphs",
                        RuntimeWarning,
                        stacklevel=2,
                    )
                eng = XpGemm(xp)
            _engines[key] = eng
        return eng
