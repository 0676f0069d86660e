"""OpenAI chat's tools and reasoning over HTTP: the request's tool fields checked (each tool's parameter
schema by the grammar engine, as a 400 naming the tool), and the reply's format for the prompt rendered."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import anyio

from spekula.core.modelfile.chat_template import renders_tools
from spekula.core.modelfile.constraint import ConstraintError, GrammarSpec
from spekula.frontends.http.errors import HttpError
from spekula.frontends.schema.chat_reply import ReplyFormat, reply_format
from spekula.frontends.schema.tool_grammar import forced_call_grammar
from spekula.frontends.schema.tool_request import (
    ToolFieldError,
    ToolOptions,
    check_tools,
    read_tool_options,
    tool_schemas,
)

if TYPE_CHECKING:
    from spekula.frontends.http.generation import Generation
    from spekula.frontends.http.serving_engine import ServingEngine
    from spekula.frontends.schema.completion import ParsedCompletion


async def read_chat_tools(body: dict[str, Any], engine: ServingEngine,
                          reasoning_format: str) -> tuple[list[dict[str, Any]], ToolOptions]:
    """The request's tools and tool options; a bad one is a 400 naming it. Tools for a template that does
    not write them into the prompt are refused: the model would never see them (a generic tool prompt for
    such templates is not built)."""
    try:
        tools = check_tools(body.get("tools"))
        options = read_tool_options(body, tools, reasoning_format)
    except ToolFieldError as exc:
        raise HttpError(str(exc)) from None
    if tools and options.parse_tools and not renders_tools(getattr(engine.tokenizer, "chat_template", None)):
        raise HttpError("'tools': the model's chat template does not render tools, and spekula has no generic tool "
                        "prompt for such templates; use a template that does (--chat-template-file), or "
                        "'tool_choice': \"none\"")
    for where, schema in tool_schemas(tools):
        try:
            await anyio.to_thread.run_sync(engine.grammars.compile, GrammarSpec("json_schema", schema))
        except ConstraintError as exc:
            raise HttpError(f"{where}: 'parameters' is not a valid JSON schema: {exc}") from None
    return tools, options


def chat_reply_format(engine: ServingEngine, prompt_text: str, tools: list[dict[str, Any]],
                      options: ToolOptions) -> ReplyFormat:
    return reply_format(getattr(engine.tokenizer, "chat_template", None), prompt_text, tools=tools,
                        parse_tools=options.parse_tools, reasoning_format=options.reasoning_format)


def force_calls(gen: Generation, parsed: ParsedCompletion, fmt: ReplyFormat, tools: list[dict[str, Any]],
                options: ToolOptions, tokenizer: Any) -> None:
    """`tool_choice` "required" or named: the request's grammar becomes the calls' (see tool_grammar.py)."""
    if not options.forced:
        return
    if fmt.tool_style != "json":
        raise HttpError("'tool_choice': forced calls (\"required\" or a named function) are built only for the "
                        "JSON call form (Hermes, Qwen 2.5, Qwen3 templates), not for this model's template")
    if gen.request.grammar is not None:
        raise HttpError(f"'{parsed.grammar_field}': cannot specify a grammar with a forced 'tool_choice'")
    gen.request.grammar = forced_call_grammar(tools, tokenizer, name=options.forced_name, parallel=options.parallel)
    parsed.grammar_field = "tool_choice"
