"""The cost model and the per-round length choice (core/policy/cost_model.py), and what they do in the engine."""

from __future__ import annotations

import itertools
import math

import anyio
from hypothesis import given, settings
from hypothesis import strategies as st
from toy_backend import (
    GarbageDrafter,
    RepeatDrafter,
    ToyBackend,
    ToyTokenizer,
    fix_cost,
    make_engine,
    run_requests,
)

from spekula.core.params import CompletionRequest, SamplingParams, SpecParams
from spekula.core.policy.acceptance import FIRST_PRIOR, LATER_PRIOR, AcceptanceModel
from spekula.core.policy.controller import (
    MISS_GAP_MAX,
    MISS_STREAK,
    PROBE_AFTER,
    PROBE_MAX,
    SKIP_STANDS,
    AdaptiveController,
)
from spekula.core.policy.cost_model import MIN_GAIN, CostModel, Offer, choose_lengths


def gains_st(max_len: int = 4) -> st.SearchStrategy[list[float]]:
    """P(first i accepted) for i = 1..k: a product of conditional rates, so non-increasing."""
    return st.lists(st.floats(0.0, 1.0), min_size=0, max_size=max_len).map(
        lambda rates: list(itertools.accumulate(rates, lambda a, b: a * b)))


def brute_best(offers: list[Offer], round_time, base: float) -> float:  # type: ignore[no-untyped-def]
    best = 0.0
    for lengths in itertools.product(*[range((1 if o.probe and o.length else 0), o.length + 1) for o in offers]):
        expected = base + sum(sum(o.gains[:k]) for o, k in zip(offers, lengths, strict=True))
        t = round_time(sum(lengths)) + sum(o.token_cost * k for o, k in zip(offers, lengths, strict=True))
        best = max(best, expected / t)
    return best


@settings(max_examples=300, deadline=None)
@given(gains=st.lists(gains_st(), min_size=1, max_size=3), probes=st.lists(st.booleans(), min_size=3, max_size=3),
       base=st.floats(1e-3, 1.0), slope=st.floats(0.0, 1.0), curve=st.floats(0.0, 0.2),
       token_cost=st.sampled_from([0.0, 0.01, 0.2]))
def test_choose_lengths_is_optimal(gains, probes, base, slope, curve, token_cost) -> None:  # type: ignore[no-untyped-def]
    """Against every combination of prefix lengths, for row costs that do not fall as rows are added
    and the same per-token cost in every offer."""
    offers = [Offer(i, "d", g, probe=p, token_cost=token_cost) for i, (g, p) in enumerate(zip(gains, probes, strict=False))]

    def round_time(n: int) -> float:
        return base + slope * n + curve * n * n

    plan = choose_lengths(offers, round_time, base_tokens=len(offers))
    for o in offers:
        assert (1 if o.probe and o.length else 0) <= plan.lengths[o.slot] <= o.length
    kept = sum(plan.lengths.values())
    expected = len(offers) + sum(sum(o.gains[: plan.lengths[o.slot]]) for o in offers)
    assert math.isclose(plan.expected_tokens, expected, rel_tol=1e-9, abs_tol=1e-12)
    assert math.isclose(plan.predicted_time, round_time(kept) + token_cost * kept, rel_tol=1e-9)
    assert math.isclose(plan.plain_time, round_time(0))
    got = plan.expected_tokens / plan.predicted_time
    # Tokens worth less than MIN_GAIN are never kept, by design: compare with the same drafts cut there.
    cut = [Offer(o.slot, o.drafter, [g for g in o.gains if g >= MIN_GAIN] or o.gains[:1] if o.probe else
                 [g for g in o.gains if g >= MIN_GAIN], probe=o.probe, token_cost=o.token_cost) for o in offers]
    assert got >= brute_best(cut, round_time, len(offers)) * (1 - 1e-9)


def test_choose_lengths_drops_what_does_not_pay_and_keeps_what_does() -> None:
    rows_cost = lambda n: 1.0 + 0.2 * n  # noqa: E731 - a row costs a fifth of a plain round
    sure = Offer(0, "d", [0.99, 0.98, 0.97])
    hopeless = Offer(1, "d", [0.1, 0.01])
    plan = choose_lengths([sure, hopeless], rows_cost)
    assert plan.lengths == {0: 3, 1: 0}
    assert choose_lengths([Offer(0, "d", [0.2, 0.1], probe=True)], rows_cost).lengths == {0: 1}  # a probe verifies one


def test_cost_model_interpolates_and_follows_measurements() -> None:
    cost = CostModel({n: 0.01 + 0.001 * n for n in (1, 2, 4, 8, 16)})  # measured forwards of n rows
    assert sorted(cost.points) == [1, 2, 4, 8, 16]
    assert math.isclose(cost.forward(3), 0.013) and math.isclose(cost.forward(32), 0.042)
    for _ in range(200):  # the machine got twice as slow at 8 rows
        cost.observe_forward(8, 2 * 0.018)
    assert math.isclose(cost.forward(8), 0.036, rel_tol=1e-3)
    xs = sorted(cost.points)
    assert all(cost.points[a] <= cost.points[b] for a, b in itertools.pairwise(xs))
    cost.observe_forward(8, float("nan"))  # ignored
    assert math.isclose(cost.forward(8), 0.036, rel_tol=1e-3)


def test_drafter_costs_are_per_token_for_models_and_per_call_otherwise() -> None:
    cost = CostModel()
    cost.observe_draft("model", 0.04, steps=4, per_token=True)
    cost.observe_draft("ngram", 0.004, steps=4, per_token=False)
    assert math.isclose(cost.drafting("model"), 0.01) and math.isclose(cost.drafting("ngram"), 0.004)
    assert cost.drafting("never") == 0.0


def test_a_model_drafters_calls_are_fitted_per_call_plus_per_token() -> None:
    """A head's first step costs more than the rest: calls of varied length separate the two, and the
    per-token mean (which prices a one-token draft at a fraction of its cost) is only the fallback."""
    cost = CostModel()
    assert cost.model_drafting("head") == (0.0, 0.0)
    for steps in [1, 2, 3, 6, 1, 4, 2, 5] * 3:
        cost.observe_draft("head", 0.8e-3 + 0.2e-3 * steps, steps=steps, per_token=True)
    call, token = cost.model_drafting("head")
    assert math.isclose(call, 0.8e-3, rel_tol=1e-6) and math.isclose(token, 0.2e-3, rel_tol=1e-6)
    # calls of one length cannot be split: the mean per token, as before
    same = CostModel()
    for _ in range(10):
        same.observe_draft("head", 3e-3, steps=3, per_token=True)
    call, token = same.model_drafting("head")
    assert call == 0.0 and math.isclose(token, 1e-3)
    # a fit that says longer calls are cheaper is noise, not a cost model
    odd = CostModel()
    for steps, seconds in [(1, 4e-3), (6, 1e-3)] * 5:
        odd.observe_draft("head", seconds, steps=steps, per_token=True)
    call, token = odd.model_drafting("head")
    assert call == 0.0 and 1e-3 / 6 < token < 4e-3  # the (decayed) mean per token
    assert cost.model_drafting("ngram") == (0.0, 0.0)


def test_a_dear_first_step_stops_one_token_drafts_that_a_per_token_mean_would_make() -> None:
    """A draft token right a third of the time, in a round of 4 ms plus 0.5 ms a row: with the head's
    calls priced at 1 ms + 0.2 ms a token nothing pays, at their per-token mean (0.4 ms) it would."""
    def round_time(extra: int) -> float:
        return 4e-3 + 0.5e-3 * extra

    ctl = AdaptiveController(CostModel())
    for _ in range(40):
        ctl.acceptance.observe("head", 0, 1, 0)
        ctl.acceptance.observe("head", 0, 2, 1)
        ctl.acceptance.observe("head", 0, 1, 0)
    ctl.called("head", 0, drafted=True)
    args = {"base_tokens": 1.0, "call_cost": 0.0, "token_cost": 0.4e-3}
    assert ctl.ask_length(0, "head", 6, round_time, **args) > 0
    assert ctl.ask_length(0, "head", 6, round_time, **{**args, "call_cost": 1e-3, "token_cost": 0.2e-3}) == 0


def test_acceptance_starts_from_the_global_estimate_and_decays() -> None:
    acc = AcceptanceModel()
    assert acc.cumulative("d", 0, 2) == [FIRST_PRIOR, FIRST_PRIOR * LATER_PRIOR]  # nothing seen: the priors
    for _ in range(30):
        acc.observe("d", 0, 2, 2)  # slot 0: always fully accepted
    assert acc.conditional("d", 0, 0) > 0.95
    # Slot 1 has nothing of its own: it takes the global estimate, which holds slot 0's evidence.
    assert 0.9 < acc.conditional("d", 1, 0) <= acc.conditional("d", 0, 0)
    for _ in range(30):
        acc.observe("d", 0, 2, 0)  # then always rejected: old evidence fades
    assert acc.conditional("d", 0, 0) < 0.15  # about PRIOR_WEIGHT pseudo-observations over ~10 decayed ones
    acc.forget_slot(0)
    assert acc.conditional("d", 0, 0) == acc.conditional("d", 5, 0)


def test_probes_back_off_when_they_fail_and_reset_when_they_succeed() -> None:
    ctl = AdaptiveController(CostModel())
    intervals = []
    for _ in range(6):
        rounds = 0
        while not ctl.probing(0):
            ctl.planned(0, 0)
            rounds += 1
        intervals.append(rounds)
        ctl.planned(0, 1)
        ctl.verified("d", 0, 1, 0, probe=True)
    assert intervals == [min(PROBE_AFTER * 2**i, PROBE_MAX) for i in range(6)] and intervals[-1] == PROBE_MAX
    while not ctl.probing(0):
        ctl.planned(0, 0)
    ctl.planned(0, 1)
    ctl.verified("d", 0, 1, 1, probe=True)
    rounds = 0
    while not ctl.probing(0):
        ctl.planned(0, 0)
        rounds += 1
    assert rounds == PROBE_AFTER


def test_a_drafter_that_keeps_finding_nothing_is_asked_less_often_until_it_drafts() -> None:
    ctl = AdaptiveController(CostModel())
    asked = []
    for _ in range(4 * MISS_STREAK + 4 * MISS_GAP_MAX):  # 16 calls every round, 16 every 2nd, then sparse
        due = ctl.due("d", 0)
        asked.append(due)
        if due:
            ctl.called("d", 0, drafted=False)
    assert all(asked[:MISS_STREAK])  # asked every round at first
    tail = asked[-4 * MISS_GAP_MAX :]
    assert sum(tail) == 4  # then every MISS_GAP_MAX-th round
    assert ctl.due("d", 1)  # another slot is unaffected
    while not ctl.due("d", 0):
        pass
    ctl.called("d", 0, drafted=True)
    ctl.kept("d", 0, 2)  # a draft of some use: back to every round
    assert all(ctl.due("d", 0) for _ in range(3))
    ctl.called("d", 0, drafted=False)
    assert ctl.due("d", 0)


def _run(types: tuple[str, ...], adaptive: bool, prompt: list[int], n_predict: int, per_row: float,
         temperature: float = 0.0):  # type: ignore[no-untyped-def]
    spec = SpecParams(types=types, n_max=6, adaptive=adaptive)
    engine = fix_cost(make_engine(ToyBackend(), ToyTokenizer(), spec=spec,
                                  drafters=[RepeatDrafter(), GarbageDrafter(48, n_max=6)]), 1.0, per_row)
    req = CompletionRequest(prompt, n_predict=n_predict, sampling=SamplingParams(temperature=temperature, seed=5))
    [final] = anyio.run(run_requests, engine, [req])
    return final, engine.stats()["drafters"]


def test_a_drafter_that_is_always_wrong_stops_being_verified() -> None:
    fixed, fixed_stats = _run(("test-garbage",), False, [1, 2, 3], 80, per_row=0.3)
    adaptive, stats = _run(("test-garbage",), True, [1, 2, 3], 80, per_row=0.3)
    assert adaptive.tokens == fixed.tokens
    assert stats["test-garbage"]["acc_tokens"] <= fixed_stats["test-garbage"]["acc_tokens"]  # chance hits only
    a = stats["test-garbage"]["adaptive"]
    assert a["skipped"] > 0.8 * a["rounds"]  # only probes and the first tries remain
    assert stats["test-garbage"]["gen_tokens"] < 0.2 * fixed_stats["test-garbage"]["gen_tokens"]


def test_a_drafter_that_is_right_keeps_its_full_length() -> None:
    prompt = [7, 8, 9, 10] * 12
    fixed, fixed_stats = _run(("test-repeat",), False, prompt, 60, per_row=0.05)
    adaptive, stats = _run(("test-repeat",), True, prompt, 60, per_row=0.05)
    assert adaptive.tokens == fixed.tokens
    a = stats["test-repeat"]["adaptive"]
    assert a["skipped"] == 0 and a["shortened"] <= 1
    assert a["predicted_gain"] > 1.2  # the model expected speculation to pay


def test_dear_rows_shorten_drafts_without_changing_output() -> None:
    prompt = [7, 8, 9, 10] * 12
    for temperature in (0.0, 1.0):
        fixed, _ = _run(("test-repeat", "test-garbage"), False, prompt, 60, per_row=0.3, temperature=temperature)
        adaptive, stats = _run(("test-repeat", "test-garbage"), True, prompt, 60, per_row=0.3, temperature=temperature)
        assert adaptive.tokens == fixed.tokens
        assert sum(s["adaptive"]["rounds"] for s in stats.values() if "adaptive" in s) > 0


def test_a_decision_not_to_ask_stands_a_few_rounds_unless_new_evidence_arrives() -> None:
    def round_time(extra: int) -> float:
        return 4e-3 + 0.5e-3 * extra

    args = {"base_tokens": 1.0, "call_cost": 1e-3, "token_cost": 0.2e-3}
    for evidence in (False, True):
        ctl = AdaptiveController(CostModel())
        for _ in range(40):
            ctl.acceptance.observe("head", 0, 1, 0)  # always wrong: not worth asking
        ctl.called("head", 0, drafted=True)
        assert ctl.ask_length(0, "head", 6, round_time, **args) == 0
        for _ in range(60):
            ctl.acceptance.observe("head", 0, 6, 6)  # now always right, but no round verified it yet
        if evidence:
            ctl.verified("head", 0, 6, 6, probe=False)  # a verified draft is weighed at once
            assert ctl.ask_length(0, "head", 6, round_time, **args) > 0
            continue
        asked = [ctl.ask_length(0, "head", 6, round_time, **args) for _ in range(SKIP_STANDS)]
        assert asked[:-1] == [0] * (SKIP_STANDS - 1) and asked[-1] > 0
