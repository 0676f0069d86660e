"""llama-server's `prompt` forms -> token ids, one list per prompt.

A prompt is a string, token ids, a mix of both (`[1, 2, "text", 3]`: the pieces joined in order),
or `{"prompt_string": "..."}`. A list whose elements are themselves prompts (strings, lists,
objects) is a batch: one completion per element, answered as a JSON array.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.lowlevel

from spekula.frontends.http.errors import HttpError

Encode = Callable[..., Awaitable[list[int]]]
MAX_BATCH = 64
# Prompt entries checked per turn of the event loop: a few milliseconds of work.
_CHECKED_PER_TURN = 65_536
_BAD = ('"prompt" elements must be a string, a list of tokens, a JSON object containing a prompt string, '
        "or a list of mixed strings & tokens")


async def element_kinds(value: list[Any]) -> set[type]:
    """The types of a list's elements, a slice per turn of the event loop: a list of millions takes a
    few hundred milliseconds even in C, and other requests are served meanwhile."""
    kinds: set[type] = set()
    for start in range(0, len(value), _CHECKED_PER_TURN):
        if start:
            await anyio.lowlevel.checkpoint()
        kinds.update(map(type, value[start:start + _CHECKED_PER_TURN]))
    return kinds


def split_batch(value: Any, kinds: set[type] | None = None) -> list[Any]:
    """The prompts of a request: a batch's elements, or the one prompt. `kinds`: `element_kinds(value)`,
    when the caller has it."""
    if not isinstance(value, list) or not value:
        return [value]
    kinds = set(map(type, value)) if kinds is None else kinds
    if kinds & {list, dict}:
        if not kinds <= {str, list, dict}:
            raise HttpError(_BAD)
        if len(value) > MAX_BATCH:
            raise HttpError(f"'prompt' holds {len(value)} prompts (at most {MAX_BATCH} per request)")
        return list(value)
    if len(value) > 1 and kinds == {str}:
        return list(value)  # several text prompts
    return [value]


async def _in_vocabulary(ids: list[int], n_vocab: int) -> bool:
    for start in range(0, len(ids), _CHECKED_PER_TURN):
        if start:
            await anyio.lowlevel.checkpoint()
        chunk = ids[start:start + _CHECKED_PER_TURN]
        if min(chunk) < 0 or max(chunk) >= n_vocab:
            return False
    return True


async def prompt_tokens(value: Any, encode: Encode, n_vocab: int) -> tuple[list[int], str | None]:
    """One prompt's token ids, and its text when it was given as text alone."""
    if isinstance(value, dict):
        if "multimodal_data" in value:
            raise HttpError("Multimodal data provided, but model does not support multimodal requests.")
        text = value.get("prompt_string")
        if not isinstance(text, str) or set(value) - {"prompt_string"}:
            raise HttpError("a prompt object must hold a string 'prompt_string' (and nothing else)")
        value = text
    if isinstance(value, str):
        return await encode(value), value
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        return await encode(value[0]), value[0]
    if not isinstance(value, list) or not value:
        raise HttpError(_BAD if value != [] else "'prompt' is empty")
    if await element_kinds(value) == {int} and await _in_vocabulary(value, n_vocab):
        return list(value), None  # token ids alone, checked in C a slice at a time
    ids: list[int] = []
    for i, part in enumerate(value):
        if i % _CHECKED_PER_TURN == _CHECKED_PER_TURN - 1:
            await anyio.lowlevel.checkpoint()  # a list of millions: other requests are served meanwhile
        if isinstance(part, bool) or not isinstance(part, int | str):
            raise HttpError(_BAD)
        if isinstance(part, str):
            ids.extend(await encode(part, add_special=i == 0))
        elif not 0 <= part < n_vocab:
            raise HttpError(f"Prompt contains invalid tokens: id {part} is outside the vocabulary [0, {n_vocab})")
        else:
            ids.append(part)
    return ids, None
