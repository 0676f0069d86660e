"""Tool calls against a real `spekula serve` (HTTP and the JSON-RPC socket over one engine) on the tiny
llama fixture with Qwen 2.5's chat template: forced calls come back parsed over the socket, streamed as
OpenAI fragment deltas that add up to the unstreamed message; bad tool fields are -32602s naming them; and
clients that hang up in the middle of a streamed call, over every API, leave the server serving with
every slot free and no descriptor left behind."""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from http_helpers import HttpServer, start
from llamacpp_sdist import read_source

from spekula.fixtures.tiny_gguf import tiny_model_path
from spekula.frontends.rpc.client import SpekulaClient

NOTE = {"type": "object", "properties": {"urgent": {"type": "boolean"}, "topic": {"enum": ["rain", "sun"]}},
        "required": ["urgent", "topic"], "additionalProperties": False}
COUNT = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["n"],
         "additionalProperties": False}
SCHEMAS = {"note": NOTE, "count": COUNT}
TOOLS = [{"type": "function", "function": {"name": name, "description": f"the {name} tool", "parameters": schema}}
         for name, schema in SCHEMAS.items()]
MESSAGES = [{"role": "user", "content": "Call a tool."}]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[HttpServer, str]]:
    tmp = tmp_path_factory.mktemp("tool-serve")
    chat_template = tmp / "qwen25.jinja"
    chat_template.write_text(read_source("models/templates/Qwen-Qwen2.5-7B-Instruct.jinja"))
    sock = str(tmp / "spekula.sock")
    server = start(tiny_model_path("llama"), "--socket", sock, "--chat-template-file", chat_template, "-np", "2",
                   "-c", "4096", "--temp", "0", "-n", "96", log=tmp / "serve.log")
    try:
        yield server, sock
    finally:
        server.stop()


def _validated(message: dict[str, Any]) -> list[dict[str, Any]]:
    calls = message.get("tool_calls") or []
    for call in calls:
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
    return calls


def _added_up(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """The message the socket's chunk deltas add up to."""
    content, calls = "", {}
    for chunk in chunks:
        for delta in chunk["deltas"]:
            content += delta.get("content", "")
            for entry in delta.get("tool_calls", []):
                if entry["index"] not in calls:
                    calls[entry["index"]] = {"type": "function", "function": {"name": entry["function"]["name"],
                                                                              "arguments": ""}, "id": entry["id"]}
                calls[entry["index"]]["function"]["arguments"] += entry["function"]["arguments"]
    return {"role": "assistant", "content": content or None, "tool_calls": [calls[i] for i in sorted(calls)]}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "count"}}])
def test_socket_chat_returns_forced_calls_and_streams_them_as_deltas(served: tuple[HttpServer, str], choice: Any) -> None:
    _, sock = served
    with SpekulaClient(sock, timeout=300) as client:
        result = client.chat(MESSAGES, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False)
        message = result["message"]
        assert result["finish_reason"] == "tool_calls" and message["content"] is None, result
        [call] = _validated(message)
        assert choice == "required" or call["function"]["name"] == "count"
        stream = client.stream_chat(MESSAGES, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False)
        chunks = list(stream)
        assert stream.result is not None and stream.result["message"] == _added_up(chunks)
        assert {**stream.result["message"]["tool_calls"][0], "id": ""} == {**call, "id": ""}  # temp 0: the same call


def test_socket_chat_under_auto_is_never_an_error(served: tuple[HttpServer, str]) -> None:
    _, sock = served  # a tiny random model writes no well-formed call: its text is the content
    with SpekulaClient(sock, timeout=300) as client:
        result = client.chat(MESSAGES, tools=TOOLS, n_predict=24)
        assert result["finish_reason"] in ("stop", "length") and result["message"]["content"] == result["content"]


@pytest.mark.parametrize(("fields", "words"), [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "no-such-type"}}}]},
     "'tools[0]' ('f'): 'parameters' is not a valid JSON schema"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope'"),
    ({"tools": TOOLS, "tool_choice": "required", "grammar": 'root ::= "x"'}, "'grammar': cannot specify"),
    ({"tools": TOOLS, "reasoning_format": "loud"}, "'reasoning_format'"),
])  # fmt: skip
def test_socket_bad_tool_fields_are_invalid_params_naming_them(served: tuple[HttpServer, str], fields: dict[str, Any],
                                                                words: str) -> None:
    _, sock = served
    with SpekulaClient(sock, timeout=60) as client:
        reply = client.batch([("chat.completion", {"messages": MESSAGES, **fields})])[0]
        assert isinstance(reply, Exception) and getattr(reply, "code", None) == -32602 and words in str(reply), reply


def _http_request(path: str, body: dict[str, Any]) -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(data)}"
            "\r\n\r\n").encode() + data


STREAMED_CALLS = {
    "/v1/chat/completions": {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "stream": True},
    "/v1/messages": {"model": "m", "max_tokens": 96, "messages": MESSAGES, "stream": True, "tool_choice": {"type": "any"},
                     "tools": [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]},
    "/v1/responses": {"input": "Call a tool.", "tool_choice": "required", "stream": True,
                      "tools": [{"type": "function", **t["function"]} for t in TOOLS]},
}


def _hang_up_mid_stream(server: HttpServer, sock: str, api: str) -> None:
    """Start a streamed forced call, read its first bytes, and close the connection."""
    if api == "socket":
        conn = socket.socket(socket.AF_UNIX)
        conn.connect(sock)
        params = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "stream": True}
        conn.sendall(json.dumps({"jsonrpc": "2.0", "id": 1, "method": "chat.completion", "params": params}).encode() + b"\n")
    else:
        conn = socket.create_connection(("127.0.0.1", server.port))
        conn.sendall(_http_request(api, STREAMED_CALLS[api]))
    conn.settimeout(120)
    assert conn.recv(64)  # the stream has begun
    conn.close()


def _all_slots_idle(server: HttpServer, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status, slots = server.get("/slots")
        if status == 200 and not any(s["is_processing"] for s in slots):
            return
        time.sleep(0.1)
    raise AssertionError(f"slots still busy: {slots}")


def test_clients_hanging_up_mid_call_leave_the_server_serving(served: tuple[HttpServer, str]) -> None:
    server, sock = served
    fds = Path(f"/proc/{server.proc.pid}/fd")
    _all_slots_idle(server)
    before = len(os.listdir(fds))
    for _ in range(3):
        for api in (*STREAMED_CALLS, "socket"):
            _hang_up_mid_stream(server, sock, api)
    _all_slots_idle(server)
    status, body = server.post("/v1/chat/completions", {**STREAMED_CALLS["/v1/chat/completions"], "stream": False})
    assert status == 200 and _validated(body["choices"][0]["message"]), body
    time.sleep(0.5)  # closed connections' descriptors are released as their tasks end
    assert len(os.listdir(fds)) <= before + 2, sorted(os.readlink(fds / f) for f in os.listdir(fds))
