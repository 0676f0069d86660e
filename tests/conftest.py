"""Shared test set-up pytest loads before any test module.

The helper modules beside the tests (toy_backend, ngram_helpers, rpc_fakes, ...) are imported as
top-level modules: pytest runs with --import-mode=importlib, which does not put tests/ on sys.path,
so this puts it there once for every test file.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

TESTS = str(Path(__file__).parent)
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)


@pytest.fixture
def anyio_backend() -> str:
    """anyio's pytest plugin runs `@pytest.mark.anyio` tests on asyncio only (the engine's loop)."""
    return "asyncio"
