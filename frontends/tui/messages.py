"""Every message the TUI's workers post to the app (toolong style: dataclasses in one module).

High-rate messages define `can_replace`, so when the UI falls behind a newer statistics snapshot
replaces a queued older one instead of piling up.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from textual.message import Message


@dataclass
class PieceReceived(Message):
    """One streamed chunk: its text split per token (when it can be) and who proposed each token."""

    content: str
    pieces: list[str]
    drafters: list[str | None]


@dataclass
class GenerationStarted(Message):
    request_params: dict[str, Any]


@dataclass
class GenerationDone(Message):
    result: dict[str, Any]


@dataclass
class GenerationFailed(Message):
    error: str


@dataclass
class StatsUpdated(Message):
    stats: dict[str, Any]
    slots: list[dict[str, Any]]
    health: dict[str, Any]

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, StatsUpdated)


@dataclass
class ThroughputSample(Message):
    tokens_per_s: float

    def can_replace(self, message: Message) -> bool:
        # Samples feed a sparkline; dropping one under load only smooths the curve.
        return isinstance(message, ThroughputSample)


@dataclass
class SourceReady(Message):
    """The engine (embedded) or the server connection (attached) is ready; props describe it."""

    props: dict[str, Any] = field(default_factory=dict)


@dataclass
class SourceFailed(Message):
    error: str
