"""A chat request's tools, made ready for one generation, the same way for every frontend (the HTTP APIs
through frontends/http/chat_tools.py, the socket's chat.completion directly).

    read_tools          the checked `tools` and tool options
    check_tool_schemas  every tool's parameter schema compiled by the grammar engine: a bad one names its tool
    tool_messages       the messages to render: the tools told in a system message when the template
                        would not show them (the generic JSON form's instruction too, for a template that
                        knows no call syntax: tool_formats/generic.py)
    tool_reply_format   how the reply to the rendered prompt is split (content, reasoning, calls)
    calls_grammar       the calls' grammar: forced for `tool_choice` "required" or named, lazy (armed by the
                        family's call trigger) for "auto", always for the generic JSON form

Every refusal is a `ToolFieldError` whose message starts with the field it is about.
"""

from __future__ import annotations

import json
from typing import Any

import anyio

from spekula.core.modelfile.constraint import ConstraintError, GrammarSpec
from spekula.frontends.schema.chat_reply import ReplyFormat, reply_format
from spekula.frontends.schema.tool_formats.detect import tools_unseen, uses_generic_form
from spekula.frontends.schema.tool_formats.generic import tool_system_messages
from spekula.frontends.schema.tool_grammar import CALL_FORMS, ToolGrammarError, call_grammar, lazy_trigger
from spekula.frontends.schema.tool_request import ToolFieldError, ToolOptions, check_tools, read_tool_options


def read_tools(body: dict[str, Any], tokenizer: Any, reasoning_format: str) -> tuple[list[dict[str, Any]], ToolOptions]:
    """The request's tools and options; `reasoning_format`: the server's, unless the request sets one.
    `tokenizer` is not consulted: a template that does not show tools gets them from `tool_messages`."""
    del tokenizer
    tools = check_tools(body.get("tools"))
    return tools, read_tool_options(body, tools, reasoning_format)


def tool_messages(tokenizer: Any, messages: Any, tools: list[dict[str, Any]], options: ToolOptions) -> Any:
    """`messages`, with the tools told in a system message when the template would not show them (and the
    generic JSON form's instruction, for a template that knows no call syntax)."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(messages, list) or not tools_unseen(template, tools, options.parse_tools):
        return messages
    return tool_system_messages(messages, tools, json_form=uses_generic_form(template, tools, options.parse_tools))


async def check_tool_schemas(tools: list[dict[str, Any]], engine: Any, schema_field: str = "parameters") -> None:
    """Compile each tool's parameter schema with `engine.grammars` (off the event loop; the engine caches it for
    the forced grammar). `schema_field`: what the caller's API calls it (Anthropic's `input_schema`)."""
    for j, tool in enumerate(tools):
        fn = tool["function"]
        if fn.get("parameters") is None:
            continue
        spec = GrammarSpec("json_schema", json.dumps(fn["parameters"]))
        try:
            await anyio.to_thread.run_sync(engine.grammars.compile, spec)
        except ConstraintError as exc:
            raise ToolFieldError(f"'tools[{j}]' ('{fn['name']}'): '{schema_field}' is not a valid JSON schema: "
                                 f"{exc}") from None


def tool_reply_format(tokenizer: Any, prompt_text: str, tools: list[dict[str, Any]],
                      options: ToolOptions) -> ReplyFormat:
    return reply_format(getattr(tokenizer, "chat_template", None), prompt_text, tools=tools,
                        parse_tools=options.parse_tools, reasoning_format=options.reasoning_format)


def calls_grammar(fmt: ReplyFormat, tools: list[dict[str, Any]], options: ToolOptions, tokenizer: Any, *,
                  grammar_given: str | None) -> GrammarSpec | None:
    """The calls' grammar (see tool_grammar.py): forced for `tool_choice` "required" or named, lazy for
    "auto" where the family has a call trigger, always for the generic JSON form; None when the reply
    stays free. `grammar_given`: the request's own grammar field, if it has one: beside forced calls or the
    generic form it is refused, as llama-server refuses a grammar with tools; beside "auto" it stays, and
    the calls are not held to their form."""
    family = fmt.tool_style
    if family is None or not tools:
        return None
    lazy = not options.forced
    if grammar_given is not None:
        if lazy and family != "generic":
            return None
        raise ToolFieldError(f"'{grammar_given}': cannot specify a grammar with tools "
                             f"({'the generic JSON tool form' if lazy else 'a forced tool_choice'})")
    if family not in CALL_FORMS or (lazy and not lazy_trigger(family)):
        if not lazy:
            raise ToolFieldError(f"'tool_choice': forced calls are not built for this template's call form ({family})")
        return None  # "auto" for a form without a trigger: the reply stays free, its calls parsed
    try:
        return call_grammar(family, tools, tokenizer, name=options.forced_name, parallel=options.parallel, lazy=lazy)
    except ToolGrammarError as exc:
        raise ToolFieldError(f"'tools': {exc}") from None


def field_of(error: ToolFieldError) -> str:
    """The field a ToolFieldError is about: the quoted name its message starts with ('tools[0]' -> tools)."""
    text = str(error)
    if not text.startswith("'"):
        return "tools"
    return text[1:].split("'", 1)[0].split("[", 1)[0].split(".", 1)[0]
