"""One scheduler step (continuous batching), run synchronously in a worker thread.

Every step gathers the work of ALL busy slots into ONE backend forward (planned by
`RoundPlanner`: verification rows of generating slots first, then prompt chunks). Then, per slot:
the drafters observe the forward, the request's verifier keeps the accepted prefix, the KV rolls
back to it (a recurrent target from the checkpoint taken before the forward), the drafters hear how their draft fared, and the tokens are emitted
(docs/semantics.md §1.1). Last the draft policies learn from the round (core/policy/policy.py).
Statistics are only announced to the observer.

The engine calls `step` only from one worker thread at a time and touches slots only between steps,
so nothing here needs a lock. No torch: arrays cross the Backend boundary as numpy.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np

from spekula.core.backend import Backend, Capture, SeqOutput
from spekula.core.drafting.drafter import Drafter
from spekula.core.engine.context_shift import needs_shift, shift_slot
from spekula.core.engine.round_observer import RoundObserver
from spekula.core.engine.round_planner import RoundPlanner, Work
from spekula.core.engine.slot import Slot, SlotState
from spekula.core.events import PieceEvent
from spekula.core.modelfile.constraint import mask_for_argmax
from spekula.core.policy.policy import DraftPolicy, RoundOutcome, Verified
from spekula.core.verify.sampling import Sampler
from spekula.core.verify.token_probs import TokenProbs, emitted_probs

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, backend: Backend, tokenizer: object, n_batch: int, observer: RoundObserver,
                 policies: Sequence[DraftPolicy], *, context_shift: bool = False) -> None:
        self.backend = backend
        self.context_shift = context_shift
        self.add_bos = bool(getattr(tokenizer, "add_bos", False))  # llama-server keeps the BOS on top of n_keep
        self.tokenizer = tokenizer
        self.observer = observer
        self.policies = tuple(policies)  # every policy a request may choose: all learn from every round
        self.planner = RoundPlanner(n_batch, observer, self.policies)

    def step(self, slots: list[Slot]) -> list[tuple[Slot, PieceEvent | None]]:
        """Run one forward for every busy slot; return each touched slot with its piece event."""
        t_start = time.perf_counter()
        if self.context_shift:
            self._shift_full(slots)
        plan = self.planner.plan(slots)
        if not plan.work:
            return []
        capture = Capture()
        awake = [_awake(w) for w in plan.work]
        for drafters in awake:
            for d in drafters:
                capture = capture.union(d.capture())
        for w in plan.work:
            if w.draft.tokens:  # a recurrent target can take back the rows it is about to verify
                self.backend.checkpoint(w.inp.seq_id)
        t_forward = time.perf_counter()
        try:
            outs = self.backend.forward([w.inp for w in plan.work], capture)
        except Exception as exc:  # a backend failure ends the requests in this batch, not the engine
            for w in plan.work:
                w.slot.error = f"backend forward failed: {type(exc).__name__}: {exc}"
            return [(w.slot, None) for w in plan.work]
        forward_seconds = time.perf_counter() - t_forward
        self.observer.forwarded(len(plan.work))
        # What the policies learn from; the verification below fills in its emitted and verified.
        outcome = RoundOutcome(plan.rows, len(plan.work), with_prompt=any(w.prompt_chunk for w in plan.work),
                               drafted=bool(plan.calls) or plan.rows > len(plan.work), forward_seconds=forward_seconds,
                               drafting_seconds=plan.drafting_seconds, round_seconds=0.0, emitted={}, verified=[])
        results: list[tuple[Slot, PieceEvent | None]] = []
        for w, out, drafters in zip(plan.work, outs, awake, strict=True):
            s = w.slot
            try:
                for d in drafters:
                    d.observe(s.id, w.inp, out)
                piece = self._after_prompt(w, out) if w.prompt_chunk else self._after_round(w, out, outcome, drafters)
                results.append((s, piece))
            except Exception as exc:  # e.g. a failing third-party drafter: end this request clearly
                s.error = f"{type(exc).__name__}: {exc}"
                results.append((s, None))
        outcome.round_seconds = time.perf_counter() - t_start
        for policy in self.policies:
            for a in policy.learn(outcome):
                self.observer.adapted(a.decision, a.emitted, a.predicted_cost, a.measured_cost)
        return results

    def _shift_full(self, slots: list[Slot]) -> None:
        """Before the round, as llama-server's pre-decode: every generating slot with a full context shifts."""
        for s in slots:
            if not needs_shift(s):
                continue
            try:
                n_keep, n_discard = shift_slot(self.backend, s, self.add_bos)
            except Exception as exc:  # the shift failed: this request ends, the others go on
                s.error = f"context shift failed: {type(exc).__name__}: {exc}"
                continue
            log.info("slot %d: context shift, n_keep = %d, n_discard = %d", s.id, n_keep, n_discard)
            for d in s.drafters:  # model drafters with caches by position follow it (core/drafting/drafter.py)
                follow = getattr(d, "shifted", None)
                if follow is not None:
                    try:
                        follow(s.id, n_keep, n_discard)
                    except Exception as exc:
                        s.error = f"context shift failed in {d.name}: {type(exc).__name__}: {exc}"
                        break

    def _is_eog(self, token: int) -> bool:
        return bool(self.tokenizer.is_eog(token))  # type: ignore[attr-defined]

    def _after_prompt(self, w: Work, out: SeqOutput) -> PieceEvent | None:
        s = w.slot
        s.n_prompt_done += len(w.inp.tokens)
        if s.n_prompt_done < len(s.prompt):
            return None
        assert s.plan is not None and s.request is not None
        s.n_hist = len(s.prompt)  # Slot.start put the prompt into the history buffer
        self.backend.snapshot(s.seq_id)  # a recurrent target's next request can reuse this prompt
        s.t_prompt_done = time.perf_counter()
        s.state = SlotState.GENERATING
        for d in s.drafters:  # begin(H) once the prompt is processed (docs/semantics.md §7.6)
            t0 = time.perf_counter()
            d.begin(s.id, s.history)
            self.observer.began(d.name, time.perf_counter() - t0)
        s.plan.policy.begin(s.id)
        logits = out.logits[-1:]
        _mask(s, logits, [])
        before = _sampler_before(s)
        result = s.plan.verifier.verify([], None, logits)
        s.last = result.emitted[-1]
        if s.plan.constraint is not None:
            s.plan.constraint.advance(result.emitted)
        return self._emit(s, result.emitted, [None], _probs(s, logits, result.emitted, before))

    def _after_round(self, w: Work, out: SeqOutput, outcome: RoundOutcome,
                     drafters: Sequence[Drafter]) -> PieceEvent | None:
        s, draft = w.slot, w.draft
        assert s.plan is not None
        constraint = s.plan.constraint
        # In place: the logits are this round's, and the drafters have already observed them.
        _mask(s, out.logits, draft.tokens)
        before = _sampler_before(s)
        result = s.plan.verifier.verify(draft.tokens, draft.probs, out.logits)
        if constraint is not None:
            constraint.advance(result.emitted)
        n_acc = result.n_accepted
        # Roll back: keep H, x and the accepted drafts; later writes overwrite the rest (O(1)).
        s.commit(result.emitted)
        self.backend.truncate(s.seq_id, s.n_hist)
        outcome.emitted[s.id] = len(result.emitted)
        if draft.tokens:
            assert w.drafter is not None
            for d in drafters:  # a resting drafter saw no forward: it has nothing to roll back
                t0 = time.perf_counter()
                d.accept(s.id, n_acc, d is w.drafter)
                if d is w.drafter:
                    self.observer.verified(s, d.name, n_acc, time.perf_counter() - t0)
            outcome.verified.append(Verified(s.id, w.drafter.name, len(draft.tokens), n_acc, draft.confidence))
        names: list[str | None] = [w.drafter.name if w.drafter else None] * n_acc + [None]
        return self._emit(s, result.emitted, names, _probs(s, out.logits, result.emitted, before))

    def _emit(self, s: Slot, emitted: list[int], names: list[str | None],
              probs: list[TokenProbs] | None) -> PieceEvent:
        assert s.request is not None
        n_out = 0
        constraint = s.plan.constraint if s.plan is not None else None
        for t in emitted:
            eog = self._is_eog(t)
            s.emit(t, eog)
            n_out += 1
            if eog and constraint is not None and constraint.stopped and not s.finished:
                s.stop_type = "eos"  # the grammar is complete: its end ends the request, even with ignore_eos
            if s.finished:
                break  # the rest of the round stays in the KV but is not emitted (docs/semantics.md §1.1 step 9)
        if s.finished and s.stop_type != "word":
            s.text.text += s.decoder.flush()  # a dangling partial character renders as U+FFFD
        if probs is not None:
            probs = probs[:n_out]
            s.probs.extend(probs)
        return PieceEvent(request_id=s.request.id, tokens=[int(t) for t in emitted[:n_out]],
                          text=s.text.take(final=s.finished), drafters=names[:n_out], slot=s.id, probs=probs,
                          timings=s.timings() if s.request.timings_per_token else None)


def _mask(s: Slot, logits: np.ndarray, draft: Sequence[int]) -> None:
    """Row i may sample only what the request's grammar allows after draft[:i]. A greedy verifier
    needs at most the rows whose raw argmax the grammar forbids masked, unless the request reads the
    rows' probabilities."""
    assert s.plan is not None
    constraint = s.plan.constraint
    if constraint is None:
        return
    if s.plan.verifier.takes_argmax and not (s.request is not None and s.request.token_probs):
        mask_for_argmax(constraint, logits, draft)
    else:
        constraint.mask_logits(logits, draft)


def _awake(w: Work) -> Sequence[Drafter]:
    """The slot's drafters that observe this forward: all of them, but for a generating round those
    that can resume after missed forwards and that the slot's policy rests (Drafter.resumes)."""
    drafters = w.slot.drafters
    plan = w.slot.plan
    if w.prompt_chunk or plan is None or not any(getattr(d, "resumes", False) for d in drafters):
        return drafters
    # The drafter whose draft (or kept rest of one) is verified always observes its verification.
    return [d for d in drafters if d is w.drafter or not (getattr(d, "resumes", False)
                                                          and plan.policy.resting(w.slot.id, d))]


def _sampler_before(s: Slot) -> Sampler | None:
    """For a request that wants probabilities after sampling: its sampler as the round starts."""
    req = s.request
    if req is None or s.plan is None or not (req.token_probs and req.post_sampling_probs):
        return None
    return s.plan.sampler.clone()


def _probs(s: Slot, rows: np.ndarray, emitted: list[int], before: Sampler | None) -> list[TokenProbs] | None:
    """The target's probabilities of the round's emitted tokens, if the request asked for them
    (rows[j] scored emitted[j]: verification emits from the rows in order)."""
    req = s.request
    if req is None or not req.token_probs:
        return None
    return emitted_probs(rows, emitted, req.n_probs, before)
