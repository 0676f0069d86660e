"""The engine over a recurrent target: speculation and prompt caching stay lossless where the
backend can rebuild only some lengths (its checkpoint before each verification, its snapshots).

The recurrent toy backend raises on any truncation it could not rebuild, so every check here also
checks that the engine keeps to the recurrent-state contract (core/backend.py).
"""

from __future__ import annotations

import anyio
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from toy_backend import (
    GarbageDrafter,
    RecurrentToyBackend,
    RepeatDrafter,
    ToyTokenizer,
    make_engine,
    plain_decode,
    run_requests,
)

from spekula.core.backend import SeqInput
from spekula.core.errors import ConfigError
from spekula.core.params import CompletionRequest, SamplingParams, SpecParams
from spekula.drafters.model.draft_simple import DraftSimpleDrafter

GREEDY = SamplingParams(temperature=0.0)
NGRAMS = ("ngram-simple", "ngram-map-k", "ngram-mod", "suffix")
SMALL_NGRAMS = {"spec-ngram-simple-size-n": 2, "spec-ngram-simple-size-m": 6,
                "spec-ngram-map-k-size-n": 2, "spec-ngram-map-k-size-m": 5,
                "spec-ngram-mod-n-match": 3, "spec-ngram-mod-n-min": 1, "spec-ngram-mod-n-max": 7}


def _reference(prompt: list[int], n_predict: int, sampling: SamplingParams, n_ctx: int = 128) -> list[int]:
    return plain_decode(RecurrentToyBackend(n_ctx=n_ctx), prompt, n_predict=n_predict, sampling=sampling,
                        seed=max(sampling.seed, 0), is_eog=lambda t: False, n_ctx=n_ctx)


def test_the_toy_contract_refuses_what_a_recurrent_backend_cannot_rebuild() -> None:
    b = RecurrentToyBackend()
    seq = b.new_seq()
    b.forward([SeqInput(seq, np.arange(10, dtype=np.int32), 0)])
    assert b.restorable(seq, 7) == 0
    with pytest.raises(ConfigError, match="cannot be restored"):
        b.truncate(seq, 7)
    b.snapshot(seq)
    b.checkpoint(seq)
    b.forward([SeqInput(seq, np.arange(5, dtype=np.int32), 10)])
    assert [b.restorable(seq, n) for n in (15, 12, 10, 9)] == [15, 12, 10, 0]
    b.truncate(seq, 12)
    assert b.restorable(seq, 11) == 11  # the checkpoint at 10 still holds
    b.truncate(seq, 0)
    assert b.restorable(seq, 10) == 0  # truncating below a snapshot drops it


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(segment=st.lists(st.integers(0, 47), min_size=2, max_size=8), repeats=st.integers(1, 4),
       n_predict=st.integers(1, 50), types=st.lists(st.sampled_from((*NGRAMS, "test-repeat", "test-garbage")),
                                                    min_size=1, max_size=3, unique=True),
       n_max=st.integers(1, 6), temperature=st.sampled_from([0.0, 0.0, 0.9]), seed=st.integers(0, 2**32 - 1),
       n_slots=st.integers(1, 2), n_batch=st.sampled_from([4, 64]))
def test_speculation_on_a_recurrent_target_never_changes_output(segment, repeats, n_predict, types, n_max,  # type: ignore[no-untyped-def]
                                                                temperature, seed, n_slots, n_batch) -> None:
    n_ctx = 128
    spec = SpecParams(types=tuple(types), n_max=n_max, drafter_options=dict(SMALL_NGRAMS))
    backend = RecurrentToyBackend(n_ctx=n_ctx)
    engine = make_engine(backend, ToyTokenizer(), n_slots=n_slots, n_ctx=n_ctx, n_batch=n_batch, spec=spec,
                         drafters=[RepeatDrafter(), GarbageDrafter(48)])
    sampling = SamplingParams(temperature=temperature, top_k=20, seed=seed)
    prompt = (segment * repeats)[: n_ctx - 2]
    reqs = [CompletionRequest(list(prompt), n_predict=n_predict, sampling=sampling),
            CompletionRequest([*prompt[::-1], 1], n_predict=n_predict, sampling=sampling)][:n_slots]
    finals = anyio.run(run_requests, engine, reqs)
    for req, final in zip(reqs, finals, strict=True):
        assert final.error is None
        assert final.tokens == _reference(list(req.prompt), n_predict, sampling, n_ctx)


@pytest.mark.anyio
async def test_rejected_drafts_roll_back_from_the_checkpoint() -> None:
    backend = RecurrentToyBackend()
    engine = make_engine(backend, ToyTokenizer(), spec=SpecParams(types=("test-garbage",), n_max=4),
                         drafters=[GarbageDrafter(48, n_max=4)])
    [final] = await run_requests(engine, [CompletionRequest([3, 9, 4, 17], n_predict=40, sampling=GREEDY)])
    assert final.error is None and final.tokens == _reference([3, 9, 4, 17], 40, GREEDY, 256)
    assert final.timings["draft_n"] > final.timings["draft_n_accepted"]  # rollbacks happened
    assert backend.n_checkpoints > 0


@pytest.mark.anyio
async def test_second_turn_reuses_the_current_state_or_the_prompt_snapshot() -> None:
    prompt = [3, 9, 4, 17, 5, 8, 2, 11]
    backend = RecurrentToyBackend()
    engine = make_engine(backend, ToyTokenizer(), spec=SpecParams(types=("test-repeat",)), drafters=[RepeatDrafter()])
    [first] = await run_requests(engine, [CompletionRequest(list(prompt), n_predict=12, sampling=GREEDY)])
    # The whole history is the sequence's current length: reused whole.
    turn2 = prompt + first.tokens + [7, 7, 13]
    [second] = await run_requests(engine, [CompletionRequest(list(turn2), n_predict=20, sampling=GREEDY)])
    assert second.timings["cache_n"] == len(prompt) + len(first.tokens) - 1
    assert second.tokens == _reference(turn2, 20, GREEDY, 256)
    # A prompt leaving the second turn's answer halfway (a template that re-renders it) falls back
    # to the snapshot at the end of the second prompt, never to a state the backend cannot rebuild.
    turn3 = turn2 + second.tokens[:5] + [1, 2]
    [third] = await run_requests(engine, [CompletionRequest(list(turn3), n_predict=10, sampling=GREEDY)])
    assert third.timings["cache_n"] == len(turn2)  # 5 more tokens are common, but not restorable
    assert third.tokens == _reference(turn3, 10, GREEDY, 256)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_draft_simple_over_a_recurrent_draft_model_follows_the_history(temperature: float) -> None:
    # The draft model is the target itself: sampled at temperature 1 the target rejects part of
    # many drafts, so the draft model takes back some of its draft steps every round.
    draft_backend, target = RecurrentToyBackend(), RecurrentToyBackend()
    drafter = DraftSimpleDrafter(draft_backend, target_n_vocab=48)
    spec = SpecParams(types=("draft-simple",), n_max=4, adaptive=False)
    engine = make_engine(target, ToyTokenizer(), spec=spec, drafters=[drafter])
    prompt, n_predict = [5, 6, 7, 8, 9, 10], 30
    sampling = SamplingParams(temperature=temperature, seed=3)
    [final] = anyio.run(run_requests, engine, [CompletionRequest(prompt, n_predict=n_predict, sampling=sampling)])
    assert final.error is None and final.tokens == _reference(prompt, n_predict, sampling, 256)
    assert 0 < final.timings["draft_n_accepted"] <= final.timings["draft_n"]
    # It takes back only its draft steps (checkpointed after x), never re-reads the history.
    assert sum(draft_backend.rows_per_forward) <= len(prompt) + n_predict + final.timings["draft_n"]
