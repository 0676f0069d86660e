"""DRY ("don't repeat yourself"): a penalty on every token that would extend a repetition.

The history is the last `dry_penalty_last_n` accepted tokens (the prompt's included, as for the
repetition penalties). For each earlier place where the history's suffix also occurs, the token
that followed it there would extend the repetition; a repetition longer than `allowed_length`
costs that token `multiplier * base^(length - allowed_length)` (the exponent capped so the penalty
stays a finite float32). A sequence breaker (by default newline, colon, quote, asterisk) in the
history limits how far back a repetition may reach, and a token that is a breaker by itself is never
penalised. Breakers are strings; `breaker_sequences` turns them into token sequences the way
llama.cpp does: every token whose text contains a breaker is a breaker by itself, and a token whose
text ends with the breaker's head is one when followed by the tokens of the breaker's rest.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Protocol

import numpy as np

# A head token -> the tails that complete a breaker after it (an empty tail: the head alone is one).
Breakers = Mapping[int, tuple[tuple[int, ...], ...]]

MAX_BREAKER_CHARS = 40  # longer breakers are cut to this many bytes
MAX_TAIL_TOKENS = 20  # a breaker's tail is cut to this many tokens
FLOAT_MAX_LOG = 88.7228391  # log of float32's largest value: caps the exponent


class BreakerTokenizer(Protocol):
    n_vocab: int

    def token_bytes(self, token: int) -> bytes: ...

    def encode(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]: ...


def breaker_sequences(tokenizer: BreakerTokenizer, breakers: Iterable[str]) -> dict[int, tuple[tuple[int, ...], ...]]:
    """Every token sequence that spells one of `breakers` (empty breakers are skipped)."""
    texts = [tokenizer.token_bytes(t) for t in range(tokenizer.n_vocab)]
    # Only a token holding a breaker's first byte can start one: find those with one numpy pass over
    # the concatenated texts rather than a Python loop over the vocabulary per breaker.
    flat = np.frombuffer(b"".join(texts), dtype=np.uint8)
    ends = np.cumsum([len(w) for w in texts])
    found: dict[int, list[tuple[int, ...]]] = {}
    for breaker in breakers:
        raw = breaker.encode("utf-8")[:MAX_BREAKER_CHARS]
        if not raw:
            continue
        holders = np.unique(np.searchsorted(ends, np.flatnonzero(flat == raw[0]), side="right"))
        for token in holders.tolist():
            word = texts[token]
            tails = found.setdefault(token, [])
            if raw in word:
                if () not in tails:
                    tails.append(())
                continue
            pos = word.find(raw[:1])
            while pos != -1:
                n = 1
                while n < len(raw) and pos + n < len(word) and word[pos + n] == raw[n]:
                    n += 1
                if pos + n == len(word):  # the word ends in the breaker's first n bytes
                    rest = raw[n:].decode("utf-8", errors="ignore")
                    tail = tuple(tokenizer.encode(rest, add_special=False, parse_special=False)[:MAX_TAIL_TOKENS])
                    if tail not in tails:
                        tails.append(tail)
                pos = word.find(raw[:1], pos + 1)
    return {t: tuple(tails) for t, tails in found.items() if tails}


class DryHistory:
    """The accepted tokens DRY looks back over, and the penalties they imply for the next token."""

    def __init__(self, multiplier: float, base: float, allowed_length: int, last_n: int, breakers: Breakers) -> None:
        self.multiplier, self.base = multiplier, base
        self.allowed_length, self.last_n = allowed_length, last_n
        self.breakers = breakers
        self.tokens: deque[int] = deque(maxlen=last_n)
        self.max_exponent = int(FLOAT_MAX_LOG / math.log(base)) if base > 1.000001 else 0

    def accept(self, token: int) -> None:
        self.tokens.append(int(token))

    def copy(self) -> DryHistory:
        other = DryHistory.__new__(DryHistory)
        other.multiplier, other.base = self.multiplier, self.base
        other.allowed_length, other.last_n = self.allowed_length, self.last_n
        other.breakers, other.max_exponent = self.breakers, self.max_exponent
        other.tokens = deque(self.tokens, maxlen=self.tokens.maxlen)
        return other

    def _repeat_limit(self, last: list[int]) -> int:
        """How far back a repetition may reach: up to the nearest complete breaker, newest first."""
        n = len(last)
        for i in range(n):  # last[i] is i tokens from the end
            tails = self.breakers.get(last[i])
            if tails is None:
                continue
            longest = -1
            for tail in tails:
                size = len(tail)
                if longest < size <= i and all(tail[j] == last[i - j - 1] for j in range(size)):
                    longest = size
            if longest >= 0:
                return i - longest
        return n

    def penalties(self) -> dict[int, float]:
        """token -> the amount its logit loses if it came next (empty when nothing repeats)."""
        n = len(self.tokens)
        if n <= self.allowed_length:
            return {}
        last = list(reversed(self.tokens))  # newest first
        limit = self._repeat_limit(last)
        if limit < self.allowed_length:
            return {}
        # repeat[k]: how many of the newest tokens also occur right before the token k places back
        # (a Z-array over the reversed history, each length capped by the breaker limit).
        z = [0] * n
        lt = rt = 0
        for k in range(1, n):
            if k > rt:
                m = 0
                while m + k < n and last[m] == last[m + k]:
                    m += 1
                z[k] = m
                if m:
                    lt, rt = k, k + m - 1
            elif z[k - lt] < rt - k + 1:
                z[k] = z[k - lt]
            else:
                i = rt + 1
                while i < n and last[i] == last[i - k]:
                    i += 1
                z[k] = i - k
                lt, rt = k, i - 1
        longest: dict[int, int] = {}
        for k in range(1, n):
            length = min(z[k], limit)
            if length >= self.allowed_length:
                following = last[k - 1]  # the token after the repeated suffix's earlier occurrence
                if longest.get(following, -1) < length:
                    longest[following] = length
        out: dict[int, float] = {}
        for token, length in longest.items():
            if () in self.breakers.get(token, ()):
                continue
            exponent = length - self.allowed_length
            if self.max_exponent > 0:
                exponent = min(exponent, self.max_exponent)
            out[token] = self.multiplier * self.base ** exponent
        return out
