"""A chat reply as Responses API output items: a `reasoning` item (the reasoning, as `reasoning_text`), a
`message` item (the content, as one `output_text` part), then one `function_call` item per call (`call_id`,
`name`, `arguments`), whole (`output_items`) or streamed (`ItemStream`), one item open at a time:

    reasoning      response.output_item.added, response.reasoning_text.delta ..., response.reasoning_text.done,
                   response.output_item.done
    message        response.output_item.added, response.content_part.added, response.output_text.delta ...,
                   response.output_text.done, response.content_part.done, response.output_item.done
    function_call  response.output_item.added, response.function_call_arguments.delta ...,
                   response.function_call_arguments.done, response.output_item.done

Item ids are `rs_...`, `msg_...` and `fc_<id>` with `call_id` `call_<id>`, as llama-server names them.
"""

from __future__ import annotations

import secrets
from typing import Any

from spekula.frontends.schema.chat_reply import Reply
from spekula.frontends.schema.reply_fragments import Fragment


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(mid: str, text: str, status: str) -> dict[str, Any]:
    return {"id": mid, "type": "message", "status": status, "role": "assistant",
            "content": [text_part(text)] if status == "completed" else []}


def _reasoning_item(rid: str, text: str, status: str) -> dict[str, Any]:
    return {"id": rid, "type": "reasoning", "summary": [], "encrypted_content": "", "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if status == "completed" else []}


def _call_item(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": f"fc_{call_id}", "type": "function_call", "status": status, "call_id": f"call_{call_id}",
            "name": name, "arguments": arguments}


def output_items(reply: Reply, mid: str) -> list[dict[str, Any]]:
    """An unstreamed reply's items; a reply with nothing in it is one empty message."""
    items: list[dict[str, Any]] = []
    if reply.reasoning:
        items.append(_reasoning_item(f"rs_{secrets.token_hex(12)}", reply.reasoning, "completed"))
    if reply.content or not (items or reply.tool_calls):
        items.append(message_item(mid, reply.content, "completed"))
    items += [_call_item(c.id, c.name, c.arguments, "completed") for c in reply.tool_calls]
    return items


class ItemStream:
    """Fragments in, Responses stream events out (dicts with `type` and `sequence_number`); `items`: the
    finished items, for the final `response.completed`."""

    def __init__(self, mid: str) -> None:
        self.mid = mid
        self.items: list[dict[str, Any]] = []
        self._seq = 0
        self._open: dict[str, Any] | None = None  # the open item (its final form, text still growing)
        self._text: list[str] = []  # the open item's text or arguments so far
        self._call = -1  # the reply's call index of the open function_call item

    def event(self, kind: str, **data: Any) -> dict[str, Any]:
        self._seq += 1
        return {"type": kind, "sequence_number": self._seq - 1, **data}

    @property
    def started(self) -> bool:
        return self._seq > 0

    @property
    def any_item(self) -> bool:
        return bool(self.items) or self._open is not None

    def feed(self, fragment: Fragment) -> list[dict[str, Any]]:
        if fragment.kind == "call_start":
            out = [*self.close(), *self._add(_call_item(fragment.call_id, fragment.name, "", "in_progress"))]
            self._call = fragment.index
            return out
        if fragment.kind == "call_arguments":
            if self._open is None or self._open["type"] != "function_call" or self._call != fragment.index:
                raise ValueError(f"arguments of call {fragment.index} outside its item")
            self._text.append(fragment.text)
            return [self.event("response.function_call_arguments.delta", item_id=self._open["id"],
                               output_index=len(self.items), delta=fragment.text)]
        kind = "reasoning" if fragment.kind == "reasoning" else "message"
        out = [] if self._open is not None and self._open["type"] == kind else [*self.close(), *self._open_kind(kind)]
        self._text.append(fragment.text)
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        out.append(self.event(name, item_id=self._open["id"], output_index=len(self.items), content_index=0,  # type: ignore[index]
                              delta=fragment.text, **extra))
        return out

    def open_message(self) -> list[dict[str, Any]]:
        """The message item opened now (plain text, or a reply that had no item of its own)."""
        return self._open_kind("message")

    def close(self) -> list[dict[str, Any]]:
        """Close the open item, if any, with its `.done` events."""
        item, text = self._open, "".join(self._text)
        if item is None:
            return []
        at = {"item_id": item["id"], "output_index": len(self.items)}
        if item["type"] == "function_call":
            item = {**item, "arguments": text, "status": "completed"}
            out = [self.event("response.function_call_arguments.done", **at, arguments=text, name=item["name"])]
        elif item["type"] == "reasoning":
            item = _reasoning_item(item["id"], text, "completed")
            out = [self.event("response.reasoning_text.done", **at, content_index=0, text=text)]
        else:
            item = message_item(item["id"], text, "completed")
            out = [self.event("response.output_text.done", **at, content_index=0, text=text, logprobs=[]),
                   self.event("response.content_part.done", **at, content_index=0, part=text_part(text))]
        out.append(self.event("response.output_item.done", output_index=len(self.items), item=item))
        self.items.append(item)
        self._open, self._text = None, []
        return out

    def _open_kind(self, kind: str) -> list[dict[str, Any]]:
        if kind == "reasoning":
            return self._add(_reasoning_item(f"rs_{secrets.token_hex(12)}", "", "in_progress"))
        out = self._add(message_item(self.mid, "", "in_progress"))
        out.append(self.event("response.content_part.added", item_id=self.mid, output_index=len(self.items),
                              content_index=0, part=text_part("")))
        return out

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self._open, self._text = item, []
        return [self.event("response.output_item.added", output_index=len(self.items), item=item)]
