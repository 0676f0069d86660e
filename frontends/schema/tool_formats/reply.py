"""What every tool-call family shares: the parsed reply, its format, and the helpers around calls."""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

REASONING_FORMATS = ("none", "auto", "deepseek")


@dataclass(frozen=True)
class ReplyFormat:
    """How one request's reply is split (see detect.reply_format)."""

    tool_style: str | None  # the family whose calls are parsed ("json", "xml", "llama3", ...), or None
    thinks: bool  # reasoning is split off into `reasoning`
    starts_in_reasoning: bool  # the prompt ends inside the reasoning opener
    tools: tuple[dict[str, Any], ...] = ()  # the request's function definitions ({"name", "parameters", ...})
    # reasoning format "none" after a prompt that opened <think>: the opening is given back in the content
    content_prefix: str = ""
    family: str = ""  # the template's family even when calls are not parsed ("" : <think> tags only)

    @property
    def active(self) -> bool:
        return self.tool_style is not None or self.thinks or bool(self.content_prefix) or self.family in (
            "harmony", "functionary_v32", "generic")

    def tool(self, name: str) -> dict[str, Any] | None:
        return next((f for f in self.tools if f.get("name") == name), None)


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object's text (while streaming, `complete` False: a prefix of it)
    id: str = ""
    complete: bool = True


@dataclass
class Reply:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    @property
    def finished_calls(self) -> list[ToolCall]:
        return [c for c in self.tool_calls if c.complete]


def held(text: str, tags: tuple[str, ...]) -> int:
    """How many characters at the end of `text` could begin one of `tags` (held back while streaming)."""
    longest = max((len(t) for t in tags), default=1) - 1
    for n in range(min(len(text), longest), 0, -1):
        tail = text[-n:]
        if any(t.startswith(tail) for t in tags):
            return n
    return 0


def object_text(raw: str) -> str | None:
    """`raw` (JSON text) when it is one JSON object, stripped; None otherwise."""
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        return None
    return raw.strip() if isinstance(value, dict) else None


def arguments_text(value: Any) -> str | None:
    """Arguments given as a parsed value: an object's JSON text (a string holding one is decoded)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


def call_id() -> str:
    """A tool call's id: 32 random letters and digits, as llama-server makes them."""
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
    return "".join(secrets.choice(alphabet) for _ in range(32))


def with_ids(reply: Reply, ids: list[str]) -> Reply:
    """`reply` with its calls given ids from `ids`, grown as needed (so a stream and its end agree); a call
    whose id the model wrote (Mistral's) keeps it."""
    while len(ids) < len(reply.tool_calls):
        ids.append(reply.tool_calls[len(ids)].id or call_id())
    for call, cid in zip(reply.tool_calls, ids, strict=False):
        call.id = cid
    return reply


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
