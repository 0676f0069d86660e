"""Functionary v3.2's recipients: the prompt ends with ``>>>``, and every message of the reply is a
recipient line then its body: ``all\\n`` text for the user, ``NAME\\n{..}`` a call (``python\\n`` code
for the python tool); further messages start with ``>>>``."""

from __future__ import annotations

import json

from spekula.frontends.schema.tool_formats.json_scan import json_arguments
from spekula.frontends.schema.tool_formats.reply import Reply, ReplyFormat, ToolCall, held
from spekula.frontends.schema.tool_formats.segments import Unfinished

SEP = ">>>"


def parse(text: str, fmt: ReplyFormat, out: Reply, partial: bool) -> Reply:
    parts = text.split(SEP)
    content: list[str] = []
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if partial and last:
            part = part[:len(part) - held(part, (SEP,))]
        recipient, newline, body = part.partition("\n")
        if not newline:
            if not partial or not last:
                content.append(SEP.join(parts[i:]) if i else part)  # no recipient line: content
            break
        name = recipient.strip()
        if name == "all" or fmt.tool_style is None:
            content.append(body if name == "all" else part)
            continue
        found = json_arguments(body, 0, name, fmt) if name != "python" or fmt.tool("python") is None else None
        if name == "python" and fmt.tool("python") is not None:
            if partial and last:
                break
            out.tool_calls.append(ToolCall("python", json.dumps({"code": body}, ensure_ascii=False)))
            continue
        if isinstance(found, tuple) and not body[found[1]:].strip():
            out.tool_calls.append(found[0])
            continue
        if partial and last and isinstance(found, Unfinished):
            out.tool_calls.extend(found.calls)
            break
        content.append(SEP.join(parts[i:]) if i else text)  # not a call: the rest is content
        break
    joined = "".join(content)
    out.content = joined.strip() if fmt.tool_style is not None else joined
    return out
