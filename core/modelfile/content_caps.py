"""What a chat template takes as a message's content (a string, a list of typed parts, or both), and
the messages shaped to it, as llama.cpp shapes them.

llama.cpp probes each template once (common/jinja/caps.cpp) and then hands it every message's content
in the form it takes: text parts joined by newlines for a template that only takes strings, a string
wrapped as one text part for a template that only takes parts, either left as it is for a template
that takes both (Qwen3.5's renders the parts itself, back to back). The probes are llama.cpp's: a user
message whose content is a marker string, watching whether the template tests it for a string and
whether it iterates or indexes it (llama.cpp's engine cannot iterate a string, so that render fails);
then, for a template that tested, an empty list, watching whether it is iterated or indexed.

jinja2 is imported by the first probe, not by importing this module (see chat_template.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any, SupportsIndex

if TYPE_CHECKING:
    import jinja2

_MARKER = "STRING_MARKER"
_TESTED = "tested for a string"
_USED_AS_LIST = "iterated or indexed"


@dataclass(frozen=True, slots=True)
class ContentCaps:
    strings: bool  # renders a string content
    parts: bool  # renders a list of typed parts


class _Watch:
    """What one probe render did with the content. Only what llama.cpp's engine counts is noted: a for
    loop over it, ``selectattr`` on it, a number subscript; a filter iterating it inside (tojson, join)
    is not, so filters run muted."""

    def __init__(self) -> None:
        self.ops: set[str] = set()
        self.muted = 0

    def note(self, op: str) -> None:
        if not self.muted:
            self.ops.add(op)


class _ProbeText(str):
    """The string probe: iterating it fails (llama.cpp's engine cannot iterate a string)."""

    watch: _Watch

    def __iter__(self) -> Iterator[str]:
        self.watch.note(_USED_AS_LIST)
        raise TypeError("a string cannot be iterated in llama.cpp's template engine")

    def __getitem__(self, key: SupportsIndex | slice) -> str:
        if isinstance(key, int):  # llama.cpp counts a number subscript, not a name or a slice
            self.watch.note(_USED_AS_LIST)
        return super().__getitem__(key)


class _ProbeParts(list[Any]):
    """The list probe."""

    watch: _Watch

    def __iter__(self) -> Iterator[Any]:
        self.watch.note(_USED_AS_LIST)
        return super().__iter__()

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, int):
            self.watch.note(_USED_AS_LIST)
        return super().__getitem__(key)


def _probe(template: jinja2.Template, content: _ProbeText | _ProbeParts, watch: _Watch) -> tuple[bool, str]:
    """(rendered without error, the text) for one user message with `content`, in llama.cpp's probe context."""
    content.watch = watch
    try:
        text = template.render(messages=[{"role": "user", "content": content}], tools=[], bos_token="",
                               eos_token="", add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - a template failing on a probe is what the probe finds out
        return False, ""
    return True, text


def _muted(watch: _Watch, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)  # keeps jinja's pass_context/pass_environment marks
    def run(*args: Any, **kwargs: Any) -> Any:
        if name == "selectattr" and any(isinstance(a, _ProbeText | _ProbeParts) for a in args):
            watch.note(_USED_AS_LIST)
        watch.muted += 1
        try:
            return fn(*args, **kwargs)
        finally:
            watch.muted -= 1

    return run


def _probing_template(source: str, watch: _Watch) -> jinja2.Template:
    from spekula.core.modelfile.jinja_sandbox import sandbox_environment

    env = sandbox_environment()
    is_string, is_iterable = env.tests["string"], env.tests["iterable"]

    def tested_string(value: Any) -> bool:
        if isinstance(value, _ProbeText | _ProbeParts):
            watch.note(_TESTED)
        return bool(is_string(value))

    def iterable(value: Any) -> bool:  # without iter(), which would count as a use
        return isinstance(value, _ProbeText | _ProbeParts) or bool(is_iterable(value))

    env.tests.update(string=tested_string, iterable=iterable)
    env.filters.update({name: _muted(watch, name, fn) for name, fn in env.filters.items()})
    return env.from_string(source)


@lru_cache(maxsize=16)
def content_caps(source: str) -> ContentCaps:
    """How the template `source` takes content (see module docstring)."""
    watch = _Watch()
    template = _probing_template(source, watch)
    rendered, output = _probe(template, _ProbeText(_MARKER), watch)
    parts = _USED_AS_LIST in watch.ops
    strings = rendered and not (parts and _MARKER not in output)
    if _TESTED in watch.ops and not parts:
        watch.ops.clear()
        rendered, _ = _probe(template, _ProbeParts(), watch)
        parts = rendered and _USED_AS_LIST in watch.ops
    return ContentCaps(strings=strings, parts=parts)


def join_text_parts(content: Any, delimiter: str) -> str:
    """A content as one string: its text parts joined by `delimiter` (llama.cpp puts none before the
    first text, and none after an empty start); a string content as it is."""
    if not isinstance(content, list):
        return "" if content is None else str(content)
    text = ""
    for part in content:
        if isinstance(part, dict) and part.get("type") == "text":
            text += (delimiter if text else "") + str(part.get("text") or "")
    return text


def shaped_messages(messages: list[dict[str, Any]], caps: ContentCaps) -> list[dict[str, Any]]:
    """`messages` with each content in the form the template takes (see module docstring)."""
    only_strings, only_parts = caps.strings and not caps.parts, caps.parts and not caps.strings
    if not (only_strings or only_parts):
        return messages
    out = []
    for message in messages:
        content = message.get("content")
        if only_parts and isinstance(content, str):
            message = {**message, "content": [{"type": "text", "text": content}]}
        elif only_strings and isinstance(content, list):
            message = {**message, "content": join_text_parts(content, "\n")}
        out.append(message)
    return out
