"""A template's family, told from its source as llama.cpp (common/chat.cpp, build 11434) tells it, in its
order: Ministral 3, gpt-oss, Functionary v3.2, Qwen3-Coder XML, then the forms its differential parser
finds (DeepSeek R1 / V3.1, Mistral, Functionary v3.1, Llama 3.x, Hermes). A template of none of them that
does not write tools into the prompt gets the generic JSON form; one of them that does not (DeepSeek R1's)
keeps its call syntax, the tools told in a system message (`tools_unseen`)."""

from __future__ import annotations

from typing import Any

from spekula.core.modelfile.chat_template import is_xml_tool_call_template, renders_tools
from spekula.core.modelfile.family_messages import is_harmony_template, is_ministral3_template
from spekula.frontends.schema.tool_formats.reply import ReplyFormat

# the reasoning opening and closing tags of the families that do not use <think>
_REASONING_TAGS = {"ministral3": ("[THINK]", "[/THINK]"), "mistral_small": ("[THINK]", "[/THINK]"),
                   "mistral_nemo": ("[THINK]", "[/THINK]")}


def template_family(source: str) -> str:
    """The family of `source`'s tool calls ("" : none known)."""
    if is_ministral3_template(source):
        return "ministral3"
    if is_harmony_template(source):
        return "harmony"
    if ">>>all" in source and ">>>${recipient}" in source:
        return "functionary_v32"
    if is_xml_tool_call_template(source):
        return "xml"
    if "<｜tool▁calls▁begin｜>" in source:
        return "deepseek_v31" if "<｜tool▁call▁begin｜>'+ tool['function']['name']" in source else "deepseek_r1"
    if "[TOOL_CALLS]" in source:  # Mistral Small 3.2 names its calls' ids; Nemo writes a JSON array
        return "mistral_small" if "[CALL_ID]" in source else "mistral_nemo"
    if "<function=" in source and "<|python_tag|>" in source:
        return "functionary_v31"
    if "<|start_header_id|>ipython<|end_header_id|>" in source:
        return "llama3"
    if "<tool_call>" in source:
        return "json"
    return ""


def reasoning_tags(family: str) -> tuple[str, str]:
    return _REASONING_TAGS.get(family, ("<think>", "</think>"))


def uses_generic_form(template: str | None, tools: list[dict[str, Any]] | None, parse_tools: bool) -> bool:
    """Whether the request's tools take the generic JSON form: the template knows no call syntax."""
    return bool(tools) and parse_tools and template_family(template or "") == "" and not renders_tools(template)


def tools_unseen(template: str | None, tools: list[dict[str, Any]] | None, parse_tools: bool) -> bool:
    """Whether the template would not show the request's tools to the model (a system message must)."""
    return bool(tools) and parse_tools and not renders_tools(template)


def reply_format(template: str | None, prompt_text: str | None, *, tools: list[dict[str, Any]] | None,
                 parse_tools: bool, reasoning_format: str) -> ReplyFormat:
    """The format of a reply to `prompt_text`, rendered by `template` (None: ChatML, which knows neither)."""
    source = template or ""
    family = "generic" if uses_generic_form(template, tools, parse_tools) else template_family(source)
    opener, _closer = reasoning_tags(family)
    if family == "harmony":
        thinks, opened = reasoning_format != "none", False
    else:
        thinks = reasoning_format != "none" and opener in source
        opened = opener in source and (prompt_text or "").rstrip().endswith(opener)
    prompt = prompt_text or ""
    prefix = prompt[prompt.rfind(opener):] if opened and not thinks else ""
    style = family if tools and parse_tools and family else None
    functions = tuple(t.get("function", t) for t in tools or ())
    return ReplyFormat(style, thinks, opened and thinks, functions, prefix, family)
