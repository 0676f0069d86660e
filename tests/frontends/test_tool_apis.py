"""Tools and reasoning over Anthropic's Messages API and OpenAI's Responses API: the reply split into
thinking / text / tool_use blocks and reasoning / message / function_call items, streamed block by block
and item by item so that the stream adds up to the unstreamed answer; tool_choice forced through the
grammar as chat's is; bad tool fields are 400s naming them over every chat-shaped API, and a reply that
is not a well-formed call is content. The engine's reply is scripted (tests/scripted_chat.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from scripted_chat import post, scripted_app, template

QWEN3 = "Qwen-Qwen3-0.6B"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
REPLY = ("<think>\nTwo cities, two calls.\n</think>\n\nChecking both.\n"
         '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')
USER = "Weather in Paris and Rome?"
ANTHROPIC_TOOL = {"name": "get_weather", "description": "The weather of a city", "input_schema": SCHEMA}
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "description": "The weather of a city",
                  "parameters": SCHEMA}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}


def _anthropic(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": USER}],
            "tools": [ANTHROPIC_TOOL], **extra}


def _responses(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "input": USER, "tools": [RESPONSES_TOOL], **extra}


def _blocks_of_stream(events: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
    """The content blocks an Anthropic stream adds up to (checking that one block is open at a time)."""
    blocks: list[dict[str, Any]] = []
    partial: dict[int, str] = {}
    open_at, stop = None, ""
    for e in events:
        kind = e["type"]
        if kind == "content_block_start":
            assert open_at is None and e["index"] == len(blocks), e
            blocks.append(dict(e["content_block"]))
            open_at = e["index"]
        elif kind == "content_block_delta":
            assert e["index"] == open_at, e
            block, delta = blocks[open_at], e["delta"]
            if delta["type"] == "input_json_delta":
                partial[open_at] = partial.get(open_at, "") + delta["partial_json"]
            elif delta["type"] == "signature_delta":
                block["signature"] = delta["signature"]
            else:
                field = {"text_delta": "text", "thinking_delta": "thinking"}[delta["type"]]
                block[field] += delta[field]
        elif kind == "content_block_stop":
            assert e["index"] == open_at, e
            if blocks[open_at]["type"] == "tool_use":
                blocks[open_at]["input"] = json.loads(partial.get(open_at, "{}"))
            open_at = None
        elif kind == "message_delta":
            stop = e["delta"]["stop_reason"]
    assert open_at is None and events[0]["type"] == "message_start" and events[-1]["type"] == "message_stop"
    return blocks, stop


def _items_of_stream(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The output items a Responses stream adds up to (checking the event order and the numbering)."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    items: list[dict[str, Any]] = []
    text, done = "", []
    for e in events:
        kind = e["type"]
        if kind == "response.output_item.added":
            assert e["output_index"] == len(items) == len(done)
            items.append(e["item"])
            text = ""
        elif kind.endswith(".delta"):
            assert e["output_index"] == len(items) - 1 and e["item_id"] == items[-1]["id"]
            text += e["delta"]
        elif kind == "response.function_call_arguments.done":
            assert e["arguments"] == text and e["name"] == items[-1]["name"]
        elif kind in ("response.output_text.done", "response.reasoning_text.done"):
            assert e["text"] == text
        elif kind == "response.output_item.done":
            assert e["output_index"] == len(done) == len(items) - 1
            item = e["item"]
            got = item["arguments"] if item["type"] == "function_call" else item["content"][0]["text"]
            assert got == text and item["status"] == "completed"
            done.append(item)
    assert events[-1]["type"] == "response.completed" and events[-1]["response"]["output"] == done
    return done


def _without_ids(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items]


@pytest.mark.anyio
async def test_anthropic_reply_is_thinking_text_and_tool_use_blocks_streamed_as_unstreamed() -> None:
    app, tok = scripted_app(template(QWEN3), REPLY)
    status, body = await post(app, "/v1/messages", _anthropic())
    assert status == 200, body
    assert "get_weather" in tok.prompts[-1] and "The weather of a city" in tok.prompts[-1]
    assert body["stop_reason"] == "tool_use"
    blocks = body["content"]
    assert blocks[:2] == [{"type": "thinking", "thinking": "Two cities, two calls.", "signature": ""},
                          {"type": "text", "text": "Checking both."}]
    assert [(b["type"], b["name"], b["input"]) for b in blocks[2:]] == [
        ("tool_use", "get_weather", {"city": "Paris"}), ("tool_use", "get_weather", {"city": "Rome"})]
    assert len({b["id"] for b in blocks[2:]}) == 2
    status, events = await post(app, "/v1/messages", _anthropic(stream=True))
    streamed, stop = _blocks_of_stream(events)
    assert status == 200 and stop == "tool_use"
    assert streamed[:2] == blocks[:2] and [{**b, "id": ""} for b in streamed[2:]] == [{**b, "id": ""} for b in blocks[2:]]


@pytest.mark.anyio
@pytest.mark.parametrize(("choice", "forced_name", "calls"), [
    ({"type": "any"}, None, 2),
    ({"type": "tool", "name": "get_weather"}, "get_weather", 2),
    ({"type": "any", "disable_parallel_tool_use": True}, None, 1),
    ({"type": "auto"}, "-", 2),
])  # fmt: skip
async def test_anthropic_tool_choice_forces_calls_as_chat_does(choice: dict[str, Any], forced_name: str | None,
                                                               calls: int) -> None:
    app, tok = scripted_app(template(QWEN3), REPLY)
    status, body = await post(app, "/v1/messages", _anthropic(tool_choice=choice))
    assert status == 200, body
    grammar = tok.requests[-1].grammar
    if forced_name == "-":  # "auto": a lazy grammar, free text until <tool_call>
        assert grammar.kind == "lark" and "%llguidance" in grammar.source and "trig[lazy]" in grammar.source
    else:
        assert grammar.kind == "lark" and "<tool_call>" in grammar.source
        assert forced_name is None or f'"const": "{forced_name}"' in grammar.source
    assert sum(b["type"] == "tool_use" for b in body["content"]) == calls


@pytest.mark.anyio
async def test_anthropic_tool_choice_none_leaves_the_reply_as_text() -> None:
    app, _ = scripted_app(template(QWEN3), REPLY)
    status, body = await post(app, "/v1/messages", _anthropic(tool_choice={"type": "none"}))
    assert status == 200 and body["stop_reason"] == "end_turn"
    assert [b["type"] for b in body["content"]] == ["thinking", "text"] and "<tool_call>" in body["content"][1]["text"]


@pytest.mark.anyio
async def test_responses_reply_is_reasoning_message_and_function_call_items_streamed_as_unstreamed() -> None:
    app, tok = scripted_app(template(QWEN3), REPLY)
    status, body = await post(app, "/v1/responses", _responses())
    assert status == 200, body
    assert "The weather of a city" in tok.prompts[-1]
    items = body["output"]
    assert [i["type"] for i in items] == ["reasoning", "message", "function_call", "function_call"]
    assert items[0]["content"] == [{"type": "reasoning_text", "text": "Two cities, two calls."}]
    assert items[1]["content"][0]["text"] == "Checking both."
    assert [(i["name"], json.loads(i["arguments"])) for i in items[2:]] == [("get_weather", {"city": "Paris"}),
                                                                          ("get_weather", {"city": "Rome"})]
    assert all(i["call_id"].startswith("call_") and i["id"].startswith("fc_") for i in items[2:])
    status, events = await post(app, "/v1/responses", _responses(stream=True))
    assert status == 200 and _without_ids(_items_of_stream(events)) == _without_ids(items)


@pytest.mark.anyio
async def test_responses_output_items_sent_back_reach_the_template() -> None:
    app, tok = scripted_app(template(QWEN3), REPLY)
    _, body = await post(app, "/v1/responses", _responses())
    call = body["output"][2]
    follow_up = [{"role": "user", "content": USER}, *body["output"],
                 {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny, 21 C"}]
    status, _ = await post(app, "/v1/responses", _responses(input=follow_up, tool_choice="none"))
    prompt = tok.prompts[-1]
    assert status == 200 and '"city": "Paris"' in prompt and "sunny, 21 C" in prompt
    assert prompt.index('"city": "Paris"') < prompt.index("sunny, 21 C")


@pytest.mark.anyio
@pytest.mark.parametrize(("choice", "forced_name", "calls"), [
    ("required", None, 2), ({"type": "function", "name": "get_weather"}, "get_weather", 2), ("auto", "-", 2),
])  # fmt: skip
async def test_responses_tool_choice_forces_calls_as_chat_does(choice: Any, forced_name: str | None, calls: int) -> None:
    app, tok = scripted_app(template(QWEN3), REPLY)
    status, body = await post(app, "/v1/responses", _responses(tool_choice=choice))
    assert status == 200, body
    grammar = tok.requests[-1].grammar
    assert ("trig[lazy]" in grammar.source) == (forced_name == "-")  # "auto": lazy, free text until <tool_call>
    assert forced_name in (None, "-") or f'"const": "{forced_name}"' in grammar.source
    assert sum(i["type"] == "function_call" for i in body["output"]) == calls
    status, body = await post(app, "/v1/responses", _responses(parallel_tool_calls=False))
    assert sum(i["type"] == "function_call" for i in body["output"]) == 1


# -- bad input, over every chat-shaped API -----------------------------------------------------------

BAD_SCHEMA = {"type": "no-such-type"}


def _body(api: str, *, schema: dict[str, Any] = SCHEMA, choice: str | None = None, stream: bool = False) -> dict[str, Any]:
    """A request to `api` with the tool get_weather(schema); `choice`: a tool name to force."""
    if api == "chat":
        body: dict[str, Any] = {"messages": [{"role": "user", "content": USER}],
                                "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": schema}}]}
        if choice:
            body["tool_choice"] = {"type": "function", "function": {"name": choice}}
    elif api == "anthropic":
        body = _anthropic(tools=[{**ANTHROPIC_TOOL, "input_schema": schema}])
        if choice:
            body["tool_choice"] = {"type": "tool", "name": choice}
    else:
        body = _responses(tools=[{**RESPONSES_TOOL, "parameters": schema}])
        if choice:
            body["tool_choice"] = {"type": "function", "name": choice}
    return {**body, "stream": stream}


PATHS = {"chat": "/v1/chat/completions", "anthropic": "/v1/messages", "responses": "/v1/responses"}


def _text_of(api: str, body: Any, stream: bool) -> str:
    """All the text of an answer (a stream's deltas joined), and no call in it."""
    if api == "chat":
        if stream:
            assert not any(c["choices"] and c["choices"][0]["delta"].get("tool_calls") for c in body)
            return "".join(c["choices"][0]["delta"].get("content") or "" for c in body if c["choices"])
        assert "tool_calls" not in body["choices"][0]["message"]
        return str(body["choices"][0]["message"]["content"])
    if api == "anthropic":
        blocks, stop = _blocks_of_stream(body) if stream else (body["content"], body["stop_reason"])
        assert stop == "end_turn" and [b["type"] for b in blocks] == ["text"]
        return str(blocks[0]["text"])
    items = _items_of_stream(body) if stream else body["output"]
    assert [i["type"] for i in items] == ["message"]
    return str(items[0]["content"][0]["text"])


@pytest.mark.anyio
@pytest.mark.parametrize("api", ["chat", "anthropic", "responses"])
async def test_bad_tool_fields_are_400s_naming_them(api: str) -> None:
    app, tok = scripted_app(template(QWEN3), REPLY)
    status, body = await post(app, PATHS[api], _body(api, schema=BAD_SCHEMA))
    field = "input_schema" if api == "anthropic" else "parameters"
    assert status == 400 and f"'tools[0]' ('get_weather'): '{field}' is not a valid JSON schema" in body["error"]["message"]
    status, body = await post(app, PATHS[api], _body(api, choice="nope"))
    assert status == 400 and "'nope'" in body["error"]["message"] and "not in 'tools'" in body["error"]["message"]
    assert not tok.requests  # neither reached the engine


@pytest.mark.anyio
@pytest.mark.parametrize("api", ["chat", "anthropic", "responses"])
@pytest.mark.parametrize("stream", [False, True])
async def test_a_reply_that_is_not_a_well_formed_call_is_content(api: str, stream: bool) -> None:
    bad = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call> and more'
    app, _ = scripted_app(template(QWEN3), bad)
    status, body = await post(app, PATHS[api], _body(api, stream=stream))
    assert status == 200 and _text_of(api, body, stream) == bad


def test_forced_call_arguments_carry_only_the_declared_parameters() -> None:
    """As llama.cpp reads a tool's schema: an object that lists its properties and says nothing of others is
    closed (agent frameworks refuse a call with an undeclared argument); one that allows them stays open."""
    from spekula.frontends.schema.tool_grammar import forced_call_grammar

    params = {"type": "object", "properties": {"where": {"type": "object", "properties": {"city": {"type": "string"}}},
                                               "properties": {"type": "string", "enum": [{"properties": 1}]},
                                               "extra": {"type": "object", "additionalProperties": True,
                                                         "properties": {"a": {"type": "string"}}}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": params}}]
    grammar = forced_call_grammar(tools, None, name=None, parallel=False).source
    rule = grammar.split("fn0: ", 1)[1].splitlines()[0]
    schema = json.JSONDecoder().raw_decode(rule[rule.index("%json ") + len("%json "):])[0]["properties"]["arguments"]
    assert schema["additionalProperties"] is False
    assert schema["properties"]["where"]["additionalProperties"] is False
    assert schema["properties"]["properties"] == params["properties"]["properties"]  # a property's data untouched
    assert schema["properties"]["extra"]["additionalProperties"] is True
    assert "additionalProperties" not in params  # the request's own schema is not changed


class _FragmentStyle:
    """ReplyStream's deltas rewritten in OpenAI's fragment style (a call's index, id and name first, then its
    arguments three characters at a time): what the adapter must read as well as whole-call deltas."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    @property
    def reply(self) -> Any:
        return self.stream.reply

    def feed(self, piece: str, *, final: str | None = None) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for delta in self.stream.feed(piece, final=final):
            if "tool_calls" not in delta:
                out.append(delta)
                continue
            for call in delta["tool_calls"]:
                fn, i = call["function"], call["index"]
                out.append({"tool_calls": [{**call, "function": {"name": fn["name"], "arguments": ""}}]})
                out += [{"tool_calls": [{"index": i, "function": {"arguments": fn["arguments"][k:k + 3]}}]}
                        for k in range(0, len(fn["arguments"]), 3)]
        return out


@pytest.mark.parametrize("fragment_style", [False, True])
def test_streams_are_the_same_from_whole_or_fragmented_call_deltas(fragment_style: bool) -> None:
    from spekula.frontends.http.anthropic_blocks import BlockStream, content_blocks
    from spekula.frontends.http.responses_items import ItemStream, output_items
    from spekula.frontends.schema.chat_reply import reply_format
    from spekula.frontends.schema.reply_fragments import ReplyFragments

    fmt = reply_format(template(QWEN3), "", tools=[CHAT_TOOL], parse_tools=True, reasoning_format="auto")
    replies = ReplyFragments(fmt)
    if fragment_style:
        replies._stream = _FragmentStyle(replies._stream)  # type: ignore[assignment]
    blocks, items = BlockStream(), ItemStream("msg_1")
    anthropic_events: list[dict[str, Any]] = [{"type": "message_start"}]
    responses_events: list[dict[str, Any]] = []
    pieces = [REPLY[i:i + 5] for i in range(0, len(REPLY), 5)]
    for piece, final in [*((p, None) for p in pieces), ("", REPLY)]:
        for fragment in replies.feed(piece, final=final):
            anthropic_events += blocks.feed(fragment)
            responses_events += items.feed(fragment)
    anthropic_events += [*blocks.close(), {"type": "message_delta", "delta": {"stop_reason": "tool_use"}},
                         {"type": "message_stop"}]
    responses_events += items.close()
    responses_events.append(items.event("response.completed", response={"output": items.items}))
    streamed, _ = _blocks_of_stream(anthropic_events)
    whole = content_blocks(replies.reply)
    assert streamed == whole and [b["type"] for b in whole] == ["thinking", "text", "tool_use", "tool_use"]
    assert _without_ids(_items_of_stream(responses_events)) == _without_ids(output_items(replies.reply, "msg_1"))
    calls_args = [e for e in responses_events if e["type"] == "response.function_call_arguments.delta"]
    pieces_per_call = [-(-len(args) // 3) if fragment_style else 1 for args in ('{"city": "Paris"}', '{"city": "Rome"}')]
    assert len(calls_args) == sum(pieces_per_call)
