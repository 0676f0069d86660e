"""Feeding a backend in pieces, for the exact-mode chunking tests of the ONNX and native backends.

Imported by tests/test_onnx_backend.py, test_onnx_quant.py, test_native_backend.py and test_native_moe.py
(tests/conftest.py puts tests/ on sys.path).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from spekula.core.backend import Backend, SeqInput


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
