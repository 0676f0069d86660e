"""Token probabilities as llama-server and OpenAI clients read them.

- llama-server (`/completion`, the socket): `completion_probabilities`, one object per token with
  its id, text, bytes and `logprob` + `top_logprobs` (or, after sampling, `prob` + `top_probs`).
- OpenAI chat: `logprobs.content`, one object per token with `token`, `logprob`, `bytes` and
  `top_logprobs`.
- OpenAI completions (the legacy form): `logprobs` with parallel lists `tokens`, `token_logprobs`,
  `top_logprobs` (token text -> logprob) and `text_offset`.

A non-streamed answer that a stop word ended leaves out the probabilities of its last tokens, as many
as the stop word has when tokenized alone (llama-server's rule); a stream has sent every token's.
A token's text is its bytes read as UTF-8; a token holding part of a character reads as U+FFFD,
its `bytes` still exact. Probabilities of zero (a token the sampler chain removed) have no logprob
in JSON: OpenAI's form writes -9999.0 for them, as OpenAI does for tokens of no probability.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from spekula.core.verify.token_probs import TokenProbs

NO_LOGPROB = -9999.0


def _piece(tokenizer: Any, token: int) -> tuple[str, list[int]]:
    raw = tokenizer.token_bytes(token)
    return raw.decode("utf-8", errors="replace"), list(raw)


def _logprob(value: float, post_sampling: bool) -> float:
    lp = (math.log(value) if value > 0 else -math.inf) if post_sampling else value
    return lp if math.isfinite(lp) else NO_LOGPROB


def native(tokenizer: Any, probs: Sequence[TokenProbs]) -> list[dict[str, Any]]:
    out = []
    for p in probs:
        key, top_key = ("prob", "top_probs") if p.post_sampling else ("logprob", "top_logprobs")
        text, raw = _piece(tokenizer, p.token)
        top = []
        for t, v in p.top:
            t_text, t_raw = _piece(tokenizer, t)
            top.append({"id": t, "token": t_text, "bytes": t_raw, key: v})
        value = p.value if p.post_sampling or math.isfinite(p.value) else NO_LOGPROB
        out.append({"id": p.token, "token": text, "bytes": raw, key: value, top_key: top})
    return out


def openai_chat(tokenizer: Any, probs: Sequence[TokenProbs]) -> dict[str, Any]:
    content = []
    for p in probs:
        text, raw = _piece(tokenizer, p.token)
        top = []
        for t, v in p.top:
            t_text, t_raw = _piece(tokenizer, t)
            top.append({"token": t_text, "logprob": _logprob(v, p.post_sampling), "bytes": t_raw})
        content.append({"token": text, "logprob": _logprob(p.value, p.post_sampling), "bytes": raw,
                        "top_logprobs": top})
    return {"content": content, "refusal": None}


def openai_completion(tokenizer: Any, probs: Sequence[TokenProbs], offset: int = 0) -> dict[str, Any]:
    """`offset`: the text offset (in characters) of the first token, for a stream's later chunks."""
    tokens, logprobs, tops, offsets = [], [], [], []
    for p in probs:
        text, _raw = _piece(tokenizer, p.token)
        tokens.append(text)
        logprobs.append(_logprob(p.value, p.post_sampling))
        tops.append({_piece(tokenizer, t)[0]: _logprob(v, p.post_sampling) for t, v in p.top})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def answer_probs(tokenizer: Any, final: Any) -> list[TokenProbs] | None:
    """A non-streamed answer's probabilities as llama-server returns them: when a stop word ended the
    answer, without its last tokens, as many as the stop word has when tokenized on its own (the
    content ends before the stop word, so its probabilities do too; a stream has sent them already)."""
    probs = final.probs
    if probs is None or final.stop_type != "word" or not final.stopping_word:
        return probs
    n_word = len(tokenizer.encode(final.stopping_word, add_special=False, parse_special=False))
    return list(probs[: max(len(probs) - n_word, 0)])


def shown(tokenizer: Any, probs: Sequence[TokenProbs] | None) -> list[TokenProbs]:
    """The probabilities of the tokens that are part of the answer's text: an end-of-generation token
    ends the answer without being written into it, so OpenAI's forms leave it out."""
    return [p for p in probs or () if not tokenizer.is_eog(p.token)]
