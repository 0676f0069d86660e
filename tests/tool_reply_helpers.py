"""What the tool-reply tests share: function tools from a few typed properties, the sdist's templates,
a request's reply format told through its template, and streamed deltas added up."""

from __future__ import annotations

import json
from functools import cache
from typing import Any

from llamacpp_sdist import read_source

from spekula.core.modelfile.chat_template import render_chat
from spekula.frontends.schema.chat_reply import Reply, ReplyFormat, reply_format

USER = [{"role": "user", "content": "Hi"}]


def tool(name: str, **props: str) -> dict[str, Any]:
    """A function tool whose parameters are these required properties of these JSON types."""
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {k: {"type": v} for k, v in props.items()}, "required": list(props)}}}


@cache
def template(name: str) -> str:
    return read_source(f"models/templates/{name}.jinja")


def format_for(name: str, tools: list[dict[str, Any]] | None, *, reasoning: str = "auto",
               thinking: bool = True) -> ReplyFormat:
    """The reply format of a one-message chat with `tools` rendered by template `name`."""
    prompt = render_chat(template(name), USER, tools=tools, enable_thinking=thinking)
    return reply_format(template(name), prompt, tools=tools, parse_tools=True, reasoning_format=reasoning)


def calls_of(reply: Reply) -> list[tuple[str, Any]]:
    return [(c.name, json.loads(c.arguments)) for c in reply.tool_calls]


def added_up(deltas: list[dict[str, Any]]) -> tuple[str, str, list[tuple[int, str, str, str]]]:
    """Content, reasoning and (index, id, name, arguments) per call that OpenAI-style deltas add up to:
    a call's head (index, id, name) first, then its arguments in pieces."""
    calls: dict[int, list[str]] = {}
    for d in deltas:
        for c in d.get("tool_calls", []):
            if "id" in c:
                calls[c["index"]] = [c["id"], c["function"]["name"], c["function"]["arguments"]]
            else:
                calls[c["index"]][2] += c["function"]["arguments"]
    return ("".join(d.get("content", "") for d in deltas), "".join(d.get("reasoning_content", "") for d in deltas),
            [(i, *v) for i, v in sorted(calls.items())])  # type: ignore[misc]
