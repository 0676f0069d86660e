"""Every sampler stays lossless under speculation: with a fixed seed, the engine's output with
draftless drafters and with a draft model (verified by sample-and-match) equals plain decoding, for
DRY (its history advances per accepted token), XTC (its own random coin), typical-p, top-n-sigma,
dynamic temperature, Mirostat 1 and 2 (mu advances per accepted token) and a reordered mixed chain;
and a probabilistic draft model (rejection sampling) is reproducible with each."""

from __future__ import annotations

import anyio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from toy_backend import (
    GarbageDrafter,
    RepeatDrafter,
    ToyBackend,
    ToyTokenizer,
    make_engine,
    plain_decode,
    run_requests,
)

from spekula.core.params import CompletionRequest, SamplingParams, SpecParams
from spekula.core.verify.dry import breaker_sequences
from spekula.drafters.model.draft_simple import DraftSimpleDrafter

# small n-gram sizes so the drafters fire on short toy histories
SMALL_NGRAMS = {"spec-ngram-simple-size-n": 2, "spec-ngram-simple-size-m": 6, "spec-ngram-mod-n-match": 3,
                "spec-ngram-mod-n-min": 1, "spec-ngram-mod-n-max": 7}
BREAKERS = (" ", ".")  # characters of the toy alphabet
SAMPLERS: dict[str, dict[str, object]] = {
    "dry": {"dry_multiplier": 0.8, "dry_base": 1.75, "dry_allowed_length": 2, "dry_penalty_last_n": 64,
            "dry_sequence_breakers": BREAKERS},
    "xtc": {"xtc_probability": 0.6, "xtc_threshold": 0.05},
    "typical": {"typical_p": 0.7},
    "top_n_sigma": {"top_n_sigma": 1.0},
    "dynatemp": {"dynatemp_range": 0.5, "dynatemp_exponent": 1.5},
    "mirostat1": {"mirostat": 1, "mirostat_tau": 3.0, "mirostat_eta": 0.2},
    "mirostat2": {"mirostat": 2, "mirostat_tau": 3.0, "mirostat_eta": 0.2},
    "mixed": {"samplers": ("temperature", "top_k", "dry", "xtc", "typ_p", "min_p", "penalties"),
              "dry_multiplier": 1.2, "dry_allowed_length": 1, "dry_sequence_breakers": BREAKERS,
              "xtc_probability": 0.5, "xtc_threshold": 0.08, "typical_p": 0.9, "repeat_penalty": 1.2},
}
N_CTX = 160
PROMPTS = [[3, 9, 4, 17, 5, 8, 2, 11, 3, 9, 4, 17], [5, 6, 7, 5, 6, 7, 5, 6], [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]]


def sampling(name: str, temperature: float, seed: int) -> SamplingParams:
    return SamplingParams(temperature=temperature, top_k=20, seed=seed, **SAMPLERS[name])  # type: ignore[arg-type]


def reference(prompt: list[int], params: SamplingParams, n_predict: int) -> list[int]:
    return plain_decode(ToyBackend(n_ctx=N_CTX), prompt, n_predict=n_predict, sampling=params, seed=params.seed,
                        is_eog=lambda t: False, n_ctx=N_CTX,
                        dry_breakers=breaker_sequences(ToyTokenizer(), params.dry_sequence_breakers))


def run(engine, reqs: list[CompletionRequest]) -> list[list[int]]:  # type: ignore[no-untyped-def]
    finals = anyio.run(run_requests, engine, reqs)
    assert all(f.error is None for f in finals), [f.error for f in finals]
    return [f.tokens for f in finals]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(names=st.lists(st.sampled_from(sorted(SAMPLERS)), min_size=1, max_size=3),
       temperature=st.sampled_from([0.0, 0.7, 1.2]), seed=st.integers(0, 2**32 - 4),
       types=st.lists(st.sampled_from(["ngram-simple", "ngram-mod", "suffix", "test-repeat", "test-garbage"]),
                      min_size=1, max_size=2, unique=True),
       n_max=st.integers(1, 6), n_predict=st.integers(5, 50))
def test_draftless_speculation_keeps_every_sampler_exact(names, temperature, seed, types, n_max,  # type: ignore[no-untyped-def]
                                                         n_predict) -> None:
    spec = SpecParams(types=tuple(types), n_max=n_max, drafter_options=dict(SMALL_NGRAMS))
    engine = make_engine(ToyBackend(n_ctx=N_CTX), ToyTokenizer(), n_slots=len(names), n_ctx=N_CTX, spec=spec,
                         drafters=[RepeatDrafter(), GarbageDrafter(48)])
    reqs = [CompletionRequest(PROMPTS[i % len(PROMPTS)], n_predict=n_predict, sampling=sampling(n, temperature, seed + i))
            for i, n in enumerate(names)]
    for req, out in zip(reqs, run(engine, reqs), strict=True):
        assert out == reference(req.prompt, req.sampling, n_predict)


def model_engine(salt: int, draft_sampling: str = "greedy"):  # type: ignore[no-untyped-def]
    drafter = DraftSimpleDrafter(ToyBackend(salt=salt, n_ctx=N_CTX), target_n_vocab=48)
    spec = SpecParams(types=("draft-simple",), n_max=4, adaptive=False, draft_sampling=draft_sampling)  # type: ignore[arg-type]
    return make_engine(ToyBackend(n_ctx=N_CTX), ToyTokenizer(), n_slots=2, n_ctx=N_CTX, spec=spec, drafters=[drafter])


@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(SAMPLERS)), temperature=st.sampled_from([0.0, 0.9]),
       seed=st.integers(0, 2**32 - 4), salt=st.sampled_from([0, 3]))
def test_draft_model_speculation_keeps_every_sampler_exact(name: str, temperature: float, seed: int,
                                                           salt: int) -> None:
    reqs = [CompletionRequest(PROMPTS[i], n_predict=30, sampling=sampling(name, temperature, seed + i)) for i in range(2)]
    for req, out in zip(reqs, run(model_engine(salt), reqs), strict=True):
        assert out == reference(req.prompt, req.sampling, 30)


def test_rejection_sampling_runs_every_sampler_reproducibly() -> None:
    for name in SAMPLERS:
        reqs = [CompletionRequest(PROMPTS[0], n_predict=25, sampling=sampling(name, 0.9, 11))]
        first, second = run(model_engine(0, "probabilistic"), reqs), run(model_engine(0, "probabilistic"), reqs)
        assert first == second and len(first[0]) == 25, name


def test_accepted_drafts_advance_the_sampler_state() -> None:
    """A draft model identical to the target gets tokens accepted under every sampler, so the state
    (DRY history, mu, XTC's coin) advances over accepted tokens, and the output is still plain decoding's."""
    for name in SAMPLERS:
        for temperature in (0.0, 0.9):
            engine = model_engine(0)
            reqs = [CompletionRequest(PROMPTS[1], n_predict=40, sampling=sampling(name, temperature, 21))]
            assert run(engine, reqs)[0] == reference(reqs[0].prompt, reqs[0].sampling, 40), (name, temperature)
            assert engine.stats()["drafters"]["draft-simple"]["acc_tokens"] > 0, (name, temperature)
