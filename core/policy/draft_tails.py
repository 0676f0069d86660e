"""Drafts the cost model cut short, kept so that the next round can verify the rest.

When the adaptive policy's cut verifies only the first k tokens of a draft and all k are accepted, the
token the target emits after them is, more often than not, the draft's next token: the draft was
right so far and may well go on being right. Asking the drafter again from the new position can give a
different draft (an n-gram drafter may now match a more recent, wrong occurrence), so the rest of
the cut draft is kept and offered in its place, with the acceptance rates of the positions it
continues rather than those of a fresh draft's first tokens. Only for draftless drafters (a model
drafter's own state follows its drafts) and only without a grammar (the kept rest was checked
against the grammar as part of the whole draft; keeping it simple keeps it safe). Slots come in as
`SlotPosition`s: the policy package knows nothing of the engine's Slot.
"""

from __future__ import annotations

from dataclasses import dataclass

from spekula.core.drafting.drafter import Drafter
from spekula.core.policy.policy import SlotPosition


@dataclass(slots=True)
class Tail:
    request_id: str | None
    drafter: Drafter
    position: int  # the slot's n_hist once the kept prefix and the target's next token are committed
    tokens: list[int]  # the cut-off part of the draft; tokens[0] is where the target's next token must agree
    start: int  # the draft position of tokens[1] in the original draft (0 = its first token)

    @property
    def rest(self) -> list[int]:
        return self.tokens[1:]


class DraftTails:
    def __init__(self) -> None:
        self._tails: dict[int, Tail] = {}

    def keep(self, s: SlotPosition, drafter: Drafter, tokens: list[int], kept: int, start: int = 0,
             constrained: bool = False) -> None:
        """`tokens[:kept]` of `drafter`'s draft (whose first token is at draft position `start`) go
        into this round's forward; keep the rest if there is any to verify after the target's own
        next token (`constrained`: a grammar checks the slot's drafts)."""
        if len(tokens) - kept >= 2 and not getattr(drafter, "model_based", True) and not constrained:
            self._tails[s.id] = Tail(s.request_id, drafter, s.n_hist + kept + 1, list(tokens[kept:]), start + kept + 1)
        else:
            self._tails.pop(s.id, None)

    def take(self, s: SlotPosition, drafter: Drafter | None = None) -> Tail | None:
        """The slot's kept tail (of `drafter`'s draft, if given: another drafter's stays) if the previous
        round accepted everything verified before it and the target's next token is the tail's first;
        None otherwise. Either way it is used up."""
        tail = self._tails.get(s.id)
        if tail is None or (drafter is not None and tail.drafter is not drafter):
            return None
        del self._tails[s.id]
        if tail.request_id != s.request_id or tail.position != s.n_hist or tail.tokens[0] != s.last:
            return None
        return tail
