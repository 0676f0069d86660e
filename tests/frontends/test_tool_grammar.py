"""`tool_choice` "required" / named, forced by a grammar: the reply is well-formed calls whose arguments
validate against each tool's schema, and the tokens are the same with a drafter on as without (the
grammar cuts drafts, losslessly). A tiny random model: whatever it prefers, the grammar decides the form."""

from __future__ import annotations

import json
from functools import cache
from typing import Any

import anyio
import jsonschema
import pytest
from toy_backend import make_engine, run_requests

from spekula.core.backend import BackendOptions, load_backend
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.core.modelfile.tokenizer import Tokenizer
from spekula.core.params import CompletionRequest, SamplingParams, SpecParams
from spekula.frontends.schema.chat_reply import ReplyFormat, parse_reply
from spekula.frontends.schema.tool_grammar import forced_call_grammar

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 9}},
           "required": ["city", "days"], "additionalProperties": False}
NOTE = {"type": "object", "properties": {"urgent": {"type": "boolean"}}, "required": ["urgent"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "note", "parameters": NOTE}}]
SCHEMAS = {"get_weather": WEATHER, "note": NOTE}
# Small n-gram sizes so that the drafter drafts on a short reply (as tests/core/test_grammar.py)
NGRAMS = {"spec-ngram-simple-size-n": 2, "spec-ngram-simple-size-m": 5}


@cache
def _tiny() -> tuple[str, Tokenizer]:
    from spekula.fixtures.tiny_gguf import tiny_model_path

    path = str(tiny_model_path("llama"))
    return path, Tokenizer.from_gguf(GGUFFile(path))


@pytest.mark.parametrize(("name", "parallel", "seed"), [(None, True, 1), (None, False, 2), ("note", True, 3),
                                                        ("get_weather", False, 4)])
def test_forced_calls_validate_and_drafting_changes_nothing(name: str | None, parallel: bool, seed: int) -> None:
    path, tok = _tiny()
    grammar = forced_call_grammar(TOOLS, tok, name=name, parallel=parallel)
    prompt = tok.encode("call a tool call a tool", add_special=True)

    async def run(types: tuple[str, ...]) -> Any:
        backend = load_backend("native", path, BackendOptions(n_ctx=512, n_seq_max=1, threads=1))
        engine = make_engine(backend, tok, n_ctx=512, spec=SpecParams(types=types, drafter_options=dict(NGRAMS)))
        [final] = await run_requests(engine, [CompletionRequest(list(prompt), n_predict=300, grammar=grammar,
                                                                sampling=SamplingParams(temperature=0.8, seed=seed))])
        engine.close()
        return final

    plain, drafted = anyio.run(run, ()), anyio.run(run, ("ngram-simple",))
    assert plain.error is None and drafted.tokens == plain.tokens
    assert drafted.timings.get("draft_n", 0) > 0  # the drafter drafted, and the grammar cut its drafts
    assert plain.stop_type == "eos", plain.content  # the grammar ended the reply after the calls
    reply = parse_reply(plain.content, ReplyFormat("json", False, False, tuple(t["function"] for t in TOOLS)))
    assert reply.tool_calls and reply.content == ""
    assert parallel or len(reply.tool_calls) == 1
    for call in reply.tool_calls:
        assert name is None or call.name == name
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
