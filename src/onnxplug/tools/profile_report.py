"""What ``onnxplug profile`` makes of a trace: a table by op type and charts of a run.

The input is the event list of a trace in onnxruntime's format (``end_profiling()``'s JSON,
see ``onnxplug/framework/profiler.py``; onnxruntime's own traces read the same). Runs are the
``model_run`` events; a run's nodes are the ``Node`` events inside its window, their device
work the ``Kernel`` events inside it (a provider that times its streams reports one per node).

* ``op_table``: per op type, nodes per run, host ms per run and device ("GPU") ms per run
  where a provider measured it, and each one's share of the total.
* ``html_report``: one self-contained HTML page (inline SVG, no script, no external file):
  the timeline of one run, a lane for the host and one per device stream, a bar per node
  coloured by op type (hover for its name and duration); the top op types by time; the table.
* ``png_report``: the same two charts with matplotlib, when it is installed.
"""

from __future__ import annotations

import bisect
import html
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

TOP_OPS = 15  # op types the charts name (the others are grey and summed)
_PALETTE = [
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#17becf",
    "#bcbd22",
    "#7f7f7f",
    "#aec7e8",
    "#ffbb78",
    "#98df8a",
    "#ff9896",
    "#c5b0d5",
]
_OTHER = "#c8c8c8"
_HOST_COLOR, _GPU_COLOR = "#4c78a8", "#f58518"


@dataclass
class OpRow:
    """One op type over the profiled runs (figures per run)."""

    op: str
    nodes: float
    host_ms: float
    gpu_ms: float | None  # None: no provider measured this op's device time


@dataclass
class Run:
    """One ``model_run`` window and what happened in it."""

    start: int  # µs since the profiler started
    end: int
    nodes: list[dict[str, Any]]
    kernels: list[dict[str, Any]]


def runs_of(events: Sequence[dict[str, Any]]) -> list[Run]:
    """The runs of a trace, in order, each with its Node and Kernel events."""
    windows = sorted(
        (e["ts"], e["ts"] + e["dur"])
        for e in events
        if e.get("cat") == "Session" and e.get("name") == "model_run"
    )
    runs = [Run(a, b, [], []) for a, b in windows]
    starts = [r.start for r in runs]
    for e in events:
        cat = e.get("cat")
        if cat not in ("Node", "Kernel"):
            continue
        k = _window_of(starts, e["ts"])
        if k is None or e["ts"] > runs[k].end:
            continue  # outside every run (a node of another thread's run, say)
        (runs[k].nodes if cat == "Node" else runs[k].kernels).append(e)
    return runs


def _window_of(starts: list[int], ts: int) -> int | None:
    k = bisect.bisect_right(starts, ts) - 1
    return k if k >= 0 else None


def op_table(runs: Sequence[Run]) -> list[OpRow]:
    """Per op type: nodes, host ms and device ms per run, largest first (by device time
    where the trace has any, else by host time)."""
    if not runs:
        return []
    n = len(runs)
    nodes: dict[str, int] = {}
    host: dict[str, float] = {}
    gpu: dict[str, float] = {}
    for r in runs:
        for e in r.nodes:
            op = e["args"].get("op_name", e["name"])
            nodes[op] = nodes.get(op, 0) + 1
            host[op] = host.get(op, 0.0) + e["dur"] / 1000.0
        for e in r.kernels:
            op = e["args"].get("op_name", e["name"])
            gpu[op] = gpu.get(op, 0.0) + e["dur"] / 1000.0
            nodes.setdefault(op, 0)
            host.setdefault(op, 0.0)
    rows = [
        OpRow(op, nodes[op] / n, host[op] / n, gpu[op] / n if op in gpu else None) for op in nodes
    ]
    by_gpu = bool(gpu)
    rows.sort(key=lambda r: -((r.gpu_ms or 0.0) if by_gpu else r.host_ms))
    return rows


def format_table(rows: Sequence[OpRow]) -> list[str]:
    """The table as text lines, with a total line."""
    host_total = sum(r.host_ms for r in rows)
    gpu_rows = [r for r in rows if r.gpu_ms is not None]
    gpu_total = sum(r.gpu_ms or 0.0 for r in gpu_rows)
    width = max([len("op type"), len("total")] + [len(r.op) for r in rows])
    head = f"  {'op type':<{width}}  {'nodes':>6}  {'host ms':>9}  {'host %':>6}"
    head += f"  {'GPU ms':>9}  {'GPU %':>6}"
    lines = [head]

    def line(op: str, nodes: float, h: float, g: float | None) -> str:
        nodes_s = f"{nodes:.0f}" if float(nodes).is_integer() else f"{nodes:.1f}"
        text = f"  {op:<{width}}  {nodes_s:>6}  {h:9.3f}  {_pct(h, host_total):>6}"
        if g is None:
            return text + f"  {'-':>9}  {'-':>6}"
        return text + f"  {g:9.3f}  {_pct(g, gpu_total):>6}"

    for r in rows:
        lines.append(line(r.op, r.nodes, r.host_ms, r.gpu_ms))
    total_nodes = sum(r.nodes for r in rows)
    lines.append(line("total", total_nodes, host_total, gpu_total if gpu_rows else None))
    return lines


def _pct(part: float, total: float) -> str:
    return f"{100.0 * part / total:.1f}%" if total > 0 else "-"


def op_colors(rows: Sequence[OpRow]) -> dict[str, str]:
    """A colour for each of the top op types (the table's order); others are grey."""
    return {r.op: _PALETTE[k] for k, r in enumerate(rows[: len(_PALETTE)])}


def _lanes(run: Run) -> list[tuple[str, list[dict[str, Any]]]]:
    """Timeline lanes: the host's nodes, then each device stream's work."""
    lanes: list[tuple[str, list[dict[str, Any]]]] = [("host", run.nodes)]
    streams: dict[str, list[dict[str, Any]]] = {}
    for e in run.kernels:
        args = e["args"]
        key = f"{args.get('provider', 'device')} stream {args.get('stream', '?')}"
        streams.setdefault(key, []).append(e)
    for k, (key, evs) in enumerate(streams.items()):
        label = key.split(" stream ")[0].removesuffix("ExecutionProvider")
        lanes.append((f"{label} stream {k}" if len(streams) > 1 else f"{label} device", evs))
    return lanes


def _ticks(span_ms: float) -> list[float]:
    """Round tick positions (ms) from 0 to ``span_ms``."""
    if span_ms <= 0:
        return [0.0]
    raw = span_ms / 8
    step = 1.0
    while step > raw:
        step /= 10
    while step * 10 <= raw:
        step *= 10
    for m in (1, 2, 5):
        if step * m >= raw:
            step *= m
            break
    out, t = [], 0.0
    while t <= span_ms + 1e-9:
        out.append(round(t, 9))
        t += step
    return out


def timeline_svg(run: Run, colors: dict[str, str], width: int = 1100) -> str:
    """One run as an SVG timeline: lanes of bars, x in ms from the run's start."""
    lanes = _lanes(run)
    left, right, top, lane_h, gap = 150, 20, 30, 26, 8
    plot_w = width - left - right
    span = max(run.end - run.start, 1)
    height = top + len(lanes) * (lane_h + gap) + 40
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'font-family="sans-serif" font-size="12">'
    ]

    def x(ts: float) -> float:
        return left + (ts - run.start) / span * plot_w

    for k, (label, evs) in enumerate(lanes):
        y = top + k * (lane_h + gap)
        parts.append(
            f'<text x="{left - 8}" y="{y + lane_h * 0.7:.1f}" text-anchor="end">'
            f"{html.escape(label)}</text>"
        )
        parts.append(
            f'<rect x="{left}" y="{y}" width="{plot_w}" height="{lane_h}" fill="#f4f4f4"/>'
        )
        for e in evs:
            op = e["args"].get("op_name", "")
            name = e["name"].removesuffix("_kernel_time")
            w = max(e["dur"] / span * plot_w, 0.5)
            tip = f"{name} ({op}): {e['dur']} µs"
            parts.append(
                f'<rect x="{x(e["ts"]):.2f}" y="{y + 2}" width="{w:.2f}" height="{lane_h - 4}" '
                f'fill="{colors.get(op, _OTHER)}"><title>{html.escape(tip)}</title></rect>'
            )
    axis_y = top + len(lanes) * (lane_h + gap)
    parts.append(
        f'<line x1="{left}" y1="{axis_y}" x2="{left + plot_w}" y2="{axis_y}" stroke="#333"/>'
    )
    span_ms = span / 1000.0
    for t in _ticks(span_ms):
        tx = left + t / span_ms * plot_w
        parts.append(
            f'<line x1="{tx:.1f}" y1="{axis_y}" x2="{tx:.1f}" y2="{axis_y + 5}" stroke="#333"/>'
        )
        parts.append(f'<text x="{tx:.1f}" y="{axis_y + 18}" text-anchor="middle">{t:g}</text>')
    parts.append(
        f'<text x="{left + plot_w / 2}" y="{axis_y + 34}" text-anchor="middle">'
        "ms since the run started</text>"
    )
    parts.append("</svg>")
    return "".join(parts)


def top_ops_svg(rows: Sequence[OpRow], width: int = 1100) -> str:
    """Horizontal bars of the top op types: host ms and device ms per run."""
    top = list(rows[:TOP_OPS])
    left, right, head, bar_h = 150, 120, 30, 9
    plot_w = width - left - right
    peak = max([r.host_ms for r in top] + [r.gpu_ms or 0.0 for r in top] + [1e-9])
    row_h = 2 * bar_h + 8
    height = head + len(top) * row_h + 20
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'font-family="sans-serif" font-size="12">',
        f'<rect x="{left}" y="6" width="12" height="10" fill="{_HOST_COLOR}"/>'
        f'<text x="{left + 16}" y="15">host ms per run</text>',
        f'<rect x="{left + 150}" y="6" width="12" height="10" fill="{_GPU_COLOR}"/>'
        f'<text x="{left + 166}" y="15">GPU ms per run</text>',
    ]
    for k, r in enumerate(top):
        y = head + k * row_h
        parts.append(
            f'<text x="{left - 8}" y="{y + bar_h + 4}" text-anchor="end">{html.escape(r.op)}</text>'
        )
        for j, (value, color) in enumerate(((r.host_ms, _HOST_COLOR), (r.gpu_ms, _GPU_COLOR))):
            if value is None:
                continue
            w = value / peak * plot_w
            by = y + j * bar_h
            parts.append(
                f'<rect x="{left}" y="{by}" width="{max(w, 0.5):.2f}" height="{bar_h - 1}" '
                f'fill="{color}"/>'
                f'<text x="{left + w + 4:.2f}" y="{by + bar_h - 1}" font-size="10">'
                f"{value:.3f}</text>"
            )
    parts.append("</svg>")
    return "".join(parts)


def html_report(title: str, facts: Sequence[str], rows: Sequence[OpRow], run: Run) -> str:
    """A self-contained HTML page: facts, the run's timeline, the top ops and the table."""
    colors = op_colors(rows)
    legend = " ".join(
        f'<span style="white-space:nowrap"><span style="display:inline-block;width:10px;'
        f'height:10px;background:{c}"></span> {html.escape(op)}</span>'
        for op, c in colors.items()
    )
    table = "\n".join(html.escape(line) for line in format_table(rows))
    items = "".join(f"<li>{html.escape(f)}</li>" for f in facts)
    return (
        '<!DOCTYPE html>\n<html><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title>"
        "<style>body{font-family:sans-serif;margin:20px}pre{font-size:12px}</style>"
        f"</head><body><h1>{html.escape(title)}</h1><ul>{items}</ul>"
        "<h2>Timeline of the last profiled run</h2>"
        f"<p>{legend}</p>{timeline_svg(run, colors)}"
        f"<h2>Top op types</h2>{top_ops_svg(rows)}"
        f"<h2>By op type (per run)</h2><pre>{table}</pre>"
        "</body></html>\n"
    )


def png_report(path: str, title: str, rows: Sequence[OpRow], run: Run) -> None:
    """The timeline and top-ops charts as a PNG (needs matplotlib: ImportError without)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = op_colors(rows)
    lanes = _lanes(run)
    top = list(rows[:TOP_OPS])
    fig, (ax1, ax2) = plt.subplots(
        2,
        1,
        figsize=(12, 2.0 + 0.5 * len(lanes) + 0.3 * len(top)),
        gridspec_kw={"height_ratios": [max(len(lanes), 1), max(len(top), 1) * 0.6]},
    )
    for k, (_label, evs) in enumerate(lanes):
        bars = [((e["ts"] - run.start) / 1000.0, max(e["dur"], 1) / 1000.0) for e in evs]
        cols = [colors.get(e["args"].get("op_name", ""), _OTHER) for e in evs]
        ax1.broken_barh(bars, (k - 0.4, 0.8), facecolors=cols)
    ax1.set_yticks(range(len(lanes)), [label for label, _ in lanes])
    ax1.invert_yaxis()
    ax1.set_xlabel("ms since the run started")
    ax1.set_title(f"{title}: the last profiled run")
    ys = list(range(len(top)))
    ax2.barh(
        [y - 0.2 for y in ys], [r.host_ms for r in top], 0.4, color=_HOST_COLOR, label="host ms"
    )
    ax2.barh(
        [y + 0.2 for y in ys], [r.gpu_ms or 0.0 for r in top], 0.4, color=_GPU_COLOR, label="GPU ms"
    )
    ax2.set_yticks(ys, [r.op for r in top])
    ax2.invert_yaxis()
    ax2.set_xlabel("ms per run")
    ax2.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


__all__ = [
    "OpRow",
    "Run",
    "format_table",
    "html_report",
    "op_colors",
    "op_table",
    "png_report",
    "runs_of",
    "timeline_svg",
    "top_ops_svg",
]
