"""Render a model's Jinja chat template the way Hugging Face transformers does.

Same environment as ``transformers``' ``apply_chat_template``: an immutable sandbox, ``trim_blocks`` and
``lstrip_blocks``, loop controls, a ``tojson`` filter that keeps non-ASCII text, ``raise_exception`` and
``strftime_now`` globals, and the ``{% generation %}`` block tag (rendered as its plain body). Models
without a template get ChatML, with a warning, because that is what the tiny fixtures and most small
instruct models use.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import structlog
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import SpekulaError

log = structlog.get_logger(__name__)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ChatTemplateError(SpekulaError):
    """The chat template is invalid, or refuses the given messages."""


class _TemplateRaised(Exception):
    """Raised by the template's own raise_exception(); carries the template author's message."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
    sort_keys: bool = False,
) -> str:  # fmt: skip
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks; here a no-op."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def render_chat(
    template: str | None,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    **extra: Any,
) -> str:
    """Render `messages` with `template` (None or empty: ChatML). Raises ChatTemplateError on failure."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise ChatTemplateError("messages must be a list of {'role': ..., 'content': ...} objects")
    if not template:
        log.warning("model has no chat template; using ChatML")
        template = CHATML_TEMPLATE
    try:
        compiled = _compile(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template does not parse (line {exc.lineno}): {exc.message}") from None
    context = {"tools": None, "documents": None, **extra}
    try:
        return compiled.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            **context,
        )
    except _TemplateRaised as exc:
        raise ChatTemplateError(f"chat template rejected the messages: {exc}") from None
    except Exception as exc:  # any failure inside someone else's template is a bad-input error, not a crash
        raise ChatTemplateError(f"chat template failed to render ({type(exc).__name__}: {exc})") from None
