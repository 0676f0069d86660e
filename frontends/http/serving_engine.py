"""What the HTTP routes need from an engine: a local `Engine`, or the Ray ingress's `RoutedEngine`
that spreads requests over engine replicas (frontends/ray/engine.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import numpy as np

    from spekula.core.backend import ModelInfo
    from spekula.core.engine.engine import EngineConfig
    from spekula.core.events import Event, FinalEvent
    from spekula.core.modelfile.grammar_llg import Grammars
    from spekula.core.params import CompletionRequest


class RequestStream(Protocol):
    id: str
    final: FinalEvent | None

    def __aiter__(self) -> AsyncIterator[Event]: ...

    async def result(self) -> FinalEvent: ...

    def cancel(self) -> None: ...


class ModelFacts(Protocol):
    @property
    def info(self) -> ModelInfo: ...


class ServingEngine(Protocol):
    tokenizer: Any
    config: EngineConfig
    grammars: Grammars

    @property
    def backend(self) -> ModelFacts: ...

    def submit(self, req: CompletionRequest, *, session: str | None = None) -> RequestStream: ...

    async def embed(self, tokens: Sequence[int]) -> np.ndarray: ...

    def stats(self) -> dict[str, Any]: ...

    def slots(self) -> list[dict[str, Any]]: ...

    def health(self) -> dict[str, Any]: ...

    def props(self) -> dict[str, Any]: ...
