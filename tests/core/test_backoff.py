"""Backing off a model drafter whose calls do not pay (core/policy/backoff.py), and the engine leaving a
resting drafter alone: no capture for it, no observe, no call but its probes."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import ClassVar

import anyio
import numpy as np
from toy_backend import ObservingDrafter, ToyBackend, ToyTokenizer, make_engine, plain_decode, run_requests

from spekula.core.backend import Capture, SeqInput, SeqOutput
from spekula.core.drafting.drafter import Draft, DraftRequest
from spekula.core.params import CompletionRequest, SamplingParams, SpecParams
from spekula.core.policy.backoff import (
    MIN_EVIDENCE,
    PROBE_SHARE,
    REST_FIRST,
    REST_MAX,
    WAKE_AHEAD,
    DrafterBackoff,
)

CHEAP = 0.2  # plain rounds a call costs: below PROBE_SHARE * REST_FIRST, the rests are the doubling ones


def _lose(b: DrafterBackoff, spent: float = CHEAP) -> int:
    """Losing calls until the drafter rests; how many it took."""
    calls = 0
    while True:
        b.next_round()
        if not b.may_call("head", 0):
            return calls
        b.called("head", 0, gained=0, spent=spent)
        calls += 1


def _rests(b: DrafterBackoff, n: int, spent: float) -> list[int]:
    """The rounds waited for each of n probes after _lose, every probe losing at `spent`."""
    intervals = []
    waited = 1  # the round _lose found it resting
    for _ in range(n):
        while True:
            b.next_round()
            waited += 1
            if b.may_call("head", 0):
                break
        assert b.probing("head", 0)
        intervals.append(waited)
        b.called("head", 0, gained=0, spent=spent)  # the probe lost too
        waited = 0
    return intervals


def test_a_drafter_that_loses_rests_then_probes_at_doubling_intervals() -> None:
    assert CHEAP / PROBE_SHARE < REST_FIRST
    b = DrafterBackoff()
    calls = _lose(b)
    # Judged once its calls weigh MIN_EVIDENCE: the benefit of the doubt until then, and not longer.
    assert MIN_EVIDENCE <= calls <= MIN_EVIDENCE + 2
    assert _rests(b, 5, CHEAP) == [REST_FIRST, 2 * REST_FIRST, 4 * REST_FIRST, min(8 * REST_FIRST, REST_MAX),
                                   min(16 * REST_FIRST, REST_MAX)]


def test_a_dear_call_rests_the_drafter_in_proportion_to_its_cost() -> None:
    """A call that cost a round buys a rest of 1 / PROBE_SHARE rounds, so probing a head that never pays
    costs about PROBE_SHARE of the time; a dearer one (charged a round later) rests up to REST_MAX."""
    dear = 0.8
    b = DrafterBackoff()
    _lose(b, dear)
    first = math.ceil(dear / PROBE_SHARE)
    assert REST_FIRST < first < REST_MAX
    assert _rests(b, 3, dear) == [first, min(2 * first, REST_MAX), REST_MAX]
    c = DrafterBackoff()
    c.next_round()
    c.called("head", 0, gained=0, spent=0.3)
    assert c.resting("head", 0)
    waited = 0
    while not c.may_call("head", 0):
        c.next_round()
        waited += 1
    assert waited == max(REST_FIRST, math.ceil(0.3 / PROBE_SHARE))


def test_the_first_call_of_a_drafter_without_a_record_decides() -> None:
    """One call is evidence enough: a first call that loses rests the drafter for the slot at once (a
    short request cannot afford a second losing call), one that pays keeps it active."""
    losing, paying = DrafterBackoff(), DrafterBackoff()
    for b in (losing, paying):
        b.next_round()
        assert b.may_call("head", 0) and not b.probing("head", 0)
    losing.called("head", 0, gained=0, spent=0.6)
    paying.called("head", 0, gained=2, spent=0.6)
    losing.next_round()
    paying.next_round()
    assert not losing.may_call("head", 0) and losing.resting("head", 0)
    assert paying.may_call("head", 0) and not paying.probing("head", 0)


def test_a_probe_that_pays_makes_the_drafter_active_again() -> None:
    b = DrafterBackoff()
    _lose(b)
    while not b.may_call("head", 0):
        b.next_round()
    for _ in range(3):  # the text became predictable: every call gains more than it costs
        b.called("head", 0, gained=4, spent=0.5)
        b.next_round()
        assert b.may_call("head", 0) and not b.probing("head", 0)
    b.charge("head", 0, 0.2)  # the round after a call was slower: charged, still paying
    assert b.may_call("head", 0)


def test_resting_ends_a_few_rounds_before_the_probe() -> None:
    b = DrafterBackoff()
    _lose(b)
    resting = []
    while True:
        resting.append(b.resting("head", 0))
        b.next_round()
        if b.may_call("head", 0):
            break
    # The forwards of the last WAKE_AHEAD rounds before the probe are observed again.
    assert resting[-WAKE_AHEAD:] == [False] * WAKE_AHEAD and not any(resting[-WAKE_AHEAD:])
    assert all(resting[:-WAKE_AHEAD])
    assert not b.resting("other", 0) and not b.resting("head", 1)


def test_a_new_request_probes_soon_and_is_judged_on_the_drafters_record() -> None:
    b = DrafterBackoff()
    _lose(b)
    for _ in range(3):  # long rests
        while not b.may_call("head", 0):
            b.next_round()
        b.called("head", 0, gained=0, spent=CHEAP)
    b.begin_request(0)
    waited = 0
    while not b.may_call("head", 0):
        b.next_round()
        waited += 1
    assert waited <= REST_FIRST
    # Another slot's first request: the drafter's global record says it does not pay, so it rests at once.
    assert not b.may_call("head", 1)


class SlowWrongHead(ObservingDrafter):
    """A model drafter that can miss forwards, always wrong, and whose calls are dear."""

    name: ClassVar[str] = "test-slow-head"
    resumes: ClassVar[bool] = True

    def __init__(self, n_vocab: int) -> None:
        super().__init__(n_vocab, n_max=4)
        self.calls = 0

    def draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        self.calls += 1
        time.sleep(0.003)  # many toy forwards' worth
        return super().draft(requests)

    def observe(self, slot: int, inp: SeqInput, out: SeqOutput) -> None:
        assert 1 in out.layer_inputs  # whenever it observes, its capture was made
        super().observe(slot, inp, out)


class CapturingBackend(ToyBackend):
    def __init__(self) -> None:
        super().__init__()
        self.captures: list[bool] = []

    def forward(self, inputs: Sequence[SeqInput], capture: Capture = Capture()) -> list[SeqOutput]:  # noqa: B008
        self.captures.append(bool(capture))
        return super().forward(inputs, capture)


def test_a_head_that_does_not_pay_rests_without_captures_or_observations_and_output_stays_plain() -> None:
    prompt, n_predict = [3, 1, 4, 1, 5], 150
    sampling = SamplingParams(temperature=0.0)
    tok = ToyTokenizer()
    expected = plain_decode(ToyBackend(), prompt, n_predict=n_predict, sampling=sampling, seed=0, is_eog=tok.is_eog,
                            n_ctx=256)
    backend = CapturingBackend()
    head = SlowWrongHead(48)
    spec = SpecParams(types=(head.name,), n_max=4, adaptive=True)
    engine = make_engine(backend, tok, spec=spec, drafters=[head])
    [final] = anyio.run(run_requests, engine, [CompletionRequest(prompt, n_predict=n_predict, sampling=sampling)])
    assert final.tokens == expected
    forwards = len(backend.captures)
    assert head.calls < 0.2 * forwards  # the first calls and rare probes
    assert len(head.observed) < 0.5 * forwards
    assert sum(backend.captures) == len(head.observed)  # no capture made for nobody
    starts = [start for _, start, _, _ in head.observed]
    assert starts == sorted(starts) and np.all(np.diff(starts) > 0)
