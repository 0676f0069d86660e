"""A chat request's tools, made ready for one generation, the same way for every frontend (the HTTP APIs
through frontends/http/chat_tools.py, the socket's chat.completion directly).

    read_tools          the checked `tools` and tool options; tools for a template that does not write
                        them into the prompt are refused (the model would never see them)
    check_tool_schemas  every tool's parameter schema compiled by the grammar engine: a bad one names its tool
    tool_reply_format   how the reply to the rendered prompt is split (content, reasoning, calls)
    forced_grammar      `tool_choice` "required" or named: the grammar that forces the calls

Every refusal is a `ToolFieldError` whose message starts with the field it is about.
"""

from __future__ import annotations

import json
from typing import Any

import anyio

from spekula.core.modelfile.chat_template import renders_tools
from spekula.core.modelfile.constraint import ConstraintError, GrammarSpec
from spekula.frontends.schema.chat_reply import ReplyFormat, reply_format
from spekula.frontends.schema.tool_grammar import forced_call_grammar
from spekula.frontends.schema.tool_request import ToolFieldError, ToolOptions, check_tools, read_tool_options

NO_TOOL_PROMPT = ("'tools': the model's chat template does not render tools, and spekula has no generic tool "
                  "prompt for such templates; use a template that does (--chat-template-file), or "
                  "'tool_choice': \"none\"")


def read_tools(body: dict[str, Any], tokenizer: Any, reasoning_format: str) -> tuple[list[dict[str, Any]], ToolOptions]:
    """The request's tools and options; `reasoning_format`: the server's, unless the request sets one."""
    tools = check_tools(body.get("tools"))
    options = read_tool_options(body, tools, reasoning_format)
    if tools and options.parse_tools and not renders_tools(getattr(tokenizer, "chat_template", None)):
        raise ToolFieldError(NO_TOOL_PROMPT)
    return tools, options


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


def forced_grammar(fmt: ReplyFormat, tools: list[dict[str, Any]], options: ToolOptions, tokenizer: Any, *,
                   grammar_given: str | None) -> GrammarSpec | None:
    """The grammar of a forced `tool_choice` (see tool_grammar.py), None when calls are not forced;
    `grammar_given`: the request's own grammar field, if it has one (both cannot apply)."""
    if not options.forced:
        return None
    if fmt.tool_style != "json":
        raise ToolFieldError("'tool_choice': forced calls (\"required\" or a named function) are built only for the "
                             "JSON call form (Hermes, Qwen 2.5, Qwen3 templates), not for this model's template")
    if grammar_given is not None:
        raise ToolFieldError(f"'{grammar_given}': cannot specify a grammar with a forced 'tool_choice'")
    return forced_call_grammar(tools, tokenizer, name=options.forced_name, parallel=options.parallel)


def field_of(error: ToolFieldError) -> str:
    """The field a ToolFieldError is about: the quoted name its message starts with ('tools[0]' -> tools)."""
    text = str(error)
    if not text.startswith("'"):
        return "tools"
    return text[1:].split("'", 1)[0].split("[", 1)[0].split(".", 1)[0]
