"""Property-based lossless harness on the toy backend (fast, exact numerics).

For random prompts, drafter type sets, caps, slot counts and concurrent requests with different
settings, every request's tokens must equal a plain one-token-per-forward decode of the same prompt
(greedy, and seeded sampling at temperature > 0 since every drafter here is verified by
sample-and-match), with fixed and adaptive draft lengths and under cost models from cheap rows to
rows so dear that most drafts are cut. Synthetic acceptance must hit the requested rates.
"""

from __future__ import annotations

import math

import anyio
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from toy_backend import (
    GarbageDrafter,
    RepeatDrafter,
    ToyBackend,
    ToyTokenizer,
    fix_cost,
    make_engine,
    plain_decode,
    run_requests,
)

from spekula.core.params import CompletionRequest, SamplingParams, SpecParams
from spekula.core.stats.stats import DrafterStats
from spekula.core.verify.synthetic import resolve_synthetic_rates

NGRAM_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache", "suffix")
ALL_TYPES = (*NGRAM_TYPES, "test-repeat", "test-garbage")
# Small n-gram sizes so the drafters fire on short toy histories.
SMALL_NGRAMS = {
    "spec-ngram-simple-size-n": 2, "spec-ngram-simple-size-m": 6,
    "spec-ngram-map-k-size-n": 2, "spec-ngram-map-k-size-m": 5,
    "spec-ngram-map-k4v-size-n": 2, "spec-ngram-map-k4v-size-m": 5, "spec-ngram-map-k4v-min-hits": 1,
    "spec-ngram-mod-n-match": 3, "spec-ngram-mod-n-min": 1, "spec-ngram-mod-n-max": 7,
}


def _reference(req: CompletionRequest, seed: int, n_ctx: int) -> list[int]:
    return plain_decode(ToyBackend(n_ctx=n_ctx), req.prompt, n_predict=req.n_predict, sampling=req.sampling,
                        seed=seed, is_eog=lambda t: False, n_ctx=n_ctx)


def _check_invariants(engine, finals) -> None:  # type: ignore[no-untyped-def]
    for f in finals:
        t = f.timings
        assert t["predicted_n"] == len(f.tokens)
        if "draft_n" in t:
            assert 0 <= t["draft_n_accepted"] <= t["draft_n"] and t["draft_n"] > 0
    for counters in engine.stats()["drafters"].values():
        assert counters["acc_tokens"] <= counters["gen_tokens"]
        assert counters["acc_drafts"] <= counters["calls_accept"] <= counters["gen_drafts"]
        pos = counters["acc_per_pos"]
        assert all(a >= b for a, b in zip(pos, pos[1:], strict=False))  # non-increasing (docs/semantics.md §8.9)
    for line in engine.spec_stats.lines(prefix=True):
        name, parsed = DrafterStats.parse_line(line)
        c = engine.stats()["drafters"][name]
        assert (parsed.n_call_begin, parsed.n_call_draft, parsed.n_call_accept) == (
            c["calls_begin"], c["calls_draft"], c["calls_accept"])
        assert (parsed.n_gen_drafts, parsed.n_acc_drafts, parsed.n_gen_tokens, parsed.n_acc_tokens) == (
            c["gen_drafts"], c["acc_drafts"], c["gen_tokens"], c["acc_tokens"])


request_strategy = st.fixed_dictionaries({
    "segment": st.lists(st.integers(0, 47), min_size=2, max_size=8),
    "repeats": st.integers(1, 4),
    "n_predict": st.integers(1, 60),
    "types": st.lists(st.sampled_from(ALL_TYPES), max_size=3, unique=True),
    "n_max": st.integers(1, 6),
    "temperature": st.sampled_from([0.0, 0.0, 0.7, 1.3]),
    "seed": st.integers(0, 2**32 - 1),
    "adaptive": st.booleans(),
    # biases and bans move the target's choice away from what the drafters copy (the greedy fast path is off)
    "logit_bias": st.lists(st.tuples(st.integers(0, 47), st.sampled_from([-math.inf, -3.0, 2.0, 8.0])), max_size=4),
    # (repeat, frequency, presence) penalties: the target's choice depends on the tokens emitted so far
    "penalties": st.sampled_from([(1.0, 0.0, 0.0), (1.0, 0.0, 0.0), (1.3, 0.0, 0.0), (1.0, 0.8, 0.0), (1.1, 0.3, 1.5)]),
})
# (base seconds, seconds per row) of a forward, or None: the cost model measured and learned.
cost_strategy = st.sampled_from([None, (1.0, 0.01), (1.0, 0.3), (1.0, 2.0)])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=st.lists(request_strategy, min_size=1, max_size=4), n_slots=st.integers(1, 3),
       n_batch=st.sampled_from([4, 16, 512]), server_types=st.lists(st.sampled_from(ALL_TYPES), max_size=3, unique=True),
       server_adaptive=st.booleans(), cost=cost_strategy)
def test_speculation_never_changes_output(reqs, n_slots, n_batch, server_types, server_adaptive,  # type: ignore[no-untyped-def]
                                          cost) -> None:
    n_ctx = 128
    spec = SpecParams(types=tuple(server_types), drafter_options=dict(SMALL_NGRAMS), adaptive=server_adaptive)
    engine = make_engine(ToyBackend(n_ctx=n_ctx), ToyTokenizer(), n_slots=n_slots, n_ctx=n_ctx, n_batch=n_batch,
                         spec=spec, drafters=[RepeatDrafter(), GarbageDrafter(48)])
    if cost is not None:
        fix_cost(engine, *cost)
    requests = []
    for r in reqs:
        prompt = (r["segment"] * r["repeats"])[: n_ctx - 2]
        repeat, frequency, presence = r["penalties"]
        sampling = SamplingParams(temperature=r["temperature"], top_k=20, seed=r["seed"],
                                  logit_bias=tuple(r["logit_bias"]), repeat_penalty=repeat,
                                  frequency_penalty=frequency, presence_penalty=presence)
        req_spec = (spec.with_(types=tuple(r["types"]), n_max=r["n_max"], adaptive=r["adaptive"])
                    if r["types"] else None)
        requests.append(CompletionRequest(prompt, n_predict=r["n_predict"], sampling=sampling, spec=req_spec))
    finals = anyio.run(run_requests, engine, requests)
    for req, final in zip(requests, finals, strict=True):
        assert final.error is None
        assert final.tokens == _reference(req, req.sampling.seed, n_ctx)
    _check_invariants(engine, finals)


@pytest.mark.anyio
async def test_real_ngram_drafters_accept_on_repetitive_text() -> None:
    spec = SpecParams(types=NGRAM_TYPES, drafter_options=dict(SMALL_NGRAMS))
    engine = make_engine(ToyBackend(), ToyTokenizer(), n_slots=2, spec=spec)
    greedy = SamplingParams(temperature=0.0)
    reqs = [CompletionRequest([3, 9, 4, 17, 5, 8, 2, 11], n_predict=120, sampling=greedy),
            CompletionRequest([5, 6, 7], n_predict=90, sampling=greedy)]
    finals = await run_requests(engine, reqs)
    for req, final in zip(reqs, finals, strict=True):
        assert final.tokens == _reference(req, 0, 256)
        assert final.timings["draft_n_accepted"] > 0
    _check_invariants(engine, finals)


def _synthetic_run(rates: tuple[float, ...] | None, length: float | None, n_predict: int = 1500):
    spec = SpecParams(types=("test-garbage",), synth_rates=rates, synth_len=length)
    engine = make_engine(ToyBackend(n_ctx=4096), ToyTokenizer(), n_ctx=4096, spec=spec,
                         drafters=[GarbageDrafter(48, n_max=4)])
    # a fixed seed: the synthetic acceptance draws come from the request's RNG, and an unseeded
    # request would make these statistical checks fail now and then (about 1 run in 5000)
    req = CompletionRequest([1, 2, 3], n_predict=n_predict, sampling=SamplingParams(temperature=0.0, seed=7))
    [final] = anyio.run(run_requests, engine, [req])
    return engine, final


def test_synthetic_rates_are_met() -> None:
    rates = (0.8, 0.6, 0.3, 0.1)
    engine, final = _synthetic_run(rates, None)
    entry = engine.request_stats[final.request_id]["spec"]
    steps = entry.n_verif_steps
    measured = [c / steps for c in entry.accepted_per_pos]
    # ~700 rounds: 4 standard errors of a rate near 0.5 is about 0.08
    assert np.allclose(measured, rates, atol=0.08), measured
    assert abs(entry.mean_len - (1 + sum(rates))) < 0.15


def test_synthetic_length_is_met() -> None:
    engine, final = _synthetic_run(None, 2.5)
    entry = engine.request_stats[final.request_id]["spec"]
    assert abs(entry.mean_len - 2.5) < 0.15
    assert resolve_synthetic_rates(4, None, 2.5) is not None


def test_zero_synthetic_rates_give_plain_output() -> None:
    engine, final = _synthetic_run((0.0, 0.0, 0.0, 0.0), None, n_predict=80)
    req = CompletionRequest([1, 2, 3], n_predict=80, sampling=SamplingParams(temperature=0.0))
    assert final.tokens == _reference(req, 0, 4096)
    assert final.timings["draft_n"] > 0 and final.timings["draft_n_accepted"] == 0


def test_bad_synthetic_options_fail_at_start() -> None:
    from spekula.core.errors import ConfigError

    with pytest.raises(ConfigError, match="4 values"):
        _synthetic_run((0.5, 0.2), None)
    with pytest.raises(ConfigError, match="mutually exclusive"):
        _synthetic_run((0.5, 0.4, 0.3, 0.2), 2.0)
