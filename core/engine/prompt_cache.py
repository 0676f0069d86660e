"""Prompt caching: which idle slot a request goes to, and how much of that slot's KV it reuses.

A slot keeps its KV sequence after a request ends; the token ids behind it stay in the slot's
history buffer. The next request whose prompt starts with the same tokens skips evaluating them:
only the rest of the prompt is prefilled. On the exact backends a row's KV and logits do not
depend on which forward computed it (the conformance suite's truncate-then-continue and batching
checks), so a reused prefix changes no output token.

Slot choice follows llama-server: among the idle slots, the one whose cached tokens share the
longest prefix with the prompt, provided that prefix covers more than `similarity` of the prompt;
otherwise the slot used least recently (its cache is the least likely to be wanted again).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from spekula.core.drafting.drafter import Drafter


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two token arrays."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def drafters_reuse_prefix(drafters: Sequence[Drafter]) -> bool:
    """Whether every drafter can start from a prompt whose prefix the target did not re-evaluate.

    Draftless drafters and draft-simple read the history they are given (`begin` receives the whole
    prompt; draft-simple re-syncs its own KV lazily). The hidden-state drafters (EAGLE-3, DFlash,
    DSpark) are fed the target's layer activations of every prompt row, which a skipped prefix
    does not produce, so their requests evaluate the whole prompt.
    """
    return not any(d.capture() for d in drafters)


@dataclass(slots=True)
class SlotCache:
    """What an idle slot offers a new request."""

    slot: int
    tokens: np.ndarray  # token ids whose KV the slot's sequence holds, in order
    last_used: float  # when its previous request ended (perf_counter), for the LRU fallback


def choose_slot(caches: Sequence[SlotCache], prompt: np.ndarray, similarity: float, use_cache: bool) -> tuple[int, int]:
    """(slot, tokens of the prompt already in its KV) for a request over the idle slots `caches`.

    The reused length always leaves at least one prompt token to evaluate: its logits give the
    first generated token.
    """
    assert caches, "choose_slot needs at least one idle slot"
    best: SlotCache | None = None
    best_n = 0
    if use_cache and similarity > 0:  # 0 turns similarity routing off, as in llama-server
        for c in caches:
            n = common_prefix(c.tokens, prompt)
            if n > best_n and n > similarity * len(prompt):
                best, best_n = c, n
    if best is None:
        best = min(caches, key=lambda c: c.last_used)
        best_n = common_prefix(best.tokens, prompt) if use_cache else 0
    return best.slot, min(best_n, len(prompt) - 1)
