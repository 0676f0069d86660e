"""Vectorised search for every occurrence of an n-gram, shared by the draftless drafters.

A Python loop over 4096 positions costs milliseconds; these numpy passes cost tens of
microseconds (the per-round latest-occurrence searches are in C: drafters/draftless/ngram_lookup.py). Also
here: the options they share and the slot-by-slot `draft` those drafters share.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence

import numpy as np

from spekula.core.drafting.description import DrafterOption
from spekula.core.drafting.drafter import Draft, DraftlessDrafter, DraftRequest

_EMPTY = np.zeros(0, dtype=np.int64)


def match_positions(hist: np.ndarray, pattern: Sequence[int], lo: int, hi: int) -> np.ndarray:
    """All j in [lo, hi] (ascending) with hist[j : j+len(pattern)] == pattern.

    The caller guarantees hi + len(pattern) <= len(hist). Candidates are filtered one pattern
    position at a time, so the work shrinks quickly after the first comparison.
    """
    n = len(pattern)
    lo = max(lo, 0)
    if n == 0 or hi < lo:
        return _EMPTY
    cand = np.flatnonzero(hist[lo : hi + 1] == pattern[0])
    if cand.size == 0:
        return _EMPTY
    cand += lo
    for k in range(1, n):
        cand = cand[hist[cand + k] == pattern[k]]
        if cand.size == 0:
            return _EMPTY
    return cand


def same_tokens(hist: np.ndarray, start: int, pattern: Sequence[int]) -> bool:
    """hist[start : start+len(pattern)] == pattern (start within bounds)."""
    n = len(pattern)
    if start < 0 or start + n > len(hist):
        return False
    return bool(np.array_equal(hist[start : start + n], np.asarray(pattern, dtype=hist.dtype)))


def ngram_size_options(prefix: str, size_n: str, size_m: str, min_hits: str) -> tuple[DrafterOption, ...]:
    """The size-n / size-m / min-hits options that ngram-simple, ngram-map-k and ngram-map-k4v share
    (llama.cpp's names under `prefix`, defaults 12/48/1, ranges [1, 1024] and >= 1)."""
    return (
        DrafterOption(f"{prefix}-size-n", int, 12, size_n, llama_cpp=True, minimum=1, maximum=1024),
        DrafterOption(f"{prefix}-size-m", int, 48, size_m, llama_cpp=True, minimum=1, maximum=1024),
        DrafterOption(f"{prefix}-min-hits", int, 1, min_hits, llama_cpp=True, minimum=1),
    )


class SlotDraftless(DraftlessDrafter):
    """A draftless drafter whose `draft` asks `draft_one` per request and cuts to its n_max.

    The cut comes after `draft_one`, so what a drafter records about its own draft (its length
    before the round cap, the value accept() credits) does not depend on the round's n_max.
    """

    def draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        out: list[Draft] = []
        for req in requests:
            tokens = self.draft_one(req.slot, req.history, req.last)
            out.append(Draft(tokens[: max(req.n_max, 0)]))
        return out

    @abstractmethod
    def draft_one(self, slot: int, hist: np.ndarray, last: int) -> list[int]:
        """The uncapped draft after (hist, last) for `slot`, updating the slot's state."""
