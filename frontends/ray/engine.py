"""The HTTP frontend's engine, made of N Ray Serve engine replicas (the ingress side).

`RoutedEngine` answers the same calls the HTTP routes make on a local Engine (`submit`, `stats`,
`slots`, `health`, `props`, `tokenizer`, `config`, `grammars`), so frontends/http_*.py serve a
Ray deployment unchanged. Each request goes to the replica a PrefixRouter picks; its events stream
back through Ray. Slots are numbered across replicas (replica r's slot s is r * n_slots + s), so
`id_slot` and the `id_slot` of an answer name one slot of one replica.

Faults: a replica that dies before a request has sent anything to its client gets that request
retried once on another replica (a non-streamed request has sent nothing until it ends, so it is
always retried once); a stream cut after its first event ends with a clear error event. The
replica is marked down (no new work, its cache mirror dropped) until a probe finds it answering
again (Ray restarts it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
from collections.abc import AsyncIterator, Sequence
from typing import Any

import anyio
import numpy as np
from ray.exceptions import RayActorError, TaskCancelledError
from ray.serve.exceptions import DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle

from spekula.core.backend import ModelInfo
from spekula.core.engine.embedding_jobs import EmbeddingsOff
from spekula.core.engine.engine import EngineConfig
from spekula.core.events import Event, FinalEvent
from spekula.core.modelfile.grammar_llg import Grammars
from spekula.core.params import CompletionRequest
from spekula.frontends.ray.router import PrefixRouter
from spekula.frontends.ray.stats import merge_snapshots

log = logging.getLogger("spekula.ray")
# The replica process is gone or cannot be reached: the request never ran there to completion.
REPLICA_GONE: tuple[type[BaseException], ...] = (RayActorError, DeploymentUnavailableError)
PROBE_TIMEOUT_S = 5.0
PROBE_PERIOD_S = 1.0


@dataclasses.dataclass(frozen=True)
class RemoteModel:
    """`engine.backend` as the routes use it: only the model facts."""

    info: ModelInfo


class RoutedEngine:
    def __init__(self, handles: list[DeploymentHandle], described: dict[str, Any], tokenizer: Any) -> None:
        self.handles = handles
        self.n_replicas = len(handles)
        local: EngineConfig = described["config"]
        self.per_replica = local.n_slots
        self.config = dataclasses.replace(local, n_slots=local.n_slots * self.n_replicas)
        self.backend = RemoteModel(described["model"])
        self.tokenizer = tokenizer
        self.grammars = Grammars(tokenizer)  # a bad grammar is refused here, before any replica sees it
        self._props = dict(described["props"], n_slots=self.config.n_slots, replicas=self.n_replicas)
        self.router = PrefixRouter(self.n_replicas, self.per_replica,
                                   min_prefix_fraction=local.slot_prompt_similarity)
        self._reports: list[dict[str, Any] | None] = [None] * self.n_replicas
        self._pids: list[int | None] = [None] * self.n_replicas
        self.requests_retried = 0  # requests whose replica died before they sent anything, run again

    # -- requests --------------------------------------------------------------------------------
    def submit(self, req: CompletionRequest, *, session: str | None = None) -> RoutedRequest:
        if not req.id:
            req.id = secrets.token_hex(8)
        return RoutedRequest(self, req, session)

    async def embed(self, tokens: Sequence[int]) -> np.ndarray:
        raise EmbeddingsOff("embeddings are not served behind --ray (start spekula serve without --ray)")

    def global_slot(self, replica: int, slot: int) -> int:
        return replica * self.per_replica + slot if slot >= 0 else slot

    # -- reports -----------------------------------------------------------------------------------
    async def refresh(self) -> None:
        """Ask every replica for its live state (in parallel, each bounded by PROBE_TIMEOUT_S)."""
        async with anyio.create_task_group() as tg:
            for r in range(self.n_replicas):
                tg.start_soon(self._probe, r)

    async def watch(self) -> None:
        """Forever: probe the replicas marked down, so a restarted one gets work again."""
        while True:
            await anyio.sleep(PROBE_PERIOD_S)
            down = [r for r, v in enumerate(self.router.replicas) if not v.up]
            if down:
                async with anyio.create_task_group() as tg:
                    for r in down:
                        tg.start_soon(self._probe, r)

    async def _probe(self, r: int) -> None:
        response = self.handles[r].report.remote()
        try:
            with anyio.fail_after(PROBE_TIMEOUT_S):
                report = await response
        except (TimeoutError, *REPLICA_GONE) as exc:
            response.cancel()
            if self.router.replicas[r].up:
                log.warning("replica %d is not answering (%s); routing around it", r, type(exc).__name__)
            self.router.failed(r)
            self._reports[r] = None
            return
        if self._pids[r] is not None and report["pid"] != self._pids[r]:
            self.router.failed(r)  # a new process: whatever its predecessor cached is gone
        self._pids[r] = report["pid"]
        self._reports[r] = report
        if not self.router.replicas[r].up:
            log.warning("replica %d is answering again", r)
        self.router.recovered(r)

    def stats(self) -> dict[str, Any]:
        return merge_snapshots([rep["stats"] for rep in self._reports if rep is not None])

    def slots(self) -> list[dict[str, Any]]:
        out = []
        for r, rep in enumerate(self._reports):
            for s in rep["slots"] if rep is not None else []:
                out.append(dict(s, id=self.global_slot(r, s["id"]), replica=r))
        return out

    def health(self) -> dict[str, Any]:
        live = [rep["health"] for rep in self._reports if rep is not None]
        replicas = [{"replica": r, "up": v.up and self._reports[r] is not None, "pid": self._pids[r],
                     "in_flight": v.in_flight,
                     "routed": v.routed, "prefix_routed": v.prefix_hits} for r, v in enumerate(self.router.replicas)]
        return {"status": "ok" if live else "unavailable",
                "slots_idle": sum(h["slots_idle"] for h in live), "slots_busy": sum(h["slots_busy"] for h in live),
                "queued": sum(h["queued"] for h in live), "requests_retried": self.requests_retried,
                "replicas": replicas}

    def props(self) -> dict[str, Any]:
        return dict(self._props)


class RoutedRequest:
    """One request on the replica the router chose: iterate for its events, or await `result()`."""

    def __init__(self, engine: RoutedEngine, request: CompletionRequest, session: str | None) -> None:
        self.engine, self.request, self.session = engine, request, session
        self.id = request.id
        self.final: FinalEvent | None = None
        self._response: Any = None
        self._cancelled = False

    def cancel(self) -> None:
        self._cancelled = True
        if self._response is not None:
            self._response.cancel()

    def _target(self, exclude: frozenset[int]) -> tuple[int, CompletionRequest] | FinalEvent:
        e, req = self.engine, self.request
        if req.id_slot >= 0:  # a named slot lives on one replica: no other can stand in for it
            replica = req.id_slot // e.per_replica
            if replica in exclude:
                return self._error(f"the replica holding slot {req.id_slot} stopped; retry the request")
            return replica, dataclasses.replace(req, id_slot=req.id_slot % e.per_replica)
        return e.router.choose(req.prompt, session=self.session, exclude=exclude), req

    def _error(self, message: str) -> FinalEvent:
        self.final = FinalEvent(self.id, "", [], "error", error=message)
        return self.final

    def _cancelled_final(self) -> FinalEvent:
        self.final = FinalEvent(self.id, "", [], "cancel")
        return self.final

    def _localised(self, replica: int, event: Event) -> Event:
        if event.slot >= 0:
            event = dataclasses.replace(event, slot=self.engine.global_slot(replica, event.slot))
        if isinstance(event, FinalEvent):
            self.final = event
        return event

    def _ended(self, replica: int, final: FinalEvent | None) -> None:
        router = self.engine.router
        if final is None or final.slot < 0 or final.stop_type == "error":
            router.finished(replica)  # it never ran in a slot, or we do not know what the slot holds
        else:
            router.finished(replica, final.slot - replica * self.engine.per_replica,
                            [*self.request.prompt, *final.tokens])

    async def result(self) -> FinalEvent:
        exclude: frozenset[int] = frozenset()
        for _attempt in range(2):
            target = self._target(exclude)
            if isinstance(target, FinalEvent):
                return target
            replica, req = target
            if self._cancelled:
                return self._cancelled_final()
            self.engine.router.started(replica)
            final: FinalEvent | None = None
            try:
                self._response = self.engine.handles[replica].complete.remote(req)
                event = self._localised(replica, await self._response)
                assert isinstance(event, FinalEvent)
                final = event
                return final
            except REPLICA_GONE as exc:
                self._replica_lost(replica, exc, retry=_attempt == 0)
                exclude = exclude | {replica}
            except (TaskCancelledError, asyncio.CancelledError):
                if self._cancelled:
                    return self._cancelled_final()
                raise
            finally:
                self._ended(replica, final)
        return self._error("no replica could finish the request: the replicas tried stopped while running it")

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._events()

    async def _events(self) -> AsyncIterator[Event]:
        exclude: frozenset[int] = frozenset()
        for _attempt in range(2):
            target = self._target(exclude)
            if isinstance(target, FinalEvent):
                yield target
                return
            replica, req = target
            if self._cancelled:
                yield self._cancelled_final()
                return
            self.engine.router.started(replica)
            sent = False
            try:
                self._response = self.engine.handles[replica].options(stream=True).generate.remote(req)
                async for event in self._response:
                    sent = True
                    yield self._localised(replica, event)
                    if isinstance(event, FinalEvent):
                        return
                return
            except REPLICA_GONE as exc:
                self._replica_lost(replica, exc, retry=not sent and _attempt == 0)
                if sent:
                    yield self._error(f"replica {replica} stopped in the middle of this stream")
                    return
                exclude = exclude | {replica}
            except (TaskCancelledError, asyncio.CancelledError):
                if self._cancelled:
                    yield self._cancelled_final()
                    return
                raise
            finally:
                self._ended(replica, self.final)
        yield self._error("no replica could run the request: the replicas tried stopped while running it")

    def _replica_lost(self, replica: int, exc: BaseException, *, retry: bool) -> None:
        log.warning("replica %d failed during request %s: %s%s", replica, self.id, type(exc).__name__,
                    "; running it on another replica" if retry else "")
        self.engine.router.failed(replica)
        self.engine.requests_retried += retry
