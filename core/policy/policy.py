"""The draft policy: what a speculative round asks about draft lengths, and what it tells afterwards.

A round asks a slot's policy three things, in this order (docs/semantics.md §1.1):

    ask    at a drafter's turn for a slot: call it, and for how many tokens (or verify the rest of
           the slot's previous draft instead of calling)
    cut    once everything is drafted: how much of each of its slots' drafts to verify, for all
           slots of the forward together; it is also told what each drafter call cost
    learn  after verification: acceptance per slot, the forward's time for its rows, the round's
           overhead; it answers with the decisions it made this round, for the statistics

and, between planning and the forward, whether a drafter rests for a slot (`resting`): the engine
then captures nothing for it and does not let it observe the forward.

The engine keeps one instance per kind and tells every one of them about every round (a cost model
follows the machine whatever the requests it serves chose); a request's plan names the one that
decides its drafts. Policies never change what is emitted, only how much is verified per round.
No torch, and nothing from core/engine: the engine's slots reach a policy as `RoundSlot`s.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from spekula.core.drafting.drafter import Draft, Drafter


class SlotPosition(Protocol):
    """Where a generating slot's request stands: enough to tell whether a kept draft still applies."""

    @property
    def id(self) -> int: ...

    @property
    def request_id(self) -> str | None: ...

    @property
    def n_hist(self) -> int: ...

    @property
    def last(self) -> int: ...


class RoundSlot(SlotPosition, Protocol):
    """A generating slot of this round as a policy sees it (the engine's Slot)."""

    @property
    def policy(self) -> DraftPolicy | None: ...

    @property
    def constrained(self) -> bool: ...

    def may_draft(self) -> bool:
        """It has drafters and context room for a draft token."""
        ...


@dataclass(frozen=True, slots=True)
class RoundShape:
    """The rows a round has before any draft token, which every length decision is weighed against."""

    n_batch: int  # the most rows a forward may take
    base_rows: int  # one per generating slot plus the pending prompt tokens
    n_gen: int  # generating slots: each emits at least one token


class Answer(NamedTuple):
    """What a drafter call returned for one slot, before the round's caps."""

    slot: RoundSlot
    drafted: bool  # anything at all
    confident: bool  # the draft carries the drafter's confidence per token


@dataclass(slots=True)
class DraftCall:
    """One call of a drafter this round, or (`resumed`) the kept rests of its drafts verified instead."""

    drafter: Drafter
    seconds: float
    lengths: dict[int, int] = field(default_factory=dict)  # slot -> its draft as verified (0: none)
    per_token: bool = False  # a model drafter: its time grows with the tokens it drafts
    steps: int = 0  # its longest draft after the caps (what a model drafter's time is fitted against)
    answers: list[Answer] = field(default_factory=list)
    resumed: bool = False


@dataclass(slots=True)
class DraftRound:
    """Everything drafted this round, as the cut sees it."""

    shape: RoundShape
    slots: Mapping[int, RoundSlot]  # every generating slot of the round, by id
    drafts: Mapping[int, tuple[Draft, Drafter]]  # slot -> its draft and drafter, in the order drafted
    calls: Sequence[DraftCall]
    drafting_seconds: float


@dataclass(slots=True)
class Decision:
    """What a policy decided for one slot this round (reported to the statistics)."""

    drafter: str  # the drafter whose draft (or whose turn) it was
    natural: int  # tokens a fixed policy would verify; -1 when the drafter was not asked at all
    kept: int  # tokens verified
    expected: float  # emitted tokens the policy expects from this slot (1 + acceptance of kept)
    probe: bool


@dataclass(slots=True)
class Verified:
    """A slot's non-empty draft as verification judged it."""

    slot: int
    drafter: str
    n_drafted: int
    n_accepted: int
    confidence: list[float] | None


@dataclass(slots=True)
class RoundOutcome:
    """What one round did, told to every policy after verification."""

    rows: int
    n_seqs: int
    with_prompt: bool  # prompt chunks were in the forward (their time buys no tokens yet)
    drafted: bool  # a drafter was called or a draft verified
    forward_seconds: float
    drafting_seconds: float
    round_seconds: float  # planning, drafting, forward and verification
    emitted: dict[int, int]  # generating slot -> tokens emitted, in the forward's order
    verified: list[Verified]


class Adapted(NamedTuple):
    """A decision and what came of it; costs are in units of the same round without drafts."""

    decision: Decision
    emitted: int
    predicted_cost: float
    measured_cost: float


class DraftPolicy(Protocol):
    def begin(self, slot: int) -> None:
        """A new request on `slot` starts generating."""

    def ask(self, slot: RoundSlot, drafter: Drafter, per_token: bool, n: int, cap: int,
            shape: RoundShape) -> int | list[int]:
        """At `drafter`'s turn for `slot` (room for `n` tokens, the drafter's own cap `cap`): tokens to
        ask it for (0: do not call it for this slot), or tokens to verify instead of calling it."""
        ...

    def keep_drafting(self, slot: RoundSlot, drafter: Drafter, n: int,
                      shape: RoundShape) -> Callable[[Sequence[float]], bool] | None:
        """For a call of model drafter `drafter` for `slot` this round, asked for `n` tokens: given the confidences of the
        tokens drafted so far, whether a further token could still be verified (None: draft to n_max)."""
        ...

    def cut(self, round: DraftRound) -> dict[int, int]:
        """How many tokens of each of its slots' drafts to verify (slots left out keep all)."""
        ...

    def learn(self, outcome: RoundOutcome) -> list[Adapted]:
        """Take in a verified round; return the decisions it made for it and what they gave."""
        ...

    def resting(self, slot: int, drafter: Drafter) -> bool:
        """Whether `drafter` will not be asked for `slot` in the next few rounds, so that a drafter able
        to resume after missed forwards (Drafter.resumes) need neither observe this round's forward
        nor have hidden states captured for it."""
        ...
