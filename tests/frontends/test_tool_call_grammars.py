"""Every family's call grammar (frontends/schema/tool_grammar.py) against its parser: a call the family's
syntax writes is what the grammar admits (forced, and after free text when lazy), the family's parser
reads it back, and arguments outside the tool's schema are refused where they go wrong. A lazy grammar
leaves text without the trigger free. Drafting under a tool grammar changes no token, with every drafter
(the tiny fixture, sampled), as tests/core/test_grammar.py checks for other grammars."""

from __future__ import annotations

import json
from functools import cache
from typing import Any

import anyio
import pytest
from toy_backend import make_engine, run_requests

from spekula.core.backend import BackendOptions, load_backend
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.core.modelfile.grammar_llg import Grammars
from spekula.core.modelfile.tokenizer import Tokenizer
from spekula.core.params import CompletionRequest, SamplingParams, SpecParams
from spekula.frontends.schema.chat_reply import ReplyFormat, parse_reply
from spekula.frontends.schema.tool_grammar import CALL_FORMS, ToolGrammarError, call_grammar, lazy_trigger

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "maximum": 9}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
ARGS, BAD_ARGS = '{"city": "Paris", "days": 3}', '{"city": "Paris", "days": 30}'
XML_ARGS = "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n"

# one call of get_weather as each family writes it (the grammar's own spacing; $A: the arguments)
CALLS = {
    "json": '<tool_call>\n{"name": "get_weather", "arguments": $A}\n</tool_call>',
    "xml": "<tool_call>\n<function=get_weather>\nXML</function>\n</tool_call>",
    "llama3": '{"name": "get_weather", "parameters": $A}',
    "mistral_nemo": '[TOOL_CALLS][{"name": "get_weather", "arguments": $A}]',
    "mistral_small": "[TOOL_CALLS]get_weather[CALL_ID]abcDEF123[ARGS]$A",
    "ministral3": "[TOOL_CALLS]get_weather[ARGS]$A",
    "functionary_v31": "<function=get_weather>$A</function>",
    "functionary_v32": "get_weather\n$A",
    "deepseek_v31": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>$A<｜tool▁call▁end｜>"
                    "<｜tool▁calls▁end｜>",
    "deepseek_r1": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n$A```"
                   "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    "harmony": "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>$A",
    "generic": '{"tool_calls": [{"name": "get_weather", "arguments": $A}]}',
}
PREFIX = {"functionary_v32": ">>>"}  # what a lazy grammar's free text ends with before the call


@cache
def _tiny() -> tuple[str, Tokenizer, Grammars]:
    from spekula.fixtures.tiny_gguf import tiny_model_path

    path = str(tiny_model_path("llama"))
    tok = Tokenizer.from_gguf(GGUFFile(path))
    return path, tok, Grammars(tok)


def _admitted(family: str, text: str, *, lazy: bool) -> tuple[int, int]:
    _path, tok, grammars = _tiny()
    spec = call_grammar(family, TOOLS, tok, name=None, parallel=True, lazy=lazy)
    ids = tok.encode(text, add_special=False, parse_special=True)
    return grammars.new(spec).valid_prefix(ids), len(ids)


def _call(family: str, args: str = ARGS) -> str:
    return CALLS[family].replace("XML", XML_ARGS if args == ARGS else XML_ARGS.replace("3", "30")).replace("$A", args)


def test_every_call_form_has_a_canned_call() -> None:
    assert set(CALLS) == set(CALL_FORMS)


@pytest.mark.parametrize("family", CALL_FORMS)
def test_forced_grammar_admits_the_call_its_parser_reads(family: str) -> None:
    text = _call(family)
    n, total = _admitted(family, text, lazy=False)
    assert n == total, text[:n * 2]
    reply = parse_reply(text, ReplyFormat(family, False, False, (TOOLS[0]["function"],), "", family))
    assert [(c.name, json.loads(c.arguments)) for c in reply.tool_calls] == [("get_weather", json.loads(ARGS))]
    bad = _call(family, BAD_ARGS)
    n_bad, total_bad = _admitted(family, bad, lazy=False)
    assert n_bad < total_bad  # "days": 30 is over the schema's maximum
    assert _admitted(family, "Hello there", lazy=False)[0] == 0 or family == "generic"


@pytest.mark.parametrize("family", [f for f in CALL_FORMS if lazy_trigger(f) and f != "generic"])
def test_lazy_grammar_frees_text_until_the_trigger(family: str) -> None:
    prose = "Let me check the weather for you. "
    assert _admitted(family, prose, lazy=True) == (len(_tiny()[1].encode(prose, add_special=False)),) * 2
    text = prose + PREFIX.get(family, "") + _call(family)
    n, total = _admitted(family, text, lazy=True)
    assert n == total
    n_bad, total_bad = _admitted(family, prose + PREFIX.get(family, "") + _call(family, BAD_ARGS), lazy=True)
    assert n_bad < total_bad


@pytest.mark.parametrize("family", ["llama3", "harmony"])
def test_forms_without_a_trigger_get_no_lazy_grammar(family: str) -> None:
    assert not lazy_trigger(family)
    with pytest.raises(ToolGrammarError):
        call_grammar(family, TOOLS, _tiny()[1], name=None, parallel=True, lazy=True)


def test_xml_string_keywords_not_built_are_named() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"s": {"type": "string", "pattern": "^a+$"}}}}}]
    with pytest.raises(ToolGrammarError, match="pattern"):
        call_grammar("xml", tools, _tiny()[1], name=None, parallel=True, lazy=False)


DRAFTERS = [("ngram-simple",), ("ngram-map-k",), ("ngram-map-k4v",), ("ngram-mod",), ("ngram-cache",), ("suffix",),
            ("draft-simple",), ("ngram-simple", "ngram-mod", "suffix", "draft-simple")]
SMALL_NGRAMS = {"spec-ngram-simple-size-n": 2, "spec-ngram-simple-size-m": 5, "spec-ngram-mod-n-match": 2,
                "spec-ngram-mod-n-min": 1, "spec-ngram-mod-n-max": 5}


@pytest.mark.parametrize(("family", "lazy", "seed"), [("json", True, 1), ("xml", False, 2), ("mistral_nemo", True, 3),
                                                      ("generic", True, 4)])
@pytest.mark.parametrize("types", DRAFTERS, ids="+".join)
def test_drafting_under_a_tool_grammar_changes_nothing(family: str, lazy: bool, seed: int, types: tuple[str, ...]) -> None:
    path, tok, grammars = _tiny()
    grammar = call_grammar(family, TOOLS, tok, name=None, parallel=True, lazy=lazy)
    prompt = tok.encode("call a tool call a tool <tool_call> [TOOL_CALLS]", add_special=True)

    async def run(spec_types: tuple[str, ...]) -> Any:
        backend = load_backend("native", path, BackendOptions(n_ctx=512, n_seq_max=1, threads=1))
        # draft-simple drafts with the same tiny model: good drafts, so the grammar's cut is exercised
        engine = make_engine(backend, tok, n_ctx=512, spec=SpecParams(types=spec_types, drafter_options=dict(SMALL_NGRAMS)),
                             draft_model_path=path)
        [final] = await run_requests(engine, [CompletionRequest(list(prompt), n_predict=80, grammar=grammar,
                                                                sampling=SamplingParams(temperature=0.8, seed=seed))])
        engine.close()
        return final

    plain, drafted = anyio.run(run, ()), anyio.run(run, types)
    assert plain.error is None and drafted.tokens == plain.tokens
    body = [t for t in plain.tokens if not tok.is_eog(t)]
    assert grammars.new(grammar).valid_prefix(body) == len(body)


class _OpenerToken:
    """The tiny fixture's tokenizer with its <|im_start|> control token standing for ``<tool_call>``: a
    vocabulary where the call opener is one special token, as Qwen's is."""

    def __init__(self, tok: Tokenizer) -> None:
        self._tok = tok
        self.opener = tok.encode("<|im_start|>", add_special=False, parse_special=True)[0]

    def encode(self, text: str, **kwargs: Any) -> list[int]:
        return [self.opener] if text == "<tool_call>" else self._tok.encode(text, **kwargs)

    def token_text(self, i: int) -> str:
        return "<tool_call>" if i == self.opener else self._tok.token_text(i)


def test_lazy_grammar_armed_by_a_special_token() -> None:
    _path, tok, grammars = _tiny()
    renamed = _OpenerToken(tok)
    spec = call_grammar("json", TOOLS, renamed, name=None, parallel=True, lazy=True)
    assert f"<[{renamed.opener}]>" in spec.source
    prose = tok.encode("Some <tool_call> text written out, not the token. ", add_special=False)
    call = [renamed.opener, *tok.encode(_call("json")[len("<tool_call>"):], add_special=False)]
    assert grammars.new(spec).valid_prefix(prose) == len(prose)  # the tag as text is free text
    assert grammars.new(spec).valid_prefix(prose + call) == len(prose + call)
    wrong = [renamed.opener, *tok.encode("\n", add_special=False), *tok.encode("not a call", add_special=False)]
    assert grammars.new(spec).valid_prefix(prose + wrong) == len(prose) + 2  # refused right after the opener and its newline
