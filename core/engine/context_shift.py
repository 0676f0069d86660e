"""Context shift (a server's --context-shift): a generating slot whose context is full drops a span of
its history and goes on, as llama-server does.

When a generating slot holds n_ctx - 1 tokens (no room for the pending token x), the first n_keep tokens
stay, the n_discard after them leave, and the rest move down by n_discard: the backend re-ropes their
keys (core/backend.py's `shift`), and the slot's history follows. The arithmetic is llama-server's:

* n_keep is the request's `n_keep` (-1: the whole prompt), plus one when the model adds a BOS token,
  capped at n_ctx - 4;
* n_discard is the request's `n_discard`, or half of what follows n_keep when 0, clamped to
  [0, n_left - 1] where n_left = tokens held - n_keep.

A speculative round never passes n_ctx - 1 (its draft budget is n_ctx - len(H) - 2), so shifts happen
at the same history lengths as in plain decoding and speculation stays lossless. Draftless drafters
read the shifted history at their next call (each one starts over from a history that does not extend
what it saw); model drafters must declare ``follows_context_shift`` (draft-simple re-decodes its draft
cache from the first changed position; draft-eagle3, draft-dflash, draft-dspark and draft-mtp shift
their heads' caches in their ``shifted`` hook, which the scheduler calls after the shift), else the
request plan refuses them (request_plan.unshiftable_drafters).
"""

from __future__ import annotations

from spekula.core.backend import Backend
from spekula.core.engine.slot import Slot, SlotState


def shift_span(n_tokens: int, n_prompt: int, n_ctx: int, n_keep: int, n_discard: int, add_bos: bool) -> tuple[int, int]:
    """(n_keep, n_discard) of a shift of a slot holding `n_tokens` tokens, by llama-server's arithmetic."""
    keep = n_prompt if n_keep < 0 else n_keep
    if add_bos:
        keep += 1
    keep = min(n_ctx - 4, keep)
    n_left = n_tokens - keep
    discard = n_discard if n_discard else n_left // 2
    return keep, min(max(discard, 0), max(0, n_left - 1))


def needs_shift(slot: Slot) -> bool:
    """A generating slot with no room left for its pending token."""
    return slot.state is SlotState.GENERATING and not slot.finished and slot.n_hist + 1 >= slot.n_ctx


def shift_slot(backend: Backend, slot: Slot, add_bos: bool) -> tuple[int, int]:
    """Shift one full slot's KV and history; returns (n_keep, n_discard)."""
    req = slot.request
    assert req is not None
    keep, discard = shift_span(slot.n_hist, len(slot.prompt), slot.n_ctx, req.n_keep, req.n_discard, add_bos)
    backend.shift(slot.seq_id, keep, discard)
    slot.tokens[keep : slot.n_hist - discard] = slot.tokens[keep + discard : slot.n_hist]
    slot.n_hist -= discard
    slot.truncated = True
    return keep, discard

