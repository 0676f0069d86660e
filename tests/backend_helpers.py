"""Opening a backend on a test file and feeding it: whole prompts or pieces (the exact-mode chunking
tests), random token rows, the SIMD kernel choices of the native backend.

Imported by the backend tests under tests/ and tests/backends/ (tests/conftest.py puts tests/ on sys.path).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from spekula.core.backend import Backend, BackendOptions, SeqInput, load_backend


def open_backend(name: str, path: Path | str, *, n_ctx: int = 512, n_seq: int = 3, threads: int = 2,
                 exact: bool = True) -> Backend:
    """The `name` backend ("native", "torch", ...) on the model file `path` (exact: BackendOptions' default)."""
    return load_backend(name, str(path), BackendOptions(n_ctx=n_ctx, n_seq_max=n_seq, threads=threads, exact=exact))


def random_tokens(n: int, seed: int, low: int = 0, high: int = 320) -> np.ndarray:
    """`n` token ids drawn uniformly from [low, high) (int32, as a prompt row)."""
    return np.random.default_rng(seed).integers(low, high, n).astype(np.int32)


def native_simd_choices() -> list[str]:
    """Native kernel choices to run the backend tests under: the best set, and AVX2 where it is not the
    best (an AVX-512 machine), so both SIMD paths pass the same bitwise checks."""
    from spekula.backends.native import lib as nl

    sets = nl.available_kernels()
    return ["best"] + (["avx2"] if "avx2" in sets and nl.kernel_name() != "avx2" else [])


@contextmanager
def native_kernels(choice: str) -> Iterator[None]:
    """Native backends built inside use the kernel choice (read when a context is made)."""
    from spekula.backends.native.lib import KERNELS_ENV

    old = os.environ.get(KERNELS_ENV)
    os.environ[KERNELS_ENV] = choice
    try:
        yield
    finally:
        if old is None:
            del os.environ[KERNELS_ENV]
        else:
            os.environ[KERNELS_ENV] = old


def chunked_logits(be: Backend, seq: int, ids: np.ndarray, sizes: Sequence[int]) -> np.ndarray:
    """Logits of every row of ``ids`` fed to ``seq`` from position 0 in consecutive chunks of ``sizes``."""
    parts, start = [], 0
    for size in sizes:
        parts.append(be.forward([SeqInput(seq, ids[start : start + size], start, np.arange(size))])[0].logits)
        start += size
    return np.concatenate(parts)


def fresh_logits(be: Backend, ids: np.ndarray, sizes: Sequence[int] | None = None) -> np.ndarray:
    """:func:`chunked_logits` in a new sequence (freed afterwards); one chunk of all of ``ids`` by default."""
    seq = be.new_seq()
    try:
        return chunked_logits(be, seq, ids, sizes or [ids.size])
    finally:
        be.free_seq(seq)
