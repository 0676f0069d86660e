"""Embedding and reranking requests on the engine: checked when submitted, queued, and run by the
engine's worker thread on an idle slot's sequence between steps (the backend is used by one thread at
a time, docs/architecture.md).

A job is one sequence: its pooled vector (or per-token vectors, pooling none, or a reranker's label
scores, pooling rank) comes back to the awaiting caller. The slot lends only its KV sequence: its
cached prefix is dropped (the sequence now holds the embedded tokens) and no drafter hears of it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import anyio
import anyio.to_thread
import numpy as np

from spekula.core.backend import Backend
from spekula.core.embedding import Pooling
from spekula.core.engine.request_plan import RequestRejected
from spekula.core.engine.round_observer import RoundObserver
from spekula.core.engine.slot import Slot
from spekula.core.errors import ConfigError


class EmbeddingsOff(RequestRejected):
    """The engine was started without embeddings (`--embedding`)."""


class InputTooLong(RequestRejected):
    """More tokens than a slot's context holds."""

    def __init__(self, n_tokens: int, n_ctx: int) -> None:
        super().__init__(f"input ({n_tokens} tokens) is too large to process: the context size is {n_ctx} tokens")
        self.n_tokens, self.n_ctx = n_tokens, n_ctx


@dataclass(eq=False)
class EmbeddingJob:
    tokens: np.ndarray
    done: anyio.Event = field(default_factory=anyio.Event)
    result: np.ndarray | None = None
    error: str | None = None
    abandoned: bool = False  # the caller stopped waiting: skip it


class EmbeddingQueue:
    """Jobs waiting for an idle slot, in arrival order."""

    def __init__(self, pooling: Pooling | None, n_ctx: int, n_vocab: int, n_batch: int) -> None:
        self.pooling, self.n_ctx, self.n_vocab, self.n_batch = pooling, n_ctx, n_vocab, n_batch
        self._jobs: deque[EmbeddingJob] = deque()

    def __bool__(self) -> bool:
        return bool(self._jobs)

    def check(self, tokens: Sequence[int]) -> np.ndarray:
        """The tokens as an array, or RequestRejected saying what is wrong with them."""
        if self.pooling is None:
            raise EmbeddingsOff("This server does not support embeddings. Start it with `--embeddings`")
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            raise RequestRejected("Input content cannot be empty")
        if ids.size > self.n_ctx:
            raise InputTooLong(int(ids.size), self.n_ctx)
        bad = ids[(ids < 0) | (ids >= self.n_vocab)]
        if bad.size:
            raise RequestRejected(f"token id {int(bad[0])} is out of the vocabulary [0, {self.n_vocab})")
        return ids.astype(np.int32)

    def put(self, tokens: Sequence[int]) -> EmbeddingJob:
        job = EmbeddingJob(self.check(tokens))
        self._jobs.append(job)
        return job

    async def embed(self, tokens: Sequence[int], wake: Callable[[], None]) -> np.ndarray:
        """Queue one sequence, wake the engine's loop and wait for the result: its pooled vector (per-token
        vectors for pooling none, the label scores for rank). RequestRejected when embeddings are off or
        the tokens are unusable; a failure while computing it is a RuntimeError naming it."""
        job = self.put(tokens)
        wake()
        try:
            await job.done.wait()
        finally:
            job.abandoned = not job.done.is_set()
        if job.error is not None:
            raise RuntimeError(job.error)
        assert job.result is not None
        return job.result

    async def run_on_idle_slot(self, slots: Sequence[Slot], backend: Backend, observer: RoundObserver) -> None:
        """On the loop, between steps: the waiting jobs, in the worker thread, on the least recently used
        idle slot's sequence (none idle: they wait for the next turn)."""
        idle = [s for s in slots if not s.busy]
        if not idle:
            return
        slot = min(idle, key=lambda s: s.last_used)
        jobs = self.take()
        slot.n_cached = 0  # its sequence is about to hold the embedded tokens instead
        try:
            await anyio.to_thread.run_sync(self.run, backend, slot.seq_id, jobs, observer)
        finally:
            self.finish(jobs)

    def take(self) -> list[EmbeddingJob]:
        """Every waiting job still wanted (the loop runs them all in one hand-off to the worker)."""
        jobs = [j for j in self._jobs if not j.abandoned]
        self._jobs.clear()
        return jobs

    def run(self, backend: Backend, seq_id: int, jobs: list[EmbeddingJob], observer: RoundObserver) -> None:
        """In the worker thread: each job in `seq_id`, one after the other. A job's failure is its own."""
        assert self.pooling is not None
        for job in jobs:
            if job.abandoned:
                continue
            t0 = time.perf_counter()
            try:
                job.result = backend.embed(seq_id, job.tokens, self.pooling, self.n_batch)
            except (ConfigError, ValueError) as exc:
                job.error = str(exc)
            except Exception as exc:  # noqa: BLE001 - a backend failure ends this job, not the engine
                job.error = f"internal error: {type(exc).__name__}: {exc}"
            else:
                n = len(job.tokens)
                observer.embedded(n, -(-n // max(1, self.n_batch)), time.perf_counter() - t0)
        backend.truncate(seq_id, 0)

    @staticmethod
    def finish(jobs: list[EmbeddingJob]) -> None:
        """On the loop: wake every caller."""
        for job in jobs:
            job.done.set()

    def fail_all(self, message: str) -> None:
        for job in self.take():
            job.error = message
            job.done.set()
