"""`parse_reply`: a reply split by its family's parser."""

from __future__ import annotations

from collections.abc import Callable

from spekula.frontends.schema.tool_formats import (
    deepseek,
    functionary,
    generic,
    harmony,
    hermes,
    llama3,
    mistral,
    qwen_xml,
)
from spekula.frontends.schema.tool_formats.reply import Reply, ReplyFormat

Parser = Callable[[str, ReplyFormat, Reply, bool], Reply]

# by ReplyFormat.family; "" (and any family whose calls are not parsed) splits <think> only
PARSERS: dict[str, Parser] = {
    "": hermes.parse, "json": hermes.parse, "xml": qwen_xml.parse, "llama3": llama3.parse_llama3,
    "functionary_v31": llama3.parse_functionary_v31, "functionary_v32": functionary.parse,
    "mistral_nemo": mistral.parse, "mistral_small": mistral.parse, "ministral3": mistral.parse, "harmony": harmony.parse,
    "deepseek_r1": deepseek.parse, "deepseek_v31": deepseek.parse, "generic": generic.parse,
}


def parse_reply(text: str, fmt: ReplyFormat, *, partial: bool = False) -> Reply:
    """Split `text`; `partial`: the reply so far, holding back any unfinished tag, and the call being
    written with its arguments so far (`complete` False)."""
    return PARSERS[fmt.family](fmt.content_prefix + text, fmt, Reply(), partial)
