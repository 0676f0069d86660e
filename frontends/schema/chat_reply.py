"""A chat model's reply -> content, reasoning and tool calls, as llama-server's --jinja parsers split it.

The format is told by the chat template, as llama.cpp (common/chat.cpp) tells it:
* Qwen3-Coder's XML calls (Qwen3-Coder, Qwen3.5): ``<tool_call><function=NAME><parameter=P>value
  </parameter></function></tool_call>``; a value is JSON when its schema type is not a string and it
  parses, else the text itself.
* Hermes 2 Pro's JSON calls (Hermes, Qwen 2.5, Qwen3, QwQ): ``<tool_call>{"name": .., "arguments": {..}}
  </tool_call>``.
* Reasoning in ``<think>..</think>`` (any template that writes ``<think>``), into `reasoning` unless
  the reasoning format is "none"; a prompt that ends inside ``<think>`` starts the reply in reasoning.

Tool calls are parsed only when the request has tools. A call that does not parse, or names a tool the
request does not have, is left in the content with everything after it (never an error), as llama.cpp
falls back to content.

Streaming re-parses the reply so far (`ReplyStream`): what has been sent is always a prefix of what the
whole reply parses to, so a streamed answer is the unstreamed one in pieces. Text that may be the start
of a tag is held back until it is known not to be one.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from spekula.core.modelfile.chat_template import is_xml_tool_call_template

REASONING_FORMATS = ("none", "auto", "deepseek")
_OPEN_CALL, _CLOSE_CALL = "<tool_call>", "</tool_call>"
_OPEN_THINK, _CLOSE_THINK = "<think>", "</think>"
_XML_CALL = re.compile(r"\s*<function=([^>\n]+)>\s*(.*?)\s*</function>\s*", re.S)
_XML_PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>\s*", re.S)


@dataclass(frozen=True)
class ReplyFormat:
    """How one request's reply is split (see `reply_format`)."""

    tool_style: str | None  # "json", "xml", or None: tool calls are not parsed
    thinks: bool  # <think> is split off into reasoning
    starts_in_reasoning: bool  # the prompt ends inside <think>
    tools: tuple[dict[str, Any], ...] = ()  # the request's function definitions ({"name", "parameters", ...})
    # reasoning format "none" after a prompt that opened <think>: the opening is given back in the content
    content_prefix: str = ""

    @property
    def active(self) -> bool:
        return self.tool_style is not None or self.thinks or bool(self.content_prefix)


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object's text
    id: str = ""


@dataclass
class Reply:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


def reply_format(template: str | None, prompt_text: str | None, *, tools: list[dict[str, Any]] | None,
                 parse_tools: bool, reasoning_format: str) -> ReplyFormat:
    """The format of a reply to `prompt_text`, rendered by `template` (None: ChatML, which knows neither)."""
    source = template or ""
    thinks = reasoning_format != "none" and _OPEN_THINK in source
    opened = _OPEN_THINK in source and (prompt_text or "").rstrip().endswith(_OPEN_THINK)
    prefix = (prompt_text or "")[(prompt_text or "").rfind(_OPEN_THINK):] if opened and not thinks else ""
    style: str | None = None
    if tools and parse_tools and _OPEN_CALL in source:
        style = "xml" if is_xml_tool_call_template(source) else "json"
    functions = tuple(t.get("function", t) for t in tools or ())
    return ReplyFormat(style, thinks, opened and thinks, functions, prefix)


def _held(text: str, tags: tuple[str, ...]) -> int:
    """How many characters at the end of `text` could begin one of `tags` (held back while streaming)."""
    for n in range(min(len(text), max(len(t) for t in tags) - 1), 0, -1):
        if any(t.startswith(text[-n:]) for t in tags):
            return n
    return 0


def parse_reply(text: str, fmt: ReplyFormat, *, partial: bool = False) -> Reply:
    """Split `text`; `partial`: the reply so far, holding back any unfinished tag or call."""
    out = Reply()
    rest = fmt.content_prefix + text
    if fmt.thinks:
        body = rest.lstrip() if not fmt.starts_in_reasoning else rest
        if fmt.starts_in_reasoning or body.startswith(_OPEN_THINK):
            inner = body if fmt.starts_in_reasoning else body[len(_OPEN_THINK):]
            end = inner.find(_CLOSE_THINK)
            if end < 0:
                keep = _held(inner, (_CLOSE_THINK,)) if partial else 0
                out.reasoning = inner[:len(inner) - keep].strip()  # unclosed: all of it is reasoning
                return out
            out.reasoning = inner[:end].strip()
            rest = inner[end + len(_CLOSE_THINK):].lstrip()
        elif partial and _OPEN_THINK.startswith(body) and body:
            return out  # maybe the opening of <think>
    if fmt.tool_style is None:
        out.content = rest
        return out
    _calls(rest, fmt, out, partial)
    return out


def _calls(text: str, fmt: ReplyFormat, out: Reply, partial: bool) -> None:
    pieces: list[str] = []
    pos = 0
    while True:
        start = text.find(_OPEN_CALL, pos)
        if start < 0:
            tail = text[pos:]
            pieces.append(tail[:len(tail) - _held(tail, (_OPEN_CALL,))] if partial else tail)
            break
        pieces.append(text[pos:start])
        end = text.find(_CLOSE_CALL, start)
        if end < 0:
            if not partial:
                pieces.append(text[start:])  # an unfinished call: content, as llama.cpp leaves it
            break
        call = _one_call(text[start + len(_OPEN_CALL):end], fmt)
        if call is None:
            pieces.append(text[start:])  # malformed: it and what follows are content
            break
        out.tool_calls.append(call)
        pos = end + len(_CLOSE_CALL)
    # stripped whether or not calls follow, so that what a stream sent is a prefix of the whole
    out.content = "".join(pieces).strip()


def _one_call(body: str, fmt: ReplyFormat) -> ToolCall | None:
    known = {str(f.get("name")): f for f in fmt.tools}
    if fmt.tool_style == "json":
        try:
            value = json.loads(body)
        except json.JSONDecodeError:
            return None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str) or value["name"] not in known:
            return None
        args = value.get("arguments", {})
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return None
        if not isinstance(args, dict):
            return None
        return ToolCall(value["name"], json.dumps(args, ensure_ascii=False))
    match = _XML_CALL.fullmatch(body)
    if match is None or match.group(1).strip() not in known:
        return None
    name = match.group(1).strip()
    props = (known[name].get("parameters") or {}).get("properties") or {}
    args: dict[str, Any] = {}
    params = match.group(2)
    pos = 0
    for p in _XML_PARAM.finditer(params):
        if p.start() != pos:
            return None
        pos = p.end()
        args[p.group(1).strip()] = _xml_value(p.group(2), props.get(p.group(1).strip()))
    if params[pos:].strip():
        return None
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


def _xml_value(raw: str, schema: Any) -> Any:
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind == "string" or (isinstance(kind, list) and "string" in kind):
        return raw
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def call_id() -> str:
    """A tool call's id: 32 random letters and digits, as llama-server makes them."""
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
    return "".join(secrets.choice(alphabet) for _ in range(32))


def with_ids(reply: Reply, ids: list[str]) -> Reply:
    """`reply` with its calls given ids from `ids`, grown as needed (so a stream and its end agree)."""
    while len(ids) < len(reply.tool_calls):
        ids.append(call_id())
    for call, cid in zip(reply.tool_calls, ids, strict=False):
        call.id = cid
    return reply


class ReplyStream:
    """A streamed reply's OpenAI deltas: each piece's new content, reasoning and finished calls."""

    def __init__(self, fmt: ReplyFormat, parallel: bool = True) -> None:
        self.fmt, self.parallel = fmt, parallel
        self.text = ""
        self.ids: list[str] = []
        self._content = self._reasoning = 0
        self._calls = 0
        self.reply = Reply()  # the reply so far, as parsed

    def feed(self, piece: str, *, final: str | None = None) -> list[dict[str, Any]]:
        """The deltas `piece` adds; `final`: the whole reply, parsed as a whole (the stream's end)."""
        self.text = final if final is not None else self.text + piece
        self.reply = reply = with_ids(limited(parse_reply(self.text, self.fmt, partial=final is None), self.parallel), self.ids)
        deltas: list[dict[str, Any]] = []
        if len(reply.reasoning) > self._reasoning:
            deltas.append({"reasoning_content": reply.reasoning[self._reasoning:]})
            self._reasoning = len(reply.reasoning)
        if len(reply.content) > self._content:
            deltas.append({"content": reply.content[self._content:]})
            self._content = len(reply.content)
        for i in range(self._calls, len(reply.tool_calls)):
            call = reply.tool_calls[i]
            deltas.append({"tool_calls": [{"index": i, "id": call.id, "type": "function",
                                           "function": {"name": call.name, "arguments": call.arguments}}]})
        self._calls = len(reply.tool_calls)
        return deltas


def limited(reply: Reply, parallel: bool) -> Reply:
    """`parallel_tool_calls: false`: the first call only, as llama-server's grammar allows one."""
    if not parallel:
        del reply.tool_calls[1:]
    return reply


def openai_message(reply: Reply) -> dict[str, Any]:
    """The reply as an OpenAI chat message, in llama-server's form: content null beside tool calls."""
    msg: dict[str, Any] = {"role": "assistant", "content": reply.content or (None if reply.tool_calls else "")}
    if reply.reasoning:
        msg["reasoning_content"] = reply.reasoning
    if reply.tool_calls:
        msg["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments},
                              "id": c.id} for c in reply.tool_calls]
    return msg
