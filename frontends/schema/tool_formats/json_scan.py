"""Where a JSON value written by a model ends, found without parsing it: calls are cut out of free text,
and a call still being written streams its arguments as they come.

The scan moves by regular-expression tokens (strings whole, brackets, runs of anything else), so a long
argument costs a few C-speed matches rather than a Python step per character."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from spekula.frontends.schema.tool_formats.reply import ReplyFormat, ToolCall, arguments_text, object_text
from spekula.frontends.schema.tool_formats.segments import Unfinished

# strings in the unrolled, possessive form: an unterminated one fails in one pass, without backtracking
_TOKEN = re.compile(r'"[^"\\]*+(?:\\.[^"\\]*+)*+"|"|[{}\[\]]|[^"{}\[\]]+', re.S)
_SCALAR = re.compile(r'-?[0-9][0-9.eE+-]*|true|false|null')
_SPACE = re.compile(r"\s*")


def skip_space(text: str, pos: int) -> int:
    return _SPACE.match(text, pos).end()  # type: ignore[union-attr]


# A stream's memo of how far each bracketed value was scanned (see `scan_memo`), keyed by where it starts:
# (end of the last whole token scanned, depth there, hash of the text scanned), checked before it is used.
_MEMO: ContextVar[dict[int, tuple[int, int, int]] | None] = ContextVar("json_scan_memo", default=None)


@contextmanager
def scan_memo(memo: dict[int, tuple[int, int, int]]) -> Iterator[None]:
    """Scans inside resume from `memo` (one stream's, whose text only grows), so that a long value being
    written is not rescanned from its start on every piece."""
    token = _MEMO.set(memo)
    try:
        yield
    finally:
        _MEMO.reset(token)


def value_end(text: str, start: int) -> int | None:
    """The index just past the JSON value starting at `start` (no leading space), or None when `text`
    ends before it does. A value that is not JSON ends where its scan stops; json.loads judges it."""
    if start >= len(text):
        return None
    first = text[start]
    if first in "{[":
        memo = _MEMO.get()
        pos, depth = start, 0
        if memo is not None and start in memo:
            seen, seen_depth, digest = memo[start]
            if seen <= len(text) and hash(text[start:seen]) == digest:
                pos, depth = seen, seen_depth
        for m in _TOKEN.finditer(text, pos):
            tok = m.group()
            if tok in ("{", "["):
                depth += 1
            elif tok in ("}", "]"):
                depth -= 1
                if depth == 0:
                    return m.end()
            elif tok == '"':
                break  # a string still open
            if memo is not None and m.end() < len(text):  # a whole token: scanning may resume after it
                pos = m.end()
                memo[start] = (pos, depth, 0)
        if memo is not None and start in memo and memo[start][2] == 0:
            seen, seen_depth, _ = memo[start]
            memo[start] = (seen, seen_depth, hash(text[start:seen]))
        return None
    if first == '"':
        m = _TOKEN.match(text, start)
        return m.end() if m is not None and m.group() != '"' else None
    m = _SCALAR.match(text, start)
    if m is None:
        return start + 1
    return m.end() if m.end() < len(text) else None


def first_member_done(args: str) -> bool:
    """Whether an object's text so far holds its first member whole (a comma at its top level follows it)."""
    depth = 0
    for m in _TOKEN.finditer(args):
        tok = m.group()
        if tok in ("{", "["):
            depth += 1
        elif tok in ("}", "]"):
            depth -= 1
        elif tok == '"':
            return False  # a string still open: its commas are text
        elif depth == 1 and tok[0] != '"' and "," in tok:
            return True
    return False


# A call object's head as models write it: {"name": "NAME", "arguments": (or "parameters"), optionally
# after "type": "function"; its arguments follow.
_CALL_HEAD = re.compile(r'\{\s*(?:"type"\s*:\s*"function"\s*,\s*)?"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*'
                        r'"(arguments|parameters)"\s*:\s*')


def call_head(text: str, pos: int) -> tuple[str, str, int] | None:
    """(name, its arguments' key, index where the arguments begin) when a call object's head starts at `pos`."""
    m = _CALL_HEAD.match(text, pos)
    if m is None:
        return None
    try:
        name = json.loads(f'"{m.group(1)}"')
    except json.JSONDecodeError:
        return None
    return name, m.group(2), m.end()


def json_arguments(text: str, pos: int, name: str, fmt: ReplyFormat) -> tuple[ToolCall, int] | Unfinished | None:
    """The call of `name` whose JSON arguments start at `pos` (after spaces): the call and where its
    arguments end, Unfinished while they are being written (streamed when they are an object), None
    when `name` is not one of the request's tools or the arguments are not a JSON object."""
    if fmt.tool(name) is None:
        return None
    pos = skip_space(text, pos)
    end = value_end(text, pos)
    if end is None:
        return Unfinished.writing(ToolCall(name, text[pos:], complete=False) if text[pos:pos + 1] == "{" else None)
    args = object_text(text[pos:end])
    return (ToolCall(name, args), end) if args is not None else None


def streamed_call(text: str, pos: int, end: int, fmt: ReplyFormat,
                  keys: tuple[str, ...] = ("arguments",)) -> tuple[ToolCall, int] | Unfinished | None:
    """A call object at `pos` written name first, arguments an object (the form a stream can send in
    pieces): the call and where its arguments end, Unfinished while they are being written; None when the
    object is not of that form (the caller then reads it whole)."""
    head = call_head(text[:end], skip_space(text, pos))
    if head is None or head[1] not in keys or text[head[2]:head[2] + 1] != "{":
        return None
    return json_arguments(text[:end], head[2], head[0], fmt)


def object_call(body: str, fmt: ReplyFormat, key: str = "arguments") -> ToolCall | None:
    """A whole call object `{"name": .., key: ..}`, read as JSON (any key order, arguments as a string)."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    name = value.get("name") if isinstance(value, dict) else None
    if not isinstance(name, str) or fmt.tool(name) is None:
        return None
    args = arguments_text(value.get(key, {}))
    return ToolCall(name, args, id=str(value.get("id") or "")) if args is not None else None


def writing_calls(found: tuple[ToolCall, int] | Unfinished | None) -> list[ToolCall]:
    """The calls a stream may send of `found` (a json_arguments or streamed_call answer) while its call is
    not closed yet: a call whose arguments are written is still being written (`complete` False)."""
    if isinstance(found, tuple):
        return [ToolCall(found[0].name, found[0].arguments, found[0].id, complete=False)]
    return found.calls if isinstance(found, Unfinished) else []
