"""A chat request's fields for the chat template, read one way for the socket and the HTTP frontends.

    add_generation_prompt   end the prompt with the template's assistant opening (default true)
    continue_final_message  continue the final assistant message (vLLM's field): a boolean, or
                            llama-server's "content"; its "reasoning_content" needs reasoning parsing,
                            which spekula does not do
    tools                   tool definitions handed to the template (checked in frontends/schema/tool_request.py)
    chat_template_kwargs    further template variables
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from spekula.core.modelfile.chat_template import ChatTemplateError, template_variables

TEMPLATE_FIELDS = frozenset({"add_generation_prompt", "continue_final_message", "tools", "chat_template_kwargs"})


class TemplateFieldError(ValueError):
    """A bad template field: the message, and the field it is about."""

    def __init__(self, message: str, field_name: str) -> None:
        super().__init__(message)
        self.field = field_name


@dataclass
class TemplateFields:
    add_generation_prompt: bool = True
    continue_final: bool = False
    tools: list[dict[str, Any]] | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)

    def variables(self) -> dict[str, Any]:
        """What the template reads besides the messages and the two switches."""
        return {**self.template_kwargs, **({"tools": self.tools} if self.tools else {})}


def _flag(obj: dict[str, Any], name: str, default: bool) -> bool:
    value = obj.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise TemplateFieldError(f"'{name}' must be true or false", name)
    return value


def _continue_final(value: Any) -> bool:
    if value is None or isinstance(value, bool):
        return bool(value)
    if value == "content":
        return True
    name = "continue_final_message"
    if value == "reasoning_content":
        raise TemplateFieldError(f"'{name}': \"reasoning_content\" is not supported (spekula does not separate "
                                 "reasoning from the reply); use true or \"content\"", name)
    raise TemplateFieldError(f"'{name}' must be a boolean or \"content\"", name)


def read_template_fields(obj: dict[str, Any]) -> TemplateFields:
    """The template fields of a request object; a TemplateFieldError names a bad one."""
    out = TemplateFields(_flag(obj, "add_generation_prompt", True), _continue_final(obj.get("continue_final_message")))
    if out.continue_final and obj.get("add_generation_prompt") is True:
        raise TemplateFieldError("'add_generation_prompt' and 'continue_final_message' cannot both be true",
                                 "continue_final_message")
    tools = obj.get("tools")
    if tools:
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise TemplateFieldError("'tools' must be a list of tool objects", "tools")
        out.tools = tools
    try:
        out.template_kwargs = template_variables(obj.get("chat_template_kwargs"), "'chat_template_kwargs'")
    except ChatTemplateError as exc:
        raise TemplateFieldError(str(exc), "chat_template_kwargs") from None
    return out
