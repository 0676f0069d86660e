"""Planning one round: which rows every busy slot puts into the next forward.

Generating slots come first, each with its pending token x and the draft to verify after it; prompt
chunks fill what is left of n_batch. Drafting follows the precedence of docs/semantics.md §3: the
drafters are called in priority order, each once, for the slots still without a draft, and the
first non-empty draft of a slot wins. The slot's draft policy (core/policy/policy.py) is asked at
every drafter's turn whether to call it and for how many tokens, and, once everything is drafted,
how much of each draft to verify; the drafters and the statistics then hear what is verified.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from spekula.core.backend import SeqInput
from spekula.core.drafting.drafter import Draft, Drafter
from spekula.core.drafting.registry import order_drafters
from spekula.core.engine.draft_call import call_drafter, tell_shortened
from spekula.core.engine.request_plan import drafter_cap
from spekula.core.engine.slot import Slot, SlotState
from spekula.core.policy.policy import DraftCall, DraftPolicy, DraftRound, RoundShape

Chosen = dict[int, tuple[Draft, Drafter]]  # slot -> the draft it verifies and whose it is, in drafting order


@dataclass(slots=True)
class Work:
    slot: Slot
    inp: SeqInput
    draft: Draft = field(default_factory=Draft.empty)
    drafter: Drafter | None = None  # whose draft is verified
    prompt_chunk: bool = False


@dataclass(slots=True)
class RoundPlan:
    work: list[Work]
    calls: list[DraftCall]
    drafting_seconds: float = 0.0
    rows: int = 0


class PlanObserver(Protocol):
    def drafted(self, slot: Slot, k: int) -> None: ...

    def draft_called(self, drafter: str, lengths: list[int], seconds: float) -> None: ...

    def grammar_rejected(self, slot: Slot, drafter: str, n: int) -> None: ...


class RoundPlanner:
    def __init__(self, n_batch: int, observer: PlanObserver, policies: Sequence[DraftPolicy]) -> None:
        self.n_batch = n_batch
        self.observer = observer
        self.policies = tuple(policies)  # every policy a request may choose: each cuts every round
        self._rotate = 0  # round-robin start, so no slot starves when n_batch is tight
        # Drafter sets seen so far -> (drafter, drafts per token?) in precedence order: sorting and
        # flag lookups would otherwise be paid every round.
        self._orders: dict[tuple[int, ...], list[tuple[Drafter, bool]]] = {}

    def plan(self, slots: list[Slot]) -> RoundPlan:
        busy = [s for s in slots if s.busy and not s.finished]
        if busy:
            self._rotate = (self._rotate + 1) % len(busy)
            busy = busy[self._rotate:] + busy[: self._rotate]
        budget = self.n_batch  # generating slots first: one row for x and room for a draft
        reserved: list[tuple[Slot, int]] = []
        for s in busy:
            if s.state is not SlotState.GENERATING or budget < 1:
                continue
            n_max = min(s.n_draft_max(), budget - 1)
            reserved.append((s, n_max))
            budget -= 1 + n_max
        prompt_pending = sum(len(s.prompt) - s.n_prompt_done for s in busy if s.state is SlotState.PROMPT)
        shape = RoundShape(self.n_batch, len(reserved) + prompt_pending, len(reserved))
        wants = [(s, n) for s, n in reserved if n > 0 and s.drafters]
        chosen, calls = self._draft(wants, shape) if wants else ({}, [])  # drafting, then the policies' cut
        plan = RoundPlan([], calls, drafting_seconds=sum(c.seconds for c in calls))
        self._cut(DraftRound(shape, {s.id: s for s, _ in reserved}, chosen, calls, plan.drafting_seconds), chosen)
        for call in calls:
            self.observer.draft_called(call.drafter.name, list(call.lengths.values()), call.seconds)
        for s, _ in wants:  # every slot that asked, even for nothing (docs/semantics.md §1.1 step 4)
            if any(s.id in c.lengths for c in calls):
                self.observer.drafted(s, len(chosen[s.id][0].tokens) if s.id in chosen else 0)
        budget = self.n_batch  # the forward's rows: x and the draft per generating slot, then prompt chunks
        for s, _ in reserved:
            if s.finished:
                continue
            draft, drafter = chosen.get(s.id, (Draft.empty(), None))
            toks = np.array([s.last, *draft.tokens], dtype=np.int32)
            plan.work.append(Work(s, SeqInput(s.seq_id, toks, s.n_hist, np.arange(len(toks))), draft, drafter))
            budget -= len(toks)
        for s in busy:
            if s.state is not SlotState.PROMPT or budget <= 0:
                continue
            n = min(len(s.prompt) - s.n_prompt_done, budget)
            chunk = s.prompt[s.n_prompt_done : s.n_prompt_done + n]
            rows = np.array([n - 1]) if s.n_prompt_done + n == len(s.prompt) else np.zeros(0, dtype=np.int64)
            plan.work.append(Work(s, SeqInput(s.seq_id, chunk, s.n_prompt_done, rows), prompt_chunk=True))
            budget -= n
        plan.rows = sum(len(w.inp.tokens) for w in plan.work)
        return plan

    def _order(self, wants: list[tuple[Slot, int]]) -> list[tuple[Drafter, bool]]:
        """Every drafter of the asking slots once, in precedence order, with its per-token flag."""
        if len(wants) == 1:
            drafters: Sequence[Drafter] = wants[0][0].drafters
        else:
            drafters = list({id(d): d for s, _ in wants for d in s.drafters}.values())
        key = tuple(id(d) for d in drafters)
        order = self._orders.get(key)
        if order is None:
            if len(self._orders) > 64:  # per-request drafter sets come and go
                self._orders.clear()
            order = [(d, bool(getattr(d, "model_based", True))) for d in order_drafters(drafters)]
            self._orders[key] = order
        return order

    def _draft(self, wants: list[tuple[Slot, int]], shape: RoundShape) -> tuple[Chosen, list[DraftCall]]:
        """One orchestrator call (docs/semantics.md §3): drafters in priority order, each once, for the
        slots still looking, as far as each slot's policy wants them asked."""
        looking = {s.id: (s, n) for s, n in wants}
        chosen: Chosen = {}
        calls: list[DraftCall] = []
        for drafter, per_token in self._order(wants):
            mine: list[tuple[Slot, int]] = []
            stops: dict[int, Callable[[Sequence[float]], bool] | None] = {}
            resumed: DraftCall | None = None
            for s, n in list(looking.values()):
                if drafter not in s.drafters:
                    continue
                assert s.plan is not None
                ask = s.plan.policy.ask(s, drafter, per_token, n, drafter_cap(drafter, s.plan.spec), shape)
                if isinstance(ask, list):  # the rest of its last draft, verified instead of a call
                    if resumed is None:
                        resumed = DraftCall(drafter, 0.0, resumed=True)
                        calls.append(resumed)
                    resumed.lengths[s.id] = len(ask)
                    tell_shortened(drafter, s.id, len(ask))  # what it judges its acceptance against
                    chosen[s.id] = (Draft(ask), drafter)
                    del looking[s.id]
                elif ask > 0:
                    mine.append((s, ask))
                    if per_token:  # a model drafter: it may stop where the cut would keep no more
                        stops[s.id] = s.plan.policy.keep_drafting(s, drafter, ask, shape)
            called = call_drafter(drafter, per_token, mine, self.observer, stops) if mine else None
            if called is not None:
                calls.append(called[0])
                for sid, draft in called[1].items():
                    chosen[sid] = (draft, drafter)
            for s, _ in mine:  # a slot with a draft, or whose drafter failed (it carries the error), is done
                if s.id in chosen or s.error is not None:
                    del looking[s.id]
            if not looking:
                break
        return chosen, calls

    def _cut(self, round: DraftRound, chosen: Chosen) -> None:
        """Every policy keeps, of its slots' drafts (`chosen`, also in `round`), what it will verify;
        the statistics count that."""
        for policy in self.policies:
            for sid, kept in policy.cut(round).items():
                draft, drafter = chosen[sid]
                for call in round.calls:
                    if call.drafter is drafter and sid in call.lengths:
                        call.lengths[sid] = kept
                if kept < len(draft.tokens):
                    tell_shortened(drafter, sid, kept)
                    if kept == 0:
                        del chosen[sid]
                    else:
                        chosen[sid] = (draft.prefix(kept), drafter)

