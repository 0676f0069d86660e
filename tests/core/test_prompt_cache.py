"""Prompt caching: slot choice, reused prefixes, and that a reused prefix changes no output token."""

from __future__ import annotations

from functools import cache

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from toy_backend import RepeatDrafter, ToyBackend, ToyTokenizer, make_engine, run_requests

from spekula.core.backend import BackendOptions, load_backend
from spekula.core.engine.prompt_cache import SlotCache, choose_slot, common_prefix
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.core.modelfile.tokenizer import Tokenizer
from spekula.core.params import CompletionRequest, SamplingParams, SpecParams

GREEDY = SamplingParams(temperature=0.0)
N_CTX = 128
SMALL_NGRAMS = {"spec-ngram-simple-size-n": 2, "spec-ngram-simple-size-m": 5, "spec-ngram-mod-n-match": 2,
                "spec-ngram-mod-n-min": 1, "spec-ngram-mod-n-max": 5}


def _a(*tokens: int) -> np.ndarray:
    return np.array(tokens, np.int32)


def test_common_prefix() -> None:
    assert common_prefix(_a(1, 2, 3), _a(1, 2, 4)) == 2
    assert common_prefix(_a(1, 2), _a(1, 2, 4)) == 2
    assert common_prefix(_a(), _a(1)) == 0
    assert common_prefix(_a(5), _a(1)) == 0


def test_choose_slot_prefers_longest_similar_prefix_then_least_recently_used() -> None:
    prompt = _a(1, 2, 3, 4, 5, 6, 7, 8, 9, 10)
    caches = [SlotCache(0, _a(1, 2, 9), 5.0), SlotCache(1, _a(1, 2, 3, 4, 5, 0), 9.0), SlotCache(2, _a(), 1.0)]
    assert choose_slot(caches, prompt, 0.1, True) == (1, 5)
    # No slot shares more than 60 % of the prompt: the least recently used one, with what it shares.
    assert choose_slot(caches, prompt, 0.6, True) == (2, 0)
    assert choose_slot(caches[:2], prompt, 0.6, True) == (0, 2)
    # similarity 0 (routing off) and cache_prompt false
    assert choose_slot(caches[:2], prompt, 0.0, True) == (0, 2)
    assert choose_slot(caches, prompt, 0.1, False) == (2, 0)
    # the whole prompt cached: its last token is still evaluated, for the first token's logits
    assert choose_slot([SlotCache(0, prompt, 0.0)], prompt, 0.1, True) == (0, 9)


async def _one(engine, req: CompletionRequest):  # type: ignore[no-untyped-def]
    [final] = await run_requests(engine, [req])
    return final


@pytest.mark.anyio
async def test_second_turn_evaluates_only_new_tokens_and_matches_a_fresh_engine() -> None:
    prompt = [3, 9, 4, 17, 5, 8, 2, 11]
    engine = make_engine(ToyBackend(), ToyTokenizer(), spec=SpecParams(types=("test-repeat",)),
                         drafters=[RepeatDrafter()])
    first = await _one(engine, CompletionRequest(list(prompt), n_predict=12, sampling=GREEDY))
    assert first.timings["cache_n"] == 0 and first.timings["prompt_n"] == len(prompt)
    turn2 = prompt + first.tokens + [7, 7, 13]
    second = await _one(engine, CompletionRequest(list(turn2), n_predict=20, sampling=GREEDY))
    # KV holds the prompt and every generated token but the last (never fed back)
    assert second.timings["cache_n"] == len(prompt) + len(first.tokens) - 1
    assert second.timings["prompt_n"] == len(turn2) - second.timings["cache_n"]
    assert second.tokens_evaluated == len(turn2)
    fresh = make_engine(ToyBackend(), ToyTokenizer(), spec=SpecParams(types=("test-repeat",)),
                        drafters=[RepeatDrafter()])
    assert (await _one(fresh, CompletionRequest(list(turn2), n_predict=20, sampling=GREEDY))).tokens == second.tokens
    # the same prompt again: all but its last token reused
    again = await _one(engine, CompletionRequest(list(turn2), n_predict=20, sampling=GREEDY))
    assert again.timings["cache_n"] == len(turn2) - 1 and again.tokens == second.tokens
    off = await _one(engine, CompletionRequest(list(turn2), n_predict=20, sampling=GREEDY, cache_prompt=False))
    assert off.timings["cache_n"] == 0 and off.tokens == second.tokens


@pytest.mark.anyio
async def test_requests_go_to_the_slot_holding_their_prefix() -> None:
    engine = make_engine(ToyBackend(), ToyTokenizer(), n_slots=3)
    a, b = [5, 6, 7, 8, 9, 10, 11, 12], [40, 41, 42, 43, 44, 45, 46, 47]
    await _one(engine, CompletionRequest(a, n_predict=4, sampling=GREEDY, id_slot=2))
    await _one(engine, CompletionRequest(b, n_predict=4, sampling=GREEDY, id_slot=0))
    follow = await _one(engine, CompletionRequest([*a, 1, 2], n_predict=4, sampling=GREEDY))
    assert follow.timings["cache_n"] == len(a)
    assert [s["n_cached"] for s in engine.slots()][2] == len(a) + 2 + 3
    # id_slot forces the slot even when another one holds the prefix
    forced = await _one(engine, CompletionRequest([*b, 3], n_predict=4, sampling=GREEDY, id_slot=1))
    assert forced.timings["cache_n"] == 0
    bad = await _one(engine, CompletionRequest(a, n_predict=4, sampling=GREEDY, id_slot=3))
    assert bad.stop_type == "error" and "id_slot" in (bad.error or "")


@cache
def _tiny(arch: str) -> tuple[str, Tokenizer]:
    if arch.startswith("qwen35"):
        from spekula.fixtures.tiny_qwen35 import tiny_qwen35_gguf_path

        path = str(tiny_qwen35_gguf_path(moe=arch == "qwen35moe"))
    else:
        from spekula.fixtures.tiny_gguf import tiny_model_path

        path = str(tiny_model_path(arch))
    return path, Tokenizer.from_gguf(GGUFFile(path))


def _engine(arch: str, backend: str, types: tuple[str, ...], n_batch: int):  # type: ignore[no-untyped-def]
    path, tok = _tiny(arch)
    b = load_backend(backend, path, BackendOptions(n_ctx=N_CTX, n_seq_max=1, threads=1))
    spec = SpecParams(types=types, drafter_options=dict(SMALL_NGRAMS))
    return make_engine(b, tok, n_slots=1, n_ctx=N_CTX, n_batch=n_batch, spec=spec)


# No shrinking: each example loads models; the raw failing example is report enough.
@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.too_slow],
          phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(arch=st.sampled_from(["llama", "qwen2", "qwen3"]), backend=st.sampled_from(["native", "torch"]),
       tokens=st.lists(st.integers(3, 300), min_size=2, max_size=60), split=st.floats(0.0, 1.0),
       tail=st.lists(st.integers(3, 300), max_size=8), n_predict=st.integers(1, 16),
       types=st.sampled_from([(), ("ngram-simple",), ("ngram-mod", "suffix")]), n_batch=st.sampled_from([7, 64]),
       temperature=st.sampled_from([0.0, 0.9]), seed=st.integers(0, 2**31))
def test_reused_prefix_gives_the_output_of_a_full_prefill(arch, backend, tokens, split, tail, n_predict, types,  # type: ignore[no-untyped-def]
                                                          n_batch, temperature, seed) -> None:
    """Turn 1 runs a prefix of the prompt (plus whatever it generates); turn 2's output on the full
    prompt must equal a fresh engine's, at every split point, chunk size and sampler."""
    import anyio

    k = max(1, int(split * len(tokens)))
    sampling = SamplingParams(temperature=temperature, seed=seed)

    async def go() -> None:
        warm = _engine(arch, backend, types, n_batch)
        first = await _one(warm, CompletionRequest(tokens[:k], n_predict=n_predict, sampling=sampling))
        prompt = tokens + tail
        second = await _one(warm, CompletionRequest(list(prompt), n_predict=n_predict, sampling=sampling))
        cold = _engine(arch, backend, types, n_batch)
        want = await _one(cold, CompletionRequest(list(prompt), n_predict=n_predict, sampling=sampling))
        assert second.tokens == want.tokens
        cached = np.array(tokens[:k] + first.tokens[:-1], np.int32)
        assert second.timings["cache_n"] == min(common_prefix(cached, np.array(prompt, np.int32)), len(prompt) - 1)
        warm.close(), cold.close()

    anyio.run(go)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow],
          phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(arch=st.sampled_from(["qwen35", "qwen35moe"]), backend=st.sampled_from(["native", "torch"]),
       tokens=st.lists(st.integers(3, 300), min_size=2, max_size=60), split=st.floats(0.0, 1.0),
       keep=st.floats(0.0, 1.0), tail=st.lists(st.integers(3, 300), max_size=8), n_predict=st.integers(1, 16),
       types=st.sampled_from([(), ("ngram-simple",), ("ngram-mod", "suffix")]), n_batch=st.sampled_from([7, 64]),
       temperature=st.sampled_from([0.0, 0.9]), seed=st.integers(0, 2**31))
def test_hybrid_second_turn_answers_as_without_the_cache(arch, backend, tokens, split, keep, tail, n_predict,  # type: ignore[no-untyped-def]
                                                         types, n_batch, temperature, seed) -> None:
    """A recurrent target reuses only a prefix it can rebuild (its current length, the prompt's snapshot,
    the last checkpoint's span): turn 2, which keeps part of turn 1's answer, answers as a fresh engine."""
    import anyio

    k = max(1, int(split * len(tokens)))
    sampling = SamplingParams(temperature=temperature, seed=seed)

    async def go() -> None:
        warm = _engine(arch, backend, types, n_batch)
        first = await _one(warm, CompletionRequest(tokens[:k], n_predict=n_predict, sampling=sampling))
        answer = first.tokens[: int(keep * len(first.tokens))]  # a template may re-render the answer differently
        prompt = tokens[:k] + answer + tail + [3]
        second = await _one(warm, CompletionRequest(list(prompt), n_predict=n_predict, sampling=sampling))
        cold = _engine(arch, backend, types, n_batch)
        want = await _one(cold, CompletionRequest(list(prompt), n_predict=n_predict, sampling=sampling))
        assert second.error is None and second.tokens == want.tokens
        cached = np.array(tokens[:k] + first.tokens[:-1], np.int32)
        common = min(common_prefix(cached, np.array(prompt, np.int32)), len(prompt) - 1)
        assert second.timings["cache_n"] <= common
        assert second.timings["cache_n"] >= min(k, common)  # the snapshot at the end of turn 1's prompt
        warm.close(), cold.close()

    anyio.run(go)


@pytest.mark.slow
def test_smollm2_two_turn_chat_reuses_the_first_turn() -> None:
    import anyio
    from model_drafter_helpers import smollm2_or_skip

    path = str(smollm2_or_skip())
    tok = Tokenizer.from_gguf(GGUFFile(path))
    messages = [{"role": "user", "content": "Name three rivers in Europe and one fact about each."}]

    def prompt_of(msgs: list[dict[str, str]]) -> list[int]:
        return tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True), add_special=True)

    def engine():  # type: ignore[no-untyped-def]
        b = load_backend("native", path, BackendOptions(n_ctx=1024, n_seq_max=1, threads=2))
        return make_engine(b, tok, n_ctx=1024, n_batch=256, spec=SpecParams(types=("ngram-simple", "ngram-mod")))

    async def go() -> None:
        warm = engine()
        first = await _one(warm, CompletionRequest(prompt_of(messages), n_predict=48, sampling=GREEDY))
        turn2 = [*messages, {"role": "assistant", "content": first.content},
                 {"role": "user", "content": "Now say which of them is longest."}]
        p2 = prompt_of(turn2)
        second = await _one(warm, CompletionRequest(p2, n_predict=48, sampling=GREEDY))
        want = await _one(engine(), CompletionRequest(p2, n_predict=48, sampling=GREEDY))
        assert second.tokens == want.tokens
        assert second.timings["cache_n"] >= len(prompt_of(messages))
        assert second.timings["prompt_n"] == len(p2) - second.timings["cache_n"]

    anyio.run(go)
