"""Adaptive draft lengths: the cost model decides, per round, what is worth drafting and verifying.

It has its say twice per round. Before drafting (`ask`): is this drafter worth calling for the
slot, and for how many tokens; or does the slot verify the rest of the draft the last cut left
over (core/policy/draft_tails.py) instead. After drafting (`cut`): how much of each draft to
verify, for all of its slots in the forward together (core/policy/cost_model.py). It learns from
every round of the engine, whichever policy the requests in it chose: the machine's costs are
the same for all of them. Shortening a draft never changes what is emitted, only how fast.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from spekula.core.drafting.drafter import Draft, Drafter
from spekula.core.policy.controller import AdaptiveController
from spekula.core.policy.cost_model import Offer, choose_lengths
from spekula.core.policy.draft_stop import DraftStop, break_even
from spekula.core.policy.draft_tails import DraftTails
from spekula.core.policy.policy import (
    Adapted,
    Decision,
    DraftRound,
    RoundOutcome,
    RoundShape,
    RoundSlot,
)

# A draftless drafter whose call costs less than this fraction of the round's forward is asked
# without weighing the call first (only a long run of calls that gave nothing of use makes its calls
# sparser): a draft found is worth far more than the call, weighing costs about as much as a cheap
# call, and skipping calls also starves the estimates of the evidence that the text has become
# predictable. The cut after drafting still sizes what is verified.
CHEAP_CALL = 0.1
# Whether a draftless drafter is worth asking is judged on its first positions only (the worth of
# later ones is small, and the decision itself must stay cheap).
DECIDE_POSITIONS = 16
# A resting model drafter's probe asks it for this many tokens (core/policy/backoff.py).
PROBE_TOKENS = 2


class AdaptivePolicy:
    def __init__(self, controller: AdaptiveController) -> None:
        self.controller = controller
        self.tails = DraftTails()
        # This round so far: slots whose drafter was not asked (a decision), slots verifying the kept
        # rest of a cut draft (-> its first token's draft position), and the cut's figures for learn.
        self._declined: dict[int, Decision] = {}
        self._resumed: dict[int, int] = {}
        self._decisions: dict[int, Decision] = {}
        self._predicted = self._plain = 0.0
        self._drafted_before = False  # the last round called a drafter or verified a draft
        # Model drafter calls of this round and of the last one: (drafter, slot), for the back-off's record.
        self._model_calls: list[tuple[str, int]] = []
        self._last_model_calls: list[tuple[str, int]] = []

    def begin(self, slot: int) -> None:
        self.controller.begin_request(slot)

    # -- ask --------------------------------------------------------------------------------------
    def ask(self, slot: RoundSlot, drafter: Drafter, per_token: bool, n: int, cap: int,
            shape: RoundShape) -> int | list[int]:
        # The rest of the slot's cut draft, at its drafter's turn: drafters before it in precedence
        # were asked and had nothing, and the drafter's own state still follows the draft it came from.
        tail = self.tails.take(slot, drafter)
        if tail is not None and (rest := tail.rest[:n]):
            self._resumed[slot.id] = tail.start
            return rest
        k = self._ask_length(slot.id, drafter, per_token, n, cap, shape)
        if k is None:
            return 0
        if k == 0:
            self._declined.setdefault(slot.id, Decision(drafter.name, -1, 0, 1.0, False))
        return k

    def _ask_length(self, slot: int, drafter: Drafter, per_token: bool, n: int, cap: int,
                    shape: RoundShape) -> int | None:
        """Tokens to ask `drafter` for on behalf of `slot`: 0 when the cost model skips it this round,
        None when it is not asked because its last calls all came back empty (not a decision about
        a draft, so not counted as one)."""
        ctl, cost = self.controller, self.controller.cost
        # Weigh only what the drafter can draft: a model drafter stops at --spec-draft-n-max, an n-gram
        # drafter at its own cap, whatever room the round has (valuing a six-token head as if it could
        # draft sixty made its calls look worth far more than they are).
        if cap <= 0:
            return None  # it drafts nothing (--spec-draft-n-max 0): asking would only cost its call
        n = min(n, cap)
        if per_token:
            backoff = ctl.backoff
            if not backoff.may_call(drafter.name, slot):
                return None  # it rests: its recent calls lost time (core/policy/backoff.py)
            if backoff.probing(drafter.name, slot):
                # Its probe: called whatever the estimates say, for a short draft (a head that has come
                # to pay shows it in its first tokens; each further step of one that still does not
                # only adds to the probe's cost). The cut sizes what is verified.
                return min(n, PROBE_TOKENS)
            call_cost, token_cost = cost.model_drafting(drafter.name)
        else:
            call_cost, token_cost = cost.drafting(drafter.name), 0.0
            if call_cost < CHEAP_CALL * cost.forward(shape.base_rows):
                # Asking costs less than deciding whether to ask; the cut after drafting decides. Only
                # a long run of empty calls makes the calls sparser (AdaptiveController.due).
                return n if ctl.due(drafter.name, slot) else None
        k = ctl.ask_length(slot, drafter.name, n if per_token else min(n, DECIDE_POSITIONS),
                           self._round_time(shape, shape.base_rows), base_tokens=shape.n_gen,
                           call_cost=call_cost, token_cost=token_cost)
        # An n-gram drafter's whole draft costs no more than a part of it: ask for all, keep what pays.
        return k if per_token or k == 0 else n

    def keep_drafting(self, slot: RoundSlot, drafter: Drafter, n: int,
                      shape: RoundShape) -> Callable[[Sequence[float]], bool] | None:
        """Stop a model drafter's draft where the cut could keep nothing more of it: its further steps
        would only be thrown away (core/policy/draft_stop.py)."""
        ctl = self.controller
        n = min(n, shape.n_batch - shape.base_rows)
        if n <= 0:
            return None
        round_time = self._round_time(shape, shape.base_rows)
        _, step_seconds = ctl.cost.model_drafting(drafter.name)
        thresholds = break_even(round_time, n, ctl.rate(shape.n_gen, round_time(0)), step_seconds)
        name, calibration = drafter.name, ctl.calibration
        return DraftStop(thresholds, lambda confidence: calibration.cumulative(name, list(confidence)))

    def resting(self, slot: int, drafter: Drafter) -> bool:
        return self.controller.backoff.resting(drafter.name, slot)

    def _round_time(self, shape: RoundShape, rows: int, extra_seconds: float = 0.0) -> Callable[[int], float]:
        cost = self.controller.cost
        return lambda extra: cost.forward(min(shape.n_batch, rows + extra)) + cost.overhead + extra_seconds

    # -- cut --------------------------------------------------------------------------------------
    def cut(self, round: DraftRound) -> dict[int, int]:
        """Keep, of every draft of its slots, the prefix that pays for its rows in this forward."""
        self.controller.backoff.next_round()
        self._learn_calls(round)
        decisions, self._declined = self._declined, {}
        resumed, self._resumed = self._resumed, {}
        self._predicted = self._plain = 0.0
        own = [sid for sid in round.drafts if round.slots[sid].policy is self]
        kept: dict[int, int] = {}
        if own or decisions:
            kept = self._cut(round, own, decisions, resumed)
        self._count_quiet_rounds(round.slots, kept, decisions)
        self._decisions = decisions
        return kept

    def _learn_calls(self, round: DraftRound) -> None:
        """What each call found for this policy's slots, and what it cost. Learned here, before the
        cut, rather than after verification: whether a drafter that found nothing counts as dear (and
        so how soon it is asked less often) is judged by the cut, with this call's cost in."""
        ctl = self.controller
        self._model_calls = []
        for call in round.calls:
            for answer in call.answers:
                if answer.slot.policy is self:
                    ctl.called(call.drafter.name, answer.slot.id, answer.drafted, judged_at_cut=answer.confident)
                    if call.per_token and not call.resumed:
                        self._model_calls.append((call.drafter.name, answer.slot.id))
            if not call.resumed:
                ctl.cost.observe_draft(call.drafter.name, call.seconds, call.steps, per_token=call.per_token)

    def _cut(self, round: DraftRound, own: list[int], decisions: dict[int, Decision],
             resumed: Mapping[int, int]) -> dict[int, int]:
        ctl, shape = self.controller, round.shape
        own_set = set(own)
        other_rows = sum(len(d.tokens) for sid, (d, _) in round.drafts.items() if sid not in own_set)
        round_time = self._round_time(shape, shape.base_rows + other_rows, round.drafting_seconds)
        self._plain = self._round_time(shape, shape.base_rows)(0)
        if not own:  # only decisions not to draft: nothing to weigh
            self._predicted = round_time(0)
            return {}
        offers: list[Offer] = []
        for sid in own:
            draft, drafter = round.drafts[sid]
            offers.append(ctl.offer(sid, drafter.name, len(draft.tokens), start=resumed.get(sid, 0),
                                    confidence=draft.confidence))
        result = choose_lengths(offers, round_time, base_tokens=shape.n_gen, rate=ctl.rate(shape.n_gen, round_time(0)))
        kept: dict[int, int] = {}
        for o in offers:
            draft, drafter = round.drafts[o.slot]
            k = kept[o.slot] = result.lengths[o.slot]
            decisions[o.slot] = Decision(drafter.name, o.length, k, 1.0 + sum(o.gains[:k]), o.probe)
            slot = round.slots[o.slot]
            self.tails.keep(slot, drafter, draft.tokens, k, resumed.get(o.slot, 0), constrained=slot.constrained)
            ctl.kept(drafter.name, o.slot, k, judged_at_cut=_confident(draft))
        self._predicted = result.predicted_time
        return kept

    def _count_quiet_rounds(self, slots: Mapping[int, RoundSlot], kept: Mapping[int, int],
                            decisions: Mapping[int, Decision]) -> None:
        """Tell the controller how many draft tokens each of its slots verifies this round (its probes
        are due after enough rounds without any)."""
        ctl = self.controller
        for sid, s in slots.items():
            if s.policy is not self or not s.may_draft():
                continue
            if kept.get(sid, 0) > 0:
                ctl.planned(sid, kept[sid])
            elif sid not in decisions and ctl.probing(sid):
                ctl.probe_found_nothing(sid)  # every drafter was asked and had nothing
            else:
                ctl.planned(sid, 0)

    # -- learn ------------------------------------------------------------------------------------
    def learn(self, outcome: RoundOutcome) -> list[Adapted]:
        """Refine the estimates with this round; report what its decisions gave."""
        ctl, cost = self.controller, self.controller.cost
        decisions, self._decisions = self._decisions, {}
        for v in outcome.verified:
            decision = decisions.get(v.slot)
            if decision is not None:
                ctl.verified(v.drafter, v.slot, v.n_drafted, v.n_accepted, decision.probe, v.confidence)
        if not (outcome.with_prompt and outcome.rows > cost.max_rows):
            # A long prompt chunk is no verification: its rows' time would only skew the points the
            # cut reads (a 512-row chunk, extrapolated from them, pulled the 64-row point up 1.8x).
            cost.observe_forward(outcome.rows, outcome.forward_seconds)
        cost.observe_overhead(max(0.0, outcome.round_seconds - outcome.forward_seconds - outcome.drafting_seconds))
        if not outcome.drafted and not self._drafted_before and not outcome.with_prompt:
            cost.observe_plain_round(outcome.n_seqs, outcome.round_seconds)
        self._drafted_before = outcome.drafted
        self._judge_model_calls(outcome)
        if not outcome.with_prompt:
            # In the cost model's own seconds (which follow the measured ones), so that the rate
            # and the round times it is weighed against are in one unit.
            ctl.observe_round(sum(outcome.emitted.values()), cost.round_time(outcome.rows, outcome.drafting_seconds))
        if self._plain <= 0:
            return []
        predicted = self._predicted / self._plain
        measured = outcome.round_seconds / self._plain
        return [Adapted(decisions[sid], n, predicted, measured) for sid, n in outcome.emitted.items()
                if sid in decisions]

    def _judge_model_calls(self, outcome: RoundOutcome) -> None:
        """Tell the back-off what this round's model drafter calls measured: the tokens each slot gained
        over a plain round, against the round's time over a plain round's (in tokens a plain round
        of its slots makes in that time, shared among the calls); a round that drafted nothing right
        after calls is charged to them too (the head's weights pushed the target's out of the caches)."""
        calls, self._model_calls = self._model_calls, []
        last, self._last_model_calls = self._last_model_calls, calls
        n_gen = len(outcome.emitted)
        if outcome.with_prompt or n_gen == 0 or not (calls or last):
            return
        cost = self.controller.cost
        plain = cost.plain_rounds.get(n_gen)
        if plain is None:
            plain = cost.round_time(n_gen)
        excess = n_gen * (outcome.round_seconds - plain) / max(plain, 1e-9)
        backoff = self.controller.backoff
        if calls:
            verified = {v.slot: v.drafter for v in outcome.verified}
            for name, sid in calls:
                gained = outcome.emitted.get(sid, 1) - 1 if verified.get(sid) == name else 0
                backoff.called(name, sid, gained, excess / len(calls))
        elif not outcome.drafted:
            for name, sid in last:
                backoff.charge(name, sid, excess / len(last))


def _confident(draft: Draft) -> bool:
    return draft.confidence is not None
