"""The `logit_bias` request field (frontends/schema/completion.py's schema): llama-server's and OpenAI's forms
-> (token id, bias) pairs for SamplingParams."""

from __future__ import annotations

import math
from typing import Any

from spekula.frontends.schema.errors import invalid_params

MAX_LOGIT_BIAS = 65_536  # entries per request
MAX_LOGIT_BIAS_TEXT = 1024  # characters of a text key
_BIAS_SHAPE = "'logit_bias' must be a list of [token, bias] pairs or an object mapping tokens to biases"


def parse(params: dict[str, Any], base: tuple[tuple[int, float], ...], tokenizer: Any) -> tuple[tuple[int, float], ...]:
    """llama-server's two forms: [[token, bias], ...] and {"token": bias, ...} (OpenAI's). A token is
    an id, or a text whose every token gets the bias (an object key that is all digits is an id);
    a bias is a number or false (the token is banned). Unlike llama-server, which skips entries it
    cannot use, a malformed entry or an id outside the vocabulary is an error naming the field."""
    value = params.get("logit_bias")
    if value is None:
        return base
    if not isinstance(value, dict | list):
        raise invalid_params(_BIAS_SHAPE, "logit_bias")
    if len(value) > MAX_LOGIT_BIAS:
        raise invalid_params(f"'logit_bias' has {len(value)} entries (at most {MAX_LOGIT_BIAS})", "logit_bias")
    if isinstance(value, dict):
        items = [(_object_key(k), b) for k, b in value.items()]
    else:
        if any(not isinstance(el, list) or len(el) != 2 for el in value):
            raise invalid_params(_BIAS_SHAPE, "logit_bias")
        items = [(el[0], el[1]) for el in value]
    # Texts are tokenized right here, on the request's path: their total is bounded like one text's.
    if sum(len(k) for k, _ in items if isinstance(k, str)) > MAX_LOGIT_BIAS_TEXT * 64:
        raise invalid_params(f"'logit_bias' texts add up to more than {MAX_LOGIT_BIAS_TEXT * 64} characters",
                             "logit_bias")
    n_vocab = tokenizer.n_vocab if tokenizer is not None else None
    out: list[tuple[int, float]] = []
    for key, raw in items:
        bias = _bias_value(raw)
        for token in _bias_tokens(key, tokenizer, n_vocab):
            out.append((token, bias))
        if len(out) > MAX_LOGIT_BIAS:
            raise invalid_params(f"'logit_bias' names more than {MAX_LOGIT_BIAS} tokens", "logit_bias")
    return tuple(out)


def _object_key(key: str) -> int | str:
    return int(key) if key.isascii() and key.lstrip("-").isdigit() and len(key) <= 12 else key


def _bias_value(raw: Any) -> float:
    if raw is False:
        return -math.inf
    if isinstance(raw, bool) or not isinstance(raw, int | float) or not math.isfinite(raw) or abs(raw) > 1e6:
        raise invalid_params("'logit_bias' biases must be numbers in [-1e6, 1e6] or false (a ban)", "logit_bias")
    return float(raw)


def _bias_tokens(key: Any, tokenizer: Any, n_vocab: int | None) -> list[int]:
    if isinstance(key, str):
        if tokenizer is None:
            raise invalid_params("'logit_bias' takes token ids here, not texts", "logit_bias")
        if len(key) > MAX_LOGIT_BIAS_TEXT:
            raise invalid_params(f"'logit_bias' texts are at most {MAX_LOGIT_BIAS_TEXT} characters", "logit_bias")
        return [int(t) for t in tokenizer.encode(key, add_special=False, parse_special=False)]
    if isinstance(key, bool) or not isinstance(key, int):
        raise invalid_params("'logit_bias' tokens must be token ids or texts", "logit_bias")
    if n_vocab is not None and not 0 <= key < n_vocab:
        raise invalid_params(f"'logit_bias' names token id {key} outside the vocabulary [0, {n_vocab})", "logit_bias")
    return [key]
