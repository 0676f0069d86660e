"""Functionary v3.2's recipients: the prompt ends with ``>>>``, and every message of the reply is a
recipient line then its body: ``all\\n`` text for the user, ``NAME\\n{..}`` a call (``python\\n`` code
for the python tool); further messages start with ``>>>``. A message that is not one of these ends the
calls: it and everything after it are content, as written."""

from __future__ import annotations

import json
import re

from spekula.frontends.schema.tool_formats.json_scan import json_arguments, writing_calls
from spekula.frontends.schema.tool_formats.reply import Reply, ReplyFormat, ToolCall, held
from spekula.frontends.schema.tool_formats.segments import Unfinished

SEP = ">>>"


def parse(text: str, fmt: ReplyFormat, out: Reply, partial: bool) -> Reply:
    starts = [0, *(m.end() for m in re.finditer(re.escape(SEP), text))]
    content: list[str] = []
    for i, start in enumerate(starts):
        last = i == len(starts) - 1
        message = text[start:starts[i + 1] - len(SEP)] if not last else text[start:]
        if partial and last:
            message = message[:len(message) - held(message, (SEP,))]
        written = text[start - len(SEP) if i else 0:]  # this message and the rest, as written
        recipient, newline, body = message.partition("\n")
        if not newline:  # no recipient line (yet)
            if not (partial and last):
                content.append(written)
            break
        name = recipient.strip()
        if name == "all":
            content.append(body)
            continue
        if fmt.tool_style is not None and name == "python" and fmt.tool("python") is not None:
            if partial and last:
                break  # code runs to the end of its message: known when the message is whole
            out.tool_calls.append(ToolCall("python", json.dumps({"code": body}, ensure_ascii=False)))
            continue
        found = json_arguments(body, 0, name, fmt) if fmt.tool_style is not None else None
        if isinstance(found, tuple) and not body[found[1]:].strip():
            out.tool_calls.append(found[0])
            continue
        if partial and last and isinstance(found, Unfinished):
            out.tool_calls.extend(writing_calls(found))
            break
        content.append(written)
        break
    joined = "".join(content)
    out.content = joined.strip() if fmt.tool_style is not None else joined
    return out
