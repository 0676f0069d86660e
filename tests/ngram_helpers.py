"""Token arrays, drafter contexts and draft requests for the draftless-drafter tests.

Shared by tests/test_ngram_{simple,map,mod,cache}.py (tests/conftest.py puts tests/ on sys.path).
"""

from __future__ import annotations

import numpy as np

from spekula.core.drafting.drafter import DrafterContext, DraftRequest
from spekula.core.params import SpecParams


def arr(tokens: list[int] | np.ndarray) -> np.ndarray:
    return np.asarray(tokens, dtype=np.int32)


def ctx(**options: object) -> DrafterContext:
    """A context carrying only drafter options (no target: draftless drafters never look at it)."""
    return DrafterContext(
        spec=SpecParams(drafter_options=dict(options)), target=None, tokenizer=None, n_seq_max=2
    )  # type: ignore[arg-type]


def request(hist: list[int] | np.ndarray, last: int, n_max: int = 1000, slot: int = 0) -> DraftRequest:
    """A greedy draft request with default speculation settings."""
    return DraftRequest(
        slot=slot, history=arr(hist), last=last, n_max=n_max, spec=SpecParams(), temperature=0.0, seed=0
    )
