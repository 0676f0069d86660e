"""A positive reasoning budget (core/modelfile/reasoning_budget.py): llama.cpp's state machine, token by
token, and under speculation exactly the output of plain decoding, with every drafter, greedy and seeded
sampling with every sampler, alone and beside a grammar."""

from __future__ import annotations

from functools import cache

import anyio
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from toy_backend import (
    GarbageDrafter,
    OracleDrafter,
    RepeatDrafter,
    ToyBackend,
    ToyTokenizer,
    make_engine,
    run_requests,
)

from spekula.core.backend import BackendOptions, load_backend
from spekula.core.modelfile.constraint import GrammarSpec
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.core.modelfile.grammar_llg import Grammars
from spekula.core.modelfile.reasoning_budget import (
    BudgetMachine,
    BudgetState,
    JointConstraint,
    ReasoningBudget,
    ReasoningBudgetConstraint,
    utf8_complete,
)
from spekula.core.modelfile.tokenizer import Tokenizer
from spekula.core.params import CompletionRequest, SamplingParams, SpecParams

EOS = 47
START, END, ALT_END = (5,), (32,), (33, 34)
MESSAGE = (30, 31)


def _spec(budget: int) -> ReasoningBudget:
    return ReasoningBudget(budget, START, (END, ALT_END), (*MESSAGE, *END))


def _ascii(_t: int) -> bytes:
    return b"x"


def _machine(budget: int, tokens: list[int], piece=_ascii) -> BudgetMachine:  # type: ignore[no-untyped-def]
    m = BudgetMachine(_spec(budget), piece)
    for t in tokens:
        m.accept(t)
    return m


def test_counts_inside_the_block_then_forces_message_and_end() -> None:
    assert _machine(3, [1, 2]).state is BudgetState.IDLE  # nothing counts before the start
    m = _machine(3, [1, 5, 9, 9])
    assert (m.state, m.remaining, m.forced_next()) == (BudgetState.COUNTING, 1, None)
    m.accept(9)
    assert m.state is BudgetState.FORCING and m.forced_next() == 30
    for t in (30, 31, 32):
        assert m.forced_next() == t
        m.accept(t)
    assert m.state is BudgetState.DONE and m.forced_next() is None
    m.accept(5)  # a new block: a fresh budget
    assert (m.state, m.remaining) == (BudgetState.COUNTING, 3)


def test_a_natural_end_stops_counting_longest_end_matched() -> None:
    assert _machine(5, [5, 1, 33, 34]).state is BudgetState.DONE
    assert _machine(5, [5, 1, 33]).state is BudgetState.COUNTING
    assert _machine(5, [5, 1, 32]).state is BudgetState.DONE
    assert _machine(0, [5]).state is BudgetState.FORCING  # budget 0 forces at once


def test_a_split_character_finishes_before_forcing() -> None:
    pieces = {7: b"\xe6", 8: b"\x97", 9: b"\xa5", 10: b"ok"}
    m = _machine(2, [5, 10, 7], pieces.get)  # type: ignore[arg-type]
    assert m.state is BudgetState.WAITING_UTF8 and m.forced_next() is None
    m.accept(8)
    m.accept(9)  # each token's own piece is read, as llama.cpp reads it: a lone continuation byte is not whole
    assert m.state is BudgetState.WAITING_UTF8
    m.accept(10)
    assert m.state is BudgetState.FORCING
    assert utf8_complete(b"") and utf8_complete("é".encode()) and not utf8_complete(b"\xc3")
    assert not utf8_complete(b"\x97\x97\x97\x97") and utf8_complete("日".encode())


def test_the_prompt_reasoning_left_open_counts() -> None:
    c = ReasoningBudgetConstraint(_spec(3), _ascii, [1, 5, 2, 32, 5, 9])  # the last block is open, one token in
    assert (c.machine.state, c.machine.remaining) == (BudgetState.COUNTING, 2)
    closed = ReasoningBudgetConstraint(_spec(3), _ascii, [1, 5, 2, 32, 9])
    assert closed.machine.state is BudgetState.DONE


def test_drafts_are_cut_where_the_forcing_differs_and_rows_are_forced() -> None:
    c = ReasoningBudgetConstraint(_spec(2), _ascii, [5])
    assert c.valid_prefix([1, 2, 30, 31, 32, 4]) == 6
    assert c.valid_prefix([1, 2, 30, 9]) == 3
    logits = np.zeros((5, 48), np.float32)
    c.mask_logits(logits, [1, 2, 30, 9])
    assert np.isfinite(logits[:2]).all()
    assert [int(np.flatnonzero(np.isfinite(r))[0]) for r in logits[2:]] == [30, 31, 31]
    assert all(np.isfinite(r).sum() == 1 for r in logits[2:])
    c.advance([1, 2, 30])
    assert c.machine.forced_next() == 31


def test_beside_a_grammar_the_forbidden_forcing_yields() -> None:
    tok = ToyTokenizer(48, eog_ids=frozenset({EOS}))
    # the grammar allows only "ab..." (tokens 0 and 1): the message (30, 31) cannot come
    grammar = Grammars(tok).new(GrammarSpec("gbnf", 'root ::= ("a" | "b")+'))
    joint = JointConstraint(ReasoningBudgetConstraint(_spec(1), _ascii, [5]), grammar)
    assert joint.valid_prefix([0, 1, 0]) == 3  # forcing 30 is forbidden: the grammar's token stands
    joint.advance([0, 1])
    assert joint.budget.machine.state is BudgetState.DONE


# -- lossless: the toy model, every kind of drafter, samplers, grammars ---------------------------

SAMPLERS = {"plain": {}, "top_k": {"top_k": 5}, "penalties": {"repeat_penalty": 1.3, "presence_penalty": 0.5},
            "dry": {"dry_multiplier": 0.8, "dry_allowed_length": 2, "dry_sequence_breakers": (" ",)},
            "mirostat2": {"mirostat": 2, "mirostat_tau": 3.0, "mirostat_eta": 0.2},
            "xtc": {"xtc_probability": 0.6, "xtc_threshold": 0.05}}
GRAMMARS = [None, 'root ::= [a-zA-Z0-9 .,!?]*', 'root ::= ("a" | "e" | "f" | "E" | "F" | "G" | "H")*']
PROMPT = [3, 9, 4, 17, 0, 1, 0, 1, 5]  # ends inside an open block


def _toy_run(types: tuple[str, ...], drafters: list, req: CompletionRequest):  # type: ignore[no-untyped-def]
    engine = make_engine(ToyBackend(), ToyTokenizer(48, eog_ids=frozenset({EOS})),
                         spec=SpecParams(types=types, adaptive=False), drafters=drafters)
    [final] = anyio.run(run_requests, engine, [req])
    assert final.error is None, final.error
    return final


def _follows_budget(tokens: list[int], budget: int) -> bool:
    """The first block (open at the prompt's end) ends by itself within the budget, or is forced after it."""
    body = tokens[:budget]
    for i in range(len(body)):
        if tuple(body[: i + 1][-1:]) == END or tuple(body[: i + 1][-2:]) == ALT_END:
            return True
    forced = tokens[budget:budget + 3]
    return forced == [*MESSAGE, *END][: len(forced)]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(budget=st.integers(1, 12), n=st.integers(4, 30), temperature=st.sampled_from([0.0, 0.9]),
       seed=st.integers(0, 2**31), sampler=st.sampled_from(sorted(SAMPLERS)), grammar=st.sampled_from(GRAMMARS),
       which=st.sampled_from(["repeat", "garbage", "oracle", "all"]))
def test_toy_output_with_a_budget_is_the_same_with_every_drafter(budget: int, n: int, temperature: float, seed: int,
                                                                 sampler: str, grammar: str | None, which: str) -> None:
    sampling = SamplingParams(temperature=temperature, seed=seed, **SAMPLERS[sampler])  # type: ignore[arg-type]

    def request() -> CompletionRequest:
        return CompletionRequest(list(PROMPT), n_predict=n, sampling=sampling, reasoning_budget=_spec(budget),
                                 grammar=None if grammar is None else GrammarSpec("gbnf", grammar))

    plain = _toy_run((), [], request())
    if grammar is None:
        assert _follows_budget(plain.tokens, budget), plain.tokens
    drafters = {"repeat": [RepeatDrafter()], "garbage": [GarbageDrafter(48)],
                "oracle": [OracleDrafter([PROMPT + plain.tokens], 48, seed=seed)],
                "all": [OracleDrafter([PROMPT + plain.tokens], 48, seed=seed), RepeatDrafter(), GarbageDrafter(48)]}[which]
    drafted = _toy_run(tuple(d.name for d in drafters), drafters, request())
    assert drafted.tokens == plain.tokens and drafted.stop_type == plain.stop_type


def test_the_oracle_drafts_the_forced_tokens_and_they_are_accepted() -> None:
    def request() -> CompletionRequest:
        return CompletionRequest(list(PROMPT), n_predict=12, sampling=SamplingParams(temperature=0.0),
                                 reasoning_budget=_spec(3))

    plain = _toy_run((), [], request())
    assert plain.tokens[3:6] == [30, 31, 32]
    oracle = OracleDrafter([PROMPT + plain.tokens], 48)
    drafted = _toy_run((oracle.name,), [oracle], request())
    assert drafted.tokens == plain.tokens


# -- lossless on a real model (the tiny GGUF) with the shipped drafters ----------------------------

SMALL_NGRAMS = {"spec-ngram-simple-size-n": 2, "spec-ngram-simple-size-m": 5, "spec-ngram-mod-n-match": 2,
                "spec-ngram-mod-n-min": 1, "spec-ngram-mod-n-max": 5}


@cache
def _tiny() -> tuple[str, Tokenizer]:
    from spekula.fixtures.tiny_gguf import tiny_model_path

    path = str(tiny_model_path("llama"))
    return path, Tokenizer.from_gguf(GGUFFile(path))


def _tiny_budget(tok: Tokenizer, budget: int) -> ReasoningBudget:
    def ids(text: str) -> tuple[int, ...]:
        return tuple(tok.encode(text, add_special=False, parse_special=True))
    return ReasoningBudget(budget, ids(" abc"), (ids(" xyz"),), ids(" stop now xyz"))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow],
          phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(budget=st.integers(1, 10), temperature=st.sampled_from([0.0, 0.8]), seed=st.integers(0, 2**31),
       types=st.sampled_from([("ngram-simple",), ("ngram-mod",), ("suffix",), ("draft-simple",),
                              ("ngram-map-k", "ngram-cache", "draft-simple")]),
       probabilistic=st.booleans())
def test_tiny_model_output_with_a_budget_is_the_same_with_every_drafter(budget: int, temperature: float, seed: int,
                                                                        types: tuple[str, ...],
                                                                        probabilistic: bool) -> None:
    path, tok = _tiny()
    spec = _tiny_budget(tok, budget)
    prompt = tok.encode("abc abc abc stop now xyz abc", add_special=True)
    sampling = SamplingParams(temperature=temperature, seed=seed)

    def run(spec_types: tuple[str, ...]) -> list[int]:
        async def go() -> list[int]:
            b = load_backend("native", path, BackendOptions(n_ctx=160, n_seq_max=1, threads=1))
            engine = make_engine(b, tok, n_ctx=160, spec=SpecParams(
                types=spec_types, drafter_options=dict(SMALL_NGRAMS),
                draft_sampling="probabilistic" if probabilistic and spec_types else "greedy"),
                draft_model_path=path)
            [final] = await run_requests(engine, [CompletionRequest(list(prompt), n_predict=40, sampling=sampling,
                                                                    reasoning_budget=spec)])
            assert final.error is None, final.error
            engine.close()
            return final.tokens
        return anyio.run(go)

    plain = run(())
    forced = list(spec.forced)
    # the prompt's last " abc" opens a block: unless " xyz" comes by itself, the forcing follows the budget
    # (after the budget, forcing waits for a token whose piece does not end inside a character)
    at = next((i + 1 for i in range(budget - 1, len(plain)) if utf8_complete(tok.token_bytes(plain[i]))), len(plain))
    natural = any(plain[i:i + len(spec.ends[0])] == list(spec.ends[0]) for i in range(at))
    assert natural or plain[at:at + len(forced)] == forced[: len(plain) - at]
    if probabilistic and temperature > 0:
        return  # rejection sampling: the same distribution, not the same tokens
    assert run(types) == plain


@pytest.mark.parametrize("bad", [-1])
def test_a_budget_needs_its_sequences(bad: int) -> None:
    with pytest.raises(ValueError):
        ReasoningBudget(bad, START, (END,), END)
    with pytest.raises(ValueError):
        ReasoningBudget(1, (), (END,), END)
