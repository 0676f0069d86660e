"""A streamed reply as OpenAI deltas: new reasoning and content, and each call as it is written (its
index, id and name first, then its arguments in pieces).

Each piece re-parses the reply so far with the family's parser in partial mode; what was sent is
remembered per field, so a delta is what the parse adds to it. A call's arguments grow only by what
extends what was sent: the parsers give a call being written the arguments as they will be once it is
finished (raw JSON as written, or Qwen3-Coder's parameters as JSON in their order), so for a call that
parses the pieces add up to the unstreamed arguments. A call that turns out malformed after its name was
sent cannot be taken back; the unstreamed reply has it in the content."""

from __future__ import annotations

from typing import Any

from spekula.frontends.schema.tool_formats.json_scan import first_member_done, scan_memo
from spekula.frontends.schema.tool_formats.parse import parse_reply
from spekula.frontends.schema.tool_formats.reply import Reply, ReplyFormat, limited, with_ids


class ReplyStream:
    """One streamed reply's deltas; `reply` is the reply so far (whole at the stream's end)."""

    def __init__(self, fmt: ReplyFormat, parallel: bool = True) -> None:
        self.fmt, self.parallel = fmt, parallel
        self.text = ""
        self.ids: list[str] = []
        self._content = self._reasoning = 0
        self._sent_args: list[str] = []  # per call, the arguments sent so far
        self.reply = Reply()
        self._scans: dict[int, tuple[int, int, int]] = {}  # json_scan's memo for this stream's text

    def feed(self, piece: str, *, final: str | None = None) -> list[dict[str, Any]]:
        """The deltas `piece` adds; `final`: the whole reply, parsed as a whole (the stream's end)."""
        self.text = final if final is not None else self.text + piece
        with scan_memo(self._scans):
            reply = limited(parse_reply(self.text, self.fmt, partial=final is None), self.parallel)
        self.reply = with_ids(reply, self.ids)
        deltas: list[dict[str, Any]] = []
        if len(reply.reasoning) > self._reasoning:
            deltas.append({"reasoning_content": reply.reasoning[self._reasoning:]})
            self._reasoning = len(reply.reasoning)
        if len(reply.content) > self._content:
            deltas.append({"content": reply.content[self._content:]})
            self._content = len(reply.content)
        for i, call in enumerate(reply.tool_calls):
            if i == len(self._sent_args) and not call.complete and not first_member_done(call.arguments):
                break  # a call is announced once a first argument is written whole, so that a call that is
                # malformed from its start (or cut off at once) is never sent
            if i == len(self._sent_args):
                self._sent_args.append(call.arguments)
                deltas.append({"tool_calls": [{"index": i, "id": call.id, "type": "function",
                                               "function": {"name": call.name, "arguments": call.arguments}}]})
                continue
            sent = self._sent_args[i]
            if len(call.arguments) > len(sent) and call.arguments.startswith(sent):
                self._sent_args[i] = call.arguments
                deltas.append({"tool_calls": [{"index": i, "function": {"arguments": call.arguments[len(sent):]}}]})
        return deltas
