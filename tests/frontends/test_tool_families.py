"""Every template family's replies parsed as llama.cpp's parsers parse them, whole and streamed.

Facts from llama.cpp's tests/test-chat.cpp (build 11434): its canned outputs per template and the messages
its parsers yield (content, reasoning, calls); malformed calls fall back to content, never an error. The
templates are the sdist's models/templates/*.jinja, through which each family is told. Streaming is
checked over every chunking hypothesis draws: the deltas add up to the unstreamed reply."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tool_reply_helpers import added_up, calls_of, format_for, template, tool

from spekula.frontends.schema.chat_reply import (
    Reply,
    ReplyFormat,
    ReplyStream,
    parse_reply,
    template_family,
    with_ids,
)

SPECIAL = tool("special_function", arg1="integer")
WITH_OPT = tool("special_function_with_opt", arg1="integer", arg2="integer")
GET_TIME, GET_WEATHER = tool("get_time", city="string"), tool("get_weather", city="string")
EDIT = tool("edit", oldString="string", newString="string", replaceAll="boolean")
PYTHON = tool("python", code="string")
TOOLS = [SPECIAL, WITH_OPT, GET_TIME, GET_WEATHER, EDIT, PYTHON]

LLAMA31, LLAMA32 = "meta-llama-Llama-3.1-8B-Instruct", "meta-llama-Llama-3.2-3B-Instruct"
NEMO, MINISTRAL = "mistralai-Mistral-Nemo-Instruct-2407", "mistralai-Ministral-3-14B-Reasoning-2512"
DEVSTRAL, GPTOSS = "unsloth-mistral-Devstral-Small-2507", "openai-gpt-oss-120b"
# (llama.cpp's own llama-cpp-deepseek-r1.jinja is checked against llama-server in test_apply_template_recordings.py)
R1_LLAMA, R1_QWEN = "deepseek-ai-DeepSeek-R1-Distill-Llama-8B", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B"
V31, FUNC31, FUNC32 = "deepseek-ai-DeepSeek-V3.1", "meetkai-functionary-medium-v3.1", "meetkai-functionary-medium-v3.2"
GEMMA2 = "google-gemma-2-2b-it"  # knows no tools: the generic form




def _format(name: str, *, tools: list[dict[str, Any]] | None = TOOLS, reasoning: str = "auto",
            thinking: bool = True) -> ReplyFormat:
    return format_for(name, tools, reasoning=reasoning, thinking=thinking)




def test_families_are_told_from_the_template() -> None:
    expected = {LLAMA31: "llama3", LLAMA32: "llama3", "meta-llama-Llama-3.3-70B-Instruct": "llama3",
                NEMO: "mistral_nemo", "Mistral-Small-3.2-24B-Instruct-2506": "mistral_small", DEVSTRAL: "ministral3", MINISTRAL: "ministral3", GPTOSS: "harmony",
                R1_LLAMA: "deepseek_r1", R1_QWEN: "deepseek_r1", V31: "deepseek_v31",
                FUNC31: "functionary_v31", FUNC32: "functionary_v32", "Qwen3.5-4B": "xml",
                "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use": "json", GEMMA2: ""}
    assert {name: template_family(template(name)) for name in expected} == expected
    assert _format(GEMMA2).tool_style == "generic"  # a template that does not render tools


HELLO = "Hello, world!\nWhat's up?"
ONE = [("special_function", {"arg1": 1})]
CASES: list[tuple[str, dict[str, Any], str, str, str, list[tuple[str, Any]]]] = [
    # (template, format options, reply, content, reasoning, calls)
    (LLAMA31, {}, HELLO, HELLO, "", []),
    (LLAMA31, {}, '{"name": "special_function", "parameters": {"arg1": 1}}', "", "", ONE),
    (LLAMA31, {}, '<|python_tag|>{"name": "special_function", "parameters": {"arg1": 1}}', "", "", ONE),
    (LLAMA31, {}, '{"name": "get_time", "parameters": {"city": "Paris"}}; '
                  '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", "",
     [("get_time", {"city": "Paris"}), ("get_weather", {"city": "Paris"})]),
    (LLAMA31, {}, "Let me run it.<|python_tag|>print('hi')", "Let me run it.", "", [("python", {"code": "print('hi')"})]),
    (LLAMA31, {}, '{"name": "unknown", "parameters": {}}', '{"name": "unknown", "parameters": {}}', "", []),
    (LLAMA32, {}, '{"type": "function", "name": "special_function", "parameters": {"arg1": 1}}', "", "", ONE),
    (NEMO, {}, HELLO, HELLO, "", []),
    (NEMO, {}, '[TOOL_CALLS][{"name": "special_function", "arguments": {"arg1": 1}, "id": "123456789"}]', "", "", ONE),
    (NEMO, {}, '[TOOL_CALLS][{"name": "get_time", "arguments": {"city": "Paris"}}, '
               '{"name": "get_weather", "arguments": {"city": "Paris"}}]', "", "",
     [("get_time", {"city": "Paris"}), ("get_weather", {"city": "Paris"})]),
    (NEMO, {}, '[TOOL_CALLS][{"name": "special_function", "arguments": [1]}]',
     '[TOOL_CALLS][{"name": "special_function", "arguments": [1]}]', "", []),
    (DEVSTRAL, {}, '[TOOL_CALLS]special_function[ARGS]{"arg1": 1}', "", "", ONE),
    (MINISTRAL, {"reasoning": "none"}, "[THINK]I'm\nthinking[/THINK]" + HELLO, "[THINK]I'm\nthinking[/THINK]" + HELLO,
     "", []),
    (MINISTRAL, {}, "[THINK]I'm\nthinking[/THINK]" + HELLO, HELLO, "I'm\nthinking", []),
    (MINISTRAL, {}, '[TOOL_CALLS]special_function[ARGS]{"arg1":1}', "", "", ONE),
    (MINISTRAL, {}, "[THINK]I'm\nthinking[/THINK]" '[TOOL_CALLS]special_function[ARGS]{"arg1":1}', "",
     "I'm\nthinking", ONE),
    (MINISTRAL, {}, '[TOOL_CALLS]special_function[ARGS]{"arg1": 1}[TOOL_CALLS]special_function_with_opt[ARGS]'
                    '{"arg1": 1, "arg2": 2}', "", "",
     [("special_function", {"arg1": 1}), ("special_function_with_opt", {"arg1": 1, "arg2": 2})]),
    (MINISTRAL, {}, '[THINK]Let me think about [TOOL_CALLS]special_function[ARGS]{"arg1":1} and more[/THINK]'
                    '[TOOL_CALLS]special_function[ARGS]{"arg1": 1}', "",
     'Let me think about [TOOL_CALLS]special_function[ARGS]{"arg1":1} and more', ONE),
    (GPTOSS, {}, "<|channel|>final<|message|>" + HELLO, HELLO, "", []),
    (GPTOSS, {}, "<|channel|>commentary<|message|>" + HELLO, HELLO, "", []),
    (GPTOSS, {}, "<|channel|>analysis<|message|>I'm\nthinking<|end|><|start|>assistant<|channel|>final<|message|>"
                 + HELLO, HELLO, "I'm\nthinking", []),
    (GPTOSS, {"reasoning": "none"}, "<|channel|>analysis<|message|>I'm\nthinking<|end|><|start|>assistant"
                                    "<|channel|>final<|message|>" + HELLO,
     "<|channel|>analysis<|message|>I'm\nthinking<|end|>" + HELLO, "", []),
    (GPTOSS, {}, ' to=functions.special_function<|channel|>analysis<|message|>{"arg1": 1}', "", "", ONE),
    (GPTOSS, {}, '<|channel|>analysis to=functions.special_function<|message|>{"arg1": 1}', "", "", ONE),
    (GPTOSS, {}, ' to=functions.special_function<|channel|>analysis <|constrain|>json<|message|>{"arg1": 1}', "", "",
     ONE),
    (GPTOSS, {}, "<|channel|>analysis<|message|>I'm\nthinking<|end|><|start|>assistant to=functions.special_function"
                 '<|channel|>analysis<|message|>{"arg1": 1}', "", "I'm\nthinking", ONE),
    (GPTOSS, {}, "<|channel|>analysis<|message|>I will execute python to say hello<|end|><|start|>assistant"
                 "<|channel|>commentary to=python <|constrain|>code<|message|>print(\"hello\")", "",
     "I will execute python to say hello", []),
    (GPTOSS, {}, "<|channel|>commentary to=assistant<|channel|>analysis<|message|>I'm\nthinking<|end|><|start|>"
                 "assistant<|channel|>final<|message|>" + HELLO, HELLO, "I'm\nthinking", []),
    (R1_LLAMA, {}, "</think>" + HELLO, HELLO, "", []),
    (R1_LLAMA, {}, "I'm\nthinking</think>" + HELLO, HELLO, "I'm\nthinking", []),
    (R1_LLAMA, {}, "</think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>special_function\n"
                 "```json\n{\"arg1\": 1}```<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "", "", ONE),
    (R1_QWEN, {"thinking": False}, "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>special_function\n"
                                   "```json\n{\"arg1\": 1}```<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "", "", ONE),
    (V31, {"thinking": False}, "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{\"city\": "
                               "\"XYZCITY\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "", "", [("get_time", {"city": "XYZCITY"})]),
    (V31, {}, "REASONING</think>CONTENT<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{\"city\": "
              "\"Paris\"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": "
              "\"Paris\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "CONTENT", "REASONING",
     [("get_time", {"city": "Paris"}), ("get_weather", {"city": "Paris"})]),
    (V31, {"thinking": False}, "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>nope<｜tool▁sep｜>{}<｜tool▁call▁end｜>"
                               "<｜tool▁calls▁end｜>",
     "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>nope<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "", []),
    (FUNC31, {}, HELLO, HELLO, "", []),
    (FUNC31, {}, '<function=special_function>{"arg1": 1}</function>', "", "", ONE),
    (FUNC31, {}, '<function=special_function>{"arg1": 1}</function><function=get_time>{"city": "Rome"}</function>',
     "", "", [*ONE, ("get_time", {"city": "Rome"})]),
    (FUNC31, {}, '<function=special_function>{"arg1": </function>', '<function=special_function>{"arg1": </function>',
     "", []),
    (FUNC32, {}, "all\n" + HELLO, HELLO, "", []),
    (FUNC32, {}, 'special_function\n{"arg1": 1}', "", "", ONE),
    (FUNC32, {}, 'all\nLet me check.>>>get_time\n{"city": "Oslo"}>>>get_weather\n{"city": "Oslo"}', "Let me check.",
     "", [("get_time", {"city": "Oslo"}), ("get_weather", {"city": "Oslo"})]),
    (GEMMA2, {}, '{"tool_calls": [{"name": "special_function", "arguments": {"arg1": 1}}]}', "", "", ONE),
    (GEMMA2, {}, '{"tool_call": {"name": "special_function", "arguments": {"arg1": 1}}}', "", "", ONE),
    (GEMMA2, {}, '{"response": "Hello, world!\\nWhat\'s up?"}', HELLO, "", []),
    (GEMMA2, {}, "not JSON at all", "not JSON at all", "", []),
    (GEMMA2, {}, '{"response": "caf\\u00e9 \\ud83d\\ude00 \\"quoted\\" \\\\ end"}', 'café 😀 "quoted" \\ end', "", []),
    (GEMMA2, {}, '{"response": "cut off at max_tokens \\u00', "cut off at max_tokens ", "", []),  # the response so far
    (GEMMA2, {}, '{"tool_calls": [{"name": "get_time", "arguments": {"city": "Paris"}}, {"name": "special_function", '
                 '"arguments": {"arg1": 1}}]}', "", "", [("get_time", {"city": "Paris"}), *ONE]),
    (GEMMA2, {}, '{"tool_calls": [{"name": "special_function", "arguments": {"arg1": 1',
     '{"tool_calls": [{"name": "special_function", "arguments": {"arg1": 1', "", []),  # cut off: content
    (GEMMA2, {}, '{"tool_calls": [{"name": "special_function", "arguments": {"arg1": 1}}, {"na', "", "", ONE),
    (GEMMA2, {}, '{"tool_call": {"name": "get_time", "arguments": {"city": "Paris, France', '{"tool_call": {"name": '
                 '"get_time", "arguments": {"city": "Paris, France', "", []),  # never announced: its comma is text
    (GEMMA2, {}, '{"tool_call": {"name": "nope", "arguments": {}}}', '{"tool_call": {"name": "nope", "arguments": {}}}',
     "", []),
    # malformed calls are content, never an error
    (MINISTRAL, {}, "[TOOL_CALLS]nope[ARGS]{}", "[TOOL_CALLS]nope[ARGS]{}", "", []),
    (MINISTRAL, {}, '[TOOL_CALLS]special_function[ARGS]{"arg1": ', '[TOOL_CALLS]special_function[ARGS]{"arg1":', "", []),
    (FUNC32, {}, 'all\nSure.>>>nope\n{"a": 1}', 'Sure.>>>nope\n{"a": 1}', "", []),
    (GPTOSS, {}, '<|channel|>commentary to=functions.special_function<|message|>{"arg1": ', '<|channel|>commentary '
                 'to=functions.special_function<|message|>{"arg1": ', "", []),
    (R1_LLAMA, {}, "</think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>special_function\n"
                   "```json\n{\"arg1\": ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
     "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>special_function\n```json\n{\"arg1\": ```"
     "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "", []),
    (LLAMA31, {}, '<|python_tag|>{"name": "special_function", "parameters": {"arg1": 1}', '<|python_tag|>{"name": '
                  '"special_function", "parameters": {"arg1": 1}', "", []),
]


@pytest.mark.parametrize(("name", "opts", "text", "content", "reasoning", "calls"), CASES)
def test_replies_parse_as_llamacpp_parses_them(name: str, opts: dict[str, Any], text: str, content: str,
                                               reasoning: str, calls: list[tuple[str, Any]]) -> None:
    reply = parse_reply(text, _format(name, **opts))
    assert (reply.content, reply.reasoning, calls_of(reply)) == (content, reasoning, calls)


def test_written_ids_are_kept() -> None:
    text = '[TOOL_CALLS][{"name": "special_function", "arguments": {"arg1": 1}, "id": "123456789"}]'
    assert [c.id for c in with_ids(parse_reply(text, _format(NEMO)), []).tool_calls] == ["123456789"]


def _streamed(fmt: ReplyFormat, text: str, cuts: list[int]) -> tuple[Reply, list[dict[str, Any]], list[str]]:
    stream = ReplyStream(fmt)
    deltas: list[dict[str, Any]] = []
    bounds = [0, *sorted(c % (len(text) + 1) for c in cuts), len(text)]
    for a, b in zip(bounds, bounds[1:], strict=False):
        deltas += stream.feed(text[a:b])
    deltas += stream.feed("", final=text)
    return stream.reply, deltas, stream.ids




@settings(max_examples=25, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=12))
def test_streamed_deltas_add_up_to_the_unstreamed_reply(case: tuple[Any, ...], cuts: list[int]) -> None:
    name, opts, text, *_ = case
    fmt = _format(name, **opts)
    _reply, deltas, ids = _streamed(fmt, text, cuts)
    whole = with_ids(parse_reply(text, fmt), list(ids))
    content, reasoning, calls = added_up(deltas)
    assert (content, reasoning) == (whole.content, whole.reasoning)
    assert calls == [(i, c.id, c.name, c.arguments) for i, c in enumerate(whole.tool_calls)]


def test_arguments_stream_in_pieces_before_the_call_ends() -> None:
    text = '<tool_call>\n{"name": "edit", "arguments": {"replaceAll": false, "oldString": "' + "x" * 50 + '", "newString": "y"}}\n</tool_call>'
    fmt = _format("NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use")
    stream = ReplyStream(fmt)
    pieces = [stream.feed(text[i:i + 5]) for i in range(0, len(text), 5)]
    first = next(i for i, p in enumerate(pieces) if any("tool_calls" in d for d in p))
    names = [d["tool_calls"][0] for p in pieces for d in p if "tool_calls" in d]
    assert names[0]["function"]["name"] == "edit" and "id" in names[0]
    assert len(names) > 5 and all("name" not in c["function"] for c in names[1:])  # fragments after the head
    assert first * 5 < len(text) // 2


def test_the_generic_form_streams_its_response_and_calls_as_they_are_written() -> None:
    fmt = _format(GEMMA2)
    said = "word " * 20
    stream = ReplyStream(fmt)
    text = json.dumps({"response": said})
    pieces = [stream.feed(text[i:i + 4]) for i in range(0, len(text), 4)]
    assert "".join(d["content"] for p in pieces for d in p) == said  # all of it before the stream's end
    assert sum(1 for p in pieces if p) > 10
    stream = ReplyStream(fmt)
    text = '{"tool_call": {"name": "edit", "arguments": {"replaceAll": false, "oldString": "' + "x" * 40 + '"}}}'
    pieces = [stream.feed(text[i:i + 4]) for i in range(0, len(text), 4)]
    calls = [d["tool_calls"][0] for p in pieces for d in p if "tool_calls" in d]
    assert calls[0]["function"]["name"] == "edit" and len(calls) > 5
    assert "".join(c["function"]["arguments"] for c in calls) == text[text.index('{"replaceAll'):-2]


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from([c for c in CASES if c[0] == GEMMA2]), cuts=st.lists(st.integers(0, 400), max_size=20))
def test_generic_deltas_add_up_to_the_unstreamed_reply(case: tuple[Any, ...], cuts: list[int]) -> None:
    test_streamed_deltas_add_up_to_the_unstreamed_reply.hypothesis.inner_test(case, cuts)  # type: ignore[attr-defined]
