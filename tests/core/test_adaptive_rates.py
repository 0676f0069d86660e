"""The acceptance estimates behind adaptive lengths, the long-run form of the length choice, and the
continuation of cut drafts (core/policy/cost_model.py, core/policy/draft_tails.py)."""

from __future__ import annotations

import itertools
import math

import anyio
from hypothesis import given, settings
from hypothesis import strategies as st
from toy_backend import RepeatDrafter, ToyBackend, ToyTokenizer, fix_cost, make_engine, run_requests

from spekula.core.params import CompletionRequest, SamplingParams, SpecParams
from spekula.core.policy.acceptance import FIRST_PRIOR, LATER_PRIOR, PRIOR_WEIGHT, AcceptanceModel
from spekula.core.policy.adaptive import AdaptivePolicy
from spekula.core.policy.controller import MISS_STREAK, AdaptiveController
from spekula.core.policy.cost_model import MIN_GAIN, CostModel, Offer, choose_lengths
from spekula.core.policy.draft_tails import DraftTails


def test_a_first_rejection_counts_once() -> None:
    """The request's counts lean on the global ones as they were before its own observations."""
    acc = AcceptanceModel()
    acc.observe("d", 0, 4, 0)
    assert math.isclose(acc.conditional("d", 0, 0), PRIOR_WEIGHT * FIRST_PRIOR / (1 + PRIOR_WEIGHT))
    # A later request on another slot starts from the global counts, which now hold that rejection.
    assert math.isclose(acc.conditional("d", 1, 0), acc.conditional("d", 0, 0))


def test_later_positions_share_their_evidence() -> None:
    """Fully accepted drafts of 8 say something about position 30, which none of them reached."""
    acc = AcceptanceModel()
    assert acc.conditional("d", 0, 30) == LATER_PRIOR
    for _ in range(6):
        acc.observe("d", 0, 8, 8)
    assert acc.conditional("d", 0, 30) > 0.98
    assert acc.conditional("d", 0, 30) <= 1.0
    # A drafter that goes wrong at its 3rd token now and then: that position is the weak one.
    for _ in range(4):
        acc.observe("d", 0, 8, 2)
        acc.observe("d", 0, 8, 8)
    assert acc.conditional("d", 0, 2) < acc.conditional("d", 0, 1)
    assert acc.conditional("d", 0, 2) < acc.conditional("d", 0, 5)


def test_the_rest_of_a_draft_takes_the_rates_of_the_positions_it_continues() -> None:
    acc = AcceptanceModel()
    for _ in range(3):
        acc.observe("d", 0, 4, 0)  # a poor first token ...
        acc.observe("d", 0, 6, 6)  # ... but, once right, right for long
    fresh = acc.cumulative("d", 0, 3)
    rest = acc.cumulative("d", 0, 3, start=6)
    assert rest[0] > fresh[0] and all(a >= b for a, b in itertools.pairwise(rest))
    assert math.isclose(rest[0], acc.conditional("d", 0, 6))


def brute_best_value(offers: list[Offer], round_time, base: float, rate: float) -> float:  # type: ignore[no-untyped-def]
    best = -math.inf
    for lengths in itertools.product(*[range((1 if o.probe and o.length else 0), o.length + 1) for o in offers]):
        expected = base + sum(sum(o.gains[:k]) for o, k in zip(offers, lengths, strict=True))
        t = round_time(sum(lengths)) + sum(o.token_cost * k for o, k in zip(offers, lengths, strict=True))
        best = max(best, expected - rate * t)
    return best


gains_st = st.lists(st.floats(0.0, 1.0), min_size=0, max_size=4).map(
    lambda rates: list(itertools.accumulate(rates, lambda a, b: a * b)))


@settings(max_examples=300, deadline=None)
@given(gains=st.lists(gains_st, min_size=1, max_size=3), probes=st.lists(st.booleans(), min_size=3, max_size=3),
       base=st.floats(1e-3, 1.0), slope=st.floats(0.0, 1.0), curve=st.floats(0.0, 0.2),
       token_cost=st.sampled_from([0.0, 0.01, 0.2]), rate=st.floats(0.01, 50.0))
def test_choose_lengths_with_a_rate_maximises_tokens_minus_rate_times_time(  # type: ignore[no-untyped-def]
        gains, probes, base, slope, curve, token_cost, rate) -> None:
    offers = [Offer(i, "d", g, probe=p, token_cost=token_cost) for i, (g, p) in enumerate(zip(gains, probes, strict=False))]

    def round_time(n: int) -> float:
        return base + slope * n + curve * n * n

    plan = choose_lengths(offers, round_time, base_tokens=len(offers), rate=rate)
    for o in offers:
        assert (1 if o.probe and o.length else 0) <= plan.lengths[o.slot] <= o.length
    got = plan.expected_tokens - rate * plan.predicted_time
    cut = [Offer(o.slot, o.drafter, [g for g in o.gains if g >= MIN_GAIN] or o.gains[:1] if o.probe else
                 [g for g in o.gains if g >= MIN_GAIN], probe=o.probe, token_cost=o.token_cost) for o in offers]
    assert got >= brute_best_value(cut, round_time, len(offers), rate) - 1e-9 * max(1.0, abs(got))


def test_a_low_engine_rate_keeps_drafts_a_round_ratio_would_cut() -> None:
    """Among plain rounds, a draft token pays when it beats what the engine makes per second, not
    what this drafting round alone makes."""
    cost = lambda n: 1.0 + 0.2 * n  # noqa: E731
    offer = Offer(0, "d", [0.9, 0.6, 0.35, 0.25])
    by_round = choose_lengths([offer], cost, 1.0)
    by_rate = choose_lengths([offer], cost, 1.0, rate=1.0)  # the plain rate: 1 token per round of 1.0
    assert by_round.lengths[0] < by_rate.lengths[0] == 4


def test_the_engine_rate_starts_at_plain_decoding_and_follows_rounds() -> None:
    ctl = AdaptiveController(CostModel())
    assert ctl.rate(2, 0.5) == 4.0  # nothing seen: what plain decoding of the round would make
    ctl.observe_round(10, 1.0)
    assert ctl.rate(2, 0.5) == 10.0
    for _ in range(200):
        ctl.observe_round(6, 1.0)
    assert math.isclose(ctl.rate(2, 0.5), 6.0, rel_tol=1e-3)
    for _ in range(200):
        ctl.observe_round(1, 1.0)  # slowed by rejected drafts: plain decoding is still within reach
    assert ctl.rate(2, 0.5) == 4.0


def test_a_draft_cut_to_nothing_counts_as_a_miss() -> None:
    ctl = AdaptiveController(CostModel())
    for _ in range(MISS_STREAK):
        assert ctl.due("d", 0)
        ctl.called("d", 0, drafted=True)
        ctl.kept("d", 0, 0)
    assert not ctl.due("d", 0)  # asked less often, as for a drafter that finds nothing
    while not ctl.due("d", 0):
        pass
    ctl.called("d", 0, drafted=True)
    ctl.kept("d", 0, 2)
    assert all(ctl.due("d", 0) for _ in range(3))


class _Slot:
    def __init__(self) -> None:
        self.id, self.request_id, self.n_hist, self.last, self.plan = 0, "r1", 10, -1, None


def test_a_cut_draft_continues_only_after_everything_before_it_was_accepted() -> None:
    tails, drafter, s = DraftTails(), RepeatDrafter(), _Slot()
    tails.keep(s, drafter, [5, 6, 7, 8, 9], kept=2)  # 5, 6 verified; 7 must be the target's next token
    s.n_hist, s.last = 13, 7  # x, 5, 6 committed; the target emitted 7
    tail = tails.take(s)
    assert tail is not None and tail.rest == [8, 9] and tail.start == 3 and tail.drafter is drafter
    assert tails.take(s) is None  # used up
    for n_hist, last, request in ((13, 4, "r1"), (12, 7, "r1"), (13, 7, "r2")):  # rejected, short, other request
        s.n_hist, s.last, s.request_id = 10, -1, "r1"
        tails.keep(s, drafter, [5, 6, 7, 8, 9], kept=2)
        s.n_hist, s.last, s.request_id = n_hist, last, request
        assert tails.take(s) is None
    s.request_id = "r1"
    s.n_hist = 10
    tails.keep(s, drafter, [5, 6, 7], kept=2)  # nothing would be left after the target's token
    s.n_hist, s.last = 13, 7
    assert tails.take(s) is None


def test_cut_drafts_are_continued_in_the_engine_and_output_stays_plain(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Dear rows cut RepeatDrafter's long drafts; the rest of each accepted cut is verified next round."""
    continued: list[int] = []
    original = AdaptivePolicy.ask

    def spy(self, slot, *args):  # type: ignore[no-untyped-def]
        answer = original(self, slot, *args)
        if isinstance(answer, list):  # the kept rest of a cut draft, verified instead of a call
            continued.append(slot.id)
        return answer

    monkeypatch.setattr(AdaptivePolicy, "ask", spy)
    prompt = [7, 8, 9, 10, 11, 12, 13, 14] * 8
    finals = {}
    for adaptive in (False, True):
        spec = SpecParams(types=("test-repeat",), n_max=16, adaptive=adaptive)
        engine = fix_cost(make_engine(ToyBackend(), ToyTokenizer(), spec=spec, drafters=[RepeatDrafter(16)]), 1.0, 1.0)
        req = CompletionRequest(prompt, n_predict=60, sampling=SamplingParams(temperature=0.0))
        [finals[adaptive]] = anyio.run(run_requests, engine, [req])
    assert finals[True].tokens == finals[False].tokens
    assert continued  # at least one round verified the rest of a cut draft
