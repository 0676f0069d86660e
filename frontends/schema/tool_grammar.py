"""`tool_choice` "required" or a named function, enforced: a Lark grammar (llguidance's) that admits only
well-formed calls, from the first token, in the template's call form; each call's arguments valid
against its tool's parameter schema.

Only the JSON call form (Hermes 2 Pro, Qwen 2.5, Qwen3: ``<tool_call>\\n{"name": .., "arguments": ..}
\\n</tool_call>``) is built; the XML form (Qwen3-Coder, Qwen3.5), whose parameter values are free text
between tags, is refused by the caller. The opening and closing tags are the vocabulary's own token when
it has one (Qwen's ``<tool_call>`` is a single added token), so the grammar forces what the model was
trained to write. Drafts are cut by the grammar as any other constraint's are (lossless).
"""

from __future__ import annotations

import json
from typing import Any

from spekula.core.modelfile.constraint import GrammarSpec

# One separator form, so that the model cannot wander in whitespace inside the call's JSON.
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _tag(text: str, tokenizer: Any) -> str:
    """`text` as a grammar item: its token when the vocabulary holds it as one, else the literal."""
    try:
        ids = tokenizer.encode(text, add_special=False, parse_special=True)
    except Exception:  # noqa: BLE001 - a tokenizer that cannot say: the text itself is always right
        ids = []
    return f"<[{ids[0]}]>" if len(ids) == 1 else json.dumps(text)


# Keys whose values are data or name -> schema maps, not schemas themselves (see _closed).
_DATA_KEYS = frozenset({"enum", "const", "default", "examples", "required"})
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def _closed(node: Any) -> Any:
    """`node` with every object schema that lists `properties` and says nothing of `additionalProperties`
    closed to others, as llama.cpp reads a tool's schema (common/json-schema.cpp): a forced call carries only
    the parameters the tool declares (agent frameworks refuse a call with any other)."""
    if isinstance(node, list):
        return [_closed(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: v if k in _DATA_KEYS else
           {n: _closed(s) for n, s in v.items()} if k in _SCHEMA_MAPS and isinstance(v, dict) else _closed(v)
           for k, v in node.items()}
    if isinstance(node.get("properties"), dict) and "additionalProperties" not in node:
        out["additionalProperties"] = False
    return out


def _call_schema(fn: dict[str, Any]) -> dict[str, Any]:
    params = _closed(fn.get("parameters") or {"type": "object"})
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False, "x-guidance": _COMPACT}


def forced_call_grammar(tools: list[dict[str, Any]], tokenizer: Any, *, name: str | None,
                        parallel: bool) -> GrammarSpec:
    """The grammar of a reply that is one call (`parallel`: one or more) of `name`, or of any tool."""
    functions = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    rules = [f"fn{i}: %json {json.dumps(_call_schema(fn))}" for i, fn in enumerate(functions)]
    body = " | ".join(f"fn{i}" for i in range(len(functions)))
    opener, closer = _tag("<tool_call>", tokenizer), _tag("</tool_call>", tokenizer)
    more = ' ("\\n" call)*' if parallel else ""
    lines = [f"start: call{more}",
             f'call: {opener} "\\n" body "\\n" {closer}', f"body: {body}", *rules]
    return GrammarSpec("lark", "\n".join(lines) + "\n")
