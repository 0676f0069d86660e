"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens.

Clients written for Anthropic (its SDKs, coding agents) can talk to spekula as they talk to
llama-server. A request is translated into an OpenAI chat request and runs through the same
template, sampling and speculation: `system` becomes a system message, text blocks the message
text, an assistant's `tool_use` blocks its tool calls, `tool_result` blocks tool messages, and
`thinking` blocks its reasoning, so a conversation's history reaches the template whole. `tools`
(`input_schema`) reach the template as functions; `tool_choice` auto / none / any / tool is OpenAI's
auto / none / required / a named function (any and tool force the calls by a grammar, as OpenAI's do;
`disable_parallel_tool_use` allows one call). `thinking: {"type": "enabled", "budget_tokens": N}` is a
reasoning budget of N tokens (10000 when left out), as llama-server reads it. The reply is split as the chat endpoint splits it
(frontends/schema/chat_reply.py) into a `thinking` block, a `text` block and `tool_use` blocks, with
`stop_reason` "tool_use" when it calls tools; a stream sends them block by block (anthropic_blocks.py).
"""

from __future__ import annotations

import json
import re
import secrets
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from spekula.core.events import Event, FinalEvent, PieceEvent
from spekula.frontends.http.anthropic_blocks import BlockStream, content_blocks
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
from spekula.frontends.schema.chat_reply import Reply
from spekula.frontends.schema.completion import CHAT_FIELDS
from spekula.frontends.schema.reasoning_budget import ANTHROPIC_DEFAULT_BUDGET
from spekula.frontends.schema.reply_fragments import ReplyFragments, whole_reply

if TYPE_CHECKING:
    from spekula.frontends.http.state import HttpState

FIELDS = frozenset({"model", "max_tokens", "messages", "system", "stop_sequences", "stream", "temperature", "top_p",
                    "top_k", "tools", "tool_choice", "metadata", "thinking", "service_tier"})


def to_chat(body: Any) -> dict[str, Any]:
    """An Anthropic request as the OpenAI chat request spekula runs."""
    if not isinstance(body, dict):
        raise HttpError("request body must be a JSON object")
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise HttpError(f"unknown field '{unknown[0][:80]}'")
    if not isinstance(body.get("messages"), list):
        raise HttpError("'messages' is required: a list of {role, content} objects")
    messages: list[dict[str, Any]] = []
    if body.get("system") is not None:
        system = _text(body["system"], "'system'")
        messages.append({"role": "system", "content": _BILLING_STAMP.sub(r"\1fffff;", system, count=1)})
    for i, m in enumerate(body["messages"]):
        messages += _messages(m, f"'messages[{i}]'")
    chat: dict[str, Any] = {"messages": messages}
    for ours, theirs in (("max_tokens", "max_tokens"), ("stop", "stop_sequences"), ("stream", "stream"),
                         ("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k")):
        if body.get(theirs) is not None:
            chat[ours] = body[theirs]
    if body.get("tools"):
        chat["tools"] = [_tool(t, f"'tools[{j}]'") for j, t in enumerate(_list(body["tools"], "'tools'"))]
    if body.get("tool_choice") is not None:
        chat.update(_tool_choice(body["tool_choice"]))
    thinking = body.get("thinking")
    if thinking is not None:
        kind = thinking.get("type") if isinstance(thinking, dict) else None
        if kind not in ("enabled", "disabled", "adaptive"):
            raise HttpError("'thinking' must be {\"type\": \"enabled\" | \"disabled\"}")
        if kind != "adaptive":
            chat["chat_template_kwargs"] = {"enable_thinking": kind == "enabled"}
        if kind == "enabled":  # llama-server's budget: budget_tokens, 10000 when left out
            chat["thinking_budget_tokens"] = thinking.get("budget_tokens", ANTHROPIC_DEFAULT_BUDGET)
    metadata = body.get("metadata")
    if isinstance(metadata, dict) and isinstance(metadata.get("user_id"), str):
        chat["user"] = metadata["user_id"]
    return chat


# Claude Code opens its system prompt with a billing line whose `cch=` stamp changes on every
# request; left alone it would end every slot's reusable prefix after a few tokens. It means nothing
# to a local model, so it is pinned to one value.
_BILLING_STAMP = re.compile(r"^(x-anthropic-billing-header:[^\n]*?cch=)[0-9a-zA-Z]{5};")


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise HttpError(f"{where} must be a list")
    return value


def _text(value: Any, where: str) -> str:
    """A string, or a list of text blocks (joined by newlines)."""
    if isinstance(value, str):
        return value
    parts = []
    for block in _list(value, where):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            _unsupported(block, where)
        parts.append(block["text"])
    return "\n".join(parts)


def _unsupported(block: Any, where: str) -> None:
    kind = block.get("type") if isinstance(block, dict) else None
    if kind in ("image", "document"):
        raise HttpError(f"{where}: image input is not supported by this server (a text-only model)")
    raise HttpError(f"{where}: unsupported content block {json.dumps(kind)[:40]}")


def _messages(m: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
        raise HttpError(f"{where} must be an object with role 'user' or 'assistant'")
    content = m.get("content", "")
    if isinstance(content, str):
        return [{"role": m["role"], "content": content}]
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for j, block in enumerate(_list(content, f"{where}.content")):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and m["role"] == "assistant" and isinstance(block.get("name"), str):
            calls.append({"id": str(block.get("id", "")), "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block.get("input", {}))}})
        elif kind == "tool_result" and m["role"] == "user":
            body = block.get("content", "")
            text = _text(body, at) if body is not None else ""
            if block.get("is_error"):
                text = f"Error: {text}"
            results.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")), "content": text})
        elif kind == "thinking" and m["role"] == "assistant" and isinstance(block.get("thinking"), str):
            reasoning.append(block["thinking"])
        elif kind == "redacted_thinking":
            continue  # encrypted by another provider: nothing a local template can show
        else:
            _unsupported(block, at)
    out = list(results)  # tool results answer the previous turn's calls, before any new text
    if texts or calls or reasoning or not results:
        msg: dict[str, Any] = {"role": m["role"], "content": "\n".join(texts)}
        if calls:
            msg["tool_calls"] = calls
        if reasoning:
            msg["reasoning_content"] = "\n".join(reasoning)
        out.append(msg)
    return out


def _tool(tool: Any, where: str) -> dict[str, Any]:
    if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
        raise HttpError(f"{where} must be an object with a string 'name'")
    if tool.get("type", "custom") != "custom":  # Anthropic's server tools (web search, bash, ...) run at Anthropic
        raise HttpError(f"{where}: the tool type {json.dumps(tool['type'])[:60]} is not supported; only client "
                        "tools ({'name', 'description', 'input_schema'}) are")
    fn = {"name": tool["name"], "parameters": tool.get("input_schema", {"type": "object"})}
    if isinstance(tool.get("description"), str):
        fn["description"] = tool["description"]
    return {"type": "function", "function": fn}


_CHOICES = {"auto": "auto", "none": "none", "any": "required"}


def _tool_choice(choice: Any) -> dict[str, Any]:
    """Anthropic's `tool_choice` as OpenAI chat's `tool_choice` (and `parallel_tool_calls`)."""
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "tool" and isinstance(choice.get("name"), str):
        out: dict[str, Any] = {"tool_choice": {"type": "function", "function": {"name": choice["name"]}}}
    elif kind in _CHOICES:
        out = {"tool_choice": _CHOICES[kind]}
    else:
        raise HttpError("'tool_choice' must be {\"type\": \"auto\" | \"any\" | \"none\"} or "
                        "{\"type\": \"tool\", \"name\": ...}")
    flag = choice.get("disable_parallel_tool_use")
    if flag is not None and not isinstance(flag, bool):
        raise HttpError("'tool_choice.disable_parallel_tool_use' must be true or false")
    if flag:
        out["parallel_tool_calls"] = False
    return out


def stop_reason(final: FinalEvent, reply: Reply | None = None) -> str:
    """"tool_use" when the reply calls tools (unless it was cut at max_tokens), as llama-server says it."""
    if final.stop_type != "limit" and reply is not None and reply.tool_calls:
        return "tool_use"
    return {"limit": "max_tokens", "word": "stop_sequence"}.get(final.stop_type, "end_turn")


def _usage(final: FinalEvent) -> dict[str, int]:
    cached = int(final.timings.get("cache_n", 0))
    return {"input_tokens": final.tokens_evaluated - cached, "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0, "output_tokens": len(final.tokens)}


async def messages(request: Request) -> Response:
    state: HttpState = request.app.state.http
    engine = state.ready()
    chat = to_chat(await state.read_json(request))
    params, opts = normalise(chat, allowed=CHAT_FIELDS, n_slots=engine.config.n_slots)
    tools, tool_opts = await read_chat_tools(chat, engine, state.service.defaults.reasoning_format,
                                             schema_field="input_schema")
    budget = chat_budget(opts, state.service.defaults)
    text = state.render_chat(messages_with_tools(engine, params.pop("messages"), tools, tool_opts), opts,
                             allow_empty=True)
    text = without_reasoning(engine, text, budget)
    fmt = chat_reply_format(engine, text, tools, tool_opts)
    prompt = await state.service.encode(text)
    gen, parsed = state.service.build(params, prompt, opts, text)
    force_calls(gen, parsed, fmt, tools, tool_opts, engine.tokenizer)
    limit_reasoning(gen, engine, budget, opts, state.service.defaults)
    await state.service.check(parsed)
    mid = f"msg_{secrets.token_hex(12)}"
    head = {"id": mid, "type": "message", "role": "assistant", "model": state.model_alias}
    if not parsed.stream:
        final = await state.service.run(gen, request)
        reply = whole_reply(final.content, fmt, tool_opts.parallel)
        return JSONResponse({**head, "content": content_blocks(reply), "stop_reason": stop_reason(final, reply),
                             "stop_sequence": final.stopping_word if final.stop_type == "word" else None,
                             "usage": _usage(final)})
    replies = ReplyFragments(fmt, tool_opts.parallel)
    blocks = BlockStream()
    started = [False]

    def shape(event: Event) -> list[Any]:
        out: list[dict[str, Any]] = []
        if not started[0]:
            started[0] = True
            usage = {"input_tokens": len(prompt), "cache_read_input_tokens": 0, "output_tokens": 0}
            out.append({"type": "message_start", "message": {**head, "content": [], "stop_reason": None,
                                                             "stop_sequence": None, "usage": usage}})
            if not fmt.active:  # plain text: its one block opens at once, as before any reply parsing
                out += blocks.start_text()
        if isinstance(event, PieceEvent):
            for fragment in replies.feed(event.text):
                out += blocks.feed(fragment)
        elif isinstance(event, FinalEvent):
            for fragment in replies.feed("", final=event.content):
                out += blocks.feed(fragment)
            out += blocks.close() if blocks.started else [*blocks.start_text(), *blocks.close()]
            out += [{"type": "message_delta", "delta": {"stop_reason": stop_reason(event, replies.reply),
                                                        "stop_sequence": event.stopping_word or None},
                     "usage": {"output_tokens": len(event.tokens)}},
                    {"type": "message_stop"}]
        return [typed_sse(o) for o in out]

    return state.service.stream(gen, shape, done_marker=False)  # type: ignore[return-value]


async def count_tokens(request: Request) -> Response:
    state: HttpState = request.app.state.http
    engine = state.ready()
    body = await state.read_json(request)
    if isinstance(body, dict):
        body.pop("max_tokens", None)  # optional here
    params, opts = normalise(to_chat(body), allowed=CHAT_FIELDS, n_slots=engine.config.n_slots)
    text = state.render_chat(params.pop("messages"), opts, allow_empty=True)
    return JSONResponse({"input_tokens": len(await state.service.encode(text))})
