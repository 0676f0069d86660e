"""llama-server's `prompt` forms -> token ids, one list per prompt.

A prompt is a string, token ids, a mix of both (`[1, 2, "text", 3]`: the pieces joined in order),
or `{"prompt_string": "..."}`. A list whose elements are themselves prompts (strings, lists,
objects) is a batch: one completion per element, answered as a JSON array.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from spekula.frontends.http.errors import HttpError

Encode = Callable[..., Awaitable[list[int]]]
MAX_BATCH = 64
_BAD = ('"prompt" elements must be a string, a list of tokens, a JSON object containing a prompt string, '
        "or a list of mixed strings & tokens")


def split_batch(value: Any) -> list[Any]:
    """The prompts of a request: a batch's elements, or the one prompt."""
    if isinstance(value, list) and value and any(isinstance(v, list | dict) for v in value):
        if not all(isinstance(v, str | list | dict) for v in value):
            raise HttpError(_BAD)
        if len(value) > MAX_BATCH:
            raise HttpError(f"'prompt' holds {len(value)} prompts (at most {MAX_BATCH} per request)")
        return list(value)
    if isinstance(value, list) and len(value) > 1 and all(isinstance(v, str) for v in value):
        return list(value)  # several text prompts
    return [value]


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
    ids: list[int] = []
    for i, part in enumerate(value):
        if isinstance(part, bool) or not isinstance(part, int | str):
            raise HttpError(_BAD)
        if isinstance(part, str):
            ids.extend(await encode(part, add_special=i == 0))
        elif not 0 <= part < n_vocab:
            raise HttpError(f"Prompt contains invalid tokens: id {part} is outside the vocabulary [0, {n_vocab})")
        else:
            ids.append(part)
    return ids, None
