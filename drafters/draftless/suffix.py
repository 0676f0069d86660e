"""suffix: draft the most frequent continuation found in a suffix tree (not a llama.cpp type).

The technique of suffix decoding (Snowflake's Arctic Inference): two depth-bounded suffix trees
count every substring of at most `max-depth` tokens,

  * a per-request tree over the prompt and everything generated so far, and
  * one tree shared by all slots over the outputs of earlier requests (what an agent or an editor
    asks for again and again), bounded to `max-nodes` nodes by evicting the oldest outputs.

Each round it looks the current context up in both for every match length of at least `min-match`
tokens, follows the most frequent next token while the counts say the continuation is still likely
(the product of count(child)/count(node) stays >= `min-prob`), and drafts the continuation with the
most expected correct tokens. A longer and more frequent match so drafts further: the length is
capped by `factor` times the match length and by `n-max`, and frequency stops it where the text has
diverged before. Unlike the n-gram types it needs no fixed key length, so it picks a copied text
back up two tokens after an edit.

Options: ``SuffixDrafter.description`` (spekula's own, not llama.cpp names).

Why a match of one token is not enough by default: what follows a single token is a guess worth
about what its verification row costs. On open-ended chat (SmolLM2, greedy) about 15 % of
such one-token drafts were accepted, and a row there costs about as large a share of a round's time
(0.5-0.9 ms of 5-6 ms); after two matching tokens 33 % were, after five or more two in three. On
copied text one-token matches did better (39 %), but there the next round finds the two-token match,
which drafts further anyway.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from spekula.core.drafting.description import DrafterDescription, DrafterOption
from spekula.core.drafting.drafter import Draft, Drafter, DrafterContext, DraftlessDrafter, DraftRequest
from spekula.core.drafting.slot_states import SlotStates
from spekula.drafters.draftless.suffix_tree import SuffixTree

MAX_DEPTH = DrafterOption("spec-suffix-max-depth", int, 64, "longest substring counted (match + continuation)",
                          minimum=2, maximum=256)
N_MAX = DrafterOption("spec-suffix-n-max", int, 32, "longest draft", minimum=1, maximum=1024)
FACTOR = DrafterOption("spec-suffix-factor", float, 1.0, "draft at most factor x match-length tokens",
                       minimum=0.0, maximum=64.0, minimum_open=True, metavar="X")
MIN_PROB = DrafterOption("spec-suffix-min-prob", float, 0.1, "stop where the continuation's probability drops below",
                         minimum=0.0, maximum=1.0, metavar="P")
# a match is at most max-depth - 1 tokens (the continuation needs one more): create() narrows the maximum
MIN_MATCH = DrafterOption("spec-suffix-min-match", int, 2, "shortest match a draft may follow (< max-depth)",
                          minimum=1, maximum=255)
MAX_NODES = DrafterOption("spec-suffix-max-nodes", int, 262144, "node budget of the shared tree (0: no shared tree)",
                          minimum=0, maximum=1 << 30)


@dataclass
class _Request:
    """One request's own tree and the tokens it holds (prompt, then accepted output)."""

    tree: SuffixTree
    handle: int
    tokens: list[int] = field(default_factory=list)
    n_prompt: int = 0


class SuffixDrafter(DraftlessDrafter, Drafter):
    name: ClassVar[str] = "suffix"
    description: ClassVar[DrafterDescription] = DrafterDescription(
        summary="the most frequent continuation in suffix trees of this request and earlier outputs "
                "(suffix decoding; not a llama.cpp type)",
        options=(MAX_DEPTH, N_MAX, FACTOR, MIN_PROB, MIN_MATCH, MAX_NODES),
        builtin_order=5,  # after the llama.cpp draftless types (docs/semantics.md §10)
        slot_state="none",  # a tree per request; the pool of earlier outputs is server-wide
    )

    def __init__(self, *, max_depth: int = 64, n_max: int = 32, factor: float = 1.0, min_prob: float = 0.1,
                 min_match: int = 2, max_nodes: int = 262144) -> None:
        self.max_depth, self.n_max, self.factor, self.min_prob = max_depth, n_max, factor, min_prob
        self.min_match = min_match
        self.max_nodes = max_nodes
        self.shared = SuffixTree(max_depth) if max_nodes > 0 else None
        self._outputs: deque[int] = deque()  # handles of earlier outputs in the shared tree, oldest first
        self._slots: SlotStates[_Request] = SlotStates()

    @classmethod
    def create(cls, ctx: DrafterContext) -> SuffixDrafter:
        max_depth = ctx.int_value(MAX_DEPTH)
        return cls(
            max_depth=max_depth, n_max=ctx.int_value(N_MAX), factor=ctx.float_value(FACTOR),
            min_prob=ctx.float_value(MIN_PROB), min_match=ctx.int_value(MIN_MATCH, maximum=max_depth - 1),
            max_nodes=ctx.int_value(MAX_NODES),
        )

    @property
    def draft_cap(self) -> int:
        return self.n_max

    # -- per request ---------------------------------------------------------------------------
    def _fresh(self, slot: int, tokens: np.ndarray) -> _Request:
        old = self._slots.pop(slot)
        if old is not None:
            old.tree.close()
        tree = SuffixTree(self.max_depth)
        req = _Request(tree, tree.new_sequence())
        self._add(req, tokens)
        self._slots.put(slot, req)
        return req

    @staticmethod
    def _add(req: _Request, tokens: Sequence[int] | np.ndarray) -> None:
        req.tree.append(req.handle, tokens)
        req.tokens.extend(tokens.tolist() if isinstance(tokens, np.ndarray) else [int(t) for t in tokens])

    def begin(self, slot: int, prompt: np.ndarray) -> None:
        self._fresh(slot, prompt).n_prompt = len(prompt)

    def _sync(self, slot: int, hist: np.ndarray, last: int) -> _Request:
        """The request's tree holding exactly H + [x]: only accepted tokens are ever added."""
        req = self._slots.peek(slot)
        n, seen = len(hist) + 1, 0 if req is None else len(req.tokens)
        if req is None or seen > n or (seen and (hist[seen - 1] if seen <= len(hist) else last) != req.tokens[-1]):
            # No begin, or a history that does not extend what was seen: start over from it.
            req = self._fresh(slot, np.append(hist, np.int32(last)))
            req.n_prompt = len(hist)
            return req
        if seen < n:  # the round's accepted tokens (a view of the history) and x
            if seen < n - 1:
                self._add(req, hist[seen:])
            req.tree.push(req.handle, last)
            req.tokens.append(int(last))
        return req

    def draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        out: list[Draft] = []
        for r in requests:
            req = self._sync(r.slot, r.history, r.last)
            n = min(self.n_max, r.n_max)
            if n <= 0:
                out.append(Draft.empty())
                continue
            # The context is the tail of the request's own sequence. That tree holds the context
            # itself: its own occurrence has no continuation.
            best = req.tree.speculate_after(req.tree, req.handle, n, factor=self.factor, min_prob=self.min_prob,
                                            min_match=self.min_match, self_count=1)
            if self.shared is not None and self._outputs:
                other = self.shared.speculate_after(req.tree, req.handle, n, factor=self.factor,
                                                    min_prob=self.min_prob, min_match=self.min_match)
                if other.score > best.score:
                    best = other
            out.append(Draft(best.tokens))
        return out

    def accept(self, slot: int, n_accepted: int, mine: bool) -> None:
        return None  # the accepted tokens arrive with the next history

    def end(self, slot: int) -> None:
        req = self._slots.pop(slot)
        if req is None:
            return
        output = req.tokens[req.n_prompt :]
        req.tree.close()
        if self.shared is None or len(output) < 2:
            return
        # One output alone may not take the whole budget: keep its tail.
        output = output[-max(self.max_nodes // self.max_depth, 2) :]
        handle = self.shared.new_sequence()
        self._outputs.append(handle)
        try:
            self.shared.append(handle, output)
        finally:
            while self._outputs and self.shared.n_nodes > self.max_nodes:
                self.shared.remove(self._outputs.popleft())
