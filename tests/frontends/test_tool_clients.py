"""Real clients run a three-tool task to completion against `spekula serve` on SmolLM2 (with Qwen 2.5's
chat template, which renders tools in the ChatML SmolLM2 was trained on): the OpenAI Python client over
chat completions and the Responses API, the Anthropic Python SDK over Messages, and smolagents'
ToolCallingAgent (which asks for `tool_choice: "required"` at every step). Every call is forced by the
grammar (named or required), streamed and not, each call's result goes back to the model in the
client's own history form, and every call's arguments validate against its tool's schema (jsonschema).
A client package that is not installed skips its test, saying so (they are in the `test` extra)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
from http_helpers import HttpServer, start
from llamacpp_sdist import read_source
from model_drafter_helpers import smollm2_or_skip

pytestmark = pytest.mark.slow  # SmolLM2 behind a real server

CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}},
        "required": ["city"], "additionalProperties": False}
CONVERT = {"type": "object", "properties": {"celsius": {"type": "number", "minimum": -90, "maximum": 60}},
           "required": ["celsius"], "additionalProperties": False}
NOTE = {"type": "object", "properties": {"text": {"type": "string", "maxLength": 40}, "urgent": {"type": "boolean"}},
        "required": ["text", "urgent"], "additionalProperties": False}
SCHEMAS = {"get_temperature": CITY, "to_fahrenheit": CONVERT, "save_note": NOTE}
DESCRIPTIONS = {"get_temperature": "The temperature of a city, in Celsius",
                "to_fahrenheit": "Convert a Celsius temperature to Fahrenheit",
                "save_note": "Save a short note for the user"}
TASK = "Get the temperature in Paris, convert it to Fahrenheit, then save a note with the result."
ORDER = list(SCHEMAS)  # the task's calls, one forced per step


def run_tool(name: str, args: dict[str, Any]) -> str:
    """The tools' results (the task's world): validated arguments in, a result text out."""
    jsonschema.validate(args, SCHEMAS[name])
    if name == "get_temperature":
        return json.dumps({"city": args["city"], "celsius": 21})
    if name == "to_fahrenheit":
        return json.dumps({"fahrenheit": args["celsius"] * 9 / 5 + 32})
    return json.dumps({"saved": True})


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpServer]:
    model = smollm2_or_skip()
    tmp = tmp_path_factory.mktemp("tool-clients")
    chat_template = tmp / "qwen25.jinja"
    chat_template.write_text(read_source("models/templates/Qwen-Qwen2.5-7B-Instruct.jinja"))
    srv = start(model, "--chat-template-file", chat_template, "-c", "4096", "--temp", "0", "-np", "1", "-n", "160",
                log=tmp / "serve.log")
    try:
        yield srv
    finally:
        srv.stop()


def _chat_tools() -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": n, "description": DESCRIPTIONS[n], "parameters": s}}
            for n, s in SCHEMAS.items()]


def _openai_stream_message(chunks: Iterator[Any]) -> dict[str, Any]:
    """The assistant message an OpenAI chat stream adds up to (its deltas joined by call index)."""
    content, calls = "", {}
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for c in choice.delta.tool_calls or []:
                entry = calls.setdefault(c.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
                entry["id"] = c.id or entry["id"]
                entry["function"]["name"] += (c.function.name or "") if c.function else ""
                entry["function"]["arguments"] += (c.function.arguments or "") if c.function else ""
    return {"role": "assistant", "content": content or None, "tool_calls": [calls[i] for i in sorted(calls)]}


@pytest.mark.parametrize("stream", [False, True])
def test_openai_client_chat_runs_the_task(server: HttpServer, stream: bool) -> None:
    openai = pytest.importorskip("openai", reason="the OpenAI Python client is not installed (pip install openai)")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    messages: list[dict[str, Any]] = [{"role": "user", "content": TASK}]
    for step, name in enumerate(ORDER):
        choice: Any = "required" if step == 0 else {"type": "function", "function": {"name": name}}
        kwargs = {"model": "spekula", "messages": messages, "tools": _chat_tools(), "tool_choice": choice,
                  "parallel_tool_calls": False}
        if stream:
            message = _openai_stream_message(client.chat.completions.create(**kwargs, stream=True))
        else:
            reply = client.chat.completions.create(**kwargs)
            assert reply.choices[0].finish_reason == "tool_calls"
            message = reply.choices[0].message.model_dump(exclude_none=True)
        [call] = message["tool_calls"]
        assert step == 0 or call["function"]["name"] == name
        result = run_tool(call["function"]["name"], json.loads(call["function"]["arguments"]))
        messages += [{"role": "assistant", "content": message.get("content"), "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": call["id"], "content": result}]
    final = client.chat.completions.create(model="spekula", messages=messages, tools=_chat_tools(), tool_choice="none",
                                           max_tokens=24)
    assert final.choices[0].message.tool_calls is None and final.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("stream", [False, True])
def test_openai_client_responses_runs_the_task(server: HttpServer, stream: bool) -> None:
    openai = pytest.importorskip("openai", reason="the OpenAI Python client is not installed (pip install openai)")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    tools = [{"type": "function", "name": n, "description": DESCRIPTIONS[n], "parameters": s, "strict": False}
             for n, s in SCHEMAS.items()]
    items: list[Any] = [{"role": "user", "content": TASK}]
    for name in ORDER:
        kwargs = {"model": "spekula", "input": items, "tools": tools, "tool_choice": {"type": "function", "name": name},
                  "parallel_tool_calls": False}
        if stream:
            with client.responses.stream(**kwargs) as events:
                response = events.get_final_response()
        else:
            response = client.responses.create(**kwargs)
        [call] = [i for i in response.output if i.type == "function_call"]
        assert call.name == name
        result = run_tool(name, json.loads(call.arguments))
        items += [i.model_dump(exclude_none=True) for i in response.output]
        items.append({"type": "function_call_output", "call_id": call.call_id, "output": result})
    final = client.responses.create(model="spekula", input=items, tools=tools, tool_choice="none", max_output_tokens=24)
    assert [i.type for i in final.output] == ["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_sdk_runs_the_task(server: HttpServer, stream: bool) -> None:
    anthropic = pytest.importorskip("anthropic", reason="the Anthropic Python SDK is not installed (pip install anthropic)")
    client = anthropic.Anthropic(base_url=server.url, api_key="unused")
    tools = [{"name": n, "description": DESCRIPTIONS[n], "input_schema": s} for n, s in SCHEMAS.items()]
    messages: list[dict[str, Any]] = [{"role": "user", "content": TASK}]
    for step, name in enumerate(ORDER):
        choice = {"type": "any", "disable_parallel_tool_use": True} if step == 0 else {"type": "tool", "name": name}
        kwargs = {"model": "spekula", "max_tokens": 160, "messages": messages, "tools": tools, "tool_choice": choice}
        if stream:
            with client.messages.stream(**kwargs) as events:
                reply = events.get_final_message()  # the SDK joins the input_json_delta fragments itself
        else:
            reply = client.messages.create(**kwargs)
        assert reply.stop_reason == "tool_use"
        [use] = [b for b in reply.content if b.type == "tool_use"]
        assert step == 0 or use.name == name
        result = run_tool(use.name, use.input)
        messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": result}]}]
    final = client.messages.create(model="spekula", max_tokens=24, messages=messages, tools=tools,
                                   tool_choice={"type": "none"})
    assert final.stop_reason in ("end_turn", "max_tokens") and all(b.type == "text" for b in final.content)


@pytest.mark.parametrize("stream", [False, True])
def test_smolagents_tool_calling_agent_runs_the_task(server: HttpServer, stream: bool) -> None:
    smolagents = pytest.importorskip("smolagents", reason="smolagents is not installed (pip install smolagents)")
    pytest.importorskip("openai", reason="smolagents' OpenAIServerModel needs the OpenAI Python client")
    from smolagents.models import get_tool_json_schema

    def make(name: str, inputs: dict[str, dict[str, Any]], output_type: str) -> Any:
        class Fn(smolagents.Tool):  # type: ignore[misc]
            skip_forward_signature_validation = True

            def forward(self, **args: Any) -> Any:
                return run_tool(name, args)

        Fn.name, Fn.description, Fn.inputs, Fn.output_type = name, DESCRIPTIONS[name], inputs, output_type
        return Fn()

    tools = [make("get_temperature", {"city": {"type": "string", "description": "Paris, Rome or Oslo"}}, "string"),
             make("to_fahrenheit", {"celsius": {"type": "number", "description": "degrees Celsius"}}, "string"),
             make("save_note", {"text": {"type": "string", "description": "the note"},
                                "urgent": {"type": "boolean", "description": "whether it is urgent"}}, "string")]
    model = smolagents.OpenAIServerModel(model_id="spekula", api_base=f"{server.url}/v1", api_key="unused",
                                         max_tokens=96)
    agent = smolagents.ToolCallingAgent(tools=tools, model=model, max_steps=3, stream_outputs=stream, verbosity_level=0)
    agent.run(TASK)
    schemas = {t.name: get_tool_json_schema(t)["function"]["parameters"] for t in agent.tools.values()}
    calls = [c for step in agent.memory.steps for c in getattr(step, "tool_calls", None) or []]
    assert calls, "the agent made no tool call"
    for call in calls:  # every call the model made, whether or not the agent ran it
        jsonschema.validate(call.arguments, schemas[call.name])
