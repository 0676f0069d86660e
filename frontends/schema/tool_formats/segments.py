"""The two shapes most families' replies take: reasoning between an opening and a closing tag first, then
content with calls cut out of it wherever an opener starts one.

A call parser gets the text and the index after the opener and answers the calls it read and where they
end, `Unfinished` when the text ends inside them (with the call being written, for streaming), or None
when what follows the opener is not a call: then it and everything after it is content, never an error,
as llama.cpp falls back to content."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from spekula.frontends.schema.tool_formats.reply import Reply, ReplyFormat, ToolCall, held


@dataclass
class Unfinished:
    """The text ends inside calls: those read so far, the last one possibly still being written (its
    arguments a prefix, `complete` False), which a stream may send."""

    calls: list[ToolCall] = field(default_factory=list)

    @staticmethod
    def writing(call: ToolCall | None) -> Unfinished:
        return Unfinished([call] if call is not None else [])


CallParser = Callable[[str, int], "tuple[list[ToolCall], int] | Unfinished | None"]


def split_reasoning(text: str, fmt: ReplyFormat, out: Reply, partial: bool, opener: str = "<think>",
                    closer: str = "</think>") -> str | None:
    """Move the leading reasoning of `text` into `out.reasoning`; the rest, or None while it is unfinished."""
    if not fmt.thinks:
        return text
    body = text if fmt.starts_in_reasoning else text.lstrip()
    if fmt.starts_in_reasoning or body.startswith(opener):
        inner = body if fmt.starts_in_reasoning else body[len(opener):]
        end = inner.find(closer)
        if end < 0:
            keep = held(inner, (closer,)) if partial else 0
            out.reasoning = inner[:len(inner) - keep].strip()  # unclosed: all of it is reasoning
            return None
        out.reasoning = inner[:end].strip()
        return inner[end + len(closer):].lstrip()
    if partial and body and opener.startswith(body):
        return None  # maybe the opening tag
    return text


def split_calls(text: str, openers: tuple[str, ...], parse_at: CallParser, out: Reply, partial: bool,
                *, strip: bool = True) -> None:
    """Content and calls of `text`: each opener hands over to `parse_at`."""
    pieces: list[str] = []
    pos = 0
    while True:
        found = [(i, o) for o in openers if (i := text.find(o, pos)) >= 0]
        if not found:
            tail = text[pos:]
            pieces.append(tail[:len(tail) - held(tail, openers)] if partial else tail)
            break
        start, opener = min(found)
        pieces.append(text[pos:start])
        result = parse_at(text, start + len(opener))
        if isinstance(result, Unfinished):
            if not partial:
                pieces.append(text[start:])  # an unfinished call: content, as llama.cpp leaves it
            else:
                out.tool_calls.extend(result.calls)
            break
        if result is None:
            pieces.append(text[start:])  # malformed: it and what follows are content
            break
        out.tool_calls.extend(result[0])
        pos = result[1]
    # stripped whether or not calls follow, so that what a stream sent is a prefix of the whole
    content = "".join(pieces)
    out.content = content.strip() if strip else content


def reasoning_then_calls(text: str, fmt: ReplyFormat, out: Reply, partial: bool, openers: tuple[str, ...],
                         parse_at: CallParser, think: tuple[str, str] = ("<think>", "</think>")) -> Reply:
    """Both shapes in turn, as most families reply: reasoning first, then content with its calls (the
    calls only when the request has tools)."""
    rest = split_reasoning(text, fmt, out, partial, *think)
    if rest is None:
        return out
    if fmt.tool_style is None:
        out.content = rest
        return out
    split_calls(rest, openers, parse_at, out, partial)
    return out
