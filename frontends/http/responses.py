"""OpenAI's Responses API: POST /v1/responses (and /responses), as llama-server serves it.

Newer OpenAI clients (the SDK's `client.responses`, agents built on it) send a Responses request;
it is translated into a chat request and runs through the same template, samplers and
speculation. `instructions` becomes a system message; `input` is a text or a list of items:
messages (`input_text` / `output_text` parts), `function_call` and `function_call_output` items
(the assistant's tool calls and their results) and `reasoning` items. `tools` are function tools;
`tool_choice` "auto" / "none" / "required" / {"type": "function", "name"} and `parallel_tool_calls` act
as in chat (required and named force the calls by a grammar). The reply is split as the chat endpoint
splits it (frontends/schema/chat_reply.py) into a `reasoning` item, a `message` item and `function_call`
items; streams send the Responses event sequence item by item (responses_items.py). There is no
server-side state, so `previous_response_id` is refused.
"""

from __future__ import annotations

import secrets
import time
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from spekula.core.events import Event, FinalEvent, PieceEvent, ProgressEvent
from spekula.frontends.http.chat_tools import (
    chat_budget,
    chat_reply_format,
    force_calls,
    limit_reasoning,
    messages_with_tools,
    read_chat_tools,
    without_reasoning,
)
from spekula.frontends.http.errors import HttpError
from spekula.frontends.http.fields import normalise
from spekula.frontends.http.generation import typed_sse
from spekula.frontends.http.native import progress_fields
from spekula.frontends.http.responses_items import ItemStream, output_items
from spekula.frontends.schema.completion import CHAT_FIELDS
from spekula.frontends.schema.reply_fragments import ReplyFragments, whole_reply

if TYPE_CHECKING:
    from spekula.frontends.http.state import HttpState

# Fields of a Responses request with no chat counterpart that change nothing here.
_IGNORED = frozenset({"store", "include", "truncation", "background", "prompt_cache_key",
                      "safety_identifier", "top_logprobs"})


def to_chat(body: Any) -> dict[str, Any]:
    """A Responses request as the chat request spekula runs (other fields pass on unchanged)."""
    if not isinstance(body, dict):
        raise HttpError("request body must be a JSON object")
    if "input" not in body:
        raise HttpError("'input' is required")
    if body.get("previous_response_id"):
        raise HttpError("'previous_response_id' is not supported: spekula keeps no responses; send the whole input")
    chat = {k: v for k, v in body.items() if k not in ("input", "instructions", "max_output_tokens", "tools",
                                                        "tool_choice", "reasoning", "text", "previous_response_id",
                                                        *_IGNORED)}
    messages: list[dict[str, Any]] = []
    if body.get("instructions") is not None:
        if not isinstance(body["instructions"], str):
            raise HttpError("'instructions' must be a string")
        messages.append({"role": "system", "content": body["instructions"]})
    value = body["input"]
    if isinstance(value, str):
        messages.append({"role": "user", "content": value})
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _add_item(messages, item, f"'input[{i}]'")
    else:
        raise HttpError("'input' must be a string or a list of items")
    chat["messages"] = messages
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    tools = body.get("tools")
    if tools:
        if not isinstance(tools, list):
            raise HttpError("'tools' must be a list")
        chat["tools"] = [_tool(t, f"'tools[{j}]'") for j, t in enumerate(tools)]
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and reasoning.get("effort") is not None:
        chat["reasoning_effort"] = reasoning["effort"]
    fmt = body.get("text", {}).get("format") if isinstance(body.get("text"), dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    elif isinstance(fmt, dict) and fmt.get("type") == "json_object":
        chat["response_format"] = {"type": "json_object"}
    return chat


def _parts(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise HttpError(f"{where}.content must be a string or a list of parts")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text") and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind in ("input_image", "input_file"):
            raise HttpError(f"{where}: {kind} is not supported by this server (a text-only model)")
        else:
            raise HttpError(f"{where}: parts must be input_text or output_text")
    return "\n".join(texts)


def _assistant(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The assistant message the next item belongs to: the last one, or a new one."""
    if not messages or messages[-1]["role"] != "assistant":
        messages.append({"role": "assistant", "content": ""})
    return messages[-1]


def _add_item(messages: list[dict[str, Any]], item: Any, where: str) -> None:
    if not isinstance(item, dict):
        raise HttpError(f"{where} must be an object")
    kind, role = item.get("type", "message"), item.get("role")
    if kind == "message" and role in ("user", "system", "developer"):
        messages.append({"role": "system" if role == "developer" else role,
                         "content": _parts(item.get("content", ""), where)})
    elif kind == "message" and role == "assistant":
        text = _parts(item.get("content", ""), where)
        msg = _assistant(messages)
        msg["content"] = "\n".join(t for t in (msg["content"], text) if t)
    elif kind == "function_call" and isinstance(item.get("name"), str):
        call = {"id": str(item.get("call_id", "")), "type": "function",
                "function": {"name": item["name"], "arguments": item.get("arguments", "{}")}}
        _assistant(messages).setdefault("tool_calls", []).append(call)
    elif kind == "function_call_output":
        output = item.get("output", "")
        messages.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")),
                         "content": _parts(output, where)})
    elif kind == "reasoning":
        texts = [c.get("text", "") for c in item.get("content") or [] if isinstance(c, dict)]
        texts = texts or [s.get("text", "") for s in item.get("summary") or [] if isinstance(s, dict)]
        _assistant(messages)["reasoning_content"] = "\n".join(t for t in texts if isinstance(t, str))
    else:
        raise HttpError(f"{where}: cannot tell what this item is (a message, function_call, "
                        "function_call_output or reasoning)")


def _tool(tool: Any, where: str) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
        raise HttpError(f"{where}: only function tools ({{'type': 'function', 'name', 'parameters'}}) are supported")
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}


def _tool_choice(choice: Any) -> Any:
    """The Responses `tool_choice` as chat's: a named function is {"type": "function", "name"} here."""
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise HttpError("'tool_choice' must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", "
                    "\"name\": ...} (hosted tools and allowed_tools are not supported)")


def _usage(final: FinalEvent) -> dict[str, Any]:
    n_in, n_out = final.tokens_evaluated, len(final.tokens)
    return {"input_tokens": n_in, "output_tokens": n_out, "total_tokens": n_in + n_out,
            "input_tokens_details": {"cached_tokens": int(final.timings.get("cache_n", 0))},
            "output_tokens_details": {"reasoning_tokens": 0}}


async def responses(request: Request) -> Response:
    state: HttpState = request.app.state.http
    engine = state.ready()
    chat = to_chat(await state.read_json(request))
    params, opts = normalise(chat, allowed=CHAT_FIELDS, n_slots=engine.config.n_slots)
    tools, tool_opts = await read_chat_tools(chat, engine, state.service.defaults.reasoning_format)
    budget = chat_budget(opts, state.service.defaults)
    text = state.render_chat(messages_with_tools(engine, params.pop("messages"), tools, tool_opts), opts)
    text = without_reasoning(engine, text, budget)
    fmt = chat_reply_format(engine, text, tools, tool_opts)
    prompt = await state.service.encode(text)
    gen, parsed = state.service.build(params, prompt, opts, text)
    force_calls(gen, parsed, fmt, tools, tool_opts, engine.tokenizer)
    limit_reasoning(gen, engine, budget, opts, state.service.defaults)
    await state.service.check(parsed)
    rid, mid, created = f"resp_{secrets.token_hex(12)}", f"msg_{secrets.token_hex(12)}", int(time.time())
    head = {"id": rid, "object": "response", "created_at": created, "model": state.model_alias}

    if not parsed.stream:
        final = await state.service.run(gen, request)
        reply = whole_reply(final.content, fmt, tool_opts.parallel)
        return JSONResponse({**head, "status": "completed", "completed_at": int(time.time()),
                             "output": output_items(reply, mid), "usage": _usage(final)})
    replies = ReplyFragments(fmt, tool_opts.parallel)
    items = ItemStream(mid)

    def opening() -> list[dict[str, Any]]:
        live = {**head, "status": "in_progress", "output": []}
        out = [items.event("response.created", response=live), items.event("response.in_progress", response=live)]
        return out + ([] if fmt.active else items.open_message())  # plain text: its message opens at once

    def shape(ev: Event) -> list[Any]:
        out = [] if items.started else opening()
        if isinstance(ev, ProgressEvent):
            out.append({**items.event("response.in_progress", response={**head, "status": "in_progress",
                                                                        "output": []}), **progress_fields(ev)})
        elif isinstance(ev, PieceEvent):
            new = [e for f in replies.feed(ev.text) for e in items.feed(f)]
            if new and ev.timings is not None:
                new[-1] = {**new[-1], "timings": ev.timings}
            out += new
        else:
            out += [e for f in replies.feed("", final=ev.content) for e in items.feed(f)]
            out += items.close() if items.any_item else [*items.open_message(), *items.close()]
            out.append({**items.event("response.completed", response={
                **head, "status": "completed", "completed_at": int(time.time()), "output": items.items,
                "usage": _usage(ev)}), "timings": dict(ev.timings)})
        return [typed_sse(o) for o in out]

    return state.service.stream(gen, shape, done_marker=False)  # type: ignore[return-value]
