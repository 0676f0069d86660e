"""A chat model's reply -> content, reasoning and tool calls, as llama-server's --jinja parsers split it.

The interface the frontends import; the families live in frontends/schema/tool_formats/ (one module
each, `detect.py` tells them from the template). Tool calls are parsed only when the request has tools.
A call that does not parse, or names a tool the request does not have, is left in the content with
everything after it (never an error), as llama.cpp falls back to content.

Streaming (`ReplyStream`) sends OpenAI deltas: each call's index, id and name first, then its arguments
in pieces as they are written; what has been sent is a prefix of what the whole reply parses to (for a
call that parses), and text that may be the start of a tag is held back until it is known not to be one.
"""

from __future__ import annotations

from spekula.frontends.schema.tool_formats.detect import reply_format, template_family
from spekula.frontends.schema.tool_formats.parse import parse_reply
from spekula.frontends.schema.tool_formats.reply import (
    REASONING_FORMATS,
    Reply,
    ReplyFormat,
    ToolCall,
    call_id,
    limited,
    openai_message,
    with_ids,
)
from spekula.frontends.schema.tool_formats.stream import ReplyStream

__all__ = ["REASONING_FORMATS", "Reply", "ReplyFormat", "ReplyStream", "ToolCall", "call_id", "limited",
           "openai_message", "parse_reply", "reply_format", "template_family", "with_ids"]
