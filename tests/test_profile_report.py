"""What ``onnxplug profile`` makes of a trace (``onnxplug.tools.profile_report``): runs split by
``model_run``, the table by op type, and charts that are well-formed whatever the names."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from onnxplug.tools.profile_report import (
    Run,
    format_table,
    html_report,
    op_table,
    runs_of,
    timeline_svg,
    top_ops_svg,
)


def ev(cat: str, name: str, ts: int, dur: int, **args: str) -> dict:
    return {
        "cat": cat,
        "pid": 1,
        "tid": 1,
        "dur": dur,
        "ts": ts,
        "ph": "X",
        "name": name,
        "args": args,
    }


def test_runs_take_the_events_inside_their_window():
    events = [
        ev("Session", "model_loading_array", 0, 5),
        ev("Node", "early_kernel_time", 6, 1, op_name="Relu"),  # before any run
        ev("Session", "model_run", 100, 50),
        ev("Node", "a_kernel_time", 110, 10, op_name="Relu"),
        ev("Kernel", "a", 112, 4, op_name="Relu", stream="7", node_index="0"),
        ev("Session", "model_run", 200, 50),
        ev("Node", "a_kernel_time", 210, 20, op_name="Relu"),
        ev("Node", "late_kernel_time", 260, 1, op_name="Relu"),  # after the run's end
    ]
    runs = runs_of(events)
    assert [(r.start, r.end) for r in runs] == [(100, 150), (200, 250)]
    assert [len(r.nodes) for r in runs] == [1, 1] and [len(r.kernels) for r in runs] == [1, 0]
    (row,) = op_table(runs)
    assert (row.op, row.nodes, row.host_ms) == ("Relu", 1.0, pytest.approx(0.015))
    assert row.gpu_ms == pytest.approx(0.002)


node_events = st.lists(
    st.tuples(st.sampled_from(["Conv", "Relu", "Add", "MatMul"]), st.integers(0, 500)),
    min_size=1,
    max_size=30,
)


@settings(max_examples=60, deadline=None)
@given(st.lists(node_events, min_size=1, max_size=4))
def test_the_table_accounts_for_every_node_once(per_run):
    """Per run figures: the rows' host ms and node counts add up to the runs' totals, and the
    host shares to 100 %."""
    runs = []
    for k, nodes in enumerate(per_run):
        start = k * 100_000
        evs = [
            ev("Node", f"{op}_kernel_time", start + 1 + j, d, op_name=op)
            for j, (op, d) in enumerate(nodes)
        ]
        runs.append(Run(start, start + 99_999, evs, []))
    rows = op_table(runs)
    n = len(runs)
    assert sum(r.host_ms for r in rows) * n == pytest.approx(
        sum(d for ns in per_run for _, d in ns) / 1000
    )
    assert sum(r.nodes for r in rows) * n == pytest.approx(sum(len(ns) for ns in per_run))
    assert all(r.gpu_ms is None for r in rows)
    assert [r.host_ms for r in rows] == sorted((r.host_ms for r in rows), reverse=True)
    total = format_table(rows)[-1].split()
    assert total[0] == "total" and total[3] == ("100.0%" if any(r.host_ms for r in rows) else "-")
    assert total[4:] == ["-", "-"]


def test_rows_without_device_time_show_a_dash_and_device_time_orders_the_table():
    runs = [
        Run(
            0,
            1000,
            [
                ev("Node", "c_kernel_time", 1, 50, op_name="Conv"),
                ev("Node", "s_kernel_time", 60, 90, op_name="Shape"),
            ],
            [ev("Kernel", "c", 5, 400, op_name="Conv")],
        )
    ]
    rows = op_table(runs)
    assert [r.op for r in rows] == ["Conv", "Shape"]  # by GPU time, though Shape's host is longer
    lines = format_table(rows)
    assert lines[2].split()[-2:] == ["-", "-"] and lines[1].split()[-1] == "100.0%"


def test_charts_escape_names_and_stay_well_formed():
    nasty = 'a<b>&"c'
    run = Run(
        0,
        1000,
        [ev("Node", f"{nasty}_kernel_time", 10, 100, op_name=nasty)],
        [ev("Kernel", nasty, 20, 50, op_name=nasty, stream="1", provider="X<Y>ExecutionProvider")],
    )
    rows = op_table([run])
    for svg in (timeline_svg(run, {nasty: "#123456"}), top_ops_svg(rows)):
        root = ET.fromstring(svg)
        assert root.tag.endswith("svg")
    page = html_report(f"title {nasty}", [f"fact {nasty}"], rows, run)
    assert nasty not in page and "a&lt;b&gt;&amp;" in page
