"""The Engine: request queue, slots and the anyio scheduler loop (docs/architecture.md, "The interfaces between layers").

Structured concurrency: `run` owns one task group (stream drainers live in it) and loops
admit -> step (in a worker thread, `anyio.to_thread.run_sync`; while every busy slot generates, a run
of steps, `_steps`) -> deliver events -> free finished slots. Everything that touches slots, drafters
or the backend happens either in that worker thread or on the loop while no step is running, so the
backend is used by one thread at a time.

Over 400 lines: admission, the loop and the slots' life cycle share the queue, the slots and that one
thread discipline; what stands alone lives beside it (request_plan, slot_actions, prompt_cache,
embedding_jobs, scheduler).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import anyio
import numpy as np
from anyio.abc import TaskGroup, TaskStatus

from spekula.core.backend import Backend, BackendOptions
from spekula.core.drafting.drafter import Drafter, DrafterContext
from spekula.core.drafting.registry import (
    DrafterSource,
    available_drafters,
    create_drafter,
    order_drafters,
    sources_by_name,
)
from spekula.core.embedding import Pooling
from spekula.core.engine.embedding_jobs import EmbeddingQueue
from spekula.core.engine.prompt_cache import SlotCache, choose_slot, drafters_reuse_prefix
from spekula.core.engine.request_handle import Outbox, RequestHandle, open_request
from spekula.core.engine.request_plan import (
    RequestPlan,
    RequestRejected,
    plan_request,
    synthetic_rates,
    unshiftable_drafters,
)
from spekula.core.engine.round_observer import RoundObserver, StatsRecorder
from spekula.core.engine.scheduler import Scheduler
from spekula.core.engine.slot import Slot, SlotState
from spekula.core.engine.slot_actions import SlotActionQueue
from spekula.core.errors import ConfigError
from spekula.core.events import FinalEvent, PieceEvent, StopType
from spekula.core.modelfile.grammar_llg import Grammars
from spekula.core.modelfile.reasoning_budget import token_piece_of
from spekula.core.params import CompletionRequest, SpecParams
from spekula.core.policy.adaptive import AdaptivePolicy
from spekula.core.policy.controller import AdaptiveController
from spekula.core.policy.cost_model import CostModel
from spekula.core.policy.fixed import FixedPolicy
from spekula.core.stats.spec_stats import EngineSpecStats
from spekula.core.verify.dry import breaker_sequences

_KEEP_REQUEST_STATS = 256
# The longest run of steps the worker thread makes without handing back to the event loop.
STEPS_PER_HANDOFF_S = 0.05
log = logging.getLogger("spekula.engine")


def _call_soon_threadsafe() -> Callable[..., object] | None:
    """The running event loop's way to queue a callback from another thread without waiting for it;
    None where the loop is not asyncio's (every step then hands back to the loop)."""
    try:
        return asyncio.get_running_loop().call_soon_threadsafe
    except RuntimeError:  # e.g. trio
        return None


def _has_content(piece: PieceEvent | None) -> bool:
    """Whether a step's piece carries anything for its client (a step can emit nothing visible yet)."""
    return piece is not None and bool(piece.tokens or piece.text)


# What a completion request on an encoder's engine is told (HTTP: llama-server's not_supported error).
EMBEDDINGS_ONLY = "This server does not support completions: its model is an encoder, which computes embeddings only"


@dataclass
class EngineConfig:
    n_slots: int = 1  # -np
    n_ctx: int = 4096  # per slot
    n_batch: int = 512  # max tokens per forward (prompt chunks + verification rows)
    spec: SpecParams = field(default_factory=SpecParams)
    # --slot-prompt-similarity: a request goes to the idle slot whose cached prefix covers more than
    # this fraction of its prompt (the longest such prefix wins); 0 routes least-recently-used only.
    slot_prompt_similarity: float = 0.1
    # --embedding: the pooling embeddings are served with (None: embeddings off, llama-server's default)
    pooling: Pooling | None = None
    # --context-shift: a generating slot whose context fills drops a span and goes on
    # (core/engine/context_shift.py); off, it stops there with finish reason "length" and `truncated`.
    context_shift: bool = False
    # An encoder model (BERT): it computes embeddings only, so every completion request is refused.
    embeddings_only: bool = False


def end_drafter(drafter: Drafter, slot: int) -> None:
    """A drafter's end-of-request work (e.g. saving a cache) never takes the engine down: the answer
    is already complete, so a failure there is logged and the request still returns."""
    try:
        drafter.end(slot)
    except Exception as exc:  # noqa: BLE001 - side work; the request's result does not depend on it
        log.warning("drafter %s failed at the end of a request: %s: %s", drafter.name, type(exc).__name__, exc)


class Engine:
    def __init__(self, backend: Backend, tokenizer: Any, config: EngineConfig, *,
                 drafters: Iterable[DrafterSource] | None = None, backend_name: str = "torch",
                 draft_model_path: str | None = None,
                 draft_backend_options: BackendOptions | None = None) -> None:
        if config.n_slots < 1:
            raise ConfigError(f"--parallel must be >= 1; got {config.n_slots}")
        if config.n_batch < 1:
            raise ConfigError(f"--batch-size must be >= 1; got {config.n_batch}")
        if config.n_ctx < 4:
            raise ConfigError(f"--ctx-size must be >= 4; got {config.n_ctx}")
        if not 0.0 <= config.slot_prompt_similarity <= 1.0:
            raise ConfigError(f"--slot-prompt-similarity must be in [0, 1]; got {config.slot_prompt_similarity}")
        if config.n_ctx > backend.n_ctx:
            raise ConfigError(f"ctx-size {config.n_ctx} exceeds the backend's context {backend.n_ctx}")
        if config.context_shift and (refusal := backend.context_shift_refusal()) is not None:
            raise ConfigError(f"--context-shift: {refusal}")
        self.backend, self.tokenizer, self.config = backend, tokenizer, config
        self._extra = sources_by_name(drafters)
        self._ctx = DrafterContext(spec=config.spec, target=backend, tokenizer=tokenizer,
                                   n_seq_max=config.n_slots, backend_name=backend_name,
                                   draft_backend_options=draft_backend_options,
                                   draft_model_path=draft_model_path)
        self._drafters: dict[str, Drafter] = {}
        self.spec_stats = EngineSpecStats()
        self.observer: RoundObserver = StatsRecorder(self.spec_stats)
        # Server-wide drafters are created now so that a bad type, plugin or draft model fails start-up.
        server_drafters = self._drafters_for(config.spec)
        synthetic_rates(config.spec, server_drafters)
        if config.context_shift and (unshiftable := unshiftable_drafters(server_drafters)):
            raise ConfigError(f"--context-shift: {', '.join(unshiftable)} cannot follow a context shift")
        self._slots = [Slot(i, backend.new_seq(), config.n_ctx, context_shift=config.context_shift)
                       for i in range(config.n_slots)]
        # The cost model measures the backend on its first forwards (no timing forwards delay the first
        # request); a request's plan picks the fixed policy or the adaptive one, and both see every round.
        max_rows = min(config.n_batch, config.n_ctx - 1, 128 if config.n_slots > 1 else 64)
        self.adaptive = AdaptiveController(CostModel.prior(max_rows))
        self._fixed_policy, self._adaptive_policy = FixedPolicy(), AdaptivePolicy(self.adaptive)
        self._scheduler = Scheduler(backend, tokenizer, config.n_batch, self.observer,
                                    (self._fixed_policy, self._adaptive_policy), context_shift=config.context_shift)
        self._queue: deque[tuple[CompletionRequest, RequestPlan, Outbox]] = deque()
        # an encoder's learned positions end at its position table: a longer input is the caller's error
        embd_ctx = min(config.n_ctx, backend.info.n_ctx_train) if config.embeddings_only else config.n_ctx
        self._embeddings = EmbeddingQueue(config.pooling, embd_ctx, backend.info.n_vocab, config.n_batch)
        self._wake: anyio.Event | None = None
        # Pieces of steps the worker made back to back (Engine._steps), waiting for the loop.
        self._pending: deque[tuple[Outbox, PieceEvent]] = deque()
        self._pending_wake: anyio.Event | None = None
        self._slot_actions = SlotActionQueue(self._poke)  # save / restore / erase, run between steps
        self._tg: TaskGroup | None = None
        self.request_stats: OrderedDict[str, dict[str, Any]] = OrderedDict()
        # Compiled on first use (building the grammar engine's view of the vocabulary takes ~0.2 s).
        self.grammars = Grammars(tokenizer)
        # DRY's breakers as token sequences: one pass over the vocabulary per distinct list, kept.
        self._dry_breakers = functools.lru_cache(maxsize=16)(functools.partial(breaker_sequences, tokenizer))

    # -- drafters ----------------------------------------------------------------------------
    def _drafters_for(self, spec: SpecParams) -> list[Drafter]:
        out = []
        for name in spec.types:
            if name not in self._drafters:
                self._drafters[name] = create_drafter(name, self._ctx, self._extra)
                self.spec_stats.register(name)
            out.append(self._drafters[name])
        return order_drafters(out)

    # -- public API ---------------------------------------------------------------------------
    def submit(self, req: CompletionRequest, *, session: str | None = None) -> RequestHandle:
        """Queue a request; its events come through the handle. `session` (a client's affinity key)
        matters only to a router in front of several engines: one engine has nothing to choose."""
        if not req.id:
            # Random, so one client cannot name (cancel, look up) another client's request.
            req.id = secrets.token_hex(8)
        handle, outbox = open_request(req, self.cancel, lambda: self.cancel(req.id))
        if not -1 <= req.id_slot < self.config.n_slots:
            self._send_final(outbox, FinalEvent(req.id, "", [], "error",
                                                error=f"id_slot {req.id_slot} is not a slot (0..{self.config.n_slots - 1})"))
            return handle
        if self.config.embeddings_only:
            self._send_final(outbox, FinalEvent(req.id, "", [], "error", error=EMBEDDINGS_ONLY))
            return handle
        try:
            plan = plan_request(req, server_spec=self.config.spec, n_ctx=self.config.n_ctx,
                                n_vocab=self.backend.info.n_vocab, drafters_for=self._drafters_for,
                                is_eog=self._is_eog, fixed_policy=self._fixed_policy,
                                adaptive_policy=self._adaptive_policy, new_constraint=self.grammars.new,
                                dry_breakers=self._dry_breakers,
                                context_shift=self.config.context_shift, token_piece=token_piece_of(self.tokenizer))
        except RequestRejected as exc:
            self._send_final(outbox, FinalEvent(req.id, "", [], "error", error=str(exc), rejected_spec=exc.spec_at_fault))
        except Exception as exc:  # noqa: BLE001 - e.g. a third-party drafter failing to build: this request only
            self._send_final(outbox, FinalEvent(req.id, "", [], "error",
                                                error=f"cannot start request: {type(exc).__name__}: {exc}"))
        else:
            self._queue.append((req, plan, outbox))
            self._poke()
        return handle

    async def embed(self, tokens: Sequence[int]) -> np.ndarray:
        """The embedding of one sequence under the engine's pooling (core/engine/embedding_jobs.py)."""
        return await self._embeddings.embed(tokens, self._poke)
    async def slot_action(self, action: str, slot_id: int, path: Path | None = None) -> dict[str, Any]:
        """Save (to `path`), restore (from `path`) or erase a slot's cache, between steps and once the slot is
        idle (core/engine/slot_actions.py): llama-server's result, or SlotActionError / SlotFileError."""
        return await self._slot_actions.perform(action, slot_id, path, self.backend, self._slots, self._drafters)

    def _is_eog(self, token: int) -> bool:
        return bool(self.tokenizer.is_eog(token))

    def cancel(self, request_id: str) -> bool:
        for i, (req, _plan, outbox) in enumerate(self._queue):
            if req.id == request_id:
                del self._queue[i]
                self._send_final(outbox, FinalEvent(req.id, "", [], "cancel"))
                return True
        for s in self._slots:
            if s.busy and s.request_id == request_id and not s.cancelled:
                s.cancelled = True  # the slot is freed as soon as the current step returns
                self._poke()
                return True
        return False

    def stats(self) -> dict[str, Any]:
        return self.spec_stats.snapshot()

    def slots(self) -> list[dict[str, Any]]:
        out = []
        for s in self._slots:
            out.append({
                "id": s.id, "state": s.state.value, "request_id": s.request_id,
                "n_past": s.n_hist if s.state is SlotState.GENERATING else s.n_prompt_done,
                "n_prompt": len(s.prompt) if s.busy else 0, "n_decoded": len(s.generated) if s.busy else 0,
                "n_cached": s.n_kv, "n_cache_reused": s.n_cache_reused if s.busy else 0,
                "spec_types": [d.name for d in s.drafters],
                "draft_n": s.spec_stats.n_draft_tokens if s.busy else 0,
                "draft_n_accepted": s.spec_stats.n_draft_accepted if s.busy else 0,
            })
        return out

    def health(self) -> dict[str, Any]:
        busy = sum(s.busy for s in self._slots)
        return {"status": "ok", "slots_idle": len(self._slots) - busy, "slots_busy": busy,
                "queued": len(self._queue)}

    def props(self) -> dict[str, Any]:
        spec = self.config.spec
        return {
            "model": asdict(self.backend.info),
            "backend": type(self.backend).__name__,
            "device": self.backend.options.device,
            "dtype": self.backend.options.dtype,
            "n_ctx": self.config.n_ctx, "n_slots": self.config.n_slots, "n_batch": self.config.n_batch,
            "spec": {"types": list(spec.types), "n_max": spec.n_max, "n_min": spec.n_min, "p_min": spec.p_min,
                     "draft_sampling": spec.draft_sampling, "synth_rates": spec.synth_rates,
                     "synth_len": spec.synth_len, "adaptive": spec.adaptive},
            "available_drafters": sorted(set(available_drafters()) | set(self._extra)),
        }

    def close(self) -> None:
        """Release the slots' backend sequences (the backend itself stays open: the caller owns it).

        Call only when `run` is not running."""
        for s in self._slots:
            if s.busy:
                for d in s.drafters:
                    end_drafter(d, s.id)
                s.reset()
            self.backend.free_seq(s.seq_id)
        self._slots = []

    # -- admission ----------------------------------------------------------------------------
    def _admit(self) -> None:
        """Queued requests go to idle slots in arrival order; one bound to a busy slot (`id_slot`)
        waits for it without holding back the others."""
        waiting: deque[tuple[CompletionRequest, RequestPlan, Outbox]] = deque()
        while self._queue:
            idle = self._free_slots()
            if not idle:
                break
            req, plan, outbox = entry = self._queue.popleft()
            if 0 <= req.id_slot < len(self._slots):
                idle = [s for s in idle if s.id == req.id_slot]
                if not idle:
                    waiting.append(entry)
                    continue
            caches = [SlotCache(s.id, s.tokens[: s.n_cached], s.last_used) for s in idle]
            use_cache = req.cache_prompt and drafters_reuse_prefix(plan.drafters)
            slot_id, n_reused = choose_slot(caches, np.asarray(req.prompt, np.int32),
                                            self.config.slot_prompt_similarity, use_cache)
            s = self._slots[slot_id]
            # A recurrent target rebuilds only some prefix lengths (its snapshots): reuse the longest.
            n_reused = self.backend.restorable(s.seq_id, n_reused)
            self.backend.truncate(s.seq_id, n_reused)
            s.start(req, outbox, plan, self.tokenizer.stream_decoder(skip_special=True), n_reused)
            if req.return_progress:
                outbox.put(s.progress(), self._tg)
        self._queue.extendleft(reversed(waiting))

    def _send_final(self, outbox: Outbox, event: FinalEvent) -> None:
        outbox.put(event, self._tg)
        outbox.close(self._tg)

    def _finish(self, s: Slot, stop_type: StopType | None = None) -> None:
        assert s.request is not None and s.outbox is not None
        s.t_end = time.perf_counter()
        if stop_type is not None:
            s.stop_type = stop_type
        if s.error is not None:
            s.stop_type = "error"
        final = FinalEvent(
            request_id=s.request.id, content=s.text.text, tokens=list(s.generated), stop_type=s.stop_type,
            stopping_word=s.stopping_word, timings=s.timings(), error=s.error,
            tokens_evaluated=int(s.n_prompt_done), slot=s.id, truncated=s.truncated,
            probs=list(s.probs) if s.request.token_probs else None)
        self.request_stats[s.request.id] = {"slot": s.id, "spec": s.spec_stats}
        while len(self.request_stats) > _KEEP_REQUEST_STATS:
            self.request_stats.popitem(last=False)
        self.observer.finished(s)
        for d in s.drafters:
            end_drafter(d, s.id)
        self._send_final(s.outbox, final)
        # After an error the KV's contents are not known to match the tokens: no prefix is reused.
        s.reset(keep_cache=s.stop_type != "error")

    def _reap(self) -> None:
        for s in self._slots:
            if not s.busy:
                continue
            if s.cancelled:
                self._finish(s, "cancel")
            elif s.finished:
                self._finish(s)

    def _free_slots(self) -> list[Slot]:
        """Idle slots that no slot action holds (core/engine/slot_actions.py): what requests and embedding
        jobs may take."""
        reserved = self._slot_actions.reserved()
        return [s for s in self._slots if not s.busy and s.id not in reserved]

    def _poke(self) -> None:
        if self._wake is not None:
            self._wake.set()

    # -- the loop -----------------------------------------------------------------------------
    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve requests until cancelled."""
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                tg.start_soon(self._deliver_pending)
                task_status.started()
                await self._loop()
        finally:
            self._tg = None
            self._shutdown()

    async def _loop(self) -> None:
        call_soon = _call_soon_threadsafe()
        while True:
            if self._embeddings:
                await self._embeddings.run_on_idle_slot(self._free_slots(), self.backend, self.observer)
            if self._slot_actions:
                await self._slot_actions.run_pending()
            self._admit()
            self._reap()
            if not any(s.busy for s in self._slots):
                if (self._queue or self._embeddings) and self._free_slots():
                    continue
                self._wake = anyio.Event()
                await self._wake.wait()
                self._wake = None
                continue
            busy = [s for s in self._slots if s.busy]
            # Requests that follow their prompt's progress, and how far it had come before this step.
            watched = {s.id: s.n_prompt_done for s in busy if s.state is SlotState.PROMPT
                       and s.request is not None and s.request.return_progress}
            try:
                if watched or call_soon is None:
                    results = await anyio.to_thread.run_sync(self._scheduler.step, busy)
                else:
                    results = await anyio.to_thread.run_sync(self._steps, busy, call_soon)
            except Exception as exc:  # an engine bug must not leave clients waiting forever
                for s in busy:
                    s.error = f"internal error: {type(exc).__name__}: {exc}"
                results = []
            self._flush_pending()  # the earlier steps' pieces first: the worker queued them before returning
            for s, piece in results:
                if s.outbox is None:
                    continue
                if s.id in watched and s.n_prompt_done > watched[s.id] and s.error is None:
                    s.outbox.put(s.progress(), self._tg)
                if _has_content(piece):
                    s.outbox.put(piece, self._tg)
            self._reap()
            await anyio.lowlevel.checkpoint()

    def _steps(self, busy: list[Slot], call_soon: Callable[..., object]) -> list[tuple[Slot, PieceEvent | None]]:
        """Steps back to back in the worker thread while the loop has nothing to do for these slots;
        returns the last step's results (the loop delivers those and reaps as after a single step).

        A hand-off to the worker thread and back costs about 0.4 ms on a small machine (two thread
        wake-ups through the event loop's self-pipe), a tenth of a SmolLM2 decode step, so the worker
        goes on stepping until a slot needs the loop: it finished, failed or was cancelled, a queued
        request could take an idle slot, or STEPS_PER_HANDOFF_S passed (so a stopping engine waits at
        most that long). Earlier steps' pieces go to their outboxes on the loop without the worker
        waiting for it; `call_soon` queues in order, so they are all delivered before the loop sees
        this call return."""
        deadline = time.perf_counter() + STEPS_PER_HANDOFF_S
        while True:
            results = self._scheduler.step(busy)
            if not results or time.perf_counter() > deadline or not self._keeps_stepping(busy):
                return results
            pieces = [(s.outbox, piece) for s, piece in results
                      if s.outbox is not None and s.outbox.wants_pieces and _has_content(piece)]
            if pieces:
                call_soon(self._deliver, pieces)

    def _keeps_stepping(self, busy: list[Slot]) -> bool:
        if ((self._queue or self._embeddings) and self._free_slots()) or self._slot_actions:
            return False  # a request waits for a slot that is idle, or a slot action for the loop
        return all(s.state is SlotState.GENERATING and not s.finished and not s.cancelled for s in busy)

    def _deliver(self, pieces: list[tuple[Outbox, PieceEvent]]) -> None:
        """On the loop, queued by the worker: hand each piece to its reader's stream right here when
        that needs no waiting (the usual case, and the cheapest for the loop), else wake the delivery
        task (a plain callback has no task from which an outbox could start draining a slow reader's
        backlog). Order is kept: once one piece waits for the task, the rest wait behind it."""
        for i, (outbox, piece) in enumerate(pieces):
            if self._pending or not outbox.put_now(piece):
                self._pending.extend(pieces[i:])
                if self._pending_wake is not None:
                    self._pending_wake.set()
                return

    def _flush_pending(self) -> None:
        while self._pending:
            outbox, piece = self._pending.popleft()
            outbox.put(piece, self._tg)

    async def _deliver_pending(self) -> None:
        while True:
            self._pending_wake = anyio.Event()
            if not self._pending:
                await self._pending_wake.wait()
            self._flush_pending()

    def _shutdown(self) -> None:
        self._pending_wake = None
        self._embeddings.fail_all("engine stopped")
        self._flush_pending()
        for s in self._slots:
            if s.busy:
                s.error = s.error or "engine stopped"
                self._finish(s)
        while self._queue:
            req, _plan, outbox = self._queue.popleft()
            self._send_final(outbox, FinalEvent(req.id, "", [], "error", error="engine stopped"))
        self._slot_actions.fail_all("engine stopped")
