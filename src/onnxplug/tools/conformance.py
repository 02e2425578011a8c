"""The ONNX backend node suite, generated in memory, run on onnxplug providers.

``onnx.backend.test.case.node.collect_testcases`` yields each case's model and data sets;
every case gets its own InferenceSession, inputs are fed by the graph's input names and the
outputs are compared like onnx's backend runner does (``assert_similar_outputs`` with the
case's rtol/atol, applied per tensor). The result of each case is ``pass``, ``fail`` (wrong
values, dtype or shape), ``load_error`` or ``run_error``.

Results are deterministic: cases run in name order, numpy's global RNG is reseeded from the
case name before each case, and cases whose outputs are random samples (Bernoulli, Random*,
Multinomial) are checked for structure (count, shape, dtype) and then always reported as
``fail``: their stored outputs are one draw that no implementation can reproduce, so a value
comparison would pass or fail by chance.

``conformance_xfail_cpu.json`` (next to this module) lists the CPU provider's expected
failures with a one-line reason; ``check_xfail`` says which results contradict it. Run as
``python -m onnxplug.tools.conformance [--pattern RE] [--json FILE] [-v]``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import warnings
import zlib
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

XFAIL_FILE = Path(__file__).with_name("conformance_xfail_cpu.json")
# Ops whose outputs are random samples: stored outputs are one draw of one implementation.
RANDOM_OPS = frozenset(
    {
        "Bernoulli",
        "Multinomial",
        "RandomNormal",
        "RandomNormalLike",
        "RandomUniform",
        "RandomUniformLike",
    }
)


@dataclass
class CaseResult:
    name: str
    status: str  # pass | fail | load_error | run_error
    message: str = ""
    ops: str = ""
    on_provider: bool = False  # at least one node ran on the first requested provider


def collect_cases(pattern: str | None = None) -> list[Any]:
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


def _normalize(v: Any) -> Any:
    if v is None:
        return v
    if isinstance(v, (list, tuple)):
        return [_normalize(x) for x in v]
    if isinstance(v, np.ndarray):
        return v
    from onnx import TensorProto, numpy_helper

    if isinstance(v, TensorProto):
        return numpy_helper.to_array(v)
    return np.asarray(v)


def _compare_value(ref: Any, out: Any, rtol: float, atol: float, where: str) -> None:
    """Compares one output, recursing into sequences and optionals.

    onnx's ``assert_similar_outputs`` recurses into a sequence by treating each element as a
    list of outputs, which calls ``len()`` on 0-d tensors (a TypeError: test_loop16_seq_none)
    and compares other tensors row by row; here every element is compared as one tensor.
    """
    from onnx.backend.test.runner import Runner

    if ref is None or out is None:
        if ref is not None or out is not None:
            raise AssertionError(
                f"{where}: expected {'an empty optional' if ref is None else type(ref).__name__}"
                f", got {'an empty optional' if out is None else type(out).__name__}"
            )
        return
    if isinstance(ref, list) or isinstance(out, list):
        if not (isinstance(ref, list) and isinstance(out, list)):
            raise AssertionError(
                f"{where}: expected {type(ref).__name__}, got {type(out).__name__}"
            )
        if len(ref) != len(out):
            raise AssertionError(f"{where}: expected {len(ref)} sequence items, got {len(out)}")
        for k, (r, o) in enumerate(zip(ref, out)):
            _compare_value(r, o, rtol, atol, f"{where}[{k}]")
        return
    if not isinstance(out, np.ndarray):
        raise AssertionError(f"{where}: expected a tensor, got {type(out).__name__}")
    try:
        Runner.assert_similar_outputs([ref], [out], rtol=rtol, atol=atol)
    except AssertionError as e:
        raise AssertionError(f"{where}: {e}") from None


def compare_outputs(ref: list[Any], out: list[Any], rtol: float, atol: float) -> None:
    """Raises AssertionError unless ``out`` matches the stored ``ref`` outputs (tensors,
    sequences as lists, empty optionals as None) within rtol/atol, as onnx's runner does."""
    ref = [_normalize(r) for r in ref]
    out = [_normalize(o) for o in out]
    if len(ref) != len(out):
        raise AssertionError(f"expected {len(ref)} outputs, got {len(out)}")
    for i, (r, o) in enumerate(zip(ref, out)):
        _compare_value(r, o, rtol, atol, f"output {i}")


def _compare_structure(ref: Any, out: Any, where: str) -> None:
    """Count, shape and dtype of (possibly nested) outputs, not their values."""
    if isinstance(ref, list) or isinstance(out, list):
        if not (isinstance(ref, list) and isinstance(out, list)) or len(ref) != len(out):
            raise AssertionError(f"{where}: structure differs from the stored output")
        for k, (r, o) in enumerate(zip(ref, out)):
            _compare_structure(r, o, f"{where}[{k}]")
        return
    if (ref is None) != (out is None):
        raise AssertionError(f"{where}: optional presence differs from the stored output")
    if ref is None:
        return
    if not isinstance(out, np.ndarray) or out.shape != ref.shape or out.dtype != ref.dtype:
        got = f"{out.dtype}{list(out.shape)}" if isinstance(out, np.ndarray) else type(out)
        raise AssertionError(f"{where}: expected {ref.dtype}{list(ref.shape)}, got {got}")


def _graph_ops(graph: Any) -> set[str]:
    ops: set[str] = set()
    for n in graph.node:
        ops.add(n.op_type)
        for a in n.attribute:
            if a.HasField("g"):
                ops |= _graph_ops(a.g)
            for g in a.graphs:
                ops |= _graph_ops(g)
    return ops


def run_case(
    case: Any, providers: list[Any], sess_options: Any = None, repeats: int = 1
) -> CaseResult:
    """One case; with ``repeats`` > 1 every data set runs that many times on the session (the
    first run records the signature's plan, the second binds prepared calls, later runs take
    the steady state) and every run's outputs are checked."""
    import onnxplug as ox

    all_ops = _graph_ops(case.model.graph)
    ops = ",".join(sorted({n.op_type for n in case.model.graph.node}))
    random_ops = sorted(all_ops & RANDOM_OPS)
    # Kernels that draw from numpy's global RNG see the same state whatever ran before.
    np.random.seed(zlib.crc32(case.name.encode()))
    try:
        sess = ox.InferenceSession(case.model, sess_options, providers=providers)
    except Exception as e:
        return CaseResult(case.name, "load_error", _short(e), ops)
    first = providers[0] if isinstance(providers[0], str) else providers[0][0]
    on_provider = any(r["ep"] == first for r in sess.get_provider_graph_assignment_info())
    names = [i.name for i in sess.get_inputs()]
    for inputs, outputs in case.data_sets:
        feed = {n: _to_feed(v) for n, v in zip(names, inputs)}
        for _ in range(max(1, repeats)):
            result = _check_run(case, sess, feed, outputs, random_ops, ops, on_provider)
            if result is not None:
                return result
    if random_ops:
        return CaseResult(
            case.name,
            "fail",
            f"random output ({', '.join(random_ops)}): the stored values are one sample that "
            "cannot be reproduced; output count, shapes and dtypes match",
            ops,
            on_provider,
        )
    return CaseResult(case.name, "pass", "", ops, on_provider)


def _check_run(
    case: Any,
    sess: Any,
    feed: dict[str, Any],
    outputs: Any,
    random_ops: list[str],
    ops: str,
    on_provider: bool,
) -> CaseResult | None:
    """One run of a data set: a failure's result, or None."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = sess.run(None, feed)
    except Exception as e:
        return CaseResult(case.name, "run_error", _short(e), ops, on_provider)
    try:
        if random_ops:
            ref = [_normalize(r) for r in outputs]
            if len(ref) != len(got):
                raise AssertionError(f"expected {len(ref)} outputs, got {len(got)}")
            for i, (r, o) in enumerate(zip(ref, got)):
                _compare_structure(r, _normalize(o), f"output {i}")
        else:
            compare_outputs(list(outputs), got, case.rtol, case.atol)
    except (AssertionError, TypeError, ValueError) as e:
        return CaseResult(case.name, "fail", _short(e), ops, on_provider)
    return None


def _short(e: BaseException) -> str:
    msg = f"{type(e).__name__}: {e}"
    msg = " ".join(msg.split())
    return msg[:300]


def run_suite(
    providers: list[Any],
    pattern: str | None = None,
    progress: bool = False,
    sess_options: Any = None,
    repeats: int = 1,
) -> list[CaseResult]:
    """Every case (matching ``pattern``) on ``providers``, in name order; ``sess_options``
    (an onnxplug.SessionOptions) applies to every case's session; ``repeats``: runs per data
    set (see ``run_case``). ``progress``: a line on stderr counting the cases done
    (``main_run`` shows it when stderr is a terminal)."""
    results = []
    cases = collect_cases(pattern)
    trace = os.environ.get("ONNXPLUG_CONFORMANCE_TRACE") == "1"  # find a case that crashes
    passed = 0
    for k, case in enumerate(cases, 1):
        if trace:
            print(f"case {case.name}", flush=True)
        results.append(run_case(case, providers, sess_options, repeats))
        passed += results[-1].status == "pass"
        if progress and (k % 25 == 0 or k == len(cases)):
            # one line, rewritten in place: a terminal shows where the suite is
            sys.stderr.write(f"\r  {k}/{len(cases)} cases, {passed} passed")
            sys.stderr.flush()
    if progress and cases:
        sys.stderr.write("\n")
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
    """The expected failures; cases failing only for want of an optional package (Pillow for
    ImageDecoder) are expected to fail only where that package is missing."""
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    cases = dict(data.get("cases", {}))
    if _importable("PIL"):
        cases = {k: v for k, v in cases.items() if "needs Pillow" not in v}
    return cases


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


@dataclass
class XfailCheck:
    """How results compare with an expected-failure list."""

    unexpected_failures: list[CaseResult] = field(default_factory=list)  # not listed, failed
    unexpected_passes: list[str] = field(default_factory=list)  # listed, passed: remove them
    not_run: list[str] = field(default_factory=list)  # listed, but no such case ran

    @property
    def ok(self) -> bool:
        return not self.unexpected_failures and not self.unexpected_passes


def check_xfail(results: list[CaseResult], xfail: dict[str, str]) -> XfailCheck:
    by_name = {r.name: r for r in results}
    check = XfailCheck()
    for r in results:
        if r.status != "pass" and r.name not in xfail:
            check.unexpected_failures.append(r)
    for name in sorted(xfail):
        listed = by_name.get(name)
        if listed is None:
            check.not_run.append(name)
        elif listed.status == "pass":
            check.unexpected_passes.append(name)
    return check


def write_json(results: list[CaseResult], path: str, meta: dict[str, Any]) -> None:
    Path(path).write_text(
        json.dumps(
            {"meta": meta, "summary": summarize(results), "cases": [asdict(r) for r in results]},
            indent=1,
            sort_keys=True,
        )
        + "\n"
    )


def _is_cpu_only(providers: list[Any]) -> bool:
    names = [p if isinstance(p, str) else p[0] for p in providers]
    return names == ["CPUExecutionProvider"]


def main_run(
    providers: list[Any],
    pattern: str | None,
    json_path: str | None,
    verbose: bool,
    check: bool = False,
    repeats: int = 1,
) -> int:
    """Runs the suite and prints a summary line; with ``check`` (CPU provider only), returns 1
    when results contradict the expected-failure list."""
    import onnx

    t0 = time.perf_counter()
    results = run_suite(providers, pattern, progress=sys.stderr.isatty(), repeats=repeats)
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
    rc = 0
    if _is_cpu_only(providers):
        xc = check_xfail(results, load_xfail())
        for r in xc.unexpected_failures:
            print(f"unexpected {r.status}: {r.name}: {r.message}")
        for name in xc.unexpected_passes:
            print(f"unexpected pass (remove it from {XFAIL_FILE.name}): {name}")
        if check and not xc.ok:
            rc = 1
    if json_path:
        write_json(
            results,
            json_path,
            {
                "providers": [str(p) for p in providers],
                "pattern": pattern,
                "onnx_version": onnx.__version__,
                "seconds": round(dt, 1),
            },
        )
    return rc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m onnxplug.tools.conformance",
        description="Run the ONNX backend node suite on onnxplug providers.",
    )
    ap.add_argument(
        "--provider",
        action="append",
        metavar="NAME",
        help="provider to run on, in priority order (repeatable; default CPUExecutionProvider)",
    )
    ap.add_argument("--pattern", metavar="REGEX", help="only cases whose name matches REGEX")
    ap.add_argument("--json", metavar="FILE", help="write every case's result to FILE")
    ap.add_argument("-v", "--verbose", action="store_true", help="list the cases that did not pass")
    ap.add_argument(
        "--check",
        action="store_true",
        help="exit 1 when CPU results contradict conformance_xfail_cpu.json",
    )
    args = ap.parse_args(argv)
    providers = args.provider or ["CPUExecutionProvider"]
    return main_run(providers, args.pattern, args.json, args.verbose, check=args.check)


if __name__ == "__main__":
    sys.exit(main())
