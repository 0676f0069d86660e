"""OpenAI chat messages, checked and normalised for the chat template.

A message has a `role` and `content` (a string, or a list of text parts, which the render joins or
hands the template as they are, as llama-server does), and may carry what agent clients send back in
a conversation's history: an assistant's `tool_calls` (their `arguments` handed to the template as an object when they are a
JSON object, as Hugging Face templates expect), a tool message's `tool_call_id`, and an assistant's
`reasoning_content` (templates such as Qwen3's render it); an empty one of these three is left out, as
llama-server leaves it out. Anything else is refused, naming it.
"""

from __future__ import annotations

import json
from typing import Any


class MessagesError(ValueError):
    """The messages are malformed; the message names the field (each frontend answers in its own form)."""


_FIELDS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content"})


def chat_messages(value: Any, *, allow_empty: bool = False) -> list[dict[str, Any]]:
    """OpenAI messages -> the template's messages: content a string, the optional fields checked."""
    if not isinstance(value, list) or not (value or allow_empty):
        raise MessagesError("'messages' must be a non-empty list of {role, content} objects")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(value):
        where = f"'messages[{i}]'"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise MessagesError(f"{where} must be an object with a string 'role'")
        unknown = set(m) - _FIELDS
        if unknown:
            raise MessagesError(f"{where}: unsupported field(s) {', '.join(sorted(unknown))[:120]}")
        msg: dict[str, Any] = {"role": m["role"]}
        calls = m.get("tool_calls")
        if calls is not None:
            msg["tool_calls"] = _tool_calls(calls, where)
        content = m.get("content")
        if content is None and calls:
            content = ""  # an assistant turn that only calls tools
        msg["content"] = _content(content, where)
        for name in ("name", "tool_call_id", "reasoning_content"):
            if m.get(name) is not None:
                if not isinstance(m[name], str):
                    raise MessagesError(f"{where}.{name} must be a string")
                if m[name]:  # llama-server hands the template no empty one (Qwen3.5's then reads <think> off the content)
                    msg[name] = m[name]
        out.append(msg)
    return out


def _content(content: Any, where: str) -> str | list[dict[str, str]]:
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise MessagesError(f"{where}.content: only text parts are supported")
            parts.append({"type": "text", "text": part["text"]})
        return parts  # joined, or not, by the render: as the template takes content (core content_caps)
    if not isinstance(content, str):
        raise MessagesError(f"{where}.content must be a string or a list of text parts")
    return content


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise MessagesError(f"{where}.tool_calls must be a list")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise MessagesError(f"{where}.tool_calls[{j}] must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}")
        arguments = fn.get("arguments", {})
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError:
                parsed = None
            arguments = parsed if isinstance(parsed, dict) else arguments
        elif not isinstance(arguments, dict):
            raise MessagesError(f"{where}.tool_calls[{j}].function.arguments must be a JSON string or an object")
        entry: dict[str, Any] = {"type": "function", "function": {"name": fn["name"], "arguments": arguments}}
        if isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        out.append(entry)
    return out
