"""One scheduler step (continuous batching), run synchronously in a worker thread.

Every step gathers the work of ALL busy slots into ONE backend forward: verification batches
[x, d1..dk] of generating slots first (they are latency-critical and each must sit whole in one
forward), then prompt chunks filling what is left of n_batch. Then, per slot: observe, verify,
roll the KV back, tell the drafters, update statistics, emit tokens (speculative-semantics.md §1.1).

The engine calls `step` only from one worker thread at a time and touches slots only between steps,
so nothing here needs a lock. No torch: arrays cross the Backend boundary as numpy.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from .backend import Backend, Capture, SeqInput, SeqOutput
from .drafter import Draft, Drafter, DraftRequest
from .events import PieceEvent
from .registry import order_drafters
from .slot import Slot, SlotState
from .spec_stats import EngineSpecStats
from .verifier import VerifyResult, verify_match, verify_rejection, verify_synthetic


@dataclass(slots=True)
class _Work:
    slot: Slot
    inp: SeqInput
    draft: Draft = field(default_factory=Draft.empty)
    drafter: Drafter | None = None  # whose draft is verified (impl_last)
    prompt_chunk: bool = False


class Scheduler:
    def __init__(self, backend: Backend, tokenizer: object, n_batch: int, stats: EngineSpecStats) -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        self.n_batch = n_batch
        self.stats = stats
        self._rotate = 0  # round-robin start, so no slot starves when n_batch is tight

    # -- planning ---------------------------------------------------------------------------
    def _draft_all(self, wants: list[tuple[Slot, int]]) -> dict[int, tuple[Draft, Drafter]]:
        """One orchestrator call (§3): drafters in priority order, each once, for the slots still looking."""
        looking = {s.id: (s, n) for s, n in wants}
        chosen: dict[int, tuple[Draft, Drafter]] = {}
        for drafter in order_drafters({id(d): d for s, _ in wants for d in s.drafters}.values()):
            mine = [(s, n) for s, n in looking.values() if drafter in s.drafters]
            if not mine:
                continue
            reqs = [
                DraftRequest(slot=s.id, history=s.history, last=s.last, n_max=n, spec=s.spec,
                             temperature=s.request.sampling.temperature, seed=s.seed)  # type: ignore[union-attr]
                for s, n in mine
            ]
            t0 = time.perf_counter()
            try:
                drafts = drafter.draft(reqs)
                if len(drafts) != len(reqs):
                    raise RuntimeError(f"returned {len(drafts)} drafts for {len(reqs)} requests")
            except Exception as exc:  # a broken drafter ends the requests it was drafting for, not the engine
                for s, _ in mine:
                    s.error = f"drafter {drafter.name!r} failed: {type(exc).__name__}: {exc}"
                    del looking[s.id]
                continue
            dt = time.perf_counter() - t0
            lengths = []
            for (s, n), d in zip(mine, drafts, strict=True):
                lengths.append(min(len(d.tokens), n))
                if not d.tokens:
                    continue  # an empty draft falls through to the next drafter
                if len(d.tokens) > n:  # the round's budget caps every drafter (§1.3)
                    d = Draft(list(d.tokens[:n]), None if d.probs is None else d.probs[:n])
                chosen[s.id] = (d, drafter)
                del looking[s.id]
            self.stats.on_draft_call(drafter.name, lengths, dt)
            if not looking:
                break
        return chosen

    def _plan(self, slots: list[Slot]) -> list[_Work]:
        budget = self.n_batch
        busy = [s for s in slots if s.busy and not s.finished]
        if busy:
            self._rotate = (self._rotate + 1) % len(busy)
            busy = busy[self._rotate:] + busy[: self._rotate]
        gen = [s for s in busy if s.state is SlotState.GENERATING]
        reserved: list[tuple[Slot, int]] = []
        for s in gen:
            if budget < 1:
                break
            n_max = min(s.n_draft_max(), budget - 1)
            reserved.append((s, n_max))
            budget -= 1 + n_max
        wants = [(s, n) for s, n in reserved if n > 0 and s.drafters]
        chosen = self._draft_all(wants) if wants else {}
        for s, _ in wants:  # n_draft_tokens += k for every slot that asked, even when k = 0 (§1.1 step 4)
            s.spec_stats.record_draft(len(chosen[s.id][0].tokens) if s.id in chosen else 0)
        work: list[_Work] = []
        budget = self.n_batch
        for s, _ in reserved:
            if s.finished:
                continue
            draft, drafter = chosen.get(s.id, (Draft.empty(), None))
            toks = np.array([s.last, *draft.tokens], dtype=np.int32)
            work.append(_Work(s, SeqInput(s.seq_id, toks, s.n_hist, np.arange(len(toks))), draft, drafter))
            budget -= len(toks)
        for s in busy:
            if s.state is not SlotState.PROMPT or budget <= 0:
                continue
            n = min(len(s.prompt) - s.n_prompt_done, budget)
            chunk = s.prompt[s.n_prompt_done : s.n_prompt_done + n]
            last = s.n_prompt_done + n == len(s.prompt)
            rows = np.array([n - 1]) if last else np.zeros(0, dtype=np.int64)
            work.append(_Work(s, SeqInput(s.seq_id, chunk, s.n_prompt_done, rows), prompt_chunk=True))
            budget -= n
        return work

    # -- one step -----------------------------------------------------------------------------
    def step(self, slots: list[Slot]) -> list[tuple[Slot, PieceEvent | None]]:
        """Run one forward for every busy slot; return each touched slot with its piece event."""
        work = self._plan(slots)
        if not work:
            return []
        capture = Capture()
        for w in work:
            for d in w.slot.drafters:
                capture = capture.union(d.capture())
        try:
            outs = self.backend.forward([w.inp for w in work], capture)
        except Exception as exc:  # a backend failure ends the requests in this batch, not the engine
            for w in work:
                w.slot.error = f"backend forward failed: {type(exc).__name__}: {exc}"
            return [(w.slot, None) for w in work]
        results: list[tuple[Slot, PieceEvent | None]] = []
        for w, out in zip(work, outs, strict=True):
            s = w.slot
            try:
                for d in s.drafters:
                    d.observe(s.id, w.inp, out)
                results.append((s, self._after_prompt(w, out) if w.prompt_chunk else self._after_round(w, out)))
            except Exception as exc:  # e.g. a failing third-party drafter: end this request clearly
                s.error = f"{type(exc).__name__}: {exc}"
                results.append((s, None))
        return results

    def _is_eog(self, token: int) -> bool:
        return bool(self.tokenizer.is_eog(token))  # type: ignore[attr-defined]

    def _after_prompt(self, w: _Work, out: SeqOutput) -> PieceEvent | None:
        s = w.slot
        s.n_prompt_done += len(w.inp.tokens)
        if s.n_prompt_done < len(s.prompt):
            return None
        assert s.sampler is not None and s.request is not None
        s.tokens[: len(s.prompt)] = s.prompt
        s.n_hist = len(s.prompt)
        s.t_prompt_done = time.perf_counter()
        s.state = SlotState.GENERATING
        for d in s.drafters:  # begin(H) once the prompt is processed (§7.6)
            t0 = time.perf_counter()
            d.begin(s.id, s.history)
            self.stats.on_begin(d.name, time.perf_counter() - t0)
        result = verify_match([], out.logits[-1:], s.sampler, self._is_eog)
        s.last = result.emitted[-1]
        return self._emit(s, result.emitted, [None])

    def _verify(self, w: _Work, logits: np.ndarray) -> VerifyResult:
        s, draft = w.slot, w.draft
        assert s.sampler is not None and s.request is not None
        if draft.tokens and s.synth_rates is not None:
            assert s.synth_rng is not None
            return verify_synthetic(draft.tokens, logits, s.sampler, s.synth_rates, s.synth_rng, self._is_eog)
        if (draft.tokens and draft.probs is not None and s.request.sampling.temperature > 0
                and s.spec.draft_sampling == "probabilistic"):
            assert s.reject_rng is not None
            return verify_rejection(draft.tokens, draft.probs, logits, s.sampler, s.reject_rng)
        return verify_match(draft.tokens, logits, s.sampler, self._is_eog)

    def _after_round(self, w: _Work, out: SeqOutput) -> PieceEvent | None:
        s, k = w.slot, len(w.draft.tokens)
        result = self._verify(w, out.logits)
        n_acc = result.n_accepted
        # Roll back: keep H, x and the accepted drafts; later writes overwrite the rest (O(1)).
        s.commit(result.emitted)
        self.backend.truncate(s.seq_id, s.n_hist)
        if k > 0:
            s.spec_stats.record_verification(n_acc)
            self.stats.on_round(n_acc)
            for d in s.drafters:
                t0 = time.perf_counter()
                d.accept(s.id, n_acc, d is w.drafter)
                if d is w.drafter:
                    self.stats.on_accept(d.name, n_acc, time.perf_counter() - t0)
        names: list[str | None] = [w.drafter.name if w.drafter else None] * n_acc + [None]
        return self._emit(s, result.emitted, names)

    def _emit(self, s: Slot, emitted: list[int], names: list[str | None]) -> PieceEvent:
        assert s.request is not None
        n_out = 0
        for t in emitted:
            s.emit(t, self._is_eog(t))
            n_out += 1
            if s.finished:
                break  # the rest of the round stays in the KV but is not emitted (§1.1 step 11)
        if s.finished and s.stop_type != "word":
            s.text.text += s.decoder.flush()  # a dangling partial character renders as U+FFFD
        return PieceEvent(request_id=s.request.id, tokens=[int(t) for t in emitted[:n_out]],
                          text=s.text.take(final=s.finished), drafters=names[:n_out])
