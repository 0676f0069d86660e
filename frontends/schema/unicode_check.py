"""Text that is not Unicode is refused at the door, naming where it is.

JSON may spell a lone UTF-16 surrogate (`"\\ud800"`), which Python decodes into a `str` that no
tokenizer, encoder or socket accepts: left in, it fails deep inside the work (after a whole
generation, for a stop string) as an internal error. llama-server's JSON parser refuses such a body
outright, so it is refused here too (400 / -32602) rather than replaced. Raw bytes cannot carry a
surrogate (UTF-8 decoding is strict), so only an escaped one can: a body without `\\uD8..`-`\\uDF..`
escapes is never walked.
"""

from __future__ import annotations

import re
from typing import Any

_ESCAPED_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def may_hold_surrogate(raw: bytes) -> bool:
    """Whether a JSON text escapes a surrogate code point (paired or not): only then can it decode
    into a string with a lone one."""
    return _ESCAPED_SURROGATE.search(raw) is not None


def _bad(text: str) -> bool:
    return not text.isascii() and _SURROGATE.search(text) is not None


def _join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def lone_surrogate_at(value: Any, root: str = "") -> str | None:
    """Where the first string (a value, or a field name) holding a lone surrogate is, as a field path
    (`messages[0].content`; a field name reads `a field name in 'messages[0]'`), or None. Iterative:
    nesting is bounded by the parser, not by this walk."""
    if isinstance(value, str):
        return (root or "the body") if _bad(value) else None
    stack: list[tuple[Any, str]] = [(value, root)]
    while stack:
        node, path = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, child in items:
            if isinstance(key, str) and _bad(key):
                return f"a field name in '{path}'" if path else "a field name"
            if isinstance(child, str):
                if _bad(child):
                    return _join(path, key)
            elif isinstance(child, dict | list):  # only containers are queued: a long list of numbers is one pass
                stack.append((child, _join(path, key)))
    return None


def not_unicode_message(where: str) -> str:
    field = where if where.startswith("a field name") or where == "the body" else f"'{where}'"
    return f"{field}: text is not valid Unicode (a lone UTF-16 surrogate escape such as \\ud800)"
