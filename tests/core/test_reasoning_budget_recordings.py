"""spekula's reasoning-budget state machine against llama-server's (tests/reasoning_budget_recording.py):
llama-server's greedy outputs with a budget, replayed token by token, are forced exactly where spekula's
machine forces and with the tokens it forces, and agree with the output without a budget up to the first
forced token. The sequences are tokenized by spekula as llama-server tokenizes them. With
$SPEKULA_LLAMA_SERVER set, the recordings are first checked against a live llama-server."""

from __future__ import annotations

import json
import os
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from reasoning_budget_recording import CASES, RECORDINGS, record

from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.core.modelfile.reasoning_budget import BudgetMachine, ReasoningBudget
from spekula.core.modelfile.tokenizer import Tokenizer

MODEL = Path(os.environ.get("SPEKULA_LLAMA_SERVER_MODEL") or Path.home() / ".cache/spekula/SmolLM2-135M-Instruct.Q4_1.gguf")


@cache
def _recordings() -> dict[str, Any]:
    return dict(json.loads(RECORDINGS.read_text()))


@cache
def _tokenizer() -> Tokenizer:
    if not MODEL.is_file():
        pytest.skip(f"no SmolLM2 model file at {MODEL} (make run fetches it)")
    return Tokenizer.from_gguf(GGUFFile(str(MODEL)))


def _spec(budget: int, start: str, ends: list[str], message: str) -> ReasoningBudget:
    tok = _tokenizer()

    def ids(text: str) -> tuple[int, ...]:
        return tuple(tok.encode(text, add_special=False, parse_special=True))
    end_ids = tuple(ids(e) for e in ends)
    return ReasoningBudget(budget, ids(start), end_ids, (*(ids(message) if message else ()), *end_ids[0]))


def test_every_case_is_recorded() -> None:
    assert sorted(_recordings()) == sorted(c[0] for c in CASES)


@pytest.mark.parametrize(("name", "prompt", "start", "ends", "message", "budgets"), CASES, ids=[c[0] for c in CASES])
def test_forcing_is_where_and_what_llama_server_forces(name: str, prompt: str, start: str, ends: list[str],
                                                       message: str, budgets: list[int]) -> None:
    del prompt  # /completion has no generation prompt: nothing is fed before the first token
    plain = _recordings()[name]["plain"]
    forced_somewhere = False
    for budget in budgets:
        tokens = _recordings()[name]["budgets"][str(budget)]
        machine = BudgetMachine(_spec(budget, start, ends, message), _tokenizer().token_bytes)
        first_forced = None
        for i, t in enumerate(tokens):
            want = machine.forced_next()
            if want is not None:
                assert t == want, (budget, i)
                first_forced = i if first_forced is None else first_forced
            machine.accept(t)
        if first_forced is None:
            assert tokens == plain, budget  # never forced: the output without a budget
            continue
        forced_somewhere = True
        assert tokens[:first_forced] == plain[:first_forced], budget
    assert forced_somewhere, f"{name}: no budget ever forced (the case tests nothing)"


@pytest.mark.skipif(not os.environ.get("SPEKULA_LLAMA_SERVER"), reason="$SPEKULA_LLAMA_SERVER is not set")
def test_recordings_match_a_live_llama_server() -> None:
    if not MODEL.is_file():
        pytest.skip(f"no model file for llama-server at {MODEL}")
    assert record(os.environ["SPEKULA_LLAMA_SERVER"], str(MODEL)) == _recordings()
