"""Chat tools and reasoning over HTTP: the request's tool fields checked (each tool's parameter schema by
the grammar engine, as a 400 naming the tool), the tools told in a system message to templates that do
not show them, the reply's format for the prompt rendered, and the calls' grammar (forced, lazy for
"auto", or the generic JSON form's); frontends/schema/tool_setup.py does the work, this answers its
refusals as 400s. Used by every chat-shaped API (OpenAI chat, Anthropic Messages, Responses)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from spekula.frontends.http.errors import HttpError
from spekula.frontends.schema.chat_reply import ReplyFormat
from spekula.frontends.schema.reasoning_budget import UNLIMITED, token_budget, without_open_reasoning
from spekula.frontends.schema.tool_request import ToolFieldError, ToolOptions
from spekula.frontends.schema.tool_setup import (
    calls_grammar,
    check_tool_schemas,
    read_tools,
    tool_messages,
    tool_reply_format,
)

if TYPE_CHECKING:
    from spekula.frontends.http.fields import HttpOptions
    from spekula.frontends.http.generation import Generation
    from spekula.frontends.http.serving_engine import ServingEngine
    from spekula.frontends.schema.completion import ParsedCompletion, ServerDefaults


async def read_chat_tools(body: dict[str, Any], engine: ServingEngine, reasoning_format: str, *,
                          schema_field: str = "parameters") -> tuple[list[dict[str, Any]], ToolOptions]:
    """The request's tools and tool options; a bad one is a 400 naming it. `schema_field`: what the API
    calls a tool's parameter schema."""
    try:
        tools, options = read_tools(body, engine.tokenizer, reasoning_format)
        await check_tool_schemas(tools, engine, schema_field)
    except ToolFieldError as exc:
        raise HttpError(str(exc)) from None
    return tools, options


def chat_budget(opts: HttpOptions, defaults: ServerDefaults) -> int:
    """The request's reasoning budget (its -1: the server's); a budget of 0 asks the template for no
    reasoning (frontends/schema/reasoning_budget.py)."""
    budget = opts.reasoning_budget if opts.reasoning_budget != UNLIMITED else defaults.reasoning_budget
    if budget == 0:
        opts.template.template_kwargs["enable_thinking"] = False
    return budget


def without_reasoning(engine: ServingEngine, prompt_text: str, budget: int) -> str:
    """A reasoning budget of 0: the prompt's open reasoning closed (frontends/schema/reasoning_budget.py)."""
    return without_open_reasoning(engine.tokenizer, prompt_text) if budget == 0 else prompt_text


def limit_reasoning(gen: Generation, engine: ServingEngine, budget: int, opts: HttpOptions,
                    defaults: ServerDefaults) -> None:
    """A positive budget: the request's reasoning forced to end after `budget` tokens (with its message)."""
    message = opts.reasoning_budget_message
    gen.request.reasoning_budget = token_budget(engine.tokenizer, budget, defaults.reasoning_budget_message
                                                if message is None else message)


def messages_with_tools(engine: ServingEngine, messages: Any, tools: list[dict[str, Any]],
                        options: ToolOptions) -> Any:
    """`messages`, with the tools told in a system message when the template would not show them."""
    return tool_messages(engine.tokenizer, messages, tools, options)


def chat_reply_format(engine: ServingEngine, prompt_text: str, tools: list[dict[str, Any]],
                      options: ToolOptions) -> ReplyFormat:
    return tool_reply_format(engine.tokenizer, prompt_text, tools, options)


def force_calls(gen: Generation, parsed: ParsedCompletion, fmt: ReplyFormat, tools: list[dict[str, Any]],
                options: ToolOptions, tokenizer: Any) -> None:
    """The calls' grammar becomes the request's (see tool_setup.calls_grammar)."""
    try:
        grammar = calls_grammar(fmt, tools, options, tokenizer,
                                grammar_given=parsed.grammar_field if gen.request.grammar is not None else None)
    except ToolFieldError as exc:
        raise HttpError(str(exc)) from None
    if grammar is not None:
        gen.request.grammar = grammar
        parsed.grammar_field = "tool_choice"
