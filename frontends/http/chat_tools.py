"""Chat tools and reasoning over HTTP: the request's tool fields checked (each tool's parameter schema by
the grammar engine, as a 400 naming the tool), the reply's format for the prompt rendered, and a forced
`tool_choice`'s grammar; frontends/schema/tool_setup.py does the work, this answers its refusals as 400s.
Used by every chat-shaped API (OpenAI chat, Anthropic Messages, Responses)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from spekula.frontends.http.errors import HttpError
from spekula.frontends.schema.chat_reply import ReplyFormat
from spekula.frontends.schema.tool_request import ToolFieldError, ToolOptions
from spekula.frontends.schema.tool_setup import (
    check_tool_schemas,
    forced_grammar,
    read_tools,
    tool_reply_format,
)

if TYPE_CHECKING:
    from spekula.frontends.http.generation import Generation
    from spekula.frontends.http.serving_engine import ServingEngine
    from spekula.frontends.schema.completion import ParsedCompletion


async def read_chat_tools(body: dict[str, Any], engine: ServingEngine, reasoning_format: str, *,
                          schema_field: str = "parameters") -> tuple[list[dict[str, Any]], ToolOptions]:
    """The request's tools and tool options; a bad one is a 400 naming it. Tools for a template that does
    not write them into the prompt are refused: the model would never see them (a generic tool prompt for
    such templates is not built). `schema_field`: what the API calls a tool's parameter schema."""
    try:
        tools, options = read_tools(body, engine.tokenizer, reasoning_format)
        await check_tool_schemas(tools, engine, schema_field)
    except ToolFieldError as exc:
        raise HttpError(str(exc)) from None
    return tools, options


def chat_reply_format(engine: ServingEngine, prompt_text: str, tools: list[dict[str, Any]],
                      options: ToolOptions) -> ReplyFormat:
    return tool_reply_format(engine.tokenizer, prompt_text, tools, options)


def force_calls(gen: Generation, parsed: ParsedCompletion, fmt: ReplyFormat, tools: list[dict[str, Any]],
                options: ToolOptions, tokenizer: Any) -> None:
    """`tool_choice` "required" or named: the request's grammar becomes the calls' (see tool_grammar.py)."""
    try:
        grammar = forced_grammar(fmt, tools, options, tokenizer,
                                 grammar_given=parsed.grammar_field if gen.request.grammar is not None else None)
    except ToolFieldError as exc:
        raise HttpError(str(exc)) from None
    if grammar is not None:
        gen.request.grammar = grammar
        parsed.grammar_field = "tool_choice"
