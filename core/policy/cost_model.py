"""Adaptive draft lengths: a cost model of the running engine and the per-round choice it drives.

A fixed n_max drafts as far whether the drafter has been right or wrong and whatever a verification
row costs, which is how speculation ends up slower than plain decoding. Here each round, for the
whole batch, the engine keeps the draft tokens whose expected value pays for their rows:

    expected emitted tokens  E = sum over slots of (1 + P_s(1) + ... + P_s(k_s))
    round time               T = forward(rows) + drafting + engine overhead
    maximise E - rate * T over k_s in 0..len(draft_s)

where rate is what the engine has been emitting per second lately (at least what plain decoding
would): a kept token must bring more than the engine makes elsewhere in the time of its row.

P_s(i) is the probability that the first i draft tokens of slot s are all accepted, from the
drafter's acceptance estimates (core/policy/acceptance.py); forward(rows) comes from timings of the target
at start-up, refined by every forward. Shortening or dropping a draft never changes the output: verification of
any draft prefix emits exactly what plain decoding would. No torch here: the scheduler imports this.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from spekula.core.policy.acceptance import AcceptanceModel
from spekula.core.policy.confidence import ConfidenceCalibration

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
_ROW_POINTS = (1, 2, 4, 8, 16, 32, 64)
MIN_GAIN = 1e-3  # a draft token less likely than this to be accepted is never worth its row
_COST_EMA = 0.2
# A model drafter's calls are fitted as seconds = per call + per token x steps over about the last
# 1 / _DRAFT_FIT_EMA calls; the fit needs calls of different lengths (a spread of steps of at least
# _DRAFT_FIT_MIN_VAR) and otherwise charges the mean per token, as a plain average would.
_DRAFT_FIT_EMA = 0.1
_DRAFT_FIT_MIN_VAR = 0.1
# The engine's recent rate (tokens per second) weighs a round RATE_DECAY^age: about the last 20 rounds.
RATE_DECAY = 0.95
_COST_EMA_ALL = 0.05


@dataclass(slots=True)
class DraftCostFit:
    """Decayed least squares of a model drafter's call time against its steps (tokens drafted).

    A model drafter's call is not k times one step: its first step is the dear one (the head's
    weights come back into the caches after the target's forward, rows queued since its last call
    are decoded with it, and the call's Python runs once), so charging the mean per token makes
    one-token drafts look two or three times cheaper than they are, and those are what open-ended
    text asks for."""

    w: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0

    def add(self, steps: float, seconds: float) -> None:
        keep = 1.0 - _DRAFT_FIT_EMA
        self.w = keep * self.w + 1.0
        self.sx = keep * self.sx + steps
        self.sy = keep * self.sy + seconds
        self.sxx = keep * self.sxx + steps * steps
        self.sxy = keep * self.sxy + steps * seconds

    def mean_per_token(self) -> float:
        """The calls' (decayed) seconds over their steps; 0 before any call."""
        return self.sy / max(self.sx, self.w) if self.w > 0 else 0.0

    def costs(self) -> tuple[float, float]:
        """(seconds per call, seconds per token): the fit where the calls' lengths spread and it is
        sensible (both parts non-negative), else the mean per token and nothing per call."""
        if self.w <= 0:
            return 0.0, 0.0
        mx, my = self.sx / self.w, self.sy / self.w
        per_token = self.mean_per_token()
        var = self.sxx / self.w - mx * mx
        if var < _DRAFT_FIT_MIN_VAR:
            return 0.0, per_token
        slope = (self.sxy / self.w - mx * my) / var
        intercept = my - slope * mx
        if slope < 0 or intercept < 0:
            return 0.0, per_token
        return intercept, slope


class CostModel:
    """Seconds for a target forward of `rows` rows, plus a round's fixed engine overhead.

    Points at 1, 2, 4, ... rows measured at start-up; every observed forward pulls the two points
    around its row count towards what it took (an exponential moving average), so the model follows
    the context length and the machine's load. Between points it interpolates linearly, beyond the
    last it extrapolates from the last two."""

    def __init__(self, points: dict[int, float] | None = None) -> None:
        self.points: dict[int, float] = dict(points or {1: 1e-3, 64: 8e-3})
        self._xs = sorted(self.points)  # the row counts measured (fixed; only their times move)
        self.overhead = 0.0  # engine time per round outside the forward
        self.draft_cost: dict[str, float] = {}  # draftless drafter -> seconds per call
        self.draft_fit: dict[str, DraftCostFit] = {}  # model drafter -> its calls' time against their steps
        # Generating slots -> seconds of a whole round that only decoded their pending tokens, measured on
        # rounds with no draft call in them or in the round before (see observe_plain_round).
        self.plain_rounds: dict[int, float] = {}

    @classmethod
    def measure(cls, forward_rows: Callable[[int], float], max_rows: int, repeats: int = 2) -> CostModel:
        """Time `forward_rows(n)` (one forward of n rows, in seconds) at 1, 2, 4, ... up to max_rows;
        the fastest of `repeats` runs per point up to 8 rows."""
        points = {}
        for n in _ROW_POINTS:
            if n > max_rows:
                break
            # Small forwards are the noisy ones and cost little to repeat; large ones are timed once.
            points[n] = min(forward_rows(n) for _ in range(repeats if n <= 8 else 1))
        return cls(points)

    def forward(self, rows: int) -> float:
        xs = self._xs
        if rows <= xs[0]:
            return self.points[xs[0]]
        for lo, hi in zip(xs, xs[1:], strict=False):
            if rows <= hi:
                f = (rows - lo) / (hi - lo)
                return self.points[lo] + f * (self.points[hi] - self.points[lo])
        if len(xs) == 1:
            return self.points[xs[0]] * rows
        a, b = xs[-2], xs[-1]
        slope = max((self.points[b] - self.points[a]) / (b - a), 0.0)
        return self.points[b] + slope * (rows - b)

    def round_time(self, rows: int, drafting: float = 0.0) -> float:
        return self.forward(rows) + drafting + self.overhead

    def observe_forward(self, rows: int, seconds: float) -> None:
        """Pull the model towards a measured forward: every point a little (the context grew, the
        machine got busier), the points around `rows` more; the curve stays non-decreasing."""
        predicted = self.forward(rows)
        if predicted <= 0 or not math.isfinite(seconds) or seconds <= 0:
            return
        ratio = seconds / predicted
        xs = self._xs
        lo = max((x for x in xs if x <= rows), default=xs[0])
        hi = min((x for x in xs if x >= rows), default=xs[-1])
        for x in xs:
            weight = _COST_EMA if x in (lo, hi) else _COST_EMA_ALL
            self.points[x] *= (1 - weight) + weight * ratio
        for a, b in zip(xs, xs[1:], strict=False):
            self.points[b] = max(self.points[b], self.points[a])

    def observe_overhead(self, seconds: float) -> None:
        if seconds >= 0 and math.isfinite(seconds):
            self.overhead += _COST_EMA * (seconds - self.overhead)

    def observe_plain_round(self, n_gen: int, seconds: float) -> None:
        """A round of `n_gen` generating slots, one row each, no draft and no drafting in it or in the
        round before, took `seconds` (forward and engine overhead). This is the time the planner holds
        drafting against. It is not read off the forward curve: a draft call leaves the next forwards
        slower (the drafter's weights and state have pushed the target's out of the caches) and its
        own rounds carry more engine work, and those rounds pull the curve's points up; a plain
        estimate taken from it then rises exactly while drafting goes on, lowering the bar that
        drafting has to clear."""
        if seconds <= 0 or not math.isfinite(seconds):
            return
        old = self.plain_rounds.get(n_gen)
        self.plain_rounds[n_gen] = seconds if old is None else old + _COST_EMA * (seconds - old)

    def observe_draft(self, drafter: str, seconds: float, steps: int, per_token: bool) -> None:
        """One call of `drafter` that took `seconds` for drafts of at most `steps` tokens. A model
        drafter's calls are fitted per call plus per drafted token (DraftCostFit: it runs a forward
        per token, the first dearer than the rest), an n-gram drafter's cost is kept per call."""
        if not math.isfinite(seconds) or seconds < 0:
            return
        if per_token:
            self.draft_fit.setdefault(drafter, DraftCostFit()).add(max(steps, 1), seconds)
            return
        old = self.draft_cost.get(drafter, seconds)
        self.draft_cost[drafter] = old + _COST_EMA * (seconds - old)

    def drafting(self, drafter: str) -> float:
        """Seconds per drafted token (model drafters: the mean of their calls) or per call (n-gram
        drafters); 0 until seen."""
        fit = self.draft_fit.get(drafter)
        return fit.mean_per_token() if fit is not None else self.draft_cost.get(drafter, 0.0)

    def model_drafting(self, drafter: str) -> tuple[float, float]:
        """A model drafter's (seconds per call, seconds per drafted token); (0, 0) until seen."""
        fit = self.draft_fit.get(drafter)
        return fit.costs() if fit is not None else (0.0, 0.0)


@dataclass(slots=True)
class Offer:
    """One slot's draft as offered to the planner."""

    slot: int
    drafter: str
    gains: list[float]  # P(first i accepted) for i = 1..len(draft): what each kept token is worth
    probe: bool = False  # verify at least one token (exploration)
    token_cost: float = 0.0  # seconds each kept token adds besides its row (drafting it, if not done yet)

    @property
    def length(self) -> int:
        return len(self.gains)


@dataclass(slots=True)
class Plan:
    lengths: dict[int, int]  # slot -> tokens to verify
    expected_tokens: float  # emitted tokens expected from the offering slots (1 each + kept gains)
    predicted_time: float  # the round with the kept tokens
    plain_time: float  # the same round without any of the offered tokens


def choose_lengths(offers: Sequence[Offer], round_time: Callable[[int], float], base_tokens: float | None = None,
                   rate: float | None = None) -> Plan:
    """The draft prefixes that pay best for the whole forward.

    `round_time(n)` is the round's time with n offered tokens added to its rows. A kept token's
    worth is the probability that it and all before it are accepted, which never increases along
    a draft; so, taking the best remaining token over all slots one at a time, the best prefix of
    that order is the optimum whenever the cost of a row does not fall as rows are added.

    With `rate` (the engine's emitted tokens per second over recent rounds) a prefix is judged by
    expected tokens minus rate x time: a token is worth its row when it brings more than the engine
    makes elsewhere in that row's time. Without it, by expected tokens per second of this round
    alone, which is the same choice when every round is like this one; the long-run form is the
    right one when they are not (drafting rounds among plain ones, where cutting a draft short
    pays a whole round's fixed cost again to verify the rest next round).
    `base_tokens`: what the round emits without any offered token (default: one per offer)."""
    lengths = {o.slot: 0 for o in offers}
    expected = float(len(offers)) if base_tokens is None else float(base_tokens)
    extra, spent = 0, 0.0
    for o in offers:
        if o.probe and o.length > 0:
            lengths[o.slot] = 1
            expected += o.gains[0]
            extra += 1
            spent += o.token_cost

    def score(e: float, t: float) -> float:
        return e / max(t, 1e-12) if rate is None else e - rate * t

    plain = round_time(0)
    t = round_time(extra) + spent
    best_score = score(expected, t)
    best, best_expected, best_time = dict(lengths), expected, t
    if len(offers) == 1:  # one draft: its gains are already in order
        o = offers[0]
        order = [(g, i, o) for i, g in enumerate(o.gains) if i >= lengths[o.slot]]
    else:
        order = sorted(((g, i, o) for o in offers for i, g in enumerate(o.gains) if i >= lengths[o.slot]),
                       key=lambda t: (-t[0], t[1]))
    taken = dict(lengths)
    for gain, _i, o in order:
        if gain < MIN_GAIN:
            break  # this and every later token are worth (next to) nothing
        taken[o.slot] += 1
        expected += gain
        extra += 1
        spent += o.token_cost
        t = round_time(extra) + spent
        value = score(expected, t)
        if value > best_score:
            best_score, best, best_expected, best_time = value, dict(taken), expected, t
    return Plan(best, best_expected, best_time, plain)


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
        self._quiet: dict[int, int] = {}  # slot -> rounds since it last verified a draft token
        self._interval: dict[int, int] = {}  # slot -> rounds between probes
        self._misses: dict[tuple[str, int], int] = {}  # (drafter, slot) -> empty calls in a row
        self._wait: dict[tuple[str, int], int] = {}  # (drafter, slot) -> rounds before the next call
        self._skips: dict[tuple[str, int], int] = {}  # (drafter, slot) -> rounds its "do not ask" still stands
        self._rate_tokens = 0.0  # decayed emitted tokens and seconds of recent generating rounds
        self._rate_seconds = 0.0

    def begin_request(self, slot: int) -> None:
        self.acceptance.forget_slot(slot)
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
