"""The Jinja environment chat templates render in, the way Hugging Face transformers sets it up.

An immutable sandbox, ``trim_blocks`` and ``lstrip_blocks``, loop controls, a ``tojson`` filter that
keeps non-ASCII text and writes a filter's generator (``tools | map(attribute='function')``) as a list, ``raise_exception`` and ``strftime_now`` globals, and the ``{% generation %}``
block tag (rendered as its plain body). A module of its own so that jinja2 (a tenth of the CLI's
start-up) is imported by the first template compiled, not by whoever names a chat-template helper.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TemplateRaised(Exception):
    """Raised by the template's own raise_exception(); carries the template author's message."""


class TemplateParseError(Exception):
    """The template source is not valid Jinja."""

    def __init__(self, lineno: int, message: str | None) -> None:
        super().__init__(f"line {lineno}: {message}")
        self.lineno, self.message = lineno, message


def _raise_exception(message: str) -> None:
    raise TemplateRaised(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Undefined(jinja2.Undefined):
    """An undefined variable added to a string is the empty string, as in llama-server's template
    engine (Firefunction's template adds an optional `functions` that way); anything else done with
    one is still an error."""

    def __add__(self, other: Any) -> Any:
        return other if isinstance(other, str) else self._fail_with_undefined_error()

    __radd__ = __add__


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
    sort_keys: bool = False,
) -> str:  # fmt: skip
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys, default=_as_list
    )


def _as_list(value: Any) -> list[Any]:
    """What `map`, `select` and the like return (a generator in jinja2, a list in llama.cpp's engine) as
    the list llama-server writes; anything else stays unserialisable."""
    if isinstance(value, Iterator):
        return list(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


class _GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks; here a no-op."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def compile_template(source: str) -> jinja2.Template:
    """The compiled template (cached by source), or TemplateParseError saying where it does not parse."""
    try:
        return _compile(source)
    except jinja2.TemplateSyntaxError as exc:
        raise TemplateParseError(exc.lineno, exc.message) from None


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    return sandbox_environment().from_string(source)


def sandbox_environment() -> ImmutableSandboxedEnvironment:
    """A fresh environment as templates render in (one that probes a template changes its tests)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols], undefined=_Undefined
    )
    env.filters["tojson"] = _tojson
    # llama.cpp's engine escapes nothing: jinja2's `safe` would make a Markup whose `+` escapes the other side
    env.filters["safe"] = str
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env
