"""``benchmarks/cold_start.py --phases`` times session creation's steps by wrapping functions
it names: every name must still exist, or the diagnostic silently loses a phase."""

from __future__ import annotations

import importlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_phase_cold_start_times_names_a_function(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "plugins" / "cuda" / "src"))
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    cold_start = importlib.import_module("cold_start")
    assert cold_start.PHASES
    for mod, qual in cold_start.PHASES:
        owner = importlib.import_module(mod)
        for part in qual.split("."):
            owner = getattr(owner, part)
        assert callable(owner), f"{mod}.{qual}"
