"""Chat replies split into content, reasoning and tool calls, per template family, streamed and not.

Facts from llama.cpp's tests/test-chat.cpp (build 11434): its canned outputs for the Qwen3.5,
Hermes 2 Pro and Qwen3-Coder templates and the messages its parsers yield; the templates are the sdist's
models/templates/*.jinja, through which the format is told as llama.cpp tells it."""

from __future__ import annotations

from typing import Any

import pytest
from tool_reply_helpers import added_up, calls_of, format_for, tool

from spekula.frontends.schema.chat_reply import (
    Reply,
    ReplyFormat,
    ReplyStream,
    limited,
    openai_message,
    parse_reply,
    with_ids,
)

QWEN35, HERMES, QWEN3 = "Qwen3.5-4B", "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use", "Qwen-Qwen3-0.6B"
QWEN25, CODER = "Qwen-Qwen2.5-7B-Instruct", "Qwen3-Coder"




SPECIAL = tool("special_function", arg1="integer")
WITH_OPT = tool("special_function_with_opt", arg1="integer", arg2="integer")
EDIT = tool("edit", filename="string", oldString="string", newString="string")
TOOLS = [SPECIAL, WITH_OPT, EDIT]




def _format(name: str, *, tools: list[dict[str, Any]] | None = TOOLS, reasoning: str = "auto",
            thinking: bool = True) -> ReplyFormat:
    return format_for(name, tools, reasoning=reasoning, thinking=thinking)




XML_CALL = "<tool_call>\n<function=special_function>\n<parameter=arg1>\n1\n</parameter>\n</function>\n</tool_call>"
JSON_CALL = '<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}</tool_call>'


def test_families_are_told_from_the_template() -> None:
    assert _format(QWEN35).tool_style == "xml" and _format(CODER).tool_style == "xml"
    assert {_format(n).tool_style for n in (HERMES, QWEN3, QWEN25)} == {"json"}
    assert _format(QWEN35).thinks and _format(QWEN35).starts_in_reasoning  # the prompt opens <think>
    assert _format(QWEN3).thinks and not _format(QWEN3).starts_in_reasoning
    assert not _format(HERMES).thinks and not _format(QWEN25).thinks
    assert _format(QWEN35, tools=None).tool_style is None  # no tools: no calls parsed, as llama-server


def test_qwen35_reasoning_auto_and_none() -> None:
    text = "I'm\nthinking\n</think>\n\nHello, world!\nWhat's up?"
    reply = parse_reply(text, _format(QWEN35))
    assert (reply.reasoning, reply.content, reply.tool_calls) == ("I'm\nthinking", "Hello, world!\nWhat's up?", [])
    none = parse_reply(text, _format(QWEN35, reasoning="none"))
    assert (none.reasoning, none.content) == ("", "<think>\n" + text)


def test_qwen35_calls_plain_after_reasoning_and_parallel() -> None:
    reply = parse_reply(XML_CALL, _format(QWEN35, thinking=False))
    assert calls_of(reply) == [("special_function", {"arg1": 1})] and reply.content == ""
    after = parse_reply("I'm\nthinking\n</think>\n\n" + XML_CALL, _format(QWEN35))
    assert after.reasoning == "I'm\nthinking" and calls_of(after) == [("special_function", {"arg1": 1})]
    two = XML_CALL + "\n<tool_call>\n<function=special_function_with_opt>\n<parameter=arg1>\n1\n</parameter>\n" \
        "<parameter=arg2>\n2\n</parameter>\n</function>\n</tool_call>"
    both = parse_reply(two, _format(QWEN35, thinking=False))
    assert calls_of(both) == [("special_function", {"arg1": 1}), ("special_function_with_opt", {"arg1": 1, "arg2": 2})]
    assert len(limited(both, parallel=False).tool_calls) == 1


def test_qwen35_string_parameters_keep_their_text() -> None:
    text = ("<tool_call>\n<function=edit>\n<parameter=filename>\nfoo.c\n</parameter>\n<parameter=oldString>\n"
            "#iclunde\n</parameter>\n<parameter=newString>\n#include\n\n</parameter>\n</function>\n</tool_call>")
    reply = parse_reply(text, _format(QWEN35, thinking=False))
    assert calls_of(reply) == [("edit", {"filename": "foo.c", "oldString": "#iclunde", "newString": "#include\n"})]


@pytest.mark.parametrize("name", [HERMES, QWEN25, QWEN3])
def test_json_calls_with_and_without_content(name: str) -> None:
    reply = parse_reply(JSON_CALL, _format(name))
    assert calls_of(reply) == [("special_function", {"arg1": 1})] and reply.content == ""
    mixed = parse_reply("Hello, world!\nWhat's up?" + JSON_CALL, _format(name))
    assert mixed.content == "Hello, world!\nWhat's up?" and len(mixed.tool_calls) == 1


def test_qwen3_think_then_json_call() -> None:
    reply = parse_reply("<think>Need the tool.</think>\n\n" + JSON_CALL, _format(QWEN3))
    assert reply.reasoning == "Need the tool." and calls_of(reply) == [("special_function", {"arg1": 1})]


@pytest.mark.parametrize(("name", "text"), [
    (HERMES, '<tool_call>\n{"name": "special_function", "arguments": {"arg1": </tool_call> after'),
    (HERMES, '<tool_call>\n{"name": "no_such_tool", "arguments": {}}</tool_call>'),
    (HERMES, '<tool_call>\n{"name": ["special_function"], "arguments": {}}</tool_call>'),
    (HERMES, '<tool_call>\n["special_function", {}]</tool_call>'),
    (HERMES, '<tool_call>\n{"name": "special_function", "arguments": [1]}</tool_call>'),
    (HERMES, 'Sure.<tool_call>\n{"name": "special_function"'),  # cut off at the token limit
    (QWEN35, "<tool_call>\n<function=special_function>\nnot a parameter\n</function>\n</tool_call>"),
])  # fmt: skip
def test_malformed_calls_are_content(name: str, text: str) -> None:
    reply = parse_reply(text, _format(name, thinking=False))
    assert reply.tool_calls == [] and reply.content == text.strip()


STREAMED = [
    (QWEN35, True, "I'm\nthinking\n</think>\n\nLet me look.\n\n" + XML_CALL + "\n" + XML_CALL),
    (QWEN35, False, "Plain answer with a < sign and <tool_ca text."),
    (QWEN3, True, "<think>\nhmm</think>\n\nText " + JSON_CALL + " between " + JSON_CALL),
    (HERMES, True, 'Sure.<tool_call>\n{"name": "special_function", "arguments": {"arg1": '),
    (HERMES, True, "<tool_call>\n{bad}</tool_call> and more"),
    (QWEN3, True, "<think>unclosed reasoning <"),
]


@pytest.mark.parametrize(("name", "thinking", "text"), STREAMED)
@pytest.mark.parametrize("step", [1, 3, 7])
def test_streamed_deltas_add_up_to_the_whole_reply(name: str, thinking: bool, text: str, step: int) -> None:
    fmt = _format(name, thinking=thinking)
    stream = ReplyStream(fmt)
    deltas: list[dict[str, Any]] = []
    for i in range(0, len(text), step):
        deltas += stream.feed(text[i:i + step])
    deltas += stream.feed("", final=text)
    whole = with_ids(parse_reply(text, fmt), list(stream.ids))
    content, reasoning, sent = added_up(deltas)
    assert content == whole.content and reasoning == whole.reasoning
    if len(sent) == len(whole.tool_calls) + 1:  # a reply cut off inside a call: its head was sent, and the
        assert sent[-1][2] in whole.content  # unstreamed reply has the unfinished call in the content
        sent.pop()
    assert sent == [(i, c.id, c.name, c.arguments) for i, c in enumerate(whole.tool_calls)]


def test_openai_message_form() -> None:
    reply = with_ids(parse_reply(JSON_CALL, _format(HERMES)), [])
    msg = openai_message(reply)
    assert msg["content"] is None and msg["tool_calls"][0]["function"]["name"] == "special_function"
    assert len(msg["tool_calls"][0]["id"]) == 32 and "reasoning_content" not in msg
    assert openai_message(Reply(content="hi"))["content"] == "hi"


_PIECES = ["<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_", "</thi", "\n", " ", "x", "{", "}",
           '"name": "special_function"', '"arguments": {"arg1": 1}', ", ", "<function=special_function>",
           "<parameter=arg1>", "</parameter>", "</function>", "<"]


@pytest.mark.parametrize("name", [QWEN35, QWEN3, HERMES])
def test_any_reply_parses_without_error_and_streams_as_a_whole(name: str) -> None:
    from hypothesis import given, settings
    from hypothesis import strategies as st

    fmt = _format(name)

    @settings(max_examples=150, deadline=None)
    @given(parts=st.lists(st.sampled_from(_PIECES), max_size=30), step=st.integers(1, 9))
    def check(parts: list[str], step: int) -> None:
        text = "".join(parts)
        stream = ReplyStream(fmt)
        deltas = [d for i in range(0, len(text), step) for d in stream.feed(text[i:i + step])]
        deltas += stream.feed("", final=text)
        whole = parse_reply(text, fmt)
        assert "".join(d.get("content", "") for d in deltas) == whole.content
        assert "".join(d.get("reasoning_content", "") for d in deltas) == whole.reasoning
        assert [d["tool_calls"][0]["function"]["arguments"] for d in deltas if "tool_calls" in d] == \
            [c.arguments for c in whole.tool_calls]

    check()
