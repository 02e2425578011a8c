"""The ONNX backend node suite on the CPU provider, against the checked-in expected failures.

The suite runs once per module (about 20 s) and once more with graph optimizations off,
which must not change any case's outcome. The expected-failure list can only shrink: a listed
case that passes fails this test until it is removed from the file.

The list holds for the range of onnx versions that pyproject.toml allows (``onnx_versions`` in
the file, checked equal to the dependency's range here), so the gate runs with whichever of
them pip installed; an onnx outside the range fails the gate instead of skipping it.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import onnx
import pytest
from packaging.requirements import Requirement
from packaging.version import Version

import onnxplug as ox
from onnxplug.tools.conformance import (
    XFAIL_FILE,
    CaseResult,
    check_xfail,
    load_xfail,
    run_suite,
    summarize,
    write_json,
)

PASS_RATE_FLOOR = 97.0
EXPECTED_CASES = 1884  # node cases onnx 1.23 generates


@pytest.fixture(scope="module")
def results() -> list[CaseResult]:
    return run_suite(["CPUExecutionProvider"])


def _onnx_range() -> Requirement:
    """The onnx requirement of pyproject.toml's dependencies."""
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    reqs = [Requirement(r) for r in project["project"]["dependencies"]]
    return next(r for r in reqs if r.name == "onnx")


@pytest.fixture(scope="module")
def xfail() -> dict[str, str]:
    data = json.loads(XFAIL_FILE.read_text())
    # no skip: an onnx the list was not made for is a failure of the gate, not a reason to
    # leave it out
    assert Version(onnx.__version__) in _onnx_range().specifier, (
        f"onnx {onnx.__version__} is outside the range {XFAIL_FILE.name} holds for "
        f"({data['onnx_versions']}): run the suite with it and update the file"
    )
    return load_xfail()


def test_xfail_file_is_well_formed() -> None:
    data = json.loads(XFAIL_FILE.read_text())
    assert set(data) == {"onnx_versions", "checked_with", "cases"}
    assert data["checked_with"], "name the onnx versions the list was checked with"
    for name, reason in data["cases"].items():
        assert name.startswith("test_"), name
        assert isinstance(reason, str) and reason.strip(), f"{name} has no reason"
        assert "\n" not in reason, f"{name}: the reason must be one line"


def test_xfail_list_covers_the_onnx_range_pyproject_allows() -> None:
    data = json.loads(XFAIL_FILE.read_text())
    allowed = _onnx_range().specifier
    assert str(allowed) == str(Requirement(f"onnx{data['onnx_versions']}").specifier), (
        f"pyproject.toml allows onnx{allowed}, {XFAIL_FILE.name} holds for "
        f"{data['onnx_versions']}: make them agree"
    )
    # the range is bounded above (a new onnx brings new cases) and every version the list
    # was checked with is inside it, the lowest allowed one included
    assert any(s.operator == "<" for s in allowed), allowed
    checked = [Version(v) for v in data["checked_with"]]
    assert all(v in allowed for v in checked), checked
    lowest = next(Version(s.version) for s in allowed if s.operator == ">=")
    assert lowest in checked, f"the lowest allowed onnx ({lowest}) was not checked"


def test_suite_size(results: list[CaseResult]) -> None:
    if onnx.__version__.startswith("1.23."):
        assert len(results) == EXPECTED_CASES
    assert len(results) == len({r.name for r in results})
    assert [r.name for r in results] == sorted(r.name for r in results)


def test_every_case_not_listed_passes(results: list[CaseResult], xfail: dict[str, str]) -> None:
    bad = check_xfail(results, xfail).unexpected_failures
    report = "\n".join(f"{r.status} {r.name}: {r.message}" for r in bad)
    assert not bad, f"{len(bad)} cases not in {XFAIL_FILE.name} failed:\n{report}"


def test_every_listed_case_still_fails(results: list[CaseResult], xfail: dict[str, str]) -> None:
    check = check_xfail(results, xfail)
    assert not check.unexpected_passes, (
        f"these cases pass now; remove them from {XFAIL_FILE.name}: {check.unexpected_passes}"
    )
    assert not check.not_run, f"{XFAIL_FILE.name} lists cases that do not exist: {check.not_run}"


def test_pass_rate_floor(results: list[CaseResult]) -> None:
    s = summarize(results)
    assert s["pass_rate"] >= PASS_RATE_FLOOR, s


def test_cases_run_on_the_cpu_provider(results: list[CaseResult]) -> None:
    loaded = [r for r in results if r.status != "load_error"]
    assert all(r.on_provider for r in loaded)


def test_results_are_deterministic(results: list[CaseResult]) -> None:
    # Random-output cases are the ones that could flip; a second run must agree exactly.
    again = run_suite(["CPUExecutionProvider"], pattern="bernoulli|dropout|scatter")
    first = {r.name: (r.status, r.message) for r in results}
    assert again and all(first[r.name] == (r.status, r.message) for r in again)


def test_optimizations_off_gives_the_same_results(results: list[CaseResult]) -> None:
    # the graph optimizer (constant folding, Identity removal, fusions) must not change a
    # case's outcome: the suite without it agrees case by case
    so = ox.SessionOptions()
    so.graph_optimization_level = ox.GraphOptimizationLevel.ORT_DISABLE_ALL
    plain = run_suite(["CPUExecutionProvider"], sess_options=so)
    optimized = {r.name: r.status for r in results}
    differ = {
        r.name: (optimized[r.name], r.status, r.message)
        for r in plain
        if r.status != optimized[r.name]
    }
    assert not differ, differ


def test_json_report(results: list[CaseResult], tmp_path) -> None:
    path = tmp_path / "conformance.json"
    write_json(results, str(path), {"providers": ["CPUExecutionProvider"]})
    data = json.loads(path.read_text())
    assert data["summary"] == summarize(results)
    assert [c["name"] for c in data["cases"]] == [r.name for r in results]
    assert set(data["cases"][0]) == {"name", "status", "message", "ops", "on_provider"}
