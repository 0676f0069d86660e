"""OpenAI's Responses API (/v1/responses) through the official client, on the tiny fixture."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from http_helpers import HttpServer, start

from spekula.fixtures.tiny_gguf import tiny_model_path
from spekula.frontends.http.errors import HttpError
from spekula.frontends.http.responses import to_chat

MODEL = tiny_model_path("llama")


def test_items_become_chat_messages() -> None:
    chat = to_chat({
        "model": "m", "instructions": "Be brief.", "max_output_tokens": 9, "store": False,
        "reasoning": {"effort": "low"}, "tools": [{"type": "function", "name": "f", "parameters": {}}],
        "text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"}}},
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "w?"}]},
            {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "think"}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"x": 1}'},
            {"type": "function_call_output", "call_id": "c1", "output": "42"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "It is 42."}]},
            {"role": "developer", "content": "Again."},
        ]})
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "w?"},
        {"role": "assistant", "content": "", "reasoning_content": "think",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
        {"role": "assistant", "content": "It is 42."},
        {"role": "system", "content": "Again."},
    ]
    assert chat["max_tokens"] == 9 and chat["reasoning_effort"] == "low" and "store" not in chat
    assert chat["tools"] == [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}}


@pytest.mark.parametrize(("body", "word"), [
    ({"model": "m"}, "'input' is required"),
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, "input_image"),
    ({"input": [{"type": "mystery"}]}, "cannot tell"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "function tools"),
    ({"input": 3}, "string or a list"),
])
def test_requests_spekula_cannot_run_are_refused(body: dict, word: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(HttpError, match=word):
        to_chat(body)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpServer]:
    log = tmp_path_factory.mktemp("responses") / "server.log"
    srv = start(MODEL, "-np", "1", "-c", "256", "--temp", "0", "--spec-type", "ngram-simple", log=log)
    try:
        yield srv
    finally:
        assert srv.stop() == 0, log.read_text()


def test_the_openai_client_gets_what_chat_gives(server: HttpServer) -> None:
    from openai import OpenAI

    client = OpenAI(api_key="none", base_url=server.url + "/v1")
    items = [{"role": "system", "content": "Book"}, {"role": "user", "content": "a b c a b c"}]
    got = client.responses.create(model="m", input=items, max_output_tokens=8)  # type: ignore[arg-type]
    chat = client.chat.completions.create(model="m", messages=items, max_tokens=8)  # type: ignore[arg-type]
    assert got.id.startswith("resp_") and got.output[0].id.startswith("msg_")
    assert got.output_text == chat.choices[0].message.content
    assert got.usage is not None and chat.usage is not None
    assert (got.usage.input_tokens, got.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    kinds, text, done = [], "", None
    for ev in client.responses.create(model="m", input=items, max_output_tokens=8, stream=True):  # type: ignore[arg-type]
        kinds.append(ev.type)
        if ev.type == "response.output_text.delta":
            text += ev.delta
        if ev.type == "response.completed":
            done = ev.response
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert done is not None and text == done.output_text == got.output_text


def test_a_json_schema_format_constrains_the_answer(server: HttpServer) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    status, got = server.post("/v1/responses", {"input": "json please", "max_output_tokens": 24, "text": {
        "format": {"type": "json_schema", "name": "obj", "schema": schema}}})
    assert status == 200, got
    _, chat = server.post("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "json please"}], "max_tokens": 24,
        "response_format": {"type": "json_schema", "json_schema": {"name": "obj", "schema": schema}}})
    _, free = server.post("/v1/responses", {"input": "json please", "max_output_tokens": 24})
    answer = got["output"][0]["content"][0]["text"]
    assert answer == chat["choices"][0]["message"]["content"] and answer.lstrip().startswith("{")
    assert answer != free["output"][0]["content"][0]["text"]  # the fixture's free answer is not JSON
