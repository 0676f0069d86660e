"""Feeding a backend in pieces, for the exact-mode chunking tests of the ONNX backend (f32 and q4).

Imported by tests/test_onnx_backend.py and test_onnx_quant.py (tests/conftest.py puts tests/ on sys.path).
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
