"""The ONNX backend node suite, generated in memory, run on onnxplug providers.

``onnx.backend.test.case.node.collect_testcases`` yields each case's model and data sets;
every case gets its own InferenceSession, inputs are fed by the graph's input names and the
outputs are compared like onnx's backend runner does (``assert_similar_outputs`` with the
case's rtol/atol). The result of each case is ``pass``, ``fail`` (wrong values, dtype or
shape), ``load_error`` or ``run_error``.
"""

from __future__ import annotations

import json
import time
import warnings
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

XFAIL_FILE = Path(__file__).with_name("conformance_xfail_cpu.json")


@dataclass
class CaseResult:
    name: str
    status: str  # pass | fail | load_error | run_error
    message: str = ""
    ops: str = ""
    on_provider: bool = False  # at least one node ran on the first requested provider


def collect_cases(pattern: str | None = None) -> list[Any]:
    import re

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from onnx.backend.test.case.node import collect_testcases

        cases = collect_testcases(None)
    if pattern:
        rx = re.compile(pattern)
        cases = [c for c in cases if rx.search(c.name)]
    return sorted(cases, key=lambda c: c.name)


def _to_feed(x: Any) -> Any:
    from onnx import TensorProto, numpy_helper

    if isinstance(x, list):
        return [_to_feed(v) for v in x]
    if isinstance(x, TensorProto):
        return numpy_helper.to_array(x)
    return x


def _compare(ref: list[Any], out: list[Any], rtol: float, atol: float) -> None:
    from onnx.backend.test.runner import Runner

    ref = [_normalize(r) for r in ref]
    out = [_normalize(o) for o in out]
    Runner.assert_similar_outputs(ref, out, rtol=rtol, atol=atol)


def _normalize(v: Any) -> Any:
    if v is None:
        return v
    if isinstance(v, list):
        return [_normalize(x) for x in v]
    if isinstance(v, np.ndarray):
        return v
    from onnx import TensorProto, numpy_helper

    if isinstance(v, TensorProto):
        return numpy_helper.to_array(v)
    return np.asarray(v)


def run_case(case: Any, providers: list[Any]) -> CaseResult:
    import onnxplug as ox

    ops = ",".join(sorted({n.op_type for n in case.model.graph.node}))
    try:
        sess = ox.InferenceSession(case.model, providers=providers)
    except Exception as e:
        return CaseResult(case.name, "load_error", _short(e), ops)
    first = providers[0] if isinstance(providers[0], str) else providers[0][0]
    on_provider = any(r["ep"] == first for r in sess.get_provider_graph_assignment_info())
    names = [i.name for i in sess.get_inputs()]
    for inputs, outputs in case.data_sets:
        feed = {n: _to_feed(v) for n, v in zip(names, inputs)}
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                got = sess.run(None, feed)
        except Exception as e:
            return CaseResult(case.name, "run_error", _short(e), ops, on_provider)
        try:
            _compare(list(outputs), got, case.rtol, case.atol)
        except (AssertionError, TypeError, ValueError) as e:
            return CaseResult(case.name, "fail", _short(e), ops, on_provider)
    return CaseResult(case.name, "pass", "", ops, on_provider)


def _short(e: BaseException) -> str:
    msg = f"{type(e).__name__}: {e}"
    msg = " ".join(msg.split())
    return msg[:300]


def run_suite(
    providers: list[Any], pattern: str | None = None, progress: bool = False
) -> list[CaseResult]:
    results = []
    cases = collect_cases(pattern)
    for k, case in enumerate(cases):
        results.append(run_case(case, providers))
        if progress and k % 200 == 0:
            print(f"  {k}/{len(cases)}", flush=True)
    return results


def summarize(results: list[CaseResult]) -> dict[str, Any]:
    c = Counter(r.status for r in results)
    total = len(results)
    return {
        "total": total,
        "passed": c["pass"],
        "failed": c["fail"],
        "load_error": c["load_error"],
        "run_error": c["run_error"],
        "pass_rate": round(100.0 * c["pass"] / total, 2) if total else 0.0,
        "on_provider": sum(1 for r in results if r.on_provider),
    }


def load_xfail(path: Path = XFAIL_FILE) -> dict[str, str]:
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    return dict(data.get("cases", {}))


def write_json(results: list[CaseResult], path: str, meta: dict[str, Any]) -> None:
    Path(path).write_text(
        json.dumps(
            {"meta": meta, "summary": summarize(results), "cases": [asdict(r) for r in results]},
            indent=1,
            sort_keys=True,
        )
    )


def main_run(
    providers: list[Any], pattern: str | None, json_path: str | None, verbose: bool
) -> int:
    t0 = time.perf_counter()
    results = run_suite(providers, pattern)
    dt = time.perf_counter() - t0
    s = summarize(results)
    if verbose:
        for r in results:
            if r.status != "pass":
                print(f"{r.status:10s} {r.name}: {r.message}")
    print(
        f"providers={providers} cases={s['total']} passed={s['passed']} failed={s['failed']} "
        f"errored={s['load_error'] + s['run_error']} (load {s['load_error']}, run {s['run_error']}) "
        f"pass_rate={s['pass_rate']}% on_first_provider={s['on_provider']} time={dt:.1f}s"
    )
    if json_path:
        write_json(
            results, json_path, {"providers": [str(p) for p in providers], "seconds": round(dt, 1)}
        )
    return 0
