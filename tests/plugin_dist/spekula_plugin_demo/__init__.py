"""A minimal third-party drafter: propose what followed the previous occurrence of the last token.

It declares one option of its own, which spekula's CLI offers without knowing this package.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import numpy as np

from spekula.core.drafting.description import DrafterDescription, DrafterOption
from spekula.core.drafting.drafter import Draft, DrafterContext, DraftlessDrafter, DraftRequest


class LookbackDrafter(DraftlessDrafter):
    name: ClassVar[str] = "demo-lookback"
    description: ClassVar[DrafterDescription] = DrafterDescription(
        summary="what followed the previous occurrence of the last token",
        options=(DrafterOption("demo-lookback-n-max", int, 4, "longest draft", minimum=1, maximum=64),),
    )
    created: ClassVar[list[LookbackDrafter]] = []  # every instance, so a test can see what reached it

    def __init__(self, n_max: int) -> None:
        self.n_max = n_max
        self.draft_cap = n_max  # the engine sizes synthetic rates and tables by it
        self.calls = 0

    @classmethod
    def create(cls, ctx: DrafterContext) -> LookbackDrafter:
        drafter = cls(ctx.int_value(cls.description.options[0]))
        cls.created.append(drafter)
        return drafter

    def begin(self, slot: int, prompt: np.ndarray) -> None:
        return None

    def draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        self.calls += 1
        out = []
        for r in requests:
            hits = np.flatnonzero(r.history[:-1] == r.last)
            if len(hits) == 0:
                out.append(Draft.empty())
                continue
            j = int(hits[-1]) + 1
            n = min(self.n_max, r.n_max)
            out.append(Draft([int(t) for t in r.history[j : j + n]]))
        return out

    def accept(self, slot: int, n_accepted: int, mine: bool) -> None:
        return None
