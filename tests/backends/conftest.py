"""Fixtures the backend tests share."""

from __future__ import annotations

import pytest
from sliding_window_checks import SMALL_RING_ROWS

from spekula.backends.native import backend as native_backend


@pytest.fixture
def small_rings(monkeypatch: pytest.MonkeyPatch) -> int:
    """Native sliding blocks with a small row cap: rings of 256 rows, so a context of several hundred
    tokens wraps them (tests/backends/test_gemma3.py, test_gemma4.py)."""
    monkeypatch.setattr(native_backend, "SWA_ROW_CAP", SMALL_RING_ROWS)
    return SMALL_RING_ROWS
