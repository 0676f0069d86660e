"""Constrained decoding: what a request's grammar allows next, behind one small interface.

The scheduler and the planner see only `Constraint` (numpy masks and token lists); the grammar
engine behind it lives in core/modelfile/grammar_llg.py. A constraint is one request's state: it starts at
the grammar's start, advances by the tokens the request emits, and answers, for a draft, how much
of it the grammar allows and what every verification row may sample.

Exactness: verification row i is masked with the state after draft tokens 0..i-1, which is the
state plain decoding would be in at that token, so a constrained request emits with speculation
exactly what it emits without (greedy, sample-and-match with a fixed seed, and rejection sampling,
whose target distribution is the masked one: see `trim_draft`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np

from spekula.core.errors import SpekulaError

GrammarKind = Literal["gbnf", "json_schema", "lark", "regex"]


class ConstraintError(SpekulaError):
    """A grammar or schema that cannot be used; the message says where or which keyword."""


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """A request's constraint as given: llama.cpp GBNF, a JSON schema (as JSON text), Lark or a regex."""

    kind: GrammarKind
    source: str


class Constraint(Protocol):
    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens` (from the current state on) the grammar allows, without moving."""
        ...

    def mask_logits(self, logits: np.ndarray, draft: Sequence[int]) -> None:
        """Set to -inf, in place, what row i may not sample: the state after draft[:i] (rows past
        the draft's grammar-valid prefix get the last valid state's mask)."""
        ...

    def mask_row(self, row: np.ndarray, prefix: Sequence[int]) -> None:
        """Set to -inf, in place, what one row ([V]) may not sample in the state after `prefix`, a
        sequence the grammar allows."""
        ...

    def advance(self, tokens: Sequence[int]) -> None:
        """The request emitted `tokens` (end-of-generation tokens are not fed to the grammar)."""
        ...

    @property
    def stopped(self) -> bool:
        """The grammar is complete and allows nothing but the end of generation."""
        ...


def mask_for_argmax(constraint: Constraint, logits: np.ndarray, draft: Sequence[int]) -> None:
    """What `mask_logits` does, for a verifier whose token of every row is that row's argmax (a plain
    greedy sampler matching the draft): the same tokens come out, for a mask only on rows whose raw
    argmax the grammar forbids, instead of one on every row.

    Greedy verification walks the rows in order and stops at the first whose token differs from the
    draft's. A row whose raw argmax is the draft token keeps it under the mask (the grammar allows the
    draft token there), and one whose raw argmax the grammar allows keeps that: neither needs its mask.
    Only a row whose raw argmax is forbidden is masked, in the state after the draft tokens before it,
    and the walk goes on if its masked choice is the draft token. Rows after the stop are not read and
    keep their raw values, so a caller that reads row probabilities masks every row instead.
    """
    k = len(draft)
    n_valid = constraint.valid_prefix(draft)
    targets = np.argmax(logits[: k + 1], axis=1)
    prefix = [int(t) for t in draft[:n_valid]]
    j = 0
    while True:
        while j < n_valid and int(targets[j]) == prefix[j]:
            j += 1
        if constraint.valid_prefix([*prefix[:j], int(targets[j])]) == j + 1:
            return  # row j's raw argmax stands: verification stops here (or it is the bonus row)
        constraint.mask_row(logits[j], prefix[:j])
        if j < n_valid and int(np.argmax(logits[j])) == prefix[j]:
            j += 1
            continue
        return


def trim_draft(tokens: list[int], probs: np.ndarray | None, n_valid: int) -> tuple[list[int], np.ndarray | None, int]:
    """The part of a draft worth verifying under a grammar that allows its first `n_valid` tokens:
    (tokens, probs, tokens the grammar rejected).

    Without draft probabilities (greedy or sample-and-match verification) the first forbidden token
    and everything after it go: the target could never emit them, and the row that would have
    checked the forbidden token samples from the same masked distribution as the row before it
    without it. With probabilities (rejection sampling) the forbidden token stays as the draft's
    last: its target probability is 0, so it is rejected with certainty and the replacement comes
    from the residual distribution max(0, p - q), exactly as rejection sampling requires; only the
    tokens after it go. The draft distribution q is used as drafted, unmasked.
    """
    if n_valid >= len(tokens):
        return tokens, probs, 0
    keep = n_valid if probs is None else n_valid + 1
    rejected = len(tokens) - n_valid
    return tokens[:keep], None if probs is None else probs[:keep], rejected
