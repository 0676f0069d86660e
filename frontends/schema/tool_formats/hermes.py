"""Hermes 2 Pro's JSON calls (Hermes, Qwen 2.5, Qwen3, QwQ and other templates writing ``<tool_call>``
without XML parameters): ``<tool_call>{"name": .., "arguments": {..}}</tool_call>``, any number, between
content; reasoning in ``<think>``."""

from __future__ import annotations

from spekula.frontends.schema.tool_formats.json_scan import object_call, streamed_call, writing_calls
from spekula.frontends.schema.tool_formats.reply import Reply, ReplyFormat, ToolCall
from spekula.frontends.schema.tool_formats.segments import Unfinished, reasoning_then_calls

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def _call_at(text: str, pos: int, fmt: ReplyFormat) -> tuple[list[ToolCall], int] | Unfinished | None:
    close = text.find(CLOSE, pos)
    streamed = streamed_call(text, pos, close if close >= 0 else len(text), fmt)
    if close < 0:  # the call is still being written (its arguments perhaps whole, the closing tag not yet)
        return Unfinished(writing_calls(streamed))
    call = object_call(text[pos:close], fmt)
    if call is None:
        return None
    if isinstance(streamed, tuple):
        call.arguments = streamed[0].arguments  # as written, which is what a stream sent
    return [call], close + len(CLOSE)


def parse(text: str, fmt: ReplyFormat, out: Reply, partial: bool) -> Reply:
    return reasoning_then_calls(text, fmt, out, partial, (OPEN,), lambda t, p: _call_at(t, p, fmt))
