"""The rewrites llama-server makes to a chat's messages before rendering the template of one family.

llama.cpp (common/parsers/*.cpp) hands some templates messages rebuilt for them:
* gpt-oss (a template with ``<|channel|>``): an assistant's ``reasoning_content`` goes to the
  ``thinking`` field the template renders as the analysis channel; with tool calls, its ``content`` is
  dropped (the template refuses both at once).
* Ministral / Mistral Large 3 (``[SYSTEM_PROMPT]``, ``[TOOL_CALLS]`` and ``[ARGS]``, no ``[CALL_ID]``):
  system and assistant contents become lists of blocks, a ``thinking`` block with the reasoning first,
  then the text.

Gemma 4's older template (without the "OpenAI Chat Completions" comment of the current one) has its tool
messages folded into ``tool_responses`` by llama-server; that rewrite is not made here, and such a
template renders tool messages as the template itself does.
"""

from __future__ import annotations

from typing import Any


def is_harmony_template(source: str) -> bool:
    return "<|channel|>" in source


def is_ministral3_template(source: str) -> bool:
    return all(tag in source for tag in ("[SYSTEM_PROMPT]", "[TOOL_CALLS]", "[ARGS]")) and "[CALL_ID]" not in source


def _harmony(message: dict[str, Any]) -> dict[str, Any]:
    reasoning = message.get("reasoning_content")
    if not isinstance(reasoning, str):
        return message
    out = {**message, "thinking": reasoning}
    if isinstance(out.get("tool_calls"), list) and out["tool_calls"]:
        out.pop("content", None)
    return out


def _ministral3(message: dict[str, Any]) -> dict[str, Any]:
    if message.get("role") not in ("system", "assistant"):
        return message
    blocks: list[Any] = []
    reasoning = message.get("reasoning_content")
    if isinstance(reasoning, str):
        blocks.append({"type": "thinking", "thinking": reasoning})
    content = message.get("content")
    if isinstance(content, str):
        blocks.append({"type": "text", "text": content})
    elif isinstance(content, list):
        blocks.extend(content)
    out = {**message, "content": blocks}
    out.pop("reasoning_content", None)
    return out


def family_messages(source: str, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` as llama-server hands them to the template `source` (unchanged for other families)."""
    if is_ministral3_template(source):
        return [_ministral3(m) for m in messages]
    if is_harmony_template(source):
        return [_harmony(m) for m in messages]
    return messages
