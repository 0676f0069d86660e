"""draft-eagle3: one Llama layer drafts from the target's own hidden states (docs/model-formats.md §2.6).

Pairing rule: the draft KV entry at position P is computed from (token at P+1, g_P), where g_P is
the fc projection of the target's three captured layer inputs at P. So after each target forward the
last row is *pending* (its next token is not known yet): its g is kept, and the draft starts from
``(x, g_pending)`` at the pending position. Later steps feed the layer's own pre-norm output back as g.
On verification, ``accept`` rebases the pending row onto the last accepted row (whoever drafted).

The draft KV is brought up to date lazily: each target forward's rows (their tokens and captured
features) are queued, and when the drafter is next asked for a draft the queue is encoded and
decoded in the same forward as the draft's first step. A round in which the cost model does not ask
the drafter then costs it nothing; updating the draft layer after every target forward (torch, one
row at a time) took about as long as SmolLM2's own forward.

While the adaptive policy rests the head (core/policy/backoff.py) the engine captures nothing for it
and it observes nothing (``resumes``); its draft KV then goes on after the gap as if the missed
positions were not there (``HiddenSlot.offset``): the head keeps the prompt's context, and the
target's features it drafts from carry the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from spekula.core.backend import SeqInput, SeqOutput
from spekula.core.drafting.description import DrafterDescription
from spekula.core.drafting.draft_models import Eagle3Rows, Eagle3Runtime
from spekula.core.drafting.drafter import Draft, DrafterContext, DraftRequest
from spekula.core.errors import ConfigError
from spekula.drafters.model.hidden_drafter import (
    DraftRun,
    HiddenSlot,
    HiddenStateDrafter,
    drop_queued_tail,
    finish_drafts,
    load_head_runtime,
    model_draft_options,
    require_draft_path,
    shift_slot_cache,
    shifted_position,
)


@dataclass(slots=True)
class _Slot(HiddenSlot):
    pending_feat: np.ndarray | None = None  # [3H] features of the last target row whose successor is unknown
    pending_pos: int = -1
    verify_feat: np.ndarray | None = None  # [n, 3H] every row of the last target forward
    verify_pos: int = 0
    # Rows not yet decoded into the draft KV, contiguous from the runtime's length: entry k pairs
    # queue_tokens[k] with the features queue_feats[k] at position len + k.
    queue_tokens: list[np.ndarray] = field(default_factory=list)
    queue_feats: list[np.ndarray] = field(default_factory=list)
    queued: int = 0


class Eagle3Drafter(HiddenStateDrafter[Eagle3Runtime, _Slot]):
    name: ClassVar[str] = "draft-eagle3"
    resumes: ClassVar[bool] = True  # may miss forwards (core/drafting/drafter.py)
    # `shifted` drops and re-ropes the head's own cache rows as the target's shift does.
    follows_context_shift: ClassVar[bool] = True
    description: ClassVar[DrafterDescription] = DrafterDescription(
        summary="an EAGLE-3 head drafts from three of the target's layer inputs (-md, else a shipped head)",
        builtin_order=7, hidden_states=True, draft_model="optional",
    )

    @classmethod
    def create(cls, ctx: DrafterContext) -> Eagle3Drafter:
        path = require_draft_path(ctx, cls.name)
        # Native beside a native target, else torch (an onnx target still hands over numpy hidden states).
        runtime = load_head_runtime(ctx, path, model_draft_options(ctx))
        if not isinstance(runtime, Eagle3Runtime):
            raise ConfigError(f"{path} is a {runtime.info.kind} model, not EAGLE-3; use --spec-type draft-{runtime.info.kind}")
        return cls(runtime)

    # --- protocol (capture, begin, end: HiddenStateDrafter) ---------------------------------------
    def new_slot(self, seq: int) -> _Slot:
        return _Slot(seq)

    def observe(self, slot: int, inp: SeqInput, out: SeqOutput) -> None:
        n = len(inp.tokens)
        if n == 0:
            return
        st = self._slots.get(slot)
        if inp.start == 0:  # a new sequence in this slot
            self._cut(st, 0)
            st.pending_feat = None
        feats = self.features(out)
        tokens = np.asarray(inp.tokens, dtype=np.int32)
        have = self._length(st)
        if st.pending_feat is not None and st.pending_pos == inp.start - 1 and have <= st.pending_pos:
            # Bridge: the previous forward's last row pairs with this forward's first token.
            self._queue(st, tokens, np.concatenate([st.pending_feat[None], feats[:-1]]), st.pending_pos)
        else:
            self._queue(st, tokens[1:], feats[:-1], inp.start)
        st.pending_feat, st.pending_pos = feats[-1], inp.start + n - 1
        st.verify_feat, st.verify_pos = feats, inp.start

    def accept(self, slot: int, n_accepted: int, mine: bool) -> None:
        st = self._slots.peek(slot)
        if st is None or st.verify_feat is None:
            return
        i = min(int(n_accepted), len(st.verify_feat) - 1)
        st.pending_feat, st.pending_pos = st.verify_feat[i], st.verify_pos + i
        # Entries from the pending position on pair rejected tokens: drop them.
        self._cut(st, st.pending_pos)

    def shifted(self, slot: int, n_keep: int, n_discard: int) -> None:
        """The slot's target cache dropped positions [n_keep, n_keep + n_discard) and moved the later
        ones down: the head's cache does the same (queued rows decoded first, so one shift moves them
        all), and the pending row moves with its position (dropped where it was discarded: a row seen
        before the policy rested the head)."""
        st = self._slots.peek(slot)
        if st is None or n_discard <= 0:
            return
        self._flush(st)
        shift_slot_cache(self.runtime, st, n_keep, n_discard)
        if st.pending_feat is not None:
            pos = shifted_position(st.pending_pos, n_keep, n_discard)
            if pos is None:
                st.pending_feat = None
            st.pending_pos = -1 if pos is None else pos
        st.verify_feat = None  # the next forward brings the rows accept() reads

    def _flush(self, st: _Slot) -> None:
        """Decode the slot's queued rows into the draft KV now."""
        if not st.queued:
            return
        g = self.runtime.encode(np.concatenate(st.queue_feats))
        rows = Eagle3Rows(st.seq, np.concatenate(st.queue_tokens), g, self.runtime.seq_len(st.seq), False)
        self.runtime.decode([rows])
        st.queue_tokens, st.queue_feats, st.queued = [], [], 0

    # --- the lazy draft KV -----------------------------------------------------------------------
    def _length(self, st: _Slot) -> int:
        """The target position the draft KV reaches once the queue is decoded."""
        return self.runtime.seq_len(st.seq) + st.queued + st.offset

    def _cut(self, st: _Slot, n_keep: int) -> None:
        """Keep target positions [0, n_keep) of the draft KV and the queue together."""
        base = self.runtime.seq_len(st.seq) + st.offset
        if n_keep <= base:
            keep = max(n_keep - st.offset, 0)  # a cut into a gap keeps nothing after it
            self.runtime.truncate(st.seq, keep)
            st.offset = n_keep - keep
            st.queue_tokens, st.queue_feats, st.queued = [], [], 0
            return
        drop_queued_tail([st.queue_tokens, st.queue_feats], base + st.queued - n_keep)
        st.queued = min(st.queued, n_keep - base)  # a cut past the end keeps everything

    def _queue(self, st: _Slot, tokens: np.ndarray, feats: np.ndarray, start: int) -> None:
        """Rows for positions start.. (a write there drops what came after it, as in the KV store); a
        start past the end follows forwards this drafter missed: the KV goes on after the gap."""
        if not len(tokens):
            return
        self._skip_gap(st, start)
        self._cut(st, start)
        st.queue_tokens.append(tokens)
        st.queue_feats.append(feats)
        st.queued += len(tokens)

    def _skip_gap(self, st: _Slot, start: int) -> None:
        """Make target position `start` the next draft KV position if the KV ends before it."""
        missed = start - self._length(st)
        if missed > 0:
            st.offset += missed

    def _take_queue(self, slots: Sequence[_Slot]) -> tuple[list[Eagle3Rows | None], list[np.ndarray]]:
        """Empty every slot's queue: its rows as one decode entry (None where nothing is queued), and each
        slot's encoded pending row g. One encoder call for all of them."""
        if not slots:
            return [], []
        pending = [st.pending_feat for st in slots]
        if any(f is None for f in pending):
            raise ValueError("a slot without a pending row cannot draft")  # draft() only picks slots with one
        feats = [f for st in slots for f in st.queue_feats] + [f[None] for f in pending if f is not None]
        g = self.runtime.encode(np.concatenate(feats))
        rows: list[Eagle3Rows | None] = []
        off = 0
        for st in slots:
            entry = None
            if st.queued:
                entry = Eagle3Rows(st.seq, np.concatenate(st.queue_tokens), g[off:off + st.queued],
                                   self.runtime.seq_len(st.seq), False)
                off += st.queued
            rows.append(entry)
            st.queue_tokens, st.queue_feats, st.queued = [], [], 0
        return rows, [g[off + i] for i in range(len(slots))]

    # --- drafting --------------------------------------------------------------------------------
    def draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        runs: list[DraftRun] = []
        for i, r in enumerate(requests):
            # step j writes at len(history) - 1 + j: stay inside the draft context
            cap = min(int(r.spec.n_max), int(r.n_max), self.runtime.n_ctx - len(r.history) + 1)
            st = self._slots.peek(r.slot)
            if cap <= 0 or st is None or st.pending_feat is None:
                continue
            pos = len(r.history) - 1  # the row whose successor is x; step j decodes at pos + j
            if st.pending_pos != pos:
                continue  # the last forward's features are not this history's: no draft this round
            self._skip_gap(st, pos)  # rows missed while resting are left out of the draft KV
            self._cut(st, pos)
            prob = self.probabilistic(st, r)
            runs.append(DraftRun(i, st, int(r.last), pos - st.offset, cap, float(r.spec.p_min),
                                 float(r.temperature), prob, keep_drafting=r.keep_drafting))
        queued, pending = self._take_queue([run.slot for run in runs])
        # The first step decodes the queued rows with it, in one forward: after a target forward the head's
        # weights are out of the caches, and a separate pass over the queue would read them twice.
        rows = []
        for run, q, g in zip(runs, queued, pending, strict=True):
            x = np.array([run.last], dtype=np.int32)
            rows.append(Eagle3Rows(run.slot.seq, x, g[None], run.start) if q is None else
                        Eagle3Rows(run.slot.seq, np.concatenate([q.tokens, x]), np.concatenate([q.hidden, g[None]]), q.start))
        active = runs
        while active:
            outs = self.runtime.draft_step(rows)
            nxt: list[DraftRun] = []
            rows = []
            for run, out in zip(active, outs, strict=True):
                assert out.logits is not None
                if run.take(out.logits[-1], out.vocab, self.runtime.info.n_vocab) and not run.full:
                    nxt.append(run)
                    rows.append(Eagle3Rows(run.slot.seq, np.array([run.tokens[-1]], dtype=np.int32), out.prenorm[-1:],
                                           run.start + len(run.tokens)))
            active = nxt
        return finish_drafts(self.runtime, requests, runs)
