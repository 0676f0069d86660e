"""Mistral's calls after ``[TOOL_CALLS]``: a JSON array of call objects (Mistral Nemo: ``[TOOL_CALLS][{"name":
.., "arguments": {..}, "id": ".."}]``) or, in the newer form, ``[TOOL_CALLS]NAME[ARGS]{..}`` per call
(Ministral 3, Devstral; Mistral Small 3.2 adds ``[CALL_ID]ID`` before ``[ARGS]``). Ministral 3 reasons in
``[THINK]..[/THINK]``. Ids the model writes are kept."""

from __future__ import annotations

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
from spekula.frontends.schema.tool_formats.segments import Unfinished, reasoning_then_calls

OPEN = "[TOOL_CALLS]"
THINK, END_THINK = "[THINK]", "[/THINK]"
_NAMED = re.compile(r"([^\[\s]+)(?:\[CALL_ID\]([^\[\s]*))?\[ARGS\]")


def _array_at(text: str, pos: int, fmt: ReplyFormat) -> tuple[list[ToolCall], int] | Unfinished | None:
    calls: list[ToolCall] = []
    pos = skip_space(text, pos) + 1  # past "["
    while True:
        pos = skip_space(text, pos)
        if pos >= len(text):
            return Unfinished(calls)
        if text[pos] == "]" and calls:
            return calls, pos + 1
        end = value_end(text, pos)
        written = streamed_call(text, pos, len(text), fmt)
        if end is None:  # the object is still being written
            return Unfinished(calls + writing_calls(written))
        call = object_call(text[pos:end], fmt)
        if call is None:
            return None
        if isinstance(written, tuple):
            call.arguments = written[0].arguments  # as written, which is what a stream sent
        calls.append(call)
        pos = skip_space(text, end)
        if text.startswith(",", pos):
            pos += 1
        elif pos < len(text) and text[pos] != "]":
            return None


def _call_at(text: str, pos: int, fmt: ReplyFormat) -> tuple[list[ToolCall], int] | Unfinished | None:
    start = skip_space(text, pos)
    if text.startswith("[", start):
        return _array_at(text, start, fmt)
    named = _NAMED.match(text, start)
    if named is None:
        return Unfinished() if re.fullmatch(r"[^\[\s]*(\[[A-Z_]*\]?[^\[\s]*)?(\[[A-Z]*)?", text[start:]) else None
    found = json_arguments(text, named.end(), named.group(1), fmt)
    if isinstance(found, tuple):
        found[0].id = named.group(2) or ""
        return [found[0]], found[1]
    return found


def parse(text: str, fmt: ReplyFormat, out: Reply, partial: bool) -> Reply:
    return reasoning_then_calls(text, fmt, out, partial, (OPEN,), lambda t, p: _call_at(t, p, fmt),
                                (THINK, END_THINK))
