"""Qwen3-Coder's XML calls (Qwen3-Coder, Qwen3.5, Nemotron Nano 3): ``<tool_call>\\n<function=NAME>\\n
<parameter=P>\\nvalue\\n</parameter>\\n</function>\\n</tool_call>``. A value is JSON when its schema type
is not a string and it parses, else the text itself. The arguments are written as JSON in the order the
parameters come (``{"P": value, ...}``), so a stream sends each parameter as it is read, and a string
value character by character."""

from __future__ import annotations

import json
import re
from typing import Any

from spekula.frontends.schema.tool_formats.json_scan import skip_space
from spekula.frontends.schema.tool_formats.reply import Reply, ReplyFormat, ToolCall, held
from spekula.frontends.schema.tool_formats.segments import Unfinished, reasoning_then_calls

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>\s*")
_PARAM = re.compile(r"<parameter=([^>\n]+)>\n?")
_PARAM_END = "</parameter>"
_FUNCTION_END = re.compile(r"\s*</function>\s*")


def _is_string(schema: Any) -> bool:
    kind = schema.get("type") if isinstance(schema, dict) else None
    return kind == "string" or (isinstance(kind, list) and "string" in kind)


def _value(raw: str, schema: Any) -> Any:
    if _is_string(schema):
        return raw
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def _may_continue(rest: str) -> bool:
    """Whether `rest` (after a call's last parameter) may still become a parameter or the call's end."""
    if "<parameter=".startswith(rest) or (rest.startswith("<parameter=") and ">" not in rest):
        return True
    closing = re.match(r"</function>\s*", rest)
    return CLOSE.startswith(rest[closing.end():]) if closing is not None else "</function>".startswith(rest)


def _call_at(text: str, pos: int, fmt: ReplyFormat) -> tuple[list[ToolCall], int] | Unfinished | None:
    fn = _FUNCTION.match(text, pos)
    if fn is None:
        rest = text[pos:].lstrip()
        writing = "<function=".startswith(rest) or (rest.startswith("<function=") and not re.search("[>\n]", rest))
        return Unfinished() if writing else None
    name = fn.group(1).strip()
    tool = fmt.tool(name)
    if tool is None:
        return None
    props = (tool.get("parameters") or {}).get("properties") or {}
    fields: list[str] = []
    pos = fn.end()
    while (param := _PARAM.match(text, pos)) is not None:
        key = param.group(1).strip()
        end = text.find(_PARAM_END, param.end())
        if end < 0:
            return Unfinished.writing(_open_call(name, fields, key, text[param.end():], props.get(key)))
        raw = text[param.end():end]
        raw = raw[:-1] if raw.endswith("\n") else raw
        value = json.dumps(_value(raw, props.get(key)), ensure_ascii=False)
        fields.append(f"{json.dumps(key, ensure_ascii=False)}: {value}")
        pos = skip_space(text, end + len(_PARAM_END))
    done = _FUNCTION_END.match(text, pos)
    if done is not None and text.startswith(CLOSE, done.end()):
        return [ToolCall(name, "{" + ", ".join(fields) + "}")], done.end() + len(CLOSE)
    if _may_continue(text[pos:]):
        return Unfinished.writing(ToolCall(name, "{" + ", ".join(fields), complete=False))
    return None


def _open_call(name: str, fields: list[str], key: str, value: str, schema: Any) -> ToolCall:
    """The call so far, inside parameter `key` whose text so far is `value`."""
    head = "{" + ", ".join([*fields, ""]) if fields else "{"
    head += json.dumps(key, ensure_ascii=False) + ": "
    if _is_string(schema):
        safe = value[:len(value) - held(value, ("\n" + _PARAM_END, _PARAM_END))]
        head += json.dumps(safe, ensure_ascii=False)[:-1]
    return ToolCall(name, head, complete=False)


def parse(text: str, fmt: ReplyFormat, out: Reply, partial: bool) -> Reply:
    return reasoning_then_calls(text, fmt, out, partial, (OPEN,), lambda t, p: _call_at(t, p, fmt))
