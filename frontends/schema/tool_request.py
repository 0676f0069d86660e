"""A chat request's tool and reasoning fields, checked: `tools`, `tool_choice`, `parallel_tool_calls`,
`reasoning_format` (OpenAI's forms, as llama-server reads them).

    tool_choice          "auto" (default) or "none" ("none": the tools still reach the template, as in
                         llama-server, but calls are not parsed out of the reply); "required" or a named
                         function: the reply is forced to be calls by a grammar (frontends/schema/tool_grammar.py)
    parallel_tool_calls  false: at most the first call is returned
    reasoning_format     "auto" (llama-server's default) and "deepseek" split <think> into
                         reasoning_content; "none" leaves it in the content
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from spekula.frontends.schema.chat_reply import REASONING_FORMATS


class ToolFieldError(ValueError):
    """A bad tool field: the message names it."""


@dataclass(frozen=True)
class ToolOptions:
    parse_tools: bool = True  # tool_choice is not "none"
    parallel: bool = True
    reasoning_format: str = "auto"
    forced: bool = False  # tool_choice "required" or a named function: calls forced by a grammar
    forced_name: str | None = None  # the named function


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """The `tools` list, each a function with a name and (optional) object `parameters`."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ToolFieldError("'tools' must be a list of tool objects")
    names: set[str] = set()
    for j, tool in enumerate(tools):
        where = f"'tools[{j}]'"
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ToolFieldError(f"{where}: only function tools ({{'type': 'function', 'function': {{...}}}}) are supported")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ToolFieldError(f"{where}.function.name must be a non-empty string")
        if name in names:
            raise ToolFieldError(f"{where}: a second tool named '{name}'")
        names.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ToolFieldError(f"{where} ('{name}'): 'parameters' must be a JSON schema object")
    return tools


def tool_schemas(tools: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(where, JSON text) of every tool's parameter schema, for the grammar engine to check."""
    return [(f"'tools[{j}]' ('{t['function']['name']}')", json.dumps(t["function"]["parameters"]))
            for j, t in enumerate(tools) if t["function"].get("parameters") is not None]


def read_tool_options(body: dict[str, Any], tools: list[dict[str, Any]], reasoning_format: str = "auto") -> ToolOptions:
    """The request's options; `reasoning_format`: the server's (--reasoning-format), unless the request sets one."""
    choice = body.get("tool_choice")
    names = {t["function"]["name"] for t in tools}
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise ToolFieldError("'tool_choice' must be \"auto\", \"none\", \"required\" or "
                                 "{'type': 'function', 'function': {'name': ...}}")
        if name not in names:
            raise ToolFieldError(f"'tool_choice' names the tool '{name[:80]}', which is not in 'tools'")
    elif choice not in (None, "auto", "none", "required"):
        raise ToolFieldError("'tool_choice' must be \"auto\", \"none\", \"required\" or a named function")
    if choice == "required" and not tools:
        raise ToolFieldError("'tool_choice' \"required\" needs 'tools'")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolFieldError("'parallel_tool_calls' must be true or false")
    fmt = body.get("reasoning_format")
    if fmt is not None and fmt not in REASONING_FORMATS:
        raise ToolFieldError(f"'reasoning_format' must be one of {', '.join(REASONING_FORMATS)}")
    forced = choice == "required" or isinstance(choice, dict)
    return ToolOptions(choice != "none", parallel is not False, fmt or reasoning_format, forced,
                       choice["function"]["name"] if isinstance(choice, dict) else None)
