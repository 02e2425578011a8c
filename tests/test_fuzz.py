"""The model fuzzer: a fixed-seed sample of cases must give no crash, hang, memory blow-up or
untyped error; the classification itself is checked on children that crash, hang and run out
of memory on purpose. The long run is ``python -m onnxplug.tools.fuzz --cases 10000``."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from onnxplug import errors
from onnxplug.tools import fuzz
from onnxplug.tools.fuzz_corpus import corpus

CI_CASES = 1000


def test_fixed_seed_sample_has_no_crash_hang_or_blowup():
    t0 = time.monotonic()
    results = fuzz.campaign(CI_CASES, seed=0, workers=2)
    print(fuzz.summary(results, "onnxplug", time.monotonic() - t0))
    assert len(results) == CI_CASES
    bad = fuzz.failures(results)
    assert not bad, "\n".join(
        f"[{r.cls}] case {r.index} {r.seed_model}/{r.mutation} ({r.detail}): {r.error}" for r in bad
    )
    # with onnxruntime as the oracle: nothing it refuses is run silently here (the classes
    # found are tests in test_validation_parity.py)
    invalid = [r for r in results if r.cls == "accepted_invalid"]
    assert not invalid, "\n".join(
        f"case {r.index} {r.seed_model}/{r.mutation} ({r.detail}): {r.error}" for r in invalid
    )


def test_every_seed_loads_and_runs():
    results = []
    seeds = corpus()
    for i, s in enumerate(seeds):
        folder = Path(os.environ.get("TMPDIR", "/tmp"))
        import tempfile

        with tempfile.TemporaryDirectory(dir=folder) as d:
            path = fuzz.write_case(Path(d), s.model.SerializeToString(), s.files)
            results.append((s.name, fuzz._attempt("onnxplug", path, i, 5.0)))
    assert all(r["cls"] == "accepted" and r["stage"] == "run" for _, r in results), results


def test_cases_are_reproducible():
    seeds = corpus()
    a = fuzz.make_case(7, 123, seeds)
    b = fuzz.make_case(7, 123, seeds)
    assert a[0] == b[0] and a[1] == b[1]
    assert fuzz.make_case(7, 124, seeds)[1] != a[1] or fuzz.make_case(7, 124, seeds)[0] != a[0]
    assert {fuzz.make_case(0, i, seeds)[0].mutation for i in range(200)} == set(fuzz.MUTATIONS)


def _one(monkeypatch, tmp_path, behaviour, time_limit=30.0, mem_limit=512 * 2**20):
    monkeypatch.setattr(fuzz, "_attempt", behaviour)
    case = fuzz.Case(0, "seed", "bytes", "test")
    return fuzz.run_case("onnxplug", False, case, b"", {}, tmp_path, time_limit, 1.0, mem_limit)


def test_a_child_killed_by_a_signal_is_a_crash(monkeypatch, tmp_path):
    def segfault(*a):
        os.kill(os.getpid(), signal.SIGSEGV)

    res = _one(monkeypatch, tmp_path, segfault)
    assert res.cls == "crash" and "SIGSEGV" in res.error


def test_a_child_that_never_returns_is_a_hang(monkeypatch, tmp_path):
    res = _one(monkeypatch, tmp_path, lambda *a: time.sleep(60), time_limit=1.0)
    assert res.cls == "hang"
    assert res.seconds < 10


def test_memory_beyond_the_limit_at_load_is_a_blowup(monkeypatch, tmp_path):
    def hog(*a):
        try:
            bytearray(2**31)  # above the 512 MB limit
        except MemoryError as e:
            return {"cls": fuzz.classify_error("onnxplug", "load", e), "stage": "load"}
        return {"cls": "accepted", "stage": "run"}

    assert _one(monkeypatch, tmp_path, hog).cls == "memory"


@pytest.mark.parametrize(
    ("stage", "error", "cls"),
    [
        ("load", errors.InvalidGraph("x"), "rejected"),
        ("run", errors.Fail("x"), "run_error"),
        ("load", ValueError("x"), "untyped"),
        ("run", errors.Fail("Exiting due to terminate flag being set to true."), "terminated"),
        ("load", errors.Fail("unexpected error while loading the model: KeyError"), "unexpected"),
    ],
)
def test_classification_of_errors(stage, error, cls):
    assert fuzz.classify_error("onnxplug", stage, error) == cls


def test_out_of_memory_at_run_time_is_a_clean_error_at_load_a_blowup():
    oom = errors.Fail("Non-zero status code returned while running Expand node")
    oom.__cause__ = MemoryError()
    assert fuzz.classify_error("onnxplug", "run", oom) == "run_oom"
    assert fuzz.classify_error("onnxplug", "load", oom) == "memory"
