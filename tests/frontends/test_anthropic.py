"""Anthropic's Messages API (/v1/messages) and conversation histories with tool calls, on the tiny fixture."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from http_helpers import HttpServer, start

from spekula.fixtures.tiny_gguf import tiny_model_path
from spekula.frontends.http.anthropic import to_chat
from spekula.frontends.http.errors import HttpError
from spekula.frontends.schema.chat_messages import chat_messages

MODEL = tiny_model_path("llama")
TOOLS_TEMPLATE = ("{% for m in messages %}[{{ m.role }}{% if m.tool_call_id %}:{{ m.tool_call_id }}{% endif %}]"
                  "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}"
                  "{% for c in m.tool_calls or [] %}<call {{ c.function.name }} {{ c.function.arguments | tojson }}>"
                  "{% endfor %}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")


def test_a_history_with_tools_becomes_openai_messages() -> None:
    chat = to_chat({
        "model": "x", "max_tokens": 5, "system": [{"type": "text", "text": "Be brief."}], "stop_sequences": ["\n"],
        "tools": [{"name": "weather", "description": "d", "input_schema": {"type": "object"}}],
        "thinking": {"type": "disabled", "budget_tokens": 10}, "metadata": {"user_id": "u1"},
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "ask the tool"},
                                              {"type": "tool_use", "id": "t1", "name": "weather",
                                               "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"},
                                         {"type": "text", "text": "And tomorrow?"}]},
        ]})
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "reasoning_content": "ask the tool",
         "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "weather",
                                                                       "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "sunny"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    assert chat["tools"] == [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"},
                                                               "description": "d"}}]
    assert chat["stop"] == ["\n"] and chat["max_tokens"] == 5 and chat["user"] == "u1"
    assert chat["chat_template_kwargs"] == {"enable_thinking": False}
    # and the OpenAI side keeps every field the template needs, arguments as an object
    msgs = chat_messages(chat["messages"])
    assert msgs[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert msgs[3] == {"role": "tool", "content": "sunny", "tool_call_id": "t1"}


@pytest.mark.parametrize(("body", "word"), [
    ({"max_tokens": 5}, "'messages' is required"),
    ({"messages": [], "frobnicate": 1}, "frobnicate"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image input is not supported"),
    ({"messages": [{"role": "system", "content": "x"}]}, "role 'user' or 'assistant'"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "name": "f"}]}]}, "unsupported content block"),
    ({"messages": [], "thinking": {"type": "sometimes"}}, "thinking"),
])
def test_requests_spekula_cannot_run_are_refused(body: dict, word: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(HttpError, match=word):
        to_chat(body)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpServer]:
    tmp = tmp_path_factory.mktemp("anthropic")
    (tmp / "t.jinja").write_text(TOOLS_TEMPLATE)
    srv = start(MODEL, "-np", "1", "-c", "256", "--temp", "0", "--chat-template-file", tmp / "t.jinja",
                "--spec-type", "ngram-simple", log=tmp / "server.log")
    try:
        yield srv
    finally:
        assert srv.stop() == 0, (tmp / "server.log").read_text()


def test_messages_answer_as_the_chat_endpoint_does(server: HttpServer) -> None:
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "a b c a b c"}]}
    status, got = server.post("/v1/messages", body)
    assert status == 200, got
    _, chat = server.post("/v1/chat/completions", {"messages": body["messages"], "max_tokens": 8, "temperature": 0})
    assert got["type"] == "message" and got["role"] == "assistant" and got["id"].startswith("msg_")
    assert got["content"] == [{"type": "text", "text": chat["choices"][0]["message"]["content"]}]
    assert got["stop_reason"] in ("max_tokens", "end_turn") and "timings" not in got
    usage = got["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == chat["usage"]["prompt_tokens"]
    assert usage["output_tokens"] == chat["usage"]["completion_tokens"]
    status, count = server.post("/v1/messages/count_tokens", {"model": "m", "messages": body["messages"]})
    assert status == 200 and count == {"input_tokens": chat["usage"]["prompt_tokens"]}


def test_a_stream_is_anthropics_event_sequence(server: HttpServer) -> None:
    body = {"model": "m", "max_tokens": 8, "stream": True, "messages": [{"role": "user", "content": "a b c a b"}]}
    status, headers, text = server.call("POST", "/v1/messages", body)
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    import json

    events = [(b.split("\n")[0].removeprefix("event: "), json.loads(b.split("\n")[1].removeprefix("data: ")))
              for b in text.strip().split("\n\n")]
    kinds = [k for k, _ in events]
    assert all(k == d["type"] for k, d in events)
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) <= {"content_block_delta"}
    streamed = "".join(d["delta"]["text"] for k, d in events if k == "content_block_delta")
    _, whole = server.post("/v1/messages", {**body, "stream": False})
    assert streamed == whole["content"][0]["text"]
    assert events[-2][1]["usage"]["output_tokens"] == whole["usage"]["output_tokens"]


def test_tool_histories_reach_the_template(server: HttpServer) -> None:
    history = [{"role": "user", "content": "w?"},
               {"role": "assistant", "content": None, "reasoning_content": "use it",
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    status, got = server.post("/apply-template", {"messages": history})
    assert status == 200, got
    assert got["prompt"] == '[user]w?[assistant]<think>use it</think><call f {"x": 1}>[tool:c1]42[assistant]'
    status, err = server.post("/apply-template", {"messages": [{"role": "assistant", "tool_calls": "x"}]})
    assert status == 400 and "tool_calls" in err["error"]["message"]


def test_api_key_in_anthropics_header(tmp_path: Path) -> None:
    srv = start(MODEL, "-np", "1", "-c", "128", "--api-key", "k-1", log=tmp_path / "server.log")
    try:
        body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "a"}]}
        assert srv.post("/v1/messages", body)[0] == 401
        assert srv.post("/v1/messages", body, headers={"x-api-key": "k-1"})[0] == 200
    finally:
        assert srv.stop() == 0


def test_claude_codes_changing_billing_stamp_does_not_break_the_prompt_cache() -> None:
    def system(stamp: str) -> str:
        chat = to_chat({"messages": [], "system": f"x-anthropic-billing-header: cc_version=2; cch={stamp};Hi"})
        return str(chat["messages"][0]["content"])

    assert system("a5145") == system("0b9c2") == "x-anthropic-billing-header: cc_version=2; cch=fffff;Hi"
    assert to_chat({"messages": [], "system": "cch=a5145;"})["messages"][0]["content"] == "cch=a5145;"
