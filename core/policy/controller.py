"""The adaptive policy's estimates per drafter and slot, and the exploration that keeps them honest.

`AdaptiveController` holds the cost model (core/policy/cost_model.py), the acceptance estimates
(core/policy/acceptance.py), the calibration of model drafters' confidence
(core/policy/confidence.py) and the model drafters' measured record (core/policy/backoff.py), and
answers the two questions AdaptivePolicy puts to them: is a drafter worth asking for a slot, and what
is each token of a draft worth. No torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from spekula.core.policy.acceptance import AcceptanceModel
from spekula.core.policy.backoff import DrafterBackoff
from spekula.core.policy.confidence import ConfidenceCalibration
from spekula.core.policy.cost_model import CostModel, Offer, choose_lengths

# A slot whose drafts were all dropped this many rounds in a row verifies one token anyway, so an
# estimate that turned pessimistic can recover when the text becomes predictable.
PROBE_AFTER = 8
PROBE_MAX = 32
# A decision not to ask a drafter stands for this many rounds (unless the slot probes or new evidence
# about the drafter arrives) before it is weighed again.
SKIP_STANDS = 4
# A cheap draftless drafter that keeps finding nothing of use for a slot (no draft, or one cut to
# nothing) is asked less often: after MISS_STREAK such calls in a row every 2nd round, after twice
# as many every MISS_GAP_MAX-th. Its first draft then comes at most MISS_GAP_MAX - 1 rounds late,
# while open-ended text, where it finds nothing for hundreds of rounds, stops paying for the calls.
# The streak is long enough to cover the dozen or so rounds an n-gram drafter needs to find its
# place again after an edit in copied text, where a late restart loses the tokens it would copy;
# a drafter whose call costs more than DEAR_CALL of a one-row forward gets the shorter streak.
MISS_STREAK = 16
MISS_STREAK_DEAR = 4
DEAR_CALL = 0.01
MISS_GAP_MAX = 4
# The engine's recent rate (tokens per second) weighs a round RATE_DECAY^age: about the last 20 rounds.
RATE_DECAY = 0.95


class AdaptiveController:
    """The engine's cost and acceptance models, and the exploration bookkeeping per slot.

    A slot that has not verified a draft token for `probe interval` rounds verifies one anyway;
    each probe that fails doubles the slot's interval (up to PROBE_MAX), one that succeeds resets
    it, so text that stays unpredictable costs ever fewer wasted rows."""

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost
        self.acceptance = AcceptanceModel()
        # Model drafters say how sure they are of each token; what that is worth is learned here.
        self.calibration = ConfidenceCalibration()
        # How often a call of the drafter returns a draft at all (position 0 of a one-token "draft"
        # per call): in open-ended text the n-gram drafters mostly find nothing, and a call that
        # finds nothing still costs its time.
        self.hits = AcceptanceModel()
        # Which model drafters rest, judged on what their calls measured (core/policy/backoff.py).
        self.backoff = DrafterBackoff()
        self._quiet: dict[int, int] = {}  # slot -> rounds since it last verified a draft token
        self._interval: dict[int, int] = {}  # slot -> rounds between probes
        self._misses: dict[tuple[str, int], int] = {}  # (drafter, slot) -> empty calls in a row
        self._wait: dict[tuple[str, int], int] = {}  # (drafter, slot) -> rounds before the next call
        self._skips: dict[tuple[str, int], int] = {}  # (drafter, slot) -> rounds its "do not ask" still stands
        self._rate_tokens = 0.0  # decayed emitted tokens and seconds of recent generating rounds
        self._rate_seconds = 0.0

    def begin_request(self, slot: int) -> None:
        self.acceptance.forget_slot(slot)
        self.backoff.begin_request(slot)
        self.hits.forget_slot(slot)
        self._quiet.pop(slot, None)
        self._interval.pop(slot, None)
        for table in (self._misses, self._wait, self._skips):
            for key in [key for key in table if key[1] == slot]:
                del table[key]

    def probing(self, slot: int) -> bool:
        return self._quiet.get(slot, 0) >= self._interval.get(slot, PROBE_AFTER)

    def offer(self, slot: int, drafter: str, length: int, token_cost: float = 0.0, start: int = 0,
              confidence: list[float] | None = None) -> Offer:
        """A draft of `length` tokens valued by the drafter's acceptance per draft position, or, for a
        draft that came with the drafter's confidence in each token, by that confidence calibrated."""
        if confidence is not None and len(confidence) >= length:
            gains = self.calibration.cumulative(drafter, confidence[:length])
        else:
            gains = self.acceptance.cumulative(drafter, slot, length, start)
        return Offer(slot, drafter, gains, self.probing(slot), token_cost)

    def ask_length(self, slot: int, drafter: str, n_max: int, round_time: Callable[[int], float], *,
                   base_tokens: float, call_cost: float, token_cost: float) -> int:
        """How many tokens are worth asking `drafter` for (0: do not ask it this round), judged on this
        slot's estimates: drafting costs `call_cost` per call plus `token_cost` per token, and a call
        returns a draft at all with the drafter's hit rate."""
        if n_max <= 0:
            return 0
        key = (drafter, slot)
        left = self._skips.get(key, 0)
        if left > 0 and not self.probing(slot):
            # Not asking changes none of the estimates the decision came from (only the cost model and
            # the rate drift a little), so it stands for a few rounds instead of being weighed again:
            # weighing costs a model drafter's slot about 2 % of a SmolLM2 round.
            self._skips[key] = left - 1
            return 0
        k = self._ask_length(slot, drafter, n_max, round_time, base_tokens=base_tokens, call_cost=call_cost,
                             token_cost=token_cost)
        if k == 0:
            self._skips[key] = SKIP_STANDS - 1
        else:
            self._skips.pop(key, None)
        return k

    def _ask_length(self, slot: int, drafter: str, n_max: int, round_time: Callable[[int], float], *,
                    base_tokens: float, call_cost: float, token_cost: float) -> int:
        offer = self.offer(slot, drafter, n_max, token_cost)
        rate = self.rate(base_tokens, round_time(0))
        plan = choose_lengths([offer], round_time, base_tokens, rate)
        kept = plan.lengths[slot]
        if offer.probe:
            return max(kept, 1)
        if kept == 0:
            return 0
        hit = self.hit_rate(drafter, slot)
        gain = hit * (plan.expected_tokens - base_tokens)
        seconds = call_cost + hit * (plan.predicted_time - plan.plain_time)
        return kept if gain > rate * seconds else 0

    def rate(self, base_tokens: float, plain_time: float) -> float:
        """The rate a draft token must beat: emitted tokens per second over the recent generating
        rounds, but never below what plain decoding of this round would make (always within reach by
        not drafting: rounds slowed by rejected drafts must not lower the bar for more of them)."""
        measured = self.cost.plain_rounds.get(round(base_tokens))
        plain = base_tokens / max(plain_time if measured is None else measured, 1e-12)
        if self._rate_seconds > 0:
            return max(self._rate_tokens / self._rate_seconds, plain)
        return plain

    def observe_round(self, tokens: int, seconds: float) -> None:
        """A round in which only generating slots ran emitted `tokens` in `seconds` (rounds with prompt
        chunks are left out: their time buys no tokens yet)."""
        if seconds > 0 and math.isfinite(seconds):
            self._rate_tokens = RATE_DECAY * self._rate_tokens + tokens
            self._rate_seconds = RATE_DECAY * self._rate_seconds + seconds

    def hit_rate(self, drafter: str, slot: int) -> float:
        return self.hits.conditional(drafter, slot, 0)

    def called(self, drafter: str, slot: int, drafted: bool, judged_at_cut: bool = False) -> None:
        """A call of `drafter` for `slot` returned a draft (or nothing). Whether a draft was of any use
        is told by `kept`, once the cut has been made. `judged_at_cut`: the draft carries the drafter's
        confidence, and whether the call hit is whether the cut keeps any of it (a model drafter always
        drafts something; what a call is worth is how often its draft is sure enough to verify)."""
        self._skips.pop((drafter, slot), None)
        if not (drafted and judged_at_cut):
            self.hits.observe(drafter, slot, 1, int(drafted))
        if not drafted:
            self._missed(drafter, slot)

    def kept(self, drafter: str, slot: int, n: int, judged_at_cut: bool = False) -> None:
        """The cut kept n tokens of `drafter`'s draft for `slot`: a draft cut to nothing counts as a call
        that found nothing (open-ended text gives some drafters a one-token guess nearly every round,
        and asking for those costs as much as asking in vain)."""
        if judged_at_cut:
            self.hits.observe(drafter, slot, 1, int(n > 0))
        if n > 0:
            self._misses[(drafter, slot)] = 0
        else:
            self._missed(drafter, slot)

    def _missed(self, drafter: str, slot: int) -> None:
        key = (drafter, slot)
        misses = self._misses.get(key, 0) + 1
        self._misses[key] = misses
        streak = MISS_STREAK if self.cost.drafting(drafter) <= DEAR_CALL * self.cost.forward(1) else MISS_STREAK_DEAR
        if misses >= streak:
            self._wait[key] = (2 if misses < 2 * streak else MISS_GAP_MAX) - 1

    def due(self, drafter: str, slot: int) -> bool:
        """Whether a cheap draftless drafter is asked for `slot` this round (see MISS_STREAK); a
        round it is not asked counts down its wait."""
        key = (drafter, slot)
        wait = self._wait.get(key, 0)
        if wait <= 0:
            return True
        self._wait[key] = wait - 1
        return False

    def probe_found_nothing(self, slot: int) -> None:
        """A probe round in which no drafter had anything: wait longer before the next one."""
        self._quiet[slot] = 0
        self._interval[slot] = min(2 * self._interval.get(slot, PROBE_AFTER), PROBE_MAX)

    def planned(self, slot: int, kept: int) -> None:
        """Record the length the planner kept for this slot's draft this round."""
        self._quiet[slot] = 0 if kept > 0 else self._quiet.get(slot, 0) + 1

    def verified(self, drafter: str, slot: int, k: int, n_accepted: int, probe: bool,
                 confidence: list[float] | None = None) -> None:
        self.acceptance.observe(drafter, slot, k, n_accepted)
        self._skips.pop((drafter, slot), None)
        if confidence is not None:
            self.calibration.observe(drafter, confidence[:k], n_accepted)
        if probe:
            interval = self._interval.get(slot, PROBE_AFTER)
            self._interval[slot] = PROBE_AFTER if n_accepted > 0 else min(2 * interval, PROBE_MAX)
