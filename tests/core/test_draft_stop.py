"""A model drafter's draft stops where the cut could keep no more of it (core/policy/draft_stop.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import ClassVar

import anyio
import numpy as np
import pytest
from toy_backend import ConfidentDrafter, ToyBackend, ToyTokenizer, make_engine, plain_decode, run_requests

from spekula.core.drafting.drafter import Draft, DraftRequest
from spekula.core.params import CompletionRequest, SamplingParams, SpecParams
from spekula.core.policy.confidence import ConfidenceCalibration
from spekula.core.policy.cost_model import Offer, choose_lengths
from spekula.core.policy.draft_stop import DraftStop, break_even


def test_break_even_is_a_rows_and_a_steps_cost_in_tokens_at_the_rate() -> None:
    # A round of 10 ms plus 1 ms a row, the rate 100 tokens/s, a head step 0.5 ms: a token must be
    # accepted with probability 0.1 + 0.05 to pay for its row and step.
    thresholds = break_even(lambda extra: 0.010 + 0.001 * extra, 4, 100.0, 0.0005)
    assert thresholds == pytest.approx([0.15] * 4)


def test_break_even_looks_past_a_dear_row_to_cheaper_ones_after_it() -> None:
    # The first extra row costs 5 ms, the next three nothing more: one token alone must be right
    # half the time, but four at the same probability share the 5 ms (1.25 ms each).
    times = {0: 0.010, 1: 0.015, 2: 0.015, 3: 0.015, 4: 0.015}
    thresholds = break_even(times.__getitem__, 4, 100.0, 0.0)
    assert thresholds[0] == pytest.approx(0.125)
    assert thresholds[1:] == pytest.approx([0.0, 0.0, 0.0])


def test_the_stop_drafts_a_first_token_and_goes_on_while_the_draft_is_likely_enough() -> None:
    stop = DraftStop([0.1, 0.1, 0.1], lambda c: list(np.cumprod(c)))
    assert stop([])
    assert stop([0.5]) and stop([0.5, 0.5]) and not stop([0.5, 0.5, 0.3])  # 0.075 < 0.1
    assert not stop([0.9, 0.9, 0.9])  # the planned length: nothing further could be verified


@pytest.mark.parametrize("seed", range(20))
def test_the_stop_never_drops_a_token_the_cut_would_keep(seed: int) -> None:
    """With head steps free, a draft stopped by the rule is at least as long as what the cut keeps of
    the whole draft: the rule only saves steps whose tokens the cut throws away."""
    rng = np.random.default_rng(seed)
    calibration = ConfidenceCalibration()
    for _ in range(50):  # some history, so the calibration is not just its prior
        conf = [float(c) for c in rng.uniform(0, 1, 6)]
        calibration.observe("head", conf, int(rng.integers(0, 7)))
    n = 8
    per_row = float(rng.uniform(0.0005, 0.004))
    concave = float(rng.uniform(0.5, 1.0))
    round_time = lambda extra: 0.010 + per_row * extra**concave  # noqa: E731
    rate = float(rng.uniform(50, 150))
    stop = DraftStop(break_even(round_time, n, rate, 0.0), lambda c: calibration.cumulative("head", list(c)))
    for _ in range(20):
        confidence = [float(c) for c in rng.uniform(0.3, 1.0, n) ** 0.3]
        drafted = 1
        while drafted < n and stop(confidence[:drafted]):
            drafted += 1
        offer = Offer(0, "head", calibration.cumulative("head", confidence))
        kept = choose_lengths([offer], round_time, base_tokens=1, rate=rate).lengths[0]
        assert kept <= drafted


class StoppingHead(ConfidentDrafter):
    """ConfidentDrafter that drafts token by token and follows the request's rule for drafting on."""

    name: ClassVar[str] = "test-stopping-head"

    def __init__(self, truth: Sequence[int], n_vocab: int) -> None:
        super().__init__(truth, n_vocab, n_max=6, right=2)
        self.rules: list[Callable[[Sequence[float]], bool] | None] = []

    def draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        out = []
        for r, full in zip(requests, super().draft(requests), strict=True):
            self.rules.append(r.keep_drafting)
            conf = full.confidence or []
            n = 1
            while n < len(full.tokens) and (r.keep_drafting is None or r.keep_drafting(conf[:n])):
                n += 1
            out.append(full.prefix(n))
        return out


@pytest.mark.parametrize("adaptive", [True, False])
def test_the_adaptive_policy_gives_a_model_drafter_a_rule_and_output_stays_plain(adaptive: bool) -> None:
    prompt, n_predict = [3, 1, 4, 1, 5], 60
    sampling = SamplingParams(temperature=0.0)
    tok = ToyTokenizer()
    expected = plain_decode(ToyBackend(), prompt, n_predict=n_predict, sampling=sampling, seed=0, is_eog=tok.is_eog,
                            n_ctx=256)
    head = StoppingHead(prompt + expected, 48)
    spec = SpecParams(types=(head.name,), n_max=6, adaptive=adaptive)
    engine = make_engine(ToyBackend(), tok, spec=spec, drafters=[head])
    [final] = anyio.run(run_requests, engine, [CompletionRequest(prompt, n_predict=n_predict, sampling=sampling)])
    assert final.tokens == expected
    assert head.rules
    assert all((rule is not None) == adaptive for rule in head.rules)  # fixed lengths draft to the cap
