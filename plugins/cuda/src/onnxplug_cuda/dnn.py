"""Convolutions through the cuDNN frontend's graph API, with a graph cache and the provider's
options (algorithm search, TF32, workspace limit, 1-D layout).

``engine_for(ep)`` gives a ``CudnnConv`` on the GPU, or None (host simulation, ``enable_cudnn=0``,
or no importable ``cudnn``). ``CudnnConv.run(ctx, spec, x, w, b, y)`` computes a forward convolution
(``spec.kind == "fprop"``) or a ConvTranspose, which is cuDNN's data gradient ("dgrad"), with the
bias, residual and ReLU of ``spec`` in the same graph when it asks for them (``fuse_conv_bias``,
or, with ``spec.precompiled``, bias and ReLU on engines cuDNN ships compiled).
It returns False when cuDNN cannot do the case (no engine supports it, a pointer is misaligned,
negative pads): the kernel then runs the plain graph, or its own im2col + GEMM path, so results
are never wrong.

Graphs are built once per ``ConvSpec`` (shapes, geometry, dtype, fusion, options, device). A
graph that failed to build is remembered as unsupported. Tensors get fixed uids, and calls
use the frontend's ordered variant pack (``_execute_with_ptrs``: raw int pointers in uid order,
no dict) when the wheel has it; an autotuned graph runs its winner by index
(``_execute_plan_at_index``), since the ordered path runs the frontend's default candidate.

Algorithm search (``cudnn_conv_algo_search``), as in onnxruntime:
* EXHAUSTIVE: the first 4 plans of heuristics A then FALLBACK that build are timed once per
  graph on the real buffers (skipped while the stream captures a CUDA graph: the first is run),
  and the fastest is run; the winner is kept on disk (below). Each plan's time is that of 5
  back-to-back calls enqueued behind a spin kernel holding the GPU until the host has enqueued
  them all, so that it is GPU time only, as in a replayed graph, not the host's launch time of a
  call on an idle GPU. Four candidates, not eight: in ResNet-50's 43 graphs (H100, b1 float32,
  three processes) the fastest of the first four was within 0.3% of the fastest of eight
  (summed over the graphs), and the replayed GPU time at b1 and b32, float32 and float16,
  was within 1.2% of eight's (two runs; b1 lower, b32 0.2-1.2% higher).
* HEURISTIC: the first plan of heuristics A (then FALLBACK) that builds.
* DEFAULT: the FALLBACK heuristic's first plan (cuDNN's always-available engines).

The float16 fused-attention graphs (``SdpaSpec``) are searched the same way (EXHAUSTIVE: the
first 4 candidates timed; otherwise heuristics A's first plan): for BERT-base's and GPT-2's
shapes the heuristics' first plan clears a workspace word with a memset each call, and is
slower in a replayed graph than the fastest plan without one (``_build_sdpa``).

``use_tf32=0`` keeps float32 convolutions in float32. Engines carrying the TENSOR_CORE or
DOWN_CONVERT_INPUTS numerical notes are deselected before the support check: for float32 data,
tensor cores mean TF32. This is the filter PyTorch applies when ``allow_tf32`` is off
(aten/src/ATen/native/cudnn/Conv_v8.cpp, ``filterEngineConfigs``), done with the frontend's
``Graph::deselect_numeric_notes`` (include/cudnn_frontend/graph_interface.h, bound as
``pygraph.deselect_numeric_notes``). It must be called after ``create_execution_plans`` and
before ``check_support``: it marks plan candidates as barred (``Execution_plan_list``,
include/cudnn_frontend/plans.h).

An optional fusion (``run(..., plain=spec)``: bias and ReLU on a shipped engine, with
``fuse_conv_bias=0``) runs, in NCHW, only where its timed best plan is not slower than the plain
graph's plus the epilogue kernel it saves (``_epilogue_ms``); in NHWC it always runs. Timed on
an H100 (ResNet-50's 20 such convolutions, GPU time as below): in NCHW the fused engines took
6-35 µs where the plain ones took 4-34, and 8 of 20 fusions (b1 float32) and 19 of 20 (b1
float16) did not pay; in NHWC every fusion paid (80 of 80: b1 and b32, float32 and float16,
fused within 3 µs of the plain graph, which the 2-5 µs epilogue kernel then follows), so the
plain graphs are not built there: they were 20 of the 43 graphs a first run built. With the
changes to the search above, ResNet-50 b1's first run took 373-477 ms instead of 531-843 (seven
interleaved first processes each, two machine starts).

Autotune results are kept on disk (``TuningCache``): the winning plan of each graph and its time,
so that a later process builds that one plan instead of every candidate and times none. The file is per
device, driver, cuDNN and frontend version; its folder is the ``tuning_cache_dir`` option, else
``$ONNXPLUG_CACHE_DIR``, else ``~/.cache/onnxplug`` (``$XDG_CACHE_HOME``); ``off`` (or an empty
``$ONNXPLUG_CACHE_DIR``) turns it off. A cached plan that no longer matches (another candidate
list, another name) is ignored and the graph is tuned again.

The plan each graph runs is kept on disk too (``PlanCache``, beside the tuning cache, any search
mode, convolutions and attention): the frontend's serialized plan, which a later process
deserializes instead of building the graph, querying the heuristics and building the plan
(about 1 ms per ResNet-50 convolution instead of 4-7 ms on an H100's host; for a
runtime-compiled engine, ``fuse_conv_bias=1``, 4 ms instead of 80 ms of compilation). A
deserialized graph has that one plan, run as its default candidate; outputs are bit-identical
to the built plan's. An entry this cuDNN cannot load is built again and rewritten. EXHAUSTIVE
search keeps a plan only once it has timed its candidates (not a capture's untimed pick).

``cudnn_conv_use_max_workspace=0`` deselects plans needing more than 32 MiB, onnxruntime's
``AlgoSearchWorkspaceSize``. Workspaces come from the provider's allocator (``ctx.scratch``).
"""

from __future__ import annotations

import functools
import math
import sys
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .blas import BF16
from .cache import PlanCache, TuningCache, cache_folder, device_fingerprint
from .compiler import ship

# Calls per path (cuDNN graph vs the kernels' own im2col/col2im + GEMM), for tests and diagnostics.
# "fused": calls whose graph also did a bias, residual or ReLU (counted within "cudnn").
# "attention": fused attention (SDPA) graph calls.
# "fused_precompiled": those of them restricted to engines cuDNN ships compiled.
stats = {
    "cudnn": 0,
    "fallback": 0,
    "fused": 0,
    "fused_precompiled": 0,
    "tuning_cache_hits": 0,
    "plan_cache_hits": 0,
    "attention": 0,
}

LIMITED_WORKSPACE = 32 << 20
_MAX_GRAPHS = 512
_UID_X, _UID_W, _UID_B, _UID_Y, _UID_Z = 1, 2, 3, 4, 5
UID_Q, UID_K, UID_V, UID_O, UID_BIAS = 11, 12, 13, 14, 15  # an attention graph's tensors
_EXHAUSTIVE, _HEURISTIC, _DEFAULT = 0, 1, 2
_F64 = np.dtype(np.float64)
# EXHAUSTIVE search builds and times this many candidates, in the heuristics' order (each one
# costs a first run host time: building it, loading its kernels)
_TUNED_PLANS = 4
# EXHAUSTIVE search times this many back-to-back calls of each candidate, behind a hold of the
# GPU that the host releases once it has enqueued them all (a flag in pinned memory). The hold
# ends by itself after _HOLD_CAP_NS, and is lengthened when the host is slower than that.
_TIMED_CALLS = 5
_HOLD_CAP_NS = 100_000_000
# part of the tuning cache's fingerprint: results timed another way are tuned again
_TIMING_METHOD = 2


@dataclass(frozen=True)
class ConvSpec:
    """Everything a convolution graph depends on (the cache key, with the engine's options).

    For ``kind == "dgrad"`` (ConvTranspose), ``x`` is cuDNN's DY, ``w`` the filter
    (C_in, C_out / group, k...) and ``y`` its DX."""

    kind: str
    dtype: np.dtype
    x: tuple[int, ...]
    w: tuple[int, ...]
    y: tuple[int, ...]
    pads_begin: tuple[int, ...]
    pads_end: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    bias: bool = False
    residual: bool = False  # + Z, a tensor of y's shape (FusedConv's fourth input)
    relu: bool = False
    # X, Y and Z are NHWC and W is (M, kH, kW, C/group) in memory (the dims stay NCHW/OIHW)
    channels_last: bool = False
    # only engines cuDNN ships compiled (no RUNTIME_COMPILATION note): the bias and ReLU of a
    # fuse_conv_bias=0 convolution, fused where such an engine exists (none: the caller runs
    # the plain graph and its epilogue kernel, without a warning)
    precompiled: bool = False


@dataclass(frozen=True)
class SdpaSpec:
    """A fused attention graph (cuDNN's SDPA, flash attention): query, key and value as
    (B, N, S, H) views with element strides (read in place from a packed projection), the
    (B, N, S, Hv) output view, the dims of an optional dense (B or 1, N or 1, S, T) additive
    bias, causal masking (top-left aligned) and the scale of Q K^T."""

    dtype: np.dtype
    q: tuple[int, ...]
    k: tuple[int, ...]
    v: tuple[int, ...]
    q_stride: tuple[int, ...]
    k_stride: tuple[int, ...]
    v_stride: tuple[int, ...]
    o_stride: tuple[int, ...]
    bias: tuple[int, ...] | None
    causal: bool
    scale: float

    @classmethod
    def packed(
        cls,
        dims: tuple[int, int, int, int, int],
        total: int,
        bias: tuple[int, ...] | None,
        causal: bool,
        scale: float,
    ) -> SdpaSpec:
        """float16 attention reading the heads in place from a packed (B * S, total)
        projection (its Q, K and V columns side by side) and writing the context into a
        (B, S, N * Hv) output; ``dims`` is (B, N, S, H, Hv)."""
        b, n, s, h, hv = dims
        row = (s * total, h, total, 1)
        return cls(
            dtype=np.dtype(np.float16),
            q=(b, n, s, h),
            k=(b, n, s, h),
            v=(b, n, s, hv),
            q_stride=row,
            k_stride=row,
            v_stride=(s * total, hv, total, 1),
            o_stride=(s * n * hv, hv, n * hv, 1),
            bias=bias,
            causal=causal,
            scale=float(scale),
        )


def _contiguous(dims: list[int]) -> list[int]:
    out = [1] * len(dims)
    for i in range(len(dims) - 2, -1, -1):
        out[i] = out[i + 1] * max(dims[i + 1], 1)
    return out


def _strides(dims: list[int], channels_last: bool) -> list[int]:
    """Element strides of a dense tensor of NCHW-ordered ``dims``, laid out NCHW or NHWC."""
    if not channels_last:
        return _contiguous(dims)
    out = [1] * len(dims)
    acc = max(dims[1], 1)
    for i in range(len(dims) - 1, 1, -1):
        out[i] = acc
        acc *= max(dims[i], 1)
    out[0] = acc
    return out


def import_cudnn() -> Any:
    """The cuDNN frontend, imported without importing torch: its ``cudnn/wrapper.py`` (1.25)
    imports torch eagerly when it is installed, which made a session's creation seconds slower
    in a process without torch; the graph API used here never needs it. torch is blocked only
    during that import (``wrapper`` then sees it missing, as its own ``except ImportError``
    allows) and imports normally afterwards; a process that has torch already is unaffected."""
    if "cudnn" in sys.modules or "torch" in sys.modules:
        import cudnn

        return cudnn
    sys.modules["torch"] = None  # type: ignore[assignment]  # "import torch" raises ImportError
    try:
        import cudnn
    finally:
        if "torch" in sys.modules and sys.modules["torch"] is None:
            del sys.modules["torch"]
    return cudnn


class _Graph:
    __slots__ = ("best", "graph", "ms", "order", "ordered", "ws")

    def __init__(
        self,
        graph: Any,
        ws: int,
        best: int | None,
        order: list[int] | None,
        ms: float | None = None,
    ):
        self.graph = graph
        self.ws = ws
        self.best = best  # the autotuned plan, run by index; None: the default plan
        self.order = order  # uid order of the ordered variant pack; None: the dict path
        self.ordered = order is not None
        self.ms = ms  # the best plan's time per call, where EXHAUSTIVE search timed it


def sdpa_graph(cudnn: Any, spec: SdpaSpec, io: Any, handle: Any) -> Any:
    """``spec``'s SDPA graph in storage type ``io`` (a cuDNN data type) on cuDNN ``handle``,
    its candidate plans listed in the heuristics' order and checked, none built yet."""
    f32 = cudnn.data_type.FLOAT
    g = cudnn.pygraph(
        io_data_type=io, intermediate_data_type=f32, compute_data_type=f32, handle=handle
    )
    q = g.tensor(name="Q", dim=list(spec.q), stride=list(spec.q_stride), data_type=io)
    k = g.tensor(name="K", dim=list(spec.k), stride=list(spec.k_stride), data_type=io)
    v = g.tensor(name="V", dim=list(spec.v), stride=list(spec.v_stride), data_type=io)
    q.set_uid(UID_Q)
    k.set_uid(UID_K)
    v.set_uid(UID_V)
    kw: dict[str, Any] = {}
    if spec.bias is not None:
        bd = list(spec.bias)
        bias = g.tensor(name="BIAS", dim=bd, stride=_contiguous(bd), data_type=io)
        bias.set_uid(UID_BIAS)
        kw["bias"] = bias
    if spec.causal:
        kw["diagonal_alignment"] = cudnn.diagonal_alignment.TOP_LEFT
        kw["diagonal_band_right_bound"] = 0
    o, _stats = g.sdpa(
        name="sdpa", q=q, k=k, v=v, generate_stats=False, attn_scale=spec.scale, **kw
    )
    o.set_output(True)
    o.set_dim([spec.q[0], spec.q[1], spec.q[2], spec.v[3]])
    o.set_stride(list(spec.o_stride))
    o.set_data_type(io)
    o.set_uid(UID_O)
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    return g


class CudnnConv:
    """cuDNN frontend graphs for Conv/ConvTranspose on one device, with the EP's options."""

    def __init__(self, ep: Any):
        cudnn = import_cudnn()
        self.cudnn = cudnn
        o = ep.options
        self.ordinal = ep.ordinal
        self.algo = int(o.cudnn_conv_algo_search)
        self.use_tf32 = bool(o.use_tf32)
        self.max_workspace = bool(o.cudnn_conv_use_max_workspace)
        self.nc1d = bool(o.cudnn_conv1d_pad_to_nc1d)
        dt = cudnn.data_type
        self._io = {
            np.dtype(np.float32): dt.FLOAT,
            np.dtype(np.float16): dt.HALF,
            np.dtype(np.float64): dt.DOUBLE,
        }
        if BF16 is not None:
            self._io[BF16] = dt.BFLOAT16
        self._graphs: OrderedDict[tuple, _Graph | None] = OrderedDict()
        folder, fingerprint = cache_folder(o.tuning_cache_dir), _fingerprint(cudnn, ep.ordinal)
        self.cache = TuningCache(folder, fingerprint)
        self.plans = PlanCache(folder, fingerprint)
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        self._pays: dict[ConvSpec, bool] = {}  # optional fusions: does the fused graph pay

    def warm_up(self, kernel: Any) -> None:
        """A convolution kernel's ``warm_up``: EXHAUSTIVE search times its candidates behind
        the hold kernel, compiled in the background meanwhile."""
        if self.algo == _EXHAUSTIVE:
            kernel.precompile(*HOLD_KERNEL)

    def _warn(self, msg: str) -> None:
        if msg not in self._warned:
            self._warned.add(msg)
            warnings.warn(f"onnxplug-cuda: {msg}", RuntimeWarning, stacklevel=3)

    # per call ---------------------------------------------------------------------------------
    def run(
        self,
        ctx: Any,
        spec: ConvSpec,
        x: Any,
        w: Any,
        b: Any,
        y: Any,
        z: Any = None,
        plain: ConvSpec | None = None,
    ) -> bool:
        """Run ``spec``'s graph on cuDNN (with its bias ``b`` and residual ``z`` when it has
        them); False when cuDNN cannot (the caller does it another way). With ``plain`` (the
        same convolution without its fused steps) the fused graph runs only where it is not
        slower than ``plain``'s graph and the epilogue kernel it saves, by EXHAUSTIVE search's
        timings (False otherwise: the caller runs ``plain`` and the epilogue)."""
        if spec.dtype == _F64:
            # float64 convolution graphs without a pointwise op compute wrong values on
            # cuDNN 9.19 + frontend 1.25 (H100; every algorithm mode, errors of 10 to 1e295,
            # scripts/debug/conv64.py): float64 takes the GEMM path, which is exact.
            return False
        ptrs = {_UID_X: int(x.data.ptr), _UID_W: int(w.data.ptr), _UID_Y: int(y.data.ptr)}
        if spec.bias:
            ptrs[_UID_B] = int(b.data.ptr)
        if spec.residual:
            ptrs[_UID_Z] = int(z.data.ptr)
        if any(p % 16 for p in ptrs.values()):
            return False  # engines assume 16-byte aligned tensors
        if plain is not None and not self._fusion_pays(ctx, spec, plain, ptrs):
            return False
        if not self._execute(ctx, spec, ptrs):
            return False
        if spec.bias or spec.residual or spec.relu:
            stats["fused"] += 1
            if spec.precompiled:
                stats["fused_precompiled"] += 1
        return True

    def _fusion_pays(self, ctx: Any, spec: ConvSpec, plain: ConvSpec, ptrs: dict[int, int]) -> bool:
        """Whether ``spec``'s fused graph takes at most the time of ``plain``'s graph and an
        epilogue kernel (True where either graph was not timed, and in NHWC: see the module's
        docstring). Decided once per spec."""
        pays = self._pays.get(spec)
        if pays is not None:
            return pays
        fused = self._graph(ctx, spec, ptrs)
        pays = fused is not None
        if fused is not None and fused.ms is not None and not spec.channels_last:
            base = self._graph(ctx, plain, {u: ptrs[u] for u in (_UID_X, _UID_W, _UID_Y)})
            if base is not None and base.ms is not None:
                pays = fused.ms <= base.ms + _epilogue_ms(spec)
        self._pays[spec] = pays
        return pays

    def _graph(self, ctx: Any, spec: ConvSpec, ptrs: dict[int, int]) -> _Graph | None:
        key = (self.ordinal, spec)
        g = self._graphs.get(key, _MISSING)
        return self._get(ctx, key, ptrs) if g is _MISSING else g

    def _execute(self, ctx: Any, spec: ConvSpec, ptrs: dict[int, int]) -> bool:
        g = self._graph(ctx, spec, ptrs)
        if g is None:
            return False
        try:
            ws = ctx.scratch(g.ws) if g.ws else None
        except Exception:  # no memory for this plan's workspace now: this call falls back
            return False
        ws_ptr = int(ws.ptr) if ws is not None else 0
        try:
            handle = ctx.stream.cudnn
            if g.ordered:
                g.graph._execute_with_ptrs([ptrs[u] for u in g.order], ws_ptr, handle)
            elif g.best is not None:
                g.graph._execute_plan_at_index(ptrs, ws_ptr, g.best, handle)
            else:
                g.graph._execute(ptrs, ws_ptr, handle)
        except Exception as e:
            if ctx.stream.capture_invalidated():
                raise  # a failed capture, not a plan that cannot run: see _get
            self._warn(f"cuDNN convolution failed to execute ({e}); using the GEMM fallback")
            with self._lock:
                self._graphs[(self.ordinal, spec)] = None
            return False
        del ws  # freed after the call was enqueued: the free is ordered on the stream
        stats["cudnn"] += 1
        return True

    def attention(
        self, ctx: Any, spec: SdpaSpec, ptrs: dict[int, int], workspace: Any = None
    ) -> Any:
        """A call running ``spec``'s SDPA graph on ``ptrs`` (by uid) on the context's stream,
        with a workspace of the frame's (``ctx.workspace``; ``workspace(nbytes) -> address``
        instead, for an unprepared run): the prepared form of a fused attention. None where
        cuDNN cannot (the attention kernel then takes its GEMM path)."""
        if spec.dtype not in (np.dtype(np.float16), BF16) or any(p % 16 for p in ptrs.values()):
            return None
        g = self._graph(ctx, spec, ptrs)
        if g is None:
            return None
        ws_ptr = (workspace or ctx.workspace)(g.ws) if g.ws else 0
        handle = ctx.stream.cudnn
        if g.ordered:
            fn, args = g.graph._execute_with_ptrs, ([ptrs[u] for u in g.order], ws_ptr, handle)
        elif g.best is not None:
            fn, args = g.graph._execute_plan_at_index, (dict(ptrs), ws_ptr, g.best, handle)
        else:
            fn, args = g.graph._execute, (dict(ptrs), ws_ptr, handle)

        def call() -> None:
            fn(*args)
            stats["attention"] += 1

        call.keep = g  # type: ignore[attr-defined]
        return call

    # graph building -----------------------------------------------------------------------------
    def _get(self, ctx: Any, key: tuple, ptrs: dict[int, int]) -> _Graph | None:
        with self._lock:
            g = self._graphs.get(key, _MISSING)
            if g is not _MISSING:
                return g
        spec = key[1]
        try:
            if isinstance(spec, SdpaSpec):
                g = self._build_sdpa(ctx, spec, ptrs)
            else:
                g = self._build(ctx, spec, ptrs)
        except Exception as e:
            if ctx.stream.capture_invalidated():
                # In a capture that an error has invalidated (this call's or an earlier one's)
                # every call fails, which says nothing about cuDNN and this graph: nothing is
                # recorded, the capture fails and the run goes on eagerly, building it there.
                # (Recorded, it once put a 1x1 convolution of ResNet-50 on the GEMM path for
                # the rest of the process, after an execution failed in 8 threads' captures.)
                raise
            if not getattr(spec, "precompiled", False):  # an optional fusion fails quietly
                what = (
                    f"attention {spec.dtype} q{list(spec.q)} v{list(spec.v)}"
                    if isinstance(spec, SdpaSpec)
                    else f"{spec.kind} {spec.dtype} x{list(spec.x)} w{list(spec.w)}"
                )
                self._warn(
                    f"cuDNN cannot run {what} ({type(e).__name__}: {str(e).strip()[:300]}); "
                    "using the GEMM path"
                )
            g = None
        with self._lock:
            self._graphs[key] = g
            while len(self._graphs) > _MAX_GRAPHS:
                self._graphs.popitem(last=False)
        return g

    def _dims(self, spec: ConvSpec) -> tuple[list[int], ...]:
        """Dims and geometry for cuDNN: 1-D becomes 2-D with a unit dim, [N, C, L, 1] or with
        ``cudnn_conv1d_pad_to_nc1d`` [N, C, 1, L] (the memory layout is the same)."""
        xd, wd, yd = list(spec.x), list(spec.w), list(spec.y)
        pb, pe = list(spec.pads_begin), list(spec.pads_end)
        st, dl = list(spec.strides), list(spec.dilations)
        if len(xd) == 3:
            if self.nc1d:
                xd, wd, yd = (d[:2] + [1] + d[2:] for d in (xd, wd, yd))
                pb, pe, st, dl = [0] + pb, [0] + pe, [1] + st, [1] + dl
            else:
                xd, wd, yd = (d + [1] for d in (xd, wd, yd))
                pb, pe, st, dl = pb + [0], pe + [0], st + [1], dl + [1]
        return xd, wd, yd, pb, pe, st, dl

    def _build(self, ctx: Any, spec: ConvSpec, ptrs: dict[int, int]) -> _Graph:
        cudnn = self.cudnn
        if min(spec.pads_begin + spec.pads_end, default=0) < 0:
            raise ValueError("negative pads (ConvTranspose output_shape beyond the full output)")
        key = repr((spec, self.use_tf32, self.max_workspace, self.nc1d))
        plan_key = repr((self.algo, key))
        loaded = self._load_plan(ctx, plan_key, ptrs)
        if loaded is not None:
            return loaded
        io = self._io[spec.dtype]
        f64 = spec.dtype == np.dtype(np.float64)
        comp = cudnn.data_type.DOUBLE if f64 else cudnn.data_type.FLOAT
        handle = ctx.stream.cudnn
        xd, wd, yd, pb, pe, st, dl = self._dims(spec)
        g = cudnn.pygraph(
            io_data_type=io, intermediate_data_type=comp, compute_data_type=comp, handle=handle
        )
        cl = spec.channels_last
        X = g.tensor(name="X", dim=xd, stride=_strides(xd, cl), data_type=io, uid=_UID_X)
        W = g.tensor(name="W", dim=wd, stride=_strides(wd, cl), data_type=io, uid=_UID_W)
        geometry = dict(pre_padding=pb, post_padding=pe, stride=st, dilation=dl)
        if spec.kind == "fprop":
            out = g.conv_fprop(image=X, weight=W, compute_data_type=comp, name="conv", **geometry)
        else:
            out = g.conv_dgrad(loss=X, filter=W, compute_data_type=comp, name="dgrad", **geometry)
        # Every tensor gets explicit dims and strides (NCHW, or NHWC for channels_last): the
        # frontend would infer NHWC strides.
        ystride = _strides(yd, cl)
        out.set_dim(yd)
        out.set_stride(ystride)
        if spec.bias:
            bd = [1, yd[1]] + [1] * (len(yd) - 2)
            B = g.tensor(name="B", dim=bd, stride=_contiguous(bd), data_type=io, uid=_UID_B)
            out = g.bias(input=out, bias=B, compute_data_type=comp, name="bias")
            out.set_dim(yd)
            out.set_stride(ystride)
        if spec.residual:
            Z = g.tensor(name="Z", dim=yd, stride=ystride, data_type=io, uid=_UID_Z)
            out = g.add(a=out, b=Z, compute_data_type=comp, name="residual")
            out.set_dim(yd)
            out.set_stride(ystride)
        if spec.relu:
            out = g.relu(input=out, compute_data_type=comp, name="relu")
            out.set_dim(yd)
            out.set_stride(ystride)
        out.set_output(True)
        out.set_uid(_UID_Y)
        out.set_data_type(io)
        g.validate()
        g.build_operation_graph()
        if self.algo == _DEFAULT:
            modes = [cudnn.heur_mode.FALLBACK]
        else:
            modes = [cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK]
        g.create_execution_plans(modes)
        if spec.precompiled:
            g.deselect_behavior_notes([cudnn.behavior_note.RUNTIME_COMPILATION])
        if spec.dtype == np.dtype(np.float32) and not self.use_tf32:
            notes = cudnn.numerical_note
            g.deselect_numeric_notes([notes.TENSOR_CORE, notes.DOWN_CONVERT_INPUTS])
        if not self.max_workspace:
            g.deselect_workspace_greater_than(LIMITED_WORKSPACE)
        g.check_support()
        return self._choose_plan(ctx, g, key, plan_key, ptrs)

    def _choose_plan(
        self, ctx: Any, g: Any, key: str, plan_key: str, ptrs: dict[int, int]
    ) -> _Graph:
        """The plan ``g`` runs, of its checked candidates: with EXHAUSTIVE search the tuning
        cache's, else the fastest of the first ``_TUNED_PLANS`` that build, timed on ``ptrs``
        (and remembered); otherwise the heuristics' choice. Kept in the plan cache."""
        cudnn = self.cudnn
        exhaustive = self.algo == _EXHAUSTIVE
        best, ms = self._cached_plan(g, key) if exhaustive else (None, None)
        chosen = True  # False: EXHAUSTIVE search could not time its candidates (capturing)
        if best is None and exhaustive:
            built = _build_candidates(g, _TUNED_PLANS)
            best, chosen = built[0], len(built) == 1
            if len(built) > 1 and not ctx.stream.is_capturing():
                times = _time_plans(ctx, g, ptrs, built)
                fastest = min(times, key=times.__getitem__, default=None)
                if fastest is not None and times[fastest] < math.inf:
                    best, ms, chosen = fastest, times[fastest], True
                    self._remember(g, key, best, ms)
        elif best is None:
            g.build_plans(cudnn.build_plan_policy.HEURISTICS_CHOICE)
        ws = int(g.get_workspace_size())
        if best is not None:
            ws = max(ws, int(g.get_workspace_size_plan_at_index(best)))
        if chosen:
            self._save_plan(plan_key, g, best, ms)
        return _Graph(g, ws, best, _variant_order(g, ptrs) if best is None else None, ms)

    def _build_sdpa(self, ctx: Any, spec: SdpaSpec, ptrs: dict[int, int]) -> _Graph:
        # The search matters here as for convolutions: for float16 BERT-base's attention
        # (H100, cuDNN 9.19) the heuristics' first plan takes a 256-byte workspace that each
        # call clears with a memset, 90 µs for 12 calls in a replayed graph against 76 µs for
        # the fastest plan without (scripts/debug/sdpa_plans.py), and a memset node makes
        # the driver launch the whole graph the slow way (20 µs of host time against 2 µs).
        key = repr(spec)
        plan_key = repr((self.algo, key))
        loaded = self._load_plan(ctx, plan_key, ptrs)
        if loaded is not None:
            return loaded
        g = sdpa_graph(self.cudnn, spec, self._io[spec.dtype], ctx.stream.cudnn)
        return self._choose_plan(ctx, g, key, plan_key, ptrs)

    def _load_plan(self, ctx: Any, key: str, ptrs: dict[int, int]) -> _Graph | None:
        """The graph of ``key`` deserialized from the plan cache (its one plan, run as the
        default candidate), or None: no entry, or one this cuDNN cannot load (it is built
        again, and the entry rewritten)."""
        hit = self.plans.get(key)
        if hit is None:
            return None
        blob, ms = hit
        try:
            g = self.cudnn.pygraph(handle=ctx.stream.cudnn)
            g.deserialize(list(blob))  # the binding takes the bytes as a list of ints
            ws = int(g.get_workspace_size())
        except Exception:
            return None
        stats["plan_cache_hits"] += 1
        return _Graph(g, ws, None, _variant_order(g, ptrs), ms)

    def _save_plan(self, key: str, g: Any, best: int | None, ms: float | None) -> None:
        """Keep the plan ``g`` runs (``best``, else its default candidate) in the plan cache."""
        if self.plans.folder is None:
            return
        try:
            if best is not None:
                g.build_plan_at_index(best)  # built already: this makes it what serialize writes
            blob = bytes(g.serialize())
        except Exception:
            return  # a plan without a serialized form is built again by the next process
        self.plans.put(key, blob, ms)

    def _cached_plan(self, g: Any, key: str) -> tuple[int | None, float | None]:
        """The tuning cache's plan for this graph, built (the only plan built), and its time
        per call in ms; (None, None) when the cache has none or it does not match this graph's
        candidates."""
        hit = self.cache.get(key)
        if not isinstance(hit, list) or len(hit) != 4:
            return None, None
        index, count, name, ms = hit
        try:
            if g.get_execution_plan_count() != count:
                return None, None
            g.build_plan_at_index(index)
            if g.get_plan_name_at_index(index) != name:
                return None, None
        except Exception:
            return None, None
        stats["tuning_cache_hits"] += 1
        return int(index), float(ms)

    def _remember(self, g: Any, key: str, best: int, ms: float) -> None:
        try:
            name = g.get_plan_name_at_index(best)
            self.cache.put(key, [best, int(g.get_execution_plan_count()), str(name), ms])
        except Exception:
            pass  # a plan without a name is tuned again in the next process


def _time_plans(ctx: Any, g: Any, ptrs: dict[int, int], built: list[int]) -> dict[int, float]:
    """EXHAUSTIVE search: the GPU time per call in ms of each built plan of ``g`` that ran on
    the real buffers (inf where a timed call failed)."""
    sizes = {}
    for i in built:
        try:
            sizes[i] = int(g.get_workspace_size_plan_at_index(i))
        except Exception:
            continue
    ws = None
    for cap in (None, 256 << 20, LIMITED_WORKSPACE, 0):
        if cap is not None:
            sizes = {i: n for i, n in sizes.items() if n <= cap}
        if not sizes:
            return {}
        try:
            need = max(sizes.values())
            ws = ctx.scratch(need) if need else None
            break
        except Exception:  # out of memory: time only the plans with smaller workspaces
            continue
    ws_ptr = int(ws.ptr) if ws is not None else 0
    handle = ctx.stream.cudnn
    calls = {i: functools.partial(g._execute_plan_at_index, ptrs, ws_ptr, i, handle) for i in sizes}
    times = time_calls(ctx, calls)
    del ws
    return times


def time_calls(
    ctx: Any, calls: dict[int, Callable[[], None]], budget_ms: float = 0.0
) -> dict[int, float]:
    """The GPU time per call in ms of each candidate call on the context's stream (inf where a
    timed call failed; left out where its first, untimed call failed, or, with ``budget_ms``,
    once the host had spent that long enqueueing the candidates before it)."""
    import cupy

    stream = ctx.stream.cupy_stream
    usable = []
    for i, call in calls.items():  # a first call each, untimed: it loads the kernels (host time)
        try:
            call()
        except Exception:
            continue
        usable.append(i)
    times: dict[int, float] = {}
    release = cupy.cuda.alloc_pinned_memory(4)  # the host's "all enqueued" flag for the GPU
    flag = np.frombuffer(release, np.uint32, 1)
    cap_ns = _HOLD_CAP_NS
    for _ in range(4):
        # The GPU is held by a spin kernel while every candidate's calls are enqueued, so
        # the events time the calls back to back as a replayed graph runs them. Timed one
        # by one on an idle GPU, a call's time included the host's launch of it: in
        # ResNet-50 b1 float16 (H100) the host took 15 us per call (median) and the fastest
        # plans 6.2 us; 30 of 43 picks changed, and the picks' GPU time fell from 326 to
        # 294 us (scripts/debug/conv_timing.py). The host releases the hold when done:
        # a fixed hold (2 ms) left the GPU idle for most of it, in each graph's search.
        marks = []
        flag[0] = 0
        t0 = time.perf_counter()
        _hold_gpu(ctx.stream.handle, cap_ns, release.ptr)
        try:
            for i in usable:
                if budget_ms and marks and (time.perf_counter() - t0) * 1e3 > budget_ms:
                    break
                start, end = cupy.cuda.Event(), cupy.cuda.Event()
                marks.append((i, start, end))
                start.record(stream)
                try:
                    for _ in range(_TIMED_CALLS):
                        calls[i]()
                except Exception:
                    times[i] = math.inf
                end.record(stream)
        finally:
            host_ns = (time.perf_counter() - t0) * 1e9
            flag[0] = 1
        stream.synchronize()
        for i, start, end in marks:
            if times.get(i) != math.inf:
                times[i] = cupy.cuda.get_elapsed_time(start, end) / _TIMED_CALLS
        if host_ns < cap_ns:
            break
        cap_ns = 2 * host_ns  # the hold ended before the host was done: time again
    return times


_HOLD_SRC = r"""
extern "C" __global__ void oxd_hold(const volatile unsigned int* release, unsigned long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        if (release != 0 && *release != 0) break;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
}
"""


HOLD_KERNEL = ("oxd_hold", lambda: _HOLD_SRC)  # (name, source)
ship(lambda: [HOLD_KERNEL])


def _hold_gpu(stream: int, ns: float, release: int = 0) -> None:
    """Keep ``stream`` busy for about ``ns`` nanoseconds (one thread spinning on the GPU's
    global timer), so that work enqueued behind it runs back to back; with ``release`` (the
    address of a uint32 in pinned host memory), only until the host sets it."""
    import cupy

    from .compiler import compiled_function
    from .launch import function_launch

    kernel = compiled_function(cupy, *HOLD_KERNEL)
    args = (np.uint64(int(release)), np.uint64(int(ns)))
    function_launch(kernel, (1,), (1,), args, stream)()


def _epilogue_ms(spec: ConvSpec) -> float:
    """What the epilogue kernel a fusion saves costs, in ms: about 2 µs at small sizes on an
    H100 (measured 1.7-2.1 µs per launch inside a replayed ResNet-50 b1 graph), plus reading
    and writing the output at 2 TB/s."""
    nbytes = math.prod(spec.y) * spec.dtype.itemsize
    return 2e-3 + 2 * nbytes / 2e9


def _variant_order(g: Any, ptrs: dict[int, int]) -> list[int] | None:
    """The uid order of the frontend's ordered variant pack (``_execute_with_ptrs``: raw
    pointers in a list, no dict per call) for a graph running its default plan; None where
    the wheel lacks it or its uids are not ``ptrs``'s."""
    if not hasattr(g, "_execute_with_ptrs"):
        return None
    try:
        if hasattr(g, "_prepare_variant_pack_template"):
            g._prepare_variant_pack_template()
        uids = [int(u) for u in g._get_variant_pack_uids_sorted()]
    except Exception:
        return None
    return uids if sorted(uids) == sorted(ptrs) else None


def _build_candidates(g: Any, limit: int) -> list[int]:
    """Build up to ``limit`` plans of ``g``'s candidates in order (skipping those that do not
    build); their indices."""
    built: list[int] = []
    for i in range(g.get_execution_plan_count()):
        try:
            g.build_plan_at_index(i)
        except Exception:
            continue
        built.append(i)
        if len(built) == limit:
            break
    if not built:
        raise RuntimeError("no execution plan of the graph builds")
    return built


def _fingerprint(cudnn: Any, ordinal: int) -> str:
    """What a tuning result depends on besides the graph: device, driver and library versions."""
    return (
        f"{device_fingerprint(ordinal)} cudnn {cudnn.backend_version()}"
        f" frontend {getattr(cudnn, '__version__', '?')} timing {_TIMING_METHOD}"
    )


# The kinds of float16 fused-attention graph whose kernels the driver compiles separately from
# the PTX cuDNN loads (H100, cuDNN 9.19, a fresh JIT cache, each graph built in a process of
# its own): the mask (none, an additive bias, causal) and the head size (64; 32 and 80 reused
# its kernels, 128 did not) each took 0.6-0.9 s; batch, head count, layout and scale never
# mattered; the sequence length did, by how it divides. Without a bias, or causal, 77 and 250
# compiled their own kernels after 128's (0.62-0.73 s); with 77's built too, 30, 64, 98, 100,
# 250 and 512 reused them. With a bias, after 128 and 77 were
# built, 512 and the odd 33, 127, 129 and 255 reused their kernels while 8, 64, 96, 100, 112,
# 120, 136 and 192 compiled their own (0.64-1.05 s); with 96 and 100 built too, multiples of 8
# (8 ... 200) and of 4 (36, 52) reused kernels, and 30, 98 and 250 (twice an odd number) did
# only once 98 was built. ``build_kernels`` builds one graph of each kind at install (18 kinds,
# 5.5 s in 4 processes); after it, every length probed reused kernels (66-170 ms).
ATTENTION_KINDS = (
    *((mask, head, seq) for mask in ("none", "causal") for head in (64, 128) for seq in (128, 77)),
    *(("bias", head, seq) for head in (64, 128) for seq in (128, 96, 100, 98, 77)),
)


def build_attention_kind(ordinal: int, mask: str, head: int, seq: int) -> None:
    """Build one float16 fused-attention graph of a kind of ``ATTENTION_KINDS`` on device
    ``ordinal`` (two heads read in place from a packed projection, as the attention kernels
    ask): building the candidate plans EXHAUSTIVE search times has the driver compile their
    kernels into its JIT cache (``~/.nv/ComputeCache``, ``CUDA_CACHE_PATH``), which a
    machine's first process would otherwise wait for in its first run. Raises what the build
    raises."""
    import cupy

    cudnn = import_cudnn()
    heads = 2
    bias = (1, 1, seq, seq) if mask == "bias" else None
    spec = SdpaSpec.packed(
        (1, heads, seq, head, head), 6 * head, bias, mask == "causal", head**-0.5
    )
    with cupy.cuda.Device(ordinal):
        handle = cudnn.create_handle()
        try:
            # the candidates EXHAUSTIVE search builds: each plan's kernels are compiled
            _build_candidates(sdpa_graph(cudnn, spec, cudnn.data_type.HALF, handle), _TUNED_PLANS)
        finally:
            cudnn.destroy_handle(handle)


_MISSING = object()
_engines: dict[tuple, CudnnConv] = {}
_engines_lock = threading.Lock()
_warned_import = False


def engine_for(ep: Any) -> CudnnConv | None:
    """The cuDNN engine of a provider instance, or None where cuDNN is not to be used."""
    global _warned_import
    if ep.backend.xp is np or not ep.options.enable_cudnn:
        return None
    o = ep.options
    key = (
        ep.ordinal,
        o.cudnn_conv_algo_search,
        o.use_tf32,
        o.cudnn_conv_use_max_workspace,
        o.cudnn_conv1d_pad_to_nc1d,
    )
    with _engines_lock:
        eng = _engines.get(key)
        if eng is None:
            try:
                eng = CudnnConv(ep)
            except ImportError as e:
                if not _warned_import:
                    _warned_import = True
                    warnings.warn(
                        f"onnxplug-cuda: the cuDNN frontend is not importable ({e}); "
                        "convolutions use the im2col + GEMM fallback",
                        RuntimeWarning,
                        stacklevel=2,
                    )
                return None
            _engines[key] = eng
        return eng
