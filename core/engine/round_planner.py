"""Planning one round: which rows every busy slot puts into the next forward.

Generating slots come first, each with its pending token x and the draft to verify after it; prompt
chunks fill what is left of n_batch. Drafting follows the precedence of docs/semantics.md §3: the
drafters are called in priority order, each once, for the slots still without a draft, and the
first non-empty draft of a slot wins. For a slot whose plan is adaptive the cost model then has
its say twice: before drafting (is this drafter worth asking, and for how many tokens) and after
(how much of each draft to verify, for all slots of the forward together). Shortening a draft
never changes what is emitted, only how fast.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from spekula.core.backend import SeqInput
from spekula.core.drafting.drafter import Draft, Drafter, DraftRequest
from spekula.core.drafting.registry import order_drafters
from spekula.core.engine.request_plan import drafter_cap
from spekula.core.engine.slot import Slot, SlotState
from spekula.core.modelfile.constraint import trim_draft
from spekula.core.policy.cost_model import AdaptiveController, Offer, choose_lengths
from spekula.core.policy.draft_tails import DraftTails, Tail

# A draftless drafter whose call costs less than this fraction of the round's forward is asked
# without weighing the call first (only a long run of calls that gave nothing of use makes its calls
# sparser): a draft found is worth far more than the call, weighing costs about as much as a cheap
# call, and skipping calls also starves the estimates of the evidence that the text has become
# predictable. The cut after drafting still sizes what is verified.
CHEAP_CALL = 0.1
# Whether a draftless drafter is worth asking is judged on its first positions only (the worth of
# later ones is small, and the decision itself must stay cheap).
DECIDE_POSITIONS = 16


@dataclass(slots=True)
class Decision:
    """What the cost model decided for one adaptive slot this round."""

    drafter: str  # the drafter whose draft (or whose turn) it was
    natural: int  # tokens a fixed policy would verify; -1 when the drafter was not asked at all
    kept: int  # tokens verified
    expected: float  # emitted tokens the model expects from this slot (1 + acceptance of kept)
    probe: bool


@dataclass(slots=True)
class Work:
    slot: Slot
    inp: SeqInput
    draft: Draft = field(default_factory=Draft.empty)
    drafter: Drafter | None = None  # whose draft is verified
    prompt_chunk: bool = False
    decision: Decision | None = None


@dataclass(slots=True)
class DraftCall:
    drafter: Drafter
    lengths: dict[int, int]  # slot -> length of its draft after the caps (0: nothing)
    seconds: float


@dataclass(slots=True)
class RoundPlan:
    work: list[Work]
    calls: list[DraftCall]
    drafting_seconds: float = 0.0
    rows: int = 0
    predicted_seconds: float = 0.0  # adaptive rounds: the cost model's time for this round
    plain_seconds: float = 0.0  # ... and for the same round without drafts or drafting


class PlanObserver(Protocol):
    def drafted(self, slot: Slot, k: int) -> None: ...

    def draft_called(self, drafter: str, lengths: list[int], seconds: float) -> None: ...

    def grammar_rejected(self, slot: Slot, drafter: str, n: int) -> None: ...


class RoundPlanner:
    def __init__(self, n_batch: int, observer: PlanObserver, controller: AdaptiveController | None) -> None:
        self.n_batch = n_batch
        self.observer = observer
        self.controller = controller
        self._rotate = 0  # round-robin start, so no slot starves when n_batch is tight
        # Drafter sets seen so far -> (drafter, drafts per token?) in precedence order: sorting and
        # flag lookups would otherwise be paid every round.
        self._orders: dict[tuple[int, ...], list[tuple[Drafter, bool]]] = {}
        self.tails = DraftTails()
        # This round's slots whose draft is the kept rest of a cut one -> its first token's draft position.
        self._continued: dict[int, int] = {}

    def plan(self, slots: list[Slot]) -> RoundPlan:
        self._continued = {}
        busy = [s for s in slots if s.busy and not s.finished]
        if busy:
            self._rotate = (self._rotate + 1) % len(busy)
            busy = busy[self._rotate:] + busy[: self._rotate]
        gen = [s for s in busy if s.state is SlotState.GENERATING]
        budget = self.n_batch
        reserved: list[tuple[Slot, int]] = []
        for s in gen:
            if budget < 1:
                break
            n_max = min(s.n_draft_max(), budget - 1)
            reserved.append((s, n_max))
            budget -= 1 + n_max
        prompt_pending = sum(len(s.prompt) - s.n_prompt_done for s in busy if s.state is SlotState.PROMPT)
        base_rows = len(reserved) + prompt_pending
        wants = [(s, n) for s, n in reserved if n > 0 and s.drafters]
        decisions: dict[int, Decision] = {}
        chosen, calls = self._draft(wants, base_rows, len(reserved), decisions) if wants else ({}, [])
        plan = RoundPlan([], calls, drafting_seconds=sum(c.seconds for c in calls))
        self._shorten({s.id: s for s, _ in reserved}, chosen, decisions, plan, base_rows, len(reserved))
        for call in calls:
            self.observer.draft_called(call.drafter.name, list(call.lengths.values()), call.seconds)
        for s, _ in wants:  # every slot that asked, even for nothing (docs/semantics.md §1.1 step 4)
            if any(s.id in c.lengths for c in calls):
                self.observer.drafted(s, len(chosen[s.id][0].tokens) if s.id in chosen else 0)
        budget = self.n_batch
        for s, _ in reserved:
            if s.finished:
                continue
            draft, drafter = chosen.get(s.id, (Draft.empty(), None))
            toks = np.array([s.last, *draft.tokens], dtype=np.int32)
            plan.work.append(Work(s, SeqInput(s.seq_id, toks, s.n_hist, np.arange(len(toks))), draft, drafter,
                                  decision=decisions.get(s.id)))
            budget -= len(toks)
        for s in busy:
            if s.state is not SlotState.PROMPT or budget <= 0:
                continue
            n = min(len(s.prompt) - s.n_prompt_done, budget)
            chunk = s.prompt[s.n_prompt_done : s.n_prompt_done + n]
            last = s.n_prompt_done + n == len(s.prompt)
            rows = np.array([n - 1]) if last else np.zeros(0, dtype=np.int64)
            plan.work.append(Work(s, SeqInput(s.seq_id, chunk, s.n_prompt_done, rows), prompt_chunk=True))
            budget -= n
        plan.rows = sum(len(w.inp.tokens) for w in plan.work)
        return plan

    # -- drafting -------------------------------------------------------------------------------
    def _round_time(self, base_rows: int, extra_seconds: float = 0.0) -> Callable[[int], float]:
        assert self.controller is not None
        cost = self.controller.cost
        return lambda extra: cost.forward(min(self.n_batch, base_rows + extra)) + cost.overhead + extra_seconds

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

    def _ask_length(self, s: Slot, drafter: Drafter, per_token: bool, n: int, base_rows: int,
                    n_gen: int) -> int | None:
        """Tokens to ask `drafter` for on behalf of slot `s`: 0 when the cost model skips it this round,
        None when it is not asked because its last calls all came back empty (not a decision about
        a draft, so not counted as one)."""
        assert self.controller is not None and s.plan is not None
        cost = self.controller.cost
        # Weigh only what the drafter can draft: a model drafter stops at --spec-draft-n-max, an n-gram
        # drafter at its own cap, whatever room the round has (valuing a six-token head as if it could
        # draft sixty made its calls look worth far more than they are).
        cap = drafter_cap(drafter, s.plan.spec)
        if cap <= 0:
            return None  # it drafts nothing (--spec-draft-n-max 0): asking would only cost its call
        n = min(n, cap)
        if per_token:
            call_cost, token_cost = cost.model_drafting(drafter.name)
        else:
            call_cost, token_cost = cost.drafting(drafter.name), 0.0
            if call_cost < CHEAP_CALL * cost.forward(base_rows):
                # Asking costs less than deciding whether to ask; the cut after drafting decides. Only
                # a long run of empty calls makes the calls sparser (AdaptiveController.due).
                return n if self.controller.due(drafter.name, s.id) else None
        k = self.controller.ask_length(s.id, drafter.name, n if per_token else min(n, DECIDE_POSITIONS),
                                       self._round_time(base_rows), base_tokens=n_gen,
                                       call_cost=call_cost, token_cost=token_cost)
        # An n-gram drafter's whole draft costs no more than a part of it: ask for all, keep what pays.
        return k if per_token or k == 0 else n

    def _draft(self, wants: list[tuple[Slot, int]], base_rows: int, n_gen: int,
               decisions: dict[int, Decision]) -> tuple[dict[int, tuple[Draft, Drafter]], list[DraftCall]]:
        """One orchestrator call (docs/semantics.md §3): drafters in priority order, each once, for the
        slots still looking."""
        looking = {s.id: (s, n) for s, n in wants}
        chosen: dict[int, tuple[Draft, Drafter]] = {}
        calls: list[DraftCall] = []
        tails = {s.id: t for s, _ in wants if s.plan is not None and s.plan.adaptive and (t := self.tails.take(s))}
        order = self._order(wants)
        for drafter, per_token in order:
            if tails:
                self._continue(drafter, tails, looking, chosen, calls, decisions)
            mine: list[tuple[Slot, int]] = []
            for s, n in looking.values():
                if drafter not in s.drafters:
                    continue
                ask = n
                if s.plan is not None and s.plan.adaptive and self.controller is not None:
                    asked = self._ask_length(s, drafter, per_token, n, base_rows, n_gen)
                    if asked is None:
                        continue
                    ask = asked
                    if ask == 0:
                        decisions.setdefault(s.id, Decision(drafter.name, -1, 0, 1.0, False))
                        continue
                mine.append((s, ask))
            if not mine:
                continue
            reqs = [_draft_request(s, n) for s, n in mine]
            t0 = time.perf_counter()
            try:
                drafts = drafter.draft(reqs)
                if len(drafts) != len(reqs):
                    raise RuntimeError(f"returned {len(drafts)} drafts for {len(reqs)} requests")
                for d in drafts:
                    _check_confidence(d)
            except Exception as exc:  # a broken drafter ends the requests it was drafting for, not the engine
                for s, _ in mine:
                    s.error = f"drafter {drafter.name!r} failed: {type(exc).__name__}: {exc}"
                    del looking[s.id]
                continue
            call = DraftCall(drafter, {}, time.perf_counter() - t0)
            calls.append(call)
            for (s, n), d in zip(mine, drafts, strict=True):
                call.lengths[s.id] = min(len(d.tokens), n)
                if self.controller is not None and s.plan is not None and s.plan.adaptive:
                    self.controller.called(drafter.name, s.id, bool(d.tokens), judged_at_cut=d.confidence is not None)
                if not d.tokens:
                    continue  # an empty draft falls through to the next drafter
                if len(d.tokens) > n:  # the round's budget caps every drafter (docs/semantics.md §1.3)
                    d = d.prefix(n)
                if s.plan is not None and s.plan.constraint is not None:
                    d = self._grammar_trim(s, drafter, d, call)
                    if not d.tokens:
                        continue  # the grammar forbids its first token: as if nothing was drafted
                chosen[s.id] = (d, drafter)
                decisions.pop(s.id, None)  # a lower drafter drafted after all
                del looking[s.id]
            if self.controller is not None:
                steps = max(call.lengths.values(), default=0)
                self.controller.cost.observe_draft(drafter.name, call.seconds, steps, per_token=per_token)
            if not looking:
                break
        return chosen, calls

    def _continue(self, drafter: Drafter, tails: dict[int, Tail], looking: dict[int, tuple[Slot, int]],
                  chosen: dict[int, tuple[Draft, Drafter]], calls: list[DraftCall],
                  decisions: dict[int, Decision]) -> None:
        """Where it is `drafter`'s turn for a slot still looking and the slot kept the rest of its cut
        draft (core/policy/draft_tails.py), that rest is its draft this round, without a call: drafters before
        it in precedence were asked and had nothing, and the drafter's own state still follows the
        draft the rest came from."""
        call: DraftCall | None = None
        for sid in [sid for sid, t in tails.items() if t.drafter is drafter and sid in looking]:
            tail = tails.pop(sid)
            rest = tail.rest[: looking[sid][1]]
            if not rest:
                continue
            if call is None:
                call = DraftCall(drafter, {}, 0.0)
                calls.append(call)
            call.lengths[sid] = len(rest)
            _shortened(drafter, sid, len(rest))  # what it judges its acceptance against: the tokens verified now
            chosen[sid] = (Draft(rest), drafter)
            decisions.pop(sid, None)
            del looking[sid]
            self._continued[sid] = tail.start

    def _grammar_trim(self, s: Slot, drafter: Drafter, d: Draft, call: DraftCall) -> Draft:
        """Drop what the request's grammar forbids before it costs a verification row."""
        assert s.plan is not None and s.plan.constraint is not None
        tokens, _probs, rejected = trim_draft(list(d.tokens), d.probs, s.plan.constraint.valid_prefix(d.tokens))
        if not rejected:
            return d
        self.observer.grammar_rejected(s, drafter.name, rejected)
        call.lengths[s.id] = len(tokens)
        return d.prefix(len(tokens))  # trim_draft keeps a prefix: the same tokens and probabilities

    # -- the cost model's cut -------------------------------------------------------------------
    def _shorten(self, slots: dict[int, Slot], chosen: dict[int, tuple[Draft, Drafter]],
                 decisions: dict[int, Decision], plan: RoundPlan, base_rows: int, n_gen: int) -> None:
        """Keep, of every adaptive slot's draft, the prefix that pays for its rows in this forward."""
        if self.controller is None:
            return
        adaptive = [sid for sid in chosen if (p := slots[sid].plan) is not None and p.adaptive]
        if adaptive or decisions:
            self._cut(slots, chosen, decisions, plan, adaptive, base_rows, n_gen)
        self._count_quiet_rounds(slots, chosen, decisions)

    def _cut(self, slots: dict[int, Slot], chosen: dict[int, tuple[Draft, Drafter]], decisions: dict[int, Decision],
             plan: RoundPlan, adaptive: list[int], base_rows: int, n_gen: int) -> None:
        assert self.controller is not None
        fixed_rows = sum(len(d.tokens) for sid, (d, _) in chosen.items() if sid not in adaptive)
        round_time = self._round_time(base_rows + fixed_rows, plan.drafting_seconds)
        plan.plain_seconds = self._round_time(base_rows)(0)
        if not adaptive:  # only decisions not to draft: nothing to weigh
            plan.predicted_seconds = round_time(0)
            return
        offers: list[Offer] = []
        for sid in adaptive:
            draft, drafter = chosen[sid]
            offers.append(self.controller.offer(sid, drafter.name, len(draft.tokens), start=self._continued.get(sid, 0),
                                                confidence=draft.confidence))
        result = choose_lengths(offers, round_time, base_tokens=n_gen,
                                rate=self.controller.rate(n_gen, round_time(0)))
        for o in offers:
            draft, drafter = chosen[o.slot]
            kept = result.lengths[o.slot]
            decisions[o.slot] = Decision(drafter.name, o.length, kept, 1.0 + sum(o.gains[:kept]), o.probe)
            for call in plan.calls:  # the statistics count what is verified
                if call.drafter is drafter and o.slot in call.lengths:
                    call.lengths[o.slot] = kept
            self.tails.keep(slots[o.slot], drafter, draft.tokens, kept, self._continued.get(o.slot, 0))
            self.controller.kept(drafter.name, o.slot, kept, judged_at_cut=draft.confidence is not None)
            if kept < o.length:
                _shortened(drafter, o.slot, kept)
                if kept == 0:
                    del chosen[o.slot]
                else:
                    chosen[o.slot] = (draft.prefix(kept), drafter)
        plan.predicted_seconds = result.predicted_time

    def _count_quiet_rounds(self, slots: dict[int, Slot], chosen: dict[int, tuple[Draft, Drafter]],
                            decisions: dict[int, Decision]) -> None:
        """Tell the controller how many draft tokens each adaptive slot verifies this round (its
        probes are due after enough rounds without any)."""
        assert self.controller is not None
        for sid, s in slots.items():
            if (p := s.plan) is None or not p.adaptive or not s.drafters or s.n_draft_max() <= 0:
                continue
            if sid in chosen:
                self.controller.planned(sid, len(chosen[sid][0].tokens))
            elif sid not in decisions and self.controller.probing(sid):
                self.controller.probe_found_nothing(sid)  # every drafter was asked and had nothing
            else:
                self.controller.planned(sid, 0)


def _check_confidence(d: Draft) -> None:
    """A drafter's confidences, if it gives any, as one float per token (a plugin's mistake here must
    end its requests with a clear error, not fail later inside the cost model)."""
    if d.confidence is None:
        return
    values = [float(c) for c in d.confidence]
    if len(values) != len(d.tokens):
        raise RuntimeError(f"returned {len(values)} confidences for a draft of {len(d.tokens)} tokens")
    d.confidence = values


def _draft_request(s: Slot, n_max: int) -> DraftRequest:
    """What a drafter is asked on behalf of a generating slot (which always has a request and a plan)."""
    assert s.plan is not None and s.request is not None
    return DraftRequest(slot=s.id, history=s.history, last=s.last, n_max=n_max, spec=s.plan.spec,
                        temperature=s.request.sampling.temperature, seed=s.plan.seed)


def _shortened(drafter: Drafter, slot: int, n: int) -> None:
    """Tell a drafter that keeps state by its draft's length (`shortened`, optional) that n tokens of
    its draft for `slot` are verified."""
    trim = getattr(drafter, "shortened", None)
    if callable(trim):
        trim(slot, n)
