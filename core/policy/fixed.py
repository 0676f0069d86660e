"""Fixed draft lengths: llama.cpp's rule, every drafter asked for all the round has room for.

What `--spec-adaptive off` (SpecParams(adaptive=False)) and synthetic acceptance run: no cost model,
so the statistics match llama.cpp counter for counter (tests/data/fixed_engine_stats.json).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from spekula.core.drafting.drafter import Drafter
from spekula.core.policy.policy import Adapted, DraftRound, RoundOutcome, RoundShape, RoundSlot


class FixedPolicy:
    def begin(self, slot: int) -> None:
        return None

    def ask(self, slot: RoundSlot, drafter: Drafter, per_token: bool, n: int, cap: int,
            shape: RoundShape) -> int | list[int]:
        return n  # the drafter stops at its own cap

    def keep_drafting(self, slot: RoundSlot, drafter: Drafter, n: int,
                      shape: RoundShape) -> Callable[[Sequence[float]], bool] | None:
        return None  # every drafter drafts up to its cap

    def cut(self, round: DraftRound) -> dict[int, int]:
        return {}

    def learn(self, outcome: RoundOutcome) -> list[Adapted]:
        return []

    def resting(self, slot: int, drafter: Drafter) -> bool:
        return False  # every drafter is asked every round
