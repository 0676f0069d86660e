"""gpt-oss's harmony channels. The prompt ends with ``<|start|>assistant``; each message of the reply is a
header (`` to=RECIPIENT``, ``<|channel|>CHANNEL``, ``<|constrain|>TYPE``, in either order) then
``<|message|>`` and its body, ended by ``<|end|>`` (the next message opens with ``<|start|>assistant``)
or by ``<|call|>`` / ``<|return|>``. A message to ``functions.NAME`` is a call of NAME with the body as
its JSON arguments; ``analysis`` is reasoning; ``final`` and ``commentary`` are content; messages to other
recipients (the built-in ``python``, ``browser``, ``container``) are dropped, as llama.cpp drops them; a
message to a function that is not a call of the request's tools (unknown, or its arguments not a JSON
object) stays in the content as written.
With reasoning format "none" the analysis messages stay in the content as written."""

from __future__ import annotations

import re

from spekula.frontends.schema.tool_formats.json_scan import json_arguments
from spekula.frontends.schema.tool_formats.reply import Reply, ReplyFormat, held
from spekula.frontends.schema.tool_formats.segments import Unfinished

MESSAGE, END, START = "<|message|>", "<|end|>", "<|start|>assistant"
_ENDS = ("<|call|>", "<|return|>")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


def _messages(text: str) -> list[str]:
    """The reply's messages, each from its header to the end of its body."""
    out: list[str] = []
    for chunk in text.split(END):
        out.append(chunk[len(START):] if chunk.startswith(START) else chunk)
    return out


def parse(text: str, fmt: ReplyFormat, out: Reply, partial: bool) -> Reply:
    for end in _ENDS:
        text = text[:-len(end)] if text.endswith(end) else text
    messages = _messages(text)
    reasoning: list[str] = []
    content: list[str] = []
    for i, message in enumerate(messages):
        last = i == len(messages) - 1
        header, found, body = message.partition(MESSAGE)
        if not found:
            if not last:
                content.append(message)  # not a message: kept as written
            break
        if partial and last:
            body = body[:len(body) - held(body, (END, *_ENDS))]
        channels = _CHANNEL.findall(header)
        channel = channels[-1] if channels else ""
        recipient = next((r for r in _RECIPIENT.findall(header) if r != "assistant"), None)
        if recipient is not None:
            name = recipient[len("functions."):] if recipient.startswith("functions.") else None
            if name is None or fmt.tool_style is None:
                continue  # a built-in tool's message: dropped
            call = json_arguments(body, 0, name, fmt)
            if isinstance(call, tuple) and not body[call[1]:].strip():
                out.tool_calls.append(call[0])
            elif partial and last and isinstance(call, Unfinished):
                out.tool_calls.extend(call.calls)
            else:  # not a call of the request's tools with JSON arguments: the message stays, as written
                content.append(header + MESSAGE + body)
            continue
        if channel == "analysis":
            if fmt.thinks:
                reasoning.append(body)
            else:
                content.append(header + MESSAGE + body + ("" if last else END))
        else:
            content.append(body)
    out.reasoning = "\n".join(reasoning)
    out.content = "".join(content)
    return out


