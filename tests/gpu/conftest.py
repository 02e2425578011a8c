"""GPU tests: per-test state of the one-op checks."""

from __future__ import annotations

import pytest
from tests.gpu import _oneop


@pytest.fixture(autouse=True)
def _reset_checks():
    _oneop.CHECKS_RUN.clear()
    yield
