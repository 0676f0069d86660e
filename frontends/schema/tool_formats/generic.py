"""The generic JSON form, for templates that do not write tools into the prompt (llama.cpp's generic
handler, which its build 11434 no longer has): the tools are described in a system message and the whole
reply is one JSON object, ``{"tool_calls": [{"name": .., "arguments": {..}}, ..]}``, ``{"tool_call": {..}}``
or ``{"response": ".."}``, held to that form by a grammar (tool_grammar.py). Nothing is sent while it is
being written: the object is read whole at the end."""

from __future__ import annotations

import json
from typing import Any

from spekula.frontends.schema.tool_formats.reply import Reply, ReplyFormat, ToolCall, arguments_text

SYSTEM_PROMPT = ("Respond in JSON format, either with `tool_call` (a request to call tools) or with `response` "
                 "reply to the user's request")


def _call(value: Any, fmt: ReplyFormat) -> ToolCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or fmt.tool(value["name"]) is None:
        return None
    args = arguments_text(value.get("arguments", {}))
    return ToolCall(value["name"], args, id=str(value.get("id") or "")) if args is not None else None


def parse(text: str, fmt: ReplyFormat, out: Reply, partial: bool) -> Reply:
    if partial:
        return out
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if isinstance(value, dict):
        listed = value.get("tool_calls") if "tool_calls" in value else [value.get("tool_call")] \
            if "tool_call" in value else None
        calls = [_call(v, fmt) for v in listed] if isinstance(listed, list) and listed else None
        if calls is not None and all(c is not None for c in calls):
            out.tool_calls = [c for c in calls if c is not None]
            return out
        if isinstance(value.get("response"), str) and len(value) == 1:
            out.content = value["response"]
            return out
    out.content = text
    return out


def tool_system_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]], *,
                  json_form: bool = True) -> list[dict[str, Any]]:
    """`messages` with the tools (and, `json_form`, the generic reply's form) told in the system message,
    added or extended: for templates that do not write tools into the prompt themselves."""
    described = json.dumps([t["function"] for t in tools], ensure_ascii=False, indent=2)
    text = f"You can call any of the following tools to satisfy the user's requests: {described}"
    text += f"\n\n{SYSTEM_PROMPT}" if json_form else ""
    if messages and messages[0].get("role") == "system" and isinstance(messages[0].get("content"), str):
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + text}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]
