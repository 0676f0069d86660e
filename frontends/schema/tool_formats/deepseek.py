"""DeepSeek R1 and V3.1 calls, inside ``<｜tool▁calls▁begin｜>..<｜tool▁calls▁end｜>``, one per
``<｜tool▁call▁begin｜>..<｜tool▁call▁end｜>``: R1 writes ``function<｜tool▁sep｜>NAME\\n```json\\n{..}\\n````,
V3.1 ``NAME<｜tool▁sep｜>{..}``. Reasoning in ``<think>`` (the prompt opens it when thinking is on)."""

from __future__ import annotations

import re

from spekula.frontends.schema.tool_formats.json_scan import json_arguments, skip_space
from spekula.frontends.schema.tool_formats.reply import Reply, ReplyFormat, ToolCall
from spekula.frontends.schema.tool_formats.segments import Unfinished, reasoning_then_calls

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_R1_HEAD = re.compile(r"function" + SEP + r"([^\n]+)\n```json\s*")
_V31_HEAD = re.compile(r"([^<\s][^<]*?)" + SEP)


def _prefix_of(text: str, pos: int, *literals: str) -> bool:
    rest = text[pos:]
    return any(lit.startswith(rest) for lit in literals)


def _calls_at(text: str, pos: int, fmt: ReplyFormat, r1: bool) -> tuple[list[ToolCall], int] | Unfinished | None:
    calls: list[ToolCall] = []
    head = _R1_HEAD if r1 else _V31_HEAD
    while True:
        pos = skip_space(text, pos)
        if text.startswith(CALLS_END, pos):
            return calls, pos + len(CALLS_END)
        if not text.startswith(CALL_BEGIN, pos):
            return Unfinished(calls) if _prefix_of(text, pos, CALLS_END, CALL_BEGIN) else None
        pos += len(CALL_BEGIN)
        m = head.match(text, pos)
        if m is None:
            writing = re.fullmatch(r"function(<[^\n]*(\n`{0,3}j?s?o?n?)?)?" if r1 else r"[^<]*<?[^>]*", text[pos:])
            return Unfinished(calls) if writing or _prefix_of(text, pos, "function") else None
        found = json_arguments(text, m.end(), m.group(1).strip(), fmt)
        if not isinstance(found, tuple):
            return Unfinished(calls + found.calls) if isinstance(found, Unfinished) else None
        call, pos = found
        tail = re.compile(r"\s*```\s*" if r1 else r"\s*").match(text, pos)
        pos = tail.end() if tail is not None else pos
        if not text.startswith(CALL_END, pos):
            if _prefix_of(text, pos, CALL_END) or (r1 and _prefix_of(text, skip_space(text, pos), "```")):
                return Unfinished(calls + [ToolCall(call.name, call.arguments, complete=False)])
            return None
        calls.append(call)
        pos += len(CALL_END)


def parse(text: str, fmt: ReplyFormat, out: Reply, partial: bool) -> Reply:
    r1 = fmt.tool_style == "deepseek_r1"
    return reasoning_then_calls(text, fmt, out, partial, (CALLS_BEGIN,), lambda t, p: _calls_at(t, p, fmt, r1))
