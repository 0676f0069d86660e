"""A streamed chat reply as ordered fragments, for the APIs whose streams are not OpenAI chat deltas
(Anthropic's content blocks, the Responses API's output items, the socket's chat chunks).

`ReplyStream` (frontends/schema/chat_reply.py) yields OpenAI chat deltas. A tool call's delta may be
whole (index, id, name and all its arguments at once) or in OpenAI's fragment style (index, id and name
first, then entries with the index and a piece of the arguments): both are read here, so that the
frontends built on these fragments do not depend on which one `ReplyStream` sends. A call's start is
the first entry seen for its index; every later `arguments` text is appended to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from spekula.frontends.schema.chat_reply import (
    Reply,
    ReplyFormat,
    ReplyStream,
    limited,
    parse_reply,
    with_ids,
)

FragmentKind = Literal["reasoning", "content", "call_start", "call_arguments"]


@dataclass(frozen=True)
class Fragment:
    kind: FragmentKind
    text: str = ""  # reasoning or content text, or a piece of a call's arguments (JSON text)
    index: int = -1  # the call's position in the reply (call_start, call_arguments)
    call_id: str = ""  # call_start only
    name: str = ""  # call_start only


class ReplyFragments:
    """Feed a reply's pieces; get its fragments in order. A format that parses nothing passes the text on."""

    def __init__(self, fmt: ReplyFormat, parallel: bool = True) -> None:
        self.fmt = fmt
        self._stream = ReplyStream(fmt, parallel)
        self._started: set[int] = set()
        self._plain: list[str] = []  # the text, when the format parses nothing

    @property
    def reply(self) -> Reply:
        """The reply so far (the whole reply once `final` was fed)."""
        if not self.fmt.active:
            return Reply(content="".join(self._plain))
        return self._stream.reply

    def feed(self, piece: str, *, final: str | None = None) -> list[Fragment]:
        """The fragments `piece` adds; `final`: the whole reply (the stream's end)."""
        if not self.fmt.active:
            if final is not None:
                return []
            self._plain.append(piece)
            return [Fragment("content", piece)] if piece else []
        out: list[Fragment] = []
        for delta in self._stream.feed(piece, final=final):
            if delta.get("reasoning_content"):
                out.append(Fragment("reasoning", delta["reasoning_content"]))
            if delta.get("content"):
                out.append(Fragment("content", delta["content"]))
            for entry in delta.get("tool_calls") or ():
                out.extend(self._call(entry))
        return out

    def _call(self, entry: dict[str, Any]) -> list[Fragment]:
        index = int(entry["index"])
        fn = entry.get("function") or {}
        out: list[Fragment] = []
        if index not in self._started:
            self._started.add(index)
            out.append(Fragment("call_start", index=index, call_id=str(entry.get("id") or ""),
                                name=str(fn.get("name") or "")))
        if fn.get("arguments"):
            out.append(Fragment("call_arguments", str(fn["arguments"]), index=index))
        return out


def whole_reply(text: str, fmt: ReplyFormat, parallel: bool = True) -> Reply:
    """An unstreamed reply, split (its calls given ids); a format that parses nothing keeps it as content."""
    if not fmt.active:
        return Reply(content=text)
    return with_ids(limited(parse_reply(text, fmt), parallel), [])


def openai_delta(fragment: Fragment) -> dict[str, Any]:
    """A fragment as an OpenAI chat delta, in OpenAI's fragment style for calls (the socket's chunks)."""
    if fragment.kind == "reasoning":
        return {"reasoning_content": fragment.text}
    if fragment.kind == "content":
        return {"content": fragment.text}
    if fragment.kind == "call_start":
        return {"tool_calls": [{"index": fragment.index, "id": fragment.call_id, "type": "function",
                                "function": {"name": fragment.name, "arguments": ""}}]}
    return {"tool_calls": [{"index": fragment.index, "function": {"arguments": fragment.text}}]}
