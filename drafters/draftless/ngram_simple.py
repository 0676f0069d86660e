"""ngram-simple: copy what followed the latest earlier occurrence of the current n-gram."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import numpy as np

from spekula.core.drafting.description import DrafterDescription
from spekula.core.drafting.drafter import Draft, Drafter, DrafterContext, DraftlessDrafter, DraftRequest
from spekula.drafters.draftless import ngram_lookup
from spekula.drafters.draftless.ngram_lookup import simple_draft
from spekula.drafters.draftless.ngram_match import ngram_size_options


def ngram_simple_draft(hist: np.ndarray, last: int, size_n: int, size_m: int, min_hits: int = 1) -> list[int]:
    """The ngram-simple draft for history H (excluding x) and x = `last`.

    The pattern is the last N tokens of (H, x). Its latest occurrence at an index j in
    [1, L-N-1] (index 0 is never tested) wins; D is the min(M, L-j-N) tokens after it, and no
    draft is made when that is fewer than N tokens. `min_hits` is the number of occurrences in
    that range the pattern needs before it drafts (1 = llama.cpp's behaviour).
    """
    return simple_draft(hist, last, size_n, size_m, max(min_hits, 1))


class NgramSimpleDrafter(DraftlessDrafter, Drafter):
    """Self-speculation from the request's own history (llama.cpp `common_ngram_simple_draft`).

    Options (llama.cpp names): ``description`` below; size-n is the pattern length N, size-m the
    longest draft M, min-hits the occurrences needed before drafting.

    Stateless: every call searches (H, x) afresh, backwards from the end (in C).

    Differences from llama.cpp:
      * ``min-hits`` works: the pattern must occur at least that many times (at indices >= 1)
        before a draft is made. llama.cpp parses the option and ignores it; the default 1 gives
        identical drafts.
    """

    name: ClassVar[str] = "ngram-simple"
    description: ClassVar[DrafterDescription] = DrafterDescription(
        summary="copy what followed the latest earlier occurrence of the last N tokens",
        options=ngram_size_options("spec-ngram-simple", "N, pattern length", "M, longest draft",
                                   "occurrences of the pattern needed before drafting"),
        builtin_order=0,
        slot_state="none",
    )

    def __init__(self, size_n: int = 12, size_m: int = 48, min_hits: int = 1) -> None:
        self.size_n = size_n
        self.size_m = size_m
        self.min_hits = min_hits

    @property
    def draft_cap(self) -> int:
        return self.size_m

    @classmethod
    def create(cls, ctx: DrafterContext) -> NgramSimpleDrafter:
        ngram_lookup.require()
        size_n, size_m, min_hits = (ctx.int_value(o) for o in cls.description.options)
        return cls(size_n=size_n, size_m=size_m, min_hits=min_hits)

    def begin(self, slot: int, prompt: np.ndarray) -> None:
        return None

    def draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        out: list[Draft] = []
        for req in requests:
            if req.n_max <= 0:
                out.append(Draft.empty())
                continue
            tokens = ngram_simple_draft(req.history, req.last, self.size_n, self.size_m, self.min_hits)
            out.append(Draft(tokens[: req.n_max]))
        return out

    def accept(self, slot: int, n_accepted: int, mine: bool) -> None:
        return None
