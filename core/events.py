"""What a request's stream carries: accepted pieces as they are emitted, then one final event."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from spekula.core.verify.token_probs import TokenProbs

StopType = Literal["eos", "limit", "word", "cancel", "error", "none"]


@dataclass(slots=True)
class PieceEvent:
    """Tokens emitted by one round, with which drafter proposed each (None = the target's own token)."""

    request_id: str
    tokens: list[int]
    text: str  # UTF-8-safe text for these tokens (may be empty if a character is incomplete)
    drafters: list[str | None]
    slot: int = -1  # the slot the request runs in
    probs: list[TokenProbs] | None = None  # one per token, when the request asked for probabilities
    timings: dict[str, Any] | None = None  # the request's timings so far, when it asked (timings_per_token)


@dataclass(slots=True)
class ProgressEvent:
    """How far the prompt has been processed, for a request that asked (return_progress): one when it
    reaches a slot (processed == cache, the reused prefix) and one after each prompt chunk's forward."""

    request_id: str
    total: int  # prompt tokens
    cache: int  # of them found in the slot's KV
    processed: int  # of them in the KV now, the cached ones included
    time_ms: float  # since the request reached its slot
    slot: int = -1
    timings: dict[str, Any] | None = None  # when the request asked (timings_per_token)


@dataclass(slots=True)
class FinalEvent:
    """llama-server /completion result fields."""

    request_id: str
    content: str
    tokens: list[int]
    stop_type: StopType
    stopping_word: str = ""
    timings: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    tokens_evaluated: int = 0  # prompt tokens
    slot: int = -1  # the slot that ran the request (-1: it never reached one)
    truncated: bool = False  # generation stopped because the slot's context was full
    # Set when the request's own `speculative` settings were refused before it ran (a drafter this
    # engine cannot create, synthetic rates that do not fit): the caller's parameter, not a failure.
    rejected_spec: bool = False
    probs: list[TokenProbs] | None = None  # one per generated token, when the request asked for them


Event = PieceEvent | ProgressEvent | FinalEvent
