"""Resize (opsets 10, 11, 13, 18, 19) and Upsample (7, 9) on the CUDA device.

Resizing is separable: along each resized axis, output position ``j`` reads a few input
positions (its *taps*) with weights. The taps and weights of every axis are computed on the
host with numpy in float64, following onnx.reference's formulas expression for expression
(coordinate transformation, nearest rounding, linear/cubic coefficients, antialias filters,
``exclude_outside``, ``keep_aspect_ratio_policy``, ``axes``), so that the choices a nearest
resize makes at exact .5 boundaries are the reference's. They depend only on the shapes and
the scales/sizes/roi, so they are made once per signature, uploaded once (int32 indices,
float32/float64 weights, a few KB) and kept with the kernel.

On the device one elementwise kernel per call computes every output element from the
per-axis tables: the data is viewed as (outer, d0..dR-1, inner), where d0..dR-1 are the
axes from the first to the last resized one (axes between them get identity tables).
Nearest copies one element (any fixed-size type, bfloat16 included); linear and cubic
accumulate weight products in float32 (float16/float32 data) or float64 (float64 and
integer data; integers are then rounded half-to-even and clamped, like the reference's
saturating cast). The kernel source is generated per number of block axes; the host
simulation runs a numpy transcription of the same loop.

Resize-10 and Upsample have no coordinate attributes: they are computed as onnxruntime does
(asymmetric coordinates; nearest takes the floor when enlarging an axis and the ceiling when
shrinking it). Not claimed (left to the CPU provider): ``tf_half_pixel_for_nn``, nearest with
``antialias`` or ``exclude_outside``, linear/cubic on bool, bfloat16 and 64-bit integers,
``tf_crop_and_resize`` on non-float types.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np

from onnxplug.ep import KernelContext, KernelInfo, KernelRegistry, dtypes

from ._base import ALL_FIXED_BF16, FLOATS, CudaKernel
from .tensor import CPU

COORD_MODES = frozenset(
    {
        "half_pixel",
        "half_pixel_symmetric",
        "pytorch_half_pixel",
        "align_corners",
        "asymmetric",
        "tf_crop_and_resize",
    }
)
NEAREST_MODES = frozenset({"round_prefer_floor", "round_prefer_ceil", "floor", "ceil"})
POLICIES = frozenset({"stretch", "not_larger", "not_smaller"})
# Integer types interpolated (in float64, rounded and clamped); 64-bit ones are left out:
# their bounds are not exact doubles.
SMALL_INTS = dtypes("int8", "uint8", "int16", "uint16", "int32", "uint32")
INTERPOLATED = FLOATS + SMALL_INTS


# ---------------------------------------------------------------------------------------------
# Host side: per-axis taps (onnx.reference's op_resize, vectorized over output positions)


def x_original(
    ctm: str, out_len: int, scale: float, in_len: int, roi: tuple[float, float] | None
) -> tuple[np.ndarray, np.ndarray | None]:
    """Input coordinate of every output position, and (tf_crop_and_resize only) which
    positions fall outside the input."""
    y = np.arange(out_len, dtype=np.float64)
    out_width = scale * in_len
    extrap = None
    if ctm == "align_corners":
        x = (
            np.zeros(out_len, dtype=np.float64)
            if out_width == 1
            else y * (in_len - 1) / (out_width - 1)
        )
    elif ctm == "asymmetric":
        x = y / scale
    elif ctm == "tf_crop_and_resize":
        if roi is None:
            raise ValueError("Resize: tf_crop_and_resize needs a roi")
        if out_width == 1:
            x = np.full(out_len, (roi[1] - roi[0]) * (in_len - 1) / 2, dtype=np.float64)
        else:
            x = y * (roi[1] - roi[0]) * (in_len - 1) / (out_width - 1)
        x = x + roi[0] * (in_len - 1)
        extrap = (x < 0) | (x > in_len - 1)
    elif ctm == "pytorch_half_pixel":
        x = np.full(out_len, -0.5, dtype=np.float64) if out_width == 1 else (y + 0.5) / scale - 0.5
    elif ctm == "half_pixel":
        x = (y + 0.5) / scale - 0.5
    elif ctm == "half_pixel_symmetric":
        adjustment = out_len / out_width
        center = in_len / 2
        offset = center * (1 - adjustment)
        x = offset + (y + 0.5) / scale - 0.5
    else:
        raise ValueError(f"Resize: unsupported coordinate_transformation_mode '{ctm}'")
    return x, extrap


def coefficients(
    mode: str, ratio: np.ndarray, scale: float, a: float, antialias: bool, nearest: str
) -> np.ndarray:
    """(out, taps) weights of the taps left of and right of each position; ``ratio`` is in
    (0, 1], 1 exactly at input positions."""
    r = ratio[:, None]
    if mode == "nearest":
        if nearest == "round_prefer_floor":
            right = r > 0.5
        elif nearest == "round_prefer_ceil":
            right = r >= 0.5
        elif nearest == "floor":
            right = np.zeros_like(r, dtype=bool)
        else:  # ceil
            right = np.ones_like(r, dtype=bool)
        right = right | (r == 1)
        return np.concatenate([~right, right], axis=1).astype(np.float64)
    if mode == "linear":
        if not antialias:
            return np.concatenate([1 - r, r], axis=1)
        s = min(scale, 1.0)
        start = int(np.floor(-1 / s) + 1)
        footprint = 2 - 2 * start
        args = (np.arange(start, start + footprint)[None, :] - r) * s
        c = np.clip(1 - np.abs(args), 0, 1)
        return c / c.sum(axis=1, keepdims=True)
    # cubic
    if not antialias:
        return np.concatenate(
            [
                ((a * (r + 1) - 5 * a) * (r + 1) + 8 * a) * (r + 1) - 4 * a,
                ((a + 2) * r - (a + 3)) * r * r + 1,
                ((a + 2) * (1 - r) - (a + 3)) * (1 - r) * (1 - r) + 1,
                ((a * ((1 - r) + 1) - 5 * a) * ((1 - r) + 1) + 8 * a) * ((1 - r) + 1) - 4 * a,
            ],
            axis=1,
        )
    s = min(scale, 1.0)
    i_start = int(np.floor(-2 / s) + 1)
    i_end = 2 - i_start
    x = np.abs(s * (np.arange(i_start, i_end)[None, :] - r))
    x2 = x * x
    x3 = x * x2
    c = np.where(
        x <= 1,
        (a + 2) * x3 - (a + 3) * x2 + 1,
        np.where(x < 2, a * x3 - 5 * a * x2 + 8 * a * x - 4 * a, 0.0),
    )
    return c / c.sum(axis=1, keepdims=True)


class AxisTaps:
    """One resized axis: ``idx`` (out, n) clamped input positions, ``w`` (out, n) weights
    (None for nearest: one tap each), ``extrap`` (out,) positions outside the crop."""

    __slots__ = ("extrap", "idx", "w")

    def __init__(self, idx: np.ndarray, w: np.ndarray | None, extrap: np.ndarray | None):
        self.idx, self.w, self.extrap = idx, w, extrap

    @staticmethod
    def identity(n: int, weighted: bool) -> AxisTaps:
        return AxisTaps(np.arange(n).reshape(n, 1), np.ones((n, 1)) if weighted else None, None)


def axis_taps(
    mode: str,
    ctm: str,
    in_len: int,
    out_len: int,
    scale: float,
    roi: tuple[float, float] | None,
    *,
    nearest: str = "round_prefer_floor",
    cubic_a: float = -0.75,
    antialias: bool = False,
    exclude_outside: bool = False,
) -> AxisTaps:
    x_ori, extrap = x_original(ctm, out_len, scale, in_len, roi)
    x_int = np.floor(x_ori).astype(np.int64)
    ratio = np.where(x_ori == x_int, 1.0, x_ori - x_int)
    c = coefficients(mode, ratio, scale, cubic_a, antialias, nearest)
    n = c.shape[1]
    # the n input positions nearest to x_ori, ties to the smaller ones (reference's
    # _get_neighbor on an edge-padded axis: padding is clamping)
    pad = int(np.ceil(n / 2))
    x_pad = x_ori + pad
    p = np.floor(x_pad).astype(np.int64)
    frac = x_pad - p
    if n % 2 == 0:
        offset = np.where(frac == 0, -(n // 2), -(n // 2) + 1)
    else:
        base = -((n - 1) // 2)
        offset = np.where(frac <= 0.5, base, base + 1)
    idx = (p + offset)[:, None] + np.arange(n)[None, :] - pad
    if exclude_outside:
        c = np.where((idx < 0) | (idx >= in_len), 0.0, c)
        total = c.sum(axis=1, keepdims=True)
        c = c / np.where(total == 0, 1.0, total)
    idx = np.clip(idx, 0, in_len - 1)
    if mode == "nearest":  # the tap whose coefficient is 1
        pick = np.argmax(c, axis=1)
        return AxisTaps(idx[np.arange(out_len), pick][:, None], None, extrap)
    return AxisTaps(idx, c, extrap)


class ResizeParams:
    """A node's attributes, in the form every opset reduces to."""

    def __init__(self, info: KernelInfo, legacy: bool):
        a = info.attr
        self.mode = str(a("mode", "nearest"))
        self.legacy = legacy  # Resize-10 / Upsample: onnxruntime's asymmetric + "simple"
        self.ctm = (
            "asymmetric" if legacy else str(a("coordinate_transformation_mode", "half_pixel"))
        )
        self.nearest = str(a("nearest_mode", "round_prefer_floor"))
        self.cubic_a = float(a("cubic_coeff_a", -0.75))
        self.exclude_outside = bool(a("exclude_outside", 0))
        self.extrapolation = float(a("extrapolation_value", 0.0))
        self.antialias = bool(a("antialias", 0))
        self.policy = str(a("keep_aspect_ratio_policy", "stretch"))
        axes = a("axes")
        self.axes = None if axes is None else [int(x) for x in axes]


def claimable(node: Any, graph: Any, legacy: bool) -> bool:
    """Whether the Resize/Upsample kernel implements this node's attributes and type."""
    at = node.attrs
    mode = str(at.get("mode", "nearest"))
    dt = graph.input_dtypes(node)[0]
    if legacy:
        ok_mode = mode in ("nearest", "linear")
    else:
        ok_mode = (
            mode in ("nearest", "linear", "cubic")
            and str(at.get("coordinate_transformation_mode", "half_pixel")) in COORD_MODES
            and str(at.get("keep_aspect_ratio_policy", "stretch")) in POLICIES
        )
    if not ok_mode or dt is None:
        return False
    if str(at.get("coordinate_transformation_mode", "")) == "tf_crop_and_resize":
        if dt not in FLOATS:
            return False
    if mode == "nearest":
        return (
            dt in ALL_FIXED_BF16
            and str(at.get("nearest_mode", "round_prefer_floor")) in NEAREST_MODES
            and not int(at.get("antialias", 0))
            and not int(at.get("exclude_outside", 0))
        )
    return dt in INTERPOLATED


def output_geometry(
    in_shape: tuple[int, ...],
    scales: np.ndarray | None,
    sizes: np.ndarray | None,
    axes: list[int] | None,
    policy: str,
) -> tuple[list[float], list[int], list[int]]:
    """Per-dim scale factors (float64) and output sizes, and the axes resized, as
    onnx.reference's _interpolate_nd derives them (scales are float32 values)."""
    r = len(in_shape)
    if axes is not None:
        axes = [a + r if a < 0 else a for a in axes]
        if sorted(set(axes)) != sorted(axes) or any(not 0 <= a < r for a in axes):
            raise ValueError(f"Resize: axes {axes} invalid for rank {r}")
    else:
        axes = list(range(r))
    n = len(axes)
    if sizes is not None and sizes.size:
        if sizes.size != n:
            raise ValueError(f"Resize: {sizes.size} sizes for {n} axes")
        out = list(in_shape)
        for i, d in enumerate(axes):
            out[d] = int(sizes[i])
        factors = [out[i] / in_shape[i] if in_shape[i] else 1.0 for i in range(r)]
        if policy != "stretch":
            sel = [factors[d] for d in axes]
            scale = min(sel) if policy == "not_larger" else max(sel)
            factors = [scale if i in axes else 1.0 for i in range(r)]
            out = [int(scale * in_shape[i] + 0.5) if i in axes else in_shape[i] for i in range(r)]
        return factors, out, axes
    if scales is None or not scales.size:
        raise ValueError("Resize: neither scales nor sizes is given")
    if scales.size != n:
        raise ValueError(f"Resize: {scales.size} scales for {n} axes")
    factors = [1.0] * r
    for i, d in enumerate(axes):
        factors[d] = float(np.float32(scales[i]))
    return factors, [int(f * d) for f, d in zip(factors, in_shape)], axes


# ---------------------------------------------------------------------------------------------
# Device side


# Index arithmetic is 32-bit unsigned when the input and output have fewer than 2**31
# elements (64-bit division costs several times more on the GPU), else 64-bit.
_INDEX = {False: ("unsigned int", "uint32"), True: ("long long", "int64")}


def _decompose(n_axes: int, it: str) -> list[str]:
    """CUDA lines splitting the flat output index i into (o, j0..jR-1, k)."""
    lines = [f"{it} r = i;", f"const {it} k = r % inner;", "r /= inner;"]
    for a in range(n_axes - 1, 0, -1):
        lines += [f"const {it} j{a} = r % od{a};", f"r /= od{a};"]
    lines += [f"const {it} j0 = r % od0;", f"const {it} o = r / od0;"]
    return lines


def nearest_source(n_axes: int, wide: bool) -> tuple[str, str]:
    """(in_params, body) of the nearest kernel over ``n_axes`` block axes."""
    it, pt = _INDEX[wide]
    params = ["raw T x"] + [f"raw int32 t{a}" for a in range(n_axes)] + [f"{pt} inner"]
    params += [f"{pt} od{a}, {pt} id{a}" for a in range(n_axes)]
    lines = _decompose(n_axes, it) + [f"{it} p = o;"]
    lines += [f"p = p * id{a} + t{a}[j{a}];" for a in range(n_axes)]
    lines.append("y = x[p * inner + k];")
    return ", ".join(params), "\n".join(lines)


def weighted_source(n_axes: int, integer: bool, wide: bool) -> tuple[str, str]:
    """(in_params, body) of the linear/cubic kernel: nested loops over each axis' taps."""
    it, pt = _INDEX[wide]
    params = ["raw T x"]
    params += [f"raw int32 t{a}, raw W w{a}" for a in range(n_axes)]
    params.append(f"{pt} inner")
    params += [f"{pt} od{a}, {pt} id{a}, {pt} n{a}" for a in range(n_axes)]
    if integer:
        params.append("float64 lo, float64 hi")
    lines = _decompose(n_axes, it) + ["W acc = 0;"]
    for a in range(n_axes):
        prev_p = "o" if a == 0 else f"p{a - 1}"
        lines.append(f"for ({it} a{a} = 0; a{a} < n{a}; ++a{a}) {{")
        lines.append(f"const {it} p{a} = {prev_p} * id{a} + t{a}[j{a} * n{a} + a{a}];")
        weight = f"w{a}[j{a} * n{a} + a{a}]"
        lines.append(f"const W c{a} = " + (weight if a == 0 else f"c{a - 1} * {weight}") + ";")
    last = n_axes - 1
    lines.append(f"acc += c{last} * static_cast<W>(x[p{last} * inner + k]);")
    lines += ["}"] * n_axes
    if integer:
        lines.append("y = static_cast<T>(fmin(fmax(rint(acc), lo), hi));")
    else:
        lines.append("y = static_cast<T>(acc);")
    return ", ".join(params), "\n".join(lines)


_kernels: dict[tuple[str, int, bool, bool], Any] = {}


def _cupy_kernel(kind: str, n_axes: int, integer: bool, wide: bool) -> Any:
    key = (kind, n_axes, integer, wide)
    k = _kernels.get(key)
    if k is None:
        import cupy

        if kind == "nearest":
            params, body = nearest_source(n_axes, wide)
        else:
            params, body = weighted_source(n_axes, integer, wide)
        name = f"onnxplug_resize_{kind}{n_axes}{'i' if integer else ''}{'w' if wide else ''}"
        k = _kernels[key] = cupy.ElementwiseKernel(params, "T y", body, name)
    return k


class Plan:
    """How one input shape (with its scales/sizes/roi) is resized: ``kind`` is "empty",
    "copy" (no axis changes), "nearest" or "weighted"; ``od``/``idims``/``n`` are the block
    axes' output and input lengths and tap counts, ``idx``/``w`` their flat tables (int32,
    and weights of dtype ``wdtype``), ``mask`` the (1, *od, 1) positions a tf_crop_and_resize
    puts outside the input. ``dev`` holds the tables once uploaded to the device."""

    __slots__ = ("dev", "idims", "idx", "inner", "kind", "mask", "n", "od", "out", "outer", "w")

    def __init__(self, out: tuple[int, ...], kind: str):
        self.out, self.kind = out, kind
        self.outer = self.inner = 1
        self.od: list[int] = []
        self.idims: list[int] = []
        self.n: list[int] = []
        self.idx: list[np.ndarray] = []
        self.w: list[np.ndarray] = []
        self.mask: np.ndarray | None = None
        self.dev: list[Any] | None = None


def make_plan(
    p: ResizeParams,
    shape: tuple[int, ...],
    roi: np.ndarray | None,
    scales: np.ndarray | None,
    sizes: np.ndarray | None,
    wdtype: np.dtype,
) -> Plan:
    factors, out_list, axes = output_geometry(shape, scales, sizes, p.axes, p.policy)
    out = tuple(out_list)
    r = len(shape)
    if any(d < 0 for d in out):
        raise ValueError(f"Resize: negative output shape {list(out)}")
    if not all(out):
        return Plan(out, "empty")
    if not all(shape):
        raise ValueError(f"Resize: cannot resize the empty input {list(shape)} to {list(out)}")
    full_roi: list[Any] | None = None
    if roi is not None and roi.size:
        flat = roi.reshape(-1)
        if p.axes is None:
            full_roi = list(flat)
        else:
            full_roi = [0.0] * r + [1.0] * r
            for i, d in enumerate(axes):
                full_roi[d] = flat[i]
                full_roi[r + d] = flat[len(axes) + i]
        if len(full_roi) != 2 * r:
            raise ValueError(f"Resize: roi of {flat.size} values for rank {r}")
    weighted = p.mode != "nearest"
    resized: dict[int, AxisTaps] = {}
    for a in axes:
        s = factors[a]
        pair = None if full_roi is None else (full_roi[a], full_roi[a + r])
        # the reference skips an axis it would leave unchanged (so must we: its scale may be
        # only close to 1)
        if (
            math.isclose(s, 1.0)
            and out[a] == shape[a]
            and (pair is None or (math.isclose(pair[0], 0.0) and math.isclose(pair[1], 1.0)))
        ):
            continue
        nearest = ("floor" if s >= 1 else "ceil") if p.legacy else p.nearest
        resized[a] = axis_taps(
            p.mode,
            p.ctm,
            shape[a],
            out[a],
            s,
            pair,
            nearest=nearest,
            cubic_a=p.cubic_a,
            antialias=p.antialias,
            exclude_outside=p.exclude_outside,
        )
    if not resized:
        return Plan(out, "copy")
    a0, a1 = min(resized), max(resized)
    plan = Plan(out, "weighted" if weighted else "nearest")
    plan.outer = int(np.prod(shape[:a0], dtype=np.int64))
    plan.inner = int(np.prod(shape[a1 + 1 :], dtype=np.int64))
    mask = None
    for a in range(a0, a1 + 1):
        taps = resized.get(a) or AxisTaps.identity(shape[a], weighted)
        plan.od.append(out[a])
        plan.idims.append(shape[a])
        plan.n.append(taps.idx.shape[1])
        plan.idx.append(np.ascontiguousarray(taps.idx, dtype=np.int32).reshape(-1))
        if taps.w is not None:
            plan.w.append(np.ascontiguousarray(taps.w, dtype=wdtype).reshape(-1))
        if taps.extrap is not None and taps.extrap.any():
            shape_a = [1] * (a1 - a0 + 1)
            shape_a[a - a0] = out[a]
            e = taps.extrap.reshape(shape_a)
            mask = e if mask is None else (mask | e)
    if mask is not None:
        full = np.zeros(plan.od, dtype=bool) | mask
        plan.mask = full.reshape((1, *plan.od, 1))
    return plan


def np_resize(x: np.ndarray, y: np.ndarray, plan: Plan, wdtype: np.dtype, bounds: Any) -> None:
    """numpy transcription of the device kernels: the same tables, the same loop order."""
    nax = len(plan.od)
    xin = x.reshape(plan.outer, -1, plan.inner)
    yout = y.reshape(plan.outer, -1, plan.inner)

    def along(a: int, table: np.ndarray, tap: int) -> np.ndarray:
        shape = [1] * nax
        shape[a] = plan.od[a]
        return table.reshape(plan.od[a], plan.n[a])[:, tap].reshape(shape)

    def positions(combo: tuple[int, ...]) -> np.ndarray:
        pos = np.zeros(plan.od, dtype=np.int64)
        for a in range(nax):
            pos = pos * plan.idims[a] + along(a, plan.idx[a], combo[a])
        return pos.reshape(-1)

    if plan.kind == "nearest":
        yout[...] = xin[:, positions((0,) * nax), :]
        return
    acc = np.zeros(yout.shape, dtype=wdtype)
    for combo in itertools.product(*[range(k) for k in plan.n]):
        c = along(0, plan.w[0], combo[0])
        for a in range(1, nax):
            c = c * along(a, plan.w[a], combo[a])
        acc += c.reshape(1, -1, 1) * xin[:, positions(combo), :].astype(wdtype)
    if bounds is not None:
        acc = np.clip(np.rint(acc), bounds[0], bounds[1])
    yout[...] = acc.astype(y.dtype)


def _key(v: Any) -> Any:
    return None if v is None else (v.dtype.str, v.shape, v.tobytes())


class Resize(CudaKernel):
    """Resize-11+ (roi, scales and sizes are host inputs; roi matters only to
    tf_crop_and_resize and to whether an axis is left unchanged)."""

    LEGACY = False
    MAX_PLANS = 8

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.p = ResizeParams(info, self.LEGACY)
        self._plans: dict[Any, Plan] = {}

    @classmethod
    def claims(cls, node: Any, graph: Any) -> bool:
        return claimable(node, graph, cls.LEGACY)

    def sources(self, ctx: KernelContext) -> tuple[Any, Any, Any]:
        """(roi, scales, sizes) as host arrays or None."""
        return ctx.input(1), ctx.input(2), ctx.input(3)

    def compute(self, ctx: KernelContext) -> None:
        t = ctx.input(0)
        roi, scales, sizes = self.sources(ctx)
        wdtype = np.dtype(np.float32 if t.dtype.name in ("float16", "float32") else np.float64)
        key = (t.shape, _key(roi), _key(scales), _key(sizes))
        plan = self._plans.get(key)
        if plan is None:
            plan = make_plan(self.p, t.shape, roi, scales, sizes, wdtype)
            if len(self._plans) >= self.MAX_PLANS:
                self._plans.clear()
            self._plans[key] = plan
        y = self.alloc(ctx, 0, plan.out, t.dtype)
        if plan.kind == "empty":
            return
        x = self.arg(ctx, 0)
        xp = self.xp
        if plan.kind == "copy":
            xp.copyto(y, x)
            return
        integer = t.dtype.kind in "iu" and plan.kind == "weighted"
        bounds = None
        if integer:
            info = np.iinfo(t.dtype)
            bounds = (float(info.min), float(info.max))
        if xp is np:
            np_resize(x, y, plan, wdtype, bounds)
        else:
            self._launch(plan, x, y, integer, bounds)
        if plan.mask is not None:
            yv = y.reshape((plan.outer, *plan.od, plan.inner))
            mask = plan.mask if xp is np else plan.dev[-1]  # type: ignore[index]
            value = np.asarray(self.p.extrapolation).astype(t.dtype)[()]
            xp.copyto(yv, value, where=mask)

    def _launch(self, plan: Plan, x: Any, y: Any, integer: bool, bounds: Any) -> None:
        xp = self.xp
        if plan.dev is None:
            # uploaded once per plan; the device is synchronized so that runs on other
            # streams never read a table before its copy has landed
            tables: list[Any] = []
            for a in range(len(plan.od)):
                tables.append(xp.asarray(plan.idx[a]))
                if plan.kind == "weighted":
                    tables.append(xp.asarray(plan.w[a]))
            if plan.mask is not None:
                tables.append(xp.asarray(plan.mask))
            self.be.synchronize()
            plan.dev = tables
        nax = len(plan.od)
        dims: list[int] = []
        for a in range(nax):
            dims += [plan.od[a], plan.idims[a]]
            if plan.kind == "weighted":
                dims.append(plan.n[a])
        per_axis = 2 if plan.kind == "weighted" else 1
        args = [x.reshape(-1), *plan.dev[: nax * per_axis], plan.inner, *dims]
        if integer:
            args += list(bounds)
        wide = max(x.size, y.size) >= 1 << 31
        _cupy_kernel(plan.kind, nax, integer, wide)(*args, y.reshape(-1))


class Resize10(Resize):
    """Resize-10: (X, scales), modes nearest and linear, onnxruntime's semantics."""

    LEGACY = True

    def sources(self, ctx: KernelContext) -> tuple[Any, Any, Any]:
        return None, ctx.input(1), None


class Upsample(Resize10):
    """Upsample-9 (scales input; Upsample-10 is deprecated and does not load)."""


class Upsample7(Resize10):
    """Upsample-7: scales is an attribute."""

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.scales = np.asarray(info.attr("scales"), dtype=np.float32)

    def sources(self, ctx: KernelContext) -> tuple[Any, Any, Any]:
        return None, self.scales, None


def register(reg: KernelRegistry, enable_cudnn: bool) -> None:
    T = ALL_FIXED_BF16  # narrowed per mode by claims()
    reg.kernel("Upsample", since=7, until=8, types={"T": T})(Upsample7)
    reg.kernel("Upsample", since=9, types={"T": T}, input_memory={1: CPU})(Upsample)
    reg.kernel("Resize", since=10, until=10, types={"T": T}, input_memory={1: CPU})(Resize10)
    reg.kernel("Resize", since=11, types={"T1": T}, input_memory={1: CPU, 2: CPU, 3: CPU})(Resize)
