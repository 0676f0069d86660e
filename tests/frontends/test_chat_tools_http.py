"""OpenAI chat with tools through the HTTP app: the tools reach the prompt, the reply comes back as
`tool_calls` (ids, finish_reason "tool_calls"), streamed as deltas that add up to the unstreamed answer,
and bad tool fields are 400s naming them. The engine's reply is scripted (a model's canned output, as in
llama.cpp's tests/test-chat.cpp), so the frontend is what is tested."""

from __future__ import annotations

import json
from typing import Any

import pytest
from asgi_helpers import asgi
from scripted_chat import TemplateTokenizer, scripted_app, template

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather of a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}
USER = [{"role": "user", "content": "Weather in Paris and Rome?"}]
CALLS = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')


def _template(name: str) -> str:
    return template(name)


def _app(chat_template: str | None, reply: str, step: int = 5, reasoning_format: str = "auto") -> tuple[Any, TemplateTokenizer]:
    return scripted_app(chat_template, reply, step, reasoning_format)


async def _chat(app: Any, **body: Any) -> tuple[int, Any]:
    status, _, raw = await asgi(app, "POST", "/v1/chat/completions", json.dumps({"messages": USER, **body}).encode())
    if body.get("stream") and status == 200:
        events = [line[6:] for line in raw.decode().split("\n") if line.startswith("data: ")]
        return status, [json.loads(e) for e in events if e != "[DONE]"]
    return status, json.loads(raw)


def _streamed_message(chunks: list[dict[str, Any]]) -> tuple[dict[str, Any], str]:
    """The message the deltas add up to, and the finish reason."""
    content, reasoning, calls, finish = "", "", {}, ""
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            reasoning += delta.get("reasoning_content") or ""
            for call in delta.get("tool_calls", []):
                entry = calls.setdefault(call["index"], {"id": call.get("id"), "type": "function",
                                                         "function": {"name": "", "arguments": ""}})
                entry["function"]["name"] += call["function"].get("name", "")
                entry["function"]["arguments"] += call["function"].get("arguments", "")
            finish = choice["finish_reason"] or finish
    msg: dict[str, Any] = {"role": "assistant", "content": content or None}
    if reasoning:
        msg["reasoning_content"] = reasoning
    if calls:
        msg["tool_calls"] = [calls[i] for i in sorted(calls)]
    return msg, finish


@pytest.mark.anyio
@pytest.mark.parametrize("name", ["NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use", "Qwen-Qwen2.5-7B-Instruct"])
async def test_parallel_calls_streamed_and_not(name: str) -> None:
    app, tok = _app(_template(name), CALLS)
    status, body = await _chat(app, tools=[TOOL])
    assert status == 200, body
    assert "get_weather" in tok.prompts[-1] and "The weather of a city" in tok.prompts[-1]  # tools reach the prompt
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    calls = choice["message"]["tool_calls"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"}, {"city": "Rome"}]
    assert len({c["id"] for c in calls}) == 2 and all(len(c["id"]) == 32 for c in calls)
    status, chunks = await _chat(app, tools=[TOOL], stream=True)
    msg, finish = _streamed_message(chunks)
    assert status == 200 and finish == "tool_calls"
    assert [c["function"] for c in msg["tool_calls"]] == [c["function"] for c in calls]
    status, one = await _chat(app, tools=[TOOL], parallel_tool_calls=False)
    assert len(one["choices"][0]["message"]["tool_calls"]) == 1


@pytest.mark.anyio
async def test_qwen35_reasoning_and_xml_call_streamed_as_unstreamed() -> None:
    reply = ("The user wants weather.\n</think>\n\nChecking.\n\n<tool_call>\n<function=get_weather>\n"
             "<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>")
    app, _ = _app(_template("Qwen3.5-4B"), reply, step=3)
    status, body = await _chat(app, tools=[TOOL])
    message = body["choices"][0]["message"]
    assert status == 200 and message["reasoning_content"] == "The user wants weather." and message["content"] == "Checking."
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    status, chunks = await _chat(app, tools=[TOOL], stream=True)
    streamed, finish = _streamed_message(chunks)
    unstreamed = {**message, "tool_calls": [{**c, "id": streamed["tool_calls"][0]["id"]} for c in message["tool_calls"]]}
    assert finish == "tool_calls" and streamed == unstreamed
    status, none = await _chat(app, tools=[TOOL], reasoning_format="none", tool_choice="none")
    assert none["choices"][0]["message"] == {"role": "assistant", "content": "<think>\n" + reply}
    assert none["choices"][0]["finish_reason"] == "stop"


@pytest.mark.anyio
async def test_server_reasoning_format_is_the_default_a_request_overrides() -> None:
    reply = "<think>Hmm.</think>\n\nHello."
    app, _ = _app(_template("Qwen-Qwen3-0.6B"), reply, reasoning_format="none")  # --reasoning-format none
    status, body = await _chat(app)
    assert status == 200 and body["choices"][0]["message"] == {"role": "assistant", "content": reply}
    status, body = await _chat(app, reasoning_format="deepseek")
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hello.", "reasoning_content": "Hmm."}


@pytest.mark.anyio
async def test_malformed_call_is_content_never_an_error() -> None:
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call>'
    app, _ = _app(_template("NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use"), bad)
    status, body = await _chat(app, tools=[TOOL])
    assert status == 200 and body["choices"][0]["message"] == {"role": "assistant", "content": bad}
    assert body["choices"][0]["finish_reason"] == "stop"
    status, chunks = await _chat(app, tools=[TOOL], stream=True)
    assert status == 200 and _streamed_message(chunks) == ({"role": "assistant", "content": bad}, "stop")


@pytest.mark.anyio
@pytest.mark.parametrize(("fields", "words"), [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "no-such-type"}}}]},
     "'tools[0]' ('f'): 'parameters' is not a valid JSON schema"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope'"),
    ({"tools": [TOOL], "tool_choice": "required", "grammar": "root ::= \"x\""}, "'grammar': cannot specify"),
    ({"tools": [TOOL], "tool_choice": "sometimes"}, "'tool_choice'"),
    ({"tools": [{"type": "retrieval"}]}, "'tools[0]'"),
    ({"tools": [TOOL], "reasoning_format": "loud"}, "'reasoning_format'"),
])  # fmt: skip
async def test_bad_tool_fields_are_400s_naming_them(fields: dict[str, Any], words: str) -> None:
    app, _ = _app(_template("Qwen-Qwen3-0.6B"), "unused")
    status, body = await _chat(app, **fields)
    assert status == 400 and words in body["error"]["message"]


@pytest.mark.anyio
async def test_forced_tool_choice_sets_the_calls_grammar() -> None:
    app, tok = _app(_template("Qwen-Qwen3-0.6B"), CALLS)
    status, body = await _chat(app, tools=[TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}},
                               n=2)
    grammars = [r.grammar for r in tok.requests]
    assert status == 200 and len(grammars) == 2 and grammars[0] == grammars[1]  # every copy is forced
    assert grammars[0].kind == "lark" and '"const": "get_weather"' in grammars[0].source
    assert body["choices"][1]["finish_reason"] == "tool_calls"
    app, tok = _app(_template("Qwen3.5-4B"), CALLS)  # XML calls: their own form is forced
    status, body = await _chat(app, tools=[TOOL], tool_choice="required")
    assert status == 200 and "<function=get_weather>" in tok.requests[-1].grammar.source
    status, body = await _chat(app, tools=[TOOL], tool_choice="auto")  # "auto": lazy, armed by <tool_call>
    assert status == 200 and "%llguidance" in tok.requests[-1].grammar.source


@pytest.mark.anyio
async def test_tools_for_a_template_that_cannot_show_them_take_the_generic_form() -> None:
    reply = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}'
    app, tok = _app(None, reply)  # ChatML: tools told in a system message, the reply one JSON object
    status, body = await _chat(app, tools=[TOOL])
    assert status == 200 and "get_weather" in tok.prompts[-1] and tok.requests[-1].grammar.kind == "json_schema"
    assert body["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    app, _ = _app(None, "unused")
    status, body = await _chat(app, tools=[TOOL], tool_choice="none")
    assert status == 200 and body["choices"][0]["message"]["content"] == "unused"


@pytest.mark.anyio
async def test_a_reasoning_budget_of_zero_asks_for_no_reasoning() -> None:
    app, tok = _app(_template("Qwen-Qwen3-0.6B"), "Hello.")  # a template with the enable_thinking switch
    status, body = await _chat(app, reasoning_budget_tokens=0)
    assert status == 200 and tok.prompts[-1].endswith("<think>\n\n</think>\n\n")
    status, body = await _chat(app, thinking_budget_tokens=-1)
    assert status == 200 and tok.prompts[-1].endswith("<|im_start|>assistant\n")
    app, tok = _app(_template("deepseek-ai-DeepSeek-R1-Distill-Llama-8B"), "Hello.")  # the prompt opens <think>
    status, body = await _chat(app, reasoning_budget_tokens=0)
    assert status == 200 and body["choices"][0]["message"] == {"role": "assistant", "content": "Hello."}
    assert tok.prompts[-1].endswith("<think>\n") and tok.encoded[-1] == tok.prompts[-1] + "</think>"
    status, body = await _chat(app, reasoning_budget_tokens=-2)
    assert status == 400 and "'reasoning_budget_tokens' must be an integer >= -1" in body["error"]["message"]


@pytest.mark.anyio
async def test_a_positive_reasoning_budget_rides_on_every_chat_api() -> None:
    app, tok = _app(_template("Qwen-Qwen3-0.6B"), "Hello.")
    status, _ = await _chat(app, reasoning_budget_tokens=100, reasoning_budget_message="Enough.")
    budget = tok.requests[-1].reasoning_budget
    assert status == 200 and budget.budget == 100 and {"<think>", "</think>", "Enough."} <= set(tok.encoded)
    assert len(budget.forced) == 6  # the message's tokens, then the end tag's (the stand-in gives 3 each)
    status, _ = await _chat(app, thinking_budget_tokens=7)  # the server's message: none
    assert status == 200 and tok.requests[-1].reasoning_budget.budget == 7
    assert len(tok.requests[-1].reasoning_budget.forced) == 3
    anthropic = {"model": "m", "max_tokens": 20, "messages": USER}
    for thinking, expected in (({"type": "enabled", "budget_tokens": 64}, 64), ({"type": "enabled"}, 10000)):
        status, _, _ = await asgi(app, "POST", "/v1/messages", json.dumps({**anthropic, "thinking": thinking}).encode())
        assert status == 200 and tok.requests[-1].reasoning_budget.budget == expected
    status, _, _ = await asgi(app, "POST", "/v1/responses", json.dumps({"input": "Hi", "reasoning_budget_tokens": 9}).encode())
    assert status == 200 and tok.requests[-1].reasoning_budget.budget == 9
    app, tok = _app(None, "Hello.")  # ChatML does not reason: no budget
    status, _ = await _chat(app, reasoning_budget_tokens=100)
    assert status == 200 and tok.requests[-1].reasoning_budget is None


@pytest.mark.anyio
async def test_streamed_calls_arrive_as_openai_fragments() -> None:
    reply = '<tool_call>\n{"name": "get_weather", "arguments": {"unit": "C", "city": "' + "Paris " * 8 + '"}}\n</tool_call>'
    app, _ = _app(_template("NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use"), reply, step=4)
    status, chunks = await _chat(app, tools=[TOOL], stream=True)
    entries = [c for chunk in chunks for choice in chunk["choices"] for c in choice["delta"].get("tool_calls", [])]
    assert status == 200 and entries[0]["function"]["name"] == "get_weather" and entries[0]["id"]
    assert len(entries) > 3 and all(set(e) == {"index", "function"} and set(e["function"]) == {"arguments"}
                                    for e in entries[1:])  # the arguments in pieces, after the call's head
    message, finish = _streamed_message(chunks)
    assert finish == "tool_calls" and json.loads(message["tool_calls"][0]["function"]["arguments"])["unit"] == "C"
