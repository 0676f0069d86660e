"""One call of a drafter for some of a round's slots, and what comes back of it.

A drafter is third-party code: a call that raises, or returns the wrong number of drafts or of
confidences, ends the requests it drafted for with a clear error and leaves the engine running.
What it returns is capped to what each slot asked for (docs/semantics.md §1.3) and, for a request
with a grammar, cut where the grammar forbids it, before any of it costs a verification row.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from spekula.core.drafting.drafter import Draft, Drafter, DraftRequest
from spekula.core.engine.slot import Slot
from spekula.core.modelfile.constraint import trim_draft
from spekula.core.policy.policy import Answer, DraftCall


class GrammarObserver(Protocol):
    def grammar_rejected(self, slot: Slot, drafter: str, n: int) -> None: ...


def call_drafter(drafter: Drafter, per_token: bool, asks: list[tuple[Slot, int]], observer: GrammarObserver,
                 stops: Mapping[int, Callable[[Sequence[float]], bool] | None] | None = None,
                 ) -> tuple[DraftCall, dict[int, Draft]] | None:
    """Ask `drafter` for up to n tokens for each (slot, n), each slot's draft stopping by its policy's
    rule in `stops` (DraftRequest.keep_drafting); the call and every slot's non-empty draft, or None
    when it failed (the slots then carry the error)."""
    reqs = [_draft_request(s, n, (stops or {}).get(s.id)) for s, n in asks]
    t0 = time.perf_counter()
    try:
        drafts = drafter.draft(reqs)
        if len(drafts) != len(reqs):
            raise RuntimeError(f"returned {len(drafts)} drafts for {len(reqs)} requests")
        for d in drafts:
            _check_confidence(d)
    except Exception as exc:  # a broken drafter ends the requests it was drafting for, not the engine
        for s, _ in asks:
            s.error = f"drafter {drafter.name!r} failed: {type(exc).__name__}: {exc}"
        return None
    call = DraftCall(drafter, time.perf_counter() - t0, per_token=per_token)
    found: dict[int, Draft] = {}
    for (s, n), d in zip(asks, drafts, strict=True):
        call.lengths[s.id] = min(len(d.tokens), n)
        call.answers.append(Answer(s, bool(d.tokens), d.confidence is not None))
        if not d.tokens:
            continue
        if len(d.tokens) > n:  # the round's budget caps every drafter (docs/semantics.md §1.3)
            d = d.prefix(n)
        if s.constrained:
            d = _grammar_trim(s, drafter, d, call, observer)
            if not d.tokens:
                continue  # the grammar forbids its first token: as if nothing was drafted
        found[s.id] = d
    call.steps = max(call.lengths.values(), default=0)
    return call, found


def tell_shortened(drafter: Drafter, slot: int, n: int) -> None:
    """Tell a drafter that keeps state by its draft's length (`shortened`, optional) that n tokens of
    its draft for `slot` are verified."""
    trim = getattr(drafter, "shortened", None)
    if callable(trim):
        trim(slot, n)


def _grammar_trim(s: Slot, drafter: Drafter, d: Draft, call: DraftCall, observer: GrammarObserver) -> Draft:
    """Drop what the request's grammar forbids before it costs a verification row."""
    assert s.plan is not None and s.plan.constraint is not None
    tokens, _probs, rejected = trim_draft(list(d.tokens), d.probs, s.plan.constraint.valid_prefix(d.tokens))
    if not rejected:
        return d
    observer.grammar_rejected(s, drafter.name, rejected)
    call.lengths[s.id] = len(tokens)
    return d.prefix(len(tokens))  # trim_draft keeps a prefix: the same tokens and probabilities


def _check_confidence(d: Draft) -> None:
    """A drafter's confidences, if it gives any, as one float per token (a plugin's mistake here must
    end its requests with a clear error, not fail later inside the cost model)."""
    if d.confidence is None:
        return
    values = [float(c) for c in d.confidence]
    if len(values) != len(d.tokens):
        raise RuntimeError(f"returned {len(values)} confidences for a draft of {len(d.tokens)} tokens")
    d.confidence = values


def _draft_request(s: Slot, n_max: int, keep_drafting: Callable[[Sequence[float]], bool] | None) -> DraftRequest:
    """What a drafter is asked on behalf of a generating slot (which always has a request and a plan)."""
    assert s.plan is not None and s.request is not None
    return DraftRequest(slot=s.id, history=s.history, last=s.last, n_max=n_max, spec=s.plan.spec,
                        temperature=s.request.sampling.temperature, seed=s.plan.seed, keep_drafting=keep_drafting)
