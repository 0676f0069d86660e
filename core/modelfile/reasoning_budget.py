"""A positive reasoning budget, as llama.cpp 11434's reasoning-budget sampler runs it, as a `Constraint`.

After `budget` tokens inside a reasoning block (opened by the start sequence, closed by any end
sequence) the budget forces its message and the first end sequence, token by token. The state machine
is llama.cpp's: IDLE -> COUNTING -> WAITING_UTF8 -> FORCING -> DONE (a new start sequence re-arms it).
WAITING_UTF8 lets a character split over tokens finish before forcing begins.

It depends only on the tokens emitted, so it is one request's constraint like a grammar: it advances
by the tokens the request emits, cuts a draft at the first token the forcing would not emit, and masks
each verification row with its state after the draft tokens before it. Speculation then emits exactly
what plain decoding does (core/modelfile/constraint.py). With a grammar beside it (`JointConstraint`)
the budget forces first; where the grammar forbids the token it would force (llama.cpp leaves no token
at all there), the grammar's choice stands and the forcing ends.

The reasoning a prompt leaves open counts as llama-server counts its generation prompt: the prompt's
tokens from its last start sequence on are fed to the state machine before the first generated token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np

from spekula.core.modelfile.constraint import Constraint


@dataclass(frozen=True, slots=True)
class ReasoningBudget:
    """A request's reasoning budget in token ids (llama-server's reasoning_budget_* sampling fields)."""

    budget: int  # tokens allowed inside a reasoning block (>= 0)
    start: tuple[int, ...]  # the start sequence (the template's opening tag)
    ends: tuple[tuple[int, ...], ...]  # sequences that end reasoning; the first is the forced one
    forced: tuple[int, ...]  # the message, then the first end sequence

    def __post_init__(self) -> None:
        if self.budget < 0 or not self.start or not any(self.ends) or not self.forced:
            raise ValueError("a reasoning budget needs budget >= 0, a start, an end and a forced sequence")


class BudgetState(Enum):
    IDLE = "idle"  # waiting for the start sequence
    COUNTING = "counting"  # counting down, watching for an end sequence
    WAITING_UTF8 = "waiting_utf8"  # budget spent, letting a split character finish
    FORCING = "forcing"  # forcing the message and end sequence
    DONE = "done"  # passthrough until a new start sequence


class _Matcher:
    """The longest of `seqs` that ends at the last token since the last match (llama.cpp's Aho-Corasick
    matcher, reset after every match)."""

    def __init__(self, seqs: Sequence[Sequence[int]]) -> None:
        self.seqs: list[tuple[int, ...]] = []
        for s in seqs:
            if s and tuple(s) not in self.seqs:
                self.seqs.append(tuple(s))
        self._longest = max(map(len, self.seqs), default=0)
        self.window: tuple[int, ...] = ()

    def advance(self, token: int) -> int:
        """The index of the longest sequence ending here (-1: none)."""
        self.window = (*self.window, token)[-self._longest:]
        best = -1
        for i, s in enumerate(self.seqs):
            if self.window[-len(s):] == s and (best < 0 or len(s) > len(self.seqs[best])):
                best = i
        if best >= 0:
            self.window = ()
        return best


def utf8_complete(piece: bytes) -> bool:
    """Whether `piece` does not end inside a UTF-8 character (llama.cpp's common_utf8_is_complete)."""
    if not piece:
        return True
    for i in range(1, min(4, len(piece)) + 1):
        c = piece[-i]
        if c & 0xC0 != 0x80:
            expected = 4 if c >= 0xF0 else 3 if c >= 0xE0 else 2 if c >= 0xC0 else 1
            return i >= expected
    return False


@dataclass(slots=True)
class BudgetMachine:
    """The state machine itself; `piece` gives a token's bytes (for the UTF-8 check)."""

    spec: ReasoningBudget
    piece: Callable[[int], bytes]
    state: BudgetState = BudgetState.IDLE
    remaining: int = -1  # -1: the whole budget
    force_pos: int = 0
    start: _Matcher = field(init=False)
    end: _Matcher = field(init=False)

    def __post_init__(self) -> None:
        self.start = _Matcher([self.spec.start])
        self.end = _Matcher(self.spec.ends)
        if self.remaining < 0:
            self.remaining = self.spec.budget

    def clone(self) -> BudgetMachine:
        twin = BudgetMachine(self.spec, self.piece, self.state, self.remaining, self.force_pos)
        twin.start.window, twin.end.window = self.start.window, self.end.window
        return twin

    def forced_next(self) -> int | None:
        """The token the budget forces next, or None when any may come."""
        return self.spec.forced[self.force_pos] if self.state is BudgetState.FORCING else None

    def _arm(self) -> None:
        self.remaining = self.spec.budget
        self.end.window = ()
        self.state, self.force_pos = (BudgetState.FORCING, 0) if self.remaining <= 0 else (BudgetState.COUNTING, 0)

    def accept(self, token: int) -> None:
        st = self.state
        if st in (BudgetState.IDLE, BudgetState.DONE):
            if self.start.advance(token) >= 0:
                self._arm()
        elif st is BudgetState.FORCING:
            if token != self.spec.forced[self.force_pos]:
                # only where a grammar beside the budget forbade the forced token: the forcing ends
                self.state = BudgetState.DONE
                return
            self.end.advance(token)
            self.force_pos += 1
            if self.force_pos >= len(self.spec.forced):
                self.state = BudgetState.DONE
        else:  # COUNTING or WAITING_UTF8
            if self.end.advance(token) >= 0:
                self.state = BudgetState.DONE
                return
            complete = utf8_complete(self.piece(token))
            if st is BudgetState.COUNTING:
                self.remaining -= 1
                if self.remaining > 0:
                    return
                self.state = BudgetState.WAITING_UTF8
                self.end.window = ()
            if complete:
                self.state, self.force_pos = BudgetState.FORCING, 0
                self.end.window = ()


def _force(row: np.ndarray, token: int) -> None:
    """Leave `row` (in place) nothing to sample but `token`."""
    keep = row[token]
    row[:] = -np.inf
    row[token] = keep


class ReasoningBudgetConstraint:
    """One request's reasoning budget (the `Constraint` of core/modelfile/constraint.py)."""

    def __init__(self, spec: ReasoningBudget, piece: Callable[[int], bytes], prompt: Sequence[int] = ()) -> None:
        self.machine = BudgetMachine(spec, piece)
        for t in prompt[_last_start(prompt, spec.start):]:
            self.machine.accept(int(t))

    def _walk(self, tokens: Sequence[int], allowed: Callable[[int, int], bool] | None = None) -> tuple[int, BudgetMachine]:
        """How many of `tokens` the forcing allows, and the state after them. `allowed(i, forced)`: whether
        a grammar allows the forced token at position i (None: it does)."""
        m = self.machine.clone()
        for i, t in enumerate(tokens):
            f = m.forced_next()
            if f is not None and int(t) != f and (allowed is None or allowed(i, f)):
                return i, m
            m.accept(int(t))
        return len(tokens), m

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        return self._walk(tokens)[0]

    def mask_rows(self, logits: np.ndarray, draft: Sequence[int], n_valid: int,
                  allowed: Callable[[int, int], bool] | None = None) -> None:
        """Force rows: row r gets the state after draft[:min(r, n_valid)]."""
        m = self.machine.clone()
        for r in range(logits.shape[0]):
            if r > 0 and r <= n_valid:
                m.accept(int(draft[r - 1]))
            f = m.forced_next()
            if f is not None and (allowed is None or allowed(min(r, n_valid), f)):
                _force(logits[r], f)

    def mask_logits(self, logits: np.ndarray, draft: Sequence[int]) -> None:
        self.mask_rows(logits, draft, self.valid_prefix(draft))

    def force_row(self, row: np.ndarray, prefix: Sequence[int], allowed: Callable[[int, int], bool] | None = None) -> None:
        """mask_rows for one row in the state after `prefix` (which the forcing allows)."""
        m = self.machine.clone()
        for t in prefix:
            m.accept(int(t))
        f = m.forced_next()
        if f is not None and (allowed is None or allowed(len(prefix), f)):
            _force(row, f)

    def mask_row(self, row: np.ndarray, prefix: Sequence[int]) -> None:
        self.force_row(row, prefix)

    def advance(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            self.machine.accept(int(t))

    @property
    def stopped(self) -> bool:
        return False


class JointConstraint:
    """A reasoning budget beside a grammar: both hold, the budget forcing first (see the module's text)."""

    def __init__(self, budget: ReasoningBudgetConstraint, grammar: Constraint) -> None:
        self.budget = budget
        self.grammar = grammar

    def _allowed(self, tokens: Sequence[int]) -> Callable[[int, int], bool]:
        def allowed(i: int, forced: int) -> bool:
            return self.grammar.valid_prefix([*tokens[:i], forced]) == i + 1
        return allowed

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        n = self.grammar.valid_prefix(tokens)
        return self.budget._walk(tokens[:n], self._allowed(tokens))[0]

    def mask_logits(self, logits: np.ndarray, draft: Sequence[int]) -> None:
        self.grammar.mask_logits(logits, draft)
        self.budget.mask_rows(logits, draft, self.valid_prefix(draft), self._allowed(draft))

    def mask_row(self, row: np.ndarray, prefix: Sequence[int]) -> None:
        self.grammar.mask_row(row, prefix)
        self.budget.force_row(row, prefix, self._allowed(prefix))

    def advance(self, tokens: Sequence[int]) -> None:
        self.grammar.advance(tokens)
        self.budget.advance(tokens)

    @property
    def stopped(self) -> bool:
        return self.grammar.stopped


def token_piece_of(tokenizer: Any) -> Callable[[int], bytes]:
    """A token's bytes as decoded output holds them (a tokenizer without bytes: its text), for the UTF-8 check."""
    if hasattr(tokenizer, "token_bytes"):
        return lambda t: bytes(tokenizer.token_bytes(t))
    return lambda t: str(tokenizer.token_text(t)).encode()


def _last_start(prompt: Sequence[int], start: Sequence[int]) -> int:
    """Where the prompt's last start sequence begins (len(prompt): none)."""
    n = len(start)
    for i in range(len(prompt) - n, -1, -1):
        if tuple(prompt[i:i + n]) == tuple(start):
            return i
    return len(prompt)
