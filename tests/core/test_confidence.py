"""A model drafter's confidence, calibrated against outcomes (core/policy/confidence.py), and the bar the
planner holds drafts against (core/policy/cost_model.py)."""

from __future__ import annotations

import math

import anyio
from toy_backend import (
    ConfidentDrafter,
    ToyBackend,
    ToyTokenizer,
    fix_cost,
    make_engine,
    plain_decode,
    run_requests,
)

from spekula.core.params import CompletionRequest, SamplingParams, SpecParams
from spekula.core.policy.confidence import BINS, PRIOR_WEIGHT, ConfidenceCalibration
from spekula.core.policy.controller import AdaptiveController
from spekula.core.policy.cost_model import CostModel


def test_a_bins_prior_is_its_midpoint_squared_until_outcomes_arrive() -> None:
    cal = ConfidenceCalibration()
    assert math.isclose(cal.rate("head", 0.95), 0.95**2)
    assert math.isclose(cal.rate("head", 0.31), 0.35**2)
    # bin edges and nonsense: 1.0 is the top bin, NaN and negatives the bottom one
    assert cal.rate("head", 1.0) == cal.rate("head", 0.99)
    assert cal.rate("head", float("nan")) == cal.rate("head", -1.0) == cal.rate("head", 0.0)


def test_outcomes_move_a_bin_and_untested_positions_teach_nothing() -> None:
    cal = ConfidenceCalibration()
    for _ in range(200):
        # the first token (confidence 0.95) rejected; the two after it were never tested
        cal.observe("head", [0.95, 0.15, 0.15], n_accepted=0)
        cal.observe("head", [0.55], n_accepted=1)
    assert cal.rate("head", 0.95) < 0.05
    assert cal.rate("head", 0.55) > 0.95
    assert math.isclose(cal.rate("head", 0.15), 0.15**2)  # untouched
    assert cal.rate("other", 0.95) == 0.95**2  # per drafter


def test_a_bin_forgets_old_outcomes() -> None:
    cal = ConfidenceCalibration()
    for _ in range(300):
        cal.observe("head", [0.75], n_accepted=0)
    for _ in range(300):
        cal.observe("head", [0.75], n_accepted=1)
    assert cal.rate("head", 0.75) > 0.95


def test_cumulative_is_the_product_of_the_rates() -> None:
    cal = ConfidenceCalibration()
    confidence = [0.95, 0.75, 0.35]
    expected = [0.95**2, 0.95**2 * 0.75**2, 0.95**2 * 0.75**2 * 0.35**2]
    got = cal.cumulative("head", confidence)
    assert all(math.isclose(a, b) for a, b in zip(got, expected, strict=True))
    assert BINS == 10 and PRIOR_WEIGHT > 0


def test_an_offer_with_confidence_is_valued_by_it_and_one_without_by_position() -> None:
    ctl = AdaptiveController(CostModel())
    for _ in range(30):
        ctl.acceptance.observe("head", 0, 3, 3)  # every position always accepted so far
    by_position = ctl.offer(0, "head", 3).gains
    assert by_position[0] > 0.9
    sure = ctl.offer(0, "head", 3, confidence=[0.95, 0.95, 0.95]).gains
    unsure = ctl.offer(0, "head", 3, confidence=[0.15, 0.95, 0.95]).gains
    assert sure[0] > 0.85 and unsure[0] < 0.05 and all(u < s for u, s in zip(unsure, sure, strict=True))
    # a confidence list shorter than the draft (a trimmed draft) falls back to the positions
    assert ctl.offer(0, "head", 3, confidence=[0.15]).gains == by_position
    ctl.verified("head", 0, 2, 0, probe=False, confidence=[0.95, 0.95])
    assert ctl.calibration.rate("head", 0.95) < 0.95**2


def test_a_calls_hit_is_whether_its_cut_kept_anything() -> None:
    """A model drafter always drafts something; whether the call was of use is decided by the cut."""
    ctl = AdaptiveController(CostModel())
    for _ in range(40):
        ctl.called("head", 0, drafted=True, judged_at_cut=True)
        ctl.kept("head", 0, 0, judged_at_cut=True)
    assert ctl.hit_rate("head", 0) < 0.15
    plain = AdaptiveController(CostModel())
    for _ in range(40):
        plain.called("ngram", 0, drafted=True)
        plain.kept("ngram", 0, 0)
    assert plain.hit_rate("ngram", 0) > 0.85  # without confidence a draft is a hit, as before


def test_the_bar_is_the_measured_plain_round_not_the_forward_curve() -> None:
    ctl = AdaptiveController(CostModel({1: 5e-3, 64: 50e-3}))
    assert math.isclose(ctl.rate(1.0, 5e-3), 200.0)
    for _ in range(50):
        ctl.cost.observe_plain_round(1, 4e-3)
    assert math.isclose(ctl.rate(1.0, 5e-3), 250.0, rel_tol=1e-6)
    assert math.isclose(ctl.rate(2.0, 5e-3), 400.0)  # two slots: no measurement yet, the curve's
    ctl.cost.observe_plain_round(1, float("nan"))
    ctl.cost.observe_plain_round(1, -1.0)
    assert math.isclose(ctl.rate(1.0, 5e-3), 250.0, rel_tol=1e-6)


PROMPT = [7, 8, 9, 10] * 12


def _run(liar: bool, adaptive: bool) -> tuple[list[int], dict[str, int]]:
    backend = ToyBackend()
    truth = PROMPT + plain_decode(backend, PROMPT, n_predict=80, sampling=SamplingParams(temperature=0.0), seed=0,
                                  is_eog=lambda t: False, n_ctx=256)
    drafter = ConfidentDrafter(truth, 48, liar=liar)
    spec = SpecParams(types=("test-confident",), n_max=6, adaptive=adaptive)
    engine = fix_cost(make_engine(ToyBackend(), ToyTokenizer(), spec=spec, drafters=[drafter]), 1.0, 0.3)
    req = CompletionRequest(PROMPT, n_predict=60, sampling=SamplingParams(temperature=0.0))
    [final] = anyio.run(run_requests, engine, [req])
    assert list(final.tokens) == truth[len(PROMPT) : len(PROMPT) + 60]
    stats = engine.stats()["drafters"]["test-confident"]
    return list(final.tokens), {"gen": stats["gen_tokens"], "acc": stats["acc_tokens"]}


def test_the_engine_verifies_what_the_drafter_is_sure_of_and_output_never_changes() -> None:
    fixed, fixed_stats = _run(liar=False, adaptive=False)
    honest, honest_stats = _run(liar=False, adaptive=True)
    liar, liar_stats = _run(liar=True, adaptive=True)
    assert honest == fixed == liar  # confidence sizes drafts; it never changes what is emitted
    assert fixed_stats["acc"] < 0.8 * fixed_stats["gen"]  # the padding is there to be refused
    # With confidence that tells the copied tokens from the padding the verified tokens are nearly all
    # right; with confidence that says the opposite the calibration learns to distrust it.
    # (valued by position instead, 5 of the 49 verified tokens are wrong in this run)
    assert honest_stats["gen"] - honest_stats["acc"] <= 1 and honest_stats["acc"] >= 40
    assert honest_stats["acc"] > liar_stats["acc"]


def test_a_model_drafter_is_weighed_for_no_more_than_it_can_draft() -> None:
    """The round has room for 60 tokens; a head capped at --spec-draft-n-max 3 is weighed for 3."""
    backend = ToyBackend()
    truth = PROMPT + plain_decode(backend, PROMPT, n_predict=40, sampling=SamplingParams(temperature=0.0), seed=0,
                                  is_eog=lambda t: False, n_ctx=256)
    spec = SpecParams(types=("test-confident",), n_max=3, adaptive=True)
    engine = fix_cost(make_engine(ToyBackend(), ToyTokenizer(), spec=spec, drafters=[ConfidentDrafter(truth, 48)]),
                      1.0, 0.3)
    weighed: list[int] = []
    ask = engine.adaptive.ask_length

    def spy(slot, drafter, n_max, round_time, **kw):  # type: ignore[no-untyped-def]
        weighed.append(n_max)
        return ask(slot, drafter, n_max, round_time, **kw)

    engine.adaptive.ask_length = spy  # type: ignore[method-assign]
    anyio.run(run_requests, engine, [CompletionRequest(PROMPT, n_predict=40, sampling=SamplingParams(temperature=0.0))])
    assert weighed and max(weighed) == 3


def test_a_model_drafter_with_a_cap_of_0_is_never_called() -> None:
    """--spec-draft-n-max 0: a model drafter drafts nothing, so the adaptive planner does not call it."""
    backend = ToyBackend()
    truth = PROMPT + plain_decode(backend, PROMPT, n_predict=20, sampling=SamplingParams(temperature=0.0), seed=0,
                                  is_eog=lambda t: False, n_ctx=256)
    drafter = ConfidentDrafter(truth, 48)
    calls: list[int] = []
    draft = drafter.draft

    def counting(requests):  # type: ignore[no-untyped-def]
        calls.append(len(requests))
        return draft(requests)

    drafter.draft = counting  # type: ignore[method-assign]
    spec = SpecParams(types=("test-confident",), n_max=0, adaptive=True)
    engine = fix_cost(make_engine(ToyBackend(), ToyTokenizer(), spec=spec, drafters=[drafter]), 1.0, 0.3)
    [final] = anyio.run(run_requests, engine, [CompletionRequest(PROMPT, n_predict=20,
                                                                 sampling=SamplingParams(temperature=0.0))])
    assert list(final.tokens) == truth[len(PROMPT) : len(PROMPT) + 20]
    assert calls == []
