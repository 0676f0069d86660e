"""A chat reply as Anthropic's content blocks: `thinking` (the reasoning), `text`, then one `tool_use` per
call, whole (`content_blocks`) or streamed (`BlockStream`: `content_block_start`, deltas, `content_block_stop`,
one block open at a time, as Anthropic streams them).

Reasoning streams as `thinking_delta`s and its block closes with an empty `signature_delta` (a local model
signs nothing); a call's block opens with its id and name and `input: {}`, and its arguments follow as
`input_json_delta` fragments whose `partial_json` pieces join to the call's JSON input.
"""

from __future__ import annotations

import json
from typing import Any

from spekula.frontends.schema.chat_reply import Reply
from spekula.frontends.schema.reply_fragments import Fragment


def _input(arguments: str) -> Any:
    try:
        return json.loads(arguments or "{}")
    except json.JSONDecodeError:  # a parsed call's arguments are JSON; kept readable should that ever change
        return {}


def content_blocks(reply: Reply) -> list[dict[str, Any]]:
    """An unstreamed reply's blocks; a reply with nothing in it is one empty text block."""
    blocks: list[dict[str, Any]] = []
    if reply.reasoning:
        blocks.append({"type": "thinking", "thinking": reply.reasoning, "signature": ""})
    if reply.content or not (blocks or reply.tool_calls):
        blocks.append({"type": "text", "text": reply.content})
    blocks += [{"type": "tool_use", "id": c.id, "name": c.name, "input": _input(c.arguments)}
               for c in reply.tool_calls]
    return blocks


class BlockStream:
    """Fragments in, content-block events out (each a dict with its `type`)."""

    def __init__(self) -> None:
        self.index = -1  # the latest block's index
        self._open: str | None = None  # its type, while it is open
        self._call = -1  # the reply's call index of the open tool_use block

    @property
    def started(self) -> bool:
        return self.index >= 0

    def feed(self, fragment: Fragment) -> list[dict[str, Any]]:
        if fragment.kind == "call_start":
            return [*self.close(), *self._start({"type": "tool_use", "id": fragment.call_id, "name": fragment.name,
                                                 "input": {}}, call=fragment.index)]
        if fragment.kind == "call_arguments":
            if self._open != "tool_use" or self._call != fragment.index:
                raise ValueError(f"arguments of call {fragment.index} outside its block")
            return [self._delta({"type": "input_json_delta", "partial_json": fragment.text})]
        out: list[dict[str, Any]] = []
        kind = "thinking" if fragment.kind == "reasoning" else "text"
        if self._open != kind:
            out += [*self.close(), *self._start({"type": kind, kind: "", **({"signature": ""} if kind == "thinking"
                                                                            else {})})]
        out.append(self._delta({"type": f"{kind}_delta", kind: fragment.text}))
        return out

    def start_text(self) -> list[dict[str, Any]]:
        """An empty text block (a reply with no block of its own still has one)."""
        return self._start({"type": "text", "text": ""})

    def close(self) -> list[dict[str, Any]]:
        """Close the open block, if any (a thinking block gets its signature first)."""
        if self._open is None:
            return []
        out = [self._delta({"type": "signature_delta", "signature": ""})] if self._open == "thinking" else []
        self._open = None
        return [*out, {"type": "content_block_stop", "index": self.index}]

    def _start(self, block: dict[str, Any], call: int = -1) -> list[dict[str, Any]]:
        self.index += 1
        self._open, self._call = block["type"], call
        return [{"type": "content_block_start", "index": self.index, "content_block": block}]

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}
