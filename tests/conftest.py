"""Shared test set-up pytest loads before any test module.

The helper modules beside the tests (toy_backend, ngram_helpers, rpc_fakes, ...) are imported as
top-level modules: pytest runs with --import-mode=importlib, which does not put tests/ on sys.path,
so this puts it there once for every test file.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

TESTS = str(Path(__file__).parent)
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)


@pytest.fixture
def anyio_backend() -> str:
    """anyio's pytest plugin runs `@pytest.mark.anyio` tests on asyncio only (the engine's loop)."""
    return "asyncio"


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """Training tests run torch on one thread: their results are fixed for a thread count."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def bigram(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A target whose next token is a function of the current one: learnable from a few thousand tokens."""
    from spekula.backends.convert.hf import convert
    from spekula.fixtures import tiny_hf

    root = tmp_path_factory.mktemp("bigram")
    target = root / "bigram.gguf"
    convert(tiny_hf.write_bigram_target(root / "hf"), target, outtype="f32")
    return target
