"""The generic JSON form, for templates that do not write tools into the prompt (llama.cpp's generic
handler, which its build 11434 no longer has): the tools are described in a system message and the whole
reply is one JSON object, ``{"tool_calls": [{"name": .., "arguments": {..}}, ..]}``, ``{"tool_call": {..}}``
or ``{"response": ".."}``, held to that form by a grammar (tool_grammar.py).

It streams as the other families do: a response's text as it is written (decoded, never cutting an
escape), each call's name and then its arguments in pieces (raw JSON as written, as the other families
give them). The unstreamed parse reads the same way, so what is sent is a prefix of it: a reply cut off
inside its response is the response so far, one cut off after whole calls is those calls, and one that is
not of the form is content, whole."""

from __future__ import annotations

import json
import re
from typing import Any

from spekula.frontends.schema.tool_formats.json_scan import (
    skip_space,
    streamed_call,
    value_end,
    writing_calls,
)
from spekula.frontends.schema.tool_formats.reply import Reply, ReplyFormat, ToolCall, arguments_text

SYSTEM_PROMPT = ("Respond in JSON format, either with `tool_call` (a request to call tools) or with `response` "
                 "reply to the user's request")
_HEAD = re.compile(r'\{\s*"(tool_calls|tool_call|response)"\s*:\s*')
_ESCAPE = re.compile(r'\\(?:u[0-9a-fA-F]{0,4}|.|$)', re.S)


def _call(value: Any, fmt: ReplyFormat) -> ToolCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or fmt.tool(value["name"]) is None:
        return None
    args = arguments_text(value.get("arguments", {}))
    return ToolCall(value["name"], args, id=str(value.get("id") or "")) if args is not None else None


def _unfinished(escape: str) -> bool:
    return len(escape) < 2 or (escape[1] == "u" and (len(escape) < 6 or 0xD800 <= int(escape[2:], 16) < 0xDC00))


def _response(text: str, pos: int) -> str | None:
    """The response string starting at `pos`, decoded as far as it is written (None: not a string)."""
    if text[pos:pos + 1] != '"':
        return None
    end = value_end(text, pos)
    body = text[pos:end] if end is not None else text[pos:]
    if end is None:
        escapes = list(_ESCAPE.finditer(body))
        # cut a lone backslash, \u short of its digits, or a high surrogate waiting for its low half
        while escapes and escapes[-1].end() == len(body) and _unfinished(escapes[-1].group()):
            body = body[:escapes.pop().start()]
        body += '"'
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, str) else None


def _calls(text: str, pos: int, many: bool, fmt: ReplyFormat) -> tuple[list[ToolCall], bool] | None:
    """The calls written from `pos` (after the key), and whether the list of them is closed; None when they
    are not of the form a stream can send (read whole instead)."""
    out: list[ToolCall] = []
    pos = skip_space(text, pos)
    if many:
        if text[pos:pos + 1] != "[":
            return ([], False) if pos == len(text) else None
        pos = skip_space(text, pos + 1)
    while pos < len(text):
        found = streamed_call(text, pos, len(text), fmt)
        if not isinstance(found, tuple):
            if found is None and len(text) - pos > 200:
                return None  # far past where a call's head ends: not a call of this form
            out += writing_calls(found)
            return out, False
        call, end = found
        closed = skip_space(text, end)
        if text[closed:closed + 1] != "}":
            out.append(ToolCall(call.name, call.arguments, complete=False))
            return out, False
        out.append(call)
        pos = skip_space(text, closed + 1)
        if not many:
            return out, True
        if text[pos:pos + 1] == "]":
            return out, True
        if text[pos:pos + 1] != ",":
            return (out, False) if pos == len(text) else None
        pos = skip_space(text, pos + 1)
    return out, False


def _whole(text: str, fmt: ReplyFormat, out: Reply) -> Reply | None:
    """The reply read as one JSON object (None: it is not one of the form)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict):
        return None
    listed = value.get("tool_calls") if "tool_calls" in value else [value.get("tool_call")] \
        if "tool_call" in value else None
    calls = [_call(v, fmt) for v in listed] if isinstance(listed, list) and listed else None
    if calls is not None and all(c is not None for c in calls):
        out.tool_calls = [c for c in calls if c is not None]
        return out
    if isinstance(value.get("response"), str) and len(value) == 1:
        out.content = value["response"]
        return out
    return None


def parse(text: str, fmt: ReplyFormat, out: Reply, partial: bool) -> Reply:
    head = _HEAD.match(text, skip_space(text, 0))
    if head is not None and head.group(1) == "response":
        said = _response(text, head.end())
        if said is not None:  # as far as it is written (the whole of it once the object is whole)
            out.content = said
            return out
    elif head is not None:
        found = _calls(text, head.end(), head.group(1) == "tool_calls", fmt)
        if partial:
            out.tool_calls = found[0] if found is not None else []
            return out
        if found is not None and found[0] and all(c.complete for c in found[0]):
            out.tool_calls = found[0]  # the arguments as written, as they were streamed (cut off after them too)
            return out
    if partial:
        return out
    return _whole(text, fmt, out) or Reply(content=text)


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
