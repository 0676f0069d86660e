"""Llama 3.x (3.1, 3.2, 3.3) and Functionary v3.1 calls.

Llama 3.x writes a call as the whole reply, ``{"name": .., "parameters": {..}}`` (several separated by
``;``), optionally after ``<|python_tag|>``; its built-in tools as ``<|python_tag|>brave_search.call(query="..")``,
and code for ``code_interpreter`` / ``python`` as ``<|python_tag|>`` and the code itself. Functionary
v3.1 writes ``<function=NAME>{..}</function>`` and code after ``<|python_tag|>``."""

from __future__ import annotations

import json
import re

from spekula.frontends.schema.tool_formats.json_scan import (
    json_arguments,
    object_call,
    skip_space,
    streamed_call,
    value_end,
    writing_calls,
)
from spekula.frontends.schema.tool_formats.reply import Reply, ReplyFormat, ToolCall
from spekula.frontends.schema.tool_formats.segments import Unfinished, split_calls

PYTHON_TAG = "<|python_tag|>"
_CODE_TOOLS = ("python", "code_interpreter")
_BUILTIN = re.compile(r"(\w+)\.call\((.*)\)\s*", re.S)
_KWARG = re.compile(r'\s*(\w+)\s*=\s*("(?:[^"\\]|\\.)*"|[^,]+?)\s*(?:,|$)', re.S)
_FUNCTION = re.compile(r"([^>\s]+)>")


def _json_calls(text: str, pos: int, fmt: ReplyFormat) -> tuple[list[ToolCall], int] | Unfinished | None:
    """One or more call objects from `pos` to the end of the reply, separated by ``;``."""
    calls: list[ToolCall] = []
    while True:
        pos = skip_space(text, pos)
        end = value_end(text, pos)
        written = streamed_call(text, pos, len(text), fmt, ("parameters", "arguments"))
        if end is None:  # the object is still being written
            return Unfinished(calls + writing_calls(written))
        call = object_call(text[pos:end], fmt, "parameters") or object_call(text[pos:end], fmt)
        if call is None:
            return None
        if isinstance(written, tuple):
            call.arguments = written[0].arguments  # as written, which is what a stream sent
        calls.append(call)
        pos = skip_space(text, end)
        if not text.startswith(";", pos):
            return (calls, pos) if pos == len(text) else None
        pos += 1


def _may_be_call(text: str) -> bool:
    """Whether `text` begins (or may yet begin) a call object rather than other JSON or prose."""
    return re.match(r'\{\s*"(name|type)"', text) is not None or re.fullmatch(r'\{\s*("[a-z]{0,4})?', text) is not None


def _code_tool(fmt: ReplyFormat) -> str | None:
    return next((name for name in _CODE_TOOLS if fmt.tool(name) is not None), None)


def _python_tag_at(text: str, pos: int, fmt: ReplyFormat,
                   partial: bool) -> tuple[list[ToolCall], int] | Unfinished | None:
    rest = text[pos:].strip()
    if not rest or rest.startswith("{"):
        return _json_calls(text, pos, fmt) if rest else Unfinished()
    builtin = _BUILTIN.fullmatch(text, skip_space(text, pos))
    if builtin is not None and fmt.tool(builtin.group(1)) is not None:
        args: dict[str, object] = {}
        for kw in _KWARG.finditer(builtin.group(2)):
            try:
                args[kw.group(1)] = json.loads(kw.group(2))
            except json.JSONDecodeError:
                args[kw.group(1)] = kw.group(2)
        return [ToolCall(builtin.group(1), json.dumps(args, ensure_ascii=False))], len(text)
    code_tool = _code_tool(fmt)
    if code_tool is None:
        return None
    if partial:  # code runs to the end of the reply: known only when the reply is whole
        return Unfinished()
    return [ToolCall(code_tool, json.dumps({"code": rest}, ensure_ascii=False))], len(text)


def _function_at(text: str, pos: int, fmt: ReplyFormat) -> tuple[list[ToolCall], int] | Unfinished | None:
    head = _FUNCTION.match(text, pos)
    if head is None:
        return Unfinished() if re.fullmatch(r"[^>\s]*", text[pos:]) else None
    close = text.find("</function>", head.end())
    found = json_arguments(text[:close] if close >= 0 else text, head.end(), head.group(1), fmt)
    if close < 0:
        return Unfinished(writing_calls(found)) if found is not None else None
    if not isinstance(found, tuple) or text[found[1]:close].strip():
        return None
    return [found[0]], close + len("</function>")


def parse_llama3(text: str, fmt: ReplyFormat, out: Reply, partial: bool) -> Reply:
    if fmt.tool_style is None:
        out.content = text
        return out
    start = skip_space(text, 0)
    if _may_be_call(text[start:]):  # a reply that is calls from its first character
        found = _json_calls(text, start, fmt)
        if isinstance(found, Unfinished) and partial:
            out.tool_calls.extend(found.calls)
            return out
        if isinstance(found, tuple):
            out.tool_calls.extend(found[0])
            return out
    split_calls(text, (PYTHON_TAG,), lambda t, p: _python_tag_at(t, p, fmt, partial), out, partial)
    return out


def parse_functionary_v31(text: str, fmt: ReplyFormat, out: Reply, partial: bool) -> Reply:
    if fmt.tool_style is None:
        out.content = text
        return out

    def call_at(t: str, p: int) -> tuple[list[ToolCall], int] | Unfinished | None:
        if t.startswith("<function=", p - len("<function=")) and not t.startswith(PYTHON_TAG, p - len(PYTHON_TAG)):
            return _function_at(t, p, fmt)
        return _python_tag_at(t, p, fmt, partial)

    split_calls(text, ("<function=", PYTHON_TAG), call_at, out, partial)
    return out
