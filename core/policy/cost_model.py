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
drafter's acceptance estimates (core/policy/acceptance.py); forward(rows) comes from the engine's own
forwards: the first ones around each row count measure it, every later one refines it (nothing is
timed before the first request). Shortening or dropping a draft never changes the output:
verification of any draft prefix emits exactly what plain decoding would. No torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

_ROW_POINTS = (1, 2, 4, 8, 16, 32, 64)
MIN_GAIN = 1e-3  # a draft token less likely than this to be accepted is never worth its row
_COST_EMA = 0.2
# A model drafter's calls are fitted as seconds = per call + per token x steps over about the last
# 1 / _DRAFT_FIT_EMA calls; the fit needs calls of different lengths (a spread of steps of at least
# _DRAFT_FIT_MIN_VAR) and otherwise charges the mean per token, as a plain average would.
_DRAFT_FIT_EMA = 0.1
_DRAFT_FIT_MIN_VAR = 0.1
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

    Points at 1, 2, 4, ... rows; every observed forward pulls the two points around its row count
    towards what it took (an exponential moving average), so the model follows the context length
    and the machine's load. Between points it interpolates linearly, beyond the last it extrapolates
    from the last two. A model made by `prior` has not measured its points yet: the first forward
    around a point sets it, and until then it keeps the prior's shape at the level of what has been
    measured, so the engine needs no timing forwards before its first request."""

    def __init__(self, points: dict[int, float] | None = None) -> None:
        self.points: dict[int, float] = dict(points or {1: 1e-3, 64: 8e-3})
        self._xs = sorted(self.points)  # the row counts modelled (fixed; only their times move)
        self._shape = dict(self.points)  # what an unmeasured point is, relative to the measured ones
        self.unmeasured: set[int] = set()  # points no forward of about their size has measured yet
        self._warming_up = False  # the next forward is the backend's first: it sets the level, measures no point
        self.overhead = 0.0  # engine time per round outside the forward
        self.draft_cost: dict[str, float] = {}  # draftless drafter -> seconds per call
        self.draft_fit: dict[str, DraftCostFit] = {}  # model drafter -> its calls' time against their steps
        # Generating slots -> seconds of a whole round that only decoded their pending tokens, measured on
        # rounds with no draft call in them or in the round before (see observe_plain_round).
        self.plain_rounds: dict[int, float] = {}

    @classmethod
    def prior(cls, max_rows: int) -> CostModel:
        """Points at 1, 2, 4, ... up to max_rows on the default guess, each measured by the engine's
        first forwards of about its size (observe_forward)."""
        guess = cls()
        model = cls({n: guess.forward(n) for n in _ROW_POINTS if n <= max(max_rows, 1)})
        model.unmeasured = set(model.points)
        model._warming_up = True
        return model

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

    @property
    def max_rows(self) -> int:
        """The largest row count modelled; beyond it forward() extrapolates."""
        return self._xs[-1]

    def observe_forward(self, rows: int, seconds: float) -> None:
        """Pull the model towards a measured forward: every measured point a little (the context grew,
        the machine got busier), the points around `rows` more; the curve stays non-decreasing.

        A point no forward of about its size has measured yet is the guess's shape at the level of the
        nearest measured point, derived afresh each time: scaling it by every forward's ratio instead
        compounded, so that a context growing over a few hundred one-row rounds took an unmeasured
        64-row point from milliseconds to seconds, and a policy that then never verified 64 rows
        never learnt otherwise."""
        predicted = self.forward(rows)
        if predicted <= 0 or not math.isfinite(seconds) or seconds <= 0:
            return
        ratio = seconds / predicted
        xs = self._xs
        if self._warming_up:  # a backend's first forward pays for its warm-up: it sets the level only
            self._warming_up = False
            for x in xs:
                self.points[x] *= ratio
            return
        lo = max((x for x in xs if x <= rows), default=xs[0])
        hi = min((x for x in xs if x >= rows), default=xs[-1])
        for x in xs:
            if x in (lo, hi) and x in self.unmeasured:
                self.points[x] *= ratio
            elif x not in self.unmeasured:
                self.points[x] *= (1 - _COST_EMA) + _COST_EMA * ratio if x in (lo, hi) else \
                    (1 - _COST_EMA_ALL) + _COST_EMA_ALL * ratio
        self.unmeasured -= {lo, hi}
        measured = [x for x in xs if x not in self.unmeasured]
        for x in self.unmeasured:
            near = min(measured, key=lambda m: abs(math.log(m / x)))
            self.points[x] = self._shape[x] * self.points[near] / self._shape[near]
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
