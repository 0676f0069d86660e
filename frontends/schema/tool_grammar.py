"""Tool calls held to their family's syntax by a Lark grammar (llguidance's), each call's arguments valid
against its tool's parameter schema.

* `tool_choice` "required" or a named function (`forced`): the reply is calls from its first token.
* `tool_choice` "auto" (`lazy`): the text is free until the family's call opener, after which the rest
  of the reply is well-formed calls (llama-server's lazy grammar with its trigger word). The free text
  may hold the family's reasoning tags.
* The generic JSON form (templates that know no tools): always one JSON object, a call (calls with
  `parallel`) or ``{"response": ".."}`` (not the latter when calls are forced).

Tags that are one token of the vocabulary (Qwen's ``<tool_call>``, Mistral's ``[TOOL_CALLS]``) are that
token, so the grammar forces what the model was trained to write. Drafts are cut by the grammar as any
other constraint's are (lossless). Families whose call form is not built here are refused by the caller
(`CALL_FORMS` lists the built ones).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from spekula.core.modelfile.constraint import GrammarSpec
from spekula.frontends.schema.tool_formats.detect import reasoning_tags

# One separator form, so that the model cannot wander in whitespace inside the call's JSON.
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
Tag = Callable[[str], str]


def _tag_of(tokenizer: Any) -> Tag:
    def tag(text: str) -> str:
        """`text` as a grammar item: its token when the vocabulary holds it as one, else the literal."""
        try:
            ids = tokenizer.encode(text, add_special=False, parse_special=True)
        except Exception:  # noqa: BLE001 - a tokenizer that cannot say: the text itself is always right
            ids = []
        return f"<[{ids[0]}]>" if len(ids) == 1 and len(text) > 1 else json.dumps(text)
    return tag


def _args(fn: dict[str, Any]) -> str:
    params = dict(fn.get("parameters") or {"type": "object"})
    return "%json " + json.dumps({**params, "x-guidance": _COMPACT})


def _call_object(fn: dict[str, Any], key: str = "arguments") -> str:
    params = fn.get("parameters") or {"type": "object"}
    schema = {"type": "object", "properties": {"name": {"const": fn["name"]}, key: params},
              "required": ["name", key], "additionalProperties": False, "x-guidance": _COMPACT}
    return "%json " + json.dumps(schema)


def _xml_params(fn: dict[str, Any], tag: Tag) -> str:
    """Qwen3-Coder's parameters in the schema's order, the required ones present; a string's text may not
    hold ``</`` (where its closing tag would begin)."""
    params = fn.get("parameters") or {}
    required = set(params.get("required") or ())
    items = []
    for key, schema in (params.get("properties") or {}).items():
        kind = schema.get("type") if isinstance(schema, dict) else None
        is_string = kind == "string" or (isinstance(kind, list) and "string" in kind)
        value = r"/([^<]|<[^\/])*/" if is_string else "%json " + json.dumps({**schema, "x-guidance": _COMPACT})
        item = f'"<parameter={key}>\\n" {value} "\\n</parameter>\\n"'
        items.append(f"({item})" if key in required else f"({item})?")
    return " ".join(items) or '""'


# family -> (opener, one call's body after the opener, separator between calls, closer after the last)
def _forms(tag: Tag) -> dict[str, tuple[str, Callable[[dict[str, Any]], str], str, str]]:
    return {
        "json": (tag("<tool_call>"), lambda fn: f'"\\n" {_call_object(fn)} "\\n" {tag("</tool_call>")}',
                 f'"\\n" {tag("<tool_call>")}', ""),
        "xml": (tag("<tool_call>"), lambda fn: f'"\\n<function={fn["name"]}>\\n" {_xml_params(fn, tag)} '
                                               f'"</function>\\n" {tag("</tool_call>")}',
                f'"\\n" {tag("<tool_call>")}', ""),
        "llama3": ('""', lambda fn: _call_object(fn, "parameters"), '"; "', ""),
        "mistral": (tag("[TOOL_CALLS]"), lambda fn: f'{json.dumps(fn["name"])} {tag("[ARGS]")} {_args(fn)}',
                    tag("[TOOL_CALLS]"), ""),
        "ministral3": (tag("[TOOL_CALLS]"), lambda fn: f'{json.dumps(fn["name"])} {tag("[ARGS]")} {_args(fn)}',
                       tag("[TOOL_CALLS]"), ""),
        "functionary_v31": ('"<function="', lambda fn: f'{json.dumps(fn["name"] + ">")} {_args(fn)} "</function>"',
                            '"<function="', ""),
        "functionary_v32": ('""', lambda fn: f'{json.dumps(fn["name"] + chr(10))} {_args(fn)}', '">>>"', ""),
        "deepseek_v31": (f'{tag("<｜tool▁calls▁begin｜>")} {tag("<｜tool▁call▁begin｜>")}',
                         lambda fn: f'{json.dumps(fn["name"])} {tag("<｜tool▁sep｜>")} {_args(fn)} '
                                    f'{tag("<｜tool▁call▁end｜>")}',
                         tag("<｜tool▁call▁begin｜>"), tag("<｜tool▁calls▁end｜>")),
        "deepseek_r1": (f'{tag("<｜tool▁calls▁begin｜>")} {tag("<｜tool▁call▁begin｜>")}',
                        lambda fn: f'"function" {tag("<｜tool▁sep｜>")} {json.dumps(fn["name"] + chr(10) + "```json" + chr(10))} '
                                   f'{_args(fn)} "```" {tag("<｜tool▁call▁end｜>")}',
                        tag("<｜tool▁call▁begin｜>"), tag("<｜tool▁calls▁end｜>")),
        "harmony": (tag("<|channel|>"), lambda fn: f'"commentary to=functions.{fn["name"]} " {tag("<|constrain|>")} '
                                                   f'"json" {tag("<|message|>")} {_args(fn)}', "", ""),
    }


CALL_FORMS = ("json", "xml", "llama3", "mistral", "ministral3", "functionary_v31", "functionary_v32",
              "deepseek_v31", "deepseek_r1", "harmony", "generic")


def _generic(functions: list[dict[str, Any]], *, parallel: bool, forced: bool) -> GrammarSpec:
    def call(fn: dict[str, Any]) -> dict[str, Any]:
        return {"type": "object", "properties": {"name": {"const": fn["name"]},
                                                 "arguments": fn.get("parameters") or {"type": "object"}},
                "required": ["name", "arguments"], "additionalProperties": False}
    one = {"anyOf": [call(fn) for fn in functions]}
    calls = ({"type": "object", "properties": {"tool_calls": {"type": "array", "items": one, "minItems": 1}},
              "required": ["tool_calls"], "additionalProperties": False} if parallel else
             {"type": "object", "properties": {"tool_call": one}, "required": ["tool_call"], "additionalProperties": False})
    response = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
                "additionalProperties": False}
    schema = calls if forced else {"anyOf": [calls, response]}
    return GrammarSpec("json_schema", json.dumps({**schema, "x-guidance": _COMPACT}))


def call_grammar(family: str, tools: list[dict[str, Any]], tokenizer: Any, *, name: str | None, parallel: bool,
                 lazy: bool) -> GrammarSpec:
    """The grammar of `family`'s calls of `name` (or any tool): forced from the first token, or `lazy`:
    free text until the call opener. `family` must be one of CALL_FORMS."""
    functions = [t.get("function", t) for t in tools if name is None or t.get("function", t)["name"] == name]
    if family == "generic":
        return _generic(functions, parallel=parallel, forced=not lazy)
    tag = _tag_of(tokenizer)
    opener, body, separator, closer = _forms(tag)[family]
    lines = [f"fn{i}: {body(fn)}" for i, fn in enumerate(functions)]
    more = f" ({separator} call_body)*" if parallel else ""
    lines += [f"calls: {opener} call_body{more} {closer}".rstrip(), "call_body: " + " | ".join(f"fn{i}" for i in range(len(functions)))]
    if not lazy:
        return GrammarSpec("lark", "\n".join(["start: calls", *lines]) + "\n")
    if opener == '""':
        raise ValueError(f"{family} calls have no opener to arm a lazy grammar on")
    free = [tag(t) for t in reasoning_tags(family) if tag(t).startswith("<[")]
    text = " | ".join(["TEXT", *free])
    head = ["%llguidance {}", "start: free | free calls", f"free: ({text})*", r"TEXT: /(.|\n)+/"]
    if not opener.startswith("<["):  # a trigger written as text: a lazy lexeme stops at its first occurrence
        head = ["%llguidance {}", "start: free | trig calls_rest", f"free: ({text})*", r"TEXT: /(.|\n)+/",
                f"trig[lazy]: free {opener}"]
        lines = [line.replace(f"calls: {opener} ", "calls_rest: ", 1) if line.startswith("calls:") else line for line in lines]
    return GrammarSpec("lark", "\n".join([*head, *lines]) + "\n")


def forced_call_grammar(tools: list[dict[str, Any]], tokenizer: Any, *, name: str | None,
                        parallel: bool) -> GrammarSpec:
    """Hermes's JSON calls from the first token (what the first slice built; kept for its callers)."""
    return call_grammar("json", tools, tokenizer, name=name, parallel=parallel, lazy=False)
