"""Tool calls held to their family's syntax by a Lark grammar (llguidance's), each call's arguments valid
against its tool's parameter schema, closed to undeclared parameters as llama.cpp closes it
(closed_schema.py).

* `tool_choice` "required" or a named function (forced): the reply is calls from its first token.
* `tool_choice` "auto" (lazy): the text is free until the family's call trigger, after which the rest of
  the reply is well-formed calls (llama-server's lazy grammar and its trigger word). Free text may hold
  the family's reasoning tags. Families whose calls have no trigger to wait for (Llama 3.x's bare JSON) or
  whose trigger also opens other messages (gpt-oss's channels) get no lazy grammar: `lazy_trigger` says.
* The generic JSON form (templates that know no tools): always one JSON object, the calls (a list with
  `parallel`) or ``{"response": ".."}``, the latter not when calls are forced.

Tags that are one token of the vocabulary (Qwen's ``<tool_call>``, Mistral's ``[TOOL_CALLS]``) are that
token, so the grammar forces what the model was trained to write. Drafts are cut by the grammar as any
other constraint's are (lossless). `CALL_FORMS` lists the families built; the caller refuses the others.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from spekula.core.modelfile.constraint import GrammarSpec
from spekula.frontends.schema.closed_schema import closed_schema
from spekula.frontends.schema.tool_formats.detect import reasoning_tags

# One separator form, so that the model cannot wander in whitespace inside the call's JSON.
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
Tag = Callable[[str], str]
Function = dict[str, Any]


class ToolGrammarError(ValueError):
    """A call form or schema this module does not build; the message names it."""


def _tag_of(tokenizer: Any) -> Tag:
    def tag(text: str) -> str:
        """`text` as a grammar item: its token when the vocabulary holds it as one, else the literal."""
        try:
            ids = tokenizer.encode(text, add_special=False, parse_special=True)
        except Exception:  # noqa: BLE001 - a tokenizer that cannot say: the text itself is always right
            ids = []
        is_token = len(ids) == 1 and len(text) > 1 and getattr(tokenizer, "token_text", lambda i: text)(ids[0]) == text
        return f"<[{ids[0]}]>" if is_token else json.dumps(text)
    return tag


def _params(fn: Function) -> dict[str, Any]:
    """The tool's parameter schema, closed as llama.cpp closes it (closed_schema.py)."""
    return dict(closed_schema(fn.get("parameters") or {"type": "object"}))


def _args(fn: Function) -> str:
    return "%json " + json.dumps({**_params(fn), "x-guidance": _COMPACT})


def _call_object(fn: Function, key: str = "arguments") -> str:
    schema = {"type": "object", "properties": {"name": {"const": fn["name"]}, key: _params(fn)},
              "required": ["name", key], "additionalProperties": False, "x-guidance": _COMPACT}
    return "%json " + json.dumps(schema)


def _xml_string(schema: dict[str, Any], where: str) -> str:
    """A string parameter's raw text and its closing tag: free (no ``</``, where the closing tag begins),
    or one of its `enum` / `const` values; other string keywords are not built."""
    if "const" in schema or "enum" in schema:
        values = [schema["const"]] if "const" in schema else schema["enum"]
        return "(" + " | ".join(json.dumps(str(v)) for v in values) + ') "\\n</parameter>\\n"'
    unsupported = sorted(set(schema) & {"pattern", "format", "minLength", "maxLength"})
    if unsupported:
        raise ToolGrammarError(f"{where}: {', '.join(unsupported)} on a string parameter is not built for XML calls")
    # one lexeme with the closing tag: free text alone would take the newline before it
    return r"/([^<]|<[^\/])*\n<\/parameter>\n/"


def _xml_params(fn: Function) -> str:
    """Qwen3-Coder's parameters in the schema's order, the required ones present."""
    params = fn.get("parameters") or {}
    required = set(params.get("required") or ())
    items = []
    for key, schema in (params.get("properties") or {}).items():
        schema = schema if isinstance(schema, dict) else {}
        kind = schema.get("type")
        if kind == "string" or (isinstance(kind, list) and "string" in kind):
            value = _xml_string(schema, f"tool '{fn['name']}' parameter '{key}'")
        else:
            value = "%json " + json.dumps({**closed_schema(schema), "x-guidance": _COMPACT}) + ' "\\n</parameter>\\n"'
        item = f'"<parameter={key}>\\n" {value}'
        items.append(f"({item})" if key in required else f"({item})?")
    return " ".join(items) or '""'


@dataclass(frozen=True)
class CallForm:
    """A family's calls: `opener` once, then calls separated by `separator` (None: one call only), then
    `closer`; `trigger` is what arms the lazy grammar (None: no lazy grammar), the opener's first item."""

    opener: str
    body: Callable[[Function], str]
    separator: str | None
    closer: str = ""
    trigger: str | None = None


def _forms(tag: Tag) -> dict[str, CallForm]:
    tc, ds_begin, ds_call = tag("<tool_call>"), tag("<｜tool▁calls▁begin｜>"), tag("<｜tool▁call▁begin｜>")
    ds_end = f'{tag("<｜tool▁call▁end｜>")}'
    named_args = lambda fn: f'{json.dumps(fn["name"])} {tag("[ARGS]")} {_args(fn)}'  # noqa: E731
    return {
        "json": CallForm(tc, lambda fn: f'"\\n" {_call_object(fn)} "\\n" {tag("</tool_call>")}', f'"\\n" {tc}', trigger=tc),
        "xml": CallForm(tc, lambda fn: f'"\\n<function={fn["name"]}>\\n" {_xml_params(fn)} "</function>\\n" '
                                       f'{tag("</tool_call>")}', f'"\\n" {tc}', trigger=tc),
        "llama3": CallForm('""', lambda fn: _call_object(fn, "parameters"), '"; "'),
        "mistral_nemo": CallForm(f'{tag("[TOOL_CALLS]")} "["', _call_object, '", "', '"]"', trigger=tag("[TOOL_CALLS]")),
        "mistral_small": CallForm(tag("[TOOL_CALLS]"), lambda fn: f'{json.dumps(fn["name"])} {tag("[CALL_ID]")} '
                                                                  f'/[A-Za-z0-9]{{9}}/ {tag("[ARGS]")} {_args(fn)}',
                                  tag("[TOOL_CALLS]"), trigger=tag("[TOOL_CALLS]")),
        "ministral3": CallForm(tag("[TOOL_CALLS]"), named_args, tag("[TOOL_CALLS]"), trigger=tag("[TOOL_CALLS]")),
        "functionary_v31": CallForm('"<function="', lambda fn: f'{json.dumps(fn["name"] + ">")} {_args(fn)} "</function>"',
                                    '"<function="', trigger='"<function="'),
        "functionary_v32": CallForm('""', lambda fn: f'{json.dumps(fn["name"] + chr(10))} {_args(fn)}', '">>>"',
                                    trigger='">>>"'),
        "deepseek_v31": CallForm(f"{ds_begin} {ds_call}", lambda fn: f'{json.dumps(fn["name"])} {tag("<｜tool▁sep｜>")} '
                                                                     f'{_args(fn)} {ds_end}', ds_call,
                                 tag("<｜tool▁calls▁end｜>"), trigger=ds_begin),
        "deepseek_r1": CallForm(f"{ds_begin} {ds_call}", lambda fn: f'"function" {tag("<｜tool▁sep｜>")} '
                                                                    f'{json.dumps(fn["name"] + chr(10) + "```json" + chr(10))} '
                                                                    f'{_args(fn)} "```" {ds_end}', ds_call,
                                tag("<｜tool▁calls▁end｜>"), trigger=ds_begin),
        # one call per reply: <|call|> (end of generation) follows its arguments
        "harmony": CallForm(tag("<|channel|>"), lambda fn: f'"commentary to=functions.{fn["name"]} " '
                                                           f'{tag("<|constrain|>")} "json" {tag("<|message|>")} {_args(fn)}', None),
    }


CALL_FORMS = ("json", "xml", "llama3", "mistral_nemo", "mistral_small", "ministral3", "functionary_v31",
              "functionary_v32", "deepseek_v31", "deepseek_r1", "harmony", "generic")


def lazy_trigger(family: str) -> bool:
    """Whether "auto" gets a lazy grammar for `family` (a call trigger to wait for)."""
    return family == "generic" or (family in CALL_FORMS and _forms(json.dumps)[family].trigger is not None)


def _generic(functions: list[Function], *, parallel: bool, forced: bool) -> GrammarSpec:
    def call(fn: Function) -> dict[str, Any]:
        return {"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": _params(fn)},
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
    """The grammar of `family`'s calls of `name` (or any tool): forced from the first token, or `lazy`: free
    text until the family's trigger. Raises ToolGrammarError for what is not built."""
    functions = [t.get("function", t) for t in tools if name is None or t.get("function", t)["name"] == name]
    if family == "generic":
        return _generic(functions, parallel=parallel, forced=not lazy)
    if family not in CALL_FORMS:
        raise ToolGrammarError(f"calls in the {family or 'unknown'} form are not built")
    tag = _tag_of(tokenizer)
    form = _forms(tag)[family]
    rules = [f"fn{i}: {form.body(fn)}" for i, fn in enumerate(functions)]
    rules.append("call_body: " + " | ".join(f"fn{i}" for i in range(len(functions))))
    more = f" ({form.separator} call_body)*" if parallel and form.separator is not None else ""
    if not lazy:
        return GrammarSpec("lark", "\n".join([f"start: {form.opener} call_body{more} {form.closer}".rstrip(), *rules]) + "\n")
    if form.trigger is None:
        raise ToolGrammarError(f"{family} calls have no trigger to arm a lazy grammar on")
    rest = form.opener[len(form.trigger):].strip() if form.opener.startswith(form.trigger) else ""
    calls = f"{rest} call_body{more} {form.closer}".strip()
    free_tokens = [t for t in map(tag, reasoning_tags(family)) if t.startswith("<[")]
    if form.trigger.startswith("<["):  # a token: free text (which cannot hold it) ends where it comes
        head = ["start: free | free " + form.trigger + " calls", "free: (" + " | ".join(["TEXT", *free_tokens]) + ")*"]
    else:  # text: a lazy lexeme ends the free text at the trigger's first occurrence
        head = ["start: free | trig calls", "free: TEXT?", f"trig[lazy]: TEXT? {form.trigger}"]
    return GrammarSpec("lark", "\n".join(["%llguidance {}", *head, r"TEXT: /(.|\n)+/", f"calls: {calls}", *rules]) + "\n")


def forced_call_grammar(tools: list[dict[str, Any]], tokenizer: Any, *, name: str | None,
                        parallel: bool) -> GrammarSpec:
    """Hermes's JSON calls from the first token (what the first slice built; kept for its callers)."""
    return call_grammar("json", tools, tokenizer, name=name, parallel=parallel, lazy=False)
